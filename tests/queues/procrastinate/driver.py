"""Test driver for tests/scripts/queue_procrastinate.sh: procrastinate workers under
pg_quota's per-tenant limit, with admission at enqueue or at claim (recipe.py).

  driver.py setup MODE       procrastinate's schema (its own API), the recipe's triggers
                             (enqueue), and the test's tables
  driver.py worker MODE N    one worker process (concurrency N) until SIGTERM
  driver.py run MODE         the whole run: workers, producer, a SIGKILL, the reaper

Environment: PQ_DSN (libpq conninfo of the application's role), PQ_LEASE (a run's
lease, '4 s'), PQ_QUEUE_LEASE (an enqueued ticket's lease until its job runs, '30 s'),
QUEUE_NO_QUOTA=1 (pg_quota taken out of the recipe: plain defer, no middleware),
PQ_OUT (a file for the run's key=value summary).

Each job writes a row in pq_running when its work starts and deletes it when its work
ends (autocommit), so the sampler (a separate session) sees per tenant what runs;
each run of a job writes a row in pq_runs (ok or failed).
"""
import asyncio
import os
import signal
import subprocess
import sys
import time

import procrastinate
import psycopg
import psycopg_pool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import recipe  # noqa: E402
import jobs  # noqa: E402
from jobs import app, work, plan, label_of  # noqa: E402

DSN = os.environ.get("PQ_DSN", "")
LEASE = os.environ.get("PQ_LEASE", "4 s")
LEASE_S = float(LEASE.split()[0])
QUEUE_LEASE = os.environ.get("PQ_QUEUE_LEASE", "30 s")  # an enqueued ticket's, until its job runs
NO_QUOTA = os.environ.get("QUEUE_NO_QUOTA", "") not in ("", "0")
N_JOBS = jobs.N_JOBS
WORKERS = int(os.environ.get("PQ_WORKERS", "3"))
CONCURRENCY = int(os.environ.get("PQ_CONCURRENCY", "6"))



async def setup(mode):
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
    async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as c:
        if mode == "enqueue" and not NO_QUOTA:
            await c.execute(recipe.FINISH_TRIGGERS)
            await c.execute(recipe.claim_trigger(LEASE))
        await c.execute("CREATE TABLE pq_running (key text, tenant text, pid int, weight int)")
        # Each tenant's limit in units: its plan's (claim: set with
        # quota.set_tenant_limits() below), or the role's setting of 2 (enqueue).
        await c.execute("CREATE TABLE pq_limits (tenant text PRIMARY KEY, plan text, lim int)")
        for t in range(jobs.N_TENANTS):
            tenant = f"t{t:02d}"
            name, lim = jobs.plan_of(tenant) if mode == "claim" else ("default", 2)
            await c.execute("INSERT INTO pq_limits VALUES (%s, %s, %s)", (tenant, name, lim))
            if mode == "claim" and not NO_QUOTA:
                # The guide's plan change, made as a signup: the application's record
                # of the plan and the tenant's limits in one transaction.
                async with c.transaction():
                    await c.execute("UPDATE pq_limits SET plan = %s WHERE tenant = %s", (name, tenant))
                    await c.execute("SELECT quota.set_tenant_limits(%s, max_active => %s)", (tenant, lim))
        await c.execute("CREATE TABLE pq_runs (key text, tenant text, ok bool, at timestamptz DEFAULT clock_timestamp())")
        await c.execute("CREATE TABLE pq_kills (key text, tenant text, pid int)")
        await c.execute("CREATE TABLE pq_reaped (key text, job_id bigint)")


async def worker(mode, concurrency):
    POOL = jobs.POOL = psycopg_pool.AsyncConnectionPool(DSN, min_size=2, max_size=concurrency + 4, open=False)
    await POOL.open(wait=True)
    middleware = []
    if not NO_QUOTA:
        if mode == "enqueue":
            middleware = [recipe.enqueued_ticket_middleware(POOL, LEASE, QUEUE_LEASE, label_of,
                                                            renewed_at_claim=True)]
        else:
            middleware = [recipe.claim_ticket_middleware(
                POOL, LEASE, tenant_of=lambda job: job.task_kwargs["tenant"], label_of=label_of,
                weight_of=lambda job: job.task_kwargs.get("weight", 1))]
    async with app.open_async(POOL):
        await app.run_worker_async(
            concurrency=concurrency, worker_middleware=middleware,
            fetch_job_polling_interval=0.1, abort_job_polling_interval=1,
            update_heartbeat_interval=0.5, stalled_worker_timeout=300,
            shutdown_graceful_timeout=10)
    await POOL.close()


def spawn_worker(mode, logdir, n):
    log = open(os.path.join(logdir, f"worker.{mode}.{n}.log"), "w")
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", mode, str(CONCURRENCY)],
                            stdout=log, stderr=subprocess.STDOUT)


async def produce(mode, conn, stats):
    jobs, rollbacks = plan()
    rb = dict((t, k) for k, t in rollbacks)  # tenant -> its rollback key, done once
    pending = list(jobs)
    while pending:
        refused = set()
        left = []
        for key, tenant, fail, ms, weight in pending:
            if tenant in refused:
                left.append((key, tenant, fail, ms, weight))
                continue
            kw = dict(key=key, fail_times=fail, ms=ms)
            if mode == "claim":
                kw["weight"] = weight
            try:
                if tenant in rb:
                    # An enqueue that rolls back (the caller's transaction fails after
                    # the defer): no job, and no charge.
                    rkey = rb[tenant]
                    try:
                        async with conn.transaction():
                            if mode == "enqueue" and not NO_QUOTA:
                                await recipe.defer_with_ticket(conn, work, tenant, QUEUE_LEASE, "pq:" + rkey,
                                                               key=rkey, fail_times=0, ms=100)
                            else:
                                await work.configure(connection=conn).defer_async(
                                    key=rkey, tenant=tenant, fail_times=0, ms=100)
                            raise RuntimeError("the application's transaction fails")
                    except RuntimeError:
                        stats["rolled_back"] += 1
                        del rb[tenant]
                if mode == "enqueue" and not NO_QUOTA:
                    await recipe.defer_with_ticket(conn, work, tenant, QUEUE_LEASE, "pq:" + key, **kw)
                else:
                    await work.defer_async(tenant=tenant, **kw)
                stats["deferred"] += 1
            except recipe.AtCapacity:
                stats["refused_at_enqueue"] += 1
                refused.add(tenant)
                left.append((key, tenant, fail, ms, weight))
        pending = left
        if pending:
            await asyncio.sleep(0.05)


async def run(mode, logdir):
    t0 = time.time()
    POOL = jobs.POOL = psycopg_pool.AsyncConnectionPool(DSN, min_size=1, max_size=4, open=False)
    await POOL.open(wait=True)
    stats = dict(deferred=0, rolled_back=0, refused_at_enqueue=0, reaped=0)
    procs = [spawn_worker(mode, logdir, n) for n in range(WORKERS)]
    killed = None
    try:
        async with app.open_async(POOL):
            conn = await psycopg.AsyncConnection.connect(DSN, autocommit=True)
            producer = asyncio.create_task(produce(mode, conn, stats))
            deadline = time.time() + 90
            while time.time() < deadline:
                await asyncio.sleep(0.1)
                if producer.done():
                    producer.result()  # raises what the producer raised
                async with POOL.connection() as c:
                    cur = await c.execute("SELECT count(DISTINCT key) FROM pq_runs WHERE ok")
                    done = (await cur.fetchone())[0]
                    if killed is None:
                        # SIGKILL the worker running the victim's first run (jobs.VICTIM),
                        # which blocks until then: in the middle of a job's work.
                        pids = [p.pid for p in procs]
                        cur = await c.execute(
                            "SELECT key, tenant, pid FROM pq_running WHERE key = %s AND pid = ANY(%s) LIMIT 1",
                            (jobs.VICTIM, pids))
                        row = await cur.fetchone()
                        if row:
                            victim = next(p for p in procs if p.pid == row[2])
                            os.kill(victim.pid, signal.SIGKILL)
                            victim.wait()
                            killed = row
                            # It runs nothing any more: its job's row goes (its ticket
                            # stays taken until its lease runs out).
                            await c.execute("DELETE FROM pq_running WHERE pid = %s", (row[2],))
                            await c.execute("INSERT INTO pq_kills VALUES (%s, %s, %s)", row)
                            procs.remove(victim)
                            procs.append(spawn_worker(mode, logdir, WORKERS))
                # procrastinate's documented recovery of a dead worker's jobs: retry the
                # jobs of workers without a heartbeat for a while (here: past the lease,
                # so that the killed run's slot comes back through its lease first).
                if killed is not None:
                    for job in await app.job_manager.get_stalled_jobs(seconds_since_heartbeat=LEASE_S + 1):
                        await app.job_manager.retry_job(job)
                        async with POOL.connection() as c:
                            await c.execute("INSERT INTO pq_reaped VALUES (%s, %s)", (job.task_kwargs["key"], job.id))
                        stats["reaped"] += 1
                if producer.done() and done >= N_JOBS:
                    break
            await conn.close()
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        await POOL.close()
    out = dict(stats, killed_key=killed[0] if killed else "", killed_pid=killed[2] if killed else "",
               seconds=round(time.time() - t0, 1))
    with open(os.environ["PQ_OUT"], "w") as f:
        for k, v in out.items():
            f.write(f"{k}={v}\n")


def main():
    cmd = sys.argv[1]
    if cmd == "setup":
        asyncio.run(setup(sys.argv[2]))
    elif cmd == "worker":
        asyncio.run(worker(sys.argv[2], int(sys.argv[3])))
    elif cmd == "run":
        asyncio.run(run(sys.argv[2], sys.argv[3]))
    elif cmd == "plan":
        jobs, rollbacks = plan()
        print(f"jobs={len(jobs)} failures={sum(j[2] for j in jobs)} rollbacks={len(rollbacks)}")
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
