//! Log-probs through both OpenAI routes on the tiny fixture: at temperature 0 the chosen
//! token is the first alternative, every log-prob is <= 0, and a stream's chunks concatenate to
//! the non-streamed list. Reference: OpenAI API reference (chat and legacy `logprobs`).

mod common;

use axum::http::StatusCode;
use common::*;
use serde_json::{json, Value};

/// EOS (991, 993 in the fixture) banned so every run generates `max_tokens` tokens.
fn chat(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Count to ten"}],
        "max_tokens": 8, "temperature": 0, "logit_bias": {"991": -1000.0, "993": -1000.0}});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

fn assert_same_entries(streamed: &[Value], whole: &[Value]) {
    assert_eq!(streamed.len(), whole.len());
    for (a, b) in streamed.iter().zip(whole) {
        assert_eq!(a["token"], b["token"]);
        assert_eq!(a["bytes"], b["bytes"]);
        // The stream is a repeat served from the prefix cache: equal up to float noise.
        let (x, y) = (
            a["logprob"].as_f64().unwrap(),
            b["logprob"].as_f64().unwrap(),
        );
        assert!((x - y).abs() < 1e-3, "{x} vs {y}");
    }
}

#[tokio::test]
async fn chat_logprobs_greedy_and_streamed() {
    let (app, _) = router(config());
    let whole = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"logprobs": true, "top_logprobs": 3})),
    )
    .await;
    assert_eq!(whole.status, StatusCode::OK, "{}", whole.text);
    let whole = whole.json();
    let content = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len(), 8);
    assert_eq!(whole["usage"]["completion_tokens"], 8);
    for entry in &content {
        let token = entry["token"].as_str().unwrap();
        let logprob = entry["logprob"].as_f64().unwrap();
        assert!(logprob <= 0.0, "{entry}");
        assert_eq!(entry["bytes"], json!(token.as_bytes()));
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the likeliest one.
        assert_eq!(top[0]["token"], entry["token"]);
        assert!((top[0]["logprob"].as_f64().unwrap() - logprob).abs() < 1e-6);
        let values: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(values.windows(2).all(|w| w[0] >= w[1]), "{values:?}");
    }

    let stream = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"logprobs": true, "top_logprobs": 3, "stream": true})),
    )
    .await;
    let events = sse(&stream.text);
    let streamed: Vec<Value> = events
        .iter()
        .filter_map(|(_, d)| d["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_same_entries(&streamed, &content);
    let text: String = events
        .iter()
        .filter_map(|(_, d)| d["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        text,
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );

    // Without logprobs: null; zero alternatives: empty lists.
    let plain = post(&app, "/v1/chat/completions", &chat(json!({})))
        .await
        .json();
    assert_eq!(plain["choices"][0]["logprobs"], Value::Null);
    let bare = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"logprobs": true})),
    )
    .await
    .json();
    let bare = &bare["choices"][0]["logprobs"]["content"];
    assert_eq!(bare.as_array().unwrap().len(), 8);
    assert_eq!(bare[0]["top_logprobs"], json!([]));
}

#[tokio::test]
async fn chat_logprob_fields_are_checked() {
    let (app, _) = router(config());
    for extra in [
        json!({"logprobs": true, "top_logprobs": 21}),
        json!({"top_logprobs": 2}),
        json!({"logprobs": false, "top_logprobs": 2}),
        json!({"logprobs": 5}),
        json!({"logprobs": true, "top_logprobs": "3"}),
    ] {
        let reply = post(&app, "/v1/chat/completions", &chat(extra.clone())).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{extra}");
        assert_eq!(openai_error(&reply).0, "invalid_request_error");
    }
    let legacy = json!({"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 21});
    assert_eq!(
        post(&app, "/v1/completions", &legacy).await.status,
        StatusCode::BAD_REQUEST
    );
}

#[tokio::test]
async fn legacy_logprobs_shape_and_stream() {
    let (app, _) = router(config());
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6,
        "temperature": 0, "logprobs": 2, "logit_bias": {"991": -1000.0, "993": -1000.0}});
    let whole = post(&app, "/v1/completions", &body).await;
    assert_eq!(whole.status, StatusCode::OK, "{}", whole.text);
    let whole = whole.json();
    let choice = &whole["choices"][0];
    let logprobs = &choice["logprobs"];
    let tokens: Vec<&str> = logprobs["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.len(), 6);
    let text = choice["text"].as_str().unwrap();
    if !text.contains('\u{fffd}') {
        assert_eq!(tokens.concat(), text);
    }
    let mut offset = 0;
    for (i, token) in tokens.iter().enumerate() {
        assert_eq!(logprobs["text_offset"][i], offset);
        offset += token.chars().count();
        let logprob = logprobs["token_logprobs"][i].as_f64().unwrap();
        assert!(logprob <= 0.0);
        let top = logprobs["top_logprobs"][i].as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 2, "{top:?}");
        // Greedy: the chosen token is the likeliest alternative.
        let best = top
            .iter()
            .max_by(|a, b| a.1.as_f64().unwrap().total_cmp(&b.1.as_f64().unwrap()))
            .unwrap();
        assert_eq!(best.0, token);
    }

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = sse(&post(&app, "/v1/completions", &streamed).await.text);
    let mut tokens_streamed = Vec::new();
    let mut offsets = Vec::new();
    for (_, data) in &events {
        let chunk = &data["choices"][0]["logprobs"];
        if chunk.is_object() {
            tokens_streamed.extend(chunk["tokens"].as_array().unwrap().iter().cloned());
            offsets.extend(chunk["text_offset"].as_array().unwrap().iter().cloned());
        }
    }
    assert_eq!(json!(tokens_streamed), logprobs["tokens"]);
    assert_eq!(json!(offsets), logprobs["text_offset"]);
}
