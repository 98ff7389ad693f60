#!/usr/bin/env bash
# The ledger writer must be available to every session that can call start(), even when
# its database no longer accepts new connections: after ALTER DATABASE app
# ALLOW_CONNECTIONS false, sessions already connected to app keep working, so their
# start() must still get a writer. (0.1.0's writer was refused like any new connection,
# so every start() in app failed with 57000 "Try again: the next call starts a new
# writer", and every retry failed the same way.)
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5603 + PORT_OFFSET))}"
with_cluster writer_availability

sql -c "CREATE DATABASE app" -c "CREATE ROLE wa_tenant LOGIN" \
    -c "ALTER ROLE wa_tenant SET quota.max_active_per_role = 10"
sql -d app -c "CREATE EXTENSION pg_quota"

# A session of wa_tenant in app, opened before the ALTER and fed through fd 3; its
# output (stderr too) goes to $CL/session.out.
mkfifo "$CL/session_in"; chmod 666 "$CL/session_in"
bg bash -c "exec '$PG_BIN/psql' -X -q -At -v ON_ERROR_STOP=0 -h '$CL' -p '$PORT' -U wa_tenant -d app < '$CL/session_in' > '$CL/session.out' 2>&1"
exec 3> "$CL/session_in"
timeout 10 bash -c "until [ -e '$CL/session.out' ]; do sleep 0.02; done"
# call K LABEL: runs start(LABEL) in the session; sets ms (time to the answer, or empty
# if none came within 10 s) and answer (the ticket, or the error and its SQLSTATE).
call() {
  local k="$1" label="$2" t0 before
  before=$(wc -l < "$CL/session.out")
  t0=$(date +%s%N)
  printf '%s\n' "SELECT 'call $k ' || quota.start('$label');" "SELECT 'done $k ' || :'SQLSTATE';" >&3
  ms=""
  if timeout 10 bash -c "until grep -q '^done $k ' '$CL/session.out'; do sleep 0.02; done"; then
    ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  fi
  answer=$(tail -n +$((before + 1)) "$CL/session.out" | tr '\n' ' ')
}
is_ticket() { grep -Eq "^call $1 [0-9a-f-]{36} done $1 00000 \$" <<<"$2"; }

call 1 'before the alter'
check "start() works in app before the ALTER (${ms:-no answer} ms): $answer" is_ticket 1 "$answer"

sql -c "ALTER DATABASE app ALLOW_CONNECTIONS false"
check "app refuses new connections" \
  bash -c "! '$PG_BIN/psql' -X -q -At -h '$CL' -p '$PORT' -U postgres -d app -c 'SELECT 1' 2>/dev/null"
# No writer for app may survive from before the ALTER: end it, and wait until it is gone.
sql -c "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity
         WHERE backend_type = 'pg_quota ledger writer' AND datname = 'app'" >/dev/null
writers() { sql -c "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_quota ledger writer' AND datname = 'app'"; }
for _ in $(seq 1 100); do [ "$(writers)" = 0 ] && break; sleep 0.05; done
expect_eq "no ledger writer serves app any more" 0 "$(writers)"

for k in 2 3 4; do
  call "$k" "after the alter $k"
  check "call $((k - 1)) after the ALTER: the open session's start() returns a ticket: $answer" is_ticket "$k" "$answer"
  check "call $((k - 1)) after the ALTER answered within 3 s (${ms:-no answer within 10 s} ms)" \
    test -n "$ms" -a "${ms:-99999}" -le 3000
done
expect_eq "app's ledger holds the four tickets of the open session" 4 \
  "$(sql -d postgres -c "ALTER DATABASE app ALLOW_CONNECTIONS true" >/dev/null;
     sql -d app -c "SELECT count(*) FROM quota.ledger WHERE role = 'wa_tenant'::regrole AND ended_at IS NULL")"
exec 3>&-
finish_checks
