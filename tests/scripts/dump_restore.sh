#!/usr/bin/env bash
# pg_dump -Fc and pg_restore carry the charges: quota.ledger and quota.summary come
# back row for row in a new database, a tenant at its limit is still refused there, and
# its tickets can be finished there (and only there).
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5525 + PORT_OFFSET))}"
with_cluster dump_restore

ledger_of() { sql -d "$1" -c "SELECT id, role::regrole, label, started_at, ended_at, outcome FROM quota.ledger ORDER BY id"; }
summary_of() { sql -d "$1" -c "SELECT role::regrole, tickets FROM quota.summary ORDER BY role"; }
# The summary is derived: a role without a row has its rows counted from the ledger
# (a restore skips the dumped summary rows), and every row there is must be right.
summary_matches_ledger() {  # summary_matches_ledger DB
  [ "$(sql -d "$1" -c "SELECT count(*) FROM quota.summary s LEFT JOIN
                 (SELECT role, count(*) AS n FROM quota.ledger GROUP BY role) l USING (role)
                WHERE s.tickets IS DISTINCT FROM coalesce(l.n, 0)")" = 0 ]
}

sql -c "CREATE DATABASE src" \
    -c "CREATE ROLE dr_a LOGIN" -c "CREATE ROLE dr_b LOGIN" \
    -c "ALTER ROLE dr_a SET quota.max_active_per_role = 2" \
    -c "ALTER ROLE dr_b SET quota.max_active_per_role = 5" \
    -c "CREATE ROLE dr_c LOGIN" -c "ALTER ROLE dr_c SET quota.max_active_per_role = 0" \
    -c "ALTER ROLE dr_c SET quota.max_retained_per_role = 3"
sql -d src -c "CREATE EXTENSION pg_quota"

# dr_a: two ended tickets and two active ones (its limit); dr_b: one active, one
# cancelled; dr_c: three ended tickets, its retained limit; the superuser: one active
# ticket with an awkward label.
a_done=$(as dr_a src "SELECT quota.start('a done ' || i) FROM generate_series(1, 2) i")
as dr_a src "SELECT quota.finish(id, o) FROM unnest(ARRAY[$(sed "s/.*/'&'/" <<<"$a_done" | paste -sd,)]::uuid[],
                                                ARRAY['succeeded', 'failed']) AS x (id, o)" >/dev/null
mapfile -t A_ACTIVE < <(as dr_a src "SELECT quota.start(l) FROM unnest(ARRAY['a active 1', NULL]) l")
b=$(as dr_b src "SELECT quota.start('b ' || i) FROM generate_series(1, 2) i")
as dr_b src "SELECT quota.finish('$(head -n1 <<<"$b")', 'cancelled')" >/dev/null
as dr_c src "SELECT quota.finish(quota.start('c ' || i)) FROM generate_series(1, 3) i" >/dev/null
sql -d src -c "SELECT quota.start(E'su \\u00e9 \\t ''quoted''')" >/dev/null
expect_eq "the source holds the tickets" "dr_a|2|4 dr_b|1|2 dr_c|0|3 postgres|1|1" \
  "$(sql -d src -c "SELECT role::regrole || '|' || count(*) FILTER (WHERE ended_at IS NULL) || '|' || count(*)
                     FROM quota.ledger GROUP BY role ORDER BY 1" | paste -sd' ')"
expect_eq "dr_a is at its limit in the source" 53400 "$(state dr_a src "SELECT quota.start('over')")"
expect_eq "dr_c is at its retained limit in the source" 53400 "$(state dr_c src "SELECT quota.start('over')")"

as_pg timeout 60 "$PG_BIN/pg_dump" -h "$CL" -p "$PORT" -U postgres -Fc -d src -f "$CL/src.dump"
sql -c "CREATE DATABASE dst"
restore_out=$(as_pg timeout 60 "$PG_BIN/pg_restore" -h "$CL" -p "$PORT" -U postgres -d dst --exit-on-error "$CL/src.dump" 2>&1) \
  && restored=0 || restored=$?
check "pg_restore into a new database succeeds${restore_out:+: $(head -c 300 <<<"$restore_out")}" test "$restored" = 0

expect_eq "quota.ledger is restored row for row" "$(ledger_of src)" "$(ledger_of dst)"
check "the source's summary has rows to dump" test -n "$(summary_of src)"
expect_eq "the dumped summary rows are not taken over: the restored ledger is counted afresh" "" "$(summary_of dst)"
check "the restored ledger is not empty" test -n "$(ledger_of dst)"
check "the restored summary equals the restored ledger" summary_matches_ledger dst
expect_eq "the restored extension is pg_quota in schema quota" "pg_quota|quota" \
  "$(sql -d dst -c "SELECT e.extname || '|' || n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace WHERE extname = 'pg_quota'")"
expect_eq "the tenant still has no privilege on the restored ledger" 42501 \
  "$(state dr_a dst "SELECT count(*) FROM quota.ledger")"

expect_eq "dr_a is still at its limit in the restored database" 53400 "$(state dr_a dst "SELECT quota.start('over')")"
out=$(timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U dr_c -d dst -v VERBOSITY=verbose \
        -c "SELECT quota.start('over')" 2>&1 || true)
check "dr_c is still at its retained limit in the restored database (the summary counts)" \
  grep -q 'ERROR:  53400: role "dr_c" has 3 retained tickets' <<<"$out"
expect_eq "try_start() returns NULL there" t "$(as dr_a dst "SELECT quota.try_start('over') IS NULL")"
expect_eq "finish() works in the restored database" t "$(as dr_a dst "SELECT quota.finish('${A_ACTIVE[0]}')")"
expect_eq "a ticket that ended before the dump stays ended (finish returns false)" f \
  "$(as dr_a dst "SELECT quota.finish('$(head -n1 <<<"$a_done")')")"
expect_eq "the freed slot admits one start in the restored database" t \
  "$(as dr_a dst "SELECT quota.start('after restore') IS NOT NULL")"
expect_eq "... and the next is refused" 53400 "$(state dr_a dst "SELECT quota.start('over again')")"
expect_eq "the restored database counts dr_a's new ticket" "dr_a|2|5" \
  "$(sql -d dst -c "SELECT role::regrole || '|' || count(*) FILTER (WHERE ended_at IS NULL) || '|' || count(*)
                     FROM quota.ledger WHERE role = 'dr_a'::regrole GROUP BY role")"
check "the restored summary equals its ledger after new starts" summary_matches_ledger dst
expect_eq "dr_b's tickets can be finished in the restored database" t \
  "$(as dr_b dst "SELECT quota.finish('$(tail -n1 <<<"$b")', 'failed')")"
# The source is untouched by what happened in the copy.
expect_eq "the finish in the copy does not touch the source" t \
  "$(sql -d src -c "SELECT ended_at IS NULL FROM quota.ledger WHERE id = '${A_ACTIVE[0]}'")"
expect_eq "dr_a is still at its limit in the source" 53400 "$(state dr_a src "SELECT quota.start('over')")"
check "the source summary equals its ledger" summary_matches_ledger src
finish_checks
