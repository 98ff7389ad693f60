-- finish() updates the ledger's heap and indexes directly. amcheck verifies that
-- every index is consistent and that every heap tuple has its index entries.
CREATE EXTENSION amcheck;
SELECT c.relname, bt_index_check(c.oid, true) IS NOT NULL AS checked
  FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
 WHERE i.indrelid IN ('quota.active'::regclass, 'quota.history'::regclass, 'quota.summary'::regclass)
 ORDER BY 1;

-- Index scans and a sequential scan agree on every role's active count.
SET enable_seqscan = off;
CREATE TEMP TABLE by_index AS
  SELECT role, count(*) FILTER (WHERE ended_at IS NULL) AS active FROM quota.ledger GROUP BY role;
RESET enable_seqscan;
SET enable_indexscan = off; SET enable_bitmapscan = off; SET enable_indexonlyscan = off;
SELECT count(*) AS mismatches FROM (
  SELECT role, count(*) FILTER (WHERE ended_at IS NULL) AS active FROM quota.ledger GROUP BY role
) seq FULL JOIN by_index USING (role)
 WHERE seq.active IS DISTINCT FROM by_index.active;
RESET enable_indexscan; RESET enable_bitmapscan; RESET enable_indexonlyscan;

-- The summary agrees with the ledger.
SELECT count(*) AS mismatches FROM quota.summary s
  FULL JOIN (SELECT role, count(*) AS n FROM quota.ledger GROUP BY role) l USING (role)
 WHERE s.tickets IS DISTINCT FROM l.n;

-- pg_quota maintains plain-column indexes only; with an expression index added by
-- hand, a write that would add entries to it refuses with a clear error rather than
-- leave the index incomplete: start() (through the writer) at an index on
-- quota.active, finish() at one on quota.history, where it inserts the ended ticket.
-- A finish() only deletes from quota.active, which adds no index entries (0.6.x:
-- quota.active's indexes are not opened for it), so one there does not stop it.
SET quota.max_active_per_role = 0;
SET ROLE quota_alice;
SELECT quota.start('before the index') AS t \gset
SELECT quota.start('before the index, ended with one on the history') AS t2 \gset
RESET ROLE;
CREATE INDEX ledger_lower_label ON quota.active (lower(label));
SET ROLE quota_alice;
SELECT quota.start('expression index');
\echo :LAST_ERROR_SQLSTATE
SELECT quota.finish(:'t') AS finished_past_an_index_on_active;
-- A renew of the ticket it ended only looks it up: 55000, as for any ended ticket;
-- a renew of an active ticket, an update there, refuses at the index (0A000).
\set VERBOSITY sqlstate
SELECT quota.renew(:'t', '1 minute');
SELECT quota.renew(:'t2', '1 minute');
\set VERBOSITY default
RESET ROLE;
DROP INDEX quota.ledger_lower_label;
CREATE INDEX history_lower_label ON quota.history (lower(label));
SET ROLE quota_alice;
-- A finish of a ticket that had ended already only looks it up: false, no error;
-- a renew of it, the same lookup, says it has ended (55000), not 0A000.
SELECT quota.finish(:'t') AS finished_again;
\set VERBOSITY sqlstate
SELECT quota.renew(:'t', '1 minute');
\set VERBOSITY default
SELECT quota.finish(:'t2');
\echo :LAST_ERROR_SQLSTATE
RESET ROLE;
DROP INDEX quota.history_lower_label;
SET ROLE quota_alice;
SELECT quota.finish(:'t2') AS finished_once_the_index_is_gone;
-- A renewal that succeeds: the ticket's new version, still active, is checked below.
SELECT quota.start('renewed', lease => '1 hour') AS t3 \gset
SELECT quota.renew(:'t3', '2 hours') > now() + interval '90 minutes' AS renewed;
RESET ROLE;

-- After those finishes and that renewal, every index still has every row's entries.
SELECT c.relname, bt_index_check(c.oid, true) IS NOT NULL AS checked
  FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
 WHERE i.indrelid IN ('quota.active'::regclass, 'quota.history'::regclass, 'quota.summary'::regclass)
 ORDER BY 1;
SET ROLE quota_alice;
SELECT quota.finish(:'t3') AS finished_after_the_check;
RESET ROLE;
