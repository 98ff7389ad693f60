#!/usr/bin/env bash
# Fair turns across tenants (0.7.0, issue 34): starts of several tenants of a role that
# wait for capacity that the role's limit holds back are admitted in turns across the
# tenants, not in arrival order; within a tenant, arrival order stays.
#
# The role's limit is 1, and a held ticket fills it. Then, each in a session of its
# own and only once the one before is seen asleep in line (wait event Extension):
# tenant a's five waiting starts a1 to a5, then b's one, b1, then c's one, c1. Each
# freed slot (the oldest active ticket finished, once the previous admission is seen)
# goes to the next waiter; the order in which their tickets start must be
# a1 b1 c1 a2 a3 a4 a5: b and c, with one start each, are admitted within as many
# freed slots as there are tenants waiting. In arrival order (0.6.x) it would be
# a1 a2 a3 a4 a5 b1 c1.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5790 + PORT_OFFSET))}"
with_cluster tenant_turns
sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE tt LOGIN" \
    -c "ALTER ROLE tt SET quota.max_active_per_role = 1" \
    -c "ALTER ROLE tt SET quota.max_retained_per_role = 0" >/dev/null
expect_eq "the held ticket" t "$(as tt postgres "SELECT quota.start('held') IS NOT NULL")"

in_line() { sql -c "SELECT count(*) FROM pg_stat_activity WHERE usename = 'tt' AND wait_event_type = 'Extension'"; }
waiters=(a1 a2 a3 a4 a5 b1 c1)
n=0
for w in "${waiters[@]}"; do
  open_session "$w" tt
  say "$w" "SELECT 'admitted:' || (quota.start('$w', tenant => '${w:0:1}', wait => '120 s') IS NOT NULL);"
  n=$((n + 1))
  for _ in $(seq 1 200); do [ "$(in_line)" = "$n" ] && break; sleep 0.05; done
  check "$w is asleep in line, behind the ${n} before it" test "$(in_line)" = "$n"
done

# Free one slot at a time: finish the one active ticket, then wait for the next one.
active() { sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'tt'::regrole AND ended_at IS NULL"; }
for i in $(seq 1 ${#waiters[@]}); do
  sql -c "SELECT quota.finish(id) FROM quota.ledger WHERE role = 'tt'::regrole AND ended_at IS NULL" >/dev/null
  for _ in $(seq 1 200); do [ "$(active)" = 1 ] && break; sleep 0.05; done
done
for w in "${waiters[@]}"; do wait_out "$w" "admitted:" 10; close_session "$w"; done

expect_eq "the waiters were admitted in turns across the tenants" "a1 b1 c1 a2 a3 a4 a5" \
  "$(sql -c "SELECT string_agg(label, ' ' ORDER BY started_at) FROM quota.ledger
              WHERE role = 'tt'::regrole AND label <> 'held'")"
expect_eq "every waiter got its ticket" "7" "$(grep -l '^admitted:true' "$CL"/{a,b,c}?.out 2>/dev/null | wc -l)"
finish_checks
