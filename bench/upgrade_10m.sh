#!/usr/bin/env bash
# ALTER EXTENSION pg_quota UPDATE from 0.5.2 to the current version with a large
# history (issue 33: "give the update's time, disk and WAL at 10,000,000 retained
# tickets"). On a scratch cluster of the installed build (scripts/lib.sh): a 0.5.2
# database with N ended tickets (default 10,000,000) and A active ones (default 10,000)
# written by SQL into its ledger, vacuumed and checkpointed; then the update, timed,
# with the WAL it wrote and the database's size before and after.
#   bench/upgrade_10m.sh [N] [A]
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/lib.sh"
N="${1:-10000000}"; A="${2:-10000}"
PORT="${PORT:-5797}"
cp "$ROOT/tests/upgrade/pg_quota--0.5.2.sql" "$("$PG_CONFIG" --sharedir)/extension/pg_quota--0.5.2.sql"
SCRATCH="$(make_scratch)"
with_cluster upgrade10m
sql -c "CREATE ROLE u10m LOGIN" -c "CREATE DATABASE u10m"
sql -d u10m -c "CREATE EXTENSION pg_quota VERSION '0.5.2'"
started=$SECONDS
sql -d u10m -c "INSERT INTO quota.ledger (id, role, label, started_at, ended_at, outcome)
                SELECT gen_random_uuid(), 'u10m'::regrole, NULL, now() - interval '2 h', now() - interval '1 h', 'succeeded'
                  FROM generate_series(1, $N)" \
            -c "INSERT INTO quota.ledger (id, role, label, started_at, lease_until)
                SELECT gen_random_uuid(), 'u10m'::regrole, 'in flight', now(), now() + interval '1 day'
                  FROM generate_series(1, $A)" \
            -c "VACUUM ANALYZE quota.ledger" -c "CHECKPOINT" >/dev/null
echo "filled $N ended and $A active tickets in $((SECONDS - started)) s"
before_size=$(sql -d u10m -c "SELECT pg_database_size('u10m')")
lsn0=$(sql -d u10m -c "SELECT pg_current_wal_insert_lsn()")
t0=$(date +%s.%N)
sql -d u10m -c "ALTER EXTENSION pg_quota UPDATE"
t1=$(date +%s.%N)
lsn1=$(sql -d u10m -c "SELECT pg_current_wal_insert_lsn()")
after_size=$(sql -d u10m -c "SELECT pg_database_size('u10m')")
wal=$(sql -d u10m -c "SELECT pg_wal_lsn_diff('$lsn1', '$lsn0')")
echo "update: $(python3 -c "print(f'{$t1 - $t0:.2f}')") s, WAL $wal bytes, database $before_size -> $after_size bytes"
sql -d u10m -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_quota'" \
            -c "SELECT (SELECT count(*) FROM quota.active) || ' active, ' || (SELECT count(*) FROM quota.history) || ' in history'"
