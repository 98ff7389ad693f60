-- 0.7.0: weighted tickets. start(weight => n) and try_start(weight => n) charge n
-- units against every limit that applies (the tenant's and the role's, active and
-- retained, and the database cap).
CREATE ROLE w_app;
ALTER ROLE w_app SET quota.max_active_per_role = 10;
ALTER ROLE w_app SET quota.max_retained_per_role = 0;

-- The overloads: the existing functions stay as they were, and the new ones take
-- weight first, without a default.
SELECT p.oid::regprocedure AS function
  FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
 WHERE n.nspname = 'quota' AND p.proname IN ('start', 'try_start')
 ORDER BY 1::text;

-- Every call without a weight resolves to the existing function, literals of unknown
-- type included (a weight first would make start('a job', '1 hour') ambiguous: the new
-- function's lease and wait are where the old one's are); a call with one to the new
-- one. A view records which function the parser picked, without calling it.
CREATE FUNCTION pg_temp.resolves(call text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    f text;
BEGIN
    EXECUTE format('CREATE TEMP VIEW w_resolve AS SELECT %s AS t', call);
    SELECT string_agg(d.refobjid::regprocedure::text, ', ') INTO f
      FROM pg_depend d JOIN pg_rewrite r ON r.oid = d.objid
     WHERE d.classid = 'pg_rewrite'::regclass AND r.ev_class = 'w_resolve'::regclass
       AND d.refclassid = 'pg_proc'::regclass;
    DROP VIEW w_resolve;
    RETURN f;
EXCEPTION WHEN ambiguous_function OR undefined_function THEN
    RETURN SQLERRM;
END
$$;
SELECT call, pg_temp.resolves(call) AS resolves_to FROM (VALUES
    ('quota.start()'),
    ('quota.start(''a job'')'),
    ('quota.start(NULL)'),
    ('quota.start(''a job'', ''1 hour'')'),
    ('quota.start(''a job'', NULL)'),
    ('quota.start(NULL, NULL, NULL, ''5 s'')'),
    ('quota.start(''a job'', ''1 hour'', ''k'', ''5 s'', ''t'', ''true'')'),
    ('quota.start(NULL, NULL, NULL, NULL, NULL, NULL)'),
    ('quota.start(label => ''a job'', tenant => ''t'')'),
    ('quota.start(''a job'', tenant => ''t'')'),
    ('quota.try_start(''a job'', ''1 hour'')'),
    ('quota.try_start(NULL, NULL, NULL, ''5 s'', ''t'')'),
    ('quota.start(weight => 2)'),
    ('quota.start(2)'),
    ('quota.start(2, label => ''a job'')'),
    ('quota.start(weight => 2, label => ''a job'', tenant => ''t'', transactional => false)'),
    ('quota.try_start(weight => 2, idempotency_key => ''k'')')) v(call);
SET ROLE w_app;
SELECT quota.finish(quota.start()) AS plain,
       quota.finish(quota.start('a label')) AS label_positional,
       quota.finish(quota.start('a label', '1 hour')) AS label_and_lease,
       quota.finish(quota.try_start('x')) AS try_positional;
-- A parameter typed text is a label, one typed int a weight.
PREPARE w_text(text) AS SELECT quota.start($1);
PREPARE w_int(int) AS SELECT quota.start($1);
EXECUTE w_text('by text') \gset
EXECUTE w_int(3) \gset
SELECT label, weight FROM quota.tickets WHERE ended_at IS NULL ORDER BY started_at;
SELECT quota.finish(id) FROM quota.tickets WHERE ended_at IS NULL;
DEALLOCATE ALL;

-- The weighted overloads take the plain ones' privileges as well: a DBA's REVOKE of
-- the plain start() (made before the update, or restored from an older dump, where it
-- names only the plain function) holds for start(weight => …) too.
RESET ROLE;
REVOKE EXECUTE ON FUNCTION quota.start(text, interval, text, interval, text, boolean) FROM PUBLIC;
SET ROLE w_app;
SELECT quota.start(weight => 1);
\echo :LAST_ERROR_SQLSTATE
SELECT quota.try_start(weight => 1) IS NOT NULL AS try_start_still_allowed;
RESET ROLE;
GRANT EXECUTE ON FUNCTION quota.start(text, interval, text, interval, text, boolean) TO PUBLIC;
SET ROLE w_app;
SELECT quota.finish(id) FROM quota.tickets WHERE role = 'w_app'::regrole AND ended_at IS NULL;

-- Bad weights: 22023, and 22004 for NULL.
SELECT quota.start(weight => 0);
\echo :LAST_ERROR_SQLSTATE
SELECT quota.start(weight => -1);
\echo :LAST_ERROR_SQLSTATE
\set VERBOSITY verbose
SELECT quota.try_start(weight => 1000001);
\set VERBOSITY default
\echo :LAST_ERROR_SQLSTATE
SELECT quota.start(weight => NULL);
\echo :LAST_ERROR_SQLSTATE

-- Units against the role's limit of 10: 8 fit, then 3 do not, then 2 do.
SELECT quota.start(weight => 8, label => 'heavy') IS NOT NULL AS heavy_8;
SELECT quota.try_start(weight => 3) IS NULL AS three_more_refused;
\set VERBOSITY verbose
SELECT quota.start(weight => 3);
\set VERBOSITY default
SELECT quota.try_start(weight => 2, label => 'light') IS NOT NULL AS two_more;
SELECT quota.try_start() IS NULL AS even_one_refused;
-- The views count units, active and retained; quota.tickets shows each ticket's
-- weight.
SELECT active, retained FROM quota.usage WHERE role = 'w_app'::regrole;
SELECT label, weight FROM quota.tickets WHERE role = 'w_app'::regrole AND ended_at IS NULL
 ORDER BY weight;
RESET ROLE;
SELECT weight FROM quota.active WHERE role = 'w_app'::regrole ORDER BY weight NULLS FIRST;
SET ROLE w_app;

-- Finishing the heavy ticket frees its 8 units at once.
SELECT quota.finish(id) FROM quota.tickets WHERE label = 'heavy' AND ended_at IS NULL;
SELECT quota.try_start(weight => 8) IS NOT NULL AS heavy_again;
SELECT quota.try_start() IS NULL AS full_again;

-- A weight above a limit that applies can never fit: 53400 at once, even with a wait,
-- and from try_start() too (waiting or retrying cannot help).
\set VERBOSITY verbose
SELECT quota.start(weight => 11, wait => '1 hour');
\set VERBOSITY default
\echo :LAST_ERROR_SQLSTATE
SELECT quota.try_start(weight => 11);
\echo :LAST_ERROR_SQLSTATE
SELECT refused_active >= 1 AS counted_as_refusals FROM quota.stats WHERE role = 'w_app';
RESET ROLE;
-- Superusers are never refused (I7), whatever the weight; their tickets are counted.
SET quota.max_active_per_role = 1;
SELECT quota.finish(quota.start(weight => 50)) AS superuser_50;
RESET quota.max_active_per_role;
SET ROLE w_app;
SELECT quota.finish(id) FROM quota.tickets WHERE role = 'w_app'::regrole AND ended_at IS NULL;

-- A lease that runs out frees the ticket's units, before the sweep writes it down.
SELECT quota.start(weight => 9, lease => '1 millisecond') IS NOT NULL AS leased_9;
SELECT pg_sleep(0.05);
SELECT quota.try_start(weight => 10) IS NOT NULL AS ten_after_lapse;
SELECT quota.finish(id) FROM quota.tickets WHERE role = 'w_app'::regrole AND ended_at IS NULL;
-- The writer's sweep writes the lapsed ticket down as expired; quota.stats counts it as
-- one expired ticket, not as its 9 units.
RESET ROLE;
DO $$
BEGIN
  FOR i IN 1..1000 LOOP
    EXIT WHEN EXISTS (SELECT FROM quota.history
                       WHERE role = 'w_app'::regrole AND outcome = 'expired');
    PERFORM pg_sleep(0.01);
  END LOOP;
END $$;
SELECT outcome, weight FROM quota.history WHERE role = 'w_app'::regrole AND outcome = 'expired';
SELECT expired FROM quota.stats WHERE role = 'w_app';
SET ROLE w_app;

-- Idempotent repeats: the same weight gets the same ticket; another raises 22023 and
-- charges nothing.
SELECT quota.start(weight => 4, idempotency_key => 'job-1') AS first \gset
SELECT quota.start(weight => 4, idempotency_key => 'job-1') = :'first' AS same_ticket;
-- (The messages name the ticket, whose id changes from run to run: cargo test checks
-- them.)
\set VERBOSITY sqlstate
SELECT quota.start(idempotency_key => 'job-1');
SELECT quota.start(weight => 5, idempotency_key => 'job-1') IS NOT NULL;
\set VERBOSITY default
SELECT active FROM quota.usage WHERE role = 'w_app'::regrole;
SELECT quota.finish(:'first');
-- A retry of a start whose limit was lowered below its weight since gets its ticket,
-- not "can never fit": the first start charged it, and the retry must say so. A new
-- start of that weight is refused at once.
SELECT quota.start(weight => 8, idempotency_key => 'job-2') AS second \gset
RESET ROLE;
ALTER ROLE w_app SET quota.max_active_per_role = 5;
SET ROLE w_app;
SELECT quota.start(weight => 8, idempotency_key => 'job-2') = :'second' AS retry_after_lowering;
SELECT quota.start(weight => 8, idempotency_key => 'job-3');
\echo :LAST_ERROR_SQLSTATE
RESET ROLE;
ALTER ROLE w_app SET quota.max_active_per_role = 10;
SET ROLE w_app;
SELECT quota.finish(:'second');

-- A tenant's limit counts units too: 4 for each tenant of w_app.
RESET ROLE;
ALTER ROLE w_app SET quota.max_active_per_tenant = 4;
SET ROLE w_app;
SELECT quota.try_start(weight => 3, tenant => 'acme') IS NOT NULL AS acme_3;
SELECT quota.try_start(weight => 2, tenant => 'acme') IS NULL AS acme_2_more_refused;
\set VERBOSITY verbose
SELECT quota.start(weight => 2, tenant => 'acme');
SELECT quota.start(weight => 5, tenant => 'acme');
\set VERBOSITY default
SELECT quota.try_start(weight => 4, tenant => 'other') IS NOT NULL AS other_4;
-- The role holds 7 of 10 units: a tenant with room still cannot take 4.
SELECT quota.try_start(weight => 4, tenant => 'third') IS NULL AS role_full_for_4;
SELECT tenant, active, retained FROM quota.tenant_usage
 WHERE role = 'w_app'::regrole ORDER BY tenant;
SELECT quota.finish(id) FROM quota.tickets WHERE role = 'w_app'::regrole AND ended_at IS NULL;

-- Transactional starts: the charge's units count until its transaction ends, and a
-- rollback (of the transaction or of a savepoint) gives them back.
RESET ROLE;
ALTER ROLE w_app SET quota.allow_transactional = on;
SET ROLE w_app;
BEGIN;
SELECT quota.start(weight => 6, transactional => true) IS NOT NULL AS txn_6;
SELECT quota.try_start(weight => 5) IS NULL AS five_refused_meanwhile;
SAVEPOINT s;
SELECT quota.start(weight => 4, transactional => true) IS NOT NULL AS txn_4;
SELECT quota.try_start() IS NULL AS full_in_savepoint;
ROLLBACK TO SAVEPOINT s;
SELECT quota.try_start(weight => 4, transactional => true) IS NOT NULL AS four_after_savepoint;
ROLLBACK;
SELECT quota.try_start(weight => 10, transactional => true) IS NOT NULL AS ten_after_rollback;
SELECT active FROM quota.usage WHERE role = 'w_app'::regrole;
SELECT quota.finish(id) FROM quota.tickets WHERE role = 'w_app'::regrole AND ended_at IS NULL;
RESET ROLE;

-- The database cap counts units: with room for 5 more units, 5 fit and then 1 does not.
-- (The numbers in its messages are the database's, which other tests' tickets are in.)
SELECT set_config('quota.max_active_per_database', (active + 5)::text, false) AS cap
  FROM quota.usage_totals() \gset
SET ROLE w_app;
SELECT quota.try_start(weight => 5) IS NOT NULL AS five_under_cap;
SELECT quota.try_start() IS NULL AS cap_full;
-- The role has room for 4 more, the database for none.
DO $$
BEGIN
    PERFORM quota.start(weight => 4);
EXCEPTION WHEN configuration_limit_exceeded THEN
    RAISE NOTICE '%', regexp_replace(SQLERRM, '\d+', 'N', 'g');
END
$$;
RESET ROLE;
SELECT active = :cap AS totals_count_units FROM quota.usage_totals();
RESET quota.max_active_per_database;

-- Retained limits count units too: an ended ticket keeps its weight's units until it
-- ages out, and a start fits only where its weight's units are free.
SELECT retained AS retained_before, ledger_rows AS rows_before FROM quota.usage_totals() \gset
CREATE ROLE w_ret;
ALTER ROLE w_ret SET quota.max_active_per_role = 0;
ALTER ROLE w_ret SET quota.max_retained_per_role = 10;
ALTER ROLE w_ret SET quota.max_retained_per_tenant = 6;
ALTER ROLE w_ret SET quota.allow_transactional = on;
-- A refusal's message and HINT, its time masked.
CREATE FUNCTION pg_temp.refusal(weight int) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    msg text;
    hint text;
BEGIN
    PERFORM quota.start(weight => weight);
    RETURN 'admitted';
EXCEPTION WHEN configuration_limit_exceeded THEN
    GET STACKED DIAGNOSTICS msg = MESSAGE_TEXT, hint = PG_EXCEPTION_HINT;
    RETURN msg || E'\nHINT: ' || regexp_replace(hint, 'at [0-9][^,]*, when', 'at T, when');
END
$$;
-- The instant a refusal's HINT names.
CREATE FUNCTION pg_temp.refusal_at(weight int) RETURNS timestamptz LANGUAGE plpgsql AS $$
DECLARE
    hint text;
BEGIN
    PERFORM quota.start(weight => weight);
    RETURN NULL;
EXCEPTION WHEN configuration_limit_exceeded THEN
    GET STACKED DIAGNOSTICS hint = PG_EXCEPTION_HINT;
    RETURN (regexp_match(hint, 'returns at ([^,]*), when'))[1]::timestamptz;
END
$$;
SET ROLE w_ret;
SELECT quota.finish(quota.start(weight => 1, label => 'a1')) AS ended_1;
SELECT quota.finish(quota.start(weight => 3, label => 'b3')) AS ended_3;
SELECT quota.try_start(weight => 5) IS NOT NULL AS five_more;
SELECT quota.try_start(weight => 2) IS NULL AS two_refused_at_9_of_10;
SELECT quota.try_start() IS NOT NULL AS one_fits;
SELECT quota.try_start() IS NULL AS full;
-- 10 of 10: a start of weight 2 needs 2 units to age out: the ended tickets' 1 and 3,
-- so when b3 ages out; one of weight 1 when a1 does; one of weight 7 needs 7, which
-- aging out cannot free while 6 are active.
SELECT pg_temp.refusal(2);
SELECT pg_temp.refusal_at(2) = (SELECT ended_at + interval '168 hours' FROM quota.tickets WHERE label = 'b3')
       AS returns_when_b3_ages_out;
SELECT pg_temp.refusal_at(1) = (SELECT ended_at + interval '168 hours' FROM quota.tickets WHERE label = 'a1')
       AS weight_1_returns_when_a1_ages_out;
SELECT pg_temp.refusal(7);
-- Above the retained limit: it can never fit.
DO $$
BEGIN
    PERFORM quota.start(weight => 11, wait => '1 hour');
EXCEPTION WHEN configuration_limit_exceeded THEN
    RAISE NOTICE '%', SQLERRM;
END
$$;
SELECT active, retained FROM quota.usage WHERE role = 'w_ret'::regrole;
-- A rolled-back transactional start gives its retained units back.
RESET ROLE;
ALTER ROLE w_ret SET quota.max_retained_per_role = 20;
SET ROLE w_ret;
BEGIN;
SELECT quota.start(weight => 9, transactional => true) IS NOT NULL AS txn_9;
SELECT quota.try_start(weight => 2) IS NULL AS refused_at_19_of_20;
ROLLBACK;
SELECT quota.try_start(weight => 9) IS NOT NULL AS nine_after_rollback;
-- A committed one keeps them: 29 of 30 after a committed start of weight 10.
RESET ROLE;
ALTER ROLE w_ret SET quota.max_retained_per_role = 30;
SET ROLE w_ret;
BEGIN;
SELECT quota.start(weight => 10, transactional => true) IS NOT NULL AS txn_10;
COMMIT;
SELECT quota.try_start(weight => 2) IS NULL AS refused_at_29_of_30;
SELECT quota.try_start() IS NOT NULL AS one_fits_at_29;
RESET ROLE;
ALTER ROLE w_ret SET quota.max_retained_per_role = 0;
SET ROLE w_ret;
-- A tenant's retained limit, the setting's and its own.
SELECT quota.finish(quota.start(weight => 3, tenant => 'acme')) AS acme_ended_3;
SELECT quota.try_start(weight => 4, tenant => 'acme') IS NULL AS acme_4_refused;
SELECT quota.try_start(weight => 3, tenant => 'acme') IS NOT NULL AS acme_3_fits;
SELECT tenant, active, retained FROM quota.tenant_usage
 WHERE role = 'w_ret'::regrole ORDER BY tenant;
RESET ROLE;
SELECT quota.set_tenant_limits('small', max_retained => 4, role => 'w_ret');
SET ROLE w_ret;
DO $$
BEGIN
    PERFORM quota.start(weight => 5, tenant => 'small');
EXCEPTION WHEN configuration_limit_exceeded THEN
    RAISE NOTICE '%', SQLERRM;
END
$$;
SELECT quota.try_start(weight => 4, tenant => 'small') IS NOT NULL AS small_4_fits;
SELECT quota.try_start(tenant => 'small') IS NULL AS small_full_at_its_own_4;
RESET ROLE;
SELECT role::text, retained FROM quota.usage WHERE role = 'w_ret'::regrole;
-- quota.usage_totals() counts the same units (its retained and ledger_rows).
SELECT retained - :retained_before AS totals_retained, ledger_rows - :rows_before AS totals_rows
  FROM quota.usage_totals();
DELETE FROM quota.ledger WHERE role = 'w_ret'::regrole;
SELECT quota.set_tenant_limits('small', role => 'w_ret');
ALTER ROLE w_ret RESET ALL;
DROP ROLE w_ret;

-- Retained units age out with their tickets, all of a ticket's units at once, whether
-- it was finished or its lease ran out.
CREATE ROLE w_age;
ALTER ROLE w_age SET quota.max_active_per_role = 0;
ALTER ROLE w_age SET quota.max_retained_per_role = 10;
ALTER ROLE w_age SET quota.retention = '1h';
SET ROLE w_age;
SELECT quota.finish(quota.start(weight => 6)) AS ended_6;
SELECT quota.try_start(weight => 3, label => 'held') IS NOT NULL AS held_3;
SELECT quota.try_start(weight => 2) IS NULL AS two_refused_at_9_of_10;
-- The retention shortened to 3 s (a role's limits and retention follow its settings
-- at each call).
RESET ROLE;
ALTER ROLE w_age SET quota.retention = '3s';
SET ROLE w_age;
SELECT quota.start(weight => 1, lease => '1 second') IS NOT NULL AS lapses_1;
RESET ROLE;
-- After the retention (and the lease): only the 3 held count. quota.usage counts at
-- the reading session's quota.retention.
SET quota.retention = '3s';
SELECT pg_sleep(5);
SELECT retained FROM quota.usage WHERE role = 'w_age'::regrole;
-- quota.usage_totals() agrees, through its units of lapsed leases and ended tickets
-- past the cutoff (every other ticket in the database ended more than 5 s ago, or is
-- active).
SELECT (SELECT retained FROM quota.usage_totals()) = (SELECT sum(retained) FROM quota.usage)
       AS totals_agree;
SET ROLE w_age;
SELECT quota.try_start(weight => 7) IS NOT NULL AS seven_fit_at_3_of_10;
SELECT quota.try_start() IS NULL AS full_again;
RESET ROLE;
RESET quota.retention;
DELETE FROM quota.ledger WHERE role = 'w_age'::regrole;
ALTER ROLE w_age RESET ALL;
DROP ROLE w_age;

-- Clean up.
DELETE FROM quota.ledger WHERE role = 'w_app'::regrole;
ALTER ROLE w_app RESET ALL;
DROP ROLE w_app;
