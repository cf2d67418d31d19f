//! The app's IPC front door onto the engine: chat, models and metrics requests go through the
//! server's own router in-process (no socket), so the app and `rmlx serve` share one request
//! validation, chat formatting, image handling and metrics path, and an answer's
//! `/metrics/cache` entry carries the id the app was given.
//! Reference: axum `examples/testing` (driving a `Router` with `oneshot`).

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
};

use axum::{
    body::Body,
    http::{header, Method, Request, StatusCode},
    Router,
};
use http_body_util::BodyExt;
use rmlx_server::AppState;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tower::ServiceExt;

/// What the UI receives on its channel while an answer streams. Exactly one `Done` or `Error`
/// ends every stream.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ChatEvent {
    Delta {
        text: String,
    },
    Reasoning {
        text: String,
    },
    Done {
        id: String,
        usage: Value,
        finish_reason: Option<String>,
    },
    Error {
        message: String,
        code: Option<String>,
    },
}

/// A failed non-streaming call, in the server's own words.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BridgeError {
    pub status: u16,
    pub message: String,
    pub code: Option<String>,
}

impl std::fmt::Display for BridgeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

#[derive(Clone)]
pub struct Bridge {
    router: Router,
    api_key: Option<String>,
    next: Arc<AtomicU64>,
    cancels: Arc<Mutex<HashMap<String, oneshot::Sender<()>>>>,
}

impl Bridge {
    pub fn new(state: AppState) -> Self {
        let api_key = state.config.api_key.clone();
        Self {
            router: rmlx_server::app(state),
            api_key,
            next: Arc::default(),
            cancels: Arc::default(),
        }
    }

    /// The same bridge over a new state (settings changed): chats already streaming keep
    /// their old router and can still be stopped, and ids keep counting.
    pub fn rebuilt(&self, state: AppState) -> Self {
        Self {
            next: self.next.clone(),
            cancels: self.cancels.clone(),
            ..Self::new(state)
        }
    }

    fn request(&self, method: Method, path: &str, body: Option<&Value>) -> Request<Body> {
        // The server's Host allow-list admits loopback names only; we are loopback.
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, "127.0.0.1");
        if let Some(key) = &self.api_key {
            request = request.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        let body = match body {
            Some(value) => {
                request = request.header(header::CONTENT_TYPE, "application/json");
                Body::from(value.to_string())
            }
            None => Body::empty(),
        };
        request.body(body).expect("a static request shape")
    }

    /// GET a JSON route (`/v1/models`, `/metrics/cache`).
    pub async fn get_json(&self, path: &str) -> Result<Value, BridgeError> {
        self.call_json(Method::GET, path, None).await
    }

    /// Any JSON route (model load/delete, the download jobs), answered as the server would
    /// answer an HTTP client: the body, or its error as a [`BridgeError`].
    pub async fn call_json(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, BridgeError> {
        let response = self
            .router
            .clone()
            .oneshot(self.request(method, path, body))
            .await
            .map_err(|never| match never {})?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|error| internal(error.to_string()))?
            .to_bytes();
        let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if status.is_success() {
            Ok(value)
        } else {
            Err(api_error(status, &value))
        }
    }

    /// Starts a streamed chat completion (the OpenAI request body) and returns the id that
    /// [`Bridge::cancel`] takes; events go to `sink` from a task until the stream ends.
    pub fn start_chat(
        &self,
        mut body: Value,
        sink: impl Fn(ChatEvent) + Send + Sync + 'static,
    ) -> String {
        let id = format!("ipc-{}", self.next.fetch_add(1, Ordering::Relaxed) + 1);
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let (cancel_tx, cancel_rx) = oneshot::channel();
        self.cancels.lock().unwrap().insert(id.clone(), cancel_tx);
        let request = self.request(Method::POST, "/v1/chat/completions", Some(&body));
        let (router, cancels, key) = (self.router.clone(), self.cancels.clone(), id.clone());
        // Tauri runs sync commands on the main thread, outside any runtime: spawn on Tauri's.
        tauri::async_runtime::spawn(async move {
            tokio::select! {
                // Dropping the response body is a client disconnect: the engine cancels.
                _ = cancel_rx => sink(ChatEvent::Error {
                    message: "stopped".into(),
                    code: Some("cancelled".into()),
                }),
                () = stream_chat(router, request, &sink) => {}
            }
            cancels.lock().unwrap().remove(&key);
        });
        id
    }

    /// Stops a streaming chat; an unknown or finished id is not an error.
    pub fn cancel(&self, id: &str) {
        if let Some(cancel) = self.cancels.lock().unwrap().remove(id) {
            let _ = cancel.send(());
        }
    }
}

/// A model or job id as one path segment: `org/name` becomes `org%2Fname`, as the browser UI
/// sends it (the server decodes it back).
pub fn path_segment(id: &str) -> String {
    let mut encoded = String::with_capacity(id.len());
    for byte in id.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            encoded.push(byte as char);
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

fn internal(message: String) -> BridgeError {
    BridgeError {
        status: 500,
        message,
        code: None,
    }
}

fn api_error(status: StatusCode, body: &Value) -> BridgeError {
    let error = &body["error"];
    BridgeError {
        status: status.as_u16(),
        message: error["message"]
            .as_str()
            .unwrap_or("the engine refused the request")
            .to_string(),
        code: error["code"]
            .as_str()
            .or(error["type"].as_str())
            .map(str::to_string),
    }
}

/// Runs one streamed request to its end, turning SSE chunks into events.
async fn stream_chat(router: Router, request: Request<Body>, sink: &impl Fn(ChatEvent)) {
    let response = match router.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    let status = response.status();
    let mut body = response.into_body();
    if !status.is_success() {
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let error = api_error(status, &value);
        sink(ChatEvent::Error {
            message: error.message,
            code: error.code,
        });
        return;
    }
    let mut parser = SseParser::default();
    let mut answer = Answer::default();
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            sink(ChatEvent::Error {
                message: "the stream broke off".into(),
                code: None,
            });
            return;
        };
        let Some(bytes) = frame.data_ref() else {
            continue;
        };
        for data in parser.push(&String::from_utf8_lossy(bytes)) {
            if let Some(end) = answer.take(&data, sink) {
                sink(end);
                return;
            }
        }
    }
    sink(answer.finish());
}

/// `data:` payloads of an SSE stream that may arrive split anywhere.
#[derive(Default)]
pub struct SseParser {
    buffer: String,
}

impl SseParser {
    pub fn push(&mut self, chunk: &str) -> Vec<String> {
        self.buffer.push_str(&chunk.replace("\r\n", "\n"));
        let mut events = Vec::new();
        while let Some(end) = self.buffer.find("\n\n") {
            let block: String = self.buffer.drain(..end + 2).collect();
            let data: Vec<&str> = block
                .lines()
                .filter_map(|line| line.strip_prefix("data:"))
                .map(|rest| rest.strip_prefix(' ').unwrap_or(rest))
                .collect();
            if !data.is_empty() {
                events.push(data.join("\n"));
            }
        }
        events
    }
}

/// What one answer's chunks have said so far.
#[derive(Default)]
struct Answer {
    id: Option<String>,
    usage: Option<Value>,
    finish_reason: Option<String>,
}

impl Answer {
    /// Forwards text; returns the closing event when the stream says it is over.
    fn take(&mut self, data: &str, sink: &impl Fn(ChatEvent)) -> Option<ChatEvent> {
        if data == "[DONE]" {
            return Some(self.finish());
        }
        let chunk: Value = serde_json::from_str(data).ok()?;
        if chunk.get("error").is_some() {
            let error = api_error(StatusCode::INTERNAL_SERVER_ERROR, &chunk);
            return Some(ChatEvent::Error {
                message: error.message,
                code: error.code,
            });
        }
        if let Some(id) = chunk["id"].as_str() {
            self.id.get_or_insert_with(|| id.to_string());
        }
        if !chunk["usage"].is_null() {
            self.usage = Some(chunk["usage"].clone());
        }
        let choice = &chunk["choices"][0];
        if let Some(reason) = choice["finish_reason"].as_str() {
            self.finish_reason = Some(reason.to_string());
        }
        let delta = &choice["delta"];
        if let Some(text) = delta["reasoning_content"]
            .as_str()
            .filter(|t| !t.is_empty())
        {
            sink(ChatEvent::Reasoning { text: text.into() });
        }
        if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
            sink(ChatEvent::Delta { text: text.into() });
        }
        None
    }

    fn finish(&mut self) -> ChatEvent {
        match self.id.take() {
            Some(id) => ChatEvent::Done {
                id,
                usage: self.usage.take().unwrap_or(Value::Null),
                finish_reason: self.finish_reason.take(),
            },
            None => ChatEvent::Error {
                message: "the stream ended before any answer".into(),
                code: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_become_one_path_segment() {
        assert_eq!(path_segment("org/name-1.5_x"), "org%2Fname-1.5_x");
        assert_eq!(path_segment("../a b"), "..%2Fa%20b");
    }

    #[test]
    fn sse_split_anywhere_gives_whole_events() {
        let mut parser = SseParser::default();
        assert!(parser.push("data: {\"a\"").is_empty());
        assert_eq!(parser.push(":1}\n\ndata: [DO"), vec!["{\"a\":1}"]);
        assert_eq!(parser.push("NE]\r\n\r\n"), vec!["[DONE]"]);
        assert_eq!(
            parser.push("event: x\ndata: 1\ndata: 2\n\n: comment\n\n"),
            vec!["1\n2"]
        );
    }
}
