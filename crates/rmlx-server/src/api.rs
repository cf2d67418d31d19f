//! The bodies `rmlx serve` answers with, as types: the handlers build these, and the OpenAPI
//! document (`crate::openapi`, docs/openapi.yaml) is derived from the same types, so the two
//! cannot drift. Shapes follow the OpenAI API reference (chat, completions, streaming) and
//! Anthropic's Messages and "Streaming Messages" docs; `timings` is rMLX's (llama.cpp's name).

use rmlx_engine::generate::{Completion, FinishReason, TokenLogprob};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

/// Token counts of one request (OpenAI).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV the engine's prefix cache supplied.
    pub cached_tokens: usize,
}

impl Usage {
    pub fn of(completion: &Completion) -> Self {
        Self {
            prompt_tokens: completion.prompt_tokens,
            completion_tokens: completion.completion_tokens,
            total_tokens: completion.prompt_tokens + completion.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: completion.cached_tokens,
            },
        }
    }
}

/// rMLX's measurements of one request (every route's final answer carries them).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Timings {
    /// Request start to the first generated token, in milliseconds.
    pub ttft_ms: f64,
    /// Prompt tokens computed per second (0 when the prefix cache supplied them all).
    pub prefill_tps: f64,
    /// Generated tokens per second after the first.
    pub decode_tps: f64,
    pub total_ms: f64,
    /// The most requests that decoded together with this one in one batch (1: alone).
    pub batched_with: usize,
    /// The most prompts prefilled in one forward with this one (1: alone; 0: its whole
    /// prompt came from the prefix cache).
    pub prefilled_with: usize,
    /// The most prompts whose image blocks went through one forward with this one's (0: no
    /// image prefilled; 1: alone).
    pub images_prefilled_with: usize,
    /// Tokens speculative decoding drafted for this answer (`rmlx serve --speculative`).
    pub draft_tokens: usize,
    /// Drafted tokens the model agreed with: each saved a decode step.
    pub accepted_tokens: usize,
    /// Per draft position (a step's first draft, its second, ...): drafts checked there, and
    /// kept (empty without drafts).
    pub drafted_at: Vec<usize>,
    pub accepted_at: Vec<usize>,
}

/// A figure JSON can carry: serde_json writes NaN and infinities as `null`, which the schema's
/// `number` would refuse (a rate over no time, say).
fn finite(value: f64) -> f64 {
    if value.is_finite() {
        value
    } else {
        0.0
    }
}

impl Timings {
    pub fn of(completion: &Completion) -> Self {
        let t = &completion.timings;
        Self {
            ttft_ms: finite(t.ttft_ms),
            prefill_tps: finite(t.prefill_tps),
            decode_tps: finite(t.decode_tps),
            total_ms: finite(t.total_ms),
            batched_with: completion.batched_with,
            prefilled_with: t.prefilled_with,
            images_prefilled_with: t.images_prefilled_with,
            draft_tokens: t.draft_tokens,
            accepted_tokens: t.accepted_tokens,
            drafted_at: t.drafted_at.clone(),
            accepted_at: t.accepted_at.clone(),
        }
    }
}

/// Why an OpenAI answer ended.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OpenAiFinish {
    Stop,
    Length,
    ToolCalls,
}

impl OpenAiFinish {
    pub fn of(reason: FinishReason, tool_calls: bool) -> Self {
        match reason {
            _ if tool_calls => Self::ToolCalls,
            FinishReason::Length => Self::Length,
            FinishReason::Stop | FinishReason::Cancelled => Self::Stop,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub enum ChatCompletionObject {
    #[serde(rename = "chat.completion")]
    ChatCompletion,
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub enum ChatChunkObject {
    #[serde(rename = "chat.completion.chunk")]
    ChatCompletionChunk,
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub enum TextCompletionObject {
    #[serde(rename = "text_completion")]
    TextCompletion,
}

#[derive(Debug, Clone, Copy, Default, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum AssistantRole {
    #[default]
    Assistant,
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum FunctionType {
    Function,
}

/// A function call the model made; `arguments` is a JSON object as a string.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

/// A tool call; `index` is sent only in stream deltas.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ToolCallOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: FunctionType,
    pub function: FunctionCall,
}

/// The assistant's message of a non-streamed chat completion. `content` is null when the
/// answer is only tool calls.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AssistantMessage {
    pub role: AssistantRole,
    pub content: Option<String>,
    /// The model's reasoning (the text inside `<think>`), when it had any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// One alternative token and its log-probability.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TopLogprobOut {
    pub token: String,
    pub logprob: f32,
    /// The token's UTF-8 bytes.
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TokenLogprobOut {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprobOut>,
}

/// Chat log-probs: one entry per generated token.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprobOut>,
}

/// A log-probability JSON can carry: minus infinity (a token the sampler could not have drawn)
/// becomes -9999, the floor OpenAI itself reports, where serde_json would write `null`.
fn logprob_value(value: f32) -> f32 {
    if value.is_finite() {
        value
    } else {
        -9999.0
    }
}

impl ChatLogprobs {
    pub fn of(entries: &[TokenLogprob]) -> Self {
        let content = entries
            .iter()
            .map(|entry| TokenLogprobOut {
                token: entry.token.clone(),
                logprob: logprob_value(entry.logprob),
                bytes: entry.token.as_bytes().to_vec(),
                top_logprobs: entry
                    .top
                    .iter()
                    .map(|alt| TopLogprobOut {
                        token: alt.token.clone(),
                        logprob: logprob_value(alt.logprob),
                        bytes: alt.token.as_bytes().to_vec(),
                    })
                    .collect(),
            })
            .collect();
        Self { content }
    }
}

/// Legacy completion log-probs (parallel lists).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LegacyLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    /// Per token, its alternatives as `{token: logprob}`.
    pub top_logprobs: Vec<std::collections::BTreeMap<String, f32>>,
    /// Per token, the characters of generated text before it.
    pub text_offset: Vec<usize>,
}

impl LegacyLogprobs {
    /// `offset` is where `entries` start in the generated text, moved past them.
    pub fn of(entries: &[TokenLogprob], offset: &mut usize) -> Self {
        let mut text_offset = Vec::with_capacity(entries.len());
        for entry in entries {
            text_offset.push(*offset);
            *offset += entry.token.chars().count();
        }
        Self {
            tokens: entries.iter().map(|e| e.token.clone()).collect(),
            token_logprobs: entries.iter().map(|e| logprob_value(e.logprob)).collect(),
            top_logprobs: entries
                .iter()
                .map(|e| {
                    e.top
                        .iter()
                        .map(|alt| (alt.token.clone(), logprob_value(alt.logprob)))
                        .collect()
                })
                .collect(),
            text_offset,
        }
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: OpenAiFinish,
}

/// `POST /v1/chat/completions` without `stream`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    pub object: ChatCompletionObject,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    pub timings: Timings,
}

/// What a stream chunk adds to the message.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<AssistantRole>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<OpenAiFinish>,
}

/// One `data:` event of a streamed chat completion. The last chunk with a choice carries the
/// `finish_reason` and `timings`; with `stream_options.include_usage` a chunk with no choices
/// and the `usage` follows; then `data: [DONE]`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: ChatChunkObject,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<LegacyLogprobs>,
    pub finish_reason: Option<OpenAiFinish>,
}

/// `POST /v1/completions`, whole or as each `data:` event of its stream (the stream's last
/// chunk with a choice carries `finish_reason` and `timings`, an optional usage chunk with no
/// choices follows, then `data: [DONE]`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextCompletion {
    pub id: String,
    pub object: TextCompletionObject,
    pub created: u64,
    pub model: String,
    pub choices: Vec<TextChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

// ---- Anthropic ----

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum MessageType {
    Message,
}

/// Why an Anthropic answer ended.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    EndTurn,
    MaxTokens,
    StopSequence,
    ToolUse,
}

impl StopReason {
    /// The reason, and the stop sequence the engine says ended the answer.
    pub fn of(completion: &Completion, tool_calls: bool) -> (Self, Option<String>) {
        match completion.finish_reason {
            _ if tool_calls => (Self::ToolUse, None),
            FinishReason::Length => (Self::MaxTokens, None),
            FinishReason::Stop | FinishReason::Cancelled => match &completion.stop_sequence {
                Some(sequence) => (Self::StopSequence, Some(sequence.clone())),
                None => (Self::EndTurn, None),
            },
        }
    }
}

/// Anthropic's usage. `input_tokens` is the whole prompt (it equals count_tokens);
/// `cache_read_input_tokens` says how many of those the prefix cache supplied. `message_start`
/// sends only the first two (cache reads are known at the end).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AnthropicUsage {
    pub input_tokens: usize,
    pub output_tokens: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_creation_input_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_read_input_tokens: Option<usize>,
}

impl AnthropicUsage {
    pub fn of(completion: &Completion) -> Self {
        Self {
            input_tokens: completion.prompt_tokens,
            output_tokens: completion.completion_tokens,
            cache_creation_input_tokens: Some(0),
            cache_read_input_tokens: Some(completion.cached_tokens),
        }
    }
}

/// A block of an Anthropic answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    Text {
        text: String,
    },
    /// The model's reasoning; the signature is empty (local models sign nothing).
    Thinking {
        thinking: String,
        signature: String,
    },
    ToolUse {
        id: String,
        name: String,
        /// The arguments, a JSON object (`{}` in a stream's block start; the arguments follow
        /// as `input_json_delta`).
        #[schema(value_type = Object)]
        input: Value,
    },
}

/// `POST /v1/messages` without `stream` (and `message_start`'s message, with no content yet,
/// no stop reason and no timings).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Message {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: MessageType,
    pub role: AssistantRole,
    pub model: String,
    pub content: Vec<ContentBlock>,
    pub stop_reason: Option<StopReason>,
    pub stop_sequence: Option<String>,
    pub usage: AnthropicUsage,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// What a `content_block_delta` adds to its block.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockDelta {
    TextDelta {
        text: String,
    },
    ThinkingDelta {
        thinking: String,
    },
    /// A piece of a tool call's arguments (the whole JSON text, in rMLX's stream).
    InputJsonDelta {
        partial_json: String,
    },
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MessageDeltaBody {
    pub stop_reason: StopReason,
    pub stop_sequence: Option<String>,
}

/// One event of a streamed `POST /v1/messages`: the SSE `event:` name equals `type`. Order:
/// `message_start`, then per block `content_block_start` (`ping` after the first),
/// `content_block_delta`s and `content_block_stop`, then `message_delta` and `message_stop`;
/// a failure after the start ends the stream with an `error` event.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum MessageStreamEvent {
    MessageStart {
        message: Message,
    },
    ContentBlockStart {
        index: usize,
        content_block: ContentBlock,
    },
    Ping,
    ContentBlockDelta {
        index: usize,
        delta: BlockDelta,
    },
    ContentBlockStop {
        index: usize,
    },
    /// The whole usage, as Anthropic now sends it (cache reads are known only here).
    MessageDelta {
        delta: MessageDeltaBody,
        usage: AnthropicUsage,
    },
    MessageStop,
}

impl MessageStreamEvent {
    /// The SSE event name (the `type` tag).
    pub fn name(&self) -> &'static str {
        match self {
            Self::MessageStart { .. } => "message_start",
            Self::ContentBlockStart { .. } => "content_block_start",
            Self::Ping => "ping",
            Self::ContentBlockDelta { .. } => "content_block_delta",
            Self::ContentBlockStop { .. } => "content_block_stop",
            Self::MessageDelta { .. } => "message_delta",
            Self::MessageStop => "message_stop",
        }
    }
}

/// `POST /v1/messages/count_tokens`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TokenCount {
    pub input_tokens: usize,
}

// ---- Errors ----

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct OpenAiErrorDetail {
    pub message: String,
    /// `invalid_request_error`, `not_found_error`, `rate_limit_error`, `server_error`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// Always null (OpenAI names the offending field here; rMLX says it in `message`).
    pub param: Option<String>,
    /// A finer reason when there is one (`context_length_exceeded`, `model_not_found`, ...).
    pub code: Option<String>,
    /// With `context_length_exceeded`: the prompt's tokens and the context that holds fewer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_length: Option<usize>,
}

/// The error body of every route but Anthropic's (and the `data:` event that ends a failed
/// OpenAI stream).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct OpenAiError {
    pub error: OpenAiErrorDetail,
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ErrorType {
    Error,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AnthropicErrorDetail {
    /// `invalid_request_error`, `not_found_error`, `rate_limit_error`, `api_error`, ...
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
}

/// The error body of `/v1/messages` and `/v1/messages/count_tokens` (and the `error` event
/// that ends a failed Anthropic stream).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AnthropicError {
    #[serde(rename = "type")]
    pub kind: ErrorType,
    pub error: AnthropicErrorDetail,
}

// ---- Models, health, metrics ----

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum HealthStatus {
    Ok,
    /// A rank of the pipeline was lost; the process exits shortly.
    Failed,
}

/// `GET /health`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Health {
    pub status: HealthStatus,
    /// Across machines (`rmlx serve --distributed`): every rank, its layers and its last
    /// heartbeat. Absent in one process.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankHealth>,
    /// Why the pipeline failed (with `failed`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One rank of a pipeline in `/health`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RankHealth {
    pub rank: usize,
    /// Its address and port in the hostfile.
    pub endpoint: String,
    /// The decoder layers it holds, `[start, end)`.
    pub layers: [usize; 2],
    /// Milliseconds since its last heartbeat.
    pub last_heartbeat_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ModelObjectType {
    Model,
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ListObject {
    List,
}

/// Where the server found a model.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ModelSource {
    /// `--model DIR`: never deleted through the API.
    Model,
    /// A folder under `--models-dir`.
    ModelsDir,
    /// The Hugging Face cache.
    HfCache,
}

/// Whether the model is expected to fit in memory at the server's context and batch.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Fits {
    Yes,
    Tight,
    No,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Quantization {
    pub bits: Option<u64>,
    pub group_size: Option<u64>,
    /// `affine`, `mxfp4`, `mxfp8`, `nvfp4`.
    pub mode: String,
}

/// A model the server can run.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelObject {
    pub id: String,
    pub object: ModelObjectType,
    pub created: u64,
    pub owned_by: String,
    /// Tokens of context (prompt + answer) a request may use.
    pub context_length: Option<usize>,
    /// Whether the engine holds it in memory now.
    pub loaded: bool,
    /// Whether it takes images.
    pub vision: bool,
    /// Whether it ships a multi-token-prediction draft head (Qwen3.5 / 3.6 `mtp.*`, or a
    /// sidecar beside the weights): `--speculative mtp` or `auto` drafts with it.
    pub draft_head: bool,
    /// The folder of the draft model paired with every model served (`--draft-model`), if any:
    /// `--speculative draft` or `auto` drafts with it.
    pub draft_model: Option<String>,
    pub model_type: Option<String>,
    pub parameters: Option<u64>,
    pub quantization: Option<Quantization>,
    pub size_bytes: u64,
    pub source: ModelSource,
    /// Whether `DELETE /v1/models/{id}` may remove its folder.
    pub deletable: bool,
    /// The structural switches of its config in a line (layers, attention kinds, experts).
    pub structure: String,
    /// Unknown when the memory available cannot be read.
    pub fits: Option<Fits>,
    /// The longest context (up to the model's own) that fits the memory available now, as this
    /// server would hold it (KV bits, sliding windows, `--max-batch` rows' fixed state, explicit
    /// prefix-cache budgets); 0 when not even the weights fit; null when the memory is unknown.
    pub max_context_fits: Option<u64>,
    /// Seconds its last load took (reading and evaluating the weights); null until it loaded.
    pub load_seconds: Option<f64>,
    /// Seconds its last warm-up took (the kernels a first burst of requests needs, built right
    /// after loading: `rmlx serve --warm-up`); null until one has run.
    pub warm_up_seconds: Option<f64>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MemoryInfo {
    pub total_bytes: Option<u64>,
    pub available_bytes: Option<u64>,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelList {
    pub object: ListObject,
    pub data: Vec<ModelObject>,
    pub memory: MemoryInfo,
    /// The same models as Codex CLI reads its model metadata (`codex-rs/protocol`
    /// `openai_models::ModelInfo`), so it knows each one's context window.
    pub models: Vec<CodexModel>,
}

/// A reasoning effort Codex may send, and what it does here.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CodexReasoningLevel {
    pub effort: String,
    pub description: String,
}

/// How Codex truncates tool output before sending it back.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CodexTruncationPolicy {
    /// `bytes` or `tokens`.
    pub mode: String,
    pub limit: u64,
}

/// One model as Codex CLI's `/models` reader takes it. `base_instructions` is left out on
/// purpose: Codex would use it in place of its own system prompt. `apply_patch_tool_type` is
/// left out too: Codex 0.169 knows only `freeform` (its grammar enforced only where the model's
/// call format writes the input raw) and refuses any other value; absent, it sends apply_patch
/// as a JSON function, which every call format holds to its schema.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CodexModel {
    pub slug: String,
    pub display_name: String,
    pub description: String,
    pub supported_reasoning_levels: Vec<CodexReasoningLevel>,
    /// `default`: Codex's own shell tool.
    pub shell_type: String,
    /// `list`.
    pub visibility: String,
    pub supported_in_api: bool,
    pub priority: i32,
    pub supports_reasoning_summaries: bool,
    pub support_verbosity: bool,
    pub truncation_policy: CodexTruncationPolicy,
    pub supports_parallel_tool_calls: bool,
    /// Tokens of context (prompt + answer), as `context_length` says.
    pub context_window: Option<usize>,
    pub max_context_window: Option<usize>,
    pub effective_context_window_percent: u8,
    pub experimental_supported_tools: Vec<String>,
    /// `text`, and `image` for a vision model.
    pub input_modalities: Vec<String>,
}

/// `POST /v1/models/{id}/unload`: `unloaded` is false when it was not loaded.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Unloaded {
    pub id: String,
    pub unloaded: bool,
}

/// `DELETE /v1/models/{id}`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Deleted {
    pub id: String,
    pub object: ModelObjectType,
    pub deleted: bool,
}

/// `GET /admin/downloads`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct JobList {
    pub object: ListObject,
    pub data: Vec<rmlx_hub::Job>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelCacheMetrics {
    pub model_id: String,
    /// Requests whose prefix came from RAM.
    pub prefix_cache_hits: u64,
    /// Requests whose prefix was read back from the disk cache.
    pub disk_cache_hits: u64,
    pub prefix_cache_misses: u64,
    pub prefix_cache_evictions: u64,
    /// Tokens speculative decoding drafted for this model's finished requests.
    pub draft_tokens: u64,
    /// Drafted tokens the model kept (each saved a decode step).
    pub accepted_tokens: u64,
    /// Bytes the prefix cache keeps for this model (KV entries and snapshots).
    pub prefix_cache_bytes: u64,
    pub kv_cache_bytes: u64,
    pub active_memory_bytes: u64,
    pub peak_memory_bytes: u64,
}

/// Latency percentiles of one model, in milliseconds.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Latency {
    pub model_id: String,
    pub p50: f64,
    pub p95: f64,
    pub mean: f64,
    pub count: u64,
}

/// A finished request.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RecentRequest {
    /// The response id the client got, when the route gives one.
    pub id: Option<String>,
    pub model: String,
    pub ttft_ms: f64,
    pub itl_p50_ms: f64,
    /// Every inter-token gap, in order (the most recent ones, capped).
    pub itl_ms: Vec<f64>,
    pub tokens_in: usize,
    pub cached_tokens: usize,
    pub tokens_out: usize,
    /// Tokens speculative decoding drafted for it, and how many were kept.
    pub draft_tokens: usize,
    pub accepted_tokens: usize,
    /// Unix time in milliseconds.
    pub ended: u64,
}

/// `GET /metrics/cache`: the engine's live figures (the app's dashboard reads them).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CacheMetrics {
    pub models: Vec<ModelCacheMetrics>,
    pub ttft: Vec<Latency>,
    pub itl: Vec<Latency>,
    pub recent: Vec<RecentRequest>,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub queue_depth: usize,
    pub in_flight: usize,
    pub kv_cache_bytes: u64,
    pub prefix_cache_bytes: u64,
    pub prefix_snapshots: usize,
    pub prefix_snapshot_bytes: u64,
    /// The prefix cache's budgets: as set (`--prefix-cache-mb`, `--prefix-snapshot-mb`), or
    /// sized for agent sessions from the machine's memory and the loaded model.
    pub prefix_cache_budget_bytes: u64,
    pub prefix_snapshot_budget_bytes: u64,
    /// KV entries stored shorter than they came, to fit the budget.
    pub prefix_cache_trimmed: u64,
    pub active_memory_bytes: u64,
    pub peak_memory_bytes: u64,
    pub cache_memory_bytes: u64,
    /// Errors answered since start, by kind (`invalid_request`, `queue_full`, ...).
    pub error_counts: std::collections::BTreeMap<String, u64>,
    /// The disk prefix cache; null when it is off.
    pub disk_cache: Option<DiskCacheMetrics>,
    /// Across machines (`rmlx serve --distributed`): every rank, its layers and its last
    /// heartbeat (as `/health`). Absent in one process.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankHealth>,
    /// Why the pipeline across machines failed (the server is exiting); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_error: Option<String>,
}

/// The disk prefix cache (`--prefix-disk-gb`, `--prefix-disk-dir`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DiskCacheMetrics {
    /// Its folder.
    pub path: String,
    pub budget_bytes: u64,
    pub bytes: u64,
    pub files: u64,
    /// Since the server started.
    pub read_bytes: u64,
    /// Time spent reading and checking them (off the engine thread).
    pub read_ms: f64,
    pub written_bytes: u64,
    pub evicted_files: u64,
    pub evicted_bytes: u64,
    /// Writing stopped after a failed write (a full disk); reads go on.
    pub writing_stopped: bool,
}
