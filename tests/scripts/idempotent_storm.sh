#!/usr/bin/env bash
# Idempotent starts under a storm (0.2.0): 16 pgbench clients call
# start(idempotency_key => 'k' || (client_id % 4)) over and over for a few seconds,
# all released at once through an advisory-lock barrier so that the first calls of
# each key race. Four roles, four admission paths:
#   is_lim   quota.max_active_per_role = 4: the limited path, at the limit once the
#            4 keys have their tickets (repeats must be answered even at the limit);
#   is_dflt  the default limits (100): the limited path, far from the limit;
#   is_free  max_active = 0 and max_retained = 0: no counting, straight to the writer;
#   is_su    a superuser: exempt (I7), straight to the writer.
# Checks, per role:
# - pgbench ran every client without an error. Fails for is_lim if a repeat is
#   charged or counted against the limit (53400), or if the 4 first calls of distinct
#   keys were refused because duplicates of another key took slots;
# - exactly 4 ledger rows exist for the role, one per key. Fails if two concurrent
#   first calls with one key both get a ticket (callers' pre-check and the writer's
#   re-check both missing a request in flight / in the same batch);
# - every ticket any client received for key k is that row's id, and all 16 clients
#   got answers many times. Fails if a repeat returns a fresh or a wrong ticket;
# - quota.usage shows 4 active and 4 retained, and quota.summary equals the ledger.
#   Fails if repeats charge the retained count or the summary counter;
# - for is_lim, a start() with a new key is then refused (53400), and try_start()
#   with a known key still returns its ticket. Fails if the limit does not count the
#   4 real tickets, or if repeats at the limit are refused.
# Rolling keys: 16 clients, key 'k' || (client_id % 4) || '-' || the current tenth of a
# second, so that every 100 ms four fresh keys are raced for by 4 clients each (about
# 150 races per role), for a limited role (limit 1000) and an unlimited one (0/0).
# Checks: no key has two ledger rows, every ticket a client received for a key is its
# row, and many keys were really shared by several clients. Fails like the checks
# above, but gives a race that needs a narrow window many more chances.
# Then a second storm for is_lim after k0's ticket was finished: repeats of k0 return
# the ENDED ticket (still retained), nothing new is charged, 3 stay active. Fails if an
# ended-but-retained key gets a new ticket.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5713 + PORT_OFFSET))}"
with_cluster idempotent_storm "max_connections = 120"

CLIENTS=16
STORM_SECONDS="${STORM_SECONDS:-4}"
sql >/dev/null <<'SQL'
CREATE EXTENSION pg_quota;
CREATE ROLE is_lim LOGIN;
ALTER ROLE is_lim SET quota.max_active_per_role = 4;
CREATE ROLE is_dflt LOGIN;
CREATE ROLE is_free LOGIN;
ALTER ROLE is_free SET quota.max_active_per_role = 0;
ALTER ROLE is_free SET quota.max_retained_per_role = 0;
CREATE ROLE is_su LOGIN SUPERUSER;
CREATE ROLE is_roll_lim LOGIN;
ALTER ROLE is_roll_lim SET quota.max_active_per_role = 1000;
CREATE ROLE is_roll_free LOGIN;
ALTER ROLE is_roll_free SET quota.max_active_per_role = 0;
ALTER ROLE is_roll_free SET quota.max_retained_per_role = 0;
CREATE TABLE got (round text, client int, key text, ticket uuid);
GRANT INSERT ON got TO PUBLIC;
SQL

# Every transaction first passes the barrier (held exclusively by the script at the
# start of a storm), then starts with its client's key and records the answer.
cat > "$CL/storm.sql" <<'PGB'
SELECT pg_advisory_lock_shared(7), pg_advisory_unlock_shared(7);
INSERT INTO got SELECT ':round', :client_id, 'k' || (:client_id % 4), quota.start('storm', idempotency_key => 'k' || (:client_id % 4));
PGB
cat > "$CL/roll.sql" <<'PGB'
SELECT pg_advisory_lock_shared(7), pg_advisory_unlock_shared(7);
INSERT INTO got SELECT ':round', :client_id, k, quota.start('roll', idempotency_key => k)
  FROM (SELECT 'k' || (:client_id % 4) || '-' || floor(extract(epoch FROM clock_timestamp()) * 10)::bigint AS k) s;
PGB
chmod 644 "$CL/storm.sql" "$CL/roll.sql"

storm() {  # storm ROLE ROUND [SCRIPT]: one storm of CLIENTS clients, released at once
  local role="$1" round="$2" script="${3:-storm}" rc=0 waiting
  open_session barrier postgres
  say barrier "SELECT 'locked=' || pg_advisory_lock(7)::text;"
  wait_out barrier 'locked=' 10 || true
  bg bash -c "timeout $((STORM_SECONDS + 60)) '$PG_BIN/pgbench' -n -h '$CL' -p '$PORT' -U $role -c $CLIENTS -j 4 \
                -T $STORM_SECONDS -D round=$round -f '$CL/$script.sql' postgres > '$CL/pgbench-$round.log' 2>&1; \
              echo \$? > '$CL/pgbench-$round.rc'"
  timeout 20 bash -c "until [ \"\$('$PG_BIN/psql' -X -At -h '$CL' -p '$PORT' -U postgres -d postgres -c \
      \"SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted\")\" = $CLIENTS ]; do sleep 0.05; done" || true
  waiting=$(sql -c "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
  say barrier "SELECT pg_advisory_unlock(7);"
  close_session barrier
  timeout $((STORM_SECONDS + 70)) bash -c "until [ -e '$CL/pgbench-$round.rc' ]; do sleep 0.1; done" || true
  rc=$(cat "$CL/pgbench-$round.rc" 2>/dev/null || echo none)
  expect_eq "$round: all $CLIENTS clients were held at the barrier, then released together" "$CLIENTS" "$waiting"
  expect_eq "$round ($role): pgbench ran all clients without error" 0 "$rc"
  [ "$rc" = 0 ] || grep -m3 -i error "$CL/pgbench-$round.log" | sed 's/^/# /'
}

verify() {  # verify ROLE ROUND: the checks every storm must pass
  local role="$1" round="$2" calls
  calls=$(sql -c "SELECT count(*) || ' ' || count(DISTINCT client) FROM got WHERE round = '$round'")
  check "$round: every client got answers, many times ($calls: calls, clients)" \
    test "${calls% *}" -gt $((CLIENTS * 5)) -a "${calls#* }" = "$CLIENTS"
  expect_eq "$round: one ledger row per key for $role" "k0 k1 k2 k3" \
    "$(sql -c "SELECT string_agg(coalesce(idempotency_key, '<none>'), ' ' ORDER BY idempotency_key) FROM quota.ledger WHERE role = '$role'::regrole")"
  expect_eq "$round: every ticket received for key k is that key's row" 0 \
    "$(sql -c "SELECT count(*) FROM got g WHERE g.round = '$round' AND g.ticket IS DISTINCT FROM
                 (SELECT l.id FROM quota.ledger l WHERE l.role = '$role'::regrole AND l.idempotency_key = g.key)")"
  expect_eq "$round: the clients received exactly 4 distinct tickets" 4 \
    "$(sql -c "SELECT count(DISTINCT ticket) FROM got WHERE round = '$round'")"
  check "$round: quota.summary equals the ledger" summary_matches_ledger
}

storm is_lim lim
verify is_lim lim
expect_eq "lim: quota.usage shows 4 active, 4 retained" "4|4" \
  "$(sql -c "SELECT active || '|' || retained FROM quota.usage WHERE role = 'is_lim'::regrole")"
expect_eq "lim: a new key is refused at the limit" 53400 \
  "$(state is_lim postgres "SELECT quota.start(idempotency_key => 'k4')")"
expect_eq "lim: try_start() with a known key still returns its ticket at the limit" t \
  "$(as is_lim postgres "SELECT quota.try_start(idempotency_key => 'k2') = (SELECT id FROM quota.tickets WHERE idempotency_key = 'k2')")"

for role in is_dflt is_free is_su; do
  storm "$role" "${role#is_}"
  verify "$role" "${role#is_}"
  expect_eq "${role#is_}: quota.usage shows 4 active, 4 retained" "4|4" \
    "$(sql -c "SELECT active || '|' || retained FROM quota.usage WHERE role = '$role'::regrole")"
done

for role in is_roll_lim is_roll_free; do
  r=${role#is_}
  storm "$role" "$r" roll
  stats=$(sql -c "SELECT count(*) || ' ' || count(DISTINCT key) || ' ' ||
                         (SELECT count(*) FROM (SELECT key FROM got WHERE round = '$r' GROUP BY key HAVING count(DISTINCT client) > 1) s)
                    FROM got WHERE round = '$r'")
  read -r calls keys shared <<<"$stats"
  check "$r: many fresh keys were raced for ($calls calls, $keys keys, $shared shared by several clients)" \
    test "$keys" -gt 40 -a "$shared" -gt 40
  expect_eq "$r: no key has two ledger rows" 0 \
    "$(sql -c "SELECT count(*) - count(DISTINCT idempotency_key) FROM quota.ledger WHERE role = '$role'::regrole")"
  expect_eq "$r: one ledger row per key received" "$keys" \
    "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = '$role'::regrole")"
  expect_eq "$r: every ticket received for a key is that key's row" 0 \
    "$(sql -c "SELECT count(*) FROM got g WHERE g.round = '$r' AND g.ticket IS DISTINCT FROM
                 (SELECT l.id FROM quota.ledger l WHERE l.role = '$role'::regrole AND l.idempotency_key = g.key)")"
  expect_eq "$r: quota.usage shows one active ticket per key" "$keys|$keys" \
    "$(sql -c "SELECT active || '|' || retained FROM quota.usage WHERE role = '$role'::regrole")"
  check "$r: quota.summary equals the ledger" summary_matches_ledger
done

# A finished ticket stays the answer for its key while it is retained.
k0=$(sql -c "SELECT id FROM quota.ledger WHERE role = 'is_lim'::regrole AND idempotency_key = 'k0'")
expect_eq "lim2: k0's ticket is finished" t "$(as is_lim postgres "SELECT quota.finish('$k0')")"
storm is_lim lim2
verify is_lim lim2
expect_eq "lim2: repeats of k0 got the ended ticket" "$k0" \
  "$(sql -c "SELECT string_agg(DISTINCT ticket::text, ',') FROM got WHERE round = 'lim2' AND key = 'k0'")"
expect_eq "lim2: quota.usage shows 3 active, 4 retained" "3|4" \
  "$(sql -c "SELECT active || '|' || retained FROM quota.usage WHERE role = 'is_lim'::regrole")"
expect_eq "lim2: k0's ticket kept its outcome" succeeded \
  "$(sql -c "SELECT outcome FROM quota.ledger WHERE id = '$k0'")"
check "no crash: the server did not reinitialize" bash -c "! grep -q 'reinitializing' '$CL/server.log'"
finish_checks
