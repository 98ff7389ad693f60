#!/usr/bin/env bash
# I1 for sessions with different quota.retention: the writer's purge of old tickets
# never deletes tickets that a session with a longer configured retention still
# counts. The server's own quota.retention is 1s here, so the writer would purge after
# 1 s unless a value configured in pg_db_role_setting says otherwise. For each way to
# configure 1h for a role (ALTER ROLE … SET, ALTER ROLE … IN DATABASE … SET, ALTER
# DATABASE … SET, ALTER ROLE ALL … SET), a role with a retained limit of 3 ends 3
# tickets; a superuser session that runs as that role with quota.retention = 1s is
# admitted (in its window the 3 have aged out), and its admission makes the writer
# purge; the 3 must be kept, and the role's own sessions must still refuse.
# (The writer reads these settings by index probe since 0.4.0; a full scan before.)
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5685 + PORT_OFFSET))}"
# One writer serves the whole test (it does not leave when idle within it): a writer
# takes ALTER DATABASE and ALTER ROLE ALL settings as its own when it starts, so one
# that started while those say 1h would keep the tickets even if it ignored them.
with_cluster retention_purge "quota.retention = '1s'" "quota.writer_idle_timeout = 300"
writer_pid() {
  sql -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer' AND datname = 'postgres'"
}

sql -c "CREATE EXTENSION pg_quota" -c "SELECT quota.finish(quota.start('first writer'))" >/dev/null
WRITER=$(writer_pid)
check "a writer runs (pid ${WRITER:-none}) with the server's quota.retention = 1s" test -n "$WRITER"
case_of() {  # case_of ROLE HOW SET-SQL RESET-SQL
  local role="$1" how="$2"
  sql -c "CREATE ROLE $role LOGIN" \
      -c "ALTER ROLE $role SET quota.max_retained_per_role = 3" \
      -c "ALTER ROLE $role SET quota.max_active_per_role = 0" -c "$3" >/dev/null
  for i in 1 2 3; do
    psql_as "$role" -c "SELECT quota.finish(quota.start('ended $i'))" >/dev/null
  done
  expect_eq "$how: with 3 ended tickets in its 1h window, $role is refused" 53400 \
    "$(state "$role" postgres "SELECT quota.start('over')")"
  sleep 1.5
  expect_eq "$how: a session of $role with quota.retention = 1s is admitted" t \
    "$(as postgres postgres "SET quota.retention = '1s'" "SET quota.max_retained_per_role = 3" \
         "SET ROLE $role" "SELECT quota.start('short window') IS NOT NULL")"
  expect_eq "$how: the writer's purge kept the ended tickets that the 1h window counts" 3 \
    "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = '$role'::regrole AND ended_at IS NOT NULL")"
  expect_eq "$how: $role's own sessions still count them and refuse" 53400 \
    "$(state "$role" postgres "SELECT quota.start('still over')")"
  expect_eq "$how: the same writer served it" "$WRITER" "$(writer_pid)"
  sql -c "$4" >/dev/null
}
case_of rp_role "ALTER ROLE SET" "ALTER ROLE rp_role SET quota.retention = '1h'" "SELECT 1"
case_of rp_role_db "ALTER ROLE IN DATABASE SET" \
  "ALTER ROLE rp_role_db IN DATABASE postgres SET quota.retention = '1h'" "SELECT 1"
case_of rp_db "ALTER DATABASE SET" "ALTER DATABASE postgres SET quota.retention = '1h'" \
  "ALTER DATABASE postgres RESET quota.retention"
case_of rp_all "ALTER ROLE ALL SET" "ALTER ROLE ALL SET quota.retention = '1h'" \
  "ALTER ROLE ALL RESET quota.retention"

# And without any of them, the writer purges: the check above can fail.
sql -c "CREATE ROLE rp_none LOGIN" -c "ALTER ROLE rp_none SET quota.max_retained_per_role = 3" \
    -c "ALTER ROLE rp_none SET quota.max_active_per_role = 0" >/dev/null
for i in 1 2 3; do psql_as rp_none -c "SELECT quota.finish(quota.start('ended $i'))" >/dev/null; done
sleep 1.5
as postgres postgres "SET quota.retention = '1s'" "SET ROLE rp_none" "SELECT quota.start('purge')" >/dev/null
expect_eq "with nothing configured, the writer purged rp_none's ended tickets past 1s" 0 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'rp_none'::regrole AND ended_at IS NOT NULL")"
expect_eq "... the same writer" "$WRITER" "$(writer_pid)"
finish_checks
