#!/usr/bin/env bash
# The orchestrator's HTTP API with curl.   bash client/curl_examples.sh [http://127.0.0.1:8000]
set -euo pipefail
URL=${1:-${PETALS_CHAIN_URL:-http://127.0.0.1:8000}}
MODEL=$(curl -sf "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "model: $MODEL"

echo "--- completion"
curl -sf "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"The quick brown fox\", \"max_tokens\": 16, \"temperature\": 0}"
echo

echo "--- chat completion, streamed (server-sent events)"
curl -sfN "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 8, \"stream\": true}"

echo "--- multi-turn session"
SID=$(curl -sf -X POST "$URL/api/v1/sessions" -H 'Content-Type: application/json' -d '{"max_length": 128}' \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["session_id"])')
curl -sf "$URL/api/v1/sessions/$SID/generate" -H 'Content-Type: application/json' -d '{"prompt": "Hello! My name is Bob.", "max_tokens": 8}'
echo
curl -sf "$URL/api/v1/sessions/$SID/generate" -H 'Content-Type: application/json' -d '{"prompt": " What is my name?", "max_tokens": 8}'
echo
curl -sf -X DELETE "$URL/api/v1/sessions/$SID"
echo

echo "--- swarm state and health"
curl -sf "$URL/api/v1/swarm" | python3 -c 'import json,sys; s=json.load(sys.stdin); print("ready:", s["ready"], "c:", s["c"], "chains:", len(s["chains"]), "queue:", s["queue_length"])'
curl -sf "$URL/healthz"
echo

echo "--- a bad request gets a 4xx in OpenAI's error format"
curl -s -w "\nHTTP %{http_code}\n" "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"hi\", \"temperature\": 9}"
