#!/usr/bin/env bash
# A charge that synchronous replication never confirmed is not handed out as a ticket
# (design.md I2/I6 across a failover; USER_GUIDE "High availability").
#
# With synchronous_standby_names set, the ledger writer's commit waits for the standby.
# When the writer is terminated, or the postmaster dies (a primary killed as patroni.sh
# does), PostgreSQL's SyncRepWaitForLSN ends that wait early: the charge is committed
# on this server only ("has already committed locally, but might not have been
# replicated"), and PostgreSQL sends its own client nothing. 0.3.1's writer answered
# its callers all the same, so a client could receive a ticket that a promoted standby
# does not have. Now the caller gets 40003 (statement_completion_unknown) instead, and
# the charge stays counted on this server (over-count, never under-count).
#
# Here no standby ever connects ('nobody'), so the writer's commit waits for good until
# it is terminated; the caller must then get 40003 and no ticket.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
with_cluster sync_rep_unconfirmed "quota.writer_idle_timeout = '1h'"
sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE su_tenant LOGIN" \
    -c "ALTER ROLE su_tenant SET quota.max_active_per_role = 5" >/dev/null
expect_eq "a start() without synchronous replication returns a ticket" t \
  "$(as su_tenant postgres "SELECT quota.start('before') IS NOT NULL")"
sql -c "ALTER SYSTEM SET synchronous_standby_names = 'nobody'" -c "SELECT pg_reload_conf()" >/dev/null
# The setting is in force once a commit waits for the standby: a probe commits, waits
# (wait event SyncRep), and is cancelled. The writer rereads the file within 250 ms.
bg bash -c "'$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U postgres -d postgres \
    -c \"SET application_name = 'probe'\" -c 'CREATE TABLE probe ()' > '$CL/probe.out' 2>&1"
probe_waits() {
  [ "$(sql -c "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'probe' AND wait_event = 'SyncRep'")" = 1 ]
}
for _ in $(seq 1 200); do probe_waits && break; sleep 0.05; done
check "a commit waits for the synchronous standby (the probe)" probe_waits
sql -c "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE application_name = 'probe'" >/dev/null
sleep 0.5

bg bash -c "'$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U su_tenant -d postgres -v ON_ERROR_STOP=0 -v VERBOSITY=verbose \
    -c \"SELECT quota.start('waits for the standby')\" -c '\\echo SQLSTATE=:SQLSTATE' > '$CL/caller.out' 2>&1"
writer_in_syncrep() {
  [ "$(sql -c "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer' AND wait_event = 'SyncRep'")" = 1 ]
}
for _ in $(seq 1 200); do writer_in_syncrep && break; sleep 0.05; done
check "the writer's commit waits for the synchronous standby (wait event SyncRep)" writer_in_syncrep
expect_eq "the ticket's row is not yet visible: the commit has not ended" 1 \
  "$(sql -c "SELECT count(*) FROM quota.ledger")"
sql -c "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer'" >/dev/null
timeout 20 bash -c "until grep -q '^SQLSTATE=' '$CL/caller.out'; do sleep 0.05; done" || true
expect_eq "the caller gets 40003 (statement_completion_unknown), not a ticket" 40003 \
  "$(sed -n 's/^SQLSTATE=//p' "$CL/caller.out")"
check "... saying why and that the ticket may be recorded" \
  grep -q "stopped before synchronous replication confirmed the charge" "$CL/caller.out"
check "... and no ticket was printed" bash -c "! grep -Eq '^[0-9a-f-]{36}$' '$CL/caller.out'"
check "PostgreSQL warned that the writer's commit was local only" \
  grep -q "canceling the wait for synchronous replication and terminating connection" "$CL/server.log"

sql -c "ALTER SYSTEM RESET synchronous_standby_names" -c "SELECT pg_reload_conf()" >/dev/null
expect_eq "the charge is committed on this server and stays counted (over-count)" 2 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE ended_at IS NULL")"
check "the tenant sees it in quota.tickets, as the hint says" \
  test "$(as su_tenant postgres "SELECT count(*) FROM quota.tickets WHERE label = 'waits for the standby'")" = 1
expect_eq "a new writer serves the next start()" t \
  "$(as su_tenant postgres "SELECT quota.start('after') IS NOT NULL")"
check "quota.summary equals the ledger" summary_matches_ledger
finish_checks
