-- pg_quota 0.5.2 -> 0.6.0
--
-- Why this script exists: ALTER EXTENSION pg_quota UPDATE needs a path from every
-- released version to 0.6.0, and this is its last step. 0.6.0 is under way (CHANGELOG.md,
-- "Unreleased (0.6.0)"); what it adds to the schema so far:
--
-- 1. quota.finish_job(), a trigger function that finishes a job's ticket when a job
--    queue ends the job, in the queue's own transaction: its status update, or the
--    delete of its row (USER_GUIDE, "quota.finish_job() RETURNS trigger"). New, with
--    PostgreSQL's default privileges, as quota.finish() has: it finishes only the
--    tickets the role that fires it may finish (I5), and CREATE TRIGGER needs the
--    table's TRIGGER privilege besides. Beside it quota.claim_job(), a trigger
--    function that renews a job's ticket in the transaction in which the queue claims
--    the job, and clears from the row a ticket it cannot renew (USER_GUIDE,
--    "quota.claim_job() RETURNS trigger"): the privileges of quota.renew().
--
-- 2. The ledger in two tables (issue 33): quota.active for the tickets that have not
--    ended, quota.history for the ended ones, and quota.ledger a view of both with the
--    columns it had. A finish was a non-HOT update of the one table (ended_at is in
--    its indexes), leaving a dead version in each of its five indexes, which an old
--    snapshot kept there; it is now a delete from quota.active and an insert into
--    quota.history, which nothing updates. Done in bounded time, whatever the history
--    holds: the table quota.ledger is renamed quota.history (its indexes, constraints
--    and triggers renamed with it, its rows left where they are), and only its unended
--    rows, as many as the tickets in flight, move to the new quota.active, found
--    through ledger_open_idx, which is then dropped (nothing reads the history by
--    ended_at alone any more). The history's new CHECK (ended_at IS NOT NULL) is NOT
--    VALID, in a fresh install too, so that no scan of the history validates it: the
--    move takes every row it would reject. The triggers that empty the summary after
--    SQL writes are off for the move (rows change tables, no role's count changes), so
--    no role's summary row is lost to it. The views that read the table are made to
--    read the new quota.ledger view; the update stops, naming them, where a view or
--    another object of the DBA's (a BEGIN ATOMIC function, a policy) is bound to the
--    table and would follow it to quota.history. An index a DBA made on quota.ledger stays on
--    quota.history, under its name (USER_GUIDE, "Upgrading to 0.6.0").
--    ALTER EXTENSION holds ACCESS EXCLUSIVE on the table and the views that read it
--    from its first statement on, taken all or none (see below), so it waits for every
--    transaction that charged, finished or renewed a ticket to end first, and start()
--    waits for it while it waits (at most 5 seconds, then 55P03). It must run at
--    READ COMMITTED (each statement of the script then sees what committed before it:
--    the move sees every ticket in flight) and refuses otherwise. The history's
--    ledger_written is put back in the state it was in; where that was not ENABLE
--    ALWAYS, the summary is emptied (counted afresh). quota.ledger_written() empties
--    the summary once per transaction (writes through the view run one statement per
--    row), and refuses, as before, a role without the TRUNCATE privilege on it.
--    Renamed with the table: its constraints named ledger_* (the CHECKs, and
--    PostgreSQL 18's NOT NULL constraints), where the DBA did not rename them.
--
-- Refusals from shared memory (0.6.0) need no SQL object; the shared memory layout of
-- the scope counters changed (88 bytes a counter), which the server restart that loads
-- a new build of a preloaded library sets up.
--
-- The result must equal a fresh 0.6.0 install (sql/schema.sql, sql/stats.sql and
-- src/api.rs); scripts/test-upgrade compares the catalogs, pg_init_privs included.

\echo Use "ALTER EXTENSION pg_quota UPDATE TO '0.6.0'" to load this file. \quit

CREATE FUNCTION quota."finish_job"() RETURNS trigger
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'finish_job_wrapper';

CREATE FUNCTION quota."claim_job"() RETURNS trigger
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'claim_job_wrapper';

-- 2. The ledger in two tables.
-- Locks first, all of them or none. A reader of quota.usage locks the view, then the
-- table; a transaction that started or finished a ticket holds the table, and may then
-- read the view. An update that held the table while it waited for a view (the rename
-- first, as it was) deadlocked with the first kind, one that held the views while it
-- waited for the table with the second (40P01, update rolled back). So each try takes
-- the views (ALTER VIEW locks no relation beneath it) and then the table with a short
-- lock_timeout, and a try that times out or meets a deadlock is rolled back, which lets
-- go of what it took, and tried again with twice the timeout (at most 10 s): the
-- update waits for the table's holders as before, but never while a reader waits for
-- it. The session's own lock_timeout, where set, bounds the whole wait. And no view of
-- the DBA's on the table can be created once the check below has run.
DO $$
DECLARE
    saved pg_catalog.text := pg_catalog.current_setting('lock_timeout');
    bound pg_catalog.interval := pg_catalog.current_setting('lock_timeout')::pg_catalog.interval;
    began pg_catalog.timestamptz := pg_catalog.clock_timestamp();
    try_ms pg_catalog.int4 := 100;
BEGIN
    LOOP
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout', try_ms::pg_catalog.text || 'ms', true);
            ALTER VIEW quota.usage SET (security_barrier = true);
            ALTER VIEW quota.tickets SET (security_barrier = true);
            ALTER VIEW quota.tenant_usage SET (security_barrier = true);
            LOCK TABLE quota.ledger IN ACCESS EXCLUSIVE MODE;
            EXIT;
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            IF bound OPERATOR(pg_catalog.>) '0'::pg_catalog.interval
               AND (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) began) OPERATOR(pg_catalog.>=) bound THEN
                RAISE EXCEPTION 'could not lock quota.ledger and the views that read it within lock_timeout (%)', saved
                    USING ERRCODE = 'lock_not_available',
                          HINT = 'Transactions that started, finished or renewed tickets, or that read quota.ledger, held it throughout. Run the update when they have ended, or with a longer lock_timeout.';
            END IF;
            IF try_ms OPERATOR(pg_catalog.<) 10000 THEN
                try_ms := try_ms OPERATOR(pg_catalog.*) 2;
            END IF;
        END;
    END LOOP;
    PERFORM pg_catalog.set_config('lock_timeout', saved, true);
END
$$;
-- The move below must see every unended row committed before the rename's lock, which
-- a statement's own snapshot does only at READ COMMITTED (under REPEATABLE READ the
-- script's statements share the one taken when ALTER EXTENSION began). And a view of
-- the DBA's on the table would silently read quota.history only after the rename:
-- stop, and name it.
DO $$
DECLARE
    views text;
    others text;
BEGIN
    IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
        RAISE EXCEPTION 'ALTER EXTENSION pg_quota UPDATE to 0.6.0 must run at READ COMMITTED'
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'Run it outside a REPEATABLE READ or SERIALIZABLE transaction (check default_transaction_isolation): the update moves the tickets in flight, and must see all of them.';
    END IF;
    SELECT pg_catalog.string_agg(DISTINCT r.ev_class::pg_catalog.regclass::pg_catalog.text, ', ')
      INTO views
      FROM pg_catalog.pg_depend d
      JOIN pg_catalog.pg_rewrite r ON r.oid OPERATOR(pg_catalog.=) d.objid
     WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_rewrite'::pg_catalog.regclass
       AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
       AND d.refobjid OPERATOR(pg_catalog.=) 'quota.ledger'::pg_catalog.regclass
       AND NOT EXISTS (SELECT FROM pg_catalog.pg_depend e
                        WHERE e.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
                          AND e.objid OPERATOR(pg_catalog.=) r.ev_class
                          AND e.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::pg_catalog.regclass
                          AND e.refobjid OPERATOR(pg_catalog.=)
                              (SELECT x.oid FROM pg_catalog.pg_extension x
                                WHERE x.extname OPERATOR(pg_catalog.=) 'pg_quota')
                          AND e.deptype OPERATOR(pg_catalog.=) 'e');
    IF views IS NOT NULL THEN
        RAISE EXCEPTION 'cannot update pg_quota to 0.6.0 while views read quota.ledger: %', views
            USING ERRCODE = 'dependent_objects_still_exist',
                  HINT = 'Drop them, run ALTER EXTENSION pg_quota UPDATE, and create them again: from 0.6.0 quota.ledger is a view of quota.active and quota.history, with the same columns.';
    END IF;
    -- The same for anything else of the DBA's bound to the table by its OID, which would
    -- follow it to quota.history: a BEGIN ATOMIC function, a policy of another table.
    -- (Its own indexes, constraints, triggers and statistics depend on it
    -- automatically, and stay on quota.history; the library refuses foreign keys to it.)
    SELECT pg_catalog.string_agg(DISTINCT pg_catalog.pg_describe_object(d.classid, d.objid, 0), ', ')
      INTO others
      FROM pg_catalog.pg_depend d
     WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
       AND d.refobjid OPERATOR(pg_catalog.=) 'quota.ledger'::pg_catalog.regclass
       AND d.deptype OPERATOR(pg_catalog.=) 'n'
       AND d.classid OPERATOR(pg_catalog.<>) 'pg_catalog.pg_rewrite'::pg_catalog.regclass
       -- The table's own CHECKs depend on its columns this way too.
       AND NOT EXISTS (SELECT FROM pg_catalog.pg_depend o
                        WHERE o.classid OPERATOR(pg_catalog.=) d.classid
                          AND o.objid OPERATOR(pg_catalog.=) d.objid
                          AND o.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
                          AND o.refobjid OPERATOR(pg_catalog.=) 'quota.ledger'::pg_catalog.regclass
                          AND o.deptype OPERATOR(pg_catalog.=) ANY ('{a,i}'::"char"[]))
       AND NOT EXISTS (SELECT FROM pg_catalog.pg_depend e
                        WHERE e.classid OPERATOR(pg_catalog.=) d.classid
                          AND e.objid OPERATOR(pg_catalog.=) d.objid
                          AND e.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::pg_catalog.regclass
                          AND e.refobjid OPERATOR(pg_catalog.=)
                              (SELECT x.oid FROM pg_catalog.pg_extension x
                                WHERE x.extname OPERATOR(pg_catalog.=) 'pg_quota')
                          AND e.deptype OPERATOR(pg_catalog.=) 'e');
    IF others IS NOT NULL THEN
        RAISE EXCEPTION 'cannot update pg_quota to 0.6.0 while objects depend on quota.ledger: %', others
            USING ERRCODE = 'dependent_objects_still_exist',
                  HINT = 'Drop them, run ALTER EXTENSION pg_quota UPDATE, and create them again on quota.active, quota.history or the new view quota.ledger: the update renames the table quota.history, and they would follow it there.';
    END IF;
END
$$;
ALTER TABLE quota.ledger RENAME TO history;
-- pg_quota finds its indexes by what they index, so a DBA may have renamed them: a
-- renamed one keeps the DBA's name.
ALTER INDEX IF EXISTS quota.ledger_pkey RENAME TO history_pkey;
ALTER INDEX IF EXISTS quota.ledger_role_ended_idx RENAME TO history_role_ended_idx;
ALTER INDEX IF EXISTS quota.ledger_role_key_idx RENAME TO history_role_key_idx;
ALTER INDEX IF EXISTS quota.ledger_tenant_idx RENAME TO history_tenant_idx;
ALTER INDEX IF EXISTS quota.ledger_txid_idx RENAME TO history_txid_idx;
-- Its constraints the same way: the CHECKs, and on PostgreSQL 18 the NOT NULL
-- constraints it names after the table (ledger_id_not_null, ...).
DO $$
DECLARE
    c text;
BEGIN
    FOR c IN SELECT conname FROM pg_catalog.pg_constraint
              WHERE conrelid OPERATOR(pg_catalog.=) 'quota.history'::pg_catalog.regclass
                AND conname OPERATOR(pg_catalog.~~) 'ledger\_%'
              ORDER BY conname
    LOOP
        EXECUTE pg_catalog.format('ALTER TABLE quota.history RENAME CONSTRAINT %I TO %I',
                                  c, 'history_' OPERATOR(pg_catalog.||) pg_catalog.substr(c, 8));
    END LOOP;
END
$$;

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
    CONSTRAINT active_unended_check CHECK (ended_at IS NULL AND outcome IS NULL)
);
-- A role's active tickets by when their leases run out (ended_at is NULL in every
-- row; it is in the key so that one scan serves both tables): its active count, its
-- earliest lease, its lapsed leases.
CREATE INDEX active_role_idx ON quota.active (role, ended_at, lease_until);
-- The database's active tickets (quota.max_active_per_database) and its leases that
-- ran out (the writer's expiry sweep), without walking every role.
CREATE INDEX active_open_idx ON quota.active (ended_at, lease_until);
-- Idempotent starts: a role's active tickets by key; only keyed tickets have entries.
CREATE INDEX active_role_key_idx ON quota.active (role, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- What admission counts for one tenant of a role.
CREATE INDEX active_tenant_idx ON quota.active (role, tenant, ended_at, lease_until)
    WHERE tenant IS NOT NULL;
-- A role's transactional tickets by the transaction that charged them.
CREATE INDEX active_txid_idx ON quota.active (role, txid) WHERE txid IS NOT NULL;

REVOKE ALL ON quota.active FROM PUBLIC;
SELECT pg_catalog.pg_extension_config_dump('quota.active', '');

-- The move, with the history's ledger_written off (rows change tables, no role's count
-- changes) and then put back as it was. Where a DBA had it other than ENABLE ALWAYS
-- (or dropped it, before 0.3.1), SQL writes may have gone unseen by the summary: it
-- is emptied, and counted afresh, as the library does when the trigger is enabled.
DO $$
DECLARE
    state "char";
BEGIN
    SELECT t.tgenabled INTO state FROM pg_catalog.pg_trigger t
     WHERE t.tgrelid OPERATOR(pg_catalog.=) 'quota.history'::pg_catalog.regclass
       AND t.tgname OPERATOR(pg_catalog.=) 'ledger_written';
    IF state IS NOT NULL AND state OPERATOR(pg_catalog.<>) 'D' THEN
        ALTER TABLE quota.history DISABLE TRIGGER ledger_written;
    END IF;
    WITH moved AS (
        DELETE FROM quota.history WHERE ended_at IS NULL RETURNING *
    )
    INSERT INTO quota.active SELECT * FROM moved;
    IF state IS NOT NULL AND state OPERATOR(pg_catalog.<>) 'D' THEN
        EXECUTE pg_catalog.format('ALTER TABLE quota.history ENABLE %s TRIGGER ledger_written',
                                  CASE state WHEN 'A' THEN 'ALWAYS' WHEN 'R' THEN 'REPLICA' ELSE '' END);
    END IF;
    IF state IS DISTINCT FROM 'A' THEN
        TRUNCATE quota.summary;
    END IF;
END
$$;

-- The history's index on (ended_at, lease_until) served the unended tickets (now
-- quota.active's active_open_idx) and quota.usage_totals(), which counts the history
-- role by role through history_role_ended_idx from 0.6.0: dropped, so that a finish
-- enters one index fewer. Dropping it is as quick as the rename (its file is unlinked
-- at commit). An index a DBA renamed is the DBA's, and stays.
DROP INDEX IF EXISTS quota.ledger_open_idx;

ALTER TABLE quota.history ADD CONSTRAINT history_ended_check
    CHECK (ended_at IS NOT NULL) NOT VALID;

CREATE TRIGGER ledger_written AFTER INSERT OR UPDATE OR DELETE ON quota.active
    FOR EACH STATEMENT EXECUTE FUNCTION quota.ledger_written();
CREATE TRIGGER ledger_truncated AFTER TRUNCATE ON quota.active
    FOR EACH STATEMENT EXECUTE FUNCTION quota.ledger_written();
ALTER TABLE quota.active ENABLE ALWAYS TRIGGER ledger_written;
ALTER TABLE quota.active ENABLE ALWAYS TRIGGER ledger_truncated;
CREATE TRIGGER repack_trigger AFTER INSERT ON quota.active
    FOR EACH STATEMENT EXECUTE FUNCTION quota.repack_placeholder();
ALTER TABLE quota.active DISABLE TRIGGER repack_trigger;
COMMENT ON TRIGGER repack_trigger ON quota.active IS
    'pg_quota: keeps pg_repack off this table, whose changes its trigger cannot see; see "Reclaiming space" in the user guide';

CREATE VIEW quota.ledger AS
SELECT id, role, label, started_at, ended_at, outcome, lease_until, idempotency_key,
       pid, tenant, txid
  FROM quota.active
UNION ALL
SELECT id, role, label, started_at, ended_at, outcome, lease_until, idempotency_key,
       pid, tenant, txid
  FROM quota.history;

REVOKE ALL ON quota.ledger FROM PUBLIC;

-- Empties the summary once per transaction (0.6.0): a write through the view runs
-- one statement per row.
CREATE OR REPLACE FUNCTION quota.ledger_written() RETURNS trigger
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

CREATE OR REPLACE VIEW quota.usage WITH (security_barrier) AS
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

CREATE OR REPLACE VIEW quota.tickets WITH (security_barrier) AS
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

CREATE OR REPLACE VIEW quota.tenant_usage WITH (security_barrier) AS
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
