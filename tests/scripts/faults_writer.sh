#!/usr/bin/env bash
# Faults of the ledger writer: it is killed with SIGKILL during a burst of starts (I6:
# no received ticket is lost), it is terminated while callers wait for it (they get an
# error at once, not a hang), a caller holds a lock the writer needs (55P03 after the
# writer's lock_timeout, not a deadlock), and background worker slots run short (a writer
# of another database gives its slot up; 53000 after quota.writer_start_wait, not a hang,
# when no writer can).
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5521 + PORT_OFFSET))}"
with_cluster faults_writer
CL1="$CL"


psql_as() {  # psql_as USER [psql args...]: like sql, as USER, in database postgres, 20 s at most
  local user="$1"; shift
  timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U "$user" -d postgres "$@"
}
writer_pids() {
  sql -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer'"
}
uuids() { grep -h '^[0-9a-f]\{8\}-[0-9a-f]\{4\}-[0-9a-f]\{4\}-[0-9a-f]\{4\}-[0-9a-f]\{12\}$' "$@" || true; }
log_count() { grep -c -- "$1" "$CL/server.log" || true; }
# wait_recovered SINCE_LINES: waits (bounded) until the postmaster has reinitialized
# after a crash that happened after the first SINCE_LINES lines of the server log,
# and accepts connections again.
wait_recovered() {
  local since="$1"
  timeout 60 bash -c "until tail -n +$((since + 1)) '$CL/server.log' | grep -q 'all server processes terminated; reinitializing'; do sleep 0.1; done" || return 1
  timeout 60 bash -c "until '$PG_BIN/pg_isready' -q -h '$CL' -p '$PORT'; do sleep 0.1; done"
}
summary_matches_ledger() {  # every role: summary row = ledger rows
  [ "$(sql -c "SELECT count(*) FROM quota.summary s FULL JOIN
                 (SELECT role, count(*) AS n FROM quota.ledger GROUP BY role) l USING (role)
                WHERE s.tickets IS DISTINCT FROM l.n")" = 0 ]
}
now_s() { date +%s.%N; }
elapsed_lt() { awk -v a="$1" -v b="$2" -v lim="$3" 'BEGIN { exit !((b - a) < lim) }'; }

sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE fw_tenant LOGIN" \
    -c "ALTER ROLE fw_tenant SET quota.max_active_per_role = 0" \
    -c "ALTER ROLE fw_tenant SET quota.max_retained_per_role = 0" \
    -c "CREATE TABLE received (ticket uuid NOT NULL)"

# ------------------------------------------------------------------------------------
# 1. kill -9 of the writer while 8 sessions are starting tickets.
# ------------------------------------------------------------------------------------
for _ in $(seq 1 50); do echo "SELECT quota.start('burst');"; done > "$CL/burst.sql"
chmod 644 "$CL/burst.sql"
rm -f "$CL/stop"
for k in $(seq 1 8); do : > "$CL/got.$k"; bg bash -c "$(declare -f burst_client); CL='$CL' PORT='$PORT' PG_BIN='$PG_BIN' burst_client fw_tenant $k"; done
burst_pids=("${BG[@]}")

# Let the burst get going, then kill the writer in the middle of it.
timeout 30 bash -c "until [ \"\$('$PG_BIN/psql' -X -At -h '$CL' -p '$PORT' -U postgres -c \"SELECT count(*) >= 300 FROM quota.ledger\")\" = t ]; do sleep 0.05; done" || true
victim=$(writer_pids | head -n1)
log_lines=$(wc -l < "$CL/server.log")
check "a ledger writer was serving the burst" test -n "$victim"
[ -n "$victim" ] && kill -9 "$victim"
received_before_kill=$(uuids "$CL"/got.* | wc -l)
check "the postmaster reinitialized after the writer's SIGKILL" wait_recovered "$log_lines"
recovered_at=$(sql -c "SELECT now()")
sleep 2   # the clients reconnect and go on starting
touch "$CL/stop"
for p in "${burst_pids[@]}"; do timeout 60 tail --pid="$p" -f /dev/null || true; done

tail -n +"$((log_lines + 1))" "$CL/server.log" > "$CL/crash1.log"
check "the writer died of signal 9" grep -q "pg_quota ledger writer.*was terminated by signal 9" "$CL/crash1.log"
uuids "$CL"/got.* > "$CL/received.1"
received=$(wc -l < "$CL/received.1")
check "callers had received tickets before the kill ($received_before_kill)" test "$received_before_kill" -gt 0
sql -c "\\copy received FROM '$CL/received.1'"
expect_eq "every ticket a caller received survived the writer's crash ($received tickets)" 0 \
  "$(sql -c "SELECT count(*) FROM received r WHERE NOT EXISTS (SELECT 1 FROM quota.ledger l WHERE l.id = r.ticket AND l.role = 'fw_tenant'::regrole AND l.ended_at IS NULL)")"
expect_eq "no ticket was handed to two callers" "$received" "$(sql -c "SELECT count(DISTINCT ticket) FROM received")"
check "starts went on after recovery with a new writer" \
  test "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label = 'burst' AND started_at > '$recovered_at'")" -gt 0
check "the summary equals the ledger row count after the writer's crash" summary_matches_ledger
expect_eq "the tenant's summary row counts its ledger rows" \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'fw_tenant'::regrole")" \
  "$(sql -c "SELECT tickets FROM quota.summary WHERE role = 'fw_tenant'::regrole")"
expect_eq "start() works after the writer's crash" t \
  "$(psql_as fw_tenant -c "SELECT quota.start('after kill') IS NOT NULL" 2>&1)"

# ------------------------------------------------------------------------------------
# 2. pg_cancel_backend and pg_terminate_backend of the writer while callers wait for
#    it. A superuser holds LOCK TABLE quota.ledger, so the writer waits inside its
#    batch and cannot answer. The callers' requests did nothing wrong: a cancelled
#    batch is retried, a terminated writer hands its uncommitted batch back to the
#    next writer, and once the lock is released every caller is admitted. (0.1.0
#    failed the whole batch with 57014, and answered 57000 after a terminate.)
# ------------------------------------------------------------------------------------
mkfifo "$CL/lock_in"; chmod 666 "$CL/lock_in"
waiter() {  # waiter ROUND K: one tenant start that will wait for the writer
  local r="$1" k="$2"
  timeout 30 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -v VERBOSITY=verbose -h "$CL" -p "$PORT" \
    -U fw_tenant -d postgres -c "SELECT quota.start('waiting $r $k') IS NOT NULL" -c '\echo SQLSTATE=:SQLSTATE' \
    > "$CL/wait_out.$r.$k" 2>&1
  date +%s.%N > "$CL/wait_done.$r.$k"
}
for how in cancel terminate; do
  rm -f "$CL/lock_out"
  bg bash -c "exec '$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U postgres -d postgres < '$CL/lock_in' > '$CL/lock_out' 2>&1"
  exec 3> "$CL/lock_in"
  echo "BEGIN; LOCK TABLE quota.ledger IN EXCLUSIVE MODE; SELECT 'locked';" >&3
  timeout 10 bash -c "until grep -q locked '$CL/lock_out'; do sleep 0.05; done"
  for k in 1 2 3; do bg bash -c "$(declare -f waiter); CL='$CL' PORT='$PORT' PG_BIN='$PG_BIN' waiter $how $k"; done
  # The writer waits on the table lock (its lock_timeout is 5 s: act well before it),
  # and the three callers wait on their latches.
  blocked=""
  for _ in $(seq 1 60); do
    blocked=$(sql -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer' AND wait_event_type = 'Lock'")
    n_wait=$(sql -c "SELECT count(*) FROM pg_stat_activity WHERE usename = 'fw_tenant' AND query LIKE '%quota.start(''waiting $how%' AND state = 'active'")
    [ -n "$blocked" ] && [ "$n_wait" = 3 ] && break
    sleep 0.05
  done
  check "$how: the writer is blocked by the table lock while 3 callers wait" test -n "$blocked" -a "$n_wait" = 3
  reinit_before=$(log_count "reinitializing")
  if [ "$how" = cancel ]; then
    [ -n "$blocked" ] && sql -c "SELECT pg_cancel_backend($blocked)" >/dev/null
  else
    [ -n "$blocked" ] && sql -c "SELECT pg_terminate_backend($blocked, 5000)" >/dev/null
  fi
  sleep 0.3   # let the writer act on the signal while the lock is still held
  echo "COMMIT;" >&3
  exec 3>&-
  timeout 20 bash -c "until [ -e '$CL/wait_done.$how.1' ] && [ -e '$CL/wait_done.$how.2' ] && [ -e '$CL/wait_done.$how.3' ]; do sleep 0.02; done" || true
  for k in 1 2 3; do
    expect_eq "$how: waiting caller $k is admitted once the lock is released" "t SQLSTATE=00000" \
      "$(tr '\n' ' ' < "$CL/wait_out.$how.$k" 2>/dev/null | sed 's/ $//')"
  done
  expect_eq "$how: the 3 waiting callers hold 3 tickets" 3 \
    "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label LIKE 'waiting $how %'")"
  expect_eq "$how of the writer is not a crash (no reinitialization)" "$reinit_before" "$(log_count "reinitializing")"
  if [ "$how" = terminate ]; then
    new_writer=$(writer_pids | head -n1)
    check "a new writer (pid $new_writer) replaced the terminated one ($blocked)" \
      test -n "$new_writer" -a "$new_writer" != "$blocked"
  fi
  check "$how: the summary equals the ledger" summary_matches_ledger
done

# ------------------------------------------------------------------------------------
# 3. The caller itself holds a lock the writer needs, then calls start() as a tenant.
#    The writer gives up after its lock_timeout (5 s) and the caller gets 55P03.
# ------------------------------------------------------------------------------------
self_lock() {  # self_lock TABLE MODE LABEL: prints the SQLSTATE and the elapsed seconds
  local s e out
  s=$(now_s)
  out=$(timeout 60 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -v VERBOSITY=verbose -h "$CL" -p "$PORT" -U postgres \
        -c "BEGIN" -c "LOCK TABLE $1 IN $2 MODE" \
        -c "SET LOCAL quota.max_active_per_role = 0" -c "SET LOCAL quota.max_retained_per_role = 0" \
        -c "SET LOCAL ROLE fw_tenant" -c "SELECT quota.start('$3')" -c '\echo SQLSTATE=:SQLSTATE' \
        -c "ROLLBACK" 2>&1 || true)
  e=$(now_s)
  echo "$(grep -o 'SQLSTATE=.*' <<<"$out" | head -n1) $(awk -v a="$s" -v b="$e" 'BEGIN { printf "%.1f", b - a }')"
}
read -r st secs <<<"$(self_lock quota.ledger EXCLUSIVE 'self-locked ledger')"
expect_eq "a caller holding LOCK TABLE quota.ledger gets 55P03 from start()" SQLSTATE=55P03 "$st"
check "... within 30 s, no hang (took $secs s)" awk -v s="$secs" 'BEGIN { exit !(s < 30) }'
read -r st secs <<<"$(self_lock quota.summary 'ACCESS EXCLUSIVE' 'self-locked summary')"
expect_eq "a caller holding ACCESS EXCLUSIVE on quota.summary gets 55P03 from start()" SQLSTATE=55P03 "$st"
check "... within 30 s, no hang (took $secs s)" awk -v s="$secs" 'BEGIN { exit !(s < 30) }'
expect_eq "no charge was recorded for the self-locked calls" 0 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label LIKE 'self-locked%'")"
expect_eq "start() works once the caller's lock is gone" t \
  "$(psql_as fw_tenant -c "SELECT quota.start('after self-lock') IS NOT NULL" 2>&1)"
check "the summary equals the ledger after the lock timeouts" summary_matches_ledger

# ------------------------------------------------------------------------------------
# 4. One background worker slot: max_worker_processes = 1 (and no logical replication
#    launcher to take it). The first database's writer takes the only slot; the
#    second database's start() does not fail: the first writer, idle, gives the slot
#    up. Then the slot is taken by something else than a writer (the logical
#    replication launcher): start() waits quota.writer_start_wait (1 s here) and fails
#    with 53000, a detail and a hint.
# ------------------------------------------------------------------------------------
stop_cluster "$CL"
CL2="$(dirname "$CL1")/faults_writer_slots"
new_cluster "$CL2" "$PORT" "max_worker_processes = 1" "max_logical_replication_workers = 0"
CL="$CL2"
sql -c "CREATE EXTENSION pg_quota" -c "CREATE DATABASE second" -c "CREATE ROLE fw_tenant2 LOGIN"
sql -d second -c "CREATE EXTENSION pg_quota"
expect_eq "the first database's start() takes the only worker slot" t \
  "$(psql_as fw_tenant2 -c "SELECT quota.start('db one') IS NOT NULL" 2>&1)"
s=$(now_s)
out=$(timeout 20 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -v VERBOSITY=verbose -h "$CL" -p "$PORT" -U fw_tenant2 -d second \
      -c "SELECT quota.start('db two') IS NOT NULL" -c '\echo SQLSTATE=:SQLSTATE' 2>&1 || true)
e=$(now_s)
expect_eq "the second database's start() gets the slot: the first database's idle writer gives it up" \
  "t SQLSTATE=00000" "$(paste -sd' ' <<<"$out")"
check "... within 5 s (the writer idles 10 s before it leaves by itself)" elapsed_lt "$s" "$e" 5
expect_eq "the first database keeps working: its next start() gets the slot back in turn" t \
  "$(psql_as fw_tenant2 -c "SELECT quota.start('db one again') IS NOT NULL" 2>&1)"
expect_eq "each database recorded its tickets" "2 1" \
  "$(sql -c "SELECT count(*) FROM quota.ledger") $(sql -d second -c "SELECT count(*) FROM quota.ledger")"

stop_cluster "$CL"
CL3="$(dirname "$CL1")/faults_writer_noslot"
new_cluster "$CL3" "$PORT" "max_worker_processes = 1" "quota.writer_start_wait = '1s'"
CL="$CL3"
sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE fw_tenant3 LOGIN" >/dev/null
timeout 30 bash -c "until [ \"\$('$PG_BIN/psql' -X -At -h '$CL' -p '$PORT' -U postgres -c \"SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'logical replication launcher'\")\" = 1 ]; do sleep 0.2; done" || true
s=$(now_s)
out=$(timeout 20 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -v VERBOSITY=verbose -h "$CL" -p "$PORT" -U fw_tenant3 -d postgres \
      -c "SELECT quota.start('no slot')" -c '\echo SQLSTATE=:SQLSTATE' 2>&1 || true)
e=$(now_s)
check "with the only slot held by the logical replication launcher, start() fails with 53000: $(grep -m1 ERROR <<<"$out")" \
  grep -q "^SQLSTATE=53000$" <<<"$out"
check "... with a detail naming quota.writer_start_wait" grep -q "^DETAIL:.*quota.writer_start_wait" <<<"$out"
check "... and a hint to raise max_worker_processes" grep -q "^HINT:.*max_worker_processes" <<<"$out"
check "... after waiting quota.writer_start_wait (1 s), not at once and not much longer" \
  awk -v a="$s" -v b="$e" 'BEGIN { exit !((b - a) >= 1 && (b - a) < 5) }'
expect_eq "nothing was recorded" 0 "$(sql -c "SELECT count(*) FROM quota.ledger")"
finish_checks
