#!/usr/bin/env bash
# Load-test `eaglekv serve` with guidellm (PyPI), in guidellm's default mode: streaming
# /v1/chat/completions, synthetic prompts, offline (no model hub), the model's own tokenizer.
#
# Usage:  bench/guidellm.sh [OUT_JSON] [-- EXTRA_SERVE_ARGS...]
#   OUT_JSON          guidellm's JSON report (default bench/results/guidellm_cpu.json)
#   EXTRA_SERVE_ARGS  appended to `eaglekv serve`, e.g. -- --spec eagle --draft default
# Knobs (environment):
#   MODEL=default            model for the server and the tokenizer (as `eaglekv serve --model`)
#   SERVED_NAME=smollm2      --served-model-name, also the `model` guidellm sends
#   PORT=                    server port on 127.0.0.1 (default: a free one)
#   GL_STREAMS=4             concurrent streams (profile kind=concurrent)
#   GL_PROMPT_TOKENS=128     synthetic prompt length (guidellm counts it with the tokenizer;
#                            the chat template adds ~30 tokens on the server)
#   GL_OUTPUT_TOKENS=32      max_completion_tokens with ignore_eos=true
#   GL_SECONDS=120           max_duration constraint (in-flight requests then count as incomplete)
#   GL_MAX_REQUESTS=         optional max_requests constraint
#   GL_MAX_ERRORS=20         stop early when the server rejects requests
#   GL_PROFILE=, GL_DATA=    override the whole --profile / --data argument strings
#   GL_WORKERS=1             guidellm worker processes (GUIDELLM__MAX_WORKER_PROCESSES); 1 keeps
#                            the client light on this 2-core machine, async within the process
#   GUIDELLM_VERSION=0.8.1   version installed into .venv-guidellm when it is missing
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

OUT=bench/results/guidellm_cpu.json
if [[ $# -gt 0 && $1 != "--" ]]; then OUT=$1; shift; fi
if [[ $# -gt 0 && $1 == "--" ]]; then shift; fi
SERVE_EXTRA=("$@")

MODEL=${MODEL:-default}
SERVED_NAME=${SERVED_NAME:-smollm2}
GL_STREAMS=${GL_STREAMS:-4}
GL_PROMPT_TOKENS=${GL_PROMPT_TOKENS:-128}
GL_OUTPUT_TOKENS=${GL_OUTPUT_TOKENS:-32}
GL_SECONDS=${GL_SECONDS:-120}
GL_MAX_REQUESTS=${GL_MAX_REQUESTS:-}
GL_MAX_ERRORS=${GL_MAX_ERRORS:-20}
GL_PROFILE=${GL_PROFILE:-kind=concurrent,streams=$GL_STREAMS}
GL_DATA=${GL_DATA:-kind=synthetic_text,prompt_tokens=$GL_PROMPT_TOKENS,output_tokens=$GL_OUTPUT_TOKENS}
GL_WORKERS=${GL_WORKERS:-1}
GUIDELLM_VERSION=${GUIDELLM_VERSION:-0.8.1}
GL_VENV=$ROOT/.venv-guidellm
PY=${PYTHON:-python3}

# Nothing may come from a model hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export GUIDELLM__MAX_WORKER_PROCESSES=$GL_WORKERS

log() { printf '[guidellm.sh] %s\n' "$*" >&2; }

# ---- (a) guidellm's own venv, apart from the project's .venv -------------------------------
if [[ ! -x $GL_VENV/bin/guidellm ]]; then
    log "creating $GL_VENV with guidellm==$GUIDELLM_VERSION (several minutes, ~6 GB with torch)"
    "$PY" -m venv "$GL_VENV"
    "$GL_VENV/bin/pip" install -q --upgrade pip
    "$GL_VENV/bin/pip" install -q "guidellm==$GUIDELLM_VERSION"
fi
GL_INSTALLED=$("$GL_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("guidellm"))')
[[ $GL_INSTALLED == "$GUIDELLM_VERSION" ]] ||
    log "warning: .venv-guidellm has guidellm $GL_INSTALLED, not $GUIDELLM_VERSION (request shapes may differ)"

# The project's venv (server + tokenizer export).
[[ -f .venv/.installed ]] || make venv

# ---- (b) the model's tokenizer, saved where guidellm can load it offline ---------------------
TOK_DIR=${TOK_DIR:-${TMPDIR:-/tmp}/eaglekv-guidellm-tok/$(printf '%s' "$MODEL" | sha1sum | cut -c1-12)}
.venv/bin/python bench/guidellm_tokenizer.py "$TOK_DIR" --model "$MODEL" >/dev/null
log "tokenizer: $TOK_DIR"

# ---- (c) the server, in the background on a free loopback port -------------------------------
PORT=${PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
BASE=http://127.0.0.1:$PORT
SERVER_LOG=${TMPDIR:-/tmp}/eaglekv-guidellm-server.$PORT.log
SERVE_CMD=(.venv/bin/eaglekv serve --model "$MODEL" --host 127.0.0.1 --port "$PORT"
           --served-model-name "$SERVED_NAME" "${SERVE_EXTRA[@]}")
SERVER_PID= GL_PID=

stop_group() {  # stop_group PID: TERM its process group (own session via setsid), then KILL
    local pid=$1 i
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
}
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    stop_group "$GL_PID"
    stop_group "$SERVER_PID"
    [[ -n $SERVER_PID ]] && wait "$SERVER_PID" 2>/dev/null || true
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

log "starting: ${SERVE_CMD[*]}  (log $SERVER_LOG)"
setsid "${SERVE_CMD[@]}" >"$SERVER_LOG" 2>&1 &
SERVER_PID=$!
T0=$(date +%s)
until curl -sf -o /dev/null "$BASE/health"; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        log "server exited during startup:"; tail -n 30 "$SERVER_LOG" >&2; exit 1
    fi
    if (( $(date +%s) - T0 > 300 )); then log "server not healthy after 300 s"; exit 1; fi
    sleep 1
done
log "server healthy after $(( $(date +%s) - T0 )) s"
# one short request so first-call warm-up is not in the measurement (its result is not judged)
curl -s -o /dev/null -H 'Content-Type: application/json' "$BASE/v1/chat/completions" \
    -d "{\"model\":\"$SERVED_NAME\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":4}" || true

# ---- (d) guidellm ----------------------------------------------------------------------------
mkdir -p "$(dirname "$OUT")"
rm -f "$OUT"
DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
GIT_REV=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD -- eaglekv 2>/dev/null || GIT_REV="$GIT_REV+dirty"
GL_CMD=("$GL_VENV/bin/guidellm" run
        --backend "kind=openai_http,target=$BASE,model=$SERVED_NAME"
        --profile "$GL_PROFILE"
        --data "$GL_DATA"
        --tokenizer "kind=huggingface_auto,model=$TOK_DIR"
        --constraint "kind=max_duration,seconds=$GL_SECONDS"
        --constraint "kind=max_errors,count=$GL_MAX_ERRORS")
[[ -n $GL_MAX_REQUESTS ]] && GL_CMD+=(--constraint "kind=max_requests,count=$GL_MAX_REQUESTS")
GL_CMD+=(--output "kind=json,path=$OUT"
         --label "date=$DATE" --label "eaglekv_git=$GIT_REV"
         --disable-progress)
log "running: ${GL_CMD[*]}"
setsid timeout -k 30 $(( GL_SECONDS + 300 )) "${GL_CMD[@]}" &
GL_PID=$!
GL_RC=0
wait "$GL_PID" || GL_RC=$?
GL_PID=
END=$(date -u +%Y-%m-%dT%H:%M:%SZ)

# ---- (e) stop the server ---------------------------------------------------------------------
stop_group "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=

if [[ ! -s $OUT ]]; then log "guidellm exited $GL_RC and wrote no $OUT"; exit 1; fi

# ---- (f) summary -----------------------------------------------------------------------------
export GL_SUM_OUT=$OUT GL_SUM_DATE=$DATE GL_SUM_END=$END GL_SUM_GIT=$GIT_REV GL_SUM_RC=$GL_RC
shquote() {  # quote only the words that need it (commas and '=' stay readable)
    local a out=()
    for a in "$@"; do
        if [[ $a =~ ^[A-Za-z0-9_./=:,@+%-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
    done
    printf '%s' "${out[*]}"
}
ENV_PREFIX="HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GUIDELLM__MAX_WORKER_PROCESSES=$GL_WORKERS"
export GL_SUM_SERVE="${PYTHONPATH:+PYTHONPATH=$PYTHONPATH }$(shquote "${SERVE_CMD[@]}")"
export GL_SUM_CMD="$ENV_PREFIX $(shquote "${GL_CMD[@]}")"
"$GL_VENV/bin/python" - <<'EOF'
import json, os

E = os.environ
report = json.load(open(E["GL_SUM_OUT"]))
print("=" * 78)
print(f"guidellm {report['metadata'].get('guidellm_version')} vs eaglekv {E['GL_SUM_GIT']}  "
      f"started {E['GL_SUM_DATE']}  ended {E['GL_SUM_END']}  (guidellm exit {E['GL_SUM_RC']})")
print(f"server:   {E['GL_SUM_SERVE']}")
print(f"guidellm: {E['GL_SUM_CMD']}")
print(f"report:   {E['GL_SUM_OUT']}")


def stat(metric, group="successful"):
    s = (metric or {}).get(group) or {}
    if not s.get("count"):
        return "n/a"
    p = s.get("percentiles") or {}
    return f"mean {s['mean']:.1f}  p50 {s['median']:.1f}  p95 {p.get('p95', float('nan')):.1f}"


for b in report["benchmarks"]:
    m, dur = b["metrics"], b.get("duration") or 0.0
    tot = m["request_totals"]
    name = b.get("config", {}).get("strategy", {}).get("type_", "")
    streams = b.get("config", {}).get("strategy", {}).get("streams", "")
    out_tok = ((m["output_token_count"].get("successful") or {}).get("total_sum") or 0.0)
    in_tok = ((m["prompt_token_count"].get("successful") or {}).get("total_sum") or 0.0)
    print("-" * 78)
    print(f"benchmark {name} {streams}: duration {dur:.1f} s")
    print(f"  requests: completed {tot['successful']}  errored {tot['errored']}  "
          f"incomplete {tot['incomplete']}  (total {tot['total']})")
    if dur:
        print(f"  throughput (completed): {tot['successful'] / dur:.3f} req/s  "
              f"{out_tok / dur:.1f} output tok/s  {in_tok / dur:.1f} prompt tok/s")
    print(f"  output tok/s (guidellm, all requests): {stat(m['output_tokens_per_second'], 'total')}")
    print(f"  prompt / output tokens per request:    {stat(m['prompt_token_count'])} / "
          f"{stat(m['output_token_count'])}")
    print(f"  TTFT ms:    {stat(m['time_to_first_token_ms'])}")
    print(f"  ITL ms:     {stat(m['inter_token_latency_ms'])}")
    print(f"  TPOT ms:    {stat(m['time_per_output_token_ms'])}")
    print(f"  latency s:  {stat(m['request_latency'])}")
    errs = [r.get("info", {}).get("error") for r in (b.get("requests") or {}).get("errored") or []]
    errs = [e for e in errs if e]
    if errs:
        print(f"  first error: {errs[0][:300]}")
print("=" * 78)
EOF
exit "$GL_RC"
