#!/usr/bin/env bash
# procrastinate (PyPI, psycopg 3) driven under pg_quota's per-tenant limit (issue 27),
# with the recipes of tests/queues/procrastinate/recipe.py, in two databases:
# - enqueue: each job is deferred (Task.configure(connection=conn).defer_async) in the
#   transaction that takes its transactional ticket (try_start(tenant, transactional),
#   lease 30 s: the wait in the queue); the job carries its ticket; a trigger on
#   procrastinate_jobs (quota.claim_job(), 0.6.0) renews it to the run's lease (8 s) in
#   procrastinate's claim, and clears it from the job's args where it has ended (a run
#   then takes a writer-committed slot of its own in the worker middleware, which also
#   keeps the ticket while the job is retried); triggers on procrastinate_jobs
#   (quota.finish_job()) finish it in the transaction of procrastinate's status update
#   when the job ends;
# - claim: jobs are deferred plainly; a worker middleware takes a writer-committed
#   try_start for the job's tenant right after procrastinate claimed it (its claim is
#   procrastinate_fetch_job_v2's own transaction), finishes it when the run ends, and on
#   NULL raises AtCapacity, which the task's retry strategy puts back in the queue.
#   Customers on plans (0.7.0, USER_GUIDE "Plans"): each tenant has its plan's own limit
#   (quota.set_tenant_limits(), set with the application's record of the plan in one
#   transaction): free 1, pro 2, enterprise 3 units; every fourth job of a paying
#   tenant weighs 2 units (try_start(weight => 2, …)).
# Each: 3 worker processes (concurrency 6), 300 jobs over 30 tenants in bursts of 10
# jobs of one tenant, quota.max_active_per_tenant = 2, 50 planned failures that
# procrastinate retries, 30 enqueues that roll back, one worker SIGKILLed mid-job (its
# jobs recovered with procrastinate's get_stalled_jobs/retry_job once the 8 s lease of
# the killed runs has passed). A sampler session counts, per tenant, the jobs whose work is
# running (rows the jobs write at the start and delete at the end of their work).
# Checks: no tenant ever ran more units than its limit (the weights of its running
# jobs summed); every job succeeded, its work done once; the
# failures happened and were retried; the rolled-back enqueues left no job, no run and
# (enqueue) no ticket; the killed run's ticket ended by its lease; no other ticket was
# lost to a lease; no slot is taken at the end; pg_quota did refuse; (enqueue) every
# job's ticket was written by the transaction that deferred the job.
#
# QUEUE_NO_QUOTA=1 takes pg_quota out of the recipe (plain defer, no middleware): the
# "never more than the limit" checks must then fail; the checks about tickets are
# skipped.
#
# procrastinate and its dependencies, pinned, are installed with Debian's python3 (3.11)
# into a venv in PQ_CACHE (default /var/cache/pg_quota-tests), reused when present
# (tests/queues/procrastinate/venv.sh, shared with `scripts/bench --queue`).
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5770 + PORT_OFFSET))}"
HERE="$ROOT/tests/queues/procrastinate"
source "$HERE/venv.sh"
VENV="$PQ_VENV"
NO_QUOTA=0
case "${QUEUE_NO_QUOTA:-}" in ""|0) ;; *) NO_QUOTA=1 ;; esac
LIMIT=2
LEASE='8 s'        # a run's (a stalled run on a loaded machine must not outlive it)
QUEUE_LEASE='30 s' # an enqueued ticket's, until its job runs
T_START=$SECONDS

# --- install ----------------------------------------------------------------------------
procrastinate_venv
PY="$VENV/bin/python"
export PYTHONDONTWRITEBYTECODE=1  # nothing generated in the repository
expect_eq "procrastinate $PQ_VERSION and psycopg 3.3.9 are importable from $VENV" "$PQ_VERSION 3.3.9" \
  "$("$PY" -c 'import procrastinate, psycopg; print(procrastinate.__version__, psycopg.__version__)')"
read -r N_JOBS N_FAILS N_ROLLBACKS < <("$PY" "$HERE/driver.py" plan | sed 's/[a-z]*=//g')

with_cluster queue_procrastinate
sql >/dev/null <<SQL
CREATE ROLE app LOGIN;
ALTER ROLE app SET quota.max_active_per_tenant = $LIMIT;
ALTER ROLE app SET quota.max_retained_per_tenant = 0;
ALTER ROLE app SET quota.max_retained_per_role = 0;
ALTER ROLE app SET quota.allow_transactional = on;
SQL
[ "$NO_QUOTA" = 0 ] || echo "# QUEUE_NO_QUOTA=1: pg_quota is taken out of the recipe"

skip() { CHECK_NO=$((CHECK_NO + 1)); echo "ok $CHECK_NO - $1 # SKIP QUEUE_NO_QUOTA"; }
active_slots() {
  sql -c "SELECT count(*) FROM quota.ledger WHERE ended_at IS NULL AND (lease_until IS NULL OR lease_until > now())"
}

for MODE in enqueue claim; do
  DB="q_$MODE"
  sql -c "CREATE DATABASE $DB OWNER app" >/dev/null
  sql -d "$DB" -c "CREATE EXTENSION pg_quota" -c "CREATE TABLE pq_stop (x int)" \
      -c "GRANT EXECUTE ON FUNCTION quota.set_tenant_limits(text, integer, integer, regrole) TO app" >/dev/null
  export PGDATABASE="$DB"  # for sql, as used by start_sampler/stop_sampler and below
  export PQ_DSN="host=$CL port=$PORT user=app dbname=$DB" PQ_LEASE="$LEASE" PQ_QUEUE_LEASE="$QUEUE_LEASE" PQ_OUT="$CL/run.$MODE"
  check "$MODE: procrastinate's schema applied through its own API (apply_schema_async)$(
         [ "$MODE" = enqueue ] && [ "$NO_QUOTA" = 0 ] && echo ", and the recipe's finish triggers")" \
    "$PY" "$HERE/driver.py" setup "$MODE"
  # The most units any tenant ran beyond its limit (pq_limits: its plan's at claim, 2 at
  # enqueue), summing the weights of its running jobs.
  start_sampler pq_stop "SELECT coalesce(max(greatest(u.units - l.lim, 0)), 0)
                           FROM (SELECT tenant, sum(weight) AS units FROM pq_running GROUP BY tenant) u
                           JOIN pq_limits l USING (tenant)"
  t0=$SECONDS
  check "$MODE: the run ended: every job done within 90 s, the workers stopped" \
    timeout 150 "$PY" "$HERE/driver.py" run "$MODE" "$CL"
  stop_sampler pq_stop
  val() { sed -n "s/^$1=//p" "$PQ_OUT" 2>/dev/null || true; }  # the run's summary
  echo "# $MODE: $(paste -sd' ' "$PQ_OUT" 2>/dev/null || true) (script: $((SECONDS - t0)) s)"

  check "$MODE: no tenant ever ran more units at once than its limit ($([ "$MODE" = claim ] && echo "its plan's: free 1, pro 2, enterprise 3, heavy jobs 2 units" || echo "$LIMIT"); most seen beyond it: ${SAMPLED_MAX:-none}, $SAMPLES samples)" \
    test "${SAMPLED_MAX:-99}" -le 0 -a "${SAMPLES:-0}" -ge 100
  if [ "$MODE" = claim ] && [ "$NO_QUOTA" = 0 ]; then
    expect_eq "$MODE: each tenant's plan is its own limit (quota.tenant_limits)" \
      "$(sql -c "SELECT string_agg(tenant || '=' || lim, ' ' ORDER BY tenant) FROM pq_limits")" \
      "$(sql -c "SELECT string_agg(tenant || '=' || max_active, ' ' ORDER BY tenant) FROM quota.tenant_limits")"
    expect_eq "$MODE: the heavy jobs ran under tickets of weight 2" \
      "$(sql -c "SELECT count(DISTINCT args->>'key') FROM procrastinate_jobs WHERE (args->>'weight')::int = 2")" \
      "$(sql -c "SELECT count(DISTINCT substr(label, 8)) FROM quota.ledger WHERE weight = 2 AND label LIKE 'pq-run:%'")"
  fi
  expect_eq "$MODE: all $N_JOBS jobs deferred, and procrastinate shows every one succeeded" \
    "$N_JOBS $N_JOBS $N_JOBS" \
    "$(val deferred) $(sql -c "SELECT count(*) FILTER (WHERE status = 'succeeded') || ' ' || count(*)
                                FROM procrastinate_jobs WHERE args->>'key' LIKE 'j%'")"
  # A job whose work was done when its worker was killed, before procrastinate wrote
  # its success, runs again once it is recovered (procrastinate runs jobs at least once).
  expect_eq "$MODE: each job's work was completed, once (twice only for jobs of the killed worker)" "$N_JOBS 0" \
    "$(sql -c "SELECT count(DISTINCT key) FROM pq_runs WHERE ok") $(sql -c "SELECT count(*) FROM (SELECT key FROM pq_runs
        WHERE ok GROUP BY key HAVING count(*) > 1) twice WHERE key NOT IN (SELECT key FROM pq_reaped)")"
  retries=$(sql -c "SELECT count(*) FROM procrastinate_events WHERE type = 'deferred_for_retry'")
  expect_eq "$MODE: the $N_FAILS planned failures happened, and procrastinate retried them ($retries retries in all)" \
    "$N_FAILS t" "$(sql -c "SELECT count(*) FROM pq_runs WHERE NOT ok") $([ "$retries" -ge "$N_FAILS" ] && echo t || echo f)"
  expect_eq "$MODE: the $N_ROLLBACKS enqueues that rolled back left no job and no run" "$N_ROLLBACKS 0 0" \
    "$(val rolled_back) $(sql -c "SELECT count(*) FROM procrastinate_jobs WHERE args->>'key' LIKE 'r%'") $(
       sql -c "SELECT count(*) FROM pq_runs WHERE key LIKE 'r%'")"
  killed=$(val killed_key)
  check "$MODE: a worker was SIGKILLed in the middle of job ${killed:-?}'s work (pid $(val killed_pid))" test -n "$killed"
  expect_eq "$MODE: procrastinate's stalled-job retry brought job $killed back, and it then succeeded" "t 1" \
    "$(sql -c "SELECT count(*) > 0 FROM pq_reaped WHERE key = '$killed'") $(sql -c "SELECT count(*) FROM pq_runs WHERE key = '$killed' AND ok")"

  if [ "$NO_QUOTA" = 1 ]; then
    skip "$MODE: the killed run's ticket came back through its lease"
    skip "$MODE: no other ticket was lost to a lease"
    skip "$MODE: pg_quota refused starts at the limit"
    [ "$MODE" = enqueue ] && skip "$MODE: the rolled-back enqueues' charges rolled back with them"
    [ "$MODE" = enqueue ] && skip "$MODE: every job's ticket was written by the transaction that deferred the job"
    [ "$MODE" = enqueue ] && skip "$MODE: procrastinate's claim cleared the ended tickets of the killed worker's jobs"
    [ "$MODE" = enqueue ] && skip "$MODE: each job's ticket was finished by procrastinate's own status update"
  else
    expect_eq "$MODE: the killed run's ticket came back through its lease (outcome expired)" 1 \
      "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label IN ('pq:$killed', 'pq-run:$killed') AND outcome = 'expired'")"
    expect_eq "$MODE: the only tickets lost to a lease are those of the $(val reaped) jobs the killed worker held (the others were finished)" "" \
      "$(sql -c "SELECT string_agg(label, ' ') FROM quota.ledger WHERE outcome = 'expired'
                  AND split_part(label, ':', 2) NOT IN (SELECT key FROM pq_reaped)")"
    refused=$(sql -c "SELECT coalesce(sum(refused_active), 0) FROM quota.stats WHERE role = 'app' AND datname = current_database()")
    check "$MODE: pg_quota refused starts at the limit ($refused refusals; $(val refused_at_enqueue) at enqueue)" test "$refused" -gt 0
    if [ "$MODE" = enqueue ]; then
      expect_eq "$MODE: the rolled-back enqueues' transactional charges rolled back with them (no ticket left)" 0 \
        "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label LIKE 'pq:r%'")"
      expect_eq "$MODE: every job's ticket was written by the transaction that deferred the job (transactional)" \
        "$N_JOBS" "$(sql -c "SELECT count(*) FROM procrastinate_jobs j
             JOIN procrastinate_events e ON e.job_id = j.id AND e.type = 'deferred'
             JOIN quota.ledger l ON l.label = 'pq:' || (j.args->>'key')
            WHERE j.args->>'key' LIKE 'j%' AND l.tenant = j.args->>'tenant'
              AND l.txid IS NOT NULL AND xid(l.txid) = e.xmin")"
      # The claim trigger (quota.claim_job()) cleared the ticket of exactly the jobs
      # whose ticket had ended when procrastinate claimed them again: those whose
      # enqueued ticket expired, every one a job of the killed worker (check 12), the
      # victim's among them (check 11); every other job still carries its own. Not
      # every reaped job: one the killed worker had just failed holds a ticket renewed
      # to the queue's lease (the middleware's retry path), and one it had claimed
      # after its last heartbeat may be reaped before its run's lease ends; both are
      # still active when claimed again, and keep their ticket.
      expect_eq "$MODE: procrastinate's claim cleared the ended tickets of the killed worker's jobs, and only theirs" \
        "$(sql -c "SELECT string_agg(substr(label, 4), ' ' ORDER BY label) FROM quota.ledger
                    WHERE label LIKE 'pq:j%' AND outcome = 'expired'")" \
        "$(sql -c "SELECT string_agg(j.args->>'key', ' ' ORDER BY j.args->>'key') FROM procrastinate_jobs j
                    WHERE j.args->'ticket' = 'null' OR NOT EXISTS (
                      SELECT 1 FROM quota.ledger l WHERE l.id = (j.args->>'ticket')::uuid
                         AND l.label = 'pq:' || (j.args->>'key'))")"
      # The recipe's triggers (quota.finish_job()): the ticket was last changed by the
      # transaction of procrastinate's status update to succeeded, the one that wrote
      # its 'succeeded' event. The killed worker's jobs ran again under a ticket of
      # their run; theirs had expired. (0.6.0: the finish moved the ticket into
      # quota.history, whose row's xmin is the finishing transaction; quota.ledger is a
      # view, without xmin.)
      expect_eq "$MODE: each job's ticket was finished (succeeded) by procrastinate's own status update, in its transaction (all but the $(sql -c "SELECT count(DISTINCT key) FROM pq_reaped") jobs of the killed worker)" \
        "$(sql -c "SELECT $N_JOBS - count(DISTINCT key) FROM pq_reaped") 0" \
        "$(sql -c "SELECT count(*) || ' ' || count(*) FILTER (WHERE NOT (l.outcome = 'succeeded' AND l.xmin = e.xmin))
             FROM procrastinate_jobs j JOIN quota.history l ON l.id = (j.args->>'ticket')::uuid
             JOIN procrastinate_events e ON e.job_id = j.id AND e.type = 'succeeded'
            WHERE j.args->>'key' LIKE 'j%' AND j.args->>'key' NOT IN (SELECT key FROM pq_reaped)")"
    fi
  fi
  # The killed run's ticket ends with its lease at the latest; every other was finished.
  for _ in $(seq 1 100); do [ "$(active_slots)" = 0 ] && break; sleep 0.1; done
  expect_eq "$MODE: no slot is left taken at the end (ledger, tenant_usage)" "0 0" \
    "$(active_slots) $(sql -c "SELECT coalesce(sum(active), 0) FROM quota.tenant_usage")"
  unset PGDATABASE
done
echo "# run time: $((SECONDS - T_START)) s"
finish_checks
