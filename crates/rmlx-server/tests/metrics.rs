//! Metrics through the server: `/metrics/cache` and `/metrics` after real requests, every
//! entry point (chat, completions, messages; streaming and not) feeding exactly one TTFT
//! sample, n-1 ITL samples and usage-equal token counts, prefix-cache hits on a repeated
//! multi-turn chat, each request's `recent` entry found by its response id, and errors counted
//! once (by the server or by the engine, never both).

mod common;

use axum::http::{Method, StatusCode};
use common::*;
use serde_json::{json, Value};

async fn cache_metrics(app: &axum::Router) -> Value {
    let reply = get(app, "/metrics/cache").await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    reply.json()
}

/// (ttft count, itl count, tokens in, tokens out) for the fixture model.
async fn counts(app: &axum::Router) -> [u64; 4] {
    let metrics = cache_metrics(app).await;
    let find = |list: &str| {
        metrics[list]
            .as_array()
            .unwrap()
            .iter()
            .find(|entry| entry["model_id"] == MODEL)
            .map_or(0, |entry| entry["count"].as_u64().unwrap())
    };
    [
        find("ttft"),
        find("itl"),
        metrics["tokens_in"].as_u64().unwrap(),
        metrics["tokens_out"].as_u64().unwrap(),
    ]
}

/// Prompt and completion tokens a request reported, from its body or its stream.
fn usage_of(path: &str, stream: bool, text: &str) -> (u64, u64) {
    let n = |v: &Value| v.as_u64().unwrap();
    if !stream {
        let body: Value = serde_json::from_str(text).unwrap();
        return if path == "/v1/messages" {
            (
                n(&body["usage"]["input_tokens"]),
                n(&body["usage"]["output_tokens"]),
            )
        } else {
            (
                n(&body["usage"]["prompt_tokens"]),
                n(&body["usage"]["completion_tokens"]),
            )
        };
    }
    let events = sse(text);
    if path == "/v1/messages" {
        let start = events
            .iter()
            .find(|(name, _)| name.as_deref() == Some("message_start"));
        let delta = events
            .iter()
            .find(|(name, _)| name.as_deref() == Some("message_delta"));
        (
            n(&start.unwrap().1["message"]["usage"]["input_tokens"]),
            n(&delta.unwrap().1["usage"]["output_tokens"]),
        )
    } else {
        let usage = events
            .iter()
            .find_map(|(_, data)| data.get("usage").filter(|u| u.is_object()))
            .expect("include_usage chunk");
        (n(&usage["prompt_tokens"]), n(&usage["completion_tokens"]))
    }
}

#[tokio::test]
async fn every_entry_point_feeds_the_metrics_once() {
    let (app, _) = router(config());
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
                      "max_tokens": 5, "temperature": 0});
    let legacy = json!({"model": MODEL, "prompt": "Once upon", "max_tokens": 5, "temperature": 0});
    let message = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}],
                         "max_tokens": 5, "temperature": 0});
    for (path, body) in [
        ("/v1/chat/completions", chat),
        ("/v1/completions", legacy),
        ("/v1/messages", message),
    ] {
        for stream in [false, true] {
            let mut body = body.clone();
            if stream {
                body["stream"] = json!(true);
                body["stream_options"] = json!({"include_usage": true});
            }
            let before = counts(&app).await;
            let reply = post(&app, path, &body).await;
            assert_eq!(reply.status, StatusCode::OK, "{path}: {}", reply.text);
            let (prompt, completion) = usage_of(path, stream, &reply.text);
            assert!(completion >= 1);
            let after = counts(&app).await;
            let added: Vec<u64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
            assert_eq!(
                added,
                [1, completion - 1, prompt, completion],
                "{path} stream={stream}"
            );
            // The request's own entry: found by its response id, with every gap listed.
            let metrics = cache_metrics(&app).await;
            let last = metrics["recent"]
                .as_array()
                .unwrap()
                .last()
                .unwrap()
                .clone();
            let id = last["id"].as_str().unwrap();
            if stream {
                assert!(reply.text.contains(id), "{path}: {id}");
            } else {
                assert_eq!(reply.json()["id"], id, "{path}");
            }
            assert_eq!(
                last["itl_ms"].as_array().unwrap().len() as u64,
                completion - 1
            );
        }
    }
    let metrics = cache_metrics(&app).await;
    assert_eq!(metrics["recent"].as_array().unwrap().len(), 6);
    assert_eq!(metrics["recent"][0]["model"], MODEL);
    assert_eq!(metrics["in_flight"], 0);
    assert_eq!(metrics["queue_depth"], 0);
}

#[tokio::test]
async fn multi_turn_chat_hits_the_prefix_cache() {
    let (app, _) = router(config());
    let mut messages = vec![
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": "Name a colour."}),
    ];
    let first = post(
        &app,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}),
    )
    .await
    .json();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let hits = |metrics: &Value| metrics["models"][0]["prefix_cache_hits"].as_u64().unwrap();
    let before = hits(&cache_metrics(&app).await);
    messages.push(json!({"role": "assistant",
                         "content": first["choices"][0]["message"]["content"]}));
    messages.push(json!({"role": "user", "content": "Another one."}));
    let second = post(
        &app,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}),
    )
    .await
    .json();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "{}", second["usage"]);
    assert!(cached < second["usage"]["prompt_tokens"].as_u64().unwrap());
    assert_eq!(hits(&cache_metrics(&app).await), before + 1);

    // Anthropic reports the same reuse as cache reads.
    let message = json!({"model": MODEL, "system": "You are terse.", "max_tokens": 3,
                         "messages": [{"role": "user", "content": "Name a colour."}]});
    let first = post(&app, "/v1/messages", &message).await.json();
    let again = post(&app, "/v1/messages", &message).await.json();
    assert_eq!(
        again["usage"]["input_tokens"],
        first["usage"]["input_tokens"]
    );
    assert_eq!(
        again["usage"]["cache_read_input_tokens"],
        first["usage"]["input_tokens"].as_u64().unwrap() - 1
    );
}

#[tokio::test]
async fn errors_are_counted_once_and_prometheus_is_served() {
    let (app, _) = router(config());
    let chat = |model: &str| {
        json!({"model": model, "messages": [{"role": "user", "content": "Hello"}],
               "max_tokens": 3, "temperature": 0})
    };
    assert_eq!(
        post(&app, "/v1/chat/completions", &chat(MODEL))
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        post(&app, "/v1/chat/completions", &chat("nope"))
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    let bad = send(&app, Method::POST, "/v1/messages", Some("{".into()), &[]).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    // Refused by the engine (context overflow): counted by the engine only.
    let mut long = chat(MODEL);
    long["messages"][0]["content"] = json!("word ".repeat(3000));
    assert_eq!(
        post(&app, "/v1/chat/completions", &long).await.status,
        StatusCode::BAD_REQUEST
    );
    let errors = cache_metrics(&app).await["error_counts"].clone();
    assert_eq!(
        errors,
        json!({"context_length_exceeded": 1, "invalid_request": 1, "model_not_found": 1})
    );

    let text = get(&app, "/metrics").await;
    assert_eq!(text.status, StatusCode::OK);
    assert!(text.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    for line in [
        "rmlx_requests_total{model=\"qwen3-tiny\"} 1",
        "rmlx_errors_total{kind=\"model_not_found\"} 1",
        "rmlx_errors_total{kind=\"context_length_exceeded\"} 1",
        "rmlx_ttft_ms_count{model=\"qwen3-tiny\"} 1",
        "rmlx_queue_depth 0",
        "rmlx_in_flight 0",
    ] {
        assert!(
            text.text.lines().any(|l| l == line),
            "{line} missing:\n{}",
            text.text
        );
    }
}

#[tokio::test]
async fn metrics_need_the_key_when_one_is_set() {
    let (app, _) = router(ServerConfigExt::with(|c| c.api_key = Some("k".into())));
    for path in ["/metrics", "/metrics/cache"] {
        assert_eq!(
            get(&app, path).await.status,
            StatusCode::UNAUTHORIZED,
            "{path}"
        );
        let ok = send(
            &app,
            Method::GET,
            path,
            None,
            &[("authorization", "Bearer k")],
        )
        .await;
        assert_eq!(ok.status, StatusCode::OK, "{path}");
    }
    assert_eq!(
        cache_metrics_with_key(&app).await["error_counts"]["unauthorized"],
        2
    );
}

async fn cache_metrics_with_key(app: &axum::Router) -> Value {
    send(
        app,
        Method::GET,
        "/metrics/cache",
        None,
        &[("authorization", "Bearer k")],
    )
    .await
    .json()
}

/// `--speculative lookup`: the answer is the one plain decode gives, and its drafted and kept
/// tokens show in its timings, its `recent` entry and the model's totals.
#[tokio::test]
async fn speculative_decoding_shows_in_timings_and_metrics() {
    let chat = json!({"model": MODEL, "max_tokens": 24, "temperature": 0, "messages": [
        {"role": "user", "content": "Repeat after me: the cat sat on the mat."},
        {"role": "assistant", "content": "The cat sat on the mat."},
        {"role": "user", "content": "Again: the cat sat on the mat."}]});
    let mut answers = Vec::new();
    for mode in ["off", "lookup"] {
        let (app, _) = router(ServerConfigExt::with(|config| {
            config.speculative = rmlx_engine::speculative::SpeculativeMode::parse(mode).unwrap();
        }));
        let reply = post(&app, "/v1/chat/completions", &chat).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
        let body = reply.json();
        let timings = &body["timings"];
        let metrics = cache_metrics(&app).await;
        let recent = &metrics["recent"][0];
        let model = &metrics["models"][0];
        let drafted = timings["draft_tokens"].as_u64().unwrap();
        assert_eq!(recent["draft_tokens"].as_u64(), Some(drafted), "{mode}");
        assert_eq!(model["draft_tokens"].as_u64(), Some(drafted), "{mode}");
        assert_eq!(
            recent["accepted_tokens"], timings["accepted_tokens"],
            "{mode}"
        );
        if mode == "off" {
            assert_eq!(drafted, 0);
        } else {
            assert!(drafted > 0, "nothing drafted: {timings}");
        }
        let prometheus = get(&app, "/metrics").await.text;
        assert!(prometheus.contains("rmlx_draft_tokens_total{"), "{mode}");
        answers.push(body["choices"][0]["message"]["content"].clone());
    }
    assert_eq!(answers[0], answers[1]);
}
