//! `POST /v1/messages` and `POST /v1/messages/count_tokens` in Anthropic's shapes, with the
//! native stream (`message_start`, `content_block_start`, `ping`, `content_block_delta`,
//! `content_block_stop`, `message_delta`, `message_stop`). Reference: Anthropic Messages API and
//! "Streaming Messages" docs.

use axum::{
    extract::State,
    response::{sse::Event, IntoResponse, Response},
    Json,
};
use rmlx_engine::{
    chat::TemplateOptions,
    engine::{Prompt, Request},
    generate::GenerateParams,
    sample::{SamplingDefaults, SamplingParams},
    EngineError,
};
use serde::Deserialize;
use serde_json::{json, Value};
use utoipa::ToSchema;

use crate::{
    api::{
        AnthropicUsage, AssistantRole, BlockDelta, ContentBlock, Message, MessageDeltaBody,
        MessageStreamEvent, MessageType, StopReason, Timings, TokenCount,
    },
    constraints, convert,
    error::{real, whole, Api, ApiError, ApiJson},
    forced::{self, ForcedCall},
    generation::{inspect_prompt, new_id, Generation, PromptInfo, Step},
    parse::{log_warnings, OutputParser, Piece, ToolCall},
    registry::ModelEntry,
    sse::{self, EventSource},
    AppState,
};

/// What shapes the prompt (`POST /v1/messages/count_tokens` takes just these): shared by
/// messages and count_tokens so the counts agree.
#[derive(Debug, Deserialize, ToSchema)]
pub struct PromptFields {
    /// A model id from `GET /v1/models`.
    #[schema(value_type = constraints::ModelId)]
    model: String,
    /// Anthropic's messages: `role` (`user`, `assistant`, `system`) and `content` (a string or
    /// blocks of `text`, `image` (base64 source), `tool_use`, `tool_result` (text and images),
    /// `thinking`); a last assistant message is the answer's prefill. Leading `system`
    /// messages join the system prompt, later ones the user or tool turn beside them. Other
    /// block types (Anthropic's server-side ones) are ignored.
    #[schema(value_type = Vec<AnthropicMessageIn>, min_items = 1)]
    messages: Vec<Value>,
    /// A string or a list of `text` blocks (`cache_control` ignored); Claude Code's
    /// `x-anthropic-billing-header:` block is left out.
    #[schema(value_type = Option<AnthropicSystem>)]
    system: Option<Value>,
    /// `{name, description, input_schema}`; Anthropic's server tools (a `type` other than
    /// `custom`, e.g. `web_search_20250305`) are ignored.
    #[schema(value_type = Option<Vec<AnthropicToolIn>>)]
    tools: Option<Vec<Value>>,
    /// `{"type": "auto" | "any" | "none" | "tool", "name": ...}` (`any` and `tool` force a call:
    /// they need a tool to call, and `tool` names one of `tools`); anything else is `auto`.
    tool_choice: Option<Value>,
    /// The model's thinking switch: `{"type": "enabled", "budget_tokens": N}` or
    /// `{"type": "adaptive"}` turn it on (after N tokens of reasoning its end is written and
    /// the answer follows; any N >= 1, where Anthropic asks for 1024), `{"type": "disabled"}`
    /// off; absent (or anything else), the chat template's default.
    thinking: Option<Value>,
    /// Accepted and ignored (Claude Code's `clear_thinking` edits: history is the client's).
    #[allow(dead_code)]
    context_management: Option<Value>,
    /// Accepted and ignored.
    #[allow(dead_code)]
    output_config: Option<Value>,
    /// Accepted and ignored (the server reaches no MCP server).
    #[allow(dead_code)]
    mcp_servers: Option<Value>,
}

/// The block types each role's content may not hold (`convert::anthropic`): audio nowhere,
/// images and tool results only in a user's turn, a call only in an assistant's.
const ASSISTANT_REFUSES: [&str; 4] = ["image", "audio", "input_audio", "tool_result"];
const USER_REFUSES: [&str; 3] = ["audio", "input_audio", "tool_use"];

crate::json_component!(
    /// A message as the document describes it (the handler reads the JSON itself, in
    /// `convert::anthropic`), by role: what each turn's blocks may be. Fields the server reads
    /// leniently (a thinking block's text, a call's id and input, a result's id) are free.
    AnthropicMessageIn [AnthropicUserBlock, AnthropicAssistantBlock, AnthropicSystem] => json!({
        "oneOf": [
            {"type": "object", "required": ["role", "content"], "properties": {
                "role": {"const": "user"},
                "content": {"oneOf": [{"type": "string"}, {"type": "array",
                    "items": {"$ref": "#/components/schemas/AnthropicUserBlock"}}]}}},
            {"type": "object", "required": ["role", "content"], "properties": {
                "role": {"const": "assistant"},
                "content": {"oneOf": [{"type": "string"}, {"type": "array",
                    "items": {"$ref": "#/components/schemas/AnthropicAssistantBlock"}}]}}},
            {"type": "object", "required": ["role"], "properties": {
                "role": {"const": "system"},
                "content": {"oneOf": [{"type": "null"},
                    {"$ref": "#/components/schemas/AnthropicSystem"}]}}}
        ]
    })
);

crate::json_component!(
    /// A block of a user message: `text`, `image` (an inline base64 source), `tool_result`
    /// (its content a string or blocks, whose images are read too), or a block of another type,
    /// which is ignored; audio and `tool_use` are refused.
    AnthropicUserBlock [AnthropicImageBlock] => json!({
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"type": "string", "not": {"enum": USER_REFUSES}}},
        "allOf": [
            {"if": {"properties": {"type": {"const": "text"}}},
             "then": {"required": ["text"], "properties": {"text": {"type": "string"}}}},
            {"if": {"properties": {"type": {"const": "image"}}},
             "then": {"$ref": "#/components/schemas/AnthropicImageBlock"}},
            {"if": {"properties": {"type": {"const": "tool_result"}}},
             "then": {"properties": {"content": {"oneOf": [
                {"type": "null"},
                {"type": "string"},
                {"type": "array", "items": {
                    "if": {"type": "object", "required": ["type"],
                           "properties": {"type": {"const": "image"}}},
                    "then": {"$ref": "#/components/schemas/AnthropicImageBlock"}}}
             ]}}}}
        ]
    })
);

crate::json_component!(
    /// A block of an assistant message: `text`, `thinking` (its text is the turn's reasoning),
    /// `tool_use` (a past call, by `name`), or a block of another type, which is ignored;
    /// images, audio and tool results are refused.
    AnthropicAssistantBlock [] => json!({
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"type": "string", "not": {"enum": ASSISTANT_REFUSES}}},
        "allOf": [
            {"if": {"properties": {"type": {"const": "text"}}},
             "then": {"required": ["text"], "properties": {"text": {"type": "string"}}}},
            {"if": {"properties": {"type": {"const": "tool_use"}}},
             "then": {"required": ["name"], "properties": {"name": {"type": "string"}}}}
        ]
    })
);

crate::json_component!(
    /// An inline image: `{"type": "image", "source": {"type": "base64", "media_type", "data"}}`
    /// (a `url` source is never fetched).
    AnthropicImageBlock [constraints::ImageRef] => json!({
        "type": "object",
        "required": ["source"],
        "properties": {"source": {
            "type": "object",
            "required": ["type", "data"],
            "properties": {
                "type": {"const": "base64"},
                "data": {"$ref": "#/components/schemas/ImageRef"}
            }
        }}
    })
);

crate::json_component!(
    /// A system prompt: a string or text blocks (a block of another type is ignored; one of
    /// type `text`, or of no string type, needs its `text`).
    AnthropicSystem [] => json!({
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {
                "type": "object",
                "anyOf": [
                    {"required": ["text"], "properties": {"text": {"type": "string"}}},
                    {"required": ["type"],
                     "properties": {"type": {"type": "string", "not": {"const": "text"}}}}
                ]
            }}
        ]
    })
);

crate::json_component!(
    /// A tool: a custom one (no `type`, or `custom`) needs a `name`; any other `type` is one of
    /// Anthropic's server tools, which are ignored.
    AnthropicToolIn [] => json!({
        "type": "object",
        "anyOf": [
            {"required": ["name"], "properties": {
                "type": {"enum": ["custom", null]},
                "name": {"type": "string"}}},
            {"required": ["type"], "properties": {"type": {"not": {"enum": ["custom", null]}}}}
        ]
    })
);

/// `POST /v1/messages`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct MessagesRequest {
    #[serde(flatten)]
    pub(crate) prompt: PromptFields,
    /// Tokens to generate at most (at least 1).
    #[serde(deserialize_with = "whole::required")]
    #[schema(value_type = constraints::MaxTokens)]
    max_tokens: usize,
    /// 0 is greedy. Default: the model's `generation_config.json`, else 1.
    #[serde(default, deserialize_with = "real::optional")]
    #[schema(value_type = Option<constraints::Temperature>)]
    temperature: Option<f32>,
    #[serde(default, deserialize_with = "real::optional")]
    #[schema(value_type = Option<constraints::TopP>)]
    top_p: Option<f32>,
    #[serde(default, deserialize_with = "whole::optional")]
    #[schema(value_type = Option<constraints::TopK>)]
    top_k: Option<i64>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    /// Accepted and ignored.
    #[allow(dead_code)]
    metadata: Option<Value>,
    /// Accepted and ignored (one tier here).
    #[allow(dead_code)]
    service_tier: Option<Value>,
    /// Accepted and ignored (no code-execution container here).
    #[allow(dead_code)]
    container: Option<Value>,
}

struct Prepared {
    entry: ModelEntry,
    prompt: Prompted,
}

pub(crate) struct Prompted {
    messages: Vec<Value>,
    images: convert::Images,
    options: TemplateOptions,
    /// The client's assistant prefill (a last assistant message of text).
    prefill: Option<String>,
    forced: Option<ForcedCall>,
    /// What the request sent that the server cannot use (logged by the routes).
    dropped: convert::Dropped,
}

impl PromptFields {
    /// `thinking.budget_tokens` of an enabled thinking (a positive integer; else none).
    fn budget_tokens(&self) -> Option<usize> {
        let thinking = self.thinking.as_ref()?;
        if thinking.get("type").and_then(Value::as_str) != Some("enabled") {
            return None;
        }
        let tokens = thinking.get("budget_tokens")?.as_u64()?;
        usize::try_from(tokens).ok().filter(|&tokens| tokens > 0)
    }
}

fn prepare(state: &AppState, fields: &PromptFields) -> Result<Prepared, ApiError> {
    let entry = state.registry.resolve(&fields.model)?;
    let prompt = convert_prompt(fields, &entry.id, state.config.keep_billing_header)?;
    prompt.dropped.log("/v1/messages");
    convert::check_vision(&entry.path, &entry.id, &prompt.images)?;
    Ok(Prepared { entry, prompt })
}

/// A request's prompt as the engine takes it, before any model is involved (`model_id` names
/// it in errors): what `prepare` does after resolving the model, and what the request fuzzer
/// drives. `keep_billing_header`: the server's `--keep-billing-header`.
pub(crate) fn convert_prompt(
    fields: &PromptFields,
    model_id: &str,
    keep_billing_header: bool,
) -> Result<Prompted, ApiError> {
    let mut dropped = convert::Dropped::default();
    let system =
        convert::anthropic_system(fields.system.as_ref(), keep_billing_header, &mut dropped)?;
    let (turns, prefill) = convert::anthropic_prefill(&fields.messages);
    if turns.is_empty() && prefill.is_some() {
        return Err(ApiError::BadRequest(
            "the conversation has no turn before the assistant's prefill (its last message, \
             text only)"
                .into(),
        ));
    }
    let (messages, images) = convert::anthropic_messages(system, turns, model_id, &mut dropped)?;
    if messages.is_empty() {
        // Only system messages with no text: nothing for a template to render.
        return Err(ApiError::BadRequest(
            "the conversation is empty: its messages hold no turn and no system text".into(),
        ));
    }
    let tools = convert::anthropic_tools(
        fields.tools.as_deref(),
        fields.tool_choice.as_ref(),
        &mut dropped,
    )?;
    let forced = ForcedCall::new(
        forced::anthropic_requires_call(fields.tool_choice.as_ref()),
        tools.as_ref(),
    )?;
    let enable_thinking = match fields
        .thinking
        .as_ref()
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
    {
        // Either asks for the family's thinking (an enabled one's budget: `budget_tokens`).
        Some("enabled" | "adaptive") => Some(true),
        Some("disabled") => Some(false),
        _ => None,
    };
    Ok(Prompted {
        messages,
        images,
        prefill,
        forced,
        dropped,
        options: TemplateOptions {
            add_generation_prompt: true,
            enable_thinking,
            tools,
            ..TemplateOptions::default()
        },
    })
}

impl Prepared {
    /// Renders the prompt: whether the answer starts in reasoning, how the model writes calls,
    /// and the whole assistant prefill (the client's, then a forced call's opening).
    async fn prefill(&self, state: &AppState) -> Result<(PromptInfo, Option<String>), ApiError> {
        let prompt = &self.prompt;
        let before = prompt.prefill.as_deref().unwrap_or("");
        let info = inspect_prompt(
            state,
            &self.entry,
            &prompt.messages,
            &prompt.options,
            before,
        )
        .await?;
        let prefill = match &prompt.forced {
            Some(forced) => Some(forced.prefill(before, info.in_reasoning, info.tool_format)),
            None => prompt.prefill.clone(),
        };
        Ok((info, prefill))
    }
}

/// The tokens `POST /v1/messages` would prefill for the same fields.
#[utoipa::path(post, path = "/v1/messages/count_tokens", tag = "anthropic", request_body = PromptFields,
    responses((status = 200, description = "The count", body = TokenCount)))]
pub async fn count_tokens(
    State(state): State<AppState>,
    ApiJson(fields): ApiJson<PromptFields>,
) -> Result<Response, ApiError> {
    let prepared = prepare(&state, &fields)?;
    let (_, prefill) = prepared.prefill(&state).await?;
    let registry = state.registry.clone();
    let count = tokio::task::spawn_blocking(move || {
        let tokenizer = registry.tokenizer(&prepared.entry.path)?;
        let prefill = prefill.as_deref().unwrap_or("");
        let (_, ids) = tokenizer
            .encode_chat_prefilled(&prepared.prompt.messages, &prepared.prompt.options, prefill)
            .map_err(|error| ApiError::from(EngineError::Chat(error)))?;
        if prepared.prompt.images.is_empty() {
            return Ok(ids.len());
        }
        // Each image counts as its whole block, sized from the image alone (no resize).
        let model_type = convert::model_type(&prepared.entry.path);
        let placed = rmlx_engine::multimodal::place_images(
            &prepared.entry.path,
            &model_type,
            &tokenizer,
            ids,
            &prepared.prompt.images,
            None,
            false,
        )?;
        Ok::<_, ApiError>(placed.ids.len())
    })
    .await
    .map_err(|error| ApiError::Internal(error.to_string()))??;
    Ok(Json(TokenCount {
        input_tokens: count,
    })
    .into_response())
}

fn tool_use_block(call: &ToolCall) -> ContentBlock {
    ContentBlock::ToolUse {
        id: new_id("toolu_"),
        name: call.name.clone(),
        input: call.arguments.clone(),
    }
}

impl MessagesRequest {
    /// The request's sampling, else the model's recommendation (`generation_config.json`), else
    /// Anthropic's defaults (temperature 1, no top_p / top_k filtering).
    fn sampling(&self, model: &SamplingDefaults) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.or(model.temperature).unwrap_or(1.0),
            top_p: self.top_p.or(model.top_p).unwrap_or(1.0),
            top_k: match self.top_k {
                Some(top_k) => top_k.max(0) as usize,
                None => model.top_k.unwrap_or(0),
            },
            min_p: model.min_p.unwrap_or(0.0),
            repetition_penalty: model.repetition_penalty,
            ..SamplingParams::default()
        }
    }
}

/// An Anthropic Messages answer, whole or streamed (`stream: true`: `MessageStreamEvent`s).
#[utoipa::path(post, path = "/v1/messages", tag = "anthropic", request_body = MessagesRequest,
    responses((status = 200, description = "The message, or its stream of `MessageStreamEvent`s",
        content((Message = "application/json"), (sse::MessagesStreamEvent = "text/event-stream")))))]
pub async fn messages(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<MessagesRequest>,
) -> Result<Response, ApiError> {
    let prepared = prepare(&state, &request.prompt)?;
    let budget_tokens = request.prompt.budget_tokens();
    if request.max_tokens == 0 {
        return Err(ApiError::BadRequest("max_tokens must be at least 1".into()));
    }
    let mut params = GenerateParams {
        max_tokens: request.max_tokens,
        sampling: request.sampling(&state.registry.sampling_defaults(&prepared.entry.path)),
        stop: request.stop_sequences.clone().unwrap_or_default(),
        max_ctx: state.config.max_ctx,
        ..GenerateParams::default()
    };
    let (info, assistant_prefill) = prepared.prefill(&state).await?;
    let Prepared {
        entry,
        prompt:
            Prompted {
                messages,
                images,
                options,
                forced,
                ..
            },
    } = prepared;
    let parser = match &forced {
        Some(forced) => {
            params.response_format = forced.response_format(info.tool_format);
            forced.parser(info.tool_format)
        }
        None => {
            params.reasoning_budget = info.reasoning_budget(budget_tokens);
            OutputParser::for_tools(info.in_reasoning, info.tool_format, options.tools.as_ref())
        }
    };
    let id = new_id("msg_");
    let engine_request = Request {
        model: entry.path.clone(),
        prompt: Prompt::Chat { messages, options },
        assistant_prefill,
        images,
        params,
        request_id: Some(id.clone()),
        ..Request::default()
    };
    let stream = request.stream.unwrap_or(false);
    let generation = Generation::start(&state, &entry, engine_request, stream).await?;
    let message = Message {
        id,
        kind: MessageType::Message,
        role: AssistantRole::Assistant,
        model: entry.id,
        content: Vec::new(),
        stop_reason: None,
        stop_sequence: None,
        usage: AnthropicUsage {
            input_tokens: generation.prompt_tokens,
            output_tokens: 0,
            cache_creation_input_tokens: None,
            cache_read_input_tokens: None,
        },
        timings: None,
    };
    if stream {
        return Ok(sse::respond(MessageStream {
            generation,
            parser,
            message,
            started: false,
            open: None,
            next_index: 0,
            tool_calls: 0,
        }));
    }
    let completion = generation.complete().await?;
    let mut parsed = parser.parse(&completion.text);
    log_warnings(std::mem::take(&mut parsed.warnings));
    let mut content = Vec::new();
    if let Some(reasoning) = parsed.reasoning {
        content.push(ContentBlock::Thinking {
            thinking: reasoning,
            signature: String::new(),
        });
    }
    if !parsed.content.is_empty() || (parsed.tool_calls.is_empty() && content.is_empty()) {
        content.push(ContentBlock::Text {
            text: parsed.content,
        });
    }
    content.extend(parsed.tool_calls.iter().map(tool_use_block));
    let (reason, sequence) = StopReason::of(&completion, !parsed.tool_calls.is_empty());
    let body = Message {
        content,
        stop_reason: Some(reason),
        stop_sequence: sequence,
        usage: AnthropicUsage::of(&completion),
        timings: Some(Timings::of(&completion)),
        ..message
    };
    Ok(Json(body).into_response())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    Text,
    Thinking,
}

struct MessageStream {
    generation: Generation,
    parser: OutputParser,
    message: Message,
    started: bool,
    /// The open text/thinking block and its index.
    open: Option<(Block, usize)>,
    next_index: usize,
    tool_calls: usize,
}

/// An event of the stream, named by its `type`.
fn event(event: MessageStreamEvent) -> Event {
    sse::named(event.name(), &event)
}

impl MessageStream {
    /// Opens a block (closing the previous one); `ping` follows the first block's start, as
    /// Anthropic's own stream does.
    fn start_block(&mut self, block: ContentBlock, events: &mut Vec<Event>) -> usize {
        self.close_block(events);
        let index = self.next_index;
        self.next_index += 1;
        events.push(event(MessageStreamEvent::ContentBlockStart {
            index,
            content_block: block,
        }));
        if index == 0 {
            events.push(event(MessageStreamEvent::Ping));
        }
        index
    }

    fn close_block(&mut self, events: &mut Vec<Event>) {
        if let Some((_, index)) = self.open.take() {
            events.push(event(MessageStreamEvent::ContentBlockStop { index }));
        }
    }

    fn ensure(&mut self, kind: Block, events: &mut Vec<Event>) -> usize {
        match self.open {
            Some((open, index)) if open == kind => index,
            _ => {
                let block = match kind {
                    Block::Text => ContentBlock::Text {
                        text: String::new(),
                    },
                    Block::Thinking => ContentBlock::Thinking {
                        thinking: String::new(),
                        signature: String::new(),
                    },
                };
                let index = self.start_block(block, events);
                self.open = Some((kind, index));
                index
            }
        }
    }

    fn pieces(&mut self, pieces: Vec<Piece>, events: &mut Vec<Event>) {
        log_warnings(self.parser.take_warnings());
        for piece in pieces {
            let (index, delta) = match piece {
                Piece::Content(text) => (
                    self.ensure(Block::Text, events),
                    BlockDelta::TextDelta { text },
                ),
                Piece::Reasoning(thinking) => (
                    self.ensure(Block::Thinking, events),
                    BlockDelta::ThinkingDelta { thinking },
                ),
                Piece::ToolCall(call) => {
                    self.tool_calls += 1;
                    let mut block = tool_use_block(&call);
                    if let ContentBlock::ToolUse { input, .. } = &mut block {
                        *input = json!({});
                    }
                    let index = self.start_block(block, events);
                    let delta = BlockDelta::InputJsonDelta {
                        partial_json: call.arguments_json(),
                    };
                    events.push(event(MessageStreamEvent::ContentBlockDelta {
                        index,
                        delta,
                    }));
                    events.push(event(MessageStreamEvent::ContentBlockStop { index }));
                    continue;
                }
            };
            events.push(event(MessageStreamEvent::ContentBlockDelta {
                index,
                delta,
            }));
        }
    }
}

impl EventSource for MessageStream {
    async fn step(&mut self) -> Option<Vec<Event>> {
        // `message_start` carries the prompt's size: it waits until the engine took the
        // request (a queued request's stream sends SSE comments meanwhile).
        if !self.started && self.generation.is_started() {
            self.started = true;
            self.message.usage.input_tokens = self.generation.prompt_tokens;
            return Some(vec![event(MessageStreamEvent::MessageStart {
                message: self.message.clone(),
            })]);
        }
        let mut events = Vec::new();
        match self.generation.next().await? {
            Step::Started => {}
            Step::Idle if !self.started => events.push(sse::keep_alive()),
            Step::Idle => events.push(event(MessageStreamEvent::Ping)),
            Step::Delta { text, .. } => {
                let pieces = self.parser.push(&text);
                self.pieces(pieces, &mut events);
            }
            Step::Done(completion) => {
                let pieces = self.parser.finish();
                self.pieces(pieces, &mut events);
                if self.next_index == 0 {
                    self.ensure(Block::Text, &mut events);
                }
                self.close_block(&mut events);
                let (stop_reason, stop_sequence) = StopReason::of(&completion, self.tool_calls > 0);
                events.push(event(MessageStreamEvent::MessageDelta {
                    delta: MessageDeltaBody {
                        stop_reason,
                        stop_sequence,
                    },
                    usage: AnthropicUsage::of(&completion),
                }));
                events.push(event(MessageStreamEvent::MessageStop));
            }
            Step::Failed(error) => events.push(sse::named("error", &error.body(Api::Anthropic))),
        }
        Some(events)
    }
}

#[cfg(test)]
mod tests {
    use rmlx_engine::{engine::Event, generate::FinishReason, EngineError};

    use super::*;
    use crate::sse::testing::{delta, done, events, generation};

    /// Unset fields take the model's recommendation, set ones win, and with neither
    /// Anthropic's defaults stand.
    #[test]
    fn sampling_is_the_requests_else_the_models() {
        let qwen3 = SamplingDefaults {
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            ..SamplingDefaults::default()
        };
        let request = |fields: Value| -> MessagesRequest {
            let mut body = json!({"model": "m", "max_tokens": 4,
                                  "messages": [{"role": "user", "content": "hi"}]});
            for (key, value) in fields.as_object().unwrap() {
                body[key] = value.clone();
            }
            serde_json::from_value(body).unwrap()
        };
        let unset = request(json!({})).sampling(&qwen3);
        assert_eq!(
            (unset.temperature, unset.top_p, unset.top_k),
            (0.6, 0.95, 20)
        );
        let set = request(json!({"temperature": 1.0, "top_k": 0})).sampling(&qwen3);
        assert_eq!((set.temperature, set.top_p, set.top_k), (1.0, 0.95, 0));
        let neither = request(json!({})).sampling(&SamplingDefaults::default());
        assert_eq!(
            (neither.temperature, neither.top_p, neither.top_k),
            (1.0, 1.0, 0)
        );
    }

    fn stream(events: Vec<Event>, tools: bool) -> MessageStream {
        MessageStream {
            generation: generation(events),
            parser: OutputParser::new(false, tools),
            message: Message {
                id: "msg_test".into(),
                kind: MessageType::Message,
                role: AssistantRole::Assistant,
                model: "m".into(),
                content: Vec::new(),
                stop_reason: None,
                stop_sequence: None,
                usage: AnthropicUsage {
                    input_tokens: 3,
                    output_tokens: 0,
                    cache_creation_input_tokens: None,
                    cache_read_input_tokens: None,
                },
                timings: None,
            },
            started: false,
            open: None,
            next_index: 0,
            tool_calls: 0,
        }
    }

    fn fixture(name: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(name)
    }

    /// The fixtures of two template families: Qwen3's, and Qwen3.6's, which raises on a system
    /// message that is not first.
    const TEMPLATES: [&str; 2] = ["qwen3-tiny", "releases/qwen3.6-35b-a3b"];

    /// The prompt a request body renders to on a fixture's template (with the client's prefill).
    fn rendered(model: &str, body: &Value, generation_prompt: bool) -> String {
        rendered_with(model, body, generation_prompt, serde_json::Map::new())
    }

    fn rendered_with(
        model: &str,
        body: &Value,
        generation_prompt: bool,
        extra: serde_json::Map<String, Value>,
    ) -> String {
        let fields: PromptFields = serde_json::from_value(body.clone()).unwrap();
        let prompt = convert_prompt(&fields, "m", false).unwrap();
        let tokenizer = rmlx_engine::chat::ChatTokenizer::from_dir(&fixture(model)).unwrap();
        let options = TemplateOptions {
            add_generation_prompt: generation_prompt,
            extra,
            ..prompt.options
        };
        let text = tokenizer
            .render(&prompt.messages, &options)
            .unwrap_or_else(|error| panic!("{model}: {error}"));
        text + prompt.prefill.as_deref().unwrap_or("")
    }

    /// Claude Code's request at turn `turn` of one growing conversation: its billing header
    /// (with a `cch` that differs every request), system messages before the first user turn,
    /// after a user turn, after a tool result and before a user turn.
    fn claude_code_turn(turn: usize, cch: &str) -> Value {
        let mut messages = vec![
            json!({"role": "system", "content": [{"type": "text", "text": "MCP server instructions.",
                "cache_control": {"type": "ephemeral"}}]}),
            json!({"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\nContext.\n</system-reminder>"},
                {"type": "text", "text": "Read notes.txt", "cache_control": {"type": "ephemeral"}}]}),
            json!({"role": "system", "content": "The todo list is empty."}),
        ];
        let more = [
            vec![
                json!({"role": "assistant", "content": [{"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "notes.txt"}}]}),
                json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "nonce 42"}]}]}),
                json!({"role": "system", "content": [{"type": "text", "text": "Tokens left: 1000."}]}),
            ],
            vec![
                json!({"role": "assistant", "content": [{"type": "text", "text": "It says nonce 42."}]}),
                json!({"role": "system", "content": "Plan mode is on."}),
                json!({"role": "user", "content": "Thanks. Now read todo.txt"}),
            ],
            vec![
                json!({"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {"file_path": "todo.txt"}}]}),
                json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "empty"},
                    {"type": "text", "text": "Also say hi."}]}),
                json!({"role": "system", "content": "Tokens left: 900."}),
            ],
        ];
        messages.extend(more.into_iter().take(turn).flatten());
        json!({
            "model": "m", "max_tokens": 32000, "stream": true, "messages": messages,
            "system": [
                {"type": "text", "text": format!("x-anthropic-billing-header: cc_version=2.1.328.e1f; cc_entrypoint=cli; cch={cch};")},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "tools": [
                {"name": "Read", "description": "Reads a file", "input_schema": {"type": "object",
                    "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}},
                {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}],
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "metadata": {"user_id": "user_abc"},
        })
    }

    /// Each turn's prompt, up to its generation prompt, starts the next turn's prompt: nothing
    /// Claude Code sends moves the rendered prefix, so the prefix cache reuses all of it.
    /// (Qwen3.6's template itself rewrites the current tool loop's assistant turns once a new
    /// user query comes, unless `preserve_thinking`: that is set here, to test the conversion.)
    #[test]
    fn a_growing_claude_code_conversation_keeps_its_prefix() {
        let mut preserve = serde_json::Map::new();
        preserve.insert("preserve_thinking".into(), json!(true));
        for model in TEMPLATES {
            let turns: Vec<Value> = (0..4)
                .map(|turn| claude_code_turn(turn, &format!("{turn}a{turn}")))
                .collect();
            for pair in turns.windows(2) {
                let before = rendered_with(model, &pair[0], false, preserve.clone());
                let after = rendered_with(model, &pair[1], true, preserve.clone());
                assert!(
                    after.starts_with(&before),
                    "{model}:\n{before}\n---- is not a prefix of ----\n{after}"
                );
            }
            let last = rendered(model, &turns[3], true);
            // Every system message is in the prompt once, in place; the header is not.
            for text in [
                "MCP server instructions.",
                "The todo list is empty.",
                "Tokens left: 1000.",
                "Plan mode is on.",
                "Tokens left: 900.",
            ] {
                assert_eq!(last.matches(text).count(), 1, "{model}: {text}\n{last}");
            }
            assert!(!last.contains("billing"), "{model}");
            assert!(
                last.find("The todo list is empty.").unwrap() < last.find("Reading.").unwrap(),
                "{model}"
            );
        }
        // Qwen3's template takes the generation prompt back as the next assistant turn's start,
        // so there the whole prompt is the next one's prefix.
        for turn in 0..3 {
            let before = rendered("qwen3-tiny", &claude_code_turn(turn, "x"), true);
            let after = rendered("qwen3-tiny", &claude_code_turn(turn + 1, "y"), true);
            assert!(after.starts_with(&before), "turn {turn}");
        }
    }

    #[test]
    fn requests_that_differ_only_in_the_billing_header_render_the_same() {
        for model in TEMPLATES {
            assert_eq!(
                rendered(model, &claude_code_turn(1, "5e2a1"), true),
                rendered(model, &claude_code_turn(1, "9c0d7"), true),
                "{model}"
            );
        }
    }

    #[test]
    fn thinking_types_map_to_the_thinking_switch() {
        let with = |thinking: Value| {
            let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
            if !thinking.is_null() {
                body["thinking"] = thinking;
            }
            let fields: PromptFields = serde_json::from_value(body).unwrap();
            convert_prompt(&fields, "m", false)
                .unwrap()
                .options
                .enable_thinking
        };
        assert_eq!(
            with(json!({"type": "enabled", "budget_tokens": 1024})),
            Some(true)
        );
        assert_eq!(with(json!({"type": "adaptive"})), Some(true));
        assert_eq!(
            with(json!({"type": "adaptive", "display": "omitted"})),
            Some(true)
        );
        assert_eq!(with(json!({"type": "disabled"})), Some(false));
        assert_eq!(with(Value::Null), None);
        assert_eq!(with(json!({"type": "something-new"})), None);
        // On Qwen3.6, the switch decides whether the answer opens in reasoning.
        let qwen36 = |thinking: Value| {
            let body = json!({"model": "m", "thinking": thinking,
                "messages": [{"role": "user", "content": "hi"}]});
            rendered("releases/qwen3.6-35b-a3b", &body, true)
        };
        assert!(qwen36(json!({"type": "adaptive"})).ends_with("<think>\n"));
        assert!(qwen36(json!({"type": "disabled"})).ends_with("<think>\n\n</think>\n\n"));
    }

    fn names(events: &[(Option<String>, Value)]) -> Vec<String> {
        events
            .iter()
            .map(|(name, _)| name.clone().unwrap())
            .collect()
    }

    #[tokio::test]
    async fn failure_after_start_ends_with_an_error_event() {
        let failing = stream(
            vec![
                delta("Hi"),
                Event::Error(EngineError::Mlx("device lost".into())),
            ],
            false,
        );
        let events = events(sse::respond(failing)).await;
        assert_eq!(
            names(&events),
            [
                "message_start",
                "content_block_start",
                "ping",
                "content_block_delta",
                "error"
            ]
        );
        let error = &events[4].1;
        assert_eq!(error["type"], "error");
        assert_eq!(error["error"]["type"], "api_error");
    }

    #[tokio::test]
    async fn xml_tool_calls_become_tool_use_blocks() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                            "days": {"type": "integer"}}}}}]);
        let text = "\nplan\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>";
        let pieces = vec![
            delta(&text[..9]),
            delta(&text[9..50]),
            delta(&text[50..]),
            done(text, 9, FinishReason::Stop),
        ];
        let mut messages = stream(pieces, true);
        messages.parser =
            OutputParser::for_tools(true, crate::parse::ToolFormat::Xml, Some(&tools));
        let events = events(sse::respond(messages)).await;
        let starts: Vec<&Value> = events
            .iter()
            .filter(|(name, _)| name.as_deref() == Some("content_block_start"))
            .map(|(_, data)| &data["content_block"])
            .collect();
        assert_eq!(starts[0]["type"], "thinking");
        assert_eq!(starts[1]["type"], "tool_use");
        assert_eq!(starts[1]["name"], "get_weather");
        let input = events
            .iter()
            .find_map(|(_, data)| data["delta"]["partial_json"].as_str())
            .unwrap();
        assert_eq!(input, r#"{"city":"Paris","days":2}"#);
        let last = &events[events.len() - 2].1;
        assert_eq!(last["delta"]["stop_reason"], "tool_use");
    }

    #[tokio::test]
    async fn thinking_text_and_tool_use_blocks() {
        let text = "<think>\nplan\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let pieces = vec![
            delta(&text[..20]),
            delta(&text[20..60]),
            delta(&text[60..]),
            done(text, 9, FinishReason::Stop),
        ];
        let events = events(sse::respond(stream(pieces, true))).await;
        assert_eq!(
            names(&events),
            [
                "message_start",
                "content_block_start",
                "ping",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(events[1].1["content_block"]["type"], "thinking");
        assert_eq!(
            events[3].1["delta"],
            json!({"type": "thinking_delta", "thinking": "plan\n"})
        );
        assert_eq!(
            events[6].1["delta"],
            json!({"type": "text_delta", "text": "Let me check.\n"})
        );
        let tool = &events[8].1;
        assert_eq!(
            (tool["index"].clone(), tool["content_block"]["type"].clone()),
            (json!(2), json!("tool_use"))
        );
        assert_eq!(tool["content_block"]["name"], "get_weather");
        assert_eq!(
            events[9].1["delta"],
            json!({"type": "input_json_delta", "partial_json": "{\"city\":\"Paris\"}"})
        );
        assert_eq!(events[11].1["delta"]["stop_reason"], "tool_use");
        assert_eq!(events[11].1["usage"]["output_tokens"], 9);
    }
}
