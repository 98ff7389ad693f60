"""A session that holds a REPEATABLE READ snapshot open, as pg_dump or an idle reporting
session does, so that no row version dead since then can be pruned. Shared by
bench/run.py and bench/ledger.py. Standard library only."""
import os
import subprocess
import time


class HeldSnapshot:
    """`with HeldSnapshot(...):` holds the snapshot for the block. `psql(sql)` runs one
    query as a superuser in any database and returns its output (the caller's helper)."""

    def __init__(self, pgbin, host, port, db, psql, name="bench_snapshot"):
        self.pgbin, self.host, self.port, self.db = pgbin, host, port, db
        self.psql, self.name = psql, name

    def __enter__(self):
        self.proc = subprocess.Popen(
            [os.path.join(self.pgbin, "psql"), "-X", "-q", "-h", self.host, "-p", self.port,
             "-U", "postgres", "-d", self.db],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
        self.proc.stdin.write(f"SET application_name = '{self.name}';\n"
                              "BEGIN ISOLATION LEVEL REPEATABLE READ;\n"
                              "SELECT count(*) FROM quota.usage;\n")
        self.proc.stdin.flush()
        for _ in range(200):
            if self.psql(f"SELECT count(*) FROM pg_stat_activity WHERE application_name = '{self.name}'"
                         " AND state = 'idle in transaction' AND backend_xmin IS NOT NULL") == "1":
                return self
            time.sleep(0.05)
        raise SystemExit("the snapshot holder did not start")

    def __exit__(self, *exc):
        self.proc.stdin.write("COMMIT;\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
