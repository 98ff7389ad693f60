#!/usr/bin/env bash
# Monitoring at 100,000 tenants and millions of retained tickets (0.5.1): the scrape
# of contrib/prometheus/queries.yaml must not read the ledger's retained history, its
# output must not grow with tenants or roles, and one tenant's numbers are one index
# range away in SQL.
#
# From 0.6.0 the ledger is two tables, quota.active (tickets not ended) and
# quota.history (ended ones), and quota.ledger a view over both: what a query reads is
# counted in both tables and their indexes.
#
# The ledger gets, by SQL as a superuser (a documented path: the trigger empties the
# summary and the writer rebuilds it; 0.6.0: into quota.history, where finished tickets
# are, rather than row by row through the view's INSTEAD OF trigger), 2,000,000
# finished tickets of role app spread
# over 100,000 tenants within the last 6 days, 20,000 finished 9 days ago (past the
# 7-day retention) of role idle, which never starts another ticket, so that no purge
# removes them, and one ticket for each of 10,000 roles; then, through quota.start(),
# active tickets of 1,000 tenants, leases that run out, and transactional tickets. The
# exporter (Debian's prometheus-postgres-exporter 0.11) runs as a member of pg_monitor
# with the shipped file, as tests/scripts/prometheus_exporter.sh runs it.
#
# Checks, and how each can fail:
# - quota.usage_totals() equals quota.usage summed and a count of the ledger, at this
#   scale, before and after the writer rebuilt the summary (the missing-summary path
#   included): fails if a role, a transactional ticket not folded, a lapsed lease or
#   the history past retention is counted wrong;
# - quota.usage_totals() reads at most 1.5 ledger entries per role with rows, plus the
#   unfinished tickets, plus for each role with history past the retention cutoff a
#   small multiple of its smaller side or 16 entries (0.6.0: the idle role's 20,000
#   past the cutoff against none since, 1,000 dormant roles' 100 against 2) (table and
#   index entries of quota.active and quota.history returned in its transaction,
#   pg_stat_get_xact_tuples_*): fails if it reads the retained history, as summing
#   quota.usage does (that read is measured too, and must be over the bound, so the
#   measure itself can fail), or each dormant role's 100;
# - the exporter's pg_quota_usage_* gauges equal the SQL, and its scrape has as many
#   pg_quota samples as before the tickets, tenants and roles came: fails if a metric
#   gets a series per tenant or per role (the opt-in per-role block does: checked to
#   fail so);
# - one tenant's numbers from quota.tenant_usage, filtered by role and tenant, equal a
#   count of its tickets and read only its entries: fails if the view's filter is not
#   pushed down to active_tenant_idx and history_tenant_idx (0.6.0; ledger_tenant_idx
#   before) (it would read every ticket of every tenant).
# The scrape's duration and size, and the time of each query, are printed (# lines) and
# recorded in USER_GUIDE.md, "Monitoring at scale"; they are not checked (timing is
# for benchmarks).
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5772 + PORT_OFFSET))}"
EXPORTER_PORT="${EXPORTER_PORT:-$((PORT + 3450))}"
# EXPORTER, PY, HELPER, port_free, start_exporter, stop_exporter, scrape
source "$ROOT/tests/scripts/prometheus_lib.bash"
TENANTS=100000 HISTORY=2000000 IDLE=20000 ROLES=10000 ACTIVE=1000 DORMANT=1000

# The exporter and its parser, installed as prometheus_exporter.sh installs them (that
# script also checks that a fresh install leaves no service running).
if ! dpkg-query -W -f='${Status}' prometheus-postgres-exporter 2>/dev/null | grep -q "install ok installed"; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d
  apt_install prometheus-postgres-exporter >&2
  rm -f /usr/sbin/policy-rc.d
  systemctl disable --now prometheus-postgres-exporter.service >/dev/null 2>&1 || true
  /etc/init.d/prometheus-postgres-exporter stop >/dev/null 2>&1 || true
fi
apt_install python3-prometheus-client python3-yaml >&2

# The writer stays up while idle, so that its purge passes run while the test waits.
with_cluster monitoring_scale "quota.writer_idle_timeout = 600" "quota.retention = '7d'" \
  "quota.allow_transactional = on" "quota.max_active_per_role = 0" "quota.max_retained_per_role = 0" "max_wal_size = '4GB'" "checkpoint_timeout = '30min'"
sql -c "CREATE EXTENSION pg_quota" >/dev/null
sql >/dev/null <<SQL
CREATE ROLE app LOGIN;
CREATE ROLE idle LOGIN;
CREATE ROLE exporter LOGIN IN ROLE pg_monitor;
SELECT format('CREATE ROLE r%s', i) FROM generate_series(1, $ROLES) i \gexec
SELECT format('CREATE ROLE d%s', i) FROM generate_series(1, $DORMANT) i \gexec
SQL

# --- the exporter, before any ticket -----------------------------------------------
quota_samples() { grep -c '^SAMPLE pg_quota_' "$CL/scrape.$1"; }
value() { sed -n 's/^SAMPLE //p' "$CL/scrape.$1" | awk -F'\t' -v k="$2" '$1 == k { print $2 }'; }
check "port $EXPORTER_PORT is free for the exporter" port_free "$EXPORTER_PORT"
start_exporter "$ROOT/contrib/prometheus/queries.yaml" default
# A few tickets first, so that every family has its row (the writer's, the stats').
sql -c "SET ROLE app" -c "SELECT quota.finish(quota.start(tenant => 't0'))" >/dev/null
scrape before
BEFORE=$(quota_samples before)
check "before: the scrape has pg_quota samples ($BEFORE)" test "$BEFORE" -gt 10

# --- the tickets --------------------------------------------------------------------
# Ids in time order (as uuid v7 are), so that the primary key grows at its end.
# 0.6.0: every one of them has ended, so they go into quota.history.
t0=$SECONDS
sql > "$CL/inserted" <<SQL
SET synchronous_commit = off;
SET maintenance_work_mem = '256MB';
WITH w AS (INSERT INTO quota.history (id, role, label, started_at, ended_at, outcome, tenant)
SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(i), 12, '0'))::uuid, 'app', 'job',
       now() - interval '6 days' + i * interval '200 ms',
       now() - interval '6 days' + i * interval '200 ms' + interval '1 s', 'succeeded',
       't' || (i % $TENANTS)
  FROM generate_series(1, $HISTORY) i RETURNING 1) SELECT count(*) FROM w;
WITH w AS (INSERT INTO quota.history (id, role, label, started_at, ended_at, outcome)
SELECT ('00000000-0000-7000-9000-' || lpad(to_hex(i), 12, '0'))::uuid, 'idle', 'old',
       now() - interval '9 days', now() - interval '9 days' + i * interval '1 ms', 'succeeded'
  FROM generate_series(1, $IDLE) i RETURNING 1) SELECT count(*) FROM w;
WITH w AS (INSERT INTO quota.history (id, role, label, started_at, ended_at, outcome)
SELECT ('00000000-0000-7000-a000-' || lpad(to_hex(i), 12, '0'))::uuid, ('r' || i)::regrole, 'one',
       now() - interval '1 day', now() - interval '1 day', 'succeeded'
  FROM generate_series(1, $ROLES) i RETURNING 1) SELECT count(*) FROM w;
-- 0.6.0: dormant roles, each with 100 tickets past retention and 2 within it, which
-- usage_totals() counts role by role: the smaller side is each one's 2.
WITH w AS (INSERT INTO quota.history (id, role, label, started_at, ended_at, outcome)
SELECT ('00000000-0000-7000-b000-' || lpad(to_hex(i * 1000 + j), 12, '0'))::uuid, ('d' || i)::regrole, 'dormant',
       now() - interval '9 days', now() - CASE WHEN j <= 100 THEN interval '8 days' ELSE interval '1 day' END
                                  + j * interval '1 ms', 'succeeded'
  FROM generate_series(1, $DORMANT) i, generate_series(1, 102) j RETURNING 1) SELECT count(*) FROM w;
SQL
echo "# wrote $((HISTORY + IDLE + ROLES + DORMANT * 102)) tickets by SQL in $((SECONDS - t0)) s"
# Through pg_quota: 1,000 tenants hold a ticket each, 20 leases of tenant "short" run
# out, 30 transactional tickets commit (not folded yet when first counted).
sql >/dev/null <<SQL
SET ROLE app;
SELECT count(quota.start('held', lease => '1 h', tenant => 't' || i)) FROM generate_series(1, $ACTIVE) i;
SELECT count(quota.start('short', lease => '1 ms', tenant => 'short')) FROM generate_series(1, 20);
BEGIN;
SELECT count(quota.start('txn', tenant => 't' || i, transactional => true)) FROM generate_series(1, 30) i;
COMMIT;
SQL
sql -c "VACUUM ANALYZE quota.active, quota.history" >/dev/null
idle_rows() { sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'idle'::regrole"; }
expect_eq "the SQL wrote the history, the idle role's, one ticket per role and the dormant roles'" \
  "$HISTORY $IDLE $ROLES $((DORMANT * 102))" "$(paste -sd' ' "$CL/inserted")"

# agree TAG: usage_totals() against quota.usage summed and a count of the ledger.
agree() {
  expect_eq "$1: quota.usage_totals() equals quota.usage summed and the ledger's rows" \
    "$(sql -c "SELECT coalesce(sum(active), 0) || ' ' || coalesce(sum(retained), 0) FROM quota.usage") $(sql -c "SELECT count(*) FROM quota.ledger")" \
    "$(sql -c "SELECT active || ' ' || retained || ' ' || ledger_rows FROM quota.usage_totals()")"
}
agree "with the summary emptied by the SQL writes"
# The writer rebuilds the summary (an admission and usage_totals() ask for it).
summary_complete() {
  [ "$(sql -c "SELECT count(DISTINCT role) FROM quota.ledger")" = \
    "$(sql -c "SELECT count(*) FROM quota.summary s WHERE EXISTS (SELECT FROM quota.ledger l WHERE l.role = s.role)")" ]
}
for _ in $(seq 1 100); do summary_complete && break; sleep 0.2; done
check "the writer rebuilt the summary: a row for each role with tickets" summary_complete
expect_eq "the idle role's history past retention is still there (no start of idle's purges it)" \
  "$IDLE" "$(idle_rows)"
agree "with the summary rebuilt"

# --- what a scrape's query reads ---------------------------------------------------------
# read_entries SQL: the ledger's heap and index entries that SQL returned, in its own
# transaction (pg_stat_get_xact_* count what this transaction did so far); and its time.
# 0.6.0: the ledger's tables are quota.active and quota.history.
read_entries() {
  sql -c "BEGIN" -c "\\o /dev/null" -c "$1" -c "\\o" -c "SELECT sum(pg_stat_get_xact_tuples_returned(c) + pg_stat_get_xact_tuples_fetched(c))
      FROM (SELECT unnest(ARRAY['quota.active'::regclass::oid, 'quota.history'::regclass::oid]) UNION ALL
            SELECT indexrelid FROM pg_index WHERE indrelid IN ('quota.active'::regclass, 'quota.history'::regclass)) r(c)" -c "COMMIT"
}
ms() {  # ms SQL: how long SQL took, in ms, as the exporter's role
  local t
  t=$(date +%s%N)
  pgq "$CL" "$PORT" -U exporter -d postgres -At -c "$1" >/dev/null
  echo $((($(date +%s%N) - t) / 1000000))
}
role_count=$(sql -c "SELECT count(DISTINCT role) FROM quota.ledger")
open=$(sql -c "SELECT count(*) FROM quota.ledger WHERE ended_at IS NULL")
retained=$(sql -c "SELECT retained FROM quota.usage_totals()")
# Each entry an index scan returns counts twice (returned by the index, fetched from
# the heap): 2 per role's probe, 2 per unfinished ticket, and (0.6.0, role by role)
# for each role with tickets past the cutoff, its steps in the walk over the roles (16
# at most) and both of its sides counted up to limits growing fourfold from 16 until
# one fits: 32 items and about 8 times its smaller side at most (core::stats'
# smaller_side test), twice; with room for the transactional tickets' probes. 0.5.1 to
# 0.6.0's first layout counted all roles at once from 1,024; role by role from 1,024,
# each dormant role read its 100 entries past the cutoff where 16 and its 2 suffice.
cut="now() - current_setting('quota.retention')::interval"
read -r smaller gone_roles <<<"$(sql -c "SELECT coalesce(sum(least(b, s)), 0) || ' ' || count(*) FILTER (WHERE b > 0)
  FROM (SELECT count(*) FILTER (WHERE ended_at < $cut) AS b, count(*) FILTER (WHERE ended_at >= $cut) AS s
          FROM quota.ledger WHERE ended_at IS NOT NULL GROUP BY role) x")"
BOUND=$((3 * role_count + 2 * open + 2 * (16 + 32) * gone_roles + 2 * 8 * smaller + 8 * 1024))
read_totals=$(read_entries "SELECT * FROM quota.usage_totals()")
read_view=$(read_entries "SELECT sum(active), sum(retained) FROM quota.usage")
echo "# $role_count roles with tickets ($gone_roles with some past the cutoff, smaller sides $smaller in all), $open unfinished, $retained retained; usage_totals() read $read_totals entries (bound $BOUND), quota.usage summed read $read_view"
check "quota.usage_totals() read at most 1.5 entries per role + the unfinished + per role past the cutoff 96 and 16 times its smaller side ($read_totals <= $BOUND)" \
  test "$read_totals" -le "$BOUND"
check "summing quota.usage reads the retained history, over the bound ($read_view > $BOUND): the measure can fail" \
  test "$read_view" -gt "$BOUND"
echo "# time, as the exporter: usage_totals() $(ms "SELECT * FROM quota.usage_totals()") ms, $(ms "SELECT * FROM quota.usage_totals()") ms; quota.usage summed $(ms "SELECT sum(active), sum(retained) FROM quota.usage") ms"

# --- the scrape ----------------------------------------------------------------------------
scrape after
AFTER=$(quota_samples after)
echo "# scrape: $(wc -c < "$CL/raw.after") bytes in all, $(grep -c '^pg_quota_' "$CL/raw.after") pg_quota sample lines ($(grep '^pg_quota_' "$CL/raw.after" | wc -c) bytes), pg_exporter_last_scrape_duration_seconds $(value after 'pg_exporter_last_scrape_duration_seconds{}')"
expect_eq "the exporter's last scrape had no error" 0 "$(value after 'pg_exporter_last_scrape_error{}')"
expect_eq "the scrape has as many pg_quota samples as before the tickets, tenants and roles" "$BEFORE" "$AFTER"
expect_eq "the exporter's usage gauges equal quota.usage_totals()" \
  "$(sql -c "SELECT active || ' ' || retained || ' ' || ledger_rows FROM quota.usage_totals()")" \
  "$(value after 'pg_quota_usage_active{datname="postgres"}') $(value after 'pg_quota_usage_retained{datname="postgres"}') $(value after 'pg_quota_usage_ledger_rows{datname="postgres"}')"
# The same check fails with a series per role: the opt-in block, enabled.
stop_exporter
sed '/^## BEGIN PER-ROLE/,/^## END PER-ROLE/s/^# //' "$ROOT/contrib/prometheus/queries.yaml" > "$CL/per-role.yaml"
start_exporter "$CL/per-role.yaml" per_role
scrape per_role
check "with the opt-in per-role block the samples grow with the roles ($(quota_samples per_role) > $BEFORE): the check can fail" \
  test "$(quota_samples per_role)" -gt "$BEFORE"
stop_exporter

# --- one tenant's numbers ----------------------------------------------------------------
# Tenant t42: its 20 finished tickets of the history and its held one.
want=$(sql -c "SELECT count(*) FILTER (WHERE ended_at IS NULL) || ' ' || count(*) FROM quota.ledger
                WHERE role = 'app'::regrole AND tenant = 't42'")
ONE="SELECT active || ' ' || retained FROM quota.tenant_usage WHERE role = 'app'::regrole AND tenant = 't42'"
expect_eq "quota.tenant_usage filtered to one tenant gives its numbers" "$want" "$(sql -c "$ONE")"
read_one=$(read_entries "$ONE")
echo "# one tenant: $want (active, retained); quota.tenant_usage read $read_one entries, in $(ms "$ONE") ms"
check "quota.tenant_usage for one tenant reads only its entries ($read_one <= 3 x ${want#* })" \
  test "$read_one" -le $((3 * ${want#* }))

finish_checks
