//! OpenAI routes in-process on the tiny Qwen3 fixture: every field family, streaming against
//! non-streaming at temperature 0, and each typed error.

mod common;

use axum::http::{Method, StatusCode};
use common::*;
use serde_json::{json, Value};

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}],
                          "max_tokens": 8, "temperature": 0});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

/// Concatenated `delta.content` of a chat stream.
fn streamed_content(events: &[(Option<String>, Value)]) -> String {
    events
        .iter()
        .filter_map(|(_, data)| data["choices"][0]["delta"]["content"].as_str())
        .collect()
}

/// Usage of a repeat of `first`: the same counts, all but the last prompt token from the
/// prefix cache (the engine recomputes one token to get the next logits).
fn assert_same_usage(repeat: &Value, first: &Value) {
    for key in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(repeat[key], first[key], "{key}");
    }
    assert_eq!(first["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        repeat["prompt_tokens_details"]["cached_tokens"],
        first["prompt_tokens"].as_u64().unwrap() - 1
    );
}

#[tokio::test]
async fn health_models_retrieve_load_unload() {
    let (app, _) = router(config());
    let health = get(&app, "/health").await;
    assert_eq!(
        (health.status, health.json()),
        (StatusCode::OK, json!({"status": "ok"}))
    );

    let models = get(&app, "/v1/models").await.json();
    assert_eq!(models["object"], "list");
    let model = &models["data"][0];
    assert_eq!(model["id"], MODEL);
    assert_eq!(model["object"], "model");
    assert_eq!(model["owned_by"], "local");
    assert!(model["created"].as_u64().unwrap() > 0);
    assert_eq!(model["context_length"], 2048);
    assert_eq!(
        (model["loaded"].clone(), model["vision"].clone()),
        (json!(false), json!(false))
    );
    assert_eq!(
        (
            model["load_seconds"].clone(),
            model["warm_up_seconds"].clone()
        ),
        (Value::Null, Value::Null),
        "not loaded, not warmed up"
    );

    assert_eq!(get(&app, "/v1/models/qwen3-tiny").await.json()["id"], MODEL);
    let load = post(&app, "/v1/models/qwen3-tiny/load", &json!({})).await;
    assert_eq!(load.status, StatusCode::OK, "{}", load.text);
    assert_eq!(load.json()["loaded"], true);
    assert_eq!(load.json()["model_type"], "qwen3");
    // Loading warms the model up (the default `warm_up`): its time is reported.
    assert!(
        load.json()["warm_up_seconds"].as_f64().unwrap() > 0.0,
        "{}",
        load.text
    );
    assert!(
        load.json()["load_seconds"].as_f64().unwrap() > 0.0,
        "{}",
        load.text
    );
    assert_eq!(
        get(&app, "/v1/models").await.json()["data"][0]["loaded"],
        true
    );

    let unload = post(&app, "/v1/models/qwen3-tiny/unload", &json!({})).await;
    assert_eq!(unload.status, StatusCode::OK, "{}", unload.text);
    assert_eq!(unload.json(), json!({"id": MODEL, "unloaded": true}));
    assert_eq!(
        get(&app, "/v1/models").await.json()["data"][0]["loaded"],
        false
    );
    let again = post(&app, "/v1/models/qwen3-tiny/unload", &json!({})).await;
    assert_eq!(again.json(), json!({"id": MODEL, "unloaded": false}));
    let missing = post(&app, "/v1/models/nope/load", &json!({})).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    let route = get(&app, "/v1/nothing").await;
    assert_eq!(route.status, StatusCode::NOT_FOUND);
    openai_error(&route);
}

#[tokio::test]
async fn chat_completion_shape_usage_and_timings() {
    let (app, _) = router(config());
    let reply = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 6})),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let body = reply.json();
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["model"], MODEL);
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(choice["message"]["content"].is_string());
    assert_eq!(choice["finish_reason"], "length");
    let usage = &body["usage"];
    assert_eq!(usage["completion_tokens"], 6);
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["prompt_tokens"].as_u64().unwrap() + 6)
    );
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    for key in ["ttft_ms", "prefill_tps", "decode_tps"] {
        assert!(body["timings"][key].as_f64().unwrap() > 0.0, "{key}");
    }
    // max_completion_tokens wins over max_tokens.
    let reply = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"max_completion_tokens": 3})),
    )
    .await;
    assert_eq!(reply.json()["usage"]["completion_tokens"], 3);
}

#[tokio::test]
async fn chat_stream_equals_non_stream_at_temperature_zero() {
    let (app, _) = router(config());
    let whole = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 12})),
    )
    .await
    .json();
    let stream = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 12, "stream": true, "stream_options": {"include_usage": true}})),
    )
    .await;
    assert_eq!(stream.status, StatusCode::OK);
    assert!(stream.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let events = sse(&stream.text);
    assert_eq!(events[0].1["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(events.last().unwrap().1, json!("[DONE]"));
    assert_eq!(
        streamed_content(&events),
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let n = events.len();
    assert_eq!(events[n - 3].1["choices"][0]["finish_reason"], "length");
    assert_eq!(events[n - 2].1["choices"], json!([]));
    assert_same_usage(&events[n - 2].1["usage"], &whole["usage"]);
    // Without include_usage there is no usage chunk.
    let plain = sse(
        &post(&app, "/v1/chat/completions", &chat(json!({"stream": true})))
            .await
            .text,
    );
    assert!(plain.iter().all(|(_, data)| data.get("usage").is_none()));
}

#[tokio::test]
async fn sampling_fields_and_stop() {
    let (app, _) = router(config());
    let sampled = json!({"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "presence_penalty": 0.5, "frequency_penalty": 0.2, "repetition_penalty": 1.1, "seed": 7,
        "max_tokens": 10});
    let a = post(&app, "/v1/chat/completions", &chat(sampled.clone())).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    let b = post(&app, "/v1/chat/completions", &chat(sampled)).await;
    assert_eq!(
        a.json()["choices"][0]["message"]["content"],
        b.json()["choices"][0]["message"]["content"],
        "same seed, same text"
    );

    let bad = post(&app, "/v1/chat/completions", &chat(json!({"top_p": 0}))).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.text);

    // A stop string taken from the greedy answer cuts it right there.
    let full = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 12})),
    )
    .await
    .json();
    let text = full["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let expected = &text[..text.find(&stop).unwrap()];
    for stop_field in [json!(stop), json!([stop, "never-seen"])] {
        let cut = post(
            &app,
            "/v1/chat/completions",
            &chat(json!({"max_tokens": 12, "stop": stop_field})),
        )
        .await
        .json();
        assert_eq!(cut["choices"][0]["message"]["content"], expected);
        assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    }
}

#[tokio::test]
async fn template_fields_tools_thinking_and_formats() {
    let (app, _) = router(config());
    let prompt_tokens = |reply: common::Reply| {
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
        reply.json()["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let base = prompt_tokens(
        post(
            &app,
            "/v1/chat/completions",
            &chat(json!({"max_tokens": 1})),
        )
        .await,
    );
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let with_tools = prompt_tokens(
        post(
            &app,
            "/v1/chat/completions",
            &chat(json!({"max_tokens": 1, "tools": tools.clone()})),
        )
        .await,
    );
    assert!(with_tools > base + 20, "tools reach the template");
    let none = prompt_tokens(
        post(
            &app,
            "/v1/chat/completions",
            &chat(json!({"max_tokens": 1, "tools": tools, "tool_choice": "none"})),
        )
        .await,
    );
    assert_eq!(none, base);
    // Qwen3 writes an empty think block into the prompt when thinking is off.
    let off = prompt_tokens(
        post(
            &app,
            "/v1/chat/completions",
            &chat(json!({"max_tokens": 1, "enable_thinking": false})),
        )
        .await,
    );
    assert!(off > base);
    let kwargs = prompt_tokens(
        post(
            &app,
            "/v1/chat/completions",
            &chat(json!({"max_tokens": 1, "chat_template_kwargs": {"enable_thinking": false}})),
        )
        .await,
    );
    assert_eq!(kwargs, off);
    // Tool-call history in OpenAI's shape renders.
    let history = json!({"max_tokens": 1, "messages": [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]});
    prompt_tokens(post(&app, "/v1/chat/completions", &chat(history)).await);

    let object = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"response_format": {"type": "json_object"}})),
    )
    .await;
    assert_eq!(object.status, StatusCode::OK);
    // A schema that leaves few choices: the random model must still produce a valid value.
    let format = json!({"type": "json_schema", "json_schema": {"name": "colour", "schema": {
        "type": "object", "properties": {"colour": {"enum": ["red", "green"]}},
        "required": ["colour"], "additionalProperties": false}}});
    let schema = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"response_format": format, "max_tokens": 400})),
    )
    .await;
    assert_eq!(schema.status, StatusCode::OK, "{}", schema.text);
    let body = schema.json();
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    let value: Value = serde_json::from_str(content).unwrap();
    assert!(
        ["red", "green"].contains(&value["colour"].as_str().unwrap()),
        "{content}"
    );
    for bad in [
        json!({"type": "xml"}),
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
    ] {
        let reply = post(
            &app,
            "/v1/chat/completions",
            &chat(json!({"response_format": bad})),
        )
        .await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text);
    }
}

#[tokio::test]
async fn request_errors_have_openai_shape() {
    let (app, _) = router(config());
    let malformed = send(
        &app,
        Method::POST,
        "/v1/chat/completions",
        Some("{not json".into()),
        &[],
    )
    .await;
    assert_eq!(malformed.status, StatusCode::BAD_REQUEST);
    assert_eq!(openai_error(&malformed).0, "invalid_request_error");

    let wrong_type = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"temperature": "hot"})),
    )
    .await;
    assert_eq!(wrong_type.status, StatusCode::BAD_REQUEST);
    assert!(openai_error(&wrong_type).2.contains("invalid type"));
    let missing = post(&app, "/v1/chat/completions", &json!({"model": MODEL})).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);

    let unknown_fields = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"user": "x", "frobnicate": {"a": 1}})),
    )
    .await;
    assert_eq!(unknown_fields.status, StatusCode::OK);

    let n2 = post(&app, "/v1/chat/completions", &chat(json!({"n": 2}))).await;
    assert_eq!(n2.status, StatusCode::BAD_REQUEST);
    assert!(openai_error(&n2).2.contains("n must be 1"));

    let image = |url: &str| {
        chat(json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}))
    };
    let remote = post(
        &app,
        "/v1/chat/completions",
        &image("https://example.com/cat.png"),
    )
    .await;
    assert_eq!(remote.status, StatusCode::BAD_REQUEST);
    assert!(openai_error(&remote)
        .2
        .contains("remote image URLs are not supported"));
    let path = post(&app, "/v1/chat/completions", &image("/Users/me/cat.png")).await;
    assert!(openai_error(&path).2.contains("file paths"));
    let inline = post(
        &app,
        "/v1/chat/completions",
        &image("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAIAAAABCAIAAAB7QOjdAAAADUlEQVR4nGP4zwAE/wEHAAH/4iOeWQAAAABJRU5ErkJggg=="),
    )
    .await;
    assert_eq!(inline.status, StatusCode::BAD_REQUEST);
    assert!(openai_error(&inline).2.contains("has no vision"));

    let unknown = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"model": "no-such-model"})),
    )
    .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(openai_error(&unknown).1, "model_not_found");
    let escape = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"model": "../../etc"})),
    )
    .await;
    assert_eq!(escape.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn context_overflow_is_refused_before_compute() {
    let (app, state) = router(common::ServerConfigExt::with(|c| c.max_ctx = Some(16)));
    let long = "word ".repeat(64);
    let started = std::time::Instant::now();
    for stream in [false, true] {
        let reply = post(
            &app,
            "/v1/chat/completions",
            &chat(json!({"stream": stream, "messages": [{"role": "user", "content": long}]})),
        )
        .await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text);
        let body = reply.json();
        assert_eq!(body["error"]["code"], "context_length_exceeded");
        assert_eq!(body["error"]["context_length"], 16);
        assert!(body["error"]["prompt_tokens"].as_u64().unwrap() > 16);
    }
    assert!(started.elapsed().as_secs() < 10);
    assert_eq!(state.engine.queue_depth(), 0);
    let models = get(&app, "/v1/models").await.json();
    assert_eq!(models["data"][0]["context_length"], 16);
}

#[tokio::test]
async fn body_limit_gives_413() {
    let (app, _) = router(common::ServerConfigExt::with(|c| c.max_body_mb = 1));
    let big = "a".repeat(2 * 1024 * 1024);
    let reply = post(
        &app,
        "/v1/chat/completions",
        &chat(json!({"messages": [{"role": "user", "content": big}]})),
    )
    .await;
    assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(openai_error(&reply).1, "request_too_large");
}

#[tokio::test]
async fn default_body_limit_takes_a_2560_png_data_uri() {
    // 2560x2560 RGBA uncompressed is 26 MB; as base64 about 35 MB. It gets past the body limit
    // to the image decoder (zeros are no image; tests/load.rs sends a real 2560² PNG).
    let (app, _) = router(config());
    let payload = "A".repeat(35 * 1024 * 1024);
    let body = chat(json!({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{payload}")}}]}]}));
    let reply = post(&app, "/v1/chat/completions", &body).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(
        openai_error(&reply).2.contains("bad image"),
        "{}",
        reply.text
    );
}

#[tokio::test]
async fn legacy_completions() {
    let (app, _) = router(config());
    let body =
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0});
    let whole = post(&app, "/v1/completions", &body).await;
    assert_eq!(whole.status, StatusCode::OK, "{}", whole.text);
    let whole = whole.json();
    assert_eq!(whole["object"], "text_completion");
    assert_eq!(whole["usage"]["completion_tokens"], 10);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = sse(&post(&app, "/v1/completions", &streamed).await.text);
    let text: String = events
        .iter()
        .filter_map(|(_, d)| d["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
    assert_eq!(events.last().unwrap().1, json!("[DONE]"));
    assert_same_usage(&events[events.len() - 2].1["usage"], &whole["usage"]);

    let mut listed = body.clone();
    listed["prompt"] = json!(["Once upon a time"]);
    assert_eq!(
        post(&app, "/v1/completions", &listed).await.json()["choices"][0]["text"],
        whole["choices"][0]["text"]
    );
    listed["prompt"] = json!({"text": 1});
    assert_eq!(
        post(&app, "/v1/completions", &listed).await.status,
        StatusCode::BAD_REQUEST
    );
}

/// A release structure whose template opens the think block (and raises on a system message
/// after the first).
const QWEN36: &str = "qwen3.6-35b-a3b";

fn qwen36_app() -> axum::Router {
    let config = rmlx_server::ServerConfig {
        models: vec![fixture().join("../releases").join(QWEN36)],
        ..config()
    };
    router(config).0
}

/// A `response_format` answer on a template that opens `<think>` (Qwen3.6 with thinking on):
/// the block is closed first (as for a forced call), so `content` holds the constrained JSON and
/// no reasoning comes back.
#[tokio::test]
async fn response_format_closes_an_open_think_block_first() {
    let (qwen36, app) = (QWEN36, qwen36_app());
    // Schemas random weights finish within the tokens (a string key might never close).
    let booleans = json!({"type": "array", "items": {"type": "boolean"}, "maxItems": 2});
    for schema in [json!({"enum": ["cat", "dog"]}), booleans] {
        let body = json!({"model": qwen36, "max_tokens": 48, "temperature": 0,
            "enable_thinking": true, "messages": [{"role": "user", "content": "A pet?"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "pet", "schema": schema}}});
        let answer = post(&app, "/v1/chat/completions", &body).await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text);
        let answer = answer.json();
        let message = &answer["choices"][0]["message"];
        assert_eq!(answer["choices"][0]["finish_reason"], "stop", "{answer}");
        let value: Value = serde_json::from_str(message["content"].as_str().unwrap())
            .unwrap_or_else(|error| panic!("{error}: {answer}"));
        match schema.get("enum") {
            Some(kinds) => assert!(kinds.as_array().unwrap().contains(&value), "{value}"),
            None => assert!(value.as_array().is_some_and(|v| v.len() <= 2), "{value}"),
        }
        assert!(message.get("reasoning_content").is_none(), "{answer}");
    }
}

/// Agents send system messages mid-conversation (Claude Code's reminders, Codex's developer
/// turns): they fold into the turn beside them, so Qwen3.6's template (which raises on a system
/// message after the first) answers, and each turn's prompt still starts the next one's.
#[tokio::test]
async fn system_messages_mid_conversation_stay_in_place() {
    let (qwen36, app) = (QWEN36, qwen36_app());
    let turn = |messages: Value| json!({"model": qwen36, "messages": messages, "max_tokens": 2, "temperature": 0});
    let first = json!([
        {"role": "system", "content": "You are an agent."},
        {"role": "developer", "content": "Tools are listed below."},
        {"role": "user", "content": "Read notes.txt"},
        {"role": "system", "content": "Tokens left: 9000."}
    ]);
    let answer = post(&app, "/v1/chat/completions", &turn(first.clone())).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text);
    let prompt = answer.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    let mut second = first.as_array().unwrap().clone();
    second.push(json!({"role": "assistant", "content": "ok"}));
    second.push(json!({"role": "user", "content": "Thanks"}));
    second.push(json!({"role": "system", "content": "Tokens left: 8000."}));
    let again = post(&app, "/v1/chat/completions", &turn(Value::Array(second))).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    let usage = &again.json()["usage"];
    // Qwen3.6 resumes from its snapshot at the last message boundary: all of the first turn but
    // its generation prompt (`<|im_start|>assistant\n<think>\n`, re-rendered as a past turn).
    assert!(
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            + 10
            >= prompt,
        "the second turn re-rendered the first one ({prompt} tokens): {usage}"
    );
}

/// A request that does not choose its sampling gets the model's recommendation (the fixture's
/// `generation_config.json`, Qwen3's: temperature 0.6, top-k 20, top-p 0.95): with a seed, the
/// tokens of a request that sets those values, on chat, text completions and Responses (whose
/// response object echoes them); what a request sets wins (temperature 1 over the whole
/// vocabulary draws other tokens).
#[tokio::test]
async fn unset_sampling_is_the_models_recommendation() {
    let (app, _) = router(config());
    let no_eos = json!({"991": -100, "993": -100});
    let recommended = json!({"temperature": 0.6, "top_k": 20, "top_p": 0.95});
    let api_defaults = json!({"temperature": 1.0, "top_k": 0, "top_p": 1.0});
    let with = |mut body: Value, extra: &Value| {
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        body
    };
    let mut differed = 0;
    for seed in 1..=4 {
        let routes = [
            (
                "/v1/chat/completions",
                json!({"model": MODEL, "max_tokens": 12, "seed": seed, "logit_bias": no_eos,
                       "messages": [{"role": "user", "content": "Tell me a story"}]}),
                "/choices/0/message/content",
            ),
            (
                "/v1/completions",
                json!({"model": MODEL, "max_tokens": 12, "seed": seed, "logit_bias": no_eos,
                       "prompt": "Once upon a time"}),
                "/choices/0/text",
            ),
            (
                "/v1/responses",
                json!({"model": MODEL, "max_output_tokens": 12, "seed": seed,
                       "logit_bias": no_eos, "input": "Tell me a story"}),
                "/output/0/content/0/text",
            ),
        ];
        for (route, body, text) in routes {
            let unset = post(&app, route, &body).await.json();
            let set = post(&app, route, &with(body.clone(), &recommended))
                .await
                .json();
            let plain = post(&app, route, &with(body.clone(), &api_defaults))
                .await
                .json();
            let answer = |reply: &Value| reply.pointer(text).cloned().unwrap_or(Value::Null);
            assert!(answer(&unset).is_string(), "{route}: {unset}");
            assert_eq!(answer(&unset), answer(&set), "{route}, seed {seed}");
            differed += usize::from(answer(&unset) != answer(&plain));
            if route == "/v1/responses" {
                assert_eq!(unset["temperature"], json!(0.6), "{unset}");
                assert_eq!(unset["top_p"], json!(0.95), "{unset}");
                assert_eq!(plain["temperature"], json!(1.0), "{plain}");
            }
        }
    }
    assert!(
        differed >= 3,
        "only {differed} of 12 answers changed with the API's defaults"
    );
}
