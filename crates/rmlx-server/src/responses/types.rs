//! The bodies `POST /v1/responses` answers with, as types: the handler builds these and the
//! OpenAPI document is derived from them. Shapes follow the OpenAI API reference (Responses:
//! "The response object", "Streaming events"); `timings` is rMLX's, as on the other routes.

use serde::Serialize;
use serde_json::{Map, Value};
use utoipa::ToSchema;

use crate::api::{AssistantRole, Timings};

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ResponseObjectType {
    Response,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ResponseStatus {
    InProgress,
    Completed,
    /// Cut short: `incomplete_details.reason` says why (`max_output_tokens`).
    Incomplete,
    Failed,
}

/// An output item's own status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ItemStatus {
    InProgress,
    Completed,
    Incomplete,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct IncompleteDetails {
    /// `max_output_tokens`.
    pub reason: String,
}

/// Why a response failed.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseError {
    /// `context_length_exceeded`, `rate_limit_exceeded`, `out_of_memory`, `server_error`, ...
    pub code: String,
    pub message: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct InputTokensDetails {
    /// Input tokens whose KV the engine's prefix cache supplied.
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct OutputTokensDetails {
    /// Output tokens the model spent reasoning (inside `<think>`).
    pub reasoning_tokens: usize,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseUsage {
    pub input_tokens: usize,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: usize,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: usize,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SummaryPart {
    SummaryText { text: String },
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ReasoningPart {
    ReasoningText { text: String },
}

/// A message's text. `annotations` and `logprobs` are always empty.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputContent {
    OutputText {
        text: String,
        #[schema(value_type = Vec<Object>)]
        annotations: Vec<Value>,
        #[schema(value_type = Vec<Object>)]
        logprobs: Vec<Value>,
    },
}

impl OutputContent {
    pub fn text(text: String) -> Self {
        Self::OutputText {
            text,
            annotations: Vec::new(),
            logprobs: Vec::new(),
        }
    }
}

/// A part `content_part.added` / `.done` opens or closes: a message's text or a reasoning
/// item's.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum ContentPart {
    Output(OutputContent),
    Reasoning(ReasoningPart),
}

/// One item of a response's `output`.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// The model's reasoning: `content` holds its text, `summary` the same text when
    /// `reasoning.summary` asked for one, and `encrypted_content` (with `include:
    /// ["reasoning.encrypted_content"]`) the text again, not encrypted: sent back as an input
    /// item, it is rendered as that turn's reasoning.
    Reasoning {
        id: String,
        summary: Vec<SummaryPart>,
        content: Vec<ReasoningPart>,
        #[serde(skip_serializing_if = "Option::is_none")]
        encrypted_content: Option<String>,
        status: ItemStatus,
    },
    Message {
        id: String,
        status: ItemStatus,
        role: AssistantRole,
        content: Vec<OutputContent>,
    },
    /// A call of a `function` tool (or of one inside a `namespace` tool, then named by
    /// `namespace` and `name`); `arguments` is a JSON object as a string.
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        namespace: Option<String>,
        arguments: String,
        status: ItemStatus,
    },
    /// A call of a `custom` (freeform) tool: `input` is the text the model wrote for it.
    CustomToolCall {
        id: String,
        call_id: String,
        name: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        namespace: Option<String>,
        input: String,
        status: ItemStatus,
    },
}

impl OutputItem {
    pub fn id(&self) -> &str {
        match self {
            Self::Reasoning { id, .. }
            | Self::Message { id, .. }
            | Self::FunctionCall { id, .. }
            | Self::CustomToolCall { id, .. } => id,
        }
    }
}

/// The request's `reasoning`, echoed.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct ReasoningEcho {
    pub effort: Option<String>,
    pub summary: Option<String>,
}

/// The request's `text`, echoed (`format` defaults to `{"type": "text"}`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextEcho {
    #[schema(value_type = Object)]
    pub format: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verbosity: Option<String>,
}

/// `POST /v1/responses` without `stream` (and the `response` of the stream's lifecycle
/// events). The request's parameters are echoed as OpenAI does; `output_text` is left to the
/// SDKs, which compute it from `output`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseObject {
    /// `resp_…`: what `previous_response_id` takes when the response was stored.
    pub id: String,
    pub object: ResponseObjectType,
    pub created_at: u64,
    pub status: ResponseStatus,
    pub error: Option<ResponseError>,
    pub incomplete_details: Option<IncompleteDetails>,
    #[schema(value_type = Option<String>)]
    pub instructions: Option<Value>,
    pub max_output_tokens: Option<usize>,
    pub model: String,
    pub output: Vec<OutputItem>,
    pub parallel_tool_calls: bool,
    pub previous_response_id: Option<String>,
    pub reasoning: ReasoningEcho,
    pub store: bool,
    pub temperature: f32,
    pub text: TextEcho,
    #[schema(value_type = super::schema::ToolChoiceIn)]
    pub tool_choice: Value,
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<Value>,
    pub top_p: f32,
    pub truncation: String,
    pub usage: Option<ResponseUsage>,
    pub user: Option<String>,
    #[schema(value_type = Object)]
    pub metadata: Map<String, Value>,
    pub prompt_cache_key: Option<String>,
    pub service_tier: String,
    pub background: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// What one stream event says; the SSE `event:` name equals `type`.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type")]
pub enum ResponseEventBody {
    #[serde(rename = "response.created")]
    Created { response: ResponseObject },
    #[serde(rename = "response.in_progress")]
    InProgress { response: ResponseObject },
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded {
        output_index: usize,
        item: OutputItem,
    },
    #[serde(rename = "response.output_item.done")]
    OutputItemDone {
        output_index: usize,
        item: OutputItem,
    },
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: ContentPart,
    },
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: ContentPart,
    },
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        item_id: String,
        output_index: usize,
        content_index: usize,
        delta: String,
        #[schema(value_type = Vec<Object>)]
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        item_id: String,
        output_index: usize,
        content_index: usize,
        text: String,
        #[schema(value_type = Vec<Object>)]
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.reasoning_text.delta")]
    ReasoningTextDelta {
        item_id: String,
        output_index: usize,
        content_index: usize,
        delta: String,
    },
    #[serde(rename = "response.reasoning_text.done")]
    ReasoningTextDone {
        item_id: String,
        output_index: usize,
        content_index: usize,
        text: String,
    },
    #[serde(rename = "response.reasoning_summary_part.added")]
    ReasoningSummaryPartAdded {
        item_id: String,
        output_index: usize,
        summary_index: usize,
        part: SummaryPart,
    },
    #[serde(rename = "response.reasoning_summary_text.delta")]
    ReasoningSummaryTextDelta {
        item_id: String,
        output_index: usize,
        summary_index: usize,
        delta: String,
    },
    #[serde(rename = "response.reasoning_summary_text.done")]
    ReasoningSummaryTextDone {
        item_id: String,
        output_index: usize,
        summary_index: usize,
        text: String,
    },
    #[serde(rename = "response.reasoning_summary_part.done")]
    ReasoningSummaryPartDone {
        item_id: String,
        output_index: usize,
        summary_index: usize,
        part: SummaryPart,
    },
    /// A call's whole arguments, in one delta.
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        item_id: String,
        output_index: usize,
        delta: String,
    },
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        item_id: String,
        output_index: usize,
        name: String,
        arguments: String,
    },
    #[serde(rename = "response.custom_tool_call_input.delta")]
    CustomToolCallInputDelta {
        item_id: String,
        output_index: usize,
        delta: String,
    },
    #[serde(rename = "response.custom_tool_call_input.done")]
    CustomToolCallInputDone {
        item_id: String,
        output_index: usize,
        input: String,
    },
    #[serde(rename = "response.completed")]
    Completed { response: ResponseObject },
    /// Cut short by `max_output_tokens`.
    #[serde(rename = "response.incomplete")]
    Incomplete { response: ResponseObject },
    /// The generation failed after the stream began (or the prompt is over the context):
    /// `response.error.code` says why.
    #[serde(rename = "response.failed")]
    Failed { response: ResponseObject },
}

impl ResponseEventBody {
    /// The SSE event name (the `type` tag).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Created { .. } => "response.created",
            Self::InProgress { .. } => "response.in_progress",
            Self::OutputItemAdded { .. } => "response.output_item.added",
            Self::OutputItemDone { .. } => "response.output_item.done",
            Self::ContentPartAdded { .. } => "response.content_part.added",
            Self::ContentPartDone { .. } => "response.content_part.done",
            Self::OutputTextDelta { .. } => "response.output_text.delta",
            Self::OutputTextDone { .. } => "response.output_text.done",
            Self::ReasoningTextDelta { .. } => "response.reasoning_text.delta",
            Self::ReasoningTextDone { .. } => "response.reasoning_text.done",
            Self::ReasoningSummaryPartAdded { .. } => "response.reasoning_summary_part.added",
            Self::ReasoningSummaryTextDelta { .. } => "response.reasoning_summary_text.delta",
            Self::ReasoningSummaryTextDone { .. } => "response.reasoning_summary_text.done",
            Self::ReasoningSummaryPartDone { .. } => "response.reasoning_summary_part.done",
            Self::FunctionCallArgumentsDelta { .. } => "response.function_call_arguments.delta",
            Self::FunctionCallArgumentsDone { .. } => "response.function_call_arguments.done",
            Self::CustomToolCallInputDelta { .. } => "response.custom_tool_call_input.delta",
            Self::CustomToolCallInputDone { .. } => "response.custom_tool_call_input.done",
            Self::Completed { .. } => "response.completed",
            Self::Incomplete { .. } => "response.incomplete",
            Self::Failed { .. } => "response.failed",
        }
    }
}

/// One event of a streamed `POST /v1/responses`. Order: `response.created`,
/// `response.in_progress`, then per output item `response.output_item.added`, its deltas
/// (`content_part.added`, `output_text.delta`/`.done`, `content_part.done` for a message;
/// `reasoning_text.delta`/`.done`, with `reasoning_summary_part.added`,
/// `reasoning_summary_text.delta`/`.done` and `reasoning_summary_part.done` when a summary was
/// asked, for reasoning; `function_call_arguments.delta`/`.done` or
/// `custom_tool_call_input.delta`/`.done` for a call) and `response.output_item.done`; last,
/// always one of `response.completed`, `response.incomplete` or `response.failed`.
/// `sequence_number` counts the events from 0.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseStreamEvent {
    #[serde(flatten)]
    pub body: ResponseEventBody,
    pub sequence_number: u64,
}
