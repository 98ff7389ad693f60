-- A job's life as applications live it from 0.2.0 on: a start with a lease and an
-- idempotency key of its own, a renewal of the lease, then the finish; each statement
-- in its own transaction.
\set k random(1, 1000000000000)
SELECT quota.start('job', lease => '5 min', idempotency_key => 'job-' || :client_id || '-' || :k) AS t \gset
SELECT quota.renew(':t', '5 min');
SELECT quota.finish(':t');
