//! Images through both APIs onto the Qwen3-VL and Gemma 4 fixtures: every mlx-vlm golden
//! conversation (one image, two in one turn, one in each of two turns, system prompt first,
//! text only) gives the golden prompt length in usage and in count_tokens, and greedy answers
//! equal the golden ids' text.

mod common;

use std::path::PathBuf;

use base64::Engine as _;
use common::{post, router};
use rmlx_engine::chat::ChatTokenizer;
use rmlx_server::ServerConfig;
use serde_json::{json, Value};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The vision fixtures, each served under its folder name.
const FAMILIES: [&str; 2] = ["qwen3-vl-tiny", "gemma4-tiny"];

fn golden(model: &str) -> Value {
    let text = std::fs::read_to_string(fixtures().join(model).join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn vision_config() -> ServerConfig {
    ServerConfig {
        models: FAMILIES.iter().map(|name| fixtures().join(name)).collect(),
        ..common::config()
    }
}

/// The base64 of a golden image by its name.
fn image_b64(golden: &Value, name: &str) -> String {
    let file = golden["preprocessed_images"][name]["file"]
        .as_str()
        .unwrap();
    base64::engine::general_purpose::STANDARD.encode(std::fs::read(fixtures().join(file)).unwrap())
}

/// A golden message's content in each API's shape.
fn content(golden: &Value, content: &Value, anthropic: bool) -> Value {
    let Some(parts) = content.as_array() else {
        return content.clone();
    };
    Value::Array(
        parts
            .iter()
            .map(|part| match part["type"].as_str().unwrap() {
                "image" => {
                    let data = image_b64(golden, part["image"].as_str().unwrap());
                    if anthropic {
                        json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}})
                    } else {
                        json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{data}")}})
                    }
                }
                _ => part.clone(),
            })
            .collect(),
    )
}

#[tokio::test]
async fn every_golden_conversation_has_the_golden_prompt_through_both_apis() {
    let (app, _) = router(vision_config());
    for model in FAMILIES {
        let golden = golden(model);
        for case in golden["cases"].as_array().unwrap() {
            let name = format!("{model}/{}", case["name"]);
            let want = case["input_ids"].as_array().unwrap().len() as u64;
            let messages = case["messages"].as_array().unwrap();
            let openai: Vec<Value> = messages
                .iter()
                .map(|m| json!({"role": m["role"], "content": content(&golden, &m["content"], false)}))
                .collect();
            let reply = post(
                &app,
                "/v1/chat/completions",
                &json!({"model": model, "messages": openai, "max_tokens": 4, "temperature": 0}),
            )
            .await;
            assert_eq!(reply.status, 200, "{name}: {}", reply.text);
            assert_eq!(reply.json()["usage"]["prompt_tokens"], want, "{name}");

            let system = messages
                .iter()
                .find(|m| m["role"] == "system")
                .map(|m| m["content"].clone());
            let turns: Vec<Value> = messages
                .iter()
                .filter(|m| m["role"] != "system")
                .map(|m| json!({"role": m["role"], "content": content(&golden, &m["content"], true)}))
                .collect();
            let mut body =
                json!({"model": model, "messages": turns, "max_tokens": 4, "temperature": 0});
            if let Some(system) = system {
                body["system"] = system;
            }
            let reply = post(&app, "/v1/messages", &body).await;
            assert_eq!(reply.status, 200, "{name}: {}", reply.text);
            assert_eq!(reply.json()["usage"]["input_tokens"], want, "{name}");
            // count_tokens counts each image as its whole block, without running anything.
            let reply = post(&app, "/v1/messages/count_tokens", &body).await;
            assert_eq!(reply.status, 200, "{name}: {}", reply.text);
            assert_eq!(reply.json()["input_tokens"], want, "{name}");
        }
    }
}

#[tokio::test]
async fn greedy_answers_about_an_image_match_the_golden_and_the_mirror_differs() {
    let (app, _) = router(vision_config());
    for model in FAMILIES {
        let golden = golden(model);
        let tokenizer = ChatTokenizer::from_dir(&fixtures().join(model)).unwrap();
        let mut texts = Vec::new();
        for name in ["single_image", "single_image_mirrored"] {
            let case = golden["cases"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["name"] == name)
                .unwrap();
            let ids: Vec<u32> = serde_json::from_value(case["greedy_ids"].clone()).unwrap();
            // The server stops at the first EOS id, as a client would want.
            let end = ids
                .iter()
                .position(|id| tokenizer.eos_token_ids().contains(id))
                .unwrap_or(ids.len());
            let want = tokenizer.decode(&ids[..end], false).unwrap();
            let messages: Vec<Value> = case["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| json!({"role": m["role"], "content": content(&golden, &m["content"], false)}))
                .collect();
            let reply = post(
                &app,
                "/v1/chat/completions",
                &json!({"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}),
            )
            .await;
            assert_eq!(reply.status, 200, "{}", reply.text);
            let text = reply.json()["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string();
            assert_eq!(text, want, "{model}/{name}");
            texts.push(text);
        }
        assert_ne!(texts[0], texts[1], "{model}");
    }
}
