-- 0.6.0: quota.finish_job(), a trigger that finishes a job's ticket in the transaction
-- in which the queue ends the job (I2: the slot frees when, and only if, that
-- transaction commits; I5: only the tickets the firing role may finish).
CREATE ROLE fj_app;
CREATE ROLE fj_other;
CREATE ROLE fj_member IN ROLE fj_app;
GRANT CREATE ON SCHEMA public TO fj_app;
SET quota.max_active_per_role = 2;
SET quota.max_retained_per_role = 0;
SET ROLE fj_app;
CREATE DOMAIN fj_ticket AS uuid;
CREATE TABLE fj_jobs (
    id int PRIMARY KEY,
    status text NOT NULL DEFAULT 'todo',
    args jsonb,
    payload json,
    ticket fj_ticket,
    ticket_text varchar(60),
    "Odd Col" jsonb
);
GRANT SELECT, UPDATE, DELETE ON fj_jobs TO fj_other, fj_member;
-- One trigger per outcome, each with its WHEN; a deleted job is cancelled.
CREATE TRIGGER fj_done AFTER UPDATE OF status ON fj_jobs FOR EACH ROW
  WHEN (NEW.status = 'succeeded' AND OLD.status <> 'succeeded')
  EXECUTE FUNCTION quota.finish_job('args->ticket');
CREATE TRIGGER fj_failed AFTER UPDATE OF status ON fj_jobs FOR EACH ROW
  WHEN (NEW.status = 'failed' AND OLD.status <> 'failed')
  EXECUTE FUNCTION quota.finish_job('args->ticket', 'failed');
CREATE TRIGGER fj_gone AFTER DELETE ON fj_jobs FOR EACH ROW
  EXECUTE FUNCTION quota.finish_job('args->ticket', 'cancelled');

-- Two jobs, each with its ticket: the role is at its limit.
INSERT INTO fj_jobs (id, args) SELECT 1, jsonb_build_object('ticket', quota.start('j1'));
INSERT INTO fj_jobs (id, args) SELECT 2, jsonb_build_object('ticket', quota.start('j2'), 'n', 2);
SELECT quota.try_start('third') IS NULL AS refused_at_two;

-- A completion that rolls back, or whose savepoint does, leaves the ticket active.
BEGIN;
UPDATE fj_jobs SET status = 'succeeded' WHERE id = 1;
SELECT outcome FROM quota.tickets WHERE label = 'j1';
ROLLBACK;
SELECT quota.try_start('third') IS NULL AS still_refused;
BEGIN;
SAVEPOINT s;
UPDATE fj_jobs SET status = 'succeeded' WHERE id = 1;
ROLLBACK TO s;
COMMIT;
SELECT quota.try_start('third') IS NULL AS still_refused;
SELECT label, outcome FROM quota.tickets WHERE label IN ('j1', 'j2') ORDER BY label;

-- The completion commits: the ticket ends with it, and its slot is free.
UPDATE fj_jobs SET status = 'succeeded' WHERE id = 1;
SELECT label, outcome, ended_at IS NOT NULL AS ended FROM quota.tickets WHERE label = 'j1';
SELECT quota.try_start('third') IS NOT NULL AS admitted_after_completion;
-- Ending it again (another status, the delete) finishes nothing twice.
UPDATE fj_jobs SET status = 'failed' WHERE id = 1;
DELETE FROM fj_jobs WHERE id = 1;
SELECT label, outcome FROM quota.tickets WHERE label = 'j1';
-- A deleted job's ticket ends with the delete's outcome; an unrelated update, no WHEN
-- match, finishes nothing.
UPDATE fj_jobs SET args = args || '{"n": 3}' WHERE id = 2;
SELECT label, outcome FROM quota.tickets WHERE label = 'j2';
DELETE FROM fj_jobs WHERE id = 2;
SELECT label, outcome FROM quota.tickets WHERE label = 'j2';

-- Rows without a ticket finish nothing: no column value, no key, JSON null, not an
-- object; nor does a ticket this database does not have. The same statement finishes
-- the one row that has a ticket (so the trigger did run for the others).
INSERT INTO fj_jobs (id, args) VALUES
  (10, NULL), (11, '{}'), (12, '{"ticket": null}'), (13, '[1, 2]'), (14, '"x"'),
  (15, '{"ticket": "00000000-0000-7000-8000-000000000000"}');
INSERT INTO fj_jobs (id, args) SELECT 16, jsonb_build_object('ticket', quota.start('j16'));
UPDATE fj_jobs SET status = 'succeeded' WHERE id BETWEEN 10 AND 16;
SELECT label, outcome FROM quota.tickets WHERE label = 'j16';
DELETE FROM fj_jobs WHERE id BETWEEN 10 AND 16;

-- The same ticket in two rows of one statement is finished once (quota.stats below
-- counts one finish for it).
INSERT INTO fj_jobs (id, args) SELECT 17, jsonb_build_object('ticket', quota.start('j17'));
INSERT INTO fj_jobs (id, args) SELECT 18, args FROM fj_jobs WHERE id = 17;
DELETE FROM fj_jobs WHERE id IN (17, 18);
SELECT label, outcome FROM quota.tickets WHERE label = 'j17';

-- A value that is not a uuid is the job's data, not the trigger's mistake: a WARNING
-- (22P02), and the queue's statement goes on (its job is done; nothing is finished).
\set VERBOSITY verbose
INSERT INTO fj_jobs (id, args) VALUES (20, '{"ticket": "not-a-ticket"}'), (21, '{"ticket": 42}');
UPDATE fj_jobs SET status = 'succeeded' WHERE id IN (20, 21);
\set VERBOSITY default
SELECT id, status FROM fj_jobs WHERE id IN (20, 21) ORDER BY id;
DELETE FROM fj_jobs WHERE id IN (20, 21);

-- I5: the firing role finishes only tickets it may finish. Another role's ticket is
-- left as it is, with a WARNING (42501) that does not say whose it is, and the queue's
-- statement goes on; a member of the holder's role finishes it. (The ticket is written
-- below the API, with an id fixed for the expected output.)
RESET ROLE;
INSERT INTO quota.ledger (id, role, label, started_at)
  VALUES ('00000000-0000-7000-8000-0000000000aa', 'fj_app', 'j30', now());
SET ROLE fj_app;
INSERT INTO fj_jobs (id, args) VALUES (30, '{"ticket": "00000000-0000-7000-8000-0000000000aa"}');
RESET ROLE;
SET ROLE fj_other;
\set VERBOSITY verbose
UPDATE fj_jobs SET status = 'succeeded' WHERE id = 30;
\set VERBOSITY default
RESET ROLE;
SELECT j.status, t.outcome FROM fj_jobs j, quota.tickets t WHERE j.id = 30 AND t.label = 'j30';
UPDATE fj_jobs SET status = 'doing' WHERE id = 30;
SET ROLE fj_member;
UPDATE fj_jobs SET status = 'failed' WHERE id = 30;
RESET ROLE;
SELECT j.status, t.outcome FROM fj_jobs j, quota.tickets t WHERE j.id = 30 AND t.label = 'j30';

-- A deferred constraint trigger finishes at COMMIT: until then the ticket is active.
SET ROLE fj_app;
CREATE CONSTRAINT TRIGGER fj_deferred AFTER UPDATE ON fj_jobs DEFERRABLE INITIALLY DEFERRED
  FOR EACH ROW WHEN (NEW.status = 'deferred') EXECUTE FUNCTION quota.finish_job('args->ticket');
INSERT INTO fj_jobs (id, args) SELECT 31, jsonb_build_object('ticket', quota.start('j31'));
BEGIN;
UPDATE fj_jobs SET status = 'deferred' WHERE id = 31;
SELECT label, outcome FROM quota.tickets WHERE label = 'j31';
COMMIT;
SELECT label, outcome FROM quota.tickets WHERE label = 'j31';
DROP TRIGGER fj_deferred ON fj_jobs;

-- The ticket in other places: a uuid column (here a domain over uuid), a varchar and
-- a text column in any form uuid input takes, json keys followed in depth, a jsonb
-- document stored out of line (TOAST), and a column whose name needs quotes in SQL
-- (written as it is, without them).
SELECT quota.finish(id) FROM quota.tickets WHERE label = 'third';
ALTER TABLE fj_jobs ADD COLUMN ticket_plain text;
CREATE TRIGGER fj_uuid AFTER UPDATE ON fj_jobs FOR EACH ROW WHEN (NEW.status = 'uuid')
  EXECUTE FUNCTION quota.finish_job('ticket');
CREATE TRIGGER fj_text AFTER UPDATE ON fj_jobs FOR EACH ROW WHEN (NEW.status = 'text')
  EXECUTE FUNCTION quota.finish_job('ticket_text', 'failed');
CREATE TRIGGER fj_plain AFTER UPDATE ON fj_jobs FOR EACH ROW WHEN (NEW.status = 'plain')
  EXECUTE FUNCTION quota.finish_job('ticket_plain', 'failed');
CREATE TRIGGER fj_json AFTER UPDATE ON fj_jobs FOR EACH ROW WHEN (NEW.status = 'json')
  EXECUTE FUNCTION quota.finish_job('payload->job->ticket', 'cancelled');
CREATE TRIGGER fj_odd AFTER UPDATE ON fj_jobs FOR EACH ROW WHEN (NEW.status = 'odd')
  EXECUTE FUNCTION quota.finish_job('Odd Col->the ticket');
INSERT INTO fj_jobs (id, ticket) SELECT 40, quota.start('j40');
INSERT INTO fj_jobs (id, ticket_text) SELECT 41, '{' || upper(replace(quota.start('j41')::text, '-', '')) || '}';
UPDATE fj_jobs SET status = 'uuid' WHERE id = 40;
UPDATE fj_jobs SET status = 'text' WHERE id = 41;
INSERT INTO fj_jobs (id, ticket_plain) SELECT 44, quota.start('j44')::text;
UPDATE fj_jobs SET status = 'plain' WHERE id = 44;
INSERT INTO fj_jobs (id, payload) SELECT 42, json_build_object('job', json_build_object('ticket', quota.start('j42')));
INSERT INTO fj_jobs (id, "Odd Col") SELECT 43, jsonb_build_object('the ticket', quota.start('j43'));
UPDATE fj_jobs SET status = 'json' WHERE id = 42;
UPDATE fj_jobs SET status = 'odd' WHERE id = 43;
INSERT INTO fj_jobs (id, args)
  SELECT 45, jsonb_build_object('pad', (SELECT string_agg(md5(i::text), '') FROM generate_series(1, 1000) i),
                                'ticket', quota.start('j45'));
SELECT pg_column_size(args) > 2000 AS stored_toasted FROM fj_jobs WHERE id = 45;
UPDATE fj_jobs SET status = 'succeeded' WHERE id = 45;
SELECT label, outcome FROM quota.tickets WHERE label IN ('j40', 'j41', 'j42', 'j43', 'j44', 'j45') ORDER BY label;

-- Misused, it says how it is meant, at CREATE TRIGGER: wrong arguments (22023), a
-- column that is not there (42703) or cannot hold a ticket (42804), fired other than
-- AFTER UPDATE or DELETE FOR EACH ROW (39P01). fj_misuse creates trigger fj_bad as
-- given and fires it, and shows the error and where it came.
CREATE FUNCTION fj_misuse(how text, fire text DEFAULT 'UPDATE fj_jobs SET status = ''bad1'' WHERE id = 40')
RETURNS void LANGUAGE plpgsql AS $$
DECLARE st text; msg text; det text; hin text; step text := 'CREATE TRIGGER';
BEGIN
  BEGIN
    EXECUTE 'CREATE TRIGGER fj_bad ' || how;
    step := 'when fired';
    EXECUTE fire;
    RAISE NOTICE 'no error';
    DROP TRIGGER fj_bad ON fj_jobs;
  EXCEPTION WHEN OTHERS THEN
    -- (The block's rollback took the trigger with it.)
    GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT,
                            det = PG_EXCEPTION_DETAIL, hin = PG_EXCEPTION_HINT;
    RAISE NOTICE E'%, %: %\nDETAIL: %\nHINT: %', step, st, msg, det, hin;
  END;
END $$;
\set when 'AFTER UPDATE ON fj_jobs FOR EACH ROW WHEN (NEW.status = ''bad1'') EXECUTE FUNCTION quota.finish_job'
SELECT fj_misuse(:'when' || '()');
SELECT fj_misuse(:'when' || '(''args->'', ''succeeded'')');
SELECT fj_misuse(:'when' || '(''args->ticket'', ''done'')');
SELECT fj_misuse(:'when' || '(''args -> ticket'')');
SELECT fj_misuse(:'when' || '(''id'')');
SELECT fj_misuse(:'when' || '(''args'')');
SELECT fj_misuse(:'when' || '(''ticket->x'')');
SELECT fj_misuse(:'when' || '(''ctid'')');
SELECT fj_misuse('BEFORE UPDATE ON fj_jobs FOR EACH ROW EXECUTE FUNCTION quota.finish_job(''args->ticket'')');
SELECT fj_misuse('AFTER UPDATE ON fj_jobs FOR EACH STATEMENT EXECUTE FUNCTION quota.finish_job(''args->ticket'')');
SELECT fj_misuse('AFTER INSERT OR UPDATE ON fj_jobs FOR EACH ROW EXECUTE FUNCTION quota.finish_job(''args->ticket'')',
                 'INSERT INTO fj_jobs (id) VALUES (50)');
SELECT count(*) AS bad_rows FROM fj_jobs WHERE id = 50 OR status = 'bad1';
-- The trigger depends on its column, as on those of its WHEN clause: dropping it or
-- changing its type is refused (so a dump restores the trigger, and a new partition
-- gets it). A rename is not: the firing meets it (42703), and the statement fails.
CREATE TRIGGER fj_later AFTER UPDATE ON fj_jobs FOR EACH ROW WHEN (NEW.status = 'later')
  EXECUTE FUNCTION quota.finish_job('ticket_plain');
ALTER TABLE fj_jobs ALTER COLUMN ticket_plain TYPE int USING NULL;
ALTER TABLE fj_jobs DROP COLUMN ticket_plain;
ALTER TABLE fj_jobs RENAME COLUMN ticket_plain TO ticket_renamed;
UPDATE fj_jobs SET status = 'later' WHERE id = 40;
ALTER TABLE fj_jobs RENAME COLUMN ticket_renamed TO ticket_plain;
UPDATE fj_jobs SET status = 'later' WHERE id = 40;
ALTER TABLE fj_jobs DROP COLUMN ticket_plain CASCADE;
SELECT tgname FROM pg_trigger WHERE tgname IN ('fj_later', 'fj_plain') ORDER BY 1;

-- Bad data shown in a WARNING is made ASCII and cut short: it is sent in the client's
-- encoding, which may lack its characters.
INSERT INTO fj_jobs (id, payload) VALUES
  (60, '{"job": {"ticket": "t\u00e2che-\u65e5\u672c-0123456789012345678901234567890123456789012345678901234567890123456789"}}'),
  (62, '{"job": {"ticket": null}}');
UPDATE fj_jobs SET status = 'json' WHERE id IN (60, 62);
-- A json document whose strings PostgreSQL cannot de-escape (\u0000) fails the
-- statement, as its own ->> does (USER_GUIDE; jsonb stores no such string).
INSERT INTO fj_jobs (id, payload) VALUES (61, '{"job": {"ticket": "\u0000"}}');
UPDATE fj_jobs SET status = 'json' WHERE id = 61;
DELETE FROM fj_jobs WHERE id IN (60, 61, 62);

-- On a partitioned jobs table: the trigger is cloned to each partition, those created
-- or attached later included (each clone goes through the CREATE TRIGGER check), and a
-- row updated within its partition finishes its ticket.
CREATE TABLE fj_parted (id int, status text, args jsonb) PARTITION BY LIST (status);
CREATE TABLE fj_parted_open PARTITION OF fj_parted FOR VALUES IN ('todo', 'done');
CREATE TRIGGER fj_parted_done AFTER UPDATE ON fj_parted FOR EACH ROW
  WHEN (NEW.status = 'done') EXECUTE FUNCTION quota.finish_job('args->ticket');
CREATE TABLE fj_parted_rest PARTITION OF fj_parted DEFAULT;
ALTER TABLE fj_parted DETACH PARTITION fj_parted_rest;
ALTER TABLE fj_parted ATTACH PARTITION fj_parted_rest DEFAULT;
SELECT tgrelid::regclass AS on_table FROM pg_trigger WHERE tgname = 'fj_parted_done' ORDER BY 1;
INSERT INTO fj_parted SELECT 1, 'todo', jsonb_build_object('ticket', quota.start('j70'));
UPDATE fj_parted SET status = 'done' WHERE id = 1;
SELECT label, outcome FROM quota.tickets WHERE label = 'j70';
DROP TABLE fj_parted;

-- Trigger functions cannot be called as functions.
SELECT quota.finish_job();

-- quota.stats counted the trigger's finishes as finish()'s.
RESET ROLE;
SELECT finished_succeeded, finished_failed, finished_cancelled
  FROM quota.stats WHERE role = 'fj_app' AND datname = current_database();

DROP FUNCTION fj_misuse(text, text);
DROP TABLE fj_jobs;
DROP DOMAIN fj_ticket;
REVOKE CREATE ON SCHEMA public FROM fj_app;
