#!/usr/bin/env bash
# Interrupted waits leave nothing behind (0.2.0, start(..., wait => ...)).
#
# A role with quota.max_active_per_role = 1; a holder session keeps the slot. Waiter A
# calls start(wait => '20 s') and takes a place in line, waiter B lines up behind it.
# A's wait is then ended three ways, one case each: statement_timeout (57014),
# pg_cancel_backend (57014), pg_terminate_backend (FATAL). After each:
# - A's call failed with the interrupt's error, long before its 20 s wait was up.
#   Fails if the wait sleeps without looking at interrupts (the call would run for 20 s
#   and end in 53400 instead, or B's admission below would come late).
# - quota.usage (active/retained), quota.tickets and quota.ledger show the role's
#   counts unchanged. Fails if an interrupted wait leaves a charge (a ledger row, or
#   a request the writer admits later: checked again after the slot was freed, by
#   label).
# - A's place in line is gone: a probe start() of the same role is refused with a
#   DETAIL counting exactly 1 earlier start() still waiting (B), not 2. Fails if the
#   Place guard / before_shmem_exit callback does not clear the waiter entry (with
#   FATAL, no Rust destructor runs: only the exit callback would clear it).
# - When the holder finishes, B is admitted within a few seconds. Fails if B still
#   counts A's stale place as ahead of it (B would time out after 20 s).
# - Once B finished too, a fail-fast try_start() from a new session (and, after a
#   cancel or timeout, from A's own session) is admitted at once: no stale place counts
#   against newcomers. Fails like the previous check, with NULL instead of a ticket.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5711 + PORT_OFFSET))}"
with_cluster wait_cancel

sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE wc LOGIN" \
    -c "ALTER ROLE wc SET quota.max_active_per_role = 1" >/dev/null

# counts: "active/retained tickets ledger" for role wc, as a superuser sees them.
counts() {
  sql -c "SELECT coalesce((SELECT active || '/' || retained FROM quota.usage WHERE role = 'wc'::regrole), '0/0')
                 || ' ' || (SELECT count(*) FROM quota.tickets WHERE role = 'wc'::regrole)
                 || ' ' || (SELECT count(*) FROM quota.ledger WHERE role = 'wc'::regrole)"
}
# napping PID: the backend PID is inside a waiting start(): it sleeps on its latch
# (wait event type Extension) while its statement runs. With the slot held, a start()
# can only get there after its first refusal, that is after it took its place.
napping() {
  timeout 10 bash -c "until [ \"\$('$PG_BIN/psql' -X -At -h '$CL' -p '$PORT' -U postgres -d postgres -c \
      \"SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active' AND wait_event_type = 'Extension'\")\" = 1 ]; do sleep 0.05; done"
}
# probe: a plain start() of wc (no wait); prints SQLSTATE and DETAIL on one line.
probe() {
  timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U wc -d postgres -v ON_ERROR_STOP=0 \
    -c "SELECT quota.start('probe')" -c '\echo SQLSTATE=:SQLSTATE' 2>&1 | tr '\n' ' ' || true
}
# session_pid NAME: the backend pid of session NAME.
session_pid() {
  say "$1" "SELECT 'pid=' || pg_backend_pid();"
  wait_out "$1" 'pid=' 10 || true
  sed -n 's/^pid=//p' "$CL/$1.out" | head -n1
}
ms_now() { date +%s%3N; }

open_session holder wc
take_slot() {  # take_slot TAG
  say holder "SELECT quota.start('holder') AS h \\gset"
  say holder "\\echo held_$1=:h"
  wait_out holder "held_$1=[0-9a-f]" 10 || true
}
take_slot first

# run_case NAME: one interrupted wait of A with B behind it; NAME is timeout, cancel
# or terminate.
run_case() {
  local how="$1" a="a_$1" b="b_$1" apid bpid before t0 t1 out
  before=$(counts)
  expect_eq "$how: the holder has the role's only slot" 1 "${before%%/*}"
  open_session "$a" wc
  open_session "$b" wc
  apid=$(session_pid "$a"); bpid=$(session_pid "$b")
  [ "$how" = timeout ] && say "$a" "SET statement_timeout = '6s';"
  t0=$(ms_now)
  say "$a" "SELECT quota.start('A $how', wait => '20 s');"
  say "$a" "\\echo state=:SQLSTATE"
  check "$how: A (pid $apid) waits in start() with its place in line" napping "$apid"
  say "$b" "SELECT quota.start('B $how', wait => '20 s') AS t \\gset"
  say "$b" "\\echo admitted=:t"
  say "$b" "SELECT 'clock=' || to_char(clock_timestamp(), 'YYYY-MM-DD HH24:MI:SS.US');"
  check "$how: B (pid $bpid) waits behind A" napping "$bpid"
  out=$(probe)
  check "$how: with A and B waiting, a probe is refused counting 2 earlier starts [$out]" \
    grep -q "SQLSTATE=53400" <<<"$out"
  check "$how: ... and its DETAIL names the 2 waiters" grep -q "2 earlier starts are still waiting for capacity and go first." <<<"$out"
  check "$how: A is still waiting, not ended yet" test -z "$(grep 'state=' "$CL/$a.out" || true)"

  case "$how" in
    timeout) ;;  # statement_timeout (6 s) ends A by itself
    cancel) sql -c "SELECT pg_cancel_backend($apid)" >/dev/null ;;
    terminate) sql -c "SELECT pg_terminate_backend($apid)" >/dev/null ;;
  esac
  if [ "$how" = terminate ]; then
    check "terminate: A's backend is gone" \
      timeout 10 bash -c "until [ \"\$('$PG_BIN/psql' -X -At -h '$CL' -p '$PORT' -U postgres -c 'SELECT count(*) FROM pg_stat_activity WHERE pid = $apid')\" = 0 ]; do sleep 0.05; done"
    check "terminate: A's session was told so" wait_out "$a" 'terminating connection due to administrator command' 10
  else
    wait_out "$a" 'state=' 15 || true
    t1=$(ms_now)
    expect_eq "$how: A's start() failed with 57014" "state=57014" "$(grep -m1 'state=' "$CL/$a.out" || true)"
    check "$how: A ended long before its 20 s wait was up ($((t1 - t0)) ms)" test $((t1 - t0)) -lt 12000
    if [ "$how" = timeout ]; then
      check "timeout: the error is statement_timeout's" grep -q "canceling statement due to statement timeout" "$CL/$a.out"
      check "timeout: A waited about its statement_timeout ($((t1 - t0)) ms)" test $((t1 - t0)) -ge 5500
    else
      check "cancel: the error is pg_cancel_backend's" grep -q "canceling statement due to user request" "$CL/$a.out"
    fi
  fi
  check "$how: B is still waiting after A's end" napping "$bpid"
  expect_eq "$how: usage, tickets and ledger of the role are unchanged by A's interrupted wait" "$before" "$(counts)"
  out=$(probe)
  check "$how: A's place in line is gone: a probe counts only B as waiting [$out]" \
    grep -q "Active tickets: 1 of 1. Retained tickets: [0-9]* of 10000. 1 earlier start() is still waiting for capacity and goes first." <<<"$out"

  # Free the slot: B, and only B, is admitted.
  local fin_ms
  say holder "SELECT quota.finish(:'h');"
  say holder "SELECT 'freed_$how=' || to_char(clock_timestamp(), 'YYYY-MM-DD HH24:MI:SS.US');"
  wait_out holder "freed_$how=" 10 || true
  fin_ms=$(ms_now)
  check "$how: B is admitted once the holder finished" wait_out "$b" 'admitted=[0-9a-f]' 5
  local lag
  lag=$(sql -c "SELECT round(extract(epoch FROM '$(sed -n 's/^clock=//p' "$CL/$b.out" | head -n1)'::timestamptz
                                             - '$(sed -n "s/^freed_$how=//p" "$CL/holder.out")'::timestamptz) * 1000)" 2>/dev/null || echo 99999)
  check "$how: ... within 3 s of the finish ($lag ms)" test "${lag:-99999}" -lt 3000
  sleep 0.5
  expect_eq "$how: A's interrupted wait never turned into a ticket" 0 \
    "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label = 'A $how'")"
  expect_eq "$how: the role has exactly B's ticket active" "B $how" \
    "$(sql -c "SELECT string_agg(label, ',') FROM quota.tickets WHERE role = 'wc'::regrole AND ended_at IS NULL")"
  say "$b" "SELECT quota.finish(:'t');"
  say "$b" "\\echo finished_b"
  wait_out "$b" 'finished_b' 10 || true

  # No waiter left: a newcomer's fail-fast try_start() is admitted at once.
  out=$(timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U wc -d postgres \
          -c "SELECT quota.finish(t) FROM (SELECT quota.try_start('newcomer $how') AS t) s" 2>&1 || true)
  expect_eq "$how: a newcomer's try_start() is admitted right after (and finished)" t "$out"
  if [ "$how" != terminate ]; then
    say "$a" "RESET statement_timeout;"
    say "$a" "SELECT 'again=' || quota.finish(t) FROM (SELECT quota.try_start('A again $how') AS t) s;"
    check "$how: A's own session starts and finishes again as before" wait_out "$a" 'again=t' 10
  fi
  close_session "$a"; close_session "$b"

  take_slot "$how"
}

run_case timeout
run_case cancel
run_case terminate

out=$(probe)
check "at the end, nobody is counted as waiting [$out]" \
  grep -q "SQLSTATE=53400" <<<"$out"
no_waiter() { ! grep -q 'still waiting' <<<"$out"; }
check "... the DETAIL mentions no waiter" no_waiter
check "no crash: the server did not reinitialize" bash -c "! grep -q 'reinitializing' '$CL/server.log'"
finish_checks
