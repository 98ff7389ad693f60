-- 0.6.0: quota.claim_job(), a trigger that renews a job's ticket in the transaction in
-- which the queue claims the job (I2: the renewal stands when, and only if, that
-- transaction commits; I5: only the tickets the firing role may renew), and clears
-- from the row a ticket it cannot renew, so that the run knows it holds no slot (I1:
-- a lapsed slot is never revived).
CREATE ROLE cj_app;
CREATE ROLE cj_other;
GRANT CREATE ON SCHEMA public TO cj_app;
SET quota.max_active_per_role = 2;
SET quota.max_retained_per_role = 0;
SET ROLE cj_app;
CREATE DOMAIN cj_uuid AS uuid;
CREATE TABLE cj_jobs (
    id int PRIMARY KEY,
    status text NOT NULL DEFAULT 'todo',
    args jsonb,
    ticket uuid,
    ticket_text text,
    must_have uuid NOT NULL DEFAULT gen_random_uuid(),
    payload json,
    via_domain cj_uuid,
    generated text GENERATED ALWAYS AS (args->>'ticket') STORED
);
GRANT SELECT, UPDATE ON cj_jobs TO cj_other;
CREATE TRIGGER cj_claimed BEFORE UPDATE OF status ON cj_jobs FOR EACH ROW
  WHEN (NEW.status = 'doing' AND OLD.status = 'todo')
  EXECUTE FUNCTION quota.claim_job('args->ticket', '1 hour');

-- A claim renews the ticket to the trigger's lease, from the claim: the row keeps it.
INSERT INTO cj_jobs (id, args)
  SELECT 1, jsonb_build_object('ticket', quota.start('c1', lease => '1 minute'), 'n', 1);
UPDATE cj_jobs SET status = 'doing' WHERE id = 1 RETURNING args->>'n' AS n, args->'ticket' IS NOT NULL AS kept;
SELECT lease_until > now() + interval '59 minutes' AS renewed_to_an_hour
  FROM quota.tickets WHERE label = 'c1';

-- A claim that rolls back, or whose savepoint does, leaves the old lease.
UPDATE cj_jobs SET status = 'todo' WHERE id = 1;
SELECT quota.renew((SELECT id FROM quota.tickets WHERE label = 'c1'), '1 minute') IS NOT NULL AS back_to_a_minute;
BEGIN;
UPDATE cj_jobs SET status = 'doing' WHERE id = 1;
ROLLBACK;
BEGIN;
SAVEPOINT s;
UPDATE cj_jobs SET status = 'doing' WHERE id = 1;
ROLLBACK TO s;
COMMIT;
SELECT lease_until < now() + interval '2 minutes' AS still_a_minute
  FROM quota.tickets WHERE label = 'c1';

-- A ticket that has ended is cleared from the claimed row (JSON null at its path; the
-- rest of the document as it was), and stays ended.
SELECT quota.finish(id) FROM quota.tickets WHERE label = 'c1';
UPDATE cj_jobs SET status = 'doing' WHERE id = 1 RETURNING args;
SELECT label, outcome FROM quota.tickets WHERE label = 'c1';

-- A ticket whose lease has run out, not yet swept: cleared too, and not revived. The
-- renewal's update is undone by a second one (the old lease back), so it stays lapsed
-- and its slot stays free. The transaction holds the ticket's row FOR SHARE before
-- the lease runs out, so that the ledger writer's sweep (which skips rows others
-- lock) cannot end it first: the claim meets it lapsed, not ended.
INSERT INTO cj_jobs (id, args)
  SELECT 2, jsonb_build_object('ticket', quota.start('c2', lease => '2 s'));
SELECT lease_until AS c2_lease FROM quota.tickets WHERE label = 'c2' \gset
BEGIN;
RESET ROLE;
SELECT label AS held FROM quota.active WHERE label = 'c2' FOR SHARE;
SET ROLE cj_app;
SELECT pg_sleep_until(:'c2_lease'::timestamptz + interval '50 ms');
UPDATE cj_jobs SET status = 'doing' WHERE id = 2 RETURNING args;
COMMIT;
SELECT lease_until = :'c2_lease' AS old_lease_kept, outcome FROM quota.tickets WHERE label = 'c2';
SELECT count(*) AS active FROM quota.tickets WHERE outcome IS NULL;
SELECT quota.try_start('c3a') IS NOT NULL AND quota.try_start('c3b') IS NOT NULL AS both_slots_free;
SELECT quota.finish(id) FROM quota.tickets WHERE label IN ('c3a', 'c3b') ORDER BY label;

-- No ticket (no key, JSON null, SQL NULL): the row goes through unchanged. One this
-- database does not have: cleared. In one statement, beside a row whose ticket it renews.
INSERT INTO cj_jobs (id, args) VALUES
  (10, NULL), (11, '{}'), (12, '{"ticket": null}'),
  (13, '{"ticket": "00000000-0000-7000-8000-000000000000", "k": [1]}');
INSERT INTO cj_jobs (id, args)
  SELECT 14, jsonb_build_object('ticket', quota.start('c14', lease => '1 minute'));
UPDATE cj_jobs SET status = 'doing' WHERE id BETWEEN 10 AND 14
  RETURNING id, args IS NULL AS no_args, args - 'ticket' AS rest, args->'ticket' = 'null' AS cleared;
SELECT lease_until > now() + interval '59 minutes' AS c14_renewed FROM quota.tickets WHERE label = 'c14';
SELECT quota.finish(id) FROM quota.tickets WHERE label = 'c14';

-- Not a uuid: a WARNING, cleared, and the claim goes on.
INSERT INTO cj_jobs (id, args) VALUES (20, '{"ticket": "not-a-ticket"}');
UPDATE cj_jobs SET status = 'doing' WHERE id = 20 RETURNING args;

-- Another role's claim of cj_app's ticket: a WARNING that names neither its holder, the
-- row cleared, and the ticket untouched.
RESET ROLE;
INSERT INTO quota.ledger (id, role, label, started_at, lease_until)
  VALUES ('00000000-0000-7000-8000-0000000000c3', 'cj_app', 'c30', now(), now() + interval '1 minute');
SET ROLE cj_app;
INSERT INTO cj_jobs (id, args) VALUES (30, '{"ticket": "00000000-0000-7000-8000-0000000000c3"}');
SET ROLE cj_other;
\set VERBOSITY verbose
UPDATE cj_jobs SET status = 'doing' WHERE id = 30 RETURNING args->'ticket' AS ticket;
\set VERBOSITY default
SET ROLE cj_app;
SELECT lease_until < now() + interval '2 minutes' AS c30_untouched, outcome FROM quota.tickets WHERE label = 'c30';
SELECT quota.finish(id) FROM quota.tickets WHERE label = 'c30';

-- Keys nested in the document: null at that place, the rest as it was.
CREATE TRIGGER cj_claimed_nested BEFORE UPDATE OF status ON cj_jobs FOR EACH ROW
  WHEN (NEW.status = 'nested') EXECUTE FUNCTION quota.claim_job('args->job->ticket', '10 minutes');
INSERT INTO cj_jobs (id, args) VALUES
  (35, '{"job": {"ticket": "00000000-0000-7000-8000-000000000000", "n": 35}, "ticket": 1}');
UPDATE cj_jobs SET status = 'nested' WHERE id = 35 RETURNING args;
DROP TRIGGER cj_claimed_nested ON cj_jobs;

-- A text column, and a uuid column: cleared to NULL.
CREATE TRIGGER cj_claimed_text BEFORE UPDATE OF status ON cj_jobs FOR EACH ROW
  WHEN (NEW.status = 'texted') EXECUTE FUNCTION quota.claim_job('ticket_text', '10 minutes');
INSERT INTO cj_jobs (id, ticket_text) VALUES (36, '00000000-0000-7000-8000-000000000000');
UPDATE cj_jobs SET status = 'texted' WHERE id = 36 RETURNING ticket_text IS NULL AS cleared;
DROP TRIGGER cj_claimed_text ON cj_jobs;
CREATE TRIGGER cj_claimed_col BEFORE UPDATE OF status ON cj_jobs FOR EACH ROW
  WHEN (NEW.status = 'running') EXECUTE FUNCTION quota.claim_job('ticket', '10 minutes');
INSERT INTO cj_jobs (id, ticket) SELECT 40, quota.start('c40', lease => '1 minute');
INSERT INTO cj_jobs (id, ticket) VALUES (41, '00000000-0000-7000-8000-000000000000');
UPDATE cj_jobs SET status = 'running' WHERE id IN (40, 41) RETURNING id, ticket IS NULL AS cleared;
SELECT lease_until > now() + interval '9 minutes' AS c40_renewed FROM quota.tickets WHERE label = 'c40';
SELECT quota.finish(id) FROM quota.tickets WHERE label = 'c40';
DROP TRIGGER cj_claimed_col ON cj_jobs;

-- A NOT NULL constraint added after CREATE TRIGGER: a claim that must clear the
-- ticket fails with an error that says why; one that renews it goes through.
CREATE TABLE cj_strict (id int, status text, ticket text);
CREATE TRIGGER cj_strict_claimed BEFORE UPDATE OF status ON cj_strict FOR EACH ROW
  WHEN (NEW.status = 'doing') EXECUTE FUNCTION quota.claim_job('ticket', '10 minutes');
INSERT INTO cj_strict VALUES (1, 'todo', '00000000-0000-7000-8000-000000000000');
INSERT INTO cj_strict SELECT 2, 'todo', quota.start('c50', lease => '1 minute');
ALTER TABLE cj_strict ALTER COLUMN ticket SET NOT NULL;
UPDATE cj_strict SET status = 'doing' WHERE id = 1;
UPDATE cj_strict SET status = 'doing' WHERE id = 2 RETURNING id, ticket IS NOT NULL AS kept;
SELECT quota.finish(id) FROM quota.tickets WHERE label = 'c50';
DROP TABLE cj_strict;

-- renew() with a lease shorter than its own work returns at once (a lease already
-- past: the ticket lapses), as a renewal may shorten a lease.
INSERT INTO cj_jobs (id, ticket) SELECT 42, quota.start('c42', lease => '1 minute');
SET statement_timeout = '5s';
SELECT quota.renew(ticket, '1 microsecond') <= clock_timestamp() AS already_past
  FROM cj_jobs WHERE id = 42;
RESET statement_timeout;
SELECT outcome FROM quota.tickets WHERE label = 'c42';

-- Mistakes in the definition are refused at CREATE TRIGGER: how it fires, its
-- arguments, its lease (not above zero, a field below zero, not an interval), its
-- column (json, which it would re-format; NOT NULL, which it cannot clear; a domain,
-- whose constraints its write would bypass; generated, which PostgreSQL computes after
-- it; missing; of a type that holds no ticket).
CREATE TRIGGER cj_bad AFTER UPDATE ON cj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.claim_job('args->ticket', '1 hour');
CREATE TRIGGER cj_bad BEFORE INSERT OR UPDATE ON cj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.claim_job('args->ticket', '1 hour');
CREATE TRIGGER cj_bad BEFORE UPDATE ON cj_jobs FOR EACH STATEMENT
  EXECUTE FUNCTION quota.claim_job('args->ticket', '1 hour');
CREATE TRIGGER cj_bad BEFORE UPDATE ON cj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.claim_job('args->ticket');
CREATE TRIGGER cj_bad BEFORE UPDATE ON cj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.claim_job('args->ticket', '0 s');
CREATE TRIGGER cj_bad BEFORE UPDATE ON cj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.claim_job('args->ticket', '1 mon -30 days');
CREATE TRIGGER cj_bad BEFORE UPDATE ON cj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.claim_job('args->ticket', '500 ms');
CREATE TRIGGER cj_bad BEFORE UPDATE ON cj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.claim_job('args->ticket', 'soon');
CREATE TRIGGER cj_bad BEFORE UPDATE ON cj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.claim_job('via_domain', '1 hour');
CREATE TRIGGER cj_bad BEFORE UPDATE ON cj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.claim_job('generated', '1 hour');
CREATE TRIGGER cj_bad BEFORE UPDATE ON cj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.claim_job('payload->ticket', '1 hour');
CREATE TRIGGER cj_bad BEFORE UPDATE ON cj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.claim_job('must_have', '1 hour');
CREATE TRIGGER cj_bad BEFORE UPDATE ON cj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.claim_job('nope->ticket', '1 hour');
CREATE TRIGGER cj_bad BEFORE UPDATE ON cj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.claim_job('status->ticket', '1 hour');
SELECT count(*) AS bad_triggers FROM pg_trigger WHERE tgname = 'cj_bad';

-- It cannot be called as a function.
SELECT quota.claim_job();

-- quota.stats counted the claims' renewals as renew()'s.
RESET ROLE;
SELECT renewed FROM quota.stats WHERE role = 'cj_app' AND datname = current_database();

DROP TABLE cj_jobs;
DROP DOMAIN cj_uuid;
REVOKE CREATE ON SCHEMA public FROM cj_app;
