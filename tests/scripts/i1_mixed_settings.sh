#!/usr/bin/env bash
# I1 across sessions with different settings: many sessions of ONE role, each running
# with its own quota.retention, race for the last slots of quota.max_active_per_role
# (1, 2 and 3) with start/finish loops in which some finishes roll back. A superuser
# sampler reads the role's committed active count as often as it can; it must never
# exceed the limit. (0.1.0 keyed the writer's per-batch counts by role and retention,
# and its callers took their snapshot before reading the requests in flight, so two
# callers could both be admitted into the last slot.)
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5601 + PORT_OFFSET))}"
with_cluster i1_mixed "max_connections = 120" "autovacuum_naptime = 1"

CLIENTS="${I1_CLIENTS:-20}"      # sessions per round, each with its own retention
SECONDS_PER_ROUND="${I1_SECONDS:-15}"

sql <<'SQL'
CREATE EXTENSION pg_quota;
CREATE TABLE samples (lim int, max_active int, samples bigint);
SQL

# One transaction of a client: as superuser, set this session's own retention (one
# hour per client number, so no two sessions share one) and the limit, become the
# tenant, try to start; hold the ticket a moment; half of the time finish it in a
# transaction that holds the finish a moment and rolls back; then finish it for good.
cat > "$CL/client.sql" <<'PGB'
\set ret 3600 * (:client_id + 1)
\set hold random(1, 4)
\set rb random(0, 1)
RESET ROLE;
SET quota.retention = :ret;
SET quota.max_active_per_role = :L;
SET quota.max_retained_per_role = 0;
SET ROLE :role;
SELECT coalesce(t::text, '') AS t, (t IS NOT NULL)::int AS got FROM (SELECT quota.try_start('mixed') AS t) s \gset
\if :got
SELECT pg_sleep(:hold * 0.001);
\if :rb
BEGIN;
SELECT quota.finish(':t');
SELECT pg_sleep(0.001);
ROLLBACK;
\endif
SELECT quota.finish(':t');
\endif
PGB
chmod 644 "$CL/client.sql"

round() {  # round LIMIT
  local limit="$1" role="i1_l$1" rc=0
  sql -c "CREATE ROLE $role" >/dev/null
  # The sampler: a READ COMMITTED DO block takes a fresh snapshot for every statement,
  # so each iteration reads the latest committed active count.
  cat > "$CL/sampler-$limit.sql" <<SAMPLER
DO \$\$
DECLARE m int := 0; n int; i bigint := 0;
        deadline timestamptz := clock_timestamp() + interval '$((SECONDS_PER_ROUND + 1)) s';
BEGIN
  WHILE clock_timestamp() < deadline LOOP
    SELECT count(*) INTO n FROM quota.ledger WHERE role = '$role'::regrole AND ended_at IS NULL;
    IF n > m THEN m := n; END IF;
    i := i + 1;
  END LOOP;
  INSERT INTO samples VALUES ($limit, m, i);
END \$\$;
SAMPLER
  chmod 644 "$CL/sampler-$limit.sql"
  bg bash -c "'$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U postgres -d postgres -f '$CL/sampler-$limit.sql' > '$CL/sampler-$limit.log' 2>&1"
  local sampler=$LAST_BG
  timeout $((SECONDS_PER_ROUND + 30)) "$PG_BIN/pgbench" -n -h "$CL" -p "$PORT" -U postgres \
    -c "$CLIENTS" -j 2 -T "$SECONDS_PER_ROUND" -D L="$limit" -D role="$role" \
    -f "$CL/client.sql" postgres > "$CL/pgbench-$limit.log" 2>&1 || rc=$?
  timeout 30 tail --pid="$sampler" -f /dev/null || true
  check "limit $limit: $CLIENTS sessions ran without error (pgbench exit $rc)" test "$rc" = 0
  [ "$rc" = 0 ] || grep -m5 -i error "$CL/pgbench-$limit.log" | sed 's/^/# /'

  local max samples tickets active
  max=$(sql -c "SELECT max_active FROM samples WHERE lim = $limit")
  samples=$(sql -c "SELECT samples FROM samples WHERE lim = $limit")
  tickets=$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = '$role'::regrole")
  active=$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = '$role'::regrole AND ended_at IS NULL")
  check "limit $limit: the sampler ran (${samples:-0} samples) and the load admitted work ($tickets tickets)" \
    test "${samples:-0}" -gt 1000 -a "$tickets" -gt "$((limit * 10))"
  check "limit $limit: the committed active count never exceeded the limit (max sampled ${max:-none})" \
    test -n "$max" -a "${max:-99}" -le "$limit"
  check "limit $limit: at the end, active ($active) <= the limit" test "$active" -le "$limit"
}

SECONDS=0
round 1
round 2
round 3
echo "# i1_mixed_settings: ${SECONDS}s"
finish_checks
