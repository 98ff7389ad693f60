-- JOB1: the same life guarded by B1 (bench/setup.sql): the guard's start in the
-- enqueue statement, its finish in the completion statement.
INSERT INTO bench.jobs (payload, guard) VALUES ('job', bench.b1_start()) RETURNING id \gset
UPDATE bench.jobs SET done_at = now(), released = bench.b1_finish(guard) WHERE id = :id;
