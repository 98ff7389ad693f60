#!/usr/bin/env bash
# Concurrent index builds on pg_quota's tables while it is in use (I9): start(),
# try_start() and finish() keep working while CREATE INDEX CONCURRENTLY waits with its
# index not yet ready, and REINDEX CONCURRENTLY of every pg_quota index under load
# leaves every index intact (amcheck with heapallindexed).
# From 0.6.0 the ledger is two tables, quota.active (tickets not ended) and
# quota.history (ended ones); quota.ledger is a view over both. The builds below run on
# both tables and quota.summary.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5680 + PORT_OFFSET))}"
with_cluster concurrent_index

amcheck() {  # amcheck INDEX: bt_index_check with heapallindexed; prints its error if any
  sql -c "SELECT bt_index_check('$1'::regclass, true)" >/dev/null
}
# 0.6.0: the ledger's tables are quota.active and quota.history.
TABLES="'quota.active'::regclass, 'quota.history'::regclass, 'quota.summary'::regclass"
all_indexes() {
  sql -c "SELECT indexrelid::regclass FROM pg_index WHERE indrelid IN ($TABLES) ORDER BY 1"
}

sql -c "CREATE EXTENSION pg_quota" -c "CREATE EXTENSION amcheck" \
    -c "CREATE ROLE ci_tenant LOGIN" -c "CREATE ROLE ci_fresh LOGIN" \
    -c "ALTER ROLE ci_tenant SET quota.max_active_per_role = 0" \
    -c "ALTER ROLE ci_tenant SET quota.max_retained_per_role = 0" \
    -c "ALTER ROLE ci_tenant SET quota.allow_transactional = on"
psql_as ci_tenant -c "SELECT quota.finish(quota.start('warm up ' || i)) FROM generate_series(1, 20) i" >/dev/null

# ------------------------------------------------------------------------------------
# 1. CREATE INDEX CONCURRENTLY held in its first wait: the new index is in the catalog
#    but not ready (indisready = false) until every older writer of the table is gone.
#    A superuser's open transaction holding ROW EXCLUSIVE keeps it there.
# ------------------------------------------------------------------------------------
# cic_held TABLE INDEX COLUMN: starts the build in the background and returns once it
# waits with its index not ready; sets `held` to 1 if it got there.
cic_held() {
  local table="$1" index="$2" column="$3" n
  open_session holder postgres
  say holder "BEGIN; LOCK TABLE quota.$table IN ROW EXCLUSIVE MODE; SELECT 'locked';"
  wait_out holder locked || true
  rm -f "$CL/cic.rc"
  bg bash -c "timeout 60 '$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U postgres -d postgres \
                -c 'CREATE INDEX CONCURRENTLY $index ON quota.$table ($column)' > '$CL/cic.out' 2>&1; echo \$? > '$CL/cic.rc'"
  held=0
  for _ in $(seq 1 100); do
    n=$(sql -c "SELECT count(*) FROM pg_index i, pg_stat_activity a
                 WHERE i.indexrelid = to_regclass('quota.$index') AND NOT i.indisready
                   AND a.query LIKE 'CREATE INDEX CONCURRENTLY%' AND a.wait_event_type = 'Lock'")
    [ "$n" = 1 ] && { held=1; break; }
    sleep 0.1
  done
}
# cic_release INDEX: ends the holder's transaction and waits for the build to finish.
cic_release() {
  say holder "COMMIT;"
  close_session holder
  timeout 30 bash -c "until [ -e '$CL/cic.rc' ]; do sleep 0.1; done" || true
}

# 0.6.0: the ledger is quota.active (a start() inserts there) and quota.history (a
# finish() deletes the row from quota.active and inserts it here): each in turn gets a
# build held not ready while tickets start and finish.
for t in active history; do
  ticket=$(psql_as ci_tenant -c "SELECT quota.start('to finish during the $t build')")
  cic_held $t ${t}_extra started_at
  expect_eq "CREATE INDEX CONCURRENTLY on quota.$t waits with its index not ready" 1 "$held"
  expect_eq "start() works while quota.$t's new index is not ready" t \
    "$(psql_as ci_tenant -c "SELECT quota.start('during $t build') IS NOT NULL" 2>&1)"
  expect_eq "try_start() works while quota.$t's new index is not ready" t \
    "$(psql_as ci_tenant -c "SELECT quota.try_start('during $t build') IS NOT NULL" 2>&1)"
  expect_eq "finish() works while quota.$t's new index is not ready" t \
    "$(psql_as ci_tenant -c "SELECT quota.finish('$ticket')" 2>&1)"
  expect_eq "finish(start()) works while quota.$t's new index is not ready" t \
    "$(psql_as ci_tenant -c "SELECT quota.finish(quota.start('during $t build'))" 2>&1)"
  cic_release
  expect_eq "CREATE INDEX CONCURRENTLY on quota.$t completes: $(tr '\n' ' ' < "$CL/cic.out")" 0 "$(cat "$CL/cic.rc" 2>/dev/null)"
  expect_eq "quota.${t}_extra is valid and ready" t \
    "$(sql -c "SELECT indisvalid AND indisready FROM pg_index WHERE indexrelid = to_regclass('quota.${t}_extra')")"
  check "bt_index_check(quota.${t}_extra, heapallindexed) passes" amcheck quota.${t}_extra
  expect_eq "start() works after quota.$t's concurrent build" t \
    "$(psql_as ci_tenant -c "SELECT quota.finish(quota.start('after $t build'))" 2>&1)"
done

# The same on quota.summary, whose row the writer updates on every start (and inserts
# for a role's first start: ci_fresh has none yet).
ticket=$(psql_as ci_tenant -c "SELECT quota.start('to finish during the summary build')")
cic_held summary summary_extra tickets
expect_eq "CREATE INDEX CONCURRENTLY on quota.summary waits with its index not ready" 1 "$held"
expect_eq "start() works while the summary's new index is not ready" t \
  "$(psql_as ci_tenant -c "SELECT quota.start('during summary build') IS NOT NULL" 2>&1)"
expect_eq "a role's first start() works while the summary's new index is not ready" t \
  "$(psql_as ci_fresh -c "SELECT quota.start('first, during summary build') IS NOT NULL" 2>&1)"
expect_eq "try_start() works while the summary's new index is not ready" t \
  "$(psql_as ci_tenant -c "SELECT quota.try_start('during summary build') IS NOT NULL" 2>&1)"
expect_eq "finish() works while the summary's new index is not ready" t \
  "$(psql_as ci_tenant -c "SELECT quota.finish('$ticket')" 2>&1)"
cic_release
expect_eq "CREATE INDEX CONCURRENTLY on quota.summary completes: $(tr '\n' ' ' < "$CL/cic.out")" 0 "$(cat "$CL/cic.rc" 2>/dev/null)"
expect_eq "quota.summary_extra is valid and ready" t \
  "$(sql -c "SELECT indisvalid AND indisready FROM pg_index WHERE indexrelid = to_regclass('quota.summary_extra')")"
check "bt_index_check(quota.summary_extra, heapallindexed) passes" amcheck quota.summary_extra
for idx in $(all_indexes); do
  check "bt_index_check($idx, heapallindexed) passes after the concurrent builds" amcheck "$idx"
done
expect_eq "start() works after the summary's concurrent build" t \
  "$(psql_as ci_tenant -c "SELECT quota.finish(quota.start('after summary build'))" 2>&1)"
check "the summary equals the ledger after the concurrent builds" summary_matches_ledger
sql -c "DROP INDEX quota.active_extra" -c "DROP INDEX quota.history_extra" -c "DROP INDEX quota.summary_extra"

# ------------------------------------------------------------------------------------
# 2. REINDEX INDEX CONCURRENTLY of every pg_quota index while two clients loop
#    finish(start()). Each client keeps its session across the rebuilds, so a backend
#    that kept an old index's OID would fail too.
# ------------------------------------------------------------------------------------
# History makes each build take a while, so that the load's writes land inside the
# builds, not only between them. A superuser writes it with SQL, and its summary row
# too where the summary takes one (0.1.0; later versions recount from the ledger).
# 0.6.0: the ledger is two tables, and the load's own tickets stay in quota.active
# only for a moment, so both get rows of their own: ended tickets in quota.history,
# tickets never ended (no lease, each with its idempotency key) in quota.active,
# written into each table directly (through the view quota.ledger each row would go
# through its INSTEAD OF trigger, one by one).
sql -c "CREATE ROLE ci_history" \
    -c "INSERT INTO quota.history SELECT gen_random_uuid(), 'ci_history'::regrole, 'old', now() - interval '1 h', now(), 'succeeded'
          FROM generate_series(1, 200000)" \
    -c "INSERT INTO quota.active (id, role, label, started_at, idempotency_key)
          SELECT gen_random_uuid(), 'ci_history'::regrole, 'open', now() - interval '1 h', 'open ' || i
          FROM generate_series(1, 100000) i" \
    -c "INSERT INTO quota.summary VALUES ('ci_history'::regrole, 300000)" -c "VACUUM ANALYZE quota.active, quota.history"
# Writer-committed, tenants' and transactional tickets (0.5.0), so that every index,
# the partial ones included, takes entries during the builds; and (0.6.0, where
# active_role_key_idx has entries only for keyed tickets) tickets with an idempotency
# key, each its own.
for _ in $(seq 1 70); do
  echo "SELECT quota.finish(quota.start('load'));"
  echo "SELECT quota.finish(quota.start('load', tenant => 'acme'));"
  echo "SELECT quota.finish(quota.start('load', tenant => 'beta', transactional => true));"
  echo "SELECT quota.finish(quota.start('load', idempotency_key => gen_random_uuid()::text));"
done > "$CL/load.sql"
chmod 644 "$CL/load.sql"
rm -f "$CL/stop"
load_client() {  # load_client K: runs load.sql over and over until $CL/stop exists
  local k="$1" round
  for round in $(seq 1 500); do
    [ -e "$CL/stop" ] && break
    timeout 30 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -h "$CL" -p "$PORT" -U ci_tenant \
      -d postgres -f "$CL/load.sql" >> "$CL/load_out.$k" 2>> "$CL/load_err.$k" || sleep 0.1
  done
}
load_pids=()
for k in 1 2; do
  : > "$CL/load_out.$k"; : > "$CL/load_err.$k"
  bg bash -c "$(declare -f load_client); CL='$CL' PORT='$PORT' PG_BIN='$PG_BIN' load_client $k"
  load_pids+=("$LAST_BG")
done
done_count() { cat "$CL"/load_out.* | grep -c '^t$' || true; }
wait_done() {  # wait_done N: until the clients have finished N more tickets (8 s at most)
  local want=$(( $(done_count) + $1 ))
  timeout 8 bash -c "until [ \"\$(cat '$CL'/load_out.* | grep -c '^t$')\" -ge $want ]; do sleep 0.1; done" || true
}
wait_done 50
# 0.6.0: the indexes of quota.active and quota.history (the ledger's tables) and quota.summary
# (0.6.1: quota.active has no active_open_idx).
OWN="active_pkey active_role_idx active_role_key_idx active_tenant_idx active_txid_idx
     history_pkey history_role_ended_idx history_role_key_idx history_tenant_idx history_txid_idx summary_pkey"
for idx in $OWN $OWN; do
  before=$(done_count)
  out=$(timeout 40 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$CL" -p "$PORT" -U postgres \
          -d postgres -c "REINDEX INDEX CONCURRENTLY quota.$idx" 2>&1) && rc=0 || rc=$?
  expect_eq "REINDEX INDEX CONCURRENTLY quota.$idx under load succeeds${out:+: $out}" 0 "$rc"
  wait_done 50
  check "the clients kept finishing tickets across the rebuild of $idx" test "$(done_count)" -gt "$before"
done
touch "$CL/stop"
for p in "${load_pids[@]}"; do timeout 40 tail --pid="$p" -f /dev/null || true; done
done_total=$(done_count)
check "the clients finished tickets during the rebuilds ($done_total)" test "$done_total" -gt 150
errors=$(cat "$CL"/load_err.* | grep -E 'ERROR|FATAL' || true)
check "the clients saw no error${errors:+: $(sort <<<"$errors" | uniq -c | sort -rn | head -n3 | tr '\n' ' ')}" test -z "$errors"
expect_eq "pg_quota's tables have their eleven indexes, valid and ready, and no leftover" \
  "active_pkey active_role_idx active_role_key_idx active_tenant_idx active_txid_idx history_pkey history_role_ended_idx history_role_key_idx history_tenant_idx history_txid_idx summary_pkey" \
  "$(sql -c "SELECT string_agg(c.relname || CASE WHEN i.indisvalid AND i.indisready THEN '' ELSE ' (invalid)' END,
                               ' ' ORDER BY c.relname) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
              WHERE i.indrelid IN ($TABLES)")"
for idx in $(all_indexes); do
  check "bt_index_check($idx, heapallindexed) passes after REINDEX CONCURRENTLY" amcheck "$idx"
done
check "the summary equals the ledger after the rebuilds" summary_matches_ledger
expect_eq "start() works after the rebuilds" t \
  "$(psql_as ci_tenant -c "SELECT quota.finish(quota.start('after reindex'))" 2>&1)"
expect_eq "a role's first start() works after the rebuilds" t \
  "$(psql_as ci_fresh -c "SELECT quota.start('after reindex') IS NOT NULL" 2>&1)"
finish_checks
