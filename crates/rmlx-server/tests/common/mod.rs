//! Shared helpers for the in-process API tests: a state on the tiny Qwen3 fixture, one-shot
//! requests through `app()` (no socket; axum `examples/testing`), and SSE parsing.
#![allow(dead_code)]

use std::path::PathBuf;

use axum::{
    body::Body,
    http::{HeaderMap, Method, Request, StatusCode},
    Router,
};
use http_body_util::BodyExt;
use rmlx_server::{app, AppState, ServerConfig};
use serde_json::Value;
use tower::ServiceExt;

pub const MODEL: &str = "qwen3-tiny";

pub fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3-tiny")
}

/// A config serving only the fixture (an empty HF cache, so the machine's own is not scanned).
pub fn config() -> ServerConfig {
    let empty = std::env::temp_dir().join("rmlx-server-tests-empty-hub");
    std::fs::create_dir_all(&empty).unwrap();
    ServerConfig {
        models: vec![fixture()],
        hf_cache: Some(empty),
        ..ServerConfig::default()
    }
}

pub fn router(config: ServerConfig) -> (Router, AppState) {
    let state = AppState::new(config).expect("engine starts");
    (app(state.clone()), state)
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub text: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text))
    }
}

pub async fn send(
    router: &Router,
    method: Method,
    path: &str,
    body: Option<String>,
    headers: &[(&str, &str)],
) -> Reply {
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1:8080");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    if body.is_some() {
        request = request.header("content-type", "application/json");
    }
    let request = request
        .body(body.map_or_else(Body::empty, Body::from))
        .unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        text: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

pub async fn post(router: &Router, path: &str, body: &Value) -> Reply {
    send(router, Method::POST, path, Some(body.to_string()), &[]).await
}

pub async fn get(router: &Router, path: &str) -> Reply {
    send(router, Method::GET, path, None, &[]).await
}

/// `(event name, data)` for each SSE event; `[DONE]` comes back as a JSON string.
pub fn sse(text: &str) -> Vec<(Option<String>, Value)> {
    text.split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .map(|block| {
            let mut event = None;
            let mut data = String::new();
            for line in block.lines() {
                if let Some(name) = line.strip_prefix("event: ") {
                    event = Some(name.to_string());
                } else if let Some(value) = line.strip_prefix("data: ") {
                    data.push_str(value);
                }
            }
            let value = serde_json::from_str(&data).unwrap_or(Value::String(data));
            (event, value)
        })
        .collect()
}

/// OpenAI error shape, checked, returning (type, code, message).
pub fn openai_error(reply: &Reply) -> (String, Value, String) {
    let body = reply.json();
    let error = &body["error"];
    assert!(error.is_object(), "not an OpenAI error: {body}");
    (
        error["type"].as_str().unwrap().to_string(),
        error["code"].clone(),
        error["message"].as_str().unwrap().to_string(),
    )
}

/// Anthropic error shape, checked, returning (type, message).
pub fn anthropic_error(reply: &Reply) -> (String, String) {
    let body = reply.json();
    assert_eq!(body["type"], "error", "not an Anthropic error: {body}");
    (
        body["error"]["type"].as_str().unwrap().to_string(),
        body["error"]["message"].as_str().unwrap().to_string(),
    )
}

/// `config()` with one change.
pub struct ServerConfigExt;

impl ServerConfigExt {
    pub fn with(change: impl FnOnce(&mut ServerConfig)) -> ServerConfig {
        let mut config = config();
        change(&mut config);
        config
    }
}
