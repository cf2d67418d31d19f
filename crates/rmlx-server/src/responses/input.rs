//! Responses API requests into the shapes chat templates take: `instructions` and `input` items
//! into template messages (the same ones chat completions builds), tools into function tools
//! with a map back to what the client named, `tool_choice` into chat's. Reference: OpenAI API
//! reference (Responses: input items, tools, tool_choice) and Codex's `codex-rs/protocol`
//! (`ResponseItem`) and `codex-rs/tools` (`ToolSpec`, `join_tool_name`) for what Codex sends.

use std::collections::HashMap;

use rmlx_engine::constrain::GrammarSyntax;
use serde_json::{json, Value};

use crate::{
    convert::{self, Dropped},
    error::ApiError,
};

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::BadRequest(message.into())
}

/// Codex's rule for a namespaced tool's flat name (`join_tool_name`): the namespace without
/// trailing `_`, `__`, the name without leading `_`.
pub fn join_name(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(namespace) => format!(
            "{}__{}",
            namespace.trim_end_matches('_'),
            name.trim_start_matches('_')
        ),
        None => name.to_string(),
    }
}

/// What a flat tool name the model sees stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolName {
    pub name: String,
    pub namespace: Option<String>,
    /// A `custom` (freeform) tool: its one argument `input` is the call's text.
    pub custom: bool,
}

/// Flat names back to the client's tools.
#[derive(Debug, Clone, Default)]
pub struct ToolNames(HashMap<String, ToolName>);

impl ToolNames {
    /// The tool a call names; an unknown name is a plain function of that name.
    pub fn get(&self, flat: &str) -> ToolName {
        self.0.get(flat).cloned().unwrap_or_else(|| ToolName {
            name: flat.to_string(),
            namespace: None,
            custom: false,
        })
    }

    /// The flat name of `name` (in `namespace` when given; else the one tool of that name).
    fn find(&self, name: &str, namespace: Option<&str>) -> Option<String> {
        if namespace.is_some() {
            let flat = join_name(namespace, name);
            return self.0.contains_key(&flat).then_some(flat);
        }
        if self.0.contains_key(name) {
            return Some(name.to_string());
        }
        let mut matches = self.0.iter().filter(|(_, tool)| tool.name == name);
        match (matches.next(), matches.next()) {
            (Some((flat, _)), None) => Some(flat.clone()),
            _ => None,
        }
    }
}

/// The function tools the template renders, and what their names stand for.
pub struct Tools {
    pub functions: Vec<Value>,
    pub names: ToolNames,
    /// The grammars of the freeform tools that give one, by flat name.
    pub grammars: Vec<(String, CustomGrammar)>,
}

/// A freeform tool's `format: {type: "grammar", syntax, definition}`.
#[derive(Debug, Clone, PartialEq)]
pub struct CustomGrammar {
    pub syntax: GrammarSyntax,
    pub definition: String,
}

impl CustomGrammar {
    /// The grammar as one regex, where it has one (a regex; a Lark grammar without recursion):
    /// what holds the input when a JSON call format writes it as a JSON string.
    pub fn regex(&self) -> Option<String> {
        match self.syntax {
            GrammarSyntax::Regex => Some(self.definition.clone()),
            GrammarSyntax::Lark => crate::lark_regex::lark_to_regex(&self.definition).ok(),
            GrammarSyntax::JsonString => None,
        }
    }

    fn of(tool: &Value) -> Result<Option<Self>, ApiError> {
        let format = &tool["format"];
        if format["type"] != "grammar" {
            return Ok(None);
        }
        let definition = format["definition"]
            .as_str()
            .ok_or_else(|| bad("a custom tool's grammar `format` needs a string `definition`"))?;
        let syntax = match format.get("syntax").map(Value::as_str) {
            None | Some(Some("lark")) => GrammarSyntax::Lark,
            Some(Some("regex")) => GrammarSyntax::Regex,
            Some(_) => {
                return Err(bad(format!(
                    "a custom tool's grammar `syntax` is `lark` or `regex`, not {}",
                    format["syntax"]
                )))
            }
        };
        Ok(Some(Self {
            syntax,
            definition: definition.to_string(),
        }))
    }
}

/// A function tool as the template takes it.
fn function(name: String, description: Option<&Value>, parameters: Value) -> Value {
    let mut function = serde_json::Map::new();
    function.insert("name".into(), Value::String(name));
    if let Some(description) = description.filter(|d| d.is_string()) {
        function.insert("description".into(), description.clone());
    }
    function.insert("parameters".into(), parameters);
    json!({"type": "function", "function": function})
}

/// A freeform tool's one string argument, its grammar (when it gives one) shown to the model in
/// the argument's description (enforced by the engine: `responses.rs`, `forced.rs`).
fn custom_parameters(grammar: Option<&CustomGrammar>) -> Value {
    let mut input = json!({"type": "string", "description": "The tool's input, as raw text."});
    if let Some(CustomGrammar { syntax, definition }) = grammar {
        let name = match syntax {
            GrammarSyntax::Regex => "regex",
            _ => "lark",
        };
        input["description"] = Value::String(format!(
            "The tool's input, as raw text following this {name} grammar:\n{definition}"
        ));
    }
    json!({"type": "object", "properties": {"input": input}, "required": ["input"],
           "additionalProperties": false})
}

fn tool_name(tool: &Value, what: &str) -> Result<String, ApiError> {
    tool.get("name")
        .and_then(Value::as_str)
        .filter(|name| !name.is_empty())
        .map(str::to_string)
        .ok_or_else(|| {
            bad(format!(
                "each `{what}` tool needs a non-empty string `name`"
            ))
        })
}

/// `function` and `custom` tools, and those inside `namespace` tools (flattened with
/// [`join_name`]); built-in tools the server cannot run are dropped into `ignored`.
pub fn tools(tools: Option<&[Value]>, ignored: &mut Dropped) -> Result<Tools, ApiError> {
    let mut out = Tools {
        functions: Vec::new(),
        names: ToolNames::default(),
        grammars: Vec::new(),
    };
    let mut add = |tool: &Value, namespace: Option<&str>, ignored: &mut Dropped| {
        let kind = tool.get("type").and_then(Value::as_str).unwrap_or_default();
        let custom = match kind {
            "function" => false,
            "custom" => true,
            other => {
                ignored.add(format!("`{other}` tool"));
                return Ok(());
            }
        };
        let name = tool_name(tool, kind)?;
        let flat = join_name(namespace, &name);
        let grammar = match custom {
            true => CustomGrammar::of(tool)?,
            false => None,
        };
        let parameters = match custom {
            true => custom_parameters(grammar.as_ref()),
            // No parameters: a function of no arguments (as OpenAI reads it).
            false => tool
                .get("parameters")
                .filter(|p| p.is_object())
                .cloned()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
        };
        out.functions
            .push(function(flat.clone(), tool.get("description"), parameters));
        if let Some(grammar) = grammar {
            out.grammars.push((flat.clone(), grammar));
        }
        out.names.0.insert(
            flat,
            ToolName {
                name,
                namespace: namespace.map(str::to_string),
                custom,
            },
        );
        Ok::<_, ApiError>(())
    };
    for tool in tools.unwrap_or_default() {
        let kind = tool.get("type").and_then(Value::as_str);
        match kind {
            Some("namespace") => {
                let namespace = tool_name(tool, "namespace")?;
                let nested = tool
                    .get("tools")
                    .and_then(Value::as_array)
                    .ok_or_else(|| bad("a `namespace` tool needs a `tools` array"))?;
                for inner in nested {
                    add(inner, Some(&namespace), ignored)?;
                }
            }
            Some(_) => add(tool, None, ignored)?,
            None => return Err(bad("each tool needs a string `type`")),
        }
    }
    Ok(out)
}

/// `tool_choice` as chat completions takes it (`none`, `auto`, `required`, or one function by
/// its flat name), with the tools it leaves (`allowed_tools` narrows them).
pub fn tool_choice(
    choice: Option<&Value>,
    tools: &mut Tools,
    ignored: &mut Dropped,
) -> Result<Option<Value>, ApiError> {
    let Some(choice) = choice.filter(|c| !c.is_null()) else {
        return Ok(None);
    };
    if let Some(mode) = choice.as_str() {
        return match mode {
            "none" | "auto" | "required" => Ok(Some(json!(mode))),
            other => Err(bad(format!(
                "`tool_choice` must be `none`, `auto`, `required` or an object, not `{other}`"
            ))),
        };
    }
    let kind = choice
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("a `tool_choice` object needs a string `type`"))?;
    // What the document states of every type, including those that then mean `auto`.
    for key in ["name", "namespace", "mode"] {
        if choice.get(key).is_some_and(|value| !value.is_string()) {
            return Err(bad(format!("`tool_choice.{key}` must be a string")));
        }
    }
    if choice.get("tools").is_some_and(|tools| !tools.is_array()) {
        return Err(bad("`tool_choice.tools` must be an array"));
    }
    let named = |choice: &Value, tools: &Tools| -> Result<String, ApiError> {
        let name = choice
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("`tool_choice` of type `{kind}` needs a `name`")))?;
        let namespace = choice.get("namespace").and_then(Value::as_str);
        tools.names.find(name, namespace).ok_or_else(|| {
            bad(format!(
                "`tool_choice` names `{name}`, which is not a function or custom tool in `tools`"
            ))
        })
    };
    match kind {
        "function" | "custom" => {
            let flat = named(choice, tools)?;
            Ok(Some(
                json!({"type": "function", "function": {"name": flat}}),
            ))
        }
        "allowed_tools" => {
            let allowed: Vec<String> = choice
                .get("tools")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("`allowed_tools` needs a `tools` array"))?
                .iter()
                .filter_map(|tool| named(tool, tools).ok())
                .collect();
            tools.functions.retain(|tool| {
                tool.pointer("/function/name")
                    .and_then(Value::as_str)
                    .is_some_and(|name| allowed.iter().any(|a| a == name))
            });
            tools.grammars.retain(|(name, _)| allowed.contains(name));
            let mode = choice.get("mode").and_then(Value::as_str).unwrap_or("auto");
            Ok(Some(json!(if mode == "required" {
                "required"
            } else {
                "auto"
            })))
        }
        other => {
            // A built-in tool (web_search, mcp, ...) the server cannot run: the model chooses.
            ignored.add(format!("`tool_choice` of type `{other}`"));
            Ok(Some(json!("auto")))
        }
    }
}

/// `input` (a string or items) after `instructions`, as template messages and their images.
/// System and developer messages stay where they are sent; `convert::fold_system_messages`
/// then merges the leading ones into the system prompt and keeps later ones in place.
pub fn messages(
    instructions: Option<&Value>,
    input: &[Value],
    ignored: &mut Dropped,
) -> Result<(Vec<Value>, convert::Images), ApiError> {
    let mut out: Vec<Value> = Vec::new();
    let mut images = convert::Images::new();
    match instructions {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) if text.is_empty() => {}
        Some(Value::String(text)) => out.push(json!({"role": "system", "content": text})),
        Some(_) => return Err(bad("`instructions` must be a string")),
    }
    for item in input {
        if !item.is_object() {
            return Err(bad("each input item must be an object"));
        }
        let kind = match item.get("type") {
            Some(Value::String(kind)) => kind.as_str(),
            None if item.get("role").is_some() => "message",
            _ => return Err(bad("each input item needs a string `type` (or a `role`)")),
        };
        match kind {
            "message" => message(item, &mut out, &mut images, ignored)?,
            "reasoning" => {
                let text = reasoning_text(item);
                let turn = assistant_turn(&mut out);
                if !text.is_empty() {
                    append(turn, "reasoning_content", &text);
                }
            }
            "function_call" | "custom_tool_call" => {
                let call = past_call(item, kind)?;
                let turn = assistant_turn(&mut out);
                match turn.get_mut("tool_calls").and_then(Value::as_array_mut) {
                    Some(calls) => calls.push(call),
                    None => turn["tool_calls"] = json!([call]),
                }
            }
            "function_call_output" | "custom_tool_call_output" => {
                let call_id = item
                    .get("call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(format!("a `{kind}` item needs a string `call_id`")))?;
                let content = match item.get("output") {
                    None | Some(Value::Null) => Value::String(String::new()),
                    Some(Value::String(text)) => Value::String(text.clone()),
                    Some(Value::Array(parts)) => content(parts, &mut images, ignored)?,
                    // Early Codex versions sent a failure as `{content, success: false}`.
                    Some(Value::Object(payload))
                        if payload.get("content").is_some_and(Value::is_string) =>
                    {
                        payload["content"].clone()
                    }
                    Some(_) => {
                        return Err(bad(format!(
                            "a `{kind}` item's `output` must be a string or content parts"
                        )))
                    }
                };
                out.push(json!({"role": "tool", "content": content, "tool_call_id": call_id}));
            }
            other => ignored.add(format!("`{other}` input item")),
        }
    }
    if !out.iter().any(|m| m["role"] != "system") {
        // Nothing but instructions (Codex probes the endpoint so): an empty user turn, which
        // every template can end with its generation prompt.
        out.push(json!({"role": "user", "content": ""}));
    }
    Ok((convert::fold_system_messages(out), images))
}

/// A `message` item: `user`, `system` and `developer` turns, and past `assistant` text.
fn message(
    item: &Value,
    out: &mut Vec<Value>,
    images: &mut convert::Images,
    ignored: &mut Dropped,
) -> Result<(), ApiError> {
    let role = item
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("a `message` item needs a string `role`"))?;
    let content = match item.get("content") {
        Some(Value::String(text)) => Value::String(text.clone()),
        Some(Value::Array(parts)) => content(parts, images, ignored)?,
        _ => {
            return Err(bad(
                "a message's `content` must be a string or an array of parts",
            ))
        }
    };
    match role {
        "user" => out.push(json!({"role": "user", "content": content})),
        "system" | "developer" => out.push(json!({"role": "system", "content": text_of(&content)})),
        "assistant" => {
            let text = text_of(&content);
            let turn = assistant_turn(out);
            if !text.is_empty() {
                append(turn, "content", &text);
            }
        }
        other => {
            return Err(bad(format!(
                "unknown message role `{other}` (user, assistant, system or developer)"
            )))
        }
    }
    Ok(())
}

/// Content parts as template content: text (`input_text`, `output_text`, `text`, a refusal)
/// and inline images (`input_image` as a data URI); other parts are dropped into `ignored`.
fn content(
    parts: &[Value],
    images: &mut convert::Images,
    ignored: &mut Dropped,
) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut out = Vec::new();
    for part in parts {
        let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
        match kind {
            "input_text" | "output_text" | "text" | "refusal" => {
                let key = if kind == "refusal" { "refusal" } else { "text" };
                let piece = part
                    .get(key)
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(format!("an `{kind}` part needs a string `{key}`")))?;
                text.push_str(piece);
                out.push(json!({"type": "text", "text": piece}));
            }
            "input_image" => {
                let url = match part.get("image_url") {
                    Some(Value::String(url)) => url.as_str(),
                    Some(Value::Object(image)) => {
                        image.get("url").and_then(Value::as_str).unwrap_or("")
                    }
                    _ if part.get("file_id").is_some() => {
                        return Err(bad(
                            "file ids are not supported: send the image inline as a data URI \
                             (data:image/png;base64,...) in `image_url`",
                        ))
                    }
                    _ => return Err(bad("an `input_image` part needs `image_url`")),
                };
                images.push(convert::inline_image(url)?);
                out.push(json!({"type": "image"}));
            }
            "" => return Err(bad("each content part needs a string `type`")),
            other => ignored.add(format!("`{other}` content part")),
        }
    }
    Ok(match out.iter().any(|part| part["type"] == "image") {
        true => Value::Array(out),
        false => Value::String(text),
    })
}

/// The text of template content (its text parts when it holds images).
fn text_of(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
        _ => String::new(),
    }
}

/// Our reasoning comes back in `encrypted_content` (we put its text there); a client's own
/// `content` text or, lacking both, the summary stands in for it.
fn reasoning_text(item: &Value) -> String {
    if let Some(text) = item.get("encrypted_content").and_then(Value::as_str) {
        return text.to_string();
    }
    let texts = |key: &str| -> String {
        item.get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let content = texts("content");
    match content.is_empty() {
        true => texts("summary"),
        false => content,
    }
}

/// A past call as the template's `tool_calls` entry, named by its flat name.
fn past_call(item: &Value, kind: &str) -> Result<Value, ApiError> {
    let name = item
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("a `{kind}` item needs a string `name`")))?;
    let namespace = item.get("namespace").and_then(Value::as_str);
    let arguments = if kind == "custom_tool_call" {
        json!({"input": item.get("input").and_then(Value::as_str).unwrap_or_default()})
    } else {
        match item.get("arguments") {
            Some(Value::String(text)) => {
                serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.clone()))
            }
            Some(other) => other.clone(),
            None => json!({}),
        }
    };
    let mut call = json!({"type": "function",
        "function": {"name": join_name(namespace, name), "arguments": arguments}});
    if let Some(id) = item.get("call_id").filter(|id| id.is_string()) {
        call["id"] = id.clone();
    }
    Ok(call)
}

/// The assistant turn that reasoning, text and calls of one response add to: the last message
/// when it is an assistant's, else a new one.
fn assistant_turn(out: &mut Vec<Value>) -> &mut Value {
    if out.last().is_none_or(|last| last["role"] != "assistant") {
        out.push(json!({"role": "assistant", "content": ""}));
    }
    out.last_mut().expect("just pushed")
}

/// Adds text to a string field of a template message, a newline apart.
fn append(message: &mut Value, key: &str, text: &str) {
    match message.get_mut(key) {
        Some(Value::String(old)) if !old.is_empty() => {
            old.push('\n');
            old.push_str(text);
        }
        _ => message[key] = Value::String(text.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_flatten_with_codex_join_rule_and_map_back() {
        let mut ignored = Dropped::default();
        let tools = tools(
            Some(&[
                json!({"type": "function", "name": "exec_command", "parameters": {"type": "object"}}),
                json!({"type": "namespace", "name": "multi_agent_v1_", "description": "agents",
                       "tools": [{"type": "function", "name": "_spawn", "description": "d"},
                                 {"type": "custom", "name": "patch"}]}),
                json!({"type": "web_search"}),
                json!({"type": "custom", "name": "apply_patch",
                       "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}}),
                json!({"type": "image_generation"}),
            ]),
            &mut ignored,
        )
        .unwrap();
        let names: Vec<&str> = tools
            .functions
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "exec_command",
                "multi_agent_v1__spawn",
                "multi_agent_v1__patch",
                "apply_patch"
            ]
        );
        assert_eq!(
            tools.names.get("multi_agent_v1__spawn"),
            ToolName {
                name: "_spawn".into(),
                namespace: Some("multi_agent_v1_".into()),
                custom: false
            }
        );
        assert!(tools.names.get("apply_patch").custom);
        let input = &tools.functions[3]["function"]["parameters"]["properties"]["input"];
        assert!(input["description"].as_str().unwrap().contains("start: x"));
        assert_eq!(
            ignored.kinds(),
            ["`image_generation` tool", "`web_search` tool"]
        );
        // A call by the inner name alone finds its namespace when unambiguous.
        let mut tools = tools;
        let choice = tool_choice(
            Some(&json!({"type": "function", "name": "_spawn"})),
            &mut tools,
            &mut ignored,
        )
        .unwrap();
        assert_eq!(
            choice,
            Some(json!({"type": "function", "function": {"name": "multi_agent_v1__spawn"}}))
        );
        let error = tool_choice(Some(&json!("sometimes")), &mut tools, &mut ignored).unwrap_err();
        assert!(error.to_string().contains("`tool_choice`"), "{error}");
    }

    #[test]
    fn items_become_turns_and_system_text_stays_in_place() {
        let mut ignored = Dropped::default();
        let input = [
            json!({"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox"}]}),
            json!({"role": "user", "content": "list files"}),
            json!({"type": "reasoning", "summary": [], "encrypted_content": "I should run ls"}),
            json!({"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{\"cmd\":\"ls\"}"}),
            json!({"type": "function_call", "call_id": "c2", "namespace": "ns", "name": "read", "arguments": "{}"}),
            json!({"type": "function_call_output", "call_id": "c1", "output": "a.txt"}),
            json!({"type": "custom_tool_call", "call_id": "c3", "name": "apply_patch", "input": "*** Begin"}),
            json!({"type": "custom_tool_call_output", "call_id": "c3", "output": [{"type": "input_text", "text": "done"}]}),
            json!({"type": "message", "role": "developer", "content": "mode changed"}),
            json!({"type": "web_search_call", "status": "completed"}),
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}),
            json!({"role": "user", "content": [{"type": "input_text", "text": "thanks"}]}),
        ];
        let (out, images) = messages(Some(&json!("be brief")), &input, &mut ignored).unwrap();
        assert!(images.is_empty());
        assert_eq!(
            out[0],
            json!({"role": "system", "content": "be brief\n\nsandbox"})
        );
        assert_eq!(out[1], json!({"role": "user", "content": "list files"}));
        assert_eq!(out[2]["reasoning_content"], "I should run ls");
        assert_eq!(
            out[2]["tool_calls"][0],
            json!({"type": "function", "id": "c1",
                   "function": {"name": "exec_command", "arguments": {"cmd": "ls"}}})
        );
        assert_eq!(out[2]["tool_calls"][1]["function"]["name"], "ns__read");
        assert_eq!(
            out[3],
            json!({"role": "tool", "content": "a.txt", "tool_call_id": "c1"})
        );
        assert_eq!(
            out[4]["tool_calls"][0]["function"]["arguments"],
            json!({"input": "*** Begin"})
        );
        // The later developer message ends the tool turn before it, not a new turn.
        assert_eq!(out[5]["role"], "tool");
        let tool_text = out[5]["content"].as_str().unwrap();
        assert!(tool_text.starts_with("done\n\n") && tool_text.contains("mode changed"));
        assert_eq!(out[6], json!({"role": "assistant", "content": "ok"}));
        assert_eq!(out[7], json!({"role": "user", "content": "thanks"}));
        assert_eq!(out.len(), 8);
        assert_eq!(ignored.kinds(), ["`web_search_call` input item"]);
    }

    #[test]
    fn bad_items_are_refused_clearly() {
        let refuse = |input: Value| {
            let items = input.as_array().unwrap().clone();
            messages(None, &items, &mut Dropped::default())
                .unwrap_err()
                .to_string()
        };
        assert!(refuse(json!([{"content": "x"}])).contains("`type`"));
        assert!(
            refuse(json!([{"type": "function_call_output", "call_id": "c", "output": 5}]))
                .contains("`output`")
        );
        // Early Codex's failure payload is taken.
        let (out, _) = messages(
            None,
            &[json!({"type": "function_call_output", "call_id": "c",
                     "output": {"content": "failed", "success": false}})],
            &mut Dropped::default(),
        )
        .unwrap();
        assert_eq!(out[0]["content"], "failed");
        assert!(refuse(json!([{"role": "tool", "content": "x"}])).contains("unknown message role"));
        assert!(
            refuse(json!([{"type": "function_call_output", "output": "x"}])).contains("call_id")
        );
        assert!(refuse(json!([{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]))
            .contains("remote image URLs"));
    }
}
