-- A start+finish of a tenant drawn at random from all 100,000 (bench_roles), as the
-- superuser acting as that role: more tenants at once than scope counters.
\set r random(1, 100000)
SET ROLE bench_many_:r;
SELECT quota.finish(quota.start('spread'));
RESET ROLE;
