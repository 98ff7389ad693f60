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
# on quota.ledger; its next start('late', lease => '1.5 s') waits for that abandoned
# answer (about 3 s, below the writer's own lock_timeout of 5 s) before its own request
# goes to the writer. The same session then counts its active tickets and asks for a
# third at once, within the late ticket's lease.
#
# Then a wait inside the writer: with the SHARE lock held again, a start() of another
# role is claimed at once and its batch waits for the lock before it can insert; the
# ticket must still start (and its lease run) from the insert, not from the claim.
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
say s "SELECT 'sent:' || clock_timestamp();"
say s "SELECT 'late:' || (quota.start('late', lease => '1.5 s') IS NOT NULL);"
say s "SELECT 'active:' || active FROM quota.usage WHERE role = 'lw'::regrole;"
say s "SELECT 'third:' || coalesce(quota.try_start('third')::text, 'refused');"
sleep 3
say lock "COMMIT;"
wait_out s "third:" 15
close_session s
close_session lock
expect_eq "the late start() is admitted once the writer is free" "late:true" "$(grep -o '^late:.*' "$CL/s.out")"
# Within the late ticket's lease: both tickets count.
expect_eq "both tickets are active" "active:2" "$(grep -o '^active:.*' "$CL/s.out")"
expect_eq "so the role, at its limit of 2, is refused" "third:refused" "$(grep -o '^third:.*' "$CL/s.out")"
sent=$(sed -n 's/^sent://p' "$CL/s.out")
waited=$(sql -c "SELECT round(extract(epoch FROM started_at - '$sent'::timestamptz))::int FROM quota.ledger WHERE label = 'late'")
check "the late ticket started after the wait (${waited:-?} s after start() was called)" test "${waited:-0}" -ge 2
expect_eq "its lease ends after it starts: lease_until - started_at is the lease asked for" "1.5" \
  "$(sql -c "SELECT round(extract(epoch FROM lease_until - started_at), 1) FROM quota.ledger WHERE label = 'late'")"

sql -c "CREATE ROLE lw2 LOGIN" -c "ALTER ROLE lw2 SET quota.max_active_per_role = 1" \
    -c "ALTER ROLE lw2 SET quota.max_retained_per_role = 0" >/dev/null
open_session lock postgres
open_session s2 lw2
say lock "BEGIN; LOCK quota.ledger IN SHARE MODE; SELECT 'locked';"
wait_out lock locked
say s2 "SELECT 'inside:' || (quota.start('inside', lease => '1.5 s') IS NOT NULL);"
say s2 "SELECT 'active:' || active FROM quota.usage WHERE role = 'lw2'::regrole;"
say s2 "SELECT 'second:' || coalesce(quota.try_start('second')::text, 'refused');"
sleep 3
say lock "COMMIT;"
wait_out s2 "second:" 15
close_session s2
close_session lock
expect_eq "a ticket whose batch waited 3 s for a lock in the writer is active when start() returns" \
  "inside:true active:1 second:refused" "$(grep -o '^[a-z]*:.*' "$CL/s2.out" | paste -sd' ')"
finish_checks
