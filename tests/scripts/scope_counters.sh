#!/usr/bin/env bash
# The scope counters (src/scopes.rs) stay exact while they are rebuilt under load. A
# counter is rebuilt whenever the summary gets a new relfilenode; VACUUM FULL of
# quota.summary does that every 0.2 s here, while 12 sessions of one role (limit 3)
# start, finish, and roll finishes back (in PL/pgSQL blocks, so in subtransactions).
# Each rebuild races with finishes and batches committing around it. A sampler checks
# that the committed active count never passes the limit (I1), and at the end the role
# must be admitted exactly as many more times as the ledger leaves room for: a finish
# counted twice would admit more, a lost one fewer.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5686 + PORT_OFFSET))}"
with_cluster scope_counters "max_prepared_transactions = 2"
LIMIT=3

sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE sc_tenant LOGIN" \
    -c "ALTER ROLE sc_tenant SET quota.max_active_per_role = $LIMIT" \
    -c "ALTER ROLE sc_tenant SET quota.max_retained_per_role = 0" \
    -c "CREATE TABLE public.sc_stop (x int)" \
    -c "CREATE FUNCTION public.sc_cycle() RETURNS void LANGUAGE plpgsql AS \$\$
          DECLARE t uuid;
          BEGIN
            t := quota.try_start('cycle');
            IF t IS NULL THEN RETURN; END IF;
            PERFORM pg_sleep(0.001);
            BEGIN
              PERFORM quota.finish(t);
              RAISE EXCEPTION 'roll the finish back';
            EXCEPTION WHEN raise_exception THEN NULL;
            END;
            PERFORM quota.finish(t);
          END \$\$"
echo "SELECT public.sc_cycle();" > "$CL/cycle.sql"

# The sampler: the committed active count of the role, as often as it can.
start_sampler public.sc_stop \
  "SELECT count(*) FROM quota.ledger WHERE role = 'sc_tenant'::regrole AND ended_at IS NULL"
# The rebuilds.
bg bash -c "for i in \$(seq 1 40); do [ -e '$CL/stop' ] && break; '$PG_BIN/psql' -X -q -h '$CL' -p '$PORT' -U postgres -c 'VACUUM FULL quota.summary' >/dev/null 2>&1; sleep 0.2; done"
"$PG_BIN/pgbench" -n -h "$CL" -p "$PORT" -U sc_tenant -c 12 -j 2 -T 8 -f "$CL/cycle.sql" postgres > "$CL/pgbench.out" 2>&1 || true
touch "$CL/stop"
stop_sampler public.sc_stop

processed=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$CL/pgbench.out")
check "the load ran (${processed:-0} cycles)" test "${processed:-0}" -gt 100
max=$SAMPLED_MAX; samples=$SAMPLES
check "the sampler ran (${samples:-0} samples)" test "${samples:-0}" -gt 100
check "the committed active count never passed $LIMIT (max ${max:-?})" test "${max:-99}" -le "$LIMIT"
active=$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'sc_tenant'::regrole AND ended_at IS NULL")
room=$(( LIMIT - active ))
got=$(psql_as sc_tenant -c "SELECT count(*) FROM generate_series(1, $((LIMIT + 2))) i WHERE quota.try_start('after ' || i) IS NOT NULL")
expect_eq "after the load, exactly the room the ledger leaves is admitted ($active active)" "$room" "$got"

# COMMIT PREPARED runs in another session, later, where a finish could not be applied to
# the counter: PREPARE TRANSACTION after a finish is refused (0A000) and rolls back, so
# the ticket stays active. A prepared transaction that only started a ticket is fine.
t=$(sql -c "SELECT id FROM quota.ledger WHERE role = 'sc_tenant'::regrole AND ended_at IS NULL LIMIT 1")
out=$(timeout 20 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -v VERBOSITY=verbose -h "$CL" -p "$PORT" -U sc_tenant -d postgres \
        -c "BEGIN" -c "SELECT quota.finish('$t')" -c "PREPARE TRANSACTION 'sc_finish'" -c '\echo SQLSTATE=:SQLSTATE' 2>&1 || true)
check "PREPARE TRANSACTION after a finish is refused with 0A000: $(grep -m1 ERROR <<<"$out")" grep -q "^SQLSTATE=0A000$" <<<"$out"
expect_eq "... nothing was prepared, and the ticket is still active" "0 t" \
  "$(sql -c "SELECT (SELECT count(*) FROM pg_prepared_xacts) || ' ' || (SELECT (ended_at IS NULL)::text FROM quota.ledger WHERE id = '$t')" | sed 's/true/t/')"
expect_eq "... and still counted: the role is at its limit" 53400 "$(state sc_tenant postgres "SELECT quota.start('over')")"
finish_checks
