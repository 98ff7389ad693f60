-- The same as roles_spread.sql over the first 1,000 tenants only: they all keep their
-- scope counters.
\set r random(1, 1000)
SET ROLE bench_many_:r;
SELECT quota.finish(quota.start('spread'));
RESET ROLE;
