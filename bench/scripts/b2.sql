-- B2: B1 with the INSERT through a persistent dblink loopback connection.
SELECT bench.b2_start() AS t \gset
SELECT bench.b2_finish(:t);
