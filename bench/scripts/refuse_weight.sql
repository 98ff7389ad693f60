-- The refusal path for a weighted start that does not fit its tenant's limit (0.7.0):
-- bench_weight_refused's tenant 'held' holds 7 of its 8 units; a start of weight 2
-- does not fit (bench/plans.py).
SELECT quota.try_start(weight => 2, label => 'refused', tenant => 'held');
