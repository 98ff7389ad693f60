-- pg_quota's own objects. CREATE EXTENSION creates the schema "quota" (see the control
-- file); everything here lives in it and belongs to the extension.
--
-- Keep in step with sql/pg_quota--*--*.sql: scripts/test-upgrade checks that an
-- upgraded install and a fresh one have the same catalog entries.

-- If the schema "quota" already existed, CREATE EXTENSION installs into it. Its owner
-- could then rename it, put look-alike tables in its place, and so bypass every
-- limit. Install only into a schema that a superuser owns, that only superusers may
-- create objects in, and that holds nothing yet.
DO $guard$
DECLARE
    owner     pg_catalog.name;
    super     boolean;
    creators  pg_catalog.text;
    objects   bigint;
BEGIN
    SELECT r.rolname, r.rolsuper INTO owner, super
      FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_roles r ON r.oid OPERATOR(pg_catalog.=) n.nspowner
     WHERE n.nspname OPERATOR(pg_catalog.=) 'quota';
    IF NOT super THEN
        RAISE EXCEPTION USING
            ERRCODE = 'duplicate_schema',
            MESSAGE = pg_catalog.format('schema "quota" already exists and is owned by role %I, which is not a superuser', owner),
            DETAIL  = 'pg_quota installs into a schema of its own, which only superusers may own or change.',
            HINT    = 'Drop or rename the existing schema "quota", then run CREATE EXTENSION pg_quota again.';
    END IF;
    SELECT pg_catalog.string_agg(CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                                      ELSE pg_catalog.quote_ident(r.rolname) END, ', ')
      INTO creators
      FROM pg_catalog.pg_namespace n,
           LATERAL pg_catalog.aclexplode(n.nspacl) a
           LEFT JOIN pg_catalog.pg_roles r ON r.oid OPERATOR(pg_catalog.=) a.grantee
     WHERE n.nspname OPERATOR(pg_catalog.=) 'quota'
       AND a.privilege_type OPERATOR(pg_catalog.=) 'CREATE'
       AND NOT coalesce(r.rolsuper, false);
    IF creators IS NOT NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'duplicate_schema',
            MESSAGE = pg_catalog.format('schema "quota" already exists and lets %s create objects in it', creators),
            HINT    = 'Revoke CREATE on schema "quota" from every role that is not a superuser, or drop the schema, then run CREATE EXTENSION pg_quota again.';
    END IF;
    SELECT (SELECT pg_catalog.count(*) FROM pg_catalog.pg_class c
             WHERE c.relnamespace OPERATOR(pg_catalog.=) 'quota'::pg_catalog.regnamespace)
         OPERATOR(pg_catalog.+)
           (SELECT pg_catalog.count(*) FROM pg_catalog.pg_proc p
             WHERE p.pronamespace OPERATOR(pg_catalog.=) 'quota'::pg_catalog.regnamespace)
         OPERATOR(pg_catalog.+)
           (SELECT pg_catalog.count(*) FROM pg_catalog.pg_type t
             WHERE t.typnamespace OPERATOR(pg_catalog.=) 'quota'::pg_catalog.regnamespace)
      INTO objects;
    IF objects OPERATOR(pg_catalog.>) 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'duplicate_schema',
            MESSAGE = 'schema "quota" already exists and is not empty',
            HINT    = 'Move or drop the objects in schema "quota", then run CREATE EXTENSION pg_quota again.';
    END IF;
END
$guard$;

-- The ledger: one row per ticket. Only the ledger writer inserts and purges, and only
-- quota.finish() updates, acting as the owner. Nobody else has any privilege on it (I5).
-- "role" is a regrole, so that pg_dump writes role names and a restore into another
-- cluster, where roles have other OIDs, keeps each charge with its role.
-- From 0.2.0: lease_until (the ticket stops being active then; NULL = never),
-- idempotency_key (a repeated start() with it returns this ticket), and pid (the
-- starting backend). An expired ticket is written down by the ledger writer with
-- ended_at = lease_until and outcome 'expired'.
CREATE TABLE quota.ledger (
    id          uuid        PRIMARY KEY,
    role        regrole     NOT NULL,
    label       text,
    started_at  timestamptz NOT NULL,
    ended_at    timestamptz,
    outcome     text,
    lease_until     timestamptz,
    idempotency_key text,
    pid             integer,
    CONSTRAINT ledger_outcome_check
        CHECK (outcome IN ('succeeded', 'failed', 'cancelled', 'expired')),
    CONSTRAINT ledger_ended_has_outcome
        CHECK ((ended_at IS NULL) = (outcome IS NULL))
);

-- Serves every count admission needs for one role: active tickets (ended_at IS NULL,
-- which btree keeps together at the end of each role's range), among them those whose
-- lease ran out (ordered by lease_until), and ended tickets past the cutoff.
CREATE INDEX ledger_role_ended_idx ON quota.ledger (role, ended_at, lease_until);
-- The database's active tickets (quota.max_active_per_database) and its leases that
-- ran out (the writer's expiry sweep), without walking every role.
CREATE INDEX ledger_open_idx ON quota.ledger (ended_at, lease_until);
-- Idempotent starts: a role's tickets by key.
CREATE INDEX ledger_role_key_idx ON quota.ledger (role, idempotency_key);

-- One row per role: how many ledger rows it has. Kept by the writer in the same
-- transaction as each insert and purge, so admission never scans a role's history.
-- A role without a row has its rows counted from the ledger instead.
CREATE TABLE quota.summary (
    role    regrole PRIMARY KEY,
    tickets bigint  NOT NULL CHECK (tickets >= 0)
);

REVOKE ALL ON quota.ledger, quota.summary FROM PUBLIC;

-- pg_dump carries the charges across a dump and restore.
SELECT pg_catalog.pg_extension_config_dump('quota.ledger', '');
SELECT pg_catalog.pg_extension_config_dump('quota.summary', '');

-- pg_quota writes its tables below SQL, so these triggers fire only for writes made
-- through SQL: a superuser's INSERT, UPDATE, DELETE, TRUNCATE or COPY (pg_restore).
-- After such a write the summary no longer matches the ledger, so it is emptied and
-- every role's rows are counted afresh from the ledger when next needed. TRUNCATE
-- rather than DELETE: it removes rows whatever the writer's transaction committed
-- after this one's snapshot (under REPEATABLE READ too), and it makes the writer wait
-- until this transaction ends, so that the writer counts what it committed.
CREATE FUNCTION quota.ledger_written() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    TRUNCATE quota.summary;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION quota.ledger_written() FROM PUBLIC;
CREATE TRIGGER ledger_written AFTER INSERT OR UPDATE OR DELETE ON quota.ledger
    FOR EACH STATEMENT EXECUTE FUNCTION quota.ledger_written();
CREATE TRIGGER ledger_truncated AFTER TRUNCATE ON quota.ledger
    FOR EACH STATEMENT EXECUTE FUNCTION quota.ledger_written();
-- Fire also under session_replication_role = replica (logical replication apply,
-- pg_restore --disable-triggers does not use it): pg_quota's counters rely on them
-- (src/scopes.rs) and are not used while they are missing or disabled.
ALTER TABLE quota.ledger ENABLE ALWAYS TRIGGER ledger_written;
ALTER TABLE quota.ledger ENABLE ALWAYS TRIGGER ledger_truncated;

-- Summary rows come only from the writer. Rows that SQL inserts or updates (a
-- superuser by hand, or pg_restore of a dump) are skipped; deleting them is harmless,
-- since a missing row is counted afresh.
CREATE FUNCTION quota.summary_written() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION quota.summary_written() FROM PUBLIC;
CREATE TRIGGER summary_written BEFORE INSERT OR UPDATE ON quota.summary
    FOR EACH ROW EXECUTE FUNCTION quota.summary_written();

GRANT USAGE ON SCHEMA quota TO PUBLIC;

-- Usage per role, for the roles that have retained tickets. Superusers see every row,
-- other roles their own. "retained" uses the quota.retention of the reading session.
-- A ticket whose lease ran out counts as ended at its lease_until, whether or not the
-- ledger writer has written that down yet.
CREATE VIEW quota.usage WITH (security_barrier) AS
WITH params AS (
    SELECT pg_catalog.current_setting('quota.retention')::pg_catalog.interval AS retention,
           pg_catalog.now() AS now
), tickets AS (
    SELECT l.role,
           CASE WHEN l.ended_at IS NULL AND l.lease_until OPERATOR(pg_catalog.<=) p.now
                THEN l.lease_until ELSE l.ended_at END AS ended_at,
           p.retention,
           p.now
      FROM quota.ledger l, params p
     WHERE l.role::pg_catalog.oid OPERATOR(pg_catalog.=)
             (SELECT r.oid FROM pg_catalog.pg_roles r
               WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER)
        OR (SELECT r.rolsuper FROM pg_catalog.pg_roles r
             WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER)
        OR (SELECT pg_catalog.pg_has_role(CURRENT_USER, 'pg_read_all_stats', 'USAGE'))
)
SELECT t.role                                                        AS role,
       pg_catalog.count(*) FILTER (WHERE t.ended_at IS NULL)         AS active,
       pg_catalog.count(*)                                           AS retained,
       (pg_catalog.min(t.ended_at) OPERATOR(pg_catalog.+) t.retention) AS next_ageout
  FROM tickets t
 WHERE t.ended_at IS NULL
    OR t.ended_at OPERATOR(pg_catalog.>=) (t.now OPERATOR(pg_catalog.-) t.retention)
 GROUP BY t.role, t.retention;

GRANT SELECT ON quota.usage TO PUBLIC;

-- The holders: one row per ticket in the ledger. Roles see their own tickets,
-- superusers all; a role can find its orphans here (after a cancelled start() or a
-- lost client) and finish them. pid is the backend that started the ticket. A
-- ticket whose lease ran out shows as ended at lease_until with outcome 'expired'.
CREATE VIEW quota.tickets WITH (security_barrier) AS
SELECT l.id,
       l.role,
       l.label,
       l.started_at,
       l.lease_until,
       CASE WHEN l.ended_at IS NULL AND l.lease_until OPERATOR(pg_catalog.<=) pg_catalog.now()
            THEN l.lease_until ELSE l.ended_at END AS ended_at,
       CASE WHEN l.ended_at IS NULL AND l.lease_until OPERATOR(pg_catalog.<=) pg_catalog.now()
            THEN 'expired'::pg_catalog.text ELSE l.outcome END AS outcome,
       l.idempotency_key,
       l.pid
  FROM quota.ledger l
 WHERE l.role::pg_catalog.oid OPERATOR(pg_catalog.=)
         (SELECT r.oid FROM pg_catalog.pg_roles r
           WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER)
    OR (SELECT r.rolsuper FROM pg_catalog.pg_roles r
         WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER);

GRANT SELECT ON quota.tickets TO PUBLIC;
