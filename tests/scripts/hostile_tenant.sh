#!/usr/bin/env bash
# I4, I5 and input checking against a hostile tenant (a non-superuser that logs in as
# itself): it cannot write the ledger or the summary, cannot raise its limits, cannot
# finish another role's tickets, cannot block or bypass admission with advisory locks,
# cannot change what pg_quota computes with objects on its search_path, cannot charge
# someone else through a SECURITY DEFINER function, finds no internal helper to call,
# and malformed input neither loses nor double-counts a charge. Every refusal is
# checked by its SQLSTATE.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5524 + PORT_OFFSET))}"
with_cluster hostile_tenant

LIMIT=3
sql <<SQL
CREATE EXTENSION pg_quota;
CREATE ROLE ht_tenant LOGIN;
CREATE ROLE ht_other LOGIN;
CREATE ROLE ht_member LOGIN;
GRANT ht_other TO ht_member;
CREATE ROLE ht_caller LOGIN;
CREATE SCHEMA ht_evil AUTHORIZATION ht_tenant;
CREATE DATABASE ht_owned OWNER ht_tenant;
-- The limits, set the ways a DBA would: for the database, and for the role.
ALTER DATABASE postgres SET quota.max_active_per_role = $LIMIT;
ALTER ROLE ht_tenant SET quota.max_active_per_role = $LIMIT;
ALTER ROLE ht_tenant IN DATABASE postgres SET quota.max_retained_per_role = 1000;
ALTER DATABASE ht_owned SET quota.max_active_per_role = $LIMIT;
SQL

# as USER SQL...: runs the statements in one session of USER (database \$DB, default
# postgres); prints their output, errors dropped.
as() {
  local user="$1"; shift; local a=() q
  for q in "$@"; do a+=(-c "$q"); done
  timeout "${TMO:-20}" "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U "$user" -d "${DB:-postgres}" \
    -v ON_ERROR_STOP=0 "${a[@]}" 2>/dev/null || true
}
# state USER SQL...: the SQLSTATE the last statement ended with (00000: success), or
# TIMEOUT if the session did not finish in time.
state() {
  local out; out=$(as "$@" '\echo SQLSTATE=:SQLSTATE')
  grep -q '^SQLSTATE=' <<<"$out" && sed -n 's/^SQLSTATE=//p' <<<"$out" | tail -n1 || echo TIMEOUT
}
refused() {  # refused NAME WANT USER SQL...
  local name="$1" want="$2"; shift 2
  expect_eq "$name" "$want" "$(state "$@")"
}
active() { sql -c "SELECT count(*) FROM quota.ledger WHERE role = '$1'::regrole AND ended_at IS NULL"; }
rows() { sql -c "SELECT count(*) FROM quota.ledger WHERE role = '$1'::regrole"; }
summary_matches_ledger() {
  [ "$(sql -c "SELECT count(*) FROM quota.summary s FULL JOIN
                 (SELECT role, count(*) AS n FROM quota.ledger GROUP BY role) l USING (role)
                WHERE s.tickets IS DISTINCT FROM l.n")" = 0 ]
}
fingerprint() {  # the whole ledger and summary, as one hash
  sql -c "SELECT md5(coalesce((SELECT string_agg(l::text, ';' ORDER BY id) FROM quota.ledger l), '')
                   || coalesce((SELECT string_agg(s::text, ';' ORDER BY role) FROM quota.summary s), ''))"
}
settings() { sql -c "SELECT string_agg(setdatabase || '/' || setrole || '/' || setconfig::text, ';' ORDER BY 1) FROM pg_db_role_setting"; }

# The tenant takes its whole quota.
as ht_tenant "SELECT quota.start('held ' || i) FROM generate_series(1, $LIMIT) i" > "$CL/held"
mapfile -t HELD < "$CL/held"
expect_eq "the tenant holds its $LIMIT tickets" "$LIMIT" "$(active ht_tenant)"
refused "the tenant at its limit is refused" 53400 ht_tenant "SELECT quota.start('over')"

# ------------------------------------------------------------------------------------
# 1. The tables: no privilege, no ownership.
#    From 0.6.0 the ledger is two tables, quota.active (tickets not ended) and
#    quota.history (ended ones), and quota.ledger a view of both (its INSTEAD OF
#    trigger routes a superuser's writes to them): each of the three is checked, and
#    quota.summary. The view takes the statements a view's owner could run on it
#    (TRUNCATE, indexes, policies, REINDEX and ALTER TABLE's trigger and constraint
#    forms are refused on a view to everyone, so they prove nothing about the tenant
#    there; that it has none of those privileges is checked with has_table_privilege).
# ------------------------------------------------------------------------------------
before=$(fingerprint)
T=ht_tenant
R_TENANT=$(sql -c "SELECT 'ht_tenant'::regrole::oid")
R_OTHER=$(sql -c "SELECT 'ht_other'::regrole::oid")
for tbl in quota.active quota.history quota.ledger quota.summary; do
  ended_row="2020-01-01 00:00:00+00	2020-01-01 00:00:00+00	succeeded	\N	\N	\N	\N	\N"
  case "$tbl" in
    quota.active)
      # Another role charged; the tenant's own tickets lapsed.
      ins="INSERT INTO quota.active (id, role, started_at) VALUES (gen_random_uuid(), 'ht_other'::regrole, now())"
      upd="UPDATE quota.active SET lease_until = now() - interval '1 second' WHERE role = 'ht_tenant'::regrole"
      copyrow="00000000-0000-7000-8000-000000000001	$R_OTHER	\N	2020-01-01 00:00:00+00	\N	\N	\N	\N	\N	\N	\N" ;;
    quota.history)
      # Another role charged; the tenant's ended tickets aged out.
      ins="INSERT INTO quota.history (id, role, started_at, ended_at, outcome) VALUES (gen_random_uuid(), 'ht_other'::regrole, now(), now(), 'succeeded')"
      upd="UPDATE quota.history SET ended_at = '2000-01-01' WHERE role = 'ht_tenant'::regrole"
      copyrow="00000000-0000-7000-8000-000000000001	$R_OTHER	\N	$ended_row" ;;
    quota.ledger)
      ins="INSERT INTO quota.ledger (id, role, started_at) VALUES (gen_random_uuid(), 'ht_other'::regrole, now())"
      upd="UPDATE quota.ledger SET ended_at = now(), outcome = 'succeeded' WHERE ended_at IS NULL"
      copyrow="00000000-0000-7000-8000-000000000001	$R_TENANT	\N	$ended_row" ;;
    quota.summary)
      ins="INSERT INTO quota.summary VALUES ('ht_other'::regrole, 0)"
      upd="UPDATE quota.summary SET tickets = 0"
      copyrow="$R_OTHER	0	\N" ;;
  esac
  expect_eq "the tenant has no privilege on $tbl" "none|none|f" \
    "$(sql -c "SELECT coalesce(string_agg(p, ','), 'none') FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES', 'TRIGGER']) p
                WHERE has_table_privilege('ht_tenant', '$tbl', p)")|$(sql -c "SELECT coalesce(string_agg(p, ','), 'none') FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'REFERENCES']) p
                WHERE has_any_column_privilege('ht_tenant', '$tbl', p)")|$(sql -c "SELECT pg_has_role('ht_tenant', relowner, 'USAGE') FROM pg_class WHERE oid = '$tbl'::regclass")"
  refused "INSERT INTO $tbl is refused" 42501 $T "$ins"
  refused "UPDATE $tbl is refused" 42501 $T "$upd"
  refused "DELETE FROM $tbl is refused" 42501 $T "DELETE FROM $tbl"
  refused "SELECT from $tbl is refused" 42501 $T "SELECT * FROM $tbl"
  refused "LOCK TABLE $tbl is refused" 42501 $T "BEGIN" "LOCK TABLE $tbl IN ACCESS EXCLUSIVE MODE"
  out=$(printf '%s\n\\.\n' "$copyrow" | timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U ht_tenant -d postgres \
          -v ON_ERROR_STOP=0 -c "COPY $tbl FROM STDIN" -c '\echo SQLSTATE=:SQLSTATE' 2>/dev/null || true)
  expect_eq "COPY $tbl FROM STDIN is refused" SQLSTATE=42501 "$(grep '^SQLSTATE=' <<<"$out")"
  refused "GRANT on $tbl to oneself is refused" 42501 $T "GRANT ALL ON $tbl TO ht_tenant"
  refused "CREATE RULE on $tbl is refused" 42501 $T "CREATE RULE evil AS ON INSERT TO $tbl DO INSTEAD NOTHING"
  if [ "$tbl" = quota.ledger ]; then
    refused "ALTER VIEW $tbl ALTER COLUMN ... SET DEFAULT is refused" 42501 $T "ALTER VIEW $tbl ALTER COLUMN outcome SET DEFAULT 'succeeded'"
    refused "ALTER VIEW $tbl OWNER TO the tenant is refused" 42501 $T "ALTER VIEW $tbl OWNER TO ht_tenant"
    refused "CREATE OR REPLACE VIEW $tbl is refused" 42501 $T "CREATE OR REPLACE VIEW $tbl AS SELECT * FROM quota.active"
    refused "DROP VIEW $tbl is refused" 42501 $T "DROP VIEW $tbl"
    refused "CREATE TRIGGER on $tbl is refused" 42501 $T \
      "CREATE FUNCTION ht_evil.trg() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NULL; END'" \
      "CREATE TRIGGER evil INSTEAD OF INSERT OR UPDATE ON $tbl FOR EACH ROW EXECUTE FUNCTION ht_evil.trg()"
    continue
  fi
  refused "TRUNCATE $tbl is refused" 42501 $T "TRUNCATE $tbl"
  refused "ALTER TABLE $tbl ADD COLUMN is refused" 42501 $T "ALTER TABLE $tbl ADD COLUMN evil int"
  refused "ALTER TABLE $tbl DISABLE TRIGGER ALL is refused" 42501 $T "ALTER TABLE $tbl DISABLE TRIGGER ALL"
  refused "ALTER TABLE $tbl OWNER TO the tenant is refused" 42501 $T "ALTER TABLE $tbl OWNER TO ht_tenant"
  refused "ALTER TABLE $tbl DROP CONSTRAINT is refused" 42501 $T "ALTER TABLE $tbl DROP CONSTRAINT ${tbl#quota.}_pkey"
  refused "DROP TABLE $tbl is refused" 42501 $T "DROP TABLE $tbl"
  refused "CREATE INDEX on $tbl is refused" 42501 $T "CREATE INDEX evil_idx ON $tbl (role)"
  refused "CREATE POLICY on $tbl is refused" 42501 $T "CREATE POLICY evil ON $tbl USING (true)"
  refused "CREATE TRIGGER on $tbl is refused" 42501 $T \
    "CREATE FUNCTION ht_evil.trg() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NULL; END'" \
    "CREATE TRIGGER evil BEFORE INSERT OR UPDATE ON $tbl FOR EACH ROW EXECUTE FUNCTION ht_evil.trg()"
  refused "REINDEX $tbl is refused" 42501 $T "REINDEX TABLE $tbl"
done
refused "DROP EXTENSION pg_quota is refused" 42501 $T "DROP EXTENSION pg_quota"
for obj in "TABLE quota.active" "TABLE quota.history" "VIEW quota.ledger"; do
  refused "ALTER EXTENSION pg_quota DROP $obj is refused" 42501 $T "ALTER EXTENSION pg_quota DROP $obj"
done
refused "DROP SCHEMA quota is refused" 42501 $T "DROP SCHEMA quota CASCADE"
refused "CREATE FUNCTION in schema quota is refused" 42501 $T "CREATE FUNCTION quota.helper() RETURNS int LANGUAGE sql AS 'SELECT 1'"
refused "CREATE TABLE in schema quota is refused" 42501 $T "CREATE TABLE quota.evil (x int)"
refused "replacing quota.start is refused" 42501 $T \
  "CREATE OR REPLACE FUNCTION quota.start(label text DEFAULT NULL, lease interval DEFAULT NULL, idempotency_key text DEFAULT NULL, wait interval DEFAULT '0') RETURNS uuid LANGUAGE sql AS 'SELECT gen_random_uuid()'"
refused "ALTER FUNCTION quota.start SECURITY DEFINER is refused" 42501 $T "ALTER FUNCTION quota.start(text, interval, text, interval, text, boolean) SECURITY DEFINER"
refused "ALTER FUNCTION quota.finish OWNER TO the tenant is refused" 42501 $T "ALTER FUNCTION quota.finish(uuid, text) OWNER TO ht_tenant"
expect_eq "the ledger and the summary are unchanged after the writes" "$before" "$(fingerprint)"

# ------------------------------------------------------------------------------------
# 2. The limits: every quota.* setting, every way a session or a catalog can set it.
# ------------------------------------------------------------------------------------
settings_before=$(settings)
# Every quota.* setting the server knows, each with the value a tenant would want: the
# minimum (0 turns a limit off, or keeps no history).
mapfile -t GUCS < <(sql -c "SELECT name || '|' || CASE vartype WHEN 'bool' THEN 'on' WHEN 'enum' THEN enumvals[1]
                                                      WHEN 'string' THEN 'x' ELSE min_val END
                                     || '|' || context
                              FROM pg_settings WHERE name LIKE 'quota.%' ORDER BY name")
expect_eq "the quota.* settings include the three limits" \
  "quota.max_active_per_role quota.max_retained_per_role quota.retention" \
  "$(printf '%s\n' "${GUCS[@]}" | cut -d'|' -f1 | grep -x -e quota.max_active_per_role -e quota.max_retained_per_role -e quota.retention | paste -sd' ')"
for gv in "${GUCS[@]}"; do
  g="${gv%%|*}"; rest="${gv#*|}"; v="'${rest%%|*}'"; context="${rest#*|}"
  # A superuser-only setting refuses tenants with 42501; a server-wide (sighup, or
  # postmaster: set at server start) one cannot be set in a session at all, which
  # PostgreSQL reports as 55P02, nor can a read-only one (internal: 0.6.1's
  # quota.library_version) by anyone.
  session=42501; [[ "$context" =~ ^(sighup|postmaster|internal)$ ]] && session=55P02
  refused "SET $g is refused, and start() is still refused after it" 53400 $T "SET $g = $v" "SELECT quota.start('after SET')"
  refused "SET $g is refused with $session" $session $T "SET $g = $v"
  refused "SET SESSION $g is refused" $session $T "SET SESSION $g = $v"
  refused "SET LOCAL $g is refused" $session $T "BEGIN" "SET LOCAL $g = $v"
  refused "SET $g TO DEFAULT is refused" $session $T "SET $g TO DEFAULT"
  refused "RESET $g is refused" $session $T "RESET $g"
  refused "set_config('$g') is refused" $session $T "SELECT set_config('$g', $v::text, false)"
  refused "set_config('$g', local) is refused" $session $T "BEGIN" "SELECT set_config('$g', $v::text, true)"
  refused "SET $g from PL/pgSQL is refused" $session $T "DO \$\$ BEGIN EXECUTE 'SET $g = ' || quote_literal($v::text); END \$\$"
  refused "ALTER ROLE <self> SET $g is refused" $session $T "ALTER ROLE ht_tenant SET $g = $v"
  refused "ALTER ROLE <self> IN DATABASE SET $g is refused" $session $T "ALTER ROLE ht_tenant IN DATABASE postgres SET $g = $v"
  refused "ALTER ROLE <self> RESET $g is refused" $session $T "ALTER ROLE ht_tenant RESET $g"
  refused "ALTER DATABASE SET $g is refused" 42501 $T "ALTER DATABASE postgres SET $g = $v"
  refused "ALTER DATABASE <own database> SET $g is refused" $session $T "ALTER DATABASE ht_owned SET $g = $v"
  refused "ALTER DATABASE <own database> RESET $g is refused" $session $T "ALTER DATABASE ht_owned RESET $g"
  refused "ALTER SYSTEM SET $g is refused" 42501 $T "ALTER SYSTEM SET $g = $v"
  refused "GRANT SET ON PARAMETER $g to oneself is refused" 42501 $T "GRANT SET ON PARAMETER $g TO ht_tenant"
  refused "CREATE FUNCTION ... SET $g is refused" $session $T \
    "CREATE FUNCTION ht_evil.\"with $g\"() RETURNS uuid LANGUAGE sql SET $g = $v AS 'SELECT quota.start()'"
  out=$(PGOPTIONS="-c $g=${v//\'/}" timeout 20 "$PG_BIN/psql" -X -At -h "$CL" -p "$PORT" -U ht_tenant -d postgres \
          -c "SELECT 'connected'" 2>&1 || true)
  if [ "$session" = 55P02 ]; then
    check "a connection option -c $g is refused" grep -q 'cannot be changed' <<<"$out"
  else
    check "a connection option -c $g is refused" grep -q 'permission denied to set parameter' <<<"$out"
  fi
done
# RESET ALL by the tenant leaves the superuser's settings alone.
refused "ALTER ROLE <self> RESET ALL runs" 00000 $T "ALTER ROLE ht_tenant RESET ALL"
refused "ALTER ROLE <self> IN DATABASE RESET ALL runs" 00000 $T "ALTER ROLE ht_tenant IN DATABASE postgres RESET ALL"
refused "ALTER DATABASE <own database> RESET ALL runs" 00000 $T "ALTER DATABASE ht_owned RESET ALL"
expect_eq "the stored limits are unchanged" "$settings_before" "$(settings)"
expect_eq "a new tenant session still has its limit after RESET ALL" "$LIMIT" \
  "$(as ht_tenant "RESET ALL" "SHOW quota.max_active_per_role")"
expect_eq "the tenant's own database still limits it" "$LIMIT" "$(DB=ht_owned as ht_tenant "SHOW quota.max_active_per_role")"
# A pooler that logs in as a superuser, SETs a lower limit in the session and runs SET
# ROLE (0.5.2, R4): PostgreSQL's RESET ALL resets superuser settings without a
# privilege check and keeps the role, so the tenant's own RESET ALL drops the
# superuser's value. What holds: the charged role's configured policy applies then
# (ALTER ROLE ht_pooled: 4, over the database's $LIMIT), never the server's 100.
sql -c "CREATE ROLE ht_pooled" -c "ALTER ROLE ht_pooled SET quota.max_active_per_role = 4" \
    -c "ALTER ROLE ht_pooled SET quota.max_retained_per_role = 0" >/dev/null
pooled() {  # pooled [SQL...]: the pooler's session as ht_pooled: admitted of 6 starts
  sql -c "SET quota.max_active_per_role = 2" -c "SET ROLE ht_pooled" "$@" \
      -c "SELECT current_user || ':' || count(quota.try_start('pooled')) FROM generate_series(1, 6)"
}
ended_pooled() { sql -c "SELECT count(quota.finish(id)) FROM quota.ledger WHERE role = 'ht_pooled'::regrole AND ended_at IS NULL" >/dev/null; }
expect_eq "a superuser's session value (2) applies to the role it SET ROLE to" "ht_pooled:2" "$(pooled)"
ended_pooled
expect_eq "after the role's own RESET ALL, its configured 4 applies, no more" "ht_pooled:4" \
  "$(pooled -c "RESET ALL")"
ended_pooled
# A function's SET clause is checked when it is created or altered.
refused "CREATE FUNCTION ... SET quota.max_active_per_role is refused" 42501 $T \
  "CREATE FUNCTION ht_evil.boost() RETURNS uuid LANGUAGE sql SET quota.max_active_per_role = 1000 AS 'SELECT quota.start(''boost'')'"
refused "ALTER FUNCTION ... SET quota.max_active_per_role is refused" 42501 $T \
  "CREATE FUNCTION ht_evil.plain() RETURNS uuid LANGUAGE sql AS 'SELECT quota.start(''plain'')'" \
  "ALTER FUNCTION ht_evil.plain() SET quota.max_active_per_role = 1000"
# ... and applied with the caller's privileges each time the function runs. The
# tenant's own ht_evil.boost() does not exist (its creation was refused above), so
# calling it proves nothing; what can be tested is a function with that SET clause
# that the tenant may call: one a superuser defined (SECURITY INVOKER, EXECUTE
# granted). For the tenant it must fail with 42501 rather than start a ticket under
# the raised limit. (A SECURITY DEFINER one would run start() as its superuser
# owner, charging the owner's scope, not the tenant's.)
sql <<SQL
CREATE SCHEMA ht_admin;
GRANT USAGE ON SCHEMA ht_admin TO ht_tenant;
CREATE FUNCTION ht_admin.boost() RETURNS uuid LANGUAGE sql
  SET quota.max_active_per_role = 1000 AS 'SELECT quota.start(''boost'')';
GRANT EXECUTE ON FUNCTION ht_admin.boost() TO ht_tenant;
SQL
before=$(active ht_tenant)
refused "calling a superuser's function with SET quota.max_active_per_role = 1000 is refused" 42501 $T \
  "SELECT ht_admin.boost()"
expect_eq "... and charges the tenant nothing" "$before" "$(active ht_tenant)"
refused "calling the plain function at the limit is refused" 53400 $T "SELECT ht_evil.plain()"
expect_eq "the tenant still has exactly $LIMIT active tickets" "$LIMIT" "$(active ht_tenant)"

# ------------------------------------------------------------------------------------
# 3. Someone else's ticket.
# ------------------------------------------------------------------------------------
other=$(as ht_other "SELECT quota.start('other''s')")
refused "finishing another role's ticket is refused" 42501 $T "SELECT quota.finish('$other')"
refused "... with any outcome" 42501 $T "SELECT quota.finish('$other', 'cancelled')"
refused "... and SET ROLE to that role is refused" 42501 $T "SET ROLE ht_other"
expect_eq "the other role's ticket is still active" 1 "$(active ht_other)"
expect_eq "a member of the holder role can finish it" t "$(as ht_member "SELECT quota.finish('$other')")"
expect_eq "a second finish by the member returns false" f "$(as ht_member "SELECT quota.finish('$other')")"
refused "finishing another role's ended ticket is still refused" 42501 $T "SELECT quota.finish('$other')"
expect_eq "the other role's ticket ended once, as succeeded" "succeeded" \
  "$(sql -c "SELECT outcome FROM quota.ledger WHERE id = '$other'")"

# ------------------------------------------------------------------------------------
# 4. Advisory lock squatting: one tenant session holds every natural key, at session
#    and transaction level, shared and exclusive; others' starts neither wait nor pass.
# ------------------------------------------------------------------------------------
read -r R O D <<<"$(sql -F ' ' -c "SELECT 'ht_tenant'::regrole::oid, 'ht_other'::regrole::oid, oid FROM pg_database WHERE datname = 'postgres'")"
bigints="$R, $O, $D, ($D::bigint << 32) | $R, ($R::bigint << 32) | $D, ($D::bigint << 32) | $O, ($O::bigint << 32) | $D,
         $R::bigint << 32, $O::bigint << 32, $D::bigint << 32, hashtext('quota'), hashtext('pg_quota'),
         hashtext('quota.start'), 0, 1"
pairs="($D, $R), ($R, $D), ($D, $O), ($O, $D), ($R, 0), (0, $R), ($O, 0), (0, $O), ($D, 0), (0, $D),
       (hashtext('quota'), $R), ($R, hashtext('quota')), (hashtext('pg_quota'), $R), (hashtext('quota'), 0),
       (hashtext('pg_quota'), 0), (0, hashtext('quota')), (0, hashtext('pg_quota')), (hashtext('quota'), hashtext('pg_quota'))"
mkfifo "$CL/squat_in"; chmod 666 "$CL/squat_in"
setsid bash -c "exec '$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U ht_tenant -d postgres < '$CL/squat_in' > '$CL/squat_out' 2>&1" &
BG+=("$!")
exec 3> "$CL/squat_in"
cat >&3 <<SQL
BEGIN;
SELECT count(*) FROM (SELECT pg_advisory_lock(k), pg_advisory_lock_shared(k),
                             pg_advisory_xact_lock(k), pg_advisory_xact_lock_shared(k)
                        FROM unnest(ARRAY[$bigints]::bigint[]) k) s;
SELECT count(*) FROM (SELECT pg_advisory_lock(a, b), pg_advisory_lock_shared(a, b),
                             pg_advisory_xact_lock(a, b), pg_advisory_xact_lock_shared(a, b)
                        FROM (VALUES $pairs) v (a, b)) s;
SELECT 'squatting ' || pg_backend_pid();
SQL
timeout 20 bash -c "until grep -q '^squatting' '$CL/squat_out'; do sleep 0.05; done" || true
squatter=$(sed -n 's/^squatting //p' "$CL/squat_out")
squat_locks() { sql -c "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = ${squatter:-0} AND granted"; }
n_locks=$(squat_locks)
check "the squatter holds its advisory locks ($n_locks)" test "$n_locks" -ge 60
TMO=10 refused "a squatted start() at the limit is refused at once, not blocked" 53400 $T "SELECT quota.start('squatted')"
expect_eq "a squatted try_start() at the limit returns NULL at once" "" "$(TMO=10 as $T "SELECT quota.try_start('squatted')")"
expect_eq "a squatted finish() returns at once" t "$(TMO=10 as $T "SELECT quota.finish('${HELD[0]}')")"
got=$(TMO=10 as $T "SELECT quota.start('squatted') IS NOT NULL")
expect_eq "a squatted start() below the limit is admitted at once" t "$got"
TMO=10 refused "... and the next one is refused: the squat opened no way past the limit" 53400 $T "SELECT quota.start('squatted over')"
expect_eq "another tenant's start() is not blocked by the squat" t "$(TMO=10 as ht_other "SELECT quota.start('next to a squat') IS NOT NULL")"
echo "SELECT 'own ' || (quota.try_start('by the squatter') IS NULL);" >&3
timeout 10 bash -c "until grep -q '^own' '$CL/squat_out'; do sleep 0.05; done" || true
expect_eq "the squatter's own try_start() is refused too" "own true" "$(grep '^own' "$CL/squat_out" || true)"
expect_eq "the squatter still held every lock throughout" "$n_locks" "$(squat_locks)"
expect_eq "the tenant has exactly $LIMIT active tickets" "$LIMIT" "$(active ht_tenant)"
echo "ROLLBACK; SELECT pg_advisory_unlock_all();" >&3
exec 3>&-

# ------------------------------------------------------------------------------------
# 5. Shadowing through the search_path: count, now, =, <, >=, +, coalesce,
#    current_setting, and tables named like pg_quota's, in ht_evil and in pg_temp.
# ------------------------------------------------------------------------------------
as $T "$(cat <<'SQL'
SET search_path = ht_evil;
CREATE FUNCTION zero1(bigint) RETURNS bigint LANGUAGE sql AS 'SELECT 0::bigint';
CREATE FUNCTION zero2(bigint, anyelement) RETURNS bigint LANGUAGE sql AS 'SELECT 0::bigint';
CREATE AGGREGATE count(*) (sfunc = zero1, stype = bigint, initcond = 0);
CREATE AGGREGATE count(anyelement) (sfunc = zero2, stype = bigint, initcond = 0);
CREATE FUNCTION now() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2000-01-01'::timestamptz $$;
CREATE FUNCTION current_setting(text) RETURNS text LANGUAGE sql AS $$ SELECT '1000' $$;
CREATE FUNCTION "coalesce"(bigint, bigint) RETURNS bigint LANGUAGE sql AS 'SELECT 0::bigint';
CREATE FUNCTION "coalesce"(timestamptz, timestamptz) RETURNS timestamptz LANGUAGE sql AS $$ SELECT 'infinity'::timestamptz $$;
CREATE FUNCTION oid_eq(oid, oid) RETURNS boolean LANGUAGE sql AS 'SELECT false';
CREATE OPERATOR = (leftarg = oid, rightarg = oid, function = oid_eq);
CREATE FUNCTION uuid_eq(uuid, uuid) RETURNS boolean LANGUAGE sql AS 'SELECT true';
CREATE OPERATOR = (leftarg = uuid, rightarg = uuid, function = uuid_eq);
CREATE FUNCTION ts_cmp(timestamptz, timestamptz) RETURNS boolean LANGUAGE sql AS 'SELECT false';
CREATE OPERATOR < (leftarg = timestamptz, rightarg = timestamptz, function = ts_cmp);
CREATE OPERATOR >= (leftarg = timestamptz, rightarg = timestamptz, function = ts_cmp);
CREATE FUNCTION int8_zero(bigint, bigint) RETURNS bigint LANGUAGE sql AS 'SELECT 0::bigint';
CREATE OPERATOR + (leftarg = bigint, rightarg = bigint, function = int8_zero);
CREATE FUNCTION is_null(anyelement) RETURNS boolean LANGUAGE sql AS 'SELECT false';
CREATE TABLE ledger (id uuid, role oid, label text, started_at timestamptz, ended_at timestamptz, outcome text);
CREATE TABLE active (LIKE ledger, lease_until timestamptz, idempotency_key text, pid int, tenant text, txid xid8);
CREATE TABLE history (LIKE active);
CREATE TABLE summary (role oid, tickets bigint);
INSERT INTO summary VALUES ('ht_tenant'::regrole, 0);
SQL
)" >/dev/null
# (0.6.0: the ledger is the tables quota.active and quota.history, so the tenant's
# look-alikes include an "active" and a "history": 4 tables.)
expect_eq "the tenant created its shadowing objects (operators, aggregates, tables, now, coalesce)" "5|2|4|1|2" \
  "$(sql -c "SELECT (SELECT count(*) FROM pg_operator WHERE oprnamespace = 'ht_evil'::regnamespace)
              || '|' || (SELECT count(*) FROM pg_proc WHERE pronamespace = 'ht_evil'::regnamespace AND prokind = 'a')
              || '|' || (SELECT count(*) FROM pg_class WHERE relnamespace = 'ht_evil'::regnamespace AND relkind = 'r')
              || '|' || (SELECT count(*) FROM pg_proc WHERE pronamespace = 'ht_evil'::regnamespace AND proname = 'now')
              || '|' || (SELECT count(*) FROM pg_proc WHERE pronamespace = 'ht_evil'::regnamespace AND proname = 'coalesce')")"
# Each shadowed session first creates the same objects in pg_temp, then puts pg_temp
# and ht_evil before pg_catalog.
SHADOW=(
  "CREATE TEMP TABLE ledger (id uuid, role oid, label text, started_at timestamptz, ended_at timestamptz, outcome text)"
  "CREATE TEMP TABLE active (LIKE pg_temp.ledger, lease_until timestamptz, idempotency_key text, pid int, tenant text, txid xid8)"
  "CREATE TEMP TABLE history (LIKE pg_temp.active)"
  "CREATE TEMP TABLE summary (role oid, tickets bigint)"
  "INSERT INTO pg_temp.summary VALUES ('ht_tenant'::regrole, 0)"
  "CREATE FUNCTION pg_temp.now() RETURNS timestamptz LANGUAGE sql AS \$\$ SELECT '2000-01-01'::timestamptz \$\$"
  "CREATE FUNCTION pg_temp.zero1(bigint) RETURNS bigint LANGUAGE sql AS 'SELECT 0::bigint'"
  "CREATE AGGREGATE pg_temp.count(*) (sfunc = pg_temp.zero1, stype = bigint, initcond = 0)"
  "SET search_path = pg_temp, ht_evil, pg_catalog, quota, public"
)
expect_eq "the shadows are in effect in a shadowed session" "0|f|2000-01-01" \
  "$(as $T "${SHADOW[@]}" "SELECT count(*), 1::oid = 1::oid, now()::date FROM (VALUES (1), (2)) v" | tail -n1)"
expect_eq "shadowed: the tenant still has $LIMIT active tickets" "$LIMIT" "$(active ht_tenant)"
refused "shadowed: start() at the limit is still refused" 53400 $T "${SHADOW[@]}" "SELECT quota.start('shadowed')"
expect_eq "shadowed: try_start() at the limit still returns NULL" t \
  "$(as $T "${SHADOW[@]}" "SELECT quota.try_start('shadowed') IS NULL" | tail -n1)"
refused "shadowed: finish() of an unknown ticket is still 22023" 22023 $T "${SHADOW[@]}" "SELECT quota.finish(gen_random_uuid())"
other2=$(as ht_other "SELECT quota.start('other''s second')")
refused "shadowed: finish() of another role's ticket is still 42501" 42501 $T "${SHADOW[@]}" "SELECT quota.finish('$other2')"
ended_before=$(sql -c "SELECT count(*) FROM quota.ledger WHERE ended_at IS NOT NULL")
expect_eq "shadowed: finish() of the tenant's own ticket works" t \
  "$(as $T "${SHADOW[@]}" "SELECT quota.finish('${HELD[1]}')" | tail -n1)"
expect_eq "shadowed: it ended that ticket and no other" \
  "$((ended_before + 1))|${HELD[1]}" \
  "$(sql -c "SELECT count(*) FILTER (WHERE ended_at IS NOT NULL) || '|' || (SELECT id FROM quota.ledger WHERE id = '${HELD[1]}' AND ended_at IS NOT NULL) FROM quota.ledger")"
expect_eq "shadowed: a second finish() of it returns false" f \
  "$(as $T "${SHADOW[@]}" "SELECT quota.finish('${HELD[1]}')" | tail -n1)"
expect_eq "shadowed: start() below the limit is admitted" t \
  "$(as $T "${SHADOW[@]}" "SELECT quota.start('shadowed ok') IS NOT NULL" | tail -n1)"
refused "shadowed: the next start() is refused again" 53400 $T "${SHADOW[@]}" "SELECT quota.start('shadowed over')"
expect_eq "shadowed: quota.usage shows the true counts" \
  "$(sql -c "SELECT count(*) FILTER (WHERE ended_at IS NULL) || '|' || count(*) FROM quota.ledger WHERE role = 'ht_tenant'::regrole")" \
  "$(as $T "${SHADOW[@]}" "SELECT active || '|' || retained FROM quota.usage" | tail -n1)"
expect_eq "the tenant has exactly $LIMIT active tickets after the shadowing" "$LIMIT" "$(active ht_tenant)"
check "the summary equals the ledger after the shadowing" summary_matches_ledger

# ------------------------------------------------------------------------------------
# 6. A SECURITY DEFINER wrapper charges its owner (the tenant), not its caller.
# ------------------------------------------------------------------------------------
as $T "CREATE FUNCTION ht_evil.start_for_me(label text) RETURNS uuid SECURITY DEFINER
         LANGUAGE sql AS 'SELECT quota.start(label)'" \
      "GRANT USAGE ON SCHEMA ht_evil TO ht_caller" >/dev/null
ended=$(as $T "SELECT quota.finish('${HELD[2]}')")
expect_eq "the tenant frees one slot" t "$ended"
via=$(as ht_caller "SELECT ht_evil.start_for_me('via definer')")
expect_eq "the wrapper's ticket is charged to the tenant" ht_tenant \
  "$(sql -c "SELECT role::regrole FROM quota.ledger WHERE id = '${via:-00000000-0000-0000-0000-000000000000}'")"
expect_eq "the caller is not charged" 0 "$(rows ht_caller)"
out=$(timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U ht_caller -d postgres -v ON_ERROR_STOP=0 \
        -v VERBOSITY=verbose -c "SELECT ht_evil.start_for_me('via definer, over')" 2>&1 || true)
check "at the tenant's limit, the wrapper is refused (53400) naming the tenant" \
  grep -q 'ERROR:  53400: role "ht_tenant" has 3 active tickets' <<<"$out"
expect_eq "the caller's own start() is charged to the caller" ht_caller \
  "$(sql -c "SELECT role::regrole FROM quota.ledger WHERE id = '$(as ht_caller "SELECT quota.start('own')")'")"

# ------------------------------------------------------------------------------------
# 7. No internal helper: the extension's functions are the public API, the two
#    trigger functions that keep quota.summary consistent with SQL-level writes to the
#    ledger, the placeholder that keeps pg_repack away (0.3.1) and quota.ledger_route()
#    (0.6.0: the view quota.ledger's INSTEAD OF trigger, which sends a superuser's
#    writes to quota.active or quota.history), which nobody but their owner may execute
#    (and only as triggers), and current_retention() (0.3.1), which quota.usage reads.
#    quota.finish_job() and quota.claim_job() (0.6.0) are trigger functions of the
#    public API, executable by PUBLIC as finish() and renew() are; called as functions,
#    they refuse. 0.7.0: quota.set_tenant_limits(), which PUBLIC may not execute (a
#    superuser grants it), and quota.tenant_overrides_written(), an internal trigger
#    function.
# ------------------------------------------------------------------------------------
expect_eq "the internal trigger functions are not executable by PUBLIC" "false false false false false" \
  "$(sql -c "SELECT string_agg(has_function_privilege('ht_tenant', p.oid, 'EXECUTE')::text, ' ')
              FROM pg_proc p WHERE p.pronamespace = 'quota'::regnamespace AND p.prorettype = 'trigger'::regtype
                AND p.proname NOT IN ('finish_job', 'claim_job')")"
refused "a tenant cannot call a trigger function" 42501 $T "SELECT quota.ledger_written()"
refused "... nor the view's routing trigger function quota.ledger_route()" 42501 $T "SELECT quota.ledger_route()"
refused "quota.finish_job(), a public trigger function, refuses a call that is not a trigger's" 0A000 $T "SELECT quota.finish_job()"
refused "... and so does quota.claim_job()" 0A000 $T "SELECT quota.claim_job()"
refused "a tenant cannot set its own limits (0.7.0: EXECUTE is not PUBLIC's)" 42501 $T \
  "SELECT quota.set_tenant_limits('me', max_active => 1000000)"
refused "... nor write them into the table behind them" 42501 $T \
  "INSERT INTO quota.tenant_overrides VALUES ('ht_tenant', 'me', 1000000, NULL, now(), 'ht_tenant')"
refused "a weight past int's range calls nothing (42883), never wraps (0.7.0)" 42883 $T "SELECT quota.start(weight => 2147483648)"
refused "a negative weight cannot take units back (22023)" 22023 $T "SELECT quota.start(weight => -5)"
refused "nor can a weight of 0 start for free (22023)" 22023 $T "SELECT quota.start(weight => 0)"
FUNCTIONS="quota.claim_job(), quota.current_retention(), quota.finish(uuid,text), quota.finish_job(), quota.ledger_route(), quota.ledger_written(), quota.renew(uuid,interval), quota.repack_placeholder(), quota.set_tenant_limits(text,integer,integer,regrole), quota.start(integer,interval,text,interval,text,boolean,text), quota.start(text,interval,text,interval,text,boolean), quota.stats_info_row(), quota.stats_reset(regrole), quota.stats_rows(), quota.summary_written(), quota.tenant_overrides_written(), quota.try_start(integer,interval,text,interval,text,boolean,text), quota.try_start(text,interval,text,interval,text,boolean), quota.usage_totals(), quota.wait_histogram_rows(), quota.writer_stats_rows()"
expect_eq "schema quota has exactly finish, renew, start, try_start, current_retention, the 0.3.0 statistics functions, usage_totals (0.5.1), the five internal trigger functions (0.6.0: with ledger_route; 0.7.0: tenant_overrides_written), finish_job and claim_job (0.6.0), set_tenant_limits and the weighted start and try_start overloads (0.7.0)" \
  "$FUNCTIONS" \
  "$(sql -c "SELECT string_agg(p.oid::regprocedure::text, ', ' ORDER BY p.oid::regprocedure::text COLLATE \"C\") FROM pg_proc p WHERE p.pronamespace = 'quota'::regnamespace")"
expect_eq "stats_reset() is not executable by PUBLIC; the statistics readers are (they filter rows themselves)" \
  "true false true true true" \
  "$(sql -c "SELECT string_agg(has_function_privilege('ht_tenant', p, 'EXECUTE')::text, ' ' ORDER BY p::text COLLATE \"C\")
              FROM unnest(ARRAY['quota.stats_reset(regrole)', 'quota.stats_info_row()', 'quota.stats_rows()',
                                'quota.wait_histogram_rows()', 'quota.writer_stats_rows()']::regprocedure[]) p")"
refused "a tenant cannot reset the statistics" 42501 $T "SELECT quota.stats_reset()"
expect_eq "usage_totals() (0.5.1, every role's tickets) is executable by pg_read_all_stats, not by PUBLIC" \
  "f t" \
  "$(sql -c "SELECT has_function_privilege('ht_tenant', 'quota.usage_totals()', 'EXECUTE'),
                     has_function_privilege('pg_read_all_stats', 'quota.usage_totals()', 'EXECUTE')" | tr '|' ' ')"
refused "a tenant cannot read the database's usage totals" 42501 $T "SELECT * FROM quota.usage_totals()"
expect_eq "the extension owns no other function anywhere" \
  "$FUNCTIONS" \
  "$(sql -c "SELECT string_agg(objid::regprocedure::text, ', ' ORDER BY objid::regprocedure::text COLLATE \"C\") FROM pg_depend
              WHERE classid = 'pg_proc'::regclass AND refclassid = 'pg_extension'::regclass
                AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'pg_quota')")"

# ------------------------------------------------------------------------------------
# 8. Oversize and malformed input.
# ------------------------------------------------------------------------------------
# A superuser finishes all of the tenant's tickets but one, to make room.
sql -c "SELECT count(quota.finish(id)) FROM (SELECT id FROM quota.ledger WHERE role = 'ht_tenant'::regrole
          AND ended_at IS NULL ORDER BY started_at OFFSET 1) s" >/dev/null
tix=$(sql -c "SELECT id FROM quota.ledger WHERE role = 'ht_tenant'::regrole AND ended_at IS NULL LIMIT 1")
rows0=$(rows ht_tenant); active0=$(active ht_tenant)
check "the tenant has room for the two admissions below ($active0 active)" test "$active0" -le $((LIMIT - 2))
refused "a 201-character label is refused with 22001" 22001 $T "SELECT quota.start(repeat('x', 201))"
refused "... by try_start() too" 22001 $T "SELECT quota.try_start(repeat('x', 201))"
refused "a 201-character multibyte label is refused with 22001" 22001 $T "SELECT quota.start(repeat('é', 201))"
refused "finish(NULL) is refused with 22004" 22004 $T "SELECT quota.finish(NULL)"
refused "finish(NULL, NULL) is refused with 22004" 22004 $T "SELECT quota.finish(NULL, NULL)"
refused "finish(ticket, NULL) is refused with 22004" 22004 $T "SELECT quota.finish('$tix', NULL)"
for o in done SUCCEEDED "" expired " succeeded"; do
  refused "finish(ticket, '$o') is refused with 22023" 22023 $T "SELECT quota.finish('$tix', '$o')"
done
refused "finish() of a random uuid is refused with 22023" 22023 $T "SELECT quota.finish(gen_random_uuid())"
refused "finish() of the nil uuid is refused with 22023" 22023 $T "SELECT quota.finish('00000000-0000-0000-0000-000000000000')"
refused "finish('not-a-uuid') is refused with 22P02" 22P02 $T "SELECT quota.finish('not-a-uuid')"
refused "finish('') is refused with 22P02" 22P02 $T "SELECT quota.finish('')"
expect_eq "the ticket of the refused finishes is still active" 1 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE id = '$tix' AND ended_at IS NULL")"
nolabel=$(as $T "SELECT quota.start(NULL)")
expect_eq "start(NULL) is admitted with no label" "t|t" \
  "$(sql -c "SELECT count(*) = 1, bool_and(label IS NULL) FROM quota.ledger WHERE id = '${nolabel:-00000000-0000-0000-0000-000000000000}'")"
wide=$(as $T "SELECT quota.start(repeat('é', 200))")
expect_eq "a 200-character multibyte label is admitted whole" 200 \
  "$(sql -c "SELECT length(label) FROM quota.ledger WHERE id = '${wide:-00000000-0000-0000-0000-000000000000}'")"
expect_eq "the tenant's rows grew by exactly the 2 admitted tickets" "$((rows0 + 2))" "$(rows ht_tenant)"
expect_eq "the tenant's active count grew by exactly 2" "$((active0 + 2))" "$(active ht_tenant)"
check "the summary equals the ledger after the malformed calls" summary_matches_ledger
expect_eq "the tenant's summary row counts its ledger rows" "$(rows ht_tenant)" \
  "$(sql -c "SELECT tickets FROM quota.summary WHERE role = 'ht_tenant'::regrole")"
finish_checks
