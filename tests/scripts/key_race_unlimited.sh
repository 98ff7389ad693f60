#!/usr/bin/env bash
# Idempotency (0.5.2, R3): one key, one ticket, for a role without limits and for a
# superuser, racing a transactional start with the same key.
#
# A start that no limit can refuse used to go to the ledger writer without the scope
# lock: its key checks ran first, outside any lock, and its request was published only
# once a writer took it. A transactional start with the same key inserted in between
# was invisible to the writer (uncommitted), so both committed a ticket. The window
# is made wide and certain here: the server has one background worker slot, which the
# writer of another database holds while its batch waits for a lock, so that A (the
# keyed start) waits in line for a writer after its key checks; B's transactional
# start with the key inserts its row meanwhile; then the lock is released and A gets
# its writer. A must come back with B's ticket once B commits: one ticket with the key.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5775 + PORT_OFFSET))}"
# One worker slot: no logical replication launcher takes one.
with_cluster key_race_unlimited "max_worker_processes = 1" "max_logical_replication_workers = 0" \
  "quota.writer_start_wait = '30s'"
sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE kr LOGIN" \
    -c "ALTER ROLE kr SET quota.max_active_per_role = 0" \
    -c "ALTER ROLE kr SET quota.max_retained_per_role = 0" \
    -c "ALTER ROLE kr SET quota.allow_transactional = on" \
    -c "ALTER ROLE postgres SET quota.allow_transactional = on" \
    -c "CREATE DATABASE other" >/dev/null
sql -d other -c "CREATE EXTENSION pg_quota" >/dev/null

# waits_for WHAT SQL: polls SQL (a boolean) for up to 15 s.
waits_for() {
  local i
  for i in $(seq 1 300); do
    [ "$(sql -c "$2")" = t ] && return 0
    sleep 0.05
  done
  echo "# timed out waiting for $1"
  return 1
}

round() {
  local who="$1" key="key-$1"
  # Every session is open before the window: the writer of other waits at most 5 s
  # (its lock_timeout) for L's lock, and B must insert within that time.
  open_session "A_$who" "$who"
  open_session "B_$who" "$who"
  open_session "C_$who" postgres
  say "C_$who" '\c other'
  # The writer of database other takes the only worker slot and waits, in a batch, for
  # a lock on its summary that L holds (it gives the slot up only after the batch).
  open_session "L_$who" postgres
  say "L_$who" '\c other'
  say "L_$who" "BEGIN; LOCK TABLE quota.summary IN SHARE MODE; SELECT 'locked';"
  wait_out "L_$who" locked
  say "C_$who" "SELECT 'other:' || (quota.start('other') IS NOT NULL);"
  waits_for "the writer of other to wait for L's lock" \
    "SELECT count(*) > 0 FROM pg_locks l JOIN pg_database d ON d.oid = l.database
      WHERE d.datname = 'other' AND l.relation IS NOT NULL AND NOT l.granted"
  # A: the keyed start that no limit can refuse, in line for a writer slot.
  say "A_$who" "SELECT 'A:' || quota.start('a', idempotency_key => '$key');"
  waits_for "A to wait in line for a writer slot" \
    "SELECT count(*) > 0 FROM pg_stat_activity
      WHERE usename = '$who' AND query LIKE '%''a'', idempotency_key%' AND wait_event_type = 'Extension'"
  # B: a transactional start with the same key, left open.
  say "B_$who" "BEGIN; SELECT 'B:' || quota.start('b', idempotency_key => '$key', transactional => true);"
  wait_out "B_$who" "B:"
  # The race was set up as meant only if B inserted while A still waited in line and
  # the writer of other still held the slot: otherwise this round proves nothing.
  expect_eq "$who: B inserted its row while A and the other database's start still waited" \
    "0 0" "$(grep -c '^A:' "$CL/A_$who.out") $(grep -c 'other:\|ERROR' "$CL/C_$who.out")"
  # The lock goes: the other writer ends its batch and gives its slot up to A's database.
  say "L_$who" "COMMIT;"
  wait_out "C_$who" "other:\\|ERROR" 20 || true
  # A is answered (a new ticket: the old code), or waits for B's transaction to end.
  local i
  for i in $(seq 1 300); do
    grep -q '^A:' "$CL/A_$who.out" 2>/dev/null && break
    [ "$(sql -c "SELECT count(*) FROM pg_stat_activity WHERE usename = '$who'
                   AND query LIKE '%''a'', idempotency_key%' AND wait_event = 'transactionid'")" -gt 0 ] && break
    sleep 0.05
  done
  say "B_$who" "COMMIT;"
  wait_out "A_$who" "A:" 20
  local a b
  a=$(sed -n 's/^A://p' "$CL/A_$who.out")
  b=$(sed -n 's/^B://p' "$CL/B_$who.out")
  expect_eq "$who: the keyed start racing a transactional start with its key got that ticket" "$b" "$a"
  expect_eq "$who: one ticket with the key" 1 \
    "$(sql -c "SELECT count(*) FROM quota.ledger WHERE idempotency_key = '$key'")"
  for s in L C A B; do close_session "${s}_$who"; done
}

round kr
round postgres
check "no server process was terminated by a signal" test "$(grep -c 'terminated by signal' "$CL/server.log" || true)" = 0
finish_checks
