-- pg_quota installs into its own schema, "quota", with a ledger nobody but the
-- extension owner can touch, and functions everyone can call.
CREATE EXTENSION pg_quota;
-- Once installed, IF NOT EXISTS skips it, and a second CREATE EXTENSION says that it
-- exists (0.3.1 review: the schema check ran first and said 42P06).
CREATE EXTENSION IF NOT EXISTS pg_quota;
CREATE EXTENSION pg_quota;
\echo :LAST_ERROR_SQLSTATE

SELECT extname, extversion, nspname
  FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
 WHERE extname = 'pg_quota';

-- The SQL surface.
SELECT p.oid::regprocedure AS function, p.prorettype::regtype AS returns,
       p.provolatile, p.prosecdef AS security_definer
  FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
 WHERE n.nspname = 'quota'
 ORDER BY p.oid::regprocedure::text COLLATE "C";

-- No privileges on the tables for PUBLIC or any role but the owner; SELECT on the view
-- only. (Listed per grantee rather than as relacl: the owner's privilege letters grow
-- with PostgreSQL, MAINTAIN in 17.)
SELECT c.relname, c.relkind, c.relowner::regrole AS owner,
       (SELECT coalesce(pg_catalog.string_agg(g.who || ' ' || g.privilege_type, ', '
                                              ORDER BY g.who, g.privilege_type), '-')
          FROM (SELECT CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END AS who,
                       a.privilege_type
                  FROM pg_catalog.aclexplode(c.relacl) a
                 WHERE a.grantee <> c.relowner) g) AS granted_to_others
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = 'quota' AND c.relkind IN ('r', 'v')
 ORDER BY 1;
-- ... and the owner's privileges come from an explicit ACL (the REVOKE ran), in full.
SELECT c.relname, c.relacl IS NOT NULL AS explicit_acl,
       (SELECT pg_catalog.count(*) FROM pg_catalog.aclexplode(c.relacl) a
         WHERE a.grantee = c.relowner)
       = (SELECT pg_catalog.count(*) FROM pg_catalog.aclexplode(pg_catalog.acldefault('r', c.relowner)))
         AS owner_has_all
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = 'quota' AND c.relkind IN ('r', 'v')
 ORDER BY 1;

-- pg_dump carries the ledger and the summary (pg_extension_config_dump).
SELECT unnest(extconfig)::regclass FROM pg_extension WHERE extname = 'pg_quota' ORDER BY 1;

-- Roles used by the other tests.
CREATE ROLE quota_alice;
CREATE ROLE quota_bob;
CREATE ROLE quota_carol;
CREATE ROLE quota_dave;
CREATE ROLE quota_erin;
CREATE ROLE quota_frank;
CREATE ROLE quota_team NOLOGIN;
GRANT quota_team TO quota_carol;
