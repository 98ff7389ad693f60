-- JOB on a cluster (scripts/bench --citus): a job's bare life in a table distributed
-- by tenant, for a tenant drawn from 1,000: the enqueue INSERT, then the completion
-- UPDATE, each in its own transaction. The same script runs on the single node.
\set t random(1, 1000)
INSERT INTO jobs (tenant, payload) VALUES ('t:t', 'job') RETURNING id \gset
UPDATE jobs SET done_at = now() WHERE tenant = 't:t' AND id = :id;
