//! What a client sends (a request) and gets back (a handle and its events).

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
};

use crate::{
    chat::TemplateOptions,
    error::{EngineError, Result},
    generate::{Completion, GenerateParams},
};

/// What to feed the model.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Messages rendered through the model's chat template.
    Chat {
        messages: Vec<serde_json::Value>,
        options: TemplateOptions,
    },
    /// Raw text, tokenized as is (BOS added when the tokenizer wants it).
    Text(String),
    /// Token ids, used as is.
    Ids(Vec<u32>),
}

/// One generation. Build it with `..Request::default()`: fields get added over time.
#[derive(Debug, Clone)]
pub struct Request {
    pub model: PathBuf,
    /// The name metrics file this request under; default the model folder's name.
    pub model_id: Option<String>,
    pub prompt: Prompt,
    /// Text appended to the prompt (after a chat prompt's generation prompt) before tokenizing:
    /// the start of the assistant's turn, part of the prompt, not of the answer (a forced
    /// `<tool_call>`, Anthropic's assistant prefill).
    pub assistant_prefill: Option<String>,
    /// Decoded images, in the order their content parts appear (or, with no parts, placed by
    /// the splice fallback inside the final user turn).
    pub images: Vec<image::RgbImage>,
    /// The caller's id for this request (the server's response id): metrics list it.
    pub request_id: Option<String>,
    /// Gemma 4's soft-token budget per image for this request (70, 140, 280, 560 or 1120);
    /// None uses the checkpoint's processor setting.
    pub image_soft_tokens: Option<usize>,
    pub params: GenerateParams,
    /// Fault injection for tests: this request's work panics at that step, as a bug would.
    #[doc(hidden)]
    pub panic_at: Option<Step>,
    /// The engine's own warm-up request (`Engine::warm_up`): no metrics, no prefix cache.
    #[doc(hidden)]
    pub warm_up: bool,
}

/// A step of the engine loop (see [`Request::panic_at`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Admit,
    Prefill,
    Decode,
}

/// Panics when the request asked for a panic at `step` (only tests do).
pub(super) fn injected_panic(panic_at: Option<Step>, step: Step) {
    if panic_at == Some(step) {
        panic!("injected panic at {step:?} (Request::panic_at)");
    }
}

impl Default for Request {
    fn default() -> Self {
        Self {
            model: PathBuf::new(),
            model_id: None,
            prompt: Prompt::Ids(Vec::new()),
            assistant_prefill: None,
            images: Vec::new(),
            request_id: None,
            image_soft_tokens: None,
            params: GenerateParams::default(),
            panic_at: None,
            warm_up: false,
        }
    }
}

impl Request {
    pub(super) fn metrics_id(&self) -> String {
        self.model_id
            .clone()
            .unwrap_or_else(|| folder_name(&self.model))
    }
}

fn folder_name(path: &Path) -> String {
    path.file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

// `Done` carries the whole completion once per request; the deltas are small and many, but a
// box would only move the completion's bytes elsewhere for the one event that has them.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Event {
    /// The prompt was tokenized and fits: generation is starting.
    Started {
        prompt_tokens: usize,
        max_ctx: usize,
    },
    /// Newly completed text for one token (with its log-probs when asked for).
    Delta {
        token_id: u32,
        text: String,
        logprob: Option<crate::generate::TokenLogprob>,
    },
    Done(Completion),
    Error(EngineError),
}

/// A running request: its events, and cancellation on demand or on drop.
pub struct RequestHandle {
    pub events: mpsc::Receiver<Event>,
    pub(super) cancel: Arc<AtomicBool>,
}

impl RequestHandle {
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// Waits for the end, returning the completion or the error.
    pub fn wait(self) -> Result<Completion> {
        for event in self.events.iter() {
            match event {
                Event::Done(completion) => return Ok(completion),
                Event::Error(error) => return Err(error),
                _ => {}
            }
        }
        Err(EngineError::EngineStopped)
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.cancel();
    }
}
