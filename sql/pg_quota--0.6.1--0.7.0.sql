-- pg_quota 0.6.1 -> 0.7.0
--
-- Why this script exists: 0.7.0 gives each tenant limits of its own, set at run time
-- (a customer's plan), in place of its role's quota.max_active_per_tenant and
-- quota.max_retained_per_tenant. They are rows of a new table, which needs:
--
-- - quota.tenant_overrides, one row per (role, tenant), written by the new function
--   quota.set_tenant_limits() in the caller's transaction (EXECUTE revoked from
--   PUBLIC: a superuser grants it), and carried by pg_dump (a config table, roles by
--   name);
-- - its statement trigger, which invalidates every backend's cache of these rows when
--   a change to them commits;
-- - the view quota.tenant_limits, which shows them as quota.tenant_usage shows usage;
-- - a disabled repack_trigger on it, which makes pg_repack skip it as it skips the
--   ledger's tables (the library refuses any other trigger on it).
--
-- 0.7.0 also weighs tickets: start(weight => n) and try_start(weight => n) charge n
-- units against the active and the retained limits. That needs:
--
-- - a column weight on quota.active and quota.history (NULL for 1, so no existing row
--   changes, and ADD COLUMN rewrites nothing), with a check that is NOT VALID (no scan
--   of the tables under their ACCESS EXCLUSIVE lock; new rows are checked);
-- - quota.ledger, quota.usage and quota.tenant_usage redefined to carry it: the views'
--   active and retained columns sum weights; quota.tickets gains a column weight at
--   its end;
-- - nothing for quota.summary: its tickets column counts units from 0.7.0 on (the
--   library adds each ticket's weight), and every ticket it counts so far weighs 1;
-- - start() and try_start() overloads whose first argument, weight, has no default:
--   the existing functions stay as they are, so that a view, a column default or a
--   function that calls them keeps working, and every existing call resolves as
--   before: a call without weight matches only the old function, and where the old
--   one takes an interval or a boolean the new one takes the same at that place, so
--   that literals of unknown type (start('a job', '1 hour')) never make a call
--   ambiguous (src/api.rs, start_v7).
--
-- No index changes, and no ticket is rewritten.
--
-- The update refuses (55000) while the server still runs an older library (see the
-- first statement): an older library would ignore the tenants' own limits, and lacks
-- the functions this script declares. Restart the server with 0.7.0's first.
--
-- The result must equal a fresh 0.7.0 install (sql/schema.sql, sql/stats.sql and
-- src/api.rs); scripts/test-upgrade compares the catalogs, pg_init_privs included.

\echo Use "ALTER EXTENSION pg_quota UPDATE TO '0.7.0'" to load this file. \quit

DO $$
DECLARE
    v pg_catalog.text := pg_catalog.current_setting('quota.library_version', true);
BEGIN
    IF v IS NULL OR pg_catalog.string_to_array(pg_catalog.split_part(v, '-', 1), '.')::pg_catalog.int4[]
                    OPERATOR(pg_catalog.<) '{0,7,0}'::pg_catalog.int4[] THEN
        RAISE EXCEPTION 'this server still runs a pg_quota library older than 0.7.0'
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = pg_catalog.format('The library loaded at server start is %s.', COALESCE(v, 'older than 0.6.1')),
                  HINT = 'Restart the server after installing pg_quota 0.7.0, then run ALTER EXTENSION pg_quota UPDATE again.';
    END IF;
END
$$;

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

CREATE VIEW quota.tenant_limits WITH (security_barrier) AS
SELECT o.role, o.tenant, o.max_active, o.max_retained, o.set_at, o.set_by
  FROM quota.tenant_overrides o
 WHERE pg_catalog.pg_has_role(CURRENT_USER, o.role::pg_catalog.oid, 'MEMBER')
    OR (SELECT pg_catalog.pg_has_role(CURRENT_USER, 'pg_read_all_stats', 'USAGE'));
GRANT SELECT ON quota.tenant_limits TO PUBLIC;

CREATE FUNCTION quota."set_tenant_limits"(
	"tenant" TEXT,
	"max_active" INT DEFAULT NULL,
	"max_retained" INT DEFAULT NULL,
	"role" regrole DEFAULT CURRENT_USER::pg_catalog.regrole
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'set_tenant_limits_wrapper';

CREATE FUNCTION quota.tenant_overrides_written() RETURNS trigger
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'tenant_overrides_written_wrapper';
REVOKE ALL ON FUNCTION quota.tenant_overrides_written() FROM PUBLIC;
CREATE TRIGGER tenant_overrides_written
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON quota.tenant_overrides
    FOR EACH STATEMENT EXECUTE FUNCTION quota.tenant_overrides_written();
ALTER TABLE quota.tenant_overrides ENABLE ALWAYS TRIGGER tenant_overrides_written;
REVOKE ALL ON FUNCTION quota.set_tenant_limits(text, integer, integer, regrole) FROM PUBLIC;

-- Weighted tickets.
-- Locks first, all of them or none, as 0.6.0's update takes them (see
-- pg_quota--0.5.2--0.6.0.sql): a reader of quota.usage locks the view, then the
-- tables; a transaction that started or finished a ticket holds quota.active, and may
-- then open quota.history or read a view. Each try takes the views (ALTER VIEW locks
-- no relation beneath it), then the tables through quota.ledger (LOCK on a view locks
-- the tables it reads, quota.active first, as the library opens them), with a short
-- lock_timeout; a try that times out or meets a deadlock is rolled back, which lets go
-- of what it took, and tried again with twice the timeout, up to half of
-- deadlock_timeout: PostgreSQL looks for a deadlock once per lock wait, that long after
-- it began, so a longer try could hold the views past its one check while a ticket's
-- holder came to wait for them, and that holder, not the update, would get the 40P01.
-- Short tries also keep starts and finishes, which queue behind the update's request
-- for the tables, well within their own bounded wait (5 s). So the update holds the
-- views only for one such try while it waits for the tables. The session's own
-- lock_timeout, where set, bounds the whole wait; no try runs past it.
DO $$
DECLARE
    saved pg_catalog.text := pg_catalog.current_setting('lock_timeout');
    bound pg_catalog.interval := pg_catalog.current_setting('lock_timeout')::pg_catalog.interval;
    began pg_catalog.timestamptz := pg_catalog.clock_timestamp();
    try_ms pg_catalog.int4 := 10;
    most_ms pg_catalog.int4 := GREATEST(10, (pg_catalog.date_part('epoch',
        pg_catalog.current_setting('deadlock_timeout')::pg_catalog.interval) OPERATOR(pg_catalog.*) 500)::pg_catalog.int4);
    left_ms pg_catalog.int4;
BEGIN
    LOOP
        BEGIN
            left_ms := try_ms;
            IF bound OPERATOR(pg_catalog.>) '0'::pg_catalog.interval THEN
                left_ms := LEAST(try_ms, GREATEST(1, pg_catalog.ceil(pg_catalog.date_part('epoch',
                    bound OPERATOR(pg_catalog.-) (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) began)) OPERATOR(pg_catalog.*) 1000)::pg_catalog.int4));
            END IF;
            PERFORM pg_catalog.set_config('lock_timeout', left_ms::pg_catalog.text || 'ms', true);
            ALTER VIEW quota.usage SET (security_barrier = true);
            ALTER VIEW quota.tickets SET (security_barrier = true);
            ALTER VIEW quota.tenant_usage SET (security_barrier = true);
            LOCK TABLE quota.ledger IN ACCESS EXCLUSIVE MODE;
            EXIT;
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            IF bound OPERATOR(pg_catalog.>) '0'::pg_catalog.interval
               AND (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) began) OPERATOR(pg_catalog.>=) bound THEN
                RAISE EXCEPTION 'could not lock quota.active, quota.history and the views that read them within lock_timeout (%)', saved
                    USING ERRCODE = 'lock_not_available',
                          HINT = 'Transactions that started, finished or renewed tickets, or that read the views, held them throughout. Run the update when they have ended, or with a longer lock_timeout.';
            END IF;
            try_ms := LEAST(try_ms OPERATOR(pg_catalog.*) 2, most_ms);
        END;
    END LOOP;
    PERFORM pg_catalog.set_config('lock_timeout', saved, true);
END
$$;
ALTER TABLE quota.history ADD COLUMN weight integer;
ALTER TABLE quota.history ADD CONSTRAINT history_weight_check
    CHECK (weight BETWEEN 1 AND 1000000) NOT VALID;
ALTER TABLE quota.active ADD COLUMN weight integer;
ALTER TABLE quota.active ADD CONSTRAINT active_weight_check
    CHECK (weight BETWEEN 1 AND 1000000) NOT VALID;

CREATE OR REPLACE VIEW quota.ledger AS
SELECT id, role, label, started_at, ended_at, outcome, lease_until, idempotency_key,
       pid, tenant, txid, weight
  FROM quota.active
UNION ALL
SELECT id, role, label, started_at, ended_at, outcome, lease_until, idempotency_key,
       pid, tenant, txid, weight
  FROM quota.history;

CREATE OR REPLACE VIEW quota.usage WITH (security_barrier) AS
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
       l.txid IS NOT NULL AS transactional,
       COALESCE(l.weight, 1) AS weight
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

CREATE FUNCTION quota."start"(
	"weight" INT,
	"lease" interval DEFAULT NULL,
	"label" TEXT DEFAULT NULL,
	"wait" interval DEFAULT '0',
	"tenant" TEXT DEFAULT NULL,
	"transactional" bool DEFAULT false,
	"idempotency_key" TEXT DEFAULT NULL
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'start_v7_wrapper';

CREATE FUNCTION quota."try_start"(
	"weight" INT,
	"lease" interval DEFAULT NULL,
	"label" TEXT DEFAULT NULL,
	"wait" interval DEFAULT '0',
	"tenant" TEXT DEFAULT NULL,
	"transactional" bool DEFAULT false,
	"idempotency_key" TEXT DEFAULT NULL
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'try_start_v7_wrapper';
