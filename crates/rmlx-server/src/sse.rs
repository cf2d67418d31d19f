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

/// `data: {json}` (OpenAI's chunks carry no event name).
pub fn data(value: &serde_json::Value) -> Event {
    Event::default().data(value.to_string())
}

/// `event: name` + `data: {json}` (Anthropic names every event).
pub fn named(name: &str, value: &serde_json::Value) -> Event {
    Event::default().event(name).data(value.to_string())
}
