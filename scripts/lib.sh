# Shared helpers for scripts/test, scripts/demo, scripts/bench and tests/scripts/*.
# Source it; it sets strict mode for the caller.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PG_MAJOR="${PG_MAJOR:-15}"
# PG_BIN may point at another installation of the same layout, for example a relocated
# copy of /usr/lib/postgresql/15 that carries an older pg_quota build.
PG_BIN="${PG_BIN:-/usr/lib/postgresql/$PG_MAJOR/bin}"
PG_CONFIG="$PG_BIN/pg_config"
PGXS_TEST="${PG_BIN%/bin}/lib/pgxs/src/test"
PGRX_VERSION="0.18.0"
APT_PACKAGES=(postgresql-$PG_MAJOR postgresql-server-dev-$PG_MAJOR libclang-dev clang sudo)

export PATH="$HOME/.cargo/bin:$PATH"
# pgrx appends a Rust backtrace to the DETAIL of errors that pass through Rust when
# these are set; servers started from here must print PostgreSQL's errors unchanged.
unset RUST_BACKTRACE RUST_LIB_BACKTRACE

log() { printf '==> %s\n' "$*" >&2; }

# PostgreSQL refuses to run as root, so servers and pg_regress run as this user.
PG_USER="${PG_USER:-postgres}"

as_pg() {
  if [ "$(id -un)" = "$PG_USER" ]; then "$@"; else runuser -u "$PG_USER" -- "$@"; fi
}

# Installs what a fresh Debian 12 machine lacks; skips each step already done.
ensure_deps() {
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    log "installing apt packages: ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
  fi
  if ! cargo pgrx --version 2>/dev/null | grep -q "$PGRX_VERSION"; then
    log "installing cargo-pgrx $PGRX_VERSION (takes several minutes)"
    cargo install cargo-pgrx --version "$PGRX_VERSION" --locked
  fi
  if ! grep -qs "^pg$PG_MAJOR = " "$HOME/.pgrx/config.toml"; then
    log "cargo pgrx init --pg$PG_MAJOR $PG_CONFIG"
    cargo pgrx init --pg"$PG_MAJOR" "$PG_CONFIG"
  fi
}

# Builds pg_quota and installs it into the system PostgreSQL.
install_extension() {
  local profile=()
  [ "${1:-}" = "--release" ] && profile=(--release)
  log "building and installing pg_quota ${profile[*]}"
  (cd "$ROOT" && cargo pgrx install "${profile[@]}" --pg-config "$PG_CONFIG" \
      --no-default-features --features "pg$PG_MAJOR" >&2)
}

# A scratch directory the postgres user can write to. Removed at exit unless KEEP_TMP=1.
make_scratch() {
  local d
  d="$(mktemp -d "${TMPDIR:-/tmp}/pg_quota.XXXXXX")"
  chmod 755 "$d"
  chown "$PG_USER" "$d" 2>/dev/null || true
  echo "$d"
}

# start_cluster DIR PORT [extra postgresql.conf lines...]: initdb + start, preloaded.
start_cluster() {
  local dir="$1" port="$2"; shift 2
  as_pg "$PG_BIN/initdb" -D "$dir/data" -A trust -U postgres --no-sync >/dev/null
  {
    echo "shared_preload_libraries = 'pg_quota'"
    echo "port = $port"
    echo "listen_addresses = ''"
    echo "unix_socket_directories = '$dir'"
    echo "max_connections = 120"
    echo "max_worker_processes = 16"
    for line in "$@"; do echo "$line"; done
  } >> "$dir/data/postgresql.conf"
  as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null
}

stop_cluster() {
  local dir="$1" mode="${2:-fast}"
  as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -m "$mode" -w -t 60 stop >/dev/null 2>&1 || true
}

# psql against a scratch cluster: pgq DIR PORT [psql args...]
pgq() {
  local dir="$1" port="$2"; shift 2
  "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$dir" -p "$port" -U postgres "$@"
}

# --- TAP-style checks for tests/scripts/*.sh ----------------------------------------
CHECKS_FAILED=0
CHECK_NO=0
# check NAME COMMAND...: runs COMMAND; prints "ok N - NAME" or "not ok N - NAME".
check() {
  local name="$1"; shift
  CHECK_NO=$((CHECK_NO + 1))
  if "$@"; then echo "ok $CHECK_NO - $name"; else echo "not ok $CHECK_NO - $name"; CHECKS_FAILED=$((CHECKS_FAILED + 1)); fi
}
# expect_eq NAME EXPECTED ACTUAL
expect_eq() {
  local name="$1" want="$2" got="$3"
  CHECK_NO=$((CHECK_NO + 1))
  if [ "$want" = "$got" ]; then echo "ok $CHECK_NO - $name"
  else echo "not ok $CHECK_NO - $name: expected [$want], got [$got]"; CHECKS_FAILED=$((CHECKS_FAILED + 1)); fi
}
finish_checks() {
  echo "1..$CHECK_NO"
  [ "$CHECKS_FAILED" -eq 0 ]
}

# Clusters and background jobs a test script started; cleanup_at_exit stops them.
CLUSTERS=()
BG=()
# bg CMD...: runs CMD in the background in a process group of its own; sets LAST_BG.
bg() { setsid "$@" & LAST_BG=$!; BG+=("$LAST_BG"); }

# At exit: kill the background jobs, stop every cluster, and remove the clusters'
# folders if the script passed (unless KEEP_TMP=1).
cleanup_at_exit() {
  local rc=$? p c
  { exec 3>&-; } 2>/dev/null || true
  for p in "${BG[@]}"; do kill -- "-$p" 2>/dev/null || true; done
  for c in "${CLUSTERS[@]}"; do stop_cluster "$c" immediate; done
  if [ "$rc" -eq 0 ] && [ "${KEEP_TMP:-0}" != 1 ]; then
    for c in "${CLUSTERS[@]}"; do rm -rf "$c"; done
  fi
}

# new_cluster DIR PORT [postgresql.conf lines...]: like start_cluster, and stopped at exit.
new_cluster() {
  local dir="$1"
  mkdir -p "$dir"; chown "$PG_USER" "$dir"
  CLUSTERS+=("$dir")
  trap cleanup_at_exit EXIT
  start_cluster "$@"
}

# A scratch cluster for one test script, stopped at exit.
# with_cluster NAME [postgresql.conf lines...]: sets CL (its directory) and PORT.
with_cluster() {
  local name="$1"; shift
  CL="${SCRATCH:-$(make_scratch)}/$name"
  PORT="${PORT:-5480}"
  new_cluster "$CL" "$PORT" "$@"
}

# burst_client ROLE K: as ROLE, runs the script $CL/burst.sql over and over against
# $CL, appending the tickets to $CL/got.K, until $CL/stop exists. Run it with bg.
burst_client() {
  local role="$1" k="$2" round
  for round in $(seq 1 400); do
    [ -e "$CL/stop" ] && break
    timeout 20 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -h "$CL" -p "$PORT" -U "$role" \
      -d postgres -f "$CL/burst.sql" >> "$CL/got.$k" 2>> "$CL/err.$k" || sleep 0.1
  done
}

# --- Sessions against the script's cluster ($CL, $PORT) ------------------------------
as() {  # as USER DB SQL...: one session, output only
  local user="$1" db="$2"; shift 2; local a=() q
  for q in "$@"; do a+=(-c "$q"); done
  timeout 20 "$PG_BIN/psql" -X -q -At -h "$CL" -p "$PORT" -U "$user" -d "$db" -v ON_ERROR_STOP=0 "${a[@]}" 2>/dev/null || true
}
state() {  # state USER DB SQL...: the SQLSTATE of the last statement
  as "$@" '\echo SQLSTATE=:SQLSTATE' | sed -n 's/^SQLSTATE=//p' | tail -n1
}
psql_as() {  # psql_as USER [psql args...]: like sql, as USER, in database postgres, 20 s at most
  local user="$1"; shift
  timeout 20 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 -h "$CL" -p "$PORT" -U "$user" -d postgres "$@"
}
# open_session NAME USER: a psql session fed through the fifo $CL/NAME.in (write to it
# with `say NAME SQL`), its output in $CL/NAME.out; `close_session NAME` ends it.
open_session() {
  local name="$1" user="$2" fd
  rm -f "$CL/$name.out" "$CL/$name.in"; mkfifo -m 666 "$CL/$name.in"
  bg bash -c "exec '$PG_BIN/psql' -X -q -At -v ON_ERROR_STOP=0 -h '$CL' -p '$PORT' -U $user -d postgres < '$CL/$name.in' > '$CL/$name.out' 2>&1"
  exec {fd}> "$CL/$name.in"
  printf -v "FD_$name" %s "$fd"
}
say() { local v="FD_$1"; echo "$2" >&"${!v}"; }
close_session() { local v="FD_$1"; eval "exec ${!v}>&-"; }
wait_out() {  # wait_out NAME TEXT [SECONDS]: until the session printed TEXT
  timeout "${3:-10}" bash -c "until grep -q '$2' '$CL/$1.out' 2>/dev/null; do sleep 0.05; done"
}

# summary_matches_ledger: every summary row equals its role's ledger rows (a role
# without a summary row is counted from the ledger, so a missing row is fine); prints
# the roles that are off.
summary_matches_ledger() {
  local off
  off=$(sql -c "SELECT s.role::regrole || ': summary ' || s.tickets || ', ledger ' || coalesce(l.n, 0)
                  FROM quota.summary s LEFT JOIN (SELECT role, count(*) AS n FROM quota.ledger GROUP BY role) l USING (role)
                 WHERE s.tickets IS DISTINCT FROM coalesce(l.n, 0)")
  [ -z "$off" ] || { echo "# $off" | tr '\n' ' '; echo; return 1; }
}

# sql [psql args...] -c ...: runs against the script's cluster, unaligned, no headers.
sql() { pgq "$CL" "$PORT" -At "$@"; }
