#!/usr/bin/env bash
# A superuser's direct SQL writes to pg_quota's tables (TRUNCATE, DELETE, UPDATE and
# INSERT on quota.ledger; TRUNCATE and UPDATE on quota.summary) leave admission
# consistent with the ledger: afterwards each role is admitted exactly up to its limit,
# counting the rows the ledger really holds. The summary may be rebuilt or recounted;
# the checks look at admission, not at summary rows.
#
# From 0.6.0 the ledger is two tables, quota.active (tickets not ended) and
# quota.history (ended ones), and quota.ledger a view of both whose INSTEAD OF trigger
# sends a superuser's INSERT, UPDATE and DELETE to the table each row belongs in. The
# writes below go through the view as before (TRUNCATE, which a view refuses, empties
# both tables), and then (at the end) straight to each table.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5625 + PORT_OFFSET))}"
with_cluster direct_writes

LIMIT=5
sql <<SQL
CREATE EXTENSION pg_quota;
CREATE ROLE dw_a LOGIN; CREATE ROLE dw_b LOGIN; CREATE ROLE dw_c LOGIN;
ALTER ROLE dw_a SET quota.max_active_per_role = 0;
ALTER ROLE dw_a SET quota.max_retained_per_role = $LIMIT;
ALTER ROLE dw_b SET quota.max_active_per_role = 0;
ALTER ROLE dw_b SET quota.max_retained_per_role = $LIMIT;
ALTER ROLE dw_c SET quota.max_active_per_role = 0;
ALTER ROLE dw_c SET quota.max_retained_per_role = $LIMIT;
SQL

as() {  # as USER SQL...: one session, output only
  local user="$1"; shift; local a=() q
  for q in "$@"; do a+=(-c "$q"); done
  timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U "$user" -d postgres -v ON_ERROR_STOP=0 "${a[@]}" 2>/dev/null || true
}
state() {  # state USER SQL...: the SQLSTATE of the last statement
  as "$@" '\echo SQLSTATE=:SQLSTATE' | sed -n 's/^SQLSTATE=//p' | tail -n1
}
rows() { sql -c "SELECT count(*) FROM quota.ledger WHERE role = '$1'::regrole"; }
# fill ROLE: starts and finishes tickets as ROLE until it is refused (at most 10);
# prints how many were admitted.
fill() {
  local n=0
  while [ $n -lt 10 ]; do
    [ "$(as "$1" "SELECT quota.finish(quota.try_start('fill'))")" = t ] || break
    n=$((n + 1))
  done
  echo $n
}
# admits_exactly NAME ROLE N: ROLE is admitted exactly N more times, then refused with
# 53400, and then holds LIMIT ledger rows.
admits_exactly() {
  local name="$1" role="$2" want="$3"
  expect_eq "$name: $role is admitted exactly $want more times" "$want" "$(fill "$role")"
  expect_eq "$name: ... then refused with 53400" 53400 "$(state "$role" "SELECT quota.start('over')")"
  expect_eq "$name: ... holding $LIMIT ledger rows" "$LIMIT" "$(rows "$role")"
}

# The retained limit reached the ordinary way.
admits_exactly "start" dw_a $LIMIT

# TRUNCATE of the ledger (from 0.6.0 its two tables, quota.active and quota.history, in
# one statement: the view quota.ledger cannot be truncated): the role has nothing
# retained.
sql -c "TRUNCATE quota.active, quota.history" >/dev/null
expect_eq "after TRUNCATE quota.active, quota.history: dw_a holds no rows" 0 "$(rows dw_a)"
expect_eq "after TRUNCATE quota.active, quota.history: start() is admitted" t "$(as dw_a "SELECT quota.start('after truncate') IS NOT NULL")"
expect_eq "after TRUNCATE quota.active, quota.history: quota.usage shows 1 active, 1 retained" "1|1" \
  "$(as dw_a "SELECT active || '|' || retained FROM quota.usage")"
admits_exactly "after TRUNCATE quota.active, quota.history" dw_a $((LIMIT - 1))

# DELETE two of the role's rows (through the view quota.ledger, as every DELETE, UPDATE
# and INSERT down to the summary's checks).
sql -c "DELETE FROM quota.ledger WHERE id IN (SELECT id FROM quota.ledger WHERE role = 'dw_a'::regrole ORDER BY id LIMIT 2)" >/dev/null
expect_eq "after DELETE of 2 rows: dw_a holds $((LIMIT - 2)) rows" $((LIMIT - 2)) "$(rows dw_a)"
admits_exactly "after DELETE of 2 rows" dw_a 2

# DELETE all of the role's rows.
sql -c "DELETE FROM quota.ledger WHERE role = 'dw_a'::regrole" >/dev/null
admits_exactly "after DELETE of all its rows" dw_a $LIMIT

# UPDATE: move 3 of dw_a's tickets to dw_b, which had none.
sql -c "UPDATE quota.ledger SET role = 'dw_b'::regrole
         WHERE id IN (SELECT id FROM quota.ledger WHERE role = 'dw_a'::regrole ORDER BY id LIMIT 3)" >/dev/null
expect_eq "after UPDATE ... SET role: dw_a holds 2 rows, dw_b 3" "2 3" "$(rows dw_a) $(rows dw_b)"
admits_exactly "after UPDATE ... SET role" dw_a 3
admits_exactly "after UPDATE ... SET role" dw_b 2

# INSERT: 4 ended tickets written for dw_c by hand.
sql -c "INSERT INTO quota.ledger (id, role, label, started_at, ended_at, outcome)
        SELECT gen_random_uuid(), 'dw_c'::regrole, 'inserted ' || i, now(), now(), 'succeeded'
          FROM generate_series(1, 4) i" >/dev/null
admits_exactly "after INSERT of 4 rows" dw_c 1

# The summary itself: emptied, or zeroed, admission still counts the ledger.
sql -c "TRUNCATE quota.summary" >/dev/null
admits_exactly "after TRUNCATE quota.summary" dw_a 0
admits_exactly "after TRUNCATE quota.summary" dw_c 0
sql -c "UPDATE quota.summary SET tickets = 0" >/dev/null
admits_exactly "after UPDATE quota.summary SET tickets = 0" dw_b 0

# Rows deleted by hand come back as capacity for every role at once.
sql -c "DELETE FROM quota.ledger WHERE label = 'fill'" >/dev/null
expect_eq "after deleting every 'fill' row: rows left for dw_a, dw_b, dw_c" "0 0 4" "$(rows dw_a) $(rows dw_b) $(rows dw_c)"
admits_exactly "after deleting every 'fill' row" dw_a 5
admits_exactly "after deleting every 'fill' row" dw_b 5
admits_exactly "after deleting every 'fill' row" dw_c 1

# 0.6.0: the same writes straight to quota.active and quota.history, each table on its
# own. Every row is an ended ticket in quota.history now: dw_a and dw_b hold 5 'fill'
# rows, dw_c 4 'inserted' and 1 'fill'.
expect_eq "before the writes to each table: quota.active holds no row, quota.history every one" "0 15" \
  "$(sql -c "SELECT (SELECT count(*) FROM quota.active) || ' ' || (SELECT count(*) FROM quota.history)")"
sql -c "DELETE FROM quota.history WHERE id IN (SELECT id FROM quota.history WHERE role = 'dw_a'::regrole ORDER BY id LIMIT 2)" >/dev/null
expect_eq "after DELETE FROM quota.history of 2 rows: dw_a holds $((LIMIT - 2)) rows" $((LIMIT - 2)) "$(rows dw_a)"
admits_exactly "after DELETE FROM quota.history of 2 rows" dw_a 2
sql -c "DELETE FROM quota.history WHERE role = 'dw_c'::regrole" >/dev/null
sql -c "UPDATE quota.history SET role = 'dw_c'::regrole
         WHERE id IN (SELECT id FROM quota.history WHERE role = 'dw_b'::regrole ORDER BY id LIMIT 3)" >/dev/null
expect_eq "after UPDATE quota.history SET role: dw_b holds 2 rows, dw_c 3" "2 3" "$(rows dw_b) $(rows dw_c)"
admits_exactly "after UPDATE quota.history SET role" dw_b 3
admits_exactly "after UPDATE quota.history SET role" dw_c 2
# Tickets not ended, written by hand into quota.active: 3 for dw_a, once its history is
# emptied by a TRUNCATE of quota.history alone.
sql -c "TRUNCATE quota.history" >/dev/null
sql -c "INSERT INTO quota.active (id, role, label, started_at)
        SELECT gen_random_uuid(), 'dw_a'::regrole, 'active ' || i, now() FROM generate_series(1, 3) i" >/dev/null
expect_eq "after TRUNCATE quota.history and INSERT INTO quota.active of 3 rows: quota.usage shows 3 active, 3 retained" "3|3" \
  "$(as dw_a "SELECT active || '|' || retained FROM quota.usage")"
admits_exactly "after INSERT INTO quota.active of 3 rows" dw_a 2
sql -c "UPDATE quota.active SET role = 'dw_b'::regrole WHERE role = 'dw_a'::regrole" >/dev/null
expect_eq "after UPDATE quota.active SET role: dw_a holds 2 rows, dw_b 3 (all active)" "2 3 3" \
  "$(rows dw_a) $(rows dw_b) $(sql -c "SELECT count(*) FROM quota.active WHERE role = 'dw_b'::regrole")"
admits_exactly "after UPDATE quota.active SET role" dw_a 3
admits_exactly "after UPDATE quota.active SET role" dw_b 2
# TRUNCATE of quota.history alone keeps the active tickets, and they still count.
sql -c "TRUNCATE quota.history" >/dev/null
expect_eq "after TRUNCATE quota.history alone: dw_b keeps its 3 active tickets" 3 "$(rows dw_b)"
admits_exactly "after TRUNCATE quota.history alone" dw_b 2
sql -c "DELETE FROM quota.active WHERE role = 'dw_b'::regrole" >/dev/null
expect_eq "after DELETE FROM quota.active: dw_b holds 2 rows" 2 "$(rows dw_b)"
admits_exactly "after DELETE FROM quota.active" dw_b 3
sql -c "INSERT INTO quota.history (id, role, label, started_at, ended_at, outcome)
        SELECT gen_random_uuid(), 'dw_c'::regrole, 'inserted ' || i, now(), now(), 'succeeded'
          FROM generate_series(1, 2) i" >/dev/null
expect_eq "after INSERT INTO quota.history of 2 rows: dw_c holds 2 rows" 2 "$(rows dw_c)"
admits_exactly "after INSERT INTO quota.history of 2 rows" dw_c 3

# 0.6.0: the writer looks a role's summary row up where it last found or wrote it
# (ledger::count::summary_row), and takes what it finds there for the role's row only if
# it is a version of that role's. Here the place dw_d's row was last written holds
# dw_e's row: dw_d's row is deleted by hand and the table vacuumed, then dw_e's row is
# rewritten by SQL until its current version sits where dw_d's was (so dw_e's tickets,
# 2, differ from dw_d's). dw_d's next start must then give dw_d a row of its own, with
# its 4 tickets, and leave dw_e's (a start that took dw_e's row for dw_d's wrote
# 2 + 1 = 3 for dw_d, and dw_e lost its row). After a restart the counters are built
# from those rows.
sql <<SQL >/dev/null 2>&1
CREATE ROLE dw_d LOGIN; CREATE ROLE dw_e LOGIN;
ALTER ROLE dw_d SET quota.max_active_per_role = 0;
ALTER ROLE dw_d SET quota.max_retained_per_role = $LIMIT;
ALTER ROLE dw_e SET quota.max_active_per_role = 0;
ALTER ROLE dw_e SET quota.max_retained_per_role = $LIMIT;
-- Empties the summary (guard.rs), and lets SQL write it.
ALTER TABLE quota.summary DISABLE TRIGGER summary_written;
SQL
summary_at() { sql -c "SELECT ctid FROM quota.summary WHERE role = '$1'::regrole"; }
for _ in 1 2 3; do as dw_d "SELECT quota.finish(quota.start('d'))" >/dev/null; done
d_at="$(summary_at dw_d)"
sql -c "DELETE FROM quota.summary WHERE role = 'dw_d'::regrole" >/dev/null
as dw_e "SELECT quota.finish(quota.start('e'))" >/dev/null
as dw_e "SELECT quota.finish(quota.start('e'))" >/dev/null
# Each UPDATE puts dw_e's new version in the page's first free slot, once VACUUM has
# freed dw_d's (an older snapshot elsewhere, autovacuum's, may hold that off a while).
for i in $(seq 1 40); do
  [ "$(summary_at dw_e)" = "$d_at" ] && break
  [ $((i % 8)) = 1 ] && sql -c "VACUUM quota.summary" >/dev/null
  sql -c "UPDATE quota.summary SET tickets = tickets WHERE role = 'dw_e'::regrole" >/dev/null
done
expect_eq "dw_e's summary row (2 tickets) now sits where dw_d's was last written, $d_at" "$d_at|2" \
  "$(sql -c "SELECT ctid || '|' || tickets FROM quota.summary WHERE role = 'dw_e'::regrole")"
as dw_d "SELECT quota.finish(quota.start('d'))" >/dev/null
expect_eq "dw_d's next start gives it a row of its own, counting its 4 tickets; dw_e keeps its row" "dw_d|4 dw_e|2" \
  "$(sql -c "SELECT string_agg(role::text || '|' || tickets, ' ' ORDER BY role::text) FROM quota.summary
              WHERE role IN ('dw_d'::regrole, 'dw_e'::regrole)")"
stop_cluster "$CL"
as_pg "$PG_BIN/pg_ctl" -D "$CL/data" -l "$CL/server.log" -w -t 60 start >/dev/null
admits_exactly "after a restart, counted from the summary rows" dw_d 1
admits_exactly "after a restart, counted from the summary rows" dw_e 3
sql -c "ALTER TABLE quota.summary ENABLE ALWAYS TRIGGER summary_written" >/dev/null 2>&1

check "no server process was terminated by a signal" test "$(grep -c 'terminated by signal' "$CL/server.log" || true)" = 0
finish_checks
