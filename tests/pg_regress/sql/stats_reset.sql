-- quota.stats_reset(role regrole DEFAULT NULL) (0.3.0).
-- Per role: that role's rows go, in every database; what they counted goes to each
-- database's row for roles no longer listed (role NULL), so that the totals per
-- database do not change; every other row keeps its counts to the last column;
-- quota.stats_info's stats_reset stays; when the role acts again its row comes back
-- with counting started over and a later stats_reset.
-- In full (no argument, or NULL): every row goes; stats_info's entries, evicted and
-- log_suppressed return to 0 and its stats_reset moves forward to the returned time.
-- The return value is the reset's time, between the start of the calling transaction
-- and the next clock reading.
-- How this test fails: a per-role reset that misses the role's row in the other
-- database ("sr_a_rows" 1), loses its counts ("totals_unchanged" f, or no role-NULL
-- rows), touches other rows ("unchanged" f), or moves stats_info's
-- stats_reset ("info_reset_kept" f); a row that comes back with its old counts
-- (admitted 2, refused_active 1) or its old stats_reset ("later" f); a full reset
-- that leaves rows, or leaves evicted or log_suppressed as they were (250, 1).
-- Eviction: with quota.stats_max at its default of 5000, one row more than fit evicts
-- the 249 least recently used role rows (5 % of the 4998 role rows), among them this
-- test's three older rows.
SELECT current_database() AS regdb, current_user AS su \gset
CREATE ROLE sr_a;
CREATE ROLE sr_b;

-- Settle first: the earlier tests' tickets with a lease are finished, and the writer
-- has swept those already expired, so that no expiry adds rows during this test.
DO $$
BEGIN
  PERFORM quota.finish(id, 'cancelled') FROM quota.ledger
    WHERE ended_at IS NULL AND lease_until > clock_timestamp();
  PERFORM quota.finish(quota.start('settle'));
  FOR i IN 1..100 LOOP
    EXIT WHEN NOT EXISTS (SELECT FROM quota.ledger
                           WHERE ended_at IS NULL AND lease_until <= clock_timestamp());
    PERFORM pg_sleep(0.1);
  END LOOP;
END $$;
SELECT count(*) AS unswept FROM quota.ledger WHERE ended_at IS NULL AND lease_until IS NOT NULL;

SELECT quota.stats_reset() AS r0 \gset
SELECT count(*) AS rows_after_reset FROM quota.stats;
SELECT entries, evicted, log_suppressed, stats_reset = :'r0' AS is_r0 FROM quota.stats_info;

-- sr_a acts in a second database and in this one; sr_b and the superuser here.
CREATE DATABASE quota_sr_db;
ALTER DATABASE quota_sr_db SET lc_messages TO 'C';
\c quota_sr_db
CREATE EXTENSION pg_quota;
SET ROLE sr_a;
SELECT quota.finish(quota.start('there')) AS finished_there;
RESET ROLE;
\c :regdb
SET quota.max_active_per_role = 1;
SET ROLE sr_a;
SELECT quota.start('a1') AS a1 \gset
SELECT quota.try_start('a2') IS NULL AS refused;
RESET ROLE;
SET ROLE sr_b;
SELECT quota.finish(quota.start('b1'), 'failed') AS finished;
RESET ROLE;
RESET quota.max_active_per_role;
SELECT quota.start('su') AS s1 \gset
CREATE TEMP TABLE before AS SELECT * FROM quota.stats;
SELECT CASE WHEN datname = current_database() THEN 'here' ELSE datname::text END AS db,
       CASE WHEN role = current_user THEN 'superuser' ELSE role::text END AS role,
       admitted, refused_active, finished_succeeded, finished_failed,
       stats_reset >= :'r0'::timestamptz AS since_r0
  FROM before ORDER BY 1, 2;
SELECT entries FROM quota.stats_info;
SELECT stats_reset AS a_since FROM quota.stats
 WHERE datname = current_database() AND role = 'sr_a' \gset

-- Per role: sr_a's rows go, in both databases; the other rows are unchanged.
BEGIN;
SELECT quota.stats_reset('sr_a') AS r1 \gset
SELECT :'r1'::timestamptz >= now() AND :'r1'::timestamptz <= clock_timestamp() AS r1_close_to_now;
COMMIT;
SELECT count(*) AS sr_a_rows FROM quota.stats WHERE role = 'sr_a';
SELECT CASE WHEN b.role = current_user THEN 'superuser' ELSE b.role::text END AS role,
       to_jsonb(s) = to_jsonb(b) AS unchanged
  FROM before b LEFT JOIN quota.stats s USING (datname, role)
 WHERE b.role <> 'sr_a' ORDER BY 1;
-- ... and what sr_a counted is in each database's row for roles no longer listed, so
-- the totals per database are as before.
SELECT CASE WHEN datname = current_database() THEN 'here' ELSE datname::text END AS db,
       admitted, refused_active, finished_succeeded
  FROM quota.stats WHERE role IS NULL ORDER BY 1;
SELECT (SELECT jsonb_object_agg(datname, t) FROM
          (SELECT datname, jsonb_build_array(sum(admitted), sum(refused_active), sum(finished_succeeded),
                                             sum(finished_failed)) t FROM before GROUP BY datname) x)
     = (SELECT jsonb_object_agg(datname, t) FROM
          (SELECT datname, jsonb_build_array(sum(admitted), sum(refused_active), sum(finished_succeeded),
                                             sum(finished_failed)) t FROM quota.stats GROUP BY datname) x)
       AS totals_unchanged;
SELECT entries, evicted, stats_reset = :'r0' AS info_reset_kept FROM quota.stats_info;
-- A role without rows: nothing to remove, still a time.
SELECT quota.stats_reset('sr_a') IS NOT NULL AS reset_again;
SELECT count(*) AS rows_left FROM quota.stats;

-- sr_a acts again here: its row comes back counting from zero (admitted 1, not 2;
-- refused_active 0, not 1), with a later stats_reset; none in quota_sr_db.
SET ROLE sr_a;
SELECT quota.finish(:'a1') AS finished;
SELECT quota.start('a3') AS a3 \gset
RESET ROLE;
SELECT CASE WHEN datname = current_database() THEN 'here' ELSE datname::text END AS db,
       role, admitted, refused_active, finished_succeeded,
       stats_reset > :'a_since'::timestamptz AS later,
       stats_reset >= :'r1'::timestamptz AS since_r1
  FROM quota.stats WHERE role = 'sr_a';

-- Eviction: refusals by new roles (the database cap of 1 refuses them; refusals make
-- rows too) fill the table until a new row evicts 5 % of the 4998 role rows = 249,
-- least recently used first: the three older rows of sr_a, sr_b and the superuser
-- among them.
SET quota.max_active_per_database = 1;
DO $$
BEGIN
  FOR i IN 1..6000 LOOP
    EXIT WHEN (SELECT evicted FROM quota.stats_info) > 0;
    EXECUTE format('CREATE ROLE %I', 'sr_fill_' || i);
    EXECUTE format('SET LOCAL ROLE %I', 'sr_fill_' || i);
    IF quota.try_start() IS NOT NULL THEN
      RAISE 'sr_fill_% was admitted', i;
    END IF;
    RESET ROLE;
  END LOOP;
END $$;
RESET quota.max_active_per_database;
SELECT max, entries, evicted FROM quota.stats_info;
SELECT count(*) AS rows, count(*) FILTER (WHERE role LIKE 'sr\_fill\_%') AS fill_rows,
       count(*) FILTER (WHERE role IN ('sr_a', 'sr_b', current_user)) AS older_rows
  FROM quota.stats;

-- log_suppressed: two refusals of sr_b within a second with quota.log_refusals on; the
-- second is not logged.
SET quota.log_refusals = on;
SET quota.max_active_per_role = 1;
SET ROLE sr_b;
SELECT quota.start('b2') AS b2 \gset
SELECT quota.try_start('b3') IS NULL AS refused;
SELECT quota.try_start('b3') IS NULL AS refused;
RESET ROLE;
RESET quota.max_active_per_role;
RESET quota.log_refusals;
SELECT log_suppressed FROM quota.stats_info;

-- sr_b acts in quota_sr_db too, so that a row of another database is there to go.
\c quota_sr_db
SET ROLE sr_b;
SELECT quota.finish(quota.start('there')) AS finished_there;
RESET ROLE;
\c :regdb
SELECT count(*) AS rows, count(*) FILTER (WHERE datname = 'quota_sr_db') AS other_database
  FROM quota.stats;

-- In full: every row goes, in every database; entries, evicted and log_suppressed
-- return to 0; stats_info's stats_reset moves forward to the returned time.
SELECT quota.stats_reset() AS r2 \gset
SELECT count(*) AS rows_after_full_reset FROM quota.stats;
SELECT entries, evicted, log_suppressed, stats_reset = :'r2' AS is_r2,
       stats_reset > :'r0'::timestamptz AS moved_forward
  FROM quota.stats_info;

-- NULL is a full reset too.
SET ROLE sr_a;
SELECT quota.finish(:'a3') AS finished;
RESET ROLE;
SELECT quota.finish(:'b2') AS finished;
SELECT count(*) AS rows_before FROM quota.stats;
BEGIN;
SELECT quota.stats_reset(NULL) AS r3 \gset
SELECT :'r3'::timestamptz >= now() AND :'r3'::timestamptz <= clock_timestamp() AS r3_close_to_now;
COMMIT;
SELECT count(*) AS rows_after_null_reset FROM quota.stats;
SELECT entries, evicted, log_suppressed, stats_reset = :'r3' AS is_r3,
       stats_reset > :'r2'::timestamptz AS moved_forward
  FROM quota.stats_info;

-- DROP ROLE: once it commits, the role's rows go and what they counted goes to
-- their databases' rows for roles no longer listed (a later role with its OID starts
-- from nothing); a DROP ROLE rolled back (in a savepoint here) changes nothing.
CREATE ROLE sr_gone;
SET ROLE sr_gone;
SELECT quota.finish(quota.start('gone')) AS finished;
RESET ROLE;
\c quota_sr_db
SET ROLE sr_gone;
SELECT quota.finish(quota.start('gone there')) AS finished;
RESET ROLE;
\c :regdb
BEGIN;
SAVEPOINT s;
DROP ROLE sr_gone;
ROLLBACK TO SAVEPOINT s;
COMMIT;
SELECT count(*) AS rows_after_rolled_back_drop FROM quota.stats WHERE role = 'sr_gone';
-- (The view would show a dropped role's name as NULL too, so the oids are read from
-- quota.stats_rows(), where the rows for roles no longer listed have roleid NULL.)
SELECT 'sr_gone'::regrole::oid AS gone_oid,
       (SELECT coalesce(sum(admitted), 0) FROM quota.stats_rows() WHERE roleid IS NULL) AS other_roles_before \gset
DROP ROLE sr_gone;
SELECT count(*) FILTER (WHERE roleid = :gone_oid) AS rows_of_the_dropped_role,
       count(*) FILTER (WHERE roleid NOT IN (SELECT oid FROM pg_roles)) AS rows_of_dropped_roles,
       sum(admitted) FILTER (WHERE roleid IS NULL) - :other_roles_before AS moved_to_other_roles
  FROM quota.stats_rows();
-- DROP DATABASE: its rows go (none is left with datname NULL).
SELECT count(*) AS rows_of_quota_sr_db FROM quota.stats WHERE datname = 'quota_sr_db';
DROP DATABASE quota_sr_db;
SELECT count(*) AS rows_without_database FROM quota.stats WHERE datname IS NULL;

-- Clean up.
SELECT quota.finish(:'s1') AS finished;
DO $$
BEGIN
  EXECUTE (SELECT 'DROP ROLE ' || string_agg(quote_ident(rolname), ', ')
             FROM pg_roles WHERE rolname LIKE 'sr\_fill\_%');
END $$;
DROP ROLE sr_a, sr_b;
