// pg_quota with graphile-worker: the producer and the workers of
// tests/scripts/queue_graphile_worker.sh (see there for what the test checks).
//
//   node queue.js migrate             graphile-worker's schema, through its own API
//   node queue.js produce PLACEMENT   enqueues the jobs with graphile_worker.add_job
//   node queue.js worker PLACEMENT    one worker process (graphile-worker's run())
//
// PLACEMENT is where admission goes:
//   enqueue  the transaction that adds the job takes a transactional ticket for the
//            job's tenant (quota.try_start(..., transactional => true)); the job
//            carries it in its payload; the task renews it when an attempt starts;
//            triggers on graphile-worker's jobs table (quota.finish_job()) finish it
//            when the job ends (success, or its last failed attempt).
//   claim    graphile-worker claims jobs with its own SQL, so the task takes a
//            writer-committed quota.try_start() for the job's tenant when it starts;
//            refused, it puts the job back for later (add_job again, same job_key,
//            run_at a moment later) without running it; it finishes the ticket in a
//            finally, whatever the attempt's end.
// QUEUE_NO_QUOTA=1 takes pg_quota out of both (no ticket is taken or finished): the
// test must then see a tenant run more jobs at once than its limit.
//
// Connection: the libpq environment (PGHOST = the cluster's socket folder, PGPORT,
// PGUSER, PGDATABASE), which node-postgres reads. Settings from the environment:
// JOBS, TENANTS, LEASE (the tickets' lease, e.g. '5 s'), JOB_MS (a job's work),
// CONCURRENCY (jobs at once per worker process).
"use strict";
const { Pool } = require("pg");
const { run, runMigrations } = require("graphile-worker");

const NO_QUOTA = process.env.QUEUE_NO_QUOTA === "1";
const JOBS = Number(process.env.JOBS || 300);
const TENANTS = Number(process.env.TENANTS || 30);
const LEASE = process.env.LEASE || "5 s";
const JOB_MS = Number(process.env.JOB_MS || 300);
const CONCURRENCY = Number(process.env.CONCURRENCY || 4);
const VICTIM = 7; // the job whose first run the test kills with SIGKILL

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// The plan: job n belongs to tenant floor((n-1) / (JOBS/TENANTS)), so a tenant's jobs
// are next to each other in the queue (without admission, the workers take many of one
// tenant at once). Kinds: victim (killed on its first run), rollback (its enqueue rolls
// back), always (fails each attempt; max_attempts 2), once (fails its first run).
function tenantOf(n) {
  return "t" + String(Math.floor((n - 1) / Math.ceil(JOBS / TENANTS))).padStart(2, "0");
}
function kindOf(n) {
  if (n === VICTIM) return "victim";
  if (n % 20 === 10) return "rollback";
  if (n % 80 === 41) return "always";
  if (n % 7 === 3) return "once";
  return "ok";
}

// --- producer ------------------------------------------------------------------------
// enqueue ONE JOB: one transaction, as the application's request would be. Returns
// 'enqueued', 'refused' (the tenant is at its limit: nothing was added, try later) or
// 'rolledback' (the transaction rolled back after adding the job).
async function enqueue(client, placement, n) {
  const tenant = tenantOf(n), kind = kindOf(n);
  const payload = { tenant, n, kind };
  const maxAttempts = kind === "always" ? 2 : 25;
  await client.query("BEGIN");
  try {
    let rows;
    if (placement === "enqueue" && !NO_QUOTA) {
      // The recipe: the job and its tenant's charge commit (or roll back) together;
      // no row back: the tenant is at its limit.
      ({ rows } = await client.query(
        `SELECT graphile_worker.add_job('work', ($1::jsonb || jsonb_build_object('ticket', t))::json,
                                        job_key => $2, max_attempts => $3)
           FROM quota.try_start($2, tenant => $4, lease => $5, transactional => true) AS t
          WHERE t IS NOT NULL`,
        [JSON.stringify(payload), "job-" + n, maxAttempts, tenant, LEASE]));
    } else {
      ({ rows } = await client.query(
        `SELECT graphile_worker.add_job('work', $1::json, job_key => $2, max_attempts => $3)`,
        [JSON.stringify(payload), "job-" + n, maxAttempts]));
    }
    if (rows.length === 0) {
      await client.query("ROLLBACK");
      return "refused";
    }
    if (kind === "rollback") {
      await client.query("ROLLBACK");
      await client.query("INSERT INTO rolled_back (n, tenant) VALUES ($1, $2)", [n, tenant]);
      return "rolledback";
    }
    await client.query("INSERT INTO enqueued (n, tenant, kind) VALUES ($1, $2, $3)", [n, tenant, kind]);
    await client.query("COMMIT");
    return "enqueued";
  } catch (e) {
    await client.query("ROLLBACK").catch(() => {});
    throw e;
  }
}

async function produce(placement) {
  const pool = new Pool({ max: 1 });
  const client = await pool.connect();
  // Pending jobs per tenant, in order; each pass offers every tenant its next job.
  const pending = new Map();
  for (let n = 1; n <= JOBS; n++) {
    const t = tenantOf(n);
    if (!pending.has(t)) pending.set(t, []);
    pending.get(t).push(n);
  }
  const counts = { enqueued: 0, refused: 0, rolledback: 0 };
  while (pending.size > 0) {
    let progress = false;
    for (const [t, ns] of pending) {
      // A tenant takes as many jobs as it is admitted, then the next tenant's turn.
      while (ns.length > 0) {
        const r = await enqueue(client, placement, ns[0]);
        counts[r]++;
        if (r === "refused") break;
        ns.shift();
        progress = true;
      }
      if (ns.length === 0) pending.delete(t);
    }
    if (!progress) await sleep(50);
  }
  client.release();
  await pool.end();
  console.log(`produced ${JSON.stringify(counts)}`);
}

// A pool for graphile-worker, with the error handlers it asks for: a connection lost
// while idle is logged, not thrown.
function newPool(max) {
  const pool = new Pool({ max });
  const lost = (e) => console.log(`connection lost: ${e.message}`);
  pool.on("error", lost);
  pool.on("connect", (client) => client.on("error", lost));
  return pool;
}

// --- worker --------------------------------------------------------------------------
async function one(helpers, text, values) {
  return helpers.withPgClient(async (c) => (await c.query(text, values)).rows[0]);
}

// Puts a job back for later without running it: add_job again with its job_key and
// run_at a moment later. graphile-worker then gives the running job's key to the new
// job and marks the running one as out of attempts, so that it is never retried even
// if this worker dies before the job is completed; the claim that was refused counts
// as no attempt (max_attempts: what the job had left).
async function putBack(payload, helpers) {
  const job = helpers.job;
  await one(helpers, "INSERT INTO put_back (n, tenant) VALUES ($1, $2)", [payload.n, payload.tenant]);
  await helpers.addJob("work", payload, {
    jobKey: job.key,
    runAt: new Date(Date.now() + 200 + Math.floor(Math.random() * 300)),
    maxAttempts: job.max_attempts - job.attempts + 1,
  });
}

function makeTask(placement) {
  return async function work(payload, helpers) {
    const job = helpers.job;
    const { tenant, n, kind } = payload;
    let ticket = null; // the slot this attempt runs under
    let own = false; // taken by this attempt (claim), not carried by the job (enqueue)
    if (!NO_QUOTA) {
      if (placement === "enqueue") {
        // The job's ticket, taken at enqueue, holds its slot across attempts; renewing
        // it extends its lease for this attempt. 55000: the lease ran out (a worker died
        // with the job, or it waited longer than its lease) or the ticket ended: its
        // slot may have gone to another job, so this attempt is admitted anew below.
        try {
          await one(helpers, "SELECT quota.renew($1, $2::interval)", [payload.ticket, LEASE]);
          ticket = payload.ticket;
        } catch (e) {
          if (e.code !== "55000") throw e;
        }
      }
      if (ticket === null) {
        ticket = (await one(helpers,
          "SELECT quota.try_start($1, tenant => $2, lease => $3::interval) AS t",
          ["job-" + n, tenant, LEASE])).t;
        own = true;
        if (ticket === null) {
          await putBack(payload, helpers); // the tenant is at its limit: not now
          return;
        }
      }
    }
    // This job's earlier runs (the test marks those of the killed worker 'killed').
    const prior = await one(helpers,
      "SELECT count(*)::int AS runs, count(*) FILTER (WHERE outcome = 'failed')::int AS failed FROM runs WHERE n = $1",
      [n]);
    // What the test samples: a row per run, from its start to its end (autocommit).
    const { id } = await one(helpers,
      `INSERT INTO runs (n, tenant, job_id, attempt, pid, worker, ticket)
       VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id`,
      [n, tenant, job.id, job.attempts, process.pid, job.locked_by, ticket]);
    let outcome = "failed";
    try {
      await sleep(JOB_MS + Math.floor(Math.random() * 200));
      if (kind === "victim" && prior.runs === 0) await sleep(120000); // the test kills it here
      if (kind === "always") throw new Error(`job ${n} fails each attempt`);
      if (kind === "once" && prior.failed === 0) throw new Error(`job ${n} fails its first run`);
      outcome = "succeeded";
    } finally {
      await one(helpers, "UPDATE runs SET ended_at = clock_timestamp(), outcome = $2 WHERE id = $1",
        [id, outcome]);
      // A ticket this attempt took (claim; or enqueue, when the job's own had ended)
      // ends with the attempt: a retry is admitted anew. The job's own ticket (enqueue)
      // is finished by the recipe's triggers (FINISH_TRIGGERS in
      // queue_graphile_worker.sh) when graphile-worker deletes the job that succeeded
      // or unlocks it after its last failed attempt, in that transaction; a job that
      // will be retried keeps its slot till then.
      if (own) {
        await one(helpers, "SELECT quota.finish($1, $2)", [ticket, outcome]);
      }
    }
  };
}

async function worker(placement) {
  const pgPool = newPool(CONCURRENCY + 2);
  const runner = await run({
    pgPool,
    concurrency: CONCURRENCY,
    pollInterval: 200,
    parsedCronItems: [], // no crontab
    taskList: { work: makeTask(placement) },
  });
  await runner.promise;
  await pgPool.end();
}

async function main() {
  const [cmd, placement] = process.argv.slice(2);
  if (cmd !== "migrate" && !["enqueue", "claim"].includes(placement)) {
    throw new Error("usage: queue.js migrate | produce enqueue|claim | worker enqueue|claim");
  }
  if (cmd === "migrate") {
    const pgPool = newPool(1);
    await runMigrations({ pgPool });
    await pgPool.end();
  } else if (cmd === "produce") {
    await produce(placement);
  } else if (cmd === "worker") {
    await worker(placement);
  } else {
    throw new Error(`unknown command ${cmd}`);
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
