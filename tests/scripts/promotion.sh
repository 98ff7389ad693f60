#!/usr/bin/env bash
# Failover to a synchronous standby under load (design.md "Beyond one machine"; issue 19).
#
# A primary and one hot standby (pg_basebackup -R), the standby synchronous
# (synchronous_standby_names = '*', synchronous_commit = on). Eight clients start and
# finish tickets of a role whose limit they hit all along (refusals happen, so
# exactness matters); each first keeps one ticket open. The clients connect with
# target_session_attrs=read-write to both servers, as an application behind a list of
# hosts would. Under load the primary dies as a machine would (kill -9 of the
# postmaster and of every process of it at once), and the standby is promoted with
# pg_ctl promote. On the new primary:
# - every ticket a client received, before the failover or after it, is in the ledger;
# - no acknowledged finish is active again;
# - quota.summary equals the ledger, and quota.usage counts what the ledger holds;
# - the limit is exact: exactly limit - active more are admitted, the next is refused
#   with 53400 (the scope counters are rebuilt from the ledger, never replayed);
# - the tickets kept open since before the failover can be finished (true), and so can
#   those whose finish() the failover cut off: a client finishes them again once it is
#   connected to the new primary, as an application retries (finish() is idempotent);
# - the clients went on by themselves: they received tickets from the new primary.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"

LIMIT=14      # 8 kept open, so the 8 clients share 6 slots: refusals all along
CLIENTS=8
with_cluster promo_primary "wal_level = replica" "max_wal_senders = 4" "wal_keep_size = '256MB'"
PRIMARY="$CL"; PRIMARY_PORT="$PORT"
STANDBY="$(dirname "$PRIMARY")/promo_standby"; STANDBY_PORT=$((PORT + 1))

sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE t1 LOGIN" \
    -c "ALTER ROLE t1 SET quota.max_active_per_role = $LIMIT" -c "ALTER ROLE t1 SET quota.max_retained_per_role = 0" >/dev/null

mkdir -p "$STANDBY"; chown "$PG_USER" "$STANDBY"; CLUSTERS+=("$STANDBY")
as_pg "$PG_BIN/pg_basebackup" -h "$PRIMARY" -p "$PRIMARY_PORT" -U postgres -D "$STANDBY/data" -R -X stream -c fast
sed -i "s/^port = .*/port = $STANDBY_PORT/; s|^unix_socket_directories = .*|unix_socket_directories = '$STANDBY'|" \
  "$STANDBY/data/postgresql.conf"
as_pg "$PG_BIN/pg_ctl" -D "$STANDBY/data" -l "$STANDBY/server.log" -w -t 60 start >/dev/null
on_standby() { pgq "$STANDBY" "$STANDBY_PORT" -At "$@"; }

# The standby becomes synchronous once it streams.
sql -c "ALTER SYSTEM SET synchronous_standby_names = '*'" -c "ALTER SYSTEM SET synchronous_commit = on" \
    -c "SELECT pg_reload_conf()" >/dev/null
timeout 30 bash -c "until [ \"\$('$PG_BIN/psql' -X -At -h '$PRIMARY' -p $PRIMARY_PORT -U postgres \
   -c \"SELECT sync_state FROM pg_stat_replication\")\" = sync ]; do sleep 0.1; done" || true
expect_eq "the standby streams synchronously" sync "$(sql -c "SELECT sync_state FROM pg_stat_replication")"
expect_eq "the standby is a hot standby" t "$(on_standby -c "SELECT pg_is_in_recovery()")"

# --- load: clients that follow the primary (failover_load in scripts/lib.sh) -------------
CONN="host=$PRIMARY,$STANDBY port=$PRIMARY_PORT,$STANDBY_PORT user=t1 dbname=postgres target_session_attrs=read-write connect_timeout=3"
# Bounded by themselves: 600 rounds (about 60 s) at most, or until the stop file appears.
failover_load "$PRIMARY" "$CONN" "$CLIENTS" 600
received() { cat "$PRIMARY"/out.* 2>/dev/null | grep -Ec '^S [0-9a-f-]{36}$' || true; }
wait_received() {  # wait_received N: until N tickets were received (60 s at most)
  local _
  for _ in $(seq 1 300); do [ "$(received)" -ge "$1" ] && return 0; sleep 0.2; done
  return 1
}
wait_received 500 || true
before_kill=$(received)
check "the load runs on the primary ($before_kill tickets received)" test "$before_kill" -ge 500
refused=$(cat "$PRIMARY"/out.* | grep -c '^S refused$' || true)
check "refusals happen under the load: the limit is reached ($refused refused)" test "$refused" -gt 0

# --- the primary dies: its postmaster and every process of it, at once ---------------------
PM=$(head -n1 "$PRIMARY/data/postmaster.pid")
t0=$(date +%s.%N)
# Stopped first, the postmaster forks nothing between the listing of its children and
# the kill: a backend forked in between would outlive the others, stuck for good on a
# lock that a killed process held (seen: orphans blocked in XLogFlush).
kill -STOP "$PM" 2>/dev/null || true
kill -9 $(pgrep -P "$PM") "$PM" 2>/dev/null || true
grep -Eho '^S [0-9a-f-]{36}$' "$PRIMARY"/out.* | cut -c3- | sort -u > "$PRIMARY/received_before"
as_pg "$PG_BIN/pg_ctl" -D "$STANDBY/data" -w -t 60 promote >/dev/null
t1=$(date +%s.%N)
expect_eq "the standby is promoted" f "$(on_standby -c "SELECT pg_is_in_recovery()")"
echo "# $(wc -l < "$PRIMARY/received_before") tickets received before the primary died; promoted $(awk "BEGIN { printf \"%.2f\", $t1 - $t0 }") s after the kill"

# The clients reconnect to the new primary by themselves.
n0=$(received)
wait_received $((n0 + 300)) || true
check "the clients go on against the new primary ($(( $(received) - n0 )) tickets received there)" \
  test "$(received)" -ge $((n0 + 300))
stop_clients "$PRIMARY"

# --- checks on the new primary -------------------------------------------------------------
CL="$STANDBY"; PORT="$STANDBY_PORT"
grep -Eho '^S [0-9a-f-]{36}$' "$PRIMARY"/out.* | cut -c3- | sort -u > "$PRIMARY/received"
grep -Eho '^F [0-9a-f-]{36} t$' "$PRIMARY"/out.* | cut -c3-38 | sort -u > "$PRIMARY/finished"
grep -Eho '^K [0-9a-f-]{36}$' "$PRIMARY"/out.* | cut -c3- | sort -u > "$PRIMARY/kept"
sql -c "SELECT id FROM quota.ledger" | sort > "$PRIMARY/in_ledger"
sql -c "SELECT id FROM quota.ledger WHERE ended_at IS NULL" | sort > "$PRIMARY/active"
missing_before=$(comm -23 "$PRIMARY/received_before" "$PRIMARY/in_ledger" | wc -l)
echo "# $(wc -l < "$PRIMARY/received") tickets received in all, $(wc -l < "$PRIMARY/finished") finishes acknowledged; missing on the new primary: $missing_before of those received before the failover, $(comm -23 "$PRIMARY/received" "$PRIMARY/in_ledger" | wc -l) in all"
expect_eq "every ticket received before the failover is in the new primary's ledger" 0 "$missing_before"
expect_eq "every ticket received at all is in the ledger" 0 "$(comm -23 "$PRIMARY/received" "$PRIMARY/in_ledger" | wc -l)"
expect_eq "no acknowledged finish is active again" 0 "$(comm -12 "$PRIMARY/finished" "$PRIMARY/active" | wc -l)"
expect_eq "each ticket whose finish() the failover cut off was finished on the new primary (no ticket lost)" 0 \
  "$(cat "$PRIMARY"/out.* | grep -c '^L ' || true)"
check "quota.summary equals the ledger" summary_matches_ledger
expect_eq "quota.usage counts what the ledger holds" \
  "$(sql -c "SELECT count(*) FILTER (WHERE ended_at IS NULL) || '|' || count(*) FROM quota.ledger WHERE role = 't1'::regrole")" \
  "$(sql -c "SELECT active || '|' || retained FROM quota.usage WHERE role = 't1'::regrole")"
active=$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 't1'::regrole AND ended_at IS NULL")
echo "# t1 holds $active active tickets of $LIMIT on the new primary"
expect_eq "the limit is exact: $LIMIT - $active more are admitted" $((LIMIT - active)) \
  "$(as t1 postgres "SELECT count(quota.try_start('fill')) FROM generate_series(1, $((LIMIT - active)) + 3)")"
expect_eq "... and the next start() is refused with 53400" 53400 "$(state t1 postgres "SELECT quota.start('over')")"
expect_eq "the ledger holds exactly the limit of active tickets" "$LIMIT" \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 't1'::regrole AND ended_at IS NULL")"
kept=$(wc -l < "$PRIMARY/kept")
expect_eq "all $CLIENTS clients kept a ticket open from before the failover" "$CLIENTS" \
  "$(comm -12 "$PRIMARY/kept" "$PRIMARY/received_before" | wc -l)"
ids=$(sed "s/.*/'&'/" "$PRIMARY/kept" | paste -sd,)
expect_eq "the tickets kept open since before the failover can be finished there" \
  "$(yes true | head -n "$kept" | paste -sd' ')" \
  "$(as t1 postgres "SELECT string_agg(quota.finish(id)::text, ' ') FROM unnest(ARRAY[$ids]::uuid[]) id")"
check "start() works on the new primary once slots are free" \
  test -n "$(as t1 postgres "SELECT quota.start('after failover')")"
check "quota.summary still equals the ledger" summary_matches_ledger
finish_checks
