#!/usr/bin/env bash
# Scope counters shared by several databases (0.4.1, F2). A counter read in the last
# 2 s keeps its entry (core::counters), whichever database it counts for. 0.4.0 judged
# the counters of other databases by the caller's own relations, found them all
# stale, and evicted them first: two busy databases whose scopes share windows evicted
# each other's counters on every call, each eviction a rebuild under the counters'
# exclusive lock.
#
# With 16 counters (one window), database sb's 15 roles and database sa's a1 take
# every entry; all are read again, then within the same second a2 (a role of sa with a
# summary row but no counter) asks: no entry may be given up. 2.5 s later a3 asks, and
# the least recently read counter gives its entry up.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5763 + PORT_OFFSET))}"
with_cluster scope_counters_databases "quota.scope_counters = 16" "log_min_messages = debug1"
for d in sa sb; do
  sql -c "CREATE DATABASE $d" >/dev/null
  sql -d "$d" -c "CREATE EXTENSION pg_quota" >/dev/null
done
sql -c "DO \$\$ BEGIN
          FOR i IN 1..15 LOOP EXECUTE format('CREATE ROLE b%s', i); END LOOP;
          FOR i IN 1..3 LOOP EXECUTE format('CREATE ROLE a%s', i); END LOOP;
        END \$\$" >/dev/null
# run DB ROLES SQL: SQL (a statement) once as each role of ROLES (a SQL set of names),
# in one session; its own settings, since ALTER ROLE's apply at login only.
run() {
  sql -d "$1" -c "SET quota.max_active_per_role = 5" -c "SET quota.max_retained_per_role = 0" \
      -c "DO \$\$ DECLARE r text; BEGIN FOR r IN $2 LOOP
            EXECUTE format('SET ROLE %I', r); $3; RESET ROLE;
          END LOOP; END \$\$" >/dev/null
}
evictions() { grep -c "gave its place up" "$CL/server.log" || true; }
# Each call builds the counter of a scope whose summary row exists (from its first
# admission on); a2 and a3 get their summary rows first, while the table has room.
run sa "SELECT unnest(ARRAY['a2', 'a3'])" "PERFORM quota.finish(quota.start())"
run sb "SELECT 'b' || i FROM generate_series(1, 15) i" "PERFORM quota.finish(quota.start()); PERFORM quota.finish(quota.start())"
run sa "SELECT 'a1'" "PERFORM quota.finish(quota.start()); PERFORM quota.finish(quota.start())"
expect_eq "the 16 counters were placed without evicting any" 0 "$(evictions)"

# A session of sb keeps reading its 15 counters (try_start, refused at the limit once a
# role holds 5) until told to stop, so that they are read lately whatever the timing.
sql -d sb -c "CREATE TABLE public.stop (x int)" >/dev/null
cat > "$CL/reader.sql" <<'SQL'
SET quota.max_active_per_role = 5;
SET quota.max_retained_per_role = 0;
DO $$ BEGIN
  WHILE NOT EXISTS (SELECT 1 FROM public.stop) LOOP
    FOR i IN 1..15 LOOP EXECUTE format('SET ROLE b%s', i); PERFORM quota.try_start(); RESET ROLE; END LOOP;
  END LOOP;
END $$;
SQL
bg bash -c "'$PG_BIN/psql' -X -q -h '$CL' -p '$PORT' -U postgres -d sb -f '$CL/reader.sql' > '$CL/reader.out' 2>&1"
reader=$LAST_BG
sleep 1
run sa "SELECT 'a1'" "PERFORM quota.finish(quota.start())"
run sa "SELECT 'a2'" "PERFORM quota.finish(quota.start())"
expect_eq "a2 took no entry from the counters read within the last 2 s, of either database" 0 "$(evictions)"
{ grep "gave its place up" "$CL/server.log" || true; } | sed "s/^/# /" | head -3
sql -d sb -c "INSERT INTO public.stop VALUES (1)" >/dev/null
timeout 30 tail --pid="$reader" -f /dev/null || true
check "the reader of sb's counters ran until told to stop" test -z "$(grep ERROR "$CL/reader.out" || true)"

sleep 2.5
run sa "SELECT 'a3'" "PERFORM quota.finish(quota.start())"
check "2.5 s later, a3 takes the entry of the least recently read counter ($(evictions) evicted)" \
  test "$(evictions)" -ge 1
expect_eq "sa's tickets were all finished" 0 \
  "$(sql -d sa -c "SELECT count(*) FROM quota.ledger WHERE ended_at IS NULL")"
finish_checks
