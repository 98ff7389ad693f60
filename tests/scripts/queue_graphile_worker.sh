#!/usr/bin/env bash
# pg_quota driving a real job queue: graphile-worker (npm, node-postgres), jobs added
# with its SQL function graphile_worker.add_job, run by its run() API in several
# worker processes (issue 27). The program is tests/queues/graphile-worker/queue.js;
# graphile-worker and pg are pinned in its package.json / package-lock.json and
# installed with `npm ci` into a cache folder outside the repository
# (GRAPHILE_WORKER_CACHE, default /var/cache/pg_quota-tests/graphile-worker), reused
# while the lock file is the same.
#
# Both places a user puts admission, each in its own database (q_enqueue, q_claim) of
# one cluster, with quota.max_active_per_tenant = LIMIT on the role app:
# - enqueue: the transaction that adds the job takes a transactional ticket for the
#   job's tenant (no ticket: the producer rolls back and offers the job again later);
#   the job carries it; each attempt renews it, the job's end finishes it (success, or
#   its last failed attempt). An attempt that finds it expired is admitted anew.
# - claim: graphile-worker claims with its own SQL, so the task takes a writer-committed
#   try_start() when it starts; refused, it puts the job back (add_job again with its
#   job_key, run_at a moment later) without running it; it finishes the ticket in a
#   finally.
# Each: JOBS jobs over TENANTS tenants (a tenant's jobs next to each other in the
# queue), WORKERS worker processes of CONCURRENCY jobs each, jobs that fail once and
# are retried by the queue, jobs that always fail (max_attempts 2), enqueues that roll
# back, and one worker killed with SIGKILL mid-job (its tickets come back through
# their lease; then graphile_worker.force_unlock_workers() lets the queue run its jobs
# again). A sampler (its own session, polling every few ms) counts each tenant's
# running jobs (rows of the table runs that each run inserts at its start and closes at
# its end); the runs' own start and end times give the exact overlap too.
# Checks: no tenant ever ran more than LIMIT jobs at once (sampled, and exact), and it
# did reach LIMIT; every job ran and succeeded (the always-failing ones: exactly their
# 2 attempts); the jobs that failed once were retried and succeeded; rolled-back
# enqueues never ran and left no ticket; the killed worker's tickets expired through
# their lease; no slot is taken at the end.
#
# QUEUE_NO_QUOTA=1 takes pg_quota out of the recipe (no ticket is taken or finished):
# the "no tenant ever ran more than LIMIT" checks must then fail.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5771 + PORT_OFFSET))}"
NODE_DIR="$ROOT/tests/queues/graphile-worker"
CACHE="${GRAPHILE_WORKER_CACHE:-/var/cache/pg_quota-tests/graphile-worker}"
LIMIT=2 JOBS=300 TENANTS=30 WORKERS=4 CONCURRENCY=4 LEASE_S=10 JOB_MS=300
NO_QUOTA="${QUEUE_NO_QUOTA:-0}"
[ "$NO_QUOTA" = 1 ] && echo "# QUEUE_NO_QUOTA=1: pg_quota is taken out of the recipe"

# --- install ---------------------------------------------------------------------------
command -v node >/dev/null && command -v npm >/dev/null || apt_install nodejs npm >&2
mkdir -p "$(dirname "$CACHE")"
exec {cache_lock}> "$CACHE.lock"
flock "$cache_lock"  # one install at a time; none while another run installs
if ! cmp -s "$NODE_DIR/package-lock.json" "$CACHE/package-lock.json" \
   || [ ! -f "$CACHE/node_modules/graphile-worker/package.json" ]; then
  log "installing graphile-worker (npm ci) into $CACHE"
  mkdir -p "$CACHE"
  rm -rf "$CACHE/node_modules" "$CACHE/package-lock.json"
  cp "$NODE_DIR/package.json" "$NODE_DIR/package-lock.json" "$CACHE/"
  (cd "$CACHE" && npm ci --no-audit --no-fund --loglevel=error >&2)
fi
exec {cache_lock}>&-
gw_version=$(node -p "require('$CACHE/node_modules/graphile-worker/package.json').version")
pg_version=$(node -p "require('$CACHE/node_modules/pg/package.json').version")
expect_eq "graphile-worker and pg are installed at their pinned versions (node $(node --version))" \
  "$(node -p "const d = require('$NODE_DIR/package.json').dependencies; d['graphile-worker'] + ' ' + d.pg")" \
  "$gw_version $pg_version"

with_cluster queue_graphile_worker
sql >/dev/null <<SQL
CREATE ROLE app LOGIN;
ALTER ROLE app SET quota.max_active_per_tenant = $LIMIT;
ALTER ROLE app SET quota.max_retained_per_role = 0;
ALTER ROLE app SET quota.allow_transactional = on;
CREATE DATABASE q_enqueue OWNER app;
CREATE DATABASE q_claim OWNER app;
SQL
export PGHOST="$CL" PGPORT="$PORT" PGUSER=app NODE_PATH="$CACHE/node_modules"
# The node processes run in the cluster's folder (env -C): graphile-worker looks for a
# configuration file (cosmiconfig) and a crontab in its working directory.
export JOBS TENANTS CONCURRENCY JOB_MS LEASE="$LEASE_S s" QUEUE_NO_QUOTA="$NO_QUOTA"

# q DB SQL...: as app in DB, one value per line.
q() { local db="$1"; shift; local a=() s; for s in "$@"; do a+=(-c "$s"); done
      timeout 30 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 -U app -d "$db" "${a[@]}"; }
# qs DB SQL: as the superuser (sees every ticket).
qs() { sql -d "$1" -c "$2"; }
# until_true SECONDS DB SQL: polls SQL (a boolean) every 0.2 s; false if it never held.
until_true() {
  local end=$((SECONDS + $1))
  while [ "$SECONDS" -lt "$end" ]; do
    [ "$(q "$2" "$3" 2>/dev/null)" = t ] && return 0
    sleep 0.2
  done
  return 1
}
# stop_group PID: SIGTERM to a process group bg started (graphile-worker shuts down
# gracefully on it), SIGKILL after 15 s.
stop_group() {
  kill -TERM -- "-$1" 2>/dev/null || return 0
  timeout 15 tail --pid="$1" -f /dev/null || kill -KILL -- "-$1" 2>/dev/null || true
}

# The recipe (USER_GUIDE "graphile-worker, at enqueue"): a job that succeeded is
# deleted by graphile-worker while locked; one that failed its last attempt is unlocked
# with its attempts used up (permanently_fail_jobs uses them up too). Either ends its
# ticket in that statement's transaction. A job deleted while not running
# (graphile_worker.remove_job) is cancelled.
FINISH_TRIGGERS="
CREATE TRIGGER quota_job_done AFTER DELETE ON graphile_worker._private_jobs FOR EACH ROW
  WHEN (OLD.locked_at IS NOT NULL)
  EXECUTE FUNCTION quota.finish_job('payload->ticket', 'succeeded');
CREATE TRIGGER quota_job_removed AFTER DELETE ON graphile_worker._private_jobs FOR EACH ROW
  WHEN (OLD.locked_at IS NULL)
  EXECUTE FUNCTION quota.finish_job('payload->ticket', 'cancelled');
CREATE TRIGGER quota_job_failed AFTER UPDATE OF locked_at, attempts ON graphile_worker._private_jobs
  FOR EACH ROW
  WHEN (NEW.locked_at IS NULL AND NEW.attempts >= NEW.max_attempts
        AND (OLD.locked_at IS NOT NULL OR OLD.attempts < OLD.max_attempts))
  EXECUTE FUNCTION quota.finish_job('payload->ticket', 'failed');"

run_placement() {
  local P="$1" db="q_$1" t0=$SECONDS w pids=() producer sampler victim vpid vworker tickets
  sql -d "$db" -c "CREATE EXTENSION pg_quota" >/dev/null
  q "$db" "CREATE TABLE runs (id bigserial PRIMARY KEY, n int, tenant text, job_id bigint, attempt int,
             pid int, worker text, ticket uuid, started_at timestamptz DEFAULT clock_timestamp(),
             ended_at timestamptz, outcome text)" \
    "CREATE INDEX ON runs (n)" \
    "CREATE TABLE enqueued (n int PRIMARY KEY, tenant text, kind text)" \
    "CREATE TABLE rolled_back (n int, tenant text)" \
    "CREATE TABLE put_back (n int, tenant text)" \
    "CREATE TABLE sampler_stop (x int)" >/dev/null
  PGDATABASE="$db" env -C "$CL" node "$NODE_DIR/queue.js" migrate > "$CL/migrate.$P.log" 2>&1
  check "$P: graphile-worker's schema is installed through its own API (runMigrations)" \
    test "$(q "$db" "SELECT count(*) FROM pg_proc WHERE proname = 'add_job' AND pronamespace = 'graphile_worker'::regnamespace")" -ge 1
  if [ "$P" = enqueue ] && [ "$NO_QUOTA" != 1 ]; then
    check "$P: the recipe's triggers that finish a job's ticket are created by the jobs table's owner" \
      q "$db" "$FINISH_TRIGGERS"
  fi

  # The sampler: the most jobs of one tenant seen running at once.
  cat > "$CL/sampler.$P.sql" <<'SQL'
DO $$
DECLARE m int := 0; c int; t text; who text := ''; k int := 0;
BEGIN
  WHILE NOT EXISTS (SELECT 1 FROM sampler_stop) LOOP
    SELECT count(*), tenant INTO c, t FROM runs WHERE ended_at IS NULL GROUP BY tenant ORDER BY 1 DESC LIMIT 1;
    IF coalesce(c, 0) > m THEN m := c; who := t; END IF;
    k := k + 1;
    PERFORM pg_sleep(0.003);
  END LOOP;
  RAISE NOTICE 'max % samples % tenant %', m, k, who;
END $$;
SQL
  bg "$PG_BIN/psql" -X -At -U app -d "$db" -f "$CL/sampler.$P.sql" > "$CL/sampler.$P.out" 2>&1
  sampler=$LAST_BG

  for w in $(seq 1 "$WORKERS"); do
    PGDATABASE="$db" bg env -C "$CL" node "$NODE_DIR/queue.js" worker "$P" > "$CL/worker.$P.$w.log" 2>&1
    pids+=("$LAST_BG")
  done
  PGDATABASE="$db" bg env -C "$CL" node "$NODE_DIR/queue.js" produce "$P" > "$CL/producer.$P.log" 2>&1
  producer=$LAST_BG

  # One worker killed with SIGKILL in the middle of the victim job (it runs 2 minutes
  # on its first run), with whatever else that process runs.
  if until_true 60 "$db" "SELECT EXISTS (SELECT 1 FROM runs WHERE n = 7 AND ended_at IS NULL)"; then
    read -r vpid vworker <<<"$(q "$db" "SELECT pid || ' ' || worker FROM runs WHERE n = 7 AND ended_at IS NULL" | tr '|' ' ')"
    disown "$vpid" 2>/dev/null || true  # no "Killed" notice from bash
    kill -KILL "$vpid"
    local killed_at=$SECONDS
    # Its runs are over: the test closes their rows (the process can no longer), and
    # marks them killed. So too a run it had closed whose end never reached the queue
    # (the job is still locked by the dead worker at that attempt) and whose ticket no
    # one finished: the process died between the run's end and the queue's (or the
    # task's) finish, so that ticket ends by its lease too. (A CI run saw this once: an
    # always-failing job's last attempt, closed 'failed', its ticket then expired.)
    tickets=$(q "$db" "WITH c AS (SELECT id, ended_at IS NOT NULL AS closed FROM runs
                                   WHERE pid = $vpid
                                     AND (ended_at IS NULL
                                          OR ((job_id, attempt) IN (SELECT id, attempts FROM graphile_worker.jobs
                                                                     WHERE locked_by = '$vworker')
                                              AND ticket IN (SELECT id FROM quota.tickets
                                                              WHERE outcome IS NULL OR outcome = 'expired')))),
                            k AS (UPDATE runs r SET ended_at = coalesce(r.ended_at, clock_timestamp()), outcome = 'killed'
                                    FROM c WHERE r.id = c.id RETURNING c.closed, r.ticket)
                       SELECT count(*) || ' ' || count(*) FILTER (WHERE closed) || ' '
                              || coalesce(string_agg(quote_literal(ticket), ','), '') FROM k")
    echo "# $P: killed worker process $vpid ($vworker) in the middle of $(cut -d' ' -f1 <<<"$tickets") jobs, the victim's among them ($(cut -d' ' -f2 <<<"$tickets") of them closed, their end not reported)"
    if [ "$NO_QUOTA" != 1 ]; then
      tickets=$(cut -d' ' -f3 <<<"$tickets")
      check "$P: the killed worker's tickets come back through their lease ($LEASE_S s): all expired within $((LEASE_S + 10)) s" \
        until_true $((LEASE_S + 10)) "$db" "SELECT count(*) FILTER (WHERE outcome = 'expired') = count(*)
                                              FROM quota.tickets WHERE id IN ($tickets)"
      echo "# $P: ... expired $((SECONDS - killed_at)) s after the kill"
    fi
    # Its jobs stay locked by the dead worker (graphile-worker frees such locks after
    # 4 hours); the documented admin function frees them now, and the queue runs them.
    q "$db" "SELECT graphile_worker.force_unlock_workers(ARRAY['$vworker'])" >/dev/null
  else
    check "$P: the victim job started" false
  fi

  timeout 90 tail --pid="$producer" -f /dev/null || true
  check "$P: the producer enqueued every job ($(tail -n1 "$CL/producer.$P.log"))" \
    grep -q '^produced ' "$CL/producer.$P.log"
  check "$P: every job ran and the queue is idle within 90 s" \
    until_true 90 "$db" "SELECT NOT EXISTS (SELECT 1 FROM graphile_worker.jobs WHERE attempts < max_attempts)
                           AND NOT EXISTS (SELECT 1 FROM runs WHERE ended_at IS NULL)"
  q "$db" "INSERT INTO sampler_stop VALUES (1)" >/dev/null
  timeout 30 tail --pid="$sampler" -f /dev/null || true
  for w in "${pids[@]}"; do stop_group "$w"; done

  # --- checks --------------------------------------------------------------------------
  local smax samples stenant exact rb ones always
  read -r smax samples stenant <<<"$(sed -n 's/.*max \([0-9]*\) samples \([0-9]*\) tenant \(.*\)$/\1 \2 \3/p' "$CL/sampler.$P.out")"
  exact=$(q "$db" "SELECT coalesce(max(c), 0) || ' ' || coalesce((array_agg(tenant ORDER BY c DESC))[1], '')
                     FROM (SELECT a.id, a.tenant, count(*) AS c FROM runs a JOIN runs b
                             ON b.tenant = a.tenant AND b.started_at <= a.started_at
                            AND coalesce(b.ended_at, 'infinity') > a.started_at
                           GROUP BY a.id, a.tenant) s")
  echo "# $P: $(q "$db" "SELECT count(*) FROM runs") runs of $(q "$db" "SELECT count(*) FROM enqueued") jobs over $TENANTS tenants; $(q "$db" "SELECT count(*) FROM put_back") claims put back; $(qs "$db" "SELECT coalesce(sum(refused_active), 0) FROM quota.stats WHERE role = 'app'") refusals; $((SECONDS - t0)) s"
  check "$P: sampled (${samples:-0} samples): no tenant ever ran more than $LIMIT jobs at once (max seen ${smax:-?}, tenant ${stenant:-?})" \
    test "${smax:-99}" -le "$LIMIT"
  check "$P: from the runs' start and end times: no tenant ever ran more than $LIMIT jobs at once (max overlap ${exact% *}, tenant ${exact#* })" \
    test "${exact% *}" -le "$LIMIT"
  check "$P: ... and the load did take tenants to their limit (max seen ${smax:-?} >= $LIMIT)" \
    test "${smax:-0}" -ge "$LIMIT"
  rb=$(q "$db" "SELECT count(*) FROM rolled_back")
  expect_eq "$P: $JOBS jobs offered: every enqueue committed but the rolled-back ones ($rb)" \
    "$JOBS 15" "$(($(q "$db" "SELECT count(*) FROM enqueued") + rb)) $rb"
  expect_eq "$P: every job ran and succeeded, but those that always fail" 0 \
    "$(q "$db" "SELECT count(*) FROM enqueued e WHERE kind <> 'always'
                  AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.n = e.n AND r.outcome = 'succeeded')")"
  ones=$(q "$db" "SELECT count(*) FROM enqueued WHERE kind = 'once'")
  # (A run of the killed worker counts as neither: its job ran again.)
  expect_eq "$P: the $ones jobs that fail their first run (not killed) were retried by the queue and succeeded" "$ones" \
    "$(q "$db" "SELECT count(*) FROM enqueued e WHERE kind = 'once'
                  AND (SELECT array_remove(array_agg(outcome ORDER BY id), 'killed') FROM runs r WHERE r.n = e.n)
                      = ARRAY['failed', 'succeeded']")"
  always=$(q "$db" "SELECT count(*) FROM enqueued WHERE kind = 'always'")
  expect_eq "$P: the $always jobs that always fail ran their 2 attempts (failed, or killed), and the queue keeps them as failed" \
    "$always $always" \
    "$(q "$db" "SELECT count(*) FROM enqueued e WHERE kind = 'always'
                  AND (SELECT array_agg(outcome ORDER BY id) <@ ARRAY['failed', 'killed'] AND count(*) = 2
                         FROM runs r WHERE r.n = e.n)") $(
       q "$db" "SELECT count(*) FROM graphile_worker.jobs WHERE attempts = max_attempts AND last_error LIKE '%fails each attempt%'")"
  expect_eq "$P: the victim ran again after its worker was killed, and succeeded" "killed succeeded" \
    "$(q "$db" "SELECT string_agg(outcome, ' ' ORDER BY id) FROM runs WHERE n = 7")"
  expect_eq "$P: rolled-back enqueues never ran" 0 \
    "$(q "$db" "SELECT count(*) FROM runs WHERE n IN (SELECT n FROM rolled_back)")"
  if [ "$NO_QUOTA" != 1 ]; then
    if [ "$P" = enqueue ]; then
      expect_eq "$P: ... and left no ticket (their transactional charge rolled back with them)" 0 \
        "$(qs "$db" "SELECT count(*) FROM quota.ledger WHERE label IN (SELECT 'job-' || n FROM rolled_back)")"
      check "$P: tenants at their limit were refused at enqueue ($(grep -o '"refused":[0-9]*' "$CL/producer.$P.log"))" \
        grep -q '"refused":[1-9]' "$CL/producer.$P.log"
    else
      check "$P: claims refused at the tenant's limit were put back and ran later ($(q "$db" "SELECT count(*) FROM put_back") put back)" \
        test "$(q "$db" "SELECT count(*) FROM put_back")" -gt 0
    fi
    expect_eq "$P: each job's last run ended its ticket as it ended (succeeded, failed; killed: expired)" \
      "$(q "$db" "SELECT count(*) FROM enqueued") 0" \
      "$(qs "$db" "SELECT count(*) || ' ' || count(*) FILTER (WHERE t.outcome IS DISTINCT FROM
                                                   CASE r.outcome WHEN 'killed' THEN 'expired' ELSE r.outcome END)
                     FROM (SELECT DISTINCT ON (n) * FROM runs ORDER BY n, id DESC) r
                     LEFT JOIN quota.tickets t ON t.id = r.ticket")"
    # What a failure of that check needs to be read: the jobs whose last run disagrees.
    qs "$db" "SELECT '#   job ' || r.n || ' (' || e.kind || '): runs '
                     || (SELECT string_agg(x.outcome || '@' || x.pid || '/' || x.attempt, ' ' ORDER BY x.id)
                           FROM runs x WHERE x.n = r.n)
                     || '; last run''s ticket ' || coalesce(t.outcome, '(none)') || ' at '
                     || coalesce(t.ended_at::text, '-') || ', run ended ' || coalesce(r.ended_at::text, '-')
                FROM (SELECT DISTINCT ON (n) * FROM runs ORDER BY n, id DESC) r
                JOIN enqueued e USING (n)
                LEFT JOIN quota.tickets t ON t.id = r.ticket
               WHERE t.outcome IS DISTINCT FROM CASE r.outcome WHEN 'killed' THEN 'expired' ELSE r.outcome END"
    expect_eq "$P: every ticket ended: succeeded, failed, or expired (the killed worker's)" 0 \
      "$(qs "$db" "SELECT count(*) FROM quota.tickets WHERE outcome IS NULL OR outcome NOT IN ('succeeded', 'failed', 'expired')")"
  fi
  expect_eq "$P: no slot is left taken at the end (ledger)" 0 \
    "$(qs "$db" "SELECT count(*) FROM quota.ledger WHERE ended_at IS NULL AND (lease_until IS NULL OR lease_until > now())")"
  expect_eq "$P: ... and quota.tenant_usage shows no active ticket" 0 \
    "$(qs "$db" "SELECT coalesce(sum(active), 0) FROM quota.tenant_usage")"
  check "$P: no worker process logged an error but the jobs' own failures" \
    bash -c "! grep -h -i 'error' '$CL'/worker.$P.*.log | grep -v -e 'fails each attempt' -e 'fails its first run' | grep -q ."
  grep -h -i 'error' "$CL"/worker.$P.*.log | grep -v -e 'fails each attempt' -e 'fails its first run' | head -n 5 | sed 's/^/#   /' || true
}

run_placement enqueue
run_placement claim
finish_checks
