#!/usr/bin/env bash
# Charges follow role names, not role OIDs (I9). A pg_dump -Fc of one cluster restored
# into another cluster, where the same roles were created in another order and so have
# other OIDs, gives every role back its own active and retained tickets: each can
# finish its restored tickets as itself, and each role's limit still counts them. And a
# dropped role leaves nothing behind: once start() has run in the database afterwards,
# no ledger or summary row carries the dropped role's OID, where a role created later
# with the same OID would inherit it. 0.7.0: the tenants' own limits
# (quota.set_tenant_limits()) follow role names the same way, and are purged with a
# dropped role, also one that has no tickets.
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5620 + PORT_OFFSET))}"
PORT2="${PORT2:-$((5621 + PORT_OFFSET))}"
with_cluster dump_restore_roles
CL1="$CL"
CL2="$(dirname "$CL1")/dump_restore_roles_2"
new_cluster "$CL2" "$PORT2"

# on 1|2 USER DB SQL...: one session of USER on cluster 1 or 2, output only.
on() {
  local c="$1" user="$2" db="$3"; shift 3; local a=() q dir port
  if [ "$c" = 1 ]; then dir="$CL1" port="$PORT"; else dir="$CL2" port="$PORT2"; fi
  for q in "$@"; do a+=(-c "$q"); done
  timeout 20 "$PG_BIN/psql" -X -q -At -h "$dir" -p "$port" -U "$user" -d "$db" -v ON_ERROR_STOP=0 "${a[@]}" 2>/dev/null || true
}
state() {  # state 1|2 USER DB SQL...: the SQLSTATE of the last statement
  on "$@" '\echo SQLSTATE=:SQLSTATE' | sed -n 's/^SQLSTATE=//p' | tail -n1
}
su1() { on 1 postgres "$@"; }
su2() { on 2 postgres "$@"; }
# Per role name: active and rows in the ledger, as "name|active|rows" lines.
by_name() {  # by_name 1|2 DB
  on "$1" postgres "$2" "SELECT role::regrole::text || '|' || count(*) FILTER (WHERE ended_at IS NULL) || '|' || count(*)
                           FROM quota.ledger GROUP BY role::regrole::text ORDER BY 1" | paste -sd' '
}
usage_by_name() {  # usage_by_name 1|2 DB
  on "$1" postgres "$2" "SELECT role::regrole::text || '|' || active || '|' || retained FROM quota.usage ORDER BY 1" | paste -sd' '
}
# The role limits are cluster-wide settings, which pg_dump of a database does not
# carry; a DBA sets them again on the new cluster (pg_dumpall --globals would).
role_settings() {
  cat <<'SQL'
ALTER ROLE r_a SET quota.max_active_per_role = 3;
ALTER ROLE r_b SET quota.max_active_per_role = 2;
ALTER ROLE r_c SET quota.max_active_per_role = 0;
ALTER ROLE r_c SET quota.max_retained_per_role = 4;
SQL
}

# ------------------------------------------------------------------------------------
# Cluster 1: r_a, r_b, r_c in that order, each with its own mix of tickets.
# ------------------------------------------------------------------------------------
su1 postgres "CREATE ROLE r_a LOGIN" "CREATE ROLE r_b LOGIN" "CREATE ROLE r_c LOGIN" \
    "CREATE DATABASE qdb" >/dev/null
su1 postgres "$(role_settings)" >/dev/null
su1 qdb "CREATE EXTENSION pg_quota" >/dev/null
# r_a: 3 active (its limit) and 1 ended; r_b: 1 active and 2 ended; r_c: 0 active and
# 3 ended, one below its retained limit of 4.
on 1 r_a qdb "SELECT quota.finish(quota.start('a ended'))" >/dev/null
on 1 r_a qdb "SELECT quota.start('a ' || i) FROM generate_series(1, 3) i" > "$CL1/a_active"
on 1 r_b qdb "SELECT quota.finish(quota.start('b ended ' || i), 'failed') FROM generate_series(1, 2) i" >/dev/null
on 1 r_b qdb "SELECT quota.start('b 1')" > "$CL1/b_active"
on 1 r_c qdb "SELECT quota.finish(quota.start('c ended ' || i)) FROM generate_series(1, 3) i" >/dev/null
mapfile -t A_ACTIVE < "$CL1/a_active"
mapfile -t B_ACTIVE < "$CL1/b_active"
SRC=$(by_name 1 qdb)
expect_eq "cluster 1 holds each role's tickets" "r_a|3|4 r_b|1|3 r_c|0|3" "$SRC"
expect_eq "r_a is at its active limit in cluster 1" 53400 "$(state 1 r_a qdb "SELECT quota.start('over')")"
# 0.7.0: tenants' own limits, by role name.
su1 qdb "SELECT quota.set_tenant_limits('gold', max_active => 1, role => 'r_c')" \
        "SELECT quota.set_tenant_limits('free', max_active => 0, max_retained => 7, role => 'r_b')" >/dev/null
limits_by_name() {  # limits_by_name 1|2 DB
  on "$1" postgres "$2" "SELECT role::regrole::text || '|' || tenant || '|' || coalesce(max_active::text, '-') || '|' || coalesce(max_retained::text, '-')
                           FROM quota.tenant_overrides ORDER BY 1" | paste -sd' '
}
expect_eq "cluster 1 holds the tenants' own limits" "r_b|free|0|7 r_c|gold|1|-" "$(limits_by_name 1 qdb)"
OIDS1=$(su1 qdb "SELECT string_agg(rolname || '=' || oid, ' ' ORDER BY rolname) FROM pg_roles WHERE rolname IN ('r_a', 'r_b', 'r_c')")

as_pg timeout 60 "$PG_BIN/pg_dump" -h "$CL1" -p "$PORT" -U postgres -Fc -d qdb -f "$CL1/qdb.dump"

# ------------------------------------------------------------------------------------
# Cluster 2: unrelated roles first, then the same names in another order.
# ------------------------------------------------------------------------------------
su2 postgres "CREATE ROLE unrelated_1" "CREATE ROLE unrelated_2 LOGIN" "CREATE ROLE unrelated_3" \
    "CREATE ROLE r_c LOGIN" "CREATE ROLE unrelated_4" "CREATE ROLE r_b LOGIN" "CREATE ROLE r_a LOGIN" \
    "CREATE DATABASE qdb" >/dev/null
su2 postgres "$(role_settings)" >/dev/null
OIDS2=$(su2 qdb "SELECT string_agg(rolname || '=' || oid, ' ' ORDER BY rolname) FROM pg_roles WHERE rolname IN ('r_a', 'r_b', 'r_c')")
check "the roles have other OIDs in cluster 2 ($OIDS1 / $OIDS2)" \
  test "$(su2 qdb "SELECT count(*) FROM pg_roles WHERE (rolname, oid::text) IN
                     (SELECT split_part(x, '=', 1), split_part(x, '=', 2) FROM unnest(string_to_array('$OIDS1', ' ')) x)")" = 0
restore_out=$(as_pg timeout 60 "$PG_BIN/pg_restore" -h "$CL2" -p "$PORT2" -U postgres -d qdb --exit-on-error "$CL1/qdb.dump" 2>&1) \
  && restored=0 || restored=$?
check "pg_restore into cluster 2 succeeds${restore_out:+: $(head -c 300 <<<"$restore_out")}" test "$restored" = 0

expect_eq "each role has its own active and total tickets in cluster 2 (by name)" "$SRC" "$(by_name 2 qdb)"
expect_eq "quota.usage shows the same roles and counts in both clusters" "$(usage_by_name 1 qdb)" "$(usage_by_name 2 qdb)"
expect_eq "no restored ledger row names a role that does not exist" 0 \
  "$(su2 qdb "SELECT count(*) FROM quota.ledger l WHERE NOT EXISTS (SELECT 1 FROM pg_roles r WHERE r.oid = l.role::oid)")"
expect_eq "no restored summary row names a role that does not exist" 0 \
  "$(su2 qdb "SELECT count(*) FROM quota.summary s WHERE NOT EXISTS (SELECT 1 FROM pg_roles r WHERE r.oid = s.role::oid)")"
expect_eq "the tenants' own limits follow the role names into cluster 2" "r_b|free|0|7 r_c|gold|1|-" "$(limits_by_name 2 qdb)"
expect_eq "the unrelated roles got no tickets" 0 \
  "$(su2 qdb "SELECT count(*) FROM quota.ledger WHERE role::regrole::text LIKE 'unrelated%'")"

# Each role finishes one of its restored tickets, as itself.
expect_eq "r_a finishes its restored ticket in cluster 2" t "$(on 2 r_a qdb "SELECT quota.finish('${A_ACTIVE[0]:-00000000-0000-0000-0000-000000000000}')")"
expect_eq "r_b finishes its restored ticket in cluster 2" t "$(on 2 r_b qdb "SELECT quota.finish('${B_ACTIVE[0]:-00000000-0000-0000-0000-000000000000}', 'cancelled')")"
c_ticket=$(su2 qdb "SELECT id FROM quota.ledger WHERE role::regrole::text = 'r_c' ORDER BY started_at LIMIT 1")
expect_eq "r_c's restored ended ticket is its own: finish() returns false, not an error" "f|00000" \
  "$(on 2 r_c qdb "SELECT quota.finish('${c_ticket:-00000000-0000-0000-0000-000000000000}')" '\echo :SQLSTATE' | paste -sd'|')"
expect_eq "another role cannot finish r_a's restored ticket (42501)" 42501 \
  "$(state 2 r_b qdb "SELECT quota.finish('${A_ACTIVE[1]:-00000000-0000-0000-0000-000000000000}')")"

# The limits count the restored tickets of each role.
expect_eq "r_a (2 of 3 active after its finish) is admitted once" t "$(on 2 r_a qdb "SELECT quota.start('a new') IS NOT NULL")"
expect_eq "... and then refused at its limit of 3" 53400 "$(state 2 r_a qdb "SELECT quota.start('a over')")"
expect_eq "r_b (0 of 2 active) is admitted twice" "t t" "$(on 2 r_b qdb "SELECT quota.start('b new 1') IS NOT NULL" "SELECT quota.start('b new 2') IS NOT NULL" | paste -sd' ')"
expect_eq "... and then refused at its limit of 2" 53400 "$(state 2 r_b qdb "SELECT quota.start('b over')")"
expect_eq "r_c (3 of 4 retained) is admitted once" t "$(on 2 r_c qdb "SELECT quota.finish(quota.start('c new'))")"
out=$(timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL2" -p "$PORT2" -U r_c -d qdb -v VERBOSITY=verbose \
        -c "SELECT quota.start('c over')" 2>&1 || true)
check "... and then refused at its retained limit of 4, counting its restored tickets" \
  grep -q 'ERROR:  53400: role "r_c" has 4 retained tickets' <<<"$out"
expect_eq "cluster 2's ledger after the new work" "r_a|3|5 r_b|2|5 r_c|0|4" "$(by_name 2 qdb)"

# ------------------------------------------------------------------------------------
# A dropped role's rows are purged (cluster 2).
# ------------------------------------------------------------------------------------
su2 qdb "CREATE ROLE r_x LOGIN" "CREATE ROLE r_y" >/dev/null
su2 qdb "SELECT quota.set_tenant_limits('t', max_active => 3, role => 'r_x')" \
        "SELECT quota.set_tenant_limits('t', max_active => 4, role => 'r_y')" >/dev/null
YOID=$(su2 qdb "SELECT oid FROM pg_roles WHERE rolname = 'r_y'")
on 2 r_x qdb "SELECT quota.finish(quota.start('x ended'))" "SELECT quota.start('x active ' || i) FROM generate_series(1, 2) i" >/dev/null
XOID=$(su2 qdb "SELECT oid FROM pg_roles WHERE rolname = 'r_x'")
expect_eq "r_x holds 2 active and 3 retained tickets" "r_x|2|3" \
  "$(su2 qdb "SELECT role::regrole::text || '|' || active || '|' || retained FROM quota.usage WHERE role::regrole::text = 'r_x'")"
su2 qdb "DROP ROLE r_x" "DROP ROLE r_y" >/dev/null
expect_eq "r_x is dropped" 0 "$(su2 qdb "SELECT count(*) FROM pg_roles WHERE rolname = 'r_x'")"
# Any start() afterwards lets the writer purge; give it up to ~5 s.
leftover() {
  su2 qdb "SELECT (SELECT count(*) FROM quota.ledger WHERE role::oid = $XOID)
                  + (SELECT count(*) FROM quota.summary WHERE role::oid = $XOID)
                  + (SELECT count(*) FROM quota.tenant_overrides WHERE role::oid IN ($XOID, $YOID))"
}
su2 qdb "SELECT quota.start('after drop')" >/dev/null
for i in $(seq 1 20); do
  [ "$(leftover)" = 0 ] && break
  [ $((i % 4)) = 0 ] && su2 qdb "SELECT quota.start('after drop ' || $i)" >/dev/null
  sleep 0.25
done
expect_eq "no ledger row carries the dropped role's OID $XOID" 0 \
  "$(su2 qdb "SELECT count(*) FROM quota.ledger WHERE role::oid = $XOID")"
expect_eq "no summary row carries the dropped role's OID $XOID" 0 \
  "$(su2 qdb "SELECT count(*) FROM quota.summary WHERE role::oid = $XOID")"
expect_eq "no tenant's own limits carry the dropped roles' OIDs $XOID and $YOID (r_y had no tickets)" 0 \
  "$(su2 qdb "SELECT count(*) FROM quota.tenant_overrides WHERE role::oid IN ($XOID, $YOID)")"
expect_eq "the other roles' tenants keep their own limits" "r_b|free|0|7 r_c|gold|1|-" "$(limits_by_name 2 qdb)"
expect_eq "quota.usage shows no row for a role that no longer exists" "" \
  "$(su2 qdb "SELECT string_agg(role::regrole::text, ',') FROM quota.usage WHERE role::regrole::text ~ '^[0-9]+\$'")"
expect_eq "the other roles' tickets are untouched by the purge" "r_a|3|5 r_b|2|5 r_c|0|4" \
  "$(on 2 postgres qdb "SELECT role::regrole::text || '|' || count(*) FILTER (WHERE ended_at IS NULL) || '|' || count(*)
                          FROM quota.ledger WHERE role::regrole::text LIKE 'r\\_%' GROUP BY role::regrole::text ORDER BY 1" | paste -sd' ')"
expect_eq "the other roles are still at their limits" "53400 53400" \
  "$(state 2 r_a qdb "SELECT quota.start('a over')") $(state 2 r_b qdb "SELECT quota.start('b over')")"
# The restored tenant's own limit is enforced for its role in cluster 2.
su2 qdb "ALTER ROLE r_c SET quota.max_retained_per_role = 0" >/dev/null
expect_eq "r_c's tenant gold is admitted once in cluster 2" t "$(on 2 r_c qdb "SELECT quota.start(tenant => 'gold') IS NOT NULL")"
out=$(timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL2" -p "$PORT2" -U r_c -d qdb \
        -c "SELECT quota.start(tenant => 'gold')" 2>&1 || true)
check "... and then refused at the restored limit of 1 set for it by quota.set_tenant_limits" \
  grep -q 'tenant "gold" of role "r_c" has 1 active ticket, the limit set for the tenant by quota.set_tenant_limits' <<<"$out"
finish_checks
