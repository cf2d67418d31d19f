//! `POST /v1/chat/completions` and `POST /v1/completions` in OpenAI's shapes (objects, chunks,
//! `data: [DONE]`, usage), plus rMLX's `timings`. Reference: OpenAI API reference (chat,
//! completions, streaming), mlx-lm `server.py`, llama.cpp server `timings`.

use std::collections::BTreeMap;

use axum::{
    extract::State,
    response::{sse::Event, IntoResponse, Response},
    Json,
};
use rmlx_engine::constrain::ResponseFormat;
use rmlx_engine::{
    chat::TemplateOptions,
    engine::{Prompt, Request},
    generate::{GenerateParams, TokenLogprob},
    sample::{SamplingDefaults, SamplingParams},
};
use serde::Deserialize;
use serde_json::{Map, Value};
use utoipa::ToSchema;

use crate::{
    api::{
        AssistantMessage, AssistantRole, ChatChoice, ChatChunkChoice, ChatChunkObject,
        ChatCompletion, ChatCompletionChunk, ChatCompletionObject, ChatDelta, ChatLogprobs,
        FunctionCall, FunctionType, LegacyLogprobs, OpenAiFinish, TextChoice, TextCompletion,
        TextCompletionObject, Timings, ToolCallOut, Usage,
    },
    constraints, convert,
    error::{object, real, whole, Api, ApiError, ApiJson},
    forced::{self, ForcedCall},
    generation::{inspect_prompt, new_id, unix_now, Generation, Step},
    logprobs,
    parse::{log_warnings, OutputParser, Piece, ToolCall},
    registry::ModelEntry,
    sse::{self, EventSource},
    AppState,
};

/// The sampler's fields, shared by chat, completions and Responses (OpenAI names; the extras
/// are vLLM/mlx-lm's), with the ranges the engine enforces.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct Sampler {
    /// 0 is greedy. Default: the model's `generation_config.json`, else 1.
    #[serde(default, deserialize_with = "real::optional")]
    #[schema(value_type = Option<constraints::Temperature>)]
    pub(crate) temperature: Option<f32>,
    /// Default: the model's `generation_config.json`, else 1 (off).
    #[serde(default, deserialize_with = "real::optional")]
    #[schema(value_type = Option<constraints::TopP>)]
    pub(crate) top_p: Option<f32>,
    /// 0 keeps every token. Default: the model's `generation_config.json`, else 0.
    #[serde(default, deserialize_with = "whole::optional")]
    #[schema(value_type = Option<constraints::TopK>)]
    top_k: Option<i64>,
    #[serde(default, deserialize_with = "real::optional")]
    #[schema(value_type = Option<constraints::MinP>)]
    min_p: Option<f32>,
    #[serde(default, deserialize_with = "real::optional")]
    #[schema(value_type = Option<constraints::Penalty>)]
    presence_penalty: Option<f32>,
    #[serde(default, deserialize_with = "real::optional")]
    #[schema(value_type = Option<constraints::Penalty>)]
    frequency_penalty: Option<f32>,
    #[serde(default, deserialize_with = "real::optional")]
    #[schema(value_type = Option<constraints::RepetitionPenalty>)]
    repetition_penalty: Option<f32>,
    #[serde(default, deserialize_with = "whole::optional")]
    #[schema(value_type = Option<constraints::Seed>)]
    seed: Option<i64>,
    /// Token id (as a string) to a bias added to its logit.
    #[serde(default, deserialize_with = "real::map")]
    #[schema(value_type = Option<constraints::LogitBias>)]
    logit_bias: Option<BTreeMap<String, f32>>,
}

impl Sampler {
    /// What the request sets, else what the model recommends (`generation_config.json`), else
    /// OpenAI's defaults (temperature 1, top_p 1, no top_k / min_p).
    pub(crate) fn params(&self, model: &SamplingDefaults) -> Result<SamplingParams, ApiError> {
        let logit_bias = constraints::logit_bias(self.logit_bias.as_ref())?;
        Ok(SamplingParams {
            temperature: self.temperature.or(model.temperature).unwrap_or(1.0),
            top_p: self.top_p.or(model.top_p).unwrap_or(1.0),
            top_k: match self.top_k {
                Some(top_k) => top_k.max(0) as usize,
                None => model.top_k.unwrap_or(0),
            },
            min_p: self.min_p.or(model.min_p).unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.or(model.repetition_penalty),
            seed: self.seed.map(|seed| seed as u64),
            logit_bias,
            ..SamplingParams::default()
        })
    }
}

/// Sampling fields shared by chat and completions: the sampler's, and how the answer ends and
/// streams.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct SamplingFields {
    #[serde(flatten)]
    sampler: Sampler,
    /// Strings that end the answer (not included in it).
    stop: Option<Stop>,
    /// Must be 1.
    #[serde(default, deserialize_with = "whole::optional")]
    #[schema(value_type = Option<constraints::ChoiceCount>)]
    n: Option<usize>,
    stream: Option<bool>,
    #[serde(default, deserialize_with = "object::optional")]
    stream_options: Option<StreamOptions>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Send a last chunk with the usage (and no choices) before `[DONE]`.
    #[serde(default)]
    include_usage: bool,
}

impl SamplingFields {
    fn check_unsupported(&self) -> Result<(), ApiError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::BadRequest(
                "n must be 1: this server generates one choice per request".into(),
            ));
        }
        Ok(())
    }

    fn stops(&self) -> Vec<String> {
        match &self.stop {
            None => Vec::new(),
            Some(Stop::One(stop)) => vec![stop.clone()],
            Some(Stop::Many(stops)) => stops.clone(),
        }
    }

    pub(crate) fn params(
        &self,
        model: &SamplingDefaults,
        max_ctx: Option<usize>,
        max_tokens: usize,
        logprobs: Option<usize>,
    ) -> Result<GenerateParams, ApiError> {
        self.check_unsupported()?;
        if max_tokens == 0 {
            return Err(ApiError::BadRequest("max_tokens must be at least 1".into()));
        }
        Ok(GenerateParams {
            max_tokens,
            sampling: self.sampler.params(model)?,
            stop: self.stops(),
            max_ctx,
            logprobs,
            ..GenerateParams::default()
        })
    }

    fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatRequest {
    /// A model id from `GET /v1/models`.
    #[schema(value_type = constraints::ModelId)]
    model: String,
    /// OpenAI's messages: `role` (`system`, `developer`, `user`, `assistant`, `tool`) and
    /// `content` (a string or a list of `text` and `image_url` parts; images inline as data
    /// URIs, never fetched), plus `tool_calls` / `tool_call_id` / `reasoning_content`.
    #[schema(value_type = Vec<ChatMessageIn>, min_items = 1)]
    messages: Vec<Value>,
    /// Tokens to generate at most (default: the rest of the context).
    #[serde(default, deserialize_with = "whole::optional")]
    #[schema(value_type = Option<constraints::MaxTokens>)]
    pub(crate) max_tokens: Option<usize>,
    /// Preferred over `max_tokens` when both are sent.
    #[serde(default, deserialize_with = "whole::optional")]
    #[schema(value_type = Option<constraints::MaxTokens>)]
    pub(crate) max_completion_tokens: Option<usize>,
    /// OpenAI function tools: `{"type": "function", "function": {name, description, parameters}}`.
    #[schema(value_type = Option<Vec<ChatToolIn>>)]
    tools: Option<Vec<Value>>,
    /// `none`, `auto`, `required`, or `{"type": "function", "function": {"name": ...}}` (a
    /// forced call: it needs `tools`, and the named function must be one of them); any other
    /// value is `auto`.
    tool_choice: Option<Value>,
    /// Turns the model's thinking on or off where its template has the switch.
    enable_thinking: Option<bool>,
    /// Extra variables for the chat template.
    #[schema(value_type = Option<Object>)]
    chat_template_kwargs: Option<Map<String, Value>>,
    /// `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
    /// {"schema": ...}}`: enforced by constrained decoding.
    #[schema(value_type = Option<ResponseFormatIn>)]
    response_format: Option<Value>,
    /// `true` for the chosen tokens' log-probs (`top_logprobs` for alternatives).
    #[schema(value_type = Option<bool>)]
    logprobs: Option<Value>,
    /// Alternatives per token, 0 to 20 (needs `logprobs: true`).
    #[schema(value_type = Option<u8>, minimum = 0, maximum = 20)]
    top_logprobs: Option<Value>,
    #[serde(flatten)]
    pub(crate) sampling: SamplingFields,
}

/// What `ChatRequest`'s schema adds across fields (utoipa's derive has no `if` / `then`):
/// `top_logprobs` needs `logprobs: true` (`logprobs::chat_request`).
pub(crate) fn chat_request_rules() -> Value {
    serde_json::json!({
        "if": {"required": ["top_logprobs"],
               "properties": {"top_logprobs": {"not": {"type": "null"}}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": true}}}
    })
}

fn tool_call(call: &ToolCall, index: Option<usize>) -> ToolCallOut {
    ToolCallOut {
        index,
        id: new_id("call_"),
        kind: FunctionType::Function,
        function: FunctionCall {
            name: call.name.clone(),
            arguments: call.arguments_json(),
        },
    }
}

/// The default `max_tokens`: what is left of the context (OpenAI chat generates to the end).
fn default_max_tokens(state: &AppState, entry: &ModelEntry) -> usize {
    state.registry.context_length(entry).unwrap_or(4096)
}

/// A chat request as the engine takes it, before any model is involved.
pub(crate) struct ChatParts {
    response_format: ResponseFormat,
    messages: Vec<Value>,
    images: convert::Images,
    tools: Option<Value>,
    forced: Option<ForcedCall>,
    options: TemplateOptions,
    logprobs: Option<usize>,
}

/// Converts a chat request's fields (`model_id` names the model in errors): everything the
/// handler does before it needs the model, and what the request fuzzer drives.
pub(crate) fn chat_parts(request: &ChatRequest, model_id: &str) -> Result<ChatParts, ApiError> {
    // Either field at 0 is refused, even beside the other one (the document bounds both).
    for (field, value) in [
        ("max_tokens", request.max_tokens),
        ("max_completion_tokens", request.max_completion_tokens),
    ] {
        if value == Some(0) {
            return Err(ApiError::BadRequest(format!("{field} must be at least 1")));
        }
    }
    // Enforced by constrained decoding in the engine; a schema it cannot compile is a 400.
    let response_format: ResponseFormat = match &request.response_format {
        None | Some(Value::Null) => ResponseFormat::Text,
        Some(format) => serde_json::from_value(format.clone())
            .map_err(|error| ApiError::BadRequest(format!("invalid response_format: {error}")))?,
    };
    let (messages, images) = convert::openai_messages(&request.messages, model_id)?;
    let tools = convert::openai_tools(request.tools.as_deref(), request.tool_choice.as_ref())?;
    let forced = ForcedCall::new(
        forced::openai_requires_call(request.tool_choice.as_ref()),
        tools.as_ref(),
    )?;
    let mut extra = request.chat_template_kwargs.clone().unwrap_or_default();
    let kwarg_thinking = extra.remove("enable_thinking").and_then(|v| v.as_bool());
    let options = TemplateOptions {
        add_generation_prompt: true,
        enable_thinking: request.enable_thinking.or(kwarg_thinking),
        tools: tools.clone(),
        extra,
        ..TemplateOptions::default()
    };
    let logprobs =
        logprobs::chat_request(request.logprobs.as_ref(), request.top_logprobs.as_ref())?;
    Ok(ChatParts {
        response_format,
        messages,
        images,
        tools,
        forced,
        options,
        logprobs,
    })
}

/// A chat answer, whole or streamed (`stream: true`: `ChatCompletionChunk` events, then
/// `data: [DONE]`; a failure after the start is an `OpenAiError` event).
#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai", request_body = ChatRequest,
    responses((status = 200, description = "The answer, or its stream of `ChatCompletionChunk`s",
        content((ChatCompletion = "application/json"), (sse::ChatStreamEvent = "text/event-stream")))))]
pub async fn chat_completions(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    let entry = state.registry.resolve(&request.model)?;
    let parts = chat_parts(&request, &entry.id)?;
    convert::check_vision(&entry.path, &entry.id, &parts.images)?;
    let max_tokens = request
        .max_completion_tokens
        .or(request.max_tokens)
        .unwrap_or_else(|| default_max_tokens(&state, &entry));
    let mut params = request.sampling.params(
        &state.registry.sampling_defaults(&entry.path),
        state.config.max_ctx,
        max_tokens,
        parts.logprobs,
    )?;
    params.response_format = parts.response_format;
    let info = inspect_prompt(&state, &entry, &parts.messages, &parts.options, "").await?;
    // A forced call is all the answer holds: its grammar replaces any response_format.
    let (parser, assistant_prefill) = match &parts.forced {
        Some(forced) => {
            params.response_format = forced.response_format(info.tool_format);
            let prefill = forced.prefill("", info.in_reasoning, info.tool_format);
            (forced.parser(info.tool_format), Some(prefill))
        }
        None => {
            let closed = info.close_for_format(&params.response_format);
            let in_reasoning = info.in_reasoning && closed.is_none();
            let tools = parts.tools.as_ref();
            (
                OutputParser::for_tools(in_reasoning, info.tool_format, tools),
                closed,
            )
        }
    };
    let (id, created) = (new_id("chatcmpl-"), unix_now());
    let engine_request = Request {
        model: entry.path.clone(),
        prompt: Prompt::Chat {
            messages: parts.messages,
            options: parts.options,
        },
        assistant_prefill,
        images: parts.images,
        params,
        request_id: Some(id.clone()),
        ..Request::default()
    };
    let stream = request.sampling.stream.unwrap_or(false);
    let generation = Generation::start(&state, &entry, engine_request, stream).await?;
    if stream {
        return Ok(sse::respond(ChatStream {
            generation,
            parser,
            head: ChunkHead {
                id,
                created,
                model: entry.id,
            },
            include_usage: request.sampling.include_usage(),
            started: false,
            tool_calls: 0,
            logprobs: logprobs::Pending::default(),
        }));
    }
    let completion = generation.complete().await?;
    let mut parsed = parser.parse(&completion.text);
    log_warnings(std::mem::take(&mut parsed.warnings));
    let has_calls = !parsed.tool_calls.is_empty();
    let message = AssistantMessage {
        role: AssistantRole::Assistant,
        content: (!has_calls || !parsed.content.is_empty()).then_some(parsed.content),
        reasoning_content: parsed.reasoning,
        tool_calls: has_calls.then(|| {
            parsed
                .tool_calls
                .iter()
                .map(|call| tool_call(call, None))
                .collect()
        }),
    };
    Ok(Json(ChatCompletion {
        id,
        object: ChatCompletionObject::ChatCompletion,
        created,
        model: entry.id,
        choices: vec![ChatChoice {
            index: 0,
            message,
            logprobs: completion.logprobs.as_deref().map(ChatLogprobs::of),
            finish_reason: OpenAiFinish::of(completion.finish_reason, has_calls),
        }],
        usage: Usage::of(&completion),
        timings: Timings::of(&completion),
    })
    .into_response())
}

/// What every chunk of one stream repeats.
struct ChunkHead {
    id: String,
    created: u64,
    model: String,
}

impl ChunkHead {
    fn chat(&self, choices: Vec<ChatChunkChoice>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: ChatChunkObject::ChatCompletionChunk,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: None,
            timings: None,
        }
    }

    fn text(&self, choices: Vec<TextChoice>) -> TextCompletion {
        TextCompletion {
            id: self.id.clone(),
            object: TextCompletionObject::TextCompletion,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: None,
            timings: None,
        }
    }
}

struct ChatStream {
    generation: Generation,
    parser: OutputParser,
    head: ChunkHead,
    include_usage: bool,
    started: bool,
    tool_calls: usize,
    logprobs: logprobs::Pending,
}

impl ChatStream {
    /// A chunk's choice, carrying the log-probs of the tokens since the last one (null when
    /// none).
    fn choice(&mut self, delta: ChatDelta, finish: Option<OpenAiFinish>) -> ChatChunkChoice {
        let waiting = self.logprobs.take();
        ChatChunkChoice {
            index: 0,
            delta,
            logprobs: (!waiting.is_empty()).then(|| ChatLogprobs::of(&waiting)),
            finish_reason: finish,
        }
    }

    fn chunk(&mut self, delta: ChatDelta) -> Event {
        let choice = self.choice(delta, None);
        sse::data(&self.head.chat(vec![choice]))
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<Event> {
        log_warnings(self.parser.take_warnings());
        pieces
            .into_iter()
            .map(|piece| match piece {
                Piece::Content(text) => self.chunk(ChatDelta {
                    content: Some(text),
                    ..ChatDelta::default()
                }),
                Piece::Reasoning(text) => self.chunk(ChatDelta {
                    reasoning_content: Some(text),
                    ..ChatDelta::default()
                }),
                Piece::ToolCall(call) => {
                    self.tool_calls += 1;
                    let call = tool_call(&call, Some(self.tool_calls - 1));
                    self.chunk(ChatDelta {
                        tool_calls: Some(vec![call]),
                        ..ChatDelta::default()
                    })
                }
            })
            .collect()
    }
}

impl EventSource for ChatStream {
    async fn step(&mut self) -> Option<Vec<Event>> {
        if !self.started {
            self.started = true;
            return Some(vec![self.chunk(ChatDelta {
                role: Some(AssistantRole::Assistant),
                content: Some(String::new()),
                ..ChatDelta::default()
            })]);
        }
        match self.generation.next().await? {
            Step::Started => Some(Vec::new()),
            // A chunk with nothing in it, not an SSE comment: clients' idle guards see only
            // the chunks their SDK yields (Qwen Code aborts after 240 s without one).
            Step::Idle => Some(vec![sse::data(&self.head.chat(vec![ChatChunkChoice {
                index: 0,
                delta: ChatDelta::default(),
                logprobs: None,
                finish_reason: None,
            }]))]),
            Step::Delta { text, logprob } => {
                self.logprobs.push(logprob);
                let pieces = self.parser.push(&text);
                Some(self.pieces(pieces))
            }
            Step::Done(completion) => {
                let pieces = self.parser.finish();
                let mut events = self.pieces(pieces);
                let rest = self.logprobs.finish(completion.logprobs.as_deref());
                let finish = OpenAiFinish::of(completion.finish_reason, self.tool_calls > 0);
                let mut last = self.head.chat(vec![ChatChunkChoice {
                    index: 0,
                    delta: ChatDelta::default(),
                    logprobs: (!rest.is_empty()).then(|| ChatLogprobs::of(&rest)),
                    finish_reason: Some(finish),
                }]);
                last.timings = Some(Timings::of(&completion));
                events.push(sse::data(&last));
                if self.include_usage {
                    let mut tail = self.head.chat(Vec::new());
                    tail.usage = Some(Usage::of(&completion));
                    events.push(sse::data(&tail));
                }
                events.push(Event::default().data("[DONE]"));
                Some(events)
            }
            Step::Failed(error) => Some(vec![sse::data(&error.body(Api::OpenAi))]),
        }
    }
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct CompletionRequest {
    /// A model id from `GET /v1/models`.
    #[schema(value_type = constraints::ModelId)]
    model: String,
    /// A string, a list of one string, or a list of token ids.
    #[schema(value_type = PromptField)]
    prompt: Value,
    /// Tokens to generate at most (default 16).
    #[serde(default, deserialize_with = "whole::optional")]
    #[schema(value_type = Option<constraints::MaxTokens>)]
    max_tokens: Option<usize>,
    /// How many alternatives per token to list with the chosen one, 0 to 20.
    #[schema(value_type = Option<u8>, minimum = 0, maximum = 20)]
    logprobs: Option<Value>,
    #[serde(flatten)]
    sampling: SamplingFields,
}

/// A chat message as the document describes it (the handler reads the JSON itself, in
/// `convert`): an assistant message may carry `tool_calls` (and `reasoning_content`), a tool
/// message its `tool_call_id`; other fields are ignored.
#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
enum ChatMessageIn {
    Assistant(AssistantMessageIn),
    Other(OtherMessageIn),
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct AssistantMessageIn {
    #[schema(value_type = String, pattern = "^assistant$")]
    role: String,
    /// Null or absent is empty.
    content: Option<ChatContent>,
    /// Past calls (`function.arguments` a JSON string, or the object itself).
    tool_calls: Option<Vec<ToolCallIn>>,
    /// Past reasoning (also read as `reasoning`); a value that is not a string is ignored.
    reasoning_content: Option<Value>,
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct OtherMessageIn {
    role: ChatRole,
    /// Null or absent is empty.
    content: Option<ChatContent>,
}

/// The roles besides `assistant` (`developer` is `system`, `function` is `tool`).
#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(rename_all = "lowercase")]
enum ChatRole {
    System,
    Developer,
    User,
    Tool,
    Function,
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct ToolCallIn {
    function: FunctionCallIn,
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct FunctionCallIn {
    name: String,
    /// A JSON object as a string (OpenAI's form), or the object.
    arguments: Option<Value>,
}

#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
enum ChatContent {
    Text(String),
    Parts(Vec<ChatContentPart>),
}

#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ChatContentPart {
    Text {
        text: String,
    },
    /// An image inline (`data:image/png;base64,...` or bare base64; never fetched).
    ImageUrl {
        image_url: ImageUrl,
    },
}

#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(untagged)]
enum ImageUrl {
    #[schema(value_type = constraints::ImageRef)]
    Url(String),
    Object {
        #[schema(value_type = constraints::ImageRef)]
        url: String,
    },
}

/// An OpenAI function tool (its `type` is not read).
#[derive(ToSchema)]
#[allow(dead_code)]
struct ChatToolIn {
    function: ChatFunctionIn,
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct ChatFunctionIn {
    name: String,
    description: Option<Value>,
    /// A JSON Schema of the arguments (absent: no arguments).
    parameters: Option<Value>,
}

/// `response_format` as the document describes it (the engine's `ResponseFormat` reads it).
#[derive(ToSchema)]
#[allow(dead_code)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ResponseFormatIn {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaIn },
}

#[derive(ToSchema)]
#[allow(dead_code)]
struct JsonSchemaIn {
    #[serde(default)]
    name: String,
    description: Option<String>,
    /// A JSON Schema the answer must follow (absent: any JSON value); one the constrained
    /// decoder cannot compile is refused (400).
    #[serde(default)]
    #[schema(value_type = constraints::SchemaDocument)]
    schema: Value,
    /// Refuse keywords that cannot be enforced instead of ignoring them.
    strict: Option<bool>,
}

/// The legacy `prompt`'s shapes: a string, a list of one string (neither empty), or token ids.
struct PromptField;

impl utoipa::PartialSchema for PromptField {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Type};
        let text = || {
            ObjectBuilder::new()
                .schema_type(Type::String)
                .min_length(Some(1))
        };
        OneOfBuilder::new()
            .item(text())
            .item(
                ArrayBuilder::new()
                    .items(text())
                    .min_items(Some(1))
                    .max_items(Some(1)),
            )
            .item(
                ArrayBuilder::new()
                    .items(utoipa::openapi::Ref::from_schema_name("TokenId"))
                    .min_items(Some(1)),
            )
            .description(Some(
                "A string, a list of one string, or a list of token ids (never empty).",
            ))
            .into()
    }
}

impl utoipa::ToSchema for PromptField {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        use utoipa::PartialSchema;
        schemas.push(("TokenId".into(), constraints::TokenId::schema()));
    }
}

/// A string, a one-string list, or token ids.
fn legacy_prompt(prompt: &Value) -> Result<Prompt, ApiError> {
    let bad = || {
        ApiError::BadRequest(
            "`prompt` must be a string, a list of one string, or a list of token ids".into(),
        )
    };
    match prompt {
        Value::String(text) => Ok(Prompt::Text(text.clone())),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => Ok(Prompt::Text(
            items[0].as_str().unwrap_or_default().to_string(),
        )),
        // Token ids: whole numbers (2.0 too, as JSON Schema's integers); one too large for a
        // token id lies past the vocabulary, as the engine says of one past the model's.
        Value::Array(items) if !items.is_empty() && items.iter().all(is_whole) => items
            .iter()
            .map(|id| {
                let wide = id
                    .as_u64()
                    .unwrap_or_else(|| id.as_f64().unwrap_or(0.0) as u64);
                u32::try_from(wide).map_err(|_| {
                    ApiError::BadRequest(format!("token id {id} is outside the vocabulary"))
                })
            })
            .collect::<Result<_, _>>()
            .map(Prompt::Ids),
        Value::Array(items) if items.len() > 1 && items.iter().all(Value::is_string) => Err(
            ApiError::BadRequest("only one prompt per request is supported".into()),
        ),
        _ => Err(bad()),
    }
}

/// A whole number of at least 0 (a token id, maybe past any vocabulary).
fn is_whole(value: &Value) -> bool {
    value.is_u64() || value.as_f64().is_some_and(|f| f >= 0.0 && f.fract() == 0.0)
}

/// A legacy completion request as the engine takes it, before any model is involved (what the
/// request fuzzer drives).
pub(crate) fn completion_parts(
    request: &CompletionRequest,
    model: &SamplingDefaults,
    max_ctx: Option<usize>,
) -> Result<(Prompt, GenerateParams), ApiError> {
    let prompt = legacy_prompt(&request.prompt)?;
    let logprobs = logprobs::legacy_request(request.logprobs.as_ref())?;
    // OpenAI's legacy default.
    let params =
        request
            .sampling
            .params(model, max_ctx, request.max_tokens.unwrap_or(16), logprobs)?;
    Ok((prompt, params))
}

/// A text completion, whole or streamed (`stream: true`: `TextCompletion` events, then
/// `data: [DONE]`).
#[utoipa::path(post, path = "/v1/completions", tag = "openai", request_body = CompletionRequest,
    responses((status = 200, description = "The completion, or its stream of `TextCompletion` chunks",
        content((TextCompletion = "application/json"), (sse::TextStreamEvent = "text/event-stream")))))]
pub async fn completions(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let entry = state.registry.resolve(&request.model)?;
    let model = state.registry.sampling_defaults(&entry.path);
    let (prompt, params) = completion_parts(&request, &model, state.config.max_ctx)?;
    let id = new_id("cmpl-");
    let engine_request = Request {
        model: entry.path.clone(),
        prompt,
        params,
        request_id: Some(id.clone()),
        ..Request::default()
    };
    let stream = request.sampling.stream.unwrap_or(false);
    let generation = Generation::start(&state, &entry, engine_request, stream).await?;
    let head = ChunkHead {
        id,
        created: unix_now(),
        model: entry.id,
    };
    if stream {
        return Ok(sse::respond(TextStream {
            generation,
            head,
            include_usage: request.sampling.include_usage(),
            logprobs: logprobs::Pending::default(),
            text_offset: 0,
        }));
    }
    let completion = generation.complete().await?;
    let mut body = head.text(vec![TextChoice {
        index: 0,
        logprobs: completion
            .logprobs
            .as_deref()
            .map(|entries| LegacyLogprobs::of(entries, &mut 0)),
        text: completion.text.clone(),
        finish_reason: Some(OpenAiFinish::of(completion.finish_reason, false)),
    }]);
    body.usage = Some(Usage::of(&completion));
    body.timings = Some(Timings::of(&completion));
    Ok(Json(body).into_response())
}

struct TextStream {
    generation: Generation,
    head: ChunkHead,
    include_usage: bool,
    logprobs: logprobs::Pending,
    /// Characters of generated text the sent log-probs cover (legacy `text_offset`).
    text_offset: usize,
}

impl TextStream {
    fn choice(
        &mut self,
        text: String,
        finish: Option<OpenAiFinish>,
        waiting: Vec<TokenLogprob>,
    ) -> TextChoice {
        let logprobs =
            (!waiting.is_empty()).then(|| LegacyLogprobs::of(&waiting, &mut self.text_offset));
        TextChoice {
            index: 0,
            text,
            logprobs,
            finish_reason: finish,
        }
    }
}

impl EventSource for TextStream {
    async fn step(&mut self) -> Option<Vec<Event>> {
        match self.generation.next().await? {
            Step::Started => Some(Vec::new()),
            // An empty piece of text, as chat's empty chunk (see `ChatStream`).
            Step::Idle => {
                let choice = self.choice(String::new(), None, Vec::new());
                Some(vec![sse::data(&self.head.text(vec![choice]))])
            }
            Step::Delta { text, logprob } => {
                self.logprobs.push(logprob);
                if text.is_empty() {
                    return Some(Vec::new());
                }
                let waiting = self.logprobs.take();
                let choice = self.choice(text, None, waiting);
                Some(vec![sse::data(&self.head.text(vec![choice]))])
            }
            Step::Done(completion) => {
                let rest = self.logprobs.finish(completion.logprobs.as_deref());
                let reason = OpenAiFinish::of(completion.finish_reason, false);
                let choice = self.choice(String::new(), Some(reason), rest);
                let mut last = self.head.text(vec![choice]);
                last.timings = Some(Timings::of(&completion));
                let mut events = vec![sse::data(&last)];
                if self.include_usage {
                    let mut tail = self.head.text(Vec::new());
                    tail.usage = Some(Usage::of(&completion));
                    events.push(sse::data(&tail));
                }
                events.push(Event::default().data("[DONE]"));
                Some(events)
            }
            Step::Failed(error) => Some(vec![sse::data(&error.body(Api::OpenAi))]),
        }
    }
}

#[cfg(test)]
mod tests {
    use rmlx_engine::{engine::Event, generate::FinishReason, EngineError};
    use serde_json::json;

    use super::*;
    use crate::sse::testing::{delta, done, events, generation};

    fn stream(events: Vec<Event>, tools: bool) -> ChatStream {
        ChatStream {
            generation: generation(events),
            parser: OutputParser::new(false, tools),
            head: ChunkHead {
                id: "chatcmpl-test".into(),
                created: 0,
                model: "m".into(),
            },
            include_usage: true,
            started: false,
            tool_calls: 0,
            logprobs: logprobs::Pending::default(),
        }
    }

    #[tokio::test]
    async fn xml_tool_calls_stream_as_typed_arguments_and_bad_ones_as_text() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                            "days": {"type": "integer"}}}}}]);
        let bad = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</function>\n</tool_call>";
        let text = format!("\nplan\n</think>\n\nChecking.\n\n{bad}\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>");
        let pieces: Vec<Event> = text
            .as_bytes()
            .chunks(7)
            .map(|chunk| delta(std::str::from_utf8(chunk).unwrap()))
            .chain([done(&text, 40, FinishReason::Stop)])
            .collect();
        let mut chat = stream(pieces, true);
        chat.parser = OutputParser::for_tools(true, crate::parse::ToolFormat::Xml, Some(&tools));
        let events = events(sse::respond(chat)).await;
        let collect = |key: &str| -> String {
            events
                .iter()
                .filter_map(|(_, d)| d["choices"][0]["delta"][key].as_str())
                .collect()
        };
        assert_eq!(collect("reasoning_content"), "plan\n");
        assert_eq!(collect("content"), format!("Checking.\n\n{bad}"));
        let calls: Vec<Value> = events
            .iter()
            .filter_map(|(_, d)| d["choices"][0]["delta"]["tool_calls"].get(0).cloned())
            .collect();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(
            calls[0]["function"]["arguments"],
            r#"{"city":"Paris","days":2}"#
        );
        let n = events.len();
        assert_eq!(events[n - 3].1["choices"][0]["finish_reason"], "tool_calls");
    }

    #[tokio::test]
    async fn failure_after_start_ends_with_an_error_chunk() {
        let failing = stream(
            vec![
                delta("Hel"),
                Event::Error(EngineError::Mlx("device lost".into())),
            ],
            false,
        );
        let events = events(sse::respond(failing)).await;
        assert_eq!(events[1].1["choices"][0]["delta"]["content"], "Hel");
        let last = &events.last().unwrap().1;
        assert_eq!(last["error"]["type"], "server_error");
        assert!(last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("device lost"));
        assert!(events.iter().all(|(_, data)| data != "[DONE]"));
    }

    #[tokio::test]
    async fn tool_calls_and_reasoning_stream_as_deltas() {
        let text = "<think>\nplan\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        // Split mid-tag, as tokens would.
        let pieces = vec![
            delta(&text[..5]),
            delta(&text[5..40]),
            delta(&text[40..]),
            done(text, 9, FinishReason::Stop),
        ];
        let events = events(sse::respond(stream(pieces, true))).await;
        let reasoning: String = events
            .iter()
            .filter_map(|(_, d)| d["choices"][0]["delta"]["reasoning_content"].as_str())
            .collect();
        assert_eq!(reasoning, "plan\n");
        let call = events
            .iter()
            .find_map(|(_, d)| d["choices"][0]["delta"]["tool_calls"].get(0).cloned())
            .unwrap();
        assert_eq!(call["index"], 0);
        assert_eq!(call["type"], "function");
        assert!(call["id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(call["function"]["name"], "get_weather");
        assert_eq!(call["function"]["arguments"], r#"{"city":"Paris"}"#);
        let n = events.len();
        assert_eq!(events[n - 3].1["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(events[n - 2].1["usage"]["completion_tokens"], 9);
        assert_eq!(events[n - 1].1, "[DONE]");
    }
}
