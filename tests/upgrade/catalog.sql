-- A catalog dump of the pg_quota extension, by name and never by OID, so that two
-- databases (an older version upgraded with ALTER EXTENSION pg_quota UPDATE, and a fresh
-- install of the current version) can be compared byte for byte with diff.
-- scripts/test-upgrade runs it with psql -At; each row is one line (view definitions
-- and function bodies span several).
--
-- The objects covered: the extension's members (pg_depend deptype 'e'), and what
-- depends on them automatically or internally (deptype 'a'/'i', recursively: indexes,
-- constraints, triggers, rules, policies, row and array types, column defaults), which
-- are not members themselves. Columns are listed in attnum order by their position
-- among the non-dropped columns, so a dropped column leaves no trace but an order change
-- does. ACLs are sorted and a NULL ACL is shown as the owner's default, so only a real
-- difference in privileges shows. Toast tables are left out: their names carry OIDs, and
-- whether a table has one depends on its history (dropping its last text column keeps it).
WITH RECURSIVE
ext AS (
    SELECT e.oid, e.extname, e.extversion, e.extowner, e.extnamespace, e.extrelocatable,
           e.extconfig, e.extcondition
      FROM pg_catalog.pg_extension e WHERE e.extname = 'pg_quota'
),
mem AS (
    SELECT DISTINCT d.classid, d.objid
      FROM pg_catalog.pg_depend d, ext
     WHERE d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass
       AND d.refobjid = ext.oid AND d.deptype = 'e'
),
-- Objects that go with the members: everything that depends on a member, or on such a
-- dependent, automatically or internally.
deps (classid, objid) AS (
    SELECT d.classid, d.objid
      FROM pg_catalog.pg_depend d JOIN mem m ON d.refclassid = m.classid AND d.refobjid = m.objid
     WHERE d.deptype IN ('a', 'i')
    UNION
    SELECT d.classid, d.objid
      FROM pg_catalog.pg_depend d JOIN deps p ON d.refclassid = p.classid AND d.refobjid = p.objid
     WHERE d.deptype IN ('a', 'i')
),
dep AS (
    SELECT DISTINCT d.classid, d.objid FROM deps d
     WHERE NOT EXISTS (SELECT 1 FROM mem m WHERE m.classid = d.classid AND m.objid = d.objid)
       AND coalesce((pg_catalog.pg_identify_object(d.classid, d.objid, 0)).schema, '')
           <> 'pg_toast'
       AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t
                        WHERE d.classid = 'pg_catalog.pg_trigger'::pg_catalog.regclass
                          AND t.oid = d.objid AND t.tgisinternal)
),
allobj AS (
    SELECT classid, objid, 'member' AS how FROM mem
    UNION ALL
    SELECT classid, objid, 'dependent' FROM dep
),
-- Member relations: tables, views, sequences, composite types' relations.
rels AS (
    SELECT c.oid AS relid, c.relname, c.relkind, c.relpersistence, c.reloptions, c.relowner,
           c.relacl, c.relrowsecurity, c.relforcerowsecurity, c.relreplident,
           c.relam, c.relispartition, pg_catalog.format('%I.%I', n.nspname, c.relname) AS name
      FROM pg_catalog.pg_class c
      JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid IN (SELECT objid FROM mem WHERE classid = 'pg_catalog.pg_class'::pg_catalog.regclass)
        OR c.oid IN (SELECT t.typrelid FROM pg_catalog.pg_type t
                      WHERE t.oid IN (SELECT objid FROM mem WHERE classid = 'pg_catalog.pg_type'::pg_catalog.regclass))
),
lines (section, sortkey, line) AS (
    -- The extension itself: name, version, schema, owner, and the schema's owner and ACL.
    SELECT 1, '', pg_catalog.format(
             'extension %s version=%s relocatable=%s schema=%I schema_owner=%s schema_acl=%s owner=%s schema_is_member=%s',
             ext.extname, ext.extversion, ext.extrelocatable, n.nspname,
             pg_catalog.pg_get_userbyid(n.nspowner),
             (SELECT pg_catalog.string_agg(a::text, ',' ORDER BY a::text)
                FROM pg_catalog.unnest(coalesce(n.nspacl, pg_catalog.acldefault('n', n.nspowner))) a),
             pg_catalog.pg_get_userbyid(ext.extowner),
             EXISTS (SELECT 1 FROM mem WHERE classid = 'pg_catalog.pg_namespace'::pg_catalog.regclass
                                          AND objid = n.oid))
      FROM ext JOIN pg_catalog.pg_namespace n ON n.oid = ext.extnamespace
    UNION ALL
    -- Extensions it requires.
    SELECT 2, r.extname, pg_catalog.format('requires extension %s', r.extname)
      FROM ext JOIN pg_catalog.pg_depend d
             ON d.classid = 'pg_catalog.pg_extension'::pg_catalog.regclass AND d.objid = ext.oid
            AND d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass
      JOIN pg_catalog.pg_extension r ON r.oid = d.refobjid
    UNION ALL
    -- pg_extension_config_dump registrations, by relation name, with their conditions.
    SELECT 3, c.rel::text, pg_catalog.format('config-dump %s condition=%L', c.rel::pg_catalog.regclass, c.cond)
      FROM ext, LATERAL unnest(ext.extconfig, ext.extcondition) AS c (rel, cond)
    UNION ALL
    -- Every member and every dependent, by type and identity.
    SELECT 4, o.how || ' ' || i.type || ' ' || i.identity,
           pg_catalog.format('%s %s %s', o.how, i.type, i.identity)
      FROM allobj o, LATERAL pg_catalog.pg_identify_object(o.classid, o.objid, 0) i
    UNION ALL
    -- Objects in the extension's schema that are neither members nor dependents (left
    -- behind by ALTER EXTENSION ... DROP, or created outside the extension script).
    SELECT 5, i.type || ' ' || i.identity, pg_catalog.format('stray %s %s', i.type, i.identity)
      FROM ext,
           LATERAL (SELECT 'pg_catalog.pg_class'::pg_catalog.regclass::pg_catalog.oid AS classid, oid AS objid
                      FROM pg_catalog.pg_class WHERE relnamespace = ext.extnamespace
                    UNION ALL
                    SELECT 'pg_catalog.pg_proc'::pg_catalog.regclass, oid
                      FROM pg_catalog.pg_proc WHERE pronamespace = ext.extnamespace
                    UNION ALL
                    SELECT 'pg_catalog.pg_type'::pg_catalog.regclass, oid
                      FROM pg_catalog.pg_type WHERE typnamespace = ext.extnamespace) s,
           LATERAL pg_catalog.pg_identify_object(s.classid, s.objid, 0) i
     WHERE NOT EXISTS (SELECT 1 FROM allobj a WHERE a.classid = s.classid AND a.objid = s.objid)
    UNION ALL
    -- Relations: kind, persistence, options, owner, ACL, row security, access method.
    SELECT 10, r.name, pg_catalog.format(
             'relation %s kind=%s persistence=%s options=%s owner=%s acl=%s rowsecurity=%s forcerowsecurity=%s replident=%s am=%s partition=%s partkey=%s inherits=%s',
             r.name, r.relkind, r.relpersistence, coalesce(r.reloptions::text, '-'),
             pg_catalog.pg_get_userbyid(r.relowner),
             (SELECT pg_catalog.string_agg(a::text, ',' ORDER BY a::text)
                FROM pg_catalog.unnest(coalesce(r.relacl,
                       pg_catalog.acldefault(CASE WHEN r.relkind = 'S' THEN 's' ELSE 'r' END::"char", r.relowner))) a),
             r.relrowsecurity, r.relforcerowsecurity, r.relreplident,
             coalesce((SELECT amname FROM pg_catalog.pg_am WHERE oid = r.relam), '-'),
             r.relispartition,
             coalesce(CASE WHEN r.relkind = 'p' THEN pg_catalog.pg_get_partkeydef(r.relid) END, '-'),
             coalesce((SELECT pg_catalog.string_agg(h.inhparent::pg_catalog.regclass::text, ',' ORDER BY h.inhseqno)
                                    FROM pg_catalog.pg_inherits h WHERE h.inhrelid = r.relid), '-'))
      FROM rels r
    UNION ALL
    -- Columns, in order: position among the non-dropped columns, name, type, not null,
    -- default, identity, generated, collation, storage, options, column ACL.
    SELECT 11, r.name || pg_catalog.to_char(a.pos, 'FM0000'), pg_catalog.format(
             'column %s #%s %I %s notnull=%s default=%s identity=%s generated=%s collation=%s storage=%s options=%s acl=%s',
             r.name, a.pos, a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod), a.attnotnull,
             coalesce(pg_catalog.pg_get_expr(ad.adbin, ad.adrelid), '-'),
             coalesce(nullif(a.attidentity, ''), '-'), coalesce(nullif(a.attgenerated, ''), '-'),
             CASE WHEN a.attcollation <> t.typcollation
                  THEN (SELECT collname FROM pg_catalog.pg_collation WHERE oid = a.attcollation) ELSE '-' END,
             a.attstorage,
             -- This server build keeps a per-relation "pg_attver" entry in attoptions:
             -- the WAL position of the relation's last column change. It differs between
             -- any two databases, so it is left out.
             coalesce((SELECT pg_catalog.string_agg(o, ',' ORDER BY o)
                         FROM pg_catalog.unnest(a.attoptions) o
                        WHERE o NOT LIKE 'pg\_attver=%'), '-'),
             coalesce((SELECT pg_catalog.string_agg(x::text, ',' ORDER BY x::text)
                                    FROM pg_catalog.unnest(a.attacl) x), '-'))
      FROM rels r
      JOIN LATERAL (SELECT at.*, pg_catalog.row_number() OVER (ORDER BY at.attnum) AS pos
                      FROM pg_catalog.pg_attribute at
                     WHERE at.attrelid = r.relid AND at.attnum > 0 AND NOT at.attisdropped) a ON true
      JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
      LEFT JOIN pg_catalog.pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
    UNION ALL
    -- Indexes on member relations, with their definitions (which carry the index name).
    SELECT 12, r.name || ' ' || ic.relname, pg_catalog.format(
             'index %s valid=%s ready=%s clustered=%s replident=%s options=%s',
             pg_catalog.pg_get_indexdef(i.indexrelid), i.indisvalid, i.indisready, i.indisclustered,
             i.indisreplident, coalesce(ic.reloptions::text, '-'))
      FROM rels r
      JOIN pg_catalog.pg_index i ON i.indrelid = r.relid
      JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid
    UNION ALL
    -- Constraints on member relations and member types (domains).
    SELECT 13, coalesce(r.name, pg_catalog.format_type(co.contypid, NULL)) || ' ' || co.conname,
           pg_catalog.format('constraint %I on %s type=%s deferrable=%s deferred=%s validated=%s def=%s',
             co.conname, coalesce(r.name, 'type ' || pg_catalog.format_type(co.contypid, NULL)),
             co.contype, co.condeferrable, co.condeferred, co.convalidated,
             pg_catalog.pg_get_constraintdef(co.oid))
      FROM pg_catalog.pg_constraint co
      LEFT JOIN rels r ON r.relid = co.conrelid
     WHERE r.relid IS NOT NULL
        OR co.contypid IN (SELECT objid FROM mem WHERE classid = 'pg_catalog.pg_type'::pg_catalog.regclass)
    UNION ALL
    -- Triggers (not the internal ones behind foreign keys, whose names carry OIDs).
    SELECT 14, r.name || ' ' || tg.tgname, pg_catalog.format('trigger %s enabled=%s',
             pg_catalog.pg_get_triggerdef(tg.oid, false), tg.tgenabled)
      FROM rels r JOIN pg_catalog.pg_trigger tg ON tg.tgrelid = r.relid
     WHERE NOT tg.tgisinternal
    UNION ALL
    -- Rules other than a view's own _RETURN rule (pg_get_viewdef shows that one).
    SELECT 15, r.name || ' ' || rw.rulename, pg_catalog.format('rule %s enabled=%s',
             pg_catalog.pg_get_ruledef(rw.oid, false), rw.ev_enabled)
      FROM rels r JOIN pg_catalog.pg_rewrite rw ON rw.ev_class = r.relid
     WHERE NOT (r.relkind IN ('v', 'm') AND rw.rulename = '_RETURN')
    UNION ALL
    -- Row security policies.
    SELECT 16, r.name || ' ' || p.polname, pg_catalog.format(
             'policy %I on %s cmd=%s permissive=%s roles=%s using=%s check=%s',
             p.polname, r.name, p.polcmd, p.polpermissive,
             (SELECT pg_catalog.string_agg(CASE WHEN x = 0 THEN 'public' ELSE pg_catalog.pg_get_userbyid(x)::text END, ',' ORDER BY 1)
                FROM pg_catalog.unnest(p.polroles) x),
             coalesce(pg_catalog.pg_get_expr(p.polqual, p.polrelid), '-'),
             coalesce(pg_catalog.pg_get_expr(p.polwithcheck, p.polrelid), '-'))
      FROM rels r JOIN pg_catalog.pg_policy p ON p.polrelid = r.relid
    UNION ALL
    -- Views and materialized views: the definition (options are on the relation line).
    SELECT 17, r.name, pg_catalog.format(E'view %s definition:\n%s', r.name,
             pg_catalog.pg_get_viewdef(r.relid, true))
      FROM rels r WHERE r.relkind IN ('v', 'm')
    UNION ALL
    -- Sequences: parameters and the column that owns them.
    SELECT 18, r.name, pg_catalog.format(
             'sequence %s type=%s start=%s increment=%s min=%s max=%s cache=%s cycle=%s owned_by=%s',
             r.name, pg_catalog.format_type(s.seqtypid, NULL), s.seqstart, s.seqincrement, s.seqmin,
             s.seqmax, s.seqcache, s.seqcycle,
             coalesce((SELECT pg_catalog.string_agg(
                                           (pg_catalog.pg_identify_object(d.refclassid, d.refobjid, d.refobjsubid)).identity, ',')
                                    FROM pg_catalog.pg_depend d
                                   WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
                                     AND d.objid = r.relid AND d.deptype = 'a'
                                     AND d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass), '-'))
      FROM rels r JOIN pg_catalog.pg_sequence s ON s.seqrelid = r.relid
    UNION ALL
    -- Functions, procedures and aggregates.
    SELECT 20, pg_catalog.format('%I.%I(%s)', n.nspname, p.proname, pg_catalog.pg_get_function_identity_arguments(p.oid)),
           pg_catalog.format(
             E'function %I.%I(%s) kind=%s args=(%s) returns=%s language=%s volatility=%s strict=%s security_definer=%s leakproof=%s parallel=%s cost=%s rows=%s config=%s owner=%s acl=%s%s',
             n.nspname, p.proname, pg_catalog.pg_get_function_identity_arguments(p.oid), p.prokind,
             pg_catalog.pg_get_function_arguments(p.oid),
             coalesce(pg_catalog.pg_get_function_result(p.oid), '-'),
             l.lanname, p.provolatile, p.proisstrict, p.prosecdef, p.proleakproof, p.proparallel,
             p.procost, p.prorows, coalesce(p.proconfig::text, '-'),
             pg_catalog.pg_get_userbyid(p.proowner),
             (SELECT pg_catalog.string_agg(a::text, ',' ORDER BY a::text)
                FROM pg_catalog.unnest(coalesce(p.proacl, pg_catalog.acldefault('f', p.proowner))) a),
             CASE WHEN l.lanname = 'c' THEN pg_catalog.format(' symbol=%s library=%s', p.prosrc, p.probin)
                  WHEN l.lanname = 'internal' THEN pg_catalog.format(' symbol=%s', p.prosrc)
                  ELSE E' source:\n' || p.prosrc END)
      FROM pg_catalog.pg_proc p
      JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
      JOIN pg_catalog.pg_language l ON l.oid = p.prolang
     WHERE p.oid IN (SELECT objid FROM mem WHERE classid = 'pg_catalog.pg_proc'::pg_catalog.regclass)
    UNION ALL
    -- Types that are members: their kind and what defines them (a composite type's
    -- attributes are listed as columns of its relation above).
    SELECT 21, pg_catalog.format_type(t.oid, NULL), pg_catalog.format(
             'type %s typtype=%s owner=%s acl=%s%s',
             pg_catalog.format_type(t.oid, NULL), t.typtype, pg_catalog.pg_get_userbyid(t.typowner),
             (SELECT pg_catalog.string_agg(a::text, ',' ORDER BY a::text)
                FROM pg_catalog.unnest(coalesce(t.typacl, pg_catalog.acldefault('T', t.typowner))) a),
             CASE t.typtype
               WHEN 'e' THEN ' labels=' || (SELECT pg_catalog.string_agg(pg_catalog.quote_literal(e.enumlabel), ',' ORDER BY e.enumsortorder)
                                             FROM pg_catalog.pg_enum e WHERE e.enumtypid = t.oid)
               WHEN 'd' THEN pg_catalog.format(' base=%s notnull=%s default=%s', pg_catalog.format_type(t.typbasetype, t.typtypmod),
                                               t.typnotnull, coalesce(t.typdefault, '-'))
               WHEN 'r' THEN ' subtype=' || (SELECT pg_catalog.format_type(rg.rngsubtype, NULL)
                                              FROM pg_catalog.pg_range rg WHERE rg.rngtypid = t.oid)
               WHEN 'b' THEN pg_catalog.format(' input=%s output=%s receive=%s send=%s len=%s byval=%s align=%s storage=%s',
                                               t.typinput, t.typoutput, t.typreceive, t.typsend, t.typlen,
                                               t.typbyval, t.typalign, t.typstorage)
               ELSE '' END)
      FROM pg_catalog.pg_type t
     WHERE t.oid IN (SELECT objid FROM mem WHERE classid = 'pg_catalog.pg_type'::pg_catalog.regclass)
    UNION ALL
    -- Comments on members, dependents and their columns.
    SELECT 30, i.identity || pg_catalog.to_char(d.objsubid, 'FM0000'),
           pg_catalog.format('comment on %s %s: %L', i.type, i.identity, d.description)
      FROM pg_catalog.pg_description d
      JOIN allobj o ON o.classid = d.classoid AND o.objid = d.objoid,
           LATERAL pg_catalog.pg_identify_object(d.classoid, d.objoid, d.objsubid) i
    UNION ALL
    -- The initial privileges pg_dump starts from (recorded by GRANT/REVOKE in the
    -- extension script).
    SELECT 31, i.identity || pg_catalog.to_char(ip.objsubid, 'FM0000') || ip.privtype::text,
           pg_catalog.format('init-privs %s %s privtype=%s privs=%s', i.type, i.identity, ip.privtype,
             (SELECT pg_catalog.string_agg(a::text, ',' ORDER BY a::text) FROM pg_catalog.unnest(ip.initprivs) a))
      FROM pg_catalog.pg_init_privs ip
      JOIN (SELECT classid, objid FROM allobj
            UNION ALL
            SELECT 'pg_catalog.pg_namespace'::pg_catalog.regclass, extnamespace FROM ext) o
        ON o.classid = ip.classoid AND o.objid = ip.objoid,
           LATERAL pg_catalog.pg_identify_object(ip.classoid, ip.objoid, ip.objsubid) i
    UNION ALL
    -- Default privileges set for the extension's schema.
    SELECT 32, pg_catalog.pg_get_userbyid(da.defaclrole)::text || da.defaclobjtype::text,
           pg_catalog.format('default-acl for role %s objtype=%s acl=%s',
             pg_catalog.pg_get_userbyid(da.defaclrole), da.defaclobjtype,
             (SELECT pg_catalog.string_agg(a::text, ',' ORDER BY a::text) FROM pg_catalog.unnest(da.defaclacl) a))
      FROM pg_catalog.pg_default_acl da, ext
     WHERE da.defaclnamespace = ext.extnamespace
)
SELECT line FROM lines ORDER BY section, sortkey COLLATE "C", line COLLATE "C";
