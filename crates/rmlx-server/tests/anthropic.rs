//! Anthropic routes in-process: message shape, the native stream's event order, streaming
//! against non-streaming, count_tokens against the engine's prompt tokens, typed errors, and
//! requests as Claude Code sends them (system messages in `messages[]`, beta query string and
//! headers, fields and blocks the server ignores, images in tool results, "prompt is too long").

mod common;

use std::path::PathBuf;

use axum::http::{Method, StatusCode};
use base64::Engine as _;
use common::*;
use rmlx_server::ServerConfig;
use serde_json::{json, Value};

fn message(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "max_tokens": 8, "temperature": 0,
                          "system": "You are terse.",
                          "messages": [{"role": "user", "content": "Hello there"}]});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

fn text_of(body: &Value) -> String {
    body["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|block| block["text"].as_str())
        .collect()
}

#[tokio::test]
async fn message_shape_and_usage() {
    let (app, _) = router(config());
    let reply = post(&app, "/v1/messages", &message(json!({}))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let body = reply.json();
    assert_eq!(
        (body["type"].clone(), body["role"].clone()),
        (json!("message"), json!("assistant"))
    );
    assert!(body["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(body["content"][0]["type"], "text");
    assert_eq!(body["stop_reason"], "max_tokens");
    assert_eq!(body["usage"]["output_tokens"], 8);
    assert!(body["usage"]["input_tokens"].as_u64().unwrap() > 5);
}

#[tokio::test]
async fn stream_event_order_and_equality() {
    let (app, _) = router(config());
    let whole = post(&app, "/v1/messages", &message(json!({"max_tokens": 12})))
        .await
        .json();
    let reply = post(
        &app,
        "/v1/messages",
        &message(json!({"max_tokens": 12, "stream": true})),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let events = sse(&reply.text);
    let names: Vec<&str> = events
        .iter()
        .map(|(name, _)| name.as_deref().unwrap())
        .collect();
    let n = names.len();
    assert_eq!(names[..3], ["message_start", "content_block_start", "ping"]);
    assert!(names[3..n - 3]
        .iter()
        .all(|name| *name == "content_block_delta"));
    assert_eq!(
        names[n - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    for (name, data) in &events {
        assert_eq!(
            data["type"],
            name.as_deref().unwrap(),
            "data.type names the event"
        );
    }
    assert_eq!(
        events[0].1["message"]["usage"]["input_tokens"],
        whole["usage"]["input_tokens"]
    );
    let streamed: String = events
        .iter()
        .filter_map(|(_, d)| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(streamed, text_of(&whole));
    assert_eq!(events[n - 2].1["delta"]["stop_reason"], "max_tokens");
    assert_eq!(events[n - 2].1["usage"]["output_tokens"], 12);
}

#[tokio::test]
async fn stop_sequences_and_sampling() {
    let (app, _) = router(config());
    let whole = post(&app, "/v1/messages", &message(json!({"max_tokens": 12})))
        .await
        .json();
    let text = text_of(&whole);
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let cut = post(
        &app,
        "/v1/messages",
        &message(json!({"max_tokens": 12, "stop_sequences": ["zzz-never", stop]})),
    )
    .await
    .json();
    assert_eq!(text_of(&cut), &text[..text.find(&stop).unwrap()]);
    assert_eq!(cut["stop_reason"], "stop_sequence");
    assert_eq!(cut["stop_sequence"], json!(stop));
    let sampled = post(
        &app,
        "/v1/messages",
        &message(json!({"temperature": 0.7, "top_p": 0.9, "top_k": 20})),
    )
    .await;
    assert_eq!(sampled.status, StatusCode::OK);
}

#[tokio::test]
async fn count_tokens_equals_prompt_tokens() {
    let (app, _) = router(config());
    let tools = json!([{"name": "get_weather", "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]);
    let history = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "text", "text": "Thanks!"}]}]);
    for extra in [
        json!({}),
        json!({"tools": tools, "messages": history}),
        json!({"system": [{"type": "text", "text": "Block system."}]}),
    ] {
        let body = message(extra);
        let used = post(&app, "/v1/messages", &body).await;
        assert_eq!(used.status, StatusCode::OK, "{}", used.text);
        let counted = post(&app, "/v1/messages/count_tokens", &body).await;
        assert_eq!(counted.status, StatusCode::OK, "{}", counted.text);
        assert_eq!(
            counted.json()["input_tokens"],
            used.json()["usage"]["input_tokens"]
        );
    }
    let with_tools = post(
        &app,
        "/v1/messages/count_tokens",
        &message(json!({"tools": tools})),
    )
    .await
    .json();
    let without = post(&app, "/v1/messages/count_tokens", &message(json!({})))
        .await
        .json();
    assert!(with_tools["input_tokens"].as_u64() > without["input_tokens"].as_u64());
}

#[tokio::test]
async fn errors_have_anthropic_shape() {
    let (app, _) = router(config());
    let malformed = send(&app, Method::POST, "/v1/messages", Some("[1,".into()), &[]).await;
    assert_eq!(malformed.status, StatusCode::BAD_REQUEST);
    assert_eq!(anthropic_error(&malformed).0, "invalid_request_error");
    let mut no_max = message(json!({}));
    no_max.as_object_mut().unwrap().remove("max_tokens");
    let reply = post(&app, "/v1/messages", &no_max).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(anthropic_error(&reply).1.contains("max_tokens"));
    let unknown = post(&app, "/v1/messages", &message(json!({"model": "nope"}))).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(anthropic_error(&unknown).0, "not_found_error");
    let image = message(json!({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgoAAAANSUhEUgAAAAIAAAABCAIAAAB7QOjdAAAADUlEQVR4nGP4zwAE/wEHAAH/4iOeWQAAAABJRU5ErkJggg=="}},
        {"type": "text", "text": "what is this?"}]}]}));
    let reply = post(&app, "/v1/messages", &image).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(
        anthropic_error(&reply).1.contains("has no vision"),
        "{:?}",
        anthropic_error(&reply)
    );
    let overflow = post(
        &app,
        "/v1/messages",
        &message(json!({"messages": [{"role": "user", "content": "word ".repeat(3000)}]})),
    )
    .await;
    assert_eq!(overflow.status, StatusCode::BAD_REQUEST);
    assert_eq!(anthropic_error(&overflow).0, "invalid_request_error");
    assert!(anthropic_error(&overflow)
        .1
        .starts_with("prompt is too long"));
    let count = post(
        &app,
        "/v1/messages/count_tokens",
        &json!({"model": "nope", "messages": []}),
    )
    .await;
    assert_eq!(anthropic_error(&count).0, "not_found_error");
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Qwen3.6's release fixture: its template raises on a system message that is not first.
const QWEN36: &str = "qwen3.6-35b-a3b";

/// A Claude Code 2.1.328 request as it arrives (`claude -p`): billing header, system messages
/// in `messages[]`, adaptive thinking, the fields and server tools the server ignores, an
/// unknown field, blocks of types it does not read.
fn claude_code(model: &str, stream: bool) -> Value {
    json!({
        "model": model, "max_tokens": 8, "temperature": 0, "stream": stream,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.e1f; cc_entrypoint=cli; cch=5e2a1;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "MCP instructions.", "cache_control": {"type": "ephemeral"}}]},
            {"role": "user", "content": [{"type": "text", "text": "Read notes.txt", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "The todo list is empty."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should read it.", "signature": "EqQBCkYIBxgCKkA"},
                {"type": "redacted_thinking", "data": "EmwKAhgBEgy"},
                {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "notes"}},
                {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
                {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "notes.txt"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "nonce 42"},
                    {"type": "search_result", "source": "s", "title": "t", "content": []}]},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "d"}}]},
            {"role": "system", "content": [{"type": "text", "text": "Tokens left: 1000."}]}],
        "tools": [
            {"name": "Read", "description": "Reads a file", "input_schema": {"type": "object",
                "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}},
            {"type": "custom", "name": "Write", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 8},
            {"type": "bash_20250124", "name": "bash"},
            {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_abc_account_x_session_y"},
        "service_tier": "auto",
        "container": "container_1",
        "mcp_servers": [{"type": "url", "url": "https://example.com/mcp", "name": "x"}],
        "a_field_from_the_future": {"anything": [1, 2]},
    })
}

const CLAUDE_CODE_HEADERS: [(&str, &str); 3] = [
    ("anthropic-version", "2023-06-01"),
    (
        "anthropic-beta",
        "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
    ),
    ("anthropic-dangerous-direct-browser-access", "true"),
];

async fn post_beta(app: &axum::Router, path: &str, body: &Value) -> Reply {
    let path = format!("{path}?beta=true");
    send(
        app,
        Method::POST,
        &path,
        Some(body.to_string()),
        &CLAUDE_CODE_HEADERS,
    )
    .await
}

/// Everything Claude Code sends is answered, streamed and not, on Qwen3's template and on
/// Qwen3.6's (which refuses a late system message, so one reaching it would be a 400), and
/// `count_tokens` counts the same prompt.
#[tokio::test]
async fn claude_code_requests_are_answered() {
    let config = ServerConfig {
        models: vec![fixture(), fixtures().join("releases").join(QWEN36)],
        max_loaded: 2,
        ..config()
    };
    let (app, _) = router(config);
    for model in [MODEL, QWEN36] {
        let whole = post_beta(&app, "/v1/messages", &claude_code(model, false)).await;
        assert_eq!(whole.status, StatusCode::OK, "{model}: {}", whole.text);
        let whole = whole.json();
        assert_eq!(whole["type"], "message");
        let streamed = post_beta(&app, "/v1/messages", &claude_code(model, true)).await;
        assert_eq!(
            streamed.status,
            StatusCode::OK,
            "{model}: {}",
            streamed.text
        );
        let events = sse(&streamed.text);
        assert_eq!(events.last().unwrap().0.as_deref(), Some("message_stop"));
        let counted = post_beta(
            &app,
            "/v1/messages/count_tokens",
            &claude_code(model, false),
        )
        .await;
        assert_eq!(counted.status, StatusCode::OK, "{model}: {}", counted.text);
        assert_eq!(
            counted.json()["input_tokens"],
            whole["usage"]["input_tokens"],
            "{model}"
        );
        assert_eq!(
            events[0].1["message"]["usage"]["input_tokens"], whole["usage"]["input_tokens"],
            "{model}"
        );
    }
}

/// The billing header's `cch` changes every request; the prompt does not.
#[tokio::test]
async fn the_billing_header_does_not_change_the_prompt() {
    let (app, _) = router(config());
    let mut other = claude_code(MODEL, false);
    other["system"][0]["text"] =
        json!("x-anthropic-billing-header: cc_version=2.1.328.e1f; cc_entrypoint=cli; cch=9c0d7;");
    let without = {
        let mut body = claude_code(MODEL, false);
        body["system"].as_array_mut().unwrap().remove(0);
        body
    };
    let count = |body: Value| {
        let app = app.clone();
        async move {
            let reply = post(&app, "/v1/messages/count_tokens", &body).await;
            assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
            reply.json()["input_tokens"].clone()
        }
    };
    let first = count(claude_code(MODEL, false)).await;
    assert_eq!(count(other).await, first);
    assert_eq!(count(without).await, first);
    // The second request reuses the whole prompt but its last token from the prefix cache.
    let reply = post(&app, "/v1/messages", &claude_code(MODEL, false)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let mut again = claude_code(MODEL, false);
    again["system"][0]["text"] = json!("x-anthropic-billing-header: cch=0;");
    let usage = post(&app, "/v1/messages", &again).await.json()["usage"].clone();
    assert!(
        usage["cache_read_input_tokens"].as_u64().unwrap() + 1
            >= usage["input_tokens"].as_u64().unwrap(),
        "{usage}"
    );

    // `--keep-billing-header`: the block is in the prompt, so its value changes the count.
    let (kept, _) = router(ServerConfig {
        keep_billing_header: true,
        ..config()
    });
    let reply = post(
        &kept,
        "/v1/messages/count_tokens",
        &claude_code(MODEL, false),
    )
    .await;
    let with_header = reply.json()["input_tokens"].as_u64().unwrap();
    assert!(
        with_header > first.as_u64().unwrap(),
        "{with_header} vs {first}"
    );
}

/// A prompt over the context is refused in Anthropic's words, which Claude Code answers by
/// compacting its history; the count is the prompt's.
#[tokio::test]
async fn a_prompt_over_the_context_is_too_long_in_anthropics_words() {
    let (app, _) = router(config());
    let body = message(json!({"messages": [{"role": "user", "content": "word ".repeat(3000)}]}));
    for stream in [false, true] {
        let mut body = body.clone();
        body["stream"] = json!(stream);
        let reply = post(&app, "/v1/messages", &body).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST);
        let tokens =
            post(&app, "/v1/messages/count_tokens", &body).await.json()["input_tokens"].clone();
        assert_eq!(
            reply.json(),
            json!({"type": "error", "error": {"type": "invalid_request_error",
                "message": format!("prompt is too long: {tokens} tokens > 2048 maximum")}})
        );
    }
    // The OpenAI routes keep their own words and code.
    let reply = post(
        &app,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": body["messages"]}),
    )
    .await;
    assert_eq!(openai_error(&reply).1, "context_length_exceeded");
}

fn image_block(name: &str) -> Value {
    let file = match name {
        "gradient" => "gradient_64x48.png",
        _ => "gradient_64x48_mirror.png",
    };
    let bytes = std::fs::read(fixtures().join("vision-images").join(file)).unwrap();
    let data = base64::engine::general_purpose::STANDARD.encode(bytes);
    json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}})
}

/// A Read tool call that returned a screenshot (how Claude Code sends images back).
fn screenshot_turn(model: &str, result: Value) -> Value {
    json!({"model": model, "max_tokens": 16, "temperature": 0, "messages": [
        {"role": "user", "content": "What does the screenshot show?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "shot.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]},
    ]})
}

/// Images inside `tool_result` content reach a vision model where they are: the prompt grows
/// by the image's block, the count agrees, and the mirrored image changes the greedy answer. A
/// text model refuses them as it refuses any image.
#[tokio::test]
async fn images_in_tool_results_reach_a_vision_model() {
    let config = ServerConfig {
        models: ["qwen3-vl-tiny", "gemma4-tiny"]
            .iter()
            .map(|name| fixtures().join(name))
            .chain([fixture()])
            .collect(),
        ..config()
    };
    let (app, _) = router(config);
    for model in ["qwen3-vl-tiny", "gemma4-tiny"] {
        let text_only = post(
            &app,
            "/v1/messages",
            &screenshot_turn(model, json!([{"type": "text", "text": "screenshot:"}])),
        )
        .await;
        assert_eq!(
            text_only.status,
            StatusCode::OK,
            "{model}: {}",
            text_only.text
        );
        let mut answers = Vec::new();
        for image in ["gradient", "gradient_mirror"] {
            let body = screenshot_turn(
                model,
                json!([{"type": "text", "text": "screenshot:"}, image_block(image)]),
            );
            let reply = post(&app, "/v1/messages", &body).await;
            assert_eq!(reply.status, StatusCode::OK, "{model}: {}", reply.text);
            let reply = reply.json();
            let tokens = reply["usage"]["input_tokens"].as_u64().unwrap();
            assert!(
                tokens > text_only.json()["usage"]["input_tokens"].as_u64().unwrap() + 4,
                "{model}: {tokens}"
            );
            let counted = post(&app, "/v1/messages/count_tokens", &body).await.json();
            assert_eq!(counted["input_tokens"], tokens, "{model}");
            answers.push(text_of(&reply));
        }
        assert_ne!(
            answers[0], answers[1],
            "{model}: the image reached the model"
        );
    }
    let refused = post(
        &app,
        "/v1/messages",
        &screenshot_turn(MODEL, json!([image_block("gradient")])),
    )
    .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert!(anthropic_error(&refused).1.contains("has no vision"));
}

/// `budget_tokens` is enforced: on Qwen3.6 (its template opens the reasoning) the random model
/// would think until `max_tokens`; with a budget of 6 its thinking is the first 6 tokens of
/// that, then the reasoning is closed and a text block follows. Whole and streamed agree.
#[tokio::test]
async fn a_thinking_budget_closes_the_reasoning() {
    let config = ServerConfig {
        models: vec![fixtures().join("releases").join(QWEN36)],
        ..config()
    };
    let (app, _) = router(config);
    let ask = |thinking: Value, stream: bool| {
        json!({"model": QWEN36, "max_tokens": 40, "temperature": 0, "stream": stream,
               "thinking": thinking, "messages": [{"role": "user", "content": "Think briefly."}]})
    };
    let blocks = |reply: &Value, kind: &str| -> Vec<String> {
        reply["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|block| block["type"] == kind)
            .map(|block| block[kind].as_str().unwrap_or_default().to_string())
            .collect()
    };
    let free = post(
        &app,
        "/v1/messages",
        &ask(json!({"type": "adaptive"}), false),
    )
    .await;
    assert_eq!(free.status, StatusCode::OK, "{}", free.text);
    let free = free.json();
    assert_eq!(free["stop_reason"], "max_tokens", "{free}");
    assert!(blocks(&free, "text").is_empty(), "never closed: {free}");
    let budget = json!({"type": "enabled", "budget_tokens": 6});
    let capped = post(&app, "/v1/messages", &ask(budget.clone(), false))
        .await
        .json();
    let (thought, all) = (
        &blocks(&capped, "thinking")[0],
        &blocks(&free, "thinking")[0],
    );
    assert!(
        all.starts_with(thought.trim_end()) && thought.len() < all.len(),
        "{capped}"
    );
    assert_eq!(
        blocks(&capped, "text").len(),
        1,
        "an answer follows: {capped}"
    );
    let streamed = post(&app, "/v1/messages", &ask(budget, true)).await;
    assert!(
        streamed.text.contains("\"type\":\"text_delta\""),
        "{}",
        streamed.text
    );
}
