-- CALL0: the floor of calling a function with start()'s signature (bench/call0).
SELECT bench.call0('refused');
