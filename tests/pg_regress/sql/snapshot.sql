-- I3: counting and finishing use the latest committed state, not the caller's
-- transaction snapshot. Tickets are committed by the ledger writer, that is, by
-- another transaction, after the snapshot below was taken. (tests/isolation has the
-- same with other sessions' tickets.)
SET quota.max_active_per_role = 3;
SET ROLE quota_dave;

-- repeatable_read_sees_current_count
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT count(*) AS rows_in_snapshot FROM quota.usage;
SELECT quota.start('rr 1') AS t1 \gset
-- The snapshot cannot see the ticket ...
SELECT count(*) AS rows_in_snapshot FROM quota.usage;
-- ... but finish finds it. The finish is not committed yet, so the ticket still
-- counts as active (I2) ...
SELECT quota.finish(:'t1');
SELECT quota.start('rr 2') IS NOT NULL AS admitted;
SELECT quota.start('rr 3') IS NOT NULL AS admitted;
-- ... and admission counts all three.
SELECT quota.try_start('rr 4') IS NULL AS refused;
COMMIT;
-- Once the finish commits, its slot is free.
SELECT quota.try_start('rr 5') IS NOT NULL AS admitted;

-- serializable_sees_current_count
RESET ROLE;
SET quota.max_active_per_role = 4;
SET ROLE quota_dave;
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT active FROM quota.usage;
SELECT quota.start('ser 1') AS t2 \gset
SELECT active FROM quota.usage;
SELECT quota.try_start('ser 2') IS NULL AS refused;
SELECT quota.finish(:'t2');
COMMIT;
SELECT quota.try_start('ser 3') IS NOT NULL AS admitted;
