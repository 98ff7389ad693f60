-- I7: superusers are never refused, and their tickets are still recorded.
SET quota.max_active_per_role = 1;
SET quota.max_retained_per_role = 1;
SELECT quota.start('su 1') IS NOT NULL AS admitted;
SELECT quota.start('su 2') IS NOT NULL AS admitted;
SELECT quota.try_start('su 3') IS NOT NULL AS admitted;
SELECT count(*) AS recorded FROM quota.ledger
 WHERE role = current_user::regrole AND label LIKE 'su %';
