//! Qwen3.5 / Qwen3.6 prompts and tool calls through the server, on the dense Qwen3.6-27B and the
//! MoE Qwen3.5-35B-A3B release fixtures (random weights, their real chat templates):
//!
//! - a multi-turn conversation with reasoning, calls and tool results renders to the ids
//!   transformers' `apply_chat_template` gives (tests/fixtures/qwen3_5_prompts.json, written by
//!   scripts/fixtures/make_qwen3_5_prompts.py), with thinking on, off (`enable_thinking`, both
//!   spellings; Anthropic `thinking: disabled`) and `preserve_thinking`, through both APIs;
//! - the switches change where the answer starts (reasoning or content);
//! - forced calls (a named function, `required`, Anthropic `tool` / `any`) open the call in the
//!   template's XML (`<tool_call>\n<function=NAME>\n`) and return arguments valid for the schema,
//!   streamed equal to non-streamed.
//!
//! The XML output parser itself (a random model never writes a call) is tested in
//! src/parse.rs and src/xml_calls.rs. Reference: Qwen's Qwen3.5 / Qwen3.6 `chat_template.jinja`.

mod common;

use std::path::PathBuf;

use axum::http::StatusCode;
use common::{post, router, sse};
use rmlx_engine::chat::{ChatTokenizer, TemplateOptions};
use rmlx_server::{convert, ServerConfig};
use serde_json::{json, Map, Value};

const DENSE: &str = "qwen3.6-27b";
const MOE: &str = "qwen3.5-35b-a3b";
const MODELS: [&str; 2] = [DENSE, MOE];

/// Room for the grammar's bounded whitespace that a random model loves.
const MAX_TOKENS: usize = 400;

fn release(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/releases")
        .join(name)
}

fn config() -> ServerConfig {
    ServerConfig {
        models: MODELS.iter().map(|name| release(name)).collect(),
        max_loaded: 2,
        ..common::config()
    }
}

fn golden() -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_5_prompts.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn golden_ids(golden: &Value, model: &str, case: &str) -> Vec<u32> {
    serde_json::from_value(golden["fixtures"][model][case]["ids"].clone()).unwrap()
}

/// The chat-template kwargs of each golden case.
fn case_kwargs(case: &str) -> Map<String, Value> {
    let kwargs = match case {
        "default" => json!({}),
        "thinking_off" => json!({"enable_thinking": false}),
        "preserve_thinking" => json!({"preserve_thinking": true}),
        other => panic!("no case {other}"),
    };
    kwargs.as_object().unwrap().clone()
}

/// Says where two id lists part, decoded, when they do.
fn assert_same_ids(tokenizer: &ChatTokenizer, got: &[u32], want: &[u32], what: &str) {
    if got == want {
        return;
    }
    let at = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    let from = at.saturating_sub(8);
    let show = |ids: &[u32]| {
        tokenizer
            .decode(&ids[from..ids.len().min(at + 24)], false)
            .unwrap()
    };
    panic!(
        "{what}: the ids part at {at} (lengths {} and {}):\n  ours: {:?}\n  transformers: {:?}",
        got.len(),
        want.len(),
        show(got),
        show(want)
    );
}

#[test]
fn the_conversation_renders_to_the_templates_ids() {
    let golden = golden();
    let messages: Vec<Value> = serde_json::from_value(golden["messages"].clone()).unwrap();
    let tools: Vec<Value> = serde_json::from_value(golden["tools"].clone()).unwrap();
    let (messages, _) = convert::openai_messages(&messages, "m").unwrap();
    let tools = convert::openai_tools(Some(&tools), None).unwrap();
    for model in MODELS {
        let tokenizer = ChatTokenizer::from_dir(&release(model)).unwrap();
        for case in ["default", "thinking_off", "preserve_thinking"] {
            let mut extra = case_kwargs(case);
            let options = TemplateOptions {
                add_generation_prompt: true,
                enable_thinking: extra.remove("enable_thinking").and_then(|v| v.as_bool()),
                tools: tools.clone(),
                extra,
            };
            let (text, ids) = tokenizer.encode_chat(&messages, &options).unwrap();
            assert_same_ids(
                &tokenizer,
                &ids,
                &golden_ids(&golden, model, case),
                &format!("{model} {case}"),
            );
            let tail = match case {
                "thinking_off" => "<|im_start|>assistant\n<think>\n\n</think>\n\n",
                _ => "<|im_start|>assistant\n<think>\n",
            };
            assert!(text.ends_with(tail), "{model} {case}: {text:?}");
        }
    }
}

/// An OpenAI request of the golden conversation, with `extra` fields.
fn chat(golden: &Value, model: &str, extra: Value) -> Value {
    let mut body = json!({"model": model, "messages": golden["messages"], "tools": golden["tools"],
                          "max_tokens": 1, "temperature": 0});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

/// An Anthropic request of the golden conversation, with `extra` fields.
fn anthropic(golden: &Value, model: &str, extra: Value) -> Value {
    let mut body = golden["anthropic"].clone();
    body["model"] = json!(model);
    body["max_tokens"] = json!(1);
    body["temperature"] = json!(0);
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

#[tokio::test]
async fn both_apis_prompt_the_templates_ids() {
    let golden = golden();
    let (app, _) = router(config());
    for model in MODELS {
        let length = |case: &str| golden_ids(&golden, model, case).len();
        for (case, extra) in [
            ("default", json!({})),
            ("thinking_off", json!({"enable_thinking": false})),
            (
                "thinking_off",
                json!({"chat_template_kwargs": {"enable_thinking": false}}),
            ),
            (
                "preserve_thinking",
                json!({"chat_template_kwargs": {"preserve_thinking": true}}),
            ),
        ] {
            let reply = post(
                &app,
                "/v1/chat/completions",
                &chat(&golden, model, extra.clone()),
            )
            .await;
            assert_eq!(
                reply.status,
                StatusCode::OK,
                "{model} {extra}: {}",
                reply.text
            );
            assert_eq!(
                reply.json()["usage"]["prompt_tokens"],
                length(case),
                "{model} {extra}"
            );
        }
        for (case, extra) in [
            ("default", json!({})),
            (
                "default",
                json!({"thinking": {"type": "enabled", "budget_tokens": 1024}}),
            ),
            ("thinking_off", json!({"thinking": {"type": "disabled"}})),
        ] {
            let body = anthropic(&golden, model, extra.clone());
            let counted = post(&app, "/v1/messages/count_tokens", &body).await;
            assert_eq!(
                counted.status,
                StatusCode::OK,
                "{model} {extra}: {}",
                counted.text
            );
            assert_eq!(
                counted.json()["input_tokens"],
                length(case),
                "{model} {extra}"
            );
            let reply = post(&app, "/v1/messages", &body).await;
            assert_eq!(
                reply.status,
                StatusCode::OK,
                "{model} {extra}: {}",
                reply.text
            );
            assert_eq!(
                reply.json()["usage"]["input_tokens"],
                length(case),
                "{model} {extra}"
            );
        }
    }
}

#[tokio::test]
async fn thinking_decides_where_the_answer_starts() {
    let (app, _) = router(config());
    for model in MODELS {
        let question = json!([{"role": "user", "content": "Hi"}]);
        let ask = |extra: Value| {
            let mut body = json!({"model": model, "messages": question, "max_tokens": 4,
                                  "temperature": 0});
            for (key, value) in extra.as_object().unwrap() {
                body[key] = value.clone();
            }
            body
        };
        // Thinking on: the prompt opened `<think>`, so the answer starts as reasoning.
        let on = post(&app, "/v1/chat/completions", &ask(json!({})))
            .await
            .json();
        let message = &on["choices"][0]["message"];
        assert!(
            message["reasoning_content"]
                .as_str()
                .is_some_and(|r| !r.is_empty()),
            "{model}: {on}"
        );
        let off = post(
            &app,
            "/v1/chat/completions",
            &ask(json!({"chat_template_kwargs": {"enable_thinking": false}})),
        )
        .await
        .json();
        let message = &off["choices"][0]["message"];
        assert!(message.get("reasoning_content").is_none(), "{model}: {off}");
        assert!(
            message["content"].as_str().is_some_and(|c| !c.is_empty()),
            "{model}: {off}"
        );

        // Anthropic: a thinking block first, or none when thinking is disabled.
        let on = post(&app, "/v1/messages", &ask(json!({}))).await.json();
        assert_eq!(on["content"][0]["type"], "thinking", "{model}: {on}");
        let off = post(
            &app,
            "/v1/messages",
            &ask(json!({"thinking": {"type": "disabled"}})),
        )
        .await
        .json();
        let blocks = off["content"].as_array().unwrap();
        assert!(blocks.iter().all(|b| b["type"] == "text"), "{model}: {off}");
    }
}

fn forecast_schema() -> Value {
    json!({"type": "object",
           "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "metric": {"type": "boolean"}},
           "required": ["unit", "days", "metric"], "additionalProperties": false})
}

fn clock_schema() -> Value {
    json!({"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
           "required": ["zone"], "additionalProperties": false})
}

fn forced_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_forecast", "description": "Weather forecast",
            "parameters": forecast_schema()}},
        {"type": "function", "function": {"name": "get_time", "description": "Current time",
            "parameters": clock_schema()}}])
}

fn anthropic_forced_tools() -> Value {
    json!([
        {"name": "get_forecast", "description": "Weather forecast", "input_schema": forecast_schema()},
        {"name": "get_time", "description": "Current time", "input_schema": clock_schema()}])
}

/// Checks `arguments` against the schema of tool `name`.
fn assert_valid_call(name: &str, arguments: &Value) {
    let mut keys: Vec<&String> = arguments.as_object().unwrap().keys().collect();
    keys.sort();
    match name {
        "get_forecast" => {
            assert_eq!(keys, ["days", "metric", "unit"], "{arguments}");
            let unit = arguments["unit"].as_str().unwrap();
            assert!(["celsius", "fahrenheit"].contains(&unit), "{arguments}");
            let days = arguments["days"].as_i64().expect("an integer");
            assert!((1..=7).contains(&days), "{arguments}");
            assert!(arguments["metric"].is_boolean(), "{arguments}");
        }
        "get_time" => {
            assert_eq!(keys, ["zone"], "{arguments}");
            assert!(["UTC", "CET"].contains(&arguments["zone"].as_str().unwrap()));
        }
        other => panic!("`{other}` is not an offered tool"),
    }
}

fn forced_chat(model: &str, tool_choice: Value, extra: Value) -> Value {
    let mut body = json!({"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": "Forecast for Paris?"}],
        "tools": forced_tools(), "tool_choice": tool_choice});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

/// The call of a chat completion, streamed (one whole delta) or not.
fn chat_call(reply: &common::Reply, stream: bool) -> Value {
    if stream {
        let calls: Vec<Value> = sse(&reply.text)
            .into_iter()
            .filter_map(|(_, data)| data["choices"][0]["delta"]["tool_calls"].get(0).cloned())
            .collect();
        assert_eq!(calls.len(), 1, "{}", reply.text);
        calls[0].clone()
    } else {
        let body = reply.json();
        assert_eq!(body["choices"][0]["finish_reason"], "tool_calls", "{body}");
        let calls = body["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap();
        assert_eq!(calls.len(), 1, "{body}");
        calls[0].clone()
    }
}

#[tokio::test]
async fn forced_calls_open_the_xml_call_and_return_valid_arguments() {
    let golden = golden();
    let (app, _) = router(config());
    for model in MODELS {
        // The prompt of a forced call of the golden's get_weather: the default rendering, an
        // empty think block and `<tool_call>\n<function=get_weather>\n`, as transformers renders.
        let body = json!({"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": "Forecast for Paris?"}],
            "tools": [golden["tools"][0]],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
        let reply = post(&app, "/v1/chat/completions", &body).await.json();
        let forced = golden_ids(&golden, model, "forced").len();
        assert_eq!(reply["usage"]["prompt_tokens"], forced, "{model}: {reply}");

        let named = json!({"type": "function", "function": {"name": "get_forecast"}});
        let mut whole = Value::Null;
        for stream in [false, true] {
            let reply = post(
                &app,
                "/v1/chat/completions",
                &forced_chat(model, named.clone(), json!({"stream": stream})),
            )
            .await;
            assert_eq!(reply.status, StatusCode::OK, "{model}: {}", reply.text);
            let call = chat_call(&reply, stream);
            assert_eq!(call["function"]["name"], "get_forecast", "{model}");
            let arguments: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            assert_valid_call("get_forecast", &arguments);
            if stream {
                assert_eq!(call["function"], whole, "{model}: streamed equals whole");
            } else {
                whole = call["function"].clone();
            }
        }
        // The same tool left to the model has a shorter prompt: the call's opening is prompt.
        let auto = post(
            &app,
            "/v1/chat/completions",
            &forced_chat(
                model,
                json!("auto"),
                json!({"max_tokens": 1, "tools": [forced_tools()[0]]}),
            ),
        )
        .await
        .json();
        let named_reply = post(
            &app,
            "/v1/chat/completions",
            &forced_chat(model, named, json!({})),
        )
        .await
        .json();
        let prompt_tokens = |body: &Value| body["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(
            prompt_tokens(&named_reply) > prompt_tokens(&auto),
            "{model}"
        );

        for stream in [false, true] {
            let reply = post(
                &app,
                "/v1/chat/completions",
                &forced_chat(model, json!("required"), json!({"stream": stream})),
            )
            .await;
            assert_eq!(reply.status, StatusCode::OK, "{model}: {}", reply.text);
            let call = chat_call(&reply, stream);
            let arguments = serde_json::from_str(call["function"]["arguments"].as_str().unwrap());
            assert_valid_call(
                call["function"]["name"].as_str().unwrap(),
                &arguments.unwrap(),
            );
        }
    }
}

#[tokio::test]
async fn anthropic_forced_tools_on_the_xml_family() {
    let (app, _) = router(config());
    for model in MODELS {
        let message = |choice: Value, stream: bool| {
            json!({"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
                "messages": [{"role": "user", "content": "Forecast for Paris?"}],
                "tools": anthropic_forced_tools(), "tool_choice": choice})
        };
        for choice in [
            json!({"type": "tool", "name": "get_forecast"}),
            json!({"type": "any"}),
        ] {
            let body = message(choice.clone(), false);
            let reply = post(&app, "/v1/messages", &body).await;
            assert_eq!(reply.status, StatusCode::OK, "{model}: {}", reply.text);
            let whole = reply.json();
            assert_eq!(whole["stop_reason"], "tool_use", "{model}: {whole}");
            let blocks = whole["content"].as_array().unwrap();
            assert_eq!(blocks.len(), 1, "{model}: {whole}");
            let block = &blocks[0];
            assert_eq!(block["type"], "tool_use");
            assert_valid_call(block["name"].as_str().unwrap(), &block["input"]);
            if choice["type"] == "tool" {
                assert_eq!(block["name"], "get_forecast");
            }
            let counted = post(&app, "/v1/messages/count_tokens", &body).await.json();
            assert_eq!(
                counted["input_tokens"], whole["usage"]["input_tokens"],
                "{model}"
            );

            let streamed = post(&app, "/v1/messages", &message(choice, true)).await;
            let events = sse(&streamed.text);
            let start = events
                .iter()
                .find(|(name, _)| name.as_deref() == Some("content_block_start"))
                .unwrap();
            assert_eq!(start.1["content_block"]["name"], block["name"], "{model}");
            let delta = events
                .iter()
                .find(|(name, _)| name.as_deref() == Some("content_block_delta"))
                .unwrap();
            let input: Value =
                serde_json::from_str(delta.1["delta"]["partial_json"].as_str().unwrap()).unwrap();
            assert_eq!(input, block["input"], "{model}: streamed equals whole");
        }
    }
}
