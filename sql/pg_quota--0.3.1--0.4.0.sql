-- pg_quota 0.3.1 -> 0.4.0
--
-- Why this script exists: ALTER EXTENSION pg_quota UPDATE needs a path from every
-- released version to 0.4.0, and this is its last step. It changes nothing. 0.4.0 is
-- a new shared library (USER_GUIDE.md, "Upgrading to 0.4.0"): ledger writers share the
-- worker slots, the scope counters are sized by quota.scope_counters and give idle
-- scopes' places up, and the writer reads the roles' retention settings through the
-- catalog's index. None of that has a SQL object: the schema of 0.4.0 is 0.3.1's,
-- object for object, privilege for privilege.
--
-- The result must equal a fresh 0.4.0 install (sql/schema.sql, sql/stats.sql and
-- src/api.rs); scripts/test-upgrade compares the catalogs, pg_init_privs included.

\echo Use "ALTER EXTENSION pg_quota UPDATE TO '0.4.0'" to load this file. \quit
