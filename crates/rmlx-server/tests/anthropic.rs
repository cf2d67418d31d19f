//! Anthropic routes in-process: message shape, the native stream's event order, streaming
//! against non-streaming, count_tokens against the engine's prompt tokens, typed errors.

mod common;

use axum::http::{Method, StatusCode};
use common::*;
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
    assert!(anthropic_error(&overflow).1.contains("context"));
    let count = post(
        &app,
        "/v1/messages/count_tokens",
        &json!({"model": "nope", "messages": []}),
    )
    .await;
    assert_eq!(anthropic_error(&count).0, "not_found_error");
}
