-- JOBT in whole calls (scripts/bench --citus): citus_fjob.sql with pg_quota on, a
-- transactional start in the enqueue's call and the finish in the completion's, each
-- run whole on the tenant's node (USER_GUIDE "Citus", the recipe of whole calls).
\set t random(1, 1000)
SELECT enqueue('t:t', 'job', true) AS id \gset
SELECT complete('t:t', :id);
