//! Splits model output into content, reasoning (`<think>…</think>`) and Qwen3 tool calls
//! (`<tool_call>{"name":..,"arguments":..}</tool_call>`), one chunk at a time, so streaming and
//! non-streaming answers come out identical. Pure text: the desktop app reuses it. Reference:
//! vLLM's `qwen3` reasoning parser and `hermes` tool parser (same tags, same fallbacks).

use serde_json::Value;

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Content,
    Reasoning,
    ToolCall,
    /// The whole output is one call's JSON (the prompt opened the call; a grammar shapes it).
    ForcedCall,
}

/// Streaming parser: `push` chunks, then `finish`. Text that might be the start of a tag is held
/// back until the next chunk decides it.
#[derive(Debug)]
pub struct OutputParser {
    mode: Mode,
    buf: String,
    tools: bool,
    /// Newlines right after a closing tag are layout, not content.
    trim_leading: bool,
}

/// Everything a whole answer splits into.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub reasoning: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

impl OutputParser {
    /// `in_reasoning`: the prompt already opened `<think>` (templates that force thinking), so
    /// output starts as reasoning. `tools`: the request offered tools, so `<tool_call>` is parsed.
    pub fn new(in_reasoning: bool, tools: bool) -> Self {
        Self {
            mode: if in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            buf: String::new(),
            tools,
            trim_leading: in_reasoning,
        }
    }

    /// A parser for a forced call: the prompt ends in `<tool_call>` and the output is its JSON,
    /// held to the end and given back as one call, or nothing when it was cut short (a broken
    /// call is worse than none).
    pub fn forced_call() -> Self {
        Self {
            mode: Mode::ForcedCall,
            buf: String::new(),
            tools: true,
            trim_leading: false,
        }
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
                    if self.tools {
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
                        out.push(tool_piece(&body, true));
                        self.mode = Mode::Content;
                        self.trim_leading = true;
                    }
                    // A tool call is only useful whole: hold it all until the closing tag.
                    None => break,
                },
                // Not even a closing tag ends it: a JSON string may hold that text.
                Mode::ForcedCall => break,
            }
        }
        out
    }

    /// Flushes what was held back; an unterminated tool call still counts if its JSON parses.
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        match self.mode {
            Mode::Content => emit(&mut out, Piece::Content(rest)),
            Mode::Reasoning => emit(&mut out, Piece::Reasoning(rest)),
            Mode::ToolCall => out.push(tool_piece(&rest, false)),
            Mode::ForcedCall => out.extend(parse_tool_call(&rest).map(Piece::ToolCall)),
        }
        self.mode = Mode::Content;
        out
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
        parsed
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

/// A tool-call body as a call, or (unparseable) back as the literal text the model wrote.
fn tool_piece(body: &str, closed: bool) -> Piece {
    match parse_tool_call(body) {
        Some(call) => Piece::ToolCall(call),
        None => Piece::Content(format!(
            "{TOOL_OPEN}{body}{}",
            if closed { TOOL_CLOSE } else { "" }
        )),
    }
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

    /// Feeds `text` one character at a time and merges the pieces like `parse_all` does.
    fn char_by_char(text: &str, in_reasoning: bool, tools: bool) -> Parsed {
        let mut parser = OutputParser::new(in_reasoning, tools);
        let mut pieces = Vec::new();
        for ch in text.chars() {
            pieces.extend(parser.push(&ch.to_string()));
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
        parsed
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
    fn partial_tag_prefix_is_released_when_it_is_not_a_tag() {
        let mut parser = OutputParser::new(false, true);
        assert_eq!(parser.push("a <tool"), vec![Piece::Content("a ".into())]);
        assert_eq!(parser.push("box"), vec![Piece::Content("<toolbox".into())]);
    }
}
