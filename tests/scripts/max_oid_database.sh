#!/usr/bin/env bash
# A database whose OID is 4294967295, the largest an OID can be (0.4.1, F5; I1).
# GetNewObjectId hands that value out like any other, but 0.4.0 also used it to mark a
# removed scope counter: a counter of another database removed by DROP DATABASE then
# looked like this database's, a counter was rebuilt into it, the scope's real counter
# stayed "current" behind it, and once another scope took the removed entry over, the
# stale counter was read again and the role was admitted past its limit.
#
# The scenario is built exactly, with 16 counters (one window, see core::counters) and
# roles picked by their hashes (src/scopes.rs, `home`): r's counter of qy lands on the
# home entry h of r's counter of qx (filler counters of qy take the entries from its own
# home up to h), so that r's counter of qx lives behind it, in h + 1; r2's counter of qx
# has its home in h.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
PORT="${PORT:-$((5762 + PORT_OFFSET))}"
with_cluster max_oid "quota.scope_counters = 16"
stop_cluster "$CL"
as_pg "$PG_BIN/pg_resetwal" -o 4294967295 -D "$CL/data" >/dev/null
as_pg "$PG_BIN/pg_ctl" -D "$CL/data" -l "$CL/server.log" -w -t 60 start >/dev/null
sql -c "CREATE DATABASE qx" >/dev/null
expect_eq "database qx has OID 4294967295" 4294967295 "$(sql -c "SELECT oid FROM pg_database WHERE datname = 'qx'")"
sql -c "CREATE DATABASE qy" >/dev/null
for d in qx qy; do sql -d "$d" -c "CREATE EXTENSION pg_quota" >/dev/null; done
sql -c "DO \$\$ BEGIN FOR i IN 1..300 LOOP
          EXECUTE format('CREATE ROLE mo_%s LOGIN', i);
          EXECUTE format('ALTER ROLE mo_%s SET quota.max_active_per_role = 1', i);
          EXECUTE format('ALTER ROLE mo_%s SET quota.max_retained_per_role = 0', i);
        END LOOP; END \$\$" >/dev/null
qy=$(sql -c "SELECT oid FROM pg_database WHERE datname = 'qy'")
# The home entry of a scope, as src/scopes.rs computes it.
read -r r r2 fillers < <(sql -c "SELECT rolname || ' ' || oid FROM pg_roles WHERE rolname LIKE 'mo\_%'" | python3 -c "
import sys
M = (1 << 64) - 1
def home(db, role): return ((((db * 0x9E3779B97F4A7C15) & M) ^ ((role * 0xC2B2AE3D27D4EB4F) & M)) >> 17) % 16
roles = [(n, int(o)) for n, o in (l.split() for l in sys.stdin if l.strip())]
X, Y = 4294967295, $qy
for n, o in roles:
    h, hy = home(X, o), home(Y, o)
    d = (h - hy) % 16
    if not 1 <= d <= 8:
        continue
    fill = []
    for k in range(d):
        f = next((n2 for n2, o2 in roles if n2 != n and n2 not in fill and home(Y, o2) == (hy + k) % 16), None)
        if f is None:
            break
        fill.append(f)
    r2 = next((n2 for n2, o2 in roles if n2 != n and n2 not in fill and home(X, o2) == h), None)
    if len(fill) == d and r2:
        print(n, r2, ','.join(fill)); sys.exit(0)
print('none none none')")
check "roles fit the scenario (r $r, r2 $r2, fillers $fillers)" test "$r" != none

for f in ${fillers//,/ }; do
  as "$f" qy "SELECT quota.finish(quota.start())" "SELECT quota.finish(quota.start())" >/dev/null
done
# (qy, r) takes entry h; (qx, r) finds it taken and lives in h + 1 (a counter is built
# at a scope's second call, once its summary row exists). r ends with nothing active.
as "$r" qy "SELECT quota.finish(quota.start())" "SELECT quota.finish(quota.start())" >/dev/null
as "$r" qx "SELECT quota.finish(quota.start())" "SELECT quota.finish(quota.start())" >/dev/null
as "$r2" qx "SELECT quota.finish(quota.start())" >/dev/null
sql -c "DROP DATABASE qy" >/dev/null
# r's counter in qy is removed; r holds one ticket in qx.
expect_eq "r is admitted once in qx" t "$(as "$r" qx "SELECT quota.start('one') IS NOT NULL")"
# r2's counter takes the removed entry h.
expect_eq "r2 is admitted in qx" t "$(as "$r2" qx "SELECT quota.start('r2') IS NOT NULL")"
expect_eq "r, at its limit of 1 in qx, is refused (53400)" 53400 "$(state "$r" qx "SELECT quota.start('two')")"
expect_eq "r holds one active ticket" 1 \
  "$(sql -d qx -c "SELECT count(*) FROM quota.ledger WHERE role = '$r'::regrole AND ended_at IS NULL")"
finish_checks
