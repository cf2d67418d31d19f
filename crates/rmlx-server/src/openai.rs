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
    generate::{Completion, FinishReason, GenerateParams, TokenLogprob},
    sample::SamplingParams,
};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::{
    convert,
    error::{Api, ApiError, ApiJson},
    forced::{self, ForcedCall},
    generation::{inspect_prompt, new_id, unix_now, Generation, Step},
    logprobs,
    parse::{log_warnings, OutputParser, Piece, ToolCall},
    registry::ModelEntry,
    sse::{self, EventSource},
    AppState,
};

/// Sampling fields shared by both routes (OpenAI names; the extras are vLLM/mlx-lm's).
#[derive(Debug, Default, Deserialize)]
pub struct SamplingFields {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    seed: Option<i64>,
    logit_bias: Option<BTreeMap<String, f32>>,
    stop: Option<Stop>,
    n: Option<usize>,
    logprobs: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

impl SamplingFields {
    /// OpenAI's defaults (temperature 1, top_p 1) unless the request says otherwise.
    fn sampling(&self) -> Result<SamplingParams, ApiError> {
        let logit_bias = self
            .logit_bias
            .iter()
            .flatten()
            .map(|(id, bias)| {
                id.parse::<u32>().map(|id| (id, *bias)).map_err(|_| {
                    ApiError::BadRequest(format!("logit_bias key `{id}` is not a token id"))
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(0).max(0) as usize,
            min_p: self.min_p.unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty,
            seed: self.seed.map(|seed| seed as u64),
            logit_bias,
            ..SamplingParams::default()
        })
    }

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
            sampling: self.sampling()?,
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

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    model: String,
    messages: Vec<Value>,
    pub(crate) max_tokens: Option<usize>,
    pub(crate) max_completion_tokens: Option<usize>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    enable_thinking: Option<bool>,
    chat_template_kwargs: Option<Map<String, Value>>,
    response_format: Option<Value>,
    top_logprobs: Option<Value>,
    #[serde(flatten)]
    pub(crate) sampling: SamplingFields,
}

pub fn usage(completion: &Completion) -> Value {
    json!({
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        // Prompt tokens whose KV the engine's prefix cache supplied.
        "prompt_tokens_details": {"cached_tokens": completion.cached_tokens},
    })
}

pub fn timings(completion: &Completion) -> Value {
    let t = &completion.timings;
    json!({"ttft_ms": t.ttft_ms, "prefill_tps": t.prefill_tps, "decode_tps": t.decode_tps, "total_ms": t.total_ms,
           "batched_with": completion.batched_with})
}

fn finish_reason(reason: FinishReason, tool_calls: bool) -> &'static str {
    match reason {
        _ if tool_calls => "tool_calls",
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

fn tool_call_json(call: &ToolCall, index: usize) -> Value {
    json!({"index": index, "id": new_id("call_"), "type": "function",
           "function": {"name": call.name, "arguments": call.arguments_json()}})
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
    let logprobs = logprobs::chat_request(
        request.sampling.logprobs.as_ref(),
        request.top_logprobs.as_ref(),
    )?;
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
    let mut params = request
        .sampling
        .params(state.config.max_ctx, max_tokens, parts.logprobs)?;
    params.response_format = parts.response_format;
    let info = inspect_prompt(&state, &entry, &parts.messages, &parts.options, "").await?;
    // A forced call is all the answer holds: its grammar replaces any response_format.
    let (parser, assistant_prefill) = match &parts.forced {
        Some(forced) => {
            params.response_format = forced.response_format(info.tool_format);
            let prefill = forced.prefill("", info.in_reasoning, info.tool_format);
            (forced.parser(info.tool_format), Some(prefill))
        }
        None => (
            OutputParser::for_tools(info.in_reasoning, info.tool_format, parts.tools.as_ref()),
            None,
        ),
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
    let generation = Generation::start(&state, &entry, engine_request).await?;
    if request.sampling.stream.unwrap_or(false) {
        return Ok(sse::respond(ChatStream {
            generation,
            parser,
            head: json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": entry.id}),
            include_usage: request.sampling.include_usage(),
            started: false,
            tool_calls: 0,
            logprobs: logprobs::Pending::default(),
        }));
    }
    let completion = generation.complete().await?;
    let mut parsed = parser.parse(&completion.text);
    log_warnings(std::mem::take(&mut parsed.warnings));
    let mut message = json!({"role": "assistant", "content": parsed.content});
    if let Some(reasoning) = &parsed.reasoning {
        message["reasoning_content"] = json!(reasoning);
    }
    if !parsed.tool_calls.is_empty() {
        let calls: Vec<Value> = parsed
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut call = tool_call_json(c, i);
                call.as_object_mut().map(|o| o.remove("index"));
                call
            })
            .collect();
        message["tool_calls"] = json!(calls);
        if parsed.content.is_empty() {
            message["content"] = Value::Null;
        }
    }
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": entry.id,
        "choices": [{"index": 0, "message": message,
                     "logprobs": completion.logprobs.as_deref().map(logprobs::chat),
                     "finish_reason": finish_reason(completion.finish_reason, !parsed.tool_calls.is_empty())}],
        "usage": usage(&completion),
        "timings": timings(&completion),
    }))
    .into_response())
}

struct ChatStream {
    generation: Generation,
    parser: OutputParser,
    head: Value,
    include_usage: bool,
    started: bool,
    tool_calls: usize,
    logprobs: logprobs::Pending,
}

impl ChatStream {
    /// A chunk, carrying the log-probs of the tokens since the last one (null when none).
    fn chunk(&mut self, delta: Value, finish: Option<&str>) -> Event {
        let waiting = self.logprobs.take();
        let mut chunk = self.head.clone();
        chunk["choices"] = json!([{"index": 0, "delta": delta,
            "logprobs": (!waiting.is_empty()).then(|| logprobs::chat(&waiting)),
            "finish_reason": finish}]);
        sse::data(&chunk)
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<Event> {
        log_warnings(self.parser.take_warnings());
        pieces
            .into_iter()
            .map(|piece| match piece {
                Piece::Content(text) => self.chunk(json!({"content": text}), None),
                Piece::Reasoning(text) => self.chunk(json!({"reasoning_content": text}), None),
                Piece::ToolCall(call) => {
                    self.tool_calls += 1;
                    self.chunk(
                        json!({"tool_calls": [tool_call_json(&call, self.tool_calls - 1)]}),
                        None,
                    )
                }
            })
            .collect()
    }
}

impl EventSource for ChatStream {
    async fn step(&mut self) -> Option<Vec<Event>> {
        if !self.started {
            self.started = true;
            return Some(vec![
                self.chunk(json!({"role": "assistant", "content": ""}), None)
            ]);
        }
        match self.generation.next().await? {
            Step::Delta { text, logprob } => {
                self.logprobs.push(logprob);
                let pieces = self.parser.push(&text);
                Some(self.pieces(pieces))
            }
            Step::Done(completion) => {
                let pieces = self.parser.finish();
                let mut events = self.pieces(pieces);
                let rest = self.logprobs.finish(completion.logprobs.as_deref());
                let mut last = self.head.clone();
                last["choices"] = json!([{"index": 0, "delta": {},
                    "logprobs": (!rest.is_empty()).then(|| logprobs::chat(&rest)),
                    "finish_reason": finish_reason(completion.finish_reason, self.tool_calls > 0)}]);
                last["timings"] = timings(&completion);
                events.push(sse::data(&last));
                if self.include_usage {
                    let mut tail = self.head.clone();
                    tail["choices"] = json!([]);
                    tail["usage"] = usage(&completion);
                    events.push(sse::data(&tail));
                }
                events.push(Event::default().data("[DONE]"));
                Some(events)
            }
            Step::Failed(error) => Some(vec![sse::data(&error.body(Api::OpenAi))]),
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    model: String,
    prompt: Value,
    max_tokens: Option<usize>,
    #[serde(flatten)]
    sampling: SamplingFields,
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
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_u64) => {
            Ok(Prompt::Ids(
                items
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|id| id as u32)
                    .collect(),
            ))
        }
        Value::Array(items) if items.len() > 1 && items.iter().all(Value::is_string) => Err(
            ApiError::BadRequest("only one prompt per request is supported".into()),
        ),
        _ => Err(bad()),
    }
}

/// A legacy completion request as the engine takes it, before any model is involved (what the
/// request fuzzer drives).
pub(crate) fn completion_parts(
    request: &CompletionRequest,
    max_ctx: Option<usize>,
) -> Result<(Prompt, GenerateParams), ApiError> {
    let prompt = legacy_prompt(&request.prompt)?;
    let logprobs = logprobs::legacy_request(request.sampling.logprobs.as_ref())?;
    // OpenAI's legacy default.
    let params = request
        .sampling
        .params(max_ctx, request.max_tokens.unwrap_or(16), logprobs)?;
    Ok((prompt, params))
}

pub async fn completions(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let entry = state.registry.resolve(&request.model)?;
    let (prompt, params) = completion_parts(&request, state.config.max_ctx)?;
    let id = new_id("cmpl-");
    let engine_request = Request {
        model: entry.path.clone(),
        prompt,
        params,
        request_id: Some(id.clone()),
        ..Request::default()
    };
    let generation = Generation::start(&state, &entry, engine_request).await?;
    let head =
        json!({"id": id, "object": "text_completion", "created": unix_now(), "model": entry.id});
    if request.sampling.stream.unwrap_or(false) {
        return Ok(sse::respond(TextStream {
            generation,
            head,
            include_usage: request.sampling.include_usage(),
            logprobs: logprobs::Pending::default(),
            text_offset: 0,
        }));
    }
    let completion = generation.complete().await?;
    let mut body = head;
    let logprobs = completion
        .logprobs
        .as_deref()
        .map(|entries| logprobs::legacy(entries, &mut 0));
    body["choices"] = json!([{"index": 0, "text": completion.text, "logprobs": logprobs,
        "finish_reason": finish_reason(completion.finish_reason, false)}]);
    body["usage"] = usage(&completion);
    body["timings"] = timings(&completion);
    Ok(Json(body).into_response())
}

struct TextStream {
    generation: Generation,
    head: Value,
    include_usage: bool,
    logprobs: logprobs::Pending,
    /// Characters of generated text the sent log-probs cover (legacy `text_offset`).
    text_offset: usize,
}

impl TextStream {
    fn choices(&mut self, text: &str, finish: Option<&str>, waiting: Vec<TokenLogprob>) -> Value {
        let logprobs =
            (!waiting.is_empty()).then(|| logprobs::legacy(&waiting, &mut self.text_offset));
        json!([{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}])
    }
}

impl EventSource for TextStream {
    async fn step(&mut self) -> Option<Vec<Event>> {
        match self.generation.next().await? {
            Step::Delta { text, logprob } => {
                self.logprobs.push(logprob);
                if text.is_empty() {
                    return Some(Vec::new());
                }
                let waiting = self.logprobs.take();
                let mut chunk = self.head.clone();
                chunk["choices"] = self.choices(&text, None, waiting);
                Some(vec![sse::data(&chunk)])
            }
            Step::Done(completion) => {
                let rest = self.logprobs.finish(completion.logprobs.as_deref());
                let reason = finish_reason(completion.finish_reason, false);
                let mut last = self.head.clone();
                last["choices"] = self.choices("", Some(reason), rest);
                last["timings"] = timings(&completion);
                let mut events = vec![sse::data(&last)];
                if self.include_usage {
                    let mut tail = self.head.clone();
                    tail["choices"] = json!([]);
                    tail["usage"] = usage(&completion);
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

    use super::*;
    use crate::sse::testing::{delta, done, events, generation};

    fn stream(events: Vec<Event>, tools: bool) -> ChatStream {
        ChatStream {
            generation: generation(events),
            parser: OutputParser::new(false, tools),
            head: json!({"id": "chatcmpl-test", "object": "chat.completion.chunk"}),
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
