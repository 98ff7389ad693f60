-- JOB in transaction blocks (scripts/bench --citus): citus_job.sql's INSERT and UPDATE,
-- each in a transaction block as citus_jobt.sql has them, without pg_quota's calls.
-- Against citus_jobt.sql it leaves out what a transaction block itself costs (on a
-- cluster, Citus' remote transaction: BEGIN and its distributed transaction id on the
-- tenant's node), which the plain JOB does not pay: what remains is pg_quota's calls.
\set t random(1, 1000)
BEGIN;
INSERT INTO jobs (tenant, payload) VALUES ('t:t', 'job') RETURNING id \gset
COMMIT;
BEGIN;
UPDATE jobs SET done_at = now() WHERE tenant = 't:t' AND id = :id;
COMMIT;
