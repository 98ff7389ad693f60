-- 0.7.0: a tenant's own limits, set at run time by quota.set_tenant_limits(), in place
-- of its role's quota.max_active_per_tenant and quota.max_retained_per_tenant.
CREATE ROLE tl_app;
CREATE ROLE tl_other;
CREATE ROLE tl_admin;          -- granted EXECUTE, and a member of tl_app
GRANT tl_app TO tl_admin;
ALTER ROLE tl_app SET quota.max_active_per_role = 100;
ALTER ROLE tl_app SET quota.max_retained_per_role = 0;
ALTER ROLE tl_app SET quota.max_active_per_tenant = 2;

-- Nobody but superusers may, until a superuser grants EXECUTE.
SET ROLE tl_app;
SELECT quota.set_tenant_limits('free', max_active => 1);
\echo :LAST_ERROR_SQLSTATE
-- Nor write the table.
INSERT INTO quota.tenant_overrides VALUES ('tl_app', 'free', 1, NULL, now(), 'tl_app');
\echo :LAST_ERROR_SQLSTATE
RESET ROLE;
GRANT EXECUTE ON FUNCTION quota.set_tenant_limits(text, integer, integer, regrole) TO tl_admin;

-- A free customer may run 1 at once, an enterprise one 5: below and above the role's
-- setting of 2.
SET ROLE tl_admin;
SELECT quota.set_tenant_limits('free', max_active => 1, role => 'tl_app');
SELECT quota.set_tenant_limits('enterprise', max_active => 5, role => 'tl_app');
-- Not for a role it is not a member of.
SELECT quota.set_tenant_limits('free', max_active => 9, role => 'tl_other');
\echo :LAST_ERROR_SQLSTATE
RESET ROLE;

SET ROLE tl_app;
SELECT quota.try_start(tenant => 'free') IS NOT NULL AS free_1;
SELECT quota.try_start(tenant => 'free') IS NULL AS free_2_refused;
SELECT quota.try_start(tenant => 'enterprise') IS NOT NULL AS ent_1,
       quota.try_start(tenant => 'enterprise') IS NOT NULL AS ent_2,
       quota.try_start(tenant => 'enterprise') IS NOT NULL AS ent_3,
       quota.try_start(tenant => 'enterprise') IS NOT NULL AS ent_4,
       quota.try_start(tenant => 'enterprise') IS NOT NULL AS ent_5;
SELECT quota.try_start(tenant => 'enterprise') IS NULL AS ent_6_refused;
-- A tenant without its own limits keeps the role's setting.
SELECT quota.try_start(tenant => 'plain') IS NOT NULL AS plain_1,
       quota.try_start(tenant => 'plain') IS NOT NULL AS plain_2;
SELECT quota.try_start(tenant => 'plain') IS NULL AS plain_3_refused;
-- The refusal names the tenant's own limit, and its HINT the function.
\set VERBOSITY verbose
SELECT quota.start(tenant => 'free');
SELECT quota.start(tenant => 'plain');
\set VERBOSITY default
RESET ROLE;

-- The tenant's own limit beats every layer of the role's setting, a session's SET too;
-- the role's own limits still apply.
SET quota.max_active_per_tenant = 50;
SET ROLE tl_app;
SELECT quota.try_start(tenant => 'free') IS NULL AS free_still_refused_under_set;
SELECT quota.try_start(tenant => 'plain') IS NOT NULL AS plain_3_under_set;
RESET ROLE;
RESET quota.max_active_per_tenant;
-- tl_app holds 1 + 5 + 3 = 9 now, over its role's limit of 8: a tenant's own limit
-- of 100 does not widen it.
ALTER ROLE tl_app SET quota.max_active_per_role = 8;
SELECT quota.set_tenant_limits('enterprise', max_active => 100, role => 'tl_app');
SET ROLE tl_app;
SELECT quota.try_start(tenant => 'enterprise') IS NULL AS refused_by_role;
RESET ROLE;
ALTER ROLE tl_app SET quota.max_active_per_role = 100;

-- 0 is no limit; NULL leaves the role's setting in force; both NULL removes the
-- tenant's own limits.
SELECT quota.set_tenant_limits('free', max_active => 0, role => 'tl_app');
SET ROLE tl_app;
SELECT quota.try_start(tenant => 'free') IS NOT NULL AS free_2_unlimited,
       quota.try_start(tenant => 'free') IS NOT NULL AS free_3_unlimited;
RESET ROLE;
SELECT quota.set_tenant_limits('free', max_active => NULL, max_retained => 10, role => 'tl_app');
SET ROLE tl_app;
SELECT quota.try_start(tenant => 'free') IS NULL AS free_back_to_role_setting;
RESET ROLE;

-- Lowering a tenant below what it holds refuses its next starts and takes nothing away.
SELECT quota.set_tenant_limits('enterprise', max_active => 1, role => 'tl_app');
SELECT tenant, active FROM quota.tenant_usage WHERE tenant = 'enterprise';
SET ROLE tl_app;
SELECT quota.start(tenant => 'enterprise');
RESET ROLE;

-- A retained limit of its own, at the retention window.
SELECT quota.set_tenant_limits('trial', max_retained => 2, role => 'tl_app');
SET ROLE tl_app;
SELECT quota.finish(quota.start(tenant => 'trial'));
SELECT quota.finish(quota.start(tenant => 'trial'));
SELECT quota.try_start(tenant => 'trial') IS NULL AS trial_retained_refused;
\set VERBOSITY terse
SELECT quota.start(tenant => 'trial');
\set VERBOSITY default
RESET ROLE;

-- Transactional: a rollback leaves the old value, a savepoint's rollback too. A change
-- applies from its commit, to the transaction that made it too (a ticket admitted
-- under it would outlive the rollback).
BEGIN;
SELECT quota.set_tenant_limits('plain', max_active => 10, role => 'tl_app');
SET LOCAL ROLE tl_app;
SELECT quota.try_start(tenant => 'plain') IS NULL AS refused_in_the_setting_xact;
ROLLBACK;
SET ROLE tl_app;
SELECT quota.try_start(tenant => 'plain') IS NULL AS plain_refused_after_rollback;
RESET ROLE;
BEGIN;
SAVEPOINT s;
SELECT quota.set_tenant_limits('plain', max_active => 10, role => 'tl_app');
ROLLBACK TO SAVEPOINT s;
SET LOCAL ROLE tl_app;
SELECT quota.try_start(tenant => 'plain') IS NULL AS plain_refused_after_savepoint_rollback;
COMMIT;

-- What quota.tenant_limits shows, to whom: a role's to its members, as
-- quota.tenant_usage.
SELECT role, tenant, max_active, max_retained, set_by FROM quota.tenant_limits
 ORDER BY role::text, tenant;
SET ROLE tl_other;
SELECT count(*) AS seen_by_another_role FROM quota.tenant_limits;
SET ROLE tl_app;
SELECT count(*) AS seen_by_its_role FROM quota.tenant_limits;
RESET ROLE;

-- Bad input: a clear error each, and nothing changed.
SELECT quota.set_tenant_limits('x', max_active => -1, role => 'tl_app');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.set_tenant_limits('x', max_retained => -5, role => 'tl_app');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.set_tenant_limits('x', max_active => 1000001, role => 'tl_app');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.set_tenant_limits(NULL, max_active => 1, role => 'tl_app');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.set_tenant_limits('x', max_active => 1, role => NULL);
\echo :LAST_ERROR_SQLSTATE
SELECT quota.set_tenant_limits('x', max_active => 1, role => '4000000000'::regrole);
\echo :LAST_ERROR_SQLSTATE
SELECT quota.set_tenant_limits(repeat('x', 201), max_active => 1, role => 'tl_app');
\echo :LAST_ERROR_SQLSTATE
SELECT count(*) AS no_row_for_x FROM quota.tenant_overrides WHERE tenant = 'x';
BEGIN READ ONLY;
SELECT quota.set_tenant_limits('x', max_active => 1, role => 'tl_app');
\echo :LAST_ERROR_SQLSTATE
ROLLBACK;

-- A superuser's own write to the table applies as the function's does (its trigger
-- invalidates every backend's cache); the function's rows and the superuser's agree.
UPDATE quota.tenant_overrides SET max_active = 0
 WHERE role = 'tl_app'::regrole AND tenant = 'enterprise';
SET ROLE tl_app;
SELECT quota.try_start(tenant => 'enterprise') IS NOT NULL AS enterprise_unlimited_by_hand;
RESET ROLE;

-- A refusal at a tenant's own limit reads shared memory and this backend's cache of
-- the tenants' limits: it scans none of pg_quota's relations (as refusal_from_counters
-- for the role's settings). A change committed since is read once, from
-- quota.tenant_overrides, then cached again. ('free' holds 3, over the role's 2.)
SET ROLE tl_app;
SELECT quota.try_start(tenant => 'free') IS NULL AS refused;
RESET ROLE;
SELECT pg_stat_force_next_flush();
BEGIN;
SET LOCAL ROLE tl_app;
SELECT quota.try_start(tenant => 'free') IS NULL AS refused;
SELECT coalesce(sum(seq_scan + coalesce(idx_scan, 0)), 0) AS scans_of_quota_relations
  FROM pg_stat_xact_all_tables WHERE schemaname = 'quota';
COMMIT;
SELECT quota.set_tenant_limits('free', max_active => 3, role => 'tl_app');
SELECT pg_stat_force_next_flush();
BEGIN;
SET LOCAL ROLE tl_app;
SELECT quota.try_start(tenant => 'free') IS NULL AS refused_at_its_own_3;
SELECT relname, idx_scan FROM pg_stat_xact_all_tables
 WHERE schemaname = 'quota' AND seq_scan + coalesce(idx_scan, 0) > 0;
COMMIT;
SELECT pg_stat_force_next_flush();
BEGIN;
SET LOCAL ROLE tl_app;
SELECT quota.try_start(tenant => 'free') IS NULL AS refused_at_its_own_3;
SELECT coalesce(sum(seq_scan + coalesce(idx_scan, 0)), 0) AS scans_of_quota_relations
  FROM pg_stat_xact_all_tables WHERE schemaname = 'quota';
COMMIT;

-- The table's trigger is pg_quota's own: it cannot be dropped or renamed, a DBA's own
-- trigger on the table is refused (it would run as the table's owner inside
-- quota.set_tenant_limits()), and ENABLE TRIGGER ALL sets it back to ENABLE ALWAYS.
DROP TRIGGER tenant_overrides_written ON quota.tenant_overrides;
\echo :LAST_ERROR_SQLSTATE
CREATE FUNCTION tl_audit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
CREATE TRIGGER tl_audit AFTER INSERT ON quota.tenant_overrides
  FOR EACH STATEMENT EXECUTE FUNCTION tl_audit();
\echo :LAST_ERROR_SQLSTATE
DROP FUNCTION tl_audit();
ALTER TABLE quota.tenant_overrides ENABLE TRIGGER ALL;
SELECT tgenabled FROM pg_trigger WHERE tgname = 'tenant_overrides_written';

-- Clean up.
DELETE FROM quota.ledger WHERE role IN ('tl_app'::regrole, 'tl_other'::regrole);
DELETE FROM quota.tenant_overrides;
REVOKE EXECUTE ON FUNCTION quota.set_tenant_limits(text, integer, integer, regrole) FROM tl_admin;
ALTER ROLE tl_app RESET ALL;
DROP ROLE tl_admin;
DROP ROLE tl_other;
DROP ROLE tl_app;
