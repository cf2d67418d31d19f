//! Forced tool calls in-process on the random-weight fixture, which never writes a call of its
//! own: OpenAI `tool_choice` "required" / a named function and Anthropic `any` / `tool` give a
//! call of an offered tool whose arguments satisfy its schema, streamed equal to non-streamed;
//! a call cut short by max_tokens is no call; Anthropic's assistant prefill is prompt.

mod common;

use axum::http::StatusCode;
use common::*;
use rmlx_engine::chat::{ChatTokenizer, TemplateOptions};
use serde_json::{json, Value};

/// Room for the grammar's whitespace (up to 32 characters a gap) that the random model loves.
const MAX_TOKENS: usize = 400;

fn forecast_schema() -> Value {
    json!({"type": "object",
           "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": false})
}

fn clock_schema() -> Value {
    json!({"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
           "required": ["zone"], "additionalProperties": false})
}

/// Checks `arguments` against the schema of tool `name`.
fn assert_valid_call(name: &str, arguments: &Value) {
    let keys = |value: &Value| {
        let mut keys: Vec<String> = value.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        keys
    };
    match name {
        "get_forecast" => {
            assert_eq!(keys(arguments), ["days", "unit"], "{arguments}");
            let unit = arguments["unit"].as_str().unwrap();
            assert!(["celsius", "fahrenheit"].contains(&unit), "{arguments}");
            let days = arguments["days"].as_i64().expect("an integer");
            assert!((1..=7).contains(&days), "{arguments}");
        }
        "get_time" => {
            assert_eq!(keys(arguments), ["zone"], "{arguments}");
            assert!(["UTC", "CET"].contains(&arguments["zone"].as_str().unwrap()));
        }
        other => panic!("`{other}` is not an offered tool"),
    }
}

fn openai_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_forecast", "description": "Weather forecast",
            "parameters": forecast_schema()}},
        {"type": "function", "function": {"name": "get_time", "description": "Current time",
            "parameters": clock_schema()}}])
}

fn anthropic_tools() -> Value {
    json!([
        {"name": "get_forecast", "description": "Weather forecast", "input_schema": forecast_schema()},
        {"name": "get_time", "description": "Current time", "input_schema": clock_schema()}])
}

fn chat(tool_choice: Value, extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": "Forecast for Paris?"}],
        "tools": openai_tools(), "tool_choice": tool_choice});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

fn message(tool_choice: Value, extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": "Forecast for Paris?"}],
        "tools": anthropic_tools(), "tool_choice": tool_choice});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

fn named_function() -> Value {
    json!({"type": "function", "function": {"name": "get_forecast"}})
}

#[tokio::test]
async fn openai_named_function_is_called_and_round_trips() {
    let (app, _) = router(config());
    let reply = post(
        &app,
        "/v1/chat/completions",
        &chat(named_function(), json!({})),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let body = reply.json();
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
    assert_eq!(choice["message"]["content"], Value::Null);
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(calls[0]["function"]["name"], "get_forecast");
    let arguments_text = calls[0]["function"]["arguments"].as_str().unwrap();
    let arguments: Value = serde_json::from_str(arguments_text).unwrap();
    assert_valid_call("get_forecast", &arguments);
    // The opened call is prompt: more prompt tokens than the same tool left to the model.
    let auto = post(
        &app,
        "/v1/chat/completions",
        &chat(
            json!("auto"),
            json!({"max_tokens": 1, "tools": [openai_tools()[0]]}),
        ),
    )
    .await
    .json();
    let prompt_tokens = |body: &Value| body["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens(&body) > prompt_tokens(&auto));

    // The tool's result goes back and the model answers in text.
    let turn = chat(
        json!("auto"),
        json!({"max_tokens": 8, "messages": [
            {"role": "user", "content": "Forecast for Paris?"},
            choice["message"].clone(),
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 21 C"}]}),
    );
    let answer = post(&app, "/v1/chat/completions", &turn).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text);
    let answer = answer.json();
    assert!(answer["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    assert!(prompt_tokens(&answer) > prompt_tokens(&body));
}

#[tokio::test]
async fn openai_forced_call_streams_as_tool_call_deltas() {
    let (app, _) = router(config());
    let whole = post(
        &app,
        "/v1/chat/completions",
        &chat(named_function(), json!({})),
    )
    .await
    .json();
    let reply = post(
        &app,
        "/v1/chat/completions",
        &chat(named_function(), json!({"stream": true})),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let events = sse(&reply.text);
    let calls: Vec<&Value> = events
        .iter()
        .filter_map(|(_, data)| data["choices"][0]["delta"]["tool_calls"].get(0))
        .collect();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["index"], 0);
    let expected = &whole["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(calls[0]["function"], *expected);
    let content: String = events
        .iter()
        .filter_map(|(_, data)| data["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "");
    let n = events.len();
    assert_eq!(events[n - 2].1["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(events[n - 1].1, "[DONE]");
}

#[tokio::test]
async fn openai_required_calls_one_of_the_tools() {
    let (app, _) = router(config());
    for stream in [false, true] {
        let reply = post(
            &app,
            "/v1/chat/completions",
            &chat(json!("required"), json!({"stream": stream})),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
        let call = if stream {
            sse(&reply.text)
                .into_iter()
                .find_map(|(_, data)| data["choices"][0]["delta"]["tool_calls"].get(0).cloned())
                .expect("a tool call delta")
        } else {
            reply.json()["choices"][0]["message"]["tool_calls"][0].clone()
        };
        let name = call["function"]["name"].as_str().unwrap();
        let arguments = serde_json::from_str(call["function"]["arguments"].as_str().unwrap());
        assert_valid_call(name, &arguments.unwrap());
    }
}

#[tokio::test]
async fn a_call_cut_short_is_length_without_a_call() {
    let (app, _) = router(config());
    let body = post(
        &app,
        "/v1/chat/completions",
        &chat(named_function(), json!({"max_tokens": 3})),
    )
    .await
    .json();
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice["message"].get("tool_calls").is_none(), "{body}");
    assert_eq!(choice["message"]["content"], "");
    let stream = post(
        &app,
        "/v1/chat/completions",
        &chat(named_function(), json!({"max_tokens": 3, "stream": true})),
    )
    .await;
    let events = sse(&stream.text);
    assert!(events
        .iter()
        .all(|(_, data)| data["choices"][0]["delta"].get("tool_calls").is_none()));
    assert_eq!(
        events[events.len() - 2].1["choices"][0]["finish_reason"],
        "length"
    );

    let cut = post(
        &app,
        "/v1/messages",
        &message(json!({"type": "any"}), json!({"max_tokens": 3})),
    )
    .await
    .json();
    assert_eq!(cut["stop_reason"], "max_tokens");
    let blocks = cut["content"].as_array().unwrap();
    assert!(blocks.iter().all(|b| b["type"] != "tool_use"), "{cut}");
}

#[tokio::test]
async fn a_required_call_without_tools_is_a_bad_request() {
    let (app, _) = router(config());
    let mut body = chat(json!("required"), json!({}));
    body.as_object_mut().unwrap().remove("tools");
    let reply = post(&app, "/v1/chat/completions", &body).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(openai_error(&reply).2.contains("tool_choice"));
    let mut body = message(json!({"type": "any"}), json!({}));
    body.as_object_mut().unwrap().remove("tools");
    let reply = post(&app, "/v1/messages", &body).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(anthropic_error(&reply).1.contains("tool_choice"));
}

#[tokio::test]
async fn anthropic_named_tool_is_used_streamed_and_not() {
    let (app, _) = router(config());
    let choice = json!({"type": "tool", "name": "get_forecast"});
    let reply = post(&app, "/v1/messages", &message(choice.clone(), json!({}))).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let whole = reply.json();
    assert_eq!(whole["stop_reason"], "tool_use", "{whole}");
    let blocks = whole["content"].as_array().unwrap();
    assert_eq!(blocks.len(), 1, "{whole}");
    assert_eq!(blocks[0]["type"], "tool_use");
    assert!(blocks[0]["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(blocks[0]["name"], "get_forecast");
    assert_valid_call("get_forecast", &blocks[0]["input"]);

    let reply = post(
        &app,
        "/v1/messages",
        &message(choice, json!({"stream": true})),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let events = sse(&reply.text);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let start = &events[1].1["content_block"];
    assert_eq!(
        (start["type"].as_str(), start["name"].as_str()),
        (Some("tool_use"), Some("get_forecast"))
    );
    let delta = &events[3].1["delta"];
    assert_eq!(delta["type"], "input_json_delta");
    let input: Value = serde_json::from_str(delta["partial_json"].as_str().unwrap()).unwrap();
    assert_eq!(input, blocks[0]["input"]);
    assert_eq!(events[5].1["delta"]["stop_reason"], "tool_use");

    // The tool's result goes back and the model answers in text.
    let turn = message(
        json!({"type": "auto"}),
        json!({"max_tokens": 8, "messages": [
            {"role": "user", "content": "Forecast for Paris?"},
            {"role": "assistant", "content": whole["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": blocks[0]["id"],
                                          "content": "sunny, 21 C"}]}]}),
    );
    let answer = post(&app, "/v1/messages", &turn).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text);
    assert!(answer.json()["usage"]["output_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn anthropic_any_uses_one_of_the_tools_and_counts_its_prompt() {
    let (app, _) = router(config());
    let body = message(json!({"type": "any"}), json!({}));
    let reply = post(&app, "/v1/messages", &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let whole = reply.json();
    assert_eq!(whole["stop_reason"], "tool_use");
    let block = &whole["content"][0];
    assert_eq!(block["type"], "tool_use");
    assert_valid_call(block["name"].as_str().unwrap(), &block["input"]);
    let counted = post(&app, "/v1/messages/count_tokens", &body).await.json();
    assert_eq!(counted["input_tokens"], whole["usage"]["input_tokens"]);
}

#[tokio::test]
async fn anthropic_assistant_prefill_is_prompt() {
    let (app, _) = router(config());
    let user = json!({"role": "user", "content": "Name a colour."});
    let body = json!({"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [
        user.clone(), {"role": "assistant", "content": [{"type": "text", "text": "The colour is"}]}]});
    let reply = post(&app, "/v1/messages", &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let whole = reply.json();
    let tokenizer = ChatTokenizer::from_dir(&fixture()).unwrap();
    let options = TemplateOptions {
        add_generation_prompt: true,
        ..TemplateOptions::default()
    };
    let (_, expected) = tokenizer
        .encode_chat_prefilled(std::slice::from_ref(&user), &options, "The colour is")
        .unwrap();
    assert_eq!(whole["usage"]["input_tokens"], expected.len());
    let counted = post(&app, "/v1/messages/count_tokens", &body).await.json();
    assert_eq!(counted["input_tokens"], expected.len());
    assert_eq!(whole["usage"]["output_tokens"], 4);
}
