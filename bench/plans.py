#!/usr/bin/env python3
"""Issue 34's speed figures (0.7.0, "customers on plans"), as far as 0.7.0 builds them.
Called by `scripts/bench --plans`, which builds, installs and starts the server and runs
bench/setup.sql, as for a normal run. Standard library only.

  plans     JOBT-tenants (bench/scripts/jobt_tenants.sql: 16 clients of one role, each
            job a transactional start and its finish for a tenant drawn from 1,000)
            on bench_plans, where half of the 1,000 tenants have limits of their own
            (quota.set_tenant_limits(): 50 or 200, never reached), against the same on
            bench_tenants, where none has. Target: >= 0.95x. And the issue's figure:
            the same on bench_plans with each job's weight drawn from 1 to 8
            (jobt_weighted.sql), against plain JOBT-tenants. Target: >= 0.95x.
  refusals  try_start() refused at a tenant's own limit (bench_override_refused, tenant
            'held'), and a weighted try_start() refused because its weight does not fit
            (bench_weight_refused: 'held' holds 7 of 8 units, the start weighs 2),
            each against one refused at the role's setting (bench_tenant_refused), 16
            clients. Target: >= 0.95x.
  100,000   start()+finish() of the tenant with own limit #100,000 of a role that has
            100,000 of them, against a tenant of the same role with none, one client,
            a REPEATABLE READ snapshot held. Target: at most 1.25x the latency.

Each figure under -M simple and -M prepared, ROUNDS rounds interleaved (a b a b); the
medians of the rounds decide. The report goes to OUT/plans.md.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

from held_snapshot import HeldSnapshot
from pgclient import psql_runner

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")


def parse_args():
    p = argparse.ArgumentParser()
    for a in ("--host", "--port", "--pgbin", "--out"):
        p.add_argument(a, required=True)
    p.add_argument("--db", default="bench")
    p.add_argument("--machine", default="")
    p.add_argument("--quick", action="store_true")
    return p.parse_args()


ARGS = parse_args()
SECONDS = 3 if ARGS.quick else 10
ROUNDS = 1 if ARGS.quick else 3
OVERRIDES = 100_000


psql = psql_runner(ARGS.pgbin, ARGS.host, ARGS.port, ARGS.db)


def pgbench(script, role, clients, protocol, per_statement=False, defines=()):
    """Transactions per second, and the per-statement latencies (ms) if asked."""
    cmd = [os.path.join(ARGS.pgbin, "pgbench"), "-n", "-h", ARGS.host, "-p", ARGS.port,
           "-U", role, "-c", str(clients), "-j", str(min(clients, 4)), "-T", str(SECONDS),
           "-M", protocol, "-f", os.path.join(SCRIPTS, script)]
    for d in defines:
        cmd += ["-D", d]
    if per_statement:
        cmd.append("-r")
    cmd.append(ARGS.db)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stdout + res.stderr)
        raise SystemExit(f"pgbench failed: {' '.join(cmd)}")
    m = re.search(r"number of transactions actually processed: (\d+)", res.stdout)
    stmt = {}
    for line in res.stdout.splitlines():
        s = re.match(r"\s+([\d.]+)\s+\d+\s+(.*)$", line)
        if s:
            stmt[s.group(2)] = float(s.group(1))
    return int(m.group(1)) / SECONDS, stmt


def setup():
    """The roles of the figures (bench_tenants and bench_tenant_refused come from
    bench/setup.sql)."""
    psql("""
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'bench_plans') THEN
    CREATE ROLE bench_plans LOGIN;
    CREATE ROLE bench_override_refused LOGIN;
    CREATE ROLE bench_many_overrides LOGIN;
  END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'bench_weight_refused') THEN
    CREATE ROLE bench_weight_refused LOGIN;
  END IF;
END $$;
ALTER ROLE bench_weight_refused SET quota.max_active_per_role = 1000;
ALTER ROLE bench_weight_refused SET quota.max_retained_per_role = 0;
ALTER ROLE bench_weight_refused SET quota.max_active_per_tenant = 8;
ALTER ROLE bench_plans SET quota.max_active_per_role = 100000;
ALTER ROLE bench_plans SET quota.max_retained_per_role = 0;
ALTER ROLE bench_plans SET quota.max_active_per_tenant = 100;
ALTER ROLE bench_plans SET quota.allow_transactional = on;
ALTER ROLE bench_override_refused SET quota.max_active_per_role = 1000;
ALTER ROLE bench_override_refused SET quota.max_retained_per_role = 0;
ALTER ROLE bench_override_refused SET quota.max_active_per_tenant = 100;
ALTER ROLE bench_many_overrides SET quota.max_active_per_role = 1000000;
ALTER ROLE bench_many_overrides SET quota.max_retained_per_role = 0;
ALTER ROLE bench_many_overrides SET quota.max_active_per_tenant = 10;
""")
    psql("SELECT count(quota.set_tenant_limits('t' || i, max_active => CASE WHEN i % 4 = 0 THEN 50 ELSE 200 END, "
         "role => 'bench_plans')) FROM generate_series(2, 1000, 2) i")
    psql("SELECT quota.set_tenant_limits('held', max_active => 1, role => 'bench_override_refused')")
    if psql("SELECT count(*) FROM quota.ledger WHERE role = 'bench_weight_refused'::regrole") == "0":
        psql("SELECT quota.start(weight => 7, label => 'held', tenant => 'held')", user="bench_weight_refused")
    if psql("SELECT count(*) FROM quota.ledger WHERE role = 'bench_override_refused'::regrole") == "0":
        psql("SELECT quota.start('held', tenant => 'held')", user="bench_override_refused")
    # 100,000 own limits in one statement (the superuser's own write, which the table's
    # trigger sees as the function's).
    psql(f"INSERT INTO quota.tenant_overrides SELECT 'bench_many_overrides', 't' || i, 10, NULL, now(), "
         f"'postgres' FROM generate_series(1, {OVERRIDES}) i ON CONFLICT DO NOTHING")
    psql("VACUUM ANALYZE quota.tenant_overrides")


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    os.makedirs(ARGS.out, exist_ok=True)
    setup()
    f = {}
    protocols = ["simple", "prepared"]
    for rnd in range(ROUNDS):
        print(f"round {rnd + 1} of {ROUNDS}", flush=True)
        for protocol in (protocols if rnd % 2 == 0 else protocols[::-1]):
            pairs = [("JOBT-tenants", "jobt_tenants.sql", "bench_tenants"),
                     ("JOBT-plans", "jobt_tenants.sql", "bench_plans"),
                     ("JOBT-weighted", "jobt_weighted.sql", "bench_plans"),
                     ("refuse-setting", "refuse_tenant.sql", "bench_tenant_refused"),
                     ("refuse-own", "refuse_tenant.sql", "bench_override_refused"),
                     ("refuse-weight", "refuse_weight.sql", "bench_weight_refused")]
            if rnd % 2:
                pairs = pairs[::-1]
            for name, script, role in pairs:
                tps, _ = pgbench(script, role, 16, protocol)
                f.setdefault((name, protocol), []).append(tps)
                print(f"  {name:15} {protocol:8} {tps:9.1f}/s", flush=True)
            with HeldSnapshot(ARGS.pgbin, ARGS.host, ARGS.port, ARGS.db, psql):
                for n in ([OVERRIDES, 0] if rnd % 2 else [0, OVERRIDES]):
                    _, stmt = pgbench("tenants_hot.sql", "bench_many_overrides", 1, protocol,
                                      per_statement=True, defines=[f"n={n}"])
                    ms = next((v for k, v in stmt.items() if "quota" in k), float("nan"))
                    f.setdefault((f"tenant-{n}", protocol), []).append(ms)
                    print(f"  tenant t{n:<7} {protocol:8} {ms:.3f} ms", flush=True)
    lines = ["# pg_quota: issue 34's figures (0.7.0, customers on plans)", "",
             f"{ROUNDS} round(s) of {SECONDS} s per figure, interleaved; medians of the rounds.", ""]
    if ARGS.machine:
        lines += [f"Machine: {ARGS.machine}", ""]
    lines += ["| figure | simple | prepared | goal |", "|---|---:|---:|---|"]

    def m(name, p):
        return median(f.get((name, p), []))
    rows = [("JOBT-plans vs JOBT-tenants (rates)", lambda p: m("JOBT-plans", p) / m("JOBT-tenants", p), ">= 0.95"),
            ("JOBT-plans with weights 1 to 8 vs JOBT-tenants (rates)",
             lambda p: m("JOBT-weighted", p) / m("JOBT-tenants", p), ">= 0.95"),
            ("refusal at a tenant's own limit vs at the setting (rates)",
             lambda p: m("refuse-own", p) / m("refuse-setting", p), ">= 0.95"),
            ("refusal of a weight that does not fit vs at the setting (rates)",
             lambda p: m("refuse-weight", p) / m("refuse-setting", p), ">= 0.95"),
            (f"start()+finish() of own limit #{OVERRIDES:,} vs a tenant with none (latency, snapshot held)",
             lambda p: m(f"tenant-{OVERRIDES}", p) / m("tenant-0", p), "<= 1.25")]
    for name, fn, goal in rows:
        lines.append(f"| {name} | {fn('simple'):.2f}x | {fn('prepared'):.2f}x | {goal} |")
    lines += ["", "Rates and latencies (medians):", ""]
    for (name, p), xs in sorted(f.items()):
        lines.append(f"- {name} ({p}): {median(xs):.3f} (rounds: {', '.join(f'{x:.3f}' for x in xs)})")
    report = "\n".join(lines) + "\n"
    with open(os.path.join(ARGS.out, "plans.md"), "w") as out:
        out.write(report)
    print(report)


main()
