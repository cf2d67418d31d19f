//! `POST /v1/responses` in-process: on the tiny Qwen3 fixture (random weights, Qwen3's JSON
//! calls) the whole answer against the stream (same items, same usage), the event order, forced
//! function / namespace / custom calls and their round trip, `text.format`, the store behind
//! `previous_response_id`, tools and items the server cannot use, and a prompt over the context;
//! on the Qwen3.6 release fixture (its real template: thinking opened in the prompt, XML calls)
//! reasoning items, their events and their round trip through `encrypted_content`. Also the
//! Codex model metadata of `GET /v1/models`. Reference: OpenAI API reference (Responses).

mod common;

use std::path::PathBuf;

use axum::http::StatusCode;
use common::*;
use serde_json::{json, Value};

/// Room for the grammar's whitespace (up to 32 characters a gap) that the random model loves.
const MAX_TOKENS: usize = 400;

/// Fixture-tokenizer ids of '"' and '}': the random model rarely closes a string on its own.
fn close_bias() -> Value {
    json!({"1": 10, "92": 10})
}

fn body(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "input": "Hello there", "max_output_tokens": 8,
                          "temperature": 0});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

async fn respond(app: &axum::Router, body: &Value) -> Value {
    let reply = post(app, "/v1/responses", body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    reply.json()
}

/// The events of a streamed response, checked: SSE names equal `type`, sequence numbers count
/// from 0, the lifecycle opens with created / in_progress and ends with exactly one final event.
async fn stream(app: &axum::Router, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let reply = post(app, "/v1/responses", &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let events: Vec<Value> = sse(&reply.text)
        .into_iter()
        .map(|(name, data)| {
            assert_eq!(name.as_deref(), data["type"].as_str(), "{data}");
            data
        })
        .collect();
    for (n, event) in events.iter().enumerate() {
        assert_eq!(event["sequence_number"], n, "{event}");
    }
    assert_eq!(kind(&events[0]), "response.created");
    assert_eq!(kind(&events[1]), "response.in_progress");
    let finals = [
        "response.completed",
        "response.incomplete",
        "response.failed",
    ];
    let last = kind(events.last().unwrap());
    assert!(finals.contains(&last), "{last}");
    assert_eq!(
        events.iter().filter(|e| finals.contains(&kind(e))).count(),
        1
    );
    events
}

fn kind(event: &Value) -> &str {
    event["type"].as_str().unwrap()
}

/// The final response of a stream.
fn last_response(events: &[Value]) -> &Value {
    &events.last().unwrap()["response"]
}

/// Items of both answers without their generated ids (and the usage without cache reuse).
fn comparable(response: &Value) -> Value {
    let mut response = response.clone();
    for key in ["id", "created_at", "timings"] {
        response.as_object_mut().unwrap().remove(key);
    }
    for item in response["output"].as_array_mut().unwrap() {
        for key in ["id", "call_id"] {
            item.as_object_mut().unwrap().remove(key);
        }
    }
    response["usage"]["input_tokens_details"]["cached_tokens"] = json!(null);
    response
}

#[tokio::test]
async fn whole_and_streamed_answers_agree_and_events_come_in_order() {
    let (app, _) = router(config());
    let request = body(
        json!({"instructions": "Be terse.", "metadata": {"run": "1"},
        "prompt_cache_key": "conversation-1", "client_metadata": {"x": 1}, "user": "u",
        "truncation": "auto", "service_tier": "auto", "unknown_field": [1, 2]}),
    );
    let whole = respond(&app, &request).await;
    assert!(whole["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(whole["object"], "response");
    assert_eq!(whole["model"], MODEL);
    assert_eq!(
        (&whole["status"], &whole["incomplete_details"]["reason"]),
        (&json!("incomplete"), &json!("max_output_tokens"))
    );
    let output = whole["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{whole}");
    let message = &output[0];
    assert_eq!(
        (&message["type"], &message["role"], &message["status"]),
        (&json!("message"), &json!("assistant"), &json!("incomplete"))
    );
    assert!(message["id"].as_str().unwrap().starts_with("msg_"));
    let text = message["content"][0]["text"].as_str().unwrap();
    assert!(!text.is_empty());
    assert_eq!(message["content"][0]["type"], "output_text");
    assert_eq!(message["content"][0]["annotations"], json!([]));
    let usage = &whole["usage"];
    assert_eq!(usage["output_tokens"], 8);
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["input_tokens"].as_u64().unwrap() + 8
    );
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 0);
    assert!(whole["timings"]["ttft_ms"].as_f64().unwrap() > 0.0);
    // The request's parameters, echoed (top_p, unset, is the fixture's recommendation).
    for (key, value) in [
        ("instructions", json!("Be terse.")),
        ("temperature", json!(0.0)),
        ("top_p", json!(0.95)),
        ("max_output_tokens", json!(8)),
        ("tool_choice", json!("auto")),
        ("tools", json!([])),
        ("parallel_tool_calls", json!(true)),
        ("store", json!(true)),
        ("metadata", json!({"run": "1"})),
        ("prompt_cache_key", json!("conversation-1")),
        ("truncation", json!("auto")),
        ("user", json!("u")),
        ("text", json!({"format": {"type": "text"}})),
    ] {
        assert_eq!(whole[key], value, "{key}");
    }

    let events = stream(&app, &request).await;
    let names: Vec<&str> = events.iter().map(kind).collect();
    let deltas = names
        .iter()
        .filter(|n| **n == "response.output_text.delta")
        .count();
    assert!(deltas >= 1);
    let mut expected = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    expected.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    expected.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]);
    assert_eq!(names, expected);
    assert_eq!(events[0]["response"]["status"], "in_progress");
    assert_eq!(events[0]["response"]["output"], json!([]));
    let streamed: String = events.iter().filter_map(|e| e["delta"].as_str()).collect();
    assert_eq!(streamed, text);
    let done = events
        .iter()
        .find(|e| kind(e) == "response.output_text.done");
    assert_eq!(done.unwrap()["text"], text);
    let item_id = &events[2]["item"]["id"];
    assert!(events[2..events.len() - 1]
        .iter()
        .all(|e| e.get("item_id").is_none_or(|id| id == item_id)));
    // The same response as the whole one; the stream's prompt came from the prefix cache.
    let last = last_response(&events);
    assert_eq!(comparable(last), comparable(&whole));
    assert_eq!(
        last["usage"]["input_tokens_details"]["cached_tokens"],
        whole["usage"]["input_tokens"].as_u64().unwrap() - 1
    );
}

fn forecast_tool() -> Value {
    json!({"type": "function", "name": "get_forecast", "description": "Weather forecast",
        "parameters": {"type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["unit", "days"], "additionalProperties": false}})
}

fn assert_forecast(arguments: &str) {
    let arguments: Value = serde_json::from_str(arguments).unwrap();
    assert!(["celsius", "fahrenheit"].contains(&arguments["unit"].as_str().unwrap()));
    assert!((1..=7).contains(&arguments["days"].as_i64().unwrap()));
}

#[tokio::test]
async fn a_forced_function_call_streams_whole_and_round_trips() {
    let (app, _) = router(config());
    let request = body(
        json!({"input": "Forecast for Paris?", "max_output_tokens": MAX_TOKENS,
        "tools": [forecast_tool(), {"type": "web_search"}, {"type": "image_generation"},
                  {"type": "tool_search", "execution": "client"}],
        "tool_choice": {"type": "function", "name": "get_forecast"}}),
    );
    let whole = respond(&app, &request).await;
    assert_eq!(whole["status"], "completed", "{whole}");
    let output = whole["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{whole}");
    let call = &output[0];
    assert_eq!(
        (&call["type"], &call["name"], &call["status"]),
        (
            &json!("function_call"),
            &json!("get_forecast"),
            &json!("completed")
        )
    );
    assert!(call["id"].as_str().unwrap().starts_with("fc_"));
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    assert!(call.get("namespace").is_none());
    assert_forecast(call["arguments"].as_str().unwrap());
    // The built-in tools are dropped, yet echoed as sent.
    assert_eq!(whole["tools"].as_array().unwrap().len(), 4);

    let events = stream(&app, &request).await;
    let names: Vec<&str> = events.iter().map(kind).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    assert_eq!(events[2]["item"]["arguments"], "");
    assert_eq!(events[3]["delta"], call["arguments"]);
    assert_eq!(events[4]["arguments"], call["arguments"]);
    assert_eq!(events[4]["name"], "get_forecast");
    assert_eq!(comparable(last_response(&events)), comparable(&whole));

    // The call and its output come back as items; the next turn sees them.
    let next = body(json!({"max_output_tokens": 4, "tools": [forecast_tool()],
        "input": [{"role": "user", "content": "Forecast for Paris?"}, call.clone(),
                  {"type": "function_call_output", "call_id": call["call_id"],
                   "output": "sunny, 21 C"}]}));
    let answer = respond(&app, &next).await;
    assert!(
        answer["usage"]["input_tokens"].as_u64() > whole["usage"]["input_tokens"].as_u64(),
        "{answer}"
    );
}

#[tokio::test]
async fn namespace_and_custom_tools_map_back_to_their_names() {
    let (app, _) = router(config());
    let tools = json!([
        {"type": "namespace", "name": "weather", "description": "Weather tools",
         "tools": [forecast_tool()]},
        {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    ]);
    let request = body(
        json!({"input": "Forecast for Paris?", "max_output_tokens": MAX_TOKENS,
        "tools": tools, "tool_choice": {"type": "function", "name": "get_forecast",
                                        "namespace": "weather"}}),
    );
    let whole = respond(&app, &request).await;
    let call = &whole["output"][0];
    assert_eq!(
        (&call["type"], &call["name"], &call["namespace"]),
        (
            &json!("function_call"),
            &json!("get_forecast"),
            &json!("weather")
        ),
        "{whole}"
    );
    assert_forecast(call["arguments"].as_str().unwrap());

    // A freeform tool: the model writes `{"input": "..."}`, the client gets the text.
    let request = body(
        json!({"input": "Fix the typo.", "max_output_tokens": MAX_TOKENS,
        "tools": tools, "tool_choice": {"type": "custom", "name": "apply_patch"},
        "logit_bias": close_bias()}),
    );
    let whole = respond(&app, &request).await;
    assert_eq!(whole["status"], "completed", "{whole}");
    let call = &whole["output"][0];
    assert_eq!(
        (&call["type"], &call["name"]),
        (&json!("custom_tool_call"), &json!("apply_patch")),
        "{whole}"
    );
    assert!(call["id"].as_str().unwrap().starts_with("ctc_"));
    assert!(call["input"].is_string());
    let events = stream(&app, &request).await;
    let names: Vec<&str> = events.iter().map(kind).collect();
    assert_eq!(
        &names[2..6],
        [
            "response.output_item.added",
            "response.custom_tool_call_input.delta",
            "response.custom_tool_call_input.done",
            "response.output_item.done"
        ]
    );
    assert_eq!(events[4]["input"], call["input"]);
    assert_eq!(comparable(last_response(&events)), comparable(&whole));

    // Both calls render back into the next prompt under the names the model saw.
    let history = json!([
        {"role": "user", "content": "Fix the typo."},
        {"type": "function_call", "call_id": "c1", "name": "get_forecast", "namespace": "weather",
         "arguments": "{\"unit\": \"celsius\", \"days\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        call.clone(),
        {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "patched"},
    ]);
    let next = respond(&app, &body(json!({"input": history, "tools": tools}))).await;
    assert_eq!(next["status"], "incomplete");
}

#[tokio::test]
async fn text_format_json_schema_is_enforced() {
    let (app, _) = router(config());
    let schema = json!({"type": "object", "properties": {"colour": {"enum": ["red", "green"]}},
                        "required": ["colour"], "additionalProperties": false});
    let request = body(
        json!({"input": "Pick a colour.", "max_output_tokens": MAX_TOKENS,
        "text": {"format": {"type": "json_schema", "name": "colour", "schema": schema,
                            "strict": true}}}),
    );
    let whole = respond(&app, &request).await;
    assert_eq!(whole["status"], "completed", "{whole}");
    let text = whole["output"][0]["content"][0]["text"].as_str().unwrap();
    let value: Value = serde_json::from_str(text).unwrap();
    assert!(["red", "green"].contains(&value["colour"].as_str().unwrap()));
    assert_eq!(whole["text"]["format"]["name"], "colour");
    let bad = post(
        &app,
        "/v1/responses",
        &body(json!({"text": {"format": {"type": "yaml"}}})),
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(openai_error(&bad).2.contains("text.format"));
}

#[tokio::test]
async fn previous_response_id_continues_a_stored_conversation() {
    let (app, state) = router(config());
    let first = respond(&app, &body(json!({"instructions": "Be terse."}))).await;
    let id = first["id"].as_str().unwrap();
    assert!(state.responses.get(id).is_some());
    let next = respond(
        &app,
        &body(json!({"previous_response_id": id, "input": "And then?"})),
    )
    .await;
    assert_eq!(next["previous_response_id"], id);
    // The same as sending the whole conversation (instructions are not carried over).
    let mut history = vec![json!({"type": "message", "role": "user", "content": "Hello there"})];
    history.extend(first["output"].as_array().unwrap().iter().cloned());
    history.push(json!({"role": "user", "content": "And then?"}));
    let whole = respond(&app, &body(json!({"input": history, "store": false}))).await;
    assert_eq!(
        next["usage"]["input_tokens"],
        whole["usage"]["input_tokens"]
    );
    assert_eq!(next["output"][0]["content"], whole["output"][0]["content"]);
    // A chain: the next response continues both.
    let third = respond(
        &app,
        &body(json!({"previous_response_id": next["id"], "input": "Again."})),
    )
    .await;
    assert!(third["usage"]["input_tokens"].as_u64() > next["usage"]["input_tokens"].as_u64());

    // Not stored, or never existed: OpenAI's 400.
    for unknown in [whole["id"].as_str().unwrap(), "resp_nope"] {
        let reply = post(
            &app,
            "/v1/responses",
            &body(json!({"previous_response_id": unknown})),
        )
        .await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST);
        let error = &reply.json()["error"];
        assert_eq!(error["code"], "previous_response_not_found");
        assert_eq!(error["param"], "previous_response_id");
        assert_eq!(error["type"], "invalid_request_error");
    }
}

#[tokio::test]
async fn unusable_tools_and_items_are_ignored_and_bad_requests_refused() {
    let (app, _) = router(config());
    let codex_like = body(json!({
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "web_search_call", "status": "completed", "action": {"type": "search"}},
            {"type": "local_shell_call", "call_id": "x", "status": "completed"},
            {"type": "item_reference", "id": "msg_1"},
            {"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
            {"type": "message", "role": "developer", "content": "a reminder"},
            {"type": "message", "role": "user", "content": "go on"},
        ],
        "tools": [{"type": "web_search", "external_web_access": false},
                  {"type": "mcp", "server_label": "x"}, {"type": "local_shell"},
                  {"type": "file_search"}, {"type": "computer_use_preview"},
                  {"type": "namespace", "name": "multi_agent_v1",
                   "tools": [{"type": "function", "name": "spawn_agent"}]}],
        "tool_choice": "auto", "parallel_tool_calls": true, "store": false,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
    }));
    let reply = respond(&app, &codex_like).await;
    assert_eq!(reply["store"], false);
    // An empty input (a probe) is an empty user turn.
    respond(&app, &body(json!({"input": []}))).await;

    let refused = [
        (json!({"input": 5}), "`input`"),
        (json!({"input": [{"content": "x"}]}), "`type`"),
        (
            json!({"input": [{"role": "tool", "content": "x"}]}),
            "unknown message role",
        ),
        (json!({"tools": [{"type": "function"}]}), "`name`"),
        (json!({"tool_choice": "sometimes"}), "`tool_choice`"),
        (json!({"tool_choice": "required"}), "no `tools`"),
        (
            json!({"tool_choice": {"type": "function", "name": "nope"}, "tools": [forecast_tool()]}),
            "nope",
        ),
        (json!({"max_output_tokens": 0}), "at least 1"),
        (json!({"conversation": "conv_1"}), "`conversation`"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAIAAAABCAIAAAB7QOjdAAAADUlEQVR4nGP4zwAE/wEHAAH/4iOeWQAAAABJRU5ErkJggg=="}]}]}),
            "no vision",
        ),
    ];
    for (extra, why) in refused {
        let reply = post(&app, "/v1/responses", &body(extra.clone())).await;
        assert_eq!(
            reply.status,
            StatusCode::BAD_REQUEST,
            "{extra}: {}",
            reply.text
        );
        let (kind, _, message) = openai_error(&reply);
        assert_eq!(kind, "invalid_request_error");
        assert!(message.contains(why), "{extra}: {message}");
    }
    let missing = post(&app, "/v1/responses", &body(json!({"model": "nope"}))).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_prompt_over_the_context_is_a_400_or_a_failed_stream() {
    let (app, _) = router(config());
    let long = body(json!({"input": "word ".repeat(3000)}));
    let reply = post(&app, "/v1/responses", &long).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let (_, code, _) = openai_error(&reply);
    assert_eq!(code, "context_length_exceeded");

    let events = stream(&app, &long).await;
    let names: Vec<&str> = events.iter().map(kind).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.failed"
        ]
    );
    let failed = last_response(&events);
    assert_eq!(failed["status"], "failed");
    assert_eq!(failed["error"]["code"], "context_length_exceeded");
    assert!(failed["error"]["message"]
        .as_str()
        .unwrap()
        .contains("context"));
}

#[tokio::test]
async fn models_carry_codex_metadata() {
    let (app, _) = router(config());
    let list = get(&app, "/v1/models").await.json();
    assert_eq!(list["object"], "list");
    assert_eq!(list["data"][0]["id"], MODEL);
    let model = &list["models"][0];
    assert_eq!(model["slug"], MODEL);
    assert_eq!(model["context_window"], 2048);
    assert_eq!(model["shell_type"], "default");
    // Codex 0.169 refuses any value but `freeform` here (absent: a JSON-function apply_patch).
    assert!(model.get("apply_patch_tool_type").is_none());
    assert_eq!(model["visibility"], "list");
    assert_eq!(model["input_modalities"], json!(["text"]));
    assert_eq!(model["truncation_policy"]["mode"], "bytes");
    let efforts: Vec<&str> = model["supported_reasoning_levels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|level| level["effort"].as_str().unwrap())
        .collect();
    assert_eq!(efforts, ["none", "low", "medium", "high"]);
    assert!(model.get("base_instructions").is_none());
}

// ---- Reasoning, on a release structure whose template opens the think block.

const QWEN36: &str = "qwen3.6-35b-a3b";

fn qwen36() -> (axum::Router, rmlx_server::AppState) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/releases/qwen3.6-35b-a3b");
    router(rmlx_server::ServerConfig {
        models: vec![path],
        ..config()
    })
}

/// A `text.format` answer where the template opened `<think>`: the block is closed first (as
/// for a forced call), so the grammar holds the message the client parses, not reasoning that
/// never ends.
#[tokio::test]
async fn text_format_closes_an_open_think_block_first() {
    let (app, _) = qwen36();
    let schema = json!({"enum": ["red", "green"]});
    let request = json!({"model": QWEN36, "input": "Pick a colour.", "max_output_tokens": 24,
        "temperature": 0, "reasoning": {"effort": "high"},
        "text": {"format": {"type": "json_schema", "name": "colour", "schema": schema}}});
    let whole = respond(&app, &request).await;
    assert_eq!(whole["status"], "completed", "{whole}");
    let message = whole["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|item| item["type"] == "message")
        .unwrap_or_else(|| panic!("no message: {whole}"));
    let text = message["content"][0]["text"].as_str().unwrap();
    let value: Value = serde_json::from_str(text).unwrap();
    assert!(
        ["red", "green"].contains(&value.as_str().unwrap()),
        "{text}"
    );
    assert_eq!(
        whole["usage"]["output_tokens_details"]["reasoning_tokens"],
        0
    );
}

#[tokio::test]
async fn reasoning_items_stream_their_text_and_summary_and_come_back_as_past_reasoning() {
    let (app, _) = qwen36();
    let request = json!({"model": QWEN36, "input": "Think about Paris.", "max_output_tokens": 6,
        "temperature": 0, "reasoning": {"effort": "high", "summary": "auto"},
        "include": ["reasoning.encrypted_content"]});
    let whole = respond(&app, &request).await;
    let item = &whole["output"][0];
    assert_eq!(item["type"], "reasoning", "{whole}");
    assert!(item["id"].as_str().unwrap().starts_with("rs_"));
    let text = item["content"][0]["text"].as_str().unwrap();
    assert!(!text.is_empty());
    assert_eq!(item["content"][0]["type"], "reasoning_text");
    assert_eq!(
        item["summary"][0],
        json!({"type": "summary_text", "text": text})
    );
    assert_eq!(item["encrypted_content"], text);
    // The template opened <think>: every generated token is reasoning.
    assert_eq!(
        whole["usage"]["output_tokens_details"]["reasoning_tokens"],
        6
    );

    let events = stream(&app, &request).await;
    let names: Vec<&str> = events.iter().map(kind).collect();
    let deltas = names
        .iter()
        .filter(|n| **n == "response.reasoning_text.delta")
        .count();
    let mut expected = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_summary_part.added",
    ];
    for _ in 0..deltas {
        expected.extend([
            "response.reasoning_text.delta",
            "response.reasoning_summary_text.delta",
        ]);
    }
    expected.extend([
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]);
    assert_eq!(names, expected);
    assert_eq!(comparable(last_response(&events)), comparable(&whole));
    // Without a summary asked or encrypted content included, neither comes.
    let plain = respond(
        &app,
        &json!({"model": QWEN36, "input": "Think about Paris.", "max_output_tokens": 6,
                "temperature": 0, "reasoning": {"effort": "high"}}),
    )
    .await;
    assert_eq!(plain["output"][0]["summary"], json!([]));
    assert!(plain["output"][0].get("encrypted_content").is_none());
    // `effort: none` turns thinking off: no reasoning.
    let off = respond(
        &app,
        &json!({"model": QWEN36, "input": "Think about Paris.", "max_output_tokens": 6,
                "temperature": 0, "reasoning": {"effort": "none"}}),
    )
    .await;
    assert!(off["output"]
        .as_array()
        .unwrap()
        .iter()
        .all(|item| item["type"] != "reasoning"));
    assert_eq!(off["usage"]["output_tokens_details"]["reasoning_tokens"], 0);
    // The template's own switch, as on chat completions, when no effort is given.
    let kwargs = respond(
        &app,
        &json!({"model": QWEN36, "input": "Think about Paris.", "max_output_tokens": 6,
                "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}}),
    )
    .await;
    let contents = |response: &Value| -> Vec<(Value, Value)> {
        let items = response["output"].as_array().unwrap();
        items
            .iter()
            .map(|item| (item["type"].clone(), item["content"].clone()))
            .collect()
    };
    assert_eq!(contents(&kwargs), contents(&off));

    // Sent back before a call (a turn after the last user message, which the template keeps
    // the reasoning of), the reasoning is rendered: more input tokens than without it.
    let call = json!({"type": "function_call", "call_id": "c1", "name": "lookup",
                      "arguments": "{\"city\": \"Paris\"}"});
    let output = json!({"type": "function_call_output", "call_id": "c1", "output": "sunny"});
    let tools = json!([{"type": "function", "name": "lookup",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let turn = |items: Vec<Value>| {
        json!({"model": QWEN36, "input": items, "max_output_tokens": 1, "temperature": 0,
               "tools": tools, "store": false})
    };
    let user = json!({"role": "user", "content": "Think about Paris."});
    let with = respond(
        &app,
        &turn(vec![
            user.clone(),
            item.clone(),
            call.clone(),
            output.clone(),
        ]),
    )
    .await;
    let without = respond(&app, &turn(vec![user, call, output])).await;
    let (with, without) = (
        with["usage"]["input_tokens"].as_u64().unwrap(),
        without["usage"]["input_tokens"].as_u64().unwrap(),
    );
    assert!(with > without + 3, "{with} vs {without}");
}

#[tokio::test]
async fn xml_format_forced_calls_work_through_the_responses_route() {
    let (app, _) = qwen36();
    let request = json!({"model": QWEN36, "input": "Forecast for Paris?",
        "max_output_tokens": MAX_TOKENS, "temperature": 0, "tools": [forecast_tool()],
        "tool_choice": "required", "reasoning": {"effort": "high"}});
    let whole = respond(&app, &request).await;
    let calls: Vec<&Value> = whole["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "function_call")
        .collect();
    assert_eq!(calls.len(), 1, "{whole}");
    assert_eq!(calls[0]["name"], "get_forecast");
    assert_forecast(calls[0]["arguments"].as_str().unwrap());
    let events = stream(&app, &request).await;
    assert_eq!(comparable(last_response(&events)), comparable(&whole));
}

/// A finite patch language in Lark (rules, `|`, `?`, regex terminals, an imported terminal):
/// the random model always ends it, and a check written here reads what it wrote.
const PATCH_GRAMMAR: &str = r#"start: "*** Begin Patch" LF op "*** End Patch"
op: "*** Delete File: " PATH LF | "*** Add File: " PATH LF ("+" LINE LF)?
PATH: /[a-z]{1,8}\.txt/
LINE: /[a-z ]{0,12}/
%import common.LF
"#;

fn is_patch(input: &str) -> bool {
    let path = |p: &str| {
        p.strip_suffix(".txt").is_some_and(|stem| {
            (1..=8).contains(&stem.len()) && stem.bytes().all(|b| b.is_ascii_lowercase())
        })
    };
    let Some(body) = input
        .strip_prefix("*** Begin Patch\n")
        .and_then(|rest| rest.strip_suffix("*** End Patch"))
    else {
        return false;
    };
    let lines: Vec<&str> = body.split_terminator('\n').collect();
    match lines.as_slice() {
        [op] => {
            op.strip_prefix("*** Delete File: ").is_some_and(path)
                || op.strip_prefix("*** Add File: ").is_some_and(path)
        }
        [op, added] => {
            op.strip_prefix("*** Add File: ").is_some_and(path)
                && added.strip_prefix('+').is_some_and(|line| {
                    line.len() <= 12 && line.bytes().all(|b| b == b' ' || b.is_ascii_lowercase())
                })
        }
        _ => false,
    }
}

/// A forced freeform call: on an XML-format model (Qwen3.6) the prompt opens the call up to the
/// raw input and the tool's grammar (Lark, or a regex) holds the input; on Qwen3's JSON format
/// the input is a JSON string held to the grammar's regex. Whole and streamed, the call comes
/// back as the client's `custom_tool_call` with the input's text. A grammar that does not
/// compile is a 400 naming the tool.
#[tokio::test]
async fn a_freeform_tool_grammar_holds_its_input() {
    let (xml, _) = qwen36();
    let (json_format, _) = router(config());
    for (app, model) in [(&xml, QWEN36), (&json_format, MODEL)] {
        freeform_inputs_follow_their_grammar(app, model).await;
    }
    let app = xml;
    let bad = json!([{"type": "custom", "name": "apply_patch",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: ("}}]);
    let request = json!({"model": QWEN36, "input": "x", "tools": bad,
        "tool_choice": {"type": "custom", "name": "apply_patch"}});
    let reply = post(&app, "/v1/responses", &request).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text);
    let body: Value = reply.json();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("grammar of custom tool `apply_patch` does not compile"),
        "{message}"
    );
}

async fn freeform_inputs_follow_their_grammar(app: &axum::Router, model: &str) {
    let cases: [(&str, &str, InputCheck); 2] = [
        ("lark", PATCH_GRAMMAR, &is_patch),
        ("regex", "[0-9]{2,4}-[a-z]{3}", &|input: &str| {
            let (digits, letters) = input.split_once('-').unwrap_or_default();
            (2..=4).contains(&digits.len())
                && digits.bytes().all(|b| b.is_ascii_digit())
                && letters.len() == 3
                && letters.bytes().all(|b| b.is_ascii_lowercase())
        }),
    ];
    for (syntax, definition, valid) in cases {
        for seed in [1, 2] {
            let tools = json!([forecast_tool(),
                {"type": "custom", "name": "apply_patch", "description": "Edit files",
                 "format": {"type": "grammar", "syntax": syntax, "definition": definition}}]);
            let request = json!({"model": model, "input": "Delete a file.",
                "max_output_tokens": MAX_TOKENS, "temperature": 1.0, "seed": seed,
                "tools": tools, "tool_choice": {"type": "custom", "name": "apply_patch"},
                "reasoning": {"effort": "none"}});
            let whole = respond(app, &request).await;
            assert_eq!(whole["status"], "completed", "{whole}");
            let call = &whole["output"][0];
            assert_eq!(call["type"], "custom_tool_call", "{whole}");
            let input = call["input"].as_str().unwrap();
            eprintln!("{model} {syntax} seed {seed}: {input:?}");
            assert!(
                valid(input),
                "{model} {syntax}: {input:?} is outside the grammar"
            );
            let events = stream(app, &request).await;
            assert_eq!(comparable(last_response(&events)), comparable(&whole));
        }
    }
}

/// Whether a tool's input is in its grammar (written out by hand for each test grammar).
type InputCheck<'a> = &'a dyn Fn(&str) -> bool;
