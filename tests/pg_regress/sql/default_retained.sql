-- 0.6.0: at quota.max_retained_per_role's default (10,000), which nothing set for the
-- role, the refusal's HINT says so and how to turn it off: a job queue that copied the
-- README's tenant example stopped after a week's 10,000 jobs with no word of why.
CREATE ROLE quota_queue;
-- A week of a queue's jobs, still active (so that the HINT names no time); no active
-- limit, so that the retained one is what refuses.
INSERT INTO quota.ledger (id, role, label, started_at)
  SELECT gen_random_uuid(), 'quota_queue'::regrole, 'job', now()
    FROM generate_series(1, 10000);
SET quota.max_active_per_role = 0;
SET ROLE quota_queue;
SELECT quota.start('job 10001');
\echo :LAST_ERROR_SQLSTATE
RESET ROLE;
-- The same limit, set for the role: the HINT of a limit someone chose.
ALTER ROLE quota_queue SET quota.max_retained_per_role = 10000;
SET ROLE quota_queue;
SELECT quota.start('job 10001');
RESET ROLE;
-- Turned off as the HINT says: admitted.
ALTER ROLE quota_queue SET quota.max_retained_per_role = 0;
SET ROLE quota_queue;
SELECT quota.start('job 10001') IS NOT NULL AS admitted;
RESET ROLE;
DELETE FROM quota.ledger WHERE role = 'quota_queue'::regrole;
ALTER ROLE quota_queue RESET ALL;
DROP ROLE quota_queue;
RESET quota.max_active_per_role;
