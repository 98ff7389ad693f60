-- I2: a charge survives the rollback of the transaction or savepoint that made it,
-- because the ledger writer committed it before start() returned.
SET quota.max_active_per_role = 2;
SET ROLE quota_carol;

-- rollback_cannot_erase_charge
BEGIN;
SELECT quota.start('rolled back 1') IS NOT NULL AS admitted;
ROLLBACK;
BEGIN;
SELECT quota.start('rolled back 2') IS NOT NULL AS admitted;
ROLLBACK;
SELECT quota.try_start('after two rollbacks') IS NULL AS refused;

-- savepoint_rollback_cannot_erase_charge
RESET ROLE;
SET quota.max_active_per_role = 3;
SET ROLE quota_carol;
BEGIN;
SAVEPOINT s;
SELECT quota.start('savepoint') IS NOT NULL AS admitted;
ROLLBACK TO SAVEPOINT s;
COMMIT;
SELECT quota.try_start('after savepoint rollback') IS NULL AS refused;

-- exception_block_cannot_erase_charge
RESET ROLE;
SET quota.max_active_per_role = 4;
SET ROLE quota_carol;
DO $$
BEGIN
  PERFORM quota.start('swallowed');
  RAISE EXCEPTION 'the work failed';
EXCEPTION WHEN others THEN
  RAISE NOTICE 'caught: %', SQLERRM;
END $$;
SELECT quota.try_start('after exception block') IS NULL AS refused;

-- A refusal caught by an exception block leaves no scope lock behind.
DO $$
BEGIN
  PERFORM quota.start('over the limit');
EXCEPTION WHEN configuration_limit_exceeded THEN
  RAISE NOTICE 'refused: %', SQLSTATE;
END $$;
SELECT count(*) AS scope_locks_held FROM pg_locks
 WHERE locktype = 'advisory' AND pid = pg_backend_pid();

-- rolled_back_finish_leaves_ticket_active
RESET ROLE;
SET quota.max_active_per_role = 5;
SET ROLE quota_carol;
SELECT quota.start('to finish') AS t \gset
SELECT quota.try_start() IS NULL AS at_limit;
BEGIN;
SELECT quota.finish(:'t');
ROLLBACK;
SELECT quota.try_start() IS NULL AS still_at_limit;
BEGIN;
SELECT quota.finish(:'t');
COMMIT;
SELECT quota.try_start() IS NOT NULL AS admitted_after_commit;

RESET ROLE;
SELECT label, ended_at IS NOT NULL AS ended FROM quota.ledger
 WHERE role = 'quota_carol'::regrole ORDER BY started_at;
