#!/usr/bin/env python3
"""Scope counters shared by two busy databases, with old snapshots held: start+finish
throughput of one or more builds, side by side. Called by `scripts/bench --windows`.
Standard library only.

Each build named with --bin NAME=PGBIN (a PostgreSQL bin directory whose pg_quota is
that build) gets a cluster of its own with `quota.scope_counters = 16`, so that the
whole table is one window (core::counters). Databases w1 and w2 each have 9 busy roles,
18 scopes for 16 counters: a scope without a counter takes the place of one not read in
the last 2 s, or, where all were read lately, is counted from the ledger. 0.4.0 judged
the other database's counters stale whatever their use, so the two databases took each
other's places on every call that missed, each time a rebuild under the counters'
exclusive lock (0.4.1, F2). In each database a REPEATABLE READ session holds its
snapshot through the run, so that counting walks the dead versions that finishes leave.

Each round runs every build once (the order turns with the round): start its cluster,
hold the snapshots, run two pgbench processes at once (8 clients on w1, 8 on w2, each
transaction a start+finish of a role drawn from the 9 with SET ROLE), stop the cluster.
"""
import argparse
import os
import re
import statistics
import subprocess
import tempfile
import threading
import time

ROLES = 9
COUNTERS = 16


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", action="append", required=True, help="NAME=PGBIN")
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=5490)
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--user", default="postgres")
    return p.parse_args()


ARGS = parse_args()
ARGS.out = os.path.abspath(ARGS.out)
BUILDS = [tuple(b.split("=", 1)) for b in ARGS.bin]


def as_pg(cmd, **kw):
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", ARGS.user, "--"] + cmd
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def cluster_dir(name):
    return os.path.join(ARGS.out, f"windows-{name}")


def psql(pgbin, sql, db="postgres"):
    out = subprocess.run(
        [os.path.join(pgbin, "psql"), "-X", "-At", "-v", "ON_ERROR_STOP=1", "-h",
         cluster_dir_of[pgbin], "-p", str(ARGS.port), "-U", "postgres", "-d", db, "-c", sql],
        check=True, capture_output=True, text=True)
    return out.stdout.strip()


cluster_dir_of = {}


def pg_ctl(name, pgbin, action):
    d = cluster_dir(name)
    as_pg([os.path.join(pgbin, "pg_ctl"), "-D", os.path.join(d, "data"), "-l",
           os.path.join(d, "server.log"), "-w", "-t", "60", "-m", "fast", action])


def setup(name, pgbin):
    d = cluster_dir(name)
    cluster_dir_of[pgbin] = d
    subprocess.run(["rm", "-rf", d], check=True)
    os.makedirs(d)
    os.chmod(d, 0o755)
    if os.geteuid() == 0:
        subprocess.run(["chown", ARGS.user, d], check=True)
    as_pg([os.path.join(pgbin, "initdb"), "-D", os.path.join(d, "data"), "-A", "trust",
           "-U", "postgres", "--no-sync"])
    with open(os.path.join(d, "data", "postgresql.conf"), "a") as f:
        f.write(f"shared_preload_libraries = 'pg_quota'\nport = {ARGS.port}\n"
                f"listen_addresses = ''\nunix_socket_directories = '{d}'\n"
                f"max_connections = 100\nquota.scope_counters = {COUNTERS}\n")
    pg_ctl(name, pgbin, "start")
    psql(pgbin, f"DO $$ BEGIN FOR i IN 1..{ROLES} LOOP "
                "EXECUTE format('CREATE ROLE ww_%s', i); END LOOP; END $$")
    for db in ("w1", "w2"):
        psql(pgbin, f"CREATE DATABASE {db}")
        for sql in ("CREATE EXTENSION pg_quota",
                    f"ALTER DATABASE {db} SET quota.max_active_per_role = 1000",
                    f"ALTER DATABASE {db} SET quota.max_retained_per_role = 0"):
            psql(pgbin, sql, db=db)
    pg_ctl(name, pgbin, "stop")


class Snapshots:
    """A REPEATABLE READ session per database holding its snapshot."""

    def __init__(self, pgbin):
        self.pgbin = pgbin

    def __enter__(self):
        self.procs = []
        for db in ("w1", "w2"):
            p = subprocess.Popen(
                [os.path.join(self.pgbin, "psql"), "-X", "-q", "-h", cluster_dir_of[self.pgbin],
                 "-p", str(ARGS.port), "-U", "postgres", "-d", db],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
            p.stdin.write("SET application_name = 'windows_snapshot';\n"
                          "BEGIN ISOLATION LEVEL REPEATABLE READ;\nSELECT count(*) FROM quota.ledger;\n")
            p.stdin.flush()
            self.procs.append(p)
        for _ in range(200):
            if psql(self.pgbin, "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                    "'windows_snapshot' AND state = 'idle in transaction' AND backend_xmin IS NOT NULL") == "2":
                return self
            time.sleep(0.05)
        raise SystemExit("the snapshot holders did not start")

    def __exit__(self, *exc):
        for p in self.procs:
            p.stdin.write("COMMIT;\n")
            p.stdin.close()
            p.wait(timeout=30)


def run_round(name, pgbin, script):
    pg_ctl(name, pgbin, "start")
    try:
        with Snapshots(pgbin):
            results = {}

            def one(db):
                res = subprocess.run(
                    [os.path.join(pgbin, "pgbench"), "-n", "-h", cluster_dir_of[pgbin], "-p",
                     str(ARGS.port), "-U", "postgres", "-c", "8", "-j", "2", "-T",
                     str(ARGS.seconds), "-f", script, db], capture_output=True, text=True)
                m = re.search(r"number of transactions actually processed: (\d+)", res.stdout)
                results[db] = int(m.group(1)) if m else 0
            threads = [threading.Thread(target=one, args=(db,)) for db in ("w1", "w2")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return sum(results.values()) / ARGS.seconds
    finally:
        pg_ctl(name, pgbin, "stop")


def main():
    os.makedirs(ARGS.out, exist_ok=True)
    script = os.path.join(tempfile.mkdtemp(dir=ARGS.out), "windows.sql")
    with open(script, "w") as f:
        f.write(f"\\set r random(1, {ROLES})\nSET ROLE ww_:r;\n"
                "SELECT quota.finish(quota.start('w'));\nRESET ROLE;\n")
    for name, pgbin in BUILDS:
        setup(name, pgbin)
    tps = {name: [] for name, _ in BUILDS}
    for rnd in range(ARGS.rounds):
        order = BUILDS[rnd % len(BUILDS):] + BUILDS[:rnd % len(BUILDS)]
        for name, pgbin in order:
            t = run_round(name, pgbin, script)
            tps[name].append(t)
            print(f"round {rnd + 1}: {name}: {t:.0f} tx/s", flush=True)
    lines = ["# Scope counters shared by two databases, old snapshots held", "",
             f"`quota.scope_counters = {COUNTERS}`; databases w1 and w2 with {ROLES} busy roles "
             f"each ({2 * ROLES} scopes); 8 pgbench clients per database, each transaction a "
             "start+finish of a role drawn at random (SET ROLE); a REPEATABLE READ snapshot held "
             f"in each database. {ARGS.rounds} rounds of {ARGS.seconds} s, builds interleaved.", "",
             "| build | tx/s per round | median |", "|---|---|---:|"]
    for name, _ in BUILDS:
        lines.append(f"| {name} | " + ", ".join(f"{t:.0f}" for t in tps[name])
                     + f" | {statistics.median(tps[name]):.0f} |")
    if len(BUILDS) == 2:
        a, b = (statistics.median(tps[n]) for n, _ in BUILDS)
        lines += ["", f"{BUILDS[0][0]} vs {BUILDS[1][0]}: {a / b if b else float('nan'):.2f}x"]
    report = "\n".join(lines) + "\n"
    with open(os.path.join(ARGS.out, "windows.md"), "w") as f:
        f.write(report)
    print(report)


if __name__ == "__main__":
    main()
