-- pg_quota 0.3.0 -> 0.3.1
--
-- Why this script exists: 0.3.1 makes pg_quota exact under the tools DBAs run beside it
-- (USER_GUIDE.md, "Upgrading to 0.3.1"). What it changes, and why:
-- 1. A disabled trigger named repack_trigger on quota.ledger and quota.summary, which
--    does nothing. pg_repack lost every ticket committed while it copied the ledger:
--    it replays what its own row trigger logged, and pg_quota writes below SQL, where
--    no trigger fires. A trigger of that name makes pg_repack skip a table before it
--    copies anything, and go on with the others. (The 0.3.1 library also refuses any
--    other CREATE TRIGGER on these tables, and a DROP or RENAME of pg_quota's own.) An
--    existing trigger of that name is pg_repack's own, left by an interrupted run: the
--    update stops and says so, since its log table would otherwise be kept filling.
-- 2. summary_written fires ALWAYS, as the ledger's triggers do (0.3.0 created it at
--    ENABLE); any of the ledger's data triggers left at ENABLE (by ENABLE TRIGGER ALL,
--    as pg_restore --disable-triggers runs it) is set back to ENABLE ALWAYS, so that
--    pg_quota uses its counters again. A trigger a DBA disabled stays disabled, and
--    one a DBA dropped stays missing.
-- 3. quota.summary is emptied once: 0.3.0 kept trusting it, and the counters built from
--    it, across a time when the triggers were disabled and SQL wrote to the ledger
--    unseen. Each role's rows are counted from the ledger again, and the writer
--    rebuilds the summary.
-- 4. quota.current_retention(), read by quota.usage instead of current_setting(), so
--    that quota.usage without the preloaded library says 55000 and how to fix it.
-- 5. quota.usage and quota.tickets show a role the rows of the roles whose tickets it may
--    finish (its own and those of roles it is a member of); quota.tickets shows every
--    row to members of pg_read_all_stats, as quota.usage and quota.stats do. Their
--    columns do not change, so they are replaced in place (CREATE OR REPLACE VIEW):
--    their privileges and views of yours on them stay.
-- 6. The 0.1.1 -> 0.2.0 update copied a DBA's EXECUTE privileges on start() and
--    try_start() inside the extension script, so PostgreSQL recorded them in
--    pg_init_privs as the extension's own, and pg_dump left them out: after a restore,
--    roles the DBA had shut out could call start() again. Those functions' entries in
--    pg_init_privs (and, from PostgreSQL 17, the pg_shdepend entries that go with them)
--    are removed, which is what a fresh install has: pg_dump then writes the DBA's
--    privileges. The privileges themselves do not change.
-- Nothing else changes: other objects, their privileges and your tickets stay.
--
-- The result must equal a fresh 0.3.1 install (sql/schema.sql, sql/stats.sql and
-- src/api.rs); scripts/test-upgrade compares the catalogs, pg_init_privs included.

\echo Use "ALTER EXTENSION pg_quota UPDATE TO '0.3.1'" to load this file. \quit

-- 1.
DO $leftover$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t
                WHERE t.tgrelid OPERATOR(pg_catalog.=) ANY (ARRAY['quota.ledger'::pg_catalog.regclass,
                                                                  'quota.summary'::pg_catalog.regclass])
                  AND t.tgname OPERATOR(pg_catalog.=) 'repack_trigger') THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_in_use',
            MESSAGE = 'a trigger "repack_trigger" left by an interrupted pg_repack run is on a table of pg_quota',
            HINT    = 'Drop it (DROP TRIGGER repack_trigger ON quota.ledger, or ON quota.summary), or drop and create extension pg_repack in this database, then update again.';
    END IF;
END
$leftover$;

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

-- 2.
DO $always$
DECLARE
    t record;
BEGIN
    FOR t IN SELECT c.relname, g.tgname
               FROM pg_catalog.pg_trigger g
               JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) g.tgrelid
              WHERE ((c.oid OPERATOR(pg_catalog.=) 'quota.ledger'::pg_catalog.regclass
                      AND g.tgname OPERATOR(pg_catalog.=) ANY (ARRAY['ledger_written', 'ledger_truncated']))
                  OR (c.oid OPERATOR(pg_catalog.=) 'quota.summary'::pg_catalog.regclass
                      AND g.tgname OPERATOR(pg_catalog.=) 'summary_written'))
                AND g.tgenabled OPERATOR(pg_catalog.<>) ALL (ARRAY['A', 'D']::"char"[]) LOOP
        EXECUTE pg_catalog.format('ALTER TABLE quota.%I ENABLE ALWAYS TRIGGER %I', t.relname, t.tgname);
    END LOOP;
END
$always$;

-- 3.
TRUNCATE quota.summary;

-- 4.
CREATE FUNCTION quota.current_retention() RETURNS interval
    STABLE PARALLEL SAFE
    LANGUAGE c AS 'MODULE_PATHNAME', 'current_retention_wrapper';

-- 5.
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
       l.pid
  FROM quota.ledger l
 WHERE pg_catalog.pg_has_role(CURRENT_USER, l.role::pg_catalog.oid, 'MEMBER')
    OR (SELECT pg_catalog.pg_has_role(CURRENT_USER, 'pg_read_all_stats', 'USAGE'));

-- 6.
DELETE FROM pg_catalog.pg_shdepend d
 WHERE d.dbid OPERATOR(pg_catalog.=) (SELECT b.oid FROM pg_catalog.pg_database b
                                       WHERE b.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
   AND d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
   AND d.objid OPERATOR(pg_catalog.=) ANY (ARRAY['quota.start(text, interval, text, interval)'::pg_catalog.regprocedure,
                                                 'quota.try_start(text, interval, text, interval)'::pg_catalog.regprocedure]::pg_catalog.oid[])
   AND d.deptype OPERATOR(pg_catalog.=) 'i';
DELETE FROM pg_catalog.pg_init_privs i
 WHERE i.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
   AND i.objoid OPERATOR(pg_catalog.=) ANY (ARRAY['quota.start(text, interval, text, interval)'::pg_catalog.regprocedure,
                                                  'quota.try_start(text, interval, text, interval)'::pg_catalog.regprocedure]::pg_catalog.oid[]);
