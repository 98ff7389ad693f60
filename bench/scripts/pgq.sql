-- pg_quota: start, then finish, each in its own transaction.
SELECT quota.start('bench') AS t \gset
SELECT quota.finish(':t');
