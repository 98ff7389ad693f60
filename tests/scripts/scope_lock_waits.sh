#!/usr/bin/env bash
# start() never waits under its role's scope lock for anything but the counts (0.4.1,
# F3; USER_GUIDE "Writer slots": waits in line happen without the scope lock). 0.4.0
# held the lock while it waited for the answer to a request its session had abandoned
# (and while it waited in line for a writer slot when its writer was gone), and every
# other start() of the role queued behind it: with lock_timeout set, they failed with
# 55P03.
#
# The wait made here: session s's first start() is cancelled by statement_timeout after
# the writer claimed it, while the writer waits for a SHARE lock a superuser holds on
# quota.ledger; its next start() waits for that abandoned answer. Meanwhile session t
# of the same role, with lock_timeout = 500ms, asks for a ticket: it must get one once
# the writer is free, not 55P03.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5761 + PORT_OFFSET))}"
with_cluster scope_lock_waits "quota.writer_idle_timeout = '1h'"
sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE sl LOGIN" \
    -c "ALTER ROLE sl SET quota.max_active_per_role = 2" \
    -c "ALTER ROLE sl SET quota.max_retained_per_role = 0" >/dev/null
expect_eq "a warm-up start and finish" t "$(as sl postgres "SELECT quota.finish(quota.start('warm-up'))")"

open_session lock postgres
open_session s sl
open_session t sl
say lock "BEGIN; LOCK quota.ledger IN SHARE MODE; SELECT 'locked';"
wait_out lock locked
say s "SET statement_timeout = '300ms';"
say s "SELECT quota.start('abandoned');"
wait_out s "statement timeout"
say s "RESET statement_timeout;"
say s "SELECT 's:' || coalesce(quota.try_start('s')::text, 'refused');"
sleep 0.5
say t "SET lock_timeout = '500ms';"
say t "SELECT 't:' || coalesce(quota.try_start('t')::text, 'refused');"
sleep 2
say lock "COMMIT;"
wait_out t "t:\|ERROR" 15
wait_out s "s:\|ERROR" 15
close_session t
close_session s
close_session lock
check "the other session's start() did not fail on the scope lock ($(grep -m1 ERROR "$CL/t.out" || echo no error))" \
  bash -c "! grep -q ERROR '$CL/t.out'"
check "... it was admitted once the writer was free" grep -Eq '^t:[0-9a-f-]{36}$' "$CL/t.out"
expect_eq "the role holds its limit: the abandoned ticket and t's" 2 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'sl'::regrole AND ended_at IS NULL")"
expect_eq "so the waiting session was refused (try_start gave NULL)" "s:refused" "$(grep -o '^s:.*' "$CL/s.out")"
finish_checks
