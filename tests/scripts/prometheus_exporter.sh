#!/usr/bin/env bash
# contrib/prometheus/queries.yaml works with Debian 12's prometheus-postgres-exporter
# (0.11) and exports what quota.stats, quota.stats_info, quota.writer_stats,
# quota.wait_histogram and quota.usage say, with no tenant identity in the default
# metrics (0.3.0).
#
# Installs prometheus-postgres-exporter, python3-prometheus-client and python3-yaml
# (apt) if missing. A fresh install must leave no exporter service running: it is
# installed under a policy-rc.d that forbids starting services (unless one exists) and
# its service is stopped and disabled afterwards. The test then runs its own exporter,
# as the role exporter (LOGIN IN ROLE pg_monitor), on 127.0.0.1:PORT+3450, with only
# the queries of the file, and stops it at exit.
#
# A scripted workload with known numbers, in database postgres (the exporter's), each
# counter with its own number so that a query reading the wrong column cannot pass:
#   tenant_alpha (max_active_per_role 2, log_refusals on): 10 finish(start())
#     succeeded, 8 'failed', 9 'cancelled'; a ticket with an idempotency key that 7
#     retries get back (hits), renewed 6 times, finished; 2 held tickets; then 9
#     try_start refused, 1 start refused (53400), 1 try_start(wait => '1.5 s') timed
#     out and 1 start(wait => '10 s') ended by statement_timeout (300 ms): 11 refusals
#     (active), 2 waits (one in the 1 s bucket of the histogram, one in the 10 s
#     bucket), 1 wait timeout, about 1.8 s waited;
#   tenant_bravo (max_retained_per_role 1): 1 succeeded, then 3 refusals (retained);
#   tenant_charlie (max_active_per_database 2, the 2 held tickets fill it): 4 refusals
#     (database);
#   tenant_delta: 5 tickets with a 1 s lease that the writer's sweep expires;
#   and in database other: tenant_alpha 1 succeeded.
# Checks, and how each can fail:
# - the workload did what it should (else the numbers below mean nothing);
# - the role exporter (pg_monitor) counts as many rows in quota.stats, writer_stats
#   and usage as a superuser: fails, naming the view, where a view hides rows from
#   pg_read_all_stats members (quota.usage did before 0.3.0);
# - the exporter is up, loaded the file (pg_exporter_user_queries_load_error 0), its
#   scrape had no error (pg_exporter_last_scrape_error 0) and its log has no error or
#   warning line: fails on a query that does not run (a wrong column, a missing
#   privilege) or a file the exporter cannot load;
# - the file defines exactly the metric names and types listed here (the names are
#   an interface), and the scrape has exactly those pg_quota families with those
#   types: fails on a renamed metric, a counter declared as a gauge, a query that
#   returns no row (family missing), a column left out of metrics (exported untyped);
# - every pg_quota sample equals what the test's own SQL on quota.stats, quota.usage,
#   quota.stats_info and quota.writer_stats returns as a superuser just before and just
#   after the scrape (sums per database, per reason, per outcome; ms turned into
#   seconds): fails on a query that sums the wrong column, drops a database or a
#   label, or sees fewer rows than a superuser;
# - the values for database postgres (and other) equal the workload's known numbers,
#   so a mistake shared by the file and the test's SQL fails too; for the time and
#   the log counters, a range;
# - usage is exported for the exporter's database only (datname = postgres);
# - no label value of the whole scrape contains a tenant's role name: fails if a
#   default metric carries a role label;
# - the commented-out per-role block, uncommented as its header says, loads next to
#   the default metrics (unchanged), its samples equal the per-role SQL and its role
#   labels are the 4 tenants: fails if the block is invalid or collides.
#
# PROMETHEUS_QUERIES overrides the queries file; it exists only to check that this
# test fails with a broken file (default: contrib/prometheus/queries.yaml).
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5740 + PORT_OFFSET))}"
EXPORTER_PORT="${EXPORTER_PORT:-$((PORT + 3450))}"
# EXPORTER, PY, HELPER, port_free, start_exporter, stop_exporter, scrape
source "$ROOT/tests/scripts/prometheus_lib.bash"
QUERIES="${PROMETHEUS_QUERIES:-$ROOT/contrib/prometheus/queries.yaml}"

# --- install -------------------------------------------------------------------------
fresh=0
dpkg-query -W -f='${Status}' prometheus-postgres-exporter 2>/dev/null | grep -q "install ok installed" || fresh=1
if [ "$fresh" = 1 ] && [ ! -e /usr/sbin/policy-rc.d ]; then
  # The postinst starts the service through invoke-rc.d / deb-systemd-invoke, which
  # both ask policy-rc.d first; 101 = action forbidden.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  apt_install prometheus-postgres-exporter python3-prometheus-client python3-yaml >&2
  rm -f /usr/sbin/policy-rc.d
  trap - EXIT
else
  apt_install prometheus-postgres-exporter python3-prometheus-client python3-yaml >&2
fi
if [ "$fresh" = 1 ]; then
  # Whatever the policy let through: stop the packaged service and keep it from
  # starting at boot. Harmless where it never ran (no systemd, no pid file).
  if [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus-postgres-exporter.service >/dev/null 2>&1 || true
  else
    /etc/init.d/prometheus-postgres-exporter stop >/dev/null 2>&1 || true
    systemctl disable prometheus-postgres-exporter.service >/dev/null 2>&1 || true
  fi
  # The package's service runs as user prometheus; nothing of it may be left.
  check "the fresh install left no exporter service running" \
    bash -c "! pgrep -u prometheus -x prometheus-post >/dev/null"
fi
check "the exporter binary is installed ($EXPORTER)" test -x "$EXPORTER"
check "python3-prometheus-client is importable by $PY" "$PY" -c "import prometheus_client.parser, yaml"

with_cluster prometheus_exporter

# --- workload --------------------------------------------------------------------------
# Every counter of database postgres gets its own number, so that a query that reads
# the wrong column cannot come out right by chance.
N_OK=10 N_FAILED=8 N_CANCELLED=9 N_HITS=7 N_RENEWS=6 N_EXPIRED=5 N_DATABASE=4 N_RETAINED=3 N_TRY=9
sql -c "CREATE EXTENSION pg_quota" -c "CREATE DATABASE other" >/dev/null
sql -d other -c "CREATE EXTENSION pg_quota" >/dev/null
sql >/dev/null <<'SQL'
CREATE ROLE tenant_alpha LOGIN;
ALTER ROLE tenant_alpha SET quota.max_active_per_role = 2;
ALTER ROLE tenant_alpha SET quota.log_refusals = on;
CREATE ROLE tenant_bravo LOGIN;
ALTER ROLE tenant_bravo SET quota.max_retained_per_role = 1;
CREATE ROLE tenant_charlie LOGIN;
ALTER ROLE tenant_charlie SET quota.max_active_per_database = 2;
CREATE ROLE tenant_delta LOGIN;
CREATE ROLE exporter LOGIN IN ROLE pg_monitor;
SQL
TENANTS=(tenant_alpha tenant_bravo tenant_charlie tenant_delta)

# repeat ROLE N SQL: runs SQL N times in one session of ROLE, each time in its own
# transaction (a finish frees its slot only at commit); prints the results on one line.
repeat() {
  local role="$1" n="$2" q="$3" a=() i
  for ((i = 0; i < n; i++)); do a+=(-c "$q"); done
  psql_as "$role" "${a[@]}" | tr '\n' ' '
}
ts() { local i; for ((i = 0; i < $1; i++)); do printf 't '; done; }  # ts N: "t t ... "

expect_eq "workload: tenant_alpha finished $N_OK succeeded" "$(ts $N_OK)" \
  "$(repeat tenant_alpha $N_OK "SELECT quota.finish(quota.start('ok'))")"
expect_eq "workload: tenant_alpha finished $N_FAILED failed" "$(ts $N_FAILED)" \
  "$(repeat tenant_alpha $N_FAILED "SELECT quota.finish(quota.start('bad'), 'failed')")"
expect_eq "workload: tenant_alpha finished $N_CANCELLED cancelled" "$(ts $N_CANCELLED)" \
  "$(repeat tenant_alpha $N_CANCELLED "SELECT quota.finish(quota.start('stop'), 'cancelled')")"
out=$(
  echo "SELECT quota.start('job', lease => '1 h', idempotency_key => 'job-1') AS t \\gset"
  for ((i = 0; i < N_HITS; i++)); do
    echo "SELECT quota.start('job', lease => '1 h', idempotency_key => 'job-1') = :'t'::uuid;"
  done
  for ((i = 0; i < N_RENEWS; i++)); do echo "SELECT quota.renew(:'t', '2 h') > now();"; done
  echo "SELECT quota.finish(:'t');"
)
expect_eq "workload: tenant_alpha's keyed ticket: $N_HITS retries got it, $N_RENEWS renewals, finished" \
  "$(ts $((N_HITS + N_RENEWS + 1)))" "$(psql_as tenant_alpha <<<"$out" | tr '\n' ' ')"
expect_eq "workload: tenant_alpha holds 2 tickets, its limit" "t t " \
  "$(repeat tenant_alpha 2 "SELECT quota.start('held') IS NOT NULL")"
expect_eq "workload: $N_TRY try_start() of tenant_alpha refused" "$(ts $N_TRY)" \
  "$(repeat tenant_alpha $N_TRY "SELECT quota.try_start('over') IS NULL")"
expect_eq "workload: a start() of tenant_alpha refused with 53400" 53400 \
  "$(state tenant_alpha postgres "SELECT quota.start('over')")"
t0=$SECONDS
expect_eq "workload: a try_start(wait => '1.5 s') of tenant_alpha waited, then was refused" t \
  "$(psql_as tenant_alpha -c "SELECT quota.try_start('patient', wait => '1.5 s') IS NULL")"
expect_eq "workload: a start(wait => '10 s') of tenant_alpha ended by statement_timeout (300 ms)" 57014 \
  "$(state tenant_alpha postgres "SET statement_timeout = '300ms'" "SELECT quota.start('impatient', wait => '10 s')")"
check "workload: both waits took about 1.8 s ($((SECONDS - t0)) s)" test $((SECONDS - t0)) -lt 8
expect_eq "workload: tenant_bravo finished 1, then was refused $N_RETAINED times (retained)" \
  "t $(ts $N_RETAINED)" \
  "$(psql_as tenant_bravo -c "SELECT quota.finish(quota.start('once'))" | tr '\n' ' ')$(
     repeat tenant_bravo $N_RETAINED "SELECT quota.try_start('again') IS NULL")"
expect_eq "workload: tenant_charlie refused $N_DATABASE times (the database cap)" "$(ts $N_DATABASE)" \
  "$(repeat tenant_charlie $N_DATABASE "SELECT quota.try_start('db') IS NULL")"
expect_eq "workload: tenant_delta started $N_EXPIRED tickets with a 1 s lease" "$(ts $N_EXPIRED)" \
  "$(repeat tenant_delta $N_EXPIRED "SELECT quota.start('short', lease => '1 s') IS NOT NULL")"
expect_eq "workload: tenant_alpha finished 1 in database other" t \
  "$(as tenant_alpha other "SELECT quota.finish(quota.start('elsewhere'))")"
expired() { [ "$(sql -c "SELECT coalesce(sum(expired), 0) FROM quota.stats WHERE role = 'tenant_delta'")" = "$N_EXPIRED" ]; }
for _ in $(seq 1 100); do expired && break; sleep 0.1; done
check "workload: the writer's sweep expired tenant_delta's $N_EXPIRED tickets within 10 s" expired

# What the exporter's role (pg_monitor) can read: every row of each view, as a
# superuser does; otherwise the sums below come out too small, and these checks say
# which view holds rows back.
for v in quota.stats quota.writer_stats quota.usage; do
  expect_eq "the exporter's role (pg_monitor) sees every row of $v, as a superuser does" \
    "$(sql -c "SELECT count(*) FROM $v")" "$(psql_as exporter -c "SELECT count(*) FROM $v")"
done

# --- exporter ---------------------------------------------------------------------------
# same NAME FILE1 FILE2: a check that the two files have the same lines; prints the diff.
same() {
  local name="$1" d
  if d=$(diff "$2" "$3"); then check "$name" true
  else check "$name" false; sed 's/^/#   /' <<<"$d" | head -n 40; fi
}
samples() { sed -n 's/^SAMPLE //p' "$CL/scrape.$1"; }
value() { samples "$1" | awk -F'\t' -v k="$2" '$1 == k { print $2 }'; }
# exporter_healthy TAG FILE: up, file loaded, last scrape without error, a clean log.
exporter_healthy() {
  local tag="$1" file="$2" bad
  expect_eq "$tag: pg_up" 1 "$(value "$tag" 'pg_up{}')"
  expect_eq "$tag: the exporter loaded the queries file (pg_exporter_user_queries_load_error)" 0 \
    "$(samples "$tag" | awk -F'\t' -v k="pg_exporter_user_queries_load_error{filename=\"$file\"," \
         'index($1, k) == 1 { print $2 }')"
  expect_eq "$tag: pg_exporter_last_scrape_error" 0 "$(value "$tag" 'pg_exporter_last_scrape_error{}')"
  bad=$(grep -E 'level=(error|warn)|err=' \
          "$CL/exporter.$tag.log" || true)
  check "$tag: the exporter logged no error or warning, none about a pg_quota namespace" test -z "$bad"
  [ -z "$bad" ] || sed 's/^/#   /' <<<"$bad" | head -n 20
}
# The metric names are an interface (dashboards and alerts use them): the file must
# define exactly these, with these types.
FAMILIES_DEFAULT="pg_quota_admitted_total counter
pg_quota_expired_total counter
pg_quota_finished_total counter
pg_quota_idempotent_hits_total counter
pg_quota_refused_total counter
pg_quota_renewed_total counter
pg_quota_stats_entries gauge
pg_quota_stats_evicted_total counter
pg_quota_stats_log_suppressed_total counter
pg_quota_stats_max gauge
pg_quota_usage_active gauge
pg_quota_usage_ledger_rows gauge
pg_quota_usage_retained gauge
pg_quota_wait_duration_seconds histogram
pg_quota_wait_seconds_total counter
pg_quota_wait_timeouts_total counter
pg_quota_waits_total counter
pg_quota_writer_batches_total counter
pg_quota_writer_commit_seconds_total counter
pg_quota_writer_requests_total counter
pg_quota_writer_restarts_total counter"
FAMILIES_PER_ROLE="pg_quota_role_admitted_total counter
pg_quota_role_expired_total counter
pg_quota_role_finished_total counter
pg_quota_role_idempotent_hits_total counter
pg_quota_role_refused_total counter
pg_quota_role_renewed_total counter
pg_quota_role_usage_active gauge
pg_quota_role_usage_retained gauge
pg_quota_role_wait_seconds_total counter
pg_quota_role_wait_timeouts_total counter
pg_quota_role_waits_total counter"
# families TAG FILE EXPECTED: the file defines exactly the EXPECTED metrics and types,
# and the scrape has exactly those pg_quota families, with those types.
families() {
  sort <<<"$3" > "$CL/families.$1"
  "$PY" "$HELPER" defs "$2" | sort > "$CL/defs.$1"
  sed -n 's/^TYPE \(pg_quota\)/\1/p' "$CL/scrape.$1" | sort > "$CL/types.$1"
  same "$1: the file defines the $(wc -l < "$CL/families.$1") expected metrics, with their types" \
    "$CL/families.$1" "$CL/defs.$1"
  same "$1: the scrape has exactly these pg_quota families, with these types" \
    "$CL/families.$1" "$CL/types.$1"
}

# The test's own SQL for every default sample, as a superuser: "key<TAB>value" lines,
# key as the helper writes it (labels sorted, no server label).
sql_default() {
  sql <<'SQL' | "$PY" "$HELPER" norm | sort
WITH s AS (SELECT * FROM quota.stats),
     c(metric, col) AS (VALUES ('admitted_total', 'admitted'), ('expired_total', 'expired'),
                               ('renewed_total', 'renewed'), ('idempotent_hits_total', 'idempotent_hits'),
                               ('waits_total', 'waits'), ('wait_timeouts_total', 'wait_timeouts'))
SELECT format('pg_quota_%s{datname="%s"}', c.metric, s.datname) || E'\t' || sum((to_jsonb(s) ->> c.col)::numeric)
  FROM s, c GROUP BY s.datname, c.metric
UNION ALL
SELECT format('pg_quota_wait_seconds_total{datname="%s"}', datname) || E'\t' || (sum(wait_time) / 1000)::float8
  FROM s GROUP BY datname
UNION ALL
SELECT format('pg_quota_refused_total{datname="%s",reason="%s"}', datname, r) || E'\t' ||
       sum(CASE r WHEN 'active' THEN refused_active WHEN 'retained' THEN refused_retained
                  WHEN 'database' THEN refused_database END)
  FROM s, unnest(ARRAY['active', 'retained', 'database']) r GROUP BY datname, r
UNION ALL
SELECT format('pg_quota_finished_total{datname="%s",outcome="%s"}', datname, o) || E'\t' ||
       sum(CASE o WHEN 'succeeded' THEN finished_succeeded WHEN 'failed' THEN finished_failed
                  WHEN 'cancelled' THEN finished_cancelled END)
  FROM s, unnest(ARRAY['succeeded', 'failed', 'cancelled']) o GROUP BY datname, o
UNION ALL
SELECT format('pg_quota_usage_active{datname="%s"}', current_database()) || E'\t' || coalesce(sum(active), 0) FROM quota.usage
UNION ALL
SELECT format('pg_quota_usage_retained{datname="%s"}', current_database()) || E'\t' || coalesce(sum(retained), 0) FROM quota.usage
UNION ALL
SELECT format('pg_quota_usage_ledger_rows{datname="%s"}', current_database()) || E'\t' || count(*) FROM quota.ledger
UNION ALL
SELECT format('pg_quota_wait_duration_seconds_bucket{datname="%s",le="%s"}', datname,
              CASE WHEN le = 'Infinity' THEN '+Inf' ELSE (le / 1000)::text END) || E'\t' || sum(waits)
  FROM quota.wait_histogram GROUP BY datname, le
UNION ALL
SELECT format('pg_quota_wait_duration_seconds_count{datname="%s"}', datname) || E'\t' || sum(waits)
  FROM quota.wait_histogram WHERE le = 'Infinity' GROUP BY datname
UNION ALL
SELECT format('pg_quota_wait_duration_seconds_sum{datname="%s"}', datname) || E'\t' || (sum(wait_time) / 1000)::float8
  FROM s GROUP BY datname
UNION ALL
SELECT 'pg_quota_stats_max{}' || E'\t' || max FROM quota.stats_info
UNION ALL
SELECT 'pg_quota_stats_entries{}' || E'\t' || entries FROM quota.stats_info
UNION ALL
SELECT 'pg_quota_stats_evicted_total{}' || E'\t' || evicted FROM quota.stats_info
UNION ALL
SELECT 'pg_quota_stats_log_suppressed_total{}' || E'\t' || log_suppressed FROM quota.stats_info
UNION ALL
SELECT format('pg_quota_writer_batches_total{datname="%s"}', datname) || E'\t' || batches FROM quota.writer_stats
UNION ALL
SELECT format('pg_quota_writer_requests_total{datname="%s"}', datname) || E'\t' || requests FROM quota.writer_stats
UNION ALL
SELECT format('pg_quota_writer_commit_seconds_total{datname="%s"}', datname) || E'\t' || (commit_time / 1000)::float8 FROM quota.writer_stats
UNION ALL
SELECT format('pg_quota_writer_restarts_total{datname="%s"}', datname) || E'\t' || restarts FROM quota.writer_stats
SQL
}
# The same for the per-role block.
sql_per_role() {
  sql <<'SQL' | "$PY" "$HELPER" norm | sort
WITH s AS (SELECT * FROM quota.stats),
     c(metric, col) AS (VALUES ('admitted_total', 'admitted'), ('expired_total', 'expired'),
                               ('renewed_total', 'renewed'), ('idempotent_hits_total', 'idempotent_hits'),
                               ('waits_total', 'waits'), ('wait_timeouts_total', 'wait_timeouts'))
SELECT format('pg_quota_role_%s{datname="%s",role="%s"}', c.metric, s.datname, s.role) || E'\t' || (to_jsonb(s) ->> c.col)
  FROM s, c
UNION ALL
SELECT format('pg_quota_role_wait_seconds_total{datname="%s",role="%s"}', datname, role) || E'\t' || (wait_time / 1000)::float8
  FROM s
UNION ALL
SELECT format('pg_quota_role_refused_total{datname="%s",reason="%s",role="%s"}', datname, r, role) || E'\t' ||
       CASE r WHEN 'active' THEN refused_active WHEN 'retained' THEN refused_retained
              WHEN 'database' THEN refused_database END
  FROM s, unnest(ARRAY['active', 'retained', 'database']) r
UNION ALL
SELECT format('pg_quota_role_finished_total{datname="%s",outcome="%s",role="%s"}', datname, o, role) || E'\t' ||
       CASE o WHEN 'succeeded' THEN finished_succeeded WHEN 'failed' THEN finished_failed
              WHEN 'cancelled' THEN finished_cancelled END
  FROM s, unnest(ARRAY['succeeded', 'failed', 'cancelled']) o
UNION ALL
SELECT format('pg_quota_role_usage_active{datname="%s",role="%s"}', current_database(), (SELECT rolname FROM pg_roles WHERE oid = role)) || E'\t' || active FROM quota.usage
UNION ALL
SELECT format('pg_quota_role_usage_retained{datname="%s",role="%s"}', current_database(), (SELECT rolname FROM pg_roles WHERE oid = role)) || E'\t' || retained FROM quota.usage
SQL
}
# scrape_steady TAG SQLFN: scrapes between two runs of SQLFN into $CL/sql.TAG, until
# both runs agree (the counters did not move during the scrape), 3 tries.
scrape_steady() {
  local tag="$1" fn="$2" i
  for i in 1 2 3; do
    "$fn" > "$CL/sql.$tag.before"
    scrape "$tag"
    "$fn" > "$CL/sql.$tag"
    cmp -s "$CL/sql.$tag.before" "$CL/sql.$tag" && break
    sleep 1
  done
  same "$tag: the SQL values did not change during the scrape" "$CL/sql.$tag.before" "$CL/sql.$tag"
}

check "port $EXPORTER_PORT is free for the exporter" port_free "$EXPORTER_PORT"
start_exporter "$QUERIES" default
scrape_steady default sql_default
exporter_healthy default "$QUERIES"
families default "$QUERIES" "$FAMILIES_DEFAULT"
# The flags that contrib/prometheus/queries.yaml names give pg_quota only: besides its
# families there are just the exporter's own (pg_up, pg_exporter_*,
# postgres_exporter_build_info, and the Go client's
# go_*, process_*, promhttp_*), none of the default collectors' pg_stat_*, pg_database_*
# or pg_settings_*.
expect_eq "default: the scrape has no family but pg_quota's and the exporter's own" "" \
  "$(sed -n 's/^TYPE \([^ ]*\) .*/\1/p' "$CL/scrape.default" \
      | grep -Ev '^(pg_quota_|pg_up$|pg_exporter_|postgres_exporter_build_info$|go_|process_|promhttp_)' | sort | paste -sd' ')"
samples default | grep '^pg_quota' | sort > "$CL/got.default"
same "default: every pg_quota sample equals the SQL on the views ($(wc -l < "$CL/sql.default") samples)" \
  "$CL/sql.default" "$CL/got.default"

# known KEY NUMBER: exporter | SQL | workload agree.
known() {
  local sqlv
  sqlv=$(awk -F'\t' -v k="$1" '$1 == k { print $2 }' "$CL/sql.default")
  expect_eq "known number: $1 (exporter|SQL)" "$2|$2" "$(value default "$1")|$sqlv"
}
P='datname="postgres"'
ADMITTED=$((N_OK + N_FAILED + N_CANCELLED + 1 + 2 + 1 + N_EXPIRED))  # alpha's, bravo's 1, delta's
known "pg_quota_admitted_total{$P}" $ADMITTED
known "pg_quota_refused_total{$P,reason=\"active\"}" $((N_TRY + 2))  # + the 53400 and the timed-out wait
known "pg_quota_refused_total{$P,reason=\"retained\"}" $N_RETAINED
known "pg_quota_refused_total{$P,reason=\"database\"}" $N_DATABASE
known "pg_quota_finished_total{$P,outcome=\"succeeded\"}" $((N_OK + 1 + 1))  # + the keyed one, bravo's
known "pg_quota_finished_total{$P,outcome=\"failed\"}" $N_FAILED
known "pg_quota_finished_total{$P,outcome=\"cancelled\"}" $N_CANCELLED
known "pg_quota_expired_total{$P}" $N_EXPIRED
known "pg_quota_renewed_total{$P}" $N_RENEWS
known "pg_quota_idempotent_hits_total{$P}" $N_HITS
known "pg_quota_waits_total{$P}" 2
known "pg_quota_wait_timeouts_total{$P}" 1
known "pg_quota_wait_duration_seconds_count{$P}" 2
known "pg_quota_wait_duration_seconds_bucket{$P,le=\"0.1\"}" 0
known "pg_quota_wait_duration_seconds_bucket{$P,le=\"1\"}" 1   # the 300 ms one
known "pg_quota_wait_duration_seconds_bucket{$P,le=\"10\"}" 2  # and the 1.5 s one
known "pg_quota_wait_duration_seconds_bucket{$P,le=\"+Inf\"}" 2
known "pg_quota_usage_active{$P}" 2
known "pg_quota_usage_retained{$P}" $ADMITTED  # every ticket is retained (7 days)
known 'pg_quota_admitted_total{datname="other"}' 1
known 'pg_quota_finished_total{datname="other",outcome="succeeded"}' 1
known 'pg_quota_refused_total{datname="other",reason="active"}' 0
known 'pg_quota_stats_entries{}' 5  # (postgres, 4 tenants), (other, tenant_alpha)
known 'pg_quota_stats_evicted_total{}' 0
known 'pg_quota_stats_max{}' 5000
known "pg_quota_writer_restarts_total{$P}" 0
known 'pg_quota_writer_restarts_total{datname="other"}' 0
# between NAME LOW HIGH: a check that NAME's exporter value is in [LOW, HIGH).
between() {
  local v
  v=$(value default "$1")
  check "known number: $1 = $v, in [$2, $3)" \
    "$PY" -c "import sys; sys.exit(not $2 <= float(sys.argv[1] or 'nan') < $3)" "$v"
}
between "pg_quota_wait_seconds_total{$P}" 1.5 6  # the 1.5 s wait and the 300 ms one (not ms, not µs)
# tenant_alpha's refusals are logged (quota.log_refusals); its burst of try_start()
# is held back by the rate limit, all but the first line.
between 'pg_quota_stats_log_suppressed_total{}' 1 $((N_TRY + 2))
for db in postgres other; do
  b=$(value default "pg_quota_writer_batches_total{datname=\"$db\"}")
  r=$(value default "pg_quota_writer_requests_total{datname=\"$db\"}")
  c=$(value default "pg_quota_writer_commit_seconds_total{datname=\"$db\"}")
  check "writer of $db: 1 <= batches ($b) <= requests ($r); commit time in seconds, under 10 ($c)" \
    "$PY" -c "import sys; b, r, c = (float(x or 'nan') for x in sys.argv[1:]); sys.exit(not (1 <= b <= r and 0 < c < 10))" "$b" "$r" "$c"
done
expect_eq "usage is exported for the exporter's database only" "" \
  "$(samples default | grep '^pg_quota_usage' | grep -v 'datname="postgres"' || true)"

# No tenant identity by default: no label value anywhere in the scrape contains the
# name of a role that used pg_quota.
sql -c "SELECT DISTINCT role FROM quota.stats WHERE role IS NOT NULL" > "$CL/roles"
printf '%s\n' "${TENANTS[@]}" >> "$CL/roles"
leaks=$(sed -n 's/^LABEL //p' "$CL/scrape.default" | sort -u | grep -F -f "$CL/roles" || true)
check "no label value of the default scrape names a role ($(sort -u "$CL/roles" | wc -l) roles)" test -z "$leaks"
[ -z "$leaks" ] || sed 's/^/#   /' <<<"$leaks"

# --- the opt-in per-role block ------------------------------------------------------------
sed '/^## BEGIN PER-ROLE/,/^## END PER-ROLE/s/^# //' "$QUERIES" > "$CL/queries.per-role.yaml"
check "the per-role metrics are commented out in the file" \
  bash -c "! '$PY' '$HELPER' defs '$QUERIES' | grep '^pg_quota_role_' >/dev/null"
check "uncommented as the file says, the per-role block defines pg_quota_role_* metrics" \
  bash -c "'$PY' '$HELPER' defs '$CL/queries.per-role.yaml' | grep '^pg_quota_role_' >/dev/null"
stop_exporter
start_exporter "$CL/queries.per-role.yaml" per-role
scrape_steady per-role sql_per_role
exporter_healthy per-role "$CL/queries.per-role.yaml"
families per-role "$CL/queries.per-role.yaml" "$FAMILIES_DEFAULT
$FAMILIES_PER_ROLE"
samples per-role | grep '^pg_quota_role_' | sort > "$CL/got.per-role"
same "per-role: every pg_quota_role_* sample equals the per-role SQL ($(wc -l < "$CL/sql.per-role") samples)" \
  "$CL/sql.per-role" "$CL/got.per-role"
samples per-role | grep '^pg_quota' | grep -v '^pg_quota_role_' | sort > "$CL/got.per-role.default"
sql_default > "$CL/sql.per-role.default"
same "per-role: the default metrics are unchanged next to it" "$CL/sql.per-role.default" "$CL/got.per-role.default"
expect_eq "per-role: the role labels are the 4 tenants" "${TENANTS[*]}" \
  "$(samples per-role | grep '^pg_quota_role_' | sed -n 's/.*role="\([^"]*\)".*/\1/p' | sort -u | tr '\n' ' ' | sed 's/ $//')"
stop_exporter

finish_checks
