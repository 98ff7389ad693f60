#!/usr/bin/env bash
# Callers' lock waits are bounded, and start() does not keep relation locks after its
# reads. A tenant's open transaction that called start() must not make a VACUUM FULL of
# the ledger queue behind it (which would in turn queue every later start() without
# bound); and when something else does hold up a queued VACUUM FULL, start() fails with
# 55P03 within seconds instead of hanging.
# From 0.6.0 the ledger is two tables, quota.active (tickets not ended; a start()
# inserts there) and quota.history (ended ones); quota.ledger is a view over both, which
# VACUUM FULL cannot take. start() reads both tables, so the VACUUM FULLs below are of
# both, and the bound is checked behind each.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5683 + PORT_OFFSET))}"
with_cluster maintenance_locks

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
# vacuum_full NAME TABLES: VACUUM FULL TABLES (0.6.0: quota.active, quota.history or
# both) in the background; its exit status goes to $CL/NAME.rc, its output to
# $CL/NAME.out.
vacuum_full() {
  rm -f "$CL/$1.rc"
  bg bash -c "timeout 60 '$PG_BIN/psql' -X -q -At -v ON_ERROR_STOP=1 -h '$CL' -p '$PORT' -U postgres -d postgres \
                -c 'VACUUM FULL $2' > '$CL/$1.out' 2>&1; echo \$? > '$CL/$1.rc'"
}
wait_rc() { timeout "$2" bash -c "until [ -e '$CL/$1.rc' ]; do sleep 0.05; done"; }
# 0.6.0: the ledger's relations are the tables quota.active and quota.history, their
# indexes, and the view quota.ledger.
ledger_locks() {  # ledger_locks PID: locks PID holds on the ledger's tables, their indexes or the view
  sql -c "SELECT count(*) FROM pg_locks WHERE pid = $1 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
            AND relation IN (SELECT unnest(ARRAY['quota.ledger'::regclass, 'quota.active'::regclass, 'quota.history'::regclass])
                             UNION ALL
                             SELECT indexrelid FROM pg_index WHERE indrelid IN ('quota.active'::regclass, 'quota.history'::regclass))"
}

sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE ml_a LOGIN" -c "CREATE ROLE ml_b LOGIN"
psql_as ml_b -c "SELECT quota.finish(quota.start('warm up'))" >/dev/null

# ------------------------------------------------------------------------------------
# 1. Tenant A calls start() in a transaction it keeps open. start() has released its
#    relation locks, so a VACUUM FULL of the ledger (0.6.0: both its tables) runs at
#    once and B is not queued.
# ------------------------------------------------------------------------------------
open_session a ml_a
say a "SELECT 'pid=' || pg_backend_pid();"
wait_out a 'pid='
a_pid=$(sed -n 's/^pid=//p' "$CL/a.out")
say a "BEGIN; SELECT 'ticket=' || quota.start('held open'); SELECT 'started';"
wait_out a started || true
check "A's start() returned a ticket inside its open transaction" grep -q '^ticket=' "$CL/a.out"
expect_eq "A holds no lock on quota.active or quota.history after start() returned" 0 \
  "$(sql -c "SELECT count(*) FROM pg_locks WHERE pid = $a_pid AND relation IN ('quota.active'::regclass, 'quota.history'::regclass)")"
expect_eq "A holds no lock on the ledger's tables, their indexes or the view quota.ledger" 0 "$(ledger_locks "$a_pid")"
expect_eq "A's transaction is still open" "idle in transaction" \
  "$(sql -c "SELECT state FROM pg_stat_activity WHERE pid = $a_pid")"
vacuum_full vf1 "quota.active, quota.history"
check "VACUUM FULL quota.active, quota.history completes within 5 s while A's transaction is open" wait_rc vf1 5
vf1_out=$(tr '\n' ' ' < "$CL/vf1.out" 2>/dev/null || true)
expect_eq "... successfully${vf1_out:+: $vf1_out}" 0 "$(cat "$CL/vf1.rc" 2>/dev/null)"
t0=$(now_ms)
expect_eq "B's start() works meanwhile" t \
  "$(timeout 10 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U ml_b -d postgres \
       -c "SELECT quota.start('beside A') IS NOT NULL" 2>&1)"
check "... within 3 s ($(( $(now_ms) - t0 )) ms)" test $(( $(now_ms) - t0 )) -lt 3000
say a "COMMIT;"
close_session a
wait_rc vf1 30 || true
expect_eq "A's ticket survived (it is in the ledger)" 1 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label = 'held open' AND role = 'ml_a'::regrole")"

# ------------------------------------------------------------------------------------
# 2. The bound: a superuser holds ACCESS SHARE on the ledger, a VACUUM FULL queues
#    behind it, and B's start(), which would queue behind the VACUUM FULL, fails with
#    55P03 within 10 s, naming the table. 0.6.0: start() reads both quota.active and
#    quota.history, so the bound is checked behind a VACUUM FULL of each.
# ------------------------------------------------------------------------------------
for t in active history; do
  open_session s postgres
  say s "BEGIN; LOCK TABLE quota.$t IN ACCESS SHARE MODE; SELECT 'locked';"
  wait_out s locked || true
  vacuum_full "vf2_$t" "quota.$t"
  queued=0
  for _ in $(seq 1 100); do
    [ "$(sql -c "SELECT count(*) FROM pg_stat_activity WHERE query = 'VACUUM FULL quota.$t' AND wait_event_type = 'Lock'")" = 1 ] \
      && { queued=1; break; }
    sleep 0.1
  done
  expect_eq "VACUUM FULL quota.$t queues behind the superuser's ACCESS SHARE lock" 1 "$queued"
  t0=$(now_ms)
  out=$(timeout 30 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U ml_b -d postgres -v ON_ERROR_STOP=0 \
          -c "SELECT quota.start('behind the vacuum of $t')" -c '\echo SQLSTATE=:SQLSTATE' 2>"$CL/bounded.err" || true)
  ms=$(( $(now_ms) - t0 ))
  expect_eq "B's start() behind the queued VACUUM FULL quota.$t fails with 55P03" SQLSTATE=55P03 "$(grep '^SQLSTATE=' <<<"$out" || echo "no answer in $ms ms")"
  check "... within 10 s ($ms ms)" test "$ms" -le 10000
  check "... and its error names quota.$t: $(tr '\n' ' ' < "$CL/bounded.err")" grep -q "quota\.$t" "$CL/bounded.err"
  say s "COMMIT;"
  close_session s
  check "the VACUUM FULL of quota.$t completes once the lock is released" wait_rc "vf2_$t" 30
  expect_eq "... successfully" 0 "$(cat "$CL/vf2_$t.rc" 2>/dev/null)"
  expect_eq "B's start() works again" t \
    "$(timeout 10 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U ml_b -d postgres \
         -c "SELECT quota.start('after the vacuum of $t') IS NOT NULL" 2>&1)"
  expect_eq "the failed start() left no charge" 0 \
    "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label = 'behind the vacuum of $t'")"
done
finish_checks
