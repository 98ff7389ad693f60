"""pg_quota admission for procrastinate (psycopg 3): the recipe of USER_GUIDE.md.

Only procrastinate's public API is used: Task.configure(connection=...).defer_async()
to defer in a transaction of ours, a worker middleware (App.run_worker_async(
worker_middleware=[...])) around every job, and a BaseRetryStrategy subclass that
puts a job refused at its tenant's limit back in the queue.

The pool handed to the middlewares is an psycopg_pool.AsyncConnectionPool of ours (the
one given to App.open_async); a connection taken from it commits when its block ends.
"""
import psycopg
import procrastinate


class AtCapacity(Exception):
    """The job's tenant is at its limit: the job goes back to the queue for later."""


class QuotaRetry(procrastinate.BaseRetryStrategy):
    """AtCapacity: try again in `capacity_delay` seconds, however often (a refusal is
    no failure). Anything else: ask `inner` (None: no retry). procrastinate's
    job.attempts counts the AtCapacity retries too, so an inner strategy should not
    rely on max_attempts alone."""

    def __init__(self, inner=None, capacity_delay=0.3):
        self.inner = inner
        self.capacity_delay = capacity_delay

    def get_retry_decision(self, *, exception, job):
        if isinstance(exception, AtCapacity):
            return procrastinate.RetryDecision(retry_in={"seconds": self.capacity_delay})
        if self.inner is None:
            return None
        return self.inner.get_retry_decision(exception=exception, job=job)


# --- at enqueue -----------------------------------------------------------------------
async def defer_with_ticket(conn, task, tenant, lease, label, weight=1, **task_kwargs):
    """Defers `task` for `tenant` with a transactional ticket of `weight` units (0.7.0),
    in ONE transaction of `conn` (an autocommit psycopg.AsyncConnection): the charge and
    the job's row commit or roll back together. The job carries its ticket and its
    weight (task kwargs `ticket`, `weight`). Returns the job id; raises AtCapacity
    (nothing enqueued, nothing charged) when the tenant is at its limit. Call it inside
    your own `async with conn.transaction():` to defer with the rest of your writes."""
    async with conn.transaction():
        cur = await conn.execute(
            "SELECT quota.try_start(weight => %s, label => %s, lease => %s::interval, tenant => %s,"
            " transactional => true)",
            (weight, label, lease, tenant))
        ticket = (await cur.fetchone())[0]
        if ticket is None:
            raise AtCapacity(tenant)
        return await task.configure(connection=conn).defer_async(
            tenant=tenant, ticket=str(ticket), weight=weight, **task_kwargs)


async def _try_start(pool, label, lease, tenant, weight=1):
    async with pool.connection() as c:
        cur = await c.execute(
            "SELECT quota.try_start(weight => %s, label => %s, lease => %s::interval, tenant => %s)",
            (weight, label, lease, tenant))
        return (await cur.fetchone())[0]


async def _finish(pool, ticket, outcome):
    async with pool.connection() as c:
        await c.execute("SELECT quota.finish(%s, %s)", (ticket, outcome))


async def _renew(pool, ticket, lease):
    """True if the ticket is still active and now runs `lease` from now; False if it
    has ended (finished, or its lease ran out: 55000)."""
    try:
        async with pool.connection() as c:
            await c.execute("SELECT quota.renew(%s, %s::interval)", (ticket, lease))
        return True
    except psycopg.errors.ObjectNotInPrerequisiteState:
        return False


# The triggers that finish a job's ticket when procrastinate ends the job, in the
# transaction of its status update (quota.finish_job(), 0.6.0): no transaction of ours
# per job for it. Run once, by the owner of procrastinate_jobs, after its schema.
FINISH_TRIGGERS = """
CREATE TRIGGER quota_job_succeeded AFTER UPDATE OF status ON procrastinate_jobs FOR EACH ROW
  WHEN (NEW.status = 'succeeded' AND OLD.status IN ('todo', 'doing'))
  EXECUTE FUNCTION quota.finish_job('args->ticket', 'succeeded');
CREATE TRIGGER quota_job_failed AFTER UPDATE OF status ON procrastinate_jobs FOR EACH ROW
  WHEN (NEW.status = 'failed' AND OLD.status IN ('todo', 'doing'))
  EXECUTE FUNCTION quota.finish_job('args->ticket', 'failed');
CREATE TRIGGER quota_job_cancelled AFTER UPDATE OF status ON procrastinate_jobs FOR EACH ROW
  WHEN (NEW.status IN ('cancelled', 'aborted') AND OLD.status IN ('todo', 'doing'))
  EXECUTE FUNCTION quota.finish_job('args->ticket', 'cancelled');
CREATE TRIGGER quota_job_deleted AFTER DELETE ON procrastinate_jobs FOR EACH ROW
  WHEN (OLD.status IN ('todo', 'doing'))
  EXECUTE FUNCTION quota.finish_job('args->ticket', 'cancelled');
"""


def claim_trigger(lease):
    """The trigger that renews a job's ticket to `lease` (the run's) when procrastinate
    claims the job, in the transaction of its own fetch (quota.claim_job(), 0.6.0): no
    transaction of ours when a run starts. Where the ticket has ended (its worker was
    killed and the lease gave the slot back; the job waited past its lease), the claim
    clears it from the job's args (JSON null), and the run knows to take a slot of its
    own. Run once, by the owner of procrastinate_jobs, after its schema."""
    return f"""
CREATE TRIGGER quota_job_claimed BEFORE UPDATE OF status ON procrastinate_jobs FOR EACH ROW
  WHEN (NEW.status = 'doing' AND OLD.status = 'todo')
  EXECUTE FUNCTION quota.claim_job('args->ticket', '{lease}');
"""


def enqueued_ticket_middleware(pool, lease, queue_lease, label_of=lambda job: None,
                               renewed_at_claim=False,
                               weight_of=lambda job: job.task_kwargs.get("weight", 1)):
    """Worker middleware for jobs deferred with defer_with_ticket, whose tickets the
    FINISH_TRIGGERS finish when procrastinate ends the job (succeeded, failed for good,
    cancelled or aborted). The job's ticket (task kwarg `ticket`) is renewed to `lease`
    (the run's) when a run starts: by the claim_trigger(lease) in procrastinate's own
    claim where `renewed_at_claim`, else here, in a transaction of its own; and renewed
    to `queue_lease` (as at enqueue) when the job goes back to the queue for a retry.
    If the ticket has ended by the time a run starts (its worker was killed and the
    lease gave the slot back; the job waited past its lease), the run takes a
    writer-committed slot for its tenant instead, of the job's weight (0.7.0: the one
    it was enqueued with), which this middleware finishes when the run ends; none
    free: AtCapacity (retry later).
    """
    async def middleware(call_next, context, worker):
        job = context.job
        own = job.task_kwargs["ticket"]
        tenant = job.task_kwargs["tenant"]
        if own is not None and (renewed_at_claim or await _renew(pool, own, lease)):
            ticket = own
        else:
            ticket = await _try_start(pool, label_of(job), lease, tenant, weight_of(job))
            if ticket is None:
                raise AtCapacity(tenant)
        outcome = "failed"
        retried = False
        try:
            result = await call_next()
            outcome = "succeeded"
            return result
        except BaseException as e:
            retried = context.task.get_retry_exception(exception=e, job=job) is not None
            raise
        finally:
            if ticket != own:
                await _finish(pool, ticket, outcome)
            elif retried and own is not None:
                # Back to the queue holding its ticket. (If its lease ran out during the
                # run, _renew is False and the next run takes a slot anew.)
                await _renew(pool, own, queue_lease)
            # else: the job ended; procrastinate's status update finishes its ticket.
    return middleware


# --- at claim -------------------------------------------------------------------------
def claim_ticket_middleware(pool, lease, tenant_of, label_of=lambda job: None,
                            weight_of=lambda job: 1):
    """Worker middleware that admits each run of a job when the worker has claimed it:
    a writer-committed try_start for the job's tenant, of the job's weight (0.7.0: the
    units it takes of its tenant's plan), as procrastinate claims in its own transaction
    (procrastinate_fetch_job_v2), which is not ours to extend; finished when the run
    ends whatever its end. Refused: AtCapacity, the job goes back to the queue
    (QuotaRetry) without running. A weight above the tenant's limit can never run: its
    try_start raises 53400, and the job fails (keep weights within the plans)."""
    async def middleware(call_next, context, worker):
        job = context.job
        ticket = await _try_start(pool, label_of(job), lease, tenant_of(job), weight_of(job))
        if ticket is None:
            raise AtCapacity(tenant_of(job))
        outcome = "failed"
        try:
            result = await call_next()
            outcome = "succeeded"
            return result
        finally:
            await _finish(pool, ticket, outcome)
    return middleware
