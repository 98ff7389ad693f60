#!/usr/bin/env bash
# Limits follow the role that is charged, not the login (0.5.0; USER_GUIDE "Whose
# limits apply"). A pooled connection that logs in as one role and runs SET ROLE to
# each tenant's role before start() (as PostgREST and Supabase do per request) must
# have each charge checked against the charged role's configured limits, in
# PostgreSQL's order of precedence: ALTER ROLE … IN DATABASE, ALTER ROLE, ALTER
# DATABASE, ALTER ROLE ALL, then the server's value; a value SET in the session by a
# superuser wins for every role it charges. 0.4.0 applied the login session's values:
# with ALTER ROLE ten0 SET quota.max_active_per_role = 2, a pooled worker ran four of
# ten0's jobs at once.
#
# The server's value is kept apart from the login's own (gucs.rs): it must follow a
# reload in an open pooled session, including a value removed from the files, and never
# take a value that ALTER SYSTEM or the pg_file_settings view only checked.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5765 + PORT_OFFSET))}"
with_cluster limits_follow_role
sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE app LOGIN" \
    -c "DO \$\$ BEGIN FOR i IN 0..8 LOOP EXECUTE format('CREATE ROLE ten%s; GRANT ten%s TO app', i, i); END LOOP; END \$\$" \
    -c "ALTER ROLE app SET quota.max_active_per_role = 5" \
    -c "ALTER ROLE ALL SET quota.max_retained_per_role = 0" \
    -c "ALTER ROLE ten0 SET quota.max_active_per_role = 2" \
    -c "ALTER ROLE ten1 SET quota.max_active_per_role = 4" \
    -c "ALTER ROLE ten1 IN DATABASE postgres SET quota.max_active_per_role = 1" \
    -c "GRANT SELECT ON pg_file_settings TO app" \
    -c "GRANT EXECUTE ON FUNCTION pg_show_all_file_settings() TO app" >/dev/null

# reloaded T0: until a new session's configuration was loaded after T0 (the postmaster
# has reloaded, so every session forked from now on has too).
reloaded() {
  local i
  for i in $(seq 1 200); do
    [ "$(sql -c "SELECT pg_conf_load_time() > '$1'")" = t ] && return 0
    sleep 0.05
  done
  return 1
}

# admitted ROLE N: how many of N starts the login app gets as ROLE, in one session.
admitted() {
  as app postgres "SET ROLE $1" "SELECT count(quota.try_start()) FROM generate_series(1, $2)"
}
expect_eq "the login's own setting applies to itself" 5 "$(as app postgres "SELECT count(quota.try_start()) FROM generate_series(1, 7)")"
expect_eq "after SET ROLE ten0, ten0's ALTER ROLE value applies (2), not the login's (5)" 2 "$(admitted ten0 4)"
expect_eq "ALTER ROLE … IN DATABASE wins over ALTER ROLE (1, not 4)" 1 "$(admitted ten1 4)"
msg=$(timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U app -d postgres -c "SET ROLE ten0" -c "SELECT quota.start()" 2>&1 | sed -n "s/^ERROR:  //p" || true)
expect_eq "the refusal names the charged role and its limit" \
  'role "ten0" has 2 active tickets, the limit set by quota.max_active_per_role' "$msg"
sql -c "ALTER DATABASE postgres SET quota.max_active_per_role = 3" >/dev/null
expect_eq "a role with no value of its own gets ALTER DATABASE's (3)" 3 "$(admitted ten2 5)"

# The server's value, which the login's own ALTER ROLE value hides from its session:
# pg_quota keeps it apart (gucs.rs).
t0=$(sql -c "SELECT now()")
sql -c "ALTER DATABASE postgres RESET quota.max_active_per_role" \
    -c "ALTER SYSTEM SET quota.max_active_per_role = 4" -c "SELECT pg_reload_conf()" >/dev/null
check "the server reloaded its configuration" reloaded "$t0"
expect_eq "then the server's value (ALTER SYSTEM: 4), though the login's is 5" 4 "$(admitted ten3 6)"

# In one pooled session of the login (its own value hides the server's): a value that
# ALTER SYSTEM wrote and pg_file_settings read, but nobody reloaded, is not the
# server's yet; a value removed from the files (ALTER SYSTEM RESET) is gone once the
# session has reloaded. The session's reload is seen by pg_conf_load_time().
open_session p app
sql -c "ALTER SYSTEM SET quota.max_active_per_role = 7" >/dev/null
say p "SELECT 'files:' || count(*) FROM pg_file_settings WHERE name = 'quota.max_active_per_role';"
wait_out p "files:"
say p "SET ROLE ten6;"
say p "SELECT 'unreloaded:' || count(quota.try_start()) FROM generate_series(1, 8);"
wait_out p "unreloaded:"
t1=$(sql -c "SELECT now()")
sql -c "ALTER SYSTEM RESET quota.max_active_per_role" -c "SELECT pg_reload_conf()" >/dev/null
for i in $(seq 1 200); do
  say p "SELECT 'poll$i:' || (pg_conf_load_time() > '$t1');"
  wait_out p "poll$i:"
  grep -q "^poll$i:true" "$CL/p.out" && break
  sleep 0.05
done
say p "SET ROLE ten7;"
say p "SELECT 'removed:' || count(quota.try_start()) FROM generate_series(1, 6);"
wait_out p "removed:"
close_session p
expect_eq "a value ALTER SYSTEM wrote and pg_file_settings checked is not applied before a reload (4, not 7)" \
  "unreloaded:4" "$(grep -o '^unreloaded:[0-9]*' "$CL/p.out")"
expect_eq "after ALTER SYSTEM RESET and a reload, the open session uses the boot value (100: all 6)" \
  "removed:6" "$(grep -o '^removed:[0-9]*' "$CL/p.out")"
t2=$(sql -c "SELECT now()")
sql -c "ALTER SYSTEM SET quota.max_active_per_role = 4" -c "SELECT pg_reload_conf()" >/dev/null
check "the server reloaded its configuration again" reloaded "$t2"

# A change applies to open sessions from their next transaction.
open_session w app
say w "SET ROLE ten4;"
say w "SELECT 'first:' || count(quota.try_start()) FROM generate_series(1, 6);"
wait_out w "first:"
sql -c "ALTER ROLE ten4 SET quota.max_active_per_role = 6" >/dev/null
say w "SELECT 'second:' || count(quota.try_start()) FROM generate_series(1, 6);"
wait_out w "second:"
close_session w
expect_eq "an open session gets the server's 4, then, after ALTER ROLE ten4 SET … = 6, 2 more" \
  "first:4 second:2" "$(grep -o '^[a-z]*:[0-9]*' "$CL/w.out" | paste -sd' ')"

# A superuser's SET in the session wins for every role it charges.
expect_eq "a superuser's session SET (10) wins over ten0's ALTER ROLE value" 8 \
  "$(sql -c "SET quota.max_active_per_role = 10" -c "SET ROLE ten0" -c "SELECT count(quota.try_start()) FROM generate_series(1, 12)")"

# The other settings of the policy follow the role too: its default lease.
sql -c "ALTER ROLE ten5 SET quota.default_lease = '1h'" >/dev/null
as app postgres "SET ROLE ten5" "SELECT quota.start()" >/dev/null
expect_eq "quota.default_lease follows the charged role (ten5's 1 h, not the server's 24 h)" "01:00:00" \
  "$(sql -c "SELECT lease_until - started_at FROM quota.ledger WHERE role = 'ten5'::regrole")"
finish_checks
