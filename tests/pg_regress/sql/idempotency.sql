-- Idempotent starts (0.2.0): within a scope (database, role), while the first ticket
-- with a key is retained (active, or ended less than quota.retention ago; an expired
-- ticket ended at its lease_until), start(..., idempotency_key => k) returns that same
-- ticket and charges nothing, even when the role is at its limit.
-- How this test fails if idempotency breaks:
-- - a retry charged as a new ticket: "same_ticket" turns f (or the retry is refused
--   with 53400 at the limit), quota.usage shows 2 active and the key has 2 tickets;
-- - keys not scoped by role: "own_ticket_per_role" turns f;
-- - a key bound forever (or never): "same_after_finish" / "new_after_ageout" turn f;
-- - the 200-character limit counted in bytes: "admitted_200_chars" errors with 22001.
CREATE FUNCTION pg_temp.err(q text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE st text; msg text;
BEGIN
  EXECUTE q;
  RETURN 'ok';
EXCEPTION WHEN others THEN
  GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
  RETURN st || ' ' || regexp_replace(msg, '[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}', '<ticket>', 'g');
END $$;
CREATE ROLE idem_a;
CREATE ROLE idem_b;

-- same_key_same_ticket: at a limit of 1, a retry with the same key returns the first
-- ticket and charges nothing; try_start too, and a wait does not wait.
SET quota.max_active_per_role = 1;
SET ROLE idem_a;
SELECT quota.start('first', idempotency_key => 'job-1') AS k1 \gset
SELECT active, retained FROM quota.usage;
SELECT quota.start('retry', idempotency_key => 'job-1') = :'k1' AS same_ticket;
SELECT quota.try_start('retry', idempotency_key => 'job-1') = :'k1' AS same_via_try_start;
SELECT clock_timestamp() AS t0 \gset
SELECT quota.start('retry', idempotency_key => 'job-1', wait => '2 s') = :'k1' AS same_with_wait,
       clock_timestamp() - :'t0'::timestamptz < interval '1 s' AS did_not_wait;
SELECT active, retained FROM quota.usage;
-- One ticket with the key; the retries' labels were not applied.
SELECT count(*) AS tickets_with_key, min(label) AS label
  FROM quota.tickets WHERE idempotency_key = 'job-1';

-- different_key_new_ticket: a different key is a new ticket, refused at the limit ...
\set VERBOSITY terse
SELECT quota.start('other', idempotency_key => 'job-2');
\echo :LAST_ERROR_SQLSTATE
\set VERBOSITY default
SELECT quota.try_start('other', idempotency_key => 'job-2') IS NULL AS other_key_refused;
-- ... and admitted, as a different ticket, when there is room.
RESET ROLE;
SET quota.max_active_per_role = 3;
SET ROLE idem_a;
SELECT quota.start('other', idempotency_key => 'job-2') AS k2 \gset
SELECT :'k2' <> :'k1' AS different_ticket;
SELECT quota.start('other again', idempotency_key => 'job-2') = :'k2' AS same_second_key;
SELECT active, retained FROM quota.usage;
RESET ROLE;

-- per_role: another role with the same key gets a ticket of its own, and its retry
-- gets that one.
SET ROLE idem_b;
SELECT quota.start('b', idempotency_key => 'job-1') AS kb \gset
SELECT :'kb' <> :'k1' AS own_ticket_per_role;
SELECT quota.start('b retry', idempotency_key => 'job-1') = :'kb' AS same_for_b;
RESET ROLE;
SELECT role, count(*) AS tickets FROM quota.tickets
 WHERE idempotency_key = 'job-1' GROUP BY role ORDER BY role::text;

-- rolled_back_start_keeps_key: the charge of a start in a rolled-back transaction
-- stays (I2), and so does its key.
SET ROLE idem_a;
BEGIN;
SELECT quota.start('rolled back', idempotency_key => 'job-rb') AS krb \gset
ROLLBACK;
SELECT quota.start('after rollback', idempotency_key => 'job-rb') = :'krb' AS same_after_rollback;
SELECT quota.finish(:'krb');

-- retained_not_forever: after finish() the key still gives the same (ended) ticket
-- while it is retained, and charges nothing; once it has aged out (quota.retention
-- 0), the key starts a new ticket.
SELECT quota.finish(:'k1');
SELECT quota.start('after finish', idempotency_key => 'job-1') = :'k1' AS same_after_finish;
SELECT outcome FROM quota.tickets WHERE id = :'k1';
SELECT active, retained FROM quota.usage;
RESET ROLE;
SET quota.retention = 0;
SET ROLE idem_a;
SELECT quota.start('after ageout', idempotency_key => 'job-1') AS k1b \gset
SELECT :'k1b' <> :'k1' AS new_after_ageout;
SELECT quota.start('after ageout, retry', idempotency_key => 'job-1') = :'k1b' AS same_new_ticket;
SELECT active, retained FROM quota.usage;
RESET ROLE;

-- expired_is_ended: a ticket whose lease ran out is retained from its lease_until:
-- with a retention of an hour its key still gives it; with retention 0, a new one.
SET quota.retention = '1h';
SET ROLE idem_a;
SELECT quota.start('leased', lease => '300 ms', idempotency_key => 'job-lease') AS kl \gset
SELECT pg_sleep_until(lease_until + interval '50 ms') FROM quota.tickets WHERE id = :'kl';
SELECT outcome FROM quota.tickets WHERE id = :'kl';
SELECT quota.start('leased retry', idempotency_key => 'job-lease') = :'kl' AS same_expired_ticket;
RESET ROLE;
SET quota.retention = 0;
SET ROLE idem_a;
SELECT quota.start('leased, new', idempotency_key => 'job-lease') <> :'kl' AS new_after_expiry;
RESET ROLE;
RESET quota.retention;
RESET quota.max_active_per_role;

-- key_length: at most 200 characters (characters, not bytes), checked before
-- anything is charged; try_start raises too.
SET ROLE idem_a;
SELECT pg_temp.err($$SELECT quota.start(idempotency_key => repeat('ü', 200))$$) AS admitted_200_chars;
SELECT pg_temp.err($$SELECT quota.start(idempotency_key => repeat('x', 201))$$) AS start_201;
SELECT pg_temp.err($$SELECT quota.try_start(idempotency_key => repeat('x', 201))$$) AS try_start_201;
SELECT count(*) FILTER (WHERE length(idempotency_key) = 200) AS with_200,
       count(*) FILTER (WHERE length(idempotency_key) > 200) AS over_200
  FROM quota.tickets;
RESET ROLE;
