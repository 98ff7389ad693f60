#!/usr/bin/env bash
# pg_quota updates its tables below SQL (src/heap.rs), so it must add index entries
# exactly as the executor would. With BRIN indexes on the ledger's tables and
# quota.summary (from 0.6.0 the ledger is two tables: quota.active, the tickets not
# ended, and quota.history, the ended ones; quota.ledger is a view over both):
#
# - From PostgreSQL 16, BRIN no longer blocks HOT. The writer's update of a summary row
#   changes only `tickets`, which no btree covers, so with a BRIN on it the update is
#   HOT and heap_update answers TU_Summarizing: the new version needs an entry in the
#   BRIN index (else the BRIN summary goes stale and a BRIN scan misses the row), and
#   in no btree (it is heap-only: btrees reach it through the HOT chain's root). Through
#   15 the same update is not HOT and every index gets an entry.
# - start() inserts the ticket's row into quota.active: every index of quota.active, the
#   BRIN on started_at included, gets an entry.
# - finish() (0.6.0) deletes the row from quota.active and inserts its ended version
#   into quota.history: an insert, so every index of quota.history, the BRIN on
#   ended_at included, gets an entry. (Up to 0.5.x it updated ended_at in place, which
#   the (role, ended_at) btree covers, so never HOT: the same entries.)
#   The rows land on pages the BRINs summarized before, whose summaries must widen.
# - From 17, BRIN's inserts keep a pinned revmap until index_insert_cleanup; closing
#   the index without it leaks the pin ("resource was not closed" at commit).
#
# Checked with amcheck (bt_index_check with heapallindexed, and checkunique where the
# server has it; verify_heapam), with pageinspect (no btree entry points at a heap-only
# tuple), with BRIN scans that must find the updated rows, and in the server log.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5687 + PORT_OFFSET))}"
with_cluster brin_summarizing "autovacuum = off"

ROLES=8
sql -c "CREATE EXTENSION pg_quota" -c "CREATE EXTENSION amcheck" -c "CREATE EXTENSION pageinspect" >/dev/null
for r in $(seq 1 "$ROLES"); do
  sql -c "CREATE ROLE bs_$r LOGIN" -c "ALTER ROLE bs_$r SET quota.max_active_per_role = 0" \
      -c "ALTER ROLE bs_$r SET quota.max_retained_per_role = 0"
done
# One block per range, so that each summarized page has a summary of its own.
# 0.6.0: the ledger's BRINs go on its two tables: started_at on both, ended_at on
# quota.history (in quota.active it is always null).
sql -c "CREATE INDEX history_ended_brin ON quota.history USING brin (ended_at) WITH (pages_per_range = 1)" \
    -c "CREATE INDEX history_started_brin ON quota.history USING brin (started_at) WITH (pages_per_range = 1)" \
    -c "CREATE INDEX active_started_brin ON quota.active USING brin (started_at) WITH (pages_per_range = 1)" \
    -c "CREATE INDEX summary_tickets_brin ON quota.summary USING brin (tickets) WITH (pages_per_range = 1)"

# starts N: every role starts N tickets (each start inserts a row into quota.active and
# inserts or updates the role's summary row, in the writer).
starts() {
  local r
  for r in $(seq 1 "$ROLES"); do
    psql_as "bs_$r" -c "SELECT quota.start('brin ' || i) FROM generate_series(1, $1) i" >> "$CL/tickets.$r"
  done
}

# 1. Five tickets per role, and each role finishes its fifth (0.6.0: so that
#    quota.history has pages for its BRINs to summarize before the finishes under test),
#    then the BRIN indexes summarize every page there is: summary rows with tickets
#    1..5, rows of quota.active not ended, one ended row per role in quota.history.
starts 5
for r in $(seq 1 "$ROLES"); do
  mapfile -t T < "$CL/tickets.$r"
  psql_as "bs_$r" -c "SELECT quota.finish('${T[4]}')" >/dev/null
done
sql -c "SELECT brin_summarize_new_values('quota.history_ended_brin'),
               brin_summarize_new_values('quota.history_started_brin'),
               brin_summarize_new_values('quota.active_started_brin'),
               brin_summarize_new_values('quota.summary_tickets_brin')" >/dev/null
for i in summary_tickets_brin history_ended_brin history_started_brin active_started_brin; do
  check "BRIN ranges of $i are summarized" \
    test "$(sql -c "SELECT count(*) FROM brin_revmap_data(get_raw_page('quota.$i', 1)) WHERE pages <> '(0,0)'")" -gt 0
done
# What was summarized: the pages each table has now, and a time after every ticket so far.
summarized_active=$(sql -c "SELECT pg_relation_size('quota.active') / current_setting('block_size')::int")
summarized_history=$(sql -c "SELECT pg_relation_size('quota.history') / current_setting('block_size')::int")
mark=$(sql -c "SELECT clock_timestamp()")

# 2. One more ticket per role: each summary row goes to tickets = 6, on its page; and
#    a row per role in quota.active, started after the summarization.
starts 1
# 3. Each role finishes two of its first tickets: 0.6.0: their ended rows go into
#    quota.history, ended after the summarization.
for r in $(seq 1 "$ROLES"); do
  mapfile -t T < "$CL/tickets.$r"
  psql_as "bs_$r" -c "SELECT quota.finish('${T[0]}')" -c "SELECT quota.finish('${T[1]}', 'failed')" >/dev/null
done

expect_eq "every role has 6 tickets in the ledger" "$ROLES" \
  "$(sql -c "SELECT count(*) FROM (SELECT role FROM quota.ledger GROUP BY role HAVING count(*) = 6) r")"
expect_eq "quota.summary says 6 for every role" "$ROLES" "$(sql -c "SELECT count(*) FROM quota.summary WHERE tickets = 6")"
expect_eq "every role has 3 tickets in quota.active and 3 in quota.history" "$ROLES $ROLES" \
  "$(sql -c "SELECT (SELECT count(*) FROM (SELECT role FROM quota.active GROUP BY role HAVING count(*) = 3) a) || ' ' ||
                    (SELECT count(*) FROM (SELECT role FROM quota.history GROUP BY role HAVING count(*) = 3) h)")"
# The BRIN checks below can fail only for rows on pages summarized before they came (a
# range not summarized is always returned by a BRIN scan).
expect_eq "the rows started after the summarization are on quota.active's summarized pages ($summarized_active)" "$ROLES 0" \
  "$(sql -c "SELECT count(*) || ' ' || count(*) FILTER (WHERE (ctid::text::point)[0] >= $summarized_active)
               FROM quota.active WHERE started_at > '$mark'")"
expect_eq "the rows ended after the summarization are on quota.history's summarized pages ($summarized_history)" "$((2 * ROLES)) 0" \
  "$(sql -c "SELECT count(*) || ' ' || count(*) FILTER (WHERE (ctid::text::point)[0] >= $summarized_history)
               FROM quota.history WHERE ended_at > '$mark'")"

# The summary updates took the path under test: HOT (heap-only versions) from 16 on,
# where BRIN no longer blocks HOT; never HOT through 15.
heap_only=$(sql -c "SELECT count(*) FROM generate_series(0, pg_relation_size('quota.summary') / current_setting('block_size')::int - 1) b,
                           heap_page_items(get_raw_page('quota.summary', b::int)) h
                     WHERE h.lp_flags = 1 AND (h.t_infomask2 & 32768) <> 0")
if [ "$PG_MAJOR" -ge 16 ]; then
  check "PostgreSQL $PG_MAJOR: the summary updates were HOT despite the BRIN index ($heap_only heap-only versions), so heap_update reported TU_Summarizing" \
    test "$heap_only" -gt 0
else
  expect_eq "PostgreSQL $PG_MAJOR: BRIN blocks HOT, so no summary version is heap-only" 0 "$heap_only"
fi

# --- amcheck ----------------------------------------------------------------------------
# 0.6.0: pg_quota's tables are quota.active, quota.history and quota.summary.
TABLES="'quota.active'::regclass, 'quota.history'::regclass, 'quota.summary'::regclass"
btrees=$(sql -c "SELECT c.oid::regclass FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                  JOIN pg_am a ON a.oid = c.relam
                 WHERE a.amname = 'btree' AND i.indrelid IN ($TABLES)
                 ORDER BY c.relname")
expect_eq "the btree indexes of quota.active, quota.history and quota.summary" \
  "quota.active_pkey quota.active_role_idx quota.active_role_key_idx quota.active_tenant_idx quota.active_txid_idx quota.history_pkey quota.history_role_ended_idx quota.history_role_key_idx quota.history_tenant_idx quota.history_txid_idx quota.summary_pkey" "$(echo $btrees)"
# checkunique (amcheck 1.4, PostgreSQL 17) also fails when two entries of a unique
# index with the same key both lead to live rows.
unique_arg=""
[ "$(sql -c "SELECT count(*) FROM pg_proc WHERE proname = 'bt_index_check' AND pronargs = 3")" = 1 ] \
  && unique_arg=", checkunique => true"
for i in $btrees; do
  out=$(sql -c "SELECT bt_index_check('$i', heapallindexed => true$unique_arg)" 2>&1) && rc=0 || rc=$?
  check "amcheck: bt_index_check('$i', heapallindexed${unique_arg:+, checkunique}) passes${out:+: $out}" test "$rc" = 0
done
for t in quota.active quota.history quota.summary; do
  expect_eq "amcheck: verify_heapam('$t') finds nothing" "" \
    "$(sql -c "SELECT blkno || '/' || offnum || ': ' || msg FROM verify_heapam('$t')")"
done

# --- no btree entry points at a heap-only tuple (pageinspect) ----------------------------
# Index entries lead to the root of a HOT chain; an entry for a heap-only version (an
# update treated as not HOT) is one more entry per update, which turns into a wrong
# row once pruning reuses the line pointer.
bad=$(sql -c "
  WITH btree AS (
    SELECT c.oid::regclass AS idx, i.indrelid::regclass AS tbl
      FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am a ON a.oid = c.relam
     WHERE a.amname = 'btree' AND i.indrelid IN ($TABLES)),
  leaves AS (
    SELECT b.idx, b.tbl, blk, s.btpo_next
      FROM btree b,
           generate_series(1, (pg_relation_size(b.idx) / current_setting('block_size')::int - 1)::int) blk,
           LATERAL bt_page_stats(b.idx::text, blk) s
     WHERE s.btpo_level = 0 AND s.type NOT IN ('d', 'e')),
  entries AS (
    SELECT l.idx, l.tbl, t AS htid
      FROM leaves l, LATERAL bt_page_items(l.idx::text, l.blk) it,
           LATERAL unnest(coalesce(it.tids, ARRAY[it.htid])) t
     WHERE it.htid IS NOT NULL AND NOT (it.itemoffset = 1 AND l.btpo_next <> 0))
  SELECT e.idx || ' ' || e.htid
    FROM entries e,
         LATERAL heap_page_items(get_raw_page(e.tbl::text, (e.htid::text::point)[0]::int)) h
   WHERE h.lp = (e.htid::text::point)[1]::int AND h.lp_flags = 1 AND (h.t_infomask2 & 32768) <> 0
   ORDER BY 1")
bad=$( [ -z "$bad" ] || echo "$(wc -l <<<"$bad") entries, among them $(head -n 5 <<<"$bad" | paste -sd' ')")
entries=$(sql -c "SELECT sum((bt_page_stats('quota.summary_pkey', 1)).live_items)")
expect_eq "no btree entry of quota.active, quota.history or quota.summary points at a heap-only tuple (summary_pkey has $entries entries)" "" "$bad"

# --- the BRIN indexes find the updated rows -------------------------------------------------
# by_brin INDEX QUERY: QUERY's result through a bitmap scan, which must use INDEX.
# The btree on ended_at (0.6.0: history_role_ended_idx, as its second column) would
# serve the same query; it is dropped inside a transaction that rolls back, so that the
# planner has only the BRIN.
by_brin() {
  local plan hide=(-c "BEGIN" -c "DROP INDEX quota.history_role_ended_idx" -c "SET LOCAL enable_seqscan = off"
                   -c "SET LOCAL enable_indexscan = off" -c "SET LOCAL enable_indexonlyscan = off")
  plan=$(sql "${hide[@]}" -c "EXPLAIN (COSTS OFF) $2" -c "ROLLBACK")
  grep -q "Bitmap Index Scan on $1\$" <<<"$plan" || { echo "plan does not use $1: $(echo $plan)"; return; }
  sql "${hide[@]}" -c "$2" -c "ROLLBACK"
}
by_seqscan() { sql -c "SET enable_bitmapscan = off" -c "SET enable_indexscan = off" -c "SET enable_indexonlyscan = off" -c "$1"; }

q="SELECT count(*) FROM quota.summary WHERE tickets >= 6"
expect_eq "summary_tickets_brin finds every summary row updated to 6 (as a sequential scan does)" \
  "$(by_seqscan "$q")" "$(by_brin summary_tickets_brin "$q")"
check "... which is every role" test "$(by_seqscan "$q")" = "$ROLES"
# 0.6.0: each query on the table whose BRIN it tests (a query on the view would scan both).
q="SELECT count(*) FROM quota.history WHERE ended_at IS NOT NULL"
expect_eq "history_ended_brin finds every ticket finish() ended (as a sequential scan does)" \
  "$(by_seqscan "$q")" "$(by_brin history_ended_brin "$q")"
check "... which is three per role" test "$(by_seqscan "$q")" = $((3 * ROLES))
# The pages were summarized with ended rows on them, so "IS NOT NULL" matches their
# ranges whatever the summary says; only a bound past the summary's maximum misses a
# range whose summary did not widen.
q="SELECT count(*) FROM quota.history WHERE ended_at > '$mark'"
expect_eq "history_ended_brin finds every ticket finish() ended after the summarization (as a sequential scan does)" \
  "$(by_seqscan "$q")" "$(by_brin history_ended_brin "$q")"
check "... which is two per role" test "$(by_seqscan "$q")" = $((2 * ROLES))
q="SELECT count(*) FROM quota.history WHERE started_at > '-infinity'"
expect_eq "history_started_brin finds every ticket ended (as a sequential scan does)" \
  "$(by_seqscan "$q")" "$(by_brin history_started_brin "$q")"
q="SELECT count(*) FROM quota.active WHERE started_at > '-infinity'"
expect_eq "active_started_brin finds every ticket not ended (as a sequential scan does)" \
  "$(by_seqscan "$q")" "$(by_brin active_started_brin "$q")"
q="SELECT count(*) FROM quota.active WHERE started_at > '$mark'"
expect_eq "active_started_brin finds every ticket started after the summarization (as a sequential scan does)" \
  "$(by_seqscan "$q")" "$(by_brin active_started_brin "$q")"
check "... which is one per role" test "$(by_seqscan "$q")" = "$ROLES"
check "quota.ledger shows both tables' tickets: six per role" \
  test "$(sql -c "SELECT count(*) FROM quota.ledger WHERE started_at > '-infinity'")" = $((6 * ROLES))

# --- nothing leaked --------------------------------------------------------------------------
leaks=$(grep -E 'resource was not closed|refcount leak|leaked' "$CL/server.log" | head -n 3 | paste -sd' ' || true)
expect_eq "the server log shows no leaked buffer pin or other resource" "" "$leaks"
errors=$(grep -E 'ERROR|PANIC|TRAP' "$CL/server.log" | head -n 3 | paste -sd' ' || true)
expect_eq "the server log shows no error" "" "$errors"
finish_checks
