#!/usr/bin/env bash
# The artlike HTTP API with nothing but curl and jq: register a model, run rollouts through trajectory
# URLs, look at what was recorded, post rewards, train one step and read the NDJSON stream.
#
#   ARTLIKE_SERVER=http://127.0.0.1:8000 ARTLIKE_BASE_MODEL=HuggingFaceTB/SmolLM2-135M-Instruct \
#     bash client/curl_examples.sh
#
# ARTLIKE_API_KEY is sent as a bearer token when set. ARTLIKE_MODEL names the trainable model.
set -euo pipefail

server=${ARTLIKE_SERVER:-http://127.0.0.1:8000}
base_model=${ARTLIKE_BASE_MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}
name=${ARTLIKE_MODEL:-curl-demo}
headers=(-H "Content-Type: application/json")
if [ -n "${ARTLIKE_API_KEY:-}" ]; then headers+=(-H "Authorization: Bearer $ARTLIKE_API_KEY"); fi
# Errors come back as {"error": {"message", "type", "param", "code"}} with a 4xx/5xx status: show the
# body and stop. (--fail-with-body needs curl >= 7.76.)
api() {
  local body
  body=$(curl -sS --fail-with-body "${headers[@]}" "$@") || { echo "artlike API error: $body" >&2; return 1; }
  printf '%s\n' "$body"
}

echo "# 1. Register the model (idempotent; a different LoRA config under the same name is a 409)" >&2
api "$server/v1/trainable_models" \
  -d "$(jq -n --arg name "$name" --arg base "$base_model" '{name: $name, base_model: $base, lora: {rank: 8}}')" |
  jq -c '{name, latest_step, served_name}' >&2

echo "# 2. Four rollouts. A trajectory id is any [A-Za-z0-9_-] string you pick; it travels in the URL." >&2
trajectories='[]'
for _ in 1 2 3 4; do
  id=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
  answer=$(api "$server/t/$id/v1/chat/completions" -d "$(jq -n --arg model "$name" '{
      model: $model, temperature: 1.0, max_tokens: 16,
      messages: [{role: "user", content: "Describe the sea in a few words."}]}')" |
    jq -r '.choices[0].message.content')
  # Any reward works: code, a grader, a judge, a human. Here: longer answers score higher.
  reward=$(jq -n --arg answer "$answer" '$answer | length / 64')
  echo "  $id  reward=$reward  ${answer//$'\n'/ }" >&2
  trajectories=$(jq -c --arg id "$id" --argjson reward "$reward" \
    '. + [{trajectory_id: $id, reward: $reward, metrics: {chars: ($reward * 64)}}]' <<<"$trajectories")
done

echo "# 3. What the server recorded for the last trajectory (token-exact)" >&2
api "$server/v1/trajectories/$id" |
  jq -c '.completions[] | {served_model, step, finish_reason, prompt_tokens: (.prompt_token_ids | length),
                           output_tokens: (.output_token_ids | length)}' >&2

echo "# 4. Train one step on the group: NDJSON, one event per line (-N: no buffering)" >&2
stream=$(mktemp)
trap 'rm -f "$stream"' EXIT
curl -sS -N --fail-with-body "${headers[@]}" "$server/_train_model" \
  -d "$(jq -nc --arg model "$name" --argjson trajectories "$trajectories" \
        '{model: $model, groups: [{trajectories: $trajectories}], config: {learning_rate: 1e-5}}')" |
  tee "$stream" | jq --unbuffered -c .

# The stream's last line says how it went: `done` (the new step is served) or `error` (the previous
# step stays served). An HTTP error before the stream started already failed `api` above.
if ! tail -n 1 "$stream" | jq -e '.type == "done"' >/dev/null; then
  echo "training failed: $(tail -n 1 "$stream")" >&2
  exit 1
fi
