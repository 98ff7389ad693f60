#!/usr/bin/env bash
# On a hot standby (pg_basebackup -R), start() and try_start() raise 25006 and
# quota.usage reads the same as on the primary.
source "$(dirname "$0")/../../scripts/lib.sh"
with_cluster primary "wal_level = replica" "max_wal_senders = 4"
PRIMARY="$CL"; PRIMARY_PORT="$PORT"

sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE standby_tenant"
sql -c "SET quota.max_active_per_role = 0" -c "SET ROLE standby_tenant" \
    -c "SELECT quota.start('on primary ' || i) FROM generate_series(1, 3) i" >/dev/null
sql -c "SELECT quota.finish(id) FROM quota.ledger WHERE label = 'on primary 1'" >/dev/null

STANDBY="$(dirname "$PRIMARY")/standby"; mkdir -p "$STANDBY"; chown "$PG_USER" "$STANDBY"
CLUSTERS+=("$STANDBY")
as_pg "$PG_BIN/pg_basebackup" -h "$PRIMARY" -p "$PRIMARY_PORT" -U postgres -D "$STANDBY/data" -R -X stream -c fast
sed -i "s/^port = .*/port = $((PORT + 1))/; s|^unix_socket_directories = .*|unix_socket_directories = '$STANDBY'|" \
  "$STANDBY/data/postgresql.conf"
as_pg "$PG_BIN/pg_ctl" -D "$STANDBY/data" -l "$STANDBY/server.log" -w -t 60 start >/dev/null
on_standby() { pgq "$STANDBY" $((PORT + 1)) -At "$@"; }

expect_eq "the standby is in recovery" t "$(on_standby -c "SELECT pg_is_in_recovery()")"
# Wait until the standby has replayed everything the primary has.
lsn=$(sql -c "SELECT pg_current_wal_lsn()")
for _ in $(seq 1 100); do
  [ "$(on_standby -c "SELECT pg_last_wal_replay_lsn() >= '$lsn'")" = t ] && break; sleep 0.1
done

# verbose_error SQL: the error a tenant gets on the standby, with its SQLSTATE.
verbose_error() {
  on_standby -v VERBOSITY=verbose -v ON_ERROR_STOP=0 -c "SET ROLE standby_tenant" -c "$1" 2>&1 || true
}
out=$(verbose_error "SELECT quota.start()")
check "start() raises 25006 on a standby" grep -q "ERROR:  25006: cannot execute quota.start() during recovery" <<<"$out"
out=$(verbose_error "SELECT quota.try_start()")
check "try_start() raises 25006 on a standby" grep -q "ERROR:  25006: cannot execute quota.try_start() during recovery" <<<"$out"
out=$(verbose_error "SELECT quota.finish('00000000-0000-0000-0000-000000000000')")
check "finish() raises 25006 on a standby" grep -q "ERROR:  25006: cannot execute quota.finish() during recovery" <<<"$out"
q="SELECT role, active, retained FROM quota.usage ORDER BY role::text"
expect_eq "quota.usage on the standby matches the primary" "$(sql -c "$q")" "$(on_standby -c "$q")"
expect_eq "quota.usage shows the tenant's numbers" "standby_tenant|2|3" \
  "$(on_standby -c "$q" | grep standby_tenant)"
finish_checks
