#!/usr/bin/env bash
# Transactional starts (0.5.0) through faults: a transactional ticket is durable
# exactly as its transaction is (I6), and an open charge never outlives its
# transaction (I1, I2).
# 1. A backend terminated with open charges (pg_terminate_backend, FATAL in the middle
#    of its transaction): its charges are given back at once, and a start waiting for
#    them is woken.
# 2. A crash (pg_ctl stop -m immediate: no shutdown checkpoint, recovery at the next
#    start) with charges open in one session and
#    just committed in another: after recovery exactly the committed tickets exist,
#    and the role is admitted exactly the room they leave.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5767 + PORT_OFFSET))}"
with_cluster transactional_faults
LIMIT=3
sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE tf LOGIN" \
    -c "ALTER ROLE tf SET quota.max_active_per_role = $LIMIT" \
    -c "ALTER ROLE tf SET quota.max_retained_per_role = 0" \
    -c "ALTER ROLE tf SET quota.allow_transactional = on" >/dev/null
active() { sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'tf'::regrole AND ended_at IS NULL"; }

# 1. Terminated with its charges open.
open_session holder tf
say holder "BEGIN;"
say holder "SELECT 'held:' || count(quota.start('held', tenant => 'x', transactional => true)) FROM generate_series(1, $LIMIT);"
wait_out holder "held:"
expect_eq "the holder took the role's $LIMIT slots in its open transaction" "held:$LIMIT" "$(grep -o '^held:.*' "$CL/holder.out")"
expect_eq "another session is refused meanwhile" t \
  "$(as tf postgres "SELECT quota.try_start('other', transactional => true) IS NULL")"
open_session waiter tf
say waiter "SELECT 'waited:' || (quota.start('waiter', wait => '30 s') IS NOT NULL) || ':' || (clock_timestamp() - statement_timestamp() < interval '10 s');"
for _ in $(seq 1 100); do
  [ "$(sql -c "SELECT count(*) FROM pg_stat_activity WHERE usename = 'tf' AND wait_event_type = 'Extension'")" -ge 1 ] && break
  sleep 0.05
done
holder_pid=$(sql -c "SELECT pid FROM pg_stat_activity WHERE usename = 'tf' AND state = 'idle in transaction'")
sql -c "SELECT pg_terminate_backend($holder_pid)" >/dev/null
wait_out waiter "waited:" 15
expect_eq "terminated, its charges are given back: the waiting start is woken and admitted within 10 s" \
  "waited:true:true" "$(grep -o '^waited:.*' "$CL/waiter.out")"
close_session waiter
close_session holder
expect_eq "none of the terminated transaction's tickets exists; the waiter's does" "waiter" \
  "$(sql -c "SELECT string_agg(label, ',') FROM quota.ledger WHERE role = 'tf'::regrole")"
expect_eq "the role is admitted exactly its room ($LIMIT - 1)" "$((LIMIT - 1))" \
  "$(as tf postgres "SELECT count(quota.try_start('room', transactional => true)) FROM generate_series(1, $LIMIT)")"
sql -c "SELECT quota.finish(id) FROM quota.ledger WHERE role = 'tf'::regrole AND ended_at IS NULL" >/dev/null

# 2. A crash with charges open in one session and committed in another.
open_session open tf
say open "BEGIN;"
say open "SELECT 'open:' || count(quota.start('open', transactional => true)) FROM generate_series(1, 2);"
wait_out open "open:"
as tf postgres "BEGIN" "SELECT quota.start('committed', transactional => true)" "COMMIT" >/dev/null
expect_eq "one ticket committed, two charges open: the role is full" t \
  "$(as tf postgres "SELECT quota.try_start('over', transactional => true) IS NULL")"
# The committed ticket's commit returned: it is on disk. Crash.
stop_cluster "$CL" immediate
close_session open
as_pg "$PG_BIN/pg_ctl" -D "$CL/data" -l "$CL/server.log" -w -t 60 start >/dev/null
expect_eq "after recovery exactly the committed ticket exists" "committed" \
  "$(sql -c "SELECT string_agg(label, ',') FROM quota.ledger WHERE role = 'tf'::regrole AND ended_at IS NULL")"
expect_eq "... it is a transactional ticket" t \
  "$(sql -c "SELECT transactional FROM quota.tickets WHERE label = 'committed'")"
expect_eq "... and the role is admitted exactly its room ($LIMIT - 1)" "$((LIMIT - 1))" \
  "$(as tf postgres "SELECT count(quota.try_start('after crash', transactional => true)) FROM generate_series(1, $LIMIT)")"
finish_checks
