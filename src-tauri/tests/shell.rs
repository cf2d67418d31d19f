//! The shell's engine-facing parts without a window: IPC chat through the in-process router
//! (streamed deltas add up to the non-streamed answer, the done event's id is the request's
//! `/metrics/cache` entry, Stop leaves nothing in flight, bad requests are error events) and
//! the local server switch (answers on its port, a busy port is a status, off stops answering).

use std::{path::PathBuf, sync::mpsc, time::Duration};

use rmlx_app::{
    bridge::{Bridge, ChatEvent},
    local_server::{LocalServer, ServerStatus},
};
use rmlx_server::{AppState, ServerConfig};
use serde_json::{json, Value};

fn state() -> AppState {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3-tiny");
    AppState::new(ServerConfig {
        models: vec![fixture],
        ..ServerConfig::default()
    })
    .unwrap()
}

fn chat(max_tokens: usize) -> Value {
    json!({"model": "qwen3-tiny", "messages": [{"role": "user", "content": "Tell me a story"}],
           "max_tokens": max_tokens, "temperature": 0})
}

/// Every event of one streamed answer, until its Done or Error.
fn collect(bridge: &Bridge, body: Value) -> Vec<ChatEvent> {
    let (tx, rx) = mpsc::channel();
    bridge.start_chat(body, move |event| {
        let _ = tx.send(event);
    });
    let mut events = Vec::new();
    while let Ok(event) = rx.recv_timeout(Duration::from_secs(60)) {
        let last = matches!(event, ChatEvent::Done { .. } | ChatEvent::Error { .. });
        events.push(event);
        if last {
            break;
        }
    }
    events
}

/// Tauri runs sync commands such as `chat_stream` on the main thread, outside any Tokio
/// runtime: starting a chat there must work (it once panicked, which aborts the whole app).
#[test]
fn a_chat_starts_from_a_thread_without_a_runtime() {
    let bridge = Bridge::new(state());
    assert!(tokio::runtime::Handle::try_current().is_err());
    let events = collect(&bridge, chat(4));
    assert!(
        matches!(events.last(), Some(ChatEvent::Done { .. })),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipc_chat_streams_the_same_answer_and_its_metrics_entry() {
    let bridge = Bridge::new(state());
    let events = tokio::task::spawn_blocking({
        let bridge = bridge.clone();
        move || collect(&bridge, chat(12))
    })
    .await
    .unwrap();
    let text: String = events
        .iter()
        .filter_map(|event| match event {
            ChatEvent::Delta { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    let Some(ChatEvent::Done {
        id,
        usage,
        finish_reason,
    }) = events.last()
    else {
        panic!("no done event: {events:?}");
    };
    assert_eq!(finish_reason.as_deref(), Some("length"));
    assert_eq!(usage["completion_tokens"], 12);

    // The same request without streaming, through the HTTP API the server serves.
    let metrics = bridge.get_json("/metrics/cache").await.unwrap();
    let entry = metrics["recent"]
        .as_array()
        .unwrap()
        .iter()
        .find(|entry| entry["id"] == id.as_str())
        .expect("the answer's id is in /metrics/cache");
    assert_eq!(entry["tokens_out"], 12);
    assert_eq!(entry["itl_ms"].as_array().unwrap().len(), 11);
    let models = bridge.get_json("/v1/models").await.unwrap();
    assert_eq!(models["data"][0]["id"], "qwen3-tiny");

    let server = LocalServer::new(state(), "127.0.0.1");
    let ServerStatus::On { url } = server.start(0).await else {
        panic!("the server did not start");
    };
    let plain = reqwest_post(&url, &chat(12)).await;
    assert_eq!(plain["choices"][0]["message"]["content"], text.as_str());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_ends_the_stream_and_bad_requests_are_error_events() {
    let bridge = Bridge::new(state());
    let (tx, rx) = mpsc::channel();
    let id = bridge.start_chat(chat(100_000), move |event| {
        let _ = tx.send(event);
    });
    // Wait for the answer to start, then stop it.
    let first = tokio::task::spawn_blocking(move || {
        let first = rx.recv_timeout(Duration::from_secs(60)).unwrap();
        (first, rx)
    })
    .await
    .unwrap();
    assert!(matches!(first.0, ChatEvent::Delta { .. }), "{:?}", first.0);
    bridge.cancel(&id);
    let rx = first.1;
    let end = tokio::task::spawn_blocking(move || loop {
        match rx.recv_timeout(Duration::from_secs(30)).unwrap() {
            ChatEvent::Delta { .. } => continue,
            other => break other,
        }
    })
    .await
    .unwrap();
    assert!(
        matches!(&end, ChatEvent::Error { code: Some(code), .. } if code == "cancelled"),
        "{end:?}"
    );
    // The engine lets go within moments: nothing in flight.
    let mut in_flight = Value::Null;
    for _ in 0..100 {
        in_flight = bridge.get_json("/metrics/cache").await.unwrap()["in_flight"].clone();
        if in_flight == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(in_flight, 0);
    bridge.cancel("ipc-unknown");

    let events = tokio::task::spawn_blocking({
        let bridge = bridge.clone();
        move || collect(&bridge, json!({"model": "nope", "messages": []}))
    })
    .await
    .unwrap();
    assert!(
        matches!(events.as_slice(), [ChatEvent::Error { .. }]),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_switch_answers_refuses_a_busy_port_and_stops() {
    let server = LocalServer::new(state(), "127.0.0.1");
    let ServerStatus::On { url } = server.start(0).await else {
        panic!("the server did not start");
    };
    let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    assert!(get(&url, "/health").await.is_some());
    assert_eq!(server.status().summary(), format!("Server: on · {url}"));

    // Another listener on a port: switching to it is a status with the message, not a crash.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap().port();
    match server.start(busy).await {
        ServerStatus::Failed { message, port } => {
            assert_eq!(port, busy);
            assert!(message.contains("in use"), "{message}");
        }
        other => panic!("expected a failed status, got {other:?}"),
    }
    assert!(
        get(&url, "/health").await.is_none(),
        "the old port still answers"
    );

    let ServerStatus::On { url } = server.start(port).await else {
        panic!("the server did not restart");
    };
    assert!(get(&url, "/health").await.is_some());
    assert_eq!(server.stop().await, ServerStatus::Off);
    assert!(
        get(&url, "/health").await.is_none(),
        "still answering after stop"
    );
}

/// A GET on loopback with a plain HTTP/1.0 exchange; None when nothing answers.
async fn get(url: &str, path: &str) -> Option<String> {
    exchange(
        url,
        &format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"),
    )
    .await
}

async fn reqwest_post(url: &str, body: &Value) -> Value {
    let body = body.to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let reply = exchange(url, &request).await.unwrap();
    let json = reply.split("\r\n\r\n").nth(1).unwrap();
    serde_json::from_str(json).unwrap()
}

async fn exchange(url: &str, request: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(address).await.ok()?;
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).await.ok()?;
    Some(reply)
}
