-- quota.renew(ticket, lease) (0.2.0): sets lease_until = now + lease in the caller's
-- transaction and returns it. It is transactional like finish(): a rolled-back renew
-- leaves the old lease. Same ownership rules as finish() (I5): another role's ticket
-- raises 42501 unless the caller is a member of that role or a superuser.
-- How this test fails if renew breaks:
-- - renew not extending the lease that admission counts: "still_active" and
--   "refused_still_at_limit" turn f once the old lease has run out;
-- - renew not transactional: after ROLLBACK "old_lease_kept" turns f and the ticket
--   does not expire at its old lease;
-- - renew reviving an ended or expired ticket: the 55000 lines turn into "ok";
-- - a tenant renewing somebody else's ticket: the 42501 lines turn into "ok".
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
-- Only the SQLSTATE, for the 42501 lines: the message of that error is not checked
-- here (it says "finish" for renew() too).
CREATE FUNCTION pg_temp.sqlstate(q text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
  EXECUTE q;
  RETURN 'ok';
EXCEPTION WHEN others THEN
  RETURN SQLSTATE;
END $$;
CREATE ROLE renew_a;
CREATE ROLE renew_b;
CREATE ROLE renew_team;
GRANT renew_team TO renew_a;

-- renew_returns_new_expiry
SET ROLE renew_a;
SELECT quota.start('one minute', lease => '1 min') AS t1 \gset
SELECT lease_until AS old_until FROM quota.tickets WHERE id = :'t1' \gset
SELECT quota.renew(:'t1', '2 hours') AS new_until \gset
SELECT lease_until = :'new_until'::timestamptz AS returned_is_lease_until,
       lease_until - now() BETWEEN interval '1 h 59 min 55 s' AND interval '2 h 5 s' AS two_hours_from_now,
       lease_until > :'old_until'::timestamptz AS later,
       ended_at IS NULL AS open
  FROM quota.tickets WHERE id = :'t1';
SELECT quota.finish(:'t1');

-- renew_keeps_ticket_active: at a limit of 1, a ticket with a 600 ms lease renewed for
-- a minute is still active, and still blocks, after its old lease has run out.
RESET ROLE;
SET quota.max_active_per_role = 1;
SET ROLE renew_a;
SELECT quota.start('about to expire', lease => '600 ms') AS t2 \gset
SELECT lease_until AS t2_old_until FROM quota.tickets WHERE id = :'t2' \gset
SELECT quota.renew(:'t2', '1 min') - now() BETWEEN interval '55 s' AND interval '65 s' AS renewed;
SELECT pg_sleep_until(:'t2_old_until'::timestamptz + interval '100 ms');
SELECT ended_at IS NULL AS still_active, outcome IS NULL AS no_outcome
  FROM quota.tickets WHERE id = :'t2';
SELECT active FROM quota.usage;
SELECT quota.try_start('over the limit') IS NULL AS refused_still_at_limit;

-- renew_rolled_back: the old lease stays. Renew to 600 ms (a renew may also shorten a
-- lease: lease_until = now + lease), then renew for an hour and roll that back: the
-- ticket expires 600 ms after the first renew.
SELECT quota.renew(:'t2', '600 ms') AS short_until \gset
BEGIN;
SELECT quota.renew(:'t2', '1 hour') - now() BETWEEN interval '59 min 55 s' AND interval '1 h 5 s'
       AS renewed_in_transaction;
SELECT lease_until <> :'short_until'::timestamptz AS changed_inside
  FROM quota.tickets WHERE id = :'t2';
ROLLBACK;
SELECT lease_until = :'short_until'::timestamptz AS old_lease_kept
  FROM quota.tickets WHERE id = :'t2';
SELECT pg_sleep_until(:'short_until'::timestamptz + interval '50 ms');
SELECT outcome FROM quota.tickets WHERE id = :'t2';
SELECT quota.try_start('after expiry') IS NOT NULL AS admitted_after_expiry;
RESET ROLE;
RESET quota.max_active_per_role;
SET ROLE renew_a;

-- renew_ended: 55000, for a finished ticket and for an expired one; nothing changes.
\set VERBOSITY default
SELECT quota.start('to finish') AS t3 \gset
SELECT quota.finish(:'t3');
SELECT pg_temp.err(format('SELECT quota.renew(%L, %L)', :'t3', '1 hour')) AS renew_finished;
SELECT pg_temp.err(format('SELECT quota.renew(%L, %L)', :'t2', '1 hour')) AS renew_expired;
DO $$
DECLARE st text; det text; hnt text;
BEGIN
  PERFORM quota.renew((SELECT id FROM quota.tickets WHERE label = 'about to expire'), '1 hour');
EXCEPTION WHEN others THEN
  GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, det = PG_EXCEPTION_DETAIL, hnt = PG_EXCEPTION_HINT;
  RAISE NOTICE 'sqlstate: %, detail: %, hint: %', st, det, hnt;
END $$;
SELECT label, outcome, ended_at IS NOT NULL AS ended FROM quota.tickets
 WHERE id IN (:'t2', :'t3') ORDER BY started_at;
SELECT quota.finish(:'t2') AS finish_expired;

-- renew_ownership: another role's ticket raises 42501; a member of the role may renew
-- it; a superuser may renew any.
RESET ROLE;
SET ROLE renew_b;
SELECT quota.start('bob''s') AS tb \gset
RESET ROLE;
SET ROLE renew_team;
SELECT quota.start('team''s', lease => '1 min') AS tt \gset
RESET ROLE;
SET ROLE renew_a;
SELECT pg_temp.sqlstate(format('SELECT quota.renew(%L, %L)', :'tb', '1 hour')) AS other_role;
SELECT quota.renew(:'tt', '1 hour') - now() BETWEEN interval '59 min 55 s' AND interval '1 h 5 s'
       AS member_renewed;
RESET ROLE;
SET ROLE renew_b;
SELECT pg_temp.sqlstate(format('SELECT quota.renew(%L, %L)', :'tt', '2 hours')) AS not_a_member;
RESET ROLE;
SELECT quota.renew(:'tb', '3 hours') - now() BETWEEN interval '2 h 59 min 55 s' AND interval '3 h 5 s'
       AS superuser_renewed;
-- bob's ticket has the superuser's 3 hours, the team's the member's hour (not the
-- 2 hours that bob was refused).
SELECT role, lease_until - started_at BETWEEN interval '2 h 59 min' AND interval '3 h 1 min' AS three_hours,
       lease_until - started_at BETWEEN interval '59 min' AND interval '1 h 1 min' AS one_hour
  FROM quota.tickets WHERE id IN (:'tb', :'tt') ORDER BY role::text;

-- renew_bad_arguments: NULL ticket or lease 22004, unknown ticket 22023, a lease that
-- is not longer than zero 22023. The lease is unchanged afterwards.
SET ROLE renew_a;
SELECT quota.start('args', lease => '1 hour') AS t4 \gset
SELECT lease_until AS t4_until FROM quota.tickets WHERE id = :'t4' \gset
SELECT pg_temp.err($$SELECT quota.renew(NULL, '1 hour')$$) AS null_ticket;
SELECT pg_temp.err(format('SELECT quota.renew(%L, NULL)', :'t4')) AS null_lease;
SELECT pg_temp.err($$SELECT quota.renew('00000000-0000-0000-0000-000000000000', '1 hour')$$) AS unknown;
SELECT pg_temp.err(format('SELECT quota.renew(%L, %L)', :'t4', '0')) AS zero_lease;
SELECT pg_temp.err(format('SELECT quota.renew(%L, %L)', :'t4', '-5 min')) AS negative_lease;
SELECT lease_until = :'t4_until'::timestamptz AS unchanged, ended_at IS NULL AS open
  FROM quota.tickets WHERE id = :'t4';
RESET ROLE;

-- renew_is_heap_only (0.6.1): a renewal changes only lease_until, which no index of
-- quota.active has, so it is a heap-only (HOT) update: its new version enters no
-- index (0.6.0 had lease_until in three of them: every renewal entered three to six).
SET ROLE renew_a;
SELECT quota.start('hot', lease => '1 hour') AS t5 \gset
RESET ROLE;
BEGIN;
SELECT quota.renew(:'t5', '2 hours') IS NOT NULL AS renewed_once,
       quota.renew(:'t5', '3 hours') IS NOT NULL AS renewed_twice;
-- (A renewal may write its row twice: see finish::renew_ticket.)
SELECT n_tup_upd >= 2 AS updated, n_tup_hot_upd = n_tup_upd AS all_heap_only
  FROM pg_stat_xact_all_tables WHERE relid = 'quota.active'::regclass;
COMMIT;
SELECT lease_until - started_at BETWEEN interval '2 h 59 min' AND interval '3 h 1 min' AS three_hours
  FROM quota.tickets WHERE id = :'t5';
SELECT quota.finish(:'t5') AS finished_hot;
