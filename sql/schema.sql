-- pg_quota's own objects. CREATE EXTENSION creates the schema "quota" (see the control
-- file); everything here lives in it and belongs to the extension.

-- The ledger: one row per ticket. Only the ledger writer inserts and purges, and only
-- quota.finish() updates, acting as the owner. Nobody else has any privilege on it (I5).
CREATE TABLE quota.ledger (
    id          uuid        PRIMARY KEY,
    role        oid         NOT NULL,
    label       text,
    started_at  timestamptz NOT NULL,
    ended_at    timestamptz,
    outcome     text,
    CONSTRAINT ledger_outcome_check
        CHECK (outcome IN ('succeeded', 'failed', 'cancelled')),
    CONSTRAINT ledger_ended_has_outcome
        CHECK ((ended_at IS NULL) = (outcome IS NULL))
);

-- Serves both counts admission needs: active tickets (ended_at IS NULL, which btree
-- keeps together at the end of each role's range) and ended tickets past the cutoff.
CREATE INDEX ledger_role_ended_idx ON quota.ledger (role, ended_at);

-- One row per role: how many ledger rows it has. Kept by the writer in the same
-- transaction as each insert and purge, so admission never scans a role's history.
CREATE TABLE quota.summary (
    role    oid    PRIMARY KEY,
    tickets bigint NOT NULL CHECK (tickets >= 0)
);

REVOKE ALL ON quota.ledger, quota.summary FROM PUBLIC;

-- pg_dump carries the charges across a dump and restore.
SELECT pg_catalog.pg_extension_config_dump('quota.ledger', '');
SELECT pg_catalog.pg_extension_config_dump('quota.summary', '');

GRANT USAGE ON SCHEMA quota TO PUBLIC;

-- Usage per role, for the roles that have retained tickets. Superusers see every row,
-- other roles their own. "retained" uses the quota.retention of the reading session.
CREATE VIEW quota.usage WITH (security_barrier) AS
WITH params AS (
    SELECT pg_catalog.current_setting('quota.retention')::pg_catalog.interval AS retention
)
SELECT l.role::pg_catalog.regrole                                    AS role,
       pg_catalog.count(*) FILTER (WHERE l.ended_at IS NULL)         AS active,
       pg_catalog.count(*)                                           AS retained,
       (pg_catalog.min(l.ended_at) OPERATOR(pg_catalog.+) p.retention) AS next_ageout
  FROM quota.ledger l, params p
 WHERE (l.ended_at IS NULL
        OR l.ended_at OPERATOR(pg_catalog.>=)
           (pg_catalog.now() OPERATOR(pg_catalog.-) p.retention))
   AND (l.role OPERATOR(pg_catalog.=)
          (SELECT r.oid FROM pg_catalog.pg_roles r
            WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER)
        OR (SELECT r.rolsuper FROM pg_catalog.pg_roles r
             WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER))
 GROUP BY l.role, p.retention;

GRANT SELECT ON quota.usage TO PUBLIC;
