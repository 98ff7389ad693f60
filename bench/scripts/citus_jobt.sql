-- JOBT on a cluster (scripts/bench --citus): JOB admitted by pg_quota's recipe for
-- Citus (USER_GUIDE "Citus"): a transactional start alone in its statement (Citus runs
-- it on the tenant's node, force-delegated) and the job's INSERT in one transaction;
-- the completion UPDATE and finish_for() (distributed by tenant) in another. The same
-- script runs on the single node, where finish_for() is a plain function.
\set t random(1, 1000)
BEGIN;
SELECT quota.start(tenant => 't:t', label => 'job', transactional => true) AS tk \gset
INSERT INTO jobs (tenant, payload, ticket) VALUES ('t:t', 'job', ':tk') RETURNING id \gset
COMMIT;
BEGIN;
UPDATE jobs SET done_at = now() WHERE tenant = 't:t' AND id = :id;
SELECT finish_for('t:t', ':tk');
COMMIT;
