#!/usr/bin/env bash
# More roles than scope counters (0.4.0, quota.scope_counters): with 128 counters
# (windows of 64) and 300 roles, counters keep giving their entries up to other roles'
# and are rebuilt from the ledger when read again, and a role whose window holds only
# counters read in the last 2 s goes without one (src/scopes.rs, core::counters).
# Admission stays exact through that: every role is admitted exactly the room its own
# tickets leave (a counter taken over with its old numbers, or a change applied to the
# wrong role, would admit more or fewer), dropped roles leave tombstones that new roles
# get past, and under load, while other roles take idle counters' entries or go
# without, no role's committed active count passes its limit (I1) and each is left
# exactly its room.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5741 + PORT_OFFSET))}"
with_cluster scope_counters_full "quota.scope_counters = 128" "log_min_messages = debug1"
LIMIT=3
ROLES=300

expect_eq "quota.scope_counters is set at server start" 128 "$(sql -c "SHOW quota.scope_counters")"
expect_eq "... and cannot be changed without a restart (55P02)" 55P02 \
  "$(state postgres postgres "SET quota.scope_counters = 32")"

sql -c "CREATE EXTENSION pg_quota" \
    -c "DO \$\$ BEGIN FOR i IN 1..$ROLES LOOP
          EXECUTE format('CREATE ROLE sf_%s LOGIN', i);
          EXECUTE format('ALTER ROLE sf_%s SET quota.max_active_per_role = $LIMIT', i);
          EXECUTE format('ALTER ROLE sf_%s SET quota.max_retained_per_role = 0', i);
        END LOOP; END \$\$" >/dev/null

# 1. Role k holds k % 3 tickets (limit 3 through SET, as ALTER ROLE applies at login).
sql -c "SET quota.max_active_per_role = $LIMIT" -c "SET quota.max_retained_per_role = 0" \
    -c "DO \$\$ BEGIN FOR k IN 1..$ROLES LOOP
          EXECUTE format('SET ROLE sf_%s', k);
          FOR j IN 1..k % 3 LOOP PERFORM quota.start('held'); END LOOP;
          RESET ROLE;
        END LOOP; END \$\$" >/dev/null
expect_eq "every role holds its tickets" "$((ROLES / 3 * 3))" \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE ended_at IS NULL")"

# 2. Two seconds later (the counters read so far may give their entries up), in an
#    order unlike the first, each role asks for 5 more: it must get exactly 3 - k % 3.
ask() {  # ask ROLE-QUERY: 'k:admitted' of each role the query lists whose count is wrong
  sql -c "SET quota.max_active_per_role = $LIMIT" -c "SET quota.max_retained_per_role = 0" \
      -c "CREATE TEMP TABLE got (k text, n int, want int)" \
      -c "DO \$\$ DECLARE n int; r record; BEGIN FOR r IN $1 LOOP
            EXECUTE format('SET ROLE %I', r.name);
            SELECT count(*) INTO n FROM generate_series(1, 5) i WHERE quota.try_start('more ' || i) IS NOT NULL;
            RESET ROLE;
            INSERT INTO got VALUES (r.name, n, r.want);
          END LOOP; END \$\$" \
      -c "SELECT coalesce(string_agg(k || ':' || n || '/' || want, ' '), '') || ' (' || count(*) || ' roles)' FROM got WHERE n <> want" \
      -c "SELECT count(*) FROM got"
}
sleep 2.5
out=$(ask "SELECT 'sf_' || k AS name, $LIMIT - k % 3 AS want FROM generate_series(1, $ROLES) k ORDER BY (k * 7919) % $ROLES")
expect_eq "each of the $ROLES roles is admitted exactly the room its tickets leave" " (0 roles)" "$(head -1 <<<"$out")"
expect_eq "... all of them were asked" "$ROLES" "$(tail -1 <<<"$out")"
evicted=$(grep -c "gave its place up" "$CL/server.log" || true)
check "counters gave their places up to other roles ($evicted times)" test "${evicted:-0}" -gt 50
expect_eq "... and now every role is at its limit" "$((ROLES * LIMIT))" \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE ended_at IS NULL")"
expect_eq "... and refused (53400)" 53400 "$(state sf_7 postgres "SELECT quota.start('over')")"

# Dropped roles leave tombstones in the windows; new roles are placed past them, and
# the roles left keep their counts.
sql -c "DO \$\$ BEGIN FOR k IN 201..$ROLES LOOP EXECUTE format('DROP ROLE sf_%s', k); END LOOP;
          FOR k IN 1..100 LOOP EXECUTE format('CREATE ROLE nf_%s LOGIN', k); END LOOP; END \$\$" >/dev/null
sleep 2.5
out=$(ask "SELECT name, want FROM (SELECT 'nf_' || k AS name, $LIMIT AS want, k FROM generate_series(1, 100) k
            UNION ALL SELECT 'sf_' || k, 0, k + 100 FROM generate_series(1, 200) k) s ORDER BY (k * 7919) % 300")
expect_eq "after 100 roles were dropped, 100 new roles get their full room and the others none" " (0 roles)" "$(head -1 <<<"$out")"
sql -c "SELECT quota.finish(id) FROM quota.ledger WHERE ended_at IS NULL" >/dev/null
expect_eq "the superuser finished them all" 0 "$(sql -c "SELECT count(*) FROM quota.ledger WHERE ended_at IS NULL")"
ROLES=48

# 3. Under load: 6 roles (sf_1..sf_6, limit 2 now) cycle start / finish rolled back /
#    finish, 3 sessions each, while a churner starts and finishes a ticket for each of
#    the other 42 roles in turn: with 128 counters taken by earlier phases, the churned
#    roles take the places of idle counters (phase 2's roles) or, where their window
#    was read lately, are counted from the ledger, beside the loaded roles' counters.
#    A sampler watches each loaded role's committed active count.
sql -c "CREATE TABLE public.sf_stop (x int)" \
    -c "CREATE FUNCTION public.sf_cycle() RETURNS void LANGUAGE plpgsql AS \$\$
          DECLARE t uuid;
          BEGIN
            t := quota.try_start('cycle');
            IF t IS NULL THEN RETURN; END IF;
            BEGIN
              PERFORM quota.finish(t);
              RAISE EXCEPTION 'roll the finish back';
            EXCEPTION WHEN raise_exception THEN NULL;
            END;
            PERFORM pg_sleep(0.001);
            PERFORM quota.finish(t);
          END \$\$" \
    -c "GRANT SELECT ON public.sf_stop TO PUBLIC" \
    -c "DO \$\$ BEGIN FOR i IN 1..6 LOOP
          EXECUTE format('ALTER ROLE sf_%s SET quota.max_active_per_role = 2', i);
        END LOOP; END \$\$" >/dev/null
LIMIT=2
echo "SELECT public.sf_cycle();" > "$CL/cycle.sql"
start_sampler public.sf_stop "SELECT coalesce(max(c), 0) FROM (SELECT count(*) AS c FROM quota.ledger
  WHERE ended_at IS NULL AND role::regrole::text IN ('sf_1','sf_2','sf_3','sf_4','sf_5','sf_6') GROUP BY role) s"
# Each statement its own transaction, so that each finish commits.
for _ in $(seq 1 200); do
  for i in $(seq 7 $ROLES); do echo "SET ROLE sf_$i; SELECT quota.finish(quota.start('churn')); RESET ROLE;"; done
done > "$CL/churn.sql"
bg bash -c "'$PG_BIN/psql' -X -q -h '$CL' -p '$PORT' -U postgres -f '$CL/churn.sql' > '$CL/churn.out' 2>&1"
churner=$LAST_BG
loaders=()
for k in 1 2 3 4 5 6; do
  bg bash -c "'$PG_BIN/pgbench' -n -h '$CL' -p '$PORT' -U sf_$k -c 3 -j 1 -T 8 -f '$CL/cycle.sql' postgres > '$CL/pgbench.$k' 2>&1"
  loaders+=("$LAST_BG")
done
wait "${loaders[@]}" || true
kill -- "-$churner" 2>/dev/null || true
stop_sampler public.sf_stop

processed=$(cat "$CL"/pgbench.* | sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' | awk '{s += $1} END {print s + 0}')
admitted=$(sql -c "SELECT count(*) FROM quota.ledger WHERE label = 'cycle'")
check "the load ran (${processed:-0} cycles, ${admitted:-0} admitted)" test "${admitted:-0}" -gt 500
churned=$(sql -c "SELECT count(*) FROM quota.ledger WHERE label = 'churn'")
check "the churner ran through the other roles (${churned:-0} tickets)" test "${churned:-0}" -gt "$((ROLES - 6))"
max=$SAMPLED_MAX; samples=$SAMPLES
check "the sampler ran (${samples:-0} samples)" test "${samples:-0}" -gt 100
check "no loaded role's committed active count passed $LIMIT (max ${max:-?})" test "${max:-99}" -le "$LIMIT"
wrong=""
for k in 1 2 3 4 5 6; do
  active=$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'sf_$k'::regrole AND ended_at IS NULL")
  got=$(psql_as "sf_$k" -c "SELECT count(*) FROM generate_series(1, $((LIMIT + 2))) i WHERE quota.try_start('after ' || i) IS NOT NULL")
  [ "$got" = "$((LIMIT - active))" ] || wrong+=" sf_$k:$got/$((LIMIT - active))"
done
expect_eq "after the load, each loaded role is admitted exactly the room the ledger leaves" "" "$wrong"
finish_checks
