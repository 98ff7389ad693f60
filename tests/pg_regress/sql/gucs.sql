-- The limits are superuser settings, range-checked by PostgreSQL.
SELECT name, setting, unit, context, min_val, max_val, boot_val
  FROM pg_settings WHERE name LIKE 'quota.%' ORDER BY name;

SHOW quota.retention;
SET quota.retention = '1h';
SHOW quota.retention;
SET quota.retention = '90min';
SHOW quota.retention;
RESET quota.retention;

-- 0.6.1: the library's version, which nobody can set (55P02).
SELECT current_setting('quota.library_version') = extversion AS library_is_the_extension
  FROM pg_extension WHERE extname = 'pg_quota';
\set VERBOSITY sqlstate
SET quota.library_version = '0.6.0';
\set VERBOSITY default
\echo :LAST_ERROR_SQLSTATE

-- Out of range.
SET quota.max_active_per_role = -1;
\echo :LAST_ERROR_SQLSTATE
SET quota.max_active_per_role = 1000001;
\echo :LAST_ERROR_SQLSTATE
SET quota.max_retained_per_role = 100000001;
\echo :LAST_ERROR_SQLSTATE
-- (Only the SQLSTATE: from PostgreSQL 18 the message shows the range with its unit;
-- pg_settings shows the range itself.)
\set VERBOSITY sqlstate
SET quota.retention = '-1s';
\set VERBOSITY default
\echo :LAST_ERROR_SQLSTATE
SELECT name, min_val, max_val, unit FROM pg_settings WHERE name = 'quota.retention';

-- The quota prefix is reserved: a misspelt setting is refused, not made up.
SET quota.max_actve_per_role = 3;
\echo :LAST_ERROR_SQLSTATE

-- Per-role limits.
ALTER ROLE quota_carol SET quota.max_active_per_role = 7;
SELECT setconfig FROM pg_db_role_setting WHERE setrole = 'quota_carol'::regrole;
ALTER ROLE quota_carol RESET quota.max_active_per_role;
