#!/usr/bin/env bash
# The ledger writer keeps every ticket that a session running with the server's
# quota.retention counts, whatever the writer's own session was given (0.5.1). The
# writer connects as the bootstrap superuser, so `ALTER ROLE postgres SET
# quota.retention` sets its own value; 0.5.0's fold pass purged the history of roles
# with transactional tickets at that value alone, and a role at its retained limit
# (the server's 1 h window) was admitted again once the writer had purged its
# tickets: I1 broken for quota.max_retained_per_role.
#
# Role app (max_retained_per_role 3, the server's retention of 1 h) finishes 3
# transactional tickets; postgres, the writer's role, has quota.retention = 1 s. After
# several fold passes (1 s each): app's 3 tickets are still in the ledger and app is
# refused (retained 3 of 3). Fails on 0.5.0's writer (seen: the tickets were purged and
# app admitted).
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5774 + PORT_OFFSET))}"
with_cluster retention_floor "quota.writer_idle_timeout = '1h'" "quota.retention = '1h'"
sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE app LOGIN" \
    -c "ALTER ROLE app SET quota.max_retained_per_role = 3" \
    -c "ALTER ROLE app SET quota.allow_transactional = on" \
    -c "ALTER ROLE postgres SET quota.retention = '1s'" >/dev/null
expect_eq "the writer's role (the bootstrap superuser) is postgres" postgres \
  "$(sql -c "SELECT rolname FROM pg_roles WHERE oid = 10")"
for i in 1 2 3; do
  echo "BEGIN; SELECT quota.finish(quota.start('t$i', transactional => true)); COMMIT;"
done > "$CL/three.sql"
chmod 644 "$CL/three.sql"
psql_as app -f "$CL/three.sql" >/dev/null
expect_eq "app finished 3 transactional tickets" 3 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'app'::regrole AND outcome = 'succeeded'")"
# A writer-committed start of another role starts the writer, with its own settings
# (quota.retention = 1 s); its fold pass runs every second.
sql -c "CREATE ROLE other" >/dev/null
sql -c "SET ROLE other" -c "SELECT quota.finish(quota.start())" >/dev/null
expect_eq "a writer runs (as postgres, whose quota.retention is 1 s)" 1 \
  "$(sql -c "SELECT count(*) FROM quota.writer_stats WHERE datname = 'postgres' AND pid IS NOT NULL")"
sleep 4
expect_eq "after 4 s of fold passes, app's 3 finished tickets (1 h retention) are still in the ledger" 3 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'app'::regrole")"
expect_eq "app, at 3 retained of 3, is refused" t \
  "$(as app postgres "SELECT quota.try_start() IS NULL")"
finish_checks
