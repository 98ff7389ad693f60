#!/usr/bin/env bash
# pg_quota on a Citus cluster (issue 35, 0.7.1): each tenant admitted where its shard
# lives. A coordinator and two workers on this machine, Citus 14 built from the
# vendored source (ensure_citus), every node preloading 'citus,pg_quota'. The DBA
# distributes pg_quota's start functions by their tenant argument, colocated with the
# queue's table distributed by tenant (USER_GUIDE "Citus"); then:
# - a start made alone in its statement, from any node, is run by Citus on the node
#   that holds the tenant and admitted by its ledger alone (one hop, none there);
# - a start that Citus runs where the client is (inside a transaction block without
#   force_delegation, in PL/pgSQL) is refused with 0A000 on a node that does not hold
#   the tenant, rather than admitted by a ledger that does not see its tickets;
# - with clients on every node racing, a tenant never runs more than its limit, with
#   starts alone in their statements and with the recipe of whole calls;
# - the enqueue recipe: a force-delegated transactional start and the job's INSERT in
#   one transaction, from any node, commit and roll back together;
# - the recipe of whole calls: enqueue() and complete(), distributed by tenant, each a
#   transaction local to the tenant's node, from any node;
# - a tenant's own limit, set through a distributed set_tenant_limits(), holds where it
#   is admitted;
# - quota.claim_job() and quota.finish_job() triggers on a distributed table renew and
#   finish on the tenant's node; across two nodes, the statement fails whole;
# - the tenant's node, stopped in a crash and restarted, keeps its tickets;
# - a move of the tenant's shard is refused while the tenant holds tickets or its own
#   limits on the node the shard would leave, and goes once they are gone; a start
#   that comes during a move waits for it, then is refused on the node the shard left;
# - a worker added with citus_add_node() gets pg_quota, and admits the tenants whose
#   shard moves to it;
# - a split of the tenant's shard is refused where it would place a tenant holding
#   tickets on another node, and goes where it keeps them (isolate_tenant_to_new_shard);
# - Citus' non-blocking move and split (force_logical) are refused alike;
# - a tenant's own limits on a worker refuse a split run by the tables' owner;
# - a coordinator that holds shards refuses a move or a split of its own shards alike,
#   the background rebalancer's drain of it too;
# - the coordinator's standby, promoted after a crash, serves as the coordinator;
# - nodes on two versions of pg_quota's SQL admit each tenant on its node; ALTER
#   EXTENSION pg_quota UPDATE on the coordinator then updates every node at once;
# - alter_distributed_table() of the shard count leaves every start refused (0A000)
#   until the start functions are distributed again.
# Where Citus' source is not on the machine, the suite is skipped (exit 77), not passed.
# majors: 18
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"

if ! citus_available; then
  echo "1..0 # SKIP Citus' source is not on this machine ($CITUS_TARBALL)"
  exit 77
fi
use_pg "$CITUS_MAJOR"
ensure_citus

DIR="${SCRATCH:-$(make_scratch)}/citus"
BASE=$((5870 + PORT_OFFSET))
# n I [psql args...]: psql on node I (0: the coordinator), database app.
n() { local i="$1"; shift; pgq "$DIR/n$i" $((BASE + i)) -d app -At "$@"; }
# on I USER SQL...: lib.sh's `as` on node I, database app (one session; output only,
# errors dropped); state_on I USER SQL...: its `state`, the last statement's SQLSTATE.
on() { local i="$1"; shift; CL="$DIR/n$i" PORT=$((BASE + i)) as "$1" app "${@:2}"; }
state_on() { local i="$1"; shift; CL="$DIR/n$i" PORT=$((BASE + i)) state "$1" app "${@:2}"; }

new_citus_cluster "$DIR" "$BASE"
expect_eq "CREATE EXTENSION pg_quota on the coordinator is propagated: every node has it, of one version" \
  "$(n 0 -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_quota'") x3" \
  "$(for i in 0 1 2; do n "$i" -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_quota'"; done | sort -u) x$(
     for i in 0 1 2; do n "$i" -c "SELECT 1 FROM pg_extension WHERE extname = 'pg_quota'"; done | wc -l)"

# The queue's tables, distributed by tenant; pg_quota's start functions distributed by
# their tenant argument ($5) alongside, start() force-delegated (the enqueue recipe
# calls it in the job's transaction); set_tenant_limits() by its tenant ($1); and the
# application's finish_for(), which finishes a ticket on its tenant's node.
n 0 -c "GRANT ALL ON SCHEMA public TO app" \
    -c "CREATE TABLE jobs (tenant text NOT NULL, id bigserial, ticket uuid, payload text CHECK (payload IS DISTINCT FROM 'bad'),
                           done_at timestamptz, PRIMARY KEY (tenant, id))" \
    -c "SELECT create_distributed_table('jobs', 'tenant', shard_count := 4)" \
    -c "CREATE TABLE running (tenant text NOT NULL, ticket uuid NOT NULL)" \
    -c "SELECT create_distributed_table('running', 'tenant', colocate_with := 'jobs')" \
    -c "GRANT ALL ON jobs, running, jobs_id_seq TO app" \
    -c "SELECT create_distributed_function('quota.start(text,interval,text,interval,text,boolean)', '\$5', colocate_with := 'jobs', force_delegation := true)" \
    -c "SELECT create_distributed_function('quota.try_start(text,interval,text,interval,text,boolean)', '\$5', colocate_with := 'jobs')" \
    -c "SELECT create_distributed_function('quota.try_start(integer,interval,text,interval,text,boolean,text)', '\$5', colocate_with := 'jobs')" \
    -c "SELECT create_distributed_function('quota.set_tenant_limits(text,integer,integer,regrole)', '\$1', colocate_with := 'jobs')" \
    -c "CREATE FUNCTION finish_for(tenant text, ticket uuid, outcome text DEFAULT 'succeeded') RETURNS bool
          LANGUAGE plpgsql STRICT AS 'BEGIN RETURN quota.finish(ticket, outcome); END'" \
    -c "SELECT create_distributed_function('finish_for(text,uuid,text)', '\$1', colocate_with := 'jobs')" \
    -c "ALTER ROLE app SET quota.max_active_per_tenant = 2" \
    -c "ALTER ROLE app SET quota.allow_transactional = on" >/dev/null
expect_eq "ALTER ROLE … SET on the coordinator reaches every node (Citus propagates it)" "2 2 2" \
  "$(for i in 0 1 2; do on "$i" app "SHOW quota.max_active_per_tenant"; done | xargs)"

# node_of TENANT: the node (1 or 2) that holds the tenant's shard.
node_of() {
  n 0 -c "SELECT n.nodeport - $BASE FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
           WHERE p.shardid = get_shard_id_for_distribution_column('jobs', '$1')"
}
A=""; B=""
for t in t1 t2 t3 t4 t5 t6 t7 t8 t9; do
  case "$(node_of "$t")" in
    1) [ -n "$A" ] || A="$t" ;;
    2) [ -n "$B" ] || B="$t" ;;
  esac
done
check "the tenants $A and $B live on different workers" test -n "$A" -a -n "$B"
NA=$(node_of "$A"); NB=$(node_of "$B")
# (A loop that stops at the first, not one piped into head: under pipefail an echo
# after head has gone fails the assignment, and set -e the suite.)
C=""
for t in t1 t2 t3 t4 t5 t6 t7 t8 t9; do [ "$t" = "$A" ] || [ "$t" = "$B" ] || { C="$t"; break; }; done
NC=$(node_of "$C")  # the race's tenant of whole calls
other() { echo $((3 - $1)); }  # the other worker
live() { n "$1" -c "SELECT count(*) FROM quota.ledger WHERE tenant = '$2' AND ended_at IS NULL"; }
# try I TENANT [LABEL]: a try_start() alone in its statement on node I, as app (so that
# Citus may delegate it: nothing may wrap the call); t if admitted, f if refused (NULL),
# else the error's SQLSTATE.
try() { admission "$(on "$1" app "SELECT quota.try_start(tenant => '$2', label => '${3:-try}')" '\echo SQLSTATE=:SQLSTATE')"; }
# admission OUTPUT: of a start's output followed by SQLSTATE=…, t if it gave a ticket,
# f if it gave none (NULL), else the SQLSTATE.
admission() {
  case "$1" in
    *-*SQLSTATE=00000) echo t ;;
    *SQLSTATE=00000) echo f ;;
    *) sed -n 's/.*SQLSTATE=//p' <<<"$1" ;;
  esac
}
# out_on I USER SQL: SQL on node I as USER, database app: its output, errors included,
# then SQLSTATE=… (60 s at most); sqlstate_of OUTPUT: that SQLSTATE.
out_on() {
  timeout 60 "$PG_BIN/psql" -X -q -At -h "$DIR/n$1" -p $((BASE + $1)) -U "$2" -d app -v ON_ERROR_STOP=0 \
    -c "$3" -c '\echo SQLSTATE=:SQLSTATE' 2>&1 || true
}
sqlstate_of() { sed -n 's/^SQLSTATE=//p' <<<"$1"; }
# split_to USER SHARD TENANT I J MODE: citus_split_shard_by_split_points() of SHARD as
# USER (shard_transfer_mode MODE), at TENANT's hash: the new shard that holds TENANT
# placed on node I, the other on node J. Its output, then SQLSTATE=… (out_on).
split_to() {
  local hash max point its other nodes
  read -r hash max < <(n 0 -F ' ' -c "SELECT worker_hash('$3'::text), shardmaxvalue FROM pg_dist_shard WHERE shardid = $2")
  its=$(n 0 -c "SELECT nodeid FROM pg_dist_node WHERE nodeport = $((BASE + $4))")
  other=$(n 0 -c "SELECT nodeid FROM pg_dist_node WHERE nodeport = $((BASE + $5))")
  # A split point is the first new shard's last hash: the tenant's, or, where it is
  # the old shard's last, the one before, which leaves the tenant in the second.
  if [ "$hash" -lt "$max" ]; then point=$hash; nodes="$its, $other"; else point=$((hash - 1)); nodes="$other, $its"; fi
  out_on 0 "$1" "SELECT citus_split_shard_by_split_points($2, ARRAY['$point'], ARRAY[$nodes], shard_transfer_mode := '$6')"
}
# waiting_on I TEXT: "waiting" once a session on node I whose query holds TEXT waits
# for a lock (within about 3 s), else "not-waiting".
waiting_on() {
  local _
  for _ in $(seq 60); do
    if [ "$(n "$1" -c "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%$2%' AND pid <> pg_backend_pid()")" = 1 ]; then
      echo waiting; return
    fi
    sleep 0.05
  done
  echo not-waiting
}
admitted() { n "$1" -c "SELECT coalesce(sum(admitted), 0) FROM quota.stats WHERE role = 'app'"; }

# --- a start alone in its statement runs on the tenant's node, from any node --------
got=""
for i in 0 1 2; do got+="$(try "$i" "$A" "from n$i") "; done
expect_eq "three starts for $A alone in their statements, one from each node, at its limit of 2: two admitted, one refused" \
  "f t t" "$(tr ' ' '\n' <<<"$got" | grep . | sort | xargs)"
expect_eq "all of $A's tickets are on its node (n$NA), none on the others" "2 0 0" \
  "$(live "$NA" "$A") $(live 0 "$A") $(live "$(other "$NA")" "$A")"
expect_eq "only $A's node admitted anything: no start was charged where its client was" "2 0 0" \
  "$(admitted "$NA") $(admitted 0) $(admitted "$(other "$NA")")"
expect_eq "the refusal was answered by $A's node (its refused_active)" "1 0 0" \
  "$(for i in "$NA" 0 "$(other "$NA")"; do n "$i" -c "SELECT coalesce(sum(refused_active), 0) FROM quota.stats WHERE role = 'app'"; done | xargs)"

# --- a start that Citus runs where the client is ------------------------------------
# In a transaction block try_start() (not force-delegated) runs on the client's node.
expect_eq "a start for $A in a transaction block on the coordinator is refused with 0A000, not admitted there" \
  0A000 "$(state_on 0 app "BEGIN" "SELECT quota.try_start(tenant => '$A')")"
expect_eq "… and on the other worker" \
  0A000 "$(state_on "$(other "$NA")" app "BEGIN" "SELECT quota.try_start(tenant => '$A')")"
expect_eq "… and from PL/pgSQL (a simple expression, never delegated)" \
  0A000 "$(state_on 0 app "DO \$\$BEGIN PERFORM quota.start(tenant => '$A'); END\$\$")"
msg=$(timeout 30 "$PG_BIN/psql" -X -q -At -h "$DIR/n0" -p "$BASE" -U app -d app -c "BEGIN" \
        -c "SELECT quota.try_start(tenant => '$A')" 2>&1 | grep ERROR || true)
check "its message names the tenant's node ($msg)" grep -q "tenant \"$A\" is held by node $DIR/n$NA:$((BASE + NA)), not by this one" <<<"$msg"
on "$NA" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE tenant = '$A' AND label = 'from n0'" >/dev/null
expect_eq "in a transaction block on $A's own node, the start is admitted (a freed slot)" t \
  "$(on "$NA" app "BEGIN" "SELECT quota.try_start(tenant => '$A', label => 'local') IS NOT NULL" "COMMIT")"
expect_eq "$A's tickets are still all on its node, and at its limit" "2 0 0" \
  "$(live "$NA" "$A") $(live 0 "$A") $(live "$(other "$NA")" "$A")"
expect_eq "finish_for(), distributed by tenant, finishes a ticket of $A from the coordinator" "t 1" \
  "$(on 0 app "SELECT finish_for('$A', '$(n "$NA" -c "SELECT id FROM quota.ledger WHERE tenant = '$A' AND label = 'local'")')") $(live "$NA" "$A")"

# --- starts without a tenant, and a superuser's -----------------------------------------
# Citus routes a distributed call on its tenant argument, and crashes its server on a
# NULL there; pg_quota keeps such a start from delegation: it runs where the client is.
nonull=""
for i in 0 1 2; do
  nonull+="$(state_on "$i" app "SELECT quota.try_start(label => 'no tenant n$i')")"
  nonull+=" $(state_on "$i" app "SELECT quota.try_start(tenant => NULL, label => 'null tenant n$i')") "
done
expect_eq "starts without a tenant, or with tenant => NULL, from every node: each admitted where its client is (no crash)" \
  "00000 00000 00000 00000 00000 00000 2 2 2" \
  "$(xargs <<<"$nonull") $(n 0 -c "SELECT count(*) FROM quota.ledger WHERE label LIKE '%tenant n0'") $(
     n 1 -c "SELECT count(DISTINCT label) FROM quota.ledger WHERE label LIKE '%tenant n1'") $(
     n 2 -c "SELECT count(DISTINCT label) FROM quota.ledger WHERE label LIKE '%tenant n2'")"
expect_eq "a prepared start whose tenant is a NULL parameter, executed past the generic-plan threshold, runs where its client is" \
  "00000 7" "$(state_on 0 app "PREPARE p(text) AS SELECT quota.try_start(tenant => \$1, label => 'param')" \
      "EXECUTE p(NULL)" "EXECUTE p(NULL)" "EXECUTE p(NULL)" "EXECUTE p(NULL)" "EXECUTE p(NULL)" "EXECUTE p(NULL)" "EXECUTE p(NULL)") $(
      n 0 -c "SELECT count(*) FROM quota.ledger WHERE label = 'param'")"
on 0 app "PREPARE p(text) AS SELECT quota.try_start(tenant => \$1, label => 'param tenant')" \
  "EXECUTE p('$A')" "EXECUTE p('$A')" "EXECUTE p('$A')" "EXECUTE p('$A')" "EXECUTE p('$A')" "EXECUTE p('$A')" >/dev/null
expect_eq "… and one whose tenant is a parameter with a value runs on the tenant's node, where its limit holds" \
  "0 1" "$(n 0 -c "SELECT count(*) FROM quota.ledger WHERE label = 'param tenant'") $(
          n "$NA" -c "SELECT count(*) FROM quota.ledger WHERE label = 'param tenant'")"
# The planner folds what Citus routes on: a SQL function is inlined, a default filled in.
expect_eq "a start without a tenant through a SQL function the planner inlines, alone and in FROM, and prepared with a NULL parameter: each runs where its client is (no crash)" \
  "00000 00000 00000 9" "$(state_on 0 app \
    "CREATE FUNCTION pg_temp.s(t text DEFAULT NULL) RETURNS uuid LANGUAGE sql AS 'SELECT quota.try_start(tenant => t, label => ''inlined'')'" \
    "SELECT pg_temp.s()") $(state_on 0 app \
    "CREATE FUNCTION pg_temp.s(t text DEFAULT NULL) RETURNS uuid LANGUAGE sql AS 'SELECT quota.try_start(tenant => t, label => ''inlined'')'" \
    "SELECT * FROM pg_temp.s(NULL)") $(state_on 0 app \
    "CREATE FUNCTION pg_temp.s(t text DEFAULT NULL) RETURNS uuid LANGUAGE sql AS 'SELECT quota.try_start(tenant => t, label => ''inlined'')'" \
    "PREPARE q(text) AS SELECT pg_temp.s(\$1)" "EXECUTE q(NULL)" "EXECUTE q(NULL)" "EXECUTE q(NULL)" "EXECUTE q(NULL)" \
    "EXECUTE q(NULL)" "EXECUTE q(NULL)" "EXECUTE q(NULL)") $(n 0 -c "SELECT count(*) FROM quota.ledger WHERE label = 'inlined'")"
expect_eq "… and in the forms the planner reduces to one call (WHERE true, a CTE, a subquery pulled up), and a STRICT wrapper's NULL: no crash" \
  "00000 00000 00000 00000 3" "$(state_on 0 app "SELECT quota.try_start(label => 'reduced') WHERE true") $(
     state_on 0 app "WITH c AS (SELECT 1) SELECT quota.try_start(label => 'reduced')") $(
     state_on 0 app "SELECT quota.try_start(tenant => s.t, label => 'reduced') FROM (SELECT NULL::text AS t) s") $(
     state_on 0 app "SELECT finish_for(NULL, NULL)") $(n 0 -c "SELECT count(*) FROM quota.ledger WHERE label = 'reduced'")"
# A query that reads a distributed table is Citus' to plan, whatever it starts.
# (Citus runs the subquery first, then delegates the call with its value.)
on 0 app "INSERT INTO jobs (tenant) VALUES ('$B')" >/dev/null
expect_eq "a start whose tenant a subquery reads from the jobs table is planned by Citus: admitted on $B's node, n$NB, not where its client is" \
  "00000 1 0" "$(state_on 0 app "SELECT quota.try_start(tenant => (SELECT tenant FROM jobs WHERE tenant = '$B' LIMIT 1), label => 'subquery')") $(
     n "$NB" -c "SELECT count(*) FROM quota.ledger WHERE label = 'subquery'") $(n 0 -c "SELECT count(*) FROM quota.ledger WHERE label = 'subquery'")"
on 0 app "DELETE FROM jobs WHERE tenant = '$B'" >/dev/null
on "$NB" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE label = 'subquery'" >/dev/null
expect_eq "a superuser's start is never refused (I7), off its tenant's node too: admitted where it runs" "00000 1" \
  "$(state_on 0 postgres "BEGIN" "SELECT quota.try_start(tenant => '$A')") $(live 0 "$A")"
for i in 0 1 2; do
  n "$i" -c "SELECT quota.finish(id) FROM quota.ledger
              WHERE ended_at IS NULL AND (tenant IS NULL OR label = 'param tenant' OR role = 'postgres'::regrole)" >/dev/null
done
# Distributed apart, the start functions cannot all count a tenant on one node.
n 0 -c "CREATE TABLE other (tenant text NOT NULL)" -c "SELECT create_distributed_table('other', 'tenant', shard_count := 2)" \
    -c "SELECT create_distributed_function('quota.try_start(integer,interval,text,interval,text,boolean,text)', '\$5', colocate_with := 'other')" >/dev/null
expect_eq "with the weighted try_start() colocated with another table, a tenant's start is refused (55000), from any node" \
  "55000 55000" "$(try 0 "$B") $(try "$NB" "$B")"
n 0 -c "SELECT create_distributed_function('quota.try_start(integer,interval,text,interval,text,boolean,text)', '\$5', colocate_with := 'jobs')" >/dev/null
expect_eq "… and admitted again once it is colocated with the others" t "$(try 0 "$B" misdeclared)"
on "$NB" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE label = 'misdeclared'" >/dev/null

# --- the enqueue recipe: a transactional start and the job's INSERT ------------------
enq() {  # enq NODE TENANT LABEL COMMIT|ROLLBACK: the start alone in its statement
  printf '%s\n' "BEGIN;" \
    "SELECT quota.start(tenant => '$2', label => '$3', transactional => true) AS tk \\gset" \
    "INSERT INTO jobs (tenant, ticket) VALUES ('$2', :'tk');" "$4;" |
    timeout 30 "$PG_BIN/psql" -X -q -At -h "$DIR/n$1" -p $((BASE + $1)) -U app -d app -v ON_ERROR_STOP=1 >/dev/null 2>&1 || true
}
enq 0 "$B" e1 COMMIT
enq "$(other "$NB")" "$B" e2 ROLLBACK
enq "$NB" "$B" e3 COMMIT
expect_eq "enqueues of $B from three nodes, one rolled back: its node holds the two committed charges, each in its transaction" \
  "e1 e3" "$(n "$NB" -c "SELECT string_agg(label, ' ' ORDER BY label) FROM quota.ledger WHERE tenant = '$B' AND txid IS NOT NULL")"
expect_eq "… and $B is at its limit: a third enqueue is refused (53400), from any node" "53400 53400" \
  "$(state_on 0 app "BEGIN" "SELECT quota.start(tenant => '$B', transactional => true)") $(
     state_on "$(other "$NB")" app "BEGIN" "SELECT quota.start(tenant => '$B', transactional => true)")"
on 0 app "SELECT finish_for('$B', ticket) FROM jobs WHERE tenant = '$B'" >/dev/null
# A transaction that writes on two nodes is committed by Citus with two-phase commit.
# pg_quota refuses to PREPARE a transaction that holds a transactional charge: the
# enqueue fails whole at COMMIT (0A000), its charge and both jobs gone. A
# writer-committed start has committed on its own: the two-phase commit goes. So no
# prepared transaction, on any worker, holds anything of pg_quota's: a worker's crash
# and Citus' recovery of its prepared transactions commit or roll back jobs only.
two_phase() {  # two_phase true|false: the COMMIT's SQLSTATE of an enqueue of $B that also writes a job of $A
  state_on 0 app "BEGIN" "SELECT quota.start(tenant => '$B', label => '2pc $1', transactional => $1)" \
    "INSERT INTO jobs (tenant, payload) VALUES ('$B', '2pc $1'), ('$A', '2pc $1')" "COMMIT"
}
live_b=$(live "$NB" "$B")
expect_eq "an enqueue of $B whose transaction also writes a job of $A, on another node, fails at its two-phase commit (0A000): no charge, no job" \
  "0A000 $live_b 0" "$(two_phase true) $(live "$NB" "$B") $(n 0 -c "SELECT count(*) FROM jobs WHERE payload = '2pc true'")"
expect_eq "… with a writer-committed start, the two-phase commit goes: its ticket, on $B's node, and both jobs" \
  "00000 $((live_b + 1)) 2" "$(two_phase false) $(live "$NB" "$B") $(n 0 -c "SELECT count(*) FROM jobs WHERE payload = '2pc false'")"
on "$NB" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE label = '2pc false'" >/dev/null
on 0 app "DELETE FROM jobs WHERE payload = '2pc false'" >/dev/null

# --- the recipe of whole calls: enqueue() and complete(), each run on the tenant's node --
# Distributed by tenant, each call runs whole on the tenant's node, from any node: the
# transactional start and the job's INSERT (or the DELETE and the finish) are one
# transaction local to that node.
on 0 app "DELETE FROM jobs WHERE tenant = '$B'" >/dev/null
# USER_GUIDE's two functions, as written there.
n 0 -c "CREATE FUNCTION enqueue(tenant text, payload text) RETURNS bigint LANGUAGE plpgsql STRICT AS \$\$
          DECLARE tk uuid; job bigint;
          BEGIN
            tk := quota.start(weight => 1, tenant => tenant, label => 'job', transactional => true);
            INSERT INTO jobs (tenant, payload, ticket) VALUES (tenant, payload, tk) RETURNING id INTO job;
            RETURN job;
          END\$\$" \
    -c "CREATE FUNCTION complete(tenant text, job bigint) RETURNS bool LANGUAGE plpgsql STRICT AS \$\$
          DECLARE tk uuid;
          BEGIN
            UPDATE jobs j SET done_at = now()
             WHERE j.tenant = complete.tenant AND j.id = job AND j.done_at IS NULL
            RETURNING j.ticket INTO tk;
            IF NOT FOUND THEN RETURN false; END IF;
            RETURN quota.finish(tk);
          END\$\$" \
    -c "SELECT create_distributed_function('enqueue(text,text)', '\$1', colocate_with := 'jobs', force_delegation := true)" \
    -c "SELECT create_distributed_function('complete(text,bigint)', '\$1', colocate_with := 'jobs', force_delegation := true)" >/dev/null
before=$(admitted "$NB")
ledger_b() { n "$NB" -c "SELECT count(*) FROM quota.ledger WHERE tenant = '$B' AND label = 'job' AND ended_at IS NULL"; }
expect_eq "an enqueue() of $B that fails after its start (the job's CHECK) on $B's node, then two from the coordinator and the other worker" \
  "23514 00000 00000" "$(state_on "$NB" app "SELECT enqueue('$B', 'bad')") $(state_on 0 app "SELECT enqueue('$B', 'one')") $(
     state_on "$(other "$NB")" app "SELECT enqueue('$B', 'two')")"
expect_eq "… charged on $B's node alone, each with its job, the failed call's charge gone with it" "2 2 0 0 2" \
  "$(ledger_b) $(n 0 -c "SELECT count(*) FROM jobs WHERE tenant = '$B'") $(
     n 0 -c "SELECT count(*) FROM quota.ledger WHERE tenant = '$B'") $(
     n "$(other "$NB")" -c "SELECT count(*) FROM quota.ledger WHERE tenant = '$B'") $(($(admitted "$NB") - before))"
expect_eq "… and $B at its limit: a third enqueue() is refused (53400) from the coordinator, with no job" "53400 2" \
  "$(state_on 0 app "SELECT enqueue('$B', 'three')") $(n 0 -c "SELECT count(*) FROM jobs WHERE tenant = '$B'")"
JOB1=$(n 0 -c "SELECT id FROM jobs WHERE tenant = '$B' AND payload = 'one'")
expect_eq "complete() of a job from the other worker ends its ticket on $B's node; completed again, it returns false; an enqueue() from the coordinator takes the freed slot" \
  "t f 00000 2" "$(on "$(other "$NB")" app "SELECT complete('$B', $JOB1)") $(on 0 app "SELECT complete('$B', $JOB1)") $(
     state_on 0 app "SELECT enqueue('$B', 'four')") $(ledger_b)"
for id in $(n 0 -c "SELECT id FROM jobs WHERE tenant = '$B' AND done_at IS NULL"); do on 0 app "SELECT complete('$B', $id)" >/dev/null; done
on 0 app "DELETE FROM jobs WHERE tenant = '$B'" >/dev/null
# What a backend read of Citus' metadata, it remembers: in one transaction on $B's
# node, after two starts of $B (its limit), five more (refused, each placed first)
# read none of Citus' catalogs (the transaction's own scan counts), until Citus'
# metadata changes.
scans="(SELECT sum(pg_stat_get_xact_numscans(c.oid)) FROM pg_class c
         WHERE c.relnamespace = 'pg_catalog'::regnamespace AND c.relname IN ('pg_dist_object', 'pg_dist_placement', 'pg_dist_local_group'))"
expect_eq "a backend that placed $B once reads none of Citus' catalogs for its next five starts of $B" "t t t 0 0" \
  "$(on "$NB" app "BEGIN" "SELECT quota.try_start(tenant => '$B', label => 'memo') IS NOT NULL" \
      "SELECT quota.try_start(tenant => '$B', label => 'memo') IS NOT NULL" \
      "SELECT set_config('memo.scans', ($scans)::text, false) IS NOT NULL" \
      "SELECT count(quota.try_start(tenant => '$B', label => 'memo')) FROM generate_series(1, 5)" \
      "SELECT $scans - current_setting('memo.scans')::numeric" "COMMIT" | xargs)"
on "$NB" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE label = 'memo' AND ended_at IS NULL" >/dev/null

# --- usage seen from any node -----------------------------------------------------------
# The whole cluster, for the DBA (run_command_on_all_nodes, each row naming its node),
# and one tenant's usage for the application, from its node (usage_of(), distributed by
# tenant like the starts).
n 0 -c "CREATE FUNCTION usage_of(tenant text) RETURNS TABLE (node text, active numeric, retained numeric)
          LANGUAGE plpgsql STRICT AS \$\$BEGIN
            RETURN QUERY SELECT (SELECT nodename || ':' || nodeport FROM pg_dist_node
                                  WHERE groupid = (SELECT groupid FROM pg_dist_local_group) AND noderole = 'primary'),
                                coalesce(sum(u.active), 0), coalesce(sum(u.retained), 0)
                           FROM quota.tenant_usage u WHERE u.tenant = usage_of.tenant;
          END\$\$" \
    -c "SELECT create_distributed_function('usage_of(text)', '\$1', colocate_with := 'jobs')" >/dev/null
expect_eq "from the other worker, the DBA reads $A's active tickets on every node (run_command_on_all_nodes): all on its node" \
  "$NA:$(live "$NA" "$A") 0:0 $(other "$NA"):0" \
  "$(n "$(other "$NA")" -c "SELECT string_agg(n.nodeport - $BASE || ':' || r.result, ' ' ORDER BY n.nodeport = $((BASE + NA)) DESC, n.nodeport)
        FROM run_command_on_all_nodes(\$\$SELECT count(*) FROM quota.ledger WHERE tenant = '$A' AND ended_at IS NULL\$\$) r
        JOIN pg_dist_node n USING (nodeid)")"
expect_eq "from the coordinator, the application reads $A's usage through usage_of(), answered by $A's node" \
  "$DIR/n$NA:$((BASE + NA)) $(live "$NA" "$A")" "$(on 0 app "SELECT node || ' ' || active FROM usage_of('$A')")"

# --- a role's own limit counts per node, and a start says so ---------------------------
warnings() {  # the per-node WARNINGs of a session of two starts for $A
  timeout 30 "$PG_BIN/psql" -X -q -At -h "$DIR/n0" -p "$BASE" -U app -d app \
    -c "SELECT quota.try_start(tenant => '$A', label => 'w1')" \
    -c "SELECT quota.try_start(tenant => '$A', label => 'w2')" 2>&1 >/dev/null | grep "counts per node on this Citus cluster" || true
}
expect_eq "at its default (100, which nothing chose), quota.max_active_per_role is not warned of (the session's starts ran)" " 1" \
  "$(warnings) $(n "$NA" -c "SELECT count(*) > 0 FROM quota.ledger WHERE label IN ('w1', 'w2')" | sed 's/t/1/')"
n 0 -c "ALTER ROLE app SET quota.max_active_per_role = 50" >/dev/null
expect_eq "with quota.max_active_per_role set, a session's start for a tenant warns, once, that it counts per node" 1 \
  "$(warnings | grep -c "WARNING:  quota.max_active_per_role = 50 counts per node on this Citus cluster")"
n 0 -c "ALTER ROLE app RESET quota.max_active_per_role" >/dev/null
on "$NA" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE label IN ('w1', 'w2') AND ended_at IS NULL" >/dev/null

# --- a tenant's own limit -------------------------------------------------------------
on 0 postgres "SELECT quota.set_tenant_limits('$B', max_active => 1, role => 'app')" >/dev/null
expect_eq "set_tenant_limits() alone in its statement on the coordinator sets $B's limit on its node" "1" \
  "$(n "$NB" -c "SELECT max_active FROM quota.tenant_limits WHERE tenant = '$B'")"
expect_eq "… where it holds: one start of $B admitted, the next refused" "t f" \
  "$(try 0 "$B") $(try 0 "$B")"
expect_eq "set_tenant_limits() in a transaction block on the coordinator is refused with 0A000" 0A000 \
  "$(state_on 0 postgres "BEGIN" "SELECT quota.set_tenant_limits('$B', max_active => 3, role => 'app')" "COMMIT" \
     "BEGIN" "SELECT quota.set_tenant_limits('$B', max_active => 3, role => 'app')")"
expect_eq "… and sets nothing on the coordinator" 0 "$(n 0 -c "SELECT count(*) FROM quota.tenant_limits")"
on 0 postgres "SELECT quota.set_tenant_limits('$B', role => 'app')" >/dev/null
# Weights count where the tenant is: the weighted try_start() is distributed as the
# others (by $5, its tenant).
on "$NB" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE tenant = '$B' AND ended_at IS NULL" >/dev/null
# weighted NODE WEIGHT: as try(), with a weight: the call alone in its statement
# (Citus delegates nothing that wraps it); t, f (NULL), or the error's SQLSTATE.
weighted() {
  admission "$(on "$1" app "SELECT quota.try_start(weight => $2, tenant => '$B', label => 'weighted')" '\echo SQLSTATE=:SQLSTATE')"
}
expect_eq "a start of $B of weight 2 from the coordinator takes its limit of 2, on $B's node; one of weight 1 from the other worker is refused" \
  "t f 2 0" "$(weighted 0 2) $(weighted "$(other "$NB")" 1) $(
     n "$NB" -c "SELECT coalesce(sum(coalesce(weight, 1)), 0) FROM quota.ledger WHERE tenant = '$B' AND ended_at IS NULL") $(
     n 0 -c "SELECT count(*) FROM quota.ledger WHERE label = 'weighted'")"
on "$NB" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE tenant = '$B' AND ended_at IS NULL" >/dev/null

# --- clients on every node race ---------------------------------------------------------
# Each client runs its loop in one psql session: a start for a tenant, alone in its
# statement (delegated) or in a transaction block (run where the client is); while it
# holds a ticket, a row in running (on the tenant's node, in the tenant's shard); then
# the row goes and finish_for() ends the ticket. Beside them, clients of the recipe of
# whole calls for $C: enqueue() (its transactional start and the job's row, in one
# transaction), then complete(). A sampler on the coordinator counts, per tenant,
# running rows and $C's jobs not yet completed, as often as it can.
on "$NA" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE ended_at IS NULL" >/dev/null
on "$NB" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE ended_at IS NULL" >/dev/null
client() {  # client NODE TENANT delegated|block ITERATIONS
  local node="$1" t="$2" how="$3" k
  for k in $(seq 1 "$4"); do
    if [ "$how" = block ]; then echo "BEGIN;"; fi
    # The call alone in its target list, as Citus delegates it; a NULL leaves tk unset.
    echo "SELECT quota.try_start(tenant => '$t', label => 'race-n$node') AS tk \\gset"
    if [ "$how" = block ]; then echo "COMMIT;"; fi
    echo "\\if :{?tk}"
    echo "INSERT INTO running VALUES ('$t', :'tk');"
    echo "SELECT pg_sleep(0.005);"
    echo "DELETE FROM running WHERE tenant = '$t' AND ticket = :'tk';"
    echo "SELECT finish_for('$t', :'tk');"
    echo "\\unset tk"
    echo "\\endif"
  done
}
whole_client() {  # whole_client TENANT ITERATIONS: enqueue(), then complete(), each alone
  local t="$1" k
  echo "\\set VERBOSITY sqlstate"
  for k in $(seq 1 "$2"); do
    echo "SELECT enqueue('$t', 'race') AS job \\gset"  # refused: 53400, and job unset
    echo "\\if :{?job}"
    echo "SELECT pg_sleep(0.005);"
    echo "SELECT complete('$t', :job);"
    echo "\\unset job"
    echo "\\endif"
  done
}
RACE="$DIR/race"; mkdir -p "$RACE"; chmod 777 "$RACE"
n 0 -c "CREATE TABLE race_stop (x int)" -c "GRANT ALL ON race_stop TO app" >/dev/null
bg "$PG_BIN/psql" -X -q -At -h "$DIR/n0" -p "$BASE" -U app -d app -c "
  DO \$\$DECLARE m int := 0; k int; s int := 0; w int := 0;
  BEGIN
    WHILE NOT EXISTS (SELECT 1 FROM race_stop) LOOP
      SELECT coalesce(max(c), 0) INTO k FROM (SELECT count(*) c FROM running GROUP BY tenant) x;
      m := greatest(m, k);
      SELECT count(*) INTO k FROM jobs WHERE tenant = '$C' AND payload = 'race' AND done_at IS NULL;
      w := greatest(w, k); s := s + 1;
      PERFORM pg_sleep(0.002);
    END LOOP;
    RAISE NOTICE 'sampled % % times, whole calls %', m, s, w;
  END\$\$" > "$RACE/sampler.out" 2>&1
SAMPLER=$LAST_BG
clients=()
for t in "$A" "$B"; do
  for i in 0 1 2; do
    for how in delegated block; do
      client "$i" "$t" "$how" 120 > "$RACE/$t-$i-$how.sql"
      bg timeout 150 "$PG_BIN/psql" -X -q -At -h "$DIR/n$i" -p $((BASE + i)) -U app -d app \
        -v ON_ERROR_STOP=0 -f "$RACE/$t-$i-$how.sql" > "$RACE/$t-$i-$how.out" 2> "$RACE/$t-$i-$how.err"
      clients+=("$LAST_BG")
    done
  done
done
for i in 0 1 2; do
  for k in 1 2; do
    whole_client "$C" 120 > "$RACE/$C-$i-$k-whole.sql"
    bg timeout 150 "$PG_BIN/psql" -X -q -At -h "$DIR/n$i" -p $((BASE + i)) -U app -d app \
      -v ON_ERROR_STOP=0 -f "$RACE/$C-$i-$k-whole.sql" > "$RACE/$C-$i-$k-whole.out" 2> "$RACE/$C-$i-$k-whole.err"
    clients+=("$LAST_BG")
  done
done
for p in "${clients[@]}"; do wait "$p" 2>/dev/null || true; done
n 0 -c "INSERT INTO race_stop VALUES (1)" >/dev/null
wait "$SAMPLER" 2>/dev/null || true
read -r most samples whole < <(sed -n 's/.*sampled \([0-9]*\) \([0-9]*\) times, whole calls \([0-9]*\).*/\1 \2 \3/p' "$RACE/sampler.out")
finished=$(cat "$RACE"/*-delegated.out "$RACE"/*-block.out | grep -c '^t$' || true)
completed=$(cat "$RACE"/*-whole.out | grep -c '^t$' || true)
refused=$(cat "$RACE"/*-whole.err | grep -c 'ERROR:  53400$' || true)
elsewhere=$(cat "$RACE"/*-block.err | grep -c "is held by node" || true)
other_errors=$(cat "$RACE"/*.err | grep ERROR | grep -v "is held by node" | grep -vc 'ERROR:  53400$' || true)
echo "# race: $finished tickets finished; block starts refused on a node without their tenant: $elsewhere; most running at once for a tenant: ${most:-?} in ${samples:-?} samples"
echo "# race of whole calls for $C (n$NC): $completed jobs completed, $refused enqueues refused; most not completed at once: ${whole:-?}"
check "with clients on every node, no tenant ever ran more than its limit of 2 at once (most seen: ${most:-none}, ${samples:-0} samples)" \
  test "${most:-9}" -le 2 -a "${samples:-0}" -gt 100
check "the race finished work ($finished tickets) and refused the block starts made on the wrong nodes ($elsewhere)" \
  test "$finished" -gt 50 -a "$elsewhere" -gt 0
check "with clients of whole calls on every node, $C never had more than its limit of 2 jobs enqueued and not completed (most seen: ${whole:-none})" \
  test "${whole:-9}" -le 2
check "… the race of whole calls completed jobs ($completed) and refused enqueues at the limit ($refused)" \
  test "$completed" -gt 50 -a "$refused" -gt 0
expect_eq "… each completed job's ticket on $C's node alone, one to a job, all ended" "$completed $completed 0 0" \
  "$(n 0 -c "SELECT count(*) FROM jobs WHERE tenant = '$C' AND payload = 'race' AND done_at IS NOT NULL") $(
     n "$NC" -c "SELECT count(*) FROM quota.ledger WHERE tenant = '$C' AND ended_at IS NOT NULL") $(
     n "$NC" -c "SELECT count(*) FROM quota.ledger WHERE tenant = '$C' AND ended_at IS NULL") $(
     elsewhere_c=0; for i in 0 1 2; do [ "$i" = "$NC" ] || elsewhere_c=$((elsewhere_c + $(n "$i" -c "SELECT count(*) FROM quota.ledger WHERE tenant = '$C'"))); done; echo $elsewhere_c)"
expect_eq "no client met another error" 0 "$other_errors"
left=0
for i in 1 2; do left=$((left + $(n "$i" -c "SELECT count(*) FROM quota.ledger WHERE label LIKE 'race%' AND ended_at IS NULL"))); done
expect_eq "every ticket of the race is on its tenant's node, and all ended" "0 0 0 0" \
  "$(n 0 -c "SELECT count(*) FROM quota.ledger WHERE label LIKE 'race%'") $(n "$(other "$NA")" -c "SELECT count(*) FROM quota.ledger WHERE tenant = '$A'") $(
     n "$(other "$NB")" -c "SELECT count(*) FROM quota.ledger WHERE tenant = '$B'") $left"

# --- the queue's own claim and completion, by pg_quota's triggers ------------------------
# On a table distributed by tenant, quota.claim_job() and quota.finish_job() fire on
# the shard, on the tenant's node, where its ticket is: a claim or a completion routed
# to one tenant renews or finishes there, from any node. A statement that writes on two
# nodes is committed by Citus with two-phase commit, which pg_quota refuses to prepare
# once a renewal or a finish is in the transaction (0A000): it fails whole.
D=$([ "$NC" = "$NA" ] && echo "$B" || echo "$A"); ND=$(node_of "$D")
n 0 -c "CREATE TABLE tjobs (tenant text NOT NULL, id bigserial, ticket uuid, status text NOT NULL DEFAULT 'todo',
                            PRIMARY KEY (tenant, id))" \
    -c "SELECT create_distributed_table('tjobs', 'tenant', colocate_with := 'jobs')" \
    -c "GRANT ALL ON tjobs, tjobs_id_seq TO app" >/dev/null
expect_eq "without citus.enable_unsafe_triggers, Citus refuses a trigger on a distributed table" \
  "triggers are not supported on distributed tables" \
  "$(n 0 -c "CREATE TRIGGER quota_job_done AFTER UPDATE OF status ON tjobs FOR EACH ROW
              EXECUTE FUNCTION quota.finish_job('ticket', 'succeeded')" 2>&1 | sed -n 's/^.*ERROR:  //p')"
expect_eq "with it, quota.claim_job() and quota.finish_job() triggers on the distributed table reach every shard (both on each of 4)" "4x2 4" \
  "$(n 0 -c "SET citus.enable_unsafe_triggers = on" \
     -c "CREATE TRIGGER quota_job_claimed BEFORE UPDATE OF status ON tjobs FOR EACH ROW
           WHEN (NEW.status = 'doing' AND OLD.status = 'todo') EXECUTE FUNCTION quota.claim_job('ticket', '5 minutes')" \
     -c "CREATE TRIGGER quota_job_done AFTER UPDATE OF status ON tjobs FOR EACH ROW
           WHEN (NEW.status = 'done' AND OLD.status <> 'done') EXECUTE FUNCTION quota.finish_job('ticket', 'succeeded')" \
     -c "SELECT result FROM run_command_on_shards('tjobs', \$\$SELECT count(*) FROM pg_trigger WHERE tgrelid = '%s'::regclass AND tgname LIKE 'quota_job_%%'\$\$)" | sort | uniq -c | awk '{print $1 "x" $2}') $(
     n 0 -c "SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'tjobs'::regclass")"
# tj_enqueue NODE TENANT: a writer-committed start with a lease of a minute, alone in its
# statement (delegated to the tenant's node), then the job's row with its ticket; the id.
tj_enqueue() {
  local tk
  tk=$(on "$1" app "SELECT quota.try_start(tenant => '$2', label => 'tj', lease => '1 minute')")
  [ -n "$tk" ] && on "$1" app "INSERT INTO tjobs (tenant, ticket) VALUES ('$2', '$tk') RETURNING id"
}
tj_ticket() { n 0 -c "SELECT ticket FROM tjobs WHERE tenant = '$1' AND id = $2"; }
tj_lease() { n "$1" -c "SELECT CASE WHEN ended_at IS NOT NULL THEN 'ended:' || outcome WHEN lease_until > now() + interval '4 minutes' THEN 'renewed' ELSE 'minute' END FROM quota.ledger WHERE id = '$2'"; }
C1=$(tj_enqueue 0 "$C"); C2=$(tj_enqueue "$(other "$NC")" "$C"); D1=$(tj_enqueue 0 "$D")
expect_eq "two jobs of $C and one of $D enqueued, each ticket on its tenant's node; $C is at its limit" \
  "minute minute minute f" "$(tj_lease "$NC" "$(tj_ticket "$C" "$C1")") $(tj_lease "$NC" "$(tj_ticket "$C" "$C2")") $(
     tj_lease "$ND" "$(tj_ticket "$D" "$D1")") $(try 0 "$C")"
expect_eq "a claim of $C's job from the other worker renews its ticket on $C's node (claim_job(), in the claim's UPDATE)" \
  "00000 renewed" "$(state_on "$(other "$NC")" app "UPDATE tjobs SET status = 'doing' WHERE tenant = '$C' AND id = $C1") $(
     tj_lease "$NC" "$(tj_ticket "$C" "$C1")")"
expect_eq "its completion from the coordinator, rolled back, leaves the ticket active" "renewed" \
  "$(on 0 app "BEGIN" "UPDATE tjobs SET status = 'done' WHERE tenant = '$C' AND id = $C1" "ROLLBACK" >/dev/null; tj_lease "$NC" "$(tj_ticket "$C" "$C1")")"
expect_eq "committed, it finishes the ticket on $C's node (finish_job()), and a start of $C is admitted in its slot" \
  "00000 ended:succeeded t" "$(state_on 0 app "UPDATE tjobs SET status = 'done' WHERE tenant = '$C' AND id = $C1") $(
     tj_lease "$NC" "$(tj_ticket "$C" "$C1")") $(try 0 "$C" "tj slot")"
on "$NC" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE label = 'tj slot' AND ended_at IS NULL" >/dev/null
two_nodes() {  # the state of one statement that claims (doing) or completes (done) $C2 and $D1
  state_on 0 app "UPDATE tjobs SET status = '$1' WHERE (tenant = '$C' AND id = $C2) OR (tenant = '$D' AND id = $D1)"
}
expect_eq "a claim of jobs of $C and $D (two nodes) in one statement fails whole (0A000: two-phase commit after a renewal): both jobs as they were, neither ticket renewed" \
  "0A000 todo todo minute minute" "$(two_nodes doing) $(n 0 -c "SELECT string_agg(status, ' ' ORDER BY tenant = '$D') FROM tjobs WHERE id IN ($C2, $D1) AND tenant IN ('$C', '$D')") $(
     tj_lease "$NC" "$(tj_ticket "$C" "$C2")") $(tj_lease "$ND" "$(tj_ticket "$D" "$D1")")"
expect_eq "… as does their completion in one statement (two-phase commit after a finish): neither ticket finished" \
  "0A000 minute minute" "$(two_nodes done) $(tj_lease "$NC" "$(tj_ticket "$C" "$C2")") $(tj_lease "$ND" "$(tj_ticket "$D" "$D1")")"
expect_eq "… and one statement per tenant completes each, on its own node" "ended:succeeded ended:succeeded" \
  "$(on 0 app "UPDATE tjobs SET status = 'done' WHERE tenant = '$C' AND id = $C2" "UPDATE tjobs SET status = 'done' WHERE tenant = '$D' AND id = $D1" >/dev/null
     tj_lease "$NC" "$(tj_ticket "$C" "$C2")") $(tj_lease "$ND" "$(tj_ticket "$D" "$D1")")"

# --- the tenant's node crashes and comes back -----------------------------------------
on 0 app "SELECT quota.try_start(tenant => '$A', label => 'kept1')" "SELECT quota.try_start(tenant => '$A', label => 'kept2')" >/dev/null
stop_cluster "$DIR/n$NA" immediate
as_pg "$PG_BIN/pg_ctl" -D "$DIR/n$NA/data" -l "$DIR/n$NA/server.log" -w -t 60 start >/dev/null
expect_eq "$A's node, stopped in a crash and restarted, kept its two tickets: a third start from the coordinator is refused" \
  "2 f" "$(live "$NA" "$A") $(try 0 "$A")"

# --- moving a tenant's shard ----------------------------------------------------------------
# The move would leave the tenant's tickets and own limits in this node's ledger: the
# node the shard leaves refuses the move (55000) while a tenant of the shard holds
# either, and the move fails whole; once they are gone, it goes, and the tenant is
# admitted where its shard now lives.
SHARD=$(n 0 -c "SELECT get_shard_id_for_distribution_column('jobs', '$A')")
TO=$(other "$NA")
# move [MODE]: one move of the shard (shard_transfer_mode MODE, block_writes unless
# given); sets MOVE_STATE (its SQLSTATE) and MOVE_ERROR.
move() {
  local out
  out=$(out_on 0 postgres "SELECT citus_move_shard_placement($SHARD, '$DIR/n$NA', $((BASE + NA)), '$DIR/n$TO', $((BASE + TO)), shard_transfer_mode := '${1:-block_writes}')")
  MOVE_STATE=$(sqlstate_of "$out")
  MOVE_ERROR=$(grep ERROR <<<"$out" || true)
}
# First Citus' non-blocking move (logical replication while writes go on), which
# sends the same metadata update once the copy has caught up; then a blocking one.
move force_logical
expect_eq "while $A holds two tickets on n$NA, a non-blocking move (force_logical) of its shard is refused (55000), and fails whole: the shard still on n$NA, with the tickets" \
  "55000 t $NA 2" "$MOVE_STATE $(grep -q "pg_quota cannot let shard $SHARD leave this node: tenant \"$A\" holds active tickets here" <<<"$MOVE_ERROR" && echo t || echo f) $(
     node_of "$A") $(live "$NA" "$A")"
move
expect_eq "while $A holds active tickets on n$NA, moving its shard $SHARD away is refused (55000)" 55000 "$MOVE_STATE"
check "… by the node it would leave, which says why ($MOVE_ERROR)" \
  grep -q "pg_quota cannot let shard $SHARD leave this node: tenant \"$A\" holds active tickets here" <<<"$MOVE_ERROR"
expect_eq "… and the move failed whole: the shard is still on n$NA, with $A's two tickets" "$NA 2" "$(node_of "$A") $(live "$NA" "$A")"
on "$NA" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE tenant = '$A' AND ended_at IS NULL" >/dev/null
on 0 postgres "SELECT quota.set_tenant_limits('$A', max_active => 1, role => 'app')" >/dev/null
move
expect_eq "with $A's tickets ended but its own limits on n$NA, the move is refused still" \
  "55000 t" "$MOVE_STATE $(grep -q "tenant \"$A\" has its own limits here" <<<"$MOVE_ERROR" && echo t || echo f)"
on 0 postgres "SELECT quota.set_tenant_limits('$A', role => 'app')" >/dev/null
# A writer-committed start in a transaction still open on n$NA: its charge committed
# on its own, and the start gave the shard lock back; the move sees the ticket (55000),
# and is not refused as busy (55P03).
CL="$DIR/n$NA" PORT=$((BASE + NA)) open_session wc app app
say wc "BEGIN;"
say wc "SELECT 'wc:' || quota.start(tenant => '$A', label => 'writer committed');"
CL="$DIR/n$NA" wait_out wc "wc:"
move
expect_eq "a writer-committed start in a transaction still open on n$NA holds no lock: the move sees its ticket (55000), not a start in progress" \
  "55000 t" "$MOVE_STATE $(grep -q "tenant \"$A\" holds active tickets here" <<<"$MOVE_ERROR" && echo t || echo f)"
say wc "COMMIT;"
close_session wc
on "$NA" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE tenant = '$A' AND ended_at IS NULL" >/dev/null
# The enqueue recipe of $A in its transaction on n$NA, its start made, its INSERT not
# yet: the charge is not committed, so no snapshot shows it. The move is refused at
# once (55P03) rather than left to wait for it, or to deadlock with it: the
# transaction's INSERT would next wait for the shard the move blocks. (Once the INSERT
# is made, Citus' own move waits for the transaction before it gets that far.)
CL="$DIR/n$NA" PORT=$((BASE + NA)) open_session tx app app
say tx "BEGIN;"
say tx "SELECT quota.start(tenant => '$A', label => 'in flight', transactional => true) AS tk \\gset"
say tx "\\echo started"
CL="$DIR/n$NA" wait_out tx "started"
move
expect_eq "while an enqueue of $A is in its transaction on n$NA, moving its shard is refused at once (55P03)" "55P03 t" \
  "$MOVE_STATE $(grep -q "pg_quota cannot let shard $SHARD leave this node now: a start for one of its tenants is in progress here" <<<"$MOVE_ERROR" && echo t || echo f)"
say tx "INSERT INTO jobs (tenant, ticket) VALUES ('$A', :'tk');"
say tx "COMMIT;"
say tx "\\echo committed=:SQLSTATE"
CL="$DIR/n$NA" wait_out tx "committed="
close_session tx
expect_eq "… and the enqueue then commits, its charge and its job on n$NA, where the shard still is" \
  "committed=00000 $NA 1 1" "$(grep committed= "$DIR/n$NA/tx.out") $(node_of "$A") $(live "$NA" "$A") $(
     n 0 -c "SELECT count(*) FROM jobs WHERE tenant = '$A'")"
on "$NA" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE tenant = '$A' AND ended_at IS NULL" >/dev/null
on 0 app "DELETE FROM jobs WHERE tenant = '$A'" >/dev/null
# A start that comes while a move is under way on n$NA waits for it, then reads where
# the shard is after it. The move's metadata update on n$NA is held open here: Citus'
# own call, made by a superuser on a connection named as Citus names its own (its
# placement moves to n$TO in n$NA's catalog alone; the rows stay where they are), then
# committed, then undone the same way. The waiting session read $A's placement before,
# so its backend remembers it here: only what it reads after the lock may decide.
LOCAL_NA=$(n "$NA" -c "SELECT groupid FROM pg_dist_local_group")
LOCAL_TO=$(n "$TO" -c "SELECT groupid FROM pg_dist_local_group")
CL="$DIR/n$NA" PORT=$((BASE + NA)) open_session mv app app
say mv "BEGIN;"  # run here, not delegated: try_start() is not force-delegated
say mv "SELECT 'primed:' || coalesce(quota.finish(quota.try_start(tenant => '$A', label => 'primed'))::text, 'refused');"
say mv "COMMIT;"  # the finish with it
say mv "BEGIN;"
CL="$DIR/n$NA" wait_out mv "primed:"
CITUS_APP="citus_internal gpid=10000000001"  # what EnsureCitusInitiatedOperation() checks
PGAPPNAME="$CITUS_APP" CL="$DIR/n$NA" PORT=$((BASE + NA)) open_session meta postgres app
say meta "BEGIN;"
say meta "SELECT citus_internal.update_placement_metadata($SHARD, $LOCAL_NA, $LOCAL_TO);"
say meta "\\echo updated=:SQLSTATE"
CL="$DIR/n$NA" wait_out meta "updated="
say mv "SELECT quota.try_start(tenant => '$A', label => 'during move');"
say mv "\\echo during=:SQLSTATE"
waited=$(waiting_on "$NA" 'during move')
expect_eq "while a move's metadata update for $A's shard is under way on n$NA (its own lock taken), a start of $A there waits for it" \
  "updated=00000 waiting none" "$(grep -o 'updated=.*' "$DIR/n$NA/meta.out") $waited $(grep -o 'during=.*' "$DIR/n$NA/mv.out" || echo none)"
say meta "COMMIT;"
close_session meta
CL="$DIR/n$NA" wait_out mv "during="
say mv "ROLLBACK;"
close_session mv
expect_eq "… and once the move commits, the start reads where the shard is now, not what its backend remembered: refused (0A000), nothing charged" \
  "during=0A000 0" "$(grep -o 'during=.*' "$DIR/n$NA/mv.out") $(n "$NA" -c "SELECT count(*) FROM quota.ledger WHERE label = 'during move'")"
PGAPPNAME="$CITUS_APP" n "$NA" -c "SELECT citus_internal.update_placement_metadata($SHARD, $LOCAL_TO, $LOCAL_NA)" >/dev/null
expect_eq "… and with the metadata put back, $A is admitted on n$NA again" \
  "t 1" "$(try "$NA" "$A" "put back") $(live "$NA" "$A")"
on "$NA" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE tenant = '$A' AND ended_at IS NULL" >/dev/null
# A REPEATABLE READ transaction on n$NA whose snapshot predates the move.
CL="$DIR/n$NA" PORT=$((BASE + NA)) open_session rr app app
# Before it begins, the session starts and finishes a ticket of $A: its backend now remembers
# where $A's shard is (what it read of Citus' metadata), and must forget it on the move.
say rr "BEGIN;"  # run here, not delegated: try_start() is not force-delegated
say rr "SELECT 'primed:' || coalesce(quota.finish(quota.try_start(tenant => '$A', label => 'primed'))::text, 'refused');"
say rr "COMMIT;"
CL="$DIR/n$NA" wait_out rr "primed:"
expect_eq "the session on n$NA starts and finishes a ticket of $A before the move" \
  "primed:true" "$(grep -o 'primed:.*' "$DIR/n$NA/rr.out")"
say rr "BEGIN ISOLATION LEVEL REPEATABLE READ;"
say rr "SELECT 'snapshot:' || count(*) FROM pg_dist_placement;"
CL="$DIR/n$NA" wait_out rr "snapshot:"
# A session on n$TO, in a transaction block (try_start() is not force-delegated, so
# it runs there): refused before the move, which its backend remembers.
CL="$DIR/n$TO" PORT=$((BASE + TO)) open_session dst app app
say dst "BEGIN;"
say dst "SELECT quota.try_start(tenant => '$A', label => 'dst');"
say dst "\\echo before=:SQLSTATE"
say dst "ROLLBACK;"
CL="$DIR/n$TO" wait_out dst "before="
# Nothing a role can prepare takes pg_quota's shard lock: only a superuser's call of
# Citus' function, as it runs.
CL="$DIR/n$NA" PORT=$((BASE + NA)) open_session prep app app
say prep "BEGIN;"
say prep "PREPARE x AS SELECT citus_internal.update_placement_metadata($SHARD, $LOCAL_NA, 0);"
say prep "\\echo prepared"
CL="$DIR/n$NA" wait_out prep "prepared"
expect_eq "a role's PREPARE of Citus' placement update on n$NA takes no lock: $A's start is admitted" t "$(try 0 "$A" prepared)"
say prep "ROLLBACK;"
close_session prep
# Nor does a superuser's call of it that never ran (filtered away), in a transaction
# left open: pg_quota acts once Citus' function has returned its row.
PGAPPNAME="$CITUS_APP" CL="$DIR/n$NA" PORT=$((BASE + NA)) open_session wf postgres app
say wf "BEGIN;"
say wf "SELECT citus_internal.update_placement_metadata($SHARD, $LOCAL_NA, 0) WHERE false;"
say wf "\\echo filtered=:SQLSTATE"
CL="$DIR/n$NA" wait_out wf "filtered="
expect_eq "a superuser's call of Citus' placement update on n$NA that a WHERE false kept from running takes no lock: $A's start is admitted" \
  "filtered=00000 t" "$(grep -o 'filtered=.*' "$DIR/n$NA/wf.out") $(try 0 "$A" prepared)"
say wf "ROLLBACK;"
close_session wf
on "$NA" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE label = 'prepared'" >/dev/null
move
expect_eq "with neither, the move goes: $A's shard is on n$TO" "00000 $TO" "$MOVE_STATE $(node_of "$A")"
say rr "SELECT 'rr:' || coalesce(quota.try_start(tenant => '$A', label => 'rr')::text, 'refused');"
say rr "\\echo rr-state=:SQLSTATE"
CL="$DIR/n$NA" wait_out rr "rr-state="
close_session rr
expect_eq "a REPEATABLE READ transaction on n$NA that began before the move, and whose backend read $A's placement before it, cannot start $A there: 0A000 (Citus' metadata is read as committed now; what the backend remembered is forgotten)" \
  "0A000 0" "$(sed -n 's/^rr-state=//p' "$DIR/n$NA/rr.out") $(n "$NA" -c "SELECT count(*) FROM quota.ledger WHERE label = 'rr'")"
say dst "BEGIN;"
say dst "SELECT 'dst:' || coalesce(quota.try_start(tenant => '$A', label => 'dst')::text, 'refused');"
say dst "\\echo after=:SQLSTATE"
say dst "COMMIT;"
CL="$DIR/n$TO" wait_out dst "after="
close_session dst
expect_eq "the session on n$TO that was refused $A before the move (its backend remembered where $A was) is admitted after it" \
  "0A000 00000 1" "$(sed -n 's/^before=//p' "$DIR/n$TO/dst.out") $(sed -n 's/^after=//p' "$DIR/n$TO/dst.out") $(
     n "$TO" -c "SELECT count(*) FROM quota.ledger WHERE label = 'dst' AND ended_at IS NULL")"
on "$TO" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE label = 'dst'" >/dev/null
got=""
for i in 0 1 2; do got+="$(try "$i" "$A" "moved n$i") "; done
expect_eq "$A is admitted where its shard now lives, to its limit of 2" "f t t" "$(tr ' ' '\n' <<<"$got" | grep . | sort | xargs)"
expect_eq "… on n$TO, and nowhere else" "2 0 0" "$(live "$TO" "$A") $(live "$NA" "$A") $(live 0 "$A")"

# --- adding a worker --------------------------------------------------------------------
# citus_add_node() of a new worker: Citus creates pg_quota there, and the role with its
# limits; a tenant whose shard moves to it is admitted there, from any node.
on "$TO" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE tenant = '$A' AND ended_at IS NULL" >/dev/null
new_citus_node "$DIR/n3" $((BASE + 3))
n 0 -c "SELECT citus_add_node('$DIR/n3', $((BASE + 3)))" >/dev/null
expect_eq "a worker added with citus_add_node() gets pg_quota, of the cluster's version, and the role's limits" \
  "$(n 0 -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_quota'") 2" \
  "$(n 3 -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_quota'") $(on 3 app "SHOW quota.max_active_per_tenant")"
NA=$TO; TO=3
move
expect_eq "with $A's tickets ended, its shard moves from n$NA to the new worker" "00000 3" "$MOVE_STATE $(node_of "$A")"
got=""
for i in 0 1 2 3; do got+="$(try "$i" "$A" "added n$i") "; done
expect_eq "$A is admitted where its shard now lives, to its limit of 2, from any node" "f f t t" \
  "$(tr ' ' '\n' <<<"$got" | grep . | sort | xargs)"
expect_eq "… on the new worker alone" "2 0 0" "$(live 3 "$A") $(live "$NA" "$A") $(live 0 "$A")"

# --- splitting a tenant's shard ------------------------------------------------------------
# A split replaces a shard by new ones, each placed on a node the split names. On the
# node that holds the old shard, pg_quota refuses the split (55000) as its transaction
# commits there, where a tenant of the shard that holds tickets or its own limits
# there would get a new shard on another node; it lets it go where they stay
# (isolate_tenant_to_new_shard keeps a tenant on its node).
SHARD=$(n 0 -c "SELECT get_shard_id_for_distribution_column('jobs', '$A')")
# A superuser's start (never refused) of $B, run on n3, which does not hold $B: a
# ticket that no split of n3's shards placed, and that judges none of them.
on 3 postgres "BEGIN" "SELECT quota.try_start(tenant => '$B', label => 'stray')" "COMMIT" >/dev/null
expect_eq "a superuser's start of $B on n3 (not $B's node) is admitted there" 1 \
  "$(n 3 -c "SELECT count(*) FROM quota.ledger WHERE label = 'stray' AND ended_at IS NULL")"
split_out=$(split_to postgres "$SHARD" "$A" 1 3 force_logical)
expect_eq "while $A holds two tickets on n3, a non-blocking split (force_logical) that would place $A's new shard on n1 is refused (55000), and fails whole: $A's shard still $SHARD, on n3, with the tickets" \
  "55000 t $SHARD 3 2" "$(sqlstate_of "$split_out") $(grep -q "pg_quota cannot let the split of shard $SHARD place tenants on another node: tenant \"$A\" holds active tickets here\$" <<<"$split_out" && echo t || echo f) $(
     n 0 -c "SELECT get_shard_id_for_distribution_column('jobs', '$A')") $(node_of "$A") $(live 3 "$A")"
split_out=$(split_to postgres "$SHARD" "$A" 1 3 block_writes)
expect_eq "while $A holds two tickets on n3, a split of its shard that would place $A's new shard on n1 is refused (55000)" \
  55000 "$(sqlstate_of "$split_out")"
check "… by n3, which says why, naming $A alone (not $B, whose stray ticket no split placed) ($(grep ERROR <<<"$split_out" | head -1))" \
  grep -q "pg_quota cannot let the split of shard $SHARD place tenants on another node: tenant \"$A\" holds active tickets here\$" <<<"$split_out"
expect_eq "… and the split failed whole: $A's shard is still $SHARD, on n3, with its two tickets" "$SHARD 3 2" \
  "$(n 0 -c "SELECT get_shard_id_for_distribution_column('jobs', '$A')") $(node_of "$A") $(live 3 "$A")"
# A session on n3 that placed $A before the isolation: its backend remembers $A's shard.
CL="$DIR/n3" PORT=$((BASE + 3)) open_session iso app app
say iso "BEGIN;"  # run here, not delegated: try_start() is not force-delegated
say iso "SELECT 'primed:' || coalesce(quota.try_start(tenant => '$A', label => 'iso')::text, 'refused');"
say iso "COMMIT;"
CL="$DIR/n3" wait_out iso "primed:"
expect_eq "isolate_tenant_to_new_shard() of $A, which keeps it on n3, goes while $A holds its two tickets there (and $B its stray one)" \
  "00000 t 3 2" "$(state_on 0 postgres "SELECT isolate_tenant_to_new_shard('jobs', '$A', 'CASCADE', shard_transfer_mode := 'block_writes')") $(
     n 0 -c "SELECT get_shard_id_for_distribution_column('jobs', '$A') <> $SHARD") $(node_of "$A") $(live 3 "$A")"
expect_eq "… where $A stays at its limit: refused from the coordinator, from n1, and in the session on n3 that remembered its old shard (at its limit, not for want of a node)" \
  "f f primed:refused f 00000" "$(try 0 "$A") $(try 1 "$A") $(grep -o 'primed:.*' "$DIR/n3/iso.out") $(
     say iso "BEGIN;"; say iso "SELECT 'after:' || coalesce(quota.try_start(tenant => '$A', label => 'iso')::text, 'refused');"
     say iso "\\echo after-state=:SQLSTATE"; say iso "COMMIT;"; CL="$DIR/n3" wait_out iso "after-state="
     grep -q 'after:refused' "$DIR/n3/iso.out" && echo f || echo t) $(sed -n 's/^after-state=//p' "$DIR/n3/iso.out")"
close_session iso
on 3 postgres "SELECT quota.finish(id) FROM quota.ledger WHERE label = 'stray' AND ended_at IS NULL" >/dev/null

# A start that comes while a split of its tenant's shard is under way on n3 waits for
# it, then locks and reads the tenant's new shard: where the split keeps the tenant
# here, it is judged here (at its limit), not refused for want of a node. The split's
# metadata change on n3 is held open here by hand, as the move's was: $A's shard
# replaced in n3's catalog by a new one over the same hashes, also on n3 (the rows
# stay where they are), then put back.
ISO=$(n 0 -c "SELECT get_shard_id_for_distribution_column('jobs', '$A')")
read -r ISO_MIN ISO_MAX < <(n 3 -F ' ' -c "SELECT shardminvalue, shardmaxvalue FROM pg_dist_shard WHERE shardid = $ISO")
read -r ISO_PLACEMENT G3 < <(n 3 -F ' ' -c "SELECT placementid, groupid FROM pg_dist_placement WHERE shardid = $ISO")
replace_shard() {  # replace_shard OLD NEW NEW_PLACEMENT: on n3, in the session meta, left open
  say meta "BEGIN;"
  say meta "SELECT citus_internal.delete_shard_metadata($1);"
  say meta "SELECT citus_internal.add_shard_metadata('jobs'::regclass, $2, 't', '$ISO_MIN', '$ISO_MAX');"
  say meta "SELECT citus_internal.add_placement_metadata($2, 0, $G3, $3);"
  say meta "\\echo replaced-$2=:SQLSTATE"
}
CL="$DIR/n3" PORT=$((BASE + 3)) open_session sw app app
say sw "BEGIN;"  # run here, not delegated: try_start() is not force-delegated
say sw "SELECT 'primed:' || coalesce(quota.try_start(tenant => '$A', label => 'split wait')::text, 'refused');"
say sw "COMMIT;"
CL="$DIR/n3" wait_out sw "primed:"
PGAPPNAME="$CITUS_APP" CL="$DIR/n3" PORT=$((BASE + 3)) open_session meta postgres app
replace_shard "$ISO" 990001 990001
CL="$DIR/n3" wait_out meta "replaced-990001="
say sw "SELECT 'during:' || coalesce(quota.try_start(tenant => '$A', label => 'split wait')::text, 'refused');"
say sw "\\echo during=:SQLSTATE"
waited=$(waiting_on 3 'split wait')
say meta "COMMIT;"
CL="$DIR/n3" wait_out sw "during="
expect_eq "a start of $A on n3 while a split that keeps $A there is under way waits for it, then is judged on $A's new shard: at its limit (refused, 00000), not 0A000" \
  "replaced-990001=00000 waiting during:refused 00000" \
  "$(grep -o 'replaced-990001=.*' "$DIR/n3/meta.out") $waited $(grep -o 'during:.*' "$DIR/n3/sw.out") $(sed -n 's/^during=//p' "$DIR/n3/sw.out")"
close_session sw
replace_shard 990001 "$ISO" "$ISO_PLACEMENT"
say meta "COMMIT;"
say meta "\\echo restored=:SQLSTATE"
CL="$DIR/n3" wait_out meta "restored="
close_session meta
expect_eq "… and with n3's metadata put back, $A's shard is $ISO again there, with its two tickets" \
  "restored=00000 $ISO 2" "$(grep -o 'restored=.*' "$DIR/n3/meta.out") $(
     on 3 postgres "SELECT get_shard_id_for_distribution_column('jobs', '$A')") $(live 3 "$A")"

# Citus runs a move or a split as the user who calls it, which may be the tables'
# owner rather than a superuser: pg_quota's guard holds for that user alike.
owners() {  # owners ROLE: the queue's tables' owner (back to postgres: its grants to app again)
  n 0 -c "ALTER TABLE jobs OWNER TO $1" -c "ALTER TABLE running OWNER TO $1" -c "ALTER TABLE tjobs OWNER TO $1" \
      -c "GRANT ALL ON jobs, running, tjobs, jobs_id_seq, tjobs_id_seq TO app" >/dev/null  # the old owner's rights went with it
}
owners app
owner_move=$(out_on 0 app "SELECT citus_move_shard_placement($ISO, '$DIR/n3', $((BASE + 3)), '$DIR/n1', $((BASE + 1)), shard_transfer_mode := 'block_writes')")
expect_eq "a move of $A's shard off n3 run by the tables' owner, not a superuser, is refused alike (55000), $A's two tickets kept there" \
  "55000 t 3 2" "$(sqlstate_of "$owner_move") $(grep -q "pg_quota cannot let shard $ISO leave this node: tenant \"$A\" holds active tickets here" <<<"$owner_move" && echo t || echo f) $(
     node_of "$A") $(live 3 "$A")"
owners postgres

# --- a tenant's own limits hold a split off --------------------------------------------------
# A tenant's own limits on a worker hold a split off as its tickets do, whoever runs
# it: $B's own limits on n$NB, and a split that would place $B's new shard on the
# other worker, run by the tables' owner.
on 0 postgres "SELECT quota.set_tenant_limits('$B', max_active => 1, role => 'app')" >/dev/null
SB=$(n 0 -c "SELECT get_shard_id_for_distribution_column('jobs', '$B')")
owners app
own_split=$(split_to app "$SB" "$B" "$(other "$NB")" "$NB" block_writes)
owners postgres
expect_eq "with $B's own limits on n$NB and no ticket, a split by the tables' owner that would place $B's new shard on n$(other "$NB") is refused by n$NB (55000), the shard kept whole" \
  "55000 t $SB $NB" "$(sqlstate_of "$own_split") $(grep -q "pg_quota cannot let the split of shard $SB place tenants on another node: tenant \"$B\" has its own limits here" <<<"$own_split" && echo t || echo f) $(
     n 0 -c "SELECT get_shard_id_for_distribution_column('jobs', '$B')") $(node_of "$B")"
on 0 postgres "SELECT quota.set_tenant_limits('$B', role => 'app')" >/dev/null

# --- a coordinator that holds shards -------------------------------------------------------
# With shouldhaveshards on, the coordinator holds shards as a worker does, and admits
# their tenants. Citus changes the coordinator's own metadata in C, without the
# commands the other nodes get, so pg_quota sees a move or a split off it by its call
# there (citus/runs.rs), and refuses it alike as its transaction commits.
n 0 -c "SELECT citus_set_node_property('$DIR/n0', $BASE, 'shouldhaveshards', true)" >/dev/null
on "$NB" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE ended_at IS NULL" >/dev/null
SB=$(n 0 -c "SELECT get_shard_id_for_distribution_column('jobs', '$B')")
coord_move() {  # coord_move SHARD FROM TO: a move of the shard, its output and SQLSTATE=…
  out_on 0 postgres "SELECT citus_move_shard_placement($1, '$DIR/n$2', $((BASE + $2)), '$DIR/n$3', $((BASE + $3)), shard_transfer_mode := 'block_writes')"
}
expect_eq "with the coordinator set to hold shards, $B's shard $SB moves to it from n$NB" "00000 0" \
  "$(sqlstate_of "$(coord_move "$SB" "$NB" 0)") $(node_of "$B")"
expect_eq "… where $B is admitted, from every node, to its limit of 2, by the coordinator's ledger" "f t t 2 0" \
  "$(for i in 0 1 2; do try "$i" "$B" "on the coordinator"; done | sort | xargs) $(live 0 "$B") $(live "$NB" "$B")"
# A superuser's start (never refused) of $A, run on the coordinator, which does not
# hold $A: a ticket that no operation on the coordinator's shards moved, and that
# judges none of them.
on 0 postgres "BEGIN" "SELECT quota.try_start(tenant => '$A', label => 'stray on the coordinator')" "COMMIT" >/dev/null
coord_out=$(coord_move "$SB" 0 "$NB")
expect_eq "while $B holds two tickets on the coordinator, moving its shard back to n$NB is refused by the coordinator (55000), naming $B alone (not $A, whose stray ticket is there too), and fails whole" \
  "55000 t 0 2 1" "$(sqlstate_of "$coord_out") $(grep -q "pg_quota cannot let shard $SB leave this node: tenant \"$B\" holds active tickets here\$" <<<"$coord_out" && echo t || echo f) $(
     node_of "$B") $(live 0 "$B") $(live 0 "$A")"
coord_out=$(split_to postgres "$SB" "$B" "$NB" 0 block_writes)
expect_eq "… and a split of it that would place $B's new shard on n$NB is refused by the coordinator (55000): the shard stays whole, with $B's tickets" \
  "55000 t $SB 0 2" "$(sqlstate_of "$coord_out") $(grep -q "pg_quota cannot let the split of shard $SB place tenants on another node: tenant \"$B\" holds active tickets here\$" <<<"$coord_out" && echo t || echo f) $(
     n 0 -c "SELECT get_shard_id_for_distribution_column('jobs', '$B')") $(node_of "$B") $(live 0 "$B")"
# A transactional start of $B in a transaction still open on the coordinator: the move
# is refused (55P03), as a worker refuses it, rather than left to wait.
on 0 postgres "SELECT quota.finish(id) FROM (SELECT id FROM quota.ledger WHERE tenant = '$B' AND ended_at IS NULL LIMIT 1) l" >/dev/null
CL="$DIR/n0" PORT=$BASE open_session ctx app app
say ctx "BEGIN;"
say ctx "SELECT 'started:' || quota.start(tenant => '$B', label => 'in flight', transactional => true);"
CL="$DIR/n0" wait_out ctx "started:"
coord_out=$(coord_move "$SB" 0 "$NB")
expect_eq "while an enqueue of $B is in its transaction on the coordinator, moving its shard off is refused (55P03)" "55P03 t 0" \
  "$(sqlstate_of "$coord_out") $(grep -q "pg_quota cannot let shard $SB leave this node now: a start for one of its tenants is in progress here" <<<"$coord_out" && echo t || echo f) $(node_of "$B")"
say ctx "ROLLBACK;"
close_session ctx
expect_eq "isolate_tenant_to_new_shard() of $B on the coordinator, which keeps it there, goes while $B holds a ticket there" \
  "00000 t 0 1" "$(state_on 0 postgres "SELECT isolate_tenant_to_new_shard('jobs', '$B', 'CASCADE', shard_transfer_mode := 'block_writes')") $(
     n 0 -c "SELECT get_shard_id_for_distribution_column('jobs', '$B') <> $SB") $(node_of "$B") $(live 0 "$B")"
# citus_drain_node() runs each of its moves in a session of its own, opened to the
# coordinator, whose commit reports an error as a warning: the refusal comes in the
# move's own statement there, so the drain fails with it.
SB=$(n 0 -c "SELECT get_shard_id_for_distribution_column('jobs', '$B')")
drain_out=$(out_on 0 postgres "SELECT citus_drain_node('$DIR/n0', $BASE, shard_transfer_mode := 'block_writes')")
expect_eq "citus_drain_node() of the coordinator is refused for $B's shard $SB (55000) while $B holds its ticket, which stays there" \
  "55000 t 0 1" "$(sqlstate_of "$drain_out") $(grep -q "pg_quota cannot let shard $SB leave this node: tenant \"$B\" holds active tickets here" <<<"$drain_out" && echo t || echo f) $(
     node_of "$B") $(live 0 "$B")"
# The background rebalancer drains the coordinator (shouldhaveshards off again): each
# of its moves is a call of citus_move_shard_placement() in a session of its own on
# the coordinator, refused there alike while $B holds its ticket (Citus retries the
# task), and once the ticket has ended, the rebalance started again drains it.
n 0 -c "SELECT citus_set_node_property('$DIR/n0', $BASE, 'shouldhaveshards', false)" \
    -c "SELECT citus_rebalance_start(drain_only := true, shard_transfer_mode := 'block_writes')" >/dev/null 2>&1
refused=""
for _ in $(seq 120); do
  refused=$(n 0 -c "SELECT message FROM pg_dist_background_task WHERE message LIKE '%pg_quota cannot let shard%' LIMIT 1")
  [ -n "$refused" ] && break
  sleep 0.25
done
expect_eq "the background rebalancer's drain of the coordinator is refused there for $B's shard $SB while $B holds its ticket, which stays there" \
  "t 0 1" "$(grep -q "pg_quota cannot let shard $SB leave this node: tenant \"$B\" holds active tickets here" <<<"$refused" && echo t || echo f) $(
     node_of "$B") $(live 0 "$B")"
on 0 postgres "SELECT quota.finish(id) FROM quota.ledger WHERE tenant = '$B' AND ended_at IS NULL" >/dev/null
n 0 -c "SELECT citus_rebalance_stop()" >/dev/null 2>&1 || true
n 0 -c "SELECT citus_rebalance_start(drain_only := true, shard_transfer_mode := 'block_writes')" \
    -c "SET statement_timeout = '120s'" -c "SELECT citus_rebalance_wait()" >/dev/null 2>&1 || true  # a refusal is retried, not raised
NB=$(node_of "$B")
expect_eq "with $B's ticket ended, the rebalance started again drains the coordinator, and $B is admitted where its shard went (n$NB, not $A's n3, as what follows assumes), and only there" \
  "0 t t 1 0" "$(n 0 -c "SELECT count(*) FROM pg_dist_placement WHERE groupid = 0") $([ "$NB" != 3 ] && [ "$NB" != 0 ] && echo t || echo f) $(
     try 0 "$B" back) $(live "$NB" "$B") $(live 0 "$B")"
SB=$(n 0 -c "SELECT get_shard_id_for_distribution_column('jobs', '$B')")
on "$NB" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE tenant = '$B' AND ended_at IS NULL" >/dev/null
on 0 postgres "SELECT quota.finish(id) FROM quota.ledger WHERE label = 'stray on the coordinator' AND ended_at IS NULL" >/dev/null

# --- a coordinator failover ---------------------------------------------------------------
# The coordinator's hot standby (pg_basebackup -R) is promoted once the coordinator
# crashes, and citus_set_coordinator_host() points the cluster at it. The coordinator's
# ledger holds only the tickets of starts without a tenant made there, which streaming
# replication carries as on any server (here; with shards it would hold their tenants'
# tickets too); tenants' tickets are on the workers, which the failover does not touch.
CO=5  # the promoted coordinator: node 5, $DIR/n5
mkdir -p "$DIR/n$CO"; chown "$PG_USER" "$DIR/n$CO"; CLUSTERS+=("$DIR/n$CO")
as_pg "$PG_BIN/pg_basebackup" -h "$DIR/n0" -p "$BASE" -U postgres -D "$DIR/n$CO/data" -R -X stream -c fast
sed -i "s/^port = .*/port = $((BASE + CO))/; s|^unix_socket_directories = .*|unix_socket_directories = '$DIR/n$CO'|;
        s|^citus.local_hostname = .*|citus.local_hostname = '$DIR/n$CO'|" "$DIR/n$CO/data/postgresql.conf"
as_pg "$PG_BIN/pg_ctl" -D "$DIR/n$CO/data" -l "$DIR/n$CO/server.log" -w -t 60 start >/dev/null
# A ticket taken once the standby streams: it reaches the standby by replication.
TL=$(on 0 app "SELECT quota.start(label => 'coordinator')")
LSN=$(n 0 -c "SELECT pg_current_wal_lsn()")
replayed=f
for _ in $(seq 300); do
  replayed=$(n "$CO" -c "SELECT pg_last_wal_replay_lsn() >= '$LSN'" 2>/dev/null || echo f)
  [ "$replayed" = t ] && break
  sleep 0.1
done
expect_eq "the coordinator's standby streams, and replayed the ticket's commit before the crash" "t streaming" \
  "$replayed $(n 0 -c "SELECT state FROM pg_stat_replication")"
live_a=$(live 3 "$A"); live_b=$(live "$NB" "$B")
stop_cluster "$DIR/n0" immediate
as_pg "$PG_BIN/pg_ctl" -D "$DIR/n$CO/data" -w -t 60 promote >/dev/null
n "$CO" -c "SELECT citus_set_coordinator_host('$DIR/n$CO', $((BASE + CO)))" >/dev/null
expect_eq "after the coordinator's crash, its promoted standby is the coordinator, for every worker" \
  "f $DIR/n$CO:$((BASE + CO)) $DIR/n$CO:$((BASE + CO))" \
  "$(n "$CO" -c "SELECT pg_is_in_recovery()") $(for i in 1 3; do n "$i" -c "SELECT nodename || ':' || nodeport FROM pg_dist_node WHERE groupid = 0"; done | xargs)"
expect_eq "… with the ticket of a start without a tenant taken on the old coordinator, which it finishes" "1 t" \
  "$(n "$CO" -c "SELECT count(*) FROM quota.ledger WHERE id = '$TL' AND ended_at IS NULL") $(on "$CO" app "SELECT quota.finish('$TL')")"
expect_eq "from the new coordinator, $A is refused at its limit (its two tickets on n3 kept) and $B admitted, on its node" \
  "2 f t $((live_b + 1))" "$live_a $(try "$CO" "$A") $(try "$CO" "$B" "failover") $(live "$NB" "$B")"
expect_eq "… and an enqueue() of $B from the new coordinator runs on $B's node, its job with it" "00000 $((live_b + 2)) 1" \
  "$(state_on "$CO" app "SELECT enqueue('$B', 'after failover')") $(live "$NB" "$B") $(
     n "$CO" -c "SELECT count(*) FROM jobs WHERE tenant = '$B' AND payload = 'after failover'")"
expect_eq "a start without a tenant on the new coordinator is admitted there, by its own ledger writer" "t 1" \
  "$(on "$CO" app "SELECT quota.try_start(label => 'new coordinator') IS NOT NULL") $(
     n "$CO" -c "SELECT count(*) FROM quota.ledger WHERE label = 'new coordinator' AND ended_at IS NULL")"

# --- updating pg_quota across the cluster ---------------------------------------------
# ALTER EXTENSION pg_quota UPDATE on the coordinator (the promoted one) is Citus' to propagate: every node
# is updated in the one distributed transaction, so no two nodes answer on two
# versions. (Last: it drops the extension, and what the suite built with it.)
versions() { for i in "$CO" 1 2 3; do n "$i" -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_quota'"; done | xargs; }
CURRENT=$(n "$CO" -c "SELECT default_version FROM pg_available_extensions WHERE name = 'pg_quota'")
n "$CO" -c "DROP EXTENSION pg_quota CASCADE" -c "CREATE EXTENSION pg_quota VERSION '0.6.1'" >/dev/null 2>&1
expect_eq "CREATE EXTENSION pg_quota VERSION '0.6.1' on the coordinator reaches every node" "0.6.1 0.6.1 0.6.1 0.6.1" "$(versions)"
# Nodes on two versions for a while: $B's node updated alone (DDL propagation off
# there), the others still on 0.6.1, start() distributed by tenant again.
n "$CO" -c "SELECT create_distributed_function('quota.start(text,interval,text,interval,text,boolean)', '\$5', colocate_with := 'jobs', force_delegation := true)" >/dev/null
n "$NB" -c "SET citus.enable_ddl_propagation = off" -c "ALTER EXTENSION pg_quota UPDATE" >/dev/null
mixed() {  # mixed NODE TENANT: start() alone in its statement; t if admitted
  case "$(on "$1" app "SELECT quota.start(tenant => '$2', label => 'mixed')")" in *-*) echo t ;; esac
}
expect_eq "with $B's node (n$NB) on $CURRENT and the rest on 0.6.1, a start of $B and one of $A (n3) from the coordinator are each admitted on their tenant's node" \
  "$(n "$NB" -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_quota'") t t 1 1" \
  "$(n "$NB" -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_quota'" | grep -vx 0.6.1) $(mixed "$CO" "$B") $(mixed "$CO" "$A") $(
     live "$NB" "$B") $(live 3 "$A")"
expect_eq "… and each version's node refuses a start of the other's tenant run there (0A000)" "0A000 0A000" \
  "$(state_on "$NB" app "BEGIN" "SELECT quota.try_start(tenant => '$A')") $(state_on 3 app "BEGIN" "SELECT quota.try_start(tenant => '$B')")"
expect_eq "ALTER EXTENSION pg_quota UPDATE on the coordinator updates every node to $CURRENT" \
  "00000 $CURRENT $CURRENT $CURRENT $CURRENT" "$(state_on "$CO" postgres "ALTER EXTENSION pg_quota UPDATE") $(versions)"

# --- changing the shard count ---------------------------------------------------------------
# alter_distributed_table(… shard_count …) of the table the start functions are colocated
# with (and its colocated tables) moves the functions' colocation on the coordinator
# only (Citus 14): the workers' copy then names a colocation group without tables, and
# every start for a tenant is refused there (0A000) until the start functions are
# distributed again, which the DBA does once the tenants' tickets from before have
# ended (USER_GUIDE "Citus").
now_of() {  # the node (port - BASE) that holds the tenant's shard of jobs now
  n "$CO" -c "SELECT n.nodeport - $BASE FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
               WHERE p.shardid = get_shard_id_for_distribution_column('jobs', '$1')"
}
COUNT=$(( $(n "$CO" -c "SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'jobs'::regclass") + 4 ))  # isolations added some
expect_eq "alter_distributed_table() of jobs to $COUNT shards, cascaded to its colocated tables, goes" 00000 \
  "$(state_on "$CO" postgres "SELECT alter_distributed_table('jobs', shard_count := $COUNT, cascade_to_colocated := true)")"
altered=$(out_on "$CO" app "SELECT quota.start(tenant => '$B', label => 'altered')")
expect_eq "… after which a start of $B is refused on its node (0A000): the workers' start functions name a colocation group without tables" \
  "0A000 t" "$(sqlstate_of "$altered") $(grep -q "tenant \"$B\" cannot be placed: pg_quota's start functions are colocated with no table" <<<"$altered" && echo t || echo f)"
for i in 1 2 3; do on "$i" postgres "SELECT quota.finish(id) FROM quota.ledger WHERE ended_at IS NULL" >/dev/null; done
n "$CO" -c "SELECT create_distributed_function('quota.start(text,interval,text,interval,text,boolean)', '\$5', colocate_with := 'jobs', force_delegation := true)" >/dev/null
NB8=$(now_of "$B")
expect_eq "… and with the tickets from before ended and start() distributed again, $B is admitted on the node of its new shard (n$NB8), and only there" \
  "t 1 1" "$(mixed "$CO" "$B") $(live "$NB8" "$B") $(total=0; for i in 1 2 3; do total=$((total + $(live "$i" "$B"))); done; echo $total)"

finish_checks
