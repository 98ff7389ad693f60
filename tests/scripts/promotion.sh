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
# - nothing the failover cut off stays charged: a start() that got no answer is asked
#   again with its idempotency key on the new primary (the ticket, if its charge
#   survived) and finished, so the role's only active tickets are the kept ones;
# - the clients went on by themselves: they received tickets from the new primary.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"

LIMIT=11      # 8 kept open, so the 8 clients share 3 slots: refusals all along (with 6 slots a full run saw none, and reruns 1 and 4)
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
received() { load_received "$PRIMARY" | wc -l; }
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
load_received "$PRIMARY" > "$PRIMARY/received_before"
as_pg "$PG_BIN/pg_ctl" -D "$STANDBY/data" -w -t 60 promote >/dev/null
t1=$(date +%s.%N)
expect_eq "the standby is promoted" f "$(on_standby -c "SELECT pg_is_in_recovery()")"
echo "# $(wc -l < "$PRIMARY/received_before") tickets received before the primary died; promoted $(awk "BEGIN { printf \"%.2f\", $t1 - $t0 }") s after the kill"

# The clients reconnect to the new primary by themselves.
n0=$(received); t0=$SECONDS
wait_received $((n0 + 300)) || true
got=$(( $(received) - n0 ))
check "the clients go on against the new primary ($got tickets received there in $((SECONDS - t0)) s)" test "$got" -ge 300
stop_clients "$PRIMARY"

# --- checks on the new primary -------------------------------------------------------------
CL="$STANDBY"; PORT="$STANDBY_PORT"
sql -c "SELECT id FROM quota.ledger" | sort > "$PRIMARY/ledger_after"
missing_before=$(comm -23 "$PRIMARY/received_before" "$PRIMARY/ledger_after" | wc -l)
echo "# missing on the new primary: $missing_before of the $(wc -l < "$PRIMARY/received_before") tickets received before the failover"
expect_eq "every ticket received before the failover is in the new primary's ledger" 0 "$missing_before"
expect_eq "all $CLIENTS clients kept a ticket open from before the failover" "$CLIENTS" \
  "$(grep -Eho '^K [0-9a-f-]{36}$' "$PRIMARY"/out.* | cut -c3- | sort -u | comm -12 - "$PRIMARY/received_before" | wc -l)"
failover_checks "$PRIMARY" "the new primary"
finish_checks
