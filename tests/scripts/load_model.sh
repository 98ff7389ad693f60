#!/usr/bin/env bash
# I1 and I2 under load, against a model: 64 sessions of one tenant start (start and
# try_start), hold, finish, roll back starts and finishes, and abandon tickets that
# others finish later. At no instant do clients hold more tickets than the limit (each
# holder must take one of L advisory-lock "seats"), and at the end the ledger matches
# what the clients saw: active = received - finished (by committed finishes), with the
# tickets of rolled-back starts counted as received.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5523 + PORT_OFFSET))}"
with_cluster load_model "max_connections = 120"

CLIENTS="${LOAD_CLIENTS:-64}"
TX="${LOAD_TX:-300}"   # transactions per client and limit
# LOAD_SEAT_DELTA=1 gives the clients one seat fewer than the limit: the seat check must
# then fail, which shows that it can.
SEAT_DELTA="${LOAD_SEAT_DELTA:-0}"

sql <<'SQL'
CREATE EXTENSION pg_quota;
-- The model: every ticket a client received (kind says how), and every ticket a
-- client finished with a finish() that returned true in a transaction that committed.
CREATE TABLE received (ticket uuid PRIMARY KEY, kind text NOT NULL);
CREATE TABLE finished (ticket uuid PRIMARY KEY);
CREATE SEQUENCE refusals;
GRANT SELECT, INSERT ON received, finished TO PUBLIC;
GRANT USAGE ON SEQUENCE refusals TO PUBLIC;

-- A client that holds a ticket sits on one of L seats (session advisory locks) from
-- when start() returned until just before it finishes the ticket. With at most L active tickets a seat is always
-- free; a ticket admitted past the limit would find every seat taken.
-- (The FOR variable is local to the loop: copy it out before EXIT.)
CREATE FUNCTION take_seat(seats int) RETURNS int LANGUAGE plpgsql AS $$
DECLARE seat int;
BEGIN
  FOR s IN 1..seats LOOP
    IF pg_try_advisory_lock(4343, s) THEN seat := s; EXIT; END IF;
  END LOOP;
  IF seat IS NULL THEN
    RAISE EXCEPTION 'I1 violated: a ticket was admitted while all % seats were held', seats;
  END IF;
  RETURN seat;
END $$;

-- start() that turns a refusal into NULL, so that pgbench goes on; the refusal is
-- caught in a subtransaction, as applications do.
CREATE FUNCTION start_or_null(label text) RETURNS uuid LANGUAGE plpgsql AS $$
BEGIN
  RETURN quota.start(label);
EXCEPTION WHEN configuration_limit_exceeded THEN
  RETURN NULL;
END $$;
SQL

# The pgbench scripts. :L is the limit (and the number of seats).
got='SELECT coalesce(t::text, '"''"') AS t, (t IS NOT NULL)::int AS got FROM (SELECT %s AS t) s \gset'
finish_and_record() {  # $1: the outcome
  printf '%s\n' "BEGIN;" "SELECT quota.finish(':t', '$1') AS ok \\gset" \
    "INSERT INTO finished SELECT ':t' WHERE ':ok'::boolean;" "COMMIT;"
}
{ # start in a transaction that commits; hold; finish.
  echo "BEGIN;"; printf "$got\n" "quota.try_start('commit')"
  echo '\if :got'
  echo "SELECT take_seat(:L) AS seat \\gset"
  echo "INSERT INTO received VALUES (':t', 'commit');"
  echo "COMMIT;"
  echo "SELECT pg_sleep(random() * 0.002);"
  echo "SELECT pg_advisory_unlock(4343, :seat);"
  finish_and_record succeeded
  echo '\else'; echo "COMMIT;"; echo "SELECT nextval('refusals');"; echo '\endif'
} > "$CL/commit.sql"
{ # start() (raising, caught) in autocommit; hold; finish.
  printf "$got\n" "start_or_null('start')"
  echo '\if :got'
  echo "SELECT take_seat(:L) AS seat \\gset"
  echo "INSERT INTO received VALUES (':t', 'start');"
  echo "SELECT pg_sleep(random() * 0.002);"
  echo "SELECT pg_advisory_unlock(4343, :seat);"
  finish_and_record failed
  echo '\else'; echo "SELECT nextval('refusals');"; echo '\endif'
} > "$CL/start.sql"
{ # start, then the transaction rolls back: the ticket stays charged; finish it.
  echo "BEGIN;"; printf "$got\n" "quota.try_start('rolled back')"
  echo '\if :got'
  echo "SELECT take_seat(:L) AS seat \\gset"
  echo "ROLLBACK;"
  echo "INSERT INTO received VALUES (':t', 'rolled back');"
  echo "SELECT pg_advisory_unlock(4343, :seat);"
  finish_and_record cancelled
  echo '\else'; echo "ROLLBACK;"; echo "SELECT nextval('refusals');"; echo '\endif'
} > "$CL/rollback.sql"
{ # start, then the finish rolls back: the ticket stays active; finish it again.
  printf "$got\n" "quota.try_start('finish rolled back')"
  echo '\if :got'
  echo "SELECT take_seat(:L) AS seat \\gset"
  echo "INSERT INTO received VALUES (':t', 'finish rolled back');"
  echo "BEGIN;"; echo "SELECT quota.finish(':t');"; echo "ROLLBACK;"
  echo "SELECT pg_sleep(random() * 0.002);"
  echo "SELECT pg_advisory_unlock(4343, :seat);"
  finish_and_record succeeded
  echo '\else'; echo "SELECT nextval('refusals');"; echo '\endif'
} > "$CL/finish_rollback.sql"
{ # start, roll back, and abandon the ticket (another session finishes it later).
  echo "BEGIN;"; printf "$got\n" "quota.try_start('abandoned')"
  echo "ROLLBACK;"
  echo '\if :got'
  echo "INSERT INTO received VALUES (':t', 'abandoned');"
  echo '\else'; echo "SELECT nextval('refusals');"; echo '\endif'
} > "$CL/abandon.sql"
{ # finish one abandoned ticket, if any (the tenant finishes its own tickets).
  echo "SELECT coalesce(x::text, '') AS t, (x IS NOT NULL)::int AS has FROM (SELECT (SELECT r.ticket FROM received r WHERE r.kind = 'abandoned' AND NOT EXISTS (SELECT 1 FROM finished f WHERE f.ticket = r.ticket) ORDER BY random() LIMIT 1) AS x) s \\gset"
  echo '\if :has'
  finish_and_record cancelled
  echo '\endif'
} > "$CL/reap.sql"
chmod 644 "$CL"/*.sql

run() {  # run LIMIT
  local limit="$1" role="lm_l$1" log="$CL/pgbench-$1.log"
  sql -c "TRUNCATE received, finished" -c "SELECT setval('refusals', 1, false)" \
      -c "CREATE ROLE $role LOGIN" \
      -c "ALTER ROLE $role SET quota.max_active_per_role = $limit" \
      -c "ALTER ROLE $role SET quota.max_retained_per_role = 0" >/dev/null
  local rc=0
  timeout 120 "$PG_BIN/pgbench" -n -h "$CL" -p "$PORT" -U "$role" -c "$CLIENTS" -j 8 -t "$TX" -D L="$((limit - SEAT_DELTA))" \
    -f "$CL/commit.sql@8" -f "$CL/start.sql@4" -f "$CL/finish_rollback.sql@2" \
    -f "$CL/rollback.sql@1" -f "$CL/abandon.sql@1" -f "$CL/reap.sql@2" postgres > "$log" 2>&1 || rc=$?
  check "limit $limit: $CLIENTS sessions ran without error (pgbench exit $rc)" test "$rc" = 0
  check "limit $limit: clients never held more tickets than the limit (a seat was always free)" \
    bash -c "! grep -q 'I1 violated' '$log'"
  [ "$rc" = 0 ] || grep -m5 -e error -e ERROR "$log" | sed 's/^/# /'

  local received finished refused active rows
  received=$(sql -c "SELECT count(*) FROM received")
  finished=$(sql -c "SELECT count(*) FROM finished")
  refused=$(sql -c "SELECT last_value - 1 + is_called::int FROM refusals")
  active=$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = '$role'::regrole AND ended_at IS NULL")
  rows=$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = '$role'::regrole")
  check "limit $limit: the load admitted tickets ($received) and hit the limit ($refused refusals)" \
    test "$received" -gt "$limit" -a "$refused" -gt 0
  check "limit $limit: the run ended with tickets of rolled-back starts received" \
    test "$(sql -c "SELECT count(*) FROM received WHERE kind IN ('rolled back', 'abandoned')")" -gt 0
  expect_eq "limit $limit: active in the ledger = received - finished" "$((received - finished))" "$active"
  expect_eq "limit $limit: the ledger holds exactly the received tickets, under the tenant" "$received" "$rows"
  expect_eq "limit $limit: every received ticket is in the ledger under the tenant" "$received" \
    "$(sql -c "SELECT count(*) FROM received r JOIN quota.ledger l ON l.id = r.ticket AND l.role = '$role'::regrole")"
  expect_eq "limit $limit: exactly the finished tickets have ended" 0 \
    "$(sql -c "SELECT count(*) FROM quota.ledger l WHERE l.role = '$role'::regrole
                 AND (l.ended_at IS NOT NULL) <> EXISTS (SELECT 1 FROM finished f WHERE f.ticket = l.id)")"
  check "limit $limit: active ($active) <= the limit" test "$active" -le "$limit"
  expect_eq "limit $limit: the summary row counts the ledger rows" "$rows" \
    "$(sql -c "SELECT tickets FROM quota.summary WHERE role = '$role'::regrole")"
}
SECONDS=0
run 1
run 3
run 10
echo "# load_model: ${SECONDS}s"
finish_checks
