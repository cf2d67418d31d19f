//! Splits model output into content, reasoning (`<think>…</think>`) and tool calls, one chunk at
//! a time, so streaming and non-streaming answers come out identical. Calls are Qwen3's JSON
//! (`<tool_call>{"name":..,"arguments":..}</tool_call>`) or, for templates that teach it (Qwen3.5,
//! Qwen3.6), the XML of `xml_calls`. A call that does not parse is given back as the text the
//! model wrote, with a warning. Pure text: the desktop app reuses it. Reference: vLLM's `qwen3`
//! reasoning parser and `hermes` / `qwen3_coder` tool parsers (same tags).

use serde_json::{json, Value};

use crate::xml_calls::{self, XmlTools};

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";
pub const TOOL_OPEN: &str = "<tool_call>";
pub const TOOL_CLOSE: &str = "</tool_call>";

/// A parsed tool call; `arguments` is the JSON the model wrote (an object normally).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Value,
}

impl ToolCall {
    /// The arguments as the JSON string OpenAI's `function.arguments` carries.
    pub fn arguments_json(&self) -> String {
        self.arguments.to_string()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Content(String),
    Reasoning(String),
    ToolCall(ToolCall),
}

/// How a model writes tool calls inside `<tool_call>` … `</tool_call>`: what its chat template
/// teaches (and renders past calls as).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ToolFormat {
    /// `{"name": NAME, "arguments": {...}}` (Qwen3, and the default for other templates).
    #[default]
    Json,
    /// `<function=NAME>` with `<parameter=KEY>` blocks (Qwen3.5, Qwen3.6, Qwen3-Coder).
    Xml,
}

/// The calls a parser reads: the format, and for XML the offered tools (names and schemas).
#[derive(Debug, Clone, PartialEq)]
enum Calls {
    Json,
    Xml(XmlTools),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    Content,
    Reasoning,
    ToolCall,
    /// The whole output is one call's JSON (the prompt opened the call; a grammar shapes it):
    /// `{"name", "arguments"}`, or with the function named by the prompt, its arguments only.
    ForcedCall(Option<String>),
    /// The whole output is a freeform tool's raw input then `closing` (the prompt opened the
    /// call up to the input; the tool's grammar shapes it).
    ForcedInput {
        name: String,
        closing: String,
    },
}

/// Streaming parser: `push` chunks, then `finish`. Text that might be the start of a tag is held
/// back until the next chunk decides it.
#[derive(Debug)]
pub struct OutputParser {
    mode: Mode,
    buf: String,
    /// None: the request offered no tools, so `<tool_call>` is text.
    calls: Option<Calls>,
    /// Newlines right after a closing tag are layout, not content.
    trim_leading: bool,
    /// Why a call was given back as text, since the last `take_warnings`.
    warnings: Vec<String>,
}

/// Everything a whole answer splits into.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub reasoning: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    /// Calls the model wrote that did not parse (they are in `content`), and why.
    pub warnings: Vec<String>,
}

impl OutputParser {
    /// `in_reasoning`: the prompt already opened `<think>` (templates that force thinking), so
    /// output starts as reasoning. `tools`: the request offered tools, so `<tool_call>` is parsed
    /// (as Qwen3's JSON).
    pub fn new(in_reasoning: bool, tools: bool) -> Self {
        Self::with_calls(in_reasoning, tools.then_some(Calls::Json))
    }

    /// A parser for a request: `tools` are the template's function tools (None: no calls are
    /// parsed), read in the model's `format`.
    pub fn for_tools(in_reasoning: bool, format: ToolFormat, tools: Option<&Value>) -> Self {
        let calls = tools.map(|tools| match format {
            ToolFormat::Json => Calls::Json,
            ToolFormat::Xml => Calls::Xml(XmlTools::from_tools(tools)),
        });
        Self::with_calls(in_reasoning, calls)
    }

    fn with_calls(in_reasoning: bool, calls: Option<Calls>) -> Self {
        Self {
            mode: if in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            buf: String::new(),
            calls,
            trim_leading: in_reasoning,
            warnings: Vec::new(),
        }
    }

    /// A parser for a forced call: the prompt ends in `<tool_call>` and the output is its JSON,
    /// held to the end and given back as one call, or nothing when it was cut short (a broken
    /// call is worse than none).
    pub fn forced_call() -> Self {
        Self::forced(None)
    }

    /// A forced call whose function the prompt already named (`<function=NAME>`): the output is
    /// the JSON object of its arguments, held to the end like `forced_call`'s.
    pub fn forced_arguments(name: &str) -> Self {
        Self::forced(Some(name.to_string()))
    }

    /// A forced call of a freeform tool whose opening the prompt wrote up to the raw input
    /// (XML): the output is the input then `closing`, held to the end, given back as the call
    /// `{"input": RAW}`, or nothing when it was cut short.
    pub fn forced_input(name: &str, closing: &str) -> Self {
        Self {
            mode: Mode::ForcedInput {
                name: name.to_string(),
                closing: closing.to_string(),
            },
            ..Self::forced(None)
        }
    }

    fn forced(name: Option<String>) -> Self {
        Self {
            mode: Mode::ForcedCall(name),
            buf: String::new(),
            calls: Some(Calls::Json),
            trim_leading: false,
            warnings: Vec::new(),
        }
    }

    /// Whether the text pushed next is read as reasoning (what reasoning tokens are counted by).
    pub fn in_reasoning(&self) -> bool {
        self.mode == Mode::Reasoning
    }

    /// Why calls were given back as text since the last call (for the server's log).
    pub fn take_warnings(&mut self) -> Vec<String> {
        std::mem::take(&mut self.warnings)
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.trim_leading {
                let trimmed = self.buf.trim_start_matches(['\n', '\r']);
                if trimmed.is_empty() {
                    self.buf.clear();
                    break;
                }
                self.buf = trimmed.to_string();
                self.trim_leading = false;
            }
            match self.mode {
                Mode::Content => {
                    let mut tags = vec![THINK_OPEN];
                    if self.calls.is_some() {
                        tags.push(TOOL_OPEN);
                    }
                    match earliest(&self.buf, &tags) {
                        Some((at, tag)) => {
                            emit(&mut out, Piece::Content(self.buf[..at].to_string()));
                            self.buf.drain(..at + tag.len());
                            self.mode = if tag == THINK_OPEN {
                                Mode::Reasoning
                            } else {
                                Mode::ToolCall
                            };
                            self.trim_leading = tag == THINK_OPEN;
                        }
                        None => {
                            let keep = held_back(&self.buf, &tags);
                            let ready: String = self.buf.drain(..self.buf.len() - keep).collect();
                            emit(&mut out, Piece::Content(ready));
                            break;
                        }
                    }
                }
                Mode::Reasoning => match self.buf.find(THINK_CLOSE) {
                    Some(at) => {
                        emit(&mut out, Piece::Reasoning(self.buf[..at].to_string()));
                        self.buf.drain(..at + THINK_CLOSE.len());
                        self.mode = Mode::Content;
                        self.trim_leading = true;
                    }
                    None => {
                        let keep = held_back(&self.buf, &[THINK_CLOSE]);
                        let ready: String = self.buf.drain(..self.buf.len() - keep).collect();
                        emit(&mut out, Piece::Reasoning(ready));
                        break;
                    }
                },
                Mode::ToolCall => match self.buf.find(TOOL_CLOSE) {
                    Some(at) => {
                        let body: String = self.buf[..at].to_string();
                        self.buf.drain(..at + TOOL_CLOSE.len());
                        out.push(self.tool_piece(&body, true));
                        self.mode = Mode::Content;
                        self.trim_leading = true;
                    }
                    // A tool call is only useful whole: hold it all until the closing tag.
                    None => break,
                },
                // Not even a closing tag ends it: a JSON string may hold that text.
                Mode::ForcedCall(_) | Mode::ForcedInput { .. } => break,
            }
        }
        out
    }

    /// Flushes what was held back; an unterminated tool call still counts if its JSON parses.
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        match std::mem::replace(&mut self.mode, Mode::Content) {
            Mode::Content => emit(&mut out, Piece::Content(rest)),
            Mode::Reasoning => emit(&mut out, Piece::Reasoning(rest)),
            Mode::ToolCall => out.push(self.tool_piece(&rest, false)),
            Mode::ForcedCall(None) => out.extend(parse_tool_call(&rest).map(Piece::ToolCall)),
            Mode::ForcedCall(Some(name)) => out.extend(
                parse_arguments(&rest)
                    .map(|arguments| Piece::ToolCall(ToolCall { name, arguments })),
            ),
            Mode::ForcedInput { name, closing } => {
                out.extend(rest.strip_suffix(closing.as_str()).map(|input| {
                    Piece::ToolCall(ToolCall {
                        name,
                        arguments: json!({ "input": input }),
                    })
                }))
            }
        }
        out
    }

    /// A tool-call body as a call, or (malformed) back as the literal text the model wrote, with
    /// a warning saying why.
    fn tool_piece(&mut self, body: &str, closed: bool) -> Piece {
        let parsed = match &self.calls {
            Some(Calls::Xml(tools)) => xml_calls::parse_call(body, tools),
            _ => parse_tool_call(body).ok_or_else(|| "its JSON is not a call".to_string()),
        };
        match parsed {
            Ok(call) => Piece::ToolCall(call),
            Err(why) => {
                let text = format!("{TOOL_OPEN}{body}{}", if closed { TOOL_CLOSE } else { "" });
                self.warnings.push(format!(
                    "a tool call the model wrote is returned as text ({why}): {text:?}"
                ));
                Piece::Content(text)
            }
        }
    }

    /// Parses a whole answer with this (fresh) streaming parser, so both paths agree by
    /// construction.
    pub fn parse(mut self, text: &str) -> Parsed {
        let mut pieces = self.push(text);
        pieces.extend(self.finish());
        let mut parsed = Parsed::default();
        for piece in pieces {
            match piece {
                Piece::Content(text) => parsed.content.push_str(&text),
                Piece::Reasoning(text) => parsed
                    .reasoning
                    .get_or_insert_with(String::new)
                    .push_str(&text),
                Piece::ToolCall(call) => parsed.tool_calls.push(call),
            }
        }
        parsed.warnings = self.take_warnings();
        parsed
    }
}

/// Logs why calls were given back as text (the server's log is its stderr).
pub fn log_warnings(warnings: Vec<String>) {
    for warning in warnings {
        eprintln!("rmlx serve: warning: {warning}");
    }
}

/// Parses a whole answer with the streaming parser.
pub fn parse_all(text: &str, in_reasoning: bool, tools: bool) -> Parsed {
    OutputParser::new(in_reasoning, tools).parse(text)
}

fn emit(out: &mut Vec<Piece>, piece: Piece) {
    let empty = match &piece {
        Piece::Content(text) | Piece::Reasoning(text) => text.is_empty(),
        Piece::ToolCall(_) => false,
    };
    if !empty {
        out.push(piece);
    }
}

/// A forced call's arguments: a JSON object.
fn parse_arguments(text: &str) -> Option<Value> {
    serde_json::from_str(text.trim())
        .ok()
        .filter(Value::is_object)
}

/// `{"name": "...", "arguments": {...}}`; `parameters` is accepted as an alias, and arguments
/// written as a JSON string are decoded when they hold JSON.
pub fn parse_tool_call(body: &str) -> Option<ToolCall> {
    let value: Value = serde_json::from_str(body.trim()).ok()?;
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = value
        .get("arguments")
        .or_else(|| value.get("parameters"))
        .cloned()
        .unwrap_or_else(|| Value::Object(Default::default()));
    let arguments = match arguments {
        Value::String(text) => serde_json::from_str(&text).unwrap_or(Value::String(text)),
        other => other,
    };
    Some(ToolCall { name, arguments })
}

fn earliest<'t>(text: &str, tags: &[&'t str]) -> Option<(usize, &'t str)> {
    tags.iter()
        .filter_map(|tag| text.find(tag).map(|at| (at, *tag)))
        .min_by_key(|(at, _)| *at)
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `tags`.
fn held_back(text: &str, tags: &[&str]) -> usize {
    tags.iter()
        .flat_map(|tag| (1..tag.len()).rev().map(move |n| &tag[..n]))
        .filter(|prefix| text.ends_with(prefix))
        .map(str::len)
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Feeds `chunks` to `parser` and merges the pieces like `parse` does.
    fn streamed<'t>(mut parser: OutputParser, chunks: impl IntoIterator<Item = &'t str>) -> Parsed {
        let mut pieces = Vec::new();
        for chunk in chunks {
            pieces.extend(parser.push(chunk));
        }
        pieces.extend(parser.finish());
        let mut parsed = Parsed::default();
        for piece in pieces {
            match piece {
                Piece::Content(t) => parsed.content.push_str(&t),
                Piece::Reasoning(t) => parsed
                    .reasoning
                    .get_or_insert_with(String::new)
                    .push_str(&t),
                Piece::ToolCall(c) => parsed.tool_calls.push(c),
            }
        }
        parsed.warnings = parser.take_warnings();
        parsed
    }

    /// Feeds `text` one character at a time and merges the pieces like `parse_all` does.
    fn char_by_char(text: &str, in_reasoning: bool, tools: bool) -> Parsed {
        let chars: Vec<String> = text.chars().map(String::from).collect();
        streamed(
            OutputParser::new(in_reasoning, tools),
            chars.iter().map(String::as_str),
        )
    }

    fn both(text: &str, in_reasoning: bool, tools: bool) -> Parsed {
        let whole = parse_all(text, in_reasoning, tools);
        assert_eq!(
            whole,
            char_by_char(text, in_reasoning, tools),
            "streaming differs for {text:?}"
        );
        whole
    }

    /// The tools of the XML tests, as the template gets them.
    fn xml_tools() -> Value {
        json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"},
                                                 "days": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "now", "parameters": {
                "type": "object", "properties": {"utc": {"type": "boolean"}}}}}
        ])
    }

    /// Parses `text` as an XML-format answer whole, and checks that every way of cutting it in
    /// two, and every character on its own, streams to the same result.
    fn xml(text: &str, in_reasoning: bool) -> Parsed {
        let tools = xml_tools();
        let parser = || OutputParser::for_tools(in_reasoning, ToolFormat::Xml, Some(&tools));
        let whole = parser().parse(text);
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let by_char = streamed(parser(), chars.iter().map(String::as_str));
        assert_eq!(whole, by_char, "char by char differs for {text:?}");
        for (at, _) in text.char_indices().skip(1) {
            let split = streamed(parser(), [&text[..at], &text[at..]]);
            assert_eq!(whole, split, "split at {at} differs for {text:?}");
        }
        whole
    }

    #[test]
    fn plain_text_passes_through() {
        let parsed = both("Hello <b>world</b> a < b", false, true);
        assert_eq!(parsed.content, "Hello <b>world</b> a < b");
        assert!(parsed.reasoning.is_none() && parsed.tool_calls.is_empty());
    }

    #[test]
    fn think_block_becomes_reasoning() {
        let parsed = both("<think>\nLet me see.\n</think>\n\nParis.", false, false);
        assert_eq!(parsed.reasoning.as_deref(), Some("Let me see.\n"));
        assert_eq!(parsed.content, "Paris.");
    }

    #[test]
    fn prompt_opened_think_starts_in_reasoning() {
        let parsed = both("\nhmm</think>\n\nok", true, false);
        assert_eq!(parsed.reasoning.as_deref(), Some("hmm"));
        assert_eq!(parsed.content, "ok");
    }

    #[test]
    fn unterminated_reasoning_is_kept() {
        let parsed = both("<think>still thinking", false, false);
        assert_eq!(parsed.reasoning.as_deref(), Some("still thinking"));
        assert_eq!(parsed.content, "");
    }

    #[test]
    fn tool_calls_are_parsed() {
        let text = "I'll check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": \"{}\"}\n</tool_call>";
        let parsed = both(text, false, true);
        assert_eq!(parsed.content, "I'll check.\n");
        assert_eq!(
            parsed.tool_calls,
            vec![
                ToolCall {
                    name: "get_weather".into(),
                    arguments: json!({"city": "Paris"})
                },
                ToolCall {
                    name: "now".into(),
                    arguments: json!({})
                },
            ]
        );
        assert_eq!(parsed.tool_calls[0].arguments_json(), r#"{"city":"Paris"}"#);
    }

    #[test]
    fn tool_tags_are_text_without_tools() {
        let text = "<tool_call>{\"name\": \"x\"}</tool_call>";
        assert_eq!(both(text, false, false).content, text);
    }

    #[test]
    fn bad_tool_json_falls_back_to_text() {
        let text = "<tool_call>not json</tool_call>";
        let parsed = both(text, false, true);
        assert_eq!(parsed.content, text);
        assert!(parsed.tool_calls.is_empty());
    }

    #[test]
    fn unterminated_tool_call_with_valid_json_counts() {
        let parsed = both(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n",
            false,
            true,
        );
        assert_eq!(parsed.tool_calls.len(), 1);
        assert_eq!(parsed.tool_calls[0].arguments, json!({"a": 1}));
    }

    #[test]
    fn reasoning_then_tool_call() {
        let text = "<think>\nneed weather\n</think>\n\n<tool_call>\n{\"name\": \"w\", \"arguments\": {}}\n</tool_call>";
        let parsed = both(text, false, true);
        assert_eq!(parsed.reasoning.as_deref(), Some("need weather\n"));
        assert_eq!(parsed.content, "");
        assert_eq!(parsed.tool_calls[0].name, "w");
    }

    #[test]
    fn a_forced_call_is_the_whole_output_or_nothing() {
        let text = "{\"name\": \"w\", \"arguments\": {\"note\": \"</tool_call> <think>\"}}";
        let mut parser = OutputParser::forced_call();
        for ch in text.chars() {
            assert_eq!(parser.push(&ch.to_string()), vec![], "held to the end");
        }
        let call = ToolCall {
            name: "w".into(),
            arguments: json!({"note": "</tool_call> <think>"}),
        };
        assert_eq!(parser.finish(), vec![Piece::ToolCall(call.clone())]);
        assert_eq!(OutputParser::forced_call().parse(text).tool_calls, [call]);
        // Cut short (max_tokens, a stop string): no call and no broken text.
        let cut = OutputParser::forced_call().parse(&text[..30]);
        assert_eq!(cut, Parsed::default());
    }

    #[test]
    fn bad_json_calls_are_logged() {
        let parsed = both("<tool_call>not json</tool_call>", false, true);
        assert_eq!(parsed.warnings.len(), 1);
        assert!(
            parsed.warnings[0].contains("not a call"),
            "{:?}",
            parsed.warnings
        );
    }

    const XML_CALL: &str = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";

    #[test]
    fn xml_calls_are_parsed_with_their_types() {
        let parsed = xml(XML_CALL, false);
        assert_eq!(
            parsed,
            Parsed {
                tool_calls: vec![ToolCall {
                    name: "get_weather".into(),
                    arguments: json!({"city": "New York", "days": 3})
                }],
                ..Parsed::default()
            }
        );
        assert_eq!(
            parsed.tool_calls[0].arguments_json(),
            r#"{"city":"New York","days":3}"#
        );
    }

    #[test]
    fn xml_reasoning_text_and_several_calls() {
        // As Qwen3.5 answers after a generation prompt that opened `<think>\n`.
        let text = format!(
            "\nThe user wants weather.\n</think>\n\nLet me check.\n\n{XML_CALL}\n<tool_call>\n<function=now>\n<parameter=utc>\nTrue\n</parameter>\n</function>\n</tool_call>"
        );
        let parsed = xml(&text, true);
        assert_eq!(
            parsed.reasoning.as_deref(),
            Some("The user wants weather.\n")
        );
        assert_eq!(parsed.content, "Let me check.\n\n");
        assert_eq!(
            parsed.tool_calls,
            [
                ToolCall {
                    name: "get_weather".into(),
                    arguments: json!({"city": "New York", "days": 3})
                },
                ToolCall {
                    name: "now".into(),
                    arguments: json!({"utc": true})
                }
            ]
        );
        assert!(parsed.warnings.is_empty());
    }

    #[test]
    fn an_xml_call_without_its_closing_tag_still_counts() {
        let text = XML_CALL.strip_suffix("</tool_call>").unwrap();
        assert_eq!(xml(text, false).tool_calls.len(), 1);
    }

    #[test]
    fn malformed_xml_calls_come_back_as_text_with_a_warning() {
        for (body, why) in [
            // Qwen3's JSON where the template asks for XML.
            (
                "\n{\"name\": \"now\", \"arguments\": {}}\n",
                "<function=NAME>",
            ),
            (
                "\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n",
                "<parameter=city> is not closed",
            ),
            (
                "\n<function=launch_rockets>\n</function>\n",
                "not one of the offered tools",
            ),
        ] {
            let call = format!("<tool_call>{body}</tool_call>");
            let text = format!("Before. {call} After, {XML_CALL}");
            let parsed = xml(&text, false);
            assert_eq!(parsed.content, format!("Before. {call} After, "));
            assert_eq!(parsed.tool_calls.len(), 1, "the good call still counts");
            assert_eq!(parsed.warnings.len(), 1, "{text}");
            assert!(parsed.warnings[0].contains(why), "{:?}", parsed.warnings);
            // Unterminated at the end of the answer: the text is kept too.
            let cut = format!("Before. <tool_call>{body}");
            let parsed = xml(&cut, false);
            assert_eq!((parsed.content, parsed.warnings.len()), (cut, 1));
        }
    }

    #[test]
    fn xml_tags_are_text_without_tools() {
        let parser = OutputParser::for_tools(false, ToolFormat::Xml, None);
        assert_eq!(parser.parse(XML_CALL).content, XML_CALL);
    }

    #[test]
    fn a_forced_call_of_a_named_function_is_its_arguments() {
        let text = "{\"city\": \"</tool_call>\", \"days\": 2}";
        let call = ToolCall {
            name: "get_weather".into(),
            arguments: json!({"city": "</tool_call>", "days": 2}),
        };
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let by_char = streamed(
            OutputParser::forced_arguments("get_weather"),
            chars.iter().map(String::as_str),
        );
        assert_eq!(by_char.tool_calls, [call]);
        let whole = OutputParser::forced_arguments("get_weather").parse(text);
        assert_eq!(whole, by_char);
        let cut = OutputParser::forced_arguments("get_weather").parse(&text[..12]);
        assert_eq!(cut, Parsed::default());
        let not_an_object = OutputParser::forced_arguments("get_weather").parse("[1]");
        assert_eq!(not_an_object, Parsed::default());
    }

    #[test]
    fn partial_tag_prefix_is_released_when_it_is_not_a_tag() {
        let mut parser = OutputParser::new(false, true);
        assert_eq!(parser.push("a <tool"), vec![Piece::Content("a ".into())]);
        assert_eq!(parser.push("box"), vec![Piece::Content("<toolbox".into())]);
    }
}
