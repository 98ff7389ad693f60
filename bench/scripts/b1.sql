-- B1: advisory lock + count(*) + INSERT; finish is an UPDATE.
SELECT bench.b1_start() AS t \gset
SELECT bench.b1_finish(:t);
