#!/usr/bin/env python3
"""A real job queue with and without pg_quota: jobs/s of procrastinate 3.10.0 deferring
and processing trivial jobs, plain and with the recipes of
tests/queues/procrastinate/recipe.py (USER_GUIDE "Job queues: recipes"). Called by
`scripts/bench --queue`, which installs the release build and runs this file with the
interpreter of the procrastinate venv (tests/queues/procrastinate/venv.sh). The
application (app, task, deferrers, workers) is bench/jobqueue_app.py; this file is the
harness, and the entry point of the deferrer and worker processes it starts. Named
jobqueue.py, not queue.py: the script's folder comes first on sys.path, and a queue.py
there would hide the standard library's queue module from asyncio.

Variants, each in a database of its own on one throwaway cluster (pg_quota preloaded,
as it must be for (b) and (c)):
  (a)  plain     procrastinate alone; its database has no pg_quota extension
  (a') plain-tx  the same, with each defer in an explicit transaction (BEGIN, defer,
                 COMMIT): enqueue only, to tell (b)'s transaction from its ticket
  (b)  enqueue   admission at enqueue: recipe.defer_with_ticket (a transactional
                 try_start for the job's tenant and the defer, in one transaction);
                 recipe.claim_trigger (quota.claim_job(), 0.6.0) renews the ticket in
                 procrastinate's claim, recipe.enqueued_ticket_middleware takes a slot
                 for a run whose ticket ended; recipe.FINISH_TRIGGERS (quota.finish_job()) finish it
                 in procrastinate's status update when the job ends
  (b') enqueue-renew  the same without the claim trigger: the middleware renews the
                 ticket when the run starts, in a transaction of its own (the recipe
                 before quota.claim_job(), and where a queue's payload is json)
  (c)  claim     admission at claim: jobs deferred plainly; recipe.claim_ticket_middleware
                 takes a writer-committed try_start when the run starts, finishes it
                 at its end
Limits are far above what the jobs need (per tenant and per role 1,000,000), so that
nothing is refused: this measures what admission costs, not what it refuses. Every
round checks it (every job succeeded, none went back to the queue, one ticket per job,
all ended as succeeded, none expired, none left active).

Each round runs every variant once, in an order that turns with the round, and each
variant's round has two phases, so that neither competes with the other for the CPU:
  enqueue     PROCS deferrer processes, one connection each, defer JOBS jobs (tenants
              drawn in turn from TENANTS) as fast as they can into the queue "hold",
              which no worker reads; rate = JOBS / wall time from the go that all of
              them wait for (connected and ready) to the last one's end.
  processing  PROCS worker processes (concurrency CONCURRENCY each, their connection
              pools opened in full) start on the queue "run"; once all have registered
              in procrastinate_workers, one UPDATE moves the held jobs to "run";
              rate = JOBS / (the last 'succeeded' event's time - the move's commit).
A CHECKPOINT precedes each phase, so that each starts with the same full-page writes
ahead. Between rounds procrastinate's tables are emptied; pg_quota's ledger keeps its
ended tickets (the default quota.retention, as a real deployment would), the same for
(b) and (c). The job itself does nothing, so that the queue's own overhead dominates
and pg_quota's share is as large as it can be: a job that works for a millisecond or
more dilutes it accordingly.

The report (OUT/queue.md) gives each phase's jobs/s per round, the medians, their ratio
to (a), and per job: the CPU of the server's processes and of the clients' (from /proc;
a neighbour's load on a shared machine moves the rates far more than the CPU a job
takes, so the CPU ratio is the steadier measure of cost), the WAL, the transactions,
and the ledger writer's requests and batch commits. Worker logs and the server log
stay in OUT/queue/.

Subcommands, for the processes the harness starts: `defer VARIANT FIRST COUNT TENANTS
ROUND`, `work VARIANT CONCURRENCY`, `schema` (each with BENCH_QUEUE_DSN set).
"""
import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import psycopg

import jobqueue_app as qa

VARIANTS = ["plain", "plain-tx", "enqueue", "enqueue-renew", "claim"]
TITLE = {"plain": "(a) plain procrastinate", "plain-tx": "(a') plain, defer in a transaction",
         "enqueue": "(b) admission at enqueue",
         "enqueue-renew": "(b') at enqueue, renewed by the middleware", "claim": "(c) admission at claim"}
ENQUEUE_ONLY = {"plain-tx"}
DB = {"plain": "q_plain", "plain-tx": "q_plain", "enqueue": "q_enqueue", "enqueue-renew": "q_enqueue_renew",
      "claim": "q_claim"}
LIMIT = 1000000  # quota.max_active_per_tenant and _per_role: nothing is refused


# --- the harness -------------------------------------------------------------------------
def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pgbin", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=5495)
    p.add_argument("--machine", default="")
    p.add_argument("--jobs", type=int, default=3000, help="jobs per variant and round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--procs", type=int, default=4, help="deferrer processes, and worker processes")
    p.add_argument("--concurrency", type=int, default=4, help="each worker's concurrency")
    p.add_argument("--tenants", type=int, default=32)
    p.add_argument("--user", default="postgres")
    return p.parse_args()


class Cluster:
    """A throwaway cluster in OUT/queue, PostgreSQL's default durability settings."""

    def __init__(self, args):
        self.args = args
        self.dir = os.path.join(os.path.abspath(args.out), "queue")
        self.data = os.path.join(self.dir, "data")

    def as_pg(self, cmd, check=True):
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", self.args.user, "--"] + cmd
        subprocess.run(cmd, check=check, stdout=subprocess.DEVNULL, stderr=None if check else subprocess.DEVNULL)

    def pg_ctl(self, action):
        self.as_pg([os.path.join(self.args.pgbin, "pg_ctl"), "-D", self.data, "-l",
                    os.path.join(self.dir, "server.log"), "-w", "-t", "60", "-m", "fast", action])

    def create(self):
        if os.path.exists(os.path.join(self.data, "postmaster.pid")):  # a run cut short
            self.as_pg([os.path.join(self.args.pgbin, "pg_ctl"), "-D", self.data, "-m", "immediate",
                        "stop"], check=False)
        subprocess.run(["rm", "-rf", self.dir], check=True)
        os.makedirs(self.dir)
        os.chmod(self.dir, 0o755)
        if os.geteuid() == 0:
            subprocess.run(["chown", self.args.user, self.dir], check=True)
        self.as_pg([os.path.join(self.args.pgbin, "initdb"), "-D", self.data, "-A", "trust",
                    "-U", "postgres", "--no-sync"])
        # Room for PROCS workers' pools, PROCS deferrers and the harness.
        conns = self.args.procs * (self.args.concurrency + 4) + self.args.procs + 20
        with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
            f.write(f"shared_preload_libraries = 'pg_quota'\nport = {self.args.port}\n"
                    f"listen_addresses = ''\nunix_socket_directories = '{self.dir}'\n"
                    f"max_connections = {max(100, conns)}\n")
        self.pg_ctl("start")

    def dsn(self, db, user="postgres"):
        return f"host={self.dir} port={self.args.port} dbname={db} user={user}"

    def sql(self, db, query, params=None):
        """Runs one statement as the superuser, autocommit; returns the rows, if any."""
        with psycopg.connect(self.dsn(db), autocommit=True) as c:
            cur = c.execute(query, params)
            return cur.fetchall() if cur.description else None

    def one(self, db, query, params=None):
        return self.sql(db, query, params)[0][0]


def setup(cl, args):
    cl.sql("postgres", "CREATE ROLE app LOGIN")
    for setting, value in (("max_active_per_tenant", LIMIT), ("max_active_per_role", LIMIT),
                           ("max_retained_per_role", 0), ("max_retained_per_tenant", 0),
                           ("allow_transactional", "on")):
        cl.sql("postgres", f"ALTER ROLE app SET quota.{setting} = {value}")
    for db in sorted(set(DB.values())):
        cl.sql("postgres", f"CREATE DATABASE {db} OWNER app")
        if db != DB["plain"]:
            cl.sql(db, "CREATE EXTENSION pg_quota")
        # procrastinate's schema through its own API, as the application's role.
        subprocess.run([sys.executable, os.path.abspath(__file__), "schema"], check=True,
                       env=dict(os.environ, BENCH_QUEUE_DSN=cl.dsn(db, "app")))
        if db in (DB["enqueue"], DB["enqueue-renew"]):
            # The recipe's triggers, which finish a job's ticket in procrastinate's
            # status update (quota.finish_job(), 0.6.0), and (b) renew it in its claim
            # (quota.claim_job()); (b') renews it in the middleware instead.
            cl.sql(db, qa.recipe.FINISH_TRIGGERS)
        if db == DB["enqueue"]:
            cl.sql(db, qa.recipe.claim_trigger(qa.RUN_LEASE))


def uses_quota(variant):
    return variant in ("enqueue", "enqueue-renew", "claim")


def counters(cl, variant, settled=True):
    """The cluster's WAL position, the database's committed transactions, and its ledger
    writer's counters (0 without one). settled: read once the database's other client
    sessions have gone, as a backend adds its transactions to pg_stat_database when it
    exits at the latest. (Read with the workers connected, before processing, their
    start-up transactions are still pending; they count in the phase, a few per worker.)"""
    db = DB[variant]
    deadline = time.monotonic() + 30
    while settled and cl.one(db, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                     "AND backend_type = 'client backend' AND pid <> pg_backend_pid()") > 0:
        if time.monotonic() > deadline:
            raise SystemExit(f"{variant}: sessions of {db} outlived their processes")
        time.sleep(0.05)
    lsn, commits = cl.sql(db, "SELECT pg_current_wal_lsn(), xact_commit FROM pg_stat_database "
                              "WHERE datname = current_database()")[0]
    batches = requests = 0
    if uses_quota(variant):
        row = cl.sql(db, "SELECT batches, requests FROM quota.writer_stats WHERE datname = current_database()")
        if row:
            batches, requests = row[0]
    return lsn, commits, batches, requests


def deltas(cl, variant, before, jobs):
    """Per job, what a phase added to counters(): WAL bytes, transactions, writer
    batches and requests."""
    after = counters(cl, variant)
    wal = cl.one(DB[variant], "SELECT pg_wal_lsn_diff(%s, %s)", (after[0], before[0]))
    return dict(wal=float(wal) / jobs, commits=(after[1] - before[1]) / jobs,
                batches=(after[2] - before[2]) / jobs, requests=(after[3] - before[3]) / jobs)


TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(pid, reaped=False):
    """CPU seconds (user + system) of a live process; with reaped, also those of its
    children that exited and that it waited for. 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()  # from field 3, state
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + (cutime + cstime if reaped else 0)) / TICK


def server_cpu(cl):
    """CPU seconds of the whole cluster so far: the postmaster, its live children
    (backends, the ledger writer, checkpointer, autovacuum, ...) and, through its
    cutime and cstime, every child that exited since it started."""
    with open(os.path.join(cl.data, "postmaster.pid")) as f:
        postmaster = int(f.readline())
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == postmaster:
                total += cpu_of(int(entry))
    return total + cpu_of(postmaster, reaped=True)


def server_cpu_by_kind(cl):
    """CPU seconds so far of the cluster's live processes by kind, from their titles:
    "backends" (client connections), the ledger writer, and the rest by their own
    title (checkpointer, autovacuum worker, ...). Processes that exited are left out
    (the server_cpu total has them)."""
    with open(os.path.join(cl.data, "postmaster.pid")) as f:
        postmaster = int(f.readline())
    kinds = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) != postmaster:
                continue
            title = title.removeprefix("postgres: ")
            if "ledger writer" in title:
                kind = "ledger writer"
            elif "autovacuum worker" in title:
                kind = "autovacuum worker"
            elif any(w in title for w in ("checkpointer", "background writer", "walwriter",
                                          "autovacuum launcher", "logical replication launcher")):
                kind = title.split(" ")[0] if title.split(" ")[0] not in ("autovacuum", "logical", "background") \
                    else " ".join(title.split(" ")[:2])
            else:
                kind = "backends"
            kinds[kind] = kinds.get(kind, 0.0) + cpu_of(int(entry))
    return kinds


def clients_cpu(procs):
    """CPU seconds of the deferrer or worker processes, read while they run."""
    return sum(cpu_of(p.pid) for p in procs)


def spawn(cl, variant, args, logname, *argv, stdin=None, stdout=None):
    log = open(os.path.join(cl.dir, logname), "a")
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *argv], stdin=stdin,
        stdout=stdout if stdout is not None else log, stderr=log, text=True,
        env=dict(os.environ, BENCH_QUEUE_DSN=cl.dsn(DB[variant], "app")))


def enqueue_phase(cl, variant, args, rnd):
    db = DB[variant]
    cl.sql(db, "CHECKPOINT")
    before = counters(cl, variant)
    share = args.jobs // args.procs
    procs = [spawn(cl, variant, args, f"deferrer.{variant}.log", "defer", variant,
                   str(k * share), str(share), str(args.tenants), str(rnd),
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
             for k in range(args.procs)]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            raise SystemExit(f"a deferrer of {variant} did not start (see {cl.dir}/deferrer.{variant}.log)")
    cpu0 = server_cpu(cl), clients_cpu(procs)
    t0 = time.monotonic()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        if p.stdout.readline().strip() != "done":
            raise SystemExit(f"a deferrer of {variant} failed (see {cl.dir}/deferrer.{variant}.log)")
    seconds = time.monotonic() - t0
    cpu1 = server_cpu(cl), clients_cpu(procs)
    for p in procs:
        p.stdin.write("exit\n")
        p.stdin.flush()
    for p in procs:
        p.wait(timeout=30)
    jobs = share * args.procs
    held = cl.one(db, "SELECT count(*) FROM procrastinate_jobs WHERE queue_name = %s", (qa.HOLD,))
    if held != jobs:
        raise SystemExit(f"{variant}: {held} jobs deferred, {jobs} expected")
    return dict(rate=jobs / seconds, server_us=(cpu1[0] - cpu0[0]) / jobs * 1e6,
                client_us=(cpu1[1] - cpu0[1]) / jobs * 1e6, **deltas(cl, variant, before, jobs))


def start_perf(cl, variant):
    """BENCH_QUEUE_PERF=VARIANT: `perf record -a --call-graph dwarf` (PostgreSQL has no
    frame pointers) over that variant's processing
    phases, into OUT/queue/perf.VARIANT.N.data (for `perf report`)."""
    if os.environ.get("BENCH_QUEUE_PERF") != variant:
        return None
    n = len([f for f in os.listdir(cl.dir) if f.startswith(f"perf.{variant}.")])
    return subprocess.Popen(["perf", "record", "-q", "-a", "--call-graph", "dwarf,16384", "-F", "299", "-o",
                             os.path.join(cl.dir, f"perf.{variant}.{n}.data")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_perf(perf):
    if perf is not None:
        perf.send_signal(2)  # SIGINT: perf writes its file and exits
        perf.wait(timeout=60)


def processing_phase(cl, variant, args):
    db = DB[variant]
    jobs = cl.one(db, "SELECT count(*) FROM procrastinate_jobs")
    # The same statistics for every variant when its workers plan procrastinate's
    # fetch: without this, whether autovacuum had analyzed the table after the enqueue
    # decided between a cached generic plan and planning each fetch anew (a custom
    # plan), some 1,000 us of server CPU per job, differently from variant to variant.
    cl.sql(db, "ANALYZE procrastinate_jobs")
    cl.sql(db, "CHECKPOINT")
    procs = [spawn(cl, variant, args, f"worker.{variant}.log", "work", variant, str(args.concurrency))
             for _ in range(args.procs)]
    perf = None
    try:
        deadline = time.monotonic() + 60
        while cl.one(db, "SELECT count(*) FROM procrastinate_workers") < args.procs:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"{variant}: the workers did not start (see {cl.dir}/worker.{variant}.log)")
            time.sleep(0.05)
        before = counters(cl, variant, settled=False)
        with psycopg.connect(cl.dsn(db), autocommit=True) as c:
            cpu0 = server_cpu(cl), clients_cpu(procs)
            kinds0 = server_cpu_by_kind(cl)
            perf = start_perf(cl, variant)
            c.execute("UPDATE procrastinate_jobs SET queue_name = %s WHERE queue_name = %s", (qa.RUN, qa.HOLD))
            released = c.execute("SELECT clock_timestamp()").fetchone()[0]
            # Polled every 0.1 s; the rate itself comes from the events' times.
            deadline = time.monotonic() + 300
            while True:
                done, ended = c.execute(
                    "SELECT count(*) FILTER (WHERE status = 'succeeded'), "
                    "count(*) FILTER (WHERE status NOT IN ('todo', 'doing', 'succeeded')) "
                    "FROM procrastinate_jobs").fetchone()
                if ended:
                    raise SystemExit(f"{variant}: {ended} of {jobs} jobs ended without succeeding "
                                     f"(see {cl.dir}/worker.{variant}.log)")
                if done >= jobs:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"{variant}: {done} of {jobs} jobs done in 300 s")
                time.sleep(0.1)
            cpu1 = server_cpu(cl), clients_cpu(procs)
            kinds1 = server_cpu_by_kind(cl)
            stopping, perf = perf, None
            stop_perf(stopping)
            last = c.execute("SELECT max(at) FROM procrastinate_events WHERE type = 'succeeded'").fetchone()[0]
    finally:
        if perf is not None:  # the phase ended early (a failed job, the timeout)
            try:
                stop_perf(perf)
            except Exception:
                perf.kill()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    by_kind = {k: (kinds1[k] - kinds0.get(k, 0.0)) / jobs * 1e6 for k in kinds1}
    return dict(rate=jobs / (last - released).total_seconds(), server_us=(cpu1[0] - cpu0[0]) / jobs * 1e6,
                client_us=(cpu1[1] - cpu0[1]) / jobs * 1e6, by_kind=by_kind,
                **deltas(cl, variant, before, jobs))


def check(cl, variant, args, rnd):
    """Nothing refused, nothing lost: the run measured admission's cost only."""
    db = DB[variant]
    jobs = args.jobs // args.procs * args.procs
    problems = []
    succeeded, retried = cl.sql(db, "SELECT (SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'), "
                                    "(SELECT count(*) FROM procrastinate_events WHERE type = 'deferred_for_retry')")[0]
    if succeeded != jobs or retried:
        problems.append(f"{succeeded} of {jobs} jobs succeeded, {retried} went back to the queue")
    if uses_quota(variant):
        label = ("pq-run:" if variant == "claim" else "pq:") + f"{rnd}.%"
        tickets, good, active, expired = cl.sql(
            db, "SELECT count(*), count(*) FILTER (WHERE outcome = 'succeeded'), "
                "count(*) FILTER (WHERE ended_at IS NULL), count(*) FILTER (WHERE outcome = 'expired') "
                "FROM quota.ledger WHERE label LIKE %s", (label,))[0]
        if (tickets, good, active, expired) != (jobs, jobs, 0, 0):
            problems.append(f"tickets {tickets}, succeeded {good}, active {active}, expired {expired}; "
                            f"{jobs} tickets, all succeeded, expected")
    if problems:
        raise SystemExit(f"{variant}, round {rnd}: " + "; ".join(problems))


def reset(cl, variant):
    cl.sql(DB[variant], "TRUNCATE procrastinate_events, procrastinate_periodic_defers, procrastinate_jobs, "
                        "procrastinate_workers RESTART IDENTITY")


def fmt(x):
    return f"{x:,.0f}"


def report(args, results, seconds):
    def med(variant, phase, key="rate"):
        return statistics.median(r[key] for r in results[variant][phase])

    lines = ["# A real queue: procrastinate 3.10.0 with and without pg_quota", ""]
    if args.machine:
        lines += [f"Machine: {args.machine}", ""]
    lines += [f"{args.rounds} rounds, variants interleaved (the order turns with the round), medians. "
              f"Each round and variant: {args.procs} deferrer processes (one connection each) defer "
              f"{args.jobs // args.procs * args.procs} jobs that do nothing, over {args.tenants} tenants; "
              f"then {args.procs} worker processes of concurrency {args.concurrency} process them. "
              f"Limits: quota.max_active_per_tenant and _per_role = {LIMIT:,} (nothing refused, "
              f"checked). Run time: {seconds:.0f} s.", ""]
    for phase, what in (("enqueue", "Enqueue: jobs deferred per second"),
                        ("processing", "Processing: jobs completed per second")):
        lines += [f"## {what}", "",
                  "| variant | jobs/s per round | median | vs (a) | CPU us/job: server | clients "
                  "| CPU vs (a) | WAL bytes/job | transactions/job | writer requests/job | writer commits/job |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        base = med("plain", phase)
        base_cpu = med("plain", phase, "server_us") + med("plain", phase, "client_us")
        for v in VARIANTS:
            if not results[v][phase]:
                continue
            m = med(v, phase)
            server, clients = med(v, phase, "server_us"), med(v, phase, "client_us")
            lines.append(f"| {TITLE[v]} | " + ", ".join(fmt(r["rate"]) for r in results[v][phase])
                         + f" | {fmt(m)} | {m / base:.2f}x | {fmt(server)} | {fmt(clients)} | "
                         f"{(server + clients) / base_cpu:.2f}x | {fmt(med(v, phase, 'wal'))} | "
                         f"{med(v, phase, 'commits'):.2f} | {med(v, phase, 'requests'):.2f} | "
                         f"{med(v, phase, 'batches'):.2f} |")
        lines.append("")
    kinds = sorted({k for v in VARIANTS for r in results[v]["processing"] for k in r["by_kind"]})
    lines += ["## Processing: the server's CPU per job by process (live processes), medians", "",
              "| variant | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
    for v in VARIANTS:
        if results[v]["processing"]:
            lines.append(f"| {TITLE[v]} | " + " | ".join(
                fmt(statistics.median(r["by_kind"].get(k, 0.0) for r in results[v]["processing"]))
                for k in kinds) + " |")
    lines.append("")
    lines += ["Per job, medians over the rounds: CPU, user + system microseconds of the whole "
              "cluster (every process of the server, the ledger writer and autovacuum included) and "
              "of the deferrer or worker processes, from /proc, from the go (enqueue) or the move "
              "to \"run\" (processing) to the last job's end; CPU vs (a), server + clients against "
              "(a)'s, a ratio of cost that another load on the machine moves much less than "
              "the rates; WAL bytes, the cluster's WAL during the phase "
              "(autovacuum and the ledger writer's background passes included); transactions, "
              "the database's committed transactions (pg_stat_database.xact_commit: the "
              "deferrers' or workers' sessions, and the harness's progress polls, some 0.02 a "
              "job); writer requests and commits, the database's ledger writer "
              "(quota.writer_stats: starts it answered, batches it committed).", ""]
    return "\n".join(lines)


def main():
    if len(sys.argv) > 1 and sys.argv[1] in ("defer", "work", "schema"):
        cmd, rest = sys.argv[1], sys.argv[2:]
        # The subprocesses of the harness: the app's module reads BENCH_QUEUE_DSN.
        if cmd == "defer":
            variant, first, count, tenants, rnd = rest
            asyncio.run(qa.deferrer(variant, int(first), int(count), int(tenants), rnd))
        elif cmd == "work":
            asyncio.run(qa.worker(rest[0], int(rest[1])))
        else:
            asyncio.run(qa.apply_schema())
        return
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    cl = Cluster(args)
    cl.create()
    try:
        setup(cl, args)
        results = {v: {"enqueue": [], "processing": []} for v in VARIANTS}
        # BENCH_QUEUE_VARIANTS=plain,enqueue runs only those (to profile one; plain
        # must be among them, the ratios are against it).
        only = [v for v in os.environ.get("BENCH_QUEUE_VARIANTS", ",".join(VARIANTS)).split(",") if v]
        if "plain" not in only or any(v not in VARIANTS for v in only):
            raise SystemExit(f"BENCH_QUEUE_VARIANTS: a list of {VARIANTS}, plain among them")
        order = [v for v in VARIANTS if v in only]
        for rnd in range(1, args.rounds + 1):
            k = (rnd - 1) % len(order)
            for v in order[k:] + order[:k]:
                reset(cl, v)
                enq = enqueue_phase(cl, v, args, rnd)
                results[v]["enqueue"].append(enq)
                msg = f"round {rnd}: {v}: enqueue {enq['rate']:.0f} jobs/s"
                if v not in ENQUEUE_ONLY:
                    proc = processing_phase(cl, v, args)
                    results[v]["processing"].append(proc)
                    check(cl, v, args, rnd)
                    msg += f", processing {proc['rate']:.0f} jobs/s"
                print(msg, flush=True)
        text = report(args, results, time.monotonic() - t0)
    finally:
        cl.pg_ctl("stop")
    with open(os.path.join(args.out, "queue.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
