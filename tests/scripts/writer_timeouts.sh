#!/usr/bin/env bash
# The ledger writer keeps its own timeouts whatever a database or role sets (0.3.1,
# item 6). Settings made with ALTER DATABASE … SET reach background workers too, and
# PostgreSQL 17's transaction_timeout ends one with FATAL "terminating connection due to
# transaction timeout" (seen on 18 with 0.3.0). The writer turns statement_timeout,
# idle_in_transaction_session_timeout and, from 17, transaction_timeout off for itself,
# and bounds its lock waits with its own 5 s lock_timeout: a superuser holding
# LOCK TABLE quota.ledger for 3.5 s delays a start(), and for longer than 5 s fails
# just that start with 55P03. The writer is the same process throughout.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
with_cluster writer_timeouts "quota.writer_idle_timeout = '1h'"
sql -c "CREATE ROLE wt_tenant LOGIN" -c "CREATE DATABASE wt_app" >/dev/null
sql -d wt_app -c "CREATE EXTENSION pg_quota" >/dev/null
OFF="SET statement_timeout = 0"  # what the test's own sessions set for themselves
sql -c "ALTER DATABASE wt_app SET statement_timeout = '1s'" \
    -c "ALTER DATABASE wt_app SET idle_in_transaction_session_timeout = '1s'" >/dev/null
if [ "$PG_MAJOR" -ge 17 ]; then
  sql -c "ALTER DATABASE wt_app SET transaction_timeout = '2s'" >/dev/null
  OFF="$OFF; SET transaction_timeout = 0"
fi
writer_pid() { sql -d wt_app -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer'"; }

expect_eq "a start() brings the writer up" t "$(as wt_tenant wt_app "SELECT quota.start('first') IS NOT NULL")"
PID=$(writer_pid)
check "the writer runs (pid ${PID:-none})" test -n "$PID"

# hold SECONDS: a superuser session takes LOCK TABLE quota.ledger and keeps it.
hold() {
  : > "$CL/lock.out"
  bg bash -c "'$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U postgres -d wt_app \
      -c \"$OFF\" -c 'BEGIN' -c 'LOCK TABLE quota.ledger IN EXCLUSIVE MODE' -c \"SELECT 'locked'\" \
      -c 'SELECT pg_sleep($1)' -c 'COMMIT' > '$CL/lock.out' 2>&1"
  timeout 10 bash -c "until grep -q locked '$CL/lock.out'; do sleep 0.05; done"
}
# start_through: the SQLSTATE of a tenant's start() made while the lock is held.
start_through() {
  "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U wt_tenant -d wt_app -v ON_ERROR_STOP=0 \
    -c "$OFF" -c "SELECT quota.start('$1')" -c '\echo SQLSTATE=:SQLSTATE' 2>>"$CL/start.err" \
    | sed -n 's/^SQLSTATE=//p'
}

hold 3.5
began=$SECONDS
expect_eq "held for 3.5 s: the start() waits for the lock and is admitted" 00000 "$(start_through 'after 3.5 s')"
check "... after the lock was released ($((SECONDS - began)) s)" test $((SECONDS - began)) -ge 2
expect_eq "... by the same writer" "$PID" "$(writer_pid)"
sleep 1

hold 8
expect_eq "held for 8 s: the start() fails with the writer's own lock timeout (55P03)" 55P03 "$(start_through 'after 8 s')"
expect_eq "... and the writer is still the same process" "$PID" "$(writer_pid)"
sleep 4
expect_eq "afterwards a start() is admitted again, by the same writer" "t $PID" \
  "$(as wt_tenant wt_app "$OFF" "SELECT quota.start('after') IS NOT NULL") $(writer_pid)"
expect_eq "no writer was ended by a timeout" 0 \
  "$(grep -Ec 'FATAL:  terminating connection due to (transaction|idle-in-transaction|statement) timeout' "$CL/server.log" || true)"
expect_eq "quota.writer_stats counts no restart" 0 \
  "$(sql -d wt_app -c "SELECT restarts FROM quota.writer_stats WHERE datname = 'wt_app'")"
finish_checks
