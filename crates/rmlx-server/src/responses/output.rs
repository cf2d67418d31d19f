//! The model's answer as Responses output items, built one engine step at a time: each piece
//! the output parser gives (reasoning, text, a call) opens, grows or closes an item and says
//! which stream events that takes. The whole answer and the stream come from the same steps, so
//! they agree by construction (the whole one just drops the events).

use serde_json::Value;

use super::{
    input::ToolNames,
    types::{
        ContentPart, ItemStatus, OutputContent, OutputItem, ReasoningPart,
        ResponseEventBody as Event, SummaryPart,
    },
};
use crate::{
    api::AssistantRole,
    generation::new_id,
    parse::{log_warnings, OutputParser, Piece, ToolCall},
};

/// What shapes the items besides the model's text.
pub struct Options {
    /// `reasoning.summary` was asked: the reasoning text is also its summary.
    pub summary: bool,
    /// `include: ["reasoning.encrypted_content"]`: reasoning items carry their text there.
    pub encrypted: bool,
    /// `parallel_tool_calls` (default true); false keeps the first call only.
    pub parallel: bool,
}

pub struct Output {
    parser: OutputParser,
    names: ToolNames,
    options: Options,
    pub items: Vec<OutputItem>,
    /// The reasoning or message item deltas go to now.
    open: Option<usize>,
    /// Output tokens generated inside the reasoning.
    pub reasoning_tokens: usize,
    calls: usize,
}

impl Output {
    pub fn new(parser: OutputParser, names: ToolNames, options: Options) -> Self {
        Self {
            parser,
            names,
            options,
            items: Vec::new(),
            open: None,
            reasoning_tokens: 0,
            calls: 0,
        }
    }

    /// One generated token's text (maybe empty while the engine holds a partial character).
    pub fn token(&mut self, text: &str, events: &mut Vec<Event>) {
        if self.parser.in_reasoning() {
            self.reasoning_tokens += 1;
        }
        let pieces = self.parser.push(text);
        self.pieces(pieces, events);
    }

    /// The end of the answer: what the parser held, then every open item closed (`incomplete`
    /// when the answer was cut short). An answer with no item gets an empty message, so the
    /// output is never empty.
    pub fn finish(&mut self, incomplete: bool, events: &mut Vec<Event>) {
        let pieces = self.parser.finish();
        self.pieces(pieces, events);
        if self.items.is_empty() {
            self.open_message(events);
        }
        self.close(incomplete, events);
    }

    /// The items as input items for a stored conversation: reasoning keeps its text in
    /// `encrypted_content` whatever `include` said, so it renders back as this turn's.
    pub fn stored_items(&self) -> Vec<Value> {
        self.items
            .iter()
            .map(|item| {
                let mut value = serde_json::to_value(item).unwrap_or_default();
                if let OutputItem::Reasoning { content, .. } = item {
                    let text: String = content
                        .iter()
                        .map(|ReasoningPart::ReasoningText { text }| text.as_str())
                        .collect();
                    value["encrypted_content"] = Value::String(text);
                }
                value
            })
            .collect()
    }

    fn pieces(&mut self, pieces: Vec<Piece>, events: &mut Vec<Event>) {
        log_warnings(self.parser.take_warnings());
        for piece in pieces {
            match piece {
                Piece::Reasoning(text) => self.reasoning(text, events),
                Piece::Content(text) => self.content(text, events),
                Piece::ToolCall(call) => self.call(call, events),
            }
        }
    }

    fn is_open(&self, reasoning: bool) -> Option<usize> {
        let index = self.open?;
        match (&self.items[index], reasoning) {
            (OutputItem::Reasoning { .. }, true) | (OutputItem::Message { .. }, false) => {
                Some(index)
            }
            _ => None,
        }
    }

    fn reasoning(&mut self, delta: String, events: &mut Vec<Event>) {
        let index = match self.is_open(true) {
            Some(index) => index,
            None => {
                self.close(false, events);
                let index = self.items.len();
                let item = OutputItem::Reasoning {
                    id: new_id("rs_"),
                    summary: Vec::new(),
                    content: Vec::new(),
                    encrypted_content: None,
                    status: ItemStatus::InProgress,
                };
                let item_id = item.id().to_string();
                events.push(Event::OutputItemAdded {
                    output_index: index,
                    item: item.clone(),
                });
                // The SDKs add reasoning deltas to the part this opens.
                events.push(Event::ContentPartAdded {
                    item_id: item_id.clone(),
                    output_index: index,
                    content_index: 0,
                    part: ContentPart::Reasoning(ReasoningPart::ReasoningText {
                        text: String::new(),
                    }),
                });
                if self.options.summary {
                    events.push(Event::ReasoningSummaryPartAdded {
                        item_id,
                        output_index: index,
                        summary_index: 0,
                        part: SummaryPart::SummaryText {
                            text: String::new(),
                        },
                    });
                }
                self.items.push(item);
                self.open = Some(index);
                index
            }
        };
        let summary = self.options.summary;
        let OutputItem::Reasoning {
            id,
            summary: parts,
            content,
            ..
        } = &mut self.items[index]
        else {
            return;
        };
        match content.first_mut() {
            Some(ReasoningPart::ReasoningText { text }) => text.push_str(&delta),
            None => content.push(ReasoningPart::ReasoningText {
                text: delta.clone(),
            }),
        }
        events.push(Event::ReasoningTextDelta {
            item_id: id.clone(),
            output_index: index,
            content_index: 0,
            delta: delta.clone(),
        });
        if summary {
            match parts.first_mut() {
                Some(SummaryPart::SummaryText { text }) => text.push_str(&delta),
                None => parts.push(SummaryPart::SummaryText {
                    text: delta.clone(),
                }),
            }
            events.push(Event::ReasoningSummaryTextDelta {
                item_id: id.clone(),
                output_index: index,
                summary_index: 0,
                delta,
            });
        }
    }

    fn open_message(&mut self, events: &mut Vec<Event>) -> usize {
        self.close(false, events);
        let index = self.items.len();
        let item = OutputItem::Message {
            id: new_id("msg_"),
            status: ItemStatus::InProgress,
            role: AssistantRole::Assistant,
            content: Vec::new(),
        };
        events.push(Event::OutputItemAdded {
            output_index: index,
            item: item.clone(),
        });
        events.push(Event::ContentPartAdded {
            item_id: item.id().to_string(),
            output_index: index,
            content_index: 0,
            part: ContentPart::Output(OutputContent::text(String::new())),
        });
        self.items.push(item);
        self.open = Some(index);
        index
    }

    fn content(&mut self, delta: String, events: &mut Vec<Event>) {
        let index = match self.is_open(false) {
            Some(index) => index,
            None => self.open_message(events),
        };
        let OutputItem::Message { id, content, .. } = &mut self.items[index] else {
            return;
        };
        match content.first_mut() {
            Some(OutputContent::OutputText { text, .. }) => text.push_str(&delta),
            None => content.push(OutputContent::text(delta.clone())),
        }
        events.push(Event::OutputTextDelta {
            item_id: id.clone(),
            output_index: index,
            content_index: 0,
            delta,
            logprobs: Vec::new(),
        });
    }

    /// A call becomes a whole item at once (the parser gives calls whole).
    fn call(&mut self, call: ToolCall, events: &mut Vec<Event>) {
        self.close(false, events);
        if self.calls > 0 && !self.options.parallel {
            log_warnings(vec![format!(
                "a second tool call is dropped (`parallel_tool_calls: false`): {}",
                call.name
            )]);
            return;
        }
        self.calls += 1;
        let tool = self.names.get(&call.name);
        let index = self.items.len();
        let call_id = new_id("call_");
        let (added, done, events_of_call) = if tool.custom {
            let input = match &call.arguments["input"] {
                Value::String(text) => text.clone(),
                _ => call.arguments_json(),
            };
            let id = new_id("ctc_");
            let item = |input: String, status| OutputItem::CustomToolCall {
                id: id.clone(),
                call_id: call_id.clone(),
                name: tool.name.clone(),
                namespace: tool.namespace.clone(),
                input,
                status,
            };
            let events_of_call = vec![
                Event::CustomToolCallInputDelta {
                    item_id: id.clone(),
                    output_index: index,
                    delta: input.clone(),
                },
                Event::CustomToolCallInputDone {
                    item_id: id.clone(),
                    output_index: index,
                    input: input.clone(),
                },
            ];
            (
                item(String::new(), ItemStatus::InProgress),
                item(input, ItemStatus::Completed),
                events_of_call,
            )
        } else {
            let arguments = call.arguments_json();
            let id = new_id("fc_");
            let item = |arguments: String, status| OutputItem::FunctionCall {
                id: id.clone(),
                call_id: call_id.clone(),
                name: tool.name.clone(),
                namespace: tool.namespace.clone(),
                arguments,
                status,
            };
            let events_of_call = vec![
                Event::FunctionCallArgumentsDelta {
                    item_id: id.clone(),
                    output_index: index,
                    delta: arguments.clone(),
                },
                Event::FunctionCallArgumentsDone {
                    item_id: id.clone(),
                    output_index: index,
                    name: tool.name.clone(),
                    arguments: arguments.clone(),
                },
            ];
            (
                item(String::new(), ItemStatus::InProgress),
                item(arguments, ItemStatus::Completed),
                events_of_call,
            )
        };
        events.push(Event::OutputItemAdded {
            output_index: index,
            item: added,
        });
        events.extend(events_of_call);
        events.push(Event::OutputItemDone {
            output_index: index,
            item: done.clone(),
        });
        self.items.push(done);
    }

    /// Closes the open reasoning or message item with its `.done` events.
    fn close(&mut self, incomplete: bool, events: &mut Vec<Event>) {
        let Some(index) = self.open.take() else {
            return;
        };
        let encrypted = self.options.encrypted;
        let summary = self.options.summary;
        let item = &mut self.items[index];
        let final_status = match incomplete {
            true => ItemStatus::Incomplete,
            false => ItemStatus::Completed,
        };
        match item {
            OutputItem::Reasoning {
                id,
                summary: parts,
                content,
                encrypted_content,
                status,
            } => {
                let text: String = content
                    .iter()
                    .map(|ReasoningPart::ReasoningText { text }| text.as_str())
                    .collect();
                *status = final_status;
                if encrypted {
                    *encrypted_content = Some(text.clone());
                }
                if content.is_empty() {
                    content.push(ReasoningPart::ReasoningText {
                        text: String::new(),
                    });
                }
                events.push(Event::ReasoningTextDone {
                    item_id: id.clone(),
                    output_index: index,
                    content_index: 0,
                    text: text.clone(),
                });
                events.push(Event::ContentPartDone {
                    item_id: id.clone(),
                    output_index: index,
                    content_index: 0,
                    part: ContentPart::Reasoning(content[0].clone()),
                });
                if summary {
                    if parts.is_empty() {
                        parts.push(SummaryPart::SummaryText {
                            text: String::new(),
                        });
                    }
                    events.push(Event::ReasoningSummaryTextDone {
                        item_id: id.clone(),
                        output_index: index,
                        summary_index: 0,
                        text: text.clone(),
                    });
                    events.push(Event::ReasoningSummaryPartDone {
                        item_id: id.clone(),
                        output_index: index,
                        summary_index: 0,
                        part: SummaryPart::SummaryText { text },
                    });
                }
            }
            OutputItem::Message {
                id,
                status,
                content,
                ..
            } => {
                *status = final_status;
                if content.is_empty() {
                    content.push(OutputContent::text(String::new()));
                }
                let part = content[0].clone();
                let OutputContent::OutputText { text, .. } = &part;
                events.push(Event::OutputTextDone {
                    item_id: id.clone(),
                    output_index: index,
                    content_index: 0,
                    text: text.clone(),
                    logprobs: Vec::new(),
                });
                events.push(Event::ContentPartDone {
                    item_id: id.clone(),
                    output_index: index,
                    content_index: 0,
                    part: ContentPart::Output(part),
                });
            }
            OutputItem::FunctionCall { .. } | OutputItem::CustomToolCall { .. } => {}
        }
        events.push(Event::OutputItemDone {
            output_index: index,
            item: item.clone(),
        });
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::{convert::Dropped, responses::input::tools};

    fn names(events: &[Event]) -> Vec<&'static str> {
        events.iter().map(Event::name).collect()
    }

    fn output(parser: OutputParser, summary: bool) -> Output {
        let tools = tools(
            Some(&[
                json!({"type": "function", "name": "read", "parameters": {"type": "object"}}),
                json!({"type": "namespace", "name": "fs", "tools": [{"type": "function", "name": "stat"}]}),
                json!({"type": "custom", "name": "apply_patch"}),
            ]),
            &mut Dropped::default(),
        )
        .unwrap();
        Output::new(
            parser,
            tools.names,
            Options {
                summary,
                encrypted: true,
                parallel: true,
            },
        )
    }

    #[test]
    fn reasoning_text_and_calls_in_order_with_their_events() {
        let mut out = output(OutputParser::new(false, true), true);
        let text = "<think>\nplan\n</think>\n\nOk.\n<tool_call>\n{\"name\": \"fs__stat\", \"arguments\": {\"p\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"apply_patch\", \"arguments\": {\"input\": \"*** Begin\"}}\n</tool_call>";
        let mut events = Vec::new();
        // Two tokens: the second starts inside the think block, so one event of each kind.
        let (first, rest) = text.split_at("<think>".len());
        out.token(first, &mut events);
        out.token(rest, &mut events);
        out.finish(false, &mut events);
        assert_eq!(
            names(&events),
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_summary_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_summary_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.reasoning_summary_text.done",
                "response.reasoning_summary_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.custom_tool_call_input.delta",
                "response.custom_tool_call_input.done",
                "response.output_item.done",
            ]
        );
        let items = serde_json::to_value(&out.items).unwrap();
        assert_eq!(items[0]["type"], "reasoning");
        assert_eq!(items[0]["content"][0]["text"], "plan\n");
        assert_eq!(items[0]["summary"][0]["text"], "plan\n");
        assert_eq!(items[0]["encrypted_content"], "plan\n");
        assert_eq!(items[1]["content"][0]["text"], "Ok.\n");
        assert_eq!(
            (
                &items[2]["name"],
                &items[2]["namespace"],
                &items[2]["arguments"]
            ),
            (&json!("stat"), &json!("fs"), &json!("{\"p\":1}"))
        );
        assert_eq!(items[3]["type"], "custom_tool_call");
        assert_eq!(items[3]["input"], "*** Begin");
        assert!(items
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["status"] == "completed"));
        // The token pushed while the parser was inside <think>.
        assert_eq!(out.reasoning_tokens, 1);
        let stored = out.stored_items();
        assert_eq!(stored[0]["encrypted_content"], "plan\n");
    }

    #[test]
    fn an_empty_answer_is_an_empty_message_and_a_cut_one_incomplete() {
        let mut out = output(OutputParser::new(false, false), false);
        let mut events = Vec::new();
        out.finish(true, &mut events);
        let items = serde_json::to_value(&out.items).unwrap();
        assert_eq!(items.as_array().unwrap().len(), 1);
        assert_eq!(items[0]["type"], "message");
        assert_eq!(items[0]["status"], "incomplete");
        assert_eq!(items[0]["content"][0]["text"], "");
        assert_eq!(
            names(&events),
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
            ]
        );
    }
}
