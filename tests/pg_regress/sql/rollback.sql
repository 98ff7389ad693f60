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

-- scope_lock_released_before_start_returns
-- The scope lock makes count-and-hand-over atomic and nothing more: start() releases
-- it before it returns, not at the end of the caller's transaction, and a
-- subtransaction abort cannot release it for us (it belongs to the top transaction's
-- resource owner). So pg_locks is read inside the transaction that called start(),
-- after starts that took the lock: the role is below its limit, so admission goes
-- through the scope lock. objsubid is the lock tag's field4, 20819 = 0x5153.
-- A role of its own (not quota_*), so that the other tests' counts do not change.
RESET ROLE;
CREATE ROLE rb_scope_lock;
SET quota.max_active_per_role = 3;
SET ROLE rb_scope_lock;
BEGIN;
SELECT quota.start('lock released on return') IS NOT NULL AS admitted;
SELECT count(*) AS scope_locks_held FROM pg_locks
 WHERE locktype = 'advisory' AND objsubid = 20819 AND pid = pg_backend_pid();
-- The same, from a PL/pgSQL block whose subtransaction then aborts.
DO $$
BEGIN
  PERFORM quota.start('lock released in a subtransaction');
  RAISE EXCEPTION 'the work failed';
EXCEPTION WHEN raise_exception THEN
  RAISE NOTICE 'caught: %', SQLERRM;
END $$;
SELECT count(*) AS scope_locks_held FROM pg_locks
 WHERE locktype = 'advisory' AND objsubid = 20819 AND pid = pg_backend_pid();
ROLLBACK;

-- error_under_scope_lock_releases_it
-- An ERROR raised while start() holds the scope lock, caught by an exception block,
-- must not leave the lock held until the top transaction ends (ScopeLock's Drop
-- releases it on the unwind). To raise one under the lock: a peer connection's start
-- is held in the writer's hands (the writer waits for our EXCLUSIVE lock on the
-- ledger), so our start, one below the limit on committed tickets, passes the
-- lock-free check, takes the scope lock, finds the limit reached with the peer's
-- request in flight, and waits under the lock until statement_timeout cancels it.
RESET ROLE;
CREATE EXTENSION IF NOT EXISTS dblink;
SELECT dblink_connect('peer', format('dbname=%s port=%s host=%s', current_database(),
       current_setting('port'), current_setting('unix_socket_directories'))) AS peer;
SELECT dblink_exec('peer', 'SET quota.max_active_per_role = 3');
SELECT dblink_exec('peer', 'SET ROLE rb_scope_lock');
SELECT active FROM quota.usage WHERE role = 'rb_scope_lock'::regrole;
BEGIN;
LOCK TABLE quota.active IN EXCLUSIVE MODE;
SELECT dblink_send_query('peer', 'SELECT quota.start(''in flight'') IS NOT NULL') AS sent;
-- Wait until the writer has claimed the peer's request and waits for our lock.
DO $$
BEGIN
  FOR i IN 1..400 LOOP
    EXIT WHEN EXISTS (SELECT FROM pg_locks
                       WHERE relation = 'quota.active'::regclass AND NOT granted);
    PERFORM pg_sleep(0.01);
  END LOOP;
END $$;
SELECT count(*) AS writer_waits_for_ledger FROM pg_locks
 WHERE relation = 'quota.active'::regclass AND NOT granted;
SET ROLE rb_scope_lock;
SET LOCAL statement_timeout = '300ms';
DO $$
BEGIN
  PERFORM quota.start('waits under the scope lock');
EXCEPTION WHEN query_canceled THEN
  RAISE NOTICE 'cancelled while waiting under the scope lock: %', SQLSTATE;
END $$;
SELECT count(*) AS scope_locks_held FROM pg_locks
 WHERE locktype = 'advisory' AND objsubid = 20819 AND pid = pg_backend_pid();
ROLLBACK;
RESET ROLE;
SELECT admitted AS peer_admitted FROM dblink_get_result('peer') AS r(admitted boolean);
SELECT dblink_disconnect('peer');
DROP EXTENSION dblink;
SELECT label FROM quota.ledger WHERE role = 'rb_scope_lock'::regrole ORDER BY started_at;

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
