//! Request messages and tools from either API into the shapes HF chat templates take
//! (`{"role","content": str, "tool_calls": [{"type":"function","function":{"name","arguments":
//! {...}}}]}`, `{"role":"tool","content","tool_call_id"}`, tools as OpenAI function schemas).
//! Reference: HF transformers chat-templating docs ("tool use"), mlx-lm `server.py`
//! (`process_message_content`). Anthropic's messages are in `convert/anthropic.rs`.

mod anthropic;

use base64::Engine as _;
use std::collections::BTreeMap;

use rmlx_engine::vision::{JPEG_BASE64, LENIENT_BASE64};
use serde_json::{json, Value};

pub use self::anthropic::{
    anthropic_messages, anthropic_prefill, anthropic_system, anthropic_tools,
};
use crate::error::ApiError;

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::BadRequest(message.into())
}

/// Images found in a request, decoded, in prompt order.
pub type Images = Vec<rmlx_engine::vision::RgbImage>;

/// Decodes an inline image (data URI or bare base64); remote and file references are refused
/// clearly, undecodable data is a bad image. Whether the model can see it is the engine's call.
pub fn inline_image(reference: &str) -> Result<rmlx_engine::vision::RgbImage, ApiError> {
    let error = refuse_image(reference, "");
    if !error.to_string().contains("has no vision") {
        return Err(error);
    }
    rmlx_engine::vision::decode_image_source(
        reference,
        rmlx_engine::vision::SourcePolicy::InlineOnly,
        &rmlx_engine::vision::ImageLimits::default(),
    )
    .map_err(|error| match error {
        rmlx_engine::vision::ImageError::OutOfMemory { .. } => ApiError::OutOfMemory(format!(
            "{error}; this request was dropped and the server goes on (free memory, send a \
             smaller image, or retry)"
        )),
        other => bad(format!("bad image: {other}")),
    })
}

/// Refuses an image: remote and file references clearly, undecodable data as a bad image, and
/// valid inline images as "no vision" (for callers that cannot take images).
pub fn refuse_image(reference: &str, model: &str) -> ApiError {
    let reference = reference.trim();
    let lower = reference.to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return bad("remote image URLs are not supported: send the image inline as a data URI (data:image/png;base64,...)");
    }
    let payload = if lower.starts_with("data:") {
        match reference.split_once(";base64,") {
            Some((_, payload)) => payload,
            None => {
                return bad(
                    "bad image: the data URI is not base64 (expected data:image/...;base64,...)",
                )
            }
        }
    } else if lower.starts_with("file:")
        // Bare base64 of a JPEG begins `/9j/` (its FF D8 FF bytes): the picture, not a path.
        || (reference.starts_with('/') && !reference.starts_with(JPEG_BASE64))
        || reference.starts_with('.')
    {
        return bad("image file paths are not supported: send the image inline as a data URI (data:image/png;base64,...)");
    } else {
        reference
    };
    if !is_base64(payload.trim()) {
        return bad("bad image: the image data is not valid base64");
    }
    no_vision(model)
}

/// Whether `payload` is base64 as the engine's decoder reads it ([`LENIENT_BASE64`]) (whitespace skipped), checked piece
/// by piece into a stack buffer: a whole decode would allocate the image's size only to throw it
/// away.
fn is_base64(payload: &str) -> bool {
    let compact: std::borrow::Cow<str> = match payload.bytes().any(|b| b.is_ascii_whitespace()) {
        true => payload.split_ascii_whitespace().collect::<String>().into(),
        false => payload.into(),
    };
    let mut out = [0u8; 3 * 1024];
    let mut pieces = compact.as_bytes().chunks(4 * 1024).peekable();
    while let Some(piece) = pieces.next() {
        // Padding may only end the whole payload, never a piece of it.
        let last = pieces.peek().is_none();
        if (!last && piece.contains(&b'=')) || LENIENT_BASE64.decode_slice(piece, &mut out).is_err()
        {
            return false;
        }
    }
    true
}

/// Refuses images for a model without a vision tower before any template sees image parts
/// (a text template may not even accept them). The checkpoint's config says which it is.
pub fn check_vision(
    model_dir: &std::path::Path,
    model: &str,
    images: &Images,
) -> Result<(), ApiError> {
    if images.is_empty() {
        return Ok(());
    }
    if has_vision(model_dir) {
        Ok(())
    } else {
        Err(no_vision(model))
    }
}

fn read_config(model_dir: &std::path::Path) -> Value {
    crate::registry::read_config(model_dir).unwrap_or(Value::Null)
}

/// Whether the checkpoint's config declares a vision tower.
pub fn has_vision(model_dir: &std::path::Path) -> bool {
    config_has_vision(&read_config(model_dir))
}

pub fn config_has_vision(config: &Value) -> bool {
    config.get("vision_config").is_some()
}

/// The checkpoint's `model_type` ("" when config.json is unreadable: loading reports that).
pub fn model_type(model_dir: &std::path::Path) -> String {
    read_config(model_dir)["model_type"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

pub fn no_vision(model: &str) -> ApiError {
    bad(format!(
        "model `{model}` has no vision: it cannot read images; send text only or use a vision model"
    ))
}

/// Template content from text and image parts: a plain string when there is no image (what
/// every template takes), else parts in order with `{"type":"image"}` where each image was.
fn template_content(text: String, parts: Vec<Value>) -> Value {
    if parts.iter().any(|part| part["type"] == "image") {
        Value::Array(parts)
    } else {
        Value::String(text)
    }
}

/// Audio parts get one clear answer: Gemma 4 E2B/E4B load with their audio tower set aside.
const AUDIO_UNSUPPORTED: &str = "audio input is not supported: rMLX runs the text and vision \
     parts of its models (the Gemma 4 audio tower is loaded but not used); send a transcript as text";

/// OpenAI content: a string, null, or parts (`text`, and `image_url` decoded into `images`).
fn openai_text(content: Option<&Value>, images: &mut Images) -> Result<Value, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(Value::String(String::new())),
        Some(Value::String(text)) => Ok(Value::String(text.clone())),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            let mut out = Vec::new();
            for part in parts {
                match part.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        let piece = part
                            .get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| bad("a `text` content part needs a string `text`"))?;
                        text.push_str(piece);
                        out.push(json!({"type": "text", "text": piece}));
                    }
                    Some("image_url") => {
                        let url = part
                            .get("image_url")
                            .and_then(|image| image.get("url").or(Some(image)))
                            .and_then(Value::as_str)
                            .ok_or_else(|| bad("an `image_url` part needs `image_url.url`"))?;
                        images.push(inline_image(url)?);
                        out.push(json!({"type": "image"}));
                    }
                    Some("input_audio" | "audio") => return Err(bad(AUDIO_UNSUPPORTED)),
                    Some(other) => {
                        return Err(bad(format!("unsupported content part type `{other}`")))
                    }
                    None => return Err(bad("each content part needs a `type`")),
                }
            }
            Ok(template_content(text, out))
        }
        Some(_) => Err(bad(
            "`content` must be a string, an array of parts, or null",
        )),
    }
}

/// OpenAI tool calls: `arguments` is a JSON string on the wire; templates want the object.
fn template_tool_calls(calls: &Value) -> Result<Value, ApiError> {
    let calls = calls
        .as_array()
        .ok_or_else(|| bad("`tool_calls` must be an array"))?;
    let converted = calls
        .iter()
        .map(|call| {
            let function = call
                .get("function")
                .ok_or_else(|| bad("each tool call needs a `function`"))?;
            let name = function
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("each tool call needs `function.name`"))?;
            let arguments = match function.get("arguments") {
                Some(Value::String(text)) => {
                    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.clone()))
                }
                Some(other) => other.clone(),
                None => json!({}),
            };
            let mut out =
                json!({"type": "function", "function": {"name": name, "arguments": arguments}});
            if let Some(id) = call.get("id") {
                out["id"] = id.clone();
            }
            Ok(out)
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    Ok(Value::Array(converted))
}

/// What a request sent that the server cannot use (Anthropic's server-side blocks and tools,
/// Responses' built-in tools and item types), counted by kind: logged once per request rather
/// than refused, as agents send them freely.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Dropped(BTreeMap<String, usize>);

impl Dropped {
    pub fn add(&mut self, what: impl Into<String>) {
        *self.0.entry(what.into()).or_default() += 1;
    }

    /// The kinds dropped, in order.
    pub fn kinds(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }

    /// One warning line naming the route and what it dropped (nothing when nothing was).
    pub fn log(&self, route: &str) {
        if self.0.is_empty() {
            return;
        }
        let list: Vec<String> = self
            .0
            .iter()
            .map(|(what, &count)| match count {
                1 => what.clone(),
                _ => format!("{what} x{count}"),
            })
            .collect();
        crate::parse::log_warnings(vec![format!(
            "{route} ignored what this server cannot use: {}",
            list.join(", ")
        )]);
    }
}

/// OpenAI chat messages into template messages, with their images decoded in order; system
/// messages after the first turn fold into the turns beside them (`fold_system_messages`).
pub fn openai_messages(messages: &[Value], _model: &str) -> Result<(Vec<Value>, Images), ApiError> {
    if messages.is_empty() {
        return Err(bad("`messages` must not be empty"));
    }
    let mut images = Images::new();
    let converted = messages
        .iter()
        .map(|message| {
            let role = message
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("each message needs a string `role`"))?;
            let content = openai_text(message.get("content"), &mut images)?;
            Ok(match role {
                "system" | "developer" => json!({"role": "system", "content": content}),
                "user" => json!({"role": "user", "content": content}),
                "assistant" => {
                    let mut out = json!({"role": "assistant", "content": content});
                    if let Some(calls) = message.get("tool_calls").filter(|c| !c.is_null()) {
                        out["tool_calls"] = template_tool_calls(calls)?;
                    }
                    // Past reasoning (vLLM and OpenRouter also send it as `reasoning`): the
                    // template decides which turns keep it (Qwen3.5 / 3.6: those after the last
                    // user query, or all with `preserve_thinking`).
                    if let Some(reasoning) = ["reasoning_content", "reasoning"]
                        .iter()
                        .find_map(|key| message.get(*key).filter(|r| r.is_string()))
                    {
                        out["reasoning_content"] = reasoning.clone();
                    }
                    out
                }
                "tool" | "function" => {
                    let mut out = json!({"role": "tool", "content": content});
                    if let Some(id) = message.get("tool_call_id") {
                        out["tool_call_id"] = id.clone();
                    }
                    out
                }
                other => return Err(bad(format!("unknown message role `{other}`"))),
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    // Agents put system (and developer) messages mid-conversation too; they stay in place.
    Ok((fold_system_messages(converted), images))
}

/// OpenAI `tools` after `tool_choice`: `none` hides them, a named function keeps only it.
pub fn openai_tools(
    tools: Option<&[Value]>,
    choice: Option<&Value>,
) -> Result<Option<Value>, ApiError> {
    let Some(tools) = tools.filter(|tools| !tools.is_empty()) else {
        return Ok(None);
    };
    for tool in tools {
        if tool
            .pointer("/function/name")
            .and_then(Value::as_str)
            .is_none()
        {
            return Err(bad("each tool needs `function.name` (type `function`)"));
        }
    }
    let chosen = match choice {
        Some(Value::String(mode)) if mode == "none" => return Ok(None),
        Some(choice) => choice.pointer("/function/name").and_then(Value::as_str),
        None => None,
    };
    let kept: Vec<Value> = match chosen {
        Some(name) => tools
            .iter()
            .filter(|tool| tool.pointer("/function/name").and_then(Value::as_str) == Some(name))
            .cloned()
            .collect(),
        None => tools.to_vec(),
    };
    if kept.is_empty() {
        return Err(bad("`tool_choice` names a function that is not in `tools`"));
    }
    Ok(Some(Value::Array(kept)))
}

/// Puts system messages where every family's template takes them without moving them: the
/// leading ones become the one system prompt; each later run, as `<system-reminder>` text
/// (Claude Code's convention), ends the user or tool turn before it, else starts the one after
/// it, else is a user turn of its own. Qwen3.5 / 3.6 templates raise on a system message
/// after the first, and hoisting one to the front or making it a new user turn would change
/// the rendered prefix every turn and defeat the prefix cache.
pub fn fold_system_messages(messages: Vec<Value>) -> Vec<Value> {
    let is_system = |message: &Value| message["role"] == "system";
    let mut messages = messages.into_iter().peekable();
    let mut leading = Vec::new();
    while let Some(message) = messages.next_if(is_system) {
        leading.push(content_text(&message["content"]));
    }
    let mut out = Vec::new();
    if !leading.is_empty() {
        out.push(json!({"role": "system", "content": leading.join("\n\n")}));
    }
    let mut run = Vec::new();
    for mut message in messages {
        if is_system(&message) {
            run.push(content_text(&message["content"]));
            continue;
        }
        if !run.is_empty() {
            let text = reminder(&std::mem::take(&mut run));
            match out.last_mut().filter(|last| takes_reminders(last)) {
                Some(before) => add_text(before, &text, true),
                None if takes_reminders(&message) => add_text(&mut message, &text, false),
                None => out.push(json!({"role": "user", "content": text})),
            }
        }
        out.push(message);
    }
    if !run.is_empty() {
        let text = reminder(&run);
        match out.last_mut().filter(|last| takes_reminders(last)) {
            Some(before) => add_text(before, &text, true),
            None => out.push(json!({"role": "user", "content": text})),
        }
    }
    out
}

/// User and tool turns are the client's side of the conversation, where system text may go.
fn takes_reminders(message: &Value) -> bool {
    message["role"] == "user" || message["role"] == "tool"
}

/// Template content as text (a string, or its text parts).
fn content_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part["text"].as_str())
            .collect(),
        _ => String::new(),
    }
}

/// System messages as one `<system-reminder>` each (kept as sent when already so wrapped).
fn reminder(texts: &[String]) -> String {
    let wrapped: Vec<String> = texts
        .iter()
        .map(
            |text| match text.trim_start().starts_with("<system-reminder>") {
                true => text.clone(),
                false => format!("<system-reminder>\n{text}\n</system-reminder>"),
            },
        )
        .collect();
    wrapped.join("\n\n")
}

/// Adds `text` at the end (or start) of a message's content, a blank line apart.
fn add_text(message: &mut Value, text: &str, at_end: bool) {
    let content = &mut message["content"];
    match content {
        Value::Array(parts) if !parts.is_empty() => match at_end {
            true => parts.push(json!({"type": "text", "text": format!("\n\n{text}")})),
            false => parts.insert(0, json!({"type": "text", "text": format!("{text}\n\n")})),
        },
        Value::String(old) if !old.is_empty() => {
            *old = match at_end {
                true => format!("{old}\n\n{text}"),
                false => format!("{text}\n\n{old}"),
            }
        }
        _ => *content = Value::String(text.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The piecewise check answers as a whole decode does, across piece boundaries, padded,
    /// unpadded and line-wrapped.
    #[test]
    fn base64_check_in_pieces_equals_a_whole_decode() {
        let engine = base64::engine::general_purpose::STANDARD;
        let mut cases: Vec<String> = [
            "",
            "QQ==",
            "QUI=",
            "QUJD",
            "QQ",
            "Q===",
            "QQ==QQ==",
            "@@@@",
            "QU\nJD",
            "QUJD\r\nQQ",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        for len in [3070usize, 3071, 3072, 3073, 6144, 6145] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let text = engine.encode(&data);
            cases.push(text.clone());
            // Padding that ends a piece but not the payload, a bad byte past the first piece,
            // a payload cut short.
            cases.push(format!("{}QQ=={}", &text[..4092], &text[4092..]));
            let mut bad = text.clone().into_bytes();
            let at = 4100.min(bad.len() - 1);
            bad[at] = b'*';
            cases.push(String::from_utf8(bad).unwrap());
            cases.push(text[..text.len() - 1].to_string());
            cases.push(text.trim_end_matches('=').to_string());
            let wrapped: Vec<String> = text
                .as_bytes()
                .chunks(76)
                .map(|l| String::from_utf8_lossy(l).into())
                .collect();
            cases.push(wrapped.join("\n"));
        }
        for case in &cases {
            let compact: String = case.split_ascii_whitespace().collect();
            assert_eq!(
                is_base64(case),
                LENIENT_BASE64.decode(&compact).is_ok(),
                "{} chars",
                case.len()
            );
        }
    }

    #[test]
    fn openai_parts_and_tool_history() {
        let messages = vec![
            json!({"role": "developer", "content": "be brief"}),
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "42"}),
        ];
        let (out, _) = openai_messages(&messages, "m").unwrap();
        assert_eq!(out[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(out[1]["content"], "ab");
        assert_eq!(
            out[2]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert_eq!(
            out[3],
            json!({"role": "tool", "content": "42", "tool_call_id": "c1"})
        );
    }

    #[test]
    fn images_are_refused_clearly() {
        let msg = |url: &str| refuse_image(url, "tiny").to_string();
        assert!(msg("https://x.org/cat.png").contains("remote image URLs"));
        assert!(msg("/tmp/cat.png").contains("file paths"));
        assert!(msg("data:image/png;base64,@@@").contains("not valid base64"));
        assert!(msg("data:image/png;base64,iVBORw0KGgo=").contains("has no vision"));
        // Unpadded, and a bare JPEG's base64 (it starts with `/9j/`, not a path).
        assert!(msg("data:image/png;base64,iVBORw0KGgo").contains("has no vision"));
        assert!(msg("/9j/4AAQSkZJRg==").contains("has no vision"));
    }

    #[test]
    fn system_text_folds_into_parts_beside_images() {
        let image = json!({"type": "image"});
        let messages = vec![
            json!({"role": "user", "content": [image.clone(), {"type": "text", "text": "what?"}]}),
            json!({"role": "system", "content": "a"}),
            json!({"role": "system", "content": [{"type": "text", "text": "b"}]}),
            json!({"role": "assistant", "content": "x"}),
            json!({"role": "system", "content": "c"}),
            json!({"role": "tool", "content": [image.clone()], "tool_call_id": "t"}),
            json!({"role": "assistant", "content": "y"}),
            json!({"role": "system", "content": "d"}),
            json!({"role": "user", "content": ""}),
        ];
        let out = fold_system_messages(messages);
        let wrap = |text: &str| format!("<system-reminder>\n{text}\n</system-reminder>");
        assert_eq!(
            out[0]["content"],
            json!([image, {"type": "text", "text": "what?"},
                   {"type": "text", "text": format!("\n\n{}\n\n{}", wrap("a"), wrap("b"))}])
        );
        assert_eq!(
            out[2]["content"],
            json!([{"type": "text", "text": format!("{}\n\n", wrap("c"))}, image])
        );
        assert_eq!(out[4], json!({"role": "user", "content": wrap("d")}));
        assert_eq!(out.len(), 5);
    }
}
