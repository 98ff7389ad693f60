#!/usr/bin/env bash
# 0.6.0's and 0.6.1's quota.active side by side: one server, the installed library (run
# `scripts/bench --jobs` or `cargo pgrx install --release` first), database a created at
# 0.6.0 (the frozen install script from tests/upgrade), database b at the current
# version. Each holds BACKLOG leased tickets of one role; rounds interleave
#   renew   8 clients renewing random tickets of the backlog (quota.renew())
#   jobt    8 clients, each transaction a transactional start and its finish
# and print jobs/s and WAL bytes per transaction, then quota.active's updates, HOT
# updates, heap and index bytes. Run as root. Results on stdout (BENCHMARKS.md, "0.6.1").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
BACKLOG=${BACKLOG:-2000} CLIENTS=${CLIENTS:-8} SECS=${SECS:-10} ROUNDS=${ROUNDS:-3}
W="$(mktemp -d /tmp/pg_quota_layouts.XXXXXX)"; chmod 755 "$W"; chown postgres "$W"
D=$W/data P=${PORT:-5799}
R() { runuser -u postgres -- "$@"; }
EXTDIR="$("$BIN/pg_config" --sharedir)/extension"
[ -e "$EXTDIR/pg_quota--0.6.0.sql" ] || cp "$ROOT/tests/upgrade/pg_quota--0.6.0.sql" "$EXTDIR/"
R "$BIN/initdb" -D "$D" -A trust >/dev/null
cat >> "$D/postgresql.conf" <<C
port = $P
unix_socket_directories = '$W'
listen_addresses = ''
shared_preload_libraries = 'pg_quota'
shared_buffers = 512MB
C
R "$BIN/pg_ctl" -D "$D" -l "$W/log" -w start >/dev/null
trap 'runuser -u postgres -- "$BIN/pg_ctl" -D "$D" -m fast -w stop >/dev/null 2>&1 || true; rm -rf "$W"' EXIT
q() { R "$BIN/psql" -X -q -At -h "$W" -p "$P" "$@"; }
q -c "CREATE ROLE r1 LOGIN" -c "ALTER ROLE r1 SET quota.max_active_per_role = 1000000" \
  -c "ALTER ROLE r1 SET quota.max_retained_per_role = 0" -c "ALTER ROLE r1 SET quota.allow_transactional = on"
q -c "CREATE DATABASE a" -c "CREATE DATABASE b"
q -d a -c "CREATE EXTENSION pg_quota VERSION '0.6.0'"
q -d b -c "CREATE EXTENSION pg_quota"
for db in a b; do
  echo "# $db: pg_quota $(q -d "$db" -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_quota'")"
  q -d "$db" -c "GRANT ALL ON SCHEMA public TO r1"
  R "$BIN/psql" -X -q -At -h "$W" -p "$P" -U r1 -d "$db" -c "CREATE TABLE tix (c int PRIMARY KEY, t uuid)" \
    -c "INSERT INTO tix SELECT g, quota.start('t', lease => '1 hour') FROM generate_series(1, $BACKLOG) g"
  q -d "$db" -c "VACUUM ANALYZE"
done
printf '%s\n' '\set c random(1, :n)' "SELECT quota.renew((SELECT t FROM tix WHERE c = :c), '1 hour');" > "$W/renew.sql"
printf '%s\n' 'BEGIN;' "SELECT quota.finish(quota.start('job', transactional => true));" 'COMMIT;' > "$W/jobt.sql"
chown postgres "$W"/*.sql
run() {  # DB WORKLOAD: one pgbench run; prints jobs/s and WAL bytes per transaction
  local db=$1 w=$2 l0 l1 out tx tps
  l0=$(q -d "$db" -c "SELECT pg_current_wal_lsn()")
  out=$(R "$BIN/pgbench" -n -h "$W" -p "$P" -U r1 -d "$db" -c "$CLIENTS" -j 2 -T "$SECS" -D n="$BACKLOG" -f "$W/$w.sql" 2>&1)
  l1=$(q -d "$db" -c "SELECT pg_current_wal_lsn()")
  tx=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' <<<"$out")
  tps=$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' <<<"$out" | head -n1)
  echo "$db $w tps=$tps wal_per_tx=$(q -c "SELECT round(('$l1'::pg_lsn - '$l0'::pg_lsn) / greatest(${tx:-0}, 1))")"
}
for round in $(seq "$ROUNDS"); do
  for w in renew jobt; do
    for db in a b; do run "$db" "$w"; done
  done
done
for db in a b; do
  q -d "$db" -c "SELECT '$db quota.active: updates ' || n_tup_upd || ', HOT ' || n_tup_hot_upd || ', heap '
                        || pg_relation_size(relid) || ' B, indexes ' || pg_indexes_size(relid) || ' B'
                   FROM pg_stat_all_tables WHERE relid = 'quota.active'::regclass"
done
