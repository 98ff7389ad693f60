-- 0.5.0: transactional starts. The charge commits or rolls back with the caller's
-- transaction; a superuser allows it with quota.allow_transactional.
CREATE ROLE tx_app;
SET quota.max_active_per_role = 2;
SET quota.max_retained_per_role = 0;
SET ROLE tx_app;

-- Off by default: 42501, with a hint naming the setting.
SELECT quota.start('x', transactional => true);
\echo :LAST_ERROR_SQLSTATE
\set VERBOSITY verbose
SELECT quota.try_start('x', transactional => true);
\set VERBOSITY default
SELECT quota.start('x', transactional => NULL);
\echo :LAST_ERROR_SQLSTATE
RESET ROLE;
SET quota.allow_transactional = on;
SET ROLE tx_app;

-- A rolled-back transactional start gives its slot back ...
BEGIN;
SELECT quota.start('rolled back', transactional => true) IS NOT NULL AS admitted;
SELECT quota.start('rolled back too', transactional => true) IS NOT NULL AS admitted;
SELECT quota.try_start('third', transactional => true) IS NULL AS refused_at_limit;
ROLLBACK;
-- ... a committed one keeps it.
BEGIN;
SELECT quota.start('committed', transactional => true) AS t \gset
COMMIT;
-- A savepoint rolled back gives its charges back; the rest of the transaction keeps its.
BEGIN;
SAVEPOINT s;
SELECT quota.start('in savepoint', transactional => true) IS NOT NULL AS admitted;
SELECT quota.try_start('over', transactional => true) IS NULL AS refused_at_limit;
ROLLBACK TO SAVEPOINT s;
SELECT quota.start('after savepoint', transactional => true) IS NOT NULL AS admitted;
COMMIT;
SELECT label FROM quota.tickets ORDER BY started_at;
SELECT quota.try_start('full', transactional => true) IS NULL AS refused_at_limit;
SELECT quota.finish(id) FROM quota.tickets WHERE label = 'after savepoint';

-- An error caught by PL/pgSQL rolls back its block's charge: the block takes the last
-- slot, and the statement after it finds that slot free again.
DO $$
BEGIN
  BEGIN
    PERFORM quota.start('caught', transactional => true);
    RAISE EXCEPTION 'roll this block back';
  EXCEPTION WHEN raise_exception THEN NULL;
  END;
  RAISE NOTICE 'after the block: %', quota.try_start('after block', transactional => true) IS NOT NULL;
  RAISE EXCEPTION 'and roll the rest back';
EXCEPTION WHEN raise_exception THEN NULL;
END $$;
SELECT count(*) AS caught_tickets FROM quota.tickets WHERE label IN ('caught', 'after block');

-- finish() of a transactional ticket in the same transaction.
BEGIN;
SELECT quota.start('same transaction', transactional => true) AS u \gset
SELECT quota.finish(:'u') AS finished_in_its_transaction;
COMMIT;
SELECT label, outcome, transactional FROM quota.tickets ORDER BY started_at;
SELECT active FROM quota.usage;

-- PREPARE TRANSACTION with a transactional charge is refused (0A000, before PostgreSQL
-- looks at max_prepared_transactions); nothing stays.
BEGIN;
SELECT quota.start('prepared', transactional => true) IS NOT NULL AS admitted;
PREPARE TRANSACTION 'tx_prepared';
\echo :LAST_ERROR_SQLSTATE
SELECT count(*) AS prepared_tickets FROM quota.tickets WHERE label = 'prepared';
SELECT quota.try_start('room again', transactional => true) IS NOT NULL AS admitted;

-- A key repeated in the same statement as its first transactional start (which that
-- statement's snapshot cannot see) gets the same ticket: one ticket, one charge.
SELECT quota.finish(id) IS NOT NULL AS made_room FROM quota.tickets WHERE label = 'room again';
SELECT count(*) AS answers, count(DISTINCT t) AS tickets
  FROM (SELECT quota.start('same statement', idempotency_key => 'same-stmt', transactional => true) AS t
          FROM generate_series(1, 3)) s;
SELECT count(*) AS tickets_with_key FROM quota.tickets WHERE idempotency_key = 'same-stmt';
-- In the charging transaction, a start without transactional may not return that
-- uncommitted ticket (55000): it promises a ticket no rollback removes.
SELECT quota.finish(id) AS made_room FROM quota.tickets WHERE idempotency_key = 'same-stmt';
BEGIN;
SELECT quota.start('open key', idempotency_key => 'open-key', transactional => true) IS NOT NULL AS admitted;
SELECT quota.start('open key', idempotency_key => 'open-key');
\echo :LAST_ERROR_SQLSTATE
ROLLBACK;
SELECT count(*) AS open_key_tickets FROM quota.tickets WHERE idempotency_key = 'open-key';

-- A transactional start in a read-only transaction is refused like any (25006).
BEGIN READ ONLY;
SELECT quota.start('read only', transactional => true);
\echo :LAST_ERROR_SQLSTATE
ROLLBACK;
RESET ROLE;
SELECT count(*) FILTER (WHERE txid IS NOT NULL) AS transactional_rows,
       count(*) FILTER (WHERE txid IS NULL) AS writer_rows
  FROM quota.ledger WHERE role = 'tx_app'::regrole;

-- 0.5.2 (R1): the database cap counts this transaction's own transactional tickets
-- once (0.5.1 counted them as rows and again as open charges, and refused the third
-- start of a transaction with room for three). The cap leaves room for three tickets
-- beside the ones earlier tests left active, none of which has a lease that could run
-- out meanwhile (and give the cap a slot more).
SET quota.max_active_per_role = 10;
SELECT count(*) FILTER (WHERE lease_until < now() + interval '1 hour') AS leases_ending_soon
  FROM quota.ledger WHERE ended_at IS NULL;
SELECT set_config('quota.max_active_per_database', (count(*) + 3)::text, false) AS cap
  FROM quota.ledger WHERE ended_at IS NULL \gset
SET ROLE tx_app;
BEGIN;
SELECT quota.start('cap 1', transactional => true) IS NOT NULL AS admitted;
SELECT quota.start('cap 2', transactional => true) IS NOT NULL AS admitted;
SELECT quota.start('cap 3', transactional => true) IS NOT NULL AS admitted;
SELECT quota.try_start('cap 4', transactional => true) IS NULL AS refused_at_cap;
SELECT quota.try_start('cap 4') IS NULL AS writer_start_refused_at_cap;
ROLLBACK;
-- With room for two: a transactional start, then one the writer commits, in the same
-- transaction (the writer's ticket outlives the rollback).
RESET ROLE;
SELECT set_config('quota.max_active_per_database', (count(*) + 2)::text, false) AS cap
  FROM quota.ledger WHERE ended_at IS NULL \gset
SET ROLE tx_app;
BEGIN;
SELECT quota.start('mixed 1', transactional => true) IS NOT NULL AS admitted;
SELECT quota.start('mixed 2') AS mixed \gset
SELECT quota.try_start('mixed 3', transactional => true) IS NULL AS refused_at_cap;
ROLLBACK;
SELECT quota.finish(:'mixed') AS finished;
RESET ROLE;
RESET quota.max_active_per_database;
RESET quota.max_active_per_role;
