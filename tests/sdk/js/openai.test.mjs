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

test("a forced tool call is a valid call and its result round-trips", async () => {
  const parameters = {
    type: "object",
    properties: {
      unit: { type: "string", enum: ["celsius", "fahrenheit"] },
      days: { type: "integer", minimum: 1, maximum: 7 },
    },
    required: ["unit", "days"], additionalProperties: false,
  };
  const tools = [{ type: "function", function: { name: "get_forecast", description: "Weather forecast", parameters } }];
  const asked = [{ role: "user", content: "Forecast for Paris?" }];
  const checkArguments = (text) => {
    const args = JSON.parse(text);
    assert.deepEqual(Object.keys(args).sort(), ["days", "unit"], text);
    assert.ok(["celsius", "fahrenheit"].includes(args.unit), text);
    assert.ok(Number.isInteger(args.days) && args.days >= 1 && args.days <= 7, text);
  };
  const reply = await client.chat.completions.create({
    model, messages: asked, tools, max_tokens: 400, temperature: 0,
    tool_choice: { type: "function", function: { name: "get_forecast" } },
  });
  const choice = reply.choices[0];
  assert.equal(choice.finish_reason, "tool_calls");
  assert.equal(choice.message.tool_calls.length, 1);
  const call = choice.message.tool_calls[0];
  assert.equal(call.function.name, "get_forecast");
  checkArguments(call.function.arguments);

  const stream = await client.chat.completions.create({
    model, messages: asked, tools, max_tokens: 400, temperature: 0, tool_choice: "required", stream: true,
  });
  let name = null;
  let args = "";
  let finish = null;
  for await (const chunk of stream) {
    for (const delta of chunk.choices[0]?.delta?.tool_calls ?? []) {
      name = delta.function?.name ?? name;
      args += delta.function?.arguments ?? "";
    }
    finish = chunk.choices[0]?.finish_reason ?? finish;
  }
  assert.equal(name, "get_forecast");
  assert.equal(finish, "tool_calls");
  checkArguments(args);

  const answer = await client.chat.completions.create({
    model, tools, max_tokens: 8, temperature: 0,
    messages: [...asked, choice.message, { role: "tool", tool_call_id: call.id, content: "sunny, 21 C" }],
  });
  assert.equal(answer.choices[0].message.role, "assistant");
  assert.ok(answer.usage.completion_tokens > 0);
  assert.ok(answer.usage.prompt_tokens > reply.usage.prompt_tokens);
});

// The Responses API (what Codex speaks): a schema ends the random model's answer, so the stream
// helper gets its response.completed.
test("responses: whole, streamed and raw events agree", async () => {
  const params = {
    model, input: "Pick a colour.", instructions: "You are terse.", max_output_tokens: 400, temperature: 0,
    text: { format: { type: "json_schema", name: "colour", strict: true, schema: {
      type: "object", properties: { colour: { enum: ["red", "green"] } },
      required: ["colour"], additionalProperties: false } } },
  };
  const whole = await client.responses.create(params);
  assert.equal(whole.status, "completed");
  assert.ok(whole.id.startsWith("resp_"));
  assert.ok(["red", "green"].includes(JSON.parse(whole.output_text).colour), whole.output_text);
  assert.equal(whole.usage.total_tokens, whole.usage.input_tokens + whole.usage.output_tokens);
  assert.equal(whole.usage.output_tokens_details.reasoning_tokens, 0);

  const stream = client.responses.stream(params);
  let text = "";
  stream.on("response.output_text.delta", (event) => { text += event.delta; });
  const final = await stream.finalResponse();
  assert.equal(text, whole.output_text);
  // The stream helper's final response has no `output_text` (only `create` adds it).
  const finalText = final.output.filter((item) => item.type === "message")
    .flatMap((item) => item.content).map((part) => part.text).join("");
  assert.equal(finalText, whole.output_text);
  assert.equal(final.usage.output_tokens, whole.usage.output_tokens);

  const raw = await client.responses.create({ ...params, stream: true });
  const types = [];
  for await (const event of raw) types.push(event.type);
  assert.deepEqual(types.slice(0, 2), ["response.created", "response.in_progress"]);
  assert.equal(types.at(-1), "response.completed");
});

test("responses: a forced function call and its output on the next turn", async () => {
  const parameters = {
    type: "object",
    properties: {
      unit: { type: "string", enum: ["celsius", "fahrenheit"] },
      days: { type: "integer", minimum: 1, maximum: 7 },
    },
    required: ["unit", "days"], additionalProperties: false,
  };
  const tools = [
    { type: "function", name: "get_forecast", description: "Weather forecast", parameters, strict: true },
    { type: "web_search" },
  ];
  const checkArguments = (text) => {
    const args = JSON.parse(text);
    assert.ok(["celsius", "fahrenheit"].includes(args.unit), text);
    assert.ok(Number.isInteger(args.days) && args.days >= 1 && args.days <= 7, text);
  };
  const params = { model, input: "Forecast for Paris?", tools, max_output_tokens: 400, temperature: 0 };
  const reply = await client.responses.create({ ...params, tool_choice: { type: "function", name: "get_forecast" } });
  const calls = reply.output.filter((item) => item.type === "function_call");
  assert.equal(calls.length, 1);
  assert.equal(calls[0].name, "get_forecast");
  checkArguments(calls[0].arguments);

  const stream = client.responses.stream({ ...params, tool_choice: "required" });
  const final = await stream.finalResponse();
  const streamed = final.output.find((item) => item.type === "function_call");
  assert.equal(streamed.name, "get_forecast");
  checkArguments(streamed.arguments);

  // The whole history sent back, as Codex does (store: false).
  const answer = await client.responses.create({
    model, tools, max_output_tokens: 8, temperature: 0, store: false,
    input: [{ role: "user", content: "Forecast for Paris?" }, ...reply.output,
            { type: "function_call_output", call_id: calls[0].call_id, output: "sunny, 21 C" }],
  });
  assert.ok(answer.usage.output_tokens > 0);
  assert.ok(answer.usage.input_tokens > reply.usage.input_tokens);
  await assert.rejects(
    client.responses.create({ model, input: "hi", previous_response_id: "resp_unknown" }),
    (error) => error instanceof OpenAI.BadRequestError && error.code === "previous_response_not_found",
  );
});
