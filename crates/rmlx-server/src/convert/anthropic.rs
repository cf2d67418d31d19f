//! Anthropic Messages into template messages, as coding agents send them (Claude Code 2.1.x):
//! `system` messages anywhere in `messages[]`, the billing-header system block, images inside
//! `tool_result` content, and blocks and server tools the server cannot use (dropped, and
//! logged once per request). Reference: Anthropic Messages API docs.

use serde_json::{json, Map, Value};

use super::{
    bad, fold_system_messages, inline_image, refuse_image, template_content, Dropped, Images,
    AUDIO_UNSUPPORTED,
};
use crate::error::ApiError;

/// Claude Code's system block 0 (`cc_version=…; cc_entrypoint=…; cch=…;`): attribution with
/// no meaning for the model, and `cch` changes every request, so kept it would end every
/// prefix-cache hit at the system prompt.
const BILLING_HEADER: &str = "x-anthropic-billing-header:";

fn block_type(block: &Value) -> Option<&str> {
    block.get("type").and_then(Value::as_str)
}

/// The text of a system prompt (`what` = "`system`") or of a system message: a string, or
/// text blocks joined by newlines, without the billing header unless `keep_billing_header`;
/// None when nothing is left.
fn system_text(
    content: &Value,
    what: &str,
    keep_billing_header: bool,
    dropped: &mut Dropped,
) -> Result<Option<String>, ApiError> {
    let blocks = match content {
        Value::Null => return Ok(None),
        Value::String(text) => return Ok(Some(text.clone())),
        Value::Array(blocks) => blocks,
        _ => {
            return Err(bad(format!(
                "{what} must be a string or an array of text blocks"
            )))
        }
    };
    let mut texts = Vec::new();
    for block in blocks {
        match (block_type(block), block.get("text").and_then(Value::as_str)) {
            (Some("text") | None, Some(text))
                if keep_billing_header || !text.starts_with(BILLING_HEADER) =>
            {
                texts.push(text)
            }
            (Some("text") | None, Some(_)) => {}
            (Some("text") | None, None) => {
                return Err(bad(format!("{what}: a text block needs a string `text`")))
            }
            (Some(other), _) => dropped.add(format!("`{other}` block in a system prompt")),
        }
    }
    Ok((!texts.is_empty()).then(|| texts.join("\n")))
}

/// Anthropic `system`: a string or text blocks (the billing header left out unless
/// `keep_billing_header`, the server's `--keep-billing-header`).
pub fn anthropic_system(
    system: Option<&Value>,
    keep_billing_header: bool,
    dropped: &mut Dropped,
) -> Result<Option<String>, ApiError> {
    system.map_or(Ok(None), |system| {
        system_text(system, "`system`", keep_billing_header, dropped)
    })
}

/// A `tool_result`'s content: a string, or its `text` and `image` blocks in order (Claude
/// Code's Read tool returns screenshots so); its images join `images` in that order.
fn tool_result_content(
    content: Option<&Value>,
    images: &mut Images,
    dropped: &mut Dropped,
) -> Result<Value, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(Value::String(String::new())),
        Some(Value::String(text)) => Ok(Value::String(text.clone())),
        Some(Value::Array(blocks)) => {
            let (mut text, mut parts) = (String::new(), Vec::new());
            for block in blocks {
                match block_type(block) {
                    Some("text") => {
                        let piece = block.get("text").and_then(Value::as_str).unwrap_or("");
                        text.push_str(piece);
                        parts.push(json!({"type": "text", "text": piece}));
                    }
                    Some("image") => {
                        images.push(anthropic_image_decode(block)?);
                        parts.push(json!({"type": "image"}));
                    }
                    Some(other) => dropped.add(format!("`{other}` block in a tool result")),
                    None => dropped.add("untyped block in a tool result"),
                }
            }
            Ok(template_content(text, parts))
        }
        Some(_) => Err(bad("`tool_result` content must be a string or blocks")),
    }
}

/// Why an image cannot be in an assistant turn's history.
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

/// A user turn: its `tool_result` blocks become `tool` messages, the rest one user message
/// after them (the order templates render them in, so images are counted in that order).
fn user_turn(
    blocks: &[Value],
    out: &mut Vec<Value>,
    images: &mut Images,
    dropped: &mut Dropped,
) -> Result<(), ApiError> {
    let (mut text, mut parts, mut own_images) = (String::new(), Vec::new(), Images::new());
    let mut results = 0;
    for block in blocks {
        match block_type(block) {
            Some("text") => {
                let piece = block
                    .get("text")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("a text block needs `text`"))?;
                text.push_str(piece);
                parts.push(json!({"type": "text", "text": piece}));
            }
            Some("image") => {
                own_images.push(anthropic_image_decode(block)?);
                parts.push(json!({"type": "image"}));
            }
            Some("tool_result") => {
                results += 1;
                let content = tool_result_content(block.get("content"), images, dropped)?;
                let mut tool = json!({"role": "tool", "content": content});
                if let Some(id) = block.get("tool_use_id") {
                    tool["tool_call_id"] = id.clone();
                }
                out.push(tool);
            }
            Some("audio" | "input_audio") => return Err(bad(AUDIO_UNSUPPORTED)),
            Some("tool_use") => return Err(bad("unsupported `tool_use` block in a user message")),
            Some(other) => dropped.add(format!("`{other}` block")),
            None => return Err(bad("each content block needs a `type`")),
        }
    }
    if !text.is_empty() || !own_images.is_empty() || results == 0 {
        out.push(json!({"role": "user", "content": template_content(text, parts)}));
    }
    images.extend(own_images);
    Ok(())
}

/// An assistant turn: text, `thinking` as its reasoning (the signature is Anthropic's and
/// means nothing here), `tool_use` as its calls.
fn assistant_turn(blocks: &[Value], model: &str, dropped: &mut Dropped) -> Result<Value, ApiError> {
    let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    for block in blocks {
        match block_type(block) {
            Some("text") => text.push_str(
                block
                    .get("text")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("a text block needs `text`"))?,
            ),
            Some("thinking") => {
                reasoning.push_str(block.get("thinking").and_then(Value::as_str).unwrap_or(""))
            }
            Some("tool_use") => {
                let name = block
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("a tool_use block needs `name`"))?;
                let arguments = block.get("input").cloned().unwrap_or(json!({}));
                let mut call =
                    json!({"type": "function", "function": {"name": name, "arguments": arguments}});
                if let Some(id) = block.get("id") {
                    call["id"] = id.clone();
                }
                calls.push(call);
            }
            Some("image") => return Err(anthropic_image(block, model)),
            Some("audio" | "input_audio") => return Err(bad(AUDIO_UNSUPPORTED)),
            Some("tool_result") => {
                return Err(bad(
                    "unsupported `tool_result` block in an assistant message",
                ))
            }
            Some(other) => dropped.add(format!("`{other}` block")),
            None => return Err(bad("each content block needs a `type`")),
        }
    }
    let mut turn = json!({"role": "assistant", "content": text});
    if !reasoning.is_empty() {
        turn["reasoning_content"] = json!(reasoning);
    }
    if !calls.is_empty() {
        turn["tool_calls"] = Value::Array(calls);
    }
    Ok(turn)
}

/// Anthropic messages (+ system) into template messages: `tool_result` blocks become `tool`
/// messages, `tool_use` blocks the assistant's `tool_calls`, `thinking` its reasoning, and
/// `system` messages are folded in where they stand (`fold_system_messages`).
pub fn anthropic_messages(
    system: Option<String>,
    messages: &[Value],
    model: &str,
    dropped: &mut Dropped,
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
        if role == "system" {
            let content = message.get("content").unwrap_or(&Value::Null);
            let what = "a system message's `content`";
            if let Some(text) = system_text(content, what, false, dropped)? {
                out.push(json!({"role": "system", "content": text}));
            }
            continue;
        }
        let blocks = match message.get("content") {
            Some(Value::String(text)) => vec![json!({"type": "text", "text": text})],
            Some(Value::Array(blocks)) => blocks.clone(),
            _ => return Err(bad("`content` must be a string or an array of blocks")),
        };
        match role {
            "user" => user_turn(&blocks, &mut out, &mut images, dropped)?,
            "assistant" => out.push(assistant_turn(&blocks, model, dropped)?),
            other => {
                return Err(bad(format!(
                    "unknown message role `{other}` (user, assistant or system)"
                )))
            }
        }
    }
    Ok((fold_system_messages(out), images))
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
            .map(|block| match block_type(block) {
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
/// after `tool_choice` (`none` hides them, `tool` keeps the named one). Anthropic's server
/// tools (a `type` other than `custom`: `web_search_20250305`, `bash_20250124`, ...) run on
/// Anthropic's side, so they are dropped.
pub fn anthropic_tools(
    tools: Option<&[Value]>,
    choice: Option<&Value>,
    dropped: &mut Dropped,
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
        match tool.get("type").filter(|kind| !kind.is_null()) {
            None => {}
            Some(kind) if kind == "custom" => {}
            Some(kind) => {
                let kind = kind.as_str().map_or_else(|| kind.to_string(), String::from);
                dropped.add(format!("server tool `{kind}`"));
                continue;
            }
        }
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
    match (converted.is_empty(), chosen) {
        (true, Some(_)) => Err(bad("`tool_choice` names a tool that is not in `tools`")),
        (true, None) => Ok(None),
        (false, _) => Ok(Some(Value::Array(converted))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let (out, _) =
            anthropic_messages(Some("sys".into()), &messages, "m", &mut Dropped::default())
                .unwrap();
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
            &mut Dropped::default(),
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            tools[0],
            json!({"type": "function", "function": {"name": "w", "description": "d", "parameters": {"type": "object"}}})
        );
    }

    /// A 2x1 PNG, decodable.
    const PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAABCAIAAAB7QOjdAAAADUlEQVR4nGP4zwAE/wEHAAH/4iOeWQAAAABJRU5ErkJggg==";

    fn image() -> Value {
        json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}})
    }

    fn convert(system: Option<&str>, messages: Value) -> (Vec<Value>, Images, Dropped) {
        let mut dropped = Dropped::default();
        let (out, images) = anthropic_messages(
            system.map(String::from),
            messages.as_array().unwrap(),
            "m",
            &mut dropped,
        )
        .unwrap();
        (out, images, dropped)
    }

    #[test]
    fn system_messages_join_the_prompt_or_the_turn_beside_them() {
        let (out, _, _) = convert(
            Some("top"),
            json!([
                {"role": "system", "content": "lead"},
                {"role": "system", "content": [{"type": "text", "text": "skills", "cache_control": {"type": "ephemeral"}}]},
                {"role": "user", "content": "hi"},
                {"role": "system", "content": "after user"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "data"}]},
                {"role": "system", "content": "tokens left"},
                {"role": "assistant", "content": "done"},
                {"role": "system", "content": "before user"},
                {"role": "user", "content": "next"},
            ]),
        );
        let wrap = |text: &str| format!("<system-reminder>\n{text}\n</system-reminder>");
        assert_eq!(
            out,
            [
                json!({"role": "system", "content": "top\n\nlead\n\nskills"}),
                json!({"role": "user", "content": format!("hi\n\n{}", wrap("after user"))}),
                json!({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "t1", "function": {"name": "read", "arguments": {}}}]}),
                json!({"role": "tool", "content": format!("data\n\n{}", wrap("tokens left")), "tool_call_id": "t1"}),
                json!({"role": "assistant", "content": "done"}),
                json!({"role": "user", "content": format!("{}\n\nnext", wrap("before user"))}),
            ]
        );
        // A user turn with text takes it there (not inside the tool result); with nothing
        // beside it, a system message is a user turn of its own.
        let (out, _, _) = convert(
            None,
            json!([
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "data"}, {"type": "text", "text": "more"}]},
                {"role": "system", "content": "<system-reminder>as sent</system-reminder>"},
                {"role": "assistant", "content": "ok"},
                {"role": "system", "content": "last"},
            ]),
        );
        assert_eq!(out[2]["content"], "data");
        assert_eq!(
            out[3],
            json!({"role": "user", "content": "more\n\n<system-reminder>as sent</system-reminder>"})
        );
        assert_eq!(out[5], json!({"role": "user", "content": wrap("last")}));
    }

    #[test]
    fn the_billing_header_block_is_left_out() {
        let mut dropped = Dropped::default();
        let system = json!([
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.abc; cc_entrypoint=cli; cch=1f2e3;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be brief."},
        ]);
        assert_eq!(
            anthropic_system(Some(&system), false, &mut dropped)
                .unwrap()
                .as_deref(),
            Some("You are Claude Code.\nBe brief.")
        );
        let only = json!([{"type": "text", "text": "x-anthropic-billing-header: cc_version=1;"}]);
        assert_eq!(
            anthropic_system(Some(&only), false, &mut dropped).unwrap(),
            None
        );
        // Only a block that starts with it.
        let quoted = json!("see x-anthropic-billing-header: in the docs");
        assert!(anthropic_system(Some(&quoted), false, &mut dropped)
            .unwrap()
            .is_some());
        assert!(dropped.kinds().is_empty());
    }

    #[test]
    fn unknown_blocks_and_server_tools_are_dropped_and_named() {
        let (out, _, dropped) = convert(
            None,
            json!([
                {"role": "user", "content": [{"type": "text", "text": "find it"},
                    {"type": "document", "source": {"type": "text", "data": "doc"}}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "plan", "signature": "EqQBCkYIB..."},
                    {"type": "redacted_thinking", "data": "abc"},
                    {"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {"query": "x"}},
                    {"type": "web_search_tool_result", "tool_use_id": "s1", "content": []},
                    {"type": "text", "text": "found"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                    {"type": "search_result", "source": "s", "title": "t", "content": []},
                    {"type": "text", "text": "r"}]}]},
            ]),
        );
        assert_eq!(out[0], json!({"role": "user", "content": "find it"}));
        assert_eq!(
            out[1],
            json!({"role": "assistant", "content": "found", "reasoning_content": "plan"})
        );
        assert_eq!(out[2]["content"], "r");
        assert_eq!(
            dropped.kinds(),
            [
                "`document` block",
                "`redacted_thinking` block",
                "`search_result` block in a tool result",
                "`server_tool_use` block",
                "`web_search_tool_result` block"
            ]
        );
        let mut dropped = Dropped::default();
        let tools = [
            json!({"type": "web_search_20250305", "name": "web_search", "max_uses": 5}),
            json!({"type": "bash_20250124", "name": "bash"}),
            json!({"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}),
            json!({"type": "custom", "name": "Read", "input_schema": {"type": "object"}}),
            json!({"name": "Write", "input_schema": {"type": "object"}}),
        ];
        let kept = anthropic_tools(Some(&tools), None, &mut dropped)
            .unwrap()
            .unwrap();
        let names: Vec<&Value> = kept
            .as_array()
            .unwrap()
            .iter()
            .map(|t| &t["function"]["name"])
            .collect();
        assert_eq!(names, [&json!("Read"), &json!("Write")]);
        assert_eq!(dropped.kinds().len(), 3);
        // Only server tools: no tools at all, unless `tool_choice` names one of them.
        let server = &tools[..1];
        assert_eq!(
            anthropic_tools(Some(server), None, &mut dropped).unwrap(),
            None
        );
        let named = json!({"type": "tool", "name": "web_search"});
        assert!(anthropic_tools(Some(server), Some(&named), &mut dropped).is_err());
    }

    #[test]
    fn images_in_tool_results_are_placed_where_they_are() {
        let (out, images, _) = convert(
            None,
            json!([
                {"role": "user", "content": "look"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
                // The user's own image renders after the tool results, so it is counted after.
                {"role": "user", "content": [image(), {"type": "text", "text": "and this"},
                    {"type": "tool_result", "tool_use_id": "t1", "content": [
                        {"type": "text", "text": "shot:"}, image(), {"type": "text", "text": "end"}]}]},
            ]),
        );
        assert_eq!(
            out[2],
            json!({"role": "tool", "tool_call_id": "t1", "content": [
                {"type": "text", "text": "shot:"}, {"type": "image"}, {"type": "text", "text": "end"}]})
        );
        assert_eq!(
            out[3],
            json!({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this"}]})
        );
        assert_eq!(images.len(), 2);
        // A tool result of only an image, and a bad one refused as a bad image.
        let (out, images, _) = convert(
            None,
            json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [image()]}]}]),
        );
        assert_eq!((out.len(), images.len()), (1, 1));
        let bad = json!([{"role": "user", "content": [{"type": "tool_result", "content": [
            {"type": "image", "source": {"type": "base64", "data": "@@@"}}]}]}]);
        let error = anthropic_messages(None, bad.as_array().unwrap(), "m", &mut Dropped::default())
            .unwrap_err();
        assert!(error.to_string().contains("bad image"), "{error}");
    }
}
