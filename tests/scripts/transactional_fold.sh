#!/usr/bin/env bash
# The role's summary row and transactional tickets (0.5.0). A transactional start must
# not update its role's summary row in the caller's transaction; the row counts the
# role's transactional tickets below its `folded` txid, the others are counted from
# the ledger's txid indexes, and the ledger writer folds them in and purges what is past
# retention (writer/fold.rs), though no start of the role ever reaches it.
# From 0.6.0 the ledger is two tables, quota.active (tickets not ended) and
# quota.history (ended ones), each with its txid index (active_txid_idx,
# history_txid_idx); quota.ledger, which the checks below read, is a view over both.
# The finished tickets of 1. and 3. are in quota.history, the unfolded one of 2. in
# quota.active. No check needed another target.
# 1. A writer-committed ticket gives the role its summary row; 20 transactional
#    tickets, committed and finished, are not in it at their commit; the writer folds
#    them in. From 0.7.0 the summary counts units: half of the 20 weigh 2, so the fold
#    adds 30 units (seen failing with the fold counting tickets: 21, not 31).
# 2. After a restart (every counter rebuilt from the summary and the index) the role,
#    at 32 retained units of 35 (one more unfolded ticket of weight 1), is admitted
#    exactly 3 more, transactional or not.
# 3. With retention 1 s everywhere, the fold pass purges the ended tickets: the
#    summary row equals the ledger again.
# 4. So it does for a role limited per tenant only, which has no summary row.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5768 + PORT_OFFSET))}"
with_cluster transactional_fold "quota.writer_idle_timeout = '1h'"
sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE tfold LOGIN" \
    -c "ALTER ROLE tfold SET quota.max_active_per_role = 0" \
    -c "ALTER ROLE tfold SET quota.max_retained_per_role = 35" \
    -c "ALTER ROLE tfold SET quota.retention = '1h'" \
    -c "ALTER ROLE tfold SET quota.allow_transactional = on" >/dev/null
for i in $(seq 1 20); do
  echo "SELECT quota.finish(quota.start(weight => $((1 + i % 2)), label => 't$i', transactional => true));"
done > "$CL/twenty.sql"
chmod 644 "$CL/twenty.sql"
# A writer-committed ticket first: the writer gives the role its summary row.
as tfold postgres "SELECT quota.finish(quota.start('first'))" >/dev/null
expect_eq "a writer-committed ticket gives the role its summary row" 1 \
  "$(sql -c "SELECT tickets FROM quota.summary WHERE role = 'tfold'::regrole")"
psql_as tfold -f "$CL/twenty.sql" >/dev/null
expect_eq "then 20 transactional tickets" "21 20" \
  "$(sql -c "SELECT count(*) || ' ' || count(txid) FROM quota.ledger WHERE role = 'tfold'::regrole")"
folded=no
for _ in $(seq 1 100); do
  [ "$(sql -c "SELECT tickets FROM quota.summary WHERE role = 'tfold'::regrole")" = 31 ] && { folded=yes; break; }
  sleep 0.1
done
expect_eq "the writer folds their 30 units into the role's summary row within 10 s (none was in it at its commit)" yes "$folded"
check "quota.summary equals the ledger" summary_matches_ledger

# 2. A restart: counters are rebuilt from the summary row and the unfolded tickets.
stop_cluster "$CL"
as_pg "$PG_BIN/pg_ctl" -D "$CL/data" -l "$CL/server.log" -w -t 60 start >/dev/null
psql_as tfold -c "SELECT quota.start('unfolded', transactional => true)" >/dev/null
expect_eq "after a restart and one more transactional ticket (32 retained units of 35), exactly 3 more are admitted" 3 \
  "$(as tfold postgres "SELECT count(quota.try_start('more ' || i, transactional => i % 2 = 0)) FROM generate_series(1, 6) i")"

# 3. Retention 1 s everywhere: the fold pass purges, though no batch admits the role.
sql -c "ALTER ROLE tfold SET quota.retention = '1s'" -c "ALTER SYSTEM SET quota.retention = '1s'" \
    -c "SELECT pg_reload_conf()" >/dev/null
sql -c "SELECT quota.finish(id) FROM quota.ledger WHERE role = 'tfold'::regrole AND ended_at IS NULL" >/dev/null
sleep 2
psql_as tfold -c "SELECT quota.finish(quota.start('wake', transactional => true))" >/dev/null
purged=no
for _ in $(seq 1 100); do
  [ "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'tfold'::regrole AND ended_at < now() - interval '1 s'")" = 0 ] \
    && { purged=yes; break; }
  sleep 0.1
done
expect_eq "the ended tickets past retention were purged by the writer" yes "$purged"
matched() {
  local i
  for i in $(seq 1 100); do summary_matches_ledger && return 0; sleep 0.1; done
  return 1
}
check "quota.summary equals the ledger after the purge and the folds (within 10 s)" matched

# 4. A role limited only per tenant never counts its own rows, which is what gives a
#    role its summary row otherwise: its history is purged all the same.
# In a database of its own, where no other role's count asks for the summary rebuild.
sql -c "CREATE DATABASE tonly" -c "CREATE ROLE tten LOGIN" \
    -c "ALTER ROLE tten SET quota.max_active_per_role = 0" \
    -c "ALTER ROLE tten SET quota.max_retained_per_role = 0" \
    -c "ALTER ROLE tten SET quota.max_active_per_tenant = 5" \
    -c "ALTER ROLE tten SET quota.allow_transactional = on" >/dev/null
sql -d tonly -c "CREATE EXTENSION pg_quota" >/dev/null
as tten tonly "SELECT count(quota.finish(quota.start('t', tenant => 'acme', transactional => true))) FROM generate_series(1, 10)" >/dev/null
expect_eq "a role limited per tenant only has no summary row at first" 0 \
  "$(sql -d tonly -c "SELECT count(*) FROM quota.summary WHERE role = 'tten'::regrole")"
purged=no
for _ in $(seq 1 100); do
  [ "$(sql -d tonly -c "SELECT count(*) FROM quota.ledger WHERE role = 'tten'::regrole")" = 0 ] && { purged=yes; break; }
  sleep 0.1
done
expect_eq "its ended tickets past retention are purged by the writer within 10 s" yes "$purged"
finish_checks
