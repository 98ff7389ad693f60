"""The test's procrastinate app and its task (imported by driver.py and by the
workers, so that the app does not live in the main module)."""
import asyncio
import os

import procrastinate

import recipe

DSN = os.environ.get("PQ_DSN", "")
N_JOBS = int(os.environ.get("PQ_JOBS", "300"))
N_TENANTS = int(os.environ.get("PQ_TENANTS", "30"))
BURST = int(os.environ.get("PQ_BURST", "10"))
# The job whose first run blocks until driver.py kills its worker (SIGKILL): a fixed
# victim, so that the kill never meets a run that is just ending.
VICTIM = os.environ.get("PQ_VICTIM", "j100")

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=DSN))
POOL = None  # the process's pool (ours, given to App.open_async); set by driver.py


class Flaky(Exception):
    """A job's planned failure: procrastinate retries it."""


class FlakyRetry(procrastinate.BaseRetryStrategy):
    def get_retry_decision(self, *, exception, job):
        if isinstance(exception, Flaky):
            return procrastinate.RetryDecision(retry_in={"seconds": 0.1})
        return None


# Customers on plans (0.7.0, the claim recipe): each tenant's plan and the number of
# units it may run at once (quota.set_tenant_limits()), by its number modulo 3.
PLANS = [("free", 1), ("pro", 2), ("enterprise", 3)]


def plan_of(tenant):
    """(plan, limit in units) of tenant 'tNN'."""
    return PLANS[int(tenant[1:]) % len(PLANS)]


def plan():
    """The jobs: (key, tenant, fail_times, ms, weight), in bursts of BURST jobs of one
    tenant (so that, unadmitted, a tenant has many jobs claimable at once), and one
    enqueue per tenant that rolls back. Every fourth job of a tenant on a paying plan
    weighs 2 units (a heavy job); the others 1. (The enqueue recipe ignores weights.)"""
    jobs = []
    for i in range(N_JOBS):
        fail = 2 if i % 23 == 5 else (1 if i % 7 == 3 else 0)
        tenant = f"t{(i // BURST) % N_TENANTS:02d}"
        weight = 2 if i % 4 == 1 and plan_of(tenant)[1] >= 2 else 1
        jobs.append((f"j{i:03d}", tenant, fail, 150 + (i * 37) % 200, weight))
    rollbacks = [(f"r{t:02d}", f"t{t:02d}") for t in range(N_TENANTS)]
    return jobs, rollbacks


@app.task(name="work", retry=recipe.QuotaRetry(inner=FlakyRetry(), capacity_delay=0.2))
async def work(*, key, tenant, fail_times=0, ms=200, ticket=None, weight=1):
    async with POOL.connection() as c:
        await c.execute("INSERT INTO pq_running (key, tenant, pid, weight) VALUES (%s, %s, %s, %s)",
                        (key, tenant, os.getpid(), weight))
    ok = False
    try:
        if key == VICTIM:
            async with POOL.connection() as c:
                cur = await c.execute("SELECT count(*) FROM pq_kills WHERE key = %s", (key,))
                if (await cur.fetchone())[0] == 0:
                    await asyncio.sleep(120)  # killed here
        await asyncio.sleep(ms / 1000)
        async with POOL.connection() as c:
            cur = await c.execute("SELECT count(*) FROM pq_runs WHERE key = %s AND NOT ok", (key,))
            ok = (await cur.fetchone())[0] >= fail_times
    finally:
        async with POOL.connection() as c:
            await c.execute("DELETE FROM pq_running WHERE key = %s AND pid = %s", (key, os.getpid()))
            await c.execute("INSERT INTO pq_runs (key, tenant, ok) VALUES (%s, %s, %s)", (key, tenant, ok))
    if not ok:
        raise Flaky(key)


def label_of(job):
    # The job's own ticket is labelled at enqueue ('pq:KEY'); a ticket a run takes
    # later (at claim, or when the enqueued one has ended) 'pq-run:KEY'.
    return "pq-run:" + job.task_kwargs["key"]
