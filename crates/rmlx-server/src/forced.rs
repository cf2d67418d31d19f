//! Forced tool calls (OpenAI `tool_choice: "required"` or a named function, Anthropic `any` or
//! `tool`): the prompt is prefilled with the opening of a Qwen3 call and the answer constrained
//! to that call's JSON, `{"name": NAME, "arguments": ARGS}` with NAME an offered tool and ARGS
//! valid for its parameters, so the call is valid whatever the model would have written.
//! Reference: vLLM's `tool_choice="required"` (a JSON-schema guided decode over the tools).

use rmlx_engine::constrain::ResponseFormat;
use serde_json::{json, Value};

use crate::{
    error::ApiError,
    parse::{THINK_CLOSE, TOOL_OPEN},
};

/// OpenAI: `"required"`, or `{"type": "function", "function": {"name": ..}}`.
pub fn openai_requires_call(choice: Option<&Value>) -> bool {
    match choice {
        Some(Value::String(mode)) => mode == "required",
        Some(choice) => choice.pointer("/function/name").is_some(),
        None => false,
    }
}

/// Anthropic: `{"type": "any"}` or `{"type": "tool", "name": ..}`.
pub fn anthropic_requires_call(choice: Option<&Value>) -> bool {
    let kind = choice.and_then(|c| c.get("type")).and_then(Value::as_str);
    matches!(kind, Some("any" | "tool"))
}

/// The call a request obliges: one of `tools` (the template's function tools, already narrowed
/// to the named one).
#[derive(Debug, Clone, PartialEq)]
pub struct ForcedCall {
    format: ResponseFormat,
}

impl ForcedCall {
    /// None unless `required`; a required call with no tools to call is the request's error.
    pub fn new(required: bool, tools: Option<&Value>) -> Result<Option<Self>, ApiError> {
        if !required {
            return Ok(None);
        }
        let tools = tools
            .and_then(Value::as_array)
            .filter(|tools| !tools.is_empty())
            .ok_or_else(|| {
                ApiError::BadRequest(
                    "`tool_choice` requires a call but no `tools` are given".into(),
                )
            })?;
        let calls: Vec<Value> = tools
            .iter()
            .map(|tool| {
                let function = &tool["function"];
                // No parameters: a function of no arguments (as OpenAI reads it).
                let parameters = function
                    .get("parameters")
                    .filter(|p| !p.is_null())
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
                json!({"type": "object",
                       "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                       "required": ["name", "arguments"], "additionalProperties": false})
            })
            .collect();
        // Lenient: a keyword the grammar cannot enforce is skipped rather than failing the call.
        let format = ResponseFormat::json_schema(json!({"anyOf": calls}), false);
        Ok(Some(Self { format }))
    }

    /// The grammar of the call's JSON.
    pub fn response_format(&self) -> ResponseFormat {
        self.format.clone()
    }

    /// The assistant prefill: the client's own (Anthropic), then the call's opening tag as
    /// Qwen3 writes it, after closing a think block the prompt left open.
    pub fn prefill(&self, before: &str, in_reasoning: bool) -> String {
        let mut prefill = before.to_string();
        if in_reasoning {
            prefill.push_str(THINK_CLOSE);
            prefill.push_str("\n\n");
        } else if !prefill.is_empty() && !prefill.ends_with('\n') {
            prefill.push('\n');
        }
        prefill.push_str(TOOL_OPEN);
        prefill.push('\n');
        prefill
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, parameters: Option<Value>) -> Value {
        let mut function = json!({"name": name});
        if let Some(parameters) = parameters {
            function["parameters"] = parameters;
        }
        json!({"type": "function", "function": function})
    }

    #[test]
    fn which_choices_require_a_call() {
        let openai = |choice: Value| openai_requires_call(Some(&choice));
        assert!(openai(json!("required")));
        assert!(openai(
            json!({"type": "function", "function": {"name": "w"}})
        ));
        assert!(!openai(json!("auto")) && !openai(json!("none")));
        assert!(!openai_requires_call(None));
        let anthropic = |choice: Value| anthropic_requires_call(Some(&choice));
        assert!(anthropic(json!({"type": "any"})));
        assert!(anthropic(json!({"type": "tool", "name": "w"})));
        assert!(!anthropic(json!({"type": "auto"})) && !anthropic(json!({"type": "none"})));
        assert!(!anthropic_requires_call(None));
    }

    #[test]
    fn the_schema_is_one_call_of_an_offered_tool() {
        let city = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let tools = json!([tool("w", Some(city.clone())), tool("now", None)]);
        let forced = ForcedCall::new(true, Some(&tools)).unwrap().unwrap();
        let ResponseFormat::JsonSchema { json_schema } = forced.response_format() else {
            panic!("a JSON schema");
        };
        assert_eq!(json_schema.strict, Some(false));
        let calls = json_schema.schema["anyOf"].as_array().unwrap();
        assert_eq!(
            calls[0],
            json!({"type": "object",
                   "properties": {"name": {"const": "w"}, "arguments": city},
                   "required": ["name", "arguments"], "additionalProperties": false})
        );
        assert_eq!(
            calls[1]["properties"]["arguments"],
            json!({"type": "object", "properties": {}})
        );
        assert_eq!(ForcedCall::new(false, Some(&tools)).unwrap(), None);
        for missing in [None, Some(json!([]))] {
            let error = ForcedCall::new(true, missing.as_ref()).unwrap_err();
            assert!(error.to_string().contains("no `tools`"), "{error}");
        }
    }

    #[test]
    fn the_prefill_opens_the_call() {
        let forced = ForcedCall::new(true, Some(&json!([tool("w", None)])))
            .unwrap()
            .unwrap();
        assert_eq!(forced.prefill("", false), "<tool_call>\n");
        assert_eq!(
            forced.prefill("", true),
            "</think>\n\n<tool_call>\n",
            "a think block the template opened is closed first"
        );
        assert_eq!(
            forced.prefill("Checking.", false),
            "Checking.\n<tool_call>\n"
        );
    }
}
