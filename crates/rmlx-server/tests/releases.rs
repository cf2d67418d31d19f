//! The MoE release fixtures (Qwen3-30B-A3B as released and its mlx-lm 4-bit conversion) through
//! the server: greedy answers equal the mlx-lm golden through both APIs, a repeated
//! conversation is served from the prefix cache with the same answer, and `/v1/models`
//! reports the structure and a fits figure that counts the KV at `--max-ctx`.

mod common;

use std::path::PathBuf;

use common::{get, post, router};
use rmlx_engine::chat::ChatTokenizer;
use rmlx_server::ServerConfig;
use serde_json::{json, Value};

const MOE: [&str; 2] = ["qwen3-30b-a3b", "qwen3-30b-a3b-4bit"];

fn release(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/releases")
        .join(name)
}

fn config() -> ServerConfig {
    ServerConfig {
        models: MOE.iter().map(|name| release(name)).collect(),
        ..common::config()
    }
}

/// The golden case `name` of a release fixture.
fn golden_case(release_name: &str, name: &str) -> Value {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(release(release_name).join("golden.json")).unwrap(),
    )
    .unwrap();
    golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|case| case["name"] == name)
        .unwrap()
        .clone()
}

/// The gradient test picture as an OpenAI image part.
fn gradient_part() -> Value {
    use base64::Engine as _;
    let png = std::fs::read(release("qwen3-0.6b").join("../../vision-images/gradient_64x48.png"))
        .unwrap();
    let data = base64::engine::general_purpose::STANDARD.encode(png);
    json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{data}")}})
}

/// A greedy answer about the gradient picture: (prompt tokens, reasoning + content).
async fn answer_about_the_gradient(app: &axum::Router, model: &str) -> (Value, String) {
    let reply = post(
        app,
        "/v1/chat/completions",
        &json!({
            "model": model,
            "messages": [{"role": "user", "content": [
                gradient_part(),
                {"type": "text", "text": "What is in this image?"},
            ]}],
            "max_tokens": 16,
            "temperature": 0,
        }),
    )
    .await;
    assert_eq!(reply.status, 200, "{model}: {}", reply.text);
    let json = reply.json();
    let text = answer_text(&json);
    (json["usage"]["prompt_tokens"].clone(), text)
}

/// A chat completion's reasoning and content, as one text (the golden ids decode to both).
fn answer_text(json: &Value) -> String {
    let message = &json["choices"][0]["message"];
    format!(
        "{}{}",
        message["reasoning_content"].as_str().unwrap_or_default(),
        message["content"].as_str().unwrap_or_default()
    )
}

/// The golden greedy text up to the first EOS, as a client receives it.
fn golden_answer(name: &str, case: &Value) -> String {
    let tokenizer = ChatTokenizer::from_dir(&release(name)).unwrap();
    let ids: Vec<u32> = serde_json::from_value(case["greedy_ids"].clone()).unwrap();
    let end = ids
        .iter()
        .position(|id| tokenizer.eos_token_ids().contains(id))
        .unwrap_or(ids.len());
    tokenizer.decode(&ids[..end], false).unwrap()
}

#[tokio::test]
async fn moe_releases_answer_like_mlx_lm_through_both_apis_and_the_prefix_cache() {
    let (app, _) = router(config());
    for name in MOE {
        let case = golden_case(name, "plain_user");
        let want = golden_answer(name, &case);
        let prompt_tokens = case["input_ids"].as_array().unwrap().len();
        let body = json!({
            "model": name,
            "messages": case["messages"],
            "max_tokens": 24,
            "temperature": 0,
        });
        let mut cached = Vec::new();
        for _ in 0..2 {
            let reply = post(&app, "/v1/chat/completions", &body).await;
            assert_eq!(reply.status, 200, "{name}: {}", reply.text);
            let json = reply.json();
            let text = answer_text(&json);
            assert_eq!(text, want, "{name}");
            assert_eq!(json["usage"]["prompt_tokens"], prompt_tokens, "{name}");
            cached.push(
                json["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0),
            );
        }
        assert_eq!(cached[0], 0, "{name}: the first request has nothing cached");
        assert!(
            cached[1] as usize >= prompt_tokens - 1,
            "{name}: the repeat reused {} of {prompt_tokens} tokens",
            cached[1]
        );

        let anthropic = post(
            &app,
            "/v1/messages",
            &json!({"model": name, "messages": case["messages"], "max_tokens": 24, "temperature": 0}),
        )
        .await;
        assert_eq!(anthropic.status, 200, "{name}: {}", anthropic.text);
        let blocks = anthropic.json()["content"].clone();
        let text: String = blocks
            .as_array()
            .unwrap()
            .iter()
            .map(|block| {
                block["text"]
                    .as_str()
                    .or(block["thinking"].as_str())
                    .unwrap_or_default()
                    .to_string()
            })
            .collect();
        assert_eq!(text, want, "{name} (Anthropic)");
    }
}

#[tokio::test]
async fn models_list_shows_the_moe_structure_and_fits_with_the_kv_at_max_ctx() {
    let (app, _) = router(config());
    let listed = get(&app, "/v1/models").await.json();
    for name in MOE {
        let entry = listed["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|entry| entry["id"] == name)
            .unwrap_or_else(|| panic!("{name} not listed: {listed}"));
        assert_eq!(entry["model_type"], "qwen3_moe");
        assert_eq!(
            entry["structure"],
            "qwen3_moe, MoE 16 experts top-8, untied lm_head"
        );
        assert!(entry["fits"].is_string(), "{entry}");
        // The whole 40960-token context fits this tiny checkpoint.
        assert_eq!(entry["max_context_fits"], 40960, "{entry}");
    }
    // At the model's own context (40960 positions) the KV alone is 40960 × 2 layers × K and V
    // × 1 head × 16 × 2 bytes = 5.2 MB: more than the weights of this tiny checkpoint.
    let dir = release(MOE[0]);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let weights = rmlx_engine::runtime::memory_needed(&dir).unwrap();
    let serving = |max_ctx, rows| rmlx_engine::runtime::Serving {
        max_ctx,
        rows,
        ..Default::default()
    };
    let needed = |dir: &std::path::Path, config: &Value, max_ctx, rows| {
        rmlx_engine::runtime::memory_needed_at(dir, config, &serving(max_ctx, rows)).unwrap()
    };
    let full = needed(&dir, &config, None, 8);
    assert_eq!(full - weights, 40960 * 2 * 2 * 16 * 2);
    let capped = needed(&dir, &config, Some(1024), 8);
    assert_eq!(capped - weights, 1024 * 2 * 2 * 16 * 2);
    // Each row of a batch carries its own Gated DeltaNet state; the rows share the KV.
    let dir = release("qwen3.5-0.8b");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let state = rmlx_engine::models::structure::recurrent_state_bytes(&config);
    assert!(state > 0);
    let one = needed(&dir, &config, Some(1024), 1);
    let eight = needed(&dir, &config, Some(1024), 8);
    assert_eq!(eight - one, 7 * state);
}

/// Qwen3-VL-30B-A3B (`qwen3_vl_moe`, Hugging Face layout): a picture through the OpenAI API
/// gives the mlx-vlm golden's prompt length and greedy answer.
#[tokio::test]
async fn vision_moe_release_answers_about_an_image_like_mlx_vlm() {
    let name = "qwen3-vl-30b-a3b-instruct";
    let (app, _) = router(ServerConfig {
        models: vec![release(name)],
        ..common::config()
    });
    let case = golden_case(name, "single_image");
    let (prompt_tokens, text) = answer_about_the_gradient(&app, name).await;
    assert_eq!(prompt_tokens, case["input_ids"].as_array().unwrap().len());
    assert_eq!(text, golden_answer(name, &case));
}

/// Gemma 4 E2B (audio tower set aside) and 26B-A4B (experts, k_eq_v) answer about a picture
/// like mlx-vlm; an audio part gets a 400 that says what is unsupported, through both APIs.
#[tokio::test]
async fn gemma_releases_answer_images_and_refuse_audio_clearly() {
    let names = ["gemma-4-e2b-it", "gemma-4-26b-a4b-it"];
    let (app, _) = router(ServerConfig {
        models: names.iter().map(|name| release(name)).collect(),
        ..common::config()
    });
    for name in names {
        let case = golden_case(name, "single_image");
        let (prompt_tokens, text) = answer_about_the_gradient(&app, name).await;
        assert_eq!(
            prompt_tokens,
            case["input_ids"].as_array().unwrap().len(),
            "{name}"
        );
        assert_eq!(text, golden_answer(name, &case), "{name}");

        let audio = post(
            &app,
            "/v1/chat/completions",
            &json!({"model": name, "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            ]}]}),
        )
        .await;
        assert_eq!(audio.status, 400, "{}", audio.text);
        assert!(
            audio.text.contains("audio input is not supported"),
            "{}",
            audio.text
        );
        let audio = post(
            &app,
            "/v1/messages",
            &json!({"model": name, "max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "audio", "source": {"type": "base64", "data": "UklGRg=="}},
            ]}]}),
        )
        .await;
        assert_eq!(audio.status, 400, "{}", audio.text);
        assert!(
            audio.text.contains("audio input is not supported"),
            "{}",
            audio.text
        );
    }
}

/// Every release fixture through `/v1/chat/completions`: the golden's prompt length and its
/// greedy answer (text releases: the plain question; vision releases: the gradient picture).
#[tokio::test]
async fn every_release_answers_like_its_reference_through_the_server() {
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(release("releases.json")).unwrap()).unwrap();
    let names: Vec<String> = index.as_object().unwrap().keys().cloned().collect();
    assert_eq!(names.len(), 27);
    let (app, _) = router(ServerConfig {
        models: names.iter().map(|name| release(name)).collect(),
        ..common::config()
    });
    for name in &names {
        let vision =
            index[name]["model_type"] != "qwen3" && index[name]["model_type"] != "qwen3_moe";
        let (case, prompt_tokens, text) = if vision {
            let case = golden_case(name, "single_image");
            let (tokens, text) = answer_about_the_gradient(&app, name).await;
            (case, tokens, text)
        } else {
            let case = golden_case(name, "plain_user");
            let reply = post(
                &app,
                "/v1/chat/completions",
                &json!({"model": name, "messages": case["messages"], "max_tokens": 24, "temperature": 0}),
            )
            .await;
            assert_eq!(reply.status, 200, "{name}: {}", reply.text);
            let json = reply.json();
            let text = answer_text(&json);
            (case, json["usage"]["prompt_tokens"].clone(), text)
        };
        assert_eq!(
            prompt_tokens,
            case["input_ids"].as_array().unwrap().len(),
            "{name}"
        );
        assert_eq!(text, golden_answer(name, &case), "{name}");
    }
}
