-- pg_quota's own objects. CREATE EXTENSION creates the schema "quota" (see the control
-- file); everything here lives in it and belongs to the extension.
--
-- Keep in step with sql/pg_quota--*--*.sql: scripts/test-upgrade checks that an
-- upgraded install and a fresh one have the same catalog entries.

-- If a schema "quota" already existed, CREATE EXTENSION would install into it. The
-- library refuses that unless a superuser owns it, only superusers may create objects
-- in it and it is empty, before this script runs (src/guard.rs, in the ProcessUtility
-- hook; the library is preloaded, or this script fails at its first C function).

-- The ledger: one row per ticket. Only the ledger writer inserts and purges, and only
-- quota.finish() updates, acting as the owner. Nobody else has any privilege on it (I5).
-- "role" is a regrole, so that pg_dump writes role names and a restore into another
-- cluster, where roles have other OIDs, keeps each charge with its role.
-- From 0.2.0: lease_until (the ticket stops being active then; NULL = never),
-- idempotency_key (a repeated start() with it returns this ticket), and pid (the
-- starting backend). An expired ticket is written down by the ledger writer with
-- ended_at = lease_until and outcome 'expired'.
-- From 0.5.0: tenant (the value under its role the ticket is charged to; NULL = the
-- role itself) and txid (for a transactional start, the full transaction id of the
-- transaction that charged it: the row commits or rolls back with that transaction;
-- NULL for a charge the ledger writer committed).
CREATE TABLE quota.ledger (
    id          uuid        PRIMARY KEY,
    role        regrole     NOT NULL,
    label       text,
    started_at  timestamptz NOT NULL,
    ended_at    timestamptz,
    outcome     text,
    lease_until     timestamptz,
    idempotency_key text,
    pid             integer,
    tenant          text,
    txid            xid8,
    CONSTRAINT ledger_outcome_check
        CHECK (outcome IN ('succeeded', 'failed', 'cancelled', 'expired')),
    CONSTRAINT ledger_ended_has_outcome
        CHECK ((ended_at IS NULL) = (outcome IS NULL))
);

-- Serves every count admission needs for one role: active tickets (ended_at IS NULL,
-- which btree keeps together at the end of each role's range), among them those whose
-- lease ran out (ordered by lease_until), and ended tickets past the cutoff.
CREATE INDEX ledger_role_ended_idx ON quota.ledger (role, ended_at, lease_until);
-- The database's active tickets (quota.max_active_per_database) and its leases that
-- ran out (the writer's expiry sweep), without walking every role.
CREATE INDEX ledger_open_idx ON quota.ledger (ended_at, lease_until);
-- Idempotent starts: a role's tickets by key.
CREATE INDEX ledger_role_key_idx ON quota.ledger (role, idempotency_key);
-- 0.5.0: what admission counts for one tenant of a role, as ledger_role_ended_idx
-- for the role; only tenants' tickets have entries.
CREATE INDEX ledger_tenant_idx ON quota.ledger (role, tenant, ended_at, lease_until)
    WHERE tenant IS NOT NULL;
-- 0.5.0: a role's transactional tickets by the transaction that charged them: those
-- not yet folded into the role's summary row are counted from here (see quota.summary).
CREATE INDEX ledger_txid_idx ON quota.ledger (role, txid) WHERE txid IS NOT NULL;

-- One row per role: how many ledger rows it has. Kept by the writer in the same
-- transaction as each insert and purge, so admission never scans a role's history.
-- A role without a row has its rows counted from the ledger instead.
-- From 0.5.0: a transactional start commits its ticket in the caller's transaction,
-- which must not update this row (every enqueue of a role would queue on it until its
-- commit). tickets counts the role's transactional tickets whose txid is below folded
-- (NULL: none), which the writer folds in from time to time; the others are counted
-- from ledger_txid_idx.
CREATE TABLE quota.summary (
    role    regrole PRIMARY KEY,
    tickets bigint  NOT NULL CHECK (tickets >= 0),
    folded  xid8
);

REVOKE ALL ON quota.ledger, quota.summary FROM PUBLIC;

-- pg_dump carries the charges across a dump and restore.
SELECT pg_catalog.pg_extension_config_dump('quota.ledger', '');
SELECT pg_catalog.pg_extension_config_dump('quota.summary', '');

-- pg_quota writes its tables below SQL, so these triggers fire only for writes made
-- through SQL: a superuser's INSERT, UPDATE, DELETE, TRUNCATE or COPY (pg_restore).
-- After such a write the summary no longer matches the ledger, so it is emptied and
-- every role's rows are counted afresh from the ledger when next needed. TRUNCATE
-- rather than DELETE: it removes rows whatever the writer's transaction committed
-- after this one's snapshot (under REPEATABLE READ too), and it makes the writer wait
-- until this transaction ends, so that the writer counts what it committed.
CREATE FUNCTION quota.ledger_written() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    TRUNCATE quota.summary;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION quota.ledger_written() FROM PUBLIC;
CREATE TRIGGER ledger_written AFTER INSERT OR UPDATE OR DELETE ON quota.ledger
    FOR EACH STATEMENT EXECUTE FUNCTION quota.ledger_written();
CREATE TRIGGER ledger_truncated AFTER TRUNCATE ON quota.ledger
    FOR EACH STATEMENT EXECUTE FUNCTION quota.ledger_written();
-- Fire also under session_replication_role = replica: pg_quota's counters rely on them
-- (src/scopes.rs) and are not used while they are missing or disabled. From 0.3.1 the
-- library keeps them so: ENABLE TRIGGER (ALL) sets them back to ENABLE ALWAYS, and any
-- change to their state empties the summary (src/guard.rs). (Logical replication's
-- apply worker fires no statement triggers at all: replicating pg_quota's tables into
-- another server is not supported.)
ALTER TABLE quota.ledger ENABLE ALWAYS TRIGGER ledger_written;
ALTER TABLE quota.ledger ENABLE ALWAYS TRIGGER ledger_truncated;

-- Summary rows come only from the writer. Rows that SQL inserts or updates (a
-- superuser by hand, or pg_restore of a dump) are skipped; deleting them is harmless,
-- since a missing row is counted afresh.
CREATE FUNCTION quota.summary_written() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION quota.summary_written() FROM PUBLIC;
CREATE TRIGGER summary_written BEFORE INSERT OR UPDATE ON quota.summary
    FOR EACH ROW EXECUTE FUNCTION quota.summary_written();
-- From 0.3.1 it fires under session_replication_role = replica too, as the ledger's do.
ALTER TABLE quota.summary ENABLE ALWAYS TRIGGER summary_written;

-- 0.3.1: pg_repack copies a table, replays what its row trigger "repack_trigger" logged
-- meanwhile, and swaps. pg_quota's own writes fire no trigger, so every ticket committed
-- during the copy was lost. A trigger of that name makes pg_repack skip the table before
-- it copies anything (it takes it for the leftover of an interrupted run) and go on
-- with the other tables. These two are disabled and do nothing. The library refuses
-- any other trigger on pg_quota's tables, and DROP or RENAME of pg_quota's own
-- (src/guard.rs).
CREATE FUNCTION quota.repack_placeholder() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION quota.repack_placeholder() FROM PUBLIC;
CREATE TRIGGER repack_trigger AFTER INSERT ON quota.ledger
    FOR EACH STATEMENT EXECUTE FUNCTION quota.repack_placeholder();
ALTER TABLE quota.ledger DISABLE TRIGGER repack_trigger;
CREATE TRIGGER repack_trigger AFTER INSERT ON quota.summary
    FOR EACH STATEMENT EXECUTE FUNCTION quota.repack_placeholder();
ALTER TABLE quota.summary DISABLE TRIGGER repack_trigger;
COMMENT ON TRIGGER repack_trigger ON quota.ledger IS
    'pg_quota: keeps pg_repack off this table, whose changes its trigger cannot see; see "Reclaiming space" in the user guide';
COMMENT ON TRIGGER repack_trigger ON quota.summary IS
    'pg_quota: keeps pg_repack off this table, whose changes its trigger cannot see; see "Reclaiming space" in the user guide';

GRANT USAGE ON SCHEMA quota TO PUBLIC;

-- 0.3.1: the reading session's quota.retention, from the library, so that quota.usage
-- says "pg_quota must be loaded via shared_preload_libraries" (55000) where the library
-- is not preloaded, as every function does, rather than that the setting is unknown.
CREATE FUNCTION quota.current_retention() RETURNS interval
    STABLE PARALLEL SAFE
    LANGUAGE c AS 'MODULE_PATHNAME', 'current_retention_wrapper';

-- Usage per role, for the roles that have retained tickets. A role sees the rows of
-- the roles whose tickets it may finish: its own and those of roles it is a member of;
-- superusers and members of pg_read_all_stats see every row. "retained" uses the
-- quota.retention of the reading session. A ticket whose lease ran out counts as ended
-- at its lease_until, whether or not the ledger writer has written that down yet.
CREATE VIEW quota.usage WITH (security_barrier) AS
WITH params AS (
    SELECT quota.current_retention() AS retention,
           pg_catalog.now() AS now
), tickets AS (
    SELECT l.role,
           CASE WHEN l.ended_at IS NULL AND l.lease_until OPERATOR(pg_catalog.<=) p.now
                THEN l.lease_until ELSE l.ended_at END AS ended_at,
           p.retention,
           p.now
      FROM quota.ledger l, params p
     WHERE pg_catalog.pg_has_role(CURRENT_USER, l.role::pg_catalog.oid, 'MEMBER')
        OR (SELECT pg_catalog.pg_has_role(CURRENT_USER, 'pg_read_all_stats', 'USAGE'))
)
SELECT t.role                                                        AS role,
       pg_catalog.count(*) FILTER (WHERE t.ended_at IS NULL)         AS active,
       pg_catalog.count(*)                                           AS retained,
       (pg_catalog.min(t.ended_at) OPERATOR(pg_catalog.+) t.retention) AS next_ageout
  FROM tickets t
 WHERE t.ended_at IS NULL
    OR t.ended_at OPERATOR(pg_catalog.>=) (t.now OPERATOR(pg_catalog.-) t.retention)
 GROUP BY t.role, t.retention;

GRANT SELECT ON quota.usage TO PUBLIC;

-- The holders: one row per ticket in the ledger. A role sees the tickets it may finish:
-- its own and those of roles it is a member of; superusers and members of
-- pg_read_all_stats see all (labels are shown as pg_stat_activity shows queries). pid
-- is the backend that started the ticket. A ticket whose lease ran out shows as ended
-- at lease_until with outcome 'expired'.
CREATE VIEW quota.tickets WITH (security_barrier) AS
SELECT l.id,
       l.role,
       l.label,
       l.started_at,
       l.lease_until,
       CASE WHEN l.ended_at IS NULL AND l.lease_until OPERATOR(pg_catalog.<=) pg_catalog.now()
            THEN l.lease_until ELSE l.ended_at END AS ended_at,
       CASE WHEN l.ended_at IS NULL AND l.lease_until OPERATOR(pg_catalog.<=) pg_catalog.now()
            THEN 'expired'::pg_catalog.text ELSE l.outcome END AS outcome,
       l.idempotency_key,
       l.pid,
       l.tenant,
       l.txid IS NOT NULL AS transactional
  FROM quota.ledger l
 WHERE pg_catalog.pg_has_role(CURRENT_USER, l.role::pg_catalog.oid, 'MEMBER')
    OR (SELECT pg_catalog.pg_has_role(CURRENT_USER, 'pg_read_all_stats', 'USAGE'));

GRANT SELECT ON quota.tickets TO PUBLIC;

-- 0.5.0: usage per tenant, for the tenants that have retained tickets, with the
-- visibility rules of quota.usage. It reads the ledger: for one tenant's numbers, ask
-- for that tenant (WHERE role = 'app'::regrole AND tenant = 'acme').
CREATE VIEW quota.tenant_usage WITH (security_barrier) AS
WITH params AS (
    SELECT quota.current_retention() AS retention,
           pg_catalog.now() AS now
), tickets AS (
    SELECT l.role,
           l.tenant,
           CASE WHEN l.ended_at IS NULL AND l.lease_until OPERATOR(pg_catalog.<=) p.now
                THEN l.lease_until ELSE l.ended_at END AS ended_at,
           p.retention,
           p.now
      FROM quota.ledger l, params p
     WHERE l.tenant IS NOT NULL
       AND (pg_catalog.pg_has_role(CURRENT_USER, l.role::pg_catalog.oid, 'MEMBER')
            OR (SELECT pg_catalog.pg_has_role(CURRENT_USER, 'pg_read_all_stats', 'USAGE')))
)
SELECT t.role                                                        AS role,
       t.tenant                                                      AS tenant,
       pg_catalog.count(*) FILTER (WHERE t.ended_at IS NULL)         AS active,
       pg_catalog.count(*)                                           AS retained,
       (pg_catalog.min(t.ended_at) OPERATOR(pg_catalog.+) t.retention) AS next_ageout
  FROM tickets t
 WHERE t.ended_at IS NULL
    OR t.ended_at OPERATOR(pg_catalog.>=) (t.now OPERATOR(pg_catalog.-) t.retention)
 GROUP BY t.role, t.tenant, t.retention;

GRANT SELECT ON quota.tenant_usage TO PUBLIC;
