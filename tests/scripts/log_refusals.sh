#!/usr/bin/env bash
# quota.log_refusals: a LOG line per refusal in the server log, rate limited
# (0.3.0 observability). The server log is $CL/server.log (start_cluster's pg_ctl -l).
#
# Roles: lr_a (max_active_per_role = 1, one ticket kept, so every start is refused at
# the active limit), lr_r (max_retained_per_role = 1, one ticket started and finished),
# lr_d in database lr_db whose quota.max_active_per_database = 1 is filled by a
# superuser's ticket, lr_t a tenant with no setting of its own.
# Checks, and how each would fail:
# - off (the default): start() and try_start() refusals write no 'pg_quota refused'
#   line, and stats_info.log_suppressed does not move (nothing was suppressed by the
#   rate limit). Fails if the setting is ignored, or defaults to on, or if refusals
#   while off are counted as suppressed.
# - a tenant cannot turn it on: SET quota.log_refusals = on and ALTER ROLE itself SET
#   quota.log_refusals as lr_t give 42501, and its refusal afterwards writes nothing.
#   Fails if the GUC is PGC_USERSET (a tenant could flood the log).
# - on (ALTER ROLE ... SET by a superuser): one start() refusal writes exactly one LOG
#   line, exactly: LOG:  pg_quota refused a start for role "lr_a" in database
#   "postgres": 1 of 1 active tickets (quota.max_active_per_role = 1); no suffix.
#   Likewise the retained and the database-cap formats of the SPEC, exactly. Fails on
#   another wording, wrong counts or limit, a wrong role/database, a missing line, or
#   a line per call site (two lines for one refusal).
# - the line goes to the server log only: a client with client_min_messages = log does
#   not receive it. Fails if it is raised as a plain LOG (sent to such clients).
# - a storm of 200 try_start() refusals of lr_a within a second writes 1 or 2 lines for
#   lr_a, the first without a suffix; refused_active grows by exactly 200. Fails if
#   there is no rate limit, or it is per server instead of per (database, role) and
#   lets more through, or if an interval with nothing suppressed gets a "(0 similar
#   ...)" suffix.
# - one more refusal more than 1 s later writes one line ending in
#   " (N similar refusals were not logged)" where N = the refusals since the previous
#   line minus the lines written (computed exactly from quota.stats refused_active
#   deltas and the lines in between), and stats_info.log_suppressed grew by the same
#   total. Fails if the suppressed count is lost, off by one (the written line counted
#   as suppressed, or the count not reset after it is reported), or not reported.
# - right after that line, one more refusal writes nothing; the next one > 1 s later
#   ends in " (1 similar refusal was not logged)" (singular for N = 1, as USER_GUIDE.md
#   says). Fails if the count is not reset after being reported, or on other wording.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5732 + PORT_OFFSET))}"
with_cluster log_refusals
LOG="$CL/server.log"

sql -c "CREATE EXTENSION pg_quota" \
    -c "CREATE ROLE lr_a LOGIN" -c "ALTER ROLE lr_a SET quota.max_active_per_role = 1" \
    -c "CREATE ROLE lr_r LOGIN" -c "ALTER ROLE lr_r SET quota.max_retained_per_role = 1" \
    -c "CREATE ROLE lr_d LOGIN" -c "CREATE ROLE lr_t LOGIN" \
    -c "ALTER ROLE lr_t SET quota.max_active_per_role = 1" \
    -c "CREATE DATABASE lr_db" >/dev/null
sql -d lr_db -c "CREATE EXTENSION pg_quota" -c "ALTER DATABASE lr_db SET quota.max_active_per_database = 1" >/dev/null

log_mark() { stat -c %s "$LOG"; }
log_since() { tail -c +"$(( $1 + 1 ))" "$LOG"; }
# refusal_lines MARK [ROLE]: the 'pg_quota refused' lines written since MARK (of ROLE).
refusal_lines() {
  sleep 0.3  # stderr of the backends goes straight to the file; leave a margin anyway
  log_since "$1" | grep 'pg_quota refused' | grep -F "role \"${2:-}" || true
}
count_lines() { refusal_lines "$@" | grep -c . || true; }
refused_active() {
  sql -c "SELECT coalesce((SELECT refused_active FROM quota.stats WHERE datname = 'postgres' AND role = '$1'), 0)"
}
suppressed() { sql -c "SELECT log_suppressed FROM quota.stats_info"; }
# suffix_sum: the N of every " (N similar refusal(s) was/were not logged)" on stdin, summed.
suffix_sum() { sed -n -E 's/.* \(([0-9]+) similar refusals? (was|were) not logged\)$/\1/p' | awk '{ s += $1 } END { print s + 0 }'; }

psql_as lr_a -c "SELECT quota.start('kept') IS NOT NULL" >/dev/null
psql_as lr_t -c "SELECT quota.start('kept') IS NOT NULL" >/dev/null
psql_as lr_r -c "SELECT quota.finish(quota.start('done'))" >/dev/null
sql -d lr_db -c "SELECT quota.start('superuser fills the database') IS NOT NULL" >/dev/null

# ------------------------------------------------------------------------------------
# Off by default.
# ------------------------------------------------------------------------------------
expect_eq "quota.log_refusals is off by default" off "$(psql_as lr_a -c "SHOW quota.log_refusals")"
m=$(log_mark); s0=$(suppressed)
expect_eq "off: a start() refusal is 53400" 53400 "$(state lr_a postgres "SELECT quota.start('off')")"
expect_eq "off: try_start() refusals return NULL" "0" \
  "$(psql_as lr_a -c "SELECT count(quota.try_start('off')) FROM generate_series(1, 20)")"
expect_eq "off: retained and database-cap refusals are 53400" "53400 53400" \
  "$(state lr_r postgres "SELECT quota.start('off')") $(state lr_d lr_db "SELECT quota.start('off')")"
expect_eq "off: no 'pg_quota refused' line in the server log" 0 "$(count_lines "$m")"
expect_eq "off: stats_info.log_suppressed did not move" "$s0" "$(suppressed)"

# ------------------------------------------------------------------------------------
# A tenant cannot turn it on for itself.
# ------------------------------------------------------------------------------------
expect_eq "a tenant's SET quota.log_refusals = on is refused with 42501" 42501 \
  "$(state lr_t postgres "SET quota.log_refusals = on")"
expect_eq "a tenant's ALTER ROLE itself SET quota.log_refusals = on is refused with 42501" 42501 \
  "$(state lr_t postgres "ALTER ROLE lr_t SET quota.log_refusals = on")"
m=$(log_mark)
state lr_t postgres "SET quota.log_refusals = on" "SELECT quota.start('tenant tried')" >/dev/null
expect_eq "the tenant's refusal after its attempt wrote no line" 0 "$(count_lines "$m")"

# ------------------------------------------------------------------------------------
# On: one refusal, one line, in the SPEC's format.
# ------------------------------------------------------------------------------------
sql -c "ALTER ROLE lr_a SET quota.log_refusals = on" -c "ALTER ROLE lr_r SET quota.log_refusals = on" \
    -c "ALTER ROLE lr_d SET quota.log_refusals = on" >/dev/null
expect_eq "ALTER ROLE ... SET by a superuser turns it on for the role's sessions" on \
  "$(psql_as lr_a -c "SHOW quota.log_refusals")"

m=$(log_mark)
expect_eq "on: lr_a's start() is refused with 53400" 53400 "$(state lr_a postgres "SELECT quota.start('on')")"
lines=$(refusal_lines "$m")
expect_eq "on: one refusal wrote exactly one line" 1 "$(grep -c . <<<"$lines" || true)"
check "on: the line is exactly the SPEC's active-limit line [$lines]" grep -qE \
  '(^| )LOG:  pg_quota refused a start for role "lr_a" in database "postgres": 1 of 1 active tickets \(quota\.max_active_per_role = 1\)$' <<<"$lines"
r1=$(refused_active lr_a); m1=$(log_mark); s1=$(suppressed)

m=$(log_mark)
timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U lr_r -d postgres -v ON_ERROR_STOP=0 \
  -c "SET client_min_messages = log" -c "SELECT quota.try_start('retained 2') IS NULL" > "$CL/client_r.out" 2>&1 || true
lines=$(refusal_lines "$m" lr_r)
check "on: the retained-limit line is exactly the SPEC's [$(head -n1 <<<"$lines")]" grep -qE \
  '(^| )LOG:  pg_quota refused a start for role "lr_r" in database "postgres": 1 of 1 retained tickets \(quota\.max_retained_per_role = 1\)$' <<<"$(head -n1 <<<"$lines")"
check "the client (client_min_messages = log) did not receive the line [$(tr '\n' ' ' < "$CL/client_r.out")]" \
  bash -c "! grep -q 'pg_quota refused' '$CL/client_r.out' && grep -qx t '$CL/client_r.out'"

m=$(log_mark)
expect_eq "on: lr_d's start() in lr_db is refused by the database cap (53400)" 53400 \
  "$(state lr_d lr_db "SELECT quota.start('cap')")"
lines=$(refusal_lines "$m")
expect_eq "on: the database-cap refusal wrote exactly one line" 1 "$(grep -c . <<<"$lines" || true)"
check "on: the database-cap line is exactly the SPEC's [$lines]" grep -qE \
  '(^| )LOG:  pg_quota refused a start for role "lr_d" in database "lr_db": 1 of 1 active tickets in the database \(quota\.max_active_per_database = 1\)$' <<<"$lines"

# 0.7.0: a refusal at a tenant's own limit (quota.set_tenant_limits()) says so.
sql -c "CREATE ROLE lr_o LOGIN" -c "ALTER ROLE lr_o SET quota.max_active_per_tenant = 5" \
    -c "ALTER ROLE lr_o SET quota.log_refusals = on" \
    -c "SELECT quota.set_tenant_limits('acme', max_active => 1, role => 'lr_o')" >/dev/null
psql_as lr_o -c "SELECT quota.start('kept', tenant => 'acme') IS NOT NULL" >/dev/null
m=$(log_mark)
expect_eq "on: lr_o's tenant acme is refused at its own limit (53400)" 53400 \
  "$(state lr_o postgres "SELECT quota.start('own', tenant => 'acme')")"
lines=$(refusal_lines "$m" lr_o)
check "on: the line names the tenant's own limit [$lines]" grep -qE \
  '(^| )LOG:  pg_quota refused a start for role "lr_o" in database "postgres": tenant "acme" holds 1 of 1 active tickets \(set for the tenant by quota\.set_tenant_limits: 1\)$' <<<"$lines"

# ------------------------------------------------------------------------------------
# The storm: 200 refusals of lr_a within a second, more than 1 s after its last line.
# ------------------------------------------------------------------------------------
sleep 1.5
storm=$(psql_as lr_a -F ' ' -c "SELECT count(*) FILTER (WHERE t IS NULL),
             round(extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000)
        FROM (SELECT quota.try_start('storm') AS t FROM generate_series(1, 200)) s")
read -r storm_null storm_ms <<<"$storm"
expect_eq "storm: all 200 try_start() calls were refused" 200 "$storm_null"
check "storm: the 200 refusals took less than a second ($storm_ms ms)" test "${storm_ms:-9999}" -lt 1000
r2=$(refused_active lr_a)
expect_eq "storm: refused_active of lr_a grew by exactly 200" 200 $((r2 - r1))
storm_lines=$(refusal_lines "$m1" lr_a)
storm_n=$(grep -c . <<<"$storm_lines" || true)
echo "# storm lines of lr_a: $storm_n"; sed 's/^/#   /' <<<"$storm_lines"
check "storm: at most 2 lines for lr_a (wrote $storm_n)" test "$storm_n" -le 2
check "storm: at least 1 line for lr_a (its first refusal comes > 1 s after the last line)" test "$storm_n" -ge 1
check "storm: the first line has no suffix (nothing was suppressed before it)" grep -qE \
  'pg_quota refused a start for role "lr_a" in database "postgres": 1 of 1 active tickets \(quota\.max_active_per_role = 1\)$' \
  <<<"$(head -n1 <<<"$storm_lines")"
storm_suffixes=$(suffix_sum <<<"$storm_lines")

sleep 1.5
m2=$(log_mark)
expect_eq "after the storm: one more start() refusal of lr_a (53400)" 53400 "$(state lr_a postgres "SELECT quota.start('after storm')")"
r3=$(refused_active lr_a)
last=$(refusal_lines "$m2" lr_a)
expect_eq "after the storm: that refusal wrote exactly one line" 1 "$(grep -c . <<<"$last" || true)"
# Since m1: r3 - r1 refusals, storm_n + 1 of them logged; the rest is suppressed and
# reported in the suffixes of the storm's later lines and of this one.
want_n=$(( (r3 - r1) - (storm_n + 1) - storm_suffixes ))
echo "# refusals since the last line before the storm: $((r3 - r1)); lines since: $((storm_n + 1)); suffixes in the storm: $storm_suffixes; expected N = $want_n"
check "after the storm: the line ends in ' ($want_n similar refusals were not logged)' [$last]" grep -qE \
  "(^| )LOG:  pg_quota refused a start for role \"lr_a\" in database \"postgres\": 1 of 1 active tickets \\(quota\\.max_active_per_role = 1\\) \\($want_n similar refusals were not logged\\)\$" <<<"$last"
check "after the storm: N = $want_n > 0" test "$want_n" -gt 0
expect_eq "stats_info.log_suppressed grew by every refusal not logged ($(( (r3 - r1) - (storm_n + 1) )))" \
  $(( (r3 - r1) - (storm_n + 1) )) $(( $(suppressed) - s1 ))

m=$(log_mark)
expect_eq "right after, the next refusal of lr_a is suppressed again: no line" "53400 0" \
  "$(state lr_a postgres "SELECT quota.start('suppressed')") $(count_lines "$m" lr_a)"
# That one suppressed refusal is reported by the next line: N = 1, in the singular.
sleep 1.5
m=$(log_mark)
expect_eq "later, one more start() refusal of lr_a (53400)" 53400 "$(state lr_a postgres "SELECT quota.start('after one')")"
last=$(refusal_lines "$m" lr_a)
check "its line ends in ' (1 similar refusal was not logged)' [$last]" grep -qE \
  '(^| )LOG:  pg_quota refused a start for role "lr_a" in database "postgres": 1 of 1 active tickets \(quota\.max_active_per_role = 1\) \(1 similar refusal was not logged\)$' <<<"$last"
check "no crash: the server did not reinitialize" bash -c "! grep -q 'reinitializing' '$LOG'"
finish_checks
