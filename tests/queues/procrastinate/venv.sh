# procrastinate and its dependencies, pinned, in a venv of Debian's python3 (3.11):
# shared by tests/scripts/queue_procrastinate.sh and `scripts/bench --queue`, so that
# the test and the benchmark run the same versions from the same cache. Source it after
# scripts/lib.sh (it uses log and apt_install), then call procrastinate_venv.
#
# The venv lives in PQ_CACHE (default /var/cache/pg_quota-tests), outside the
# repository, and is reused when present: it is built once, under a lock, and marked
# complete only when pip has installed every pin; a venv built with other pins is
# built again.
PQ_VERSION=3.10.0
# Exactly what pip resolves for procrastinate 3.10.0 + psycopg[binary] 3.3.9 on 3.11.
PQ_PINS=(procrastinate==3.10.0 "psycopg[binary]==3.3.9" psycopg-binary==3.3.9 psycopg-pool==3.3.3
         asgiref==3.13.0 attrs==26.1.0 croniter==7.0.0 packaging==26.4 python-dateutil==4.0.0
         typing_extensions==4.16.0 tzdata==2026.6)
PQ_CACHE="${PQ_CACHE:-/var/cache/pg_quota-tests}"
PQ_VENV="$PQ_CACHE/procrastinate-$PQ_VERSION-py3.11"

# procrastinate_venv: installs the pinned venv into PQ_VENV unless it is complete; its
# interpreter is then $PQ_VENV/bin/python.
procrastinate_venv() {
  [ -x /usr/bin/python3 ] || apt_install python3 >&2
  /usr/bin/python3 -c 'import ensurepip, venv' 2>/dev/null || apt_install python3-venv >&2
  mkdir -p "$PQ_CACHE"
  local lock
  exec {lock}> "$PQ_CACHE/.procrastinate.lock"
  flock "$lock"  # one install at a time; none while another run installs
  # Built again when its pins changed (the marker holds the pins it was built with).
  if ! printf '%s\n' "${PQ_PINS[@]}" | cmp -s - "$PQ_VENV/.complete"; then
    log "installing procrastinate $PQ_VERSION into $PQ_VENV"
    rm -rf "$PQ_VENV"
    /usr/bin/python3 -m venv "$PQ_VENV" >&2
    "$PQ_VENV/bin/pip" install -q --no-input "${PQ_PINS[@]}" >&2
    printf '%s\n' "${PQ_PINS[@]}" > "$PQ_VENV/.complete"
  fi
  exec {lock}>&-
}
