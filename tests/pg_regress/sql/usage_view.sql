-- quota.usage: one row per role with retained tickets. Superusers see every row;
-- other roles see their own.
SELECT attname, atttypid::regtype FROM pg_attribute
 WHERE attrelid = 'quota.usage'::regclass AND attnum > 0 ORDER BY attnum;

SELECT role, active, retained, next_ageout IS NOT NULL AS has_ageout
  FROM quota.usage WHERE role::text LIKE 'quota\_%' ORDER BY role::text;

SET ROLE quota_dave;
SELECT role, active, retained FROM quota.usage;
RESET ROLE;

-- "retained" follows the reading session's quota.retention.
SET quota.retention = 0;
SELECT role, active, retained FROM quota.usage WHERE role = 'quota_alice'::regrole;
