-- quota.stats (0.3.0): exact counts. One tenant, st_a, runs a scripted workload with a
-- known number of each event, in a database of its own (so that no ticket of another
-- test, and no other writer's work, counts), and every counter of its row is checked
-- against the number the workload implies:
--   admitted 10, refused_active 4, refused_retained 2, refused_database 3,
--   finished_succeeded 3, finished_failed 1, finished_cancelled 2, expired 4,
--   renewed 2, idempotent_hits 3, waits 4, wait_timeouts 3,
--   wait_time: at least the three 200 ms timeouts plus the admitted wait, at most the
--   time the four waiting calls took.
-- The superuser's row: admitted 1, finished_succeeded 1, nothing else (its finish of
-- st_a's ticket counts for st_a).
-- How this test fails:
-- - a counter bumped at the call instead of at commit, or kept after a rollback: the
--   rolled-back finishes and renewals add to finished_failed (2 or 3 instead of 1) and
--   renewed (3 or 4 instead of 2), and "before_commit" turns 1;
-- - a finish() that returned false counted: finished_succeeded 4 (a1 twice), or the
--   expired e1 counted as succeeded;
-- - a finish counted for the finishing role instead of the ticket's: the superuser's
--   finished_cancelled turns 1 and st_a's 1;
-- - refusals filed under the wrong limit: refused_active/retained/database not 4/2/3;
-- - idempotent hits counted as admissions: admitted 13 instead of 10;
-- - a wait timeout not counted as a refusal, or an admitted wait counted as a
--   timeout: refused_database 2, wait_timeouts 4;
-- - wait_time in microseconds or seconds, or not summed: the bounds turn f;
-- - expiries not counted by the sweep: the poll ends at 10 s and expired is below 4.
SELECT current_database() AS regdb, current_user AS su \gset
CREATE ROLE st_a;
CREATE DATABASE quota_stats_db;
ALTER DATABASE quota_stats_db SET lc_messages TO 'C';
\c quota_stats_db
CREATE EXTENSION pg_quota;

-- The interface, in the spec's column order.
SELECT attrelid::regclass AS view, attname, atttypid::regtype
  FROM pg_attribute
 WHERE attrelid IN ('quota.stats'::regclass, 'quota.stats_info'::regclass,
                    'quota.writer_stats'::regclass)
   AND attnum > 0
 ORDER BY attrelid::regclass::text, attnum;
SELECT p.oid::regprocedure AS function, p.prorettype::regtype AS returns
  FROM pg_proc p WHERE p.pronamespace = 'quota'::regnamespace AND p.proname = 'stats_reset';

-- Start from nothing: earlier tests' counts are gone.
SELECT quota.stats_reset() AS reset_at \gset
SELECT count(*) AS rows_after_reset FROM quota.stats;

-- pg_temp.run() runs a statement in the backend and reports its result (or SQLSTATE
-- and message), when it began and how long it took, in milliseconds.
CREATE FUNCTION pg_temp.run(q text, OUT result text, OUT t0 timestamptz, OUT took_ms float8)
LANGUAGE plpgsql AS $$
DECLARE st text; msg text;
BEGIN
  t0 := clock_timestamp();
  BEGIN
    EXECUTE q INTO result;
  EXCEPTION WHEN others THEN
    GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
    result := st || ' ' || msg;
  END;
  took_ms := extract(epoch FROM clock_timestamp() - t0) * 1000;
END $$;
-- st_a's row in this database, as the superuser sees it.
CREATE FUNCTION pg_temp.c(counter text) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE n bigint;
BEGIN
  EXECUTE format('SELECT %I FROM quota.stats WHERE datname = current_database() AND role = %L',
                 counter, 'st_a') INTO n;
  RETURN n;
END $$;

\set VERBOSITY terse
SET quota.max_active_per_role = 3;

-- 1. Three admissions; at the limit of 3, a start and a try_start are refused
--    (refused_active 2); a repeated key returns the same ticket, even at the limit
--    (idempotent_hits 2, nothing admitted).
SET ROLE st_a;
SELECT quota.start('a1') AS a1 \gset
SELECT quota.try_start('a2') AS a2 \gset
SELECT quota.start('a3', idempotency_key => 'k1') AS a3 \gset
SELECT quota.start('over');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.try_start('over') IS NULL AS refused;
SELECT quota.start('again', idempotency_key => 'k1') = :'a3' AS same_ticket;
SELECT quota.try_start('again', idempotency_key => 'k1') = :'a3' AS same_ticket;

-- 2. Finishes. a1 succeeds (1); finishing it again returns false (not counted).
SELECT quota.finish(:'a1') AS finished;
SELECT quota.finish(:'a1') AS finished_again;
-- a2's finish rolled back with its transaction, then in a savepoint: not counted.
BEGIN;
SELECT quota.finish(:'a2', 'failed') AS finished_in_rolled_back_transaction;
ROLLBACK;
BEGIN;
SAVEPOINT s;
SELECT quota.finish(:'a2', 'failed') AS finished_in_rolled_back_savepoint;
ROLLBACK TO SAVEPOINT s;
COMMIT;
-- ... then in a released savepoint: counted, but only when the transaction commits.
BEGIN;
SAVEPOINT s;
SELECT quota.finish(:'a2', 'failed') AS finished;
RELEASE SAVEPOINT s;
SELECT pg_temp.c('finished_failed') AS before_commit;
COMMIT;
SELECT pg_temp.c('finished_failed') AS after_commit;

-- 3. Renewals: one in autocommit (1); one rolled back with its transaction (0); in one
--    transaction, one rolled back to a savepoint and one kept (1). renewed = 2.
SELECT quota.renew(:'a3', '1 hour') IS NOT NULL AS renewed;
BEGIN;
SELECT quota.renew(:'a3', '2 hours') IS NOT NULL AS renewed_in_rolled_back_transaction;
ROLLBACK;
BEGIN;
SAVEPOINT s;
SELECT quota.renew(:'a3', '2 hours') IS NOT NULL AS renewed_in_rolled_back_savepoint;
ROLLBACK TO SAVEPOINT s;
SELECT quota.renew(:'a3', '3 hours') IS NOT NULL AS renewed;
SELECT pg_temp.c('renewed') AS before_commit;
COMMIT;
SELECT pg_temp.c('renewed') AS after_commit;

-- 4. The superuser finishes st_a's a3, cancelled: it counts for st_a, the ticket's
--    role, not for the superuser.
RESET ROLE;
SELECT quota.finish(:'a3', 'cancelled') AS finished_by_superuser;

-- 5. The retained limit: st_a has 3 ended tickets, retained for an hour; a4 makes 4
--    of 4. A start and a try_start are refused (refused_retained 2); the key k1 still
--    names a3, which is retained: an idempotent hit (3), not refused.
SET quota.retention = '1h';
SET quota.max_retained_per_role = 4;
SET ROLE st_a;
SELECT quota.start('a4') AS a4 \gset
SELECT active, retained FROM quota.usage;
SELECT quota.start('retained');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.try_start('retained') IS NULL AS refused;
SELECT quota.start('third', idempotency_key => 'k1') = :'a3' AS same_ticket;
RESET ROLE;
RESET quota.max_retained_per_role;

-- 6. The database cap: the superuser's ticket s1 and st_a's a4 fill a cap of 2
--    (superusers are counted, never refused). st_a is refused three times
--    (refused_database 3), the third after waiting 200 ms (waits 1, wait_timeouts 1).
SELECT quota.start('s1') AS s1 \gset
SET quota.max_active_per_database = 2;
SET ROLE st_a;
SELECT quota.start('database');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.try_start('database') IS NULL AS refused;
SELECT result IS NULL AS refused, took_ms AS took_db_timeout
  FROM pg_temp.run($$SELECT quota.try_start('database', wait => '200 ms')$$) \gset
\echo refused after the wait: :refused
RESET ROLE;
RESET quota.max_active_per_database;
SELECT quota.finish(:'s1') AS superuser_finished;
SET ROLE st_a;
SELECT quota.finish(:'a4') AS finished;

-- 7. Expiries: three tickets with 500 ms leases run out (expired 3, once the writer
--    has swept them). A finish() of an expired ticket returns false and a renew()
--    raises 55000: neither is counted.
SELECT quota.start('e1', lease => '500 ms') AS e1 \gset
SELECT quota.start('e2', lease => '500 ms') AS e2 \gset
SELECT quota.start('e3', lease => '500 ms') AS e3 \gset
SELECT pg_sleep_until(max(lease_until) + interval '50 ms') FROM quota.tickets
 WHERE id IN (:'e1', :'e2', :'e3');
SELECT quota.finish(:'e1') AS finished_expired;
\set VERBOSITY sqlstate
SELECT quota.renew(:'e2', '1 hour');
\set VERBOSITY terse

-- 8. Waits at the active limit of 1. h1 holds the slot: a start and a try_start wait
--    200 ms each and are refused (refused_active 4, waits 3, wait_timeouts 3). h1 is
--    finished, cancelled; h2 holds the slot with a 2 s lease, and a start that waits
--    up to 10 s is admitted when that lease runs out (admitted, waits 4; h2 expires:
--    expired 4). The waiter w succeeds.
RESET ROLE;
SET quota.max_active_per_role = 1;
SET ROLE st_a;
SELECT quota.start('h1') AS h1 \gset
SELECT result, took_ms AS took_start_timeout
  FROM pg_temp.run($$SELECT quota.start('timeout', wait => '200 ms')$$) \gset
\echo :result
SELECT result IS NULL AS refused, took_ms AS took_try_start_timeout
  FROM pg_temp.run($$SELECT quota.try_start('timeout', wait => '200 ms')$$) \gset
\echo refused after the wait: :refused
SELECT quota.finish(:'h1', 'cancelled') AS finished;
SELECT quota.start('h2', lease => '2 s') AS h2 \gset
SELECT lease_until AS h2_until FROM quota.tickets WHERE id = :'h2' \gset
SELECT result AS w, took_ms AS took_admitted_wait,
       extract(epoch FROM :'h2_until'::timestamptz - t0) * 1000 AS h2_remaining
  FROM pg_temp.run($$SELECT quota.start('waiter', wait => '10 s')$$) \gset
SELECT :'w' ~ '^[0-9a-f-]{36}$' AS admitted_after_waiting,
       :took_admitted_wait >= :h2_remaining AS waited_for_the_lease;
SELECT quota.finish(:'w') AS finished;
RESET ROLE;
RESET quota.max_active_per_role;

-- The writer sweeps the four expired tickets down; poll for it (up to 10 s).
DO $$
BEGIN
  FOR i IN 1..100 LOOP
    EXIT WHEN pg_temp.c('expired') >= 4;
    PERFORM pg_sleep(0.1);
  END LOOP;
END $$;

-- The waits by duration (quota.wait_histogram, cumulative): the three 200 ms
-- timeouts within 1 s, the admitted wait (about 2 s) within 10 s. Fails if a wait is
-- put in the wrong bucket (a unit mistake moves all four), or the buckets are not
-- cumulative.
SELECT le, waits FROM quota.wait_histogram
 WHERE datname = current_database() AND role = 'st_a' ORDER BY le;

-- Every counter of st_a's row, and the superuser's row.
\x on
SELECT datname = current_database() AS this_database, role,
       admitted, refused_active, refused_retained, refused_database,
       finished_succeeded, finished_failed, finished_cancelled, expired,
       renewed, idempotent_hits, waits, wait_timeouts,
       wait_time >= 3 * 200 + :h2_remaining - 30 AS wait_time_at_least_the_waits,
       wait_time <= :took_db_timeout + :took_start_timeout + :took_try_start_timeout
                    + :took_admitted_wait AS wait_time_at_most_the_calls,
       wait_time < 60000 AS wait_time_under_a_minute,
       stats_reset >= :'reset_at'::timestamptz AND stats_reset <= now() AS stats_reset_since_reset
  FROM quota.stats WHERE role = 'st_a';
SELECT CASE WHEN role = current_user THEN 'superuser' ELSE role::text END AS role,
       admitted, refused_active, refused_retained, refused_database,
       finished_succeeded, finished_failed, finished_cancelled, expired,
       renewed, idempotent_hits, waits, wait_time, wait_timeouts
  FROM quota.stats WHERE datname = current_database() AND role = current_user;
\x off
-- Nothing else in this database.
SELECT count(*) AS rows_in_this_database FROM quota.stats WHERE datname = current_database();

-- The ticket counts agree: 10 tickets of st_a, outcomes as counted.
SELECT outcome, count(*) FROM quota.tickets WHERE role = 'st_a'::regrole
 GROUP BY outcome ORDER BY outcome;
-- st_a sees its own row too.
SET ROLE st_a;
SELECT role, admitted, expired FROM quota.stats;
RESET ROLE;

-- quota.writer_stats: this database's writer ran; it answered at least the 11
-- admissions (every ticket is inserted by it) and at most the 23 start()/try_start()
-- calls made here; the mean batch size is requests/batches; pid is the running
-- writer's (its idle timeout is 10 s, and it has just swept).
SELECT count(*) AS writer_rows,
       bool_and(batches >= 1) AS batches,
       bool_and(requests >= (SELECT sum(admitted) FROM quota.stats
                              WHERE datname = current_database())) AS requests_at_least_admitted,
       bool_and(requests <= 23) AS requests_at_most_calls,
       bool_and(abs(mean_batch_size - requests::float8 / batches) < 1e-9) AS mean_batch_size,
       bool_and(pid = (SELECT pid FROM pg_stat_activity
                        WHERE backend_type = 'pg_quota ledger writer'
                          AND datname = current_database())) AS pid_is_writer,
       bool_and(started_at >= :'reset_at'::timestamptz AND started_at <= now()) AS started_at,
       bool_and(commit_time > 0) AS commit_time,
       bool_and(restarts = 0) AS no_restarts,
       bool_and(last_error IS NULL AND last_error_at IS NULL) AS no_error
  FROM quota.writer_stats WHERE datname = current_database();

-- Rows are for every database: the regression database sees st_a's row here.
\c :regdb
SELECT datname, role, admitted FROM quota.stats WHERE role = 'st_a';
DROP DATABASE quota_stats_db;
DROP ROLE st_a;
-- The views stay readable with the database and the role gone.
SELECT count(*) >= 0 AS stats_readable FROM quota.stats;
SELECT count(*) >= 0 AS writer_stats_readable FROM quota.writer_stats;
