#!/usr/bin/env bash
# pg_quota does not install into, or read from, objects that someone else prepared.
#  1. A non-superuser who may create schemas creates schema "quota" before the DBA runs
#     CREATE EXTENSION: the extension refuses to install there (42P06) and leaves
#     nothing behind, so the tenant cannot rename the schema and plant a look-alike
#     ledger that pg_quota would then read and write.
#  2. A schema "quota" owned by a superuser (left over after DROP EXTENSION, or made by
#     the DBA) is still fine.
#  3. Defence in depth: when a superuser changes the shape of pg_quota's tables, takes
#     one out of the extension, or swaps in a look-alike, start(), try_start() and
#     finish() raise a clear error (not XX000) and the server does not crash.
# From 0.6.0 the ledger is two tables, quota.active (tickets not ended) and
# quota.history (ended ones), and quota.ledger is a view over both: the look-alikes
# below stand in for those tables, and each change to the ledger's shape or each swap
# is made to each of the two tables, in a database of its own.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5622 + PORT_OFFSET))}"
with_cluster schema_takeover

# clear_error NAME USER DB SQL...: the last statement fails with a proper SQLSTATE: not
# success, not XX000 (internal error), and not a lost connection (classes 08, 57).
clear_error() {
  local name="$1"; shift; local got
  got=$(state "$@")
  CHECK_NO=$((CHECK_NO + 1))
  if [[ "$got" =~ ^[0-9A-Z]{5}$ && "$got" != 00000 && "$got" != XX000 && "$got" != 08* && "$got" != 57* ]]; then
    echo "ok $CHECK_NO - $name ($got)"
  else
    echo "not ok $CHECK_NO - $name: expected a clear error, got [${got:-no answer}]"; CHECKS_FAILED=$((CHECKS_FAILED + 1))
  fi
}
has_ext() { sql -d "$1" -c "SELECT count(*) FROM pg_extension WHERE extname = 'pg_quota'"; }
wait_up() { for _ in $(seq 1 60); do sql -c "SELECT 1" >/dev/null 2>&1 && return 0; sleep 0.25; done; return 1; }

sql -c "CREATE ROLE st_tenant LOGIN" -c "ALTER ROLE st_tenant SET quota.max_active_per_role = 1" \
    -c "CREATE DATABASE st_take" -c "GRANT CREATE ON DATABASE st_take TO st_tenant" \
    -c "CREATE DATABASE st_left" -c "CREATE DATABASE st_su" \
    -c "CREATE DATABASE st_label" -c "CREATE DATABASE st_label_h" -c "CREATE DATABASE st_tickets" \
    -c "CREATE DATABASE st_member" -c "CREATE DATABASE st_swap" -c "CREATE DATABASE st_swap_h" \
    -c "CREATE DATABASE st_take2" -c "GRANT CREATE ON DATABASE st_take2 TO st_tenant"

# ------------------------------------------------------------------------------------
# 1. The tenant creates schema quota first.
# ------------------------------------------------------------------------------------
expect_eq "the tenant creates schema quota in a database where it may create schemas" 00000 \
  "$(state st_tenant st_take "CREATE SCHEMA quota")"
expect_eq "CREATE EXTENSION pg_quota refuses the tenant's schema quota with 42P06" 42P06 \
  "$(state postgres st_take "CREATE EXTENSION pg_quota")"
expect_eq "... and leaves no extension behind" 0 "$(has_ext st_take)"
out=$("$PG_BIN/psql" -X -q -h "$CL" -p "$PORT" -U postgres -d st_take -c "CREATE EXTENSION pg_quota" 2>&1 || true)
expect_eq "the refusal names the schema's owner" \
  'ERROR:  schema "quota" already exists and is owned by role st_tenant, which is not a superuser' "$(head -n1 <<<"$out")"
# 0.3.0 checked this in a DO block of the install script, and PostgreSQL printed the
# block's 45 lines as the error's CONTEXT. From 0.3.1 the library checks it first.
expect_eq "... with a DETAIL and a HINT, and no script quoted as CONTEXT" "DETAIL HINT" \
  "$(sed -n 's/^\([A-Z]*\):  .*/\1/p' <<<"$out" | tail -n +2 | paste -sd' ')"
expect_eq "... in $(wc -l <<<"$out") lines" 3 "$(wc -l <<<"$out")"
expect_eq "... and no pg_quota object in the tenant's schema" 0 \
  "$(sql -d st_take -c "SELECT (SELECT count(*) FROM pg_class WHERE relnamespace = 'quota'::regnamespace)
                              + (SELECT count(*) FROM pg_proc WHERE pronamespace = 'quota'::regnamespace)")"
# CREATE EXTENSION … CASCADE of an extension that requires pg_quota installs pg_quota
# without a CREATE EXTENSION pg_quota statement: the check holds there too.
EXTDIR="$("$PG_CONFIG" --sharedir)/extension"
printf "comment = 'test: requires pg_quota'\ndefault_version = '1.0'\nrequires = 'pg_quota'\nrelocatable = true\n" \
  > "$EXTDIR/pg_quota_dep.control"
echo "SELECT 1;" > "$EXTDIR/pg_quota_dep--1.0.sql"
trap 'rc=$?; rm -f "$EXTDIR/pg_quota_dep.control" "$EXTDIR/pg_quota_dep--1.0.sql"; set +e; (exit $rc); cleanup_at_exit' EXIT
expect_eq "CREATE EXTENSION pg_quota_dep CASCADE (which requires pg_quota) is refused the same way" 42P06 \
  "$(state postgres st_take "CREATE EXTENSION pg_quota_dep CASCADE")"
expect_eq "... and leaves no extension behind" 0 "$(has_ext st_take)"
as st_tenant st_take2 "CREATE SCHEMA quota" >/dev/null
expect_eq "CREATE EXTENSION pg_quota SCHEMA quota is refused the same way" 42P06 \
  "$(state postgres st_take2 "CREATE EXTENSION pg_quota SCHEMA quota")"
expect_eq "... and leaves no extension behind" 0 "$(has_ext st_take2)"
# What the tenant would do next: keep the real schema under another name and plant a
# look-alike ledger and summary where pg_quota reads them, then start past its limit.
# (0.6.0: the ledger's tables are quota.active and quota.history.)
as st_tenant st_take "SELECT quota.start('held')" \
  "ALTER SCHEMA quota RENAME TO st_real" \
  "CREATE SCHEMA quota" \
  "CREATE TABLE quota.active (id uuid PRIMARY KEY, role oid NOT NULL, label text, started_at timestamptz NOT NULL,
                              ended_at timestamptz, outcome text)" \
  "CREATE INDEX active_role_idx ON quota.active (role, ended_at)" \
  "CREATE TABLE quota.history (LIKE quota.active INCLUDING ALL)" \
  "CREATE TABLE quota.summary (role oid PRIMARY KEY, tickets bigint NOT NULL)" >/dev/null
got=$(state st_tenant st_take "SELECT st_real.start('past the limit')")
check "the tenant gets no ticket past its limit of 1 through its look-alike ledger (got $got)" \
  test "$got" != 00000 -a -n "$got"

# ------------------------------------------------------------------------------------
# 2. A schema quota that a superuser owns is fine.
# ------------------------------------------------------------------------------------
sql -d st_left -c "CREATE EXTENSION pg_quota" -c "DROP EXTENSION pg_quota" >/dev/null
expect_eq "after DROP EXTENSION, schema quota is left, owned by a superuser" "t" \
  "$(sql -d st_left -c "SELECT r.rolsuper FROM pg_namespace n JOIN pg_roles r ON r.oid = n.nspowner WHERE n.nspname = 'quota'")"
expect_eq "CREATE EXTENSION pg_quota installs again over that schema" 00000 \
  "$(state postgres st_left "CREATE EXTENSION pg_quota")"
expect_eq "... and start() works there" t "$(as postgres st_left "SELECT quota.start('again') IS NOT NULL")"
sql -d st_su -c "CREATE SCHEMA quota" >/dev/null
expect_eq "CREATE EXTENSION pg_quota installs into a schema quota the superuser made" 00000 \
  "$(state postgres st_su "CREATE EXTENSION pg_quota")"
expect_eq "... and start() works there" t "$(as postgres st_su "SELECT quota.start('made by the DBA') IS NOT NULL")"

# ------------------------------------------------------------------------------------
# 3. Tables whose shape or membership a superuser changed.
# ------------------------------------------------------------------------------------
for db in st_label st_label_h st_tickets st_member st_swap st_swap_h; do
  sql -d "$db" -c "CREATE EXTENSION pg_quota" >/dev/null
  # The writer is running and has seen the tables before they change.
  as postgres "$db" "SELECT quota.start('before')" > "$CL/before.$db"
done

# The view quota.ledger reads the column, and quota.tickets, quota.usage and
# quota.tenant_usage read quota.ledger: take them out of the extension and drop them
# first. 0.6.0: quota.active loses the column in st_label, quota.history in st_label_h.
for t in active history; do
  db=st_label; [ "$t" = active ] || db=st_label_h
  sql -d "$db" -c "ALTER EXTENSION pg_quota DROP VIEW quota.tickets" -c "ALTER EXTENSION pg_quota DROP VIEW quota.usage" \
      -c "ALTER EXTENSION pg_quota DROP VIEW quota.tenant_usage" -c "ALTER EXTENSION pg_quota DROP VIEW quota.ledger" \
      -c "DROP VIEW quota.tickets, quota.usage, quota.tenant_usage, quota.ledger" \
      -c "ALTER TABLE quota.$t DROP COLUMN label" >/dev/null
  clear_error "quota.$t without its label column: start() raises a clear error" postgres "$db" "SELECT quota.start('x')"
  clear_error "quota.$t without its label column: try_start() raises a clear error" postgres "$db" "SELECT quota.try_start('x')"
  clear_error "quota.$t without its label column: finish() raises a clear error" postgres "$db" \
    "SELECT quota.finish('$(cat "$CL/before.$db")')"
done

wait_up || true
sql -d st_tickets -c "DO \$\$ DECLARE c name; BEGIN
                        FOR c IN SELECT conname FROM pg_constraint WHERE conrelid = 'quota.summary'::regclass AND contype = 'c' LOOP
                          EXECUTE format('ALTER TABLE quota.summary DROP CONSTRAINT %I', c);
                        END LOOP; END \$\$" \
    -c "ALTER TABLE quota.summary ALTER COLUMN tickets TYPE text" >/dev/null || true
expect_eq "summary.tickets is now text" text \
  "$(sql -d st_tickets -c "SELECT atttypid::regtype FROM pg_attribute WHERE attrelid = 'quota.summary'::regclass AND attname = 'tickets'")"
clear_error "summary.tickets of type text: start() raises a clear error" postgres st_tickets "SELECT quota.start('x')"
clear_error "summary.tickets of type text: a tenant's start() raises a clear error" st_tenant st_tickets "SELECT quota.start('x')"

wait_up || true
sql -d st_member -c "ALTER EXTENSION pg_quota DROP TABLE quota.summary" >/dev/null || true
clear_error "a summary that is no member of the extension: start() raises a clear error" postgres st_member "SELECT quota.start('x')"

# A look-alike ledger (role text) in place of the real one, which keeps its data under
# another name. 0.1.0's writer crashed the server on this one, so it comes last.
# 0.6.0: a look-alike quota.active in st_swap, a look-alike quota.history in st_swap_h.
for t in active history; do
  db=st_swap; [ "$t" = active ] || db=st_swap_h
  wait_up || true
  sql -d "$db" -c "ALTER TABLE quota.$t RENAME TO ${t}_real" \
      -c "CREATE TABLE quota.$t (id uuid PRIMARY KEY, role text NOT NULL, label text, started_at timestamptz NOT NULL,
                                 ended_at timestamptz, outcome text)" \
      -c "CREATE INDEX ON quota.$t (role, ended_at)" >/dev/null || true
  expect_eq "$db: quota.$t is the look-alike (role text)" text \
    "$(sql -d "$db" -c "SELECT atttypid::regtype FROM pg_attribute WHERE attrelid = 'quota.$t'::regclass AND attname = 'role'")"
  clear_error "a look-alike quota.$t with role text: start() raises a clear error" postgres "$db" "SELECT quota.start('x')"
  wait_up || true
  clear_error "a look-alike quota.$t with role text: finish() raises a clear error" postgres "$db" \
    "SELECT quota.finish('$(cat "$CL/before.$db")')"
done
sleep 0.5
check "the server still answers" wait_up
crashes=$(grep -c "terminated by signal" "$CL/server.log" || true)
expect_eq "no server process was terminated by a signal" 0 "$crashes"
[ "$crashes" = 0 ] || grep "terminated by signal" "$CL/server.log" | head -3 | sed 's/^/# /'
finish_checks
