//! The XML tool-call format of Qwen3.5 / Qwen3.6 (and Qwen3-Coder): inside `<tool_call>` …
//! `</tool_call>`, one `<function=NAME>` block of `<parameter=KEY>\nVALUE\n</parameter>` blocks,
//! closed by `</function>`. Values are text: strings verbatim, anything else JSON, so each is read
//! back as the type the tool's JSON schema declares for it. Whether a model writes this format is
//! read off its chat template (how it renders a past call), not its architecture: Qwen3-Coder is
//! a `qwen3_moe` with this template, and a fine-tune may change the template.
//!
//! References: Qwen's Qwen3.5 / Qwen3.6 `chat_template.jinja` (the format it teaches and how it
//! renders history: strings `| string`, others `| tojson` in 3.6; in 3.5 only mappings and
//! sequences are `tojson`, so booleans and null come back as Python's `True` / `None`), and
//! vLLM's `qwen3_coder` tool parser (value types from the schema; read for understanding). Unlike
//! vLLM, a call that does not have this shape is not guessed at: the caller returns it as text.

use std::collections::HashMap;

use rmlx_engine::chat::{ChatTokenizer, TemplateOptions};
use serde_json::{json, Map, Value};

use crate::parse::ToolCall;

pub const FUNCTION_OPEN: &str = "<function=";
pub const FUNCTION_CLOSE: &str = "</function>";
pub const PARAMETER_OPEN: &str = "<parameter=";
pub const PARAMETER_CLOSE: &str = "</parameter>";

/// A freeform tool's call up to its raw input (`input`, its one parameter), as the template
/// writes it: what switches the tool's grammar on.
pub fn raw_input_opening(name: &str) -> String {
    format!("{FUNCTION_OPEN}{name}>\n{PARAMETER_OPEN}input>\n")
}

/// What closes that input and the call's function block.
pub const RAW_INPUT_CLOSING: &str = "\n</parameter>\n</function>";

/// The offered tools by name, with their parameter schemas (what the values are converted to).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct XmlTools {
    parameters: HashMap<String, Value>,
}

impl XmlTools {
    /// From the template's function tools (`[{"type": "function", "function": {"name",
    /// "parameters"}}]`, both APIs' tools converted); entries without a name are skipped.
    pub fn from_tools(tools: &Value) -> Self {
        let parameters = tools
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|tool| {
                let function = tool.get("function")?;
                let name = function.get("name")?.as_str()?;
                let schema = function.get("parameters").cloned().unwrap_or(Value::Null);
                Some((name.to_string(), schema))
            })
            .collect();
        Self { parameters }
    }
}

/// Reads one call body (the text between `<tool_call>` and `</tool_call>`), or says why it is
/// not a call of an offered tool in this format.
pub fn parse_call(body: &str, tools: &XmlTools) -> Result<ToolCall, String> {
    let rest = body
        .trim_start()
        .strip_prefix(FUNCTION_OPEN)
        .ok_or("no <function=NAME> opens it")?;
    let (name, mut rest) = tag_name(rest).ok_or("its <function= tag is not closed by `>`")?;
    let schema = tools
        .parameters
        .get(name)
        .ok_or_else(|| format!("`{name}` is not one of the offered tools"))?;
    let mut arguments = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix(FUNCTION_CLOSE) {
            if !after.trim().is_empty() {
                return Err(format!("text follows </function>: {:?}", after.trim()));
            }
            break;
        }
        let Some(after) = rest.strip_prefix(PARAMETER_OPEN) else {
            return Err(if rest.is_empty() {
                "<function=…> is not closed by </function>".to_string()
            } else {
                format!("unexpected text in <function={name}>: {:?}", clip(rest))
            });
        };
        let (key, after) =
            tag_name(after).ok_or("a <parameter= tag is not closed by `>`".to_string())?;
        let unclosed = || format!("<parameter={key}> is not closed by </parameter>");
        let end = after.find(PARAMETER_CLOSE).ok_or_else(unclosed)?;
        let raw = &after[..end];
        // A parameter opening inside the value: the value before it was never closed.
        if raw.contains(PARAMETER_OPEN) {
            return Err(unclosed());
        }
        let text = raw.strip_prefix('\n').unwrap_or(raw);
        let text = text.strip_suffix('\n').unwrap_or(text);
        arguments.insert(key.to_string(), convert_value(text, key, schema));
        rest = &after[end + PARAMETER_CLOSE.len()..];
    }
    Ok(ToolCall {
        name: name.to_string(),
        arguments: Value::Object(arguments),
    })
}

/// `NAME>` at the start of `text`: the name (one line, no `<`) and what follows the `>`.
fn tag_name(text: &str) -> Option<(&str, &str)> {
    let (name, rest) = text.split_once('>')?;
    let name = name.trim();
    let bad = name.is_empty() || name.contains(['\n', '<']);
    (!bad).then_some((name, rest))
}

fn clip(text: &str) -> String {
    text.chars().take(40).collect()
}

/// A value as the type its schema declares: string (or no declared type) as the text itself;
/// integer, number, boolean, null, object and array parsed as JSON (booleans and null also in the
/// Python spelling the Qwen3.5 template renders them in), falling back to the text when that
/// fails. A value that may be a string or something else is the other type when it parses as one.
pub fn convert_value(text: &str, key: &str, parameters: &Value) -> Value {
    let mut types = Vec::new();
    if let Some(schema) = property_schema(parameters, key) {
        declared_types(schema, parameters, 0, &mut types);
    }
    let others: Vec<&str> = types.iter().copied().filter(|t| *t != "string").collect();
    if others.is_empty() {
        return Value::String(text.to_string());
    }
    match parse_typed(text.trim(), &others, others.len() < types.len()) {
        Some(value) => value,
        None => Value::String(text.to_string()),
    }
}

/// The text as one of `types` (JSON type names other than string), if it reads as one. With
/// `string` also allowed (the caller falls back to it) JSON of another type is not enough.
fn parse_typed(text: &str, types: &[&str], or_string: bool) -> Option<Value> {
    let allows = |name: &str| types.contains(&name);
    if allows("boolean") {
        if text.eq_ignore_ascii_case("true") {
            return Some(Value::Bool(true));
        }
        if text.eq_ignore_ascii_case("false") {
            return Some(Value::Bool(false));
        }
    }
    if allows("null") && (text == "null" || text == "None") {
        return Some(Value::Null);
    }
    let value: Value = serde_json::from_str(text).ok()?;
    let fits = match &value {
        Value::Null => allows("null"),
        Value::Bool(_) => allows("boolean"),
        Value::Number(number) => {
            allows("number") || (allows("integer") && (number.is_i64() || number.is_u64()))
        }
        Value::String(_) => false,
        Value::Array(_) => allows("array"),
        Value::Object(_) => allows("object"),
    };
    // JSON of another type (3.0 for an integer) is still closer to what the model meant than
    // its text, unless a string would also do.
    (fits || !or_string).then_some(value)
}

/// The schema of parameter `key`: its `properties` entry, else an `additionalProperties` schema.
fn property_schema<'s>(parameters: &'s Value, key: &str) -> Option<&'s Value> {
    parameters
        .get("properties")
        .and_then(|properties| properties.get(key))
        .or_else(|| {
            parameters
                .get("additionalProperties")
                .filter(|a| a.is_object())
        })
}

/// JSON type names a schema allows: `type` (a name or a list), else the types of its `enum` /
/// `const` values, else those of its `anyOf` / `oneOf` / `allOf` members, following local `$ref`s
/// (`#/$defs/…`, `#/definitions/…`) into the tool's parameters.
fn declared_types<'s>(schema: &'s Value, root: &'s Value, depth: usize, out: &mut Vec<&'s str>) {
    if depth > 8 {
        return;
    }
    let mut push = |name: &'s str| {
        if !out.contains(&name) {
            out.push(name);
        }
    };
    match schema.get("type") {
        Some(Value::String(name)) => return push(name),
        Some(Value::Array(names)) => return names.iter().filter_map(Value::as_str).for_each(push),
        _ => {}
    }
    let values: Vec<&Value> = match (schema.get("enum"), schema.get("const")) {
        (Some(Value::Array(values)), _) => values.iter().collect(),
        (_, Some(value)) => vec![value],
        _ => Vec::new(),
    };
    if !values.is_empty() {
        for value in values {
            push(json_type(value));
        }
        return;
    }
    if let Some(target) = schema.get("$ref").and_then(Value::as_str) {
        let pointer = target.strip_prefix('#').unwrap_or("/");
        if let Some(found) = root.pointer(pointer) {
            declared_types(found, root, depth + 1, out);
        }
        return;
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        for member in schema
            .get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            declared_types(member, root, depth + 1, out);
        }
    }
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(number) if number.is_i64() || number.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Whether this tokenizer's chat template writes tool calls in the XML format: a past call of a
/// probe function, rendered through the template, comes out as `<function=…>` with
/// `<parameter=…>`. A template that cannot render the probe is taken as not XML (Qwen3's JSON
/// stays the default).
pub fn template_writes_xml(tokenizer: &ChatTokenizer) -> bool {
    if !tokenizer.has_chat_template() {
        return false;
    }
    let tool = json!({"type": "function", "function": {"name": "rmlx_probe",
        "description": "probe", "parameters": {"type": "object",
            "properties": {"rmlx_key": {"type": "string"}}}}});
    let messages = [
        json!({"role": "user", "content": "probe"}),
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call_rmlx_probe",
            "type": "function",
            "function": {"name": "rmlx_probe", "arguments": {"rmlx_key": "rmlx_value"}}}]}),
        json!({"role": "tool", "tool_call_id": "call_rmlx_probe", "content": "done"}),
    ];
    let options = TemplateOptions {
        add_generation_prompt: true,
        tools: Some(json!([tool])),
        ..TemplateOptions::default()
    };
    tokenizer.render(&messages, &options).is_ok_and(|text| {
        text.contains("<function=rmlx_probe>") && text.contains("<parameter=rmlx_key>")
    })
}

/// A conversation with one past `apply_patch` call of `input`, rendered by the fixture's
/// template (where a freeform tool's grammar switches on is read off it).
#[cfg(test)]
pub(crate) fn rendered_apply_patch_call(fixture: &str, input: &str) -> String {
    let tool = json!({"type": "function", "function": {"name": "apply_patch",
        "parameters": {"type": "object", "properties": {"input": {"type": "string"}}}}});
    let messages = [
        json!({"role": "user", "content": "patch"}),
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "c1",
            "type": "function",
            "function": {"name": "apply_patch", "arguments": {"input": input}}}]}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "done"}),
    ];
    let options = TemplateOptions {
        add_generation_prompt: true,
        tools: Some(json!([tool])),
        ..TemplateOptions::default()
    };
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(fixture);
    ChatTokenizer::from_dir(&dir)
        .unwrap()
        .render(&messages, &options)
        .unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> XmlTools {
        XmlTools::from_tools(&json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "scale": {"type": "number"},
                    "metric": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "options": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                    "zone": {"enum": ["UTC", "CET"]},
                    "level": {"enum": [1, 2, 3]},
                    "when": {"$ref": "#/$defs/when"},
                    "either": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
                "$defs": {"when": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "now"}}
        ]))
    }

    fn call(body: &str) -> Result<ToolCall, String> {
        parse_call(body, &tools())
    }

    #[test]
    fn values_take_their_declared_types() {
        let body = "\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n\
            <parameter=days>\n3\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n\
            <parameter=metric>\ntrue\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n\
            <parameter=options>\n{\"x\": {\"y\": null}}\n</parameter>\n\
            <parameter=zone>\nCET\n</parameter>\n<parameter=level>\n2\n</parameter>\n\
            <parameter=when>\n7\n</parameter>\n<parameter=either>\nFalse\n</parameter>\n\
            </function>\n";
        let parsed = call(body).unwrap();
        assert_eq!(parsed.name, "get_weather");
        assert_eq!(
            parsed.arguments,
            json!({"city": "New York", "days": 3, "scale": 1.5, "metric": true,
                   "tags": ["a", "b"], "options": {"x": {"y": null}}, "zone": "CET",
                   "level": 2, "when": 7, "either": false})
        );
        // Keys keep the model's order (preserve_order), as the template renders them back.
        let keys: Vec<&String> = parsed.arguments.as_object().unwrap().keys().collect();
        assert_eq!(keys[..3], ["city", "days", "scale"]);
    }

    #[test]
    fn strings_are_verbatim_but_for_one_newline_each_side() {
        let body = "<function=get_weather>\n<parameter=city>\n\n  two\nlines \n\n</parameter>\n</function>";
        assert_eq!(
            call(body).unwrap().arguments,
            json!({"city": "\n  two\nlines \n"})
        );
        // No newlines at all, and an empty value.
        let body = "<function=get_weather><parameter=city>Paris</parameter><parameter=note>\n</parameter></function>";
        assert_eq!(
            call(body).unwrap().arguments,
            json!({"city": "Paris", "note": ""})
        );
        // A string that looks like JSON stays a string.
        let body = "<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>";
        assert_eq!(call(body).unwrap().arguments, json!({"city": "42"}));
    }

    #[test]
    fn unparseable_typed_values_fall_back_to_the_text() {
        let body = "<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n\
            <parameter=tags>\n[a, b\n</parameter>\n<parameter=metric>\nyes\n</parameter>\n</function>";
        assert_eq!(
            call(body).unwrap().arguments,
            json!({"days": "three", "tags": "[a, b", "metric": "yes"})
        );
    }

    #[test]
    fn python_spellings_and_nullable_strings() {
        // Qwen3.5's template renders a past `true` / `null` as `True` / `None`.
        let body = "<function=get_weather>\n<parameter=metric>\nTrue\n</parameter>\n\
            <parameter=note>\nNone\n</parameter>\n</function>";
        assert_eq!(
            call(body).unwrap().arguments,
            json!({"metric": true, "note": null})
        );
        let body = "<function=get_weather>\n<parameter=note>\nnull\n</parameter>\n</function>";
        assert_eq!(call(body).unwrap().arguments, json!({"note": null}));
        let body = "<function=get_weather>\n<parameter=note>\n12\n</parameter>\n</function>";
        assert_eq!(call(body).unwrap().arguments, json!({"note": "12"}));
    }

    #[test]
    fn undeclared_parameters_and_tools_without_parameters() {
        let body = "<function=get_weather>\n<parameter=extra>\n5\n</parameter>\n</function>";
        assert_eq!(call(body).unwrap().arguments, json!({"extra": "5"}));
        assert_eq!(
            call("<function=now>\n</function>\n").unwrap(),
            ToolCall {
                name: "now".into(),
                arguments: json!({})
            }
        );
    }

    #[test]
    fn malformed_calls_say_why() {
        let why = |body: &str| call(body).unwrap_err();
        assert!(why("\n{\"name\": \"now\", \"arguments\": {}}\n").contains("<function=NAME>"));
        assert!(why("<function=now\n</function>").contains("not closed by `>`"));
        assert!(why("<function=launch>\n</function>").contains("`launch` is not one of"));
        let unclosed = "<function=get_weather>\n<parameter=city>\nParis\n</function>";
        assert!(why(unclosed).contains("<parameter=city> is not closed"));
        let unclosed =
            "<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</parameter>\n</function>";
        assert!(why(unclosed).contains("<parameter=city> is not closed"));
        assert!(why("<function=now>\n").contains("not closed by </function>"));
        assert!(why("<function=now>\nhello\n</function>").contains("unexpected text"));
        assert!(
            why("<function=now>\n</function>\n<function=now>\n</function>")
                .contains("text follows")
        );
    }

    #[test]
    fn the_probe_tells_the_xml_templates_apart() {
        let release = |name: &str| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures")
                .join(name)
        };
        for name in ["releases/qwen3.6-27b", "releases/qwen3.5-35b-a3b"] {
            let tokenizer = ChatTokenizer::from_dir(&release(name)).unwrap();
            assert!(template_writes_xml(&tokenizer), "{name}");
        }
        for name in ["qwen3-tiny", "releases/qwen3-4b", "releases/gemma-4-e2b-it"] {
            let tokenizer = ChatTokenizer::from_dir(&release(name)).unwrap();
            assert!(!template_writes_xml(&tokenizer), "{name}");
        }
    }

    /// A freeform tool's grammar switches on at `raw_input_opening` and its input ends at
    /// `RAW_INPUT_CLOSING`: both exactly as the real templates write a past call of it.
    #[test]
    fn a_raw_input_opens_and_closes_as_the_templates_write_it() {
        let input = "*** Begin Patch\n*** Delete File: a.txt\n*** End Patch";
        let written = format!(
            "{}{input}{RAW_INPUT_CLOSING}",
            raw_input_opening("apply_patch")
        );
        for name in [
            "qwen3.6-27b",
            "qwen3.6-35b-a3b",
            "qwen3.5-35b-a3b",
            "qwen3.5-0.8b",
        ] {
            let text = rendered_apply_patch_call(&format!("releases/{name}"), input);
            assert!(text.contains(&written), "{name}: {text}");
        }
    }
}
