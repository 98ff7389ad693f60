# Shared by tests/scripts/prometheus_exporter.sh and monitoring_scale.sh (not a suite:
# scripts/test runs *.sh only): our own prometheus-postgres-exporter, run as the role
# exporter against database postgres of the script's cluster, and its scrapes. Source
# it after scripts/lib.sh; it needs CL, PORT and EXPORTER_PORT.
EXPORTER=/usr/bin/prometheus-postgres-exporter
PY=/usr/bin/python3  # Debian's, which has python3-prometheus-client (not a pyenv one)
HELPER="$ROOT/tests/scripts/prometheus_scrape.py"

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# start_exporter FILE TAG: our own exporter with that queries file, as role exporter,
# nothing but the file's metrics; its log in $CL/exporter.TAG.log. Stopped at exit (bg).
start_exporter() {
  bg env DATA_SOURCE_NAME="host=$CL port=$PORT user=exporter dbname=postgres sslmode=disable" \
    "$EXPORTER" --extend.query-path="$1" --web.listen-address="127.0.0.1:$EXPORTER_PORT" \
    --disable-default-metrics --disable-settings-metrics --no-auto-discover-databases \
    --no-collector.database --no-collector.bgwriter > "$CL/exporter.$2.log" 2>&1
  EXPORTER_PID=$LAST_BG
}
stop_exporter() {
  kill -- "-$EXPORTER_PID" 2>/dev/null || true
  timeout 10 tail --pid="$EXPORTER_PID" -f /dev/null || true
}
# scrape TAG: GET /metrics; $CL/raw.TAG is the text, $CL/scrape.TAG the helper's lines.
scrape() {
  "$PY" "$HELPER" scrape "http://127.0.0.1:$EXPORTER_PORT/metrics" "$CL/raw.$1" > "$CL/scrape.$1"
}
