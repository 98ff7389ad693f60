#!/usr/bin/env bash
# What other sessions see of pg_quota's waits, in pg_locks and pg_stat_activity (0.3.1).
#
# pg_locks: every role may read it. The scope lock is shown there while a start() holds
# it (locktype advisory, objsubid 20819); 0.3.0 put the role's OID in its tag, so any
# tenant could tell which roles were being admitted. The tag is now a keyed hash of the
# scope: no role's OID is in it.
#
# pg_stat_activity: from PostgreSQL 17 pg_quota names its waits (wait_event_type
# Extension): QuotaWriterReply (a start() waiting for the ledger writer's answer),
# QuotaInFlight (waiting, under the scope lock, for requests of its scope the writer has
# not answered), QuotaCapacity (a start(wait => …) waiting for capacity) and
# QuotaWriterMain (the writer waiting for work). Through 16 each is "Extension".
#
# The set-up: a superuser holds LOCK TABLE quota.ledger, so the writer cannot commit;
# ws_a (limit 1) starts once (its request is in the writer's hands) and again (that
# start waits under the scope lock for the first); ws_b, another tenant, looks.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
with_cluster waits_seen "quota.writer_idle_timeout = '1h'"
sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE ws_a LOGIN" -c "CREATE ROLE ws_b LOGIN" -c "CREATE ROLE ws_c LOGIN" \
    -c "ALTER ROLE ws_a SET quota.max_active_per_role = 1" \
    -c "ALTER ROLE ws_c SET quota.max_active_per_role = 1" >/dev/null
if [ "$PG_MAJOR" -ge 17 ]; then named=1; else named=0; fi
ev() { if [ "$named" = 1 ]; then echo "Extension|$1"; else echo "Extension|Extension"; fi; }
# event_of PID WANT: wait_event_type|wait_event of that backend; WANT if it shows that
# within 2 s (a backend that naps 1 ms between looks is not always asleep when sampled).
event_of() {
  local got
  for _ in $(seq 1 40); do
    got=$(sql -c "SELECT wait_event_type || '|' || wait_event FROM pg_stat_activity WHERE pid = $1")
    [ "$got" = "$2" ] && break
    sleep 0.05
  done
  echo "$got"
}
pid_of() { timeout 10 bash -c "until grep -q '^pid ' '$CL/$1.out' 2>/dev/null; do sleep 0.05; done"; sed -n 's/^pid //p' "$CL/$1.out"; }

expect_eq "a start() brings the writer up" t "$(as ws_c postgres "SELECT quota.start('held') IS NOT NULL")"
WPID=$(sql -c "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer'")
sleep 0.5
expect_eq "the idle writer waits as $(ev QuotaWriterMain)" "$(ev QuotaWriterMain)" "$(event_of "$WPID" "$(ev QuotaWriterMain)")"

# ws_c is at its limit: a start with a wait waits for capacity.
: > "$CL/cap.out"
bg bash -c "'$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U ws_c -d postgres \
    -c \"SELECT 'pid ' || pg_backend_pid()\" -c \"SELECT quota.try_start('waits', wait => '4 s') IS NULL\" > '$CL/cap.out' 2>&1"
CPID=$(pid_of cap); sleep 0.5
expect_eq "a start() waiting for capacity waits as $(ev QuotaCapacity)" "$(ev QuotaCapacity)" "$(event_of "$CPID" "$(ev QuotaCapacity)")"

: > "$CL/lock.out"
bg bash -c "'$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U postgres -d postgres \
    -c 'BEGIN' -c 'LOCK TABLE quota.ledger IN EXCLUSIVE MODE' -c \"SELECT 'locked'\" \
    -c 'SELECT pg_sleep(4)' -c 'COMMIT' -c \"SELECT 'released'\" > '$CL/lock.out' 2>&1"
timeout 10 bash -c "until grep -q locked '$CL/lock.out'; do sleep 0.05; done"
for k in 1 2; do
  : > "$CL/a$k.out"
  bg bash -c "'$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U ws_a -d postgres \
      -c \"SELECT 'pid ' || pg_backend_pid()\" -c \"SELECT quota.try_start('a$k') IS NOT NULL\" > '$CL/a$k.out' 2>&1"
  P[$k]=$(pid_of "a$k")
  sleep 0.5
done
expect_eq "a start() whose request the writer holds waits as $(ev QuotaWriterReply)" "$(ev QuotaWriterReply)" "$(event_of "${P[1]}" "$(ev QuotaWriterReply)")"
expect_eq "a start() waiting for it under the scope lock waits as $(ev QuotaInFlight)" "$(ev QuotaInFlight)" "$(event_of "${P[2]}" "$(ev QuotaInFlight)")"

A_OID=$(sql -c "SELECT 'ws_a'::regrole::oid")
locks=$(psql_as ws_b -c "SELECT classid::oid::text || ' ' || objid::text FROM pg_locks
                           WHERE locktype = 'advisory' AND objsubid = 20819 AND pid = ${P[2]}")
echo "# the scope lock as ws_b sees it: classid objid = [$locks]; ws_a's OID is $A_OID"
check "another tenant sees the scope lock held" test -n "$locks"
check "... but no role's OID in its tag" test -n "$locks" -a "${locks%% *}" != "$A_OID" -a "${locks##* }" != "$A_OID"
expect_eq "... in two fields (64 bits) that are not the same for another scope" 1 \
  "$(psql_as ws_b -c "SELECT count(DISTINCT (classid, objid)) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 20819")"

timeout 15 bash -c "until grep -q released '$CL/lock.out'; do sleep 0.1; done"
timeout 15 bash -c "until grep -qE '^(t|f)$' '$CL/a2.out' && grep -qE '^(t|f)$' '$CL/cap.out'; do sleep 0.1; done"
expect_eq "then the first is admitted, the second refused (limit 1), the waiting start refused in time" "t f t" \
  "$(grep -E '^(t|f)$' "$CL/a1.out") $(grep -E '^(t|f)$' "$CL/a2.out") $(grep -E '^(t|f)$' "$CL/cap.out")"
finish_checks
