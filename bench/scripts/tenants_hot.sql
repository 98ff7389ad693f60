-- A start+finish of one tenant of bench_tenants (:n, set on the command line), for
-- the latency of tenant #1 against tenant #100,000 under an old snapshot.
SELECT quota.finish(quota.start('cycle', tenant => 't' || :n));
