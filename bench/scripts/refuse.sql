-- The refusal path: a role at its limit calling try_start.
SELECT quota.try_start('refused');
