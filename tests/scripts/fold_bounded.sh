#!/usr/bin/env bash
# The fold of transactional tickets reads only what it folds (0.5.2, R2).
#
# A role's summary row counts its transactional tickets below `folded`; the others are
# counted from ledger_txid_idx. 0.5.1 counted every ticket from `folded` on, without an
# upper bound, twice per fold pass, and once more in every counter rebuild.
# From 0.6.0 the ledger is two tables, quota.active (tickets not ended) and
# quota.history (ended ones), quota.ledger a view of both; ledger_txid_idx is
# active_txid_idx and history_txid_idx, and the figures below add up both tables'.
#
# 1. Restored from a cluster further on: tickets whose txids this cluster has not
#    issued yet (pg_restore's COPY writes them through SQL, as the INSERT here does,
#    into quota.history from 0.6.0, since they have ended; the statement trigger
#    empties the summary). They stayed "unfolded" until this
#    cluster's horizon passed them, so every fold pass walked them twice and every
#    counter rebuild walked them under the counters' lock. Now the writer adopts them
#    (a txid below every fold) in bounded steps: the fold then reads nothing, and a
#    rebuild after a restart reads a handful of index entries.
# 2. A horizon that creeps (long transactions with xids ending one after another):
#    each move of the horizon made the next pass walk every ticket committed since the
#    first of them, twice. Now a pass reads only the range it folds.
#
# Figures printed as "#" lines: index entries the writer read per pass, and the first
# start after a restart (its counter rebuild).
#
# Only a running writer folds. The cluster keeps an idle writer for an hour
# (quota.writer_idle_timeout), so that section 2 measures folds while the horizon
# creeps: with the default 10 s, a slow machine's writer left during the creep, the
# reads counted nothing, and nothing folded once the horizon passed the tickets.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5776 + PORT_OFFSET))}"
with_cluster fold_bounded "quota.writer_idle_timeout = '${FB_WRITER_IDLE:-1h}'"
# The database's writer: its pid and when it started (a pid alone could be reused).
writer_pid() {
  sql -c "SELECT pid || ' since ' || backend_start FROM pg_stat_activity
           WHERE backend_type = 'pg_quota ledger writer' AND datname = 'postgres'"
}
N="${FB_RESTORED:-100000}"   # restored tickets
M="${FB_COMMITTED:-20000}"   # tickets committed behind a held horizon
sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE fb LOGIN" \
    -c "ALTER ROLE fb SET quota.max_active_per_role = 0" \
    -c "ALTER ROLE fb SET quota.max_retained_per_role = $((N + 3))" \
    -c "ALTER ROLE fb SET quota.allow_transactional = on" \
    -c "CREATE ROLE fx LOGIN" \
    -c "CREATE ROLE fh LOGIN" \
    -c "ALTER ROLE fh SET quota.max_active_per_role = 0" \
    -c "ALTER ROLE fh SET quota.max_retained_per_role = 0" \
    -c "ALTER ROLE fh SET quota.allow_transactional = on" >/dev/null

# Index entries read from ledger_txid_idx so far (0.6.0: from active_txid_idx and
# history_txid_idx together), as the statistics have them (the writer reports its reads
# at most once a second).
txid_idx_reads() {
  sql -c "SET stats_fetch_consistency = none" \
      -c "SELECT sum(idx_tup_read) FROM pg_stat_all_indexes
           WHERE indexrelid IN ('quota.active_txid_idx'::regclass, 'quota.history_txid_idx'::regclass)
          HAVING count(*) = 2"
}
next_xid() { sql -c "SELECT pg_snapshot_xmax(pg_current_snapshot())"; }

# --- 1. Restored tickets ------------------------------------------------------------
as fb postgres "SELECT quota.start('first')" >/dev/null   # a writer, and fb's summary row
far=$(( $(next_xid) + 50000000 ))
sql -c "INSERT INTO quota.history (id, role, label, started_at, ended_at, outcome, txid)
        SELECT gen_random_uuid(), 'fb'::regrole, 'restored', now() - interval '2 min',
               now() - interval '1 min', 'succeeded', ($far + g)::text::xid8
          FROM generate_series(1, $N) g" >/dev/null
foreign() { sql -c "SELECT count(*) FROM quota.ledger WHERE txid >= '$far'::xid8"; }
expect_eq "$N restored tickets carry txids this cluster has not issued" "$N" "$(foreign)"
expect_eq "the SQL write emptied the summary" 0 "$(sql -c "SELECT count(*) FROM quota.summary")"
# A start of fb counts its rows one by one and asks the writer for its summary row.
expect_eq "fb is admitted up to its retained limit meanwhile: 2 more" 2 \
  "$(as fb postgres "SELECT count(quota.try_start('more')) FROM generate_series(1, 5)")"
began=$(date +%s%N)
for _ in $(seq 1 1200); do [ "$(foreign)" = 0 ] && break; sleep 0.1; done
took_ms=$(( ($(date +%s%N) - began) / 1000000 ))
expect_eq "the writer adopted every restored ticket (within 120 s)" 0 "$(foreign)"
echo "# adopting $N restored tickets took $took_ms ms"
expect_eq "their transactional mark is kept" "$((N + 0))" \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'fb'::regrole AND txid IS NOT NULL")"
for _ in $(seq 1 100); do
  [ "$(sql -c "SELECT count(*) FROM quota.summary WHERE role = 'fb'::regrole")" = 1 ] && break; sleep 0.1
done
expect_eq "fb's summary row counts every ledger row, the adopted ones folded" \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'fb'::regrole")" \
  "$(sql -c "SELECT tickets FROM quota.summary WHERE role = 'fb'::regrole AND folded > '2'::xid8")"
sleep 3
# Starts of another role go on meanwhile: the writer stays, and the horizon moves, so
# that every pass has a range to fold.
r0=$(txid_idx_reads)
for _ in $(seq 1 40); do as fx postgres "SELECT quota.finish(quota.start('load'))" >/dev/null; sleep 0.1; done
r1=$(txid_idx_reads)
echo "# fold passes after the adoption, transactions going on: $((r1 - r0)) active_txid_idx + history_txid_idx entries read in about 5 s (0.5.1: twice the restored tickets a pass)"
check "fold passes read fewer than a tenth of the restored tickets meanwhile (read $((r1 - r0)))" test $((r1 - r0)) -lt $((N / 10))
expect_eq "still exact: fb is refused at its retained limit" "" \
  "$(as fb postgres "SELECT quota.try_start('over')")"

# A restart: the scope counters are gone, and fb's first start rebuilds its counter
# from the summary row plus the unfolded tickets.
stop_cluster "$CL"
as_pg "$PG_BIN/pg_ctl" -D "$CL/data" -l "$CL/server.log" -w -t 60 start >/dev/null
out=$(as fb postgres "BEGIN" "\\timing on" "SELECT quota.try_start('after restart') IS NULL" "\\timing off" \
        "SELECT 'fetched:' || sum(idx_tup_fetch) FROM pg_stat_xact_all_tables
          WHERE relid IN ('quota.active'::regclass, 'quota.history'::regclass) HAVING count(*) = 2" "COMMIT")
fetched=$(sed -n 's/^fetched://p' <<<"$out")
echo "# the first start after a restart (counter rebuild): $(grep -o 'Time: [0-9.]* ms' <<<"$out" | head -n1), $fetched ledger rows fetched"
check "the rebuild after a restart fetched fewer than 100 ledger rows (fetched $fetched)" test "${fetched:-999999}" -lt 100
expect_eq "... and refused fb at its limit" t "$(head -n1 <<<"$out")"

# --- 2. A horizon that creeps -----------------------------------------------------------
as fh postgres "SELECT quota.start('first')" >/dev/null
creep_writer=$(writer_pid)
for k in 1 2 3 4; do
  open_session "h$k" postgres
  say "h$k" "BEGIN; SELECT 'xid:' || txid_current();"
  wait_out "h$k" "xid:"
done
as fh postgres "BEGIN" "SELECT count(quota.start('behind', transactional => true)) FROM generate_series(1, $M)" "COMMIT" >/dev/null
expect_eq "$M transactional tickets committed behind the held horizon" "$M" \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'fh'::regrole AND txid IS NOT NULL")"
sleep 2
r0=$(txid_idx_reads)
for k in 1 2 3; do
  say "h$k" "COMMIT;"
  sleep 1.5
done
sleep 1.5
r1=$(txid_idx_reads)
echo "# three moves of a held horizon: $((r1 - r0)) active_txid_idx + history_txid_idx entries read (0.5.1: twice the $M tickets per move)"
check "the folds read fewer than $M index entries while the horizon crept (read $((r1 - r0)))" test $((r1 - r0)) -lt "$M"
check "one writer was there all along the creep (${creep_writer:-none}; now $(writer_pid))" \
  test -n "$creep_writer" -a "$(writer_pid)" = "$creep_writer"
say h4 "COMMIT;"
for _ in $(seq 1 100); do
  [ "$(sql -c "SELECT tickets FROM quota.summary WHERE role = 'fh'::regrole")" = $((M + 1)) ] && break; sleep 0.1
done
expect_eq "once the horizon passed them, fh's summary row counts them all" $((M + 1)) \
  "$(sql -c "SELECT tickets FROM quota.summary WHERE role = 'fh'::regrole")"
for k in 1 2 3 4; do close_session "h$k"; done
check "no server process was terminated by a signal" test "$(grep -c 'terminated by signal' "$CL/server.log" || true)" = 0
finish_checks
