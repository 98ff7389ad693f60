#!/usr/bin/env bash
# The ledger writer never blocks DROP DATABASE or DROP EXTENSION, and comes back on
# the next start().
source "$(dirname "$0")/../../scripts/lib.sh"
with_cluster lifecycle

writers() { sql -d postgres -c "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer'"; }

sql -c "CREATE DATABASE tenantdb"
sql -d tenantdb -c "CREATE EXTENSION pg_quota" -c "SELECT quota.start('before drop')" >/dev/null
expect_eq "a writer serves the database after its first start" 1 "$(writers)"

# DROP DATABASE waits at most 5 s for other sessions; the DROP hook makes the writer
# leave at once.
check "DROP DATABASE succeeds while its writer is running" sql -c "DROP DATABASE tenantdb"
expect_eq "no writer is left" 0 "$(writers)"

# DROP EXTENSION while the writer is active, then CREATE EXTENSION again.
sql -c "CREATE EXTENSION pg_quota" -c "SELECT quota.start('first life')" >/dev/null
check "DROP EXTENSION succeeds while its writer is running" sql -c "DROP EXTENSION pg_quota"
for _ in $(seq 1 50); do [ "$(writers)" = 0 ] && break; sleep 0.1; done
expect_eq "the writer left after DROP EXTENSION" 0 "$(writers)"
check "CREATE EXTENSION works again" sql -c "CREATE EXTENSION pg_quota"
expect_eq "start() works after re-creating the extension" t \
  "$(sql -c "SELECT quota.start('second life') IS NOT NULL")"
expect_eq "the new ledger starts empty" 1 "$(sql -c "SELECT count(*) FROM quota.ledger")"

# A rolled-back DROP EXTENSION only costs the writer a restart.
sql -c "BEGIN" -c "DROP EXTENSION pg_quota" -c "ROLLBACK"
expect_eq "start() works after a rolled-back DROP EXTENSION" t \
  "$(sql -c "SELECT quota.start('third life') IS NOT NULL")"

# An idle writer leaves by itself (after 10 s), and the next start brings one back.
for _ in $(seq 1 150); do [ "$(writers)" = 0 ] && break; sleep 0.1; done
expect_eq "an idle writer leaves by itself" 0 "$(writers)"
expect_eq "the next start brings a writer back" t \
  "$(sql -c "SELECT quota.start('after idle') IS NOT NULL")"
finish_checks
