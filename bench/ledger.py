#!/usr/bin/env python3
"""The ledger's figures for issue 33 (0.6.0, "a ledger made for churn"), measured the
same way before and after the ledger's layout changes. Called by `scripts/bench
--ledger`, which builds, installs and starts the server and runs bench/setup.sql, as for
a normal run. Standard library only; Linux only (CPU from /proc).

  space     a queue load of JOBS jobs (JOBT: a transactional start in the enqueue,
            finish() in the completion) into a minimal job table (id bigserial PRIMARY
            KEY, role name NOT NULL, ticket uuid, payload text DEFAULT '{}', done
            timestamptz), 16 clients on 16 roles, in a database of its own; then a
            plain VACUUM. Bytes of pg_quota's relations (tables, indexes, TOAST) per
            retained ticket against the job table's bytes per job. Target: <= 1x.
  growth    the same load, in a fresh database, for SLICES slices of SLICE_S seconds
            with quota.retention at RETENTION_S seconds (ALTER SYSTEM, the server's
            value: the writer purges what no configured retention counts), autovacuum
            as configured: pg_quota's bytes and rows after each slice. Target: they
            stop growing.
  steady    JOBT (bench/scripts/jobt.sql on bench.jobs, 16 clients on bench_r1..16)
            CPU per job, server and clients, before and after the roles' history grows
            by HISTORY tickets (ended an hour ago, inserted below the API). Target: the
            CPU per job grows by at most 10%. The roles have no retained limit
            (bench/setup.sql), as in the runs the issue measured: this is what history
            costs the heap and the indexes; the history phase below counts it.
  history   start()+finish() (bench/scripts/pgq.sql, one client) of a role with HISTORY
            retained tickets against a role with none, both with a retained limit that
            applies (2,000,000), rounds interleaved. Target: at most 1.25x the cost.
  snapshot  start()+finish() of one role (one client), CYCLES_AFTER cycles timed before
            and after CHURN cycles run with a REPEATABLE READ snapshot held open (a
            pg_dump, a long report), the snapshot still held. Target: at most 1.25x
            the cost.
  layouts   bench/history_layouts.sql in a database of its own: quota.history's layout
            and compact ones in plain SQL, bytes per row, each added to this run's
            quota.active bytes per retained ticket (space, above) and set against its
            job table's bytes per job: what a history of that layout would reach on
            the space target. No target of its own.

Cost is the inverse of the rate (seconds per unit), so "1.25x the cost" is a rate of
0.8x. The report goes to OUT/ledger.md.
"""
import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from held_snapshot import HeldSnapshot
from pgclient import psql_runner

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
CLIENTS = 16


def parse_args():
    p = argparse.ArgumentParser()
    for a in ("--host", "--port", "--pgbin", "--out", "--datadir"):
        p.add_argument(a, required=True)
    p.add_argument("--db", default="bench")
    p.add_argument("--machine", default="")
    p.add_argument("--quick", action="store_true", help="smaller loads, to try the harness")
    return p.parse_args()


ARGS = parse_args()
JOBS = 10_000 if ARGS.quick else 100_000
HISTORY = 100_000 if ARGS.quick else 1_000_000
SLICES, SLICE_S, RETENTION_S = (3, 5, 5) if ARGS.quick else (6, 20, 10)
STEADY_S, STEADY_ROUNDS = (5, 1) if ARGS.quick else (10, 3)
# BENCH_STEADY_S=30: longer steady rounds, to see whether the "after" side's first
# rounds' extra cost ends.
if os.environ.get("BENCH_STEADY_S"):
    if not os.environ["BENCH_STEADY_S"].isdigit() or int(os.environ["BENCH_STEADY_S"]) < 1:
        sys.exit("BENCH_STEADY_S must be a whole number of seconds, at least 1")
    STEADY_S = int(os.environ["BENCH_STEADY_S"])
HISTORY_S, HISTORY_ROUNDS = (3, 1) if ARGS.quick else (10, 3)
CHURN, CYCLES_AFTER, SNAPSHOT_ROUNDS = (2_000, 1_000, 1) if ARGS.quick else (11_000, 3_000, 3)
SPACE_DB = "bench_space"
GROWTH_DB = "bench_growth"
LAYOUTS_DB = "bench_layouts"


psql = psql_runner(ARGS.pgbin, ARGS.host, ARGS.port, ARGS.db)


def pgbench(script, user, db, seconds=None, transactions=None):
    """One pgbench process, one client. Returns (transactions, seconds it ran)."""
    cmd = [os.path.join(ARGS.pgbin, "pgbench"), "-n", "-h", ARGS.host, "-p", ARGS.port,
           "-U", user, "-c", "1", "-f", script]
    cmd += ["-T", str(seconds)] if seconds else ["-t", str(transactions)]
    cmd.append(db)
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True)
    took = time.monotonic() - t0
    if res.returncode != 0:
        sys.stderr.write(res.stdout + res.stderr)
        raise SystemExit(f"pgbench failed: {' '.join(cmd)}")
    m = re.search(r"number of transactions actually processed: (\d+)", res.stdout)
    return int(m.group(1)), took


def on_roles(script, db, seconds=None, per_client=None):
    """CLIENTS pgbench processes, one client each, as bench_r1..bench_rN. Returns the
    transactions done and the wall time."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=CLIENTS) as ex:
        futs = [ex.submit(pgbench, script, f"bench_r{i + 1}", db, seconds, per_client)
                for i in range(CLIENTS)]
        done = sum(f.result()[0] for f in futs)
    return done, time.monotonic() - t0


# --- CPU, from /proc ---------------------------------------------------------------------
TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    # The fields after the command (which may hold spaces), from field 3 on.
    return text[text.rindex(")") + 2:].split()


def server_cpu():
    """CPU seconds of the whole server: the postmaster, its children that exited (its
    cutime and cstime, once it has reaped them) and its live children."""
    with open(os.path.join(ARGS.datadir, "postmaster.pid")) as f:
        pm = int(f.readline())
    f = _stat(pm)
    total = sum(int(x) for x in f[11:15])  # utime stime cutime cstime
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == pm:
            continue
        try:
            s = _stat(int(d))
        except OSError:
            continue
        if int(s[1]) == pm:  # ppid
            total += int(s[11]) + int(s[12])
    return total / TICK


def clients_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Cpu:
    def __enter__(self):
        self.s, self.c = server_cpu(), clients_cpu()
        return self

    def __exit__(self, *exc):
        time.sleep(0.5)  # the backends of the finished clients exit and are reaped
        self.server = server_cpu() - self.s
        self.clients = clients_cpu() - self.c


# --- the figures -------------------------------------------------------------------------
def quota_bytes(db):
    """Bytes of pg_quota's relations in db (tables with their indexes and TOAST), and
    per relation."""
    rows = psql("SELECT c.relname, pg_catalog.pg_total_relation_size(c.oid) FROM pg_catalog.pg_class c "
                "WHERE c.relnamespace = 'quota'::regnamespace AND c.relkind IN ('r', 'p') ORDER BY 1", db=db)
    per = {}
    for line in rows.splitlines():
        name, size = line.split("|")
        per[name] = int(size)
    return sum(per.values()), per


def ledger_tables(db):
    """The ledger's tables: quota.active and quota.history (0.6.0), or the one table
    quota.ledger of the older layouts."""
    split = psql("SELECT to_regclass('quota.history') IS NOT NULL", db=db) == "t"
    return ["quota.active", "quota.history"] if split else ["quota.ledger"]


def ended_table(db):
    """Where rows of ended tickets go when written by hand."""
    return ledger_tables(db)[-1]


def index_sizes(db, schema_table):
    rows = psql("SELECT i.indexrelid::regclass, pg_catalog.pg_relation_size(i.indexrelid) FROM pg_catalog.pg_index i "
                f"WHERE i.indrelid = '{schema_table}'::regclass ORDER BY 1", db=db)
    return [tuple(line.split("|")) for line in rows.splitlines()]


def retained(db):
    return int(psql("SELECT coalesce(sum(retained), 0) FROM quota.usage", db=db))


def minjobs_script():
    f = tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False, dir=ARGS.out)
    f.write("-- JOBT on the minimal job table of issue 33's space target.\n"
            "INSERT INTO bench.minjobs (ticket) VALUES (quota.start('job', transactional => true)) RETURNING id \\gset\n"
            "UPDATE bench.minjobs SET done = now() WHERE id = :id AND quota.finish(ticket);\n")
    f.close()
    return f.name


def ensure_queue_db(db):
    """A database of its own for a queue load: pg_quota and the minimal job table."""
    psql(f"DROP DATABASE IF EXISTS {db}")
    psql(f"CREATE DATABASE {db}")
    for sql in ("CREATE EXTENSION pg_quota", "CREATE SCHEMA bench",
                "CREATE TABLE bench.minjobs (id bigserial PRIMARY KEY, role name NOT NULL DEFAULT current_user, "
                "ticket uuid, payload text DEFAULT '{}', done timestamptz)",
                "GRANT USAGE ON SCHEMA bench TO PUBLIC",
                "GRANT SELECT, INSERT, UPDATE, DELETE ON bench.minjobs TO PUBLIC",
                "GRANT USAGE ON SEQUENCE bench.minjobs_id_seq TO PUBLIC"):
        psql(sql, db=db)


def space(script):
    ensure_queue_db(SPACE_DB)
    done, took = on_roles(script, SPACE_DB, per_client=JOBS // CLIENTS)
    psql("VACUUM", db=SPACE_DB)
    total, per = quota_bytes(SPACE_DB)
    kept = retained(SPACE_DB)
    jobs_bytes = int(psql("SELECT pg_catalog.pg_total_relation_size('bench.minjobs')", db=SPACE_DB))
    jobs = int(psql("SELECT count(*) FROM bench.minjobs", db=SPACE_DB))
    return dict(done=done, rate=done / took, quota=total, per=per, retained=kept,
                ledger_indexes=[x for t in ledger_tables(SPACE_DB) for x in index_sizes(SPACE_DB, t)],
                jobs_bytes=jobs_bytes, jobs=jobs)


def growth(script):
    # A fresh database: in the space phase's, the files are sized for its load already.
    ensure_queue_db(GROWTH_DB)
    psql(f"ALTER SYSTEM SET quota.retention = '{RETENTION_S}s'")
    psql("SELECT pg_catalog.pg_reload_conf()")
    time.sleep(1)
    out = []
    try:
        for k in range(SLICES):
            done, _ = on_roles(script, GROWTH_DB, seconds=SLICE_S)
            total, _ = quota_bytes(GROWTH_DB)
            rows = int(psql("SELECT count(*) FROM quota.tickets", db=GROWTH_DB))
            out.append(dict(slice=k + 1, jobs=done, bytes=total, rows=rows))
            print(f"  growth: slice {k + 1}: {done} jobs, pg_quota {total:,} bytes, {rows:,} tickets", flush=True)
    finally:
        # Put the server's retention back (scripts/bench starts a new cluster each run,
        # so no earlier value is lost); a failure here must not hide the one above.
        try:
            psql("ALTER SYSTEM RESET quota.retention")
            psql("SELECT pg_catalog.pg_reload_conf()")
        except SystemExit as e:
            print(f"  growth: could not reset quota.retention: {e}", file=sys.stderr, flush=True)
    return out


def add_history(roles, n):
    """n tickets that ended an hour ago, spread over roles, inserted below the API (the
    ledger's summary is emptied by its trigger and counted afresh when next needed)."""
    each = n // len(roles)
    for r in roles:
        psql(f"INSERT INTO {ended_table(ARGS.db)} (id, role, label, started_at, ended_at, outcome) "
             f"SELECT gen_random_uuid(), '{r}'::regrole, 'history', now() - interval '2 hours', "
             f"now() - interval '1 hour', 'succeeded' FROM generate_series(1, {each})")
    psql("VACUUM ANALYZE " + ", ".join(ledger_tables(ARGS.db)))


def jobt_cpu(rounds, tag):
    out = []
    for k in range(rounds):
        with Cpu() as cpu:
            done, _ = on_roles(os.path.join(SCRIPTS, "jobt.sql"), ARGS.db, seconds=STEADY_S)
        out.append(dict(jobs=done, server_us=cpu.server / done * 1e6, clients_us=cpu.clients / done * 1e6))
        print(f"  steady ({tag}), round {k + 1}: {done} jobs, CPU {out[-1]['server_us']:.0f} + "
              f"{out[-1]['clients_us']:.0f} us/job", flush=True)
    return out


def settle():
    """No work of the earlier phases left running (their databases' cleanup would be
    counted as the server's CPU): they are dropped, autovacuum has nothing in progress,
    and a checkpoint has written what they dirtied."""
    for db in (SPACE_DB, GROWTH_DB):
        psql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    for _ in range(120):
        if psql("SELECT count(*) FROM pg_stat_progress_vacuum") == "0":
            break
        time.sleep(0.5)
    psql("CHECKPOINT")


def steady_side(tag):
    """Both sides start alike: the database VACUUMed (add_history's VACUUM of the
    ledger's tables came before the "after" side only), a CHECKPOINT with no vacuum in
    progress (the history's INSERT writes hundreds of MB of WAL, which started a
    checkpoint by WAL volume during the "after" rounds, every page they touched first
    written whole to the WAL again), and a warm-up round. Autovacuum is not held off:
    before the history is added its thresholds are low (small tables), so it may run
    during the "before" rounds, and its CPU counts there."""
    psql("VACUUM ANALYZE")
    settle()
    jobt_cpu(1, f"warm-up {tag}")
    return jobt_cpu(STEADY_ROUNDS, tag)


def steady():
    before = steady_side("before")
    t0 = time.monotonic()
    add_history([f"bench_r{i + 1}" for i in range(CLIENTS)], HISTORY)
    print(f"  steady: {HISTORY:,} tickets of history added in {time.monotonic() - t0:.0f} s", flush=True)
    after = steady_side("after")
    return before, after


def history():
    for role in ("bench_hist_full", "bench_hist_none"):
        psql(f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN "
             f"CREATE ROLE {role} LOGIN; END IF; END $$")
        psql(f"ALTER ROLE {role} SET quota.max_active_per_role = 1000")
        psql(f"ALTER ROLE {role} SET quota.max_retained_per_role = 2000000")
    add_history(["bench_hist_full"], HISTORY)
    script = os.path.join(SCRIPTS, "pgq.sql")
    for role in ("bench_hist_full", "bench_hist_none"):
        pgbench(script, role, ARGS.db, seconds=2)  # warm-up: counters, caches
    rates = {"bench_hist_full": [], "bench_hist_none": []}
    for k in range(HISTORY_ROUNDS):
        order = ["bench_hist_full", "bench_hist_none"][::1 if k % 2 == 0 else -1]
        for role in order:
            done, took = pgbench(script, role, ARGS.db, seconds=HISTORY_S)
            rates[role].append(done / took)
            print(f"  history: round {k + 1}: {role}: {done / took:.0f} start+finish/s", flush=True)
    return rates


def snapshot():
    role = "bench_snap"
    psql(f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN "
         f"CREATE ROLE {role} LOGIN; END IF; END $$")
    psql(f"ALTER ROLE {role} SET quota.max_active_per_role = 1000")
    psql(f"ALTER ROLE {role} SET quota.max_retained_per_role = 0")
    script = os.path.join(SCRIPTS, "pgq.sql")
    out = []
    for k in range(SNAPSHOT_ROUNDS):
        psql("VACUUM " + ", ".join(ledger_tables(ARGS.db)))
        pgbench(script, role, ARGS.db, transactions=500)  # warm-up
        done, took = pgbench(script, role, ARGS.db, transactions=CYCLES_AFTER)
        before = done / took
        with HeldSnapshot(ARGS.pgbin, ARGS.host, ARGS.port, ARGS.db, psql, "bench_ledger_snapshot"):
            pgbench(script, role, ARGS.db, transactions=CHURN)
            done, took = pgbench(script, role, ARGS.db, transactions=CYCLES_AFTER)
            after = done / took
        out.append((before, after))
        print(f"  snapshot: round {k + 1}: {before:.0f} start+finish/s before, {after:.0f} after "
              f"{CHURN:,} cycles behind a held snapshot", flush=True)
    return out


# --- the report --------------------------------------------------------------------------
def layouts():
    """bench/history_layouts.sql in a fresh database: ([(table, relation, bytes per row)],
    None), or ([], why) where it failed: the phase has no target, and the report of the
    run's other phases is kept."""
    try:
        psql(f"DROP DATABASE IF EXISTS {LAYOUTS_DB}")
        psql(f"CREATE DATABASE {LAYOUTS_DB}")
        try:
            out = psql(None, db=LAYOUTS_DB, file=os.path.join(HERE, "history_layouts.sql"))
        finally:
            psql(f"DROP DATABASE IF EXISTS {LAYOUTS_DB}")
    except SystemExit as e:  # psql() ends a run so; this phase must not
        lines = str(e).splitlines()
        return [], ([line for line in lines if "ERROR" in line] or lines or ["?"])[0]
    return [tuple(line.split("|")) for line in out.splitlines() if line.count("|") == 2], None


def report(sp, gr, st, hi, sn, la, seconds):
    med = statistics.median
    lines = ["# The ledger's figures (issue 33)", ""]
    if ARGS.machine:
        lines += [f"Machine: {ARGS.machine}", ""]
    version = psql("SELECT extversion FROM pg_extension WHERE extname = 'pg_quota'")
    lines += [f"pg_quota {version}{' (--quick: smaller loads)' if ARGS.quick else ''}; run time {seconds:.0f} s. "
              "Cost is the inverse of a rate; ratios are within this run.", ""]
    targets = []

    per_ticket = sp["quota"] / max(1, sp["retained"])
    per_job = sp["jobs_bytes"] / max(1, sp["jobs"])
    lines += ["## Space", "",
              f"{sp['done']:,} JOBT jobs into the minimal job table ({sp['rate']:.0f} jobs/s, 16 clients on 16 roles), "
              "then a plain VACUUM of the database.", "",
              "| relation | bytes | per retained ticket |", "|---|---:|---:|"]
    for name, size in sp["per"].items():
        lines.append(f"| quota.{name} | {size:,} | {size / max(1, sp['retained']):.0f} |")
    for name, size in sp["ledger_indexes"]:
        lines.append(f"| (index {name}) | {int(size):,} | {int(size) / max(1, sp['retained']):.0f} |")
    lines += [f"| pg_quota, all ({sp['retained']:,} retained tickets) | {sp['quota']:,} | {per_ticket:.0f} |",
              f"| bench.minjobs ({sp['jobs']:,} jobs; per job) | {sp['jobs_bytes']:,} | {per_job:.0f} |", ""]
    targets.append(("space: pg_quota bytes per retained ticket vs the job table's per job",
                    per_ticket / per_job, "<=", 1.0))

    rows, failed = la
    lines += ["## Layouts in plain SQL", "",
              "bench/history_layouts.sql: 100,000 ended tickets of 16 roles in turn, inserted by one writer in "
              "the order they end with the indexes in place, then a VACUUM; bytes per row.", ""]
    if failed:
        lines += [f"Not measured: the script failed ({failed.splitlines()[0] if failed.strip() else '?'}).", ""]
    else:
        lines += ["| table | relation | bytes per row |", "|---|---|---:|"]
        lines += [f"| {t} | {r} | {b} |" for t, r, b in rows]
        lines += [""]
    script_jobs = next((float(b) for t, r, b in rows if t == "jobs" and r == "(all)"), None)
    if rows and "active" in sp["per"] and script_jobs:
        active = sp["per"]["active"] / max(1, sp["retained"])
        lines += [f"Each history layout with this run's quota.active ({active:.0f} bytes per retained ticket), "
                  f"against this run's job table ({per_job:.0f} bytes per job) and against the script's "
                  f"({script_jobs:.0f}, written as its history is):", "",
                  "| history layout | its bytes per row | with quota.active | vs the run's job table "
                  "| vs the script's |", "|---|---:|---:|---:|---:|"]
        for t, r, b in rows:
            if r == "(all)" and t.startswith(("history", "compact")):
                with_active = float(b) + active
                lines.append(f"| {t} | {float(b):.0f} | {with_active:.0f} | {with_active / per_job:.2f}x "
                             f"| {with_active / script_jobs:.2f}x |")
        lines += [""]
    elif rows and "active" not in sp["per"]:
        lines += ["No quota.active in this layout (one ledger table): the layouts are not added to it.", ""]

    lines += ["## Growth under a short retention", "",
              f"The same load, {SLICES} slices of {SLICE_S} s, quota.retention = {RETENTION_S} s (server), "
              "autovacuum as configured.", "",
              "| slice | jobs | pg_quota bytes | tickets in the ledger |", "|---:|---:|---:|---:|"]
    for g in gr:
        lines.append(f"| {g['slice']} | {g['jobs']:,} | {g['bytes']:,} | {g['rows']:,} |")
    # Whether it stopped growing: the bytes after the last slice against two slices
    # before (the last 2 * SLICE_S seconds, several retention periods), and where it
    # settled, per ticket the ledger then held.
    back = gr[-3]["bytes"] if len(gr) >= 3 else gr[0]["bytes"]
    settled = gr[-1]["bytes"] / max(1, gr[-1]["rows"])
    lines += ["", f"The last slice against two before it: {gr[-1]['bytes'] / max(1, back):.2f}x the bytes; "
              f"after the last slice, {settled:,.0f} bytes per ticket in the ledger.", ""]
    targets.append((f"growth: bytes after the last slice vs two slices ({2 * SLICE_S} s) before (stopped: ~1.0)",
                    gr[-1]["bytes"] / max(1, back), "<=", 1.05))

    b = med([r["server_us"] + r["clients_us"] for r in st[0]])
    a = med([r["server_us"] + r["clients_us"] for r in st[1]])
    lines += ["## Steady: JOBT CPU per job as history grows", "",
              f"JOBT, 16 clients on 16 roles, {STEADY_S} s rounds, CPU of the server and the clients per job, "
              f"before and after {HISTORY:,} tickets of history were added to the 16 roles; each side "
              "after a VACUUM ANALYZE of the database, a CHECKPOINT with no vacuum in progress, and a warm-up round.", "",
              "| | rounds (server + clients us/job) | median us/job |", "|---|---|---:|",
              "| before | " + ", ".join(f"{r['server_us']:.0f} + {r['clients_us']:.0f}" for r in st[0]) + f" | {b:.0f} |",
              "| after | " + ", ".join(f"{r['server_us']:.0f} + {r['clients_us']:.0f}" for r in st[1]) + f" | {a:.0f} |",
              "", f"After against before: {a / b:.2f}x.", ""]
    targets.append((f"steady: JOBT CPU per job after +{HISTORY:,} history vs before", a / b, "<=", 1.10))

    full, none = med(hi["bench_hist_full"]), med(hi["bench_hist_none"])
    lines += ["## Flat in history", "",
              f"start()+finish(), one client, {HISTORY_S} s rounds interleaved; retained limit 2,000,000 for both roles.", "",
              "| role | start+finish/s per round | median |", "|---|---|---:|",
              f"| {HISTORY:,} retained tickets | " + ", ".join(f"{x:.0f}" for x in hi["bench_hist_full"]) + f" | {full:.0f} |",
              "| none | " + ", ".join(f"{x:.0f}" for x in hi["bench_hist_none"]) + f" | {none:.0f} |",
              "", f"Cost with history against without: {none / full:.2f}x.", ""]
    targets.append((f"history: start+finish cost, {HISTORY:,} retained vs none", none / full, "<=", 1.25))

    ratio = med([bf / af for bf, af in sn])
    lines += ["## Flat under an old snapshot", "",
              f"start()+finish() of one role, one client: {CYCLES_AFTER:,} cycles timed before, then {CHURN:,} cycles "
              f"with a REPEATABLE READ snapshot held, then {CYCLES_AFTER:,} cycles timed, the snapshot still held.", "",
              "| round | before /s | after /s | cost after vs before |", "|---:|---:|---:|---:|"]
    for k, (bf, af) in enumerate(sn):
        lines.append(f"| {k + 1} | {bf:.0f} | {af:.0f} | {bf / af:.2f}x |")
    lines += [""]
    targets.append((f"snapshot: start+finish cost after {CHURN:,} cycles behind a held snapshot vs before",
                    ratio, "<=", 1.25))

    lines += ["## Targets", "", "| target | figure | goal | met |", "|---|---:|---:|---|"]
    for name, value, op, goal in targets:
        ok = value <= goal
        lines.append(f"| {name} | {value:.2f} | {op} {goal} | {'yes' if ok else 'no'} |")
    return "\n".join(lines) + "\n"


def main():
    os.makedirs(ARGS.out, exist_ok=True)
    t0 = time.monotonic()
    script = minjobs_script()
    try:
        print("space ...", flush=True)
        sp = space(script)
        print(f"  {sp['retained']:,} retained tickets take {sp['quota']:,} bytes; "
              f"{sp['jobs']:,} jobs {sp['jobs_bytes']:,}", flush=True)
        print("growth ...", flush=True)
        gr = growth(script)
        print("steady ...", flush=True)
        st = steady()
        print("history ...", flush=True)
        hi = history()
        print("snapshot ...", flush=True)
        sn = snapshot()
        print("layouts ...", flush=True)
        la = layouts()
    finally:
        os.unlink(script)
    text = report(sp, gr, st, hi, sn, la, time.monotonic() - t0)
    with open(os.path.join(ARGS.out, "ledger.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
