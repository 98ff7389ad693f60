-- JOBT for the recipe whose finish is a trigger (scripts/bench --citus): the enqueue as
-- in citus_jobt.sql (a force-delegated transactional start and the INSERT, in one
-- transaction), then the completion UPDATE alone, routed to the tenant's shard, whose
-- quota.finish_job() trigger finishes the ticket there in the same transaction.
\set t random(1, 1000)
BEGIN;
SELECT quota.start(tenant => 't:t', label => 'job', transactional => true) AS tk \gset
INSERT INTO tjobs (tenant, payload, ticket) VALUES ('t:t', 'job', ':tk') RETURNING id \gset
COMMIT;
UPDATE tjobs SET done_at = now() WHERE tenant = 't:t' AND id = :id;
