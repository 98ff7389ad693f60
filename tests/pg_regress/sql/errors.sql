-- Bad input gets a clear error with a fitting SQLSTATE and changes nothing.
SET ROLE quota_bob;

-- 22004: NULL ticket or outcome.
SELECT quota.finish(NULL);
\echo :LAST_ERROR_SQLSTATE
SELECT quota.start() AS t \gset
SELECT quota.finish(:'t', NULL);
\echo :LAST_ERROR_SQLSTATE

-- 22023: an outcome that does not exist (matching is exact), an unknown ticket.
SELECT quota.finish(:'t', 'Succeeded');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.finish(:'t', 'expired');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.finish('00000000-0000-0000-0000-000000000000');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.finish('not a uuid');
\echo :LAST_ERROR_SQLSTATE

-- The ticket is still active after all that, and finishes normally.
SELECT quota.finish(:'t');

-- 22001: labels are at most 200 characters (characters, not bytes).
SELECT quota.start(repeat('ü', 200)) IS NOT NULL AS admitted_200;
SELECT quota.start(repeat('x', 201));
\echo :LAST_ERROR_SQLSTATE
SELECT quota.try_start(repeat('x', 201));
\echo :LAST_ERROR_SQLSTATE
-- An empty label is a label; NULL is none.
SELECT quota.start('') IS NOT NULL AS admitted_empty;
RESET ROLE;
SELECT count(*) FILTER (WHERE label = '') AS empty, count(*) FILTER (WHERE label IS NULL) AS unlabelled
  FROM quota.ledger WHERE role = 'quota_bob'::regrole;
