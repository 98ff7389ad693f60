-- pgq.sql for -M prepared: the ticket is a parameter there, not quoted text.
SELECT quota.start('bench') AS t \gset
SELECT quota.finish(:t);
