#!/usr/bin/env bash
# The ledger writer reports its table statistics while it lives (pgstat_report_stat),
# not only when it exits: pg_stat_user_tables shows its inserts into the ledger and
# its updates of quota.summary within seconds, so autovacuum and monitoring see them.
# From 0.6.0 the ledger is two tables, quota.active (tickets not ended) and
# quota.history (ended ones), and quota.ledger is a view over both, with no table
# statistics. The writer inserts each ticket into quota.active (finish(), in the
# client's backend, moves it to quota.history), so its inserts are quota.active's.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5681 + PORT_OFFSET))}"
with_cluster writer_stats

sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE ws_tenant LOGIN" \
    -c "ALTER ROLE ws_tenant SET quota.max_active_per_role = 0" \
    -c "ALTER ROLE ws_tenant SET quota.max_retained_per_role = 0"

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
writer_pid() { sql -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer' AND datname = 'postgres'"; }
# stats: "quota.active inserts|summary inserts+updates|ledger rows (both tables)",
# each psql call a new backend, so no cached statistics snapshot.
stats() {
  sql -c "SELECT pg_stat_clear_snapshot()" \
      -c "SELECT (SELECT n_tup_ins FROM pg_stat_user_tables WHERE relid = 'quota.active'::regclass) || '|' ||
                 (SELECT n_tup_ins + n_tup_upd FROM pg_stat_user_tables WHERE relid = 'quota.summary'::regclass) || '|' ||
                 (SELECT count(*) FROM quota.ledger)" | tail -n1
}

# Sustained churn: one client loops finish(start()) until $CL/stop exists (20 s at most).
for _ in $(seq 1 100); do echo "SELECT quota.finish(quota.start('churn'));"; done > "$CL/churn.sql"
chmod 644 "$CL/churn.sql"
rm -f "$CL/stop"
churn() {
  local end=$((SECONDS + 20))
  while [ ! -e "$CL/stop" ] && [ "$SECONDS" -lt "$end" ]; do
    timeout 20 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -h "$CL" -p "$PORT" -U ws_tenant \
      -d postgres -f "$CL/churn.sql" >> "$CL/churn.out" 2>> "$CL/churn.err" || sleep 0.1
  done
}
bg bash -c "$(declare -f churn); CL='$CL' PORT='$PORT' PG_BIN='$PG_BIN' churn"
churn_pid=$LAST_BG

pid=""
for _ in $(seq 1 50); do pid=$(writer_pid); [ -n "$pid" ] && break; sleep 0.1; done
check "a writer serves the churn" test -n "$pid"

# 1. Within 5 s, the counters show the writer's first inserts and summary updates.
s=$(stats); end=$(( $(now_ms) + 5000 ))
while [ "$(now_ms)" -lt "$end" ]; do
  IFS='|' read -r ins sum rows <<<"$s"
  [ "$ins" -gt 0 ] && [ "$sum" -gt 0 ] && break
  sleep 0.1; s=$(stats)
done
IFS='|' read -r ins sum rows <<<"$s"
sum1=$sum
check "quota.active n_tup_ins shows the writer's inserts within 5 s ($ins of $rows rows)" test "$ins" -gt 0
check "quota.summary n_tup_ins + n_tup_upd shows the writer's updates within 5 s ($sum)" test "$sum" -gt 0
expect_eq "... while the same writer is still alive" "$pid" "$(writer_pid)"

# 2. They keep up: the inserts counted catch up with the rows the ledger had a moment
#    ago, within 5 s, while the writer is still the same process and still busy.
#    (0.6.0: every ticket of the ledger, in quota.active or quota.history, was inserted
#    into quota.active by the writer.)
IFS='|' read -r _ _ target <<<"$(stats)"
s=$(stats); end=$(( $(now_ms) + 5000 ))
while [ "$(now_ms)" -lt "$end" ]; do
  IFS='|' read -r ins sum rows <<<"$s"
  [ "$ins" -ge "$target" ] && break
  sleep 0.1; s=$(stats)
done
IFS='|' read -r ins sum rows <<<"$s"
check "quota.active n_tup_ins catches up with the ledger's $target rows within 5 s ($ins)" test "$ins" -ge "$target"
check "quota.summary n_tup_ins + n_tup_upd keeps growing too ($sum1, then $sum)" test "$sum" -gt "$sum1"
expect_eq "... while the same writer is still alive" "$pid" "$(writer_pid)"
check "the churn was still running" test ! -e "$CL/stop" -a -d "/proc/$churn_pid"

touch "$CL/stop"
timeout 30 tail --pid="$churn_pid" -f /dev/null || true
check "the churn saw no error" test ! -s "$CL/churn.err"
finish_checks
