-- start() writes a charge, so like nextval() it refuses in a read-only transaction
-- with 25006; so does finish(). quota.usage still reads.
SET ROLE quota_alice;
BEGIN READ ONLY;
SELECT quota.start();
\echo :LAST_ERROR_SQLSTATE
ROLLBACK;
BEGIN READ ONLY;
SELECT quota.try_start();
\echo :LAST_ERROR_SQLSTATE
ROLLBACK;
BEGIN READ ONLY;
SELECT quota.finish('00000000-0000-0000-0000-000000000000');
\echo :LAST_ERROR_SQLSTATE
ROLLBACK;
BEGIN READ ONLY;
SELECT role, active FROM quota.usage;
COMMIT;
