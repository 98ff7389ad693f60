-- pg_quota's own objects. CREATE EXTENSION creates the schema "quota" (see the control
-- file); everything here lives in it and belongs to the extension.
--
-- Keep in step with sql/pg_quota--*--*.sql: scripts/test-upgrade checks that an
-- upgraded install and a fresh one have the same catalog entries.

-- If a schema "quota" already existed, CREATE EXTENSION would install into it. The
-- library refuses that unless a superuser owns it, only superusers may create objects
-- in it and it is empty, before this script runs (src/guard.rs, in the ProcessUtility
-- hook; the library is preloaded, or this script fails at its first C function).

-- The ledger: one row per ticket, in two tables (0.6.0). quota.active holds the tickets
-- that have not ended, quota.history the ended ones; the view quota.ledger shows both,
-- as the one table of 0.1.0 to 0.5.2 did. A finish (and the writer's end of a lapsed
-- lease) deletes the ticket's row from quota.active and inserts its ended version into
-- quota.history, in one transaction: nothing updates quota.history, so a finish leaves
-- no dead version in its indexes, and quota.active stays as small as the work in flight.
-- Only the ledger writer inserts and purges, and only quota.finish() (and
-- quota.finish_job()) moves and quota.renew() updates, below SQL, acting as the owner.
-- Nobody else has any privilege on them (I5).
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
-- From 0.7.0: weight (the units the ticket counts against its limits; NULL
-- stands for 1, so that a ticket of weight 1 takes no byte more). The checks are NOT
-- VALID so that the update from 0.6.1 adds the column without reading the tables; new
-- rows are checked (pg_quota's own writes, below SQL, never store anything but 2 to
-- 1,000,000).
--
-- quota.history is 0.5.2's quota.ledger table renamed (sql/pg_quota--0.5.2--0.6.0.sql
-- renames it and moves its unended rows to quota.active), with its indexes.
CREATE TABLE quota.history (
    id          uuid        CONSTRAINT history_pkey PRIMARY KEY,
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
    weight          integer,
    CONSTRAINT history_outcome_check
        CHECK (outcome IN ('succeeded', 'failed', 'cancelled', 'expired')),
    CONSTRAINT history_ended_has_outcome
        CHECK ((ended_at IS NULL) = (outcome IS NULL))
);
-- Only ended tickets. NOT VALID: the update from 0.5.2 moves every unended row out in
-- the same transaction instead of scanning the history to validate it; new rows are
-- checked (pg_quota's own writes, below SQL, put only ended tickets here).
ALTER TABLE quota.history ADD CONSTRAINT history_ended_check
    CHECK (ended_at IS NOT NULL) NOT VALID;
ALTER TABLE quota.history ADD CONSTRAINT history_weight_check
    CHECK (weight BETWEEN 1 AND 1000000) NOT VALID;

-- A role's ended tickets by when they ended: its retained count at the window's edge,
-- its oldest retained ticket, its purge.
CREATE INDEX history_role_ended_idx ON quota.history (role, ended_at, lease_until);
-- Idempotent starts: a role's retained tickets by key.
CREATE INDEX history_role_key_idx ON quota.history (role, idempotency_key);
-- 0.5.0: what admission counts for one tenant of a role, as history_role_ended_idx
-- for the role; only tenants' tickets have entries.
CREATE INDEX history_tenant_idx ON quota.history (role, tenant, ended_at, lease_until)
    WHERE tenant IS NOT NULL;
-- 0.5.0: a role's transactional tickets by the transaction that charged them: those
-- not yet folded into the role's summary row are counted from here and from
-- active_txid_idx (see quota.summary).
CREATE INDEX history_txid_idx ON quota.history (role, txid) WHERE txid IS NOT NULL;

-- One row per role: how many ledger rows (in quota.active and quota.history together)
-- it has, in units from 0.7.0 (each row counts its ticket's weight, as the retained
-- limits do; before, every ticket weighed 1). Kept by the writer in the same transaction as each insert and purge, so
-- admission never scans a role's history. A role without a row has its rows counted
-- from the ledger instead.
-- From 0.5.0: a transactional start commits its ticket in the caller's transaction,
-- which must not update this row (every enqueue of a role would queue on it until its
-- commit). tickets counts the role's transactional tickets whose txid is below folded
-- (NULL: none), which the writer folds in from time to time; the others are counted
-- from active_txid_idx and history_txid_idx.
CREATE TABLE quota.summary (
    role    regrole PRIMARY KEY,
    tickets bigint  NOT NULL CHECK (tickets >= 0),
    folded  xid8
);

-- 0.6.0: the tickets that have not ended. Its columns are the history's.
CREATE TABLE quota.active (
    id          uuid        CONSTRAINT active_pkey PRIMARY KEY,
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
    weight          integer,
    CONSTRAINT active_unended_check CHECK (ended_at IS NULL AND outcome IS NULL)
);
-- A role's active tickets (ended_at is NULL in every row; it is in the key so that one
-- scan serves both tables). 0.6.1: lease_until is in none of quota.active's indexes,
-- so that a renewal (which changes only lease_until) is a heap-only update; a scope's
-- lapsed leases, its earliest lease, the database's active tickets and the expiry
-- sweep read the rows themselves (quota.active holds only unended tickets).
ALTER TABLE quota.active ADD CONSTRAINT active_weight_check
    CHECK (weight BETWEEN 1 AND 1000000) NOT VALID;
CREATE INDEX active_role_idx ON quota.active (role, ended_at);
-- Idempotent starts: a role's active tickets by key; only keyed tickets have entries.
CREATE INDEX active_role_key_idx ON quota.active (role, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- What admission counts for one tenant of a role.
CREATE INDEX active_tenant_idx ON quota.active (role, tenant, ended_at)
    WHERE tenant IS NOT NULL;
-- A role's transactional tickets by the transaction that charged them.
CREATE INDEX active_txid_idx ON quota.active (role, txid) WHERE txid IS NOT NULL;

REVOKE ALL ON quota.history, quota.active, quota.summary FROM PUBLIC;

-- pg_dump carries the charges across a dump and restore.
SELECT pg_catalog.pg_extension_config_dump('quota.history', '');
SELECT pg_catalog.pg_extension_config_dump('quota.summary', '');
SELECT pg_catalog.pg_extension_config_dump('quota.active', '');

-- The ledger as 0.1.0 to 0.5.2 had it: every ticket, ended or not, with the same
-- columns. For superusers (USER_GUIDE, "Tables"); the views below read it. A
-- superuser's INSERT, UPDATE or DELETE on it goes to the table the row belongs in
-- (quota.ledger_route).
CREATE VIEW quota.ledger AS
SELECT id, role, label, started_at, ended_at, outcome, lease_until, idempotency_key,
       pid, tenant, txid, weight
  FROM quota.active
UNION ALL
SELECT id, role, label, started_at, ended_at, outcome, lease_until, idempotency_key,
       pid, tenant, txid, weight
  FROM quota.history;

REVOKE ALL ON quota.ledger FROM PUBLIC;

-- Writes through quota.ledger, as a superuser makes them by hand: a row goes to
-- quota.active while it has not ended, to quota.history once it has. An UPDATE or
-- DELETE acts on the ticket's id, in whichever table it is.
CREATE FUNCTION quota.ledger_route() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        -- The row leaves the table it was read from: an unended one quota.active, an
        -- ended one quota.history. If a finish or a purge took it from there meanwhile,
        -- nothing is written back, as an UPDATE or DELETE of a table skips a row that
        -- a concurrent transaction deleted (looking in the other table would find the
        -- finish's row and bring the ticket back to life).
        IF OLD.ended_at IS NULL THEN
            DELETE FROM quota.active WHERE id OPERATOR(pg_catalog.=) OLD.id;
        ELSE
            DELETE FROM quota.history WHERE id OPERATOR(pg_catalog.=) OLD.id;
        END IF;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    IF NEW.ended_at IS NULL THEN
        INSERT INTO quota.active VALUES (NEW.*);
    ELSE
        INSERT INTO quota.history VALUES (NEW.*);
    END IF;
    RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION quota.ledger_route() FROM PUBLIC;
CREATE TRIGGER ledger_route INSTEAD OF INSERT OR UPDATE OR DELETE ON quota.ledger
    FOR EACH ROW EXECUTE FUNCTION quota.ledger_route();

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
    -- 0.6.0: once per transaction. Writes through the view quota.ledger run one
    -- statement per row (its INSTEAD OF trigger); the summary, once emptied, stays
    -- locked (ACCESS EXCLUSIVE) and empty until this transaction ends, since only the
    -- ledger writer fills it. The mark is transaction-local (and undone with a
    -- savepoint's rollback, as the TRUNCATE is). Anybody can set it, so it spares the
    -- TRUNCATE only to a role that may run it: any other (a member of
    -- pg_write_all_data, say) still gets the TRUNCATE's 42501, and its write fails, as
    -- in 0.5.2.
    IF pg_catalog.current_setting('pg_quota_internal.summary_emptied', true)
       IS DISTINCT FROM pg_catalog.pg_current_xact_id()::pg_catalog.text
       OR NOT pg_catalog.has_table_privilege('quota.summary', 'TRUNCATE') THEN
        TRUNCATE quota.summary;
        PERFORM pg_catalog.set_config('pg_quota_internal.summary_emptied',
                                      pg_catalog.pg_current_xact_id()::pg_catalog.text, true);
    END IF;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION quota.ledger_written() FROM PUBLIC;
CREATE TRIGGER ledger_written AFTER INSERT OR UPDATE OR DELETE ON quota.history
    FOR EACH STATEMENT EXECUTE FUNCTION quota.ledger_written();
CREATE TRIGGER ledger_truncated AFTER TRUNCATE ON quota.history
    FOR EACH STATEMENT EXECUTE FUNCTION quota.ledger_written();
CREATE TRIGGER ledger_written AFTER INSERT OR UPDATE OR DELETE ON quota.active
    FOR EACH STATEMENT EXECUTE FUNCTION quota.ledger_written();
CREATE TRIGGER ledger_truncated AFTER TRUNCATE ON quota.active
    FOR EACH STATEMENT EXECUTE FUNCTION quota.ledger_written();
-- Fire also under session_replication_role = replica: pg_quota's counters rely on them
-- (src/scopes.rs) and are not used while they are missing or disabled. From 0.3.1 the
-- library keeps them so: ENABLE TRIGGER (ALL) sets them back to ENABLE ALWAYS, and any
-- change to their state empties the summary (src/guard.rs). (Logical replication's
-- apply worker fires no statement triggers at all: replicating pg_quota's tables into
-- another server is not supported.)
ALTER TABLE quota.history ENABLE ALWAYS TRIGGER ledger_written;
ALTER TABLE quota.history ENABLE ALWAYS TRIGGER ledger_truncated;
ALTER TABLE quota.active ENABLE ALWAYS TRIGGER ledger_written;
ALTER TABLE quota.active ENABLE ALWAYS TRIGGER ledger_truncated;

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
-- with the other tables. These are disabled and do nothing. The library refuses
-- any other trigger on pg_quota's tables, and DROP or RENAME of pg_quota's own
-- (src/guard.rs).
CREATE FUNCTION quota.repack_placeholder() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION quota.repack_placeholder() FROM PUBLIC;
CREATE TRIGGER repack_trigger AFTER INSERT ON quota.history
    FOR EACH STATEMENT EXECUTE FUNCTION quota.repack_placeholder();
ALTER TABLE quota.history DISABLE TRIGGER repack_trigger;
CREATE TRIGGER repack_trigger AFTER INSERT ON quota.summary
    FOR EACH STATEMENT EXECUTE FUNCTION quota.repack_placeholder();
ALTER TABLE quota.summary DISABLE TRIGGER repack_trigger;
CREATE TRIGGER repack_trigger AFTER INSERT ON quota.active
    FOR EACH STATEMENT EXECUTE FUNCTION quota.repack_placeholder();
ALTER TABLE quota.active DISABLE TRIGGER repack_trigger;
COMMENT ON TRIGGER repack_trigger ON quota.history IS
    'pg_quota: keeps pg_repack off this table, whose changes its trigger cannot see; see "Reclaiming space" in the user guide';
COMMENT ON TRIGGER repack_trigger ON quota.summary IS
    'pg_quota: keeps pg_repack off this table, whose changes its trigger cannot see; see "Reclaiming space" in the user guide';
COMMENT ON TRIGGER repack_trigger ON quota.active IS
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
           COALESCE(l.weight, 1) AS weight,
           p.retention,
           p.now
      FROM quota.ledger l, params p
     WHERE pg_catalog.pg_has_role(CURRENT_USER, l.role::pg_catalog.oid, 'MEMBER')
        OR (SELECT pg_catalog.pg_has_role(CURRENT_USER, 'pg_read_all_stats', 'USAGE'))
)
SELECT t.role                                                        AS role,
       COALESCE(pg_catalog.sum(t.weight) FILTER (WHERE t.ended_at IS NULL), 0)
                                                                     AS active,
       pg_catalog.sum(t.weight)                                      AS retained,
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
       l.txid IS NOT NULL AS transactional,
       COALESCE(l.weight, 1) AS weight
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
           COALESCE(l.weight, 1) AS weight,
           p.retention,
           p.now
      FROM quota.ledger l, params p
     WHERE l.tenant IS NOT NULL
       AND (pg_catalog.pg_has_role(CURRENT_USER, l.role::pg_catalog.oid, 'MEMBER')
            OR (SELECT pg_catalog.pg_has_role(CURRENT_USER, 'pg_read_all_stats', 'USAGE')))
)
SELECT t.role                                                        AS role,
       t.tenant                                                      AS tenant,
       COALESCE(pg_catalog.sum(t.weight) FILTER (WHERE t.ended_at IS NULL), 0)
                                                                     AS active,
       pg_catalog.sum(t.weight)                                      AS retained,
       (pg_catalog.min(t.ended_at) OPERATOR(pg_catalog.+) t.retention) AS next_ageout
  FROM tickets t
 WHERE t.ended_at IS NULL
    OR t.ended_at OPERATOR(pg_catalog.>=) (t.now OPERATOR(pg_catalog.-) t.retention)
 GROUP BY t.role, t.tenant, t.retention;

GRANT SELECT ON quota.tenant_usage TO PUBLIC;

-- 0.7.0: each tenant's own limits, in place of its role's quota.max_active_per_tenant
-- and quota.max_retained_per_tenant: NULL where the role's setting applies, 0 for no
-- limit. Written by quota.set_tenant_limits() in the caller's transaction, read by
-- start() below SQL (src/ledger/overrides.rs), which caches them until its trigger
-- (created with the function, src/api.rs) invalidates the cache when a change commits.
-- tenant compares byte for byte, as a start's tenant does.
CREATE TABLE quota.tenant_overrides (
    role         regrole     NOT NULL,
    tenant       text        COLLATE "C" NOT NULL,
    max_active   integer     CHECK (max_active >= 0),
    max_retained integer     CHECK (max_retained >= 0),
    set_at       timestamptz NOT NULL,
    set_by       name        NOT NULL,
    CONSTRAINT tenant_overrides_pkey PRIMARY KEY (role, tenant),
    CONSTRAINT tenant_overrides_some_limit
        CHECK (max_active IS NOT NULL OR max_retained IS NOT NULL)
);
REVOKE ALL ON quota.tenant_overrides FROM PUBLIC;
SELECT pg_catalog.pg_extension_config_dump('quota.tenant_overrides', '');
-- pg_repack would copy it through a trigger of its own, which pg_quota refuses on this
-- table (src/hooks/guard.rs): the placeholder makes pg_repack skip it, as the ledger's.
CREATE TRIGGER repack_trigger AFTER INSERT ON quota.tenant_overrides
    FOR EACH STATEMENT EXECUTE FUNCTION quota.repack_placeholder();
ALTER TABLE quota.tenant_overrides DISABLE TRIGGER repack_trigger;
COMMENT ON TRIGGER repack_trigger ON quota.tenant_overrides IS
    'pg_quota: keeps pg_repack off this table, where its trigger is refused; VACUUM FULL compacts it';

-- 0.7.0: the tenants' own limits, visible as quota.tenant_usage is: a role's to its
-- members, all of them to superusers and members of pg_read_all_stats.
CREATE VIEW quota.tenant_limits WITH (security_barrier) AS
SELECT o.role, o.tenant, o.max_active, o.max_retained, o.set_at, o.set_by
  FROM quota.tenant_overrides o
 WHERE pg_catalog.pg_has_role(CURRENT_USER, o.role::pg_catalog.oid, 'MEMBER')
    OR (SELECT pg_catalog.pg_has_role(CURRENT_USER, 'pg_read_all_stats', 'USAGE'));
GRANT SELECT ON quota.tenant_limits TO PUBLIC;
