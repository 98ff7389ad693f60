-- Fixture for scripts/bench: pg_quota plus the three baselines it is compared with.
-- Run as a superuser in the bench database. :connstr is a libpq string for B2's
-- loopback connection; :roles is how many bench_rN roles to create.
CREATE EXTENSION pg_quota;
CREATE EXTENSION dblink;
CREATE SCHEMA bench;

-- Every bench role may run one unit of work per client at a time; the retained limit
-- is off so that long runs measure the active path, not the window.
SELECT format('CREATE ROLE bench_r%s LOGIN', i) FROM generate_series(1, :roles) i \gexec
SELECT format('ALTER ROLE bench_r%s SET quota.max_active_per_role = 1000', i) FROM generate_series(1, :roles) i \gexec
SELECT format('ALTER ROLE bench_r%s SET quota.max_retained_per_role = 0', i) FROM generate_series(1, :roles) i \gexec
CREATE ROLE bench_refused LOGIN;
ALTER ROLE bench_refused SET quota.max_active_per_role = 1;
-- Databases beyond the worker slots (bench_db_N, made by run.py): one client each.
CREATE ROLE bench_dbs LOGIN;
ALTER ROLE bench_dbs SET quota.max_active_per_role = 1000;
ALTER ROLE bench_dbs SET quota.max_retained_per_role = 0;
CREATE ROLE bench_history LOGIN;
ALTER ROLE bench_history SET quota.max_active_per_role = 10;
ALTER ROLE bench_history SET quota.max_retained_per_role = 1000000;

GRANT USAGE ON SCHEMA bench TO PUBLIC;

-- B0, the floor: a bare one-row INSERT and commit.
CREATE TABLE bench.b0_log (id bigserial PRIMARY KEY, role name NOT NULL DEFAULT current_user,
                           at timestamptz NOT NULL DEFAULT now());
GRANT INSERT ON bench.b0_log TO PUBLIC;
GRANT USAGE ON SEQUENCE bench.b0_log_id_seq TO PUBLIC;

-- B1, the usual guard: an advisory lock keyed on the role, count(*), INSERT; finish is
-- an UPDATE. Not rollback-proof: a rollback erases the charge.
CREATE TABLE bench.b1_ledger (id bigserial PRIMARY KEY, role name NOT NULL,
                              started_at timestamptz NOT NULL DEFAULT now(), ended_at timestamptz);
CREATE INDEX ON bench.b1_ledger (role) WHERE ended_at IS NULL;

CREATE FUNCTION bench.b1_start(lim int DEFAULT 1000) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
DECLARE n bigint; t bigint;
BEGIN
  PERFORM pg_advisory_xact_lock(hashtext(session_user));
  SELECT count(*) INTO n FROM bench.b1_ledger WHERE role = session_user AND ended_at IS NULL;
  IF n >= lim THEN
    RAISE EXCEPTION 'quota exceeded for %', session_user USING ERRCODE = '53400';
  END IF;
  INSERT INTO bench.b1_ledger (role) VALUES (session_user) RETURNING id INTO t;
  RETURN t;
END $$;

CREATE FUNCTION bench.b1_finish(t bigint) RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog AS $$
  UPDATE bench.b1_ledger SET ended_at = now() WHERE id = t AND ended_at IS NULL RETURNING true
$$;

-- B2, the classic rollback-proof guard: B1 with the INSERT sent through a persistent
-- dblink loopback connection (one per session), so that it commits on its own.
CREATE TABLE bench.b2_ledger (LIKE bench.b1_ledger INCLUDING ALL);
CREATE TABLE bench.config (connstr text NOT NULL);
INSERT INTO bench.config VALUES (:'connstr');

CREATE FUNCTION bench.b2_start(lim int DEFAULT 1000) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE n bigint; t bigint;
BEGIN
  IF NOT coalesce('b2' = ANY (dblink_get_connections()), false) THEN
    PERFORM dblink_connect_u('b2', (SELECT connstr FROM bench.config));
  END IF;
  PERFORM pg_advisory_xact_lock(hashtext(session_user));
  SELECT count(*) INTO n FROM bench.b2_ledger WHERE role = session_user AND ended_at IS NULL;
  IF n >= lim THEN
    RAISE EXCEPTION 'quota exceeded for %', session_user USING ERRCODE = '53400';
  END IF;
  SELECT id INTO t FROM dblink('b2',
    format('INSERT INTO bench.b2_ledger (role) VALUES (%L) RETURNING id', session_user)) AS r(id bigint);
  RETURN t;
END $$;

CREATE FUNCTION bench.b2_finish(t bigint) RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog AS $$
  UPDATE bench.b2_ledger SET ended_at = now() WHERE id = t AND ended_at IS NULL RETURNING true
$$;

-- The job lifecycles (bench/scripts/job*.sql): an application's queue table, where a
-- job is enqueued by one INSERT and completed by one UPDATE. JOB1 keeps B1's guard in
-- `guard`, JOBQ pg_quota's ticket in `ticket`.
CREATE TABLE bench.jobs (id bigserial PRIMARY KEY, role name NOT NULL DEFAULT current_user,
                         payload text, guard bigint, ticket uuid,
                         created_at timestamptz NOT NULL DEFAULT now(), done_at timestamptz,
                         released boolean);
GRANT SELECT, INSERT, UPDATE ON bench.jobs TO PUBLIC;
GRANT USAGE ON SEQUENCE bench.jobs_id_seq TO PUBLIC;

GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA bench TO PUBLIC;

-- The refusal path: bench_refused holds its one ticket for the whole run.
SET quota.max_active_per_role = 1;
SET ROLE bench_refused;
SELECT quota.start('held for the refusal workload') IS NOT NULL AS holding;
RESET ROLE;
RESET quota.max_active_per_role;

-- The old-snapshot workloads: one role per round and per side, so that the dead
-- versions one run leaves behind do not slow the next. Refused roles churn first, then
-- take their two tickets (see bench/run.py).
SELECT format('CREATE ROLE bench_snap_%s_%s_%s LOGIN', w, r, h)
  FROM unnest(ARRAY['cycle', 'refused']) w, generate_series(0, 2) r, generate_series(0, 1) h \gexec
SELECT format('ALTER ROLE bench_snap_cycle_%s_%s SET quota.max_active_per_role = 1000', r, h)
  FROM generate_series(0, 2) r, generate_series(0, 1) h \gexec
SELECT format('ALTER ROLE bench_snap_cycle_%s_%s SET quota.max_retained_per_role = 0', r, h)
  FROM generate_series(0, 2) r, generate_series(0, 1) h \gexec
SELECT format('ALTER ROLE bench_snap_refused_%s_%s SET quota.max_active_per_role = 2', r, h)
  FROM generate_series(0, 2) r, generate_series(0, 1) h \gexec
SELECT format('ALTER ROLE bench_snap_refused_%s_%s SET quota.max_retained_per_role = 0', r, h)
  FROM generate_series(0, 2) r, generate_series(0, 1) h \gexec

-- Idempotent retries: bench_idem's 16 keys each hold a ticket (bench/run.py starts them),
-- which is its limit, so a repeat that charged would be refused. 16 is IDEM_CLIENTS there.
CREATE ROLE bench_idem LOGIN;
ALTER ROLE bench_idem SET quota.max_active_per_role = 16;
ALTER ROLE bench_idem SET quota.max_retained_per_role = 0;

-- Wake latency: bench_wake may hold one ticket at a time.
CREATE ROLE bench_wake LOGIN;
ALTER ROLE bench_wake SET quota.max_active_per_role = 1;
ALTER ROLE bench_wake SET quota.max_retained_per_role = 0;

-- Measures how soon a start() waiting for bench_wake's one slot returns once the slot
-- frees. Two dblink sessions of bench_wake: h holds the ticket, w calls
-- start(wait => '30 s'). Once w sleeps in line (wait event Extension), either h
-- finishes its ticket in a transaction of its own (how = 'finish': measured from just
-- before COMMIT), or h's ticket, started with `lease`, runs out (how = 'lease':
-- measured from its lease_until). Both ends are clock_timestamp() on this server; w's
-- is taken right after its start() returned. One row per sample, after a first one
-- that warms up: wake_ms (NULL if w was not yet waiting when the lease ran out) and,
-- for 'finish', how long the COMMIT took. Superuser only (dblink_connect_u).
CREATE FUNCTION bench.wake_latency(samples int, how text, lease interval DEFAULT '250 ms')
RETURNS TABLE (wake_ms float8, commit_ms float8)
LANGUAGE plpgsql SET search_path = pg_catalog, public AS $$
DECLARE
  conn text := (SELECT connstr FROM bench.config) || ' user=bench_wake';
  wpid int; held uuid; got uuid; freed timestamptz; committed timestamptz;
  sent timestamptz; waiting timestamptz; back timestamptz;
BEGIN
  IF how NOT IN ('finish', 'lease') THEN
    RAISE EXCEPTION 'how must be finish or lease, not %', how;
  END IF;
  PERFORM dblink_connect_u('wake_h', conn);
  PERFORM dblink_connect_u('wake_w', conn);
  SELECT pid INTO wpid FROM dblink('wake_w', 'SELECT pg_backend_pid()') AS r(pid int);
  FOR i IN 0 .. samples LOOP
    IF how = 'finish' THEN
      SELECT t INTO held FROM dblink('wake_h', 'SELECT quota.start()') AS r(t uuid);
    ELSE
      SELECT t INTO held FROM dblink('wake_h', format('SELECT quota.start(lease => %L)', lease)) AS r(t uuid);
      SELECT lease_until INTO freed FROM quota.tickets WHERE id = held;
    END IF;
    sent := clock_timestamp();
    PERFORM dblink_send_query('wake_w',
      'SELECT t, clock_timestamp() FROM quota.start(wait => ''30 s'') t');
    -- Until w sleeps in line. pg_stat_activity is read once per transaction unless
    -- the snapshot is cleared.
    LOOP
      PERFORM pg_stat_clear_snapshot();
      EXIT WHEN dblink_is_busy('wake_w') = 0 OR EXISTS (
        SELECT FROM pg_stat_activity
         WHERE pid = wpid AND state = 'active' AND wait_event_type = 'Extension');
      IF clock_timestamp() > sent + interval '30 s' THEN
        RAISE EXCEPTION 'the waiter never waited';
      END IF;
      PERFORM pg_sleep(0.001);
    END LOOP;
    waiting := clock_timestamp();
    committed := NULL;
    IF how = 'finish' THEN
      IF dblink_is_busy('wake_w') = 0 THEN
        RAISE EXCEPTION 'the waiter got a ticket while the holder still held the only one';
      END IF;
      PERFORM dblink_exec('wake_h', 'BEGIN');
      PERFORM FROM dblink('wake_h', format('SELECT quota.finish(%L)', held)) AS r(ok boolean);
      freed := clock_timestamp();
      PERFORM dblink_exec('wake_h', 'COMMIT');
      committed := clock_timestamp();
    END IF;
    SELECT t, at INTO got, back FROM dblink_get_result('wake_w') AS r(t uuid, at timestamptz);
    -- The empty result that frees the connection for the next query.
    PERFORM FROM dblink_get_result('wake_w') AS r(t uuid, at timestamptz);
    PERFORM FROM dblink('wake_h', format('SELECT quota.finish(%L)', got)) AS r(ok boolean);
    IF i > 0 THEN
      wake_ms := CASE WHEN waiting < freed
                      THEN extract(epoch FROM back - freed) * 1000 END;
      commit_ms := extract(epoch FROM committed - freed) * 1000;
      RETURN NEXT;
    END IF;
  END LOOP;
  PERFORM dblink_disconnect('wake_h');
  PERFORM dblink_disconnect('wake_w');
END $$;

-- 0.5.0: the bench roles may take transactional charges (JOBT).
SELECT format('ALTER ROLE bench_r%s SET quota.allow_transactional = on', i) FROM generate_series(1, :roles) i \gexec

-- JOBT-tenants: 16 clients of one role, each job for a tenant drawn from 1,000; the
-- tenant limit is set (and checked) without refusing.
CREATE ROLE bench_tenants LOGIN;
ALTER ROLE bench_tenants SET quota.max_active_per_role = 100000;
ALTER ROLE bench_tenants SET quota.max_retained_per_role = 0;
ALTER ROLE bench_tenants SET quota.max_active_per_tenant = 100;
ALTER ROLE bench_tenants SET quota.allow_transactional = on;

-- Refusals of a tenant at its limit: bench_tenant_refused's tenant 'held' holds its one.
CREATE ROLE bench_tenant_refused LOGIN;
ALTER ROLE bench_tenant_refused SET quota.max_active_per_role = 1000;
ALTER ROLE bench_tenant_refused SET quota.max_retained_per_role = 0;
ALTER ROLE bench_tenant_refused SET quota.max_active_per_tenant = 1;
SET ROLE bench_tenant_refused;
SELECT quota.start('held for the tenant refusal workload', tenant => 'held') IS NOT NULL AS holding;
RESET ROLE;

-- 100,000 tenants of one role, each holding one ticket (bench/run.py fills them), for
-- start() of tenant #100,000 against tenant #1.
CREATE ROLE bench_many_tenants LOGIN;
ALTER ROLE bench_many_tenants SET quota.max_active_per_role = 1000000;
ALTER ROLE bench_many_tenants SET quota.max_retained_per_role = 0;
ALTER ROLE bench_many_tenants SET quota.max_active_per_tenant = 10;
ALTER ROLE bench_many_tenants SET quota.allow_transactional = on;

-- CALL0: a C function that does nothing, with quota.start()'s exact signature and
-- defaults (bench/call0/call0.c, built and installed by scripts/bench): the floor of
-- such a call, which refusals are measured against.
CREATE FUNCTION bench.call0(
	"label" TEXT DEFAULT NULL,
	"lease" interval DEFAULT NULL,
	"idempotency_key" TEXT DEFAULT NULL,
	"wait" interval DEFAULT '0',
	"tenant" TEXT DEFAULT NULL,
	"transactional" bool DEFAULT false
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS '$libdir/pg_quota_bench_call0', 'call0';
GRANT EXECUTE ON FUNCTION bench.call0 TO PUBLIC;
-- FINISH0: the same for quota.finish() (JOBT0: JOBT's statements, pg_quota's work left out).
CREATE FUNCTION bench.finish0(
	"ticket" uuid,
	"outcome" TEXT DEFAULT 'succeeded'
) RETURNS bool
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS '$libdir/pg_quota_bench_call0', 'finish0';
GRANT EXECUTE ON FUNCTION bench.finish0 TO PUBLIC;
