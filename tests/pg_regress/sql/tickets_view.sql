-- quota.tickets (0.2.0): one row per ledger row, with the starting backend's pid and
-- the idempotency key. Roles see their own tickets and those of roles they are members
-- of, superusers and pg_read_all_stats members all (I5: a tenant learns nothing about
-- other roles' tickets, not even through a leaky function).
-- A tenant finds its orphan tickets here (a start whose transaction rolled back keeps
-- its charge, I2) and finishes them.
-- How this test fails: other roles' rows visible to a tenant ("others_visible" > 0,
-- "leaky_calls" above the tenant's own count); pid not the starter's
-- ("pid_is_starter" f); the orphan not listed, or not finishable ("finished" f).
SELECT current_user AS su \gset
CREATE ROLE tv_a LOGIN;
CREATE ROLE tv_b;

-- Columns and types; SELECT for PUBLIC, the ledger itself stays closed.
SELECT attname, atttypid::regtype FROM pg_attribute
 WHERE attrelid = 'quota.tickets'::regclass AND attnum > 0 ORDER BY attnum;
SELECT has_table_privilege('tv_a', 'quota.tickets', 'SELECT') AS tickets_readable,
       has_table_privilege('tv_a', 'quota.ledger', 'SELECT') AS ledger_readable;

-- A tenant's tickets, started in a session of its own.
\c - tv_a
SELECT pg_backend_pid() AS a_pid \gset
SELECT quota.start('a keyed', idempotency_key => 'key-a') AS a1 \gset
SELECT quota.start('a leased', lease => '1 hour') AS a2 \gset
-- orphan: started in a transaction that rolled back; the charge stays.
BEGIN;
SELECT quota.start('a orphan') IS NOT NULL AS started;
ROLLBACK;
SELECT quota.start('a short', lease => '300 ms') AS a3 \gset
\c - :su
SELECT pg_backend_pid() AS su_pid \gset
SET ROLE tv_b;
SELECT quota.start('b one', idempotency_key => 'key-b') AS b1 \gset
RESET ROLE;
SELECT quota.start('su one', lease => '1 hour') AS s1 \gset
SELECT pg_sleep_until(lease_until + interval '50 ms') FROM quota.tickets WHERE id = :'a3';

-- The tenant sees its own four tickets and nobody else's.
\c - tv_a
SELECT label, idempotency_key, pid = :a_pid AS pid_is_starter,
       started_at IS NOT NULL AS started, lease_until IS NOT NULL AS leased,
       ended_at IS NULL AS open, outcome
  FROM quota.tickets ORDER BY started_at;
SELECT count(*) AS others_visible FROM quota.tickets WHERE role <> current_user::regrole
   OR id IN (:'b1', :'s1');
SELECT count(*) FROM quota.ledger;
\echo :LAST_ERROR_SQLSTATE
-- The expired ticket shows as ended at its lease_until.
SELECT ended_at = lease_until AS ended_at_lease_until, outcome FROM quota.tickets WHERE id = :'a3';
-- A leaky function in the tenant's query sees only the tenant's rows (security_barrier).
CREATE FUNCTION pg_temp.leak(t text) RETURNS boolean LANGUAGE plpgsql COST 0.0000001 AS $$
BEGIN
  PERFORM set_config('test.leaked', (coalesce(nullif(current_setting('test.leaked', true), ''), '0')::int + 1)::text, false);
  RETURN true;
END $$;
SELECT count(*) AS rows_seen FROM quota.tickets WHERE pg_temp.leak(label);
SELECT current_setting('test.leaked') AS leaky_calls;

-- find_and_finish_orphan: the tenant finds the ticket its rolled-back transaction
-- left active, and finishes it.
SELECT active FROM quota.usage;
SELECT id AS orphan FROM quota.tickets WHERE ended_at IS NULL AND label = 'a orphan' \gset
SELECT quota.finish(:'orphan', 'cancelled') AS finished;
SELECT label, outcome FROM quota.tickets WHERE id = :'orphan';
SELECT active FROM quota.usage;

-- A superuser sees every role's tickets; pid is the backend that started each one
-- (tv_b's was started after SET ROLE in the superuser's backend), not the reader's.
\c - :su
SELECT CASE WHEN role = current_user::regrole THEN 'superuser' ELSE role::text END AS role,
       label, idempotency_key,
       pid = CASE WHEN role = 'tv_a'::regrole THEN :a_pid ELSE :su_pid END AS pid_is_starter,
       pid = pg_backend_pid() AS pid_is_reader
  FROM quota.tickets
 WHERE role IN ('tv_a'::regrole, 'tv_b'::regrole) OR id = :'s1'
 ORDER BY started_at;

-- tickets_follow_finish_rights (0.3.1): a member of a role sees that role's tickets, as
-- it may finish and renew them; a member of pg_read_all_stats (pg_monitor) sees every
-- ticket, as it sees every row of quota.usage and quota.stats, but may not finish any.
-- Before 0.3.1 both saw none ("member_rows" and "monitor_rows" 0).
CREATE ROLE tv_member LOGIN;
GRANT tv_b TO tv_member;
CREATE ROLE tv_monitor LOGIN;
GRANT pg_monitor TO tv_monitor;
\c - tv_member
SELECT count(*) AS member_rows, bool_and(role = 'tv_b'::regrole) AS only_tv_b FROM quota.tickets;
SELECT role, active FROM quota.usage;
SELECT quota.finish(:'b1') AS member_finished;
\c - tv_monitor
SELECT count(*) AS monitor_rows FROM quota.tickets
 WHERE role IN ('tv_a'::regrole, 'tv_b'::regrole) OR id = :'s1';
\set VERBOSITY sqlstate
SELECT quota.finish(:'a1');
\set VERBOSITY default
\c - :su
DROP ROLE tv_member;
DROP ROLE tv_monitor;
