-- JOB in whole calls (scripts/bench --citus): the job's enqueue and its completion,
-- each one call of a function distributed by tenant (bench/citus_setup.sql), with
-- pg_quota switched off; for a tenant drawn from 1,000. The same on the single node.
\set t random(1, 1000)
SELECT enqueue('t:t', 'job', false) AS id \gset
SELECT complete('t:t', :id);
