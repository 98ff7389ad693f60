#!/usr/bin/env bash
# I1 for transactional starts (0.5.0) under a real race: 100 clients of one role at a
# limit of 10 take transactional charges, hold them a moment, and commit half of them
# and roll back the others; the committed tickets are finished in the next
# transaction. Meanwhile 10 more clients take writer-committed tickets of the same role
# (mixed modes), and in a second round every charge is a tenant's (5 tenants, each
# limited to 3, under the role's 10). A sampler reads the committed active count as
# often as it can: it must never pass a limit. After the load, the role is admitted
# exactly the room its ledger leaves: no open charge was lost or kept. A third round
# races eight roles' transactional starts and a ninth role's writer-committed ones for
# a database cap, which no role's scope lock covers (scopes::cap_lock_tag).
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5766 + PORT_OFFSET))}"
with_cluster transactional_race "max_connections = 150"
LIMIT=10
sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE tr LOGIN" \
    -c "ALTER ROLE tr SET quota.max_active_per_role = $LIMIT" \
    -c "ALTER ROLE tr SET quota.max_retained_per_role = 0" \
    -c "ALTER ROLE tr SET quota.max_active_per_tenant = 3" \
    -c "ALTER ROLE tr SET quota.allow_transactional = on" \
    -c "CREATE TABLE public.tr_stop (x int)" -c "GRANT SELECT ON public.tr_stop TO PUBLIC" >/dev/null

cat > "$CL/txn.sql" <<'SQL'
\set r random(0, 1)
BEGIN;
SELECT coalesce(quota.try_start('txn', transactional => true)::text, '') AS t \gset
SELECT pg_sleep(0.002);
\if :r
COMMIT;
SELECT quota.finish(t) FROM (SELECT NULLIF(':t', '')::uuid AS t) s WHERE t IS NOT NULL;
\else
ROLLBACK;
\endif
SQL
cat > "$CL/txn_tenant.sql" <<'SQL'
\set r random(0, 1)
\set n random(1, 5)
BEGIN;
SELECT coalesce(quota.try_start('txn', tenant => 't' || :n, transactional => true)::text, '') AS t \gset
SELECT pg_sleep(0.002);
\if :r
COMMIT;
SELECT quota.finish(t) FROM (SELECT NULLIF(':t', '')::uuid AS t) s WHERE t IS NOT NULL;
\else
ROLLBACK;
\endif
SQL
cat > "$CL/writer.sql" <<'SQL'
SELECT coalesce(quota.try_start('writer')::text, '') AS t \gset
SELECT pg_sleep(0.002);
SELECT quota.finish(t) FROM (SELECT NULLIF(':t', '')::uuid AS t) s WHERE t IS NOT NULL;
SQL
chmod 644 "$CL"/*.sql

# round SCRIPT SAMPLE_SQL NAME: 100 clients of SCRIPT and 10 of writer.sql for 8 s,
# with a sampler of SAMPLE_SQL (the largest committed count it sees).
round() {
  local script="$1" sample="$2" name="$3" pids=()
  sql -c "DELETE FROM public.tr_stop" >/dev/null
  start_sampler public.tr_stop "$sample"
  bg bash -c "'$PG_BIN/pgbench' -n -h '$CL' -p '$PORT' -U tr -c 100 -j 2 -T 8 -f '$CL/$script' postgres > '$CL/pgbench.$name' 2>&1"
  pids+=("$LAST_BG")
  bg bash -c "'$PG_BIN/pgbench' -n -h '$CL' -p '$PORT' -U tr -c 10 -j 1 -T 8 -f '$CL/writer.sql' postgres > '$CL/pgbench.$name.writer' 2>&1"
  pids+=("$LAST_BG")
  wait "${pids[@]}" || true
  stop_sampler public.tr_stop
}
processed() { sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$1" | head -1; }

round txn.sql "SELECT count(*) FROM quota.ledger WHERE role = 'tr'::regrole AND ended_at IS NULL" role
check "round 1 ran: $(processed "$CL/pgbench.role") transactional and $(processed "$CL/pgbench.role.writer") writer-committed cycles" \
  test "$(processed "$CL/pgbench.role")" -gt 500
check "the sampler ran ($SAMPLES samples)" test "${SAMPLES:-0}" -gt 100
check "the role's committed active count never passed $LIMIT (max $SAMPLED_MAX)" test "${SAMPLED_MAX:-99}" -le "$LIMIT"
rolled=$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'tr'::regrole AND label = 'txn'")
echo "# $rolled transactional tickets committed in round 1"

round txn_tenant.sql "SELECT coalesce(max(c), 0) FROM (SELECT count(*) AS c FROM quota.ledger
  WHERE role = 'tr'::regrole AND ended_at IS NULL AND tenant IS NOT NULL GROUP BY tenant) s" tenants
check "round 2 ran: $(processed "$CL/pgbench.tenants") transactional tenant cycles" \
  test "$(processed "$CL/pgbench.tenants")" -gt 500
check "no tenant's committed active count passed 3 (max $SAMPLED_MAX)" test "${SAMPLED_MAX:-99}" -le 3
errors=$(grep -h "ERROR" "$CL"/pgbench.* | grep -v "53400" | sort | uniq -c | head -3 || true)
check "the clients saw no error but refusals${errors:+: $errors}" test -z "$errors"

# After the load every open charge is gone: the role is admitted exactly its room.
active=$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'tr'::regrole AND ended_at IS NULL")
expect_eq "the role is admitted exactly the room its ledger leaves ($LIMIT - $active)" "$((LIMIT - active))" \
  "$(as tr postgres "SELECT count(quota.try_start('after', transactional => true)) FROM generate_series(1, $LIMIT + 2)")"
expect_eq "... and each tenant its own room" 3 \
  "$(as tr postgres "SELECT quota.finish(id) FROM quota.tickets WHERE label = 'after'" >/dev/null; as tr postgres "SELECT count(quota.try_start('t', tenant => 'fresh', transactional => true)) FROM generate_series(1, 5)")"

# 3. The database cap, across roles and modes: eight roles take transactional charges
#    (12 clients each) and a ninth writer-committed tickets (10 clients), under
#    quota.max_active_per_database = 50 and no role limit, while a superuser holds 40
#    of the 50 (it is never refused, and its tickets count): each count of the
#    database then reads 40 tickets and more, which leaves two roles' starts time to
#    meet between their counts and their charges, if nothing keeps them apart.
CAP=50
# Every charge commits and is held a moment: the ledger then has each one's
# [started_at, ended_at), and the most that overlap bound from below how many were
# admitted at once (a charge was taken before its started_at, and held until after its
# ended_at, its finish's commit), so more than the cap there is an admission past it.
cat > "$CL/txn_cap.sql" <<'SQL'
BEGIN;
SELECT coalesce(quota.try_start('cap', transactional => true)::text, '') AS t \gset
COMMIT;
SELECT pg_sleep(0.003);
SELECT quota.finish(t) FROM (SELECT NULLIF(':t', '')::uuid AS t) s WHERE t IS NOT NULL;
SQL
chmod 644 "$CL/txn_cap.sql"
sql -c "SELECT count(quota.finish(id)) FROM quota.ledger WHERE ended_at IS NULL" \
    -c "DO \$\$ BEGIN FOR i IN 1..9 LOOP EXECUTE format('CREATE ROLE tc%s LOGIN; ALTER ROLE tc%s SET quota.max_active_per_role = 0; ALTER ROLE tc%s SET quota.max_retained_per_role = 0; ALTER ROLE tc%s SET quota.allow_transactional = on', i, i, i, i); END LOOP; END \$\$" \
    -c "SELECT count(quota.start('held')) FROM generate_series(1, 40)" \
    -c "ALTER DATABASE postgres SET quota.max_active_per_database = $CAP" -c "DELETE FROM public.tr_stop" >/dev/null
start_sampler public.tr_stop "SELECT count(*) FROM quota.ledger WHERE ended_at IS NULL"
pids=()
for i in 1 2 3 4 5 6 7 8; do
  bg bash -c "'$PG_BIN/pgbench' -n -h '$CL' -p '$PORT' -U tc$i -c 12 -j 1 -T 8 -f '$CL/txn_cap.sql' postgres > '$CL/pgbench.cap.$i' 2>&1"
  pids+=("$LAST_BG")
done
bg bash -c "'$PG_BIN/pgbench' -n -h '$CL' -p '$PORT' -U tc9 -c 10 -j 1 -T 8 -f '$CL/writer.sql' postgres > '$CL/pgbench.cap.writer' 2>&1"
pids+=("$LAST_BG")
wait "${pids[@]}" || true
stop_sampler public.tr_stop
cycles=0
for i in 1 2 3 4 5 6 7 8; do cycles=$((cycles + $(processed "$CL/pgbench.cap.$i"))); done
check "round 3 ran: $cycles transactional cycles of eight roles, $(processed "$CL/pgbench.cap.writer") writer-committed" \
  test "$cycles" -gt 500
check "the database's committed active count never passed its cap of $CAP (max $SAMPLED_MAX of $SAMPLES samples)" \
  test "${SAMPLED_MAX:-99}" -le "$CAP"
overlap=$(sql -c "SELECT max(n) FROM (SELECT sum(d) OVER (ORDER BY t, d) AS n FROM (
    SELECT started_at AS t, 1 AS d FROM quota.ledger
    UNION ALL SELECT ended_at, -1 FROM quota.ledger WHERE ended_at IS NOT NULL) e) s")
check "no more than $CAP of the database's tickets were ever active at once, by their ledger times (max $overlap)" \
  test "${overlap:-99}" -le "$CAP"
errors=$(grep -h "ERROR" "$CL"/pgbench.cap.* | grep -v "53400" | sort | uniq -c | head -3 || true)
check "the clients saw no error but refusals${errors:+: $errors}" test -z "$errors"
active=$(sql -c "SELECT count(*) FROM quota.ledger WHERE ended_at IS NULL")
expect_eq "the database is admitted exactly the room its cap leaves ($CAP - $active)" "$((CAP - active))" \
  "$(as tc1 postgres "SELECT count(quota.try_start('after', transactional => true)) FROM generate_series(1, 12)")"
finish_checks
