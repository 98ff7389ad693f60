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
# it is terminated; the caller must then get 40003 and no ticket. Then:
# - a repeat of that start's idempotency key must not get the ticket at once either:
#   the writer answers it after waiting for the standby (40003 if terminated there);
# - a cancel of the writer (pg_cancel_backend) during a commit's wait also gives 40003
#   (PostgreSQL leaves no flag for it; the standby's confirmed position tells);
# - once synchronous_standby_names is reset, a repeat gets the key's ticket.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
with_cluster sync_rep_unconfirmed "quota.writer_idle_timeout = '1h'"
sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE su_tenant LOGIN" \
    -c "ALTER ROLE su_tenant SET quota.max_active_per_role = 5" >/dev/null
expect_eq "a start() without synchronous replication returns a ticket" t \
  "$(as su_tenant postgres "SELECT quota.start('before') IS NOT NULL")"
# standby_waited_for: synchronous_standby_names = 'nobody', in force once a commit waits
# for the standby: a probe commits, waits (wait event SyncRep), and is cancelled. The
# writer rereads the file within 250 ms.
PROBES=0
standby_waited_for() {
  PROBES=$((PROBES + 1))
  sql -c "ALTER SYSTEM SET synchronous_standby_names = 'nobody'" -c "SELECT pg_reload_conf()" >/dev/null
  bg bash -c "'$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U postgres -d postgres \
      -c \"SET application_name = 'probe'\" -c 'CREATE TABLE probe_$PROBES ()' > '$CL/probe.out' 2>&1"
  probe_waits() {
    [ "$(sql -c "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'probe' AND wait_event = 'SyncRep'")" = 1 ]
  }
  for _ in $(seq 1 200); do probe_waits && break; sleep 0.05; done
  check "a commit waits for the synchronous standby (the probe)" probe_waits
  sql -c "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE application_name = 'probe'" >/dev/null
  sleep 0.5
}
standby_waited_for

# caller NAME SQL: runs SQL as su_tenant in the background, into $CL/NAME.out, ending
# with the SQLSTATE of its last statement.
caller() {
  bg bash -c "'$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U su_tenant -d postgres -v ON_ERROR_STOP=0 -v VERBOSITY=verbose \
      -c \"$2\" -c '\\echo SQLSTATE=:SQLSTATE' > '$CL/$1.out' 2>&1"
}
answered() { timeout 20 bash -c "until grep -q '^SQLSTATE=' '$CL/$1.out'; do sleep 0.05; done" || true; }
sqlstate_of() { sed -n 's/^SQLSTATE=//p' "$CL/$1.out"; }
caller caller "SELECT quota.start('waits for the standby', idempotency_key => 'k1')"
writer_in_syncrep() {
  [ "$(sql -c "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer' AND wait_event = 'SyncRep'")" = 1 ]
}
wait_writer_in_syncrep() {  # 10 s at most
  for _ in $(seq 1 200); do writer_in_syncrep && return; sleep 0.05; done
}
wait_writer_in_syncrep
check "the writer's commit waits for the synchronous standby (wait event SyncRep)" writer_in_syncrep
expect_eq "the ticket's row is not yet visible: the commit has not ended" 1 \
  "$(sql -c "SELECT count(*) FROM quota.ledger")"
sql -c "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer'" >/dev/null
answered caller
expect_eq "the caller gets 40003 (statement_completion_unknown), not a ticket" 40003 "$(sqlstate_of caller)"
check "... saying why and that the ticket may be recorded" \
  grep -q "stopped before synchronous replication confirmed the charge" "$CL/caller.out"
check "... and no ticket was printed" bash -c "! grep -Eq '^[0-9a-f-]{36}$' '$CL/caller.out'"
check "PostgreSQL warned that the writer's commit was local only" \
  grep -q "canceling the wait for synchronous replication and terminating connection" "$CL/server.log"


# A writer past its start (a new writer's first summary rebuild would wait for the
# standby too): served while no standby is waited for, then 'nobody' again.
sql -c "ALTER SYSTEM RESET synchronous_standby_names" -c "SELECT pg_reload_conf()" >/dev/null
sleep 0.5
expect_eq "with no standby waited for, a new writer serves a start" t \
  "$(as su_tenant postgres "SELECT quota.start('warm') IS NOT NULL")"
standby_waited_for

# pg_cancel_backend ends a commit's wait for the standby as well, with a WARNING and
# no flag; the standby's confirmed position tells.
caller cancelled "SELECT quota.start('cancelled wait', idempotency_key => 'k2')"
wait_writer_in_syncrep
check "a new start's commit waits for the standby" writer_in_syncrep
sql -c "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer'" >/dev/null
answered cancelled
expect_eq "a cancel of the writer in that wait answers 40003, not the ticket" 40003 "$(sqlstate_of cancelled)"
check "... and the writer goes on (it was cancelled, not terminated)" \
  test "$(sql -c "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer'")" = 1

# A repeat of k1 must not hand out its unconfirmed ticket either: the writer answers
# it, and waits for the standby first (before, the caller's own session found the
# ticket and returned it at once).
caller repeat "SELECT quota.start(idempotency_key => 'k1')"
wait_writer_in_syncrep
check "a repeat of the key waits for the standby: the writer waits in SyncRep" writer_in_syncrep
check "... and the repeat has no answer meanwhile" bash -c "! grep -q '^SQLSTATE=' '$CL/repeat.out'"
sql -c "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer'" >/dev/null
answered repeat
expect_eq "terminated in that wait, the writer answers the repeat 40003, not the ticket" 40003 "$(sqlstate_of repeat)"

# Once the standby is no longer waited for, a repeat gets the ticket the key names.
caller confirmed "SELECT quota.start(idempotency_key => 'k1')"
wait_writer_in_syncrep
check "the next repeat waits for the standby too (a new writer)" writer_in_syncrep
sql -c "ALTER SYSTEM RESET synchronous_standby_names" -c "SELECT pg_reload_conf()" >/dev/null
answered confirmed
expect_eq "with synchronous_standby_names reset, the repeat returns the key's ticket" \
  "$(sql -c "SELECT id FROM quota.ledger WHERE idempotency_key = 'k1'") 00000" \
  "$(grep -Eo '^[0-9a-f-]{36}$' "$CL/confirmed.out") $(sqlstate_of confirmed)"
expect_eq "the charges are committed on this server and stay counted (over-count)" 4 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE ended_at IS NULL")"
check "the tenant sees it in quota.tickets, as the hint says" \
  test "$(as su_tenant postgres "SELECT count(*) FROM quota.tickets WHERE label = 'waits for the standby'")" = 1
expect_eq "a new writer serves the next start()" t \
  "$(as su_tenant postgres "SELECT quota.start('after') IS NOT NULL")"
check "quota.summary equals the ledger" summary_matches_ledger
finish_checks
