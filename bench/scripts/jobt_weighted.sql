-- JOBT-plans with weights (0.7.0): JOBT-tenants with each job's weight drawn from 1 to
-- 8 (bench/plans.py runs it on bench_plans, where half of the 1,000 tenants have limits
-- of their own).
\set t random(1, 1000)
\set w random(1, 8)
INSERT INTO bench.jobs (payload, ticket) VALUES ('job', quota.start(weight => :w, label => 'job', tenant => 't' || :t, transactional => true)) RETURNING id \gset
UPDATE bench.jobs SET done_at = now(), released = quota.finish(ticket) WHERE id = :id;
