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
--    table's TRIGGER privilege besides.
--
-- Refusals from shared memory (0.6.0) need no SQL object; the shared memory layout of
-- the scope counters changed (80 bytes a counter), which the server restart that loads
-- a new build of a preloaded library sets up.
--
-- The result must equal a fresh 0.6.0 install (sql/schema.sql, sql/stats.sql and
-- src/api.rs); scripts/test-upgrade compares the catalogs, pg_init_privs included.

\echo Use "ALTER EXTENSION pg_quota UPDATE TO '0.6.0'" to load this file. \quit

CREATE FUNCTION quota."finish_job"() RETURNS trigger
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'finish_job_wrapper';
