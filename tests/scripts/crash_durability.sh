#!/usr/bin/env bash
# I6: every ticket a caller received is still counted after a crash (pg_ctl stop -m
# immediate), including one charged inside a transaction that never committed.
source "$(dirname "$0")/../../scripts/lib.sh"
with_cluster crash

sql -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE crash_tenant"
SET="SET quota.max_active_per_role = 0; SET ROLE crash_tenant;"

# Tickets from committed caller transactions and from rolled-back ones.
: > "$CL/tickets"
for i in $(seq 1 20); do
  end=COMMIT; [ $((i % 3)) -eq 0 ] && end=ROLLBACK
  sql -c "$SET" -c "BEGIN" -c "SELECT quota.start('crash $i')" -c "$end" >> "$CL/tickets"
done

# One caller holds its transaction open when the server dies.
mkfifo "$CL/in"
chmod 666 "$CL/in"
sql < "$CL/in" > "$CL/open_ticket" 2>&1 &
exec 3> "$CL/in"
echo "$SET BEGIN; SELECT quota.start('never committed');" >&3
for _ in $(seq 1 100); do [ -s "$CL/open_ticket" ] && break; sleep 0.1; done
cat "$CL/open_ticket" >> "$CL/tickets"

stop_cluster "$CL" immediate
exec 3>&-
as_pg "$PG_BIN/pg_ctl" -D "$CL/data" -l "$CL/server.log" -w -t 60 start >/dev/null

received=$(grep -c '^[0-9a-f-]\{36\}$' "$CL/tickets")
expect_eq "all 21 starts returned a ticket" 21 "$received"
ids=$(grep '^[0-9a-f-]\{36\}$' "$CL/tickets" | sed "s/.*/'&'/" | paste -sd,)
expect_eq "every received ticket survived the crash" "$received" \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE id IN ($ids) AND ended_at IS NULL")"
expect_eq "the ticket of the never-committed transaction is counted" 1 \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE label = 'never committed'")"
expect_eq "the summary agrees with the ledger after recovery" \
  "$(sql -c "SELECT count(*) FROM quota.ledger WHERE role = 'crash_tenant'::regrole")" \
  "$(sql -c "SELECT tickets FROM quota.summary WHERE role = 'crash_tenant'::regrole")"
expect_eq "start() works after recovery" t \
  "$(sql -c "$SET" -c "SELECT quota.start('after') IS NOT NULL")"
finish_checks
