-- The ceiling of any call.
SELECT 1;
