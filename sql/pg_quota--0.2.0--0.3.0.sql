-- pg_quota 0.2.0 -> 0.3.0
--
-- Why this script exists: 0.3.0 lets a DBA see what admission is doing
-- (USER_GUIDE.md, "Monitoring"). Nothing in the ledger changes; the update only adds:
-- 1. five functions of the library: stats_rows(), stats_info_row(),
--    writer_stats_rows() and wait_histogram_rows() read the counters the library
--    keeps in shared memory (they exist once the server runs the 0.3.0 library,
--    whatever the schema's version), and stats_reset(role) empties them;
-- 2. the views quota.stats, quota.stats_info, quota.writer_stats and
--    quota.wait_histogram on top of them, readable by PUBLIC: the functions decide
--    which rows a caller sees (all of them for superusers and members of
--    pg_read_all_stats, otherwise the caller's own);
-- 3. EXECUTE on stats_reset() revoked from PUBLIC: superusers only, unless granted.
-- 4. quota.usage shows every role's row to members of pg_read_all_stats too (as
--    quota.stats does), so that a monitoring role in pg_monitor reads the usage
--    without being a superuser. Its columns do not change, so it is replaced in place
--    (CREATE OR REPLACE VIEW): its privileges and views of yours on it stay.
-- Nothing else changes: other objects, their privileges and your tickets stay.
-- 0.1.0 and 0.1.1 reach 0.3.0 through 0.2.0.
--
-- The result must equal a fresh 0.3.0 install (sql/schema.sql, sql/stats.sql and
-- src/api.rs); scripts/test-upgrade compares the catalogs.

\echo Use "ALTER EXTENSION pg_quota UPDATE TO '0.3.0'" to load this file. \quit

CREATE FUNCTION quota."stats_rows"(
	OUT "dbid" oid, OUT "roleid" oid,
	OUT "admitted" bigint,
	OUT "refused_active" bigint, OUT "refused_retained" bigint, OUT "refused_database" bigint,
	OUT "finished_succeeded" bigint, OUT "finished_failed" bigint, OUT "finished_cancelled" bigint,
	OUT "expired" bigint, OUT "renewed" bigint, OUT "idempotent_hits" bigint,
	OUT "waits" bigint, OUT "wait_time" double precision, OUT "wait_timeouts" bigint,
	OUT "stats_reset" timestamptz
) RETURNS SETOF record
VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stats_rows_wrapper';

CREATE FUNCTION quota."stats_info_row"(
	OUT "max" integer, OUT "entries" bigint, OUT "evicted" bigint,
	OUT "log_suppressed" bigint, OUT "stats_reset" timestamptz
) RETURNS SETOF record
VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stats_info_row_wrapper';

CREATE FUNCTION quota."writer_stats_rows"(
	OUT "dbid" oid, OUT "pid" integer, OUT "started_at" timestamptz,
	OUT "batches" bigint, OUT "requests" bigint, OUT "mean_batch_size" double precision,
	OUT "commit_time" double precision, OUT "restarts" bigint,
	OUT "last_error" text, OUT "last_error_at" timestamptz
) RETURNS SETOF record
VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'writer_stats_rows_wrapper';

CREATE FUNCTION quota."wait_histogram_rows"(
	OUT "dbid" oid, OUT "roleid" oid, OUT "le" double precision, OUT "waits" bigint
) RETURNS SETOF record
VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'wait_histogram_rows_wrapper';

CREATE FUNCTION quota."stats_reset"(
	"role" regrole DEFAULT NULL
) RETURNS timestamptz
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stats_reset_wrapper';

CREATE VIEW quota.stats AS
SELECT d.datname,
       r.rolname AS role,
       s.admitted,
       s.refused_active,
       s.refused_retained,
       s.refused_database,
       s.finished_succeeded,
       s.finished_failed,
       s.finished_cancelled,
       s.expired,
       s.renewed,
       s.idempotent_hits,
       s.waits,
       s.wait_time,
       s.wait_timeouts,
       s.stats_reset
  FROM quota.stats_rows() s
  LEFT JOIN pg_catalog.pg_database d ON d.oid OPERATOR(pg_catalog.=) s.dbid
  LEFT JOIN pg_catalog.pg_roles r ON r.oid OPERATOR(pg_catalog.=) s.roleid;

CREATE VIEW quota.stats_info AS
SELECT i.max, i.entries, i.evicted, i.log_suppressed, i.stats_reset
  FROM quota.stats_info_row() i;

CREATE VIEW quota.writer_stats AS
SELECT d.datname,
       w.pid,
       w.started_at,
       w.batches,
       w.requests,
       w.mean_batch_size,
       w.commit_time,
       w.restarts,
       w.last_error,
       w.last_error_at
  FROM quota.writer_stats_rows() w
  LEFT JOIN pg_catalog.pg_database d ON d.oid OPERATOR(pg_catalog.=) w.dbid;

CREATE VIEW quota.wait_histogram AS
SELECT d.datname,
       r.rolname AS role,
       h.le,
       h.waits
  FROM quota.wait_histogram_rows() h
  LEFT JOIN pg_catalog.pg_database d ON d.oid OPERATOR(pg_catalog.=) h.dbid
  LEFT JOIN pg_catalog.pg_roles r ON r.oid OPERATOR(pg_catalog.=) h.roleid;

GRANT SELECT ON quota.stats, quota.stats_info, quota.writer_stats, quota.wait_histogram
    TO PUBLIC;
REVOKE EXECUTE ON FUNCTION quota.stats_reset(pg_catalog.regrole) FROM PUBLIC;

CREATE OR REPLACE VIEW quota.usage WITH (security_barrier) AS
WITH params AS (
    SELECT pg_catalog.current_setting('quota.retention')::pg_catalog.interval AS retention,
           pg_catalog.now() AS now
), tickets AS (
    SELECT l.role,
           CASE WHEN l.ended_at IS NULL AND l.lease_until OPERATOR(pg_catalog.<=) p.now
                THEN l.lease_until ELSE l.ended_at END AS ended_at,
           p.retention,
           p.now
      FROM quota.ledger l, params p
     WHERE l.role::pg_catalog.oid OPERATOR(pg_catalog.=)
             (SELECT r.oid FROM pg_catalog.pg_roles r
               WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER)
        OR (SELECT r.rolsuper FROM pg_catalog.pg_roles r
             WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER)
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
