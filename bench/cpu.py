#!/usr/bin/env python3
"""Where a unit of work spends its time: CPU per unit and wait events, for the job
lifecycles (JOB, JOB1, JOBQ, and 0.5.0's JOBT and JOBT-tenants), start+finish, and the
refusal floor (a refused try_start() of a role and of a tenant against CALL0, a C
function with start()'s signature that does nothing). Called by `scripts/bench --cpu`,
which builds, installs and starts the server as for a normal run. Standard library
only; Linux only (it reads /proc).

Each workload runs as the throughput runs do (16 pgbench processes, one client each, on
16 roles, or all on the one role the workload names) for SECONDS. Meanwhile every process of the server and every pgbench
process is sampled from /proc every 0.2 s (user and system CPU; a process that exits
keeps its last sample), and pg_stat_activity every 50 ms from one session of its own
(psql's \\watch), which leaves itself out. The report divides the CPU by the units
done, per kind of process, and gives each kind's share of the wait-event samples.
"""
import argparse
import collections
import os
import re
import subprocess
import threading
import time

from pgclient import protocol_script
from procstat import TICK, cpu_of, server_pids

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
# (name, script, role): None spreads the clients over bench_r1..bench_r16.
WORKLOADS = [("JOB", "job.sql", None), ("JOB1", "job1.sql", None), ("JOBQ", "jobq.sql", None),
             ("JOBT", "jobt.sql", None), ("JOBT0", "jobt0.sql", None),
             ("JOBT-tenants", "jobt_tenants.sql", "bench_tenants"),
             ("start+finish", "pgq.sql", None),
             ("refuse", "refuse.sql", "bench_refused"),
             ("refuse-tenant", "refuse_tenant.sql", "bench_tenant_refused"),
             ("CALL0", "call0.sql", "bench_refused")]
CLIENTS = 16


def parse_args():
    p = argparse.ArgumentParser()
    for a in ("--host", "--port", "--pgbin", "--out", "--datadir"):
        p.add_argument(a, required=True)
    p.add_argument("--db", default="bench")
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--machine", default="")
    p.add_argument("--only", default="", help="comma-separated workload names (default: all)")
    p.add_argument("--protocol", default="simple", choices=("simple", "prepared"),
                   help="pgbench's -M (a script's _prepared.sql variant is used where it has one)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the workloads this many times, interleaved (round k's are named NAME#k)")
    return p.parse_args()


ARGS = parse_args()


def kind_of(pid, pgbench_pids):
    """'pgbench', 'backend', 'writer', 'other postgres', or None (not ours)."""
    if pid in pgbench_pids:
        return "pgbench"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    if "pg_quota ledger writer" in cmd:
        return "writer"
    if re.search(r"postgres: bench_\w+ bench ", cmd):
        return "backend"
    return "other postgres"


def machine_cpu():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return {"user": (v[0] + v[1]) / TICK, "system": (v[2] + v[5] + v[6]) / TICK,
            "idle": (v[3] + v[4]) / TICK}


def run(name, script, role):
    with open(os.path.join(ARGS.datadir, "postmaster.pid")) as f:
        postmaster = int(f.readline())
    first = {}   # pid -> (kind, user, system) at its first sample
    last = {}    # pid -> (kind, user, system) at its last sample
    procs = []
    stop = threading.Event()

    def sample(pgbench_pids):
        for pid in server_pids(postmaster) + list(pgbench_pids):
            c = cpu_of(pid)
            if c is None:
                continue
            k = last.get(pid, (None,))[0] or kind_of(pid, pgbench_pids)
            if k is None:
                continue
            first.setdefault(pid, (k,) + c)
            last[pid] = (k,) + c

    sample(set())   # what runs before: the writer, walwriter, checkpointer…
    preexisting = set(first)
    m0 = machine_cpu()
    watch = subprocess.Popen(
        [os.path.join(ARGS.pgbin, "psql"), "-X", "-At", "-h", ARGS.host, "-p", ARGS.port,
         "-U", "postgres", "-d", ARGS.db, "-v", "ON_ERROR_STOP=1"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    watch.stdin.write(
        "SET application_name = 'cpu_sampler';\n"
        "SELECT CASE WHEN backend_type = 'pg_quota ledger writer' THEN 'writer' ELSE 'backend' END,"
        " coalesce(wait_event_type || ':' || wait_event, 'on CPU') FROM pg_stat_activity"
        " WHERE (backend_type = 'pg_quota ledger writer' OR application_name = 'pgbench')"
        f" \\watch 0.05\n")
    watch.stdin.flush()
    t0 = time.time()
    for i in range(CLIENTS):
        procs.append(subprocess.Popen(
            [os.path.join(ARGS.pgbin, "pgbench"), "-n", "-h", ARGS.host, "-p", ARGS.port,
             "-U", role or f"bench_r{i + 1}", "-c", "1", "-T", str(ARGS.seconds), "-M", ARGS.protocol,
             "-f", os.path.join(SCRIPTS, protocol_script(SCRIPTS, script, ARGS.protocol)), ARGS.db],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    pg_pids = {p.pid for p in procs}

    def sampler():
        while not stop.is_set():
            sample(pg_pids)
            time.sleep(0.2)
    th = threading.Thread(target=sampler)
    th.start()
    done = [p.communicate() for p in procs]
    outs = [o for o, _ in done]
    failed = [(p.returncode, e) for p, (_, e) in zip(procs, done) if p.returncode != 0]
    stop.set()
    th.join()
    wall = time.time() - t0
    m1 = machine_cpu()
    watch.kill()
    waits = collections.Counter()
    for line in watch.stdout.read().splitlines():
        parts = line.split("|")
        if len(parts) == 2:
            waits[(parts[0], parts[1])] += 1
    units = sum(int(m.group(1)) for o in outs
                for m in [re.search(r"number of transactions actually processed: (\d+)", o)] if m)
    if failed or units == 0:
        # pgbench's first line of stderr names the statement's error; its last says only
        # that the run was aborted.
        why = failed[0][1].strip().splitlines()[:1] if failed else []
        raise SystemExit(f"{name}: {len(failed)} pgbench process(es) failed, {units} units done"
                         + (f": {why[0]}" if why else ""))
    cpu = collections.defaultdict(lambda: [0.0, 0.0])
    for pid, (k, u, s) in last.items():
        base = first[pid] if pid in preexisting else (k, 0.0, 0.0)
        cpu[k][0] += u - base[1]
        cpu[k][1] += s - base[2]
    machine = {k: m1[k] - m0[k] for k in m0}
    return {"name": name, "units": units, "wall": wall, "cpu": dict(cpu), "waits": waits,
            "machine": machine}


def report(results):
    kinds = ["backend", "writer", "other postgres", "pgbench"]
    lines = ["# Where the time goes (scripts/bench --cpu)", ""]
    if ARGS.machine:
        lines += [f"Machine: {ARGS.machine}", ""]
    lines += [f"{CLIENTS} pgbench processes (`-M {ARGS.protocol}`), one client each on 16 roles, "
              f"{ARGS.seconds} s per "
              "workload (all 16 on one role for JOBT-tenants and the calls). CPU in microseconds "
              "per unit (a job, a start+finish, or a call), user + system; "
              "the machine's columns are all its CPUs together.", "",
              "| workload | units/s | " + " | ".join(f"{k} us" for k in kinds)
              + " | all processes us | machine user us | machine system us | machine idle |",
              "|---|---:|" + "---:|" * (len(kinds) + 4)]
    for r in results:
        n = max(r["units"], 1)
        per = {k: sum(r["cpu"].get(k, (0, 0))) * 1e6 / n for k in kinds}
        busy = r["machine"]["user"] + r["machine"]["system"]
        idle = r["machine"]["idle"] / max(busy + r["machine"]["idle"], 1e-9)
        lines.append(f"| {r['name']} | {r['units'] / r['wall']:.0f} | "
                     + " | ".join(f"{per[k]:.0f}" for k in kinds)
                     + f" | {sum(per.values()):.0f} | {r['machine']['user'] * 1e6 / n:.0f}"
                     f" | {r['machine']['system'] * 1e6 / n:.0f} | {idle:.0%} |")
    lines += ["", "Kernel time of our processes (system CPU) apart, per unit:", "",
              "| workload | " + " | ".join(f"{k} system us" for k in kinds) + " |",
              "|---|" + "---:|" * len(kinds)]
    for r in results:
        n = max(r["units"], 1)
        lines.append(f"| {r['name']} | " + " | ".join(
            f"{r['cpu'].get(k, (0, 0))[1] * 1e6 / n:.0f}" for k in kinds) + " |")
    lines += ["", "Wait events, share of the samples of each kind of process (top 6):", ""]
    for r in results:
        for who in ("backend", "writer"):
            total = sum(v for (w, _), v in r["waits"].items() if w == who)
            if not total:
                continue
            top = sorted(((v, e) for (w, e), v in r["waits"].items() if w == who), reverse=True)[:6]
            lines.append(f"- {r['name']}, {who} ({total} samples): "
                         + ", ".join(f"{e} {v / total:.0%}" for v, e in top))
    return "\n".join(lines) + "\n"


def main():
    if ARGS.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    results = []
    only = set(filter(None, ARGS.only.split(",")))
    for k in range(1, ARGS.rounds + 1):
        # Every other round runs the workloads in reverse, as run.py's rounds alternate,
        # so that a drift over the run (bench.jobs grows) does not favour one of them.
        for name, script, role in (WORKLOADS if k % 2 else WORKLOADS[::-1]):
            if only and name not in only:
                continue
            r = run(name if ARGS.rounds == 1 else f"{name}#{k}", script, role)
            results.append(r)
            print(f"{r['name']}: {r['units'] / r['wall']:.0f} units/s", flush=True)
    text = report(results)
    os.makedirs(ARGS.out, exist_ok=True)
    with open(os.path.join(ARGS.out, "cpu.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
