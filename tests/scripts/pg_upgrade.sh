#!/usr/bin/env bash
# pg_upgrade carries the charges (I9): a PostgreSQL 15 cluster using pg_quota is upgraded
# with pg_upgrade into a new PostgreSQL 15 cluster (same binaries, same initdb options,
# both preloaded). Every ticket keeps its role name and state, the counts per role
# match, a role at its limit is still refused, and a role's ticket can still be finished
# by that role. pg_upgrade keeps pg_authid OIDs, so a role column of type oid or regrole
# keeps naming the same role; the roles here are created around a gap of unrelated roles
# so that their OIDs would not come out the same by chance.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5646 + PORT_OFFSET))}"
OLD_PORT="$PORT" NEW_PORT=$((PORT + 1)) UPG_OLD_PORT=$((PORT + 2)) UPG_NEW_PORT=$((PORT + 3))
PG_UPGRADE="$PG_BIN/pg_upgrade"
# The options start_cluster gives initdb and postgresql.conf; the new cluster gets the same.
INITDB_OPTS=(-A trust -U postgres --no-sync)

with_cluster pg_upgrade_old
OLD="$CL" NEW="$(dirname "$CL")/pg_upgrade_new"

as() {  # as USER DB SQL...: one session against $CL, output only
  local user="$1" db="$2"; shift 2; local a=() q
  for q in "$@"; do a+=(-c "$q"); done
  timeout 30 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U "$user" -d "$db" -v ON_ERROR_STOP=0 "${a[@]}" 2>/dev/null || true
}
state() {  # state USER DB SQL...: the SQLSTATE of the last statement
  as "$@" '\echo SQLSTATE=:SQLSTATE' | sed -n 's/^SQLSTATE=//p' | tail -n1
}
ledger_of() {
  sql -d app -c "SELECT id, role::regrole::text, coalesce(label, '<null>'), ended_at IS NOT NULL,
                        coalesce(outcome, '-'), started_at, ended_at FROM quota.ledger ORDER BY id"
}
counts_of() {
  sql -d app -c "SELECT role::regrole::text || '|' || count(*) FILTER (WHERE ended_at IS NULL) || '|' || count(*)
                   FROM quota.ledger GROUP BY role ORDER BY 1" | paste -sd' '
}
summary_of() { sql -d app -c "SELECT role::regrole::text || '|' || tickets FROM quota.summary ORDER BY 1" | paste -sd' '; }
usage_of() { sql -d app -c "SELECT role::text, active, retained, next_ageout FROM quota.usage ORDER BY 1"; }
role_oids() { sql -c "SELECT rolname || '=' || oid FROM pg_roles WHERE rolname IN ('t1', 't2') ORDER BY 1" | paste -sd' '; }
summary_agrees() {  # each summary row equals the ledger (a role may lack a row)
  [ "$(sql -d app -c "SELECT count(*) FROM quota.summary s LEFT JOIN
                 (SELECT role, count(*) AS n FROM quota.ledger GROUP BY role) l USING (role)
                WHERE s.tickets IS DISTINCT FROM l.n")" = 0 ]
}
summary_matches_ledger() {
  [ "$(sql -d app -c "SELECT count(*) FROM quota.summary s FULL JOIN
                 (SELECT role, count(*) AS n FROM quota.ledger GROUP BY role) l USING (role)
                WHERE s.tickets IS DISTINCT FROM l.n")" = 0 ]
}

# --- the old cluster: roles around a gap, tickets in several states --------------------
gap() { local i; for i in $(seq 1 "$2"); do echo "CREATE ROLE $1_$i;"; done; }
sql -c "$(gap before 5) CREATE ROLE t1 LOGIN; $(gap gap 40) CREATE ROLE t2 LOGIN;"
sql -c "DROP ROLE gap_3, gap_17, before_2"
sql -c "CREATE DATABASE app" \
    -c "ALTER ROLE t1 IN DATABASE app SET quota.max_active_per_role = 2" \
    -c "ALTER ROLE t2 IN DATABASE app SET quota.max_active_per_role = 4" \
    -c "ALTER ROLE t2 IN DATABASE app SET quota.max_retained_per_role = 3"
sql -d app -c "CREATE EXTENSION pg_quota"

# t1: two ended (succeeded, failed) and two active, its active limit; t2: one active,
# one cancelled, one succeeded, its retained limit; the superuser: one active.
mapfile -t T1_DONE < <(as t1 app "SELECT quota.start('t1 done ' || i) FROM generate_series(1, 2) i")
as t1 app "SELECT quota.finish('${T1_DONE[0]}')" "SELECT quota.finish('${T1_DONE[1]}', 'failed')" >/dev/null
mapfile -t T1_ACTIVE < <(as t1 app "SELECT quota.start(l) FROM unnest(ARRAY['t1 active', NULL]) l")
mapfile -t T2 < <(as t2 app "SELECT quota.start('t2 ' || i) FROM generate_series(1, 3) i")
as t2 app "SELECT quota.finish('${T2[0]}', 'cancelled')" "SELECT quota.finish('${T2[1]}')" >/dev/null
sql -d app -c "SELECT quota.start(E'superuser \\u00e9 ''quoted''')" >/dev/null

expect_eq "the old cluster holds the tickets" "postgres|1|1 t1|2|4 t2|1|3" "$(counts_of)"
expect_eq "t1 is at its active limit in the old cluster" 53400 "$(state t1 app "SELECT quota.start('over')")"
expect_eq "t2 is at its retained limit in the old cluster" 53400 "$(state t2 app "SELECT quota.start('over')")"
check "the old summary equals its ledger" summary_matches_ledger
# Transactional tickets (0.5.0) carry the full id of the transaction that charged them;
# pg_upgrade keeps the cluster's transaction ids, epoch and commit log, so after it none
# is an id the new cluster has not issued yet (none for the writer to adopt, 0.5.2).
sql -c "CREATE DATABASE txdb" -c "CREATE ROLE tx LOGIN" -c "ALTER ROLE tx SET quota.allow_transactional = on" >/dev/null
sql -d txdb -c "CREATE EXTENSION pg_quota" >/dev/null
as tx txdb "BEGIN" "SELECT count(quota.start('tx', transactional => true)) FROM generate_series(1, 3)" "COMMIT" >/dev/null
txids_of() { sql -d txdb -c "SELECT string_agg(txid::text, ',' ORDER BY id) FROM quota.ledger"; }
TXIDS_BEFORE="$(txids_of)"
# A job queue's triggers (0.6.0) depend on the column they read the ticket from, so
# DROP COLUMN is refused. pg_upgrade recreates triggers but not pg_depend: the library
# records the dependency again as the new cluster's trigger is created (seen failing
# without it: the DROP COLUMN went through after the upgrade).
sql -d app -c "CREATE TABLE public.jobs (id int PRIMARY KEY, status text, args jsonb, ticket uuid)" \
    -c "CREATE TRIGGER jobs_done AFTER UPDATE ON public.jobs FOR EACH ROW EXECUTE FUNCTION quota.finish_job('ticket')" \
    -c "CREATE TRIGGER jobs_claimed BEFORE UPDATE ON public.jobs FOR EACH ROW EXECUTE FUNCTION quota.claim_job('args->ticket', '5 min')" >/dev/null
job_columns_kept() {
  expect_eq "$1: DROP COLUMN of finish_job()'s ticket column is refused (2BP01)" 2BP01 \
    "$(state postgres app "ALTER TABLE public.jobs DROP COLUMN ticket")"
  expect_eq "$1: DROP COLUMN of claim_job()'s ticket column is refused (2BP01)" 2BP01 \
    "$(state postgres app "ALTER TABLE public.jobs DROP COLUMN args")"
}
job_columns_kept "the old cluster"
OIDS_BEFORE="$(role_oids)"
LEDGER_BEFORE="$(ledger_of)"
COUNTS_BEFORE="$(counts_of)"
SUMMARY_BEFORE="$(summary_of)"
USAGE_BEFORE="$(usage_of)"
VERSION_BEFORE="$(sql -d app -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_quota'")"
ROLE_TYPE="$(sql -d app -c "SELECT format_type(atttypid, atttypmod) FROM pg_attribute
                             WHERE attrelid = 'quota.ledger'::regclass AND attname = 'role'")"
echo "# pg_quota $VERSION_BEFORE, quota.ledger.role is $ROLE_TYPE; roles $OIDS_BEFORE"
stop_cluster "$OLD"

# --- the new cluster: same binaries, same initdb options, preloaded, not started -------
mkdir -p "$NEW"; chown "$PG_USER" "$NEW"
CLUSTERS+=("$NEW")
as_pg "$PG_BIN/initdb" -D "$NEW/data" "${INITDB_OPTS[@]}" >/dev/null
{
  echo "shared_preload_libraries = 'pg_quota'"
  echo "port = $NEW_PORT"
  echo "listen_addresses = ''"
  echo "unix_socket_directories = '$NEW'"
  echo "max_connections = 120"
  echo "max_worker_processes = 16"
} >> "$NEW/data/postgresql.conf"

# pg_upgrade writes its sockets and scripts into the working directory, which must be
# one postgres can write; it runs both servers on ports of its own.
upgrade() {
  (cd "$NEW" && as_pg timeout 300 "$PG_UPGRADE" -b "$PG_BIN" -B "$PG_BIN" \
      -d "$OLD/data" -D "$NEW/data" -U postgres -p "$UPG_OLD_PORT" -P "$UPG_NEW_PORT" \
      --socketdir="$NEW" "$@")
}
show_upgrade_logs() {
  local f
  for f in $(find "$NEW/data/pg_upgrade_output.d" "$NEW" -maxdepth 3 \( -name '*.log' -o -name '*.txt' \) 2>/dev/null | sort -u); do
    echo "# --- $f"; tail -n 30 "$f" | sed 's/^/#   /'
  done
}
check_out=$(upgrade --check 2>&1) && checked=0 || checked=$?
check "pg_upgrade --check passes" test "$checked" = 0
if [ "$checked" != 0 ]; then
  sed 's/^/#   /' <<<"$check_out" | tail -n 40; show_upgrade_logs
  finish_checks; exit 1
fi
upgrade_out=$(upgrade 2>&1) && upgraded=0 || upgraded=$?
check "pg_upgrade passes" test "$upgraded" = 0
if [ "$upgraded" != 0 ]; then
  sed 's/^/#   /' <<<"$upgrade_out" | tail -n 40; show_upgrade_logs
  finish_checks; exit 1
fi

as_pg "$PG_BIN/pg_ctl" -D "$NEW/data" -l "$NEW/server.log" -w -t 60 start >/dev/null
CL="$NEW" PORT="$NEW_PORT"

# --- the new cluster: the same charges under the same role names ----------------------
expect_eq "the extension is still pg_quota $VERSION_BEFORE" "$VERSION_BEFORE" \
  "$(sql -d app -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_quota'")"
expect_eq "pg_upgrade kept the roles' OIDs" "$OIDS_BEFORE" "$(role_oids)"
check "three transactional tickets were charged before the upgrade ($TXIDS_BEFORE)" \
  test "$(tr ',' '\n' <<<"$TXIDS_BEFORE" | grep -c .)" = 3
expect_eq "the transactional tickets keep their txids" "$TXIDS_BEFORE" "$(txids_of)"
expect_eq "... all below the new cluster's next transaction id" 0 \
  "$(sql -d txdb -c "SELECT count(*) FROM quota.ledger WHERE txid >= pg_snapshot_xmax(pg_current_snapshot())::text::xid8")"
expect_eq "every ticket keeps its id, role name, label, state and times" "$LEDGER_BEFORE" "$(ledger_of)"
check "the ledger is not empty" test -n "$LEDGER_BEFORE"
expect_eq "the counts per role match" "$COUNTS_BEFORE" "$(counts_of)"
expect_eq "quota.summary matches by role name" "$SUMMARY_BEFORE" "$(summary_of)"
expect_eq "quota.usage shows the same rows" "$USAGE_BEFORE" "$(usage_of)"
expect_eq "the role limits came along" \
  "t1|quota.max_active_per_role=2 t2|quota.max_active_per_role=4,quota.max_retained_per_role=3" \
  "$(sql -c "SELECT r.rolname || '|' || array_to_string(s.setconfig, ',') FROM pg_db_role_setting s
               JOIN pg_roles r ON r.oid = s.setrole JOIN pg_database d ON d.oid = s.setdatabase
              WHERE d.datname = 'app' ORDER BY 1" | paste -sd' ')"

out=$(timeout 30 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U t1 -d app -v VERBOSITY=verbose \
        -c "SELECT quota.start('over')" 2>&1 || true)
check "t1 is still at its active limit after pg_upgrade (53400)" \
  grep -q 'ERROR:  53400: role "t1" has 2 active tickets' <<<"$out"
out=$(timeout 30 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U t2 -d app -v VERBOSITY=verbose \
        -c "SELECT quota.start('over')" 2>&1 || true)
check "t2 is still at its retained limit after pg_upgrade (53400)" \
  grep -q 'ERROR:  53400: role "t2" has 3 retained tickets' <<<"$out"
expect_eq "try_start() returns NULL for t1" t "$(as t1 app "SELECT quota.try_start('over') IS NULL")"
expect_eq "t2 cannot finish t1's ticket (42501)" 42501 "$(state t2 app "SELECT quota.finish('${T1_ACTIVE[0]}')")"
expect_eq "t1 finishes its active ticket (true)" t "$(as t1 app "SELECT quota.finish('${T1_ACTIVE[0]}')")"
expect_eq "a ticket that ended before the upgrade stays ended (false)" f \
  "$(as t1 app "SELECT quota.finish('${T1_DONE[0]}', 'failed')")"
expect_eq "the freed slot admits one start" t "$(as t1 app "SELECT quota.start('after upgrade') IS NOT NULL")"
expect_eq "... and the next is refused" 53400 "$(state t1 app "SELECT quota.start('over again')")"
expect_eq "t2 finishes its active ticket (true)" t "$(as t2 app "SELECT quota.finish('${T2[2]}', 'succeeded')")"
expect_eq "t2 is still at its retained limit" 53400 "$(state t2 app "SELECT quota.start('over')")"
expect_eq "the counts follow" "postgres|1|1 t1|2|5 t2|0|3" "$(counts_of)"
job_columns_kept "after pg_upgrade"
check "the summary agrees with the ledger after new starts" summary_agrees
finish_checks
