-- 0.5.0: tenants under a role. A tenant's limits apply beside its role's and only
-- restrict; the database cap applies too. Keys, refusals and views per tenant.
CREATE ROLE tn_app;
SET quota.max_active_per_role = 3;
SET quota.max_retained_per_role = 0;
SET quota.max_active_per_tenant = 2;
SET ROLE tn_app;

-- Each tenant gets at most 2; the role at most 3 in all.
SELECT quota.try_start('a1', tenant => 'acme') IS NOT NULL AS acme_1;
SELECT quota.try_start('a2', tenant => 'acme') IS NOT NULL AS acme_2;
SELECT quota.try_start('a3', tenant => 'acme') IS NULL AS acme_3_refused;
SELECT quota.try_start('b1', tenant => 'beta') IS NOT NULL AS beta_1;
-- The role is full (3), though beta has room.
SELECT quota.try_start('b2', tenant => 'beta') IS NULL AS beta_2_refused_by_role;
SELECT quota.try_start('role') IS NULL AS role_refused;

-- Refusals name the tenant, the setting and the numbers.
\set VERBOSITY verbose
SELECT quota.start('a3', tenant => 'acme');
SELECT quota.start('b2', tenant => 'beta');
\set VERBOSITY default

-- Tenants compare byte for byte, and a tenant of 200 characters is accepted, 201 not.
RESET ROLE;
SET quota.max_active_per_role = 0;
SET ROLE tn_app;
SELECT quota.try_start(tenant => 'Acme') IS NOT NULL AS other_case_is_another_tenant;
SELECT quota.start(tenant => repeat('ü', 200)) IS NOT NULL AS tenant_200;
SELECT quota.start(tenant => repeat('x', 201));
\echo :LAST_ERROR_SQLSTATE

-- An idempotency key is a scope's: the same key under another tenant is another ticket.
SELECT quota.start(tenant => 'k1', idempotency_key => 'job-1') AS k1 \gset
SELECT quota.start(tenant => 'k1', idempotency_key => 'job-1') = :'k1' AS same_ticket;
SELECT quota.start(tenant => 'k2', idempotency_key => 'job-1') <> :'k1' AS other_tenant_other_ticket;
SELECT quota.start(idempotency_key => 'job-1') <> :'k1' AS role_itself_other_ticket;

-- Finishing a tenant's ticket frees its tenant's slot and its role's.
RESET ROLE;
SET quota.max_active_per_role = 3;
SET ROLE tn_app;
SELECT quota.finish(id) FROM quota.tickets WHERE tenant = 'acme' AND label = 'a1';
SELECT quota.try_start('a4', tenant => 'acme') IS NULL AS acme_still_refused_by_role;
RESET ROLE;
SET quota.max_active_per_role = 100;
SET ROLE tn_app;
SELECT quota.try_start('a4', tenant => 'acme') IS NOT NULL AS acme_admitted_again;

-- What the views show, per tenant.
SELECT tenant, label, ended_at IS NULL AS active, transactional
  FROM quota.tickets WHERE tenant IN ('acme', 'beta') ORDER BY tenant, label;
SELECT tenant, active, retained FROM quota.tenant_usage
 WHERE tenant IN ('acme', 'beta', 'Acme') ORDER BY tenant;
SELECT active FROM quota.usage;
RESET ROLE;
-- Statistics stay per role: the tenant refusals count as the role's.
SELECT refused_active FROM quota.stats WHERE role = 'tn_app';
