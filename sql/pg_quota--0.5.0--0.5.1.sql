-- pg_quota 0.5.0 -> 0.5.1
--
-- Why this script exists: monitoring must stay cheap at 100,000 tenants and millions of
-- retained tickets. The usage gauges of contrib/prometheus/queries.yaml summed
-- quota.usage, which reads every retained ticket of the ledger: with two million, each
-- scrape read two million rows. 0.5.1 adds quota.usage_totals(), which answers the same
-- totals from the summary (one row per role), one index probe per role, the active
-- tickets and the smaller side of the caller's retention cutoff, usually the few
-- tickets past it not purged yet (USER_GUIDE.md, "Monitoring at scale").
-- What it changes:
-- 1. The function quota.usage_totals(OUT active bigint, OUT retained bigint,
--    OUT ledger_rows bigint), on the library's symbol usage_totals_wrapper.
-- 2. EXECUTE on it is revoked from PUBLIC and granted to pg_read_all_stats (so to
--    pg_monitor): it reports every role's tickets together, which only those who see
--    every role's statistics may see; quota.usage stays everyone's, showing each role
--    the rows it may see.
-- It is PARALLEL UNSAFE: it reads the latest committed state, which a parallel worker
-- cannot take (it refuses there with 25000).
-- Nothing else changes: other objects, their privileges and your tickets stay. The
-- shared memory layout is 0.5.0's.
--
-- The result must equal a fresh 0.5.1 install (sql/schema.sql, sql/stats.sql and
-- src/api.rs); scripts/test-upgrade compares the catalogs, pg_init_privs included.

\echo Use "ALTER EXTENSION pg_quota UPDATE TO '0.5.1'" to load this file. \quit

-- 1.
CREATE FUNCTION quota.usage_totals(
	OUT "active" bigint, OUT "retained" bigint, OUT "ledger_rows" bigint
) RETURNS SETOF record
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'usage_totals_wrapper';

-- 2.
REVOKE EXECUTE ON FUNCTION quota.usage_totals() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION quota.usage_totals() TO pg_read_all_stats;
