#!/usr/bin/env python3
"""Runs the pg_quota benchmarks with pgbench and writes target/bench/results.md and
target/bench/throughput.svg. Called by scripts/bench, which builds, installs and starts
the server. Standard library only.

Every figure is measured side by side in one run: each round runs every system once
for each configuration, interleaved (A B A B ...), so ratios survive a noisy machine.
Workloads are data (THROUGHPUT, the refusal pair, HISTORY); a new feature adds a
pgbench script under bench/scripts and an entry here, not a new harness. Wake latency
is not a pgbench workload: bench.wake_latency (bench/setup.sql) samples it server-side.
"""
import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import held_snapshot
from pgclient import protocol_script, psql_runner

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")

# The job lifecycles, 16 clients on 16 roles: bare, guarded by B1, by pg_quota.
JOBS = {
    "JOB": "job.sql",
    "JOB1": "job1.sql",
    "JOBQ": "jobq.sql",
}

SYSTEMS = {
    "pg_quota": "pgq.sql",
    "B0": "b0.sql",
    "B1": "b1.sql",
    "B2": "b2.sql",
}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--host", required=True)
    p.add_argument("--port", required=True)
    p.add_argument("--pgbin", required=True)
    p.add_argument("--db", default="bench")
    p.add_argument("--out", required=True)
    p.add_argument("--machine", default="")
    p.add_argument("--only", choices=["jobs"], default=None,
                   help="jobs: only 0.5.0's job-system figures (JOBT, tenants, CALL0)")
    return p.parse_args()


ARGS = parse_args()
QUICK = ARGS.quick
SECONDS = 3 if QUICK else 10
ROUNDS = 1 if QUICK else 3
CLIENTS = [1, 16] if QUICK else [1, 4, 16, 64]
HISTORY = [0, 1000, 10000]
# Idempotent repeats: clients on bench_idem, whose limit in bench/setup.sql is this.
IDEM_CLIENTS = 16
# Wake-latency samples per way of freeing the slot, spread over the rounds.
WAKE_SAMPLES = 40 if QUICK else 200
WAKE_LEASE = "250 ms"
# Databases beyond the worker slots (max_worker_processes = 8, the logical replication
# launcher holds one): one client per database, each database its own writer.
DATABASES = [7, 24] if QUICK else [7, 24, 100]
# Tenants beyond the scope counters: this many roles in database bench_roles, each
# holding one ticket; quota.scope_counters keeps its default (65,536), so not every
# role fits. MANY_ROLES_AT are the roles whose start() is timed, interleaved.
MANY_ROLES = 100_000
MANY_ROLES_DB = "bench_roles"
MANY_ROLES_AT = [1, MANY_ROLES // 2, MANY_ROLES]


psql = psql_runner(ARGS.pgbin, ARGS.host, ARGS.port, ARGS.db)


def read_latencies(logdir, tag):
    """The per-transaction latencies (us) of pgbench's logs for `tag`, which it removes."""
    lat = []
    for name in os.listdir(logdir):
        if name.startswith(tag + "."):
            with open(os.path.join(logdir, name)) as f:
                for line in f:
                    cols = line.split()
                    if len(cols) >= 3 and cols[2].isdigit():
                        lat.append(int(cols[2]))
            os.remove(os.path.join(logdir, name))
    return lat


def pgbench(script, user, clients, seconds, logdir, tag, per_statement=False, db=None,
            protocol="simple", defines=()):
    """One pgbench process. Returns (transactions, failed, latencies_us, stmt_lat_ms)."""
    prefix = os.path.join(logdir, tag)
    cmd = [os.path.join(ARGS.pgbin, "pgbench"), "-n", "-h", ARGS.host, "-p", ARGS.port,
           "-U", user, "-c", str(clients), "-j", str(min(clients, 4)), "-T", str(seconds),
           "-M", protocol, "-f", os.path.join(SCRIPTS, script), "-l", "--log-prefix", prefix]
    for d in defines:
        cmd += ["-D", d]
    if per_statement:
        cmd.append("-r")
    cmd.append(db or ARGS.db)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stdout + res.stderr)
        raise SystemExit(f"pgbench failed: {' '.join(cmd)}")
    lat = read_latencies(logdir, tag)
    m = re.search(r"number of transactions actually processed: (\d+)", res.stdout)
    failed = re.search(r"number of failed transactions: (\d+)", res.stdout)
    stmt = {}
    if per_statement:
        for line in res.stdout.splitlines():
            mm = re.match(r"^\s+([\d.]+)\s+\d+\s+(\S.*)$", line)
            if mm:
                stmt[mm.group(2).strip()] = float(mm.group(1))
    return int(m.group(1)) if m else 0, int(failed.group(1)) if failed else 0, lat, stmt


def ensure_databases(n):
    """Databases bench_db_1 .. bench_db_N with pg_quota, and the role bench_dbs."""
    have = set(psql("SELECT datname FROM pg_database WHERE datname LIKE 'bench\\_db\\_%'").split())
    for i in range(1, n + 1):
        name = f"bench_db_{i}"
        if name not in have:
            psql(f"CREATE DATABASE {name}")
            psql("CREATE EXTENSION pg_quota", db=name)


def run_databases(n, logdir, tag):
    """n pgbench processes, one client each, each in its own database. Unlike `run`, a
    client that fails (53000) is counted, not fatal."""
    def one(i):
        prefix = os.path.join(logdir, f"{tag}-{i}")
        cmd = [os.path.join(ARGS.pgbin, "pgbench"), "-n", "-h", ARGS.host, "-p", ARGS.port,
               "-U", "bench_dbs", "-c", "1", "-T", str(SECONDS), "-f", os.path.join(SCRIPTS, "dbs.sql"),
               "-l", "--log-prefix", prefix, f"bench_db_{i}"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        m = re.search(r"number of transactions actually processed: (\d+)", res.stdout)
        return int(m.group(1)) if m else 0, res.returncode != 0, read_latencies(logdir, f"{tag}-{i}")
    with ThreadPoolExecutor(max_workers=n) as ex:
        results = list(ex.map(one, range(1, n + 1)))
    return {"tps": sum(r[0] for r in results) / SECONDS,
            "served": sum(1 for r in results if r[0] > 0),
            "failed": sum(1 for r in results if r[1]),
            "lat": sorted(x for r in results for x in r[2])}


def run(system_script, clients, mode, logdir, tag, role="bench_r1", per_statement=False, db=None,
        protocol="simple", defines=()):
    """mode 'roles': one pgbench process per role, one client each; 'one': all on `role`."""
    t0 = time.time()
    if mode == "roles":
        with ThreadPoolExecutor(max_workers=clients) as ex:
            futs = [ex.submit(pgbench, system_script, f"bench_r{i + 1}", 1, SECONDS, logdir,
                              f"{tag}-{i + 1}", False, None, protocol) for i in range(clients)]
            results = [f.result() for f in futs]
    else:
        results = [pgbench(system_script, role, clients, SECONDS, logdir, tag, per_statement, db,
                           protocol, defines)]
    elapsed = max(SECONDS, time.time() - t0 - 0.5)
    tx = sum(r[0] for r in results)
    lat = sorted(x for r in results for x in r[2])
    stmt = results[0][3] if results else {}
    return {"tps": tx / SECONDS if tx else 0.0, "lat": lat, "stmt": stmt,
            "failed": sum(r[1] for r in results), "elapsed": elapsed}


def pct(lat, p):
    if not lat:
        return float("nan")
    return lat[min(len(lat) - 1, int(len(lat) * p))] / 1000.0


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def ledger_tables():
    """quota.active and quota.history (0.6.0), or the one table quota.ledger before."""
    split = psql("SELECT to_regclass('quota.history') IS NOT NULL") == "t"
    return ["quota.active", "quota.history"] if split else ["quota.ledger"]


def prefill_history(n):
    tables = ledger_tables()
    deletes = "".join(f"DELETE FROM {t} WHERE role = 'bench_history'::regrole;\n" for t in tables)
    psql(f"""
      {deletes}
      DELETE FROM quota.summary WHERE role = 'bench_history'::regrole;
      INSERT INTO {tables[-1]} (id, role, label, started_at, ended_at, outcome)
        SELECT gen_random_uuid(), 'bench_history'::regrole, 'history',
               now() - interval '2 hours', now() - interval '1 hour', 'succeeded'
          FROM generate_series(1, {n});
      INSERT INTO quota.summary VALUES ('bench_history'::regrole, {n});""")
    psql("VACUUM ANALYZE " + ", ".join(tables))


def HeldSnapshot(db=None):
    """An old snapshot held open in db (bench/held_snapshot.py)."""
    return held_snapshot.HeldSnapshot(ARGS.pgbin, ARGS.host, ARGS.port, db or ARGS.db, psql)


def ensure_many_roles():
    """Database bench_roles with MANY_ROLES roles bench_many_N, each with a setting of
    its own and holding one ticket (started by four sessions at once, each walking its
    share of the roles with SET ROLE). Returns the seconds it took."""
    t0 = time.time()
    if not psql(f"SELECT 1 FROM pg_database WHERE datname = '{MANY_ROLES_DB}'"):
        psql(f"CREATE DATABASE {MANY_ROLES_DB}")
        for sql in ("CREATE EXTENSION pg_quota",
                    f"ALTER DATABASE {MANY_ROLES_DB} SET quota.max_active_per_role = 1000",
                    f"ALTER DATABASE {MANY_ROLES_DB} SET quota.max_retained_per_role = 0"):
            psql(sql, db=MANY_ROLES_DB)
    # Each role gets a setting of its own, as a DBA gives per-role limits, so that
    # pg_db_role_setting holds 100,000 rows (the writer reads the batch's roles' there).
    psql(f"DO $$ BEGIN FOR i IN 1..{MANY_ROLES} LOOP "
         "IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'bench_many_' || i) THEN "
         "EXECUTE format('CREATE ROLE bench_many_%s LOGIN', i); "
         "EXECUTE format('ALTER ROLE bench_many_%s SET quota.max_active_per_role = 1000', i); END IF; "
         "IF i % 5000 = 0 THEN COMMIT; END IF; END LOOP; END $$")
    parts = 4
    def charge(k):
        lo, hi = k * MANY_ROLES // parts + 1, (k + 1) * MANY_ROLES // parts
        psql(f"DO $$ BEGIN FOR i IN {lo}..{hi} LOOP "
             "IF NOT EXISTS (SELECT FROM quota.ledger WHERE role = ('bench_many_' || i)::regrole) THEN "
             "EXECUTE format('SET ROLE bench_many_%s', i); PERFORM quota.start('held'); RESET ROLE; "
             "END IF; END LOOP; END $$", db=MANY_ROLES_DB)
    with ThreadPoolExecutor(max_workers=parts) as ex:
        list(ex.map(charge, range(parts)))
    held = psql("SELECT count(DISTINCT role) FROM quota.ledger WHERE ended_at IS NULL", db=MANY_ROLES_DB)
    if int(held) < MANY_ROLES:
        raise SystemExit(f"only {held} of {MANY_ROLES} roles hold a ticket in {MANY_ROLES_DB}")
    return time.time() - t0


def many_roles_round(logdir, rnd):
    """start() latency (ms, pgbench per statement) of each role of MANY_ROLES_AT, with an
    old snapshot held: first each role churns through tickets for the same time behind
    it, then each is timed, in an order that turns with the round."""
    out = {}
    with HeldSnapshot(MANY_ROLES_DB):
        for n in MANY_ROLES_AT:
            run("pgq.sql", 1, "one", logdir, f"roles-churn-{n}", role=f"bench_many_{n}", db=MANY_ROLES_DB)
        order = MANY_ROLES_AT[rnd % len(MANY_ROLES_AT):] + MANY_ROLES_AT[:rnd % len(MANY_ROLES_AT)]
        for n in order:
            r = run("pgq.sql", 1, "one", logdir, f"roles-{n}", role=f"bench_many_{n}",
                    per_statement=True, db=MANY_ROLES_DB)
            out[n] = next((v for k, v in r["stmt"].items() if "quota.start" in k), float("nan"))
        # Many tenants at once, 16 clients: each transaction a tenant drawn from all
        # of them (more than there are counters) or from the first 1,000 (which fit).
        for name in (["spread", "hot"] if rnd % 2 == 0 else ["hot", "spread"]):
            out[name] = run(f"roles_{name}.sql", 16, "one", logdir, f"roles-{name}",
                            role="postgres", db=MANY_ROLES_DB)["tps"]
    return out


def ledger_rows(role):
    return int(psql(f"SELECT count(*) FROM quota.ledger WHERE role = '{role}'::regrole"))


def start_idempotency_keys():
    """Starts the ticket of each idempotent client's key ('k' || pgbench's client_id)."""
    psql(f"SELECT quota.start(idempotency_key => 'k' || i) FROM generate_series(0, {IDEM_CLIENTS - 1}) i",
         user="bench_idem")


def wake_latency(samples, how):
    """Samples of bench.wake_latency (bench/setup.sql), as (wake, commit) in µs like
    pgbench's latencies; wake is None where the waiter did not wait in time."""
    out = psql(f"SELECT wake_ms, commit_ms FROM bench.wake_latency({samples}, '{how}', '{WAKE_LEASE}')")
    def us(v):
        return round(float(v) * 1000) if v else None
    return [tuple(us(v) for v in line.split("|")) for line in out.splitlines()]


def wal_lsn():
    return psql("SELECT pg_current_wal_insert_lsn()")


def wal_bytes(a, b):
    return int(psql(f"SELECT pg_wal_lsn_diff('{b}', '{a}')::bigint"))


# 0.5.0: the job lifecycles and the refusal floor, under both protocols (drivers such
# as pgx, JDBC and asyncpg prepare). JOBT-tenants runs 16 clients on ONE role.
JOBS5 = [("JOB", "job.sql", "roles", None), ("JOB1", "job1.sql", "roles", None),
         ("JOBQ", "jobq.sql", "roles", None), ("JOBT", "jobt.sql", "roles", None),
         ("JOBT0", "jobt0.sql", "roles", None),
         ("JOBT-tenants", "jobt_tenants.sql", "one", "bench_tenants"),
         ("start+finish", "pgq.sql", "roles", None), ("B2", "b2.sql", "roles", None)]
CALLS5 = [("refuse", "refuse.sql", "bench_refused"),
          ("refuse-tenant", "refuse_tenant.sql", "bench_tenant_refused"),
          ("CALL0", "call0.sql", "bench_refused"), ("select1", "select1.sql", "bench_refused")]
PROTOCOLS = ["simple", "prepared"]
MANY_TENANTS = 100_000
MANY_TENANTS_AT = [1, MANY_TENANTS]


def ensure_many_tenants():
    """MANY_TENANTS tenants of bench_many_tenants, each holding one transactional
    ticket (a commit per 1,000). Returns the seconds it took."""
    t0 = time.time()
    have = int(psql("SELECT count(*) FROM quota.ledger WHERE role = 'bench_many_tenants'::regrole"))
    if have < MANY_TENANTS:
        psql("SELECT count(quota.finish(id)) FROM quota.ledger WHERE role = 'bench_many_tenants'::regrole")
        parts = 4

        def fill(k):
            lo, hi = k * MANY_TENANTS // parts + 1, (k + 1) * MANY_TENANTS // parts
            psql(f"DO $$ BEGIN FOR i IN {lo}..{hi} LOOP "
                 "PERFORM quota.start('held', tenant => 't' || i, transactional => true); "
                 "IF i % 1000 = 0 THEN COMMIT; END IF; END LOOP; END $$",
                 user="bench_many_tenants")
        with ThreadPoolExecutor(max_workers=parts) as ex:
            list(ex.map(fill, range(parts)))
    return time.time() - t0


def jobs_round(logdir, rnd, figures):
    """One round of 0.5.0's figures into `figures`: (name, protocol) -> list of runs,
    and ("wal", name) -> bytes per call, and ("tenant", n) -> start() ms."""
    for protocol in (PROTOCOLS if rnd % 2 == 0 else PROTOCOLS[::-1]):
        for name, script, mode, role in JOBS5:
            r = run(protocol_script(SCRIPTS, script, protocol), 16, mode, logdir, f"j5-{name}-{protocol}",
                    role=role or "bench_r1", protocol=protocol)
            figures.setdefault((name, protocol), []).append(r)
            print(f"  {name:13} {protocol:8} 16 clients: {r['tps']:9.1f} jobs/s", flush=True)
        for name, script, role in CALLS5:
            a = wal_lsn()
            r = run(script, 16, "one", logdir, f"j5-{name}-{protocol}", role=role, protocol=protocol)
            b = wal_lsn()
            figures.setdefault((name, protocol), []).append(r)
            if name.startswith("refuse"):
                figures.setdefault(("wal", name), []).append(wal_bytes(a, b) / max(1.0, r["tps"] * SECONDS))
            print(f"  {name:13} {protocol:8} 16 clients: {r['tps']:9.1f} calls/s", flush=True)
    # Tenant #1 against tenant #100,000 of one role, an old snapshot held: each churns
    # through tickets first, leaving dead versions behind the snapshot, then is timed.
    with HeldSnapshot():
        for n in MANY_TENANTS_AT:
            run("tenants_hot.sql", 1, "one", logdir, f"j5-churn-{n}", role="bench_many_tenants",
                defines=[f"n={n}"])
        order = MANY_TENANTS_AT if rnd % 2 == 0 else MANY_TENANTS_AT[::-1]
        for n in order:
            r = run("tenants_hot.sql", 1, "one", logdir, f"j5-tenant-{n}", role="bench_many_tenants",
                    per_statement=True, defines=[f"n={n}"])
            ms = next((v for k, v in r["stmt"].items() if "quota" in k), float("nan"))
            figures.setdefault(("tenant", n), []).append(ms)
            print(f"  start()+finish() of tenant #{n:,} (old snapshot held): {ms:.3f} ms", flush=True)


def write_jobs_report(figures, lines):
    """0.5.0's section of the report; returns its targets."""
    add = lines.append

    def t(name, protocol):
        return median([r["tps"] for r in figures.get((name, protocol), [])])

    def ratio(a, b):
        return a / b if b else float("nan")
    add("## 0.5.0: job systems")
    add("")
    add("16 clients. JOB, JOB1, JOBQ, JOBT, start+finish (pgq.sql) and B2 on 16 roles (a role each); JOBT-tenants on one "
        "role, each job for a tenant drawn from 1,000 (quota.max_active_per_tenant = 100). JOBT "
        "is JOBQ with `transactional => true`: the charge commits with the job's row. Refusals "
        "on one role at its limit (a tenant at its limit for refuse-tenant); CALL0 is a C "
        "function with start()'s signature that does nothing (bench/call0). JOBT0 is JOBT "
        "with CALL0 and a FINISH0 in place of start() and finish(): JOBT's SQL without "
        "pg_quota's work, the most any ledger could reach.")
    add("")
    add("| workload | simple /s | prepared /s | vs JOB (simple) | vs JOB (prepared) |")
    add("|---|---:|---:|---:|---:|")
    for name, _, _, _ in JOBS5:
        add(f"| {name} | {t(name, 'simple'):.0f} | {t(name, 'prepared'):.0f} | "
            f"{ratio(t(name, 'simple'), t('JOB', 'simple')):.2f}x | "
            f"{ratio(t(name, 'prepared'), t('JOB', 'prepared')):.2f}x |")
    add("")
    add("| call (16 clients) | simple /s | prepared /s | vs CALL0 (simple) | vs CALL0 (prepared) |")
    add("|---|---:|---:|---:|---:|")
    for name, _, _ in CALLS5:
        add(f"| {name} | {t(name, 'simple'):.0f} | {t(name, 'prepared'):.0f} | "
            f"{ratio(t(name, 'simple'), t('CALL0', 'simple')):.2f}x | "
            f"{ratio(t(name, 'prepared'), t('CALL0', 'prepared')):.2f}x |")
    add("")
    wal = {n: median(figures.get(("wal", n), [])) for n in ("refuse", "refuse-tenant")}
    add(f"WAL per refusal: {wal['refuse']:.4f} bytes (role), {wal['refuse-tenant']:.4f} bytes (tenant).")
    add("")
    first, last = (median(figures.get(("tenant", n), [])) for n in MANY_TENANTS_AT)
    add(f"start()+finish() of tenant #{MANY_TENANTS_AT[-1]:,} of one role: {last:.3f} ms, of tenant #1: "
        f"{first:.3f} ms ({ratio(last, first):.2f}x), a REPEATABLE READ snapshot held, each "
        f"tenant of {MANY_TENANTS:,} holding a ticket, after each churned for the same time.")
    add("")
    targets = []
    for p in PROTOCOLS:
        targets += [
            (f"0.5.0 ({p}): JOBT vs JOB", ratio(t("JOBT", p), t("JOB", p)), ">=", 0.8),
            (f"0.5.0 ({p}): JOBT vs JOB1", ratio(t("JOBT", p), t("JOB1", p)), ">=", 1.2),
            (f"0.5.0 ({p}): JOBT-tenants vs JOBT", ratio(t("JOBT-tenants", p), t("JOBT", p)), ">=", 0.9),
            (f"0.5.0 ({p}): refusals vs CALL0", ratio(t("refuse", p), t("CALL0", p)), ">=", 0.9),
            (f"0.5.0 ({p}): tenant refusals vs CALL0", ratio(t("refuse-tenant", p), t("CALL0", p)), ">=", 0.9),
            (f"0.5.0 ({p}): JOBQ vs JOB (writer path kept)", ratio(t("JOBQ", p), t("JOB", p)), ">=", 0.55),
            (f"0.5.0 ({p}): start+finish vs B2 (writer path kept)",
             ratio(t("start+finish", p), t("B2", p)), ">=", 1.35),
            (f"0.6.0 ({p}): JOBT vs JOB", ratio(t("JOBT", p), t("JOB", p)), ">=", 0.85),
            (f"0.6.0 ({p}): JOBT vs JOB1", ratio(t("JOBT", p), t("JOB1", p)), ">=", 1.3),
        ]
    targets += [
        ("0.5.0: WAL bytes per refusal (role)", wal["refuse"], "<", 1.0),
        ("0.5.0: WAL bytes per refusal (tenant)", wal["refuse-tenant"], "<", 1.0),
        (f"0.5.0: tenant #{MANY_TENANTS:,} vs #1, old snapshot held", ratio(last, first), "<=", 1.25),
    ]
    return targets


def targets_table(lines, targets):
    add = lines.append
    add("## Targets")
    add("")
    add("| figure | measured | target | |")
    add("|---|---:|---|---|")
    for name, val, op, goal in targets:
        met = {">=": val >= goal, "<=": val <= goal, "<": val < goal}[op]
        add(f"| {name} | {val:.2f} | {op} {goal} | {'met' if met else 'MISSED'} |")
        print(f"target: {name}: {val:.2f} ({op} {goal}) {'met' if met else 'MISSED'}")


def main_jobs():
    """`--only jobs`: 0.5.0's figures alone."""
    os.makedirs(ARGS.out, exist_ok=True)
    logdir = tempfile.mkdtemp(prefix="pgbench-logs-", dir=ARGS.out)
    print(f"{MANY_TENANTS} tenants holding a ticket each: {ensure_many_tenants():.0f} s", flush=True)
    figures = {}
    for rnd in range(ROUNDS):
        print(f"round {rnd + 1} of {ROUNDS}", flush=True)
        jobs_round(logdir, rnd, figures)
    lines = [f"# pg_quota benchmark results: 0.5.0's figures ({'quick' if QUICK else 'full'} run)", "",
             f"{ROUNDS} round(s) of {SECONDS} s per figure, interleaved; medians of the rounds.", ""]
    if ARGS.machine:
        lines += [f"Machine: {ARGS.machine}", ""]
    targets = write_jobs_report(figures, lines)
    targets_table(lines, targets)
    report = "\n".join(lines) + "\n"
    with open(os.path.join(ARGS.out, "results-jobs.md"), "w") as f:
        f.write(report)
    print(report)
    shutil.rmtree(logdir, ignore_errors=True)


def main():
    if ARGS.only == "jobs":
        return main_jobs()
    os.makedirs(ARGS.out, exist_ok=True)
    logdir = tempfile.mkdtemp(prefix="pgbench-logs-", dir=ARGS.out)
    through = {}   # (system, mode, clients) -> list of runs
    refusal = {"refuse": [], "select1": [], "wal": [], "count": []}
    history = {n: [] for n in HISTORY}
    # (workload, held) -> list of runs: admission with an old snapshot open vs none.
    snapshot = {}
    idem = {"runs": [], "wal": [], "rows": []}
    wake = {"finish": [], "lease": []}   # (wake_us, commit_us) samples
    lifecycle = []   # runs of bench/scripts/lifecycle.sql, 16 clients on 16 roles
    jobs = {name: [] for name in JOBS}   # runs of bench/scripts/job*.sql, 16 on 16 roles
    dbs = {n: [] for n in DATABASES}   # runs of bench/scripts/dbs.sql, a client per database
    # start() ms of role bench_many_N per round, and tx/s of the "spread" and "hot" runs
    roles = {n: [] for n in MANY_ROLES_AT + ["spread", "hot"]}
    jobs5 = {}   # 0.5.0's figures (jobs_round)
    start_idempotency_keys()
    ensure_databases(max(DATABASES))
    print(f"{MANY_ROLES} roles holding a ticket each in {MANY_ROLES_DB}: "
          f"{ensure_many_roles():.0f} s", flush=True)
    print(f"{MANY_TENANTS} tenants holding a ticket each: {ensure_many_tenants():.0f} s", flush=True)

    for rnd in range(ROUNDS):
        print(f"round {rnd + 1} of {ROUNDS}", flush=True)
        for clients in CLIENTS:
            for mode in ("roles", "one"):
                for system, script in SYSTEMS.items():
                    r = run(script, clients, mode, logdir, f"{system}-{mode}-{clients}")
                    through.setdefault((system, mode, clients), []).append(r)
                    print(f"  {system:8} {clients:3} clients, {'one role' if mode == 'one' else 'a role each'}:"
                          f" {r['tps']:9.1f} tx/s", flush=True)
        # A job's whole life (start with lease and key, renew, finish), 16 clients on
        # 16 roles, against start+finish above.
        r = run("lifecycle.sql", 16, "roles", logdir, "lifecycle")
        lifecycle.append(r)
        print(f"  lifecycle 16 clients, a role each: {r['tps']:9.1f} jobs/s", flush=True)
        # A job in an application's queue table, bare (JOB), guarded by B1 (JOB1) and
        # by pg_quota (JOBQ), interleaved.
        for name, script in JOBS.items():
            r = run(script, 16, "roles", logdir, name)
            jobs[name].append(r)
            print(f"  {name:8} 16 clients, a role each: {r['tps']:9.1f} jobs/s", flush=True)
        # Databases beyond the worker slots: 7 fit, the others share the slots in turn.
        for n in DATABASES:
            r = run_databases(n, logdir, f"dbs-{n}")
            dbs[n].append(r)
            print(f"  {n:3} databases, a client each: {r['tps']:9.1f} tx/s, {r['served']} served,"
                  f" {r['failed']} clients failed", flush=True)
        # Tenants beyond the scope counters, with an old snapshot held.
        for n, ms in many_roles_round(logdir, rnd).items():
            roles[n].append(ms)
        print("  start() of role #" + ", #".join(f"{n}: {roles[n][-1]:.3f} ms" for n in MANY_ROLES_AT)
              + f"; 16 clients on random tenants of all: {roles['spread'][-1]:.0f} tx/s, "
              f"of the first 1,000: {roles['hot'][-1]:.0f} tx/s", flush=True)
        # The refusal path against SELECT 1 under the same load.
        for name, script in (("refuse", "refuse.sql"), ("select1", "select1.sql")):
            a = wal_lsn()
            r = run(script, 16, "one", logdir, name, role="bench_refused")
            b = wal_lsn()
            refusal[name].append(r)
            if name == "refuse":
                refusal["wal"].append(wal_bytes(a, b))
                refusal["count"].append(r["tps"] * SECONDS)
            print(f"  {name:8} 16 clients: {r['tps']:9.1f} calls/s", flush=True)
        # Start+finish and refusals with an old snapshot held open for the whole run,
        # against none, interleaved. Each side uses roles of its own, so that the dead
        # versions one run leaves behind do not slow the next. The refused role first
        # churns through tickets (as the cycle role does), then holds its limit of 2,
        # so that its refusals meet the dead versions an old snapshot keeps.
        for held in (False, True):
            cyc, ref = f"bench_snap_cycle_{rnd}_{int(held)}", f"bench_snap_refused_{rnd}_{int(held)}"
            ctx = HeldSnapshot() if held else contextlib.nullcontext()
            with ctx:
                r = run("pgq.sql", 16, "one", logdir, f"snap-cycle-{held}", role=cyc)
                snapshot.setdefault(("cycle", held), []).append(r)
                run("pgq.sql", 1, "one", logdir, f"snap-churn-{held}", role=ref)
                psql("SELECT quota.start('held'), quota.start('held')", user=ref)
                r2 = run("refuse.sql", 16, "one", logdir, f"snap-refuse-{held}", role=ref)
                snapshot.setdefault(("refuse", held), []).append(r2)
            side = "old snapshot held" if held else "no old snapshot"
            print(f"  cycle    16 clients, {side}: {r['tps']:9.1f} /s; refusals: {r2['tps']:9.1f} /s",
                  flush=True)
        # start() latency against the role's history.
        for n in HISTORY:
            prefill_history(n)
            r = run("pgq.sql", 1, "one", logdir, f"history-{n}", role="bench_history", per_statement=True)
            start_ms = next((v for k, v in r["stmt"].items() if "quota.start" in k), float("nan"))
            history[n].append(start_ms)
            print(f"  start() with {n:5} retained: {start_ms:.3f} ms", flush=True)
        # Idempotent repeats, each returning a ticket its key holds already, against
        # start+finish at the same client count above. The role's ledger rows are
        # counted on both sides: a repeat charges nothing.
        a, rows = wal_lsn(), ledger_rows("bench_idem")
        r = run("idem.sql", IDEM_CLIENTS, "one", logdir, "idem", role="bench_idem")
        idem["wal"].append(wal_bytes(a, wal_lsn()))
        idem["rows"].append((rows, ledger_rows("bench_idem")))
        idem["runs"].append(r)
        print(f"  idempotent repeats {IDEM_CLIENTS} clients: {r['tps']:9.1f} calls/s;"
              f" ledger rows {rows} -> {idem['rows'][-1][1]}", flush=True)
        # 0.5.0: the job lifecycles with transactional starts and tenants, under both
        # protocols, the refusal floor (CALL0), and tenant #100,000.
        jobs_round(logdir, rnd, jobs5)
        # How soon a waiting start() gets a slot that a finish() or a lease frees.
        for how in wake:
            got = wake_latency(max(1, WAKE_SAMPLES // ROUNDS), how)
            wake[how] += got
            p50 = pct(sorted(w for w, _ in got if w is not None), 0.5)
            print(f"  wake after {how:6}: {len(got)} samples, p50 {p50:.2f} ms", flush=True)

    write_report(through, refusal, history, snapshot, idem, wake, lifecycle, jobs, dbs, roles, jobs5)

    shutil.rmtree(logdir, ignore_errors=True)


def tps(through, system, mode, clients):
    return median([r["tps"] for r in through.get((system, mode, clients), [])])


def lat_pcts(through, system, mode, clients):
    lat = sorted(x for r in through.get((system, mode, clients), []) for x in r["lat"])
    return pct(lat, 0.5), pct(lat, 0.99)


def write_report(through, refusal, history, snapshot, idem, wake, lifecycle, jobs, dbs, roles, jobs5):
    lines = []
    add = lines.append
    add(f"# pg_quota benchmark results ({'quick' if QUICK else 'full'} run)")
    add("")
    add(f"{ROUNDS} round(s) of {SECONDS} s per figure, interleaved; medians of the rounds. "
        "fsync and synchronous_commit on (PostgreSQL's defaults).")
    if ARGS.machine:
        add("")
        add(f"Machine: {ARGS.machine}")
    add("")
    add("## start + finish throughput")
    add("")
    add("One pg_quota transaction is `start()` then `finish()`, each in its own transaction; "
        "B1 and B2 do the same with their functions; B0 is one INSERT.")
    add("")
    add("| clients | roles | system | tx/s | p50 ms | p99 ms | vs B0 | vs B1 | vs B2 |")
    add("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for clients in CLIENTS:
        for mode in ("roles", "one"):
            base = {s: tps(through, s, mode, clients) for s in SYSTEMS}
            for system in SYSTEMS:
                p50, p99 = lat_pcts(through, system, mode, clients)
                t = base[system]
                ratios = [f"{t / base[b]:.2f}x" if base[b] else "-" for b in ("B0", "B1", "B2")]
                add(f"| {clients} | {'one each' if mode == 'roles' else 'all on one'} | {system} | {t:.0f} | "
                    f"{p50:.2f} | {p99:.2f} | " + " | ".join(ratios) + " |")
    add("")

    ref = median([r["tps"] for r in refusal["refuse"]])
    sel = median([r["tps"] for r in refusal["select1"]])
    wal_per = sum(refusal["wal"]) / max(1.0, sum(refusal["count"]))
    add("## Refusals")
    add("")
    add("| workload (16 clients, one role at its limit) | calls/s | p50 ms | p99 ms |")
    add("|---|---:|---:|---:|")
    for name, label in (("refuse", "`quota.try_start()` refused"), ("select1", "`SELECT 1`")):
        lat = sorted(x for r in refusal[name] for x in r["lat"])
        add(f"| {label} | {median([r['tps'] for r in refusal[name]]):.0f} | {pct(lat, .5):.2f} | {pct(lat, .99):.2f} |")
    add("")
    add(f"WAL written during the refusal runs: {sum(refusal['wal'])} bytes for "
        f"{sum(refusal['count']):.0f} refusals ({wal_per:.4f} bytes per refusal).")
    add("")
    life = median([r["tps"] for r in lifecycle])
    c16 = 16 if 16 in CLIENTS else CLIENTS[-1]
    add("## Job lifecycle")
    add("")
    add("16 clients on 16 roles, each job `start(label, lease, idempotency_key)`, `renew()`, "
        "`finish()`, each in its own transaction (bench/scripts/lifecycle.sql).")
    add("")
    lat = sorted(x for r in lifecycle for x in r["lat"])
    add(f"| jobs/s | p50 ms | p99 ms | vs start+finish ({c16} on {c16} roles) |")
    add("|---:|---:|---:|---:|")
    sf = tps(through, "pg_quota", "roles", c16)
    add(f"| {life:.0f} | {pct(lat, .5):.2f} | {pct(lat, .99):.2f} | {life / sf if sf else float('nan'):.2f}x |")
    add("")

    add("## Job lifecycle in a queue table")
    add("")
    add("16 clients on 16 roles. JOB is a job's bare life in an application's queue table: "
        "the enqueue INSERT, then the completion UPDATE, each in its own transaction. JOB1 "
        "puts B1's start in the INSERT and its finish in the UPDATE; JOBQ does the same with "
        "`quota.start()` and `quota.finish()` (bench/scripts/job*.sql).")
    add("")
    add("| workload | jobs/s | p50 ms | p99 ms | vs JOB |")
    add("|---|---:|---:|---:|---:|")
    job_tps = {name: median([r["tps"] for r in runs]) for name, runs in jobs.items()}
    for name in JOBS:
        lat = sorted(x for r in jobs[name] for x in r["lat"])
        add(f"| {name} | {job_tps[name]:.0f} | {pct(lat, .5):.2f} | {pct(lat, .99):.2f} | "
            f"{job_tps[name] / job_tps['JOB'] if job_tps['JOB'] else float('nan'):.2f}x |")
    add("")

    add("## start() latency against the role's history")
    add("")
    add("| retained tickets | start() ms (mean per round) |")
    add("|---:|---:|")
    for n in HISTORY:
        add(f"| {n} | " + ", ".join(f"{x:.3f}" for x in history[n]) + " |")
    add("")

    def snap_tps(name, held):
        return median([r["tps"] for r in snapshot.get((name, held), [])])
    add("## With an old snapshot held open")
    add("")
    add("16 clients on one role; a REPEATABLE READ session holds its snapshot for the whole "
        "run, as pg_dump does. Each run uses roles of its own. The refused role first cycles "
        "through tickets with one client for the same time, then holds its limit of 2.")
    add("")
    add("| workload | none /s | snapshot held /s | ratio |")
    add("|---|---:|---:|---:|")
    for name, label in (("cycle", "start + finish"), ("refuse", "`try_start()` refused")):
        a, b = snap_tps(name, False), snap_tps(name, True)
        add(f"| {label} | {a:.0f} | {b:.0f} | {b / a if a else float('nan'):.2f}x |")
    add("")

    add("## Wake latency")
    add("")
    add("bench_wake may hold one ticket. One session holds it; another calls "
        "`quota.start(wait => '30 s')`. Once the waiter sleeps in line (pg_stat_activity "
        "shows it active with wait event type Extension), the holder runs `BEGIN; SELECT "
        "quota.finish(t); COMMIT`, and the latency runs from just before the COMMIT to the "
        "waiter's `start()` returning. In the lease case the holder's ticket was started with "
        f"`lease => '{WAKE_LEASE}'` and nobody finishes it; the latency runs from its "
        "lease_until. Both ends are `clock_timestamp()` on the server, the waiter's read right "
        "after its `start()` returned (both sessions driven through dblink by "
        "`bench.wake_latency` in bench/setup.sql). The figures include the waiter's admission "
        "and the writer's commit of its ticket. A waiter left to its 200 ms poll would show "
        "tens to 200 ms. The samples are split evenly over the rounds and pooled.")
    add("")
    add("| slot freed by | samples | p50 ms | p90 ms | p99 ms | max ms |")
    add("|---|---:|---:|---:|---:|---:|")
    for how, label in (("finish", "`finish()` committed (from before COMMIT)"),
                       ("lease", "the holder's lease ran out (from lease_until)")):
        lat = sorted(w for w, _ in wake[how] if w is not None)
        add(f"| {label} | {len(lat)} | {pct(lat, .5):.2f} | {pct(lat, .9):.2f} | "
            f"{pct(lat, .99):.2f} | {lat[-1] / 1000 if lat else float('nan'):.2f} |")
    add("")
    commit = sorted(c for _, c in wake["finish"] if c is not None)
    add(f"The holder's COMMIT itself took {pct(commit, .5):.2f} ms at p50 and "
        f"{pct(commit, .99):.2f} ms at p99 (from before it to its return, through dblink).")
    late = sum(1 for w, _ in wake["lease"] if w is None)
    if late:
        add(f"{late} lease sample(s) left out: the waiter was not yet waiting when the lease ran out.")
    add("")

    idem_tps = median([r["tps"] for r in idem["runs"]])
    cycle_tps = tps(through, "pg_quota", "one", IDEM_CLIENTS)
    idem_calls = sum(r["tps"] * SECONDS for r in idem["runs"])
    grew = sum(after - before for before, after in idem["rows"])
    add("## Idempotent retries")
    add("")
    add(f"{IDEM_CLIENTS} clients on one role, each repeating `quota.start(idempotency_key => "
        "'k' || client)` for a key whose ticket it started before the run, so every call "
        f"returns that ticket and charges nothing. The role is at its limit ({IDEM_CLIENTS} "
        "active tickets), so a call that charged would be refused. Compared with start + finish "
        f"at {IDEM_CLIENTS} clients on one role from the throughput table (the same rounds; "
        "there one transaction is two calls). The role's ledger rows are counted before and "
        "after each run.")
    add("")
    add(f"| workload ({IDEM_CLIENTS} clients, one role) | tx/s | p50 ms | p99 ms |")
    add("|---|---:|---:|---:|")
    lat = sorted(x for r in idem["runs"] for x in r["lat"])
    add(f"| `start(idempotency_key => …)`, a repeat | {idem_tps:.0f} | {pct(lat, .5):.2f} | {pct(lat, .99):.2f} |")
    p50, p99 = lat_pcts(through, "pg_quota", "one", IDEM_CLIENTS)
    add(f"| `start()` + `finish()` | {cycle_tps:.0f} | {p50:.2f} | {p99:.2f} |")
    add("")
    add(f"Repeats vs start + finish: {idem_tps / cycle_tps if cycle_tps else float('nan'):.2f}x. "
        "Ledger rows of the role before and after each run: "
        + ", ".join(f"{b} -> {a}" for b, a in idem["rows"])
        + (" (no charge)." if grew == 0 else f" (GREW by {grew}: repeats charged)."))
    add(f"WAL written during the runs: {sum(idem['wal'])} bytes for {idem_calls:.0f} repeats "
        f"({sum(idem['wal']) / max(1.0, idem_calls):.4f} bytes per repeat).")
    add("")

    add("## Databases beyond the worker slots")
    add("")
    add("One client per database, each looping `start()` + `finish()` (bench/scripts/dbs.sql), "
        "all databases at once, on `max_worker_processes = 8` (the logical replication launcher "
        "holds one slot, so 7 writers fit). Latency is per start+finish, pooled over the rounds; "
        "a client that failed (53000) counts as failed.")
    add("")
    add("| databases | tx/s | p50 ms | p99 ms | served | clients failed | tx/s vs 7 | p99 vs 7 |")
    add("|---:|---:|---:|---:|---:|---:|---:|---:|")
    base_tps = median([r["tps"] for r in dbs[DATABASES[0]]])
    base_p99 = pct(sorted(x for r in dbs[DATABASES[0]] for x in r["lat"]), .99)
    for n in DATABASES:
        t = median([r["tps"] for r in dbs[n]])
        lat = sorted(x for r in dbs[n] for x in r["lat"])
        served = min(r["served"] for r in dbs[n])
        failed = max(r["failed"] for r in dbs[n])
        add(f"| {n} | {t:.0f} | {pct(lat, .5):.2f} | {pct(lat, .99):.2f} | {served} of {n} | {failed} |"
            f" {t / base_tps if base_tps else float('nan'):.2f}x | {pct(lat, .99) / base_p99 if base_p99 else float('nan'):.2f}x |")
    add("")

    add("## Tenants beyond the scope counters")
    add("")
    n_counters = psql("SHOW quota.scope_counters")
    add(f"{MANY_ROLES:,} roles in one database, each with a setting of its own (`ALTER ROLE … SET`) "
        f"and holding one ticket; `quota.scope_counters` "
        f"= {n_counters}, so not all of them have a counter at once. A REPEATABLE READ session "
        "holds its snapshot through each round; in it, each timed role first loops start() + "
        "finish() with one client for the same time as the timed run, leaving dead row versions "
        "behind the snapshot, then each role is timed in turn (pgbench -r, the mean start() per "
        "round; the order turns with the round).")
    add("")
    add("| role | start() ms per round | median | vs role #1 |")
    add("|---:|---|---:|---:|")
    first = median(roles[MANY_ROLES_AT[0]])
    for n in MANY_ROLES_AT:
        m = median(roles[n])
        add(f"| #{n:,} | " + ", ".join(f"{x:.3f}" for x in roles[n]) + f" | {m:.3f} | "
            f"{m / first if first else float('nan'):.2f}x |")
    add("")
    spread, hot = median(roles["spread"]), median(roles["hot"])
    add(f"Many tenants at once, under the same snapshot: 16 clients, each transaction a "
        f"start() + finish() of a tenant drawn at random (as the superuser with SET ROLE, "
        f"bench/scripts/roles_*.sql) from all {MANY_ROLES:,}, more than there are counters, "
        f"or from the first 1,000, which all keep theirs: {spread:.0f} against {hot:.0f} tx/s "
        f"({spread / hot if hot else float('nan'):.2f}x). A tenant without a counter takes the "
        "place of one not read in the last 2 s (a rebuild), or is counted from the ledger.")
    add("")

    def ratio(a, b):
        return a / b if b else float("nan")
    c16 = 16 if 16 in CLIENTS else CLIENTS[-1]
    pq = tps(through, "pg_quota", "roles", c16)
    targets = [
        (f"start+finish tx/s, {c16} clients on {c16} roles, vs B1", ratio(pq, tps(through, "B1", "roles", c16)), ">=", 1.0),
        ("same, vs B2", ratio(pq, tps(through, "B2", "roles", c16)), ">=", 2.0),
        ("same, vs B0", ratio(pq, tps(through, "B0", "roles", c16)), ">=", 0.6),
        (f"{c16} clients on one role vs {c16} on {c16} roles", ratio(tps(through, "pg_quota", "one", c16), pq), ">=", 0.5),
        ("refusals/s vs SELECT 1/s (16 clients)", ratio(ref, sel), ">=", 0.5),
        ("WAL bytes per refusal", wal_per, "<", 1.0),
        ("start() latency, 10,000 retained vs 0", ratio(median(history[10000]), median(history[0])), "<=", 1.25),
        ("start+finish with an old snapshot held vs none", ratio(snap_tps("cycle", True), snap_tps("cycle", False)), ">=", 0.8),
        ("refusals with an old snapshot held vs none", ratio(snap_tps("refuse", True), snap_tps("refuse", False)), ">=", 0.8),
        # 0.4.0's targets (issue "cheap enough to forget").
        ("0.4.0: job lifecycle JOBQ vs JOB", ratio(job_tps["JOBQ"], job_tps["JOB"]), ">=", 0.8),
        ("0.4.0: job lifecycle JOBQ vs JOB1", ratio(job_tps["JOBQ"], job_tps["JOB1"]), ">=", 1.5),
        ("0.4.0: start+finish vs B1", ratio(pq, tps(through, "B1", "roles", c16)), ">=", 1.5),
        ("0.4.0: start+finish vs B2", ratio(pq, tps(through, "B2", "roles", c16)), ">=", 2.5),
        ("0.4.0: refusals/s vs SELECT 1/s", ratio(ref, sel), ">=", 0.9),
        (f"0.4.0: databases served, {DATABASES[-1]} on 8 worker slots (share)",
         min(r["served"] for r in dbs[DATABASES[-1]]) / DATABASES[-1], ">=", 1.0),
        (f"0.4.0: start() of role #{MANY_ROLES:,} vs #1, old snapshot held",
         ratio(median(roles[MANY_ROLES]), median(roles[1])), "<=", 1.25),
    ]
    targets += write_jobs_report(jobs5, lines)
    targets_table(lines, targets)
    report = "\n".join(lines) + "\n"
    with open(os.path.join(ARGS.out, "results.md"), "w") as f:
        f.write(report)
    write_svg(through)
    print(report)


def write_svg(through):
    """Throughput against clients, one line per system, a role per client."""
    w, h, m = 640, 400, 60
    colors = {"pg_quota": "#1f77b4", "B0": "#7f7f7f", "B1": "#d62728", "B2": "#2ca02c"}
    ymax = max([tps(through, s, "roles", c) for s in SYSTEMS for c in CLIENTS] + [1]) * 1.1
    xs = {c: m + i * (w - 2 * m) / max(1, len(CLIENTS) - 1) for i, c in enumerate(CLIENTS)}

    def y(v):
        return h - m - v / ymax * (h - 2 * m)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">start+finish throughput, one role per client</text>',
           f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="black"/>',
           f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="black"/>',
           f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">clients</text>',
           f'<text x="15" y="{h / 2}" text-anchor="middle" transform="rotate(-90 15 {h / 2})">tx/s</text>']
    for c, x in xs.items():
        out.append(f'<text x="{x}" y="{h - m + 18}" text-anchor="middle">{c}</text>')
    for i in range(5):
        v = ymax * i / 4
        out.append(f'<text x="{m - 6}" y="{y(v) + 4}" text-anchor="end">{v:.0f}</text>')
        out.append(f'<line x1="{m}" y1="{y(v)}" x2="{w - m}" y2="{y(v)}" stroke="#eee"/>')
    for k, s in enumerate(SYSTEMS):
        pts = " ".join(f"{xs[c]:.1f},{y(tps(through, s, 'roles', c)):.1f}" for c in CLIENTS)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{colors[s]}" stroke-width="2"/>')
        out.append(f'<text x="{w - m + 5}" y="{m + 16 * k}" fill="{colors[s]}">{s}</text>')
    out.append("</svg>")
    with open(os.path.join(ARGS.out, "throughput.svg"), "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
