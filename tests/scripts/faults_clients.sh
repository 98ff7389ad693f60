#!/usr/bin/env bash
# Faults on the callers' side: a client backend killed with SIGKILL, or terminated, in
# the middle of start(), an immediate shutdown during a burst of starts (I6), and statement_timeout
# and pg_cancel_backend hitting start() at random points (I1 and I2: the ledger may
# over-count what callers received, never under-count, and never passes the limit).
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5522 + PORT_OFFSET))}"
with_cluster faults_clients


psql_as() {  # psql_as USER [psql args...]: like sql, as USER, in database postgres, 20 s at most
  local user="$1"; shift
  timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U "$user" -d postgres "$@"
}
uuids() { grep -h '^[0-9a-f]\{8\}-[0-9a-f]\{4\}-[0-9a-f]\{4\}-[0-9a-f]\{4\}-[0-9a-f]\{12\}$' "$@" || true; }
log_count() { grep -c -- "$1" "$CL/server.log" || true; }
wait_recovered() {  # wait_recovered SINCE_LINES (see faults_writer.sh)
  local since="$1"
  timeout 60 bash -c "until tail -n +$((since + 1)) '$CL/server.log' | grep -q 'all server processes terminated; reinitializing'; do sleep 0.1; done" || return 1
  timeout 60 bash -c "until '$PG_BIN/pg_isready' -q -h '$CL' -p '$PORT'; do sleep 0.1; done"
}
summary_matches_ledger() {
  [ "$(sql -c "SELECT count(*) FROM quota.summary s FULL JOIN
                 (SELECT role, count(*) AS n FROM quota.ledger GROUP BY role) l USING (role)
                WHERE s.tickets IS DISTINCT FROM l.n")" = 0 ]
}
# missing FILE ROLE: how many tickets listed in FILE are not active tickets of ROLE.
missing() {
  sql -c "TRUNCATE received" -c "\\copy received FROM '$1'" \
      -c "SELECT count(*) FROM received r WHERE NOT EXISTS (SELECT 1 FROM quota.ledger l
            WHERE l.id = r.ticket AND l.role = '$2'::regrole AND l.ended_at IS NULL)"
}

sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE fc_tenant LOGIN" \
    -c "ALTER ROLE fc_tenant SET quota.max_active_per_role = 0" \
    -c "ALTER ROLE fc_tenant SET quota.max_retained_per_role = 0" \
    -c "CREATE TABLE received (ticket uuid NOT NULL)"

# hold_ledger_lock: a superuser session, fed through fd 3, holds LOCK TABLE
# quota.ledger IN EXCLUSIVE MODE, so that the writer cannot answer. Release it with
# echo "COMMIT;" >&3 (or by closing fd 3).
hold_ledger_lock() {
  rm -f "$CL/lock_out"
  [ -p "$CL/lock_in" ] || { mkfifo "$CL/lock_in"; chmod 666 "$CL/lock_in"; }
  bg bash -c "exec '$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U postgres -d postgres < '$CL/lock_in' > '$CL/lock_out' 2>&1"
  exec 3> "$CL/lock_in"
  echo "BEGIN; LOCK TABLE quota.ledger IN EXCLUSIVE MODE; SELECT 'locked';" >&3
  timeout 10 bash -c "until grep -q locked '$CL/lock_out'; do sleep 0.05; done"
}

# start_waiting_caller ROLE LABEL NAME: runs ROLE's quota.start(LABEL) in the
# background (output in $CL/NAME.out, exit status in $CL/NAME.rc) and sets `victim` to
# its pid once it waits inside start() while the writer waits for the ledger lock.
start_waiting_caller() {
  local role="$1" label="$2" name="$3"
  bg bash -c "timeout 60 '$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U $role -d postgres \
                -c \"SELECT quota.start('$label')\" > '$CL/$name.out' 2>&1; echo \$? > '$CL/$name.rc'"
  victim=""
  for _ in $(seq 1 80); do
    victim=$(sql -c "SELECT pid FROM pg_stat_activity WHERE usename = '$role' AND state = 'active'
                       AND query LIKE '%$label%' AND wait_event_type = 'Extension'")
    writer_waits=$(sql -c "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer' AND wait_event_type = 'Lock'")
    [ -n "$victim" ] && [ "$writer_waits" = 1 ] && break
    sleep 0.05
  done
}

# ------------------------------------------------------------------------------------
# 1. kill -9 of a client backend while it waits in start(). A superuser's LOCK TABLE
#    keeps the writer from answering, so the caller is surely inside start().
# ------------------------------------------------------------------------------------
psql_as fc_tenant -c "SELECT quota.start('kept ' || i) FROM generate_series(1, 3) i" > "$CL/kept"
psql_as fc_tenant -c "SELECT quota.finish(id) FROM (SELECT '$(head -n1 "$CL/kept")'::uuid AS id) s" >/dev/null
tail -n +2 "$CL/kept" > "$CL/kept_active"

hold_ledger_lock
start_waiting_caller fc_tenant 'killed mid-start' killed
check "the caller is waiting inside start() while the writer waits for the lock" test -n "$victim" -a "$writer_waits" = 1
log_lines=$(wc -l < "$CL/server.log")
[ -n "$victim" ] && kill -9 "$victim"
check "the postmaster reinitialized after the client's SIGKILL" wait_recovered "$log_lines"
exec 3>&-
check "the killed caller's psql ended with an error, not a hang" \
  timeout 20 bash -c "until [ -e '$CL/killed.rc' ]; do sleep 0.05; done; [ \"\$(cat '$CL/killed.rc')\" != 0 ] && [ \"\$(cat '$CL/killed.rc')\" != 124 ]"
# PostgreSQL 15 logs "server process (PID …)", 18 "client backend (PID …)".
check "the client backend died of signal 9" grep -qE "(server process|client backend) \(PID $victim\) was terminated by signal 9" "$CL/server.log"
expect_eq "the received tickets are still active after recovery" 0 "$(missing "$CL/kept_active" fc_tenant)"
expect_eq "the finished ticket stays finished" 1 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE id = '$(head -n1 "$CL/kept")' AND outcome = 'succeeded'")"
# The writer could not insert while the lock was held, and the crash ended both.
expect_eq "the killed call left no charge (the writer never got the lock)" 0 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label = 'killed mid-start'")"
expect_eq "the tenant's active count is consistent after the crash" 2 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'fc_tenant'::regrole AND ended_at IS NULL")"
check "the summary equals the ledger after the client's crash" summary_matches_ledger
expect_eq "start() works after the client's crash" t \
  "$(psql_as fc_tenant -c "SELECT quota.start('after client kill') IS NOT NULL" 2>&1)"

# ------------------------------------------------------------------------------------
# 1b. pg_terminate_backend of a client whose request the writer has NOT claimed yet
#     (I6): the caller dies (FATAL, so no Rust Drop guard runs) and must leave no
#     charge behind: no orphan ticket that nobody holds, and its role's slot stays free.
#     To be sure the request is unclaimed, a first caller (fc_tenant) is claimed by the
#     writer, which then waits inside that batch for the ledger lock a superuser holds;
#     the second caller (fc_one, limit 1) hands its request over meanwhile, and is
#     terminated while the writer is still stuck. The writer's lock_timeout is 5 s: the
#     checks below confirm the writer was still in the first batch after the terminate.
# ------------------------------------------------------------------------------------
sql -c "CREATE ROLE fc_one LOGIN" -c "ALTER ROLE fc_one SET quota.max_active_per_role = 1"
reinit_before=$(log_count "reinitializing")
hold_ledger_lock
lock_taken=$(date +%s%N)
start_waiting_caller fc_tenant 'claimed first' claimed
check "a first caller's request is claimed and the writer waits for the lock inside its batch" \
  test -n "$victim" -a "$writer_waits" = 1
start_waiting_caller fc_one 'terminated unclaimed' term
check "a second caller (fc_one) is waiting inside start() while the writer is still stuck" \
  test -n "$victim" -a "$writer_waits" = 1
[ -n "$victim" ] && sql -c "SELECT pg_terminate_backend($victim, 4000)" >/dev/null
check "the terminated caller's psql ended at once, with an error" \
  timeout 5 bash -c "until [ -e '$CL/term.rc' ]; do sleep 0.05; done; [ \"\$(cat '$CL/term.rc')\" != 0 ]"
check "the terminated backend is gone" \
  test "$(sql -c "SELECT count(*) FROM pg_stat_activity WHERE pid = ${victim:-0}")" = 0
# The writer never left the first batch: it still waits for the lock and the first
# caller has no answer yet. So the terminated request was never claimed.
check "after the terminate, the writer still waits for the lock in the first batch ($(( ($(date +%s%N) - lock_taken) / 1000000 )) ms after the lock was taken)" \
  test "$(sql -c "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer' AND wait_event_type = 'Lock'")" = 1 \
       -a ! -e "$CL/claimed.rc"
echo "COMMIT;" >&3
exec 3>&-
check "the first caller is admitted once the lock is released" \
  timeout 15 bash -c "until [ -e '$CL/claimed.rc' ]; do sleep 0.05; done; [ \"\$(cat '$CL/claimed.rc')\" = 0 ] && grep -Eqx '[0-9a-f-]{36}' '$CL/claimed.out'"
# A superuser's start() handed over after the release is answered only after every
# request that was pending before it has been handled: after this, an orphan would show.
expect_eq "a start() after the release is answered (every earlier request handled)" t \
  "$(psql_as postgres -c "SELECT quota.start('barrier') IS NOT NULL" 2>&1)"
expect_eq "the terminated caller's unclaimed request left no charge" 0 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label = 'terminated unclaimed'")"
expect_eq "fc_one holds no ticket after its only caller was terminated" 0 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'fc_one'::regrole AND ended_at IS NULL")"
out=$(timeout 15 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U fc_one -d postgres -v ON_ERROR_STOP=0 \
        -c "SELECT quota.start('after terminate') IS NOT NULL" -c '\echo SQLSTATE=:SQLSTATE' 2>&1 || true)
expect_eq "fc_one's next start() is admitted: the terminated caller holds no slot" \
  "t SQLSTATE=00000" "$(tr '\n' ' ' <<<"$out" | sed 's/ $//')"
check "fc_one has at most 1 active ticket" test "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'fc_one'::regrole AND ended_at IS NULL")" -le 1
expect_eq "terminating a waiting client is not a crash" "$reinit_before" "$(log_count "reinitializing")"
check "the summary equals the ledger after the terminate" summary_matches_ledger
sql -c "SELECT count(quota.finish(id)) FROM quota.ledger WHERE role = 'fc_one'::regrole AND ended_at IS NULL" \
    -c "SELECT count(quota.finish(id)) FROM quota.ledger WHERE label IN ('claimed first', 'barrier') AND ended_at IS NULL" >/dev/null
expect_eq "once its tickets are finished, fc_one is admitted again" t \
  "$(psql_as fc_one -c "SELECT quota.start('again') IS NOT NULL" 2>&1)"

# ------------------------------------------------------------------------------------
# 2. pg_ctl stop -m immediate during a burst of starts from 8 sessions.
# ------------------------------------------------------------------------------------
for _ in $(seq 1 50); do echo "SELECT quota.start('burst');"; done > "$CL/burst.sql"
chmod 644 "$CL/burst.sql"
rm -f "$CL/stop"
burst_pids=()
for k in $(seq 1 8); do
  : > "$CL/got.$k"
  bg bash -c "$(declare -f burst_client); CL='$CL' PORT='$PORT' PG_BIN='$PG_BIN' burst_client fc_tenant $k"
  burst_pids+=("$LAST_BG")
done
timeout 30 bash -c "until [ \"\$('$PG_BIN/psql' -X -At -h '$CL' -p '$PORT' -U postgres -c \"SELECT count(*) >= 300 FROM quota.ledger WHERE label = 'burst'\")\" = t ]; do sleep 0.05; done" || true
stop_cluster "$CL" immediate
received_before=$(uuids "$CL"/got.* | wc -l)
as_pg "$PG_BIN/pg_ctl" -D "$CL/data" -l "$CL/server.log" -w -t 60 start >/dev/null
restarted_at=$(sql -c "SELECT now()")
sleep 1.5
touch "$CL/stop"
for p in "${burst_pids[@]}"; do timeout 60 tail --pid="$p" -f /dev/null || true; done
uuids "$CL"/got.* > "$CL/received.2"
received=$(wc -l < "$CL/received.2")
check "callers had received tickets before the immediate shutdown ($received_before)" test "$received_before" -gt 0
expect_eq "every ticket any client printed survived the immediate shutdown ($received tickets)" 0 \
  "$(missing "$CL/received.2" fc_tenant)"
expect_eq "no ticket was handed to two callers" "$received" "$(sort -u "$CL/received.2" | wc -l)"
check "starts went on after the restart" \
  test "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label = 'burst' AND started_at > '$restarted_at'")" -gt 0
check "the summary equals the ledger after the immediate shutdown" summary_matches_ledger
expect_eq "start() works after the restart" t \
  "$(psql_as fc_tenant -c "SELECT quota.start('after restart') IS NOT NULL" 2>&1)"

# ------------------------------------------------------------------------------------
# 3. statement_timeout (1..5 ms) and pg_cancel_backend at random points of start(),
#    try_start() and finish(), for a tenant with limit L. Each client prints every
#    ticket it receives ("got") and every finish that returned (committed, as psql runs
#    in autocommit; "fin"); a failed finish is retried once without a timeout. A
#    superuser janitor finishes tickets that stay active for more than 100 ms (charges
#    nobody received, or finishes that failed twice), so that the chaos goes on; it
#    prints what it ended, and the model counts those as finished too.
# ------------------------------------------------------------------------------------
L=6
sql -c "CREATE ROLE fc_limited LOGIN" \
    -c "ALTER ROLE fc_limited SET quota.max_active_per_role = $L" \
    -c "ALTER ROLE fc_limited SET quota.max_retained_per_role = 0"
reinit_before=$(log_count "reinitializing")
log_lines=$(wc -l < "$CL/server.log")
tiny() { local r=$((RANDOM % 6)); echo "SET statement_timeout = '${r}ms';"; }  # 0 = none
for k in $(seq 1 8); do
  for i in $(seq 1 40); do
    echo '\unset t'
    tiny
    if [ $((RANDOM % 2)) = 0 ]; then echo "SELECT quota.start('chaos $k.$i') AS t \\gset"
    else echo "SELECT quota.try_start('chaos $k.$i') AS t \\gset"; fi
    echo '\if :{?t}'
    echo '\echo got|:t'
    if [ $((RANDOM % 4)) = 0 ]; then tiny; else echo "SET statement_timeout = 0;"; fi
    echo "SELECT 'fin', quota.finish(:'t'), :'t';"
    echo '\if :ERROR'
    echo "SET statement_timeout = 0;"
    echo "SELECT 'fin', quota.finish(:'t'), :'t';"
    echo '\endif'
    echo '\endif'
  done > "$CL/chaos.$k.sql"
  chmod 644 "$CL/chaos.$k.sql"
done
rm -f "$CL/stop"
chaos_client() {  # chaos_client K: runs its script over and over for CHAOS_SECONDS
  local k="$1" end=$((SECONDS + CHAOS_SECONDS)) round
  for round in $(seq 1 200); do
    [ "$SECONDS" -ge "$end" ] && break
    timeout 60 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -h "$CL" -p "$PORT" -U fc_limited \
      -d postgres -f "$CL/chaos.$k.sql" >> "$CL/chaos_got.$k" 2>> "$CL/chaos_err.$k" || true
  done
}
chaos_pids=()
for k in $(seq 1 8); do
  bg bash -c "$(declare -f chaos_client); CL='$CL' PORT='$PORT' PG_BIN='$PG_BIN' CHAOS_SECONDS='${CHAOS_SECONDS:-8}' chaos_client $k"
  chaos_pids+=("$LAST_BG")
done
canceller() {  # cancels a fc_limited backend every few milliseconds: half of the time
               # one that waits inside pg_quota, else any busy one
  local n cond
  for n in $(seq 1 5000); do
    [ -e "$CL/stop" ] && break
    cond="state = 'active'"; [ $((RANDOM % 2)) = 0 ] && cond="wait_event_type = 'Extension'"
    timeout 10 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U postgres -d postgres -c \
      "SELECT pg_cancel_backend(pid) FROM pg_stat_activity
        WHERE usename = 'fc_limited' AND $cond ORDER BY random() LIMIT 1" >> "$CL/cancels" 2>&1 || true
    sleep "0.00$((RANDOM % 5))"
  done
}
bg bash -c "$(declare -f canceller); CL='$CL' PORT='$PORT' PG_BIN='$PG_BIN' canceller"
canceller_pid=$LAST_BG
janitor() {  # stops a second before the clients, so that their last charges stay
  local n end=$((SECONDS + CHAOS_SECONDS - 1))
  for n in $(seq 1 1000); do
    [ -e "$CL/stop" ] || [ "$SECONDS" -ge "$end" ] && break
    timeout 10 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U postgres -d postgres -c \
      "SELECT 'fin', quota.finish(id, 'cancelled'), id FROM quota.ledger
        WHERE role = 'fc_limited'::regrole AND ended_at IS NULL
          AND started_at < now() - interval '100 ms'" >> "$CL/janitor" 2>> "$CL/janitor_err" || true
    sleep 0.05
  done
}
bg bash -c "$(declare -f janitor); CL='$CL' PORT='$PORT' PG_BIN='$PG_BIN' CHAOS_SECONDS='${CHAOS_SECONDS:-8}' janitor"
janitor_pid=$LAST_BG
for p in "${chaos_pids[@]}"; do timeout 150 tail --pid="$p" -f /dev/null || true; done
touch "$CL/stop"
timeout 30 tail --pid="$canceller_pid" -f /dev/null || true
timeout 30 tail --pid="$janitor_pid" -f /dev/null || true

cat "$CL"/chaos_got.* > "$CL/chaos_got"
sed -n 's/^fin|t|//p' "$CL/chaos_got" | uuids /dev/stdin > "$CL/client_finished.3"
cat "$CL/janitor" >> "$CL/chaos_got"
sed -n 's/^got|//p' "$CL/chaos_got" | uuids /dev/stdin > "$CL/received.3"
sed -n 's/^fin|t|//p' "$CL/chaos_got" | uuids /dev/stdin > "$CL/finished.3"
grep -vxFf "$CL/finished.3" "$CL/received.3" > "$CL/held.3" || true
received=$(wc -l < "$CL/received.3"); finished=$(wc -l < "$CL/finished.3"); held=$(wc -l < "$CL/held.3")
active=$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'fc_limited'::regrole AND ended_at IS NULL")
cat "$CL"/chaos_err.* > "$CL/chaos_err"
timeouts=$(grep -c "canceling statement due to statement timeout" "$CL/chaos_err" || true)
cancels=$(grep -c "canceling statement due to user request" "$CL/chaos_err" || true)
refusals=$(grep -c "the limit set by quota.max_active_per_role" "$CL/chaos_err" || true)
check "statement timeouts hit calls ($timeouts)" test "$timeouts" -gt 0
check "pg_cancel_backend hit calls ($cancels)" test "$cancels" -gt 0
check "callers received tickets ($received) and finished some ($finished)" test "$received" -gt 0 -a "$finished" -gt 0
check "the limit was reached during the chaos ($refusals refusals)" test "$refusals" -gt 0
unexpected=$(grep ERROR "$CL/chaos_err" | grep -v -e "canceling statement due to" -e "the limit set by quota.max_active_per_role" || true)
check "no other error than cancels and refusals${unexpected:+: $(sort <<<"$unexpected" | uniq -c | head -n3)}" test -z "$unexpected"
check "every finish a client saw return had received its ticket" \
  test -z "$(grep -vxFf "$CL/received.3" "$CL/client_finished.3" || true)"
check "the janitor's finishes raised no error" test ! -s "$CL/janitor_err"
janitor_fin=$(grep -c '^fin|t|' "$CL/janitor" || true)
check "the chaos went on: more tickets received ($received) than the limit, janitor finished $janitor_fin" test "$received" -gt "$L"
expect_eq "every received ticket that no finish returned for is still active" 0 "$(missing "$CL/held.3" fc_limited)"
sql -c "TRUNCATE received" -c "\\copy received FROM '$CL/finished.3'"
expect_eq "every ticket whose finish returned is ended" 0 \
  "$(sql -c "SELECT count(*) FROM received r LEFT JOIN quota.ledger l ON l.id = r.ticket WHERE l.ended_at IS NULL")"
check "active in the ledger ($active) >= tickets received and not finished ($held): over-count only" test "$active" -ge "$held"
check "active in the ledger ($active) <= the limit $L" test "$active" -le "$L"
check "the summary equals the ledger after the cancels" summary_matches_ledger
expect_eq "no crash during the cancels" "$reinit_before" "$(log_count "reinitializing")"
check "no PANIC or assertion failure in the server log" \
  bash -c "! tail -n +$((log_lines + 1)) '$CL/server.log' | grep -E 'PANIC|TRAP|panicked'"
# No request is left behind in the writer's hands: the tenant can take exactly the
# slots the ledger says are free, and is then refused.
expect_eq "after the cancels, exactly L - active more tickets are admitted" "$((L - active))" \
  "$(psql_as fc_limited -c "SELECT count(t) FROM (SELECT quota.try_start('fill') AS t FROM generate_series(1, $L + 5)) s" 2>&1)"
expect_eq "... and the next start() is refused with 53400" 53400 \
  "$(psql_as fc_limited -v ON_ERROR_STOP=0 -c "SELECT quota.start('over')" -c '\echo :SQLSTATE' 2>/dev/null | tail -n1)"
finish_checks
