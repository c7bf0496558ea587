// artlike from TypeScript with the official `openai` package: register a trainable model, run rollouts
// through trajectory URLs (only `baseURL` changes), read what was recorded, post rewards and train one
// step, reading the NDJSON stream line by line. The HTTP contract is ../README.md.
//
//   cd client/typescript && npm install && npm run build
//   ARTLIKE_SERVER=http://127.0.0.1:8000 ARTLIKE_BASE_MODEL=HuggingFaceTB/SmolLM2-135M-Instruct npm start
//
// ARTLIKE_API_KEY is sent as a bearer token when set; ARTLIKE_MODEL names the trainable model.
import { randomBytes } from "node:crypto";
import OpenAI from "openai";

const server = process.env.ARTLIKE_SERVER ?? "http://127.0.0.1:8000";
const baseModel = process.env.ARTLIKE_BASE_MODEL ?? "HuggingFaceTB/SmolLM2-135M-Instruct";
const name = process.env.ARTLIKE_MODEL ?? "typescript-demo";
const apiKey = process.env.ARTLIKE_API_KEY ?? "";
const headers: Record<string, string> = { "Content-Type": "application/json" };
if (apiKey) headers.Authorization = `Bearer ${apiKey}`;

/** An artlike route; a 4xx/5xx answer is {"error": {"message", "type", "param", "code"}}: thrown. */
async function api(path: string, body?: unknown): Promise<any> {
  const response = await fetch(`${server}${path}`, {
    method: body === undefined ? "GET" : "POST", headers, body: JSON.stringify(body),
  });
  const payload = await response.json();
  if (!response.ok) throw new Error(`${path}: ${response.status} ${JSON.stringify(payload.error)}`);
  return payload;
}

async function rollout(): Promise<{ trajectory_id: string; reward: number }> {
  // A trajectory id is any [A-Za-z0-9_-] string you pick; it travels in the URL.
  const id = randomBytes(16).toString("hex");
  const client = new OpenAI({ baseURL: `${server}/t/${id}/v1`, apiKey: apiKey || "unused" });
  const completion = await client.chat.completions.create({
    model: name, temperature: 1.0, max_tokens: 16,
    messages: [{ role: "user", content: "Describe the sea in a few words." }],
  });
  const answer = completion.choices[0].message.content ?? "";
  const reward = answer.length / 64; // any reward works; here longer answers score higher
  console.error(`  ${id} reward=${reward.toFixed(3)} ${answer.replace(/\n/g, " ")}`);
  return { trajectory_id: id, reward };
}

async function main(): Promise<void> {
  console.error("# 1. Register the model (idempotent)");
  const info = await api("/v1/trainable_models", { name, base_model: baseModel, lora: { rank: 8 } });
  console.error(`  ${info.name} latest_step=${info.latest_step}`);

  console.error("# 2. Four rollouts through trajectory URLs");
  const trajectories = await Promise.all([rollout(), rollout(), rollout(), rollout()]);

  console.error("# 3. What the server recorded for the first trajectory (token-exact)");
  const record = await api(`/v1/trajectories/${trajectories[0].trajectory_id}`);
  for (const c of record.completions) {
    console.error(`  ${c.served_model} prompt_tokens=${c.prompt_token_ids.length} output_tokens=${c.output_token_ids.length}`);
  }

  console.error("# 4. Train one step: an NDJSON stream, one event per line");
  const response = await fetch(`${server}/_train_model`, {
    method: "POST", headers,
    body: JSON.stringify({ model: name, groups: [{ trajectories }], config: { learning_rate: 1e-5 } }),
  });
  if (!response.ok || !response.body) throw new Error(`/_train_model: ${response.status} ${await response.text()}`);
  let last: any = null;
  let buffer = "";
  const decoder = new TextDecoder();
  for await (const bytes of response.body) {
    buffer += decoder.decode(bytes, { stream: true });
    let newline: number;
    while ((newline = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, newline).trim();
      buffer = buffer.slice(newline + 1);
      if (!line) continue;
      last = JSON.parse(line);
      console.log(line);
    }
  }
  // The last line says how it went: `done` (the new step is served) or `error` (the previous step is).
  if (last?.type !== "done") throw new Error(`training failed: ${JSON.stringify(last)}`);
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
