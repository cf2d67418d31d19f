//! Request messages and tools from either API into the shapes HF chat templates take
//! (`{"role","content": str, "tool_calls": [{"type":"function","function":{"name","arguments":
//! {...}}}]}`, `{"role":"tool","content","tool_call_id"}`, tools as OpenAI function schemas).
//! Reference: HF transformers chat-templating docs ("tool use"), mlx-lm `server.py`
//! (`process_message_content`).

use base64::Engine as _;
use serde_json::{json, Map, Value};

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
    } else if lower.starts_with("file:") || reference.starts_with('/') || reference.starts_with('.')
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

/// Whether `payload` is standard, padded base64, checked piece by piece into a stack buffer: a
/// whole decode would allocate the image's size only to throw it away.
fn is_base64(payload: &str) -> bool {
    let mut out = [0u8; 3 * 1024];
    let mut pieces = payload.as_bytes().chunks(4 * 1024).peekable();
    while let Some(piece) = pieces.next() {
        // Padding may only end the whole payload, never a piece of it.
        let last = pieces.peek().is_none();
        if (!last && piece.contains(&b'='))
            || base64::engine::general_purpose::STANDARD
                .decode_slice(piece, &mut out)
                .is_err()
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

/// OpenAI chat messages into template messages, with their images decoded in order.
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
    Ok((converted, images))
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

/// Anthropic `system`: a string or text blocks.
pub fn anthropic_system(system: Option<&Value>) -> Result<Option<String>, ApiError> {
    match system {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text.clone())),
        Some(Value::Array(blocks)) => {
            let texts: Result<Vec<&str>, ApiError> = blocks
                .iter()
                .map(|block| {
                    block
                        .get("text")
                        .and_then(Value::as_str)
                        .ok_or_else(|| bad("`system` blocks must be text blocks"))
                })
                .collect();
            Ok(Some(texts?.join("\n")))
        }
        Some(_) => Err(bad("`system` must be a string or an array of text blocks")),
    }
}

/// A `tool_result`'s content: a string or text blocks.
fn tool_result_text(content: Option<&Value>, model: &str) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(text)) => Ok(text.clone()),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for block in blocks {
                match block.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        text.push_str(block.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    Some("image") => return Err(anthropic_image(block, model)),
                    _ => return Err(bad("`tool_result` content must be text blocks")),
                }
            }
            Ok(text)
        }
        Some(_) => Err(bad("`tool_result` content must be a string or blocks")),
    }
}

fn anthropic_image(block: &Value, model: &str) -> ApiError {
    let source = block.get("source");
    match source.and_then(|s| s.get("type")).and_then(Value::as_str) {
        Some("base64") => refuse_image(
            source
                .and_then(|s| s.get("data"))
                .and_then(Value::as_str)
                .unwrap_or(""),
            model,
        ),
        Some("url") => refuse_image(
            source
                .and_then(|s| s.get("url"))
                .and_then(Value::as_str)
                .unwrap_or("http://"),
            model,
        ),
        _ => bad("an `image` block needs `source` of type `base64`"),
    }
}

/// Anthropic messages (+ system) into template messages: `tool_result` blocks become `tool`
/// messages, `tool_use` blocks the assistant's `tool_calls`, `thinking` its reasoning.
pub fn anthropic_messages(
    system: Option<String>,
    messages: &[Value],
    model: &str,
) -> Result<(Vec<Value>, Images), ApiError> {
    if messages.is_empty() {
        return Err(bad("`messages` must not be empty"));
    }
    let mut out = Vec::new();
    let mut images = Images::new();
    if let Some(system) = system {
        out.push(json!({"role": "system", "content": system}));
    }
    for message in messages {
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("each message needs a string `role`"))?;
        if role != "user" && role != "assistant" {
            return Err(bad(format!(
                "unknown message role `{role}` (user or assistant)"
            )));
        }
        let blocks = match message.get("content") {
            Some(Value::String(text)) => vec![json!({"type": "text", "text": text})],
            Some(Value::Array(blocks)) => blocks.clone(),
            _ => return Err(bad("`content` must be a string or an array of blocks")),
        };
        let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
        let mut parts = Vec::new();
        for block in &blocks {
            match block.get("type").and_then(Value::as_str) {
                Some("text") => {
                    let piece = block
                        .get("text")
                        .and_then(Value::as_str)
                        .ok_or_else(|| bad("a text block needs `text`"))?;
                    text.push_str(piece);
                    parts.push(json!({"type": "text", "text": piece}));
                }
                Some("image") if role == "user" => {
                    images.push(anthropic_image_decode(block)?);
                    parts.push(json!({"type": "image"}));
                }
                Some("image") => return Err(anthropic_image(block, model)),
                Some("thinking") => {
                    reasoning.push_str(block.get("thinking").and_then(Value::as_str).unwrap_or(""))
                }
                Some("redacted_thinking") => {}
                Some("tool_use") if role == "assistant" => {
                    let name = block
                        .get("name")
                        .and_then(Value::as_str)
                        .ok_or_else(|| bad("a tool_use block needs `name`"))?;
                    let mut call = json!({"type": "function", "function": {"name": name, "arguments": block.get("input").cloned().unwrap_or(json!({}))}});
                    if let Some(id) = block.get("id") {
                        call["id"] = id.clone();
                    }
                    calls.push(call);
                }
                Some("audio" | "input_audio") => return Err(bad(AUDIO_UNSUPPORTED)),
                Some("tool_result") if role == "user" => {
                    let mut tool = json!({"role": "tool", "content": tool_result_text(block.get("content"), model)?});
                    if let Some(id) = block.get("tool_use_id") {
                        tool["tool_call_id"] = id.clone();
                    }
                    out.push(tool);
                }
                Some(other) => {
                    return Err(bad(format!(
                        "unsupported `{other}` block in a {role} message"
                    )))
                }
                None => return Err(bad("each content block needs a `type`")),
            }
        }
        if role == "assistant" {
            let mut turn = json!({"role": "assistant", "content": text});
            if !reasoning.is_empty() {
                turn["reasoning_content"] = json!(reasoning);
            }
            if !calls.is_empty() {
                turn["tool_calls"] = Value::Array(calls);
            }
            out.push(turn);
        } else if !text.is_empty()
            || !blocks
                .iter()
                .any(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
        {
            out.push(json!({"role": "user", "content": template_content(text, parts)}));
        }
    }
    Ok((out, images))
}

/// An Anthropic `image` block's pixels (`source.type` base64 only).
fn anthropic_image_decode(block: &Value) -> Result<rmlx_engine::vision::RgbImage, ApiError> {
    let source = block.get("source");
    match source.and_then(|s| s.get("type")).and_then(Value::as_str) {
        Some("base64") => inline_image(
            source
                .and_then(|s| s.get("data"))
                .and_then(Value::as_str)
                .unwrap_or(""),
        ),
        Some("url") => Err(refuse_image("http://", "")),
        _ => Err(bad("an `image` block needs `source` of type `base64`")),
    }
}

/// Anthropic's assistant prefill: a last message from the assistant holding only text is the
/// start of the answer, not a turn. Returns the messages before it and its text; other
/// conversations come back whole.
pub fn anthropic_prefill(messages: &[Value]) -> (&[Value], Option<String>) {
    let Some((last, before)) = messages.split_last() else {
        return (messages, None);
    };
    if last.get("role").and_then(Value::as_str) != Some("assistant") {
        return (messages, None);
    }
    let text = match last.get("content") {
        Some(Value::String(text)) => Some(text.clone()),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .map(|block| match block.get("type").and_then(Value::as_str) {
                Some("text") => block.get("text").and_then(Value::as_str),
                _ => None,
            })
            .collect::<Option<String>>(),
        _ => None,
    };
    match text {
        Some(text) => (before, Some(text)),
        None => (messages, None),
    }
}

/// Anthropic tools (`name`, `description`, `input_schema`) as the template's function tools,
/// after `tool_choice` (`none` hides them, `tool` keeps the named one).
pub fn anthropic_tools(
    tools: Option<&[Value]>,
    choice: Option<&Value>,
) -> Result<Option<Value>, ApiError> {
    let Some(tools) = tools.filter(|tools| !tools.is_empty()) else {
        return Ok(None);
    };
    let choice_type = choice.and_then(|c| c.get("type")).and_then(Value::as_str);
    if choice_type == Some("none") {
        return Ok(None);
    }
    let chosen = match choice_type {
        Some("tool") => choice.and_then(|c| c.get("name")).and_then(Value::as_str),
        _ => None,
    };
    let mut converted = Vec::new();
    for tool in tools {
        let name = tool
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("each tool needs a `name`"))?;
        if chosen.is_some_and(|chosen| chosen != name) {
            continue;
        }
        let mut function = Map::new();
        function.insert("name".into(), json!(name));
        if let Some(description) = tool.get("description") {
            function.insert("description".into(), description.clone());
        }
        function.insert(
            "parameters".into(),
            tool.get("input_schema")
                .cloned()
                .unwrap_or(json!({"type": "object", "properties": {}})),
        );
        converted.push(json!({"type": "function", "function": function}));
    }
    if converted.is_empty() {
        return Err(bad("`tool_choice` names a tool that is not in `tools`"));
    }
    Ok(Some(Value::Array(converted)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The piecewise check answers as a whole decode does, across piece boundaries.
    #[test]
    fn base64_check_in_pieces_equals_a_whole_decode() {
        let engine = base64::engine::general_purpose::STANDARD;
        let mut cases: Vec<String> = ["", "QQ==", "QUI=", "QUJD", "QQ", "Q===", "QQ==QQ==", "@@@@"]
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
        }
        for case in &cases {
            assert_eq!(
                is_base64(case),
                engine.decode(case).is_ok(),
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
    }

    #[test]
    fn a_last_assistant_text_is_a_prefill() {
        let user = json!({"role": "user", "content": "Hi"});
        for content in [
            json!("The answer is"),
            json!([{"type": "text", "text": "The answer"},
                                                       {"type": "text", "text": " is"}]),
        ] {
            let messages = [
                user.clone(),
                json!({"role": "assistant", "content": content}),
            ];
            let (turns, prefill) = anthropic_prefill(&messages);
            assert_eq!(
                (turns, prefill.as_deref()),
                (&messages[..1], Some("The answer is"))
            );
        }
        let tool_use = [
            user.clone(),
            json!({"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "w", "input": {}}]}),
        ];
        assert_eq!(anthropic_prefill(&tool_use), (&tool_use[..], None));
        let only_user = [user];
        assert_eq!(anthropic_prefill(&only_user), (&only_user[..], None));
        assert_eq!(anthropic_prefill(&[]), (&[][..], None));
    }

    #[test]
    fn anthropic_tool_round_trip_shapes() {
        let messages = vec![
            json!({"role": "user", "content": "weather?"}),
            json!({"role": "assistant", "content": [{"type": "text", "text": "checking"}, {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}}]}),
            json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]}]}),
        ];
        let (out, _) = anthropic_messages(Some("sys".into()), &messages, "m").unwrap();
        assert_eq!(out.len(), 4);
        assert_eq!(
            out[2]["tool_calls"][0]["function"],
            json!({"name": "w", "arguments": {"city": "Paris"}})
        );
        assert_eq!(
            out[3],
            json!({"role": "tool", "content": "sunny", "tool_call_id": "t1"})
        );
        let tools = anthropic_tools(
            Some(&[json!({"name": "w", "description": "d", "input_schema": {"type": "object"}})]),
            None,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            tools[0],
            json!({"type": "function", "function": {"name": "w", "description": "d", "parameters": {"type": "object"}}})
        );
    }
}
