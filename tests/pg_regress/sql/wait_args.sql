-- Bounded waits (0.2.0): start(..., wait => w) waits up to w for capacity, then
-- refuses with the usual 53400 (try_start: NULL). The wait is checked (negative 22023,
-- NULL 22004), can be interrupted (statement_timeout: 57014) and leaves no charge and
-- no place in line behind. The 0.1.x calls still resolve to the new functions.
-- How this test fails: a wait that does not wait ("waited" f) or waits for nothing
-- ("fast" f); a wait that misses an expiring lease ("admitted_when_lease_expired" f);
-- a cancelled wait that leaves a charge (ticket counts change) or a ghost in line
-- ("admitted_after_cancelled_wait" f); an ambiguous 0.1.x call (42725).
-- pg_temp.run() runs a statement in the backend and reports its result (or SQLSTATE
-- and message) and how long it took, without the client's round trip.
CREATE FUNCTION pg_temp.run(q text, OUT result text, OUT took interval) LANGUAGE plpgsql AS $$
DECLARE t0 timestamptz := clock_timestamp(); st text; msg text;
BEGIN
  EXECUTE q INTO result;
  took := clock_timestamp() - t0;
EXCEPTION WHEN others THEN
  GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
  result := st || ' ' || msg;
  took := clock_timestamp() - t0;
END $$;
CREATE ROLE wait_a;

-- wait_arguments: checked before anything else, by start and try_start alike.
SET quota.max_active_per_role = 1;
SET ROLE wait_a;
SELECT result FROM pg_temp.run($$SELECT quota.start('w', wait => '-1 s')$$);
SELECT result FROM pg_temp.run($$SELECT quota.start('w', wait => NULL)$$);
SELECT result FROM pg_temp.run($$SELECT quota.try_start('w', wait => '-1 s')$$);
SELECT result FROM pg_temp.run($$SELECT quota.try_start('w', wait => NULL)$$);
SELECT count(*) AS tickets FROM quota.tickets;

-- wait_zero_is_immediate: at the limit, wait => '0' (the default) refuses at once.
SELECT quota.start('held') AS held \gset
SELECT result, took < interval '150 ms' AS fast
  FROM pg_temp.run($$SELECT quota.start('w0', wait => '0')$$);
SELECT result, took < interval '150 ms' AS fast
  FROM pg_temp.run($$SELECT quota.start('w0')$$);

-- short_wait_times_out: 200 ms at the limit, nothing frees: 53400 after the wait;
-- try_start returns NULL after the wait.
SELECT result, took >= interval '200 ms' AS waited, took < interval '2 s' AS bounded
  FROM pg_temp.run($$SELECT quota.start('w200', wait => '200 ms')$$);
SELECT result IS NULL AS try_start_null, took >= interval '200 ms' AS waited,
       took < interval '2 s' AS bounded
  FROM pg_temp.run($$SELECT quota.try_start('w200', wait => '200 ms')$$);
SELECT count(*) AS tickets, count(*) FILTER (WHERE ended_at IS NULL) AS active
  FROM quota.tickets;

-- statement_timeout_interrupts: a wait longer than statement_timeout is cancelled
-- with 57014, and leaves no charge and no waiter behind.
SELECT active, retained FROM quota.usage;
SET statement_timeout = '300ms';
\set VERBOSITY terse
SELECT quota.start('cancelled', wait => '5 s');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.try_start('cancelled', wait => '5 s');
\echo :LAST_ERROR_SQLSTATE
\set VERBOSITY default
RESET statement_timeout;
SELECT active, retained FROM quota.usage;
SELECT count(*) AS cancelled_tickets FROM quota.tickets WHERE label = 'cancelled';
SELECT quota.finish(:'held');
SELECT quota.try_start('after cancelled wait') IS NOT NULL AS admitted_after_cancelled_wait;

-- wait_for_lease: a wait ends when the lease in its way runs out.
SELECT quota.finish(id) FROM quota.tickets WHERE label = 'after cancelled wait';
SELECT quota.start('short lease', lease => '600 ms') IS NOT NULL AS started;
SELECT result IS NOT NULL AND result NOT LIKE '5%' AS admitted_when_lease_expired,
       took >= interval '150 ms' AS waited, took < interval '2500 ms' AS before_the_wait_ended
  FROM pg_temp.run($$SELECT quota.start('waiter', wait => '3 s')::text$$);
RESET ROLE;
RESET quota.max_active_per_role;

-- old_calls_resolve: the 0.1.x calls still mean what they meant; no "function is
-- not unique" (42725).
SELECT count(*) AS start_functions FROM pg_proc
 WHERE pronamespace = 'quota'::regnamespace AND proname IN ('start', 'try_start');
SET ROLE wait_a;
SELECT quota.start() IS NOT NULL AS start_no_args;
SELECT quota.start('x') IS NOT NULL AS start_label;
SELECT quota.start(NULL) IS NOT NULL AS start_null;
SELECT quota.try_start() IS NOT NULL AS try_start_no_args;
SELECT quota.try_start('y') IS NOT NULL AS try_start_label;
SELECT quota.try_start(NULL) IS NOT NULL AS try_start_null;
SELECT quota.finish(quota.start('z')) AS start_then_finish;
SELECT label, lease_until - started_at BETWEEN interval '23 h 59 min' AND interval '24 h 1 min' AS default_lease
  FROM quota.tickets WHERE label IN ('x', 'y', 'z') ORDER BY started_at;
RESET ROLE;
