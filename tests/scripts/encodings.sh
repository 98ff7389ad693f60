#!/usr/bin/env bash
# Labels and outcomes work in every server encoding, not only UTF-8. In a LATIN1 and a
# SQL_ASCII database: a non-ASCII label is stored as sent (converted by the server from
# the client's UTF-8 where the database has a real encoding), a label is limited to 200
# characters as that encoding counts them (as length() does), and a non-ASCII or
# non-UTF-8 outcome is an invalid outcome (22023), never an internal error (XX000).
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5624 + PORT_OFFSET))}"
with_cluster encodings
export PGCLIENTENCODING=UTF8

sql -c "CREATE ROLE enc_tenant LOGIN" \
    -c "CREATE DATABASE enc_latin1 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0" \
    -c "CREATE DATABASE enc_ascii ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"

NIL=00000000-0000-0000-0000-000000000000
# label_hex DB TICKET: the stored label's bytes in the server encoding, as hex.
label_hex() { sql -d "$1" -c "SELECT encode(convert_to(label, current_setting('server_encoding')), 'hex') FROM quota.ledger WHERE id = '${2:-$NIL}'"; }
label_len() { sql -d "$1" -c "SELECT length(label) FROM quota.ledger WHERE id = '${2:-$NIL}'"; }
rows() { sql -d "$1" -c "SELECT count(*) FROM quota.ledger"; }

for db in enc_latin1 enc_ascii; do
  sql -d "$db" -c "CREATE EXTENSION pg_quota" >/dev/null
  enc=$(sql -d "$db" -c "SHOW server_encoding")
  T="enc_tenant"
  if [ "$enc" = LATIN1 ]; then
    hello_hex=68e96c6c6f            # 'héllo' converted to LATIN1
    L200="repeat('é', 200)"; L201="repeat('é', 201)"
  else
    hello_hex=68c3a96c6c6f          # SQL_ASCII stores the client's UTF-8 bytes unchanged
    L200="repeat(E'\\xe9', 200)"; L201="repeat(E'\\xe9', 201)"
  fi

  t1=$(as $T "$db" "SELECT quota.start('héllo')")
  expect_eq "$enc: start('héllo') is admitted and stores the label as sent" "$hello_hex" "$(label_hex "$db" "$t1")"
  expect_eq "$enc: the label reads back as 'héllo' through a UTF-8 client" "héllo" \
    "$(sql -d "$db" -c "SELECT label FROM quota.ledger WHERE id = '${t1:-$NIL}'")"
  t2=$(as $T "$db" "SELECT quota.try_start(E'h\\xe9llo')")
  expect_eq "$enc: try_start() with the byte 0xE9 in its label stores it as sent" 68e96c6c6f "$(label_hex "$db" "$t2")"
  t3=$(as $T "$db" "SELECT quota.start($L200)")
  expect_eq "$enc: a label of 200 non-ASCII characters is admitted whole" 200 "$(label_len "$db" "$t3")"
  n=$(rows "$db")
  expect_eq "$enc: a label of 201 non-ASCII characters is refused with 22001" 22001 "$(state $T "$db" "SELECT quota.start($L201)")"
  expect_eq "$enc: ... by try_start() too" 22001 "$(state $T "$db" "SELECT quota.try_start($L201)")"
  expect_eq "$enc: ... and nothing was charged" "$n" "$(rows "$db")"
  if [ "$enc" = SQL_ASCII ]; then
    # In SQL_ASCII every byte is a character: 100 UTF-8 'é' are 200 characters there.
    t4=$(as $T "$db" "SELECT quota.start(repeat('é', 100))")
    expect_eq "$enc: 100 UTF-8 'é' (200 bytes, 200 characters here) are admitted whole" 200 "$(label_len "$db" "$t4")"
    expect_eq "$enc: 101 UTF-8 'é' (202 characters here, as length() counts) are refused with 22001" 22001 \
      "$(state $T "$db" "SELECT quota.start(repeat('é', 101))")"
  fi
  expect_eq "$enc: finish(t, 'dön') is refused with 22023" 22023 "$(state $T "$db" "SELECT quota.finish('${t1:-$NIL}', 'dön')")"
  expect_eq "$enc: finish(t, E'd\\xf6n') is refused with 22023" 22023 "$(state $T "$db" "SELECT quota.finish('${t1:-$NIL}', E'd\\xf6n')")"
  expect_eq "$enc: the ticket is still active after the refused finishes" 1 \
    "$(sql -d "$db" -c "SELECT count(*) FROM quota.ledger WHERE id = '${t1:-$NIL}' AND ended_at IS NULL")"
  expect_eq "$enc: finish(t, 'failed') ends it" t "$(as $T "$db" "SELECT quota.finish('${t1:-$NIL}', 'failed')")"
  expect_eq "$enc: the tenant's quota.usage counts its tickets" "$(sql -d "$db" -c "SELECT count(*) FILTER (WHERE ended_at IS NULL) || '|' || count(*) FROM quota.ledger")" \
    "$(as $T "$db" "SELECT active || '|' || retained FROM quota.usage")"
done
check "no server process was terminated by a signal" test "$(grep -c 'terminated by signal' "$CL/server.log" || true)" = 0
finish_checks
