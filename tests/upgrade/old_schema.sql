-- The installed library on an older schema: everything the older version offered still
-- works before the operator runs ALTER EXTENSION pg_quota UPDATE.
--
-- scripts/test-upgrade runs this as postgres, with psql -At and ON_ERROR_STOP, in a
-- database where CREATE EXTENSION pg_quota VERSION :'version' was run and never updated.
-- Roles t1 and t2 exist and hold no tickets in this database. Each check prints
-- "ok - <name>"; a failed check raises, which stops the script.
\set ON_ERROR_STOP 1

CREATE FUNCTION public.expect(name text, ok boolean) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    IF ok IS NOT TRUE THEN
        RAISE EXCEPTION 'check failed: %', name;
    END IF;
    RETURN 'ok - ' || name;
END $$;

-- expect_error(name, statement, sqlstate, message pattern for LIKE)
CREATE FUNCTION public.expect_error(name text, stmt text, want_state text, want_msg text)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    got_state text;
    got_msg text;
BEGIN
    BEGIN
        EXECUTE stmt;
    EXCEPTION WHEN OTHERS THEN
        GET STACKED DIAGNOSTICS got_state = RETURNED_SQLSTATE, got_msg = MESSAGE_TEXT;
    END;
    IF got_state IS NULL THEN
        RAISE EXCEPTION 'check failed: % (no error from %)', name, stmt;
    END IF;
    IF got_state <> want_state OR got_msg NOT LIKE want_msg THEN
        RAISE EXCEPTION 'check failed: % (got % "%", want % "%")',
            name, got_state, got_msg, want_state, want_msg;
    END IF;
    RETURN 'ok - ' || name;
END $$;

SELECT expect('the extension is at version ' || :'version' || ' (not updated)',
              (SELECT extversion FROM pg_extension WHERE extname = 'pg_quota') = :'version');
SELECT expect('no ledger rows yet', (SELECT count(*) FROM quota.ledger) = 0);

ALTER ROLE t1 IN DATABASE :"DBNAME" SET quota.max_active_per_role = 2;
ALTER ROLE t2 IN DATABASE :"DBNAME" SET quota.max_active_per_role = 2;

\connect - t1
SELECT quota.start() AS a \gset
SELECT expect('start() returns a ticket', :'a' <> '');
SELECT quota.start('labelled') AS b \gset
SELECT expect('start(''label'') returns a ticket', :'b' <> '' AND :'b' <> :'a');
SELECT expect('try_start(''label'') returns NULL at the limit', quota.try_start('over') IS NULL);
SELECT expect('try_start() returns NULL at the limit too', quota.try_start() IS NULL);
SELECT expect_error('start() at the limit raises 53400 naming the role, the count and the GUC',
    $$SELECT quota.start('over')$$, '53400',
    'role "t1" has 2 active tickets, the limit set by quota.max_active_per_role');
SELECT expect('finish(t) returns true', quota.finish(:'a'));
SELECT expect('finish(t) again returns false', quota.finish(:'a') = false);
SELECT quota.try_start('after finish') AS c \gset
SELECT expect('try_start() admits once a slot is free', :'c' <> '');
SELECT expect_error('... and start() refuses the next with 53400',
    $$SELECT quota.start('over')$$, '53400', 'role "t1" has 2 active tickets,%');
SELECT expect('finish(t, ''failed'') returns true', quota.finish(:'b', 'failed'));
SELECT expect('finish(t, ''failed'') again returns false', quota.finish(:'b', 'failed') = false);
SELECT expect_error('finish(NULL) raises 22004',
    $$SELECT quota.finish(NULL)$$, '22004', 'ticket must not be null');
SELECT expect_error('finish(t, NULL) raises 22004',
    'SELECT quota.finish(' || quote_literal(:'c') || ', NULL)', '22004', 'outcome must not be null');
SELECT expect_error('an unknown ticket raises 22023',
    $$SELECT quota.finish('00000000-0000-0000-0000-000000000000')$$, '22023',
    'ticket 00000000-0000-0000-0000-000000000000 does not exist');
SELECT expect_error('an invalid outcome raises 22023',
    'SELECT quota.finish(' || quote_literal(:'c') || ', ''bogus'')', '22023', 'invalid outcome "bogus"');
SELECT expect_error('a label over 200 characters raises 22001',
    $$SELECT quota.start(repeat('x', 201))$$, '22001', 'label is too long');
SELECT expect_error('a tenant cannot read the ledger (42501)',
    $$SELECT count(*) FROM quota.ledger$$, '42501', 'permission denied%');
SELECT expect('quota.usage shows t1 its own row',
    (SELECT array_agg(format('%s|%s|%s', role, active, retained)) FROM quota.usage) = ARRAY['t1|1|3']);

\connect - t2
SELECT expect_error('t2 cannot finish t1''s ticket (42501)',
    'SELECT quota.finish(' || quote_literal(:'c') || ')', '42501',
    'permission denied to finish ticket ' || :'c');
SELECT quota.start('t2 work') AS d \gset
SELECT expect('t2 gets a ticket of its own', :'d' <> '');
SELECT expect('quota.usage shows t2 only its own row',
    (SELECT array_agg(format('%s|%s|%s', role, active, retained)) FROM quota.usage) = ARRAY['t2|1|1']);

\connect - postgres
SELECT expect('the superuser sees every row of quota.usage',
    (SELECT array_agg(format('%s|%s|%s', role, active, retained) ORDER BY role::text) FROM quota.usage)
    = ARRAY['t1|1|3', 't2|1|1']);
SELECT expect('the ledger holds each ticket under its role, label and outcome',
    (SELECT array_agg(format('%s|%s|%s', role::regrole, coalesce(label, '-'), coalesce(outcome, '-'))
                      ORDER BY started_at) FROM quota.ledger)
    = ARRAY['t1|-|succeeded', 't1|labelled|failed', 't1|after finish|-', 't2|t2 work|-']);
SELECT expect('t1''s ticket is still active after t2''s refused finish',
    (SELECT ended_at IS NULL FROM quota.ledger WHERE id = :'c'));
SELECT expect('the superuser can finish anyone''s ticket', quota.finish(:'c', 'cancelled'));
-- A 0.2.0 setting on an old schema is not silently ignored: the database cap needs the
-- 0.2.0 schema, and a limited start() says to update (a superuser is never refused).
-- Skipped once the schema under test is itself 0.2.0 or later.
SELECT :'version' LIKE '0.1.%' AS old_schema \gset
\if :old_schema
ALTER ROLE t1 IN DATABASE :"DBNAME" SET quota.max_active_per_database = 5;
\connect - t1
SELECT expect_error('with quota.max_active_per_database set, start() on the old schema raises 55000 and says to update',
                    'SELECT quota.start()', '55000',
                    'quota.max_active_per_database needs the schema of pg_quota 0.2.0 or later');
SELECT expect_error('... and so does try_start()',
                    'SELECT quota.try_start()', '55000', '%0.2.0 or later');
\connect - postgres
SELECT expect('a superuser is still admitted (never refused)', quota.start('su') IS NOT NULL);
ALTER ROLE t1 IN DATABASE :"DBNAME" RESET quota.max_active_per_database;
\endif

-- quota.usage_totals() (0.5.1, 0.5.2) on the one table: the library counts each role's
-- finished tickets past the cutoff through its (role, ended_at, lease_until) index,
-- where the unended have a NULL ended_at, and may take that side as the role's finished
-- tickets less those since. t2 holds an active ticket (not among its finished ones):
-- 100 of its tickets ended 9 days ago, 1 s apart, counted at retentions that put the
-- cutoff after them (the side since, none, is the smaller: t2's unended ticket must
-- not be taken for a finished one), across them (both sides over the count's first
-- limit), and before them (no probe).
SELECT to_regprocedure('quota.usage_totals()') IS NOT NULL AS has_totals \gset
\if :has_totals
INSERT INTO quota.ledger (id, role, started_at, ended_at, outcome)
SELECT gen_random_uuid(), 't2'::regrole, now() - interval '9 days',
       now() - interval '9 days' + i * interval '1 s', 'succeeded'
  FROM generate_series(1, 100) i;
CREATE FUNCTION pg_temp.totals_agree() RETURNS boolean LANGUAGE sql AS $$
  SELECT t.active = u.a AND t.retained = u.r AND t.ledger_rows = l.n
    FROM quota.usage_totals() t,
         (SELECT coalesce(sum(active), 0) AS a, coalesce(sum(retained), 0) AS r FROM quota.usage) u,
         (SELECT count(*) AS n FROM quota.ledger) l
$$;
SELECT expect('t2 holds an active ticket', (SELECT active = 1 FROM quota.usage WHERE role = 't2'::regrole));
SELECT expect('quota.usage_totals() agrees with quota.usage and the ledger on the old schema',
              pg_temp.totals_agree());
SET quota.retention = '1 h';
SELECT expect('... at a retention of an hour',
              pg_temp.totals_agree() AND (SELECT retained < ledger_rows FROM quota.usage_totals()));
SELECT floor(extract(epoch FROM now() - min(ended_at)))::bigint - 50 || 's' AS across
  FROM quota.ledger WHERE role = 't2'::regrole AND ended_at IS NOT NULL \gset
SET quota.retention = :'across';
SELECT expect('... at a retention whose cutoff falls among t2''s 100 (' || :'across' || ')',
              pg_temp.totals_agree());
SET quota.retention = '10d';
SELECT expect('... and at one that keeps them all', pg_temp.totals_agree());
RESET quota.retention;
DELETE FROM quota.ledger WHERE started_at < now() - interval '8 days';
\endif

-- renew() (0.2.0 on): an update of an active ticket's row in place, as finish() is on
-- the one-table layouts, through the same lazily opened table (0.6.x).
SELECT to_regproc('quota.renew') IS NOT NULL AS has_renew \gset
\if :has_renew
SELECT quota.start('renewed', lease => '1 hour') AS r \gset
SELECT expect('renew() of an active ticket on the old schema returns its new lease end',
              quota.renew(:'r', '2 hours') > now() + interval '90 minutes');
SELECT expect('... and the ledger row carries it',
              (SELECT lease_until > now() + interval '90 minutes' FROM quota.ledger WHERE id = :'r'));
\endif

-- After those starts, finishes, renewals, refusals and the superuser's writes on the old
-- layout (0.1.0 to 0.5.2: one table, a finish updates its row in place; 0.6.0: a finish
-- moves it to quota.history), every btree index of pg_quota's tables holds exactly the
-- entries of the rows it covers (amcheck's bt_index_check with heapallindexed), the
-- renewed ticket's new version included: it is still active here.
CREATE EXTENSION amcheck;
SELECT expect('every index of pg_quota''s tables on the old schema passes amcheck (' ||
              string_agg(c.relname, ', ' ORDER BY c.relname) || ')',
              bool_and(bt_index_check(c.oid, true) IS NOT NULL) AND count(*) >= 3)
  FROM pg_index i
  JOIN pg_class c ON c.oid = i.indexrelid
  JOIN pg_class t ON t.oid = i.indrelid
  JOIN pg_am am ON am.oid = c.relam
 WHERE t.relnamespace = 'quota'::regnamespace AND t.relkind = 'r' AND am.amname = 'btree';
DROP EXTENSION amcheck;
\if :has_renew
SELECT expect('finish() after the renewal returns true', quota.finish(:'r'));
\endif

SELECT expect('the extension is still at version ' || :'version',
              (SELECT extversion FROM pg_extension WHERE extname = 'pg_quota') = :'version');
DROP FUNCTION public.expect_error(text, text, text, text);
DROP FUNCTION public.expect(text, boolean);
