#!/usr/bin/env bash
# Waiting starts are not starved, and go in their order of arrival (0.2.0 fairness).
#
# A role with quota.max_active_per_role = 1.
#
# Part 1, a stream of fail-fast newcomers: 6 sessions call try_start() in a tight
# server-side loop (a procedure that COMMITs after each call) and finish at once
# whenever they are admitted. In each of 4 rounds a holder takes the slot, a waiter
# calls start(wait => '20 s') and takes its place in line, the stream goes on for a
# second, and the holder finishes. Checks, per round:
# - a probe start() while the waiter waits is refused with a DETAIL that counts 1
#   earlier start() still waiting (the newcomers count the waiter as if it were
#   active). Fails if waiters are not counted by later starts (waiters::ahead returns
#   0) or the DETAIL loses its sentence;
# - the waiter gets a ticket, within 2 s of the holder's finish. Fails if it is
#   starved (it would wait its 20 s and fail with 53400) or if finish() does not wake
#   it and the wake-up lags;
# - the first ticket admitted after the holder's is the waiter's: no newcomer slipped
#   in between, although the stream was trying all the time. Fails if newcomers do
#   not count the waiters ahead of them: a spinning newcomer usually takes the freed
#   slot before the woken waiter, in at least one of the rounds;
# - the stream really competed: newcomers got tickets between the rounds (when the
#   slot was free) and tried thousands of times. Fails if the stream was not running,
#   which would make the checks above vacuous.
#
# Part 2, waiters among waiters (FIFO): 4 newcomer sessions loop on
# start(wait => '20 s') (finishing each ticket at once, recording when each call
# began); a holder takes the slot; then waiters w1..w5 arrive one by one, each only
# after the previous is seen napping in line. The holder finishes; each w_k holds its
# ticket 50 ms. Checks:
# - w1..w5 are admitted in their order of arrival (started_at strictly increasing).
#   Fails if the line is not ordered by place (e.g. whoever wakes first wins);
# - no newcomer whose call began after w_k was already in line got a ticket before
#   w_k. Fails the same way, or if a waiter that re-checks after a wake-up loses its
#   place (takes a new number).
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5710 + PORT_OFFSET))}"
with_cluster wait_fairness

sql >/dev/null <<'SQL'
CREATE EXTENSION pg_quota;
CREATE ROLE wf LOGIN;
ALTER ROLE wf SET quota.max_active_per_role = 1;
-- calls: the tickets the stream received, and when each call began.
CREATE TABLE calls (ticket uuid, who int, called_at timestamptz);
CREATE TABLE stream_stats (part int, who int, tries bigint, admitted bigint);
CREATE TABLE stop_flag (part int);
GRANT INSERT, SELECT ON calls, stream_stats, stop_flag TO wf;
-- One newcomer: calls try_start() (or start() with a wait) over and over, finishing
-- what it gets at once; one transaction per call, so each finish commits at once.
CREATE PROCEDURE newcomer(part int, who int, waiting bool) LANGUAGE plpgsql AS $$
DECLARE t uuid; c timestamptz; tries bigint := 0; got bigint := 0;
        deadline timestamptz := clock_timestamp() + interval '50 s';
BEGIN
  WHILE clock_timestamp() < deadline AND NOT EXISTS (SELECT 1 FROM stop_flag s WHERE s.part = newcomer.part) LOOP
    c := clock_timestamp();
    IF waiting THEN
      t := quota.start('newcomer', wait => '20 s');
    ELSE
      t := quota.try_start('newcomer');
    END IF;
    tries := tries + 1;
    IF t IS NOT NULL THEN
      PERFORM quota.finish(t);
      INSERT INTO calls VALUES (t, who, c);
      got := got + 1;
    END IF;
    COMMIT;
  END LOOP;
  INSERT INTO stream_stats VALUES (part, who, tries, got);
END $$;
SQL

# napping PID: the backend PID sleeps inside a waiting start() (its statement runs,
# waiting on its latch). With the slot held, it gets there only after its first
# refusal, that is after it took its place in line.
napping() {
  timeout 10 bash -c "until [ \"\$('$PG_BIN/psql' -X -At -h '$CL' -p '$PORT' -U postgres -d postgres -c \
      \"SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active' AND wait_event_type = 'Extension'\")\" = 1 ]; do sleep 0.05; done"
}
session_pid() {
  say "$1" "SELECT 'pid=' || pg_backend_pid();"
  wait_out "$1" 'pid=' 10 || true
  sed -n 's/^pid=//p' "$CL/$1.out" | head -n1
}
probe() {  # a plain start() of wf; SQLSTATE and messages on one line
  timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U wf -d postgres -v ON_ERROR_STOP=0 \
    -c "SELECT quota.start('probe')" -c '\echo SQLSTATE=:SQLSTATE' 2>&1 | tr '\n' ' ' || true
}
stream() {  # stream PART N WAITING: N newcomer sessions in the background
  local k
  for k in $(seq 1 "$2"); do
    bg bash -c "timeout 70 '$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U wf -d postgres \
                  -c 'CALL newcomer($1, $k, $3)' > '$CL/stream.$1.$k.log' 2>&1"
  done
}
stop_stream() {  # stop_stream PART N: until the N newcomers reported
  sql -c "INSERT INTO stop_flag VALUES ($1)" >/dev/null
  timeout 40 bash -c "until [ \"\$('$PG_BIN/psql' -X -At -h '$CL' -p '$PORT' -U postgres -d postgres -c \
      'SELECT count(*) FROM stream_stats WHERE part = $1')\" = $2 ]; do sleep 0.1; done" || true
}
TS="to_char(clock_timestamp(), 'YYYY-MM-DD HH24:MI:SS.US')"

# ---------------------------------------------------------------------------------
# Part 1: one waiter against a stream of fail-fast newcomers.
# ---------------------------------------------------------------------------------
ROUNDS=4
stream 1 6 false
open_session holder wf
open_session waiter wf
wpid=$(session_pid waiter)
sleep 0.5
for r in $(seq 1 $ROUNDS); do
  # The holder takes the slot (waiting for it: it must get it against the stream).
  say holder "SELECT quota.start('holder $r', wait => '20 s') AS h \\gset"
  say holder "\\echo held_$r=:h"
  check "round $r: the holder got the slot against the stream" wait_out holder "held_$r=[0-9a-f]" 25
  say waiter "SELECT quota.start('waiter $r', wait => '20 s') AS t \\gset"
  say waiter "SELECT 'admitted_$r=' || :'t' || '|' || $TS;"
  check "round $r: the waiter waits in line" napping "$wpid"
  out=$(probe)
  check "round $r: a newcomer's start() is refused counting the waiter ahead of it [$out]" \
    grep -q "Active tickets: 1 of 1\. .* 1 earlier start() is still waiting for capacity and goes first\..*SQLSTATE=53400" <<<"$out"
  sleep 1
  say holder "SELECT quota.finish(:'h');"
  say holder "SELECT 'freed_$r=' || $TS;"
  wait_out holder "freed_$r=" 10 || true
  check "round $r: the waiter got a ticket" wait_out waiter "admitted_$r=[0-9a-f]" 25
  line=$(sed -n "s/^admitted_$r=//p" "$CL/waiter.out")
  ticket=${line%%|*}
  lag=$(sql -c "SELECT round(extract(epoch FROM '${line#*|}'::timestamptz - '$(sed -n "s/^freed_$r=//p" "$CL/holder.out")'::timestamptz) * 1000)" 2>/dev/null || echo 99999)
  check "round $r: ... within 2 s of the holder's finish ($lag ms)" test "${lag:-99999}" -lt 2000
  # The tickets in the order the writer admitted them: the one after the holder's.
  next=$(sql -c "SELECT coalesce(label, '?') FROM quota.ledger
                  WHERE role = 'wf'::regrole
                    AND started_at > (SELECT started_at FROM quota.ledger WHERE label = 'holder $r')
                  ORDER BY started_at, label LIMIT 1")
  expect_eq "round $r: the first ticket admitted after the holder's is the waiter's (no newcomer slipped in)" \
    "waiter $r" "$next"
  expect_eq "round $r: that is the ticket the waiter received" "waiter $r" \
    "$(sql -c "SELECT label FROM quota.ledger WHERE id = '${ticket:-00000000-0000-0000-0000-000000000000}'")"
  say waiter "SELECT quota.finish(:'t');"
  sleep 0.5   # the stream has the slot to itself for a while
done
between=$(sql -c "SELECT count(*) FROM quota.ledger n WHERE n.label = 'newcomer'
                     AND n.started_at > (SELECT started_at FROM quota.ledger WHERE label = 'holder 1')")
stop_stream 1 6
stats=$(sql -c "SELECT coalesce(sum(tries), 0) || ' ' || coalesce(sum(admitted), 0) || ' ' || count(*) FROM stream_stats WHERE part = 1")
read -r tries admitted reported <<<"$stats"
expect_eq "part 1: the 6 newcomer sessions ran to the end without error" 6 "$reported"
check "part 1: the stream tried hard ($tries try_start() calls)" test "$tries" -gt 2000
check "part 1: the stream got tickets between the rounds ($between after the first holder's, $admitted in all)" \
  test "$between" -ge "$ROUNDS"
grep -h ERROR "$CL"/stream.1.*.log | sed 's/^/# /' | head -n3 || true
expect_eq "part 1: no ticket left active" 0 \
  "$(sql -c "SELECT count(*) FROM quota.tickets WHERE role = 'wf'::regrole AND ended_at IS NULL")"
close_session waiter

# ---------------------------------------------------------------------------------
# Part 2: FIFO among waiters, newcomers waiting too.
# ---------------------------------------------------------------------------------
K=5
stream 2 4 true
sleep 0.5
say holder "SELECT quota.start('fifo holder', wait => '20 s') AS h \\gset"
say holder "\\echo fifo_held=:h"
check "part 2: the holder got the slot" wait_out holder "fifo_held=[0-9a-f]" 25
for k in $(seq 1 $K); do
  open_session "w$k" wf
  pid=$(session_pid "w$k")
  say "w$k" "SELECT quota.start('w$k', wait => '20 s') AS t \\gset"
  say "w$k" "\\echo admitted=:t"
  say "w$k" "SELECT pg_sleep(0.05);"
  say "w$k" "SELECT 'finished=' || quota.finish(:'t');"
  check "part 2: w$k waits in line" napping "$pid"
  # From now on w$k is in line: any call that begins later arrives after it.
  sql -c "INSERT INTO calls VALUES (NULL, -$k, clock_timestamp())" >/dev/null
done
sleep 0.5
say holder "SELECT quota.finish(:'h');"
all_in() { local k; for k in $(seq 1 $K); do wait_out "w$k" 'finished=t' 30 || return 1; done; }
check "part 2: every waiter got its ticket and finished it" all_in
stop_stream 2 4
expect_eq "part 2: the 4 waiting newcomer sessions ran to the end without error" 4 \
  "$(sql -c "SELECT count(*) FROM stream_stats WHERE part = 2")"
grep -h ERROR "$CL"/stream.2.*.log | sed 's/^/# /' | head -n3 || true
order=$(sql -c "SELECT string_agg(label, ' ' ORDER BY started_at) FROM quota.ledger WHERE label ~ '^w[0-9]+$'")
expect_eq "part 2: w1..w$K were admitted in their order of arrival" "$(seq -f 'w%g' -s ' ' 1 $K)" "$order"
overtakers=$(sql -c "SELECT count(*) FROM calls m JOIN quota.ledger w ON w.label = 'w' || (-m.who)
                       JOIN calls c ON c.who > 0 AND c.called_at > m.called_at
                       JOIN quota.ledger n ON n.id = c.ticket
                      WHERE m.who < 0 AND n.started_at < w.started_at")
expect_eq "part 2: no newcomer that called after w_k was in line got a ticket before w_k" 0 "$overtakers"
late=$(sql -c "SELECT count(*) FROM calls c JOIN quota.ledger n ON n.id = c.ticket
                WHERE c.who > 0 AND c.called_at > (SELECT called_at FROM calls WHERE who = -1)
                  AND n.started_at > (SELECT started_at FROM quota.ledger WHERE label = 'fifo holder')")
check "part 2: newcomers kept arriving behind the waiters ($late calls after w1 lined up)" test "$late" -gt 0
check "no crash: the server did not reinitialize" bash -c "! grep -q 'reinitializing' '$CL/server.log'"
finish_checks
