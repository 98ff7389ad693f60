#!/usr/bin/env bash
# After quota.summary is emptied (TRUNCATE, which the ledger's triggers also do after
# any SQL-level write to the ledger), a role at its limit gets its summary row back from
# the writer, so that its scope counter comes back (0.4.1). 0.4.0 asked the writer for
# that only for roles with more than 100 ledger rows: a smaller role at its limit, never
# admitted again, stayed without a counter until the writer restarted, and each of its
# calls took the counters' lock exclusively for a rebuild that built nothing.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5764 + PORT_OFFSET))}"
with_cluster summary_truncate "quota.writer_idle_timeout = '1h'"
sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE st LOGIN" \
    -c "ALTER ROLE st SET quota.max_active_per_role = 2" \
    -c "ALTER ROLE st SET quota.max_retained_per_role = 0" >/dev/null
expect_eq "the role takes its two tickets" 2 "$(as st postgres "SELECT count(quota.start()) FROM generate_series(1, 2)")"
expect_eq "it has its summary row" 2 "$(sql -c "SELECT tickets FROM quota.summary WHERE role = 'st'::regrole")"
writer=$(sql -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer'")
sql -c "TRUNCATE quota.summary" >/dev/null
expect_eq "after TRUNCATE quota.summary, the role at its limit is refused (53400)" 53400 \
  "$(state st postgres "SELECT quota.start()")"
back=0
for _ in $(seq 1 50); do
  [ "$(sql -c "SELECT tickets FROM quota.summary WHERE role = 'st'::regrole")" = 2 ] && { back=1; break; }
  sleep 0.1
done
expect_eq "... and the writer gives it its summary row back" 1 "$back"
expect_eq "... the same writer, still running" "$writer" \
  "$(sql -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer'")"
expect_eq "the role is still refused at its limit" 53400 "$(state st postgres "SELECT quota.start()")"
finish_checks
