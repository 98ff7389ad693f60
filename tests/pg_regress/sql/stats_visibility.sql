-- Who sees what of quota.stats (0.3.0; 0.3.1: member roles). A tenant sees the rows of
-- the roles whose tickets it may finish: its current_user and the roles it is a member
-- of (as in quota.tickets and quota.usage), through a leaky function too, and no
-- others; members of pg_read_all_stats and superusers see every row. quota.stats_info is
-- readable by everyone. quota.writer_stats shows no rows to a tenant and every row to
-- pg_read_all_stats members. quota.stats_reset() is not executable by PUBLIC: 42501
-- until EXECUTE is granted.
-- How this test fails: other roles' rows visible to the tenant ("others_visible" above
-- 1, sv_other's, "leaky_calls" above 2), or its member role's row hidden; rows hidden
-- from pg_read_all_stats members or superusers ("mine" below 3); the writer's row shown to a tenant ("writer_rows" 1) or hidden
-- from pg_read_all_stats ("writer_rows" 0); stats_reset callable without a grant (the
-- 42501 lines turn into "t"), or a granted tenant's reset not working.
-- Only rows of this test's roles are counted where other roles' rows may exist (the
-- writer may still sweep other tests' expired tickets, which adds rows for their roles).
SELECT current_user AS su \gset
CREATE ROLE sv_tenant LOGIN;
CREATE ROLE sv_other;
CREATE ROLE sv_reader LOGIN;
GRANT pg_read_all_stats TO sv_reader;
GRANT sv_other TO sv_tenant;

-- Privileges: SELECT on the views for everyone; EXECUTE on stats_reset for nobody
-- but superusers (not for pg_read_all_stats either).
SELECT v, has_table_privilege('sv_tenant', v, 'SELECT') AS tenant_select
  FROM unnest(ARRAY['quota.stats', 'quota.stats_info', 'quota.writer_stats']) v;
SELECT has_function_privilege('sv_tenant', 'quota.stats_reset(regrole)', 'EXECUTE') AS tenant_execute,
       has_function_privilege('sv_reader', 'quota.stats_reset(regrole)', 'EXECUTE') AS reader_execute;

-- Three roles act: the tenant (in a session of its own, below), sv_other and the
-- superuser.
SELECT quota.stats_reset() IS NOT NULL AS reset;
SET ROLE sv_other;
SELECT quota.start('other') AS o1 \gset
RESET ROLE;
SELECT quota.finish(quota.start('superuser')) AS superuser_finished;
\c - sv_tenant
SELECT quota.start('tenant', idempotency_key => 'k') AS t1 \gset
SELECT quota.try_start('tenant again', idempotency_key => 'k') = :'t1' AS same_ticket;
-- The superuser sees all three rows.
\c - :su
SELECT CASE WHEN role = current_user THEN 'superuser' ELSE role::text END AS role,
       datname = current_database() AS here, admitted, finished_succeeded, idempotent_hits
  FROM quota.stats WHERE role IN ('sv_tenant', 'sv_other', current_user)
 ORDER BY 1;

-- The tenant sees its own row and sv_other's (it is a member of that role), not the
-- superuser's.
\c - sv_tenant
SELECT datname = current_database() AS here, role, admitted, idempotent_hits FROM quota.stats;
SELECT count(*) AS others_visible FROM quota.stats WHERE role <> current_user;
-- A leaky function in the tenant's query sees only those two rows.
CREATE FUNCTION pg_temp.leak(t text) RETURNS boolean LANGUAGE plpgsql COST 0.0000001 AS $$
BEGIN
  PERFORM set_config('test.leaked', (coalesce(nullif(current_setting('test.leaked', true), ''), '0')::int + 1)::text, false);
  RETURN true;
END $$;
SELECT count(*) AS rows_seen FROM quota.stats WHERE pg_temp.leak(role::text);
SELECT current_setting('test.leaked') AS leaky_calls;
-- After SET ROLE sv_other, current_user is sv_other: that role's row, and only it.
SET ROLE sv_other;
SELECT role, admitted FROM quota.stats;
RESET ROLE;
-- stats_info is readable by everyone.
SELECT max, entries >= 3 AS entries, evicted, log_suppressed, stats_reset IS NOT NULL AS has_reset
  FROM quota.stats_info;
-- The writer is shared by every role: the tenant sees none of it.
SELECT count(*) AS writer_rows FROM quota.writer_stats;
-- quota.usage shows the tenant the same two roles' rows.
SELECT count(*) AS usage_rows, bool_and(role IN ('sv_tenant'::regrole, 'sv_other'::regrole)) AS own_or_member
  FROM quota.usage;
-- stats_reset without the grant: 42501, for the tenant's own role too, and nothing
-- was reset.
SELECT quota.stats_reset();
\echo :LAST_ERROR_SQLSTATE
SELECT quota.stats_reset('sv_tenant');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.stats_reset(NULL);
\echo :LAST_ERROR_SQLSTATE
SELECT role, admitted FROM quota.stats;

-- A member of pg_read_all_stats sees every row, and the writer's, but may not reset.
\c - sv_reader
SELECT count(*) FILTER (WHERE role IN ('sv_tenant', 'sv_other', :'su')) AS mine,
       count(*) FILTER (WHERE role = current_user) AS own
  FROM quota.stats;
SELECT count(*) AS writer_rows, bool_and(batches >= 1) AS batches
  FROM quota.writer_stats WHERE datname = current_database();
SELECT max, evicted, log_suppressed FROM quota.stats_info;
-- ... and (0.3.0) every role's row of quota.usage, so that a monitoring role in
-- pg_monitor need not be a superuser.
SELECT count(*) FILTER (WHERE role IN ('sv_tenant', 'sv_other')) AS usage_rows FROM quota.usage;
SELECT quota.stats_reset('sv_tenant');
\echo :LAST_ERROR_SQLSTATE

-- The superuser sees the writer's row too.
\c - :su
SELECT count(*) AS writer_rows, bool_and(batches >= 1) AS batches
  FROM quota.writer_stats WHERE datname = current_database();

-- Granted EXECUTE, the tenant resets its own role's rows; the others stay.
GRANT EXECUTE ON FUNCTION quota.stats_reset(regrole) TO sv_tenant;
\c - sv_tenant
SELECT quota.stats_reset('sv_tenant') IS NOT NULL AS reset;
SELECT string_agg(role, ' ') AS rows_left FROM quota.stats;
\c - :su
SELECT CASE WHEN role = current_user THEN 'superuser' ELSE role::text END AS role, admitted
  FROM quota.stats WHERE role IN ('sv_tenant', 'sv_other', current_user)
 ORDER BY 1;

-- Clean up.
REVOKE EXECUTE ON FUNCTION quota.stats_reset(regrole) FROM sv_tenant;
SELECT quota.finish(:'o1') AS finished;
SELECT quota.finish(:'t1') AS finished;
DROP ROLE sv_tenant, sv_other, sv_reader;
SELECT has_function_privilege('public', 'quota.stats_reset(regrole)', 'EXECUTE') AS public_execute;
