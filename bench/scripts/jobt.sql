-- JOBT: the job lifecycle with a transactional start (0.5.0) in the enqueue statement
-- and finish() in the completion statement: the charge commits with the job's row.
INSERT INTO bench.jobs (payload, ticket) VALUES ('job', quota.start('job', transactional => true)) RETURNING id \gset
UPDATE bench.jobs SET done_at = now(), released = quota.finish(ticket) WHERE id = :id;
