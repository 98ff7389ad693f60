#!/usr/bin/env bash
# quota.writer_stats: what the ledger writer of each database did (0.3.0 observability).
# (writer_stats.sh is about the writer's pg_stat_user_tables reports, not this view.)
#
# Checks, and how each would fail:
# - before any start(): no row. Fails if rows exist for databases without a writer.
# - after N = 20 sequential start() calls from one session (limits off): one row, for
#   database postgres, pid = the pid of the 'pg_quota ledger writer' backend in
#   pg_stat_activity, started_at set and not in the future, 1 <= batches <= 20,
#   requests = 20 exactly (each sequential start reaches the writer), mean_batch_size =
#   requests / batches, commit_time > 0, restarts = 0, last_error and last_error_at
#   NULL. Fails if requests are counted per batch or twice (a retry), if commit time
#   is not measured, if the first writer of a database counts as a restart, or if a
#   normal batch leaves an error behind.
# - visibility: a tenant sees no row, a member of pg_read_all_stats sees the row. Fails
#   if the view is open to tenants, or closed to monitoring roles.
# - pg_terminate_backend(writer): once it is gone, pid is NULL; after one more start(),
#   a new pid (that of the new writer), a later started_at, restarts = 1, requests =
#   21. Fails if a terminated writer's replacement is not counted, or the counters of
#   the database start over with the new writer.
# - idle exit (quota.writer_idle_timeout = 1 via ALTER SYSTEM + reload): the writer
#   leaves by itself, pid becomes NULL; the next start() brings a new one and restarts
#   stays 1, requests = 22. Fails if a normal idle exit counts as a restart.
# - a writer error: a superuser holds LOCK TABLE quota.ledger IN EXCLUSIVE MODE, so the
#   writer's batch for start('blocked') fails on its 5 s lock_timeout (the caller gets
#   55P03, nothing is charged); last_error is that lock timeout ('could not obtain lock
#   on relation "quota.ledger"'), last_error_at lies
#   between before and after the call, and the writer (same pid) goes on: the next
#   start() is admitted, batches and requests grow, restarts stays 1. Fails if the
#   error the writer caught is not recorded, or recorded without its time, or if
#   recording it disturbs the other counters or costs the writer its life.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5733 + PORT_OFFSET))}"
with_cluster writer_stats_view

N=20
sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE wv LOGIN" \
    -c "ALTER ROLE wv SET quota.max_active_per_role = 0" \
    -c "ALTER ROLE wv SET quota.max_retained_per_role = 0" \
    -c "CREATE ROLE wv_mon LOGIN IN ROLE pg_read_all_stats" >/dev/null

writer_pid() { sql -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer' AND datname = 'postgres'"; }
# ws COLUMNS: the row of database postgres in quota.writer_stats, columns joined by ' '
# (NULL shown as 'null').
ws() { sql -c "SELECT concat_ws(' ', $1) FROM (SELECT * FROM quota.writer_stats WHERE datname = 'postgres') w"; }
writer_gone() {
  timeout "$1" bash -c "until [ -z \"\$('$PG_BIN/psql' -X -At -h '$CL' -p '$PORT' -U postgres -d postgres -c \
    \"SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer' AND datname = 'postgres'\")\" ]; do sleep 0.1; done"
}
start_wv() { psql_as wv -c "SELECT quota.start('$1') IS NOT NULL" 2>&1; }

expect_eq "no row before any start()" 0 "$(sql -c "SELECT count(*) FROM quota.writer_stats")"

for i in $(seq 1 $N); do echo "SELECT quota.start('seq $i') IS NOT NULL;"; done > "$CL/seq.sql"
chmod 644 "$CL/seq.sql"
expect_eq "$N sequential starts from one session are admitted" $N "$(psql_as wv -f "$CL/seq.sql" | grep -c '^t$')"

pid1=$(writer_pid)
check "a writer runs (pid $pid1)" test -n "$pid1"
expect_eq "one row, for database postgres" "postgres" "$(sql -c "SELECT string_agg(datname, ',') FROM quota.writer_stats")"
expect_eq "pid is the writer's pid in pg_stat_activity" "$pid1" "$(ws pid)"
read -r batches requests mean commit_ms <<<"$(ws "batches, requests, mean_batch_size, commit_time")"
echo "# after $N starts: batches $batches, requests $requests, mean_batch_size $mean, commit_time $commit_ms ms"
expect_eq "requests = $N exactly" $N "$requests"
check "1 <= batches <= $N ($batches)" test "${batches:-0}" -ge 1 -a "${batches:-0}" -le $N
expect_eq "mean_batch_size = requests / batches" t \
  "$(sql -c "SELECT abs(mean_batch_size - requests::float8 / batches) < 1e-9 FROM quota.writer_stats WHERE datname = 'postgres'")"
expect_eq "commit_time > 0" t "$(ws "commit_time > 0")"
expect_eq "started_at is set, not in the future" t "$(ws "started_at <= now()")"
expect_eq "restarts = 0, last_error and last_error_at NULL" "0 null null" "$(ws "restarts, coalesce(last_error, 'null'), coalesce(last_error_at::text, 'null')")"
expect_eq "a tenant sees no row of quota.writer_stats" 0 "$(psql_as wv -c "SELECT count(*) FROM quota.writer_stats")"
expect_eq "a member of pg_read_all_stats sees the row" "postgres $pid1" \
  "$(psql_as wv_mon -c "SELECT datname || ' ' || pid FROM quota.writer_stats")"
started1=$(ws started_at)

# ------------------------------------------------------------------------------------
# The writer is terminated: the next start() brings a new one, counted as a restart.
# ------------------------------------------------------------------------------------
sql -c "SELECT pg_terminate_backend($pid1)" >/dev/null
check "the terminated writer is gone" writer_gone 10
expect_eq "pid is NULL while no writer runs" null "$(ws "coalesce(pid::text, 'null')")"
expect_eq "one more start() is admitted" t "$(start_wv "after terminate")"
pid2=$(writer_pid)
check "a new writer runs (pid $pid2, was $pid1)" test -n "$pid2" -a "$pid2" != "$pid1"
expect_eq "pid is the new writer's, restarts = 1, requests = $((N + 1))" "$pid2 1 $((N + 1))" "$(ws "pid, restarts, requests")"
expect_eq "started_at is the new writer's (later than the first's)" t "$(ws "started_at > '$started1'::timestamptz")"

# ------------------------------------------------------------------------------------
# An idle writer leaves by itself: not a restart.
# ------------------------------------------------------------------------------------
sql -c "ALTER SYSTEM SET quota.writer_idle_timeout = 1" -c "SELECT pg_reload_conf()" >/dev/null
check "the idle writer leaves by itself (writer_idle_timeout = 1 s)" writer_gone 20
expect_eq "pid is NULL after the idle exit, restarts still 1" "null 1" "$(ws "coalesce(pid::text, 'null'), restarts")"
expect_eq "the next start() is admitted" t "$(start_wv "after idle exit")"
pid3=$(writer_pid)
check "a new writer runs (pid $pid3)" test -n "$pid3" -a "$pid3" != "$pid2"
expect_eq "after an idle exit the new writer is not a restart: restarts = 1, requests = $((N + 2))" \
  "$pid3 1 $((N + 2))" "$(ws "pid, restarts, requests")"
# Keep writers from leaving during the rest of the test: back to the default (10 s),
# and past the old 1 s, so that the writer taken below is one that has the default.
sql -c "ALTER SYSTEM RESET quota.writer_idle_timeout" -c "SELECT pg_reload_conf()" >/dev/null
sleep 2

# ------------------------------------------------------------------------------------
# A writer error. (A CHECK constraint a superuser adds to quota.ledger would not do:
# pg_quota's own writes do not evaluate CHECK constraints, as USER_GUIDE.md says, so
# start('bad') is admitted.) A superuser holds LOCK TABLE quota.ledger IN EXCLUSIVE
# MODE: the caller's reads (ACCESS SHARE) pass, the writer's insert waits and fails
# after its 5 s lock_timeout, inside its batch, which it catches: the caller gets 55P03.
# ------------------------------------------------------------------------------------
expect_eq "a good start() before the error is admitted" t "$(start_wv "good before")"
pid4=$(writer_pid)
read -r b_before r_before <<<"$(ws "batches, requests")"
open_session locker postgres
say locker "BEGIN; LOCK TABLE quota.ledger IN EXCLUSIVE MODE; SELECT 'locked';"
check "a superuser holds LOCK TABLE quota.ledger IN EXCLUSIVE MODE" wait_out locker locked 10
t_before=$(sql -c "SELECT clock_timestamp()")
out=$(timeout 30 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -h "$CL" -p "$PORT" -U wv -d postgres \
        -c "SELECT quota.start('blocked')" -c '\echo SQLSTATE=:SQLSTATE' 2>&1 || true)
t_after=$(sql -c "SELECT clock_timestamp()")
say locker "COMMIT;"
close_session locker
echo "# start('blocked'): $(tr '\n' ' ' <<<"$out")"
check "start('blocked') fails with the writer's 55P03" grep -q 'SQLSTATE=55P03' <<<"$out"
expect_eq "start('blocked') charged nothing" 0 "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label = 'blocked'")"
err=$(ws "coalesce(last_error, 'null')")
echo "# last_error: $err"
# (0.6.0: LOCK TABLE on the view quota.ledger locks its tables; the writer's insert
# waits for quota.active, which the error names.)
check "last_error is the lock timeout the writer caught (could not obtain lock on relation \"quota.active\")" \
  grep -qF 'could not obtain lock on relation "quota.active"' <<<"$err"
expect_eq "last_error_at is set, between before and after the call" t \
  "$(ws "last_error_at BETWEEN '$t_before'::timestamptz AND '$t_after'::timestamptz")"
expect_eq "the next good start() is admitted" t "$(start_wv "good after")"
read -r b_after r_after <<<"$(ws "batches, requests")"
check "batches went on ($b_before -> $b_after)" test "${b_after:-0}" -gt "${b_before:-0}"
check "requests went on: the good start counted ($r_before -> $r_after)" \
  test "${r_after:-0}" -ge $(( ${r_before:-0} + 1 )) -a "${r_after:-0}" -le $(( ${r_before:-0} + 2 ))
expect_eq "the same writer goes on (pid $pid4), restarts still 1, last_error kept" "$pid4 1 t" \
  "$(ws "pid, restarts, last_error LIKE '%could not obtain lock on relation \"quota.active\"%'")"
finish_checks
