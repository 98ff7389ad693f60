-- JOBT0: JOBT's two statements with pg_quota's calls replaced by C functions of the
-- same signatures that do nothing (bench/call0): what JOBT costs besides pg_quota's
-- own work, the ceiling any ledger layout can reach.
INSERT INTO bench.jobs (payload, ticket) VALUES ('job', bench.call0('job', transactional => true)) RETURNING id \gset
UPDATE bench.jobs SET done_at = now(), released = bench.finish0(ticket) WHERE id = :id;
