#!/usr/bin/env bash
# The image, checked end to end in one command: build it (unless
# SKIP_BUILD=1), run it as the README says, wait for its healthcheck, ask
# both probes and one request of each default model, then stop it and check
# that it drained and exited 0 within its stop timeout. Prints what it saw;
# exits non-zero at the first thing that is wrong.
#
# Settings (environment), besides build.sh's:
#   PORT           the host port (default 17733)
#   STOP_TIMEOUT   the container's stop timeout, above drain_timeout (default 45)
#   MODELS_VOLUME  the models volume (default berth-smoke-models; kept, so a
#                  second run starts without fetching)
#   CA_BUNDLE      also mounted into the container for pip's first-start
#                  fetch (PIP_CERT), when set (default: $SSL_CERT_FILE)
set -euo pipefail
cd "$(dirname "$0")/../.."
engine=${ENGINE:-$(command -v podman || command -v docker || true)}
[ -n "$engine" ] || { echo "smoke.sh: neither podman nor docker is installed" >&2; exit 1; }
image=${IMAGE:-berth}
port=${PORT:-17733}
stop_timeout=${STOP_TIMEOUT:-45}
volume=${MODELS_VOLUME:-berth-smoke-models}
token=smoke-$RANDOM$RANDOM
name=berth-smoke-$$
ca_bundle=${CA_BUNDLE:-${SSL_CERT_FILE:-}}
say() { printf 'smoke: %s\n' "$*"; }
fail() { say "FAILED: $*"; "$engine" logs "$name" 2>&1 | tail -20 | sed 's/^/  log: /'; exit 1; }
trap '"$engine" rm -f "$name" >/dev/null 2>&1 || true' EXIT

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  started=$(date +%s)
  deploy/container/build.sh
  say "built $image in $(( $(date +%s) - started )) s"
fi
say "image: $("$engine" image inspect "$image" --format '{{.Size}}' | awk '{printf "%.0f MB", $1/1e6}')"
health=$("$engine" image inspect "$image" --format '{{json .Config.Healthcheck}}')
case "$health" in *berth*health*) say "healthcheck: present";; *) fail "the image has no HEALTHCHECK ($health)";; esac

. deploy/container/limits.sh
run_flags=(--detach --name "$name" -p "127.0.0.1:$port:7733" --stop-timeout "$stop_timeout"
           -e "BERTH_TOKEN=$token" -v "$volume:/var/lib/berth/models")
host_runtime run_flags
host_limits run_flags
if [ -n "$ca_bundle" ] && [ -s "$ca_bundle" ]; then
  run_flags+=(-v "$ca_bundle:/etc/berth/ca.crt:ro" -e PIP_CERT=/etc/berth/ca.crt)
fi
started=$(date +%s)
"$engine" run "${run_flags[@]}" "$image" >/dev/null
say "started container $name (first start fetches the default models if the volume lacks them)"

# The healthcheck runs `berth health --ready` inside; wait for it.
for _ in $(seq 1 120); do
  status=$("$engine" inspect "$name" --format '{{.State.Health.Status}}' 2>/dev/null || echo gone)
  [ "$status" = healthy ] && break
  [ "$status" = gone ] && fail "the container exited"
  "$engine" healthcheck run "$name" >/dev/null 2>&1 || true
  sleep 2
done
[ "$status" = healthy ] || fail "not healthy after 240 s (status: $status)"
say "healthy after $(( $(date +%s) - started )) s"

url=http://127.0.0.1:$port
for probe in healthz readyz; do
  code=$(curl -s -o /dev/null -w '%{http_code}' "$url/$probe")
  [ "$code" = 200 ] || fail "/$probe answered $code"
  say "/$probe: 200"
done
code=$(curl -s -o /dev/null -w '%{http_code}' "$url/api/ps")
[ "$code" = 401 ] || fail "/api/ps without the token answered $code, not 401"
say "/api/ps without the token: 401"
auth=(-H "Authorization: Bearer $token" -H 'Content-Type: application/json')
dim=$(curl -s "${auth[@]}" "$url/v1/embeddings" -d '{"model":"minilm","input":"a ship in its berth"}' \
      | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["data"][0]["embedding"]))')
[ "$dim" = 384 ] || fail "minilm answered a vector of $dim numbers"
say "minilm: a 384-number embedding"
text=$(curl -s "${auth[@]}" "$url/v1/chat/completions" \
       -d '{"model":"smollm2","messages":[{"role":"user","content":"What is 2 + 3?"}],"max_tokens":16}' \
       | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])')
[ -n "$text" ] || fail "smollm2 answered no text"
say "smollm2: $(printf '%s' "$text" | tr '\n' ' ' | cut -c1-60)"
workers=$(curl -s "${auth[@]}" "$url/api/ps" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["models"]))')
say "workers loaded: $workers"

# A chat still running when the stop comes: SIGTERM drains it, so it is
# answered whole (an engine's default 10 s stop timeout would cut it).
out=$(mktemp -d)
curl -s "${auth[@]}" "$url/v1/chat/completions" -o "$out/drain.json" -w '%{http_code}' \
  -d '{"model":"smollm2","messages":[{"role":"user","content":"Tell a long story about ships."}],"max_tokens":256}' \
  > "$out/drain.code" &
chat=$!
sleep 1
started=$(date +%s.%N)
"$engine" stop -t "$stop_timeout" "$name" >/dev/null
took=$(python3 -c "print(f'{$(date +%s.%N) - $started:.1f}')")
code=$("$engine" inspect "$name" --format '{{.State.ExitCode}}')
[ "$code" = 0 ] || fail "exit status $code after SIGTERM (killed, or the drain failed)"
python3 -c "import sys; sys.exit(0 if $took < $stop_timeout else 1)" || fail "the stop took $took s"
"$engine" logs "$name" 2>&1 | grep -q "unloaded \`" || fail "no unload report in the log"
wait "$chat" || true
[ "$(cat "$out/drain.code")" = 200 ] || fail "the chat in flight at the stop got $(cat "$out/drain.code")"
tokens=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["usage"]["completion_tokens"])' "$out/drain.json")
rm -rf "$out"
say "the chat in flight when the stop came was answered whole: $tokens tokens"
say "stopped in $took s (limit $stop_timeout s), exit status 0, unload reports in the log"
say "all good"
