#!/usr/bin/env bash
# Point-in-time recovery to a target time in the middle of a load (issue 19).
#
# WAL is archived (archive_command copies each segment to a folder); a base backup is
# taken before the load. Eight clients start and finish tickets of a role whose limit
# they hit all along (each first keeps one ticket open), and note the server's clock
# before each start() is called and after it returned, and after each finish()
# returned. A target time T is taken in the middle of the load. The backup is restored
# into a new data directory with restore_command, recovery_target_time = T and
# recovery_target_action = 'promote' (recovery_target_inclusive at its default). On
# the recovered server:
# - every ticket whose start() returned before T is in the ledger;
# - no ticket whose start() was called after T is: its commit came after T;
# - a ticket whose call spanned T may be there or not. Recovery stops at commit records
#   by their commit time, and the ledger writer commits a charge before start()
#   returns, so a charge committed just before T is kept although its client heard of
#   it after T. Those are counted and printed, not checked;
# - every finish acknowledged before T is still ended, and no finish called after T
#   is (its ticket is active again, as it was at T);
# - quota.summary equals the ledger, quota.usage counts what the ledger holds, and the
#   limit is exact (limit - active admitted, the next refused with 53400);
# - the tickets received before T that are active there can be finished, and start()
#   works.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"

LIMIT=11      # 8 kept open, so the 8 clients share 3 slots: refusals all along (with 6 slots a full run saw none, and reruns 1 and 4)
CLIENTS=8
with_cluster pitr_source "wal_level = replica" "archive_mode = on" "archive_timeout = 0"
SRC="$CL"; ARCH="$CL/archive"; mkdir -p "$ARCH"; chown "$PG_USER" "$ARCH"
sql -c "ALTER SYSTEM SET archive_command = 'test ! -f $ARCH/%f && cp %p $ARCH/%f'" -c "SELECT pg_reload_conf()" >/dev/null
sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE t1 LOGIN" \
    -c "ALTER ROLE t1 SET quota.max_active_per_role = $LIMIT" -c "ALTER ROLE t1 SET quota.max_retained_per_role = 0" >/dev/null
as_pg "$PG_BIN/pg_basebackup" -h "$CL" -p "$PORT" -U postgres -D "$CL/base" -X stream -c fast

# --- load ---------------------------------------------------------------------------------
# Times are the server's clock in UTC, formatted so that they sort as text.
# "S <ticket> <before the call> <after it returned>" (try_start(), the same admission as
# start(): "S refused ..." when it returned NULL); the ticket is held 5 ms; then
# "F <ticket> t <before the call> <after it returned>" for a finish that returned true
# (committed); "K <ticket>" for a ticket kept open.
NOW="to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US')"
{
  echo "SELECT $NOW AS b \\gset"
  for i in $(seq 1 40); do
    echo "\\unset t"; echo "\\unset f"
    echo "SELECT coalesce(quota.try_start('load')::text, 'refused') AS t \\gset"
    echo "SELECT $NOW AS m \\gset"
    echo "\\echo S :t :b :m"
    echo "SELECT $NOW AS c FROM pg_sleep(0.005) \\gset"
    echo "SELECT quota.finish(t::uuid) AS f FROM (SELECT :'t' AS t) s WHERE t <> 'refused' \\gset"
    echo "SELECT $NOW AS b \\gset"
    echo "\\echo F :t :f :c :b"
  done
} > "$CL/iter.sql"
printf '%s\n' "SELECT $NOW AS b \\gset" "SELECT quota.start('kept') AS t \\gset" "SELECT $NOW AS m \\gset" \
  "\\echo S :t :b :m" "\\echo K :t" > "$CL/keep.sql"
client() {
  local k="$1" n=0
  until [ -s "$D/out.$k" ] && grep -q '^K ' "$D/out.$k"; do
    [ -e "$D/stop" ] && return 0
    timeout 20 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$D" -p "$P" -U t1 -d postgres \
      -f "$D/keep.sql" >> "$D/out.$k" 2>> "$D/err.$k" || sleep 0.1
  done
  # Bounded by itself: 60 s at most, or until the stop file appears.
  while [ ! -e "$D/stop" ] && [ "$n" -lt 600 ]; do
    n=$((n + 1))
    timeout 20 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -h "$D" -p "$P" -U t1 -d postgres \
      -f "$D/iter.sql" >> "$D/out.$k" 2>> "$D/err.$k" || sleep 0.1
  done
}
CLIENT_PIDS=()
for k in $(seq 1 $CLIENTS); do
  bg bash -c "$(declare -f client); D='$CL' P='$PORT' PG_BIN='$PG_BIN' client $k"
  CLIENT_PIDS+=("$LAST_BG")
done
received() { grep -Eh '^S [0-9a-f-]{36} ' "$CL"/out.* 2>/dev/null | wc -l; }
wait_received() {  # wait_received N: until N tickets were received (60 s at most)
  local _
  for _ in $(seq 1 300); do [ "$(received)" -ge "$1" ] && return 0; sleep 0.2; done
  return 1
}
wait_received 400 || true
# Two probes, started before T and finished after it: the check that no finish called
# after T is applied has tickets to look at, whatever the timing of the load.
probes=$(as t1 postgres "SELECT quota.start('probe', wait => '30 s')" "SELECT quota.start('probe', wait => '30 s')")
T=$(sql -c "SELECT $NOW")
probe_ids=$(sed "s/.*/'&'/" <<<"$probes" | paste -sd,)
expect_eq "two probes started before T are finished after it" "2" \
  "$(as t1 postgres "SELECT count(*) FILTER (WHERE quota.finish(id)) FROM unnest(ARRAY[$probe_ids]::uuid[]) id")"
n0=$(received)
wait_received $((n0 + 400)) || true
stop_clients "$CL"
refused=$(cat "$CL"/out.* | grep -c '^S refused ' || true)
check "refusals happen under the load: the limit is reached ($refused refused)" test "$refused" -gt 0

# Every segment up to the end of the load is archived.
seg=$(sql -c "SELECT pg_walfile_name(pg_switch_wal())")
timeout 60 bash -c "until [ -e '$ARCH/$seg' ]; do sleep 0.2; done" || true
check "the WAL of the load is archived (up to $seg)" test -e "$ARCH/$seg"
stop_cluster "$CL"

# --- what the clients saw, split at T -------------------------------------------------------
cat "$CL"/out.* | awk -v T="$T" '
  $1 == "S" && length($2) == 36 && NF == 6 {
    b = $3 " " $4; m = $5 " " $6
    if (m < T) print $2 > "'"$CL"'/before"; else if (b > T) print $2 > "'"$CL"'/after"; else print $2 > "'"$CL"'/spanning"
  }
  $1 == "F" && length($2) == 36 && $3 == "t" && NF == 7 {
    c = $4 " " $5; b = $6 " " $7
    if (b < T) print $2 > "'"$CL"'/finished_before"; else if (c > T) print $2 > "'"$CL"'/finished_after"
  }'
echo "$probes" >> "$CL/finished_after"
for f in before after spanning finished_before finished_after; do touch "$CL/$f"; sort -u -o "$CL/$f" "$CL/$f"; done
echo "# T = $T UTC: $(wc -l < "$SRC/before") tickets received before T, $(wc -l < "$SRC/after") started after T, $(wc -l < "$SRC/spanning") spanning T; $(wc -l < "$SRC/finished_before") finishes acknowledged before T, $(wc -l < "$SRC/finished_after") called after T"
check "hundreds of tickets on both sides of T" test "$(wc -l < "$SRC/before")" -ge 300 -a "$(wc -l < "$SRC/after")" -ge 300

# --- restore the base backup and recover to T -----------------------------------------------
R="$(dirname "$CL")/pitr_restored"; RPORT=$((PORT + 1))
mkdir -p "$R"; chown "$PG_USER" "$R"; CLUSTERS+=("$R")
cp -a "$SRC/base" "$R/data"
chown -R "$PG_USER" "$R/data"; chmod 700 "$R/data"
{
  echo "port = $RPORT"
  echo "unix_socket_directories = '$R'"
  echo "archive_mode = off"
  echo "restore_command = 'cp $ARCH/%f %p'"
  echo "recovery_target_time = '$T+00'"
  echo "recovery_target_action = 'promote'"
} >> "$R/data/postgresql.auto.conf"
as_pg touch "$R/data/recovery.signal"
t0=$(date +%s.%N)
as_pg "$PG_BIN/pg_ctl" -D "$R/data" -l "$R/server.log" -w -t 120 start >/dev/null
CL="$R"; PORT="$RPORT"
for _ in $(seq 1 600); do [ "$(sql -c "SELECT pg_is_in_recovery()" 2>/dev/null)" = f ] && break; sleep 0.1; done
t1=$(date +%s.%N)
expect_eq "the restored server reached T and was promoted" f "$(sql -c "SELECT pg_is_in_recovery()")"
stopped=$(grep -o 'recovery stopping before commit of transaction [0-9]*, time .*' "$R/server.log" | head -n1)
check "recovery stopped at a commit after T, not at the end of the WAL" test -n "$stopped"
echo "# $stopped; recovered in $(awk "BEGIN { printf \"%.1f\", $t1 - $t0 }") s"

sql -c "SELECT id FROM quota.ledger" | sort > "$R/in_ledger"
sql -c "SELECT id FROM quota.ledger WHERE ended_at IS NULL" | sort > "$R/active"
sql -c "SELECT id FROM quota.ledger WHERE ended_at IS NOT NULL" | sort > "$R/ended"
echo "# of the tickets spanning T, $(comm -12 "$SRC/spanning" "$R/in_ledger" | wc -l) are in the ledger (committed before T), $(comm -23 "$SRC/spanning" "$R/in_ledger" | wc -l) not"
expect_eq "every ticket received before T is in the ledger" 0 "$(comm -23 "$SRC/before" "$R/in_ledger" | wc -l)"
expect_eq "no ticket started after T is in the ledger" 0 "$(comm -12 "$SRC/after" "$R/in_ledger" | wc -l)"
expect_eq "every finish acknowledged before T is still ended" 0 "$(comm -23 "$SRC/finished_before" "$R/ended" | wc -l)"
fa_present=$(comm -12 "$SRC/finished_after" "$R/in_ledger")
echo "# $(comm -12 "$SRC/finished_after" "$SRC/before" | wc -l) tickets were received before T and finished after it"
expect_eq "no finish called after T is applied (those tickets are active; the probes among them)" "0 2" \
  "$(comm -12 <(echo "$fa_present" | sed '/^$/d') "$R/ended" | wc -l) $(comm -12 <(sort <<<"$probes") "$R/active" | wc -l)"
check "quota.summary equals the ledger" summary_matches_ledger
expect_eq "quota.usage counts what the ledger holds" \
  "$(sql -c "SELECT count(*) FILTER (WHERE ended_at IS NULL) || '|' || count(*) FROM quota.ledger WHERE role = 't1'::regrole")" \
  "$(sql -c "SELECT active || '|' || retained FROM quota.usage WHERE role = 't1'::regrole")"

# The tickets from before T that were active at T can be finished.
comm -12 "$SRC/before" "$R/active" > "$R/to_finish"
n=$(wc -l < "$R/to_finish")
ids=$(sed "s/.*/'&'/" "$R/to_finish" | paste -sd,)
check "tickets from before T are active at T ($n: the $CLIENTS kept ones, and those finished after T)" test "$n" -ge "$CLIENTS"
expect_eq "... and each can be finished (true)" "$n" \
  "$(as t1 postgres "SELECT count(*) FILTER (WHERE quota.finish(id)) FROM unnest(ARRAY[$ids]::uuid[]) id")"

active=$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 't1'::regrole AND ended_at IS NULL")
echo "# t1 holds $active active tickets of $LIMIT after those finishes"
expect_eq "the limit is exact: $LIMIT - $active more are admitted" $((LIMIT - active)) \
  "$(as t1 postgres "SELECT count(quota.try_start('fill')) FROM generate_series(1, $((LIMIT - active)) + 3)")"
expect_eq "... and the next start() is refused with 53400" 53400 "$(state t1 postgres "SELECT quota.start('over')")"
expect_eq "the ledger holds exactly the limit of active tickets" "$LIMIT" \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 't1'::regrole AND ended_at IS NULL")"
check "start() works once a slot is free" grep -Eq '^[0-9a-f-]{36}$' \
  <<<"$(as t1 postgres "SELECT quota.finish(id) FROM quota.tickets WHERE label = 'fill' AND ended_at IS NULL LIMIT 1" "SELECT quota.start('after recovery')" | tail -n1)"
check "quota.summary still equals the ledger" summary_matches_ledger
finish_checks
