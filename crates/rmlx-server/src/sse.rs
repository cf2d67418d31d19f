//! Server-sent events from a per-API state machine: each `step` yields the next events (maybe
//! none) or `None` at the end. When the client goes, axum drops the stream, the machine and its
//! `Generation` with it, which cancels the engine work.

use std::{convert::Infallible, future::Future};

use axum::response::{
    sse::{Event, Sse},
    IntoResponse, Response,
};
use futures_util::{stream, StreamExt};

pub trait EventSource: Send + 'static {
    fn step(&mut self) -> impl Future<Output = Option<Vec<Event>>> + Send;
}

pub fn respond<M: EventSource>(machine: M) -> Response {
    let events = stream::unfold(machine, |mut machine| async move {
        let events = machine.step().await?;
        Some((events, machine))
    })
    .flat_map(|events| stream::iter(events.into_iter().map(Ok::<_, Infallible>)));
    Sse::new(events).into_response()
}

/// An OpenAI stream's event: `data:` is one JSON chunk of `$chunk` (or, after a failure, the
/// error), then the last one is `[DONE]`.
macro_rules! openai_events {
    ($(#[$doc:meta])* $name:ident, $chunk:ty, $chunk_name:literal) => {
        crate::json_component!(
            $(#[$doc])*
            pub $name [$chunk, crate::api::OpenAiError] => serde_json::json!({
                "type": "object",
                "required": ["data"],
                "properties": {"data": {"anyOf": [
                    {"const": "[DONE]"},
                    {"type": "string", "contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [
                        {"$ref": concat!("#/components/schemas/", $chunk_name)},
                        {"$ref": "#/components/schemas/OpenAiError"}]}}
                ]}}
            })
        );
    };
}

openai_events!(
    /// One event of a chat completion stream (the document's schema of `text/event-stream`
    /// describes each event: `data:` and, for named events, `event:`).
    ChatStreamEvent,
    crate::api::ChatCompletionChunk,
    "ChatCompletionChunk"
);

openai_events!(
    /// One event of a text completion stream.
    TextStreamEvent,
    crate::api::TextCompletion,
    "TextCompletion"
);

/// A named stream's event: `event:` names it, `data:` is its JSON (`$payload`, or the error).
macro_rules! named_events {
    ($(#[$doc:meta])* $name:ident, $payload:ty, $payload_name:literal, $error:ty, $error_name:literal) => {
        crate::json_component!(
            $(#[$doc])*
            pub $name [$payload, $error] => serde_json::json!({
                "type": "object",
                "required": ["event", "data"],
                "properties": {
                    "event": {"type": "string", "description": "The payload's `type`."},
                    "data": {"type": "string", "contentMediaType": "application/json",
                             "contentSchema": {"anyOf": [
                                {"$ref": concat!("#/components/schemas/", $payload_name)},
                                {"$ref": concat!("#/components/schemas/", $error_name)}]}}
                }
            })
        );
    };
}

named_events!(
    /// One event of an Anthropic Messages stream (`event: error` after a failure).
    MessagesStreamEvent,
    crate::api::MessageStreamEvent,
    "MessageStreamEvent",
    crate::api::AnthropicError,
    "AnthropicError"
);

named_events!(
    /// One event of a Responses stream (a failure is its `response.failed` event).
    ResponsesStreamEvent,
    crate::responses::types::ResponseStreamEvent,
    "ResponseStreamEvent",
    crate::api::OpenAiError,
    "OpenAiError"
);

/// An SSE comment line: clients skip it, the connection sees traffic (chat and text
/// completions have no event of their own for "still working").
pub fn keep_alive() -> Event {
    Event::default().comment("keep-alive")
}

/// `data: {json}` (OpenAI's chunks carry no event name).
pub fn data(value: &impl serde::Serialize) -> Event {
    Event::default().data(serde_json::to_string(value).unwrap_or_default())
}

/// `event: name` + `data: {json}` (Anthropic names every event).
pub fn named(name: &str, value: &impl serde::Serialize) -> Event {
    Event::default()
        .event(name)
        .data(serde_json::to_string(value).unwrap_or_default())
}

/// Test helpers: synthetic engine events through a stream machine, read back as SSE text.
#[cfg(test)]
pub(crate) mod testing {
    use http_body_util::BodyExt;
    use rmlx_engine::{
        engine::Event,
        generate::{Completion, FinishReason},
    };

    use crate::generation::Generation;

    pub fn generation(events: Vec<Event>) -> Generation {
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
        for event in events {
            sender.send(event).unwrap();
        }
        Generation::from_events(receiver, 3)
    }

    pub fn done(text: &str, tokens: usize, finish_reason: FinishReason) -> Event {
        Event::Done(Completion {
            text: text.into(),
            prompt_ids: vec![1, 2, 3],
            token_ids: vec![5; tokens],
            finish_reason,
            prompt_tokens: 3,
            completion_tokens: tokens,
            ..Completion::default()
        })
    }

    pub fn delta(text: &str) -> Event {
        Event::Delta {
            token_id: 5,
            text: text.into(),
            logprob: None,
        }
    }

    /// `(event name, data)` of each SSE event.
    pub async fn events(
        response: axum::response::Response,
    ) -> Vec<(Option<String>, serde_json::Value)> {
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec())
            .unwrap()
            .split("\n\n")
            .filter(|block| !block.trim().is_empty())
            .map(|block| {
                let name = block
                    .lines()
                    .find_map(|l| l.strip_prefix("event: "))
                    .map(str::to_string);
                let data: String = block
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect();
                (
                    name,
                    serde_json::from_str(&data).unwrap_or(serde_json::Value::String(data)),
                )
            })
            .collect()
    }
}
