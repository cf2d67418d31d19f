//! Prefill in chunks, then decode with MLX's async evaluation pipelined one step ahead, with
//! stop handling and per-request timings. Reference: mlx-lm `generate.py` (`generate_step`,
//! `stream_generate`).

use std::{
    cell::OnceCell,
    rc::Rc,
    sync::atomic::{AtomicBool, Ordering},
    time::Instant,
};

use mlx_rs::{ops::indexing::IndexOp, Array};

use crate::{
    cache::{KvCache, KvStorage},
    chat::{ChatTokenizer, StopMatcher, StreamDecoder},
    constrain::{
        self, Constraint, Grammars, ReasoningBudget, ResponseFormat, ToolGrammars, TriggeredGrammar,
    },
    error::{EngineError, Result},
    models::{LanguageModel, Logits},
    multimodal::{self, ImagePrefill},
    prefix_cache::Reuse,
    sample::{Sampler, SamplingParams},
};

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

/// One decode step's lazy outputs: the token and, when asked, its log-prob arrays.
struct Step {
    token: Array,
    logprobs: Option<[Array; 3]>,
    /// Where the token was sampled with the rest of its batch: row `.1` of those tokens, read
    /// to the host once for every row.
    batch: Option<(Rc<BatchTokens>, usize)>,
}

/// One decode step's tokens for all rows of a batch (`[B]`, uint32), read to the host at most
/// once: one device read per step instead of one per row.
struct BatchTokens {
    tokens: Array,
    host: OnceCell<Vec<u32>>,
}

impl BatchTokens {
    fn get(&self, row: usize) -> Result<u32> {
        if self.host.get().is_none() {
            crate::runtime::eval([&self.tokens])?;
            let _ = self.host.set(self.tokens.as_slice::<u32>().to_vec());
        }
        Ok(self.host.get().expect("set above")[row])
    }
}

impl Step {
    fn arrays(&self) -> impl Iterator<Item = &Array> {
        std::iter::once(&self.token).chain(self.logprobs.iter().flatten())
    }
}

/// The chosen token's log-prob and the top-`n` (ids, values), all still on device.
fn logprob_arrays(row: &Array, token: &Array, top: usize) -> Result<[Array; 3]> {
    let row = row.reshape(&[-1])?;
    let chosen = row.take_axis(token.reshape(&[1])?, 0)?;
    let top = top.clamp(1, MAX_TOP_LOGPROBS).min(row.shape()[0] as usize) as i32;
    let ids =
        mlx_rs::ops::argpartition_axis(mlx_rs::ops::negative(&row)?, top - 1, 0)?.index(..top);
    let values = row.take_axis(&ids, 0)?;
    Ok([chosen, ids, values])
}

fn read_logprob(
    tokenizer: &ChatTokenizer,
    token_id: u32,
    arrays: &[Array; 3],
    top: usize,
) -> TokenLogprob {
    let piece = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
    let ids: Vec<u32> = arrays[1].as_slice::<u32>().to_vec();
    let values: Vec<f32> = arrays[2]
        .as_dtype(mlx_rs::Dtype::Float32)
        .map(|a| a.as_slice::<f32>().to_vec())
        .unwrap_or_default();
    let mut alternatives: Vec<TopLogprob> = ids
        .into_iter()
        .zip(values)
        .map(|(id, logprob)| TopLogprob {
            token_id: id,
            token: piece(id),
            logprob,
        })
        .collect();
    alternatives.sort_by(|a, b| b.logprob.total_cmp(&a.logprob));
    alternatives.truncate(top);
    TokenLogprob {
        token_id,
        token: piece(token_id),
        logprob: arrays[0]
            .as_dtype(mlx_rs::Dtype::Float32)
            .map(|a| a.item_cast::<f32>())
            .unwrap_or(f32::NAN),
        top: alternatives,
    }
}

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

fn as_input(ids: &[u32]) -> Array {
    let ids: Vec<i32> = ids.iter().map(|&id| id as i32).collect();
    Array::from_slice(&ids, &[1, ids.len() as i32])
}

/// Runs one request to completion on the calling thread (the engine thread).
pub fn generate(
    model: &dyn LanguageModel,
    tokenizer: &ChatTokenizer,
    prompt_ids: &[u32],
    params: &GenerateParams,
    cancel: &AtomicBool,
    on_delta: impl FnMut(Delta),
) -> Result<Completion> {
    generate_reusing(
        model,
        tokenizer,
        prompt_ids,
        params,
        None,
        Grammars::default(),
        None,
        cancel,
        on_delta,
    )
    .map(|(completion, _)| completion)
}

/// `generate`, starting from a reused prefix's KV when given, and handing back the request's
/// caches with the tokens they hold (for the prefix cache). `grammars` enforce
/// `params.response_format` and `params.tool_grammars` (from the model's cached
/// `ConstraintFactory`); left empty, they are built for this call. The engine runs the same
/// prefill and decode steps, with other requests' rows beside this one's.
#[allow(clippy::too_many_arguments)]
pub fn generate_reusing(
    model: &dyn LanguageModel,
    tokenizer: &ChatTokenizer,
    prompt_ids: &[u32],
    params: &GenerateParams,
    reuse: Option<Reuse>,
    grammars: Grammars,
    images: Option<ImagePrefill>,
    cancel: &AtomicBool,
    on_delta: impl FnMut(Delta),
) -> Result<(Completion, CachedSequence)> {
    let mut prefill = Prefill::new(model, tokenizer, prompt_ids, params, reuse, images)?;
    while !prefill.is_done() {
        if cancel.load(Ordering::Relaxed) {
            return Ok(prefill.cancelled());
        }
        prefill.step(model)?;
    }
    let (sequence, mut caches) = prefill.into_sequence(model, tokenizer, grammars)?;
    let mut row = Solo {
        sequence,
        cancel,
        on_delta,
    };
    while !row.sequence.is_finished() {
        decode_iteration(
            model,
            tokenizer,
            &mut caches,
            std::slice::from_mut(&mut row),
        )?;
    }
    let Solo {
        sequence,
        mut on_delta,
        ..
    } = row;
    Ok(sequence.finish(tokenizer, caches, &mut on_delta))
}

/// The one row of a request run alone.
struct Solo<'c, F> {
    sequence: Sequence,
    cancel: &'c AtomicBool,
    on_delta: F,
}

impl<F: FnMut(Delta)> DecodeRow for Solo<'_, F> {
    fn sequence(&mut self) -> &mut Sequence {
        &mut self.sequence
    }
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
    fn emit(&mut self, delta: Delta) {
        (self.on_delta)(delta)
    }
}

/// A prompt's prefill, one bounded piece at a time: the engine runs a piece of a new request
/// between decode steps of the running ones, so no stream waits longer than one piece.
pub struct Prefill {
    prompt_ids: Vec<u32>,
    params: GenerateParams,
    caches: Vec<KvCache>,
    cached_tokens: usize,
    max_ctx: usize,
    pieces: std::collections::VecDeque<std::ops::Range<usize>>,
    /// Prompt lengths whose recurrent state is snapshotted (empty for rewindable models).
    cuts: Vec<usize>,
    snapshots: Vec<CachedSequence>,
    images: Option<ImagePrefill>,
    started: Instant,
}

impl Prefill {
    /// Checks the request (context, log-prob count, image blocks) before any compute and
    /// plans the pieces: all prompt tokens but the last, from the reused prefix on.
    pub fn new(
        model: &dyn LanguageModel,
        tokenizer: &ChatTokenizer,
        prompt_ids: &[u32],
        params: &GenerateParams,
        reuse: Option<Reuse>,
        images: Option<ImagePrefill>,
    ) -> Result<Self> {
        let started = images
            .as_ref()
            .and_then(|images| images.started)
            .unwrap_or_else(Instant::now);
        let max_ctx = effective_context(model, params, prompt_ids.len())?;
        if params.logprobs.is_some_and(|top| top > MAX_TOP_LOGPROBS) {
            return Err(EngineError::InvalidRequest(format!(
                "at most {MAX_TOP_LOGPROBS} top log-probs per token"
            )));
        }
        let (caches, cached_tokens) = match reuse {
            Some(reuse) if reuse.cached_tokens < prompt_ids.len() => {
                let mut caches = reuse.caches;
                caches
                    .iter_mut()
                    .for_each(|cache| cache.set_max_ctx(max_ctx));
                (caches, reuse.cached_tokens)
            }
            _ => {
                let mut caches = model.new_cache(max_ctx);
                caches
                    .iter_mut()
                    .filter(|cache| !cache.is_windowed())
                    .for_each(|cache| cache.set_storage(params.kv_storage));
                (caches, 0)
            }
        };
        let chunk = params.prefill_chunk.unwrap_or(DEFAULT_PREFILL_CHUNK).max(1);
        // Each piece is one bounded graph, evaluated before the next (the Metal watchdog kills
        // command buffers past ~10 s).
        let body = cached_tokens..prompt_ids.len() - 1;
        let (pieces, cuts) = match &images {
            Some(images) => {
                if model.as_vision().is_none() {
                    return Err(EngineError::InvalidRequest(
                        "this model has no vision: send text only".into(),
                    ));
                }
                multimodal::check_blocks(images, body.clone())?;
                let pieces = multimodal::plan_chunks(body.clone(), chunk, &images.blocks);
                // Snapshots at message boundaries here too (see below); they fall between
                // image blocks, never inside one.
                let cuts = snapshot_cuts(model, tokenizer, prompt_ids, body);
                let pieces = pieces
                    .into_iter()
                    .flat_map(|piece| {
                        let len = piece.len();
                        split_at_cuts(piece, len, &cuts)
                    })
                    .collect::<Vec<_>>();
                (pieces, cuts)
            }
            None => {
                let cuts = snapshot_cuts(model, tokenizer, prompt_ids, body.clone());
                (split_at_cuts(body, chunk, &cuts), cuts)
            }
        };
        Ok(Self {
            prompt_ids: prompt_ids.to_vec(),
            params: params.clone(),
            caches,
            cached_tokens,
            max_ctx,
            pieces: pieces.into(),
            cuts,
            snapshots: Vec::new(),
            images,
            started,
        })
    }

    pub fn is_done(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Counts the request's time (TTFT, total) from `earlier`: a prefix read off the disk
    /// before this prefill was made is part of the wait for the first token.
    pub fn count_from(&mut self, earlier: Instant) {
        self.started = self.started.min(earlier);
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt_ids.len()
    }

    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    pub fn caches(&self) -> &[KvCache] {
        &self.caches
    }

    /// Prefills the next piece and evaluates the caches.
    pub fn step(&mut self, model: &dyn LanguageModel) -> Result<()> {
        let Some(piece) = self.pieces.pop_front() else {
            return Ok(());
        };
        match (&self.images, model.as_vision()) {
            (Some(images), Some(vision)) => multimodal::prefill_piece(
                vision,
                images,
                &self.prompt_ids,
                piece.clone(),
                &mut self.caches,
            )?,
            _ => {
                model.forward(
                    &as_input(&self.prompt_ids[piece.clone()]),
                    &mut self.caches,
                    Logits::Last,
                )?;
                crate::runtime::eval(self.caches.iter().flat_map(|cache| cache.state()))?;
            }
        }
        if self.cuts.contains(&piece.end) {
            self.snapshots.push(CachedSequence {
                tokens: self.prompt_ids[..piece.end].to_vec(),
                caches: self.caches.clone(),
                snapshots: Vec::new(),
            });
        }
        Ok(())
    }

    /// A request cancelled before its first token: what it had prefilled goes back.
    pub fn cancelled(self) -> (Completion, CachedSequence) {
        let sequence = CachedSequence::new(&self.prompt_ids, &[], self.caches);
        (
            cancelled(&self.prompt_ids, self.cached_tokens, self.started),
            sequence,
        )
    }

    /// The decode state and the caches of a fully prefilled prompt.
    pub fn into_sequence(
        self,
        model: &dyn LanguageModel,
        tokenizer: &ChatTokenizer,
        grammars: Grammars,
    ) -> Result<(Sequence, Vec<KvCache>)> {
        let params = self.params;
        let constraint = match grammars.format {
            Some(constraint) => Some(constraint),
            None => constrain::one_off_constraint(
                tokenizer,
                model.vocab_size(),
                &params.response_format,
            )?,
        };
        let tools = match grammars.tools.is_empty() {
            false => grammars.tools,
            true => constrain::one_off_tool_grammars(
                tokenizer,
                model.vocab_size(),
                &params.tool_grammars,
                params.reasoning_budget.as_ref(),
            )?,
        };
        let mut stop_ids: Vec<u32> = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_ids.extend_from_slice(tokenizer.eos_token_ids());
        }
        let last = *self
            .prompt_ids
            .last()
            .expect("checked: the prompt is not empty");
        let max_new = params
            .max_tokens
            .min(self.max_ctx - self.prompt_ids.len() + 1);
        let sequence = Sequence {
            sampler: Sampler::new(&params.sampling)?,
            constraint,
            tools,
            stop_ids,
            history: self.prompt_ids.clone(),
            decoder: StreamDecoder::new(tokenizer),
            stops: StopMatcher::new(params.stop.clone()),
            text: String::new(),
            token_ids: Vec::new(),
            logprobs: params.logprobs.map(|_| Vec::new()),
            timings: Timings::default(),
            started: self.started,
            last_token_at: self.started,
            max_new,
            context: self.max_ctx,
            prompt_ids: self.prompt_ids,
            cached_tokens: self.cached_tokens,
            snapshots: self.snapshots,
            queued: 0,
            unread: std::collections::VecDeque::new(),
            input: Array::from_slice(&[last as i32], &[1]),
            input_row: None,
            finish: (max_new == 0).then_some(FinishReason::Length),
            stop_sequence: None,
            document_complete: false,
            batched_with: 1,
            params,
        };
        Ok((sequence, self.caches))
    }
}

/// One request's decode state: its sampler, constraint, stop handling, text and timings.
pub struct Sequence {
    params: GenerateParams,
    sampler: Sampler,
    constraint: Option<Constraint>,
    /// Freeform tools' grammars, dormant until the model opens a call of one.
    tools: ToolGrammars,
    stop_ids: Vec<u32>,
    /// Prompt and read tokens: what penalties see (plus the newest token, still lazy).
    history: Vec<u32>,
    decoder: StreamDecoder,
    stops: StopMatcher,
    text: String,
    token_ids: Vec<u32>,
    logprobs: Option<Vec<TokenLogprob>>,
    timings: Timings,
    started: Instant,
    last_token_at: Instant,
    max_new: usize,
    context: usize,
    prompt_ids: Vec<u32>,
    cached_tokens: usize,
    snapshots: Vec<CachedSequence>,
    /// Steps built for this request (tokens sampled, read or not).
    queued: usize,
    /// Steps whose token the host has not read yet, oldest first (at most two).
    unread: std::collections::VecDeque<Step>,
    /// The token the next step feeds: the last prompt token, then each sampled one (lazy).
    input: Array,
    /// Set when `input` is row `.1` of a batch's tokens: a batch whose rows all still hold
    /// their own row of the same tokens feeds them as they are, without a concatenate.
    input_row: Option<(Rc<BatchTokens>, usize)>,
    finish: Option<FinishReason>,
    stop_sequence: Option<String>,
    document_complete: bool,
    /// The most rows that decoded together while this request did.
    batched_with: usize,
}

impl Sequence {
    pub fn is_finished(&self) -> bool {
        self.finish.is_some()
    }

    /// Whether another token should be sampled for this request.
    fn wants_step(&self) -> bool {
        self.finish.is_none() && self.queued < self.max_new
    }

    /// A constrained request's next mask depends on its last token: its steps cannot be
    /// queued ahead of reading.
    fn is_constrained(&self) -> bool {
        self.constraint.is_some() || self.tools.is_watching()
    }

    /// The request's effective context (its `max_ctx`).
    pub fn context(&self) -> usize {
        self.context
    }

    /// Samples this request's token from its row of the batch's logits (`[1, vocab]`).
    fn sample(&mut self, logits: &Array) -> Result<()> {
        let mut logits = logits.clone();
        if let Some(constraint) = self.constraint.as_mut().or(self.tools.active()) {
            // Start the forward, and build the grammar's mask on the host meanwhile. Adding it
            // before the processors equals mlx-lm's order: they keep -inf at -inf and x + 0 = x.
            crate::runtime::async_eval([&logits])?;
            logits = constraint.apply(&logits)?;
        }
        // The newest token is still lazy when this step was queued ahead of reading it.
        let pending = self.unread.back().map(|step| step.token.clone());
        let (token, row) = self
            .sampler
            .sample_pending(&logits, &self.history, pending.as_ref())?;
        let logprobs = self
            .params
            .logprobs
            .map(|top| logprob_arrays(&row, &token, top))
            .transpose()?;
        self.input = token.clone();
        self.input_row = None;
        self.queued += 1;
        self.unread.push_back(Step {
            token,
            logprobs,
            batch: None,
        });
        Ok(())
    }

    /// Whether this row's token is the argmax of its log-probs after at most a logit bias (see
    /// [`Sampler::is_batchable_greedy`]): such rows of a batch are sampled together.
    fn is_batchable_greedy(&self) -> bool {
        !self.is_constrained() && self.sampler.is_batchable_greedy()
    }

    /// Takes row `row` of a batch sampled together (`logprobs`: the batch's `[B, vocab]`).
    fn take_batched(
        &mut self,
        batch: &Rc<BatchTokens>,
        row: usize,
        logprobs: &Array,
    ) -> Result<()> {
        let token = batch.tokens.index(row as i32);
        let logprobs = self
            .params
            .logprobs
            .map(|top| logprob_arrays(&logprobs.index(row as i32), &token, top))
            .transpose()?;
        self.input = token.clone();
        self.input_row = Some((batch.clone(), row));
        self.queued += 1;
        self.unread.push_back(Step {
            token,
            logprobs,
            batch: Some((batch.clone(), row)),
        });
        Ok(())
    }

    /// Reads the oldest unread token and handles it: timings, log-probs, stops, the delta.
    fn read_one(
        &mut self,
        tokenizer: &ChatTokenizer,
        kv_bytes: u64,
        cancelled: bool,
        emit: &mut dyn FnMut(Delta),
    ) -> Result<()> {
        let Some(current) = self.unread.pop_front() else {
            return Ok(());
        };
        if self.finish.is_some() {
            return Ok(());
        }
        let token = match &current.batch {
            Some((batch, row)) => batch.get(*row)?,
            None => current.token.item_cast::<u32>(),
        };
        let now = Instant::now();
        if self.token_ids.is_empty() {
            self.timings.ttft_ms = ms(now - self.started);
        } else {
            self.timings.itl_ms.push(ms(now - self.last_token_at));
        }
        self.last_token_at = now;
        self.token_ids.push(token);
        self.history.push(token);
        let logprob = match (&current.logprobs, self.params.logprobs) {
            (Some(arrays), Some(top)) => {
                crate::runtime::eval(arrays.iter())?;
                Some(read_logprob(tokenizer, token, arrays, top))
            }
            _ => None,
        };
        if let (Some(all), Some(one)) = (self.logprobs.as_mut(), &logprob) {
            all.push(one.clone());
        }
        if self.stop_ids.contains(&token) {
            self.finish = Some(FinishReason::Stop);
            return Ok(());
        }
        if let Some(constraint) = self.constraint.as_mut() {
            constraint.consume(token)?;
        }
        let piece = self.decoder.push(token);
        self.tools.read(tokenizer, token, &piece);
        let matched = self.stops.push(&piece);
        self.text.push_str(&matched.text);
        emit(Delta {
            token_id: token,
            text: matched.text,
            logprob,
            kv_bytes,
        });
        if matched.stopped {
            self.finish = Some(FinishReason::Stop);
            self.stop_sequence = matched.matched;
        } else if self
            .constraint
            .as_ref()
            .is_some_and(Constraint::is_finished)
        {
            // A complete document: only EOS could follow, so stop without spending a step on it.
            self.finish = Some(FinishReason::Stop);
            self.document_complete = true;
        } else if cancelled {
            self.finish = Some(FinishReason::Cancelled);
        } else if self.token_ids.len() >= self.max_new {
            self.finish = Some(FinishReason::Length);
        }
        Ok(())
    }

    /// Ends the request: flushes held-back text, and hands back the completion and its own
    /// caches (one row, with the tokens they hold) for the prefix cache.
    pub fn finish(
        mut self,
        tokenizer: &ChatTokenizer,
        caches: Vec<KvCache>,
        emit: &mut dyn FnMut(Delta),
    ) -> (Completion, CachedSequence) {
        let _ = tokenizer;
        let mut finish_reason = self.finish.unwrap_or(FinishReason::Length);
        let mut stop_sequence = self.stop_sequence.take();
        let kv_bytes = caches.iter().map(|cache| cache.nbytes() as u64).sum();
        if finish_reason != FinishReason::Stop || self.document_complete {
            // Flush what the decoder and the stop matcher held back.
            let tail = self.stops.push(&self.decoder.finish());
            let mut rest = tail.text;
            if tail.stopped {
                finish_reason = FinishReason::Stop;
                stop_sequence = tail.matched;
            } else {
                rest.push_str(&self.stops.finish());
            }
            if !rest.is_empty() {
                self.text.push_str(&rest);
                emit(Delta {
                    token_id: *self.token_ids.last().unwrap_or(&0),
                    text: rest,
                    logprob: None,
                    kv_bytes,
                });
            }
        }
        let mut timings = self.timings;
        timings.total_ms = ms(self.started.elapsed());
        timings.prefill_tps = self.prompt_ids.len() as f64 / (timings.ttft_ms / 1000.0).max(1e-9);
        let decode_ms: f64 = timings.itl_ms.iter().sum();
        timings.decode_tps = if timings.itl_ms.is_empty() {
            0.0
        } else {
            timings.itl_ms.len() as f64 / (decode_ms / 1000.0).max(1e-9)
        };
        let mut sequence = CachedSequence::new(&self.prompt_ids, &self.token_ids, caches);
        sequence.snapshots = self.snapshots;
        let completion = Completion {
            text: self.text,
            prompt_tokens: self.prompt_ids.len(),
            prompt_ids: self.prompt_ids,
            completion_tokens: self.token_ids.len(),
            token_ids: self.token_ids,
            finish_reason,
            logprobs: self.logprobs,
            stop_sequence,
            cached_tokens: self.cached_tokens,
            batched_with: self.batched_with,
            timings,
        };
        (completion, sequence)
    }
}

/// A request decoding in a batch, as the decode loop sees it.
pub(crate) trait DecodeRow {
    fn sequence(&mut self) -> &mut Sequence;
    /// Whether the client gave up (checked after each token).
    fn cancelled(&self) -> bool;
    fn emit(&mut self, delta: Delta);
}

/// One step of a batch: `rows[b]` owns row `b` of `caches`. Every row feeds its next token
/// (one forward for all: the weights are read once for the batch); rows that need no more
/// tokens feed their last one and get nothing back. With no constrained row, each row's step
/// is queued before its previous token is read, so the device never waits on the host.
pub(crate) fn decode_iteration<R: DecodeRow>(
    model: &dyn LanguageModel,
    tokenizer: &ChatTokenizer,
    caches: &mut [KvCache],
    rows: &mut [R],
) -> Result<()> {
    let kv_bytes = |caches: &[KvCache], rows: usize| {
        caches
            .iter()
            .map(|cache| cache.nbytes() as u64)
            .sum::<u64>()
            / rows.max(1) as u64
    };
    let pipelined = !rows.iter_mut().any(|row| row.sequence().is_constrained());
    if !pipelined {
        let bytes = kv_bytes(caches, rows.len());
        for row in rows.iter_mut() {
            read_all(row, tokenizer, bytes, 0)?;
        }
    }
    let count = rows.len();
    let mut clock = crate::profile::StepClock::start();
    let mut fresh = vec![false; count];
    if rows.iter_mut().any(|row| row.sequence().wants_step()) {
        let input = batch_input(rows)?;
        let logits = model.forward(&input, caches, Logits::Last)?;
        let logits = logits.index((.., -1, ..));
        let mut queued = Vec::new();
        // Greedy rows with no processor but a logit bias are sampled in one op for the whole
        // batch (one bias add, one log-softmax, one argmax, one host read), not row by row.
        let together = if count > 1
            && rows
                .iter_mut()
                .all(|row| row.sequence().is_batchable_greedy())
        {
            let logits = with_bias_rows(&logits, rows)?;
            let logprobs = crate::sample::log_softmax(&logits)?;
            let batch = Rc::new(BatchTokens {
                tokens: crate::sample::greedy(&logprobs)?,
                host: OnceCell::new(),
            });
            queued.push(batch.tokens.clone());
            Some((batch, logprobs))
        } else {
            None
        };
        for (b, row) in rows.iter_mut().enumerate() {
            let sequence = row.sequence();
            sequence.batched_with = sequence.batched_with.max(count);
            if !sequence.wants_step() {
                if let Some((batch, _)) = &together {
                    // It feeds this row's argmax and gets nothing back (its KV past its end
                    // is never kept), so the next step's input stays one array.
                    sequence.input = batch.tokens.index(b as i32);
                    sequence.input_row = Some((batch.clone(), b));
                }
                continue;
            }
            match &together {
                Some((batch, logprobs)) => sequence.take_batched(batch, b, logprobs)?,
                None if count == 1 => sequence.sample(&logits)?,
                None => sequence.sample(&logits.index(b as i32..b as i32 + 1))?,
            }
            fresh[b] = true;
            queued.extend(
                sequence
                    .unread
                    .back()
                    .into_iter()
                    .flat_map(Step::arrays)
                    .cloned(),
            );
        }
        if let Some(clock) = clock.as_mut() {
            clock.built();
        }
        crate::runtime::async_eval(queued.iter())?;
        if let Some(clock) = clock.as_mut() {
            clock.submitted();
        }
    }
    let bytes = kv_bytes(caches, rows.len());
    for (row, fresh) in rows.iter_mut().zip(fresh) {
        read_all(row, tokenizer, bytes, fresh as usize)?;
    }
    if let Some(clock) = clock {
        clock.finish(count);
    }
    Ok(())
}

/// `logits` `[B, vocab]` plus each row's logit bias (one add; unchanged when no row has one).
fn with_bias_rows<R: DecodeRow>(logits: &Array, rows: &mut [R]) -> Result<Array> {
    let (vocab, dtype) = (logits.shape()[1] as usize, logits.dtype());
    let biases = rows
        .iter_mut()
        .map(|row| row.sequence().sampler.bias_row(vocab, dtype))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    if biases.iter().all(Option::is_none) {
        return Ok(logits.clone());
    }
    let zeros = mlx_rs::ops::zeros_dtype(&[1, vocab as i32], dtype)?;
    let rows: Vec<Array> = biases
        .into_iter()
        .map(|bias| bias.unwrap_or_else(|| zeros.clone()))
        .collect();
    Ok(mlx_rs::ops::add(
        logits,
        mlx_rs::ops::concatenate(&rows, 0)?,
    )?)
}

/// The `[B, 1]` input of a decode step: the rows' next tokens. When every row still holds its
/// own row of one batch's tokens (the batch neither grew nor shrank since), those tokens as
/// they are; otherwise one concatenate of the rows' inputs.
fn batch_input<R: DecodeRow>(rows: &mut [R]) -> Result<Array> {
    let count = rows.len();
    if count == 1 {
        return Ok(rows[0].sequence().input.reshape(&[1, 1])?);
    }
    let shared = rows[0]
        .sequence()
        .input_row
        .as_ref()
        .map(|(batch, _)| batch.clone());
    if let Some(batch) = shared.filter(|batch| batch.tokens.shape() == [count as i32]) {
        let aligned = rows.iter_mut().enumerate().all(|(b, row)| {
            row.sequence()
                .input_row
                .as_ref()
                .is_some_and(|(own, index)| Rc::ptr_eq(own, &batch) && *index == b)
        });
        if aligned {
            return Ok(batch.tokens.reshape(&[count as i32, 1])?);
        }
    }
    let inputs: Vec<Array> = rows
        .iter_mut()
        .map(|row| {
            row.sequence()
                .input
                .as_dtype(mlx_rs::Dtype::Int32)?
                .reshape(&[1, 1])
        })
        .collect::<std::result::Result<_, _>>()?;
    Ok(mlx_rs::ops::concatenate(&inputs, 0)?)
}

/// Reads `row`'s unread tokens until `keep` remain (or it finishes).
fn read_all<R: DecodeRow>(
    row: &mut R,
    tokenizer: &ChatTokenizer,
    kv_bytes: u64,
    keep: usize,
) -> Result<()> {
    while row.sequence().unread.len() > keep && !row.sequence().is_finished() {
        let cancelled = row.cancelled();
        let mut deltas = Vec::new();
        row.sequence()
            .read_one(tokenizer, kv_bytes, cancelled, &mut |delta| {
                deltas.push(delta)
            })?;
        deltas.into_iter().for_each(|delta| row.emit(delta));
    }
    Ok(())
}

/// Where a prefill snapshots its caches for the prefix cache. A recurrent state cannot be cut
/// back to a shorter prefix, so it is snapshotted where a later prompt is likely to diverge:
/// before each message of the rendered prompt and at the end of the prompt (turn N+1 of a chat
/// re-renders everything after its last unchanged message). A windowed model's caches can be
/// cut back only within their windows, which are large: it snapshots before the last message
/// and at the end. Models whose caches always cut back need none.
fn snapshot_cuts(
    model: &dyn LanguageModel,
    tokenizer: &ChatTokenizer,
    prompt: &[u32],
    body: std::ops::Range<usize>,
) -> Vec<usize> {
    if body.is_empty() || (model.rewindable() && !model.windowed()) {
        return Vec::new();
    }
    let mut cuts = snapshot_points(prompt, body, tokenizer.token_id(model.message_opener()));
    if model.rewindable() {
        let end = cuts.pop();
        cuts = cuts.pop().into_iter().chain(end).collect();
    }
    cuts
}

/// Prompt lengths to snapshot a recurrent model's state at, within `range` (the positions to
/// prefill): before every `message_start` token, and the end of the range.
pub(crate) fn snapshot_points(
    prompt: &[u32],
    range: std::ops::Range<usize>,
    message_start: Option<u32>,
) -> Vec<usize> {
    let mut cuts: Vec<usize> = (range.start + 1..range.end)
        .filter(|&at| Some(prompt[at]) == message_start)
        .collect();
    cuts.push(range.end);
    cuts
}

/// `range` in pieces of at most `chunk` positions that also end at every cut.
fn split_at_cuts(
    range: std::ops::Range<usize>,
    chunk: usize,
    cuts: &[usize],
) -> Vec<std::ops::Range<usize>> {
    let mut pieces = Vec::new();
    let mut start = range.start;
    while start < range.end {
        let mut end = (start + chunk.max(1)).min(range.end);
        if let Some(&cut) = cuts.iter().find(|&&cut| cut > start && cut < end) {
            end = cut;
        }
        pieces.push(start..end);
        start = end;
    }
    pieces
}

/// A request's caches and exactly the tokens they hold: the prompt and the generated tokens
/// that were fed back (the decode loop may have fed one more than it read out).
pub struct CachedSequence {
    pub tokens: Vec<u32>,
    pub caches: Vec<KvCache>,
    /// States of a recurrent model taken during prefill at message boundaries (each its own
    /// prefix of `tokens` with the caches as they were then); empty for attention-only models.
    pub snapshots: Vec<CachedSequence>,
}

impl CachedSequence {
    fn new(prompt: &[u32], generated: &[u32], caches: Vec<KvCache>) -> Self {
        let held = caches
            .first()
            .map_or(0, |cache| cache.offset().max(0) as usize);
        let tokens: Vec<u32> = prompt.iter().chain(generated).copied().take(held).collect();
        // A recurrent state holding a token without an id cannot be cut back: keep nothing.
        if !caches
            .iter()
            .all(|cache| cache.can_truncate_to(tokens.len() as i32))
        {
            return Self {
                tokens: Vec::new(),
                caches: Vec::new(),
                snapshots: Vec::new(),
            };
        }
        let mut caches = caches;
        // A fed token that was never read back has no id here: drop its position.
        caches
            .iter_mut()
            .for_each(|cache| cache.truncate(tokens.len() as i32));
        Self {
            tokens,
            caches,
            snapshots: Vec::new(),
        }
    }

    pub fn nbytes(&self) -> u64 {
        self.caches.iter().map(|cache| cache.nbytes() as u64).sum()
    }
}

fn one() -> usize {
    1
}

fn ms(duration: std::time::Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

fn cancelled(prompt_ids: &[u32], cached_tokens: usize, started: Instant) -> Completion {
    Completion {
        text: String::new(),
        prompt_ids: prompt_ids.to_vec(),
        token_ids: Vec::new(),
        finish_reason: FinishReason::Cancelled,
        prompt_tokens: prompt_ids.len(),
        completion_tokens: 0,
        logprobs: None,
        stop_sequence: None,
        cached_tokens,
        batched_with: 1,
        timings: Timings {
            total_ms: ms(started.elapsed()),
            ..Timings::default()
        },
    }
}

#[cfg(test)]
mod snapshot_tests {
    use super::*;

    #[test]
    fn pieces_end_at_every_message_boundary_and_stay_within_the_chunk() {
        // 7 = the message opener.
        let prompt = [7, 1, 2, 3, 7, 4, 5, 6, 7, 8, 9];
        let cuts = snapshot_points(&prompt, 0..10, Some(7));
        assert_eq!(cuts, vec![4, 8, 10]);
        assert_eq!(
            split_at_cuts(0..10, 3, &cuts),
            vec![0..3, 3..4, 4..7, 7..8, 8..10]
        );
        assert_eq!(split_at_cuts(0..10, 100, &cuts), vec![0..4, 4..8, 8..10]);
        // A reused prefix: only boundaries after it count.
        assert_eq!(snapshot_points(&prompt, 4..10, Some(7)), vec![8, 10]);
        assert_eq!(snapshot_points(&prompt, 0..10, None), vec![10]);
    }
}
