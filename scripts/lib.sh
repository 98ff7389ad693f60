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

# --- Citus (tests only) -------------------------------------------------------------------
# Citus is in no package registry here: its released source is vendored beside the
# project (CITUS_TARBALL, ../shared/vendor/), and ensure_citus builds it once against
# PG_CACHE/18 (Citus 14 supports PostgreSQL 16 to 18), as ensure_pg builds 18. The
# build is cached: CITUS_STAMP in the prefix names the tarball it was built from.
CITUS_VERSION="14.0.1"
# Beside the clone (../shared/vendor), else where this project's machines keep it.
CITUS_TARBALL="${CITUS_TARBALL:-$(for d in "$(cd "$ROOT/.." && pwd)/shared/vendor" /work/shared/vendor; do
  [ -r "$d/citus-$CITUS_VERSION.tar.gz" ] && { echo "$d/citus-$CITUS_VERSION.tar.gz"; break; }
done; true)}"  # true: a loop that finds none must not end the caller under set -e
CITUS_TARBALL="${CITUS_TARBALL:-../shared/vendor/citus-$CITUS_VERSION.tar.gz}"
CITUS_MAJOR=18

# citus_available: whether Citus' vendored source is on this machine (else the Citus
# tests are skipped, and say why).
citus_available() { [ -r "$CITUS_TARBALL" ]; }

# ensure_citus: builds and installs Citus into PostgreSQL CITUS_MAJOR's cache (once).
ensure_citus() {
  local prefix="$PG_CACHE/$CITUS_MAJOR" stamp lock work sum lib
  if [ "$(pg_bin_of "$CITUS_MAJOR")" != "$prefix/bin" ]; then
    log "Citus is built into $prefix, not into PG${CITUS_MAJOR}_BIN's installation"
    return 1
  fi
  ensure_pg "$CITUS_MAJOR"  # and with it the compiler and tools (ensure_deps)
  stamp="$prefix/share/citus-build.stamp"
  lib="$("$prefix/bin/pg_config" --pkglibdir)/citus.so"
  sum="$(sha256sum "$CITUS_TARBALL" | cut -d' ' -f1)"
  [ "$(cat "$stamp" 2>/dev/null)" = "$sum" ] && [ -e "$lib" ] && return 0
  exec {lock}> "$PG_CACHE/.build-citus.lock"
  flock "$lock"
  if [ "$(cat "$stamp" 2>/dev/null)" = "$sum" ] && [ -e "$lib" ]; then
    exec {lock}>&-; return 0
  fi
  work="$(mktemp -d "$PG_CACHE/.build-citus.XXXXXX")"
  log "building Citus $CITUS_VERSION against PostgreSQL $CITUS_MAJOR (once; about 4 minutes; log: $work/build.log)"
  tar -xzf "$CITUS_TARBALL" -C "$work"
  if ! (cd "$work/citus-$CITUS_VERSION" \
        && ./configure PG_CONFIG="$prefix/bin/pg_config" --without-libcurl --without-lz4 --without-zstd \
        && make -j"$(nproc)" && make install DESTDIR="$work/stage") > "$work/build.log" 2>&1; then
    tail -n 40 "$work/build.log" >&2
    log "building Citus failed; the build folder $work is kept"
    exec {lock}>&-
    return 1
  fi
  cp -a "$work/stage$prefix/." "$prefix/"
  chmod -R a+rX "$prefix"
  echo "$sum" > "$stamp"
  rm -rf "$work"
  exec {lock}>&-
  log "Citus $CITUS_VERSION is in $prefix"
}

# new_citus_cluster DIR BASE: a coordinator (DIR/n0, port BASE) and two workers (n1,
# n2: BASE+1, BASE+2) of PostgreSQL CITUS_MAJOR (use_pg it first), each preloading
# 'citus,pg_quota', with a database app where Citus and pg_quota are created (pg_quota
# on the coordinator, which Citus propagates) and a login role app (created on the
# coordinator once the workers are added, so that Citus propagates it, and with it
# every ALTER ROLE app SET); stopped at exit.
new_citus_cluster() {
  local dir="$1" base="$2" i
  for i in 0 1 2; do new_citus_node "$dir/n$i" $((base + i)); done
  pgq "$dir/n0" "$base" -d app -c "SELECT citus_set_coordinator_host('$dir/n0', $base)" \
    -c "SELECT citus_add_node('$dir/n1', $((base + 1)))" \
    -c "SELECT citus_add_node('$dir/n2', $((base + 2)))" \
    -c "CREATE EXTENSION pg_quota" -c "CREATE ROLE app LOGIN" >/dev/null
}

# new_citus_node DIR PORT: a node for a Citus cluster, preloading 'citus,pg_quota',
# with database app and Citus in it; citus_add_node() makes it a worker.
new_citus_node() {
  local dir="$1" port="$2"
  # citus.local_hostname: a shard move connects to its own node; no TCP here.
  new_cluster "$dir" "$port" "shared_preload_libraries = 'citus,pg_quota'" \
    "wal_level = logical" "output_plugin_libraries = 'pgoutput, test_decoding, citus'" "max_worker_processes = 32" "max_prepared_transactions = 20" \
    "citus.local_hostname = '$dir'" "max_connections = 200"
  pgq "$dir" "$port" -c "CREATE DATABASE app" >/dev/null
  pgq "$dir" "$port" -d app -c "CREATE EXTENSION citus" >/dev/null
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

# start_sampler STOP_TABLE COUNT_SQL: a session of $CL that evaluates COUNT_SQL (a
# query giving one integer) as often as it can and keeps the largest value, until a row
# appears in STOP_TABLE (each statement of a READ COMMITTED DO block sees the latest
# committed state). Run stop_sampler to end it and read its result.
start_sampler() {
  cat > "$CL/sampler.sql" <<SQL
DO \$\$
DECLARE m int := 0; n int; k int := 0;
BEGIN
  WHILE NOT EXISTS (SELECT 1 FROM $1) LOOP
    n := ($2);
    m := greatest(m, n); k := k + 1;
  END LOOP;
  RAISE NOTICE 'max % samples %', m, k;
END \$\$;
SQL
  bg bash -c "'$PG_BIN/psql' -X -At -h '$CL' -p '$PORT' -U postgres -f '$CL/sampler.sql' > '$CL/sampler.out' 2>&1"
  SAMPLER=$LAST_BG
}
# stop_sampler STOP_TABLE: ends start_sampler's session; sets SAMPLED_MAX and SAMPLES.
stop_sampler() {
  sql -c "INSERT INTO $1 VALUES (1)"
  timeout 30 tail --pid="$SAMPLER" -f /dev/null || true
  SAMPLED_MAX=$(sed -n 's/.*max \([0-9]*\) samples \([0-9]*\).*/\1/p' "$CL/sampler.out")
  SAMPLES=$(sed -n 's/.*max \([0-9]*\) samples \([0-9]*\).*/\2/p' "$CL/sampler.out")
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
# open_session NAME USER [DB]: a psql session (in database DB, postgres by default) fed
# through the fifo $CL/NAME.in (write to it with `say NAME SQL`), its output in
# $CL/NAME.out; `close_session NAME` ends it.
open_session() {
  local name="$1" user="$2" db="${3:-postgres}" fd
  rm -f "$CL/$name.out" "$CL/$name.in"; mkfifo -m 666 "$CL/$name.in"
  bg bash -c "exec '$PG_BIN/psql' -X -q -At -v ON_ERROR_STOP=0 -h '$CL' -p '$PORT' -U $user -d '$db' < '$CL/$name.in' > '$CL/$name.out' 2>&1"
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
# follow the primary); sets CLIENT_PIDS. Client K first keeps one ticket open, then runs
# DIR/iter.sql (40 start-finish pairs) at most ROUNDS times, until DIR/stop exists. It
# writes the round under way to DIR/run.K, line-buffered, and appends it to DIR/out.K:
#   I KEY          a start with idempotency key KEY is sent (K.ROUND.N; kept.K)
#   S TICKET       start()/try_start() returned TICKET ("S refused": try_start() returned
#                  NULL, the same admission as start() without an ERROR in the log)
#   K TICKET       the ticket kept open till the end
#   F TICKET t|f   finish() returned (t: it ended the ticket; f: it had ended)
#   R KEY          a start that got no answer, sent again with its key (its S line follows)
#   L X            a retry of X (a key or a ticket) found no primary in 90 s
# \unset first, so that a failed statement leaves nothing of the iteration before. What
# a failover cut off is retried on the next primary, as the guide tells applications
# to (USER_GUIDE "High availability"): a start that got no answer, with its key (the
# ticket if its charge survived, else a new admission), and a ticket received but not
# finished, with finish() (idempotent). So when the clients stop, the role's only
# active tickets are the kept ones: see failover_checks.
failover_load() {
  local dir="$1" conn="$2" clients="$3" rounds="$4" i k
  {
    for i in $(seq 1 40); do
      echo "\\unset t"; echo "\\unset f"
      echo "\\set key :c '.' :r '.$i'"
      echo "\\echo I :key"
      echo "SELECT coalesce(quota.try_start('load', idempotency_key => :'key')::text, 'refused') AS t \\gset"
      echo "\\echo S :t"
      echo "SELECT quota.finish(t::uuid) AS f FROM (SELECT :'t' AS t) s WHERE t <> 'refused' \\gset"
      echo "\\echo F :t :f"
    done
  } > "$dir/iter.sql"
  printf '%s\n' "\\set key 'kept.' :c" "\\echo I :key" "SELECT quota.start('kept', idempotency_key => :'key') AS t \\gset" \
    "\\echo S :t" "\\echo K :t" > "$dir/keep.sql"
  CLIENT_PIDS=()
  for k in $(seq 1 "$clients"); do
    bg bash -c "$(declare -f failover_client failover_retry); D='$dir' CONN='$conn' PG_BIN='$PG_BIN' ROUNDS='$rounds' failover_client $k"
    CLIENT_PIDS+=("$LAST_BG")
  done
}
# stop_clients DIR: asks the clients of CLIENT_PIDS to stop (DIR/stop), waits 120 s at
# most (a client may be retrying for 90 s), checks that they stopped by themselves, and
# kills what is left.
stop_clients() {
  local p _
  touch "$1/stop"
  clients_stopped() { for p in "${CLIENT_PIDS[@]}"; do kill -0 "$p" 2>/dev/null && return 1; done; return 0; }
  for _ in $(seq 1 600); do clients_stopped && break; sleep 0.2; done
  check "the clients stopped by themselves" clients_stopped
  for p in "${CLIENT_PIDS[@]}"; do kill -- "-$p" 2>/dev/null || true; done
}
# failover_client K: one client of failover_load (D, CONN, PG_BIN and ROUNDS set).
failover_client() {
  local k="$1" n=0 open what x r
  # stdbuf -oL: a psql that timeout ends still leaves every line it printed.
  until grep -qs '^K [0-9a-f-]\{36\}$' "$D/out.$k"; do
    [ -e "$D/stop" ] && return 0
    timeout 20 stdbuf -oL "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 -v c="$k" "$CONN" -f "$D/keep.sql" \
      > "$D/run.$k" 2>> "$D/err.$k" || sleep 0.1
    cat "$D/run.$k" >> "$D/out.$k"
  done
  while [ ! -e "$D/stop" ] && [ "$n" -lt "$ROUNDS" ]; do
    n=$((n + 1))
    timeout 20 stdbuf -oL "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=0 -v c="$k" -v r="$n" "$CONN" \
      -f "$D/iter.sql" > "$D/run.$k" 2>> "$D/err.$k" || sleep 0.1
    # What the round left open: keys whose start() got no answer, tickets not finished.
    open=$(awk '$1 == "I" { k = $2; p[k] = 1 }
                $1 == "S" && ($2 == "refused" || length($2) == 36) { delete p[k]; if ($2 != "refused") s[$2] = 1 }
                $1 == "F" && ($3 == "t" || $3 == "f") { delete s[$2] }
                END { for (x in p) print "key", x; for (x in s) print "ticket", x }' "$D/run.$k")
    cat "$D/run.$k" >> "$D/out.$k"
    while read -r what x; do
      [ -n "$what" ] || continue
      if [ "$what" = key ]; then
        echo "R $x"
        r=$(failover_retry "SELECT coalesce(quota.try_start('load', idempotency_key => '$x')::text, 'refused')") \
          || { echo "L $x"; continue; }
        echo "S $r"
        [ "$r" != refused ] || continue
        x=$r
      fi
      r=$(failover_retry "SELECT quota.finish('$x')") || r=
      case "$r" in t|f) echo "F $x $r" ;; *) echo "L $x" ;; esac
    done <<< "$open" >> "$D/out.$k"
  done
}
# failover_retry SQL: runs SQL (one value) on CONN until it answers, 90 s at most (as
# long as the tests give a failover).
failover_retry() {
  local r i=$((SECONDS + 90))
  while [ "$SECONDS" -lt "$i" ]; do
    r=$(timeout 5 "$PG_BIN/psql" -X -q -At "$CONN" -c "$1" 2>> "$D/err.$k") && [ -n "$r" ] && { echo "$r"; return 0; }
    sleep 0.2
  done
  return 1
}
# load_received DIR: the tickets the clients of DIR received so far, one per line, sorted.
# grep reads each file apart: a line a client is writing is not yet whole, and run
# through cat it would swallow the first line of the next file. run.K before out.K: a
# client appends run.K to out.K before it empties run.K, so no line is missed between.
load_received() { grep -Eho '^S [0-9a-f-]{36}$' "$1"/run.* "$1"/out.* 2>/dev/null | cut -c3- | sort -u; }

# failover_checks DIR WHERE: after stop_clients, on the primary that sql, as and state
# reach (WHERE names it in the checks): every ticket the clients of DIR received is in
# the ledger, no acknowledged finish is active again, nothing was given up, the role's
# only active tickets are the kept ones (nothing a failover cut off stays charged),
# summary and usage equal the ledger, the limit is exact, the kept tickets can be
# finished, and start() works.
failover_checks() {
  local dir="$1" where="$2" active kept ids
  load_received "$dir" > "$dir/received"
  grep -Eho '^F [0-9a-f-]{36} t$' "$dir"/out.* | cut -c3-38 | sort -u > "$dir/finished"
  grep -Eho '^K [0-9a-f-]{36}$' "$dir"/out.* | cut -c3- | sort -u > "$dir/kept"
  sql -c "SELECT id FROM quota.ledger" | sort > "$dir/in_ledger"
  sql -c "SELECT id FROM quota.ledger WHERE role = 't1'::regrole AND ended_at IS NULL" | sort > "$dir/active"
  echo "# $(wc -l < "$dir/received") tickets received in all, $(wc -l < "$dir/finished") finishes acknowledged, $(cat "$dir"/out.* | grep -c '^I [0-9]' || true) starts sent, $(cat "$dir"/out.* | grep -c '^R ' || true) of them sent again with their key"
  expect_eq "every ticket received at all is in the ledger on $where" 0 "$(comm -23 "$dir/received" "$dir/in_ledger" | wc -l)"
  expect_eq "no acknowledged finish is active again" 0 "$(comm -12 "$dir/finished" "$dir/active" | wc -l)"
  expect_eq "every start and finish a failover cut off was retried on the next primary (none given up)" 0 \
    "$(cat "$dir"/out.* | grep -c '^L ' || true)"
  expect_eq "nothing a failover cut off stays charged: t1's active tickets are the $CLIENTS kept ones" \
    "$CLIENTS kept, 0 other" \
    "$(wc -l < "$dir/kept") kept, $(comm -13 "$dir/kept" "$dir/active" | wc -l) other"
  check "quota.summary equals the ledger" summary_matches_ledger
  expect_eq "quota.usage counts what the ledger holds" \
    "$(sql -c "SELECT count(*) FILTER (WHERE ended_at IS NULL) || '|' || count(*) FROM quota.ledger WHERE role = 't1'::regrole")" \
    "$(sql -c "SELECT active || '|' || retained FROM quota.usage WHERE role = 't1'::regrole")"
  active=$(wc -l < "$dir/active")
  echo "# t1 holds $active active tickets of $LIMIT on $where"
  expect_eq "the limit is exact: $LIMIT - $active more are admitted" $((LIMIT - active)) \
    "$(as t1 postgres "SELECT count(quota.try_start('fill')) FROM generate_series(1, $((LIMIT - active)) + 3)")"
  expect_eq "... and the next start() is refused with 53400" 53400 "$(state t1 postgres "SELECT quota.start('over')")"
  kept=$(wc -l < "$dir/kept")
  ids=$(sed "s/.*/'&'/" "$dir/kept" | paste -sd,)
  expect_eq "the $CLIENTS tickets kept open since the start can be finished on $where" \
    "$CLIENTS $(yes true | head -n "$CLIENTS" | paste -sd' ')" \
    "$kept $(as t1 postgres "SELECT string_agg(quota.finish(id)::text, ' ') FROM unnest(ARRAY[$ids]::uuid[]) id")"
  check "start() works on $where once slots are free" grep -Eq '^[0-9a-f-]{36}$' <<<"$(as t1 postgres "SELECT quota.start('after')")"
  check "quota.summary still equals the ledger" summary_matches_ledger
}

# summary_matches_ledger [DB]: every summary row equals its role's ledger rows, each
# counting its ticket's weight from 0.7.0 (a schema without the column counts 1 each; a
# role without a summary row is counted from the ledger, so a missing row is fine);
# prints the roles that are off.
summary_matches_ledger() {
  local off
  off=$(sql -d "${1:-postgres}" -c "SELECT s.role::regrole || ': summary ' || s.tickets || ', ledger ' || coalesce(l.n, 0)
                  FROM quota.summary s LEFT JOIN (SELECT role, sum(coalesce((pg_catalog.to_jsonb(x) ->> 'weight')::int, 1)) AS n
                                                    FROM quota.ledger x GROUP BY role) l USING (role)
                 WHERE s.tickets IS DISTINCT FROM coalesce(l.n, 0)")
  [ -z "$off" ] || { echo "# $off" | tr '\n' ' '; echo; return 1; }
}

# sql [psql args...] -c ...: runs against the script's cluster, unaligned, no headers.
sql() { pgq "$CL" "$PORT" -At "$@"; }
