-- pg_quota 0.4.1 -> 0.5.0
--
-- Why this script exists: 0.5.0 is made for job systems (USER_GUIDE.md, "Tenants" and
-- "Transactional starts"): tickets can belong to a tenant under their role, and a
-- transactional start commits or rolls back its charge with the calling transaction.
-- What it changes, and why:
-- 1. quota.ledger gets two columns, appended so that no row is rewritten: tenant (the
--    value under the role a ticket is charged to; NULL = the role itself, as every
--    ticket before the update) and txid (the transaction that charged a transactional
--    start; NULL for a charge the ledger writer committed, as every ticket before).
-- 2. Two partial indexes, which only the new kinds of tickets enter:
--    ledger_tenant_idx (role, tenant, ended_at, lease_until) WHERE tenant IS NOT NULL
--    serves what admission counts for one tenant, as ledger_role_ended_idx does for a
--    role; ledger_txid_idx (role, txid) WHERE txid IS NOT NULL finds a role's
--    transactional tickets not yet folded into its summary row. Building them reads the
--    ledger once, under the lock ALTER EXTENSION holds; both start empty.
-- 3. quota.summary gets the column folded (NULL: nothing folded yet): a transactional
--    start must not update its role's summary row in the caller's transaction (every
--    enqueue of the role would queue on that row until its commit), so the row counts
--    the transactional tickets below folded, which the ledger writer folds in later.
-- 4. start() and try_start() get the parameters tenant and transactional, after the
--    others and with defaults, so every older call means what it meant. A function's
--    argument list cannot be replaced, so they are dropped and created again; a
--    function of yours whose body depends on them (BEGIN ATOMIC) must be dropped first
--    and created again after the update. The EXECUTE privileges a DBA gave or took on
--    the old functions are carried over, and then removed from pg_init_privs (with,
--    from PostgreSQL 17, the pg_shdepend entries that go with them): an extension
--    script's GRANT is recorded there as the extension's own, and pg_dump would leave
--    the DBA's privileges out (the defect 0.3.1 repaired for 0.2.0's update).
-- 5. quota.tickets gains the columns tenant and transactional, at its end, so it is
--    replaced in place (CREATE OR REPLACE VIEW): its privileges and views of yours on
--    it stay. quota.tenant_usage is new, with quota.usage's visibility rules.
-- Nothing else changes: other objects, their privileges and your tickets stay.
--
-- The result must equal a fresh 0.5.0 install (sql/schema.sql, sql/stats.sql and
-- src/api.rs); scripts/test-upgrade compares the catalogs, pg_init_privs included.

\echo Use "ALTER EXTENSION pg_quota UPDATE TO '0.5.0'" to load this file. \quit

-- 1.
ALTER TABLE quota.ledger
    ADD COLUMN tenant text,
    ADD COLUMN txid xid8;

-- 2.
CREATE INDEX ledger_tenant_idx ON quota.ledger (role, tenant, ended_at, lease_until)
    WHERE tenant IS NOT NULL;
CREATE INDEX ledger_txid_idx ON quota.ledger (role, txid) WHERE txid IS NOT NULL;

-- 3.
ALTER TABLE quota.summary ADD COLUMN folded xid8;

-- 4.
CREATE TEMPORARY TABLE pg_quota_old_acl ON COMMIT DROP AS
SELECT p.proname, p.proacl
  FROM pg_catalog.pg_proc p
 WHERE p.oid OPERATOR(pg_catalog.=) ANY (ARRAY['quota.start(text, interval, text, interval)'::pg_catalog.regprocedure,
                                               'quota.try_start(text, interval, text, interval)'::pg_catalog.regprocedure]);

DROP FUNCTION quota.start(text, interval, text, interval);
DROP FUNCTION quota.try_start(text, interval, text, interval);

CREATE FUNCTION quota."start"(
	"label" TEXT DEFAULT NULL,
	"lease" interval DEFAULT NULL,
	"idempotency_key" TEXT DEFAULT NULL,
	"wait" interval DEFAULT '0',
	"tenant" TEXT DEFAULT NULL,
	"transactional" bool DEFAULT false
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'start_v5_wrapper';

CREATE FUNCTION quota."try_start"(
	"label" TEXT DEFAULT NULL,
	"lease" interval DEFAULT NULL,
	"idempotency_key" TEXT DEFAULT NULL,
	"wait" interval DEFAULT '0',
	"tenant" TEXT DEFAULT NULL,
	"transactional" bool DEFAULT false
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'try_start_v5_wrapper';

DO $acl$
DECLARE
    f record;
    g record;
BEGIN
    FOR f IN SELECT o.proname, o.proacl FROM pg_quota_old_acl o WHERE o.proacl IS NOT NULL LOOP
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION quota.%I(text, interval, text, interval, text, bool) FROM PUBLIC', f.proname);
        FOR g IN SELECT a.grantee, a.is_grantable FROM pg_catalog.aclexplode(f.proacl) a
                  WHERE a.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE' LOOP
            EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION quota.%I(text, interval, text, interval, text, bool) TO %s%s',
                f.proname,
                CASE WHEN g.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                     ELSE g.grantee::pg_catalog.regrole::pg_catalog.text END,
                CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
        END LOOP;
    END LOOP;
END
$acl$;
DROP TABLE pg_quota_old_acl;

DELETE FROM pg_catalog.pg_shdepend d
 WHERE d.dbid OPERATOR(pg_catalog.=) (SELECT b.oid FROM pg_catalog.pg_database b
                                       WHERE b.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
   AND d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
   AND d.objid OPERATOR(pg_catalog.=) ANY (ARRAY['quota.start(text, interval, text, interval, text, bool)'::pg_catalog.regprocedure,
                                                 'quota.try_start(text, interval, text, interval, text, bool)'::pg_catalog.regprocedure]::pg_catalog.oid[])
   AND d.deptype OPERATOR(pg_catalog.=) 'i';
DELETE FROM pg_catalog.pg_init_privs i
 WHERE i.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
   AND i.objoid OPERATOR(pg_catalog.=) ANY (ARRAY['quota.start(text, interval, text, interval, text, bool)'::pg_catalog.regprocedure,
                                                  'quota.try_start(text, interval, text, interval, text, bool)'::pg_catalog.regprocedure]::pg_catalog.oid[]);

-- 5.
CREATE OR REPLACE VIEW quota.tickets WITH (security_barrier) AS
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
       l.pid,
       l.tenant,
       l.txid IS NOT NULL AS transactional
  FROM quota.ledger l
 WHERE pg_catalog.pg_has_role(CURRENT_USER, l.role::pg_catalog.oid, 'MEMBER')
    OR (SELECT pg_catalog.pg_has_role(CURRENT_USER, 'pg_read_all_stats', 'USAGE'));

CREATE VIEW quota.tenant_usage WITH (security_barrier) AS
WITH params AS (
    SELECT quota.current_retention() AS retention,
           pg_catalog.now() AS now
), tickets AS (
    SELECT l.role,
           l.tenant,
           CASE WHEN l.ended_at IS NULL AND l.lease_until OPERATOR(pg_catalog.<=) p.now
                THEN l.lease_until ELSE l.ended_at END AS ended_at,
           p.retention,
           p.now
      FROM quota.ledger l, params p
     WHERE l.tenant IS NOT NULL
       AND (pg_catalog.pg_has_role(CURRENT_USER, l.role::pg_catalog.oid, 'MEMBER')
            OR (SELECT pg_catalog.pg_has_role(CURRENT_USER, 'pg_read_all_stats', 'USAGE')))
)
SELECT t.role                                                        AS role,
       t.tenant                                                      AS tenant,
       pg_catalog.count(*) FILTER (WHERE t.ended_at IS NULL)         AS active,
       pg_catalog.count(*)                                           AS retained,
       (pg_catalog.min(t.ended_at) OPERATOR(pg_catalog.+) t.retention) AS next_ageout
  FROM tickets t
 WHERE t.ended_at IS NULL
    OR t.ended_at OPERATOR(pg_catalog.>=) (t.now OPERATOR(pg_catalog.-) t.retention)
 GROUP BY t.role, t.tenant, t.retention;

GRANT SELECT ON quota.tenant_usage TO PUBLIC;
