#!/usr/bin/env bash
# I3 under SERIALIZABLE: pg_quota's own reads and writes raise no serialization failure.
# Sessions of one role each run start() then finish() in one SERIALIZABLE transaction,
# over and over: none of them may fail with 40001, and no ticket may be left behind.
# (On 0.1.0 about 1 in 6 failed with 40001; each failure left an orphan ticket, and
# once the orphans reached the limit the role was refused for good.)
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5602 + PORT_OFFSET))}"
with_cluster serializable

CLIENTS="${SER_CLIENTS:-4}"
TX="${SER_TX:-300}"
LIMIT=50

sql <<SQL
CREATE EXTENSION pg_quota;
CREATE ROLE ser_plain LOGIN;
CREATE ROLE ser_reads LOGIN;
ALTER ROLE ser_plain SET quota.max_active_per_role = $LIMIT;
ALTER ROLE ser_reads SET quota.max_active_per_role = $LIMIT;
-- A table of the application's own, read in the same SERIALIZABLE transaction, so that
-- SSI stays in force for the caller's own statements.
CREATE TABLE jobs (id serial PRIMARY KEY, ticket uuid);
GRANT SELECT, INSERT ON jobs TO ser_reads;
GRANT USAGE ON SEQUENCE jobs_id_seq TO ser_reads;
SQL

cat > "$CL/plain.sql" <<'PGB'
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT quota.start('ser') AS t \gset
SELECT quota.finish(':t');
COMMIT;
PGB
cat > "$CL/reads.sql" <<'PGB'
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT count(*) FROM jobs;
SELECT quota.start('ser reads') AS t \gset
SELECT quota.finish(':t');
COMMIT;
PGB
chmod 644 "$CL"/*.sql

run() {  # run ROLE SCRIPT
  local role="$1" script="$2" rc=0 log="$CL/pgbench-$1.log"
  timeout 80 "$PG_BIN/pgbench" -n -h "$CL" -p "$PORT" -U "$role" -c "$CLIENTS" -j 2 -t "$TX" \
    --failures-detailed -f "$CL/$script" postgres > "$log" 2>&1 || rc=$?
  local processed failed serialization
  processed=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$log")
  failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$log")
  serialization=$(sed -n 's/^number of serialization failures: \([0-9]*\).*/\1/p' "$log")
  check "$role: pgbench ran to the end (exit $rc)" test "$rc" = 0
  [ "$rc" = 0 ] || grep -m3 -i -e error -e abort "$log" | sed 's/^/# /'
  expect_eq "$role: no transaction failed (serialization failures: ${serialization:-?})" 0 "${failed:-missing}"
  expect_eq "$role: every transaction was processed" "$((CLIENTS * TX))" "${processed:-missing}"
  expect_eq "$role: no ticket is left active" 0 \
    "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = '$role'::regrole AND ended_at IS NULL")"
  expect_eq "$role: every admitted ticket was finished" "$((CLIENTS * TX))" \
    "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = '$role'::regrole AND ended_at IS NOT NULL")"
  expect_eq "$role: one more start() is admitted" t \
    "$("$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U "$role" -d postgres \
         -c "SELECT quota.start('one more') IS NOT NULL" 2>&1)"
}

run ser_plain plain.sql
run ser_reads reads.sql
finish_checks
