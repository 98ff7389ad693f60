-- The ledger in two tables (0.6.0): quota.active holds the tickets that have not ended,
-- quota.history the ended ones, and quota.ledger is a view of both. A finish (and the
-- writer's end of a lapsed lease) moves the ticket from one to the other in one
-- transaction; nothing updates quota.history.
-- How this test fails:
-- - a finish that updates the row in place instead of moving it: "in_active" stays 1
--   after the finish, and quota.history's n_tup_upd is not 0;
-- - a move that is not one transaction (a finish that rolls back leaving the ticket in
--   quota.history, or a delete without its insert): "rolled_back" does not read 1|0,
--   or the ticket is gone from both;
-- - an expiry written in place: the expired ticket stays in quota.active;
-- - counts that read one table only: the limits below admit past 2 active (I1), or
--   the retained refusal comes late.
CREATE ROLE split_t;
-- The tables' update counts before (see "No finish was an update" below).
SELECT pg_stat_force_next_flush();
SELECT sum(n_tup_upd) FILTER (WHERE relname = 'active') AS active_upd0,
       sum(n_tup_upd) FILTER (WHERE relname = 'history') AS history_upd0
  FROM pg_stat_all_tables WHERE schemaname = 'quota' \gset
SET quota.max_active_per_role = 2;
SET quota.max_retained_per_role = 4;
SET ROLE split_t;
SELECT quota.start('one') AS t1 \gset
SELECT quota.start('two') AS t2 \gset
SELECT quota.try_start('three') IS NULL AS refused_at_two_active;
RESET ROLE;
-- A started ticket is in quota.active only.
SELECT (SELECT count(*) FROM quota.active WHERE id = :'t1') AS in_active,
       (SELECT count(*) FROM quota.history WHERE id = :'t1') AS in_history;

-- only_over_count_split: a finish that rolls back leaves the ticket where it was.
SET ROLE split_t;
BEGIN;
SELECT quota.finish(:'t1');
ROLLBACK;
RESET ROLE;
SELECT (SELECT count(*) FROM quota.active WHERE id = :'t1') || '|' ||
       (SELECT count(*) FROM quota.history WHERE id = :'t1') AS rolled_back;
SET ROLE split_t;
SELECT quota.try_start('still full') IS NULL AS still_refused;

-- A committed finish moves the ticket: deleted from quota.active, inserted into
-- quota.history with its outcome, in the finishing transaction.
BEGIN;
SELECT quota.finish(:'t1', 'failed');
SELECT pg_current_xact_id()::text AS finishing_xact \gset
COMMIT;
RESET ROLE;
SELECT (SELECT count(*) FROM quota.active WHERE id = :'t1') AS in_active,
       (SELECT count(*) FROM quota.history WHERE id = :'t1') AS in_history,
       (SELECT outcome FROM quota.history WHERE id = :'t1') AS outcome,
       (SELECT xmin::text = :'finishing_xact' FROM quota.history WHERE id = :'t1') AS moved_by_the_finish;
-- The view shows it once, as the one table did.
SELECT count(*) AS rows_in_view, bool_and(ended_at IS NOT NULL) AS ended
  FROM quota.ledger WHERE id = :'t1';
-- Finished again: false, and still once in quota.history.
SET ROLE split_t;
SELECT quota.finish(:'t1') AS finished_twice;
-- The freed slot admits one start (I1 across both tables), then the limit holds.
SELECT quota.start('three') IS NOT NULL AS admitted;
SELECT quota.try_start('four') IS NULL AS refused_again;
RESET ROLE;
-- Retained: 3 rows (2 active, 1 in history) of 4; one more fits, then refusal.
SET ROLE split_t;
SELECT quota.finish(:'t2');
SELECT quota.start('four') IS NOT NULL AS admitted_to_retained_limit;
SELECT quota.try_start('five') IS NULL AS refused_at_retained_limit;
RESET ROLE;
SELECT active, retained FROM quota.usage WHERE role = 'split_t'::regrole;

-- A lease that runs out: the writer's sweep moves the ticket to quota.history with
-- outcome 'expired' and ended_at = lease_until; renew() keeps a ticket in quota.active.
SET quota.max_retained_per_role = 0;
SET ROLE split_t;
SELECT quota.finish(id) FROM quota.tickets WHERE role = 'split_t'::regrole AND ended_at IS NULL;
SELECT quota.start('short', lease => '1 second') AS t5 \gset
SELECT quota.start('renewed', lease => '1 hour') AS t6 \gset
SELECT quota.renew(:'t6', '2 hours') > now() + interval '1 hour' AS renewed;
RESET ROLE;
SELECT (SELECT count(*) FROM quota.active WHERE id = :'t6') AS renewed_in_active;
SELECT pg_sleep(1.2);
DO $$
BEGIN
  FOR i IN 1..200 LOOP
    EXIT WHEN EXISTS (SELECT FROM quota.history WHERE outcome = 'expired'
                        AND role = 'split_t'::regrole);
    PERFORM pg_sleep(0.05);
  END LOOP;
END $$;
SELECT (SELECT count(*) FROM quota.active WHERE id = :'t5') AS expired_in_active,
       (SELECT outcome || '|' || (ended_at = lease_until)::text
          FROM quota.history WHERE id = :'t5') AS expired_in_history;

-- No finish was an update: this session's one update of pg_quota's tables is the
-- renew() in quota.active; quota.history takes inserts only (and a purge's deletes).
SELECT pg_stat_force_next_flush();
SELECT sum(n_tup_upd) FILTER (WHERE relname = 'active') - :active_upd0 AS active_updates,
       sum(n_tup_upd) FILTER (WHERE relname = 'history') - :history_upd0 AS history_updates
  FROM pg_stat_all_tables WHERE schemaname = 'quota';
-- Every unended ticket is in quota.active, every ended one in quota.history, none in
-- both.
SELECT (SELECT count(*) FROM quota.active WHERE ended_at IS NOT NULL) AS ended_in_active,
       (SELECT count(*) FROM quota.history WHERE ended_at IS NULL) AS unended_in_history,
       (SELECT count(*) FROM quota.active a JOIN quota.history h USING (id)) AS in_both;

-- A superuser's writes through the view go to the table each row belongs in.
INSERT INTO quota.ledger (id, role, label, started_at)
VALUES ('00000000-0000-7000-8000-000000000001', 'split_t', 'by hand', now());
UPDATE quota.ledger SET ended_at = now(), outcome = 'cancelled'
 WHERE id = '00000000-0000-7000-8000-000000000001';
SELECT (SELECT count(*) FROM quota.active WHERE label = 'by hand') AS by_hand_active,
       (SELECT count(*) FROM quota.history WHERE label = 'by hand') AS by_hand_history;
DELETE FROM quota.ledger WHERE id = '00000000-0000-7000-8000-000000000001';
SELECT count(*) AS by_hand_left FROM quota.ledger WHERE label = 'by hand';
-- Many rows through the view in one statement: each goes where it belongs.
INSERT INTO quota.ledger (id, role, label, started_at, ended_at, outcome)
SELECT gen_random_uuid(), 'split_t', 'many', now(), now(), 'succeeded'
  FROM generate_series(1, 50);
SELECT count(*) AS many_in_history FROM quota.history WHERE label = 'many';
-- COPY into the view under session_replication_role = replica would drop every row
-- (PostgreSQL fires no origin trigger there): refused, 55000.
SET session_replication_role = replica;
COPY quota.ledger (id, role, started_at) FROM stdin;
00000000-0000-7000-8000-000000000002	split_t	2026-12-05 00:00:00+00
\.
\echo :LAST_ERROR_SQLSTATE
RESET session_replication_role;
SELECT count(*) AS copied_under_replica FROM quota.ledger
 WHERE id = '00000000-0000-7000-8000-000000000002';
-- The history's rows must have ended; the active table's must not have.
\set VERBOSITY terse
INSERT INTO quota.history (id, role, started_at) VALUES (gen_random_uuid(), 'split_t', now());
INSERT INTO quota.active (id, role, started_at, ended_at, outcome)
VALUES (gen_random_uuid(), 'split_t', now(), now(), 'succeeded');
\set VERBOSITY default

DELETE FROM quota.ledger WHERE role = 'split_t'::regrole;
DROP ROLE split_t;
RESET quota.max_active_per_role;
RESET quota.max_retained_per_role;
