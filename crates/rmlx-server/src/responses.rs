//! `POST /v1/responses`, OpenAI's Responses API, streamed and not, on the completion path chat
//! completions uses: the same template messages (`input`), function tools (`tools`), forced
//! calls and constrained decoding (`tool_choice`, `text.format`), output parser and engine
//! request, with the answer as Responses output items and events. What Codex sends is taken
//! as it sends it (namespace and freeform tools, reasoning carried in `encrypted_content`,
//! built-in tools dropped). Reference: OpenAI API reference (Responses: create, the response
//! object, streaming events); Codex CLI 0.169 (`codex-rs/codex-api`) for what an agent reads.

pub mod input;
pub mod output;
mod schema;
pub mod store;
pub mod types;

use std::sync::Arc;

use axum::{
    extract::State,
    http::StatusCode,
    response::{sse::Event, IntoResponse, Response},
    Json,
};
use rmlx_engine::{
    chat::TemplateOptions,
    constrain::{GrammarSyntax, ResponseFormat, ToolInputGrammar, TriggeredGrammar},
    engine::{Prompt, Request},
    generate::{Completion, FinishReason, GenerateParams},
    EngineError,
};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use utoipa::ToSchema;

use crate::{
    api::Timings,
    constraints,
    convert::{self, Dropped},
    error::{object, whole, Api, ApiError, ApiJson},
    forced::{self, ForcedCall},
    generation::{inspect_prompt, new_id, unix_now, Generation, Step},
    openai::Sampler,
    parse::{OutputParser, ToolFormat},
    sse::{self, EventSource},
    xml_calls, AppState,
};
use input::{CustomGrammar, ToolNames};
use output::{Options, Output};
use schema::{NullOnly, ResponseToolIn, ResponsesInput, TextFormatIn, ToolChoiceIn};
use store::Store;
use types::{
    IncompleteDetails, InputTokensDetails, OutputTokensDetails, ReasoningEcho, ResponseError,
    ResponseEventBody, ResponseObject, ResponseObjectType, ResponseStatus, ResponseStreamEvent,
    ResponseUsage, TextEcho,
};

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::BadRequest(message.into())
}

/// `POST /v1/responses`. Fields the server has no use for (`prompt_cache_key`,
/// `client_metadata`, `service_tier`, `truncation`, ...) are accepted and echoed or ignored;
/// unknown fields are ignored.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ResponsesRequest {
    /// A model id from `GET /v1/models`.
    #[schema(value_type = constraints::ModelId)]
    model: String,
    /// The conversation: a string (one user message) or input items. Items of a type the
    /// server cannot use are ignored (and logged).
    #[schema(value_type = Option<ResponsesInput>)]
    input: Option<Value>,
    /// The system prompt, before any leading `system` / `developer` messages of `input`.
    instructions: Option<String>,
    /// `function`, `custom` (freeform: one string argument) and `namespace` tools (flattened
    /// to `NAMESPACE__NAME` functions); built-in tools (`web_search`, `image_generation`, ...)
    /// are dropped (and logged).
    #[schema(value_type = Option<Vec<ResponseToolIn>>)]
    tools: Option<Vec<Value>>,
    /// `none`, `auto` (default), `required`, `{"type": "function" | "custom", "name"}` (a
    /// forced call) or `{"type": "allowed_tools", "mode", "tools"}`. A forced call needs a
    /// tool to call, and a named tool must be one of `tools`.
    #[schema(value_type = Option<ToolChoiceIn>)]
    tool_choice: Option<Value>,
    /// `false` keeps only the model's first call (default `true`).
    parallel_tool_calls: Option<bool>,
    /// Tokens to generate at most, reasoning included (default: the rest of the context).
    #[serde(default, deserialize_with = "whole::optional")]
    #[schema(value_type = Option<constraints::MaxTokens>)]
    max_output_tokens: Option<usize>,
    /// temperature, top_p (OpenAI's), and rMLX's extras as on chat completions (top_k,
    /// min_p, the penalties, seed, logit_bias).
    #[serde(flatten)]
    sampler: Sampler,
    /// `effort`: `none` or `minimal` turn the model's thinking off, `low`, `medium`, `high`
    /// (or `xhigh`) on; absent (or another value), the template's default. `summary` (`auto`,
    /// `concise`, `detailed`; not `none`): the reasoning text also comes as the item's summary,
    /// with the summary events.
    #[serde(default, deserialize_with = "object::optional")]
    reasoning: Option<ReasoningParam>,
    /// `format`: `text`, `json_object` or `json_schema` (enforced by constrained decoding).
    #[serde(default, deserialize_with = "object::optional")]
    text: Option<TextParam>,
    /// rMLX's extra: variables for the chat template, as on chat completions (e.g. Qwen3.6's
    /// `preserve_thinking: true`); `enable_thinking` here applies when `reasoning.effort` is
    /// not given.
    #[schema(value_type = Option<Object>)]
    chat_template_kwargs: Option<Map<String, Value>>,
    /// Keep the response for `previous_response_id` (default `true`; in memory, bounded).
    store: Option<bool>,
    /// A stored response (`resp_…`) whose conversation this one continues; one that is not
    /// stored is a 400 `previous_response_not_found`.
    previous_response_id: Option<String>,
    /// `reasoning.encrypted_content` puts the reasoning text in reasoning items'
    /// `encrypted_content` (not encrypted), so it comes back with the next turn.
    include: Option<Vec<String>>,
    stream: Option<bool>,
    prompt_cache_key: Option<String>,
    #[schema(value_type = Option<Object>)]
    metadata: Option<Map<String, Value>>,
    user: Option<String>,
    /// `disabled` (default) or `auto`: echoed; a prompt over the context fails either way.
    truncation: Option<String>,
    service_tier: Option<String>,
    /// Codex's per-request metadata (ignored).
    #[allow(dead_code)]
    #[schema(value_type = Option<Object>)]
    client_metadata: Option<Map<String, Value>>,
    /// Conversation objects are not kept: send the history in `input` or continue a stored
    /// response with `previous_response_id` (only null is taken).
    #[schema(value_type = Option<NullOnly>)]
    conversation: Option<Value>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct ReasoningParam {
    effort: Option<String>,
    summary: Option<String>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct TextParam {
    #[schema(value_type = Option<TextFormatIn>)]
    format: Option<Value>,
    verbosity: Option<String>,
}

impl ResponsesRequest {
    fn summary(&self) -> bool {
        let summary = self.reasoning.as_ref().and_then(|r| r.summary.as_deref());
        summary.is_some_and(|summary| summary != "none")
    }

    fn includes(&self, what: &str) -> bool {
        self.include.iter().flatten().any(|include| include == what)
    }

    /// The request's parameters as the response object echoes them, in progress and empty.
    fn head(&self, id: &str, model: &str) -> ResponseObject {
        let reasoning = self.reasoning.as_ref();
        let text = self.text.as_ref();
        ResponseObject {
            id: id.to_string(),
            object: ResponseObjectType::Response,
            created_at: unix_now(),
            status: ResponseStatus::InProgress,
            error: None,
            incomplete_details: None,
            instructions: self.instructions.clone().map(Value::String),
            max_output_tokens: self.max_output_tokens,
            model: model.to_string(),
            output: Vec::new(),
            parallel_tool_calls: self.parallel_tool_calls.unwrap_or(true),
            previous_response_id: self.previous_response_id.clone(),
            reasoning: ReasoningEcho {
                effort: reasoning.and_then(|r| r.effort.clone()),
                summary: reasoning.and_then(|r| r.summary.clone()),
            },
            store: self.store.unwrap_or(true),
            temperature: self.sampler.temperature.unwrap_or(1.0),
            text: TextEcho {
                format: text
                    .and_then(|t| t.format.clone())
                    .unwrap_or_else(|| json!({"type": "text"})),
                verbosity: text.and_then(|t| t.verbosity.clone()),
            },
            tool_choice: self.tool_choice.clone().unwrap_or_else(|| json!("auto")),
            tools: self.tools.clone().unwrap_or_default(),
            top_p: self.sampler.top_p.unwrap_or(1.0),
            truncation: self.truncation.clone().unwrap_or_else(|| "disabled".into()),
            usage: None,
            user: self.user.clone(),
            metadata: self.metadata.clone().unwrap_or_default(),
            prompt_cache_key: self.prompt_cache_key.clone(),
            service_tier: self
                .service_tier
                .clone()
                .unwrap_or_else(|| "default".into()),
            background: false,
            timings: None,
        }
    }
}

/// `reasoning.effort` as a reasoning budget, in tokens: `low` 1024, `medium` 4096 (after them
/// the family's end of thinking is written and the answer follows); `high` and `xhigh` none.
fn reasoning_budget(effort: Option<&str>) -> Option<usize> {
    match effort? {
        "low" => Some(1024),
        "medium" => Some(4096),
        _ => None,
    }
}

/// `reasoning.effort` as the template's thinking switch (None: the template's default).
fn thinking(effort: Option<&str>) -> Option<bool> {
    match effort? {
        "none" | "minimal" => Some(false),
        "low" | "medium" | "high" | "xhigh" => Some(true),
        _ => None,
    }
}

/// `text.format` as the engine's response format (chat's `response_format`, flattened).
fn response_format(format: Option<&Value>) -> Result<ResponseFormat, ApiError> {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(ResponseFormat::Text);
    };
    let invalid = |why: String| bad(format!("invalid `text.format`: {why}"));
    let chat = match format.get("type").and_then(Value::as_str) {
        Some("json_schema") => {
            let mut schema = format.clone();
            if let Some(fields) = schema.as_object_mut() {
                fields.remove("type");
            }
            json!({"type": "json_schema", "json_schema": schema})
        }
        _ => format.clone(),
    };
    serde_json::from_value(chat).map_err(|error| invalid(error.to_string()))
}

/// The freeform tools' grammars, each switched on when the model opens a call of its tool: in
/// the XML format the input is raw text after `<parameter=input>\n`; Qwen3's JSON format writes
/// it as a JSON string after `"arguments": {"input": `, held to the grammar's regex (a regex, or
/// a Lark grammar without recursion; a recursive one cannot be mapped into a JSON string's
/// escapes and is only shown to the model).
fn triggered_grammars(
    grammars: &[(String, CustomGrammar)],
    format: ToolFormat,
) -> Vec<TriggeredGrammar> {
    grammars
        .iter()
        .filter_map(|(name, grammar)| {
            let (trigger, syntax, definition, closing) = match format {
                ToolFormat::Xml => (
                    xml_calls::raw_input_opening(name),
                    grammar.syntax,
                    grammar.definition.clone(),
                    xml_calls::RAW_INPUT_CLOSING,
                ),
                ToolFormat::Json => (
                    json_input_opening(name),
                    GrammarSyntax::JsonString,
                    grammar.regex()?,
                    "}}",
                ),
            };
            Some(TriggeredGrammar {
                trigger,
                input: ToolInputGrammar {
                    tool: name.clone(),
                    syntax,
                    definition,
                    closing: closing.to_string(),
                },
            })
        })
        .collect()
}

/// A freeform tool's call in Qwen3's JSON format up to its input's JSON string, as the model
/// writes it (the template's `{"name": <function-name>, "arguments": <args-json-object>}`).
pub(crate) fn json_input_opening(name: &str) -> String {
    let name = serde_json::to_string(name).expect("a string serializes");
    format!("{{\"name\": {name}, \"arguments\": {{\"input\": ")
}

/// A request as the engine takes it, before any model is involved.
pub(crate) struct Prepared {
    messages: Vec<Value>,
    images: convert::Images,
    tools: Option<Value>,
    forced: Option<ForcedCall>,
    options: TemplateOptions,
    response_format: ResponseFormat,
    names: ToolNames,
    grammars: Vec<(String, CustomGrammar)>,
    /// The whole conversation as input items (a previous response's, then this input): what
    /// is stored for the next `previous_response_id`.
    items: Vec<Value>,
    ignored: Dropped,
}

/// Converts a request's fields, `previous` being the stored conversation it continues.
pub(crate) fn prepare(
    request: &ResponsesRequest,
    mut previous: Vec<Value>,
) -> Result<Prepared, ApiError> {
    if request.conversation.as_ref().is_some_and(|c| !c.is_null()) {
        return Err(bad(
            "`conversation` is not supported: send the history in `input` or continue a stored \
             response with `previous_response_id`",
        ));
    }
    if request.max_output_tokens == Some(0) {
        return Err(bad("max_output_tokens must be at least 1"));
    }
    match &request.input {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => {
            previous.push(json!({"type": "message", "role": "user", "content": text}))
        }
        Some(Value::Array(items)) => previous.extend(items.iter().cloned()),
        Some(_) => return Err(bad("`input` must be a string or an array of items")),
    }
    let mut ignored = Dropped::default();
    let instructions = request.instructions.clone().map(Value::String);
    let (messages, images) = input::messages(instructions.as_ref(), &previous, &mut ignored)?;
    let mut tools = input::tools(request.tools.as_deref(), &mut ignored)?;
    let choice = input::tool_choice(request.tool_choice.as_ref(), &mut tools, &mut ignored)?;
    let functions = convert::openai_tools(Some(&tools.functions), choice.as_ref())?;
    let forced = ForcedCall::new(
        forced::openai_requires_call(choice.as_ref()),
        functions.as_ref(),
    )?
    .map(|forced| forced.with_grammars(&tools.grammars));
    let mut extra = request.chat_template_kwargs.clone().unwrap_or_default();
    let kwarg_thinking = extra.remove("enable_thinking").and_then(|v| v.as_bool());
    let effort = request.reasoning.as_ref().and_then(|r| r.effort.as_deref());
    let options = TemplateOptions {
        add_generation_prompt: true,
        enable_thinking: thinking(effort).or(kwarg_thinking),
        tools: functions.clone(),
        extra,
    };
    Ok(Prepared {
        messages,
        images,
        tools: functions,
        forced,
        options,
        response_format: response_format(request.text.as_ref().and_then(|t| t.format.as_ref()))?,
        names: tools.names,
        grammars: tools.grammars,
        items: previous,
        ignored,
    })
}

/// OpenAI's answer for an unknown `previous_response_id`: a 400 with its own code.
fn previous_not_found(id: &str) -> Response {
    let error = bad(format!(
        "Previous response with id '{id}' not found: it was not stored (`store: false`), was \
         evicted from the in-memory store, or the server restarted; send the whole \
         conversation in `input` instead"
    ));
    let mut body = error.body(Api::OpenAi);
    body["error"]["code"] = json!("previous_response_not_found");
    body["error"]["param"] = json!("previous_response_id");
    let mut response = (StatusCode::BAD_REQUEST, Json(body)).into_response();
    // Counted as the server's own invalid request, as every other 400.
    response.extensions_mut().insert(error);
    response
}

/// A Responses answer, whole or streamed (`stream: true`: `ResponseStreamEvent`s, each named by
/// its `type`, always ending in `response.completed`, `response.incomplete` or
/// `response.failed`).
#[utoipa::path(post, path = "/v1/responses", tag = "openai", request_body = ResponsesRequest,
    responses((status = 200, description = "The response, or its stream of `ResponseStreamEvent`s",
        content((ResponseObject = "application/json"), (sse::ResponsesStreamEvent = "text/event-stream")))))]
pub async fn create(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let entry = state.registry.resolve(&request.model)?;
    let previous = match &request.previous_response_id {
        Some(id) => match state.responses.get(id) {
            Some(items) => items,
            None => return Ok(previous_not_found(id)),
        },
        None => Vec::new(),
    };
    let prepared = prepare(&request, previous)?;
    prepared.ignored.log("/v1/responses");
    convert::check_vision(&entry.path, &entry.id, &prepared.images)?;
    let max_tokens = request.max_output_tokens.unwrap_or_else(|| {
        // As chat completions: the rest of the context.
        state.registry.context_length(&entry).unwrap_or(4096)
    });
    let mut params = GenerateParams {
        max_tokens,
        sampling: request
            .sampler
            .params(&state.registry.sampling_defaults(&entry.path))?,
        max_ctx: state.config.max_ctx,
        response_format: prepared.response_format.clone(),
        ..GenerateParams::default()
    };
    let info = inspect_prompt(&state, &entry, &prepared.messages, &prepared.options, "").await?;
    // A forced call is all the answer holds: its grammar replaces any text.format.
    let (parser, assistant_prefill) = match &prepared.forced {
        Some(forced) => {
            params.response_format = forced.response_format(info.tool_format);
            let prefill = forced.prefill("", info.in_reasoning, info.tool_format);
            (forced.parser(info.tool_format), Some(prefill))
        }
        None => {
            params.tool_grammars = triggered_grammars(&prepared.grammars, info.tool_format);
            // A text.format answer closes the think block first: no reasoning to budget.
            let closed = info.close_for_format(&params.response_format);
            if closed.is_none() {
                let effort = request.reasoning.as_ref().and_then(|r| r.effort.as_deref());
                params.reasoning_budget = info.reasoning_budget(reasoning_budget(effort));
            }
            let in_reasoning = info.in_reasoning && closed.is_none();
            (
                OutputParser::for_tools(in_reasoning, info.tool_format, prepared.tools.as_ref()),
                closed,
            )
        }
    };
    let id = new_id("resp_");
    let mut head = request.head(&id, &entry.id);
    // The sampling it runs with: the request's, else the model's recommendation.
    head.temperature = params.sampling.temperature;
    head.top_p = params.sampling.top_p;
    let output = Output::new(
        parser,
        prepared.names,
        Options {
            summary: request.summary(),
            encrypted: request.includes("reasoning.encrypted_content"),
            parallel: request.parallel_tool_calls.unwrap_or(true),
        },
    );
    let stored = head
        .store
        .then(|| (state.responses.clone(), prepared.items));
    let engine_request = Request {
        model: entry.path.clone(),
        prompt: Prompt::Chat {
            messages: prepared.messages,
            options: prepared.options,
        },
        assistant_prefill,
        images: prepared.images,
        params,
        request_id: Some(id),
        ..Request::default()
    };
    let stream = request.stream.unwrap_or(false);
    let mut turn = Turn {
        generation: None,
        output,
        head,
        stored,
    };
    let started = Generation::start(&state, &entry, engine_request, stream).await;
    match started {
        Ok(generation) => turn.generation = Some(generation),
        // Over the context: Codex reads that from the stream's `response.failed`, as OpenAI
        // sends it; a whole response is the 400 every other route answers.
        Err(error) if stream && is_context_length(&error) => {
            return Ok(sse::respond(ResponseStream::new(turn, Some(error))))
        }
        Err(error) => return Err(error),
    }
    if stream {
        return Ok(sse::respond(ResponseStream::new(turn, None)));
    }
    let mut ignored_events = Vec::new();
    loop {
        match turn.next().await {
            Step::Started | Step::Idle => {}
            Step::Delta { text, .. } => turn.output.token(&text, &mut ignored_events),
            Step::Done(completion) => {
                let response = turn.finish(&completion, &mut ignored_events);
                return Ok(Json(response).into_response());
            }
            Step::Failed(error) => return Err(error),
        }
        ignored_events.clear();
    }
}

fn is_context_length(error: &ApiError) -> bool {
    error.body(Api::OpenAi)["error"]["code"] == "context_length_exceeded"
}

/// One response being generated: what both the whole answer and the stream are built from.
struct Turn {
    generation: Option<Generation>,
    output: Output,
    head: ResponseObject,
    /// Where to keep the conversation when `store` is on, and its input items.
    stored: Option<(Arc<Store>, Vec<Value>)>,
}

impl Turn {
    async fn next(&mut self) -> Step {
        let next = match self.generation.as_mut() {
            Some(generation) => generation.next().await,
            None => None,
        };
        next.unwrap_or_else(|| Step::Failed(EngineError::EngineStopped.into()))
    }

    /// The finished response (its last events into `events`), stored when asked.
    fn finish(
        &mut self,
        completion: &Completion,
        events: &mut Vec<ResponseEventBody>,
    ) -> ResponseObject {
        let cut = completion.finish_reason == FinishReason::Length;
        self.output.finish(cut, events);
        let mut response = self.head.clone();
        response.status = match cut {
            true => ResponseStatus::Incomplete,
            false => ResponseStatus::Completed,
        };
        response.incomplete_details = cut.then(|| IncompleteDetails {
            reason: "max_output_tokens".into(),
        });
        response.output = self.output.items.clone();
        response.usage = Some(ResponseUsage {
            input_tokens: completion.prompt_tokens,
            input_tokens_details: InputTokensDetails {
                cached_tokens: completion.cached_tokens,
            },
            output_tokens: completion.completion_tokens,
            output_tokens_details: OutputTokensDetails {
                reasoning_tokens: self
                    .output
                    .reasoning_tokens
                    .min(completion.completion_tokens),
            },
            total_tokens: completion.prompt_tokens + completion.completion_tokens,
        });
        response.timings = Some(Timings::of(completion));
        if let Some((store, mut items)) = self.stored.take() {
            items.extend(self.output.stored_items());
            store.put(&response.id, &items);
        }
        response
    }

    /// The response as it stands, failed for `error`.
    fn failed(&self, error: &ApiError) -> ResponseObject {
        let mut response = self.head.clone();
        response.status = ResponseStatus::Failed;
        response.output = self.output.items.clone();
        response.error = Some(ResponseError {
            code: error_code(error),
            message: error.to_string(),
        });
        response
    }
}

/// A failure's `error.code`: OpenAI's codes where the error has one (`context_length_exceeded`,
/// `rate_limit_exceeded`, ...), else `server_error` or `invalid_prompt`.
fn error_code(error: &ApiError) -> String {
    match error.body(Api::OpenAi)["error"]["code"].as_str() {
        Some("queue_full") => "rate_limit_exceeded".into(),
        Some(code) => code.into(),
        None if error.status().is_server_error() => "server_error".into(),
        None => "invalid_prompt".into(),
    }
}

struct ResponseStream {
    turn: Turn,
    /// A refusal decided before the first event (a prompt over the context).
    refused: Option<ApiError>,
    sequence: u64,
    started: bool,
    ended: bool,
}

impl ResponseStream {
    fn new(turn: Turn, refused: Option<ApiError>) -> Self {
        Self {
            turn,
            refused,
            sequence: 0,
            started: false,
            ended: false,
        }
    }

    fn events(&mut self, bodies: Vec<ResponseEventBody>) -> Vec<Event> {
        bodies
            .into_iter()
            .map(|body| {
                let event = ResponseStreamEvent {
                    sequence_number: self.sequence,
                    body,
                };
                self.sequence += 1;
                sse::named(event.body.name(), &event)
            })
            .collect()
    }
}

impl EventSource for ResponseStream {
    async fn step(&mut self) -> Option<Vec<Event>> {
        if self.ended {
            return None;
        }
        let mut bodies = Vec::new();
        if !self.started {
            self.started = true;
            let response = self.turn.head.clone();
            bodies.push(ResponseEventBody::Created {
                response: response.clone(),
            });
            bodies.push(ResponseEventBody::InProgress { response });
            if let Some(error) = self.refused.take() {
                let response = self.turn.failed(&error);
                bodies.push(ResponseEventBody::Failed { response });
                self.ended = true;
            }
            return Some(self.events(bodies));
        }
        match self.turn.next().await {
            Step::Started => {}
            // The response as it stands, again: still in progress.
            Step::Idle => bodies.push(ResponseEventBody::InProgress {
                response: self.turn.head.clone(),
            }),
            Step::Delta { text, .. } => self.turn.output.token(&text, &mut bodies),
            Step::Done(completion) => {
                let response = self.turn.finish(&completion, &mut bodies);
                bodies.push(match response.status {
                    ResponseStatus::Incomplete => ResponseEventBody::Incomplete { response },
                    _ => ResponseEventBody::Completed { response },
                });
                self.ended = true;
            }
            Step::Failed(error) => {
                let response = self.turn.failed(&error);
                bodies.push(ResponseEventBody::Failed { response });
                self.ended = true;
            }
        }
        Some(self.events(bodies))
    }
}

#[cfg(test)]
mod tests {
    use rmlx_engine::{engine::Event as EngineEvent, generate::FinishReason};

    use super::*;
    use crate::sse::testing::{delta, done, events, generation};

    /// A freeform tool's grammar switches on where Qwen3's template writes a past call's input
    /// (the JSON string after `json_input_opening`, closed by `}}`), in each Qwen3 release.
    #[test]
    fn a_json_input_opens_as_the_qwen3_templates_write_it() {
        let input = "*** Begin Patch\n*** Delete File: \"a\".txt\n*** End Patch";
        let written = format!(
            "{}{}}}}}",
            json_input_opening("apply_patch"),
            serde_json::to_string(input).unwrap()
        );
        for name in ["releases/qwen3-4b", "releases/qwen3-30b-a3b", "qwen3-tiny"] {
            let text = crate::xml_calls::rendered_apply_patch_call(name, input);
            assert!(text.contains(&written), "{name}: {text}");
        }
    }

    fn turn(engine_events: Vec<EngineEvent>) -> Turn {
        let request: ResponsesRequest =
            serde_json::from_value(json!({"model": "m", "input": "hi"})).unwrap();
        Turn {
            generation: Some(generation(engine_events)),
            output: Output::new(
                OutputParser::new(false, false),
                ToolNames::default(),
                Options {
                    summary: false,
                    encrypted: false,
                    parallel: true,
                },
            ),
            head: request.head("resp_test", "m"),
            stored: None,
        }
    }

    fn names(events: &[(Option<String>, Value)]) -> Vec<&str> {
        events
            .iter()
            .map(|(name, _)| name.as_deref().unwrap())
            .collect()
    }

    #[tokio::test]
    async fn a_failure_after_the_start_ends_with_response_failed() {
        let failing = turn(vec![
            delta("Hel"),
            EngineEvent::Error(EngineError::Mlx("device lost".into())),
        ]);
        let events = events(sse::respond(ResponseStream::new(failing, None))).await;
        assert_eq!(
            names(&events),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.failed"
            ]
        );
        let failed = &events[5].1;
        assert_eq!(failed["sequence_number"], 5);
        assert_eq!(failed["response"]["status"], "failed");
        assert_eq!(failed["response"]["error"]["code"], "server_error");
        assert!(failed["response"]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("device lost"));
        // What was generated before the failure is kept, unfinished.
        assert_eq!(failed["response"]["output"][0]["content"][0]["text"], "Hel");
        assert_eq!(failed["response"]["output"][0]["status"], "in_progress");
    }

    #[tokio::test]
    async fn a_stream_whose_engine_goes_away_still_ends_with_a_final_event() {
        let gone = turn(vec![delta("Hi")]);
        let gone_events = events(sse::respond(ResponseStream::new(gone, None))).await;
        assert_eq!(names(&gone_events).last(), Some(&"response.failed"));
        let finished = turn(vec![delta("Hi"), done("Hi", 1, FinishReason::Stop)]);
        let events = events(sse::respond(ResponseStream::new(finished, None))).await;
        let last = &events.last().unwrap().1;
        assert_eq!(last["type"], "response.completed");
        assert_eq!(last["response"]["usage"]["output_tokens"], 1);
        assert_eq!(last["response"]["output"][0]["content"][0]["text"], "Hi");
    }
}
