"""The application of `scripts/bench --queue` (bench/jobqueue.py): a procrastinate app
with one task that does nothing, its deferrers and its workers, with and without the
pg_quota recipes of tests/queues/procrastinate/recipe.py. It is a module of its own,
imported by jobqueue.py (which the deferrer and worker processes run), so that the app
does not live in the main module (procrastinate warns about an app there).

Variants: "plain" (procrastinate alone), "plain-tx" (each defer in an explicit
transaction), "enqueue" (recipe.defer_with_ticket; recipe.claim_trigger and
enqueued_ticket_middleware), "enqueue-renew" (the same, the middleware renewing),
"claim" (plain defers; claim_ticket_middleware).

Environment: BENCH_QUEUE_DSN, the libpq conninfo of the application's role.
"""
import asyncio
import os
import sys

import procrastinate
import psycopg
import psycopg_pool

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "queues", "procrastinate"))
import recipe  # noqa: E402  (the recipes the test suite checks)

# Jobs are deferred into HOLD, which no worker reads, and moved to RUN when the
# processing phase starts (bench/jobqueue.py).
HOLD, RUN = "hold", "run"
# Leases long enough that no ticket ends by its lease in a round: the queue's while a
# job waits (the whole enqueue and processing of a round), the run's for one run.
QUEUE_LEASE, RUN_LEASE = "10 min", "1 min"
DSN = os.environ.get("BENCH_QUEUE_DSN", "")

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=DSN))


@app.task(name="noop", queue=HOLD, retry=recipe.QuotaRetry())
async def noop(*, tenant, key, ticket=None, weight=1):
    """The job: nothing at all, so that the queue's own work is all there is. QuotaRetry,
    as in the recipe, would put a job refused at claim back in the queue; the harness
    checks that none was. `ticket` and `weight` are what recipe.defer_with_ticket adds
    to a job's arguments (weight since 0.7.0)."""


def label_of(job):
    # The ticket a run takes at claim; at enqueue the label is "pq:KEY" (defer_one).
    return "pq-run:" + job.task_kwargs["key"]


async def apply_schema():
    """procrastinate's schema, through its own API."""
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


async def defer_one(conn, variant, tenant, key):
    if variant in ("enqueue", "enqueue-renew"):
        await recipe.defer_with_ticket(conn, noop, tenant, QUEUE_LEASE, "pq:" + key, key=key)
    elif variant == "plain-tx":
        async with conn.transaction():
            await noop.configure(connection=conn).defer_async(tenant=tenant, key=key)
    else:
        # One statement on an autocommit connection: procrastinate's own defer, through
        # the same kind of connection as the other variants' (not the app's pool).
        await noop.configure(connection=conn).defer_async(tenant=tenant, key=key)


async def deferrer(variant, first, count, tenants, rnd):
    """Defers jobs FIRST .. FIRST+COUNT-1 (tenant: the job's number modulo TENANTS) on
    one connection, one after the other, as one client of an application would. Prints
    'ready' once connected and waits for a line on stdin; prints 'done' at the end and
    waits for another line before it disconnects and exits, so that the harness reads
    the CPU of this process and its backend while both still run."""
    conn = await psycopg.AsyncConnection.connect(DSN, autocommit=True)
    print("ready", flush=True)
    # The harness says go when every deferrer is connected: the connections' setup is
    # not in the measured time.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for n in range(first, first + count):
        await defer_one(conn, variant, f"t{n % tenants:02d}", f"{rnd}.{n}")
    print("done", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await conn.close()


async def worker(variant, concurrency):
    """One worker process on queue RUN until SIGTERM, with the variant's middleware."""
    # Opened in full before the worker registers, so that no job of the measured phase
    # waits for a new connection; the middlewares use it too, as in the recipe. Room
    # for procrastinate's LISTEN connection, its fetches and heartbeats, and each job's
    # admission calls.
    size = concurrency + 4
    pool = psycopg_pool.AsyncConnectionPool(DSN, min_size=size, max_size=size, open=False)
    await pool.open(wait=True)
    middleware = []
    if variant in ("enqueue", "enqueue-renew"):
        middleware = [recipe.enqueued_ticket_middleware(pool, RUN_LEASE, QUEUE_LEASE, label_of,
                                                        renewed_at_claim=variant == "enqueue")]
    elif variant == "claim":
        middleware = [recipe.claim_ticket_middleware(
            pool, RUN_LEASE, tenant_of=lambda job: job.task_kwargs["tenant"], label_of=label_of)]
    async with app.open_async(pool):
        # The jobs come to RUN by one UPDATE, which sends no NOTIFY: the workers find
        # them by polling, every 50 ms, the same in each variant.
        await app.run_worker_async(
            queues=[RUN], concurrency=concurrency, worker_middleware=middleware,
            fetch_job_polling_interval=0.05, shutdown_graceful_timeout=10)
    await pool.close()
