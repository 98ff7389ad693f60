#!/usr/bin/env bash
# Weighted tickets and waits (0.7.0, issue 34): a heavy start waiting for capacity holds
# the units that free up until it fits, so a stream of light starts cannot overtake it
# for ever. The role's limit is 8 units, and 8 held tickets of weight 1 fill it. A start
# of weight 8 (tenant a) waits in line. Then, 8 times: one held ticket is finished, and
# a light start of weight 1 (tenant b, not waiting) tries at once, and then a light
# start of tenant c that waits joins the line behind the heavy one. Every light start
# must be refused or kept waiting while the heavy one waits, since the units it waits
# for are counted ahead of them; after the eighth finish the heavy start is admitted,
# and only then the waiting light ones. Without its units counted ahead, the first
# light try would take the first freed unit, and the heavy start would wait out its
# 120 s.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5792 + PORT_OFFSET))}"
with_cluster weighted_waits
sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE ww LOGIN" \
    -c "ALTER ROLE ww SET quota.max_active_per_role = 8" \
    -c "ALTER ROLE ww SET quota.max_retained_per_role = 0" >/dev/null
expect_eq "8 held tickets" 8 \
  "$(as ww postgres "SELECT count(quota.start('held')) FROM generate_series(1, 8)")"

in_line() { sql -c "SELECT count(*) FROM pg_stat_activity WHERE usename = 'ww' AND wait_event_type = 'Extension'"; }
open_session heavy ww
say heavy "SELECT 'admitted:' || (quota.start(weight => 8, label => 'heavy', tenant => 'a', wait => '120 s') IS NOT NULL);"
for _ in $(seq 1 200); do [ "$(in_line)" = 1 ] && break; sleep 0.05; done
check "the heavy start is asleep in line" test "$(in_line)" = 1

refused=0
for i in $(seq 1 8); do
  sql -c "SELECT quota.finish(id) FROM quota.ledger
           WHERE role = 'ww'::regrole AND label = 'held' AND ended_at IS NULL
           ORDER BY started_at LIMIT 1" >/dev/null
  [ "$(as ww postgres "SELECT quota.try_start('light-$i', tenant => 'b') IS NULL")" = t ] && refused=$((refused + 1))
  if [ "$i" -le 3 ]; then
    open_session "c$i" ww
    say "c$i" "SELECT 'admitted:' || (quota.start('waiting-$i', tenant => 'c', wait => '120 s') IS NOT NULL);"
    for _ in $(seq 1 200); do [ "$(in_line)" -ge $((i + 1)) ] && break; sleep 0.05; done
    check "c$i is asleep in line behind the heavy start" test "$(in_line)" -ge $((i + 1))
  fi
done
expect_eq "every light start that did not wait was refused while the heavy one waited" 8 "$refused"
wait_out heavy "admitted:" 20
check "the heavy start was admitted" grep -q '^admitted:true' "$CL/heavy.out"
close_session heavy
expect_eq "it holds the role's 8 units" 8 \
  "$(sql -c "SELECT active FROM quota.usage WHERE role = 'ww'::regrole")"
expect_eq "no light ticket started before it" "heavy" \
  "$(sql -c "SELECT string_agg(label, ' ' ORDER BY started_at) FROM quota.ledger
              WHERE role = 'ww'::regrole AND label <> 'held'")"
# Its finish frees the units for the light ones that waited behind it (all three fit
# at once, so they may start in any order, after it).
sql -c "SELECT quota.finish(id) FROM quota.ledger WHERE label = 'heavy'" >/dev/null
for i in 1 2 3; do wait_out "c$i" "admitted:" 20; close_session "c$i"; done
expect_eq "the waiting light starts were admitted after it" "waiting-1 waiting-2 waiting-3" \
  "$(sql -c "SELECT string_agg(l.label, ' ' ORDER BY l.label) FROM quota.ledger l, quota.ledger h
              WHERE l.role = 'ww'::regrole AND l.label LIKE 'waiting-%'
                AND h.label = 'heavy' AND l.started_at > h.started_at")"
finish_checks
