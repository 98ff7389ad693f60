-- 0.6.0: a try_start() refused at an active limit whose scope counter is live reads
-- shared memory only: it scans none of pg_quota's relations (pg_stat_xact_all_tables,
-- in its transaction, after what earlier ones counted is flushed). The first refusal
-- of the scope counts from the ledger once (it builds the counter, and finds when its
-- tickets' leases end); the ones after it need nothing else.
CREATE ROLE quota_busy;
SET quota.max_active_per_role = 2;
SET quota.max_retained_per_role = 0;
SET ROLE quota_busy;
SELECT count(quota.start('busy')) AS admitted FROM generate_series(1, 2);
SELECT quota.try_start('over') IS NULL AS refused;
-- 0.7.0: a backend's first start of a tenant reads the tenant's own limits once
-- (quota.tenant_overrides, tenant_limits); the ones after it read its cache.
SELECT quota.try_start('over', tenant => 'acme') IS NULL AS refused_with_a_tenant;
SELECT pg_stat_force_next_flush();
BEGIN;
SELECT quota.try_start('over') IS NULL AS refused;
SELECT quota.try_start('over', tenant => 'acme') IS NULL AS refused_with_a_tenant;
SELECT coalesce(sum(seq_scan + coalesce(idx_scan, 0)), 0) AS scans_of_quota_relations
  FROM pg_stat_xact_all_tables WHERE schemaname = 'quota';
COMMIT;

-- 0.6.1: no index of quota.active is in lease order, so finding a scope's lapsed
-- leases means reading all of its active tickets. Where its counter knows that none
-- ran out, nothing does: neither start()'s error, which counts its numbers from the
-- ledger, nor a start that waits, on each of its looks (at the counters) and for when
-- to look again. Neither fetches a row of quota.active.
SELECT pg_stat_force_next_flush();
BEGIN;
DO $$ BEGIN PERFORM quota.start('over'); EXCEPTION WHEN sqlstate '53400' THEN NULL; END $$;
SELECT quota.try_start('over', wait => '300 ms') IS NULL AS refused_after_waiting;
SELECT coalesce(sum(idx_tup_fetch), 0) AS rows_of_quota_active_fetched
  FROM pg_stat_xact_all_tables WHERE relid = 'quota.active'::regclass;
COMMIT;

-- A tenant's active limit, the same way.
RESET ROLE;
SET quota.max_active_per_role = 10;
SET quota.max_active_per_tenant = 1;
SET ROLE quota_busy;
SELECT quota.start('acme''s', tenant => 'acme') IS NOT NULL AS admitted;
SELECT quota.try_start('acme''s', tenant => 'acme') IS NULL AS refused;
SELECT pg_stat_force_next_flush();
BEGIN;
SELECT quota.try_start('acme''s', tenant => 'acme') IS NULL AS refused;
SELECT coalesce(sum(seq_scan + coalesce(idx_scan, 0)), 0) AS scans_of_quota_relations
  FROM pg_stat_xact_all_tables WHERE schemaname = 'quota';
COMMIT;
-- start() reads the ledger for its error's numbers, as before.
SELECT quota.start('acme''s', tenant => 'acme');

-- A lease that runs out frees its slot as before: a renew() that shortens it is seen
-- by the refusals that read the counter (which would otherwise wait for the old lease).
SELECT id AS acme_ticket, lease_until AS old_until FROM quota.tickets
 WHERE tenant = 'acme' AND ended_at IS NULL \gset
SELECT quota.renew(:'acme_ticket', '100 ms') < :'old_until'::timestamptz AS shortened;
SELECT pg_sleep_until(lease_until + interval '50 ms') FROM quota.tickets WHERE id = :'acme_ticket';
SELECT quota.try_start('acme''s', tenant => 'acme') IS NOT NULL AS admitted_once_the_lease_ran_out;
RESET ROLE;
SELECT count(*) FILTER (WHERE quota.finish(id)) AS finished FROM quota.ledger
 WHERE role = 'quota_busy'::regrole AND ended_at IS NULL;
RESET quota.max_active_per_role;
RESET quota.max_retained_per_role;
RESET quota.max_active_per_tenant;

-- 0.6.1: a counter's earliest lease end only goes down as tickets come and are
-- renewed, so once a lease it knew of has passed it knows nothing more, whether that
-- ticket is still there or not. The first walk of the scope's tickets that finds no
-- lease run out tells it the earliest still to come, and the looks after it need no
-- walk. Here the lease it knew of was renewed to 100 ms and then finished; at the
-- retained limit, two start()s refused: the first walks quota.active's two tickets
-- twice (its refusal's walk tells the counter no more than that 100 ms lease, applied
-- since the counter last learnt one and passed since; its numbers' walk then tells it
-- the leases to come), the second none.
CREATE ROLE quota_kept;
SET quota.max_active_per_role = 10;
SET quota.max_retained_per_role = 3;
SET ROLE quota_kept;
SELECT count(quota.start('kept')) AS admitted FROM generate_series(1, 2);
SELECT quota.start('brief') AS brief \gset
SELECT quota.renew(:'brief', '100 ms') IS NOT NULL AS renewed_to_100_ms;
SELECT quota.finish(:'brief') AS finished;
SELECT pg_sleep(0.2);
SELECT pg_stat_force_next_flush();
BEGIN;
DO $$ BEGIN PERFORM quota.start('over'); EXCEPTION WHEN sqlstate '53400' THEN NULL; END $$;
SELECT coalesce(sum(idx_tup_fetch), 0) AS fetched_by_the_first
  FROM pg_stat_xact_all_tables WHERE relid = 'quota.active'::regclass;
DO $$ BEGIN PERFORM quota.start('over'); EXCEPTION WHEN sqlstate '53400' THEN NULL; END $$;
SELECT coalesce(sum(idx_tup_fetch), 0) AS fetched_by_both
  FROM pg_stat_xact_all_tables WHERE relid = 'quota.active'::regclass;
COMMIT;
RESET ROLE;
SELECT count(*) FILTER (WHERE quota.finish(id)) AS finished FROM quota.ledger
 WHERE role = 'quota_kept'::regrole AND ended_at IS NULL;
RESET quota.max_active_per_role;
RESET quota.max_retained_per_role;
DROP ROLE quota_kept;

-- PREPARE TRANSACTION after a renew() is refused (0A000), as after a finish(): COMMIT
-- PREPARED would shorten a lease where nothing tells the scope counters.
SET ROLE quota_busy;
SELECT quota.start('to renew') AS to_renew \gset
BEGIN;
SELECT quota.renew(:'to_renew', '1 hour') IS NOT NULL AS renewed;
PREPARE TRANSACTION 'renewed';
\echo :LAST_ERROR_SQLSTATE
SELECT quota.finish(:'to_renew') AS finished;
RESET ROLE;
DROP ROLE quota_busy;
