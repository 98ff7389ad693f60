# Shared helpers for scripts/test, scripts/demo, scripts/bench and tests/scripts/*.
# Source it; it sets strict mode for the caller.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PGRX_VERSION="0.18.0"

# --- PostgreSQL majors ------------------------------------------------------------------
# Tested majors, in the order scripts/test runs them. Debian 12 ships 15 as a binary
# package; every other major is built from Debian's source package into PG_CACHE/MAJOR
# (ensure_pg). 16 and 17 have cfg paths in src/compat.rs but no server on this archive.
TESTED_MAJORS=(15 18)
DEBIAN_MAJOR=15
PG_CACHE="${PG_CACHE:-/opt/pg_quota-pg}"

# pg_bin_of MAJOR: the bin directory of that major's server. PG<MAJOR>_BIN (for example
# PG15_BIN) may point at another installation of the same layout, such as a relocated
# copy of /usr/lib/postgresql/15 that carries an older pg_quota build.
pg_bin_of() {
  local var="PG$1_BIN"
  if [ -n "${!var:-}" ]; then echo "${!var}"
  elif [ "$1" = "$DEBIAN_MAJOR" ]; then echo "/usr/lib/postgresql/$1/bin"
  else echo "$PG_CACHE/$1/bin"
  fi
}

# use_pg MAJOR: points PG_MAJOR, PG_BIN, PG_CONFIG, PGXS_TEST and PORT_OFFSET at that
# major, and exports them so that child scripts use the same server.
use_pg() {
  PG_MAJOR="$1"
  PG_BIN="$(pg_bin_of "$PG_MAJOR")"
  pg_paths
  export PG_MAJOR PG_BIN
}

# pg_paths: the paths that follow from PG_BIN. PGXS_TEST holds pg_regress and
# pg_isolation_regress of the same major (Debian: lib/pgxs/src/test; a source build
# whose prefix names no "postgres" or "pgsql": lib/postgresql/pgxs/src/test).
pg_paths() {
  PG_CONFIG="$PG_BIN/pg_config"
  if [ -x "$PG_CONFIG" ]; then
    PGXS_TEST="$(dirname "$(dirname "$("$PG_CONFIG" --pgxs)")")/test"
  else
    PGXS_TEST="${PG_BIN%/bin}/lib/pgxs/src/test"
  fi
  # Test clusters listen on Unix sockets in their own folders, yet each major gets its
  # own port range (+1000 per major above 15) and QUOTA_PORT_OFFSET shifts them all, so
  # that runs on several majors, or next to someone else's run, never share a port.
  PORT_OFFSET=$(( (PG_MAJOR - 15) * 1000 + ${QUOTA_PORT_OFFSET:-0} ))
}

PG_MAJOR="${PG_MAJOR:-15}"
# PG_BIN, when set, names the installation for PG_MAJOR (as before there were several
# majors): it stands for PG<PG_MAJOR>_BIN unless that is set too.
if [ -n "${PG_BIN:-}" ]; then
  _var="PG${PG_MAJOR}_BIN"
  [ -n "${!_var:-}" ] || export "$_var=$PG_BIN"
  unset _var
fi
PG_BIN="$(pg_bin_of "$PG_MAJOR")"
pg_paths

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

# apt_install PACKAGE...: installs those of the packages that are missing.
apt_install() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    log "installing apt packages: ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
  fi
}

# ensure_deps [MAJOR...]: installs what a fresh Debian 12 machine lacks to build and test
# pg_quota on those majors (default: PG_MAJOR); skips each step already done.
ensure_deps() {
  local majors=("$@") m pkgs=(libclang-dev clang sudo)
  [ "${#majors[@]}" -gt 0 ] || majors=("$PG_MAJOR")
  for m in "${majors[@]}"; do
    if [ "$m" = "$DEBIAN_MAJOR" ]; then pkgs+=("postgresql-$m" "postgresql-server-dev-$m")
    else pkgs+=(gcc make bzip2 perl bison flex libreadline-dev zlib1g-dev)  # ensure_pg's build
    fi
  done
  apt_install "${pkgs[@]}"
  if ! cargo pgrx --version 2>/dev/null | grep -q "$PGRX_VERSION"; then
    log "installing cargo-pgrx $PGRX_VERSION (takes several minutes)"
    cargo install cargo-pgrx --version "$PGRX_VERSION" --locked
  fi
  for m in "${majors[@]}"; do ensure_pg "$m"; done
  pgrx_init "${majors[@]}"
  pg_paths
}

# ensure_pg MAJOR: a major that Debian 12 does not ship as a binary is built once from
# the upstream source that Debian's archive serves in the postgresql-MAJOR source
# package of `sid`, into the cache PG_CACHE/MAJOR. Skipped when the cache has pg_config;
# rebuilt when it is missing. The system's apt setup is not touched: a private sources
# list, lists and cache directory under PG_CACHE/apt are passed with -o options.
ensure_pg() {
  local major="$1"
  [ "$major" != "$DEBIAN_MAJOR" ] || return 0  # the apt package (ensure_deps)
  local prefix="$PG_CACHE/$major"
  [ -x "$prefix/bin/pg_config" ] && return 0
  mkdir -p "$PG_CACHE"; chmod 755 "$PG_CACHE"
  local lock
  exec {lock}> "$PG_CACHE/.build-$major.lock"
  flock "$lock"  # one build at a time, if two runs start together
  if [ -x "$prefix/bin/pg_config" ]; then exec {lock}>&-; return 0; fi
  log "building PostgreSQL $major from Debian's source package into $prefix (once; a few minutes)"
  local apt="$PG_CACHE/apt" work src
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial"
  echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main" \
    > "$apt/sources.list"
  local aptopts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
                 -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o APT::Sandbox::User=root)
  work="$(mktemp -d "$PG_CACHE/.build-$major.XXXXXX")"
  apt-get "${aptopts[@]}" -q update >&2
  (cd "$work" && apt-get "${aptopts[@]}" -q source --download-only "postgresql-$major" >&2)
  tar -xjf "$work"/postgresql-"$major"_*.orig.tar.bz2 -C "$work"
  src="$(find "$work" -mindepth 1 -maxdepth 1 -type d -name "postgresql-$major*" | head -n1)"
  log "PostgreSQL $(basename "$src"): configure, make world-bin, install (log: $work/build.log)"
  # From PostgreSQL 17 the release tarball no longer carries the generated parsers
  # (distprep is gone), so the build needs bison and flex (ensure_deps installs them).
  # make install-world-bin goes to a staging folder first; the cache appears only whole.
  if ! (cd "$src" && ./configure --prefix="$prefix" --without-icu \
        && make -j"$(nproc)" world-bin && make install-world-bin DESTDIR="$work/stage") \
        > "$work/build.log" 2>&1; then
    tail -n 40 "$work/build.log" >&2
    log "building PostgreSQL $major failed; the build folder $work is kept"
    exec {lock}>&-
    return 1
  fi
  rm -rf "$prefix"
  mv "$work/stage$prefix" "$prefix"
  chmod -R a+rX "$prefix"  # the postgres user runs the servers
  rm -rf "$work"
  exec {lock}>&-
  log "PostgreSQL $major is in $prefix"
}

# pgrx_init [MAJOR...]: registers every tested major that is installed (and the given
# ones) with cargo pgrx, in one call, because `cargo pgrx init` keeps only what it is
# given. Runs only when config.toml lacks a major or names another pg_config for it.
pgrx_init() {
  local config="${PGRX_HOME:-$HOME/.pgrx}/config.toml" m args=() stale=0
  for m in "${TESTED_MAJORS[@]}" "$@"; do
    [[ " ${args[*]} " == *" --pg$m "* ]] && continue
    [ -x "$(pg_bin_of "$m")/pg_config" ] || continue
    args+=(--pg"$m" "$(pg_bin_of "$m")/pg_config")
  done
  for m in "$@"; do
    grep -qsx "pg$m = \"$(pg_bin_of "$m")/pg_config\"" "$config" || stale=1
  done
  [ "$stale" = 1 ] || return 0
  log "cargo pgrx init ${args[*]}"
  cargo pgrx init "${args[@]}" >&2
}

# Builds pg_quota and installs it into PG_MAJOR's PostgreSQL (PG_CONFIG).
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
  PORT="${PORT:-$((5480 + PORT_OFFSET))}"
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

# --- A load that follows the primary (promotion.sh, patroni.sh) ----------------------------
# failover_load DIR CONN CLIENTS ROUNDS: starts CLIENTS clients of role t1 on the libpq
# connection string CONN (every node, with target_session_attrs=read-write, so that they
# follow the primary), each writing to DIR/out.K; sets CLIENT_PIDS. A client first
# keeps one ticket open ("S <ticket>", "K <ticket>"), then runs DIR/iter.sql at most
# ROUNDS times, until DIR/stop exists: "S <ticket>" once try_start() returned it ("S
# refused" when it returned NULL: the same admission as start(), without an ERROR in
# the server log for each refusal), "F <ticket> t" once finish() returned true
# (committed). \unset first, so that a failed statement leaves nothing from the
# iteration before. A ticket whose finish() a failover cut off is finished again once a
# primary takes connections, as an application retries (finish() is idempotent: "F
# <ticket> f" if it had ended); "L <ticket>" if no server ended it in 20 s.
failover_load() {
  local dir="$1" conn="$2" clients="$3" rounds="$4" i k
  {
    for i in $(seq 1 40); do
      echo "\\unset t"; echo "\\unset f"
      echo "SELECT coalesce(quota.try_start('load')::text, 'refused') AS t \\gset"
      echo "\\echo S :t"
      echo "SELECT quota.finish(t::uuid) AS f FROM (SELECT :'t' AS t) s WHERE t <> 'refused' \\gset"
      echo "\\echo F :t :f"
    done
  } > "$dir/iter.sql"
  printf '%s\n' "SELECT quota.start('kept') AS t \\gset" "\\echo S :t" "\\echo K :t" > "$dir/keep.sql"
  CLIENT_PIDS=()
  for k in $(seq 1 "$clients"); do
    bg bash -c "$(declare -f failover_client); D='$dir' CONN='$conn' PG_BIN='$PG_BIN' ROUNDS='$rounds' failover_client $k"
    CLIENT_PIDS+=("$LAST_BG")
  done
}
# stop_clients DIR: asks the clients of CLIENT_PIDS to stop (DIR/stop), waits 60 s at
# most, checks that they stopped by themselves, and kills what is left.
stop_clients() {
  local p _
  touch "$1/stop"
  clients_stopped() { for p in "${CLIENT_PIDS[@]}"; do kill -0 "$p" 2>/dev/null && return 1; done; return 0; }
  for _ in $(seq 1 300); do clients_stopped && break; sleep 0.2; done
  check "the clients stopped by themselves" clients_stopped
  for p in "${CLIENT_PIDS[@]}"; do kill -- "-$p" 2>/dev/null || true; done
}
# failover_client K: one client of failover_load (D, CONN, PG_BIN and ROUNDS set).
failover_client() {
  local k="$1" n=0 x r i
  until [ -s "$D/out.$k" ] && grep -q '^K ' "$D/out.$k"; do
    [ -e "$D/stop" ] && return 0
    timeout 20 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 "$CONN" -f "$D/keep.sql" >> "$D/out.$k" 2>> "$D/err.$k" || sleep 0.1
  done
  while [ ! -e "$D/stop" ] && [ "$n" -lt "$ROUNDS" ]; do
    n=$((n + 1))
    timeout 20 "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 "$CONN" \
      -f "$D/iter.sql" > "$D/run.$k" 2>> "$D/err.$k" || sleep 0.1
    cat "$D/run.$k" >> "$D/out.$k"
    for x in $(awk '$1 == "S" && length($2) == 36 { s[$2] = 1 } $1 == "F" && ($3 == "t" || $3 == "f") { delete s[$2] }
                    END { for (x in s) print x }' "$D/run.$k"); do
      r=; i=$((SECONDS + 20))
      while [ "$SECONDS" -lt "$i" ]; do
        r=$(timeout 5 "$PG_BIN/psql" -X -q -At "$CONN" -c "SELECT quota.finish('$x')" 2>> "$D/err.$k") && break
        sleep 0.2
      done
      case "$r" in t|f) echo "F $x $r" >> "$D/out.$k" ;; *) echo "L $x" >> "$D/out.$k" ;; esac
    done
  done
}

# summary_matches_ledger [DB]: every summary row equals its role's ledger rows (a role
# without a summary row is counted from the ledger, so a missing row is fine); prints
# the roles that are off.
summary_matches_ledger() {
  local off
  off=$(sql -d "${1:-postgres}" -c "SELECT s.role::regrole || ': summary ' || s.tickets || ', ledger ' || coalesce(l.n, 0)
                  FROM quota.summary s LEFT JOIN (SELECT role, count(*) AS n FROM quota.ledger GROUP BY role) l USING (role)
                 WHERE s.tickets IS DISTINCT FROM coalesce(l.n, 0)")
  [ -z "$off" ] || { echo "# $off" | tr '\n' ' '; echo; return 1; }
}

# sql [psql args...] -c ...: runs against the script's cluster, unaligned, no headers.
sql() { pgq "$CL" "$PORT" -At "$@"; }
