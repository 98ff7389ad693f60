#!/usr/bin/env bash
# quota.stats loses no increment under concurrency (0.3.0 observability).
#
# Three pgbench runs at the same time, one per role (pgbench runs every client as one
# role), 64 sessions together, against one database:
#   sc_a: 32 clients, SELECT quota.finish(quota.start()) per transaction (limits off);
#   sc_b: 16 clients, SELECT quota.try_start() per transaction while a ticket kept
#         from before holds the role's only slot (max_active_per_role = 1): every call
#         is refused (the script divides by zero if one is admitted, failing pgbench);
#   sc_c: 16 clients, start(idempotency_key => one of 4 keys) per transaction.
# Checks, and how each would fail:
# - every pgbench exits 0 and reports all its transactions processed and 0 failed.
#   Fails on any SQL error (a start() of sc_a refused or failing, a try_start() of sc_b
#   admitted past the limit, an idempotent start failing) or an aborted client.
# - pg_stat_activity saw at least 32 (in fact up to 64) pg_quota sessions at once, of
#   all three roles: the counters really were hit concurrently. Fails if the runs did
#   not overlap (then the exact counts below would prove nothing about races).
# - sc_a: admitted = finished_succeeded = 32 * T_A exactly, no refusal, no failed or
#   cancelled finish; the ledger holds exactly 32 * T_A tickets of sc_a, all ended
#   'succeeded'. Fails if concurrent increments of one shared counter are lost (a
#   read-modify-write without a lock or atomic), or if finish() is counted at the
#   wrong moment (twice, or not at its commit).
# - sc_b: refused_active = 16 * T_B exactly, admitted = 1 (the kept ticket), nothing
#   in refused_retained / refused_database: lost increments on the refusal path (which
#   takes no lock of pg_quota's) or a refusal counted under the wrong limit.
# - sc_c: admitted + idempotent_hits = 16 * T_C exactly, and admitted = 4 = the
#   number of distinct keys = sc_c's tickets in the ledger. Fails if a start that
#   returned an existing ticket counts as admitted (or not at all), or if hits are
#   lost under concurrency.
# - quota.stats has one row per role (datname postgres), no duplicates. Fails if two
#   sessions racing to create a role's entry both create one.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5730 + PORT_OFFSET))}"
with_cluster stats_concurrency

C_A=32 T_A=250   # sc_a: clients, transactions per client
C_B=16 T_B=500   # sc_b
C_C=16 T_C=250   # sc_c
KEYS=4

sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE sc_a LOGIN" -c "CREATE ROLE sc_b LOGIN" -c "CREATE ROLE sc_c LOGIN" \
    -c "ALTER ROLE sc_a SET quota.max_active_per_role = 1000" \
    -c "ALTER ROLE sc_a SET quota.max_retained_per_role = 0" \
    -c "ALTER ROLE sc_b SET quota.max_active_per_role = 1" >/dev/null

# sc_b's only slot: a ticket that is never finished (its lease is 24 h).
expect_eq "sc_b's kept ticket is admitted" t "$(psql_as sc_b -c "SELECT quota.start('kept') IS NOT NULL")"

echo "SELECT quota.finish(quota.start('bench a'));" > "$CL/a.sql"
# A ticket here would be a limit broken: 1/0 makes that transaction fail.
echo "SELECT 1 / (CASE WHEN quota.try_start('bench b') IS NULL THEN 1 ELSE 0 END);" > "$CL/b.sql"
printf '%s\n' "\\set k random(1, $KEYS)" \
  "SELECT quota.start('bench c', idempotency_key => 'key-' || :k::int);" > "$CL/c.sql"
chmod 644 "$CL"/[abc].sql

check "pgbench is installed next to the server" test -x "$PG_BIN/pgbench"

run_bench() {  # run_bench TAG ROLE CLIENTS TRANSACTIONS
  bg bash -c "'$PG_BIN/pgbench' -n -M prepared -h '$CL' -p '$PORT' -U $2 -c $3 -j 2 -t $4 \
                -f '$CL/$1.sql' postgres > '$CL/bench_$1.out' 2>&1; echo \$? > '$CL/bench_$1.rc'"
}
rm -f "$CL"/bench_*.rc
run_bench a sc_a "$C_A" "$T_A"
run_bench b sc_b "$C_B" "$T_B"
run_bench c sc_c "$C_C" "$T_C"

# While they run: the most pg_quota sessions seen at once, and of how many roles.
max_sessions=0 max_roles=0
for _ in $(seq 1 3000); do
  [ -e "$CL/bench_a.rc" ] && [ -e "$CL/bench_b.rc" ] && [ -e "$CL/bench_c.rc" ] && break
  read -r n r <<<"$(sql -F ' ' -c "SELECT count(*), count(DISTINCT usename) FROM pg_stat_activity WHERE usename IN ('sc_a', 'sc_b', 'sc_c')" 2>/dev/null || echo '0 0')"
  [ "${n:-0}" -gt "$max_sessions" ] && max_sessions=$n
  [ "${r:-0}" -gt "$max_roles" ] && max_roles=$r
  sleep 0.1
done
timeout 300 bash -c "until [ -e '$CL/bench_a.rc' ] && [ -e '$CL/bench_b.rc' ] && [ -e '$CL/bench_c.rc' ]; do sleep 0.2; done" || true

for t in a b c; do
  case $t in a) want=$((C_A * T_A)) ;; b) want=$((C_B * T_B)) ;; c) want=$((C_C * T_C)) ;; esac
  expect_eq "pgbench sc_$t exited 0" 0 "$(cat "$CL/bench_$t.rc" 2>/dev/null || echo missing)"
  expect_eq "pgbench sc_$t processed all $want transactions" "$want/$want" \
    "$(sed -n 's/^number of transactions actually processed: \([0-9]*\/[0-9]*\).*/\1/p' "$CL/bench_$t.out")"
  expect_eq "pgbench sc_$t reports 0 failed transactions" 0 \
    "$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$CL/bench_$t.out")"
  grep -q '^number of failed transactions: 0 ' "$CL/bench_$t.out" \
    || { echo "# pgbench sc_$t output:"; sed 's/^/#   /' "$CL/bench_$t.out" | tail -n 20; }
done
check "at least 32 pg_quota sessions ran at once (saw $max_sessions, of $max_roles roles)" \
  test "$max_sessions" -ge 32 -a "$max_roles" -eq 3

# No session of the runs is left (the counts are taken once everything committed).
timeout 20 bash -c "until [ \"\$('$PG_BIN/psql' -X -At -h '$CL' -p '$PORT' -U postgres -d postgres -c \
  \"SELECT count(*) FROM pg_stat_activity WHERE usename IN ('sc_a', 'sc_b', 'sc_c')\")\" = 0 ]; do sleep 0.1; done" || true

stat_of() {  # stat_of ROLE COLUMNS: the role's row in quota.stats, columns joined by ' '
  sql -c "SELECT concat_ws(' ', $2) FROM quota.stats WHERE datname = 'postgres' AND role = '$1'"
}
N_A=$((C_A * T_A)) N_B=$((C_B * T_B)) N_C=$((C_C * T_C))
expect_eq "sc_a: admitted and finished_succeeded are exactly $N_A each" "$N_A $N_A" \
  "$(stat_of sc_a "admitted, finished_succeeded")"
expect_eq "sc_a: no refusal, no failed or cancelled finish, no expiry, no hit, no wait" "0 0 0 0 0 0 0 0 0" \
  "$(stat_of sc_a "refused_active, refused_retained, refused_database, finished_failed, finished_cancelled, expired, renewed, idempotent_hits, waits")"
expect_eq "sc_a: the ledger holds exactly $N_A tickets of sc_a, all ended 'succeeded'" "$N_A $N_A" \
  "$(sql -c "SELECT count(*) || ' ' || count(*) FILTER (WHERE outcome = 'succeeded' AND ended_at IS NOT NULL)
               FROM quota.ledger WHERE role = 'sc_a'::regrole")"
expect_eq "sc_b: refused_active is exactly $N_B, admitted 1 (the kept ticket)" "$N_B 1" \
  "$(stat_of sc_b "refused_active, admitted")"
expect_eq "sc_b: no other refusal kind, no finish, no hit" "0 0 0 0" \
  "$(stat_of sc_b "refused_retained, refused_database, finished_succeeded, idempotent_hits")"
expect_eq "sc_b: the ledger still holds only the kept ticket" 1 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'sc_b'::regrole")"
expect_eq "sc_c: admitted + idempotent_hits is exactly $N_C" "$N_C" \
  "$(sql -c "SELECT admitted + idempotent_hits FROM quota.stats WHERE datname = 'postgres' AND role = 'sc_c'")"
expect_eq "sc_c: admitted = $KEYS = distinct keys = sc_c's tickets in the ledger" "$KEYS $KEYS $KEYS" \
  "$(sql -c "SELECT (SELECT admitted FROM quota.stats WHERE datname = 'postgres' AND role = 'sc_c') || ' ' ||
                    count(DISTINCT idempotency_key) || ' ' || count(*) FROM quota.ledger WHERE role = 'sc_c'::regrole")"
expect_eq "sc_c: no refusal" "0 0 0" "$(stat_of sc_c "refused_active, refused_retained, refused_database")"
expect_eq "quota.stats has exactly one row per role" "sc_a:1 sc_b:1 sc_c:1" \
  "$(sql -c "SELECT string_agg(role || ':' || n, ' ' ORDER BY role) FROM
               (SELECT role, count(*) AS n FROM quota.stats WHERE role IN ('sc_a', 'sc_b', 'sc_c') GROUP BY role) s")"
check "the summary equals the ledger" summary_matches_ledger
finish_checks
