#!/usr/bin/env bash
# I1 under load: many sessions racing at the limit never get more tickets than the
# limit, whether they commit, roll back, or finish as they go.
source "$(dirname "$0")/../../scripts/lib.sh"
with_cluster stress "max_connections = 120"

CLIENTS="${STRESS_CLIENTS:-32}"
sql <<'SQL'
CREATE EXTENSION pg_quota;
CREATE ROLE stress_tenant LOGIN;
CREATE TABLE got (ticket uuid NOT NULL);
GRANT INSERT, SELECT ON got TO stress_tenant;

-- One unit of work that holds its ticket while it sits on one of L "seats"
-- (advisory locks). With at most L active tickets, a free seat always exists; an
-- extra admission would leave some holder without a seat.
CREATE FUNCTION stress_step(seats int) RETURNS int LANGUAGE plpgsql AS $$
DECLARE t uuid; seat int;
BEGIN
  t := quota.try_start('stress');
  IF t IS NULL THEN RETURN 0; END IF;
  FOR s IN 1..seats LOOP
    IF pg_try_advisory_lock(4242, s) THEN seat := s; EXIT; END IF;
  END LOOP;
  IF seat IS NULL THEN
    RAISE EXCEPTION 'I1 violated: a ticket was admitted while % others were active', seats;
  END IF;
  PERFORM pg_sleep(0.001);
  PERFORM pg_advisory_unlock(4242, seat);
  PERFORM quota.finish(t);
  RETURN 1;
END $$;
SQL

race() {  # race LIMIT: CLIENTS sessions try to start 5 tickets each, 1 in 10 rolled back
  local limit="$1"
  sql -c "TRUNCATE got" -c "ALTER ROLE stress_tenant SET quota.max_active_per_role = $limit"
  sql -c "DELETE FROM quota.ledger WHERE role = 'stress_tenant'::regrole" \
      -c "DELETE FROM quota.summary WHERE role = 'stress_tenant'::regrole"
  printf '%s\n' "INSERT INTO got SELECT t FROM (SELECT quota.try_start('race') AS t) s WHERE t IS NOT NULL;" > "$CL/keep.sql"
  printf '%s\n' "BEGIN;" "SELECT quota.try_start('rolled back');" "ROLLBACK;" > "$CL/rollback.sql"
  "$PG_BIN/pgbench" -n -h "$CL" -p "$PORT" -U stress_tenant -c "$CLIENTS" -j 2 -t 5 \
     -f "$CL/keep.sql@9" -f "$CL/rollback.sql@1" postgres > "$CL/pgbench-race.log" 2>&1
  expect_eq "limit $limit: $CLIENTS racing sessions charge exactly the limit" "$limit" \
    "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'stress_tenant'::regrole")"
  check "limit $limit: committed holders never exceed the limit" \
    test "$(sql -c "SELECT count(*) FROM got")" -le "$limit"
}
race 1
race 5

churn_bench() {
  local log="$CL/pgbench-churn-$1.log"
  if "$PG_BIN/pgbench" -n -h "$CL" -p "$PORT" -U stress_tenant -c "$CLIENTS" -j 2 \
       -T "${STRESS_SECONDS:-8}" -f "$CL/churn.sql" postgres > "$log" 2>&1; then
    return 0
  fi
  grep -m3 error "$log"
  return 1
}

churn() {  # churn LIMIT: start, hold, finish, for a while, with seats checking I1
  local limit="$1"
  sql -c "ALTER ROLE stress_tenant SET quota.max_active_per_role = $limit"
  sql -c "DELETE FROM quota.ledger WHERE role = 'stress_tenant'::regrole" \
      -c "DELETE FROM quota.summary WHERE role = 'stress_tenant'::regrole"
  printf '%s\n' "SELECT stress_step($limit);" > "$CL/churn.sql"
  check "limit $limit: $CLIENTS sessions churning never hold more than the limit" churn_bench "$limit"
  local admitted
  admitted=$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'stress_tenant'::regrole")
  check "limit $limit: the churn admitted work ($admitted tickets)" test "$admitted" -gt "$limit"
  expect_eq "limit $limit: every churned ticket was finished" 0 \
    "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'stress_tenant'::regrole AND ended_at IS NULL")"
}
churn 1
churn 3
finish_checks
