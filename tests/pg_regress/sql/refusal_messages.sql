-- I8: a refusal raises 53400; the message names the role, the count and the GUC,
-- DETAIL gives the numbers, HINT says what to do and when capacity returns.
\set VERBOSITY default
SET quota.max_active_per_role = 1;
SET quota.max_retained_per_role = 3;
SET quota.retention = '1h';
SET ROLE quota_frank;
-- frank holds one ticket from the wrapper test.
SELECT quota.start('over');
\echo :LAST_ERROR_SQLSTATE

-- At the retained limit with ended tickets, the hint says when the oldest ages out.
RESET ROLE;
SET quota.max_active_per_role = 0;
SET ROLE quota_frank;
SELECT quota.finish(id) FROM (SELECT quota.start('r1') AS id) s;
SELECT quota.finish(id) FROM (SELECT quota.start('r2') AS id) s;
DO $$
DECLARE msg text; det text; hnt text;
BEGIN
  PERFORM quota.start('r3');
EXCEPTION WHEN configuration_limit_exceeded THEN
  GET STACKED DIAGNOSTICS msg = MESSAGE_TEXT, det = PG_EXCEPTION_DETAIL, hnt = PG_EXCEPTION_HINT;
  RAISE NOTICE 'message: %', msg;
  RAISE NOTICE 'detail: %', det;
  RAISE NOTICE 'hint: %', regexp_replace(hnt, '\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?[+-]\d\d', '<an hour after the first finish>');
END $$;

-- With retention 0, ended tickets stop counting at once.
RESET ROLE;
SET quota.retention = 0;
SET ROLE quota_frank;
SELECT quota.start('r3') IS NOT NULL AS admitted;

-- At the retained limit with every retained ticket still active. Retention 0 again:
-- r1 and r2 are still in the ledger (the purge keeps what the server's 7-day
-- retention counts), but in this window only the active tickets count.
RESET ROLE;
SET quota.max_retained_per_role = 2;
SET quota.retention = 0;
SET ROLE quota_frank;
SELECT quota.start('r4');
