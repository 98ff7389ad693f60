#!/usr/bin/env bash
# Without shared_preload_libraries, CREATE EXTENSION and every call fail with a clear
# error (55000) whose hint says how to fix it.
source "$(dirname "$0")/../../scripts/lib.sh"
with_cluster preload

sql -c "CREATE EXTENSION pg_quota"
sql -c "SELECT quota.start('while preloaded')" >/dev/null

# Restart without the preload.
stop_cluster "$CL"
sed -i "s/^shared_preload_libraries = 'pg_quota'/shared_preload_libraries = ''/" "$CL/data/postgresql.conf"
as_pg "$PG_BIN/pg_ctl" -D "$CL/data" -l "$CL/server.log" -w -t 60 start >/dev/null

err() { pgq "$CL" "$PORT" -At -v VERBOSITY=verbose -v ON_ERROR_STOP=0 "$@" 2>&1 || true; }
out=$(err -c "SELECT quota.start()")
check "a call fails with 55000 without the preload" grep -q "55000" <<<"$out"
check "the message says the library must be preloaded" \
  grep -q "pg_quota must be loaded via shared_preload_libraries" <<<"$out"
check "the hint says how to fix it" \
  grep -q "HINT:  Add pg_quota to shared_preload_libraries in postgresql.conf and restart the server." <<<"$out"
out=$(err -c "SELECT quota.finish('00000000-0000-0000-0000-000000000000')")
check "finish() fails the same way" grep -q "55000" <<<"$out"
# The views fail the same way (0.3.1: quota.usage read current_setting('quota.retention')
# and said 42704 "unrecognized configuration parameter" instead).
for v in quota.usage quota.stats quota.stats_info; do
  out=$(err -c "SELECT * FROM $v")
  check "SELECT * FROM $v fails with 55000 and the hint" \
    grep -q "HINT:  Add pg_quota to shared_preload_libraries" <<<"$(grep -A3 "ERROR:  55000: pg_quota must be loaded via shared_preload_libraries" <<<"$out")"
done

sql -c "CREATE DATABASE fresh"
out=$(err -d fresh -c "CREATE EXTENSION pg_quota")
check "CREATE EXTENSION fails with 55000 without the preload" grep -q "55000" <<<"$out"
check "CREATE EXTENSION's hint says how to fix it" grep -q "HINT:  Add pg_quota to shared_preload_libraries" <<<"$out"
expect_eq "nothing was created" 0 "$(pgq "$CL" "$PORT" -d fresh -At -c "SELECT count(*) FROM pg_extension WHERE extname = 'pg_quota'")"
finish_checks
