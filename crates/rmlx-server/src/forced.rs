//! Forced tool calls (OpenAI `tool_choice: "required"` or a named function, Anthropic `any` or
//! `tool`): the prompt is prefilled with the opening of a call and the answer constrained to that
//! call's JSON, so the call is valid whatever the model would have written.
//!
//! - Qwen3's JSON format: the prompt ends in `<tool_call>\n` and the answer is
//!   `{"name": NAME, "arguments": ARGS}` with NAME an offered tool and ARGS valid for its
//!   parameters.
//! - The XML format (Qwen3.5 / 3.6, `xml_calls`) with one tool to call (a named one, or the only
//!   one offered): the prompt ends in `<tool_call>\n<function=NAME>\n` and the answer is ARGS,
//!   the JSON object of the arguments, valid for the parameters. The grammar the engine takes is
//!   JSON (a JSON schema, then only EOS), which cannot write `<parameter=KEY>\nVALUE\n</parameter>`
//!   blocks with raw string values, so the arguments come as one JSON object inside the opened
//!   function rather than as parameter blocks: every value and the object's own keywords
//!   (`required`, `additionalProperties`, ...) are enforced, in the one generation. With several
//!   tools to choose from the name cannot be left open in XML (`<function=` then a grammar over
//!   raw names), so those calls use the JSON form above, `<tool_call>\n{"name", "arguments"}`.
//!
//! - A freeform tool with a grammar (Responses `custom` tools) as the one tool to call, in the XML
//!   format: the prompt ends in `<tool_call>\n<function=NAME>\n<parameter=input>\n` and the
//!   answer is the raw input in the tool's grammar, then `\n</parameter>\n</function>`. In the
//!   JSON format its input is a JSON string, held by the string's `pattern` to the grammar's
//!   regex (a regex, or a Lark grammar without recursion: `lark_regex`; a recursive one cannot be
//!   mapped into a JSON string's escapes and is only shown to the model).
//!
//! Reference: vLLM's `tool_choice="required"` (a JSON-schema guided decode over the tools,
//! whatever the model's own call format).

use rmlx_engine::constrain::{ResponseFormat, ToolInputGrammar};
use serde_json::{json, Value};

use crate::{
    error::ApiError,
    parse::{OutputParser, ToolFormat, TOOL_OPEN},
    responses::input::CustomGrammar,
    xml_calls::{raw_input_opening, FUNCTION_OPEN, RAW_INPUT_CLOSING},
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
/// to the named one), as (name, parameters schema).
#[derive(Debug, Clone, PartialEq)]
pub struct ForcedCall {
    tools: Vec<(String, Value)>,
    /// The grammar of the one tool to call, when it is a freeform tool that gives one.
    input_grammar: Option<CustomGrammar>,
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
        let tools = tools
            .iter()
            .map(|tool| {
                let function = &tool["function"];
                // No parameters: a function of no arguments (as OpenAI reads it).
                let parameters = function
                    .get("parameters")
                    .filter(|p| !p.is_null())
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
                let name = function["name"].as_str().unwrap_or_default().to_string();
                (name, parameters)
            })
            .collect();
        Ok(Some(Self {
            tools,
            input_grammar: None,
        }))
    }

    /// Knows the freeform tools' grammars (by flat name): one of them as the only tool to call
    /// is written as its raw input where the format allows (see the module's notes).
    pub fn with_grammars(mut self, grammars: &[(String, CustomGrammar)]) -> Self {
        if let [(name, _)] = self.tools.as_slice() {
            self.input_grammar = grammars
                .iter()
                .find(|(tool, _)| tool == name)
                .map(|(_, grammar)| grammar.clone());
        }
        self
    }

    /// The freeform tool (name, grammar) whose raw input is the answer.
    fn raw_input(&self, format: ToolFormat) -> Option<(&str, &CustomGrammar)> {
        match (format, self.tools.as_slice(), &self.input_grammar) {
            (ToolFormat::Xml, [(name, _)], Some(grammar)) => Some((name, grammar)),
            _ => None,
        }
    }

    /// The function the prompt names, when the format writes the name as text (XML) and there is
    /// only one to call.
    fn named(&self, format: ToolFormat) -> Option<&(String, Value)> {
        match (format, self.tools.as_slice()) {
            (ToolFormat::Xml, [only]) => Some(only),
            _ => None,
        }
    }

    /// The grammar of the answer: the call's JSON, or the named function's arguments.
    pub fn response_format(&self, format: ToolFormat) -> ResponseFormat {
        if let Some((name, grammar)) = self.raw_input(format) {
            return ResponseFormat::ToolInput(ToolInputGrammar {
                tool: name.to_string(),
                syntax: grammar.syntax,
                definition: grammar.definition.clone(),
                closing: RAW_INPUT_CLOSING.to_string(),
            });
        }
        // Lenient: a keyword the grammar cannot enforce is skipped rather than failing the call.
        if let Some((_, parameters)) = self.named(format) {
            return ResponseFormat::json_schema(parameters.clone(), false);
        }
        // A freeform tool's grammar as its JSON string's pattern.
        let pattern = self.input_grammar.as_ref().and_then(CustomGrammar::regex);
        let calls: Vec<Value> = self
            .tools
            .iter()
            .map(|(name, parameters)| {
                let mut parameters = parameters.clone();
                if let (Some(pattern), Some(input)) =
                    (&pattern, parameters.pointer_mut("/properties/input"))
                {
                    input["pattern"] = json!(format!("^(?:{pattern})$"));
                }
                json!({"type": "object",
                       "properties": {"name": {"const": name}, "arguments": parameters},
                       "required": ["name", "arguments"], "additionalProperties": false})
            })
            .collect();
        ResponseFormat::json_schema(json!({"anyOf": calls}), false)
    }

    /// The parser of the answer (held whole to the end).
    pub fn parser(&self, format: ToolFormat) -> OutputParser {
        if let Some((name, _)) = self.raw_input(format) {
            return OutputParser::forced_input(name, RAW_INPUT_CLOSING);
        }
        match self.named(format) {
            Some((name, _)) => OutputParser::forced_arguments(name),
            None => OutputParser::forced_call(),
        }
    }

    /// The assistant prefill: the client's own (Anthropic), then the call's opening as the model
    /// writes it, after closing a think block the prompt left open (as the template writes an
    /// empty one: `<think>\n\n</think>\n\n`).
    pub fn prefill(&self, before: &str, in_reasoning: bool, format: ToolFormat) -> String {
        let mut prefill = before.to_string();
        if in_reasoning {
            prefill.push_str(&crate::generation::closed_think());
        } else if !prefill.is_empty() && !prefill.ends_with('\n') {
            prefill.push('\n');
        }
        prefill.push_str(TOOL_OPEN);
        prefill.push('\n');
        if let Some((name, _)) = self.raw_input(format) {
            prefill.push_str(&raw_input_opening(name));
        } else if let Some((name, _)) = self.named(format) {
            prefill.push_str(&format!("{FUNCTION_OPEN}{name}>\n"));
        }
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
        // With several tools the XML format takes the JSON form too.
        for format in [ToolFormat::Json, ToolFormat::Xml] {
            let ResponseFormat::JsonSchema { json_schema } = forced.response_format(format) else {
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
            assert_eq!(forced.prefill("", false, format), "<tool_call>\n");
        }
        assert_eq!(ForcedCall::new(false, Some(&tools)).unwrap(), None);
        for missing in [None, Some(json!([]))] {
            let error = ForcedCall::new(true, missing.as_ref()).unwrap_err();
            assert!(error.to_string().contains("no `tools`"), "{error}");
        }
    }

    #[test]
    fn one_xml_tool_is_named_in_the_prompt_and_its_arguments_are_the_answer() {
        let city = json!({"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]});
        let forced = ForcedCall::new(true, Some(&json!([tool("w", Some(city.clone()))])))
            .unwrap()
            .unwrap();
        let ResponseFormat::JsonSchema { json_schema } = forced.response_format(ToolFormat::Xml)
        else {
            panic!("a JSON schema");
        };
        assert_eq!(json_schema.schema, city);
        assert_eq!(
            forced.prefill("", true, ToolFormat::Xml),
            "\n</think>\n\n<tool_call>\n<function=w>\n"
        );
        let parsed = forced
            .parser(ToolFormat::Xml)
            .parse("{\"city\": \"Paris\"}");
        assert_eq!(parsed.tool_calls[0].name, "w");
        assert_eq!(parsed.tool_calls[0].arguments, json!({"city": "Paris"}));
        // Qwen3's JSON form names the function in the answer even for one tool.
        assert_eq!(forced.prefill("", false, ToolFormat::Json), "<tool_call>\n");
        let parsed = forced
            .parser(ToolFormat::Json)
            .parse("{\"name\": \"w\", \"arguments\": {}}");
        assert_eq!(parsed.tool_calls[0].name, "w");
    }

    #[test]
    fn the_prefill_opens_the_call() {
        let forced = ForcedCall::new(true, Some(&json!([tool("w", None)])))
            .unwrap()
            .unwrap();
        assert_eq!(forced.prefill("", false, ToolFormat::Json), "<tool_call>\n");
        assert_eq!(
            forced.prefill("", true, ToolFormat::Json),
            "\n</think>\n\n<tool_call>\n",
            "a think block the template opened is closed first, as an empty one"
        );
        assert_eq!(
            forced.prefill("Checking.", false, ToolFormat::Json),
            "Checking.\n<tool_call>\n"
        );
    }
}
