#!/usr/bin/env bash
# Labels and outcomes work in every server encoding, not only UTF-8. In a LATIN1 and a
# SQL_ASCII database: a non-ASCII label is stored as sent (converted by the server from
# the client's UTF-8 where the database has a real encoding), a label is limited to 200
# characters as that encoding counts them (as length() does), and a non-ASCII or
# non-UTF-8 outcome is an invalid outcome (22023), never an internal error (XX000).
#
# 0.5.2 (R5): names in refusals, as PostgreSQL's own messages put them: in the server
# encoding, converted for the client. In LATIN1, EUC_JP (multibyte) and SQL_ASCII
# databases a UTF-8 client reads a tenant's name, its role's and its database's as it
# wrote them (0.5.1 sent `caf\u{FFFD}` as UTF-8 bytes that PostgreSQL then took for
# LATIN1: `cafï¿½`), in the error and in the server log's refusal line; an error the
# ledger writer relays reaches the client in its encoding, with no mojibake.
# 0.6.0: quota.finish_job() with non-ASCII names, and its ASCII warnings (at the end).
source "$(dirname "$0")/../../scripts/lib.sh"
PORT="${PORT:-$((5624 + PORT_OFFSET))}"
with_cluster encodings
export PGCLIENTENCODING=UTF8

sql -c "CREATE ROLE enc_tenant LOGIN" \
    -c "CREATE DATABASE enc_latin1 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0" \
    -c "CREATE DATABASE enc_ascii ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0" \
    -c "CREATE DATABASE enc_eucjp ENCODING 'EUC_JP' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"

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
  # (0.6.0: an active ticket is a row of quota.active, and none of quota.history.)
  expect_eq "$enc: the ticket is still active after the refused finishes" "1 0" \
    "$(sql -d "$db" -c "SELECT (SELECT count(*) FROM quota.active WHERE id = '${t1:-$NIL}' AND ended_at IS NULL)
                            || ' ' || (SELECT count(*) FROM quota.history WHERE id = '${t1:-$NIL}')")"
  expect_eq "$enc: finish(t, 'failed') ends it" t "$(as $T "$db" "SELECT quota.finish('${t1:-$NIL}', 'failed')")"
  expect_eq "$enc: the tenant's quota.usage counts its tickets" "$(sql -d "$db" -c "SELECT count(*) FILTER (WHERE ended_at IS NULL) || '|' || count(*) FROM quota.ledger")" \
    "$(as $T "$db" "SELECT active || '|' || retained FROM quota.usage")"
done
# --- Names in refusals (0.5.2) ---------------------------------------------------------
# A role and a database whose names are not ASCII (stored as the UTF-8 client sent
# them: role and database names are shared by every database, whatever its encoding).
sql -c "CREATE ROLE \"rôle\" LOGIN" \
    -c "ALTER ROLE \"rôle\" SET quota.max_active_per_tenant = 1" \
    -c "ALTER ROLE \"rôle\" SET quota.max_active_per_database = 2" \
    -c "ALTER ROLE \"rôle\" SET quota.log_refusals = on" \
    -c "CREATE DATABASE \"bäse_latin1\" ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0" >/dev/null
# refusal_of ROLE DB SQL: the message the statement failed with.
refusal_of() {
  timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U "$1" -d "$2" -v ON_ERROR_STOP=0 \
    -c "$3" 2>&1 >/dev/null | sed -n 's/^ERROR:  //p' || true
}
for db in enc_latin1 enc_eucjp enc_ascii "bäse_latin1"; do
  sql -d "$db" -c "SET client_min_messages = warning" -c "CREATE EXTENSION IF NOT EXISTS pg_quota" >/dev/null
  sql -d "$db" -c "SELECT count(quota.finish(id)) FROM quota.ledger WHERE ended_at IS NULL" >/dev/null
  enc=$(sql -d "$db" -c "SHOW server_encoding")
  case "$enc" in
    EUC_JP) tenant="東京の会社" ;;
    *) tenant="café" ;;
  esac
  # How PostgreSQL itself shows the role's and the database's names in this database.
  shown_role=$(as "rôle" "$db" "SELECT current_user")
  shown_db=$(as "rôle" "$db" "SELECT current_database()")
  as "rôle" "$db" "SELECT quota.start('first', tenant => '$tenant')" >/dev/null
  msg=$(refusal_of "rôle" "$db" "SELECT quota.start('second', tenant => '$tenant')")
  expect_eq "$db ($enc): the tenant's refusal names the tenant and its role as PostgreSQL shows them" \
    "tenant \"$tenant\" of role \"$shown_role\" has 1 active ticket, the limit set by quota.max_active_per_tenant" "$msg"
  as "rôle" "$db" "SELECT quota.start('other', tenant => 'other')" >/dev/null
  msg=$(refusal_of "rôle" "$db" "SELECT quota.start('third', tenant => 'third')")
  expect_eq "$db ($enc): the database cap's refusal names the database as PostgreSQL shows it" \
    "database \"$shown_db\" has 2 active tickets, the limit set by quota.max_active_per_database" "$msg"
  sql -d "$db" -c "SELECT quota.finish(id) FROM quota.ledger WHERE ended_at IS NULL" >/dev/null
done
# The server log's refusal lines (quota.log_refusals) are in each database's encoding,
# as PostgreSQL writes every message of a backend: LATIN1's é is the byte E9, EUC_JP's
# 東 the bytes C5 EC.
check "the LATIN1 refusal line holds the tenant in LATIN1" grep -aq $'tenant "caf\xe9"' "$CL/server.log"
check "the EUC_JP refusal line holds the tenant in EUC_JP" grep -aq $'tenant "\xc5\xec' "$CL/server.log"
check "no refusal line holds the UTF-8 replacement character" bash -c "! grep -a 'refused' '$CL/server.log' | grep -aq $'\xef\xbf\xbd'"

# Errors that name an index or a trigger a DBA created with a non-ASCII name: one the
# ledger writer raises and the caller relays, the same one raised by finish() itself,
# the writer's last error in quota.writer_stats, and a refused trigger (which 0.5.1
# answered with an internal error, XX000: it read the name as UTF-8).
# From 0.6.0 the ledger is quota.active (where the writer inserts a start's ticket, and
# whose row finish() deletes) and quota.history (where finish() inserts the ended
# ticket); quota.ledger is a view, which takes no index and no row trigger. So the index
# goes on quota.active for the writer's path, then on quota.history for finish()'s
# insert, and the trigger on each table. (0.6.x: finish() no longer opens quota.active's
# indexes, since its delete adds no entries; it names the one on quota.history.)
t=$(as enc_tenant enc_latin1 "SELECT quota.start('before the index')")
sql -d enc_latin1 -c "CREATE INDEX \"ledger_löwer\" ON quota.active (lower(label))" >/dev/null
expect_eq "the writer's refusal of the index, relayed, names it as the client wrote it" \
  'pg_quota ledger writer failed: pg_quota cannot maintain the expression index "ledger_löwer" on quota.active' \
  "$(refusal_of enc_tenant enc_latin1 "SELECT quota.start('with the index')")"
expect_eq "... and keeps its SQLSTATE (0A000)" 0A000 "$(state enc_tenant enc_latin1 "SELECT quota.start('with the index')")"
# (The writer's fold pass fails on the index too, a second apart, and its error may be
# the last one: either names the index.)
last_error=$(sql -d enc_latin1 -c "SELECT last_error FROM quota.writer_stats WHERE datname = current_database()")
check "quota.writer_stats shows the writer's last error in the reader's encoding ($last_error)" \
  grep -q 'pg_quota cannot maintain the expression index "ledger_löwer" on quota.active' <<<"$last_error"
sql -d enc_latin1 -c "DROP INDEX quota.\"ledger_löwer\"" >/dev/null
sql -d enc_latin1 -c "CREATE INDEX \"hïstory_löwer\" ON quota.history (lower(label))" >/dev/null
expect_eq "finish() names an index on quota.history, where it writes the ended ticket, as the client wrote it" \
  'pg_quota cannot maintain the expression index "hïstory_löwer" on quota.history' \
  "$(refusal_of enc_tenant enc_latin1 "SELECT quota.finish('${t:-$NIL}')")"
expect_eq "... with 0A000, and the ticket is still active" "0A000 1" \
  "$(state enc_tenant enc_latin1 "SELECT quota.finish('${t:-$NIL}')") $(sql -d enc_latin1 -c "SELECT count(*) FROM quota.active WHERE id = '${t:-$NIL}'")"
sql -d enc_latin1 -c "DROP INDEX quota.\"hïstory_löwer\"" >/dev/null
sql -d enc_latin1 -c "CREATE FUNCTION public.noop() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NULL; END'" >/dev/null
# (The view quota.ledger takes only INSTEAD OF row triggers: one is refused likewise.)
for tbl in quota.active quota.history quota.ledger; do
  when=AFTER; [ "$tbl" = quota.ledger ] && when="INSTEAD OF"
  expect_eq "a trigger on $tbl is refused with 0A000, not an internal error" 0A000 \
    "$(state postgres enc_latin1 "CREATE TRIGGER \"trïgger\" $when INSERT ON $tbl FOR EACH ROW EXECUTE FUNCTION public.noop()")"
  expect_eq "... naming it as the client wrote it" 'trïgger' \
    "$(refusal_of postgres enc_latin1 "CREATE TRIGGER \"trïgger\" $when INSERT ON $tbl FOR EACH ROW EXECUTE FUNCTION public.noop()" | grep -o 'trïgger' | head -n1)"
done

# quota.finish_job() (0.6.0) in a LATIN1 database: a column and a key with non-ASCII
# names find the ticket; its errors name the trigger and the path as the client wrote
# them; a WARNING that quotes a job's non-ASCII value is written in ASCII (it is sent in
# the client's encoding, which may lack the character), and the statement goes on.
sql -d enc_latin1 -c "CREATE TABLE jöbs (id int PRIMARY KEY, status text, \"pâyload\" jsonb)" \
  -c "CREATE TRIGGER \"fïnish\" AFTER UPDATE ON jöbs FOR EACH ROW WHEN (NEW.status = 'done')
        EXECUTE FUNCTION quota.finish_job('pâyload->clé')" >/dev/null
t=$(as enc_tenant enc_latin1 "SELECT quota.start('job')")
sql -d enc_latin1 -c "INSERT INTO jöbs VALUES (1, 'todo', jsonb_build_object('clé', '${t:-$NIL}'::text)),
                                             (2, 'todo', '{\"clé\": \"tâche\"}')" >/dev/null
warning=$(timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U postgres -d enc_latin1 \
  -c "UPDATE jöbs SET status = 'done'" 2>&1 >/dev/null | sed -n 's/^WARNING:  //p' || true)
expect_eq "finish_job() reads the ticket through a non-ASCII column and key: the job's ticket ended" succeeded \
  "$(sql -d enc_latin1 -c "SELECT outcome FROM quota.ledger WHERE id = '${t:-$NIL}'")"
expect_eq "... and a non-ASCII value that is no uuid is quoted in ASCII in a WARNING" \
  'invalid input syntax for type uuid: "t\u00E2che"' "$warning"
expect_eq "... while the statement went on (both jobs done)" 2 \
  "$(sql -d enc_latin1 -c "SELECT count(*) FROM jöbs WHERE status = 'done'")"
expect_eq "a misused finish_job() names the trigger and the path as the client wrote them" \
  'invalid arguments for quota.finish_job() in trigger "fïnish2"' \
  "$(refusal_of postgres enc_latin1 "CREATE TRIGGER \"fïnish2\" AFTER UPDATE ON jöbs FOR EACH ROW EXECUTE FUNCTION quota.finish_job('pâyload->')")"
expect_eq "... and its column" 'column "pâyløad" of relation "jöbs" does not exist' \
  "$(refusal_of postgres enc_latin1 "CREATE TRIGGER \"fïnish2\" AFTER UPDATE ON jöbs FOR EACH ROW EXECUTE FUNCTION quota.finish_job('pâyløad->clé')")"

# quota.claim_job() (0.6.0) there too: it clears a ticket it cannot renew at a
# non-ASCII key of the document (jsonb_set, with the key in the server encoding), and
# renews one it can.
sql -d enc_latin1 -c "CREATE TRIGGER \"clâim\" BEFORE UPDATE ON jöbs FOR EACH ROW WHEN (NEW.status = 'doing')
        EXECUTE FUNCTION quota.claim_job('pâyload->clé', '10 minutes')" >/dev/null
t2=$(as enc_tenant enc_latin1 "SELECT quota.start('job2', lease => '1 minute')")
sql -d enc_latin1 -c "INSERT INTO jöbs VALUES (3, 'todo', jsonb_build_object('clé', '${t2:-$NIL}'::text, 'nöte', 'é')),
                                             (4, 'todo', '{\"clé\": \"00000000-0000-7000-8000-000000000000\", \"nöte\": \"é\"}')" >/dev/null
sql -d enc_latin1 -c "UPDATE jöbs SET status = 'doing' WHERE id IN (3, 4)" >/dev/null
expect_eq "claim_job() clears an unknown ticket at a non-ASCII key, the rest of the document as it was; renews a live one" \
  "{\"clé\": null, \"nöte\": \"é\"} true" \
  "$(sql -d enc_latin1 -c "SELECT (SELECT \"pâyload\"::text FROM jöbs WHERE id = 4) || ' '
                              || (SELECT (lease_until > now() + interval '9 minutes')::text FROM quota.ledger WHERE id = '${t2:-$NIL}')")"

check "no server process was terminated by a signal" test "$(grep -c 'terminated by signal' "$CL/server.log" || true)" = 0
finish_checks
