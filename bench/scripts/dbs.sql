SELECT quota.finish(quota.start('db'));
