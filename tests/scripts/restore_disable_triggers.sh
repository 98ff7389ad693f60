#!/usr/bin/env bash
# A data-only restore with --disable-triggers into a database with pg_quota (design.md
# I9; 0.3.1, item 4). pg_restore wraps each table's data in ALTER TABLE … DISABLE
# TRIGGER ALL and ENABLE TRIGGER ALL, which leaves triggers at ENABLE, not ENABLE
# ALWAYS. pg_quota uses its counters only while its data triggers are ENABLE ALWAYS, so
# after such a restore 0.3.0 counted every start() from the ledger for good, the slow
# path under long transactions, and said nothing. From 0.3.1 any change to those
# triggers empties the summary, and ENABLE sets them back to ENABLE ALWAYS: after the
# restore they are ENABLE ALWAYS, the restored tickets count exactly, and the summary
# agrees with the ledger. The same holds for a plain-format dump run with psql.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
with_cluster restore_disable_triggers
sql -c "CREATE ROLE rd_tenant LOGIN" -c "ALTER ROLE rd_tenant SET quota.max_active_per_role = 3" \
    -c "CREATE DATABASE rd_src" -c "CREATE DATABASE rd_dst" -c "CREATE DATABASE rd_plain" >/dev/null
for db in rd_src rd_dst rd_plain; do sql -d "$db" -c "CREATE EXTENSION pg_quota" >/dev/null; done
as rd_tenant rd_src "SELECT quota.finish(quota.start('ended'))" "SELECT quota.start('active ' || i) FROM generate_series(1, 3) i" >/dev/null
expect_eq "rd_src: the tenant holds 3 active tickets of 4" "3|4" \
  "$(sql -d rd_src -c "SELECT count(*) FILTER (WHERE ended_at IS NULL) || '|' || count(*) FROM quota.ledger")"

# From 0.6.0 the ledger is two tables, quota.active (tickets not ended) and
# quota.history (ended ones), each with the data triggers ledger_written and
# ledger_truncated; quota.ledger is a view over both. pg_restore disables and enables
# the triggers of each table it restores.
states() {  # the data triggers' states, table by table
  sql -d "$1" -c "SELECT string_agg(tgrelid::regclass || '.' || tgname || '=' || tgenabled::text, ' '
                                    ORDER BY tgrelid::regclass::text, tgname) FROM pg_trigger
                   WHERE tgrelid IN ('quota.active'::regclass, 'quota.history'::regclass, 'quota.summary'::regclass)
                     AND tgname <> 'repack_trigger'"
}
WANT="quota.active.ledger_truncated=A quota.active.ledger_written=A quota.history.ledger_truncated=A quota.history.ledger_written=A quota.summary.summary_written=A"

"$PG_BIN/pg_dump" -h "$CL" -p "$PORT" -U postgres -Fc --data-only -d rd_src -f "$CL/data.dump"
out=$("$PG_BIN/pg_restore" -h "$CL" -p "$PORT" -U postgres --data-only --disable-triggers -d rd_dst "$CL/data.dump" 2>&1) \
  && rc=0 || rc=$?
check "pg_restore --data-only --disable-triggers succeeds${out:+: $(head -c 300 <<<"$out")}" test "$rc" = 0
expect_eq "rd_dst: the restored tickets are there" "3|4" \
  "$(sql -d rd_dst -c "SELECT count(*) FILTER (WHERE ended_at IS NULL) || '|' || count(*) FROM quota.ledger")"
expect_eq "rd_dst: pg_quota's data triggers are ENABLE ALWAYS again" "$WANT" "$(states rd_dst)"
check "rd_dst: quota.summary agrees with the ledger" summary_matches_ledger rd_dst
expect_eq "rd_dst: the tenant, at its limit with the restored tickets, is refused" 53400 \
  "$(state rd_tenant rd_dst "SELECT quota.start('over')")"
expect_eq "rd_dst: one finished, one more is admitted, and the next refused" "t t 53400" \
  "$(as rd_tenant rd_dst "SELECT quota.finish(id) FROM quota.tickets WHERE label = 'active 1'") $(as rd_tenant rd_dst "SELECT quota.start('fits') IS NOT NULL") $(state rd_tenant rd_dst "SELECT quota.start('over')")"

"$PG_BIN/pg_dump" -h "$CL" -p "$PORT" -U postgres --data-only --disable-triggers -d rd_src -f "$CL/data.sql"
out=$("$PG_BIN/psql" -X -q -h "$CL" -p "$PORT" -U postgres -d rd_plain -v ON_ERROR_STOP=1 -f "$CL/data.sql" 2>&1) && rc=0 || rc=$?
check "a plain data-only dump with --disable-triggers restores with psql${out:+: $(head -c 300 <<<"$out")}" test "$rc" = 0
expect_eq "rd_plain: pg_quota's data triggers are ENABLE ALWAYS" "$WANT" "$(states rd_plain)"
check "rd_plain: quota.summary agrees with the ledger" summary_matches_ledger rd_plain
finish_checks
