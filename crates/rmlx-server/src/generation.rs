//! Bridges the engine thread's blocking event channel into async handlers. The engine decides
//! context overflow before any compute, so a request waits for `Started` (or the refusal) before
//! its HTTP status is chosen; after that, failures become in-stream errors. A stream whose
//! request still waits after one heartbeat (queued behind a full batch, its model loading)
//! answers anyway and sends keep-alives: agents abort a request whose headers are late (Qwen
//! Code after 120 s), and a refusal then comes in the stream. Dropping a `Generation` (a client
//! gone mid-stream) drops the `RequestHandle`, which cancels the work.
//! Reference: text-generation-inference router (validate, then stream events).

use std::{sync::mpsc::RecvTimeoutError, time::Duration};

use rmlx_engine::{
    constrain::{ReasoningBudget, ResponseFormat},
    engine::{Event, Request, RequestHandle},
    generate::{Completion, TokenLogprob},
    EngineError,
};
use tokio::sync::mpsc;

use crate::{
    error::ApiError,
    parse::{ToolFormat, THINK_CLOSE, THINK_OPEN},
    registry::ModelEntry,
    AppState,
};

/// How often an idle forwarder checks whether its client is still there (prefill sends no
/// events, so a disconnect during a long prompt is noticed at this pace).
const DISCONNECT_POLL: Duration = Duration::from_millis(50);

// As the engine's `Event`: the completion comes once per request.
#[allow(clippy::large_enum_variant)]
pub enum Step {
    /// The engine took a request whose stream answered before it did (see
    /// [`Generation::start`]): the prompt's size is known from now on.
    Started,
    /// Nothing yet after the stream's heartbeat interval (the prompt is still queued or
    /// prefilling): streams send their format's keep-alive event, so clients with idle timeouts
    /// (Codex: 300 s) wait, and a gone client is noticed when it is written to.
    Idle,
    /// Text (maybe empty while the engine holds a partial character or stop string) and the
    /// token's log-probs when the request asked for them.
    Delta {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Done(Completion),
    Failed(ApiError),
}

pub struct Generation {
    events: mpsc::UnboundedReceiver<Event>,
    pub prompt_tokens: usize,
    pub max_ctx: usize,
    finished: bool,
    /// Until the first token: how long `next` waits before it says `Idle`.
    heartbeat: Option<Duration>,
    /// Whether the engine took the request (`prompt_tokens` and `max_ctx` are its).
    started: bool,
}

impl Generation {
    /// Validates, queues and waits until the engine accepts the prompt (or refuses it). A
    /// `stream` waits one heartbeat at most: without the engine's answer by then (the request
    /// is queued, or its model loads) it returns anyway, so the stream's headers and keep-alives
    /// go out while it waits; `next` then says `Started` when the engine takes it, and a
    /// refusal comes as `Failed`.
    pub async fn start(
        state: &AppState,
        entry: &ModelEntry,
        mut request: Request,
        stream: bool,
    ) -> Result<Self, ApiError> {
        // Metrics are filed under the id clients use, not the folder name.
        request.model_id.get_or_insert_with(|| entry.id.clone());
        request
            .params
            .sampling
            .validate()
            .map_err(|error| ApiError::BadRequest(error.to_string()))?;
        let handle = state
            .engine
            .submit(request)
            .map_err(ApiError::from_engine)?;
        let (sender, events) = mpsc::unbounded_channel();
        tokio::task::spawn_blocking(move || forward(handle, sender));
        let mut generation = Self {
            events,
            prompt_tokens: 0,
            max_ctx: 0,
            finished: false,
            heartbeat: Some(state.config.heartbeat).filter(|interval| !interval.is_zero()),
            started: false,
        };
        let patience = generation.heartbeat.filter(|_| stream);
        generation.wait_started(patience).await?;
        Ok(generation)
    }

    /// Waits for the engine to take the request (`Ok`) or refuse it (`Err`), at most
    /// `patience` when given (then `Ok`, not started yet).
    async fn wait_started(&mut self, patience: Option<Duration>) -> Result<(), ApiError> {
        let Ok(event) = self.recv_within(patience).await else {
            return Ok(());
        };
        match event {
            Some(Event::Started {
                prompt_tokens,
                max_ctx,
            }) => {
                self.record_start(prompt_tokens, max_ctx);
                Ok(())
            }
            Some(Event::Error(error)) => Err(ApiError::from_engine(error)),
            Some(_) => Err(ApiError::Internal(
                "the engine skipped its start event".into(),
            )),
            None => Err(EngineError::EngineStopped.into()),
        }
    }

    /// The next event, or `Err` after `patience` without one (`recv` is cancel-safe: a
    /// timed-out wait loses no event).
    async fn recv_within(&mut self, patience: Option<Duration>) -> Result<Option<Event>, ()> {
        match patience {
            Some(patience) => tokio::time::timeout(patience, self.events.recv())
                .await
                .map_err(|_| ()),
            None => Ok(self.events.recv().await),
        }
    }

    /// Keeps the engine's start (the prompt's size); whether it was kept before.
    fn record_start(&mut self, prompt_tokens: usize, max_ctx: usize) -> bool {
        self.prompt_tokens = prompt_tokens;
        self.max_ctx = max_ctx;
        std::mem::replace(&mut self.started, true)
    }

    /// Whether the engine took the request (its prompt's size is known).
    pub fn is_started(&self) -> bool {
        self.started
    }

    /// A generation fed from a channel, for tests of the stream formats.
    #[cfg(test)]
    pub fn from_events(events: mpsc::UnboundedReceiver<Event>, prompt_tokens: usize) -> Self {
        Self {
            events,
            prompt_tokens,
            max_ctx: 2048,
            finished: false,
            heartbeat: None,
            started: true,
        }
    }

    /// The same, saying `Idle` after `heartbeat` without a first token.
    #[cfg(test)]
    pub fn with_heartbeat(mut self, heartbeat: Duration) -> Self {
        self.heartbeat = Some(heartbeat);
        self
    }

    /// The next piece of the answer (or `Idle` while the first token is late); after `Done` or
    /// `Failed`, always `None`.
    pub async fn next(&mut self) -> Option<Step> {
        if self.finished {
            return None;
        }
        loop {
            let Ok(event) = self.recv_within(self.heartbeat).await else {
                return Some(Step::Idle);
            };
            let step = match event {
                Some(Event::Delta { text, logprob, .. }) => Step::Delta { text, logprob },
                Some(Event::Done(completion)) => Step::Done(completion),
                Some(Event::Error(error)) => Step::Failed(ApiError::from_engine(error)),
                Some(Event::Started {
                    prompt_tokens,
                    max_ctx,
                }) => {
                    if self.record_start(prompt_tokens, max_ctx) {
                        continue;
                    }
                    // The prompt's wait goes on: it prefills next.
                    return Some(Step::Started);
                }
                None => Step::Failed(EngineError::EngineStopped.into()),
            };
            self.finished = !matches!(step, Step::Delta { .. });
            // Decoding answers at its own pace: only a prompt's wait is filled.
            self.heartbeat = None;
            return Some(step);
        }
    }

    /// Runs to the end (non-streaming responses).
    pub async fn complete(mut self) -> Result<Completion, ApiError> {
        while let Some(step) = self.next().await {
            match step {
                Step::Started | Step::Idle | Step::Delta { .. } => {}
                Step::Done(completion) => return Ok(completion),
                Step::Failed(error) => return Err(error),
            }
        }
        Err(EngineError::EngineStopped.into())
    }
}

/// Moves events across until the end, or until the async side is gone (then the handle drops
/// here, cancelling the generation).
fn forward(handle: RequestHandle, sender: mpsc::UnboundedSender<Event>) {
    loop {
        match handle.events.recv_timeout(DISCONNECT_POLL) {
            Ok(event) => {
                let last = matches!(event, Event::Done(_) | Event::Error(_));
                if sender.send(event).is_err() || last {
                    return;
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                if sender.is_closed() {
                    return;
                }
                // A pipeline that lost a rank may leave the engine blocked on it: the request
                // ends here, with the reason, before the process exits.
                if let Some(reason) = rmlx_engine::distributed::health::failure() {
                    let _ = sender.send(Event::Error(EngineError::Distributed(reason)));
                    return;
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                let _ = sender.send(Event::Error(EngineError::EngineStopped));
                return;
            }
        }
    }
}

/// A fresh id with a prefix (`chatcmpl-`, `msg_`, `call_`): time plus a process-wide counter
/// is unique enough for a local server and needs no RNG.
pub fn new_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{nanos:x}{count:04x}")
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What rendering a chat prompt tells the handlers before it is queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptInfo {
    /// The prompt, with the prefill after it, ends inside an open `<think>` (templates that
    /// force thinking), so the output parser starts in reasoning mode.
    pub in_reasoning: bool,
    /// How the model's template writes tool calls.
    pub tool_format: ToolFormat,
    /// The model reasons in `<think>` … `</think>` (its vocabulary has the closing tag), so a
    /// reasoning budget can close it.
    pub thinks: bool,
}

impl PromptInfo {
    /// A budget of `tokens` for the model's reasoning, where it has `<think>` reasoning.
    pub fn reasoning_budget(&self, tokens: Option<usize>) -> Option<ReasoningBudget> {
        Some(ReasoningBudget {
            tokens: tokens.filter(|_| self.thinks)?,
            open: THINK_OPEN.into(),
            close: THINK_CLOSE.into(),
            starts_open: self.in_reasoning,
            forced: closed_think(),
        })
    }

    /// The assistant prefill a constrained answer (`response_format`, `text.format`) starts
    /// with: where the template opened `<think>`, that block closed empty, so the grammar holds
    /// the answer the client parses rather than reasoning that never ends (as for a forced
    /// call). None for text or where no think block is open.
    pub fn close_for_format(&self, format: &ResponseFormat) -> Option<String> {
        (self.in_reasoning && !format.is_text()).then(closed_think)
    }
}

/// How the templates write the end of a think block (an empty one when thinking is off).
pub(crate) fn closed_think() -> String {
    format!("\n{THINK_CLOSE}\n\n")
}

/// Renders the prompt (with `prefill` after it) to see whether it ends inside an open `<think>`,
/// and reads how the model writes tool calls. Rendering here also surfaces template errors as a
/// 400 before the request is queued.
pub async fn inspect_prompt(
    state: &AppState,
    entry: &ModelEntry,
    messages: &[serde_json::Value],
    options: &rmlx_engine::chat::TemplateOptions,
    prefill: &str,
) -> Result<PromptInfo, ApiError> {
    let (registry, path) = (state.registry.clone(), entry.path.clone());
    let (messages, options) = (messages.to_vec(), options.clone());
    let prefill = prefill.to_string();
    tokio::task::spawn_blocking(move || {
        let tokenizer = registry.tokenizer(&path)?;
        let prompt = tokenizer
            .render(&messages, &options)
            .map_err(|error| ApiError::from(EngineError::Chat(error)))?;
        let tail = format!("{prompt}{prefill}");
        Ok(PromptInfo {
            in_reasoning: tail.trim_end().ends_with(THINK_OPEN),
            tool_format: registry.tool_format(&path)?,
            thinks: tokenizer.inner().token_to_id(THINK_CLOSE).is_some(),
        })
    })
    .await
    .map_err(|error| ApiError::Internal(error.to_string()))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::testing::{delta, done};
    use rmlx_engine::generate::FinishReason;

    /// `Idle` while the first token is late, then never again: events come as they were sent.
    #[tokio::test]
    async fn idle_until_the_first_token_then_the_events_in_order() {
        let (sender, receiver) = mpsc::unbounded_channel();
        let mut generation =
            Generation::from_events(receiver, 3).with_heartbeat(Duration::from_millis(5));
        assert!(matches!(generation.next().await, Some(Step::Idle)));
        assert!(matches!(generation.next().await, Some(Step::Idle)));
        sender.send(delta("a")).unwrap();
        assert!(matches!(generation.next().await, Some(Step::Delta { text, .. }) if text == "a"));
        let late = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            sender.send(done("a", 2, FinishReason::Stop)).unwrap();
        });
        // Decoding is not padded: the wait for the second token is the engine's own.
        assert!(matches!(generation.next().await, Some(Step::Done(_))));
        assert!(generation.next().await.is_none());
        late.await.unwrap();
    }
}
