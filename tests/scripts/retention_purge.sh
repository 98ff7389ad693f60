#!/usr/bin/env bash
# I1 for sessions with different quota.retention: the writer's purge of old tickets
# never deletes tickets that a session with a longer configured retention still
# counts. Role rp_tenant has quota.retention = 1h and a retained limit of 3 (ALTER ROLE).
# A superuser session that runs as rp_tenant with quota.retention = 1s is admitted (in
# its window the 3 ended tickets have aged out), and its admission makes the writer
# purge; the role's own sessions must still count the 3 ended tickets and refuse.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5685 + PORT_OFFSET))}"
with_cluster retention_purge

sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE rp_tenant LOGIN" \
    -c "ALTER ROLE rp_tenant SET quota.max_retained_per_role = 3" \
    -c "ALTER ROLE rp_tenant SET quota.max_active_per_role = 0" \
    -c "ALTER ROLE rp_tenant SET quota.retention = '1h'"
for i in 1 2 3; do
  psql_as rp_tenant -c "SELECT quota.finish(quota.start('ended $i'))" >/dev/null
done
expect_eq "with 3 ended tickets in its 1h window, rp_tenant is refused" 53400 \
  "$(state rp_tenant postgres "SELECT quota.start('over')")"
sleep 1.5
expect_eq "a session of rp_tenant with quota.retention = 1s is admitted" t \
  "$(as postgres postgres "SET quota.retention = '1s'" "SET quota.max_retained_per_role = 3" \
       "SET ROLE rp_tenant" "SELECT quota.start('short window') IS NOT NULL")"
expect_eq "the writer's purge kept the ended tickets that the 1h window counts" 3 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'rp_tenant'::regrole AND ended_at IS NOT NULL")"
expect_eq "rp_tenant's own sessions still count them and refuse" 53400 \
  "$(state rp_tenant postgres "SELECT quota.start('still over')")"
finish_checks
