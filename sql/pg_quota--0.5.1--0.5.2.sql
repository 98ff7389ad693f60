-- pg_quota 0.5.1 -> 0.5.2
--
-- Why this script exists: ALTER EXTENSION pg_quota UPDATE needs a path from every
-- released version to 0.5.2, and this is its last step. It changes nothing. 0.5.2 is a
-- library release that fixes five defects a review of 0.5.1 found (CHANGELOG.md,
-- 0.5.2): the database cap counted a transaction's own transactional tickets twice; the
-- fold of transactional tickets read every unfolded ticket twice a pass, and tickets
-- restored from a cluster further on were never folded (the writer now gives them txid
-- 2 in its own transactions, which is data, not schema); an idempotency key could get
-- two tickets when a role without limits raced a transactional start; names in
-- messages were not in the server encoding; and the guide now says what RESET ALL does
-- to a superuser's session value. None of that has a SQL object: the schema of 0.5.2 is
-- 0.5.1's, object for object, privilege for privilege. The shared memory layout is
-- 0.5.1's too; the new library runs from the next server restart, as any new build of a
-- preloaded library does.
--
-- The result must equal a fresh 0.5.2 install (sql/schema.sql, sql/stats.sql and
-- src/api.rs); scripts/test-upgrade compares the catalogs, pg_init_privs included.

\echo Use "ALTER EXTENSION pg_quota UPDATE TO '0.5.2'" to load this file. \quit
