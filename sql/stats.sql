-- pg_quota 0.3.0: the statistics views (see src/stats.rs and USER_GUIDE.md,
-- "Monitoring"). The functions behind them return oids (roleid NULL for a database's
-- row of roles no longer listed); the views name databases and roles. stats_rows() shows a caller every row only if it
-- is a superuser or a member of pg_read_all_stats, and otherwise its own rows;
-- writer_stats_rows() shows others no rows. wait_histogram_rows() follows stats_rows(). Also in sql/pg_quota--0.2.0--0.3.0.sql.

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

-- 0.5.1: quota.usage_totals() (src/api.rs) reports every role's tickets together, so
-- it is for those who see every role's statistics. Also in sql/pg_quota--0.5.0--0.5.1.sql.
REVOKE EXECUTE ON FUNCTION quota.usage_totals() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION quota.usage_totals() TO pg_read_all_stats;
