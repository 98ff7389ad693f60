-- I2 with the scope counters (src/scopes.rs): a finish frees its slot only if it
-- commits, and only once. Admission reads the role's counter, so a finish rolled back
-- with its savepoint (or its caught error) must not lower it, and a finish in a
-- released savepoint must, when the top transaction commits.
CREATE ROLE quota_subx;
SET quota.max_active_per_role = 1;
SET ROLE quota_subx;
SELECT quota.start('held') AS t \gset
SELECT set_config('test.t', :'t', false) IS NOT NULL AS noted;

-- finish in a savepoint that is rolled back: the slot stays taken
BEGIN;
SAVEPOINT a;
SELECT quota.finish(:'t');
ROLLBACK TO a;
COMMIT;
SELECT quota.try_start('after rolled-back savepoint') IS NULL AS still_refused;

-- nested: released inner savepoint, rolled-back outer one
BEGIN;
SAVEPOINT a;
SAVEPOINT b;
SELECT quota.finish(:'t');
RELEASE b;
ROLLBACK TO a;
COMMIT;
SELECT quota.try_start('after rolled-back outer savepoint') IS NULL AS still_refused;

-- a finish whose error is caught in PL/pgSQL is rolled back with its block
DO $$
BEGIN
  PERFORM quota.finish(current_setting('test.t')::uuid);
  RAISE EXCEPTION 'undo';
EXCEPTION WHEN raise_exception THEN
  NULL;
END $$;
SELECT quota.try_start('after caught error') IS NULL AS still_refused;

-- a released savepoint commits with its top transaction: the slot frees once
BEGIN;
SAVEPOINT a;
SELECT quota.finish(:'t');
RELEASE a;
SELECT quota.try_start('inside, before commit') IS NULL AS refused_before_commit;
COMMIT;
SELECT quota.try_start('after commit') IS NOT NULL AS admitted_after_commit;
SELECT quota.try_start('one slot only') IS NULL AS refused_again;

-- finishing the same ticket again frees nothing
SELECT quota.finish(:'t') AS finished_again;
SELECT quota.try_start('still one slot') IS NULL AS still_refused;

-- a rolled-back top transaction frees nothing
RESET ROLE;
SELECT id AS t2 FROM quota.ledger
 WHERE role = 'quota_subx'::regrole AND ended_at IS NULL \gset
SET ROLE quota_subx;
BEGIN;
SELECT quota.finish(:'t2');
ROLLBACK;
SELECT quota.try_start('after rollback') IS NULL AS still_refused;
RESET ROLE;

-- A counter rebuilt inside a transaction that already finished a ticket counts that
-- ticket as still active (as every other session sees it), so that the finish, applied
-- when the transaction commits, is counted once. VACUUM FULL quota.summary gives the
-- summary a new relfilenode, which makes the next reader rebuild the counter.
SELECT id AS t3 FROM quota.ledger
 WHERE role = 'quota_subx'::regrole AND ended_at IS NULL \gset
VACUUM FULL quota.summary;
BEGIN;
SET LOCAL ROLE quota_subx;
SELECT quota.finish(:'t3');
SELECT quota.try_start('rebuilt inside') IS NULL AS refused_before_commit;
COMMIT;
SET ROLE quota_subx;
SELECT count(*) AS admitted_after_commit FROM generate_series(1, 3) i
 WHERE quota.try_start('after rebuild ' || i) IS NOT NULL;
RESET ROLE;
