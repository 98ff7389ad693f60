#!/usr/bin/env bash
# Delegating limits to a role that is not a superuser (USER_GUIDE "Delegating limits";
# 0.3.1). GRANT SET ON PARAMETER alone does not let a role set another role's limit:
# ALTER ROLE tenant SET needs CREATEROLE too, and from PostgreSQL 16 also the ADMIN
# OPTION on the tenant. And SET on a limit lets its holder raise its own limit, in its
# sessions and with ALTER ROLE for itself: a tenant must never have it.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
with_cluster delegation
sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE dl_tenant LOGIN" \
    -c "CREATE ROLE dl_set LOGIN" -c "CREATE ROLE dl_cr LOGIN CREATEROLE" -c "CREATE ROLE dl_admin LOGIN CREATEROLE" \
    -c "GRANT SET ON PARAMETER quota.max_active_per_role TO dl_set, dl_admin" >/dev/null
[ "$PG_MAJOR" -lt 16 ] || sql -c "GRANT dl_tenant TO dl_admin WITH ADMIN OPTION" >/dev/null
alter() { state "$1" postgres "ALTER ROLE dl_tenant SET quota.max_active_per_role = 5"; }
expect_eq "SET ON PARAMETER without CREATEROLE: ALTER ROLE tenant SET is refused (42501)" 42501 "$(alter dl_set)"
expect_eq "CREATEROLE without SET ON PARAMETER: refused (42501)" 42501 "$(alter dl_cr)"
if [ "$PG_MAJOR" -ge 16 ]; then
  sql -c "GRANT SET ON PARAMETER quota.max_active_per_role TO dl_cr" >/dev/null
  expect_eq "$PG_MAJOR: CREATEROLE and SET without the ADMIN OPTION on the tenant: refused (42501)" 42501 "$(alter dl_cr)"
fi
expect_eq "CREATEROLE, SET ON PARAMETER$([ "$PG_MAJOR" -lt 16 ] || echo " and ADMIN OPTION on the tenant"): allowed" 00000 "$(alter dl_admin)"
expect_eq "... and the tenant's next session has the limit" 5 "$(as dl_tenant postgres "SHOW quota.max_active_per_role")"
expect_eq "the tenant cannot change it (42501)" 42501 "$(state dl_tenant postgres "SET quota.max_active_per_role = 1000")"
expect_eq "a holder of SET raises its own limit in its session" 1000 \
  "$(as dl_set postgres "SET quota.max_active_per_role = 1000" "SHOW quota.max_active_per_role")"
expect_eq "... and for its future sessions" "00000 1000" \
  "$(state dl_set postgres "ALTER ROLE dl_set SET quota.max_active_per_role = 1000") $(as dl_set postgres "SHOW quota.max_active_per_role")"
finish_checks
