//! Guards and lifecycle in-process: API keys, Host allow-list, CORS, queue limits, client
//! disconnects cancelling work, concurrent requests batched without mixing their tokens.

mod common;

use std::time::{Duration, Instant};

use axum::{
    body::Body,
    http::{Method, Request, StatusCode},
};
use common::*;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

fn chat(content: &str, max_tokens: usize, stream: bool) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": content}],
           "max_tokens": max_tokens, "temperature": 0, "stream": stream})
}

/// A request that runs to `max_tokens`: EOS (`<|endoftext|>` 991, `<|im_end|>` 993 in the
/// fixture's vocab) is banned through `logit_bias`.
fn long_chat(max_tokens: usize, stream: bool) -> Value {
    let mut body = chat("Tell me a story", max_tokens, stream);
    body["logit_bias"] = json!({"991": -1000.0, "993": -1000.0});
    body
}

#[tokio::test]
async fn api_key_on_both_apis() {
    let (app, _) = router(ServerConfigExt::with(|c| c.api_key = Some("sekret".into())));
    let body = chat("hi", 1, false).to_string();
    let openai = |headers: &'static [(&'static str, &'static str)]| {
        let (app, body) = (app.clone(), body.clone());
        async move {
            send(
                &app,
                Method::POST,
                "/v1/chat/completions",
                Some(body),
                headers,
            )
            .await
        }
    };
    let missing = openai(&[]).await;
    assert_eq!(missing.status, StatusCode::UNAUTHORIZED);
    assert_eq!(openai_error(&missing).1, "invalid_api_key");
    assert_eq!(
        openai(&[("authorization", "Bearer wrong")]).await.status,
        StatusCode::UNAUTHORIZED
    );
    // x-api-key is Anthropic's header, not OpenAI's.
    assert_eq!(
        openai(&[("x-api-key", "sekret")]).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        openai(&[("authorization", "Bearer sekret")]).await.status,
        StatusCode::OK
    );
    assert_eq!(get(&app, "/health").await.status, StatusCode::OK);
    assert_eq!(
        get(&app, "/v1/models").await.status,
        StatusCode::UNAUTHORIZED
    );

    let message =
        json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
            .to_string();
    let anthropic = |headers: &'static [(&'static str, &'static str)]| {
        let (app, body) = (app.clone(), message.clone());
        async move { send(&app, Method::POST, "/v1/messages", Some(body), headers).await }
    };
    let missing = anthropic(&[]).await;
    assert_eq!(missing.status, StatusCode::UNAUTHORIZED);
    assert_eq!(anthropic_error(&missing).0, "authentication_error");
    assert_eq!(
        anthropic(&[("x-api-key", "nope")]).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        anthropic(&[("x-api-key", "sekret"), ("anthropic-version", "2023-06-01")])
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        anthropic(&[("authorization", "Bearer sekret")])
            .await
            .status,
        StatusCode::OK
    );
}

async fn with_host(app: &axum::Router, host: Option<&str>) -> StatusCode {
    let mut request = Request::builder().uri("/health");
    if let Some(host) = host {
        request = request.header("host", host);
    }
    app.clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap()
        .status()
}

#[tokio::test]
async fn host_header_allow_list() {
    let (app, _) = router(config());
    for host in ["localhost:8080", "127.0.0.1", "[::1]:9000"] {
        assert_eq!(with_host(&app, Some(host)).await, StatusCode::OK, "{host}");
    }
    assert_eq!(
        with_host(&app, Some("attacker.example:8080")).await,
        StatusCode::FORBIDDEN
    );
    assert_eq!(with_host(&app, None).await, StatusCode::BAD_REQUEST);
    let (bound, _) = router(ServerConfigExt::with(|c| c.host = "studio.local".into()));
    assert_eq!(
        with_host(&bound, Some("studio.local:8080")).await,
        StatusCode::OK
    );
}

#[tokio::test]
async fn cors_only_for_listed_origins() {
    let preflight = |app: axum::Router, origin: &'static str| async move {
        let request = Request::builder()
            .method(Method::OPTIONS)
            .uri("/v1/chat/completions")
            .header("host", "localhost")
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization,content-type",
            )
            .body(Body::empty())
            .unwrap();
        let response = app.oneshot(request).await.unwrap();
        response
            .headers()
            .get("access-control-allow-origin")
            .map(|v| v.to_str().unwrap().to_string())
    };
    let (off, _) = router(config());
    assert_eq!(preflight(off.clone(), "http://app.example").await, None);
    let reply = send(
        &off,
        Method::GET,
        "/v1/models",
        None,
        &[("origin", "http://app.example")],
    )
    .await;
    assert!(reply.headers.get("access-control-allow-origin").is_none());

    let (on, _) = router(ServerConfigExt::with(|c| {
        c.cors_origins = vec!["http://app.example".into()]
    }));
    assert_eq!(
        preflight(on.clone(), "http://app.example").await.as_deref(),
        Some("http://app.example")
    );
    assert_eq!(preflight(on.clone(), "http://evil.example").await, None);
    let reply = send(
        &on,
        Method::GET,
        "/v1/models",
        None,
        &[("origin", "http://app.example")],
    )
    .await;
    assert_eq!(
        reply.headers["access-control-allow-origin"],
        "http://app.example"
    );
}

async fn start_stream(app: &axum::Router, body: &Value) -> axum::response::Response {
    start_stream_at(app, "/v1/chat/completions", body).await
}

/// `start_stream` on any route: the response as soon as its headers are.
async fn start_stream_at(
    app: &axum::Router,
    route: &str,
    body: &Value,
) -> axum::response::Response {
    let request = Request::builder()
        .method(Method::POST)
        .uri(route)
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    app.clone().oneshot(request).await.unwrap()
}

/// Streams `body`, drops the connection after the first frame and says how long the engine
/// took to go idle (at most three times `full`, a whole run's time).
async fn cancel_after_first_frame(
    app: &axum::Router,
    state: &rmlx_server::AppState,
    body: &Value,
    full: Duration,
) -> Duration {
    let response = start_stream(app, body).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut stream = response.into_body();
    let first = stream.frame().await.unwrap().unwrap();
    assert!(first.is_data());
    let dropped_at = Instant::now();
    drop(stream);
    wait_idle(state, full * 3).await;
    dropped_at.elapsed()
}

async fn wait_idle(state: &rmlx_server::AppState, limit: Duration) -> Duration {
    let started = Instant::now();
    while state.engine.queue_depth() > 0 {
        assert!(
            started.elapsed() < limit,
            "the engine is still busy after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    started.elapsed()
}

#[tokio::test]
async fn disconnect_cancels_the_generation() {
    let (app, state) = router(config());
    // A full run, for scale.
    let started = Instant::now();
    let full = post(&app, "/v1/chat/completions", &long_chat(1500, false))
        .await
        .json();
    let full_time = started.elapsed();
    assert_eq!(full["usage"]["completion_tokens"], 1500);

    let cancel_time =
        cancel_after_first_frame(&app, &state, &long_chat(1500, true), full_time).await;
    assert!(
        cancel_time < full_time / 2,
        "cancel took {cancel_time:?}, a full run {full_time:?}"
    );
    // The engine serves the next request normally.
    assert_eq!(
        post(&app, "/v1/chat/completions", &chat("hi", 2, false))
            .await
            .status,
        StatusCode::OK
    );
}

/// The bound counts requests waiting beyond the running batch: with a batch of 2 and a queue
/// of 1, two long streams decode together, a third waits, and a fourth is refused.
#[tokio::test]
async fn full_queue_gives_429() {
    let (app, state) = router(ServerConfigExt::with(|c| {
        c.max_queue = 1;
        c.max_batch = 2;
    }));
    let mut running = Vec::new();
    for _ in 0..2 {
        let stream = start_stream(&app, &long_chat(1800, true)).await;
        assert_eq!(stream.status(), StatusCode::OK);
        running.push(stream);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while state.engine.metrics().in_flight < 2 {
        assert!(
            Instant::now() < deadline,
            "the two streams never ran together"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let waiting = tokio::spawn({
        let app = app.clone();
        async move { start_stream(&app, &chat("hi", 1, true)).await.status() }
    });
    while state.engine.queue_depth() < 3 {
        assert!(Instant::now() < deadline, "the third request never queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let refused = post(&app, "/v1/chat/completions", &chat("hi", 1, false)).await;
    assert_eq!(
        refused.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        refused.text
    );
    assert_eq!(openai_error(&refused).0, "rate_limit_error");
    drop(running);
    assert_eq!(waiting.await.unwrap(), StatusCode::OK);
}

#[tokio::test]
async fn concurrent_clients_get_their_own_tokens() {
    let (app, _) = router(config());
    let prompts = [
        "The sky is",
        "Rust is a language",
        "Once upon a time",
        "2 + 2 =",
    ];
    let mut expected = Vec::new();
    for prompt in prompts {
        let body = post(&app, "/v1/chat/completions", &chat(prompt, 24, false))
            .await
            .json();
        expected.push(
            body["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    let tasks: Vec<_> = prompts
        .iter()
        .map(|prompt| {
            let (app, body) = (app.clone(), chat(prompt, 24, true));
            tokio::spawn(async move {
                let reply = post(&app, "/v1/chat/completions", &body).await;
                let events = sse(&reply.text);
                let text = events
                    .iter()
                    .filter_map(|(_, d)| {
                        d["choices"][0]["delta"]["content"]
                            .as_str()
                            .map(str::to_string)
                    })
                    .collect::<String>();
                let batched_with = events
                    .iter()
                    .filter_map(|(_, d)| d["timings"]["batched_with"].as_u64())
                    .max()
                    .unwrap_or(0);
                (text, batched_with)
            })
        })
        .collect();
    let mut widest = 0;
    for (task, expected) in tasks.into_iter().zip(expected) {
        let (text, batched_with) = task.await.unwrap();
        assert_eq!(text, expected);
        widest = widest.max(batched_with);
    }
    // They ran as one batch (continuous batching), each still getting its own tokens.
    assert!(widest >= 2, "the concurrent streams never decoded together");
}

/// A `logit_bias` id past the vocabulary is the request's own 400, decided before it joins the
/// batch: it used to reach the sampler at the first decode step, fail as a 500 and take the
/// requests decoding beside it down with it.
#[tokio::test]
async fn a_logit_bias_past_the_vocabulary_fails_only_its_request() {
    let (app, _) = router(config());
    let running = start_stream(&app, &long_chat(64, true)).await;
    assert_eq!(running.status(), StatusCode::OK);
    for route in ["/v1/chat/completions", "/v1/completions", "/v1/responses"] {
        let mut body = match route {
            "/v1/chat/completions" => chat("hi", 4, false),
            "/v1/completions" => json!({"model": MODEL, "prompt": "hi", "max_tokens": 4}),
            _ => json!({"model": MODEL, "input": "hi", "max_output_tokens": 4}),
        };
        body["logit_bias"] = json!({"28107570": -1.0, "8": 1.0});
        let refused = post(&app, route, &body).await;
        assert_eq!(
            refused.status,
            StatusCode::BAD_REQUEST,
            "{route}: {}",
            refused.text
        );
        assert!(
            refused
                .text
                .contains("logit_bias token id 28107570 is outside the vocabulary"),
            "{route}: {}",
            refused.text
        );
    }
    let text = String::from_utf8(
        running
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    let events = sse(&text);
    assert_eq!(events.last().unwrap().1, "[DONE]", "{text}");
    assert!(!text.contains("\"error\""), "{text}");
}

/// A long prompt for the 0.6B release fixture (its context is 40k; qwen3-tiny's is 2k).
fn release_chat(words: usize, max_tokens: usize, stream: bool) -> Value {
    json!({"model": "qwen3-0.6b", "max_tokens": max_tokens, "stream": stream, "temperature": 0,
           "messages": [{"role": "user", "content": "lorem ipsum dolor ".repeat(words)}]})
}

fn with_release(heartbeat: Duration) -> rmlx_server::ServerConfig {
    ServerConfigExt::with(|c| {
        c.models.push(fixture().join("../releases/qwen3-0.6b"));
        c.heartbeat = heartbeat;
    })
}

/// While a prompt prefills, each stream sends its keep-alive event (every 1 ms here): a chunk
/// with nothing in it for chat and text completions (an SSE comment would not reach clients'
/// idle guards), Anthropic's `ping`, Responses' `response.in_progress`, all before the first
/// token (decoding answers at its own pace).
#[tokio::test]
async fn streams_keep_alive_while_the_prompt_prefills() {
    let (app, _) = router(with_release(Duration::from_millis(1)));
    // Each prompt its own words: none is a prefix-cache hit on another.
    let text = |word: &str| format!("{word} ").repeat(450);
    let chat = json!({"model": "qwen3-0.6b", "max_tokens": 3, "stream": true,
                      "messages": [{"role": "user", "content": text("alpha")}]});
    let completion = json!({"model": "qwen3-0.6b", "prompt": text("beta"), "max_tokens": 3,
                            "stream": true});
    let messages = json!({"model": "qwen3-0.6b", "max_tokens": 3, "stream": true,
                          "messages": [{"role": "user", "content": text("gamma")}]});
    let responses = json!({"model": "qwen3-0.6b", "input": text("delta"),
                           "max_output_tokens": 3, "stream": true});
    let empty_chunk = |block: &str, empty: &str| {
        block.starts_with("data: {\"id\"")
            && block.contains(empty)
            && block.contains("\"finish_reason\":null")
    };
    let chat_alive = |block: &str| empty_chunk(block, "\"delta\":{}");
    let text_alive = |block: &str| empty_chunk(block, "\"text\":\"\"");
    // (route, body, whether a block is a keep-alive, whether it is the first token's)
    type Is<'a> = &'a dyn Fn(&str) -> bool;
    let cases: [(&str, Value, Is, Is); 4] = [
        (
            "/v1/chat/completions",
            chat,
            &chat_alive,
            // Not the role's chunk, sent before the prompt is read.
            &|block: &str| {
                block.starts_with("data: {\"id\"")
                    && !chat_alive(block)
                    && !block.contains("\"role\"")
            },
        ),
        (
            "/v1/completions",
            completion,
            &text_alive,
            &|block: &str| block.starts_with("data: {\"id\"") && !text_alive(block),
        ),
        (
            "/v1/messages",
            messages,
            &|block: &str| block.starts_with("event: ping"),
            &|block: &str| block.starts_with("event: content_block_start"),
        ),
        (
            "/v1/responses",
            responses,
            &|block: &str| block.starts_with("event: response.in_progress"),
            &|block: &str| block.starts_with("event: response.output_item.added"),
        ),
    ];
    for (route, body, keep_alive, first_token) in cases {
        let reply = post(&app, route, &body).await;
        assert_eq!(reply.status, StatusCode::OK, "{route}: {}", reply.text);
        let blocks: Vec<&str> = reply.text.split("\n\n").collect();
        let alive: Vec<usize> = (0..blocks.len())
            .filter(|&i| keep_alive(blocks[i]))
            .collect();
        let token = (0..blocks.len())
            .find(|&i| first_token(blocks[i]))
            .unwrap_or_else(|| panic!("{route}: no token in {}", reply.text));
        let before = alive.iter().filter(|&&i| i < token).count();
        // Responses' own first in_progress, and Anthropic's ping after the first block start.
        let own = usize::from(route == "/v1/responses");
        assert!(
            before > own,
            "{route}: no keep-alive before the first token: {}",
            reply.text
        );
        let after = alive.iter().filter(|&&i| i > token).count();
        assert!(
            after <= usize::from(route == "/v1/messages"),
            "{route}: {}",
            reply.text
        );
    }
}

/// A stream whose request waits in the queue (the one batch row is taken) answers after one
/// heartbeat, headers and keep-alives, before the engine takes it: agents abort a request
/// whose headers are late (Qwen Code after 120 s). A refusal then comes in the stream: a
/// prompt over the context, queued, ends in the error chunk / event / `response.failed`.
#[tokio::test]
async fn queued_streams_answer_before_the_engine_takes_them() {
    let (app, state) = router(ServerConfigExt::with(|c| {
        c.max_batch = 1;
        c.heartbeat = Duration::from_millis(20);
    }));
    let over = "word ".repeat(3000);
    let chat_over = json!({"model": MODEL, "max_tokens": 4, "stream": true,
                           "messages": [{"role": "user", "content": over}]});
    let messages_over = json!({"model": MODEL, "max_tokens": 4, "stream": true,
                               "messages": [{"role": "user", "content": over}]});
    let responses_over = json!({"model": MODEL, "max_output_tokens": 4, "stream": true,
                                "input": over});
    // (route, an over-long request, the first frame's start, the refusal's mark in the body)
    let cases = [
        (
            "/v1/chat/completions",
            chat_over,
            "data: {\"id\"",
            "context_length_exceeded",
        ),
        (
            "/v1/messages",
            messages_over,
            ": keep-alive",
            "event: error",
        ),
        (
            "/v1/responses",
            responses_over,
            "event: response.created",
            "event: response.failed",
        ),
    ];
    for (route, body, first, refusal) in cases {
        let running = start_stream(&app, &long_chat(1800, true)).await;
        assert_eq!(running.status(), StatusCode::OK);
        let deadline = Instant::now() + Duration::from_secs(10);
        while state.engine.metrics().in_flight < 1 {
            assert!(Instant::now() < deadline, "{route}: the first never ran");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let queued = start_stream_at(&app, route, &body).await;
        assert_eq!(queued.status(), StatusCode::OK, "{route}");
        // Headers came while it waited: the running stream still holds the batch.
        assert_eq!(state.engine.queue_depth(), 2, "{route}");
        let mut queued = queued.into_body();
        let frame = queued.frame().await.unwrap().unwrap().into_data().unwrap();
        let frame = String::from_utf8(frame.to_vec()).unwrap();
        assert!(frame.starts_with(first), "{route}: {frame}");
        assert_eq!(state.engine.queue_depth(), 2, "{route}");
        drop(running);
        let rest = queued.collect().await.unwrap().to_bytes();
        let rest = String::from_utf8(rest.to_vec()).unwrap();
        assert!(rest.contains(refusal), "{route}: {rest}");
        wait_idle(&state, Duration::from_secs(10)).await;
    }
}

/// A client gone during a long prefill stops it within a chunk: the engine is idle long
/// before the prompt would have been read.
#[tokio::test]
async fn disconnect_during_prefill_stops_it() {
    let (app, state) = router(with_release(Duration::from_millis(100)));
    let started = Instant::now();
    let full = post(&app, "/v1/chat/completions", &release_chat(700, 1, false)).await;
    assert_eq!(full.status, StatusCode::OK, "{}", full.text);
    let prefill = started.elapsed();

    let cancel = cancel_after_first_frame(&app, &state, &release_chat(701, 1, true), prefill).await;
    assert!(
        cancel < prefill / 2,
        "cancel took {cancel:?}, a whole prefill {prefill:?}"
    );
}
