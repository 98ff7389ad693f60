-- start() hands out tickets until the role is at its limit; finish() frees a slot.
SET quota.max_active_per_role = 2;
SET ROLE quota_alice;

SELECT quota.start('first') AS t1 \gset
SELECT quota.start('second') AS t2 \gset
-- The third is refused with 53400 ...
SELECT quota.start('third');
\echo :LAST_ERROR_SQLSTATE
-- ... and try_start says NULL instead of raising.
SELECT quota.try_start('third') IS NULL AS refused;

-- Finishing frees the slot; finishing again returns false and frees nothing.
SELECT quota.finish(:'t1');
SELECT quota.finish(:'t1');
SELECT quota.try_start('third') IS NOT NULL AS admitted;
SELECT quota.try_start('fourth') IS NULL AS refused_again;

-- Every outcome is accepted.
SELECT quota.finish(:'t2', 'failed');
SELECT quota.start() AS t4 \gset
SELECT quota.finish(:'t4', 'cancelled');

-- Ticket ids are version 7 UUIDs: time-ordered.
SELECT substr(:'t1'::text, 15, 1) AS uuid_version, :'t1'::uuid < :'t2'::uuid AS time_ordered;

RESET ROLE;
SELECT label, outcome FROM quota.ledger
 WHERE role = 'quota_alice'::regrole ORDER BY started_at;

-- The submitting role is current_user at the call site.
SET ROLE quota_bob;
SELECT quota.start('bob''s') IS NOT NULL AS admitted;
RESET ROLE;
SELECT role::regrole, label FROM quota.ledger WHERE label = 'bob''s';
