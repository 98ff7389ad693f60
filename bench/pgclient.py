"""The psql helper the bench drivers share (bench/run.py, bench/ledger.py, bench/plans.py).
Standard library only."""
import os
import subprocess


def psql_runner(pgbin, host, port, default_db):
    """A function psql(sql, user='postgres', db=None, file=None) that runs one statement
    (or, with `file`, that script, quietly: no command tags) through psql -At against the
    bench server and returns its output, stripped; a failure ends the run with psql's
    error."""
    def psql(sql, user="postgres", db=None, file=None):
        what = ["-q", "-f", file] if file else ["-c", sql]
        out = subprocess.run(
            [os.path.join(pgbin, "psql"), "-X", "-At", "-v", "ON_ERROR_STOP=1",
             "-h", host, "-p", str(port), "-U", user, "-d", db or default_db, *what],
            capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"psql failed: {file or sql}\n{out.stderr}")
        return out.stdout.strip()
    return psql


def protocol_script(scripts, script, protocol):
    """SCRIPT (a file name in the directory SCRIPTS), or its variant for pgbench's
    -M PROTOCOL where it has one (a \\gset value that simple mode needs quoted is a
    parameter under -M prepared)."""
    variant = script.replace(".sql", f"_{protocol}.sql")
    return variant if os.path.exists(os.path.join(scripts, variant)) else script
