//! A request's generation settings, and what it gives back: deltas, log-probs, the completion.

use crate::{
    cache::KvStorage,
    constrain::{ReasoningBudget, ResponseFormat, TriggeredGrammar},
    error::{EngineError, Result},
    models::LanguageModel,
    sample::SamplingParams,
    speculative::SpeculativeParams,
};

use super::one;

/// Prompt tokens per prefill chunk by default; each chunk is one bounded graph.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct GenerateParams {
    pub max_tokens: usize,
    #[serde(default)]
    pub sampling: SamplingParams,
    /// Keep generating through EOS (benchmarks, golden comparisons).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Extra stop token ids beyond the model's EOS ids.
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    #[serde(default)]
    pub stop: Vec<String>,
    /// Effective context; default the model's `max_position_embeddings`.
    #[serde(default)]
    pub max_ctx: Option<usize>,
    #[serde(default)]
    pub prefill_chunk: Option<usize>,
    /// `Some(n)`: report each token's log-prob and its `n` most likely alternatives (n <= 20).
    #[serde(default)]
    pub logprobs: Option<usize>,
    /// Constrain the output to JSON (OpenAI `response_format`).
    #[serde(default)]
    pub response_format: ResponseFormat,
    /// Freeform tools' grammars, each switched on when the model opens a call of its tool.
    #[serde(skip)]
    pub tool_grammars: Vec<TriggeredGrammar>,
    /// A cap on the reasoning, its closing forced once spent.
    #[serde(skip)]
    pub reasoning_budget: Option<ReasoningBudget>,
    /// How new caches store keys and values (the engine's `kv_bits`); sliding-window layers
    /// stay dense.
    #[serde(skip)]
    pub kv_storage: KvStorage,
    /// Drafting tokens and checking them in one forward (greedy, sampled, penalised and
    /// constrained rows; not those with custom-tool grammars or a reasoning budget).
    #[serde(default)]
    pub speculative: SpeculativeParams,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            sampling: SamplingParams::default(),
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            max_ctx: None,
            prefill_chunk: None,
            logprobs: None,
            response_format: ResponseFormat::Text,
            tool_grammars: Vec::new(),
            reasoning_budget: None,
            kv_storage: KvStorage::Dense,
            speculative: SpeculativeParams::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An EOS/stop token or a stop string.
    Stop,
    /// `max_tokens` reached, or the context is full.
    #[default]
    Length,
    Cancelled,
}

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Timings {
    /// Request start to the first generated token on the host.
    pub ttft_ms: f64,
    /// Gap before each token after the first.
    pub itl_ms: Vec<f64>,
    pub prefill_tps: f64,
    pub decode_tps: f64,
    pub total_ms: f64,
    /// Tokens speculative decoding drafted for this request, and how many of them the model
    /// agreed with (each saved one decode step).
    #[serde(default)]
    pub draft_tokens: usize,
    #[serde(default)]
    pub accepted_tokens: usize,
    /// Per draft position (the first draft of a step, the second, ...): how many drafts were
    /// checked there and how many kept. A head's or proposer's accuracy falls with depth; this
    /// says where.
    #[serde(default)]
    pub drafted_at: Vec<usize>,
    #[serde(default)]
    pub accepted_at: Vec<usize>,
    /// The most prompts prefilled in one forward with this one, itself included (1: alone; 0:
    /// the prefix cache held the whole prompt).
    #[serde(default)]
    pub prefilled_with: usize,
    /// The most prompts in the forward that took this prompt's image blocks, itself included
    /// (0: no image was prefilled; 1: its images went alone).
    #[serde(default)]
    pub images_prefilled_with: usize,
}

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Completion {
    pub text: String,
    pub prompt_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Per generated token, when the request asked for log-probs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// The stop string that ended the answer (None when a stop token, the length or a
    /// cancel did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_sequence: Option<String>,
    /// Prompt tokens whose KV came from the prefix cache instead of being computed.
    #[serde(default)]
    pub cached_tokens: usize,
    /// The most requests that decoded together in one batch while this one did (1: alone).
    #[serde(default = "one")]
    pub batched_with: usize,
    pub timings: Timings,
}

/// One streamed piece: the token and the text it completed (possibly empty while a character
/// or a possible stop string is held back).
#[derive(Debug, Clone)]
pub struct Delta {
    pub token_id: u32,
    pub text: String,
    pub logprob: Option<TokenLogprob>,
    /// KV bytes this request holds now (for the live-memory gauges).
    pub kv_bytes: u64,
}

/// A token's log-prob under the (penalised) model distribution, with the likeliest
/// alternatives, most likely first.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprob {
    pub token_id: u32,
    /// The token alone, decoded (lossy where it is part of a multi-byte character).
    pub token: String,
    pub logprob: f32,
    pub top: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TopLogprob {
    pub token_id: u32,
    pub token: String,
    pub logprob: f32,
}

/// Most alternatives a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The context a request gets, and the typed refusal of a prompt that cannot fit (checked
/// before any compute).
pub fn effective_context(
    model: &dyn LanguageModel,
    params: &GenerateParams,
    prompt_tokens: usize,
) -> Result<usize> {
    let max_ctx = params
        .max_ctx
        .unwrap_or_else(|| model.max_position_embeddings());
    if prompt_tokens == 0 {
        return Err(EngineError::InvalidRequest("the prompt is empty".into()));
    }
    if prompt_tokens > max_ctx {
        return Err(EngineError::ContextOverflow {
            prompt_tokens,
            max_ctx,
        });
    }
    Ok(max_ctx)
}
