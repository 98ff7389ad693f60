#!/usr/bin/env bash
# A lease runs from the moment the ticket starts, however long start() waited first
# (0.4.1, F1; design.md I1). 0.4.0 computed lease_until when start() began its
# attempt, before the waits that can follow it (a slot in line for a writer, a new
# writer, the answer to a request this session abandoned), and the writer stamped
# started_at with its own, later clock: a ticket could be born expired, never count as
# active, and let the role run past its limit.
#
# The wait made here: the session's first start() is cancelled by statement_timeout
# after the writer claimed it, while the writer waits for a SHARE lock a superuser holds
# on quota.ledger; its next start('late', lease => '2 s') waits for that abandoned
# answer (about 3.5 s, below the writer's own lock_timeout of 5 s) before its own
# request goes to the writer.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5760 + PORT_OFFSET))}"
with_cluster lease_after_wait "quota.writer_idle_timeout = '1h'"
sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE lw LOGIN" \
    -c "ALTER ROLE lw SET quota.max_active_per_role = 2" \
    -c "ALTER ROLE lw SET quota.max_retained_per_role = 0" >/dev/null
# The writer runs before the scenario, so that it claims the first request at once.
expect_eq "a warm-up start and finish" t "$(as lw postgres "SELECT quota.finish(quota.start('warm-up'))")"

open_session lock postgres
open_session s lw
say lock "BEGIN; LOCK quota.ledger IN SHARE MODE; SELECT 'locked';"
wait_out lock locked
say s "SET statement_timeout = '300ms';"
say s "SELECT quota.start('abandoned');"
wait_out s "statement timeout"
say s "RESET statement_timeout;"
say s "SELECT 'late:' || (quota.start('late', lease => '2 s') IS NOT NULL);"
sleep 3.5
say lock "COMMIT;"
wait_out s "late:" 15
expect_eq "the late start() is admitted once the writer is free" "late:true" "$(grep -o 'late:.*' "$CL/s.out")"
close_session s
close_session lock

# Within the late ticket's lease of 2 s: both tickets count.
expect_eq "both tickets are active" 2 "$(sql -c "SELECT active FROM quota.usage WHERE role = 'lw'::regrole")"
expect_eq "so the role, at its limit of 2, is refused (53400)" 53400 "$(state lw postgres "SELECT quota.start('third')")"
waited=$(sql -c "SELECT round(extract(epoch FROM l.started_at - a.started_at))::int FROM quota.ledger l, quota.ledger a
                 WHERE l.label = 'late' AND a.label = 'abandoned'")
check "the late ticket started after the wait (${waited:-?} s after the abandoned one)" test "${waited:-0}" -ge 3
expect_eq "its lease ends after it starts: lease_until - started_at is the lease asked for" "2" \
  "$(sql -c "SELECT round(extract(epoch FROM lease_until - started_at))::int FROM quota.ledger WHERE label = 'late'")"
finish_checks
