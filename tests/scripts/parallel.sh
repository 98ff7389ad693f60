#!/usr/bin/env bash
# pg_quota's functions refuse to run during a parallel operation, as nextval() does
# (quota.usage_totals() too, 0.5.1):
# SQLSTATE 25000, "cannot execute quota.start() during a parallel operation". They are
# declared PARALLEL UNSAFE, but a user's own wrapper marked PARALLEL SAFE still brings
# them into parallel workers; there they must neither charge nor end a ticket, for a
# tenant or for a superuser, and must not fail with an internal error (XX000).
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5623 + PORT_OFFSET))}"
with_cluster parallel

sql <<'SQL'
CREATE EXTENSION pg_quota;
CREATE ROLE pq_tenant LOGIN;
CREATE TABLE pq_rows AS SELECT g AS id FROM generate_series(1, 50000) g;
ANALYZE pq_rows;
GRANT SELECT ON pq_rows TO pq_tenant;
CREATE FUNCTION pq_start() RETURNS uuid LANGUAGE plpgsql PARALLEL SAFE
  AS $$ BEGIN RETURN quota.start('from a parallel worker'); END $$;
CREATE FUNCTION pq_try_start() RETURNS uuid LANGUAGE plpgsql PARALLEL SAFE
  AS $$ BEGIN RETURN quota.try_start('from a parallel worker'); END $$;
CREATE FUNCTION pq_finish(t uuid) RETURNS boolean LANGUAGE plpgsql PARALLEL SAFE
  AS $$ BEGIN RETURN quota.finish(t, 'failed'); END $$;
CREATE FUNCTION pq_totals() RETURNS bigint LANGUAGE plpgsql PARALLEL SAFE
  AS $$ BEGIN RETURN (SELECT ledger_rows FROM quota.usage_totals()); END $$;
SQL

# Every session below plans for parallel workers, with the leader only gathering.
# force_parallel_mode was renamed debug_parallel_query in PostgreSQL 16.
FORCE_PARALLEL=$(sql -c "SELECT name FROM pg_settings WHERE name IN ('debug_parallel_query', 'force_parallel_mode')")
PAR=(
  "SET $FORCE_PARALLEL = on"
  "SET parallel_setup_cost = 0"
  "SET parallel_tuple_cost = 0"
  "SET min_parallel_table_scan_size = 0"
  "SET parallel_leader_participation = off"
  "SET max_parallel_workers_per_gather = 2"
)
# run USER SQL: one parallel-minded session, verbose errors; prints output and errors
# and a last line SQLSTATE=...
run() {
  local user="$1" q="$2" a=() s
  for s in "${PAR[@]}"; do a+=(-c "$s"); done
  timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U "$user" -d postgres -v ON_ERROR_STOP=0 \
    -v VERBOSITY=verbose "${a[@]}" -c "$q" -c '\echo SQLSTATE=:SQLSTATE' 2>&1 || true
}
rows() { sql -c "SELECT count(*) || '|' || count(*) FILTER (WHERE ended_at IS NULL) FROM quota.ledger"; }
# refused_in_worker USER FUNC QUERY: the query fails with 25000 and the message of FUNC.
refused_in_worker() {
  local user="$1" fn="$2" q="$3" out before
  before=$(rows)
  out=$(run "$user" "$q")
  expect_eq "$user: $fn in a parallel worker fails with 25000" SQLSTATE=25000 "$(grep '^SQLSTATE=' <<<"$out" | tail -n1)"
  check "$user: ... with 'cannot execute $fn during a parallel operation'$(grep -m1 'ERROR' <<<"$out" | sed 's/^/ (got: /; s/$/)/')" \
    grep -qF "ERROR:  25000: cannot execute $fn during a parallel operation" <<<"$out"
  expect_eq "$user: ... and the ledger is unchanged (rows|active)" "$before" "$(rows)"
}

# The wrapper really runs under a Gather, in the workers.
plan=$(run postgres "EXPLAIN (VERBOSE, COSTS OFF) SELECT pq_start() FROM pq_rows WHERE id = 1")
check "the wrapper is planned below a Gather" grep -q "Gather" <<<"$plan"
check "... and evaluated in the parallel scan" grep -q "Parallel Seq Scan" <<<"$plan"

TENANT_T=$(sql -c "SET ROLE pq_tenant" -c "SELECT quota.start('to finish')")
SU_T=$(sql -c "SELECT quota.start('to finish')")
for user in pq_tenant postgres; do
  refused_in_worker "$user" "quota.start()" "SELECT pq_start() FROM pq_rows WHERE id = 1"
  refused_in_worker "$user" "quota.try_start()" "SELECT pq_try_start() FROM pq_rows WHERE id = 1"
  if [ "$user" = postgres ]; then t="$SU_T"; else t="$TENANT_T"; fi
  refused_in_worker "$user" "quota.finish()" "SELECT pq_finish('$t') FROM pq_rows WHERE id = 1"
  expect_eq "$user: the ticket given to finish() in a worker is still active" 1 \
    "$(sql -c "SELECT count(*) FROM quota.ledger WHERE id = '$t' AND ended_at IS NULL")"
done

# quota.usage_totals() (0.5.1) reads the latest committed state, which a worker cannot
# take: in a worker it refuses with 25000 too (not XX000, "cannot update
# SecondarySnapshot during a parallel operation"); called directly in a session that
# plans for workers, it is PARALLEL UNSAFE, so the query runs without them and answers.
refused_in_worker postgres "quota.usage_totals()" "SELECT pq_totals() FROM pq_rows WHERE id = 1"
expect_eq "usage_totals() called directly in a parallel-minded session answers (its query gets no workers)" \
  "$(sql -c "SELECT count(*) FROM quota.ledger")" \
  "$(run postgres "SELECT ledger_rows FROM quota.usage_totals()" | grep -v '^SQLSTATE')"

# Outside parallel mode the same wrappers work.
expect_eq "the tenant's wrapper works in a plain query" "t|t" \
  "$(sql -c "SET ROLE pq_tenant" -c "SELECT pq_start() IS NOT NULL, pq_finish('$TENANT_T')" | tr -d ' ')"
check "no server process was terminated by a signal" test "$(grep -c 'terminated by signal' "$CL/server.log" || true)" = 0
finish_checks
