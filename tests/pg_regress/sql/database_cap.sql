-- quota.max_active_per_database (0.2.0) caps the active tickets of all roles together
-- in a database. The refusal is 53400 naming the database, the count and the GUC
-- (I8). Superusers are never refused (I7), but their tickets count towards the total.
-- When a role is at its own limit too, the role's limit is reported first.
-- The test runs in a database of its own, so that the tickets the other tests left
-- active do not count. The cap is set with ALTER DATABASE ... SET and each tenant
-- logs in (\c - role), so that the setting reaches the tenants' own sessions.
-- How this test fails if the cap breaks:
-- - no cap, or a per-role count: cap_b's third ticket in the database is admitted and
--   "refused" turns f;
-- - superusers' tickets not counted: after cap_a's finish "refused_su_counted" turns f;
-- - capacity not returned by a finish of another role: "admitted_after_finish" turns f;
-- - the database cap checked before the role limit: the message names the database.
SELECT current_database() AS regdb, current_user AS su \gset
CREATE ROLE cap_a LOGIN;
CREATE ROLE cap_b LOGIN;
CREATE DATABASE quota_cap_db;
ALTER DATABASE quota_cap_db SET lc_messages TO 'C';
ALTER DATABASE quota_cap_db SET quota.max_active_per_database = 3;
\c quota_cap_db
CREATE EXTENSION pg_quota;
SHOW quota.max_active_per_database;

-- The cap is a superuser setting.
\c - cap_a
SHOW quota.max_active_per_database;
SET quota.max_active_per_database = 100;
\echo :LAST_ERROR_SQLSTATE

-- all_roles_together: cap_a takes 2, cap_b 1; the database is full for both.
SELECT quota.start('a1') AS a1 \gset
SELECT quota.start('a2') AS a2 \gset
\c - cap_b
SELECT quota.start('b1') AS b1 \gset
\set VERBOSITY default
SELECT quota.start('b2');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.try_start('b2') IS NULL AS refused;
\c - cap_a
\set VERBOSITY terse
SELECT quota.start('a3');
\echo :LAST_ERROR_SQLSTATE
\set VERBOSITY default

-- superuser_exempt_but_counted: a superuser is admitted over the cap, and its ticket
-- counts: after cap_a finishes one, the database is still full.
\c - :su
SELECT quota.start('su') AS s1 \gset
SELECT count(*) AS active_in_database FROM quota.tickets WHERE ended_at IS NULL;
\c - cap_a
SELECT quota.finish(:'a1');
\c - cap_b
SELECT quota.try_start('b2') IS NULL AS refused_su_counted;
DO $$
DECLARE det text;
BEGIN
  PERFORM quota.start('b2');
EXCEPTION WHEN configuration_limit_exceeded THEN
  GET STACKED DIAGNOSTICS det = PG_EXCEPTION_DETAIL;
  RAISE NOTICE '%', det;
END $$;

-- capacity_returns_after_finish: the superuser finishes its ticket; cap_b is admitted.
\c - :su
SELECT quota.finish(:'s1');
\c - cap_b
SELECT quota.start('b2') AS b2 \gset
SELECT quota.try_start('b3') IS NULL AS full_again;

-- role_limit_first: cap_b at its own limit (2) and the database at its cap (3): the
-- refusal names the role's limit.
\c - :su
ALTER ROLE cap_b SET quota.max_active_per_role = 2;
\c - cap_b
SELECT quota.start('b3');
\echo :LAST_ERROR_SQLSTATE
\c - :su
ALTER ROLE cap_b RESET quota.max_active_per_role;

-- expiry_frees_database_capacity: a ticket whose lease ran out stops counting at once
-- towards the cap too.
\c - cap_a
SELECT quota.finish(:'a2');
SELECT quota.start('a short', lease => '1 s') AS a4 \gset
\c - cap_b
SELECT quota.try_start('b3') IS NULL AS full_while_leased;
\c - :su
SELECT pg_sleep_until(lease_until + interval '50 ms') FROM quota.tickets WHERE id = :'a4';
\c - cap_b
SELECT quota.try_start('b3') IS NOT NULL AS admitted_after_expiry;

-- A superuser's SET reaches the session it is made in (and SET ROLE keeps it): with
-- the cap raised to 4 in this session, cap_b gets one more, and then no more.
\c - :su
SET quota.max_active_per_database = 4;
SET ROLE cap_b;
SELECT quota.start('b4') IS NOT NULL AS admitted_with_session_cap;
SELECT quota.start('b5');
\echo :LAST_ERROR_SQLSTATE
RESET ROLE;
SELECT CASE WHEN role = current_user::regrole THEN 'superuser' ELSE role::text END AS role,
       count(*) FILTER (WHERE ended_at IS NULL) AS active, count(*) AS tickets
  FROM quota.tickets GROUP BY 1 ORDER BY 1;

-- The cap is per database: the regression database has none.
\c :regdb
SHOW quota.max_active_per_database;
DROP DATABASE quota_cap_db;
