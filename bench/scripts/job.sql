-- JOB: a job's bare life in an application's queue table, the floor the two guarded
-- lifecycles are measured against: the enqueue INSERT, then the completion UPDATE,
-- each in its own transaction.
INSERT INTO bench.jobs (payload) VALUES ('job') RETURNING id \gset
UPDATE bench.jobs SET done_at = now() WHERE id = :id;
