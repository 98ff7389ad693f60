-- pg_quota 0.1.1 -> 0.2.0
--
-- Why this script exists: 0.2.0 adds leases, idempotent starts, bounded waits, a
-- database cap and the quota.tickets view (USER_GUIDE.md, "0.2.0"). Their schema:
-- 1. quota.ledger gets three columns, appended so that no row is rewritten:
--    lease_until (NULL = never expires), idempotency_key and pid. Tickets started
--    before the update keep NULL in all three: they have no lease, no key and no
--    recorded backend, exactly as they were started. The outcome check admits
--    'expired', which the ledger writer writes when a lease runs out.
-- 2. ledger_role_ended_idx gains lease_until as its third column (admission counts a
--    role's leases that ran out with one probe); ledger_open_idx (ended_at,
--    lease_until) serves the database cap and the expiry sweep; ledger_role_key_idx
--    (role, idempotency_key) serves idempotent starts. Building them reads the
--    ledger once, under the lock ALTER EXTENSION holds.
-- 3. start() and try_start() get the parameters lease, idempotency_key and wait,
--    after label and with defaults, so every 0.1.x call (start(), start('x'),
--    try_start()) means what it meant. A function's argument list cannot be
--    replaced, so the one-argument functions are dropped and created again; a
--    function of yours whose body depends on them (BEGIN ATOMIC) must be dropped
--    first and created again after the update (PostgreSQL refuses the DROP otherwise,
--    and the update changes nothing). Whatever EXECUTE privileges a DBA gave or took
--    on the old functions are carried over to the new ones. renew() is new, with
--    PostgreSQL's default privileges.
-- 4. quota.usage counts a ticket whose lease ran out as ended at its lease_until. Its
--    columns do not change, so it is replaced in place (CREATE OR REPLACE VIEW): views
--    of yours on it and its privileges stay. quota.tickets is new.
-- 5. The old index is found by its columns, not its name, so that an index a DBA
--    renamed (pg_quota itself finds indexes by what they index) is replaced too.
--
-- The result must equal a fresh 0.2.0 install (sql/schema.sql and src/api.rs);
-- scripts/test-upgrade compares the two catalogs.

\echo Use "ALTER EXTENSION pg_quota UPDATE TO '0.2.0'" to load this file. \quit

ALTER TABLE quota.ledger
    ADD COLUMN lease_until timestamptz,
    ADD COLUMN idempotency_key text,
    ADD COLUMN pid integer;
ALTER TABLE quota.ledger DROP CONSTRAINT ledger_outcome_check;
ALTER TABLE quota.ledger ADD CONSTRAINT ledger_outcome_check
    CHECK (outcome IN ('succeeded', 'failed', 'cancelled', 'expired'));

DO $drop$
DECLARE
    idx pg_catalog.regclass;
BEGIN
    FOR idx IN
        SELECT i.indexrelid::pg_catalog.regclass
          FROM pg_catalog.pg_index i
         WHERE i.indrelid OPERATOR(pg_catalog.=) 'quota.ledger'::pg_catalog.regclass
           AND i.indkey::pg_catalog.text OPERATOR(pg_catalog.=) '2 5'
           AND i.indexprs IS NULL AND i.indpred IS NULL AND NOT i.indisunique
    LOOP
        EXECUTE pg_catalog.format('DROP INDEX %s', idx);
    END LOOP;
END
$drop$;
CREATE INDEX ledger_role_ended_idx ON quota.ledger (role, ended_at, lease_until);
CREATE INDEX ledger_open_idx ON quota.ledger (ended_at, lease_until);
CREATE INDEX ledger_role_key_idx ON quota.ledger (role, idempotency_key);

-- The old functions' privileges, if a DBA changed them (NULL: PostgreSQL's defaults).
CREATE TEMPORARY TABLE pg_quota_old_acl ON COMMIT DROP AS
SELECT p.proname, p.proacl
  FROM pg_catalog.pg_proc p
 WHERE p.oid OPERATOR(pg_catalog.=) ANY (ARRAY['quota.start(text)'::pg_catalog.regprocedure,
                                               'quota.try_start(text)'::pg_catalog.regprocedure]);

DROP FUNCTION quota.start(text);
DROP FUNCTION quota.try_start(text);

CREATE FUNCTION quota."start"(
	"label" TEXT DEFAULT NULL,
	"lease" interval DEFAULT NULL,
	"idempotency_key" TEXT DEFAULT NULL,
	"wait" interval DEFAULT '0'
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'start_v2_wrapper';

CREATE FUNCTION quota."try_start"(
	"label" TEXT DEFAULT NULL,
	"lease" interval DEFAULT NULL,
	"idempotency_key" TEXT DEFAULT NULL,
	"wait" interval DEFAULT '0'
) RETURNS uuid
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'try_start_v2_wrapper';

DO $acl$
DECLARE
    f record;
    g record;
BEGIN
    FOR f IN SELECT o.proname, o.proacl FROM pg_quota_old_acl o WHERE o.proacl IS NOT NULL LOOP
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION quota.%I(text, interval, text, interval) FROM PUBLIC', f.proname);
        FOR g IN SELECT a.grantee, a.is_grantable FROM pg_catalog.aclexplode(f.proacl) a
                  WHERE a.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE' LOOP
            EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION quota.%I(text, interval, text, interval) TO %s%s',
                f.proname,
                CASE WHEN g.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                     ELSE g.grantee::pg_catalog.regrole::pg_catalog.text END,
                CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
        END LOOP;
    END LOOP;
END
$acl$;
DROP TABLE pg_quota_old_acl;

CREATE FUNCTION quota."renew"(
	"ticket" uuid,
	"lease" interval
) RETURNS timestamptz
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'renew_wrapper';

-- Usage per role, for the roles that have retained tickets. Superusers see every row,
-- other roles their own. "retained" uses the quota.retention of the reading session.
-- A ticket whose lease ran out counts as ended at its lease_until, whether or not the
-- ledger writer has written that down yet.
CREATE OR REPLACE VIEW quota.usage WITH (security_barrier) AS
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
)
SELECT t.role                                                        AS role,
       pg_catalog.count(*) FILTER (WHERE t.ended_at IS NULL)         AS active,
       pg_catalog.count(*)                                           AS retained,
       (pg_catalog.min(t.ended_at) OPERATOR(pg_catalog.+) t.retention) AS next_ageout
  FROM tickets t
 WHERE t.ended_at IS NULL
    OR t.ended_at OPERATOR(pg_catalog.>=) (t.now OPERATOR(pg_catalog.-) t.retention)
 GROUP BY t.role, t.retention;


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
