-- JOB for the recipe whose finish is a trigger (scripts/bench --citus): citus_job.sql
-- on tjobs, whose finish_job() trigger (bench/citus_setup.sql) does not fire for a job
-- without a ticket. The same on the single node.
\set t random(1, 1000)
INSERT INTO tjobs (tenant, payload) VALUES ('t:t', 'job') RETURNING id \gset
UPDATE tjobs SET done_at = now() WHERE tenant = 't:t' AND id = :id;
