#!/usr/bin/env bash
# quota.stats across restarts, and its size bound (0.3.0 observability).
#
# 1. Clean restart (pg_ctl stop -m fast, then start): the counters are written to
#    $PGDATA/pg_stat/pg_quota.stat at shutdown and read (and the file removed) at start.
#    - the file does not exist while the server runs (before and after the restart).
#      Fails if it is not removed after it was read (a later crash would then bring
#      back stale numbers), or written while running.
#    - the file exists while the server is down. Fails if nothing is written at shutdown.
#    - every row of quota.stats is the same after the restart, its stats_reset included,
#      and quota.stats_info is unchanged (entries, evicted, log_suppressed, stats_reset).
#      Fails if the counters are not kept, kept partly (a column or a row lost), or if
#      loading them counts as a reset.
#    - quota.writer_stats is empty after the restart (it is not kept).
# 2. Crash: kill -9 of a backend, the postmaster reinitializes.
#    - quota.stats is empty and stats_info counts from scratch (entries 0, evicted 0,
#      log_suppressed 0), with stats_reset later than the kill. Fails if shared memory
#      counters survive the crash restart, or if the file from the previous start (or a
#      copy) is read again.
#    - after a second clean restart that follows, still empty, stats_reset the one of the
#      crash restart. Fails if an old file comes back at that start.
#    - counting starts over: a start() afterwards is counted once, in a row whose
#      stats_reset is not before stats_info's.
# 2b. Immediate shutdown (pg_ctl stop -m immediate): like a crash, crash recovery
#    follows, so the counters are not written and start over. Fails if the exit
#    callback saves them because the postmaster exits with code 0 (pg_control still
#    says "in production").
# 3. quota.stats_max = 100 (its minimum; a postmaster setting: ALTER SYSTEM + restart;
#    99 is refused with 22023). After a full reset, 130 roles do one start() each, in
#    order, from one session:
#    - stats_info.max = 100, evicted > 0, entries <= 100, entries + evicted = 131 (the
#      130 roles and the database's row for roles no longer listed, which holds what
#      the evicted rows counted) and quota.stats shows exactly `entries` rows. Fails if
#      the table grows past its bound, or a row is lost without being counted as
#      evicted (or counted twice).
#    - the database's total of admitted is still 130: the evicted rows' counts went to
#      its row for roles no longer listed (role NULL, admitted = evicted). Fails if an
#      eviction loses counts (monitoring would see the database's counter go down).
#    - the 10 most recently used roles are all present, the least recently used one is
#      not. Fails if eviction picks other rows than the least recently used (for
#      example the newest, or by hash order).
#    - exactly, by the 5 % of the role rows: evicted = 33 (5 at role 101, then 4 of
#      99 role rows at roles 105, 109, ..., 129), entries = 98, and the role rows left
#      are sr_034 .. sr_130. Fails if an eviction takes another share or not the oldest
#      rows.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5731 + PORT_OFFSET))}"
with_cluster stats_restart

STATFILE="$CL/data/pg_stat/pg_quota.stat"
no_statfile() { [ ! -e "$STATFILE" ]; }
restart_clean() {
  as_pg "$PG_BIN/pg_ctl" -D "$CL/data" -m fast -w -t 60 stop >/dev/null
  check "$1: pg_stat/pg_quota.stat was written at the shutdown" test -e "$STATFILE"
  as_pg "$PG_BIN/pg_ctl" -D "$CL/data" -l "$CL/server.log" -w -t 60 start >/dev/null
  check "$1: pg_stat/pg_quota.stat is gone once the server runs again" no_statfile
}
STATS_ROWS="SELECT coalesce(string_agg(s::text, E'\n' ORDER BY datname, role), '(none)') FROM quota.stats s"
INFO="SELECT concat_ws(' ', max, entries, evicted, log_suppressed, stats_reset) FROM quota.stats_info"

sql -c "CREATE EXTENSION pg_quota" -c "CREATE DATABASE other" >/dev/null
sql -d other -c "CREATE EXTENSION pg_quota" >/dev/null
sql -c "CREATE ROLE sr_a LOGIN" -c "CREATE ROLE sr_b LOGIN" \
    -c "ALTER ROLE sr_b SET quota.max_active_per_role = 1" >/dev/null

# Some of every kind: sr_a admitted 3, finished 2 (succeeded, failed), renewed 1,
# an idempotent hit; sr_b admitted 1, refused twice; sr_a in database other too.
psql_as sr_a -c "SELECT quota.finish(quota.start('a1'))" \
  -c "SELECT quota.finish(quota.start('a2'), 'failed')" \
  -c "SELECT quota.renew(quota.start('a3', idempotency_key => 'k'), '1 h') IS NOT NULL" \
  -c "SELECT quota.start('a3 again', idempotency_key => 'k') IS NOT NULL" >/dev/null
psql_as sr_b -c "SELECT quota.start('b1') IS NOT NULL" -c "SELECT quota.try_start('b2')" \
  -c "SELECT quota.try_start('b3')" >/dev/null
timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U sr_a -d other -c "SELECT quota.start('o1') IS NOT NULL" >/dev/null

rows_before=$(sql -c "$STATS_ROWS")
info_before=$(sql -c "$INFO")
expect_eq "three rows before the restart (sr_a twice, sr_b)" "other/sr_a postgres/sr_a postgres/sr_b" \
  "$(sql -c "SELECT string_agg(datname || '/' || role, ' ' ORDER BY datname, role) FROM quota.stats")"
expect_eq "sr_a's counts before the restart (admitted finished_succeeded finished_failed renewed idempotent_hits)" \
  "3 1 1 1 1" "$(sql -c "SELECT concat_ws(' ', admitted, finished_succeeded, finished_failed, renewed, idempotent_hits)
                           FROM quota.stats WHERE datname = 'postgres' AND role = 'sr_a'")"
expect_eq "sr_b's counts before the restart (admitted refused_active)" "1 2" \
  "$(sql -c "SELECT admitted || ' ' || refused_active FROM quota.stats WHERE datname = 'postgres' AND role = 'sr_b'")"
check "pg_stat/pg_quota.stat does not exist while the server runs" no_statfile

# ------------------------------------------------------------------------------------
# 1. Clean restart.
# ------------------------------------------------------------------------------------
restart_clean "clean restart"
expect_eq "every row of quota.stats (stats_reset included) is the same after a clean restart" \
  "$rows_before" "$(sql -c "$STATS_ROWS")"
expect_eq "quota.stats_info is unchanged by a clean restart" "$info_before" "$(sql -c "$INFO")"
expect_eq "quota.writer_stats is not kept across a restart" 0 "$(sql -c "SELECT count(*) FROM quota.writer_stats")"
# A second clean restart in a row keeps them again (the file of the first start is
# gone, the second shutdown writes a new one).
restart_clean "second clean restart"
expect_eq "... and after a second clean restart in a row" "$rows_before" "$(sql -c "$STATS_ROWS")"

# ------------------------------------------------------------------------------------
# 2. Crash restart: kill -9 of a backend.
# ------------------------------------------------------------------------------------
info_reset_before=$(sql -c "SELECT stats_reset FROM quota.stats_info")
bg bash -c "exec '$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U sr_a -d postgres -c 'SELECT pg_sleep(60)' >/dev/null 2>&1"
victim=""
for _ in $(seq 1 100); do
  victim=$(sql -c "SELECT pid FROM pg_stat_activity WHERE usename = 'sr_a' AND query LIKE 'SELECT pg_sleep(60)%'")
  [ -n "$victim" ] && break; sleep 0.1
done
check "a backend to kill (pid $victim)" test -n "$victim"
killed_at=$(sql -c "SELECT clock_timestamp()")
kill -9 "$victim"
# The postmaster notices, terminates everyone and reinitializes; wait until it serves.
check "the server reinitialized after the kill" \
  timeout 60 bash -c "until grep -q 'all server processes terminated; reinitializing' '$CL/server.log'; do sleep 0.1; done"
up=""
for _ in $(seq 1 300); do
  up=$(sql -c "SELECT 1" 2>/dev/null || true); [ "$up" = 1 ] && break; sleep 0.1
done
check "the server accepts connections again after the crash restart" test "$up" = 1
expect_eq "quota.stats is empty after the crash" "(none)" "$(sql -c "$STATS_ROWS")"
expect_eq "stats_info counts from scratch after the crash (entries evicted log_suppressed)" "0 0 0" \
  "$(sql -c "SELECT concat_ws(' ', entries, evicted, log_suppressed) FROM quota.stats_info")"
info_reset_crash=$(sql -c "SELECT stats_reset FROM quota.stats_info")
expect_eq "stats_info.stats_reset is later than before the crash, and than the kill" t \
  "$(sql -c "SELECT '$info_reset_crash'::timestamptz > '$info_reset_before'::timestamptz
                AND '$info_reset_crash'::timestamptz > '$killed_at'::timestamptz")"
check "pg_stat/pg_quota.stat does not exist after the crash restart" no_statfile

restart_clean "clean restart after the crash"
expect_eq "quota.stats is still empty after a clean restart following the crash (the old file did not come back)" \
  "(none)" "$(sql -c "$STATS_ROWS")"
expect_eq "stats_info is the crash restart's (entries 0, same stats_reset)" "0 $info_reset_crash" \
  "$(sql -c "SELECT entries || ' ' || stats_reset FROM quota.stats_info")"
psql_as sr_a -c "SELECT quota.start('after crash') IS NOT NULL" >/dev/null
expect_eq "counting starts over: sr_a's one start() is its only admission, in the only row" "postgres/sr_a 1 t" \
  "$(sql -c "SELECT string_agg(concat_ws(' ', datname || '/' || role, admitted, CASE WHEN stats_reset >= '$info_reset_crash'::timestamptz THEN 't' ELSE 'f' END), ';')
               FROM quota.stats")"

# ------------------------------------------------------------------------------------
# 2b. Immediate shutdown.
# ------------------------------------------------------------------------------------
expect_eq "a row to lose before the immediate shutdown" 1 "$(sql -c "SELECT count(*) FROM quota.stats")"
as_pg "$PG_BIN/pg_ctl" -D "$CL/data" -m immediate -w -t 60 stop >/dev/null
check "immediate shutdown: pg_stat/pg_quota.stat was not written" no_statfile
as_pg "$PG_BIN/pg_ctl" -D "$CL/data" -l "$CL/server.log" -w -t 60 start >/dev/null
expect_eq "quota.stats is empty after an immediate shutdown" "(none)" "$(sql -c "$STATS_ROWS")"

# ------------------------------------------------------------------------------------
# 3. quota.stats_max = 100 and eviction of the least recently used rows.
# ------------------------------------------------------------------------------------
expect_eq "quota.stats_max below its minimum (99) is refused with 22023" 22023 \
  "$(state postgres postgres "ALTER SYSTEM SET quota.stats_max = 99")"
sql -c "ALTER SYSTEM SET quota.stats_max = 100" >/dev/null
stop_cluster "$CL" fast
as_pg "$PG_BIN/pg_ctl" -D "$CL/data" -l "$CL/server.log" -w -t 60 start >/dev/null
expect_eq "quota.stats_max is 100 after the restart, and stats_info.max says so" "100 100" \
  "$(sql -c "SELECT current_setting('quota.stats_max') || ' ' || max FROM quota.stats_info")"
sql -c "SELECT quota.stats_reset()" >/dev/null
expect_eq "after a full reset: no row, nothing evicted" "0 0" \
  "$(sql -c "SELECT entries || ' ' || evicted FROM quota.stats_info")"

sql -c "DO \$\$ BEGIN FOR i IN 1..130 LOOP EXECUTE format('CREATE ROLE sr_%s', lpad(i::text, 3, '0')); END LOOP; END \$\$" >/dev/null
for i in $(seq 1 130); do
  printf 'SET ROLE sr_%03d;\nSELECT quota.start() IS NOT NULL;\nRESET ROLE;\n' "$i"
done > "$CL/roles.sql"
chmod 644 "$CL/roles.sql"
expect_eq "130 roles each got a ticket, one after the other" 130 \
  "$(sql -f "$CL/roles.sql" | grep -c '^t$')"
read -r max entries evicted rows <<<"$(sql -F ' ' -c "SELECT max, entries, evicted, (SELECT count(*) FROM quota.stats) FROM quota.stats_info")"
echo "# stats_info after 130 roles: max $max, entries $entries, evicted $evicted; quota.stats rows $rows"
check "rows were evicted (evicted = $evicted > 0)" test "${evicted:-0}" -gt 0
check "the table kept its bound (entries = $entries <= 100)" test "${entries:-999}" -le 100
expect_eq "every role is either present or counted as evicted, plus the row for roles no longer listed (entries + evicted)" 131 $(( ${entries:-0} + ${evicted:-0} ))
expect_eq "the database's total of admitted is unchanged by evictions; the row for roles no longer listed holds the evicted ones (total, role NULL row)" "130 $evicted" \
  "$(sql -c "SELECT sum(admitted) || ' ' || sum(admitted) FILTER (WHERE role IS NULL) FROM quota.stats WHERE datname = current_database()")"
expect_eq "quota.stats shows as many rows as stats_info.entries" "$entries" "$rows"
expect_eq "the 10 most recently used roles (sr_121 .. sr_130) are all present" 10 \
  "$(sql -c "SELECT count(*) FROM quota.stats WHERE role::text BETWEEN 'sr_121' AND 'sr_130' AND admitted = 1")"
expect_eq "the least recently used role (sr_001) was evicted" 0 \
  "$(sql -c "SELECT count(*) FROM quota.stats WHERE role = 'sr_001'")"
# Exactly: each new role that finds the table full evicts 5 % of the role rows: 5 of
# 100 at role 101 (the first makes the row for roles no longer listed), then 4 of 99 at
# roles 105, 109, ..., 129; so 33 go, sr_001 .. sr_033.
expect_eq "exactly: 33 rows evicted, 98 entries" "98 33" "$entries $evicted"
expect_eq "exactly: the role rows left are those of sr_034 .. sr_130, the 97 most recently used" "97 sr_034 sr_130" \
  "$(sql -c "SELECT count(*) || ' ' || min(role::text) || ' ' || max(role::text) FROM quota.stats WHERE role::text LIKE 'sr\_%' AND admitted = 1")"
check "pg_stat/pg_quota.stat does not exist while the server runs (end)" no_statfile
finish_checks
