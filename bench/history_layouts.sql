-- Issue 33's space target, in plain SQL: what quota.history's layout and a compact one
-- take per ended ticket, beside the issue's minimal job table, filled as a queue fills
-- them: 100,000 tickets of 16 roles in turn, in the order they end, each row inserted
-- with its indexes in place (so B-tree pages split as they do under the load), then a
-- VACUUM of those tables. No extension needed:
--   psql -X -q -f bench/history_layouts.sql DB
-- It creates schema lay and drops it at the end; it stops at once where a schema lay
-- exists already, and a run that fails midway leaves it for you to drop. Results in
-- BENCHMARKS.md, "Issue 33 on 07ea822", "What a history could take, in plain SQL".
\set ON_ERROR_STOP on
SET client_min_messages = warning;
CREATE SCHEMA lay;
-- The tickets: ids time-ordered as pg_quota's (version 7: milliseconds first).
CREATE TABLE lay.src AS
SELECT i,
       (16384 + i % 16)::oid AS role,
       t0 + make_interval(secs => i * 0.0002) AS started_at,
       t0 + make_interval(secs => i * 0.0002 + 0.003) AS ended_at,
       (lpad(to_hex((extract(epoch FROM t0) * 1000)::bigint + i / 5), 12, '0') || '7'
        || substr(md5(i::text), 1, 19))::uuid AS id,
       (1000000 + i)::text::xid8 AS txid
  FROM generate_series(1, 100000) i, (SELECT now() AS t0) t;

-- history: quota.history as 0.7.0 has it, its columns and indexes (sql/schema.sql),
-- rows as a JOBT job's finish writes them (a label, the outcome, the pid, the txid).
CREATE TABLE lay.history (
    id uuid PRIMARY KEY, role oid NOT NULL, label text, started_at timestamptz NOT NULL,
    ended_at timestamptz, outcome text, lease_until timestamptz, idempotency_key text,
    pid integer, tenant text, txid xid8, weight integer);
CREATE INDEX history_role_ended_idx ON lay.history (role, ended_at, lease_until);
CREATE INDEX history_role_key_idx ON lay.history (role, idempotency_key);
CREATE INDEX history_tenant_idx ON lay.history (role, tenant, ended_at, lease_until)
    WHERE tenant IS NOT NULL;
CREATE INDEX history_txid_idx ON lay.history (role, txid) WHERE txid IS NOT NULL;
INSERT INTO lay.history (id, role, label, started_at, ended_at, outcome, pid, txid)
SELECT id, role, 'job', started_at, ended_at, 'succeeded', 4000 + i % 16, txid
  FROM lay.src ORDER BY i;

-- ended2: the same rows' (role, ended_at) alone, beside history_role_ended_idx's three
-- columns: an index tuple of at most 28 bytes with its line pointer (two 8-byte
-- columns' worth) lets nbtree split a page after the new item when a key's values
-- rise (nbtsplitloc.c, _bt_afternewitemoff); history_role_ended_idx's are 36.
CREATE TABLE lay.ended2 (role oid NOT NULL, ended_at timestamptz NOT NULL);
CREATE INDEX ended2_idx ON lay.ended2 (role, ended_at);
INSERT INTO lay.ended2 SELECT role, ended_at FROM lay.src ORDER BY i;
-- ended3: the same rows on history_role_ended_idx's three columns, then rebuilt:
-- what REINDEX packs it to (inserts after it would split its pages again).
CREATE TABLE lay.ended3 (role oid NOT NULL, ended_at timestamptz NOT NULL,
                         lease_until timestamptz);
CREATE INDEX ended3_idx ON lay.ended3 (role, ended_at, lease_until);
INSERT INTO lay.ended3 SELECT role, ended_at, NULL FROM lay.src ORDER BY i;
REINDEX INDEX lay.ended3_idx;

-- compact11: the columns an ended ticket needs, the rest NULL (the outcome a "char",
-- NULL for succeeded; no pid); eleven columns, so the null bitmap takes a second
-- MAXALIGN word of the tuple header. One B-tree, on (role, ended_at).
CREATE TABLE lay.compact11 (
    id uuid NOT NULL, role oid NOT NULL, started_at timestamptz NOT NULL,
    ended_at timestamptz NOT NULL, txid xid8, label text, outcome "char",
    lease_until timestamptz, idempotency_key text, tenant text, weight integer);
CREATE INDEX compact11_idx ON lay.compact11 (role, ended_at);
INSERT INTO lay.compact11 (id, role, started_at, ended_at, txid, label)
SELECT id, role, started_at, ended_at, txid, 'job' FROM lay.src ORDER BY i;

-- compact7: at most eight columns, so that the null bitmap fits in the padding byte
-- after the 23-byte tuple header;
-- what is rare (outcome other than succeeded, lease, key, tenant, weight) in one
-- nullable column. A BRIN index on the id (time-ordered) beside its B-tree: the
-- ticket-by-id lookups without a B-tree entry per row.
CREATE TABLE lay.compact7 (
    id uuid NOT NULL, role oid NOT NULL, started_at timestamptz NOT NULL,
    ended_at timestamptz NOT NULL, txid xid8, label text, details jsonb);
CREATE INDEX compact7_idx ON lay.compact7 (role, ended_at);
CREATE INDEX compact7_id_brin ON lay.compact7 USING brin (id);
INSERT INTO lay.compact7 (id, role, started_at, ended_at, txid, label)
SELECT id, role, started_at, ended_at, txid, 'job' FROM lay.src ORDER BY i;

-- compact6: compact7 without the txid (a transactional ticket folded into its role's
-- count by the time it ends).
CREATE TABLE lay.compact6 (
    id uuid NOT NULL, role oid NOT NULL, started_at timestamptz NOT NULL,
    ended_at timestamptz NOT NULL, label text, details jsonb);
CREATE INDEX compact6_idx ON lay.compact6 (role, ended_at);
INSERT INTO lay.compact6 (id, role, started_at, ended_at, label)
SELECT id, role, started_at, ended_at, 'job' FROM lay.src ORDER BY i;

-- jobs: the issue's minimal job table, its rows as they stand once done.
CREATE TABLE lay.jobs (id bigserial PRIMARY KEY, role name NOT NULL, ticket uuid,
                       payload text DEFAULT '{}', done timestamptz);
INSERT INTO lay.jobs (role, ticket, done)
SELECT 'bench_r' || (i % 16), id, ended_at FROM lay.src ORDER BY i;

DROP TABLE lay.src;
VACUUM lay.history, lay.ended2, lay.ended3, lay.compact11, lay.compact7, lay.compact6,
       lay.jobs;
-- Bytes per row: the heap, each index, and the table with its indexes.
SELECT c.relname AS "table", '(heap)' AS relation,
       round(pg_relation_size(c.oid) / 100000.0, 1) AS bytes_per_row
  FROM pg_class c WHERE c.relnamespace = 'lay'::regnamespace AND c.relkind = 'r'
UNION ALL
SELECT c.relname, i.relname, round(pg_relation_size(i.oid) / 100000.0, 1)
  FROM pg_class c JOIN pg_index x ON x.indrelid = c.oid JOIN pg_class i ON i.oid = x.indexrelid
 WHERE c.relnamespace = 'lay'::regnamespace
UNION ALL
SELECT c.relname, '(all)', round(pg_total_relation_size(c.oid) / 100000.0, 1)
  FROM pg_class c WHERE c.relnamespace = 'lay'::regnamespace AND c.relkind = 'r'
 ORDER BY 1, 2;
DROP SCHEMA lay CASCADE;
