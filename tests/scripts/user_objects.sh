#!/usr/bin/env bash
# Objects a DBA adds to pg_quota's ledger. A unique index or an exclusion constraint,
# which the writer's direct index inserts cannot honour (one tenant's duplicate label
# would fail whole batches of other roles), makes start() refuse with 0A000 for every
# role, as expression and partial indexes do. A trigger on the ledger is refused at
# CREATE TRIGGER (0.3.1: pg_quota's writes would never fire it, and a trigger-based
# copy such as pg_repack's lost tickets); a rule does not fire on the writer's purge of
# expired tickets, and cannot make start() fail.
# From 0.6.0 the ledger is two tables, quota.active (tickets not ended) and
# quota.history (ended ones), and quota.ledger is a view over both: each object below
# goes on each of the two tables in turn (the writer's batch writes both: it inserts
# into quota.active and purges quota.history).
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5684 + PORT_OFFSET))}"
with_cluster user_objects

sqlstate() {  # sqlstate USER SQL: the SQLSTATE that SQL ends with, as USER
  timeout 20 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -h "$CL" -p "$PORT" -U "$1" -d postgres \
    -c "$2" -c '\echo SQLSTATE=:SQLSTATE' 2>>"$CL/errors" | sed -n 's/^SQLSTATE=//p'
}

sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE uo_a LOGIN" -c "CREATE ROLE uo_b LOGIN" -c "CREATE ROLE uo_p LOGIN"
psql_as uo_a -c "SELECT quota.start('a first')" >/dev/null

# ------------------------------------------------------------------------------------
# 1. A user-added UNIQUE index, then an EXCLUDE constraint, on quota.active, then the
#    same on quota.history (0.6.0: the ledger's two tables).
# ------------------------------------------------------------------------------------
# refused_everywhere WHAT: start() and try_start() raise 0A000 for two tenants and a
# superuser (labels all distinct, so nothing else could refuse them).
refused_everywhere() {
  local what="$1" tag="$2"
  expect_eq "$what: uo_a's start() is refused with 0A000" 0A000 "$(sqlstate uo_a "SELECT quota.start('$tag a')")"
  expect_eq "$what: uo_b's start() is refused with 0A000" 0A000 "$(sqlstate uo_b "SELECT quota.start('$tag b')")"
  expect_eq "$what: uo_b's try_start() is refused with 0A000" 0A000 "$(sqlstate uo_b "SELECT quota.try_start('$tag b2')")"
  expect_eq "$what: a superuser's start() is refused with 0A000" 0A000 "$(sqlstate postgres "SELECT quota.start('$tag su')")"
  expect_eq "$what: no charge was recorded" 0 "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label LIKE '$tag %'")"
}
for t in active history; do
  : > "$CL/errors"
  sql -c "CREATE UNIQUE INDEX ${t}_label_key ON quota.$t (label)"
  refused_everywhere "with a unique index on quota.$t (label)" "uniq_$t"
  check "the refusal names the unique index: $(sort -u "$CL/errors" | head -n2 | tr '\n' ' ')" \
    grep -q "${t}_label_key" "$CL/errors"
  sql -c "DROP INDEX quota.${t}_label_key"
  expect_eq "start() works again once the unique index on quota.$t is dropped" t \
    "$(psql_as uo_a -c "SELECT quota.start('after unique $t a') IS NOT NULL" 2>&1)"

  sql -c "ALTER TABLE quota.$t ADD CONSTRAINT ${t}_label_excl EXCLUDE USING btree (label WITH =)"
  refused_everywhere "with an EXCLUDE constraint on quota.$t (label)" "excl_$t"
  sql -c "ALTER TABLE quota.$t DROP CONSTRAINT ${t}_label_excl"
  expect_eq "start() works again once the constraint on quota.$t is dropped" t \
    "$(psql_as uo_b -c "SELECT quota.start('after exclude $t b') IS NOT NULL" 2>&1)"
done
check "the summary equals the ledger after the refusals" summary_matches_ledger

# ------------------------------------------------------------------------------------
# 2. An AFTER DELETE trigger (refused), then a DO INSTEAD NOTHING rule, on the
#    ledger, while uo_p runs with quota.retention = 0 (server-wide, for the
#    cycles), so that each of its start()s purges its ended tickets. The purge must
#    happen, fire nothing, and never fail start(). 0.6.0: on both of the ledger's
#    tables, quota.history (which the purge deletes from) and quota.active (which each
#    finish() deletes the ticket from, to insert it into quota.history).
# ------------------------------------------------------------------------------------
sql -c "CREATE TABLE public.purge_count (n int NOT NULL)" -c "INSERT INTO public.purge_count VALUES (0)" \
    -c "CREATE FUNCTION public.count_purge() RETURNS trigger LANGUAGE plpgsql AS
          \$\$BEGIN UPDATE public.purge_count SET n = n + 1; RETURN OLD; END\$\$"
p_rows() { sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'uo_p'::regrole"; }
ended_history() {  # five ended tickets of uo_p, kept by the default retention
  psql_as uo_p -c "SELECT quota.finish(quota.start('history ' || i)) FROM generate_series(1, 5) i" >/dev/null
}
# cycles: three start/finish cycles of uo_p with quota.retention = 0, set server-wide
# for the cycles (the writer purges only what no configured retention still counts),
# then reset; prints each result, or the error.
retention_everywhere() {  # retention_everywhere VALUE|DEFAULT: ALTER SYSTEM, reload
  if [ "$1" = DEFAULT ]; then sql -c "ALTER SYSTEM RESET quota.retention" >/dev/null
  else sql -c "ALTER SYSTEM SET quota.retention = $1" >/dev/null; fi
  sql -c "SELECT pg_reload_conf()" >/dev/null
  sleep 1   # the writer rereads the file on SIGHUP
}
cycles() {
  retention_everywhere 0
  timeout 30 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$CL" -p "$PORT" -U postgres -d postgres \
    -c "SET quota.retention = 0" -c "SET ROLE uo_p" \
    -c "SELECT quota.finish(quota.start('cycle 1'))" \
    -c "SELECT quota.finish(quota.start('cycle 2'))" \
    -c "SELECT quota.finish(quota.start('cycle 3'))" 2>&1 | tr '\n' ' '
  retention_everywhere DEFAULT
}

ended_history
before=$(p_rows)
for t in active history; do
  expect_eq "an AFTER DELETE trigger on quota.$t is refused (0A000)" 0A000 \
    "$(sqlstate postgres "CREATE TRIGGER count_purge AFTER DELETE ON quota.$t FOR EACH ROW EXECUTE FUNCTION public.count_purge()")"
done
expect_eq "start()/finish() cycles with retention 0 succeed" "t t t " "$(cycles)"
expect_eq "... and nothing fired on the writer's purge" 0 "$(sql -c "SELECT n FROM public.purge_count")"
after=$(p_rows)
check "... and the purge happened: uo_p's ledger rows went from $before to $after" test "$after" -lt "$before" -a "$after" -le 1
check "the summary equals the ledger after the purges" summary_matches_ledger

ended_history
before=$(p_rows)
sql -c "CREATE RULE ledger_keep AS ON DELETE TO quota.active DO INSTEAD NOTHING" \
    -c "CREATE RULE ledger_keep AS ON DELETE TO quota.history DO INSTEAD NOTHING"
expect_eq "with a DO INSTEAD NOTHING delete rule on quota.active and quota.history, start()/finish() cycles with retention 0 succeed" "t t t " "$(cycles)"
after=$(p_rows)
check "... and the purge happened: uo_p's ledger rows went from $before to $after" test "$after" -lt "$before" -a "$after" -le 1
check "the summary equals the ledger after the purges" summary_matches_ledger
sql -c "DROP RULE ledger_keep ON quota.active" -c "DROP RULE ledger_keep ON quota.history"
expect_eq "start() works once the rules are dropped" t \
  "$(psql_as uo_p -c "SELECT quota.start('after the rule') IS NOT NULL" 2>&1)"
finish_checks
