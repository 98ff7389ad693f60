#!/usr/bin/env bash
# What pg_quota's hooks cost statements that never call it: one backend runs a PL/pgSQL
# loop of EXECUTE 'SELECT f($1)' (f a PL/pgSQL function, so each statement is parsed,
# planned, executed and looks f up through fmgr: the planner, executor-end and fmgr
# hooks all run), with pg_quota preloaded and created in the database, and without it
# preloaded, ROUNDS rounds alternating; then, where perf is installed, pg_quota.so's
# share of that backend's samples in the preloaded loop. Uses the installed library
# (`scripts/bench` or `cargo pgrx install --release` first). Run as root. Results on
# stdout (BENCHMARKS.md, "pg_quota's hooks on other statements").
set -euo pipefail
BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
N=${N:-100000} ROUNDS=${ROUNDS:-8} P=${PORT:-5797}
W="$(mktemp -d /tmp/pg_quota_hooks.XXXXXX)"
R() { runuser -u postgres -- "$@"; }
stop() { [ -d "$W/data" ] && R "$BIN/pg_ctl" -D "$W/data" -m fast -w stop >/dev/null 2>&1 || true; }
# On a failure, the server's log goes to stderr before the directory is removed.
trap 'rc=$?; stop; [ "$rc" = 0 ] || { [ -f "$W/log" ] && tail -20 "$W/log" >&2; }; rm -rf "$W"' EXIT
chmod 755 "$W"; chown postgres "$W"
R "$BIN/initdb" -D "$W/data" -A trust >/dev/null
printf "port = %s\nunix_socket_directories = '%s'\nlisten_addresses = ''\nautovacuum = off\n" "$P" "$W" \
  >> "$W/data/postgresql.conf"
q() { R "$BIN/psql" -X -At -q -h "$W" -p "$P" -d postgres "$@"; }
start() { R "$BIN/pg_ctl" -D "$W/data" -l "$W/log" -w -o "-c shared_preload_libraries=$1" start >/dev/null; }
start pg_quota
q -c "CREATE EXTENSION pg_quota" -c "CREATE FUNCTION f(int) RETURNS int LANGUAGE plpgsql AS 'BEGIN RETURN \$1; END'"
stop
loop() {  # N statements; prints microseconds per statement
  q -c "DO \$\$ DECLARE x int; t0 timestamptz := clock_timestamp(); BEGIN
          FOR i IN 1..$1 LOOP EXECUTE 'SELECT f(\$1)' INTO x USING i; END LOOP;
          RAISE NOTICE 'us=%', round(extract(epoch FROM clock_timestamp() - t0) * 1e6 / $1, 3); END \$\$" 2>&1 |
    sed -n 's/.*us=//p'
}
for r in $(seq "$ROUNDS"); do
  # Which goes first turns with the round.
  if [ $((r % 2)) = 1 ]; then libs=(pg_quota "''"); else libs=("''" pg_quota); fi
  for lib in "${libs[@]}"; do
    start "$lib"
    loop "$N" >/dev/null  # warm-up
    echo "round $r preloaded=$([ "$lib" = pg_quota ] && echo yes || echo no) us_per_statement=$(loop "$N")"
    stop
  done
done
# perf of the preloaded loop's backend: best effort (perf may be missing, or not allowed
# here), never the end of the run.
if command -v perf >/dev/null; then
  start pg_quota
  (loop $((N * 1000)) >/dev/null 2>&1 &)  # long enough; cancelled once perf is done
  pid=""
  for _ in $(seq 100); do
    pid=$(q -c "SELECT pid FROM pg_stat_activity WHERE query LIKE 'DO%' AND pid <> pg_backend_pid() LIMIT 1")
    [ -n "$pid" ] && break
    sleep 0.1
  done
  if [ -z "$pid" ]; then
    echo "perf: the loop's backend was not found"
  elif ! perf record -q -F 4000 -g -p "$pid" -o "$W/perf.data" -- sleep 3 >"$W/perf.log" 2>&1; then
    echo "perf: perf record failed: $(tail -1 "$W/perf.log")"
  else
    echo "perf, the preloaded loop's backend, samples by object:"
    perf report -i "$W/perf.data" --no-children --sort dso --stdio 2>/dev/null | { grep -E '^ +[0-9.]+%' || true; } | head -6
    echo "pg_quota.so by function:"
    perf report -i "$W/perf.data" --no-children --dsos pg_quota.so --sort sym --stdio 2>/dev/null |
      { grep -E '^ +[0-9.]+%' || true; } | head -12
  fi
  [ -n "$pid" ] && q -c "SELECT pg_cancel_backend($pid)" >/dev/null
fi
