#!/usr/bin/env bash
# I1 under load with leases, renewals and waits (0.2.0).
#
# Round "role": 20 pgbench clients of one role (quota.max_active_per_role = 3) loop:
# try_start(lease => random 100..400 ms, wait => '2 s'); hold 0..40 ms; half of the
# time renew(lease => random 100..400 ms) and hold again; then either finish the
# ticket or abandon it (let its lease run out). Every ticket and what was done with it
# is recorded in table acts.
# Round "database": the same with two roles (10 clients each, each role limit 3) and
# quota.max_active_per_database = 4.
#
# A superuser sampler (a procedure, READ COMMITTED, one transaction per sample) counts
# the active tickets as often as it can:
#   SELECT count(*) FROM quota.tickets WHERE role = ... AND ended_at IS NULL
# restricted to lease_until > clock_timestamp(). The view decides expiry with now(),
# the transaction's start, which precedes the statement's snapshot: a lease that runs
# out in between, and a ticket admitted into its slot and committed in between, would
# both be counted, by the sampler's own delay. clock_timestamp() read during the
# scan is later than the snapshot, so every ticket counted was active at the snapshot's
# moment: a count above the limit is a real violation. (The view's plain count is
# reported too, as a diagnostic line: with another test loading the machine it was
# seen at 4 for limit 3 once, while the clock-bounded count stayed at 3.)
#
# Checks, and how they fail:
# - the sampled maximum never exceeds the role limit (3), nor, in round "database", the
#   database cap (4) for the two roles together. Fails if admission counts an expired
#   lease too early or a ticket as expired while a renew() of it is in flight and then
#   commits (counts::being_changed), if renew() can revive an expired ticket whose slot
#   was given away, if a woken waiter is admitted without the scope's exact count, or
#   if the database cap is checked without the requests in flight of other roles;
# - the sampled maximum reaches the limit (the load saturated it) and the sampler ran
#   many times per second: otherwise the first check would be vacuous;
# - in every sample that looked (every 5th), the ledger had no unfinished row whose
#   lease ran out more than 1 s earlier (the writer's sweep writes them down within
#   ~250 ms). Fails if the sweep stops or falls behind under load;
# - quota.usage equals a direct count of quota.ledger in the same statement (same
#   snapshot, same now()), in every sample that looked. Fails if the view counts
#   expired tickets as active, or retention from the wrong time;
# - tickets were admitted after waits (>= 50 ms), and no wait that timed out gave up
#   before its 2 s. Fails if wait => is ignored (waits would be vacuous) or its
#   deadline is computed wrong;
# - after the load (and 1.5 s): every abandoned ticket's ledger row has
#   outcome 'expired' and ended_at = lease_until (its last, renewed, lease); every
#   ticket whose finish() returned true has outcome 'succeeded'; no row is unfinished;
#   every ledger row was received by a client (no phantom charges); quota.summary
#   equals the ledger. Fails if the sweep writes the wrong end time or outcome, if
#   renew() is not what the sweep sees, or if a wait leaves a charge nobody received.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5712 + PORT_OFFSET))}"
with_cluster leases_i1 "max_connections = 120"

ROUND_SECONDS="${LEASES_SECONDS:-15}"
sql >/dev/null <<'SQL'
CREATE EXTENSION pg_quota;
CREATE ROLE li_a LOGIN;
ALTER ROLE li_a SET quota.max_active_per_role = 3;
CREATE ROLE li_b LOGIN;
ALTER ROLE li_b SET quota.max_active_per_role = 3;
ALTER ROLE li_b SET quota.max_active_per_database = 4;
CREATE ROLE li_c LOGIN;
ALTER ROLE li_c SET quota.max_active_per_role = 3;
ALTER ROLE li_c SET quota.max_active_per_database = 4;
CREATE TABLE acts (role regrole, ticket uuid, act text, ok boolean, waited_ms int, at timestamptz DEFAULT clock_timestamp());
GRANT SELECT, INSERT ON acts TO PUBLIC;
-- renew(), or NULL if the lease ran out first (55000): the client goes on.
CREATE FUNCTION renew_or_null(t uuid, l interval) RETURNS timestamptz LANGUAGE plpgsql AS $$
BEGIN
  RETURN quota.renew(t, l);
EXCEPTION WHEN object_not_in_prerequisite_state THEN
  RETURN NULL;
END $$;
CREATE TABLE samples (round text, max_total int, max_role int, max_view int, samples bigint,
                      lag_looks bigint, max_lag interval, usage_looks bigint, usage_off bigint);
CREATE PROCEDURE sampler(rnd text, roles regrole[], secs int) LANGUAGE plpgsql AS $$
DECLARE total int; per int; viewn int; lag interval; off int;
        m_total int := 0; m_per int := 0; m_view int := 0; m_lag interval := '0';
        i bigint := 0; lag_looks bigint := 0; usage_looks bigint := 0; usage_off bigint := 0;
        deadline timestamptz := clock_timestamp() + make_interval(secs => secs);
BEGIN
  WHILE clock_timestamp() < deadline LOOP
    SELECT coalesce(sum(s), 0), coalesce(max(s), 0), coalesce(sum(v), 0) INTO total, per, viewn
      FROM (SELECT role, count(*) FILTER (WHERE lease_until IS NULL OR lease_until > clock_timestamp()) AS s,
                   count(*) AS v
              FROM quota.tickets WHERE role = ANY (roles) AND ended_at IS NULL GROUP BY role) x;
    m_total := greatest(m_total, total); m_per := greatest(m_per, per); m_view := greatest(m_view, viewn);
    i := i + 1;
    IF i % 5 = 0 THEN
      SELECT max(clock_timestamp() - lease_until) INTO lag
        FROM quota.ledger WHERE ended_at IS NULL AND lease_until < clock_timestamp();
      m_lag := greatest(m_lag, coalesce(lag, '0'));
      lag_looks := lag_looks + 1;
    ELSIF i % 5 = 1 THEN
      -- quota.usage against a direct count: one statement, one snapshot, one now().
      SELECT count(*) INTO off
        FROM (SELECT role, active, retained FROM quota.usage WHERE role = ANY (roles)) u
        FULL JOIN (SELECT role,
                          count(*) FILTER (WHERE ended_at IS NULL AND (lease_until IS NULL OR lease_until > now())) AS active,
                          count(*) AS retained
                     FROM quota.ledger
                    WHERE role = ANY (roles)
                      AND (CASE WHEN ended_at IS NULL AND lease_until <= now() THEN lease_until ELSE ended_at END IS NULL
                           OR CASE WHEN ended_at IS NULL AND lease_until <= now() THEN lease_until ELSE ended_at END
                              >= now() - current_setting('quota.retention')::interval)
                    GROUP BY role) d USING (role)
       WHERE u.active IS DISTINCT FROM d.active OR u.retained IS DISTINCT FROM d.retained;
      usage_looks := usage_looks + 1;
      usage_off := usage_off + off;
    END IF;
    COMMIT;
  END LOOP;
  INSERT INTO samples VALUES (rnd, m_total, m_per, m_view, i, lag_looks, m_lag, usage_looks, usage_off);
END $$;
SQL

cat > "$CL/client.sql" <<'PGB'
\set lease random(100, 400)
\set lease2 random(100, 400)
\set act random(0, 3)
\set renew :act % 2
\set abandon :act / 2
\set hold random(0, 40)
WITH s AS (SELECT quota.try_start('load', lease => make_interval(secs => :lease / 1000.0), wait => '2 s') AS t OFFSET 0)
INSERT INTO acts (role, ticket, act, waited_ms)
  SELECT current_user::regrole, t, CASE WHEN t IS NULL THEN 'timeout' ELSE 'got' END,
         round(extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000)
    FROM s
  RETURNING coalesce(ticket::text, '') AS t, (ticket IS NOT NULL)::int AS got \gset
\if :got
SELECT pg_sleep(:hold / 1000.0);
\if :renew
INSERT INTO acts (role, ticket, act, ok)
  SELECT current_user::regrole, ':t', 'renew', renew_or_null(':t', make_interval(secs => :lease2 / 1000.0)) IS NOT NULL;
SELECT pg_sleep(:hold / 1000.0);
\endif
\if :abandon
INSERT INTO acts (role, ticket, act) VALUES (current_user::regrole, ':t', 'abandon');
\else
INSERT INTO acts (role, ticket, act, ok) SELECT current_user::regrole, ':t', 'finish', quota.finish(':t');
\endif
\endif
PGB
chmod 644 "$CL/client.sql"

# run_round ROUND ROLE_LIMIT TOTAL_LIMIT ROLE:CLIENTS...
run_round() {
  local rnd="$1" role_limit="$2" total_limit="$3"; shift 3
  local spec role n roles=() pids=() rc
  for spec in "$@"; do roles+=("${spec%%:*}"); done
  local arr="ARRAY[$(printf "'%s'::regrole," "${roles[@]}" | sed 's/,$//')]"
  bg bash -c "'$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U postgres -d postgres \
                -c \"CALL sampler('$rnd', $arr, $((ROUND_SECONDS + 1)))\" > '$CL/sampler-$rnd.log' 2>&1"
  local sampler=$LAST_BG
  for spec in "$@"; do
    role=${spec%%:*}; n=${spec#*:}
    bg bash -c "timeout $((ROUND_SECONDS + 60)) '$PG_BIN/pgbench' -n -h '$CL' -p '$PORT' -U $role -c $n -j 2 \
                  -T $ROUND_SECONDS -f '$CL/client.sql' postgres > '$CL/pgbench-$rnd-$role.log' 2>&1; \
                echo \$? > '$CL/pgbench-$rnd-$role.rc'"
    pids+=("$LAST_BG")
  done
  for p in "${pids[@]}"; do timeout $((ROUND_SECONDS + 70)) tail --pid="$p" -f /dev/null || true; done
  timeout 30 tail --pid="$sampler" -f /dev/null || true
  for spec in "$@"; do
    role=${spec%%:*}; n=${spec#*:}
    rc=$(cat "$CL/pgbench-$rnd-$role.rc" 2>/dev/null || echo none)
    expect_eq "$rnd: $n clients of $role ran without error" 0 "$rc"
    [ "$rc" = 0 ] || grep -m3 -i error "$CL/pgbench-$rnd-$role.log" | sed 's/^/# /'
  done
  check "$rnd: the sampler ran to the end" grep -q . <(sql -c "SELECT 1 FROM samples WHERE round = '$rnd'")
  [ -s "$CL/sampler-$rnd.log" ] && sed 's/^/# sampler: /' "$CL/sampler-$rnd.log" | head -n3

  local s max_total max_role max_view samples lag_looks lag_ms usage_looks usage_off
  s=$(sql -F ' ' -c "SELECT max_total, max_role, max_view, samples, lag_looks,
                            round(extract(epoch FROM max_lag) * 1000), usage_looks, usage_off
                       FROM samples WHERE round = '$rnd'")
  read -r max_total max_role max_view samples lag_looks lag_ms usage_looks usage_off <<<"${s:-x x x 0 0 99999 0 1}"
  echo "# $rnd: max sampled total $max_total, per role $max_role (view's own count: $max_view), $samples samples in ${ROUND_SECONDS}s"
  check "$rnd: the sampler looked many times per second ($samples samples)" test "$samples" -ge $((ROUND_SECONDS * 20))
  check "$rnd: active tickets of one role never exceeded $role_limit (max sampled $max_role)" test "$max_role" -le "$role_limit"
  check "$rnd: active tickets of all the roles never exceeded $total_limit (max sampled $max_total)" test "$max_total" -le "$total_limit"
  expect_eq "$rnd: the load reached the limit" "$total_limit" "$max_total"
  check "$rnd: the sweep wrote expired leases down within 1 s (max lag seen $lag_ms ms in $lag_looks looks)" \
    test "$lag_looks" -gt 0 -a "$lag_ms" -lt 1000
  check "$rnd: quota.usage equalled a direct count of the ledger ($usage_off off in $usage_looks looks)" \
    test "$usage_looks" -gt 0 -a "$usage_off" = 0

  # After the load: the last leases run out (<= 400 ms), the sweep writes them down.
  sleep 1.5
  local in="role IN ($(printf "'%s'::regrole," "${roles[@]}" | sed 's/,$//'))"
  local acts
  acts=$(sql -F ' ' -c "SELECT count(*) FILTER (WHERE act = 'abandon'), count(*) FILTER (WHERE act = 'renew' AND ok),
                               count(*) FILTER (WHERE act = 'finish' AND ok), count(*) FILTER (WHERE act = 'renew' AND NOT ok),
                               count(*) FILTER (WHERE act = 'finish' AND NOT ok)
                          FROM acts WHERE $in")
  local abandoned renewed finished renew_late finish_late
  read -r abandoned renewed finished renew_late finish_late <<<"$acts"
  echo "# $rnd: $abandoned abandoned, $renewed renewed, $finished finished; $renew_late renewals and $finish_late finishes came after the lease ran out"
  check "$rnd: the load abandoned, renewed and finished tickets ($abandoned, $renewed, $finished)" \
    test "$abandoned" -ge 10 -a "$renewed" -ge 10 -a "$finished" -ge 10
  local waits
  waits=$(sql -F ' ' -c "SELECT count(*) FILTER (WHERE act = 'got' AND waited_ms >= 50),
                                count(*) FILTER (WHERE act = 'got'),
                                count(*) FILTER (WHERE act = 'timeout'),
                                coalesce(min(waited_ms) FILTER (WHERE act = 'timeout'), 2000)
                           FROM acts WHERE $in")
  local waited admitted timeouts min_timeout
  read -r waited admitted timeouts min_timeout <<<"$waits"
  echo "# $rnd: $waited of $admitted admitted tickets came after a wait of 50 ms or more; $timeouts waits timed out"
  check "$rnd: waits admitted tickets ($waited after waiting >= 50 ms)" test "$waited" -ge 10
  check "$rnd: no wait gave up before its 2 s (shortest timeout $min_timeout ms)" test "$min_timeout" -ge 1990
  expect_eq "$rnd: every abandoned ticket was swept: outcome 'expired', ended_at = its last lease_until" 0 \
    "$(sql -c "SELECT count(*) FROM acts a LEFT JOIN quota.ledger l ON l.id = a.ticket
                WHERE a.$in AND a.act = 'abandon'
                  AND (l.outcome IS DISTINCT FROM 'expired' OR l.ended_at IS DISTINCT FROM l.lease_until)")"
  expect_eq "$rnd: every ticket whose finish() returned true ended as 'succeeded' before its lease ran out" 0 \
    "$(sql -c "SELECT count(*) FROM acts a LEFT JOIN quota.ledger l ON l.id = a.ticket
                WHERE a.$in AND a.act = 'finish' AND a.ok
                  AND (l.outcome IS DISTINCT FROM 'succeeded' OR NOT l.ended_at < l.lease_until)")"
  expect_eq "$rnd: every ticket whose finish() returned false had expired" 0 \
    "$(sql -c "SELECT count(*) FROM acts a LEFT JOIN quota.ledger l ON l.id = a.ticket
                WHERE a.$in AND a.act = 'finish' AND NOT a.ok AND l.outcome IS DISTINCT FROM 'expired'")"
  expect_eq "$rnd: no ledger row is left unfinished" 0 \
    "$(sql -c "SELECT count(*) FROM quota.ledger WHERE $in AND ended_at IS NULL")"
  expect_eq "$rnd: every ledger row was received by a client" 0 \
    "$(sql -c "SELECT count(*) FROM quota.ledger l WHERE l.$in AND NOT EXISTS (SELECT 1 FROM acts a WHERE a.ticket = l.id AND a.act = 'got')")"
  expect_eq "$rnd: quota.usage shows no active ticket and every ticket retained" \
    "$(sql -c "SELECT count(*) FROM quota.ledger WHERE $in") 0" \
    "$(sql -F ' ' -c "SELECT coalesce(sum(retained), 0), coalesce(sum(active), 0) FROM quota.usage WHERE $in")"
  check "$rnd: quota.summary equals the ledger" summary_matches_ledger
}

SECONDS=0
run_round role 3 3 li_a:20
run_round database 3 4 li_b:10 li_c:10
check "no crash: the server did not reinitialize" bash -c "! grep -q 'reinitializing' '$CL/server.log'"
echo "# leases_i1: ${SECONDS}s"
finish_checks
