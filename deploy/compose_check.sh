#!/usr/bin/env bash
# Build and run the compose stack (compose.yaml) and check it as a user would:
# the image builds, a key is added, both gateways answer a chat with it over the
# OpenAI API, every Prometheus target is up and a documented metric is stored
# under its documented name. Prints one line per check; exit 0 when all passed,
# 1 when one failed, 2 when there is no Docker engine or compose to run it on.
#
#   deploy/compose_check.sh            # build, run, check, then tear down
#   KEEP=1 deploy/compose_check.sh     # leave the stack running afterwards
#
# The stack runs under its own project name (orcapod-check), so a stack of
# yours started with plain `docker compose up` is not touched; its volumes are
# removed at the end unless KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=${PROJECT:-orcapod-check}
START_TIMEOUT_S=${START_TIMEOUT_S:-600}  # a first start prepares the model and compiles

if docker compose version >/dev/null 2>&1; then
    compose=(docker compose -p "$PROJECT")
elif command -v docker-compose >/dev/null 2>&1; then
    compose=(docker-compose -p "$PROJECT")
else
    echo "skipped: neither 'docker compose' nor 'docker-compose' is installed" >&2
    exit 2
fi
if ! docker info >/dev/null 2>&1; then
    echo "skipped: no Docker engine answers (docker info failed)" >&2
    exit 2
fi

failures=0
check() {  # check NAME COMMAND...: run it, print ok/FAILED with the name
    local name=$1
    shift
    if "$@"; then
        echo "ok      $name"
    else
        echo "FAILED  $name"
        failures=$((failures + 1))
    fi
}

teardown() {
    if [ "${KEEP:-0}" != 1 ]; then
        "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
    fi
}
trap teardown EXIT

wait_for() {  # wait_for URL: until it answers 200, or START_TIMEOUT_S passes
    local deadline=$((SECONDS + START_TIMEOUT_S))
    until curl -fsS -o /dev/null "$1"; do
        [ $SECONDS -lt $deadline ] || return 1
        sleep 2
    done
}

chat() {  # chat PORT: one OpenAI chat completion with the key; its reply non-empty
    local reply
    reply=$(curl -fsS "http://127.0.0.1:$1/v1/chat/completions" \
        -H "Authorization: Bearer $key" -H "Content-Type: application/json" \
        -d '{"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}') \
        || return 1
    python3 -c 'import json, sys; r = json.load(sys.stdin); assert r["choices"][0]["message"]["content"], r' \
        <<<"$reply"
}

targets_up() {  # every Prometheus target (scheduler, worker, two gateways) up
    local deadline=$((SECONDS + 60))
    until curl -fsS http://127.0.0.1:9090/api/v1/targets | python3 -c '
import json, sys
targets = json.load(sys.stdin)["data"]["activeTargets"]
sys.exit(0 if len(targets) == 4 and all(t["health"] == "up" for t in targets) else 1)'; do
        [ $SECONDS -lt $deadline ] || return 1
        sleep 2
    done
}

stored_by_name() {  # a documented series, queried by its documented name
    curl -fsS http://127.0.0.1:9090/api/v1/query --data-urlencode \
        'query=sum(orcapod_request_success_total)' | python3 -c '
import json, sys
result = json.load(sys.stdin)["data"]["result"]
sys.exit(0 if result and float(result[0]["value"][1]) >= 2 else 1)'
}

check "image builds (docker compose build)" "${compose[@]}" build --quiet
check "stack starts (docker compose up -d)" "${compose[@]}" up -d --quiet-pull
key=$("${compose[@]}" run --rm -T scheduler orcapod tenants add-key --tenant compose-check \
    | grep -Eo '[A-Za-z0-9_-]{32,}' | tail -n 1 || true)
check "a key is added (orcapod tenants add-key)" test -n "$key"
check "gateway-0 ready (:8000/healthz)" wait_for http://127.0.0.1:8000/healthz
check "gateway-1 ready (:8001/healthz)" wait_for http://127.0.0.1:8001/healthz
check "gateway-0 answers a chat with the key" chat 8000
check "gateway-1 answers a chat with the key" chat 8001
check "Prometheus: 4 of 4 targets up" targets_up
sleep 6  # one more scrape after the chats
check "Prometheus stores orcapod_request_success_total by its documented name" stored_by_name

if [ "$failures" -gt 0 ]; then
    echo "$failures check(s) failed; logs: ${compose[*]} logs" >&2
    exit 1
fi
echo "all checks passed"
