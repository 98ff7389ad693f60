#!/usr/bin/env python3
"""What pg_quota adds to a job's CPU on a Citus cluster against what it adds on a
single node (issue 35), for `scripts/bench --citus`, which builds Citus, starts the
single node and the cluster (a coordinator and two workers on this machine), and
sets both up (bench/citus_setup.sql). Standard library only; Linux only (/proc).

A round runs, for each recipe, JOB and then JOBT (bench/scripts/citus_*.sql) on the single node and
then on the cluster, each for SECONDS with CLIENTS clients: on the single node all of
them; on the cluster as many on each node, the coordinator included. Meanwhile every
process of every server is sampled from /proc every 0.2 s (user and system CPU; a
process that exits keeps its last sample). The CPU per job is all the servers' CPU
divided by the jobs done; pgbench's own is left out. What pg_quota adds is JOBT's
CPU per job less JOB's, on each; the ratio of the cluster's to the single node's is
the figure the issue bounds (at most 1.3). Rounds alternate, and the report gives
each round and the medians.

Hops: each node's quota.stats says how many starts it admitted, and each node's
pgbench how many jobs its clients ran: a start is admitted only on its tenant's node,
so the starts of the coordinator's clients all made one hop, and those of a worker's
clients one hop for the tenants of the other worker.
"""
import argparse
import os
import re
import statistics
import subprocess
import threading
import time

from procstat import cpu_of, server_pids

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pgbin", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--single", required=True, help="DIR:PORT of the single node")
    p.add_argument("--cluster", required=True, help="DIR:PORT,DIR:PORT,… coordinator first")
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--machine", default="")
    return p.parse_args()


ARGS = parse_args()


def nodes(spec):
    return [(d, int(p)) for d, p in (x.rsplit(":", 1) for x in spec.split(","))]


def server_cpu(datadir):
    """{pid: user + system seconds} of every process of the server in `datadir`."""
    with open(os.path.join(datadir, "postmaster.pid")) as f:
        postmaster = int(f.readline())
    out = {}
    for pid in server_pids(postmaster):
        c = cpu_of(pid)
        if c is not None:
            out[pid] = c[0] + c[1]
    return out


def is_pg_quota(pid, seen={}):
    """Whether the process is one of pg_quota's background workers (its title names
    pg_quota), as first seen."""
    if pid not in seen:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                seen[pid] = b"pg_quota" in f.read()
        except OSError:
            seen[pid] = False
    return seen[pid]


def psql(node, sql):
    d, port = node
    return subprocess.run([os.path.join(ARGS.pgbin, "psql"), "-X", "-At", "-h", d, "-p", str(port),
                           "-U", "postgres", "-d", "app", "-c", sql],
                          check=True, capture_output=True, text=True).stdout.strip()


def admitted(node):
    return int(psql(node, "SELECT coalesce(sum(admitted), 0) FROM quota.stats WHERE role = 'app'"))


def run(servers, script):
    """Jobs done, CPU seconds of all the servers, and the jobs run per node."""
    first, last = {}, {}
    stop = threading.Event()

    def sample():
        for d, _ in servers:
            for pid, c in server_cpu(os.path.join(d, "data")).items():
                first.setdefault(pid, c)
                last[pid] = c

    sample()
    before = dict(first)
    per_node = max(1, ARGS.clients // len(servers))
    procs = [subprocess.Popen(
        [os.path.join(ARGS.pgbin, "pgbench"), "-n", "-h", d, "-p", str(port), "-U", "app",
         "-c", str(per_node), "-j", "1", "-T", str(ARGS.seconds),
         "-f", os.path.join(SCRIPTS, script), "app"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for d, port in servers]

    def sampler():
        while not stop.is_set():
            sample()
            time.sleep(0.2)
    th = threading.Thread(target=sampler)
    th.start()
    outs = [p.communicate() for p in procs]
    stop.set()
    th.join()
    sample()
    jobs = []
    for out, err in outs:
        m = re.search(r"number of transactions actually processed: (\d+)", out)
        failed = re.search(r"number of failed transactions: (\d+)", out)
        if not m or (failed and int(failed.group(1)) > 0):
            raise SystemExit(f"pgbench failed:\n{out}\n{err}")
        jobs.append(int(m.group(1)))
    cpu = sum(c - before.get(pid, 0.0) for pid, c in last.items())
    workers = sum(c - before.get(pid, 0.0) for pid, c in last.items() if is_pg_quota(pid))
    return sum(jobs), cpu, jobs, workers


RECIPES = [("statements", "citus_job.sql", "citus_jobt.sql"),
           ("statements, against JOB in transaction blocks", "citus_bjob.sql", "citus_jobt.sql"),
           ("statements, finish by trigger", "citus_tjob.sql", "citus_tjobt.sql"),
           ("whole calls", "citus_fjob.sql", "citus_fjobt.sql")]


def main():
    single = nodes(ARGS.single)
    cluster = nodes(ARGS.cluster)
    setups = [("single node", single), ("cluster of 3", cluster)]
    rows = {(r, name): {"JOB": [], "JOBT": []} for r, _, _ in RECIPES for name, _ in setups}
    hops = {}
    for _ in range(ARGS.rounds):
        for recipe, job, jobt in RECIPES:
            for name, servers in setups:
                for w, script in (("JOB", job), ("JOBT", jobt)):
                    on_cluster = w == "JOBT" and name != "single node"
                    before = [admitted(n) for n in servers] if on_cluster else None
                    jobs, cpu, per_node, workers = run(servers, script)
                    rows[(recipe, name)][w].append((jobs, cpu, workers))
                    if before is not None:
                        hops[recipe] = (per_node, [admitted(n) - b for n, b in zip(servers, before)])
    lines = ["# pg_quota on a Citus cluster: what it adds to a job's CPU (scripts/bench --citus)", ""]
    if ARGS.machine:
        lines += [f"Machine: {ARGS.machine}", ""]
    lines += [f"{ARGS.clients} clients (on the cluster {ARGS.clients // len(cluster)} on each of its "
              f"{len(cluster)} nodes, the coordinator included), {ARGS.seconds} s per run, "
              f"{ARGS.rounds} rounds; CPU is every server process's (user + system), in "
              "microseconds per job; tenants drawn from 1,000. Three recipes (USER_GUIDE "
              "\"Citus\"): statements (a start alone in its statement, then the INSERT, in "
              "one transaction; the UPDATE and finish_for() in another; measured against the "
              "bare INSERT and UPDATE, and again against them in the same transaction blocks, "
              "which leaves out what a transaction block costs on each), statements whose "
              "finish is the completion UPDATE's quota.finish_job() trigger, and whole calls "
              "(enqueue() and complete(), each distributed by tenant and run whole on the "
              "tenant's node; JOB runs the same calls with pg_quota off).", ""]
    for recipe, _, _ in RECIPES:
        added = {}
        lines += [f"## Recipe: {recipe}", "",
                  "| setup | round | JOB jobs/s | JOB us/job | JOBT jobs/s | JOBT us/job | added us/job "
                  "| of which pg_quota's background workers |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, _ in setups:
            per = []
            r = rows[(recipe, name)]
            for i, ((jj, jc, jw), (tj, tc, tw)) in enumerate(zip(r["JOB"], r["JOBT"])):
                job_us, jobt_us = jc * 1e6 / max(jj, 1), tc * 1e6 / max(tj, 1)
                workers_us = tw * 1e6 / max(tj, 1) - jw * 1e6 / max(jj, 1)
                per.append(jobt_us - job_us)
                lines.append(f"| {name} | {i + 1} | {jj / ARGS.seconds:.0f} | {job_us:.0f} | "
                             f"{tj / ARGS.seconds:.0f} | {jobt_us:.0f} | {jobt_us - job_us:.0f} | "
                             f"{workers_us:.0f} |")
            added[name] = statistics.median(per)
        ratio = added["cluster of 3"] / max(added["single node"], 1e-9)
        lines += ["", f"Median added CPU per job: single node {added['single node']:.0f} us, "
                  f"cluster {added['cluster of 3']:.0f} us; ratio {ratio:.2f} (the issue's bound: 1.3).", ""]
        if recipe in hops:
            ran, adm = hops[recipe]
            lines += ["Hops, from the last cluster round's JOBT: jobs run by each node's clients, "
                      "and starts admitted by each node (quota.stats):", "",
                      "| node | jobs its clients ran | starts it admitted |", "|---|---:|---:|"]
            for i, (r, a) in enumerate(zip(ran, adm)):
                lines.append(f"| {'coordinator' if i == 0 else f'worker {i}'} | {r} | {a} |")
            lines.append("")
    lines += ["Every start is admitted on its tenant's node (the coordinator holds no "
              "shards, so it admits none): a start makes one hop from the coordinator, "
              "and from a worker for the tenants of the other worker.", ""]
    os.makedirs(ARGS.out, exist_ok=True)
    with open(os.path.join(ARGS.out, "citus.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
