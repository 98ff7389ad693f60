-- JOBQ: the same life guarded by pg_quota: quota.start() in the enqueue statement,
-- quota.finish() in the completion statement.
INSERT INTO bench.jobs (payload, ticket) VALUES ('job', quota.start('job')) RETURNING id \gset
UPDATE bench.jobs SET done_at = now(), released = quota.finish(ticket) WHERE id = :id;
