-- pg_quota 0.6.0 -> 0.6.1
--
-- Why this script exists: a renewal of a ticket's lease (quota.renew(), and
-- quota.claim_job() inside a queue's claim) changes only lease_until, yet 0.6.0 has
-- lease_until in two of quota.active's indexes and a third on (ended_at, lease_until).
-- So every renewal was a non-HOT update that entered a new version into three to six
-- of quota.active's indexes (the three that have lease_until, the primary key, and
-- the partial ones its ticket is in) (BENCHMARKS.md, "the real queue again, and where its
-- processing goes": in plain SQL, the same table without lease_until in its indexes
-- renewed at 1.17x the rate with 0.26x the WAL). 0.6.1 takes lease_until out of every
-- index of quota.active, so that a renewal is a heap-only update where its page has
-- room, and a start enters one index fewer:
--
-- - active_role_idx becomes (role, ended_at), active_tenant_idx (role, tenant,
--   ended_at) WHERE tenant IS NOT NULL;
-- - active_open_idx (ended_at, lease_until) is dropped.
--
-- What they served is read from quota.active's rows instead: a role's (or tenant's)
-- lapsed leases and its earliest lease from all its active tickets, the database's
-- active tickets and the writer's expiry sweep from all of quota.active, which holds
-- only tickets that have not ended. quota.history keeps its indexes: its rows are never
-- updated. The library of 0.6.1 reads both shapes, so a database not yet updated keeps
-- working; it needs the prefix (role, ended_at) of active_role_idx only.
--
-- quota.active holds only unended tickets, so rebuilding its two indexes takes as long
-- as indexing those (USER_GUIDE, "Upgrading to 0.6.1"); the update holds quota.active
-- locked meanwhile. An index that a DBA renamed is the DBA's, and stays (IF EXISTS):
-- the new one is created beside it.
--
-- The update refuses (55000) while the server still runs an older library (see the
-- first statement): restart it with 0.6.1's first.
--
-- The result must equal a fresh 0.6.1 install (sql/schema.sql, sql/stats.sql and
-- src/api.rs); scripts/test-upgrade compares the catalogs, pg_init_privs included.

\echo Use "ALTER EXTENSION pg_quota UPDATE TO '0.6.1'" to load this file. \quit

-- The library of 0.6.0 requires the indexes this script drops, and would refuse every
-- call in this database once it commits. A preloaded library is replaced only when
-- the server restarts; 0.6.1's shows its version in quota.library_version, which no
-- older one has.
DO $$
BEGIN
    IF pg_catalog.current_setting('quota.library_version', true) IS NULL THEN
        RAISE EXCEPTION 'this server still runs a pg_quota library older than 0.6.1'
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = 'The library of 0.6.0 cannot use the indexes that the update to 0.6.1 gives quota.active.',
                  HINT = 'Restart the server after installing pg_quota 0.6.1, then run ALTER EXTENSION pg_quota UPDATE again.';
    END IF;
END
$$;

DROP INDEX IF EXISTS quota.active_open_idx;
DROP INDEX IF EXISTS quota.active_role_idx;
DROP INDEX IF EXISTS quota.active_tenant_idx;

-- A role's active tickets (ended_at is NULL in every row; it is in the key so that one
-- scan serves quota.active and the one table of older schemas alike).
CREATE INDEX active_role_idx ON quota.active (role, ended_at);
-- What admission counts for one tenant of a role.
CREATE INDEX active_tenant_idx ON quota.active (role, tenant, ended_at)
    WHERE tenant IS NOT NULL;
