-- The refusal path for a tenant at its limit (bench_tenants' tenant 'held').
SELECT quota.try_start('refused', tenant => 'held');
