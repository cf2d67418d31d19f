//! The prefix property agents' speed rests on: turn N's rendered prompt plus the ids the model
//! generated is a token prefix of turn N+1's render, once the answer went through the server
//! (parsed into content, reasoning and calls) and came back as the client sends it (the call's
//! arguments as a JSON string, the reasoning as `reasoning_content`), for every family and call
//! format. When it holds, turn N+1 reuses all of turn N from the prefix cache.
//! Reference: the families' chat templates (tests/fixtures/releases), and the turn loop of
//! `crates/rmlx-engine/tests/qwen3_5_prefix.rs`.

#![cfg(test)]

use std::path::Path;

use rmlx_engine::chat::{ChatTokenizer, TemplateOptions};
use serde_json::{json, Value};

use crate::{
    convert,
    generation::PromptInfo,
    parse::{OutputParser, ToolFormat, THINK_OPEN},
    xml_calls,
};

fn tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object",
                       "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
                       "required": ["path"]}}}])
}

fn options() -> TemplateOptions {
    TemplateOptions {
        add_generation_prompt: true,
        tools: Some(tools()),
        ..TemplateOptions::default()
    }
}

/// What the model writes for a tool-call turn in `format`: reasoning (its opening only when
/// the prompt did not open it), then the call as the template teaches it. Its arguments are not
/// in key order (`path` before `lines`): re-rendered, they must keep the model's order.
fn answer(format: ToolFormat, opened: bool, thinks: bool) -> String {
    let reasoning = match (thinks, opened) {
        (false, _) => String::new(),
        (true, true) => "I should read it first.\n</think>\n\n".to_string(),
        (true, false) => "<think>\nI should read it first.\n</think>\n\n".to_string(),
    };
    let call = match format {
        ToolFormat::Json => "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"src/a.rs\", \"lines\": 20}}\n</tool_call>".to_string(),
        ToolFormat::Xml => "<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/a.rs\n</parameter>\n<parameter=lines>\n20\n</parameter>\n</function>\n</tool_call>".to_string(),
    };
    format!("{reasoning}{call}")
}

/// Turn N's ids plus the answer's, and turn N+1's ids, for the fixture in `dir`.
fn turns(dir: &str) -> (Vec<u32>, Vec<u32>, String) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(dir);
    let tokenizer = ChatTokenizer::from_dir(&path).unwrap();
    let format = match xml_calls::template_writes_xml(&tokenizer) {
        true => ToolFormat::Xml,
        false => ToolFormat::Json,
    };
    let mut wire = vec![
        json!({"role": "system", "content": "You are a coding agent."}),
        json!({"role": "user", "content": "What does src/a.rs do?"}),
    ];
    let (messages, _) = convert::openai_messages(&wire, dir).unwrap();
    let (prompt, mut ids) = tokenizer.encode_chat(&messages, &options()).unwrap();
    let opened = prompt.trim_end().ends_with(THINK_OPEN);
    // A thinking model: its template writes past reasoning back (instruct releases carry the
    // `</think>` token but never think).
    let probe = [
        json!({"role": "user", "content": "hi"}),
        json!({"role": "assistant", "content": "ok", "reasoning_content": "probe"}),
    ];
    let thinks = tokenizer
        .render(&probe, &TemplateOptions::default())
        .unwrap()
        .contains("<think>");
    let info = PromptInfo {
        in_reasoning: opened,
        tool_format: format,
        thinks,
    };
    // What the model generates: the answer's tokens and its end of turn.
    let text = answer(format, opened, thinks);
    ids.extend(tokenizer.encode(&text, false).unwrap());
    ids.push(tokenizer.eos_token_ids()[0]);
    let parsed =
        OutputParser::for_tools(info.in_reasoning, info.tool_format, Some(&tools())).parse(&text);
    assert_eq!(parsed.tool_calls.len(), 1, "{dir}: {parsed:?}");
    // As an OpenAI client sends the turn back.
    let call = &parsed.tool_calls[0];
    let mut assistant = json!({"role": "assistant", "content": parsed.content,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": call.name, "arguments": call.arguments.to_string()}}]});
    if let Some(reasoning) = parsed.reasoning {
        assistant["reasoning_content"] = json!(reasoning);
    }
    wire.push(assistant);
    wire.push(json!({"role": "tool", "tool_call_id": "call_1", "content": "fn main() {}"}));
    let (messages, _) = convert::openai_messages(&wire, dir).unwrap();
    let (next_text, next) = tokenizer.encode_chat(&messages, &options()).unwrap();
    (ids, next, next_text)
}

#[test]
fn a_tool_turn_and_its_answer_are_a_prefix_of_the_next_turn_in_every_family() {
    for dir in [
        "qwen3-tiny",
        "releases/qwen3-4b",
        "releases/qwen3-4b-instruct-2507",
        "releases/qwen3-30b-a3b",
        "releases/qwen3-vl-4b-instruct",
        "releases/qwen3.5-0.8b",
        "releases/qwen3.5-35b-a3b",
        "releases/qwen3.6-27b",
        "releases/qwen3.6-35b-a3b",
    ] {
        let (held, next, next_text) = turns(dir);
        let shared = held.iter().zip(&next).take_while(|(a, b)| a == b).count();
        assert_eq!(
            shared,
            held.len(),
            "{dir}: turn N + answer diverge from turn N+1 at token {shared} of {}:\n{next_text}",
            held.len()
        );
    }
}
