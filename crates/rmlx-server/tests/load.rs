//! A bounded loopback load test on a real socket: `serve_on` bound to 127.0.0.1 on a free port,
//! 200 requests 16 at a time (chat and messages, streaming and not), a quarter of the streams
//! dropped mid-way. Afterwards every completed response is whole, the server is healthy and
//! idle, live KV is 0 and MLX active memory is back to idle plus what the prefix cache keeps;
//! unloading returns MLX memory to its baseline and the RSS to near it. Then a real 2560x2560
//! noise PNG as a data URI passes the default body limit. Also: 16 clients hanging up at
//! random points for 60 s, and the minutes-long soak `make soak` runs (ignored here).

mod common;

use std::{net::SocketAddr, time::Duration};

use axum::http::{Request, StatusCode};
use base64::Engine as _;
use common::*;
use futures_util::{stream, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

const REQUESTS: usize = 200;
const CONCURRENT: usize = 16;
/// Allocator slack on top of the prefix cache's bytes (small arrays, alignment).
const MEMORY_SLACK: u64 = 4 << 20;

/// MLX's memory figures are process-wide: the tests here run one at a time so each one's
/// memory checks see only its own server.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// One request on its own connection; the connection task comes back so a test can cut it.
async fn send_raw(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<Vec<u8>>,
) -> (hyper::Response<Incoming>, tokio::task::JoinHandle<()>) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    let task = tokio::spawn(async move {
        let _ = connection.await;
    });
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .unwrap();
    (sender.send_request(request).await.unwrap(), task)
}

async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> (StatusCode, String) {
    let (response, _task) =
        send_raw(addr, method, path, body.map(|b| b.to_string().into_bytes())).await;
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

#[derive(Clone, Copy)]
struct Plan {
    messages_api: bool,
    stream: bool,
    drop_mid_stream: bool,
    max_tokens: u64,
}

fn plan(i: usize) -> Plan {
    let stream = i % 2 == 1;
    // Two of every eight streams are cut: a quarter of them.
    let drop_mid_stream = stream && (i / 2).is_multiple_of(4);
    Plan {
        messages_api: (i / 2) % 2 == 1,
        stream,
        drop_mid_stream,
        // Cut streams run long enough to be cut mid-way.
        max_tokens: if drop_mid_stream {
            64
        } else {
            2 + (i % 5) as u64
        },
    }
}

fn body(plan: Plan, i: usize) -> (&'static str, Value) {
    let content = format!("Request {i}: say something");
    if plan.messages_api {
        let body = json!({"model": MODEL, "max_tokens": plan.max_tokens, "stream": plan.stream,
                          "messages": [{"role": "user", "content": content}]});
        ("/v1/messages", body)
    } else {
        let body = json!({"model": MODEL, "max_tokens": plan.max_tokens, "stream": plan.stream,
                          "stream_options": {"include_usage": true}, "temperature": 0.7,
                          "messages": [{"role": "user", "content": content}]});
        ("/v1/chat/completions", body)
    }
}

/// Runs one planned request; returns whether it completed (not cut) and checks it is whole.
async fn run_one(addr: SocketAddr, i: usize) -> bool {
    let plan = plan(i);
    let (path, body) = body(plan, i);
    let (response, connection) =
        send_raw(addr, "POST", path, Some(body.to_string().into_bytes())).await;
    assert_eq!(response.status(), StatusCode::OK, "request {i}");
    if plan.drop_mid_stream {
        let mut body = response.into_body();
        let first = body.frame().await.unwrap().unwrap();
        assert!(first.is_data());
        drop(body);
        connection.abort();
        return false;
    }
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    let max = plan.max_tokens;
    let n = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("request {i}: {text}"));
    match (plan.messages_api, plan.stream) {
        (false, false) => {
            let reply: Value = serde_json::from_str(&text).unwrap();
            let usage = &reply["usage"];
            assert!(
                (1..=max).contains(&n(&usage["completion_tokens"])),
                "{i}: {usage}"
            );
            assert_eq!(
                n(&usage["total_tokens"]),
                n(&usage["prompt_tokens"]) + n(&usage["completion_tokens"])
            );
            assert!(reply["choices"][0]["message"].is_object());
        }
        (true, false) => {
            let reply: Value = serde_json::from_str(&text).unwrap();
            assert!(
                (1..=max).contains(&n(&reply["usage"]["output_tokens"])),
                "{i}: {reply}"
            );
            assert!(reply["content"].is_array());
            assert!(reply["stop_reason"].is_string());
        }
        (false, true) => {
            let events = sse(&text);
            assert_eq!(events.last().unwrap().1, json!("[DONE]"), "request {i}");
            let usage = &events[events.len() - 2].1["usage"];
            assert!(
                (1..=max).contains(&n(&usage["completion_tokens"])),
                "{i}: {usage}"
            );
        }
        (true, true) => {
            let events = sse(&text);
            assert_eq!(
                events.last().unwrap().0.as_deref(),
                Some("message_stop"),
                "{i}"
            );
            let delta = &events[events.len() - 2].1;
            assert_eq!(delta["type"], "message_delta");
            assert!(
                (1..=max).contains(&n(&delta["usage"]["output_tokens"])),
                "{i}: {delta}"
            );
        }
    }
    true
}

/// A real server on a free loopback port: its address, the switch that stops it, its task.
async fn start(
    config: rmlx_server::ServerConfig,
) -> (
    SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    let state = rmlx_server::AppState::new(config).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(rmlx_server::serve_on(listener, state, async {
        let _ = stopped.await;
    }));
    (addr, stop, server)
}

/// `POST /v1/models/{model}/{action}` (load, unload), which must succeed.
async fn model_action(addr: SocketAddr, model: &str, action: &str) {
    let path = format!("/v1/models/{model}/{action}");
    let (status, text) = call(addr, "POST", &path, Some(&json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{action} {model}: {text}");
}

/// After the traffic: healthy, and once cut requests are cancelled (the engine notices them
/// between steps) idle, with no live KV and no error counted. The metrics at that point.
async fn settled(addr: SocketAddr) -> Value {
    let (status, _) = call(addr, "GET", "/health", None).await;
    assert_eq!(status, StatusCode::OK);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let metrics = loop {
        let metrics = cache_metrics(addr).await;
        if metrics["in_flight"] == 0 && metrics["queue_depth"] == 0 {
            break metrics;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never idle: {metrics}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(metrics["kv_cache_bytes"], 0, "{metrics}");
    assert!(
        metrics["error_counts"].as_object().unwrap().is_empty(),
        "{metrics}"
    );
    metrics
}

async fn cache_metrics(addr: SocketAddr) -> Value {
    let (status, text) = call(addr, "GET", "/metrics/cache", None).await;
    assert_eq!(status, StatusCode::OK);
    serde_json::from_str(&text).unwrap()
}

/// This process's resident set (Linux `/proc/self/statm`; None elsewhere).
fn resident_set_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// A 2560x2560 RGBA PNG of noise (incompressible, so as large as such a PNG gets).
fn noise_png() -> Vec<u8> {
    let side = 2560u32;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let pixels: Vec<u8> = (0..side * side * 4)
        .map(|_| {
            // xorshift64: fast, deterministic noise.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 56) as u8
        })
        .collect();
    let mut png = Vec::new();
    let encoder = image::codecs::png::PngEncoder::new_with_quality(
        &mut png,
        image::codecs::png::CompressionType::Fast,
        image::codecs::png::FilterType::NoFilter,
    );
    image::ImageEncoder::write_image(
        encoder,
        &pixels,
        side,
        side,
        image::ExtendedColorType::Rgba8,
    )
    .unwrap();
    png
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn loopback_load_and_large_image() {
    let _serial = SERIAL.lock().await;
    let (addr, stop, server) = start(config()).await;

    // A first cycle (load, a few requests, unload) pages in the code and the allocator arenas
    // that any use needs once, so the baseline below measures what requests leave behind.
    for i in 0..16 {
        run_one(addr, i).await;
    }
    model_action(addr, MODEL, "unload").await;
    let (baseline, rss_before) = (
        cache_metrics(addr).await["active_memory_bytes"]
            .as_u64()
            .unwrap(),
        resident_set_bytes(),
    );
    // Idle: the model loaded, nothing running, nothing cached yet.
    model_action(addr, MODEL, "load").await;
    let idle = cache_metrics(addr).await["active_memory_bytes"]
        .as_u64()
        .unwrap();

    let started = std::time::Instant::now();
    let completed: Vec<bool> = stream::iter(0..REQUESTS)
        .map(|i| run_one(addr, i))
        .buffer_unordered(CONCURRENT)
        .collect()
        .await;
    let load_time = started.elapsed();
    assert_eq!(completed.iter().filter(|done| !**done).count(), 25);

    let metrics = settled(addr).await;
    let active = metrics["active_memory_bytes"].as_u64().unwrap();
    let kept = metrics["prefix_cache_bytes"].as_u64().unwrap();
    assert!(
        active <= idle + kept + MEMORY_SLACK,
        "active {active} > idle {idle} + prefix cache {kept} + slack"
    );
    eprintln!("load: {REQUESTS} requests in {load_time:?}; memory idle {idle}, after {active}, prefix cache {kept}");
    assert!(load_time < Duration::from_secs(45), "{load_time:?}");

    // Unloading gives everything back: MLX active memory to its pre-load baseline (the buffer
    // cache is cleared as the engine goes idle), the process's resident set to within 64 MiB
    // plus a tenth of the weights of where it was.
    model_action(addr, MODEL, "unload").await;
    let after = cache_metrics(addr).await;
    let (active_after, cache_after) = (
        after["active_memory_bytes"].as_u64().unwrap(),
        after["cache_memory_bytes"].as_u64().unwrap(),
    );
    let weights = std::fs::metadata(fixture().join("model.safetensors"))
        .unwrap()
        .len();
    let rss_after = resident_set_bytes();
    eprintln!(
        "load: after unload MLX active {active_after} (baseline {baseline}), buffer cache \
         {cache_after}; RSS {rss_after:?} (before loading {rss_before:?}, weights {weights})"
    );
    assert!(
        active_after <= baseline + (1 << 20),
        "active {active_after} > baseline {baseline} + 1 MiB"
    );
    assert_eq!(cache_after, 0, "{after}");
    if let (Some(before), Some(now)) = (rss_before, rss_after) {
        assert!(
            now <= before + (64 << 20) + weights / 10,
            "RSS {now} > {before} + 64 MiB + a tenth of {weights}"
        );
    }

    // A real 2560x2560 PNG as a data URI fits the default body limit: it reaches the image
    // check (no vision here) instead of a 413.
    let png = noise_png();
    let uri = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(&png)
    );
    let body = json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": uri}}]}]});
    let (status, text) = call(addr, "POST", "/v1/chat/completions", Some(&body)).await;
    assert_eq!(
        status,
        StatusCode::BAD_REQUEST,
        "{}",
        &text[..text.len().min(300)]
    );
    assert!(text.contains("has no vision"), "{text}");
    eprintln!(
        "png: {} bytes, body {} bytes",
        png.len(),
        body.to_string().len()
    );

    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

/// One request of the soak: the load test's mix (both APIs, streamed and not, a quarter of
/// the streams cut) for six of every eight, then a picture for the vision fixture and a JSON
/// mode request. Returns what it was, for the counts.
async fn soak_one(addr: SocketAddr, i: usize, image_uri: &str) -> &'static str {
    match i % 8 {
        0..=5 => {
            if run_one(addr, i).await {
                "text"
            } else {
                "cut"
            }
        }
        6 => {
            let body = json!({"model": "qwen3-vl-tiny", "max_tokens": 3, "stream": i % 16 == 6,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": image_uri}},
                    {"type": "text", "text": format!("Picture {i}: what is it?")}]}]});
            let (status, text) = call(addr, "POST", "/v1/chat/completions", Some(&body)).await;
            assert_eq!(status, StatusCode::OK, "image request {i}: {text}");
            assert!(text.contains("\"choices\""), "image request {i}: {text}");
            "image"
        }
        _ => {
            let body = json!({"model": MODEL, "max_tokens": 12,
                "response_format": {"type": "json_object"},
                "messages": [{"role": "user", "content": format!("JSON {i}, please")}]});
            let (status, text) = call(addr, "POST", "/v1/chat/completions", Some(&body)).await;
            assert_eq!(status, StatusCode::OK, "JSON request {i}: {text}");
            let reply: Value = serde_json::from_str(&text).unwrap();
            let content = reply["choices"][0]["message"]["content"].as_str().unwrap();
            assert!(
                content.trim_start().starts_with('{'),
                "JSON request {i}: {content}"
            );
            "json"
        }
    }
}

/// `make soak` (not in `make test`): `SOAK_MINUTES` (default 5) of mixed traffic from 8
/// clients on a real socket, two models resident (text and vision), then the load test's end
/// checks: healthy, idle, no live KV, no error counted, MLX memory back to idle plus what the
/// prefix cache keeps. Prints the counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a soak of minutes: make soak"]
async fn soak() {
    let _serial = SERIAL.lock().await;
    let minutes: f64 = std::env::var("SOAK_MINUTES")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(5.0);
    let mut config = config();
    config
        .models
        .push(fixture().with_file_name("qwen3-vl-tiny"));
    config.max_loaded = 2;
    let (addr, stop, server) = start(config).await;
    let baseline = cache_metrics(addr).await["active_memory_bytes"]
        .as_u64()
        .unwrap();
    for model in [MODEL, "qwen3-vl-tiny"] {
        model_action(addr, model, "load").await;
    }
    let idle = cache_metrics(addr).await["active_memory_bytes"]
        .as_u64()
        .unwrap();
    let png = std::fs::read(fixture().join("../vision-images/gradient_64x48.png")).unwrap();
    let image_uri = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(&png)
    );

    let started = std::time::Instant::now();
    let until = started + Duration::from_secs_f64(minutes * 60.0);
    let image_uri = &image_uri;
    let kinds: Vec<&'static str> = stream::iter(0..)
        .take_while(|_| std::future::ready(std::time::Instant::now() < until))
        .map(|i| soak_one(addr, i, image_uri))
        .buffer_unordered(8)
        .collect()
        .await;
    let elapsed = started.elapsed();

    let metrics = settled(addr).await;
    let active = metrics["active_memory_bytes"].as_u64().unwrap();
    let kept = metrics["prefix_cache_bytes"].as_u64().unwrap();
    let count = |kind: &str| kinds.iter().filter(|k| **k == kind).count();
    eprintln!(
        "soak: {} requests in {elapsed:.0?} ({:.1}/s): {} text (chat + messages, streamed and not), \
         {} cut mid-stream, {} with an image, {} JSON mode; MLX active memory idle {idle}, after {active}, \
         prefix cache {kept}",
        kinds.len(),
        kinds.len() as f64 / elapsed.as_secs_f64(),
        count("text"),
        count("cut"),
        count("image"),
        count("json"),
    );
    // Thousands of small cached prefixes cost more than their bytes (allocator rounding), so
    // the hard check is after unloading: everything the models and their requests held is
    // given back, to the byte budget of a few small arrays.
    for model in [MODEL, "qwen3-vl-tiny"] {
        model_action(addr, model, "unload").await;
    }
    let after = cache_metrics(addr).await["active_memory_bytes"]
        .as_u64()
        .unwrap();
    eprintln!("soak: MLX active memory before loading {baseline}, after unloading {after}");
    assert!(
        after <= baseline + (1 << 20),
        "after unloading: active {after} > baseline {baseline} + 1 MiB"
    );
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

/// 16 clients for a bounded 60 s, each sending request after request (both APIs, streamed and
/// not) and hanging up at a random point in most of them: before the answer, mid-stream, or
/// not at all. Afterwards nothing is in flight or queued, no KV is live, no error was counted,
/// and a fresh request is answered whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn random_disconnects_leave_nothing_behind() {
    let _serial = SERIAL.lock().await;
    let (addr, stop, server) = start(config()).await;
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    let clients: Vec<_> = (0..16u64)
        .map(|client| {
            tokio::spawn(async move {
                let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ (client + 1).wrapping_mul(0x2545_f491);
                let mut random = move |below: u64| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed % below
                };
                let (mut sent, mut cut) = (0u64, 0u64);
                while tokio::time::Instant::now() < until {
                    let i = random(1 << 20) as usize;
                    let plan = Plan {
                        messages_api: random(2) == 1,
                        stream: random(3) > 0,
                        drop_mid_stream: false,
                        max_tokens: 1 + random(40),
                    };
                    let (path, body) = body(plan, i);
                    let exchange = async {
                        let (response, _connection) =
                            send_raw(addr, "POST", path, Some(body.to_string().into_bytes())).await;
                        assert_eq!(response.status(), StatusCode::OK);
                        response.into_body().collect().await.unwrap();
                    };
                    sent += 1;
                    // Three in four hang up after 0-150 ms; the rest read to the end.
                    if random(4) > 0 {
                        let after = Duration::from_millis(random(150));
                        if tokio::time::timeout(after, exchange).await.is_err() {
                            cut += 1;
                        }
                    } else {
                        exchange.await;
                    }
                }
                (sent, cut)
            })
        })
        .collect();
    let (mut sent, mut cut) = (0, 0);
    for client in clients {
        let (s, c) = client.await.unwrap();
        sent += s;
        cut += c;
    }
    settled(addr).await;
    eprintln!("disconnects: {sent} requests from 16 clients in 60 s, {cut} cut at a random point");
    assert!(cut > 100, "only {cut} of {sent} were cut");
    // Plan 3: a streamed chat request read to the end.
    assert!(run_one(addr, 3).await, "a fresh request after the storm");
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}
