-- 0.5.1: quota.usage_totals(), the database's active and retained tickets and its
-- ledger rows, counted from the summary and the indexes rather than from the retained
-- history. Whatever the tests before left in the ledger (writer-committed tickets,
-- tenants', transactional ones folded or not, finished, lapsed), it must agree with
-- quota.usage summed over roles and with a count of the ledger.
SELECT pg_get_function_arguments('quota.usage_totals()'::regprocedure);

CREATE FUNCTION pg_temp.agree() RETURNS TABLE (active boolean, retained boolean, ledger_rows boolean)
LANGUAGE sql AS $$
  SELECT t.active = u.active, t.retained = u.retained, t.ledger_rows = l.n
    FROM quota.usage_totals() t,
         (SELECT coalesce(sum(active), 0) AS active, coalesce(sum(retained), 0) AS retained
            FROM quota.usage) u,
         (SELECT count(*) AS n FROM quota.ledger) l
$$;
SELECT (SELECT count(*) FROM quota.ledger) > 0 AS ledger_has_tickets;
SELECT * FROM pg_temp.agree();

-- Some active tickets of a new role, a tenant's among them, and a transactional one,
-- not folded yet; then each retention.
CREATE ROLE ut_role;
SET ROLE ut_role;
SELECT quota.start('a', lease => '1 h') AS ut1 \gset
SELECT quota.start('b', tenant => 'acme') AS ut2 \gset
SELECT quota.finish(quota.start('c'));
RESET ROLE;
SET quota.allow_transactional = on;
SELECT active AS active_before FROM quota.usage_totals() \gset
BEGIN;
SET LOCAL ROLE ut_role;
SELECT quota.start('d', tenant => 'acme', transactional => true) IS NOT NULL AS charged;
RESET ROLE;
-- Its own transaction sees its uncommitted ticket, as quota.usage does.
SELECT * FROM pg_temp.agree();
SELECT t.active = :active_before + 1 AS counts_its_own FROM quota.usage_totals() t;
COMMIT;
RESET quota.allow_transactional;
SELECT * FROM pg_temp.agree();
SET quota.retention = 0;
SELECT * FROM pg_temp.agree();
SELECT t.retained = t.active AS only_active_retained FROM quota.usage_totals() t;
RESET quota.retention;

-- History past the reading session's retention that the writer has not purged (it
-- keeps it for the longest retention configured; this session's is shorter), written
-- by SQL: the trigger empties the summary, and every role is counted from the ledger
-- until the writer rebuilds its summary row. More of it than the first limit of
-- usage_totals()' count (1,024), so that it counts the other side of the cutoff and
-- takes it from the role's finished tickets (its active ones not among them).
INSERT INTO quota.ledger (id, role, started_at, ended_at, outcome)
SELECT gen_random_uuid(), 'ut_role', now() - interval '3 days', now() - interval '3 days' + i * interval '1 s', 'succeeded'
  FROM generate_series(1, 2000) i;
SELECT count(*) AS summary_rows FROM quota.summary;
SELECT * FROM pg_temp.agree();
SET quota.retention = '1d';
SELECT * FROM pg_temp.agree();
SELECT t.ledger_rows - t.retained >= 2000 AS history_not_retained FROM quota.usage_totals() t;
RESET quota.retention;
-- An admission asks the writer to rebuild the summary; the totals agree before and
-- after it does.
SET ROLE ut_role;
SELECT quota.finish(quota.start('e'));
RESET ROLE;
SELECT * FROM pg_temp.agree();

-- A lease that ran out counts as ended at lease_until, as in quota.usage.
SET ROLE ut_role;
SELECT quota.start('short', lease => '10 ms') IS NOT NULL AS started;
RESET ROLE;
SELECT pg_sleep(0.05);
SELECT * FROM pg_temp.agree();
SET quota.retention = 0;
SELECT * FROM pg_temp.agree();
RESET quota.retention;

-- The totals cover every role: only members of pg_read_all_stats (pg_monitor) and
-- superusers may call it.
SET ROLE ut_role;
SELECT * FROM quota.usage_totals();
RESET ROLE;
CREATE ROLE ut_monitor IN ROLE pg_monitor;
SET ROLE ut_monitor;
SELECT t.active >= 2 AS sees_all FROM quota.usage_totals() t;
RESET ROLE;

SELECT quota.finish(:'ut1'), quota.finish(:'ut2');
SELECT * FROM pg_temp.agree();
