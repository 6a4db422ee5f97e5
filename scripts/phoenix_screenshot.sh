#!/usr/bin/env bash
# A screenshot of one real tierserve trace in Arize Phoenix's UI (docs/observability.md shows it).
#
#   scripts/phoenix_screenshot.sh [OUT.png]        default: docs/images/phoenix-trace.png
#
# Needs Phoenix in .cache/apm-venv (`make test-apm` installs it) and a Chromium (`apt-get install -y
# chromium` on Debian; CHROMIUM=... names another binary). Starts Phoenix (fresh working dir, free ports)
# and `tierserve serve --mock 1` exporting its traces to it, sends one streamed chat completion, waits
# until Phoenix has the worker's spans, opens the trace's page in headless Chromium and saves it.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-docs/images/phoenix-trace.png}
PY=.venv/bin/python
PHOENIX=${PHOENIX:-.cache/apm-venv/bin/phoenix}
CHROMIUM=${CHROMIUM:-chromium}
PROJECT=tierserve
WINDOW=${WINDOW:-1400,860}
MAX_BYTES=300000

[[ -x $PHOENIX ]] || { echo "error: $PHOENIX not found; \`make test-apm\` installs Phoenix" >&2; exit 1; }
command -v "$CHROMIUM" >/dev/null || { echo "error: $CHROMIUM not found (apt-get install -y chromium)" >&2; exit 1; }

work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# wait_for SECONDS WHAT COMMAND...: poll COMMAND until it succeeds, or fail naming WHAT.
wait_for() {
    local deadline=$((SECONDS + $1)) what=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS > deadline)); then
            echo "error: $what not after $1 s; logs in $work:" >&2
            tail -n 20 "$work"/*.log >&2
            exit 1
        fi
        sleep 0.5
    done
}

phoenix_port=$(free_port)
phoenix="http://127.0.0.1:$phoenix_port"
PHOENIX_HOST=127.0.0.1 PHOENIX_PORT=$phoenix_port PHOENIX_GRPC_PORT=$(free_port) \
    PHOENIX_WORKING_DIR="$work/phoenix" setsid "$PHOENIX" serve >"$work/phoenix.log" 2>&1 &
pids+=($!)
wait_for 180 "Phoenix on $phoenix" curl -sf "$phoenix/healthz"

serve_port=$(free_port)
tierserve="http://127.0.0.1:$serve_port"
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="$phoenix/v1/traces" OTEL_METRICS_EXPORTER=none OTEL_BSP_SCHEDULE_DELAY=100 \
    OTEL_SERVICE_NAME=tierserve OTEL_RESOURCE_ATTRIBUTES="openinference.project.name=$PROJECT" \
    setsid "$PY" -m tierserve serve --mock 1 --host 127.0.0.1 --port "$serve_port" >"$work/serve.log" 2>&1 &
pids+=($!)
wait_for 120 "tierserve on $tierserve" curl -sf "$tierserve/ready"

curl -sf "$tierserve/v1/chat/completions" -H 'content-type: application/json' -H 'x-sla-tier: interactive' \
    -d '{"model": "mock", "messages": [{"role": "user", "content": "What is paged attention?"}],
         "max_tokens": 150, "stream": true, "ignore_eos": true}' >/dev/null

# The trace id of the completion, once Phoenix holds the worker's side of it too.
trace_id() {
    curl -sf "$phoenix/v1/projects/$PROJECT/spans?limit=100" | "$PY" -c '
import json, sys
spans = json.load(sys.stdin)["data"]
names = {s["name"] for s in spans}
roots = [s["context"]["trace_id"] for s in spans if s["name"].startswith("POST ")]
assert roots and {"tierserve.worker.request", "tierserve.worker.finish"} <= names
print(roots[0])'
}
wait_for 60 "the trace in Phoenix" trace_id
trace=$(trace_id)
project_id=$(curl -sf "$phoenix/v1/projects" | "$PY" -c "
import json, sys
print(next(p['id'] for p in json.load(sys.stdin)['data'] if p['name'] == '$PROJECT'))")

url="$phoenix/projects/$project_id/traces/$trace"
echo "screenshot of $url"
mkdir -p "$(dirname "$OUT")"
# The UI is a single-page app: the virtual time budget lets it fetch and draw the trace first.
"$CHROMIUM" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size="$WINDOW" \
    --virtual-time-budget=15000 --screenshot="$OUT" "$url" >"$work/chromium.log" 2>&1
size=$(stat -c %s "$OUT")
echo "$OUT: $size bytes"
((size <= MAX_BYTES)) || { echo "error: $OUT is over $MAX_BYTES bytes; try a smaller WINDOW" >&2; exit 1; }
