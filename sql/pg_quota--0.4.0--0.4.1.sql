-- pg_quota 0.4.0 -> 0.4.1
--
-- Why this script exists: ALTER EXTENSION pg_quota UPDATE needs a path from every
-- released version to 0.4.1, and this is its last step. It changes nothing. 0.4.1 is a
-- library release that fixes five defects of 0.4.0 (CHANGELOG.md, 0.4.1): a lease now
-- runs from the moment its ticket starts, however long start() waited first; scope
-- counters of other databases keep their places while in use; start() no longer waits
-- under its role's scope lock for an abandoned answer or a writer slot; DROP DATABASE
-- waits for every writer process that left the database, terminated ones included; and
-- a removed scope counter is marked apart from its key, so that a database whose OID is
-- 4294967295 is counted right. None of that has a SQL object: the schema of 0.4.1 is
-- 0.4.0's, object for object, privilege for privilege. The shared memory layout
-- changed, so the new library runs from the next server restart.
--
-- The result must equal a fresh 0.4.1 install (sql/schema.sql, sql/stats.sql and
-- src/api.rs); scripts/test-upgrade compares the catalogs, pg_init_privs included.

\echo Use "ALTER EXTENSION pg_quota UPDATE TO '0.4.1'" to load this file. \quit
