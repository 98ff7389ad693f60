-- JOBT-tenants: JOBT for 16 clients of ONE role, each job for a tenant drawn from
-- 1,000, with quota.max_active_per_tenant set (bench/setup.sql, bench_tenants).
\set t random(1, 1000)
INSERT INTO bench.jobs (payload, ticket) VALUES ('job', quota.start('job', tenant => 't' || :t, transactional => true)) RETURNING id \gset
UPDATE bench.jobs SET done_at = now(), released = quota.finish(ticket) WHERE id = :id;
