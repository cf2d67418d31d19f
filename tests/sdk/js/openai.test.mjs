// The official TypeScript `openai` SDK, unmodified, against a real `rmlx serve` on loopback.
// RMLX_URL (e.g. http://127.0.0.1:8123/v1), RMLX_MODEL and RMLX_API_KEY come from the runner.
import { test } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";

const baseURL = process.env.RMLX_URL;
const model = process.env.RMLX_MODEL;
const client = new OpenAI({ baseURL, apiKey: process.env.RMLX_API_KEY ?? "unused", maxRetries: 0 });
const messages = [{ role: "user", content: "What is the capital of France?" }];

test("streaming equals non-streaming at temperature 0", async () => {
  const whole = await client.chat.completions.create({ model, messages, temperature: 0, max_tokens: 24 });
  const stream = await client.chat.completions.create({
    model, messages, temperature: 0, max_tokens: 24, stream: true, stream_options: { include_usage: true },
  });
  let text = "";
  let usage = null;
  for await (const chunk of stream) {
    text += chunk.choices[0]?.delta?.content ?? "";
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(text, whole.choices[0].message.content);
  assert.deepEqual(usage.completion_tokens, whole.usage.completion_tokens);
  assert.equal(whole.usage.total_tokens, whole.usage.prompt_tokens + whole.usage.completion_tokens);
});

test("models are listed", async () => {
  const models = [];
  for await (const entry of client.models.list()) models.push(entry.id);
  assert.ok(models.includes(model), JSON.stringify(models));
});

test("errors are the SDK's typed exceptions", async () => {
  await assert.rejects(
    client.chat.completions.create({ model: "no-such-model", messages }),
    (error) => error instanceof OpenAI.NotFoundError,
  );
  await assert.rejects(
    client.chat.completions.create({ model, messages: [{ role: "user", content: "x ".repeat(5000) }] }),
    (error) => error instanceof OpenAI.BadRequestError,
  );
});

test("json_schema output is valid JSON of that schema", async () => {
  const reply = await client.chat.completions.create({
    model, messages: [{ role: "user", content: "Pick a colour." }], max_tokens: 400, temperature: 0,
    response_format: { type: "json_schema", json_schema: { name: "colour", schema: {
      type: "object", properties: { colour: { enum: ["red", "green"] } },
      required: ["colour"], additionalProperties: false } } },
  });
  assert.equal(reply.choices[0].finish_reason, "stop");
  const value = JSON.parse(reply.choices[0].message.content);
  assert.ok(["red", "green"].includes(value.colour), JSON.stringify(value));
});
