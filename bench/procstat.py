"""CPU of processes from /proc, for the benchmarks that divide a server's CPU by the
work done (bench/cpu.py, bench/citus.py). Linux only."""
import os

TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(pid):
    """(user, system) seconds of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) / TICK, int(fields[12]) / TICK
    except (OSError, IndexError, ValueError):
        return None


def server_pids(postmaster):
    """The postmaster and its children."""
    pids = [postmaster]
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == postmaster:
                        pids.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return pids
