-- pg_quota 0.1.0 -> 0.1.1
--
-- Why this script exists:
-- 1. quota.ledger.role and quota.summary.role become regrole (they were oid). pg_dump
--    wrote the OIDs as numbers, so a restore into another cluster, where the same
--    roles have other OIDs, handed the charges to the wrong roles or to none. A
--    regrole column dumps as the role's name. Both types are the same four bytes, so
--    no row is rewritten, and pg_upgrade accepts regrole (it keeps role OIDs).
-- 2. Triggers keep quota.summary consistent with writes made through SQL (a
--    superuser's TRUNCATE, DELETE, UPDATE or INSERT on quota.ledger, or a restore):
--    0.1.0 refused a role for ever after TRUNCATE quota.ledger. The summary is emptied
--    here once, so that any damage such a write did under 0.1.0 is counted afresh.
-- 3. quota.usage depends on the role column, so it is dropped and created again,
--    unchanged but for reading the new column type.
--
-- The result must equal a fresh 0.1.1 install (sql/schema.sql); scripts/test-upgrade
-- compares the two catalogs.

\echo Use "ALTER EXTENSION pg_quota UPDATE TO '0.1.1'" to load this file. \quit

DROP VIEW quota.usage;

ALTER TABLE quota.ledger ALTER COLUMN role TYPE regrole;
ALTER TABLE quota.summary ALTER COLUMN role TYPE regrole;

TRUNCATE quota.summary;

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

CREATE FUNCTION quota.summary_written() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION quota.summary_written() FROM PUBLIC;
CREATE TRIGGER summary_written BEFORE INSERT OR UPDATE ON quota.summary
    FOR EACH ROW EXECUTE FUNCTION quota.summary_written();

CREATE VIEW quota.usage WITH (security_barrier) AS
WITH params AS (
    SELECT pg_catalog.current_setting('quota.retention')::pg_catalog.interval AS retention
)
SELECT l.role                                                        AS role,
       pg_catalog.count(*) FILTER (WHERE l.ended_at IS NULL)         AS active,
       pg_catalog.count(*)                                           AS retained,
       (pg_catalog.min(l.ended_at) OPERATOR(pg_catalog.+) p.retention) AS next_ageout
  FROM quota.ledger l, params p
 WHERE (l.ended_at IS NULL
        OR l.ended_at OPERATOR(pg_catalog.>=)
           (pg_catalog.now() OPERATOR(pg_catalog.-) p.retention))
   AND (l.role::pg_catalog.oid OPERATOR(pg_catalog.=)
          (SELECT r.oid FROM pg_catalog.pg_roles r
            WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER)
        OR (SELECT r.rolsuper FROM pg_catalog.pg_roles r
             WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER))
 GROUP BY l.role, p.retention;

GRANT SELECT ON quota.usage TO PUBLIC;
