-- Leases (0.2.0): start(..., lease) and quota.default_lease set lease_until; a ticket
-- whose lease ran out stops being active at once, counts as ended at lease_until with
-- outcome 'expired', and stays retained for quota.retention from lease_until.
-- How this test fails if leases break:
-- - expiry subtracted only by the ledger writer's sweep, not at once: the writer is
--   terminated before the lease runs out, so "admitted_right_after_expiry" turns f and
--   quota.usage still shows the ticket active;
-- - an expired ticket that finish() ends again: "finished_expired" turns t and the
--   outcome is no longer 'expired';
-- - retention counted from started_at instead of lease_until: "refused_before_ageout"
--   turns f and the hint's time is not lease_until + retention;
-- - default_lease ignored (or 0 not meaning "never"): the lease bounds or
--   "never_expires" turn f.
-- Error text that names a ticket is shown with the uuid replaced by <ticket>.
CREATE FUNCTION pg_temp.err(q text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE st text; msg text;
BEGIN
  EXECUTE q;
  RETURN 'ok';
EXCEPTION WHEN others THEN
  GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
  RETURN st || ' ' || regexp_replace(msg, '[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}', '<ticket>', 'g');
END $$;
SELECT current_user AS su \gset
CREATE ROLE lease_t LOGIN;
CREATE ROLE lease_x;
CREATE ROLE lease_r;

-- lease_parameter: lease_until = the start's time + lease.
SET ROLE lease_t;
SELECT quota.start('ten minutes', lease => '10 min') AS t1 \gset
SELECT lease_until - started_at BETWEEN interval '9 min 55 s' AND interval '10 min 1 s' AS lease_10min,
       lease_until - now() BETWEEN interval '9 min 55 s' AND interval '10 min 1 s' AS until_from_now,
       ended_at IS NULL AS open, outcome IS NULL AS no_outcome
  FROM quota.tickets WHERE id = :'t1';
-- try_start takes the same parameters.
SELECT quota.try_start('try, one hour', '1 hour') AS t2 \gset
SELECT lease_until - started_at BETWEEN interval '59 min 55 s' AND interval '1 hour 1 s' AS lease_1h
  FROM quota.tickets WHERE id = :'t2';

-- default_lease: 24h unless set; a lease given to start() wins over it.
RESET ROLE;
SHOW quota.default_lease;
SET ROLE lease_t;
SELECT quota.start('default') AS t3 \gset
SELECT lease_until - started_at BETWEEN interval '23 h 59 min 55 s' AND interval '24 h 1 s' AS lease_24h
  FROM quota.tickets WHERE id = :'t3';
RESET ROLE;
SET quota.default_lease = '90s';
SET ROLE lease_t;
SELECT quota.start('ninety seconds') AS t4 \gset
SELECT quota.start('explicit wins', lease => '2 hours') AS t5 \gset
SELECT id = :'t4' AS ticket,
       lease_until - started_at BETWEEN interval '85 s' AND interval '91 s' AS as_expected
  FROM quota.tickets WHERE id = :'t4'
UNION ALL
SELECT id = :'t5',
       lease_until - started_at BETWEEN interval '1 h 59 min 55 s' AND interval '2 h 1 s'
  FROM quota.tickets WHERE id = :'t5';
-- 0 = never expires: lease_until is NULL.
RESET ROLE;
SET quota.default_lease = 0;
SET ROLE lease_t;
SELECT quota.start('no lease') AS t6 \gset
SELECT lease_until IS NULL AS never_expires FROM quota.tickets WHERE id = :'t6';
RESET ROLE;
RESET quota.default_lease;

-- default_lease is a superuser setting, range-checked; ALTER ROLE ... SET gives a
-- tenant its own, applied when it logs in.
SET ROLE lease_t;
SET quota.default_lease = '1h';
\echo :LAST_ERROR_SQLSTATE
RESET ROLE;
-- Only the SQLSTATE: PostgreSQL 18 words the range with units.
\set VERBOSITY sqlstate
SET quota.default_lease = '-1s';
\set VERBOSITY default
\echo :LAST_ERROR_SQLSTATE
ALTER ROLE lease_t SET quota.default_lease = '2min';
\c - lease_t
SHOW quota.default_lease;
SELECT quota.start('role default') AS t7 \gset
SELECT lease_until - started_at BETWEEN interval '115 s' AND interval '121 s' AS lease_2min
  FROM quota.tickets WHERE id = :'t7';
\c - :su
ALTER ROLE lease_t RESET quota.default_lease;

-- bad_leases: zero or negative raise 22023 (try_start too) and charge nothing.
CREATE FUNCTION pg_temp.err(q text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE st text; msg text;
BEGIN
  EXECUTE q;
  RETURN 'ok';
EXCEPTION WHEN others THEN
  GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
  RETURN st || ' ' || regexp_replace(msg, '[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}', '<ticket>', 'g');
END $$;
SET ROLE lease_t;
\set VERBOSITY default
SELECT quota.start('bad', lease => '-1 hour');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.start('bad', lease => '0');
\echo :LAST_ERROR_SQLSTATE
\set VERBOSITY terse
SELECT pg_temp.err($$SELECT quota.try_start('bad', lease => '-1 s')$$) AS try_start;
SELECT count(*) AS tickets, count(*) FILTER (WHERE label = 'bad') AS bad
  FROM quota.tickets;
RESET ROLE;

-- expiry_is_at_once: at its limit of 1, a tenant can start again as soon as its
-- ticket's lease has run out, before the ledger writer has written the expiry down.
-- The writer is terminated first, so nothing can sweep the row in between.
SET quota.max_active_per_role = 1;
SET ROLE lease_x;
SELECT quota.start('short', lease => '600 ms') AS tx \gset
SELECT quota.try_start('while the lease runs') IS NULL AS refused_while_leased;
RESET ROLE;
SELECT count(*) FILTER (WHERE NOT pg_terminate_backend(pid, 5000)) AS writers_left
  FROM pg_stat_activity
 WHERE backend_type = 'pg_quota ledger writer' AND datname = current_database();
SELECT pg_sleep_until(lease_until + interval '50 ms')
  FROM quota.tickets WHERE id = :'tx';
-- The ledger row is still open: no writer has swept it ...
SELECT ended_at IS NULL AS open_in_ledger, outcome IS NULL AS no_outcome_in_ledger
  FROM quota.ledger WHERE id = :'tx';
-- ... yet it no longer counts as active: quota.tickets and quota.usage show it ended
-- at lease_until with outcome 'expired'; it stays retained.
SELECT outcome, ended_at = lease_until AS ended_at_lease_until
  FROM quota.tickets WHERE id = :'tx';
SELECT active, retained FROM quota.usage WHERE role = 'lease_x'::regrole;
SET ROLE lease_x;
-- finish() on an expired ticket returns false: it had already ended.
SELECT quota.finish(:'tx') AS finished_expired;
SELECT quota.start('right after expiry') IS NOT NULL AS admitted_right_after_expiry;
SELECT quota.try_start('one slot only') IS NULL AS refused_again;
SELECT active, retained FROM quota.usage;
RESET ROLE;
-- The new writer sweeps the row down: ended_at = lease_until, outcome 'expired'
-- (finish() did not overwrite it).
DO $$
BEGIN
  FOR i IN 1..200 LOOP
    EXIT WHEN EXISTS (SELECT FROM quota.ledger
                       WHERE role = 'lease_x'::regrole AND label = 'short'
                         AND ended_at IS NOT NULL);
    PERFORM pg_sleep(0.01);
  END LOOP;
END $$;
SELECT l.ended_at = l.lease_until AS swept_at_lease_until, l.outcome
  FROM quota.ledger l WHERE id = :'tx';
SET ROLE lease_x;
SELECT quota.finish(:'tx') AS finished_after_sweep;
RESET ROLE;
SELECT outcome FROM quota.ledger WHERE id = :'tx';

-- retained_from_expiry: an expired ticket is retained for quota.retention from its
-- lease_until, not from its start. With max_retained_per_role = 1 it blocks the role.
SET quota.max_active_per_role = 5;
SET quota.max_retained_per_role = 1;
SET quota.retention = '1h';
SET ROLE lease_r;
SELECT quota.start('expires', lease => '300 ms') AS tr \gset
SELECT pg_sleep_until(lease_until + interval '50 ms')
  FROM quota.tickets WHERE id = :'tr';
SELECT active, retained FROM quota.usage;
\set VERBOSITY terse
SELECT quota.start('blocked by the retained limit');
\echo :LAST_ERROR_SQLSTATE
\set VERBOSITY default
SELECT quota.try_start('blocked by the retained limit') IS NULL AS refused;
-- Capacity returns at lease_until + retention, as the hint and quota.usage say.
DO $$
DECLARE det text; hnt text; lu timestamptz;
BEGIN
  SELECT lease_until INTO lu FROM quota.tickets WHERE label = 'expires';
  PERFORM quota.start('blocked');
EXCEPTION WHEN configuration_limit_exceeded THEN
  GET STACKED DIAGNOSTICS det = PG_EXCEPTION_DETAIL, hnt = PG_EXCEPTION_HINT;
  RAISE NOTICE 'detail: %', det;
  RAISE NOTICE 'capacity returns at lease_until + 1h: %',
    substring(hnt from 'Capacity returns at (.*), when the oldest')::timestamptz
      = lu + interval '1 hour';
END $$;
SELECT next_ageout = (SELECT lease_until + interval '1 hour' FROM quota.tickets WHERE id = :'tr')
       AS next_ageout_from_lease_until
  FROM quota.usage;
-- A short retention: retention 0 ages the expired ticket out at once; then, with
-- retention 1 s, a ticket with a 1 s lease still blocks 1.5 s after its start
-- (counted from started_at it would have aged out at 1 s; from lease_until it ages
-- out at 2 s) and is gone at lease_until + 1 s.
RESET ROLE;
SET quota.retention = 0;
SET ROLE lease_r;
SELECT quota.start('retention 0', lease => '1 s') AS ts \gset
RESET ROLE;
SET quota.retention = '1s';
SET ROLE lease_r;
SELECT started_at AS ts_started, lease_until AS ts_lease_until FROM quota.tickets WHERE id = :'ts' \gset
SELECT pg_sleep_until(:'ts_started'::timestamptz + interval '1.5 s');
SELECT quota.try_start('at 1.5 s') IS NULL AS refused_before_ageout;
SELECT pg_sleep_until(:'ts_lease_until'::timestamptz + interval '1.05 s');
SELECT quota.try_start('after lease_until + retention') IS NOT NULL AS admitted_after_ageout;
RESET ROLE;
RESET quota.max_active_per_role;
RESET quota.max_retained_per_role;
RESET quota.retention;
SELECT role, label, outcome FROM quota.tickets
 WHERE role IN ('lease_x'::regrole, 'lease_r'::regrole) ORDER BY started_at;

-- A lease that takes the end of the ticket past what timestamptz can hold is
-- PostgreSQL's own 22008 (datetime_field_overflow), for start() and renew() alike, and
-- charges nothing (USER_GUIDE's SQLSTATE tables list it from 0.3.1).
SELECT quota.start('renewed too far') AS far \gset
SELECT count(*) AS before FROM quota.ledger \gset
\set VERBOSITY sqlstate
SELECT quota.start('too far', lease => '1000000 years');
SELECT quota.renew(:'far', '1000000 years');
\set VERBOSITY default
SELECT count(*) = :before AS nothing_charged FROM quota.ledger;
SELECT quota.finish(:'far') AS finished;
