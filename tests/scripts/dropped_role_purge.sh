#!/usr/bin/env bash
# A dropped role's tickets are purged even when the writer's first tries fail (0.3.1,
# item 7; design.md I5, I9). After DROP ROLE commits, every writer deletes the role's
# tickets, so that they count for nobody (a later role with the same OID, or whatever
# role has it after a restore elsewhere). The purge waits for locks like any writer
# transaction, at most 5 s; 0.3.0 tried twice (at once and a second later) and then
# never again while the writer ran, so a maintenance lock held across both tries left
# the tickets in place. The writer now tries again every second until a purge commits.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
with_cluster dropped_role_purge "quota.writer_idle_timeout = '1h'"
sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE dp_gone LOGIN" -c "CREATE ROLE dp_stays LOGIN" >/dev/null
as dp_gone postgres "SELECT quota.start('gone ' || i) FROM generate_series(1, 3) i" >/dev/null
as dp_stays postgres "SELECT quota.start('stays')" >/dev/null
GONE_OID=$(sql -c "SELECT 'dp_gone'::regrole::oid")
tickets_of() { sql -c "SELECT count(*) FROM quota.ledger WHERE role::oid = $1"; }
expect_eq "the role holds 3 tickets" 3 "$(tickets_of "$GONE_OID")"

# Maintenance holds the ledger against writes for 12 s, longer than the writer's first
# two tries (reads go on).
: > "$CL/lock.out"
bg bash -c "'$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U postgres -d postgres \
    -c 'BEGIN' -c 'LOCK TABLE quota.ledger IN EXCLUSIVE MODE' -c \"SELECT 'locked'\" \
    -c 'SELECT pg_sleep(12)' -c 'COMMIT' -c \"SELECT 'released'\" > '$CL/lock.out' 2>&1"
timeout 10 bash -c "until grep -q locked '$CL/lock.out'; do sleep 0.05; done"
sql -c "DROP ROLE dp_gone" >/dev/null
sleep 3
expect_eq "while the lock is held, the tickets are still there" 3 "$(tickets_of "$GONE_OID")"
timeout 20 bash -c "until grep -q released '$CL/lock.out'; do sleep 0.1; done"
for _ in $(seq 1 50); do [ "$(tickets_of "$GONE_OID")" = 0 ] && break; sleep 0.1; done
expect_eq "once the lock is gone, the dropped role's tickets are purged" 0 "$(tickets_of "$GONE_OID")"
expect_eq "the other role's ticket stays" 1 "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'dp_stays'::regrole")"
check "the failed tries are in the server log" grep -q "could not purge the tickets of dropped roles" "$CL/server.log"
finish_checks
