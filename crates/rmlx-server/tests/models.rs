//! Model residency through the API: the engine's LRU keeps at most `--max-loaded` models,
//! `/v1/models` reports what the engine holds, and unload frees a model.

mod common;

use axum::http::StatusCode;
use common::*;
use serde_json::{json, Value};

const OTHER: &str = "qwen3-tiny-4bit";

fn two_models(max_loaded: usize) -> rmlx_server::ServerConfig {
    ServerConfigExt::with(|c| {
        c.models.push(fixture().with_file_name(OTHER));
        c.max_loaded = max_loaded;
    })
}

/// `{id: loaded}` from `/v1/models`.
async fn loaded(app: &axum::Router) -> Vec<(String, bool)> {
    let models = get(app, "/v1/models").await.json();
    models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap().to_string(), m["loaded"] == true))
        .collect()
}

fn chat_with(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
           "temperature": 0})
}

#[tokio::test]
async fn least_recently_used_model_is_evicted() {
    let (app, _) = router(two_models(1));
    assert_eq!(
        loaded(&app).await,
        [(MODEL.into(), false), (OTHER.into(), false)]
    );
    let reply = post(&app, "/v1/chat/completions", &chat_with(MODEL)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    assert_eq!(
        loaded(&app).await,
        [(MODEL.into(), true), (OTHER.into(), false)]
    );
    // Using the other model evicts the first (one resident at most).
    let reply = post(&app, "/v1/chat/completions", &chat_with(OTHER)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    assert_eq!(
        loaded(&app).await,
        [(MODEL.into(), false), (OTHER.into(), true)]
    );
    let unloaded = post(&app, &format!("/v1/models/{MODEL}/unload"), &json!({})).await;
    assert_eq!(unloaded.json(), json!({"id": MODEL, "unloaded": false}));
}

#[tokio::test]
async fn max_loaded_keeps_both_until_unloaded() {
    let (app, _) = router(two_models(2));
    for model in [MODEL, OTHER] {
        let load = post(&app, &format!("/v1/models/{model}/load"), &json!({})).await;
        assert_eq!(load.status, StatusCode::OK, "{}", load.text);
        assert_eq!(load.json()["loaded"], true);
    }
    assert_eq!(
        loaded(&app).await,
        [(MODEL.into(), true), (OTHER.into(), true)]
    );
    let unload = post(&app, &format!("/v1/models/{OTHER}/unload"), &json!({})).await;
    assert_eq!(unload.json(), json!({"id": OTHER, "unloaded": true}));
    assert_eq!(
        loaded(&app).await,
        [(MODEL.into(), true), (OTHER.into(), false)]
    );
    assert_eq!(
        post(&app, "/v1/models/nope/unload", &json!({}))
            .await
            .status,
        StatusCode::NOT_FOUND
    );
}

/// `/v1/models` says which checkpoints ship a draft head (`mtp.*` of Qwen3.5 / 3.6) before and
/// after loading, so clients can offer `--speculative mtp` only where it can draft.
#[tokio::test]
async fn models_say_which_ship_a_draft_head() {
    const HEADED: &str = "qwen3.6-35b-a3b";
    let config = ServerConfigExt::with(|c| {
        c.models
            .push(fixture().with_file_name("releases").join(HEADED));
    });
    let (app, _) = router(config);
    let heads = |models: Value| -> Vec<(String, bool)> {
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["id"].as_str().unwrap().into(), m["draft_head"] == true))
            .collect()
    };
    let want = [(MODEL.to_string(), false), (HEADED.to_string(), true)];
    assert_eq!(heads(get(&app, "/v1/models").await.json()), want);
    let reply = post(&app, "/v1/chat/completions", &chat_with(HEADED)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let models = get(&app, "/v1/models").await.json();
    assert_eq!(models["data"][1]["loaded"], true);
    assert_eq!(heads(models), want);
}

/// With `--draft-model`, every entry names the draft model that drafts for it; without, none.
#[tokio::test]
async fn models_name_the_paired_draft_model() {
    let (app, _) = router(ServerConfigExt::with(|_| {}));
    let models = get(&app, "/v1/models").await.json();
    assert_eq!(models["data"][0]["draft_model"], Value::Null);
    let draft = fixture().with_file_name("releases").join("qwen3-0.6b");
    let config = ServerConfigExt::with(|c| c.draft_model = Some(draft.clone()));
    let (app, _) = router(config);
    let models = get(&app, "/v1/models").await.json();
    assert_eq!(
        models["data"][0]["draft_model"],
        json!(draft.display().to_string())
    );
    // The model loads paired with it (the fixtures share a tokenizer) and answers.
    let mut chat = chat_with(MODEL);
    chat["max_tokens"] = json!(6);
    let reply = post(&app, "/v1/chat/completions", &chat).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
}
