#!/usr/bin/env bash
# pg_repack beside pg_quota (design.md I6 Durable, I9 Operable; 0.3.1, item 1).
#
# pg_repack copies a table, replays the changes its row trigger "repack_trigger" logged
# during the copy, and swaps the copy in. pg_quota writes its tables below SQL, where no
# trigger fires, so every ticket committed during a copy of quota.ledger was lost
# (0.3.0: 367 of 3,124 received tickets). From 0.3.1 each of pg_quota's tables carries
# a disabled trigger of that name, which makes pg_repack skip it before it copies
# anything, and the library refuses every other trigger on them.
#
# From 0.6.0 the ledger is two tables, quota.active (tickets not ended) and
# quota.history (ended ones; a finish deletes the row from quota.active and inserts it
# here), and quota.ledger is a view over both: what was done to the ledger table below
# is done to each of the two.
#
# On every major: the placeholders exist, CREATE TRIGGER (a foreign key's too) and
# DROP/RENAME of pg_quota's triggers are refused. On 15, where Debian packages
# pg_repack (postgresql-15-repack, installed here if missing), under load from four
# clients that start and finish tickets all along: `--table quota.active`, `--table
# quota.history`, `--table quota.summary`, `--only-indexes --table` each of the
# ledger's tables, `-d app` and `--all` lose no received ticket and undo no
# acknowledged finish; the summary still equals the ledger; pg_quota's tables are
# skipped with pg_repack's warning before any copy (their files are the same
# afterwards) while the other tables of a `-d` or `--all` run are repacked; and on a
# database still at the 0.3.0 schema (no placeholders, the ledger one table
# quota.ledger), pg_repack is refused at CREATE TRIGGER with pg_quota's error before it
# copies anything.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"

with_cluster pg_repack "max_connections = 60"
sql -c "CREATE ROLE t1 LOGIN" -c "CREATE DATABASE app" -c "CREATE DATABASE app2" \
    -c "ALTER ROLE t1 SET quota.max_active_per_role = 1000" >/dev/null
sql -d app -c "CREATE EXTENSION pg_quota" -c "GRANT CREATE ON SCHEMA public TO t1" >/dev/null

# --- on every major: the placeholders, and what DDL may not do -------------------------
expect_eq "each of pg_quota's tables has a disabled repack_trigger" "quota.active|D quota.history|D quota.summary|D quota.tenant_overrides|D" \
  "$(sql -d app -c "SELECT string_agg(tgrelid::regclass || '|' || tgenabled::text, ' ' ORDER BY tgrelid::regclass::text)
                      FROM pg_trigger WHERE tgname = 'repack_trigger'")"
err_of() {  # err_of DB SQL: the SQLSTATE and message of the statement's error
  "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U postgres -d "$1" -v VERBOSITY=verbose -c "$2" 2>&1 \
    | sed -n 's/^ERROR:  \([0-9A-Z]\{5\}\): \(.*\)/\1 \2/p' | head -n1
}
# 0.6.0: on each of the ledger's tables, quota.active and quota.history.
for t in active history; do
  expect_eq "CREATE TRIGGER on quota.$t is refused (0A000)" \
    "0A000 cannot create trigger \"audit\" on table \"quota.$t\"" \
    "$(err_of app "CREATE TRIGGER audit AFTER INSERT ON quota.$t FOR EACH ROW EXECUTE FUNCTION quota.ledger_written()")"
done
# The view quota.ledger: PostgreSQL itself refuses row AFTER triggers on a view; a
# statement trigger is pg_quota's to refuse.
expect_eq "CREATE TRIGGER on the view quota.ledger (a statement trigger) is refused (0A000)" \
  '0A000 cannot create trigger "audit" on table "quota.ledger"' \
  "$(err_of app "CREATE TRIGGER audit AFTER INSERT ON quota.ledger FOR EACH STATEMENT EXECUTE FUNCTION quota.ledger_written()")"
expect_eq "CREATE TRIGGER on quota.summary is refused (0A000)" \
  '0A000 cannot create trigger "audit" on table "quota.summary"' \
  "$(err_of app "CREATE TRIGGER audit AFTER INSERT ON quota.summary FOR EACH STATEMENT EXECUTE FUNCTION quota.ledger_written()")"
for t in active history; do
  expect_eq "a foreign key to quota.$t (whose checks are triggers) is refused (0A000)" 0A000 \
    "$(err_of app "CREATE TABLE public.jobs_fk (ticket uuid REFERENCES quota.$t (id))" | cut -c1-5)"
  expect_eq "DROP TRIGGER repack_trigger ON quota.$t is refused (2BP01)" \
    "2BP01 cannot drop trigger \"repack_trigger\" on table \"quota.$t\" because extension pg_quota requires it" \
    "$(err_of app "DROP TRIGGER repack_trigger ON quota.$t")"
  expect_eq "DROP TRIGGER ledger_written ON quota.$t is refused (2BP01)" 2BP01 \
    "$(err_of app "DROP TRIGGER ledger_written ON quota.$t" | cut -c1-5)"
done
expect_eq "renaming repack_trigger is refused (0A000)" 0A000 \
  "$(err_of app "ALTER TRIGGER repack_trigger ON quota.summary RENAME TO x" | cut -c1-5)"
for t in active history; do
  expect_eq "CREATE OR REPLACE TRIGGER ledger_written ON quota.$t is refused (0A000)" 0A000 \
    "$(err_of app "CREATE OR REPLACE TRIGGER ledger_written AFTER INSERT ON quota.$t FOR EACH STATEMENT EXECUTE FUNCTION quota.repack_placeholder()" | cut -c1-5)"
done
expect_eq "the tenant's own tables take triggers as usual" t \
  "$(as t1 app "CREATE TABLE mine (x int)" "CREATE FUNCTION mine_t() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NEW; END'" \
               "CREATE TRIGGER t BEFORE INSERT ON mine FOR EACH ROW EXECUTE FUNCTION mine_t()" \
               "SELECT count(*) = 1 FROM pg_trigger WHERE tgrelid = 'mine'::regclass")"
expect_eq "pg_quota's triggers are all still there" \
  "quota.active.ledger_truncated quota.active.ledger_written quota.active.repack_trigger quota.history.ledger_truncated quota.history.ledger_written quota.history.repack_trigger quota.summary.repack_trigger quota.summary.summary_written" \
  "$(sql -d app -c "SELECT string_agg(tgrelid::regclass || '.' || tgname, ' ' ORDER BY tgrelid::regclass::text, tgname) FROM pg_trigger
                     WHERE tgrelid IN ('quota.active'::regclass, 'quota.history'::regclass, 'quota.summary'::regclass)")"

if [ "$PG_MAJOR" != 15 ]; then
  echo "# pg_repack itself runs on 15 only: Debian packages it for 15 (postgresql-15-repack)"
  finish_checks
  exit
fi

# --- pg_repack, installed from Debian's package ----------------------------------------
apt_install postgresql-15-repack >/dev/null
# A PostgreSQL copy under PG15_BIN (an older build's) gets the package's files too.
for f in $(dpkg -L postgresql-15-repack | grep -E '/(pg_repack\.so|extension/pg_repack.*)$'); do
  case "$f" in
    */extension/*) dest="$("$PG_CONFIG" --sharedir)/extension" ;;
    *) dest="$("$PG_CONFIG" --pkglibdir)" ;;
  esac
  [ -e "$dest/$(basename "$f")" ] || cp "$f" "$dest/"
done
REPACK=/usr/lib/postgresql/15/bin/pg_repack
check "pg_repack is installed ($($REPACK --version 2>&1))" test -x "$REPACK"
for db in app app2; do sql -d "$db" -c "CREATE EXTENSION pg_repack" >/dev/null; done
# Tables of the DBA's, bloated, which -d and --all must still repack.
for db in app app2; do
  sql -d "$db" -c "CREATE TABLE public.jobs (id int PRIMARY KEY, payload text)" \
      -c "INSERT INTO public.jobs SELECT i, repeat('x', 100) FROM generate_series(1, 20000) i" \
      -c "DELETE FROM public.jobs WHERE id % 2 = 0" >/dev/null
done
relfile() { sql -d "$1" -c "SELECT pg_relation_filenode('$2')"; }

# --- load: four clients start and finish tickets all along ------------------------------
# Each iteration prints "S <ticket>" once start() returned it, and "F <ticket> t" once
# finish() returned true (committed). Failed statements print nothing usable.
{
  for i in $(seq 1 50); do
    echo "\\unset t"
    echo "SELECT quota.start('load') AS t \\gset"
    echo "\\echo S :t"
    echo "SELECT quota.finish(:'t') AS f \\gset"
    echo "\\echo F :t :f"
  done
} > "$CL/iter.sql"
client() {
  local k="$1"
  until [ -e "$CL/stop" ]; do
    timeout 120 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -h "$CL" -p "$PORT" -U t1 -d app \
      -f "$CL/iter.sql" >> "$CL/out.$k" 2>> "$CL/err.$k" || sleep 0.1
  done
}
for k in 1 2 3 4; do bg bash -c "$(declare -f client); CL='$CL' PORT='$PORT' PG_BIN='$PG_BIN' client $k"; done
received() { grep -Eh '^S [0-9a-f-]{36}$' "$CL"/out.* 2>/dev/null | wc -l; }
timeout 60 bash -c "until [ \$(cat '$CL'/out.* 2>/dev/null | grep -c '^S ') -ge 200 ]; do sleep 0.2; done"
check "the load runs (received tickets before pg_repack: $(received))" test "$(received)" -ge 200

# repack NAME ARGS...: runs pg_repack under the load; its output in $CL/repack.NAME.
repack() {
  local name="$1"; shift
  local before; before=$(received)
  "$REPACK" -h "$CL" -p "$PORT" -U postgres "$@" > "$CL/repack.$name" 2>&1 && REPACK_RC=0 || REPACK_RC=$?
  echo "# pg_repack $*: exit $REPACK_RC, $(( $(received) - before )) tickets received meanwhile"
  sed 's/^/#   /' "$CL/repack.$name" | head -n 20
}
skipped() { grep -q "WARNING: the table \"$2\" already has a trigger called \"repack_trigger\"" "$CL/repack.$1"; }

# 0.6.0: the ledger's tables are quota.active and quota.history; each in turn.
A0=$(relfile app quota.active); H0=$(relfile app quota.history); S0=$(relfile app quota.summary)
for t in active history; do
  T0=$(relfile app quota.$t)
  repack table_$t -d app --table quota.$t
  check "--table quota.$t: skipped before any copy, with pg_repack's warning" skipped table_$t quota.$t
  expect_eq "--table quota.$t: its file is the same" "$T0" "$(relfile app quota.$t)"
done
repack table_summary -d app --table quota.summary
check "--table quota.summary: skipped with pg_repack's warning" skipped table_summary quota.summary
expect_eq "--table quota.summary: the summary's file is the same" "$S0" "$(relfile app quota.summary)"
for t in active history; do
  I0=$(relfile app quota.${t}_pkey)
  repack only_indexes_$t -d app --only-indexes --table quota.$t
  expect_eq "--only-indexes --table quota.$t: succeeds (index builds read the table, which holds every row)" 0 "$REPACK_RC"
  check "--only-indexes: the indexes of quota.$t were rebuilt" test "$I0" != "$(relfile app quota.${t}_pkey)"
done
J0=$(relfile app public.jobs)
repack database -d app
check "-d app: quota.active is skipped" skipped database quota.active
check "-d app: quota.history is skipped" skipped database quota.history
check "-d app: the summary is skipped" skipped database quota.summary
check "-d app: the DBA's table public.jobs is repacked" test "$J0" != "$(relfile app public.jobs)"
expect_eq "-d app: pg_quota's files are the same" "$A0 $H0 $S0" \
  "$(relfile app quota.active) $(relfile app quota.history) $(relfile app quota.summary)"
J0=$(relfile app public.jobs); J2=$(relfile app2 public.jobs)
repack all --all
check "--all: quota.active is skipped" skipped all quota.active
check "--all: quota.history is skipped" skipped all quota.history
check "--all: public.jobs is repacked in app and in app2" \
  test "$J0" != "$(relfile app public.jobs)" -a "$J2" != "$(relfile app2 public.jobs)"
expect_eq "--all: the DBA's rows are all there" "10000 10000" \
  "$(sql -d app -c "SELECT count(*) FROM public.jobs") $(sql -d app2 -c "SELECT count(*) FROM public.jobs")"

touch "$CL/stop"
# The bracket keeps the pattern from matching this waiting shell's own command line.
timeout 150 bash -c "while pgrep -f '$CL/iter[.]sql' >/dev/null; do sleep 0.2; done" || true
sleep 1

# --- nothing was lost ---------------------------------------------------------------------
grep -Eho '^S [0-9a-f-]{36}$' "$CL"/out.* | cut -c3- | sort -u > "$CL/received"
grep -Eho '^F [0-9a-f-]{36} t$' "$CL"/out.* | cut -c3-38 | sort -u > "$CL/finished"
sql -d app -c "SELECT id FROM quota.ledger" | sort > "$CL/in_ledger"
sql -d app -c "SELECT id FROM quota.ledger WHERE ended_at IS NOT NULL" | sort > "$CL/ended"
echo "# $(wc -l < "$CL/received") tickets received, $(wc -l < "$CL/finished") finishes acknowledged"
# How many depends on the machine (1,400 on a quiet 2-core one, 800 under a parallel
# build); what matters is that the load ran through the runs.
check "hundreds of tickets were received during the runs" test "$(wc -l < "$CL/received")" -ge 400
expect_eq "every received ticket is in the ledger" 0 "$(comm -23 "$CL/received" "$CL/in_ledger" | wc -l)"
expect_eq "every acknowledged finish is still ended" 0 "$(comm -23 "$CL/finished" "$CL/ended" | wc -l)"
expect_eq "no finish() of a held ticket was told it does not exist (22023)" 0 \
  "$(cat "$CL"/err.* 2>/dev/null | grep -c 'does not exist' || true)"
check "quota.summary equals the ledger" summary_matches_ledger app

# --- a database still at 0.3.0's schema: no placeholder, so the library refuses ----------
EXTDIR="$("$PG_CONFIG" --sharedir)/extension"
cp "$ROOT/tests/upgrade/pg_quota--0.3.0.sql" "$EXTDIR/pg_quota--0.3.0.sql"
sql -c "CREATE DATABASE old" >/dev/null
sql -d old -c "CREATE EXTENSION pg_quota VERSION '0.3.0'" -c "CREATE EXTENSION pg_repack" >/dev/null
as t1 old "SELECT quota.start('old schema')" > "$CL/old_ticket"
O0=$(relfile old quota.ledger)
repack old_schema -d old --table quota.ledger
check "0.3.0 schema: pg_repack fails" test "$REPACK_RC" != 0
check "0.3.0 schema: ... at CREATE TRIGGER, with pg_quota's error and hint" \
  grep -q 'cannot create trigger "repack_trigger" on table "quota.ledger"' "$CL/repack.old_schema"
expect_eq "0.3.0 schema: the ledger was not copied, and its ticket is there" "$O0 1" \
  "$(relfile old quota.ledger) $(sql -d old -c "SELECT count(*) FROM quota.ledger WHERE id = '$(cat "$CL/old_ticket")'")"
expect_eq "0.3.0 schema: pg_repack left nothing behind on the ledger" 0 \
  "$(sql -d old -c "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'quota.ledger'::regclass AND tgname = 'repack_trigger'")"

finish_checks
