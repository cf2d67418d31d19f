//! Prefill in chunks, then decode with MLX's async evaluation pipelined one step ahead, with
//! stop handling and per-request timings. Reference: mlx-lm `generate.py` (`generate_step`,
//! `stream_generate`).

use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Instant,
};

use mlx_rs::{ops::indexing::IndexOp, transforms, Array};

use crate::{
    cache::KvCache,
    chat::{ChatTokenizer, StopMatcher, StreamDecoder},
    constrain::{self, Constraint, ResponseFormat},
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
        model, tokenizer, prompt_ids, params, None, None, None, cancel, on_delta,
    )
    .map(|(completion, _)| completion)
}

/// `generate`, starting from a reused prefix's KV when given, and handing back the request's
/// caches with the tokens they hold (for the prefix cache). `constraint` enforces
/// `params.response_format` (from the model's cached `ConstraintFactory`); without one, a
/// non-text format builds its own.
#[allow(clippy::too_many_arguments)]
pub fn generate_reusing(
    model: &dyn LanguageModel,
    tokenizer: &ChatTokenizer,
    prompt_ids: &[u32],
    params: &GenerateParams,
    reuse: Option<Reuse>,
    constraint: Option<Constraint>,
    images: Option<ImagePrefill>,
    cancel: &AtomicBool,
    mut on_delta: impl FnMut(Delta),
) -> Result<(Completion, CachedSequence)> {
    let started = images
        .as_ref()
        .and_then(|images| images.started)
        .unwrap_or_else(Instant::now);
    let max_ctx = effective_context(model, params, prompt_ids.len())?;
    let mut sampler = Sampler::new(&params.sampling)?;
    let mut constraint = match constraint {
        Some(constraint) => Some(constraint),
        None => {
            constrain::one_off_constraint(tokenizer, model.vocab_size(), &params.response_format)?
        }
    };
    let (mut caches, cached_tokens) = match reuse {
        Some(reuse) if reuse.cached_tokens < prompt_ids.len() => {
            let mut caches = reuse.caches;
            caches
                .iter_mut()
                .for_each(|cache| cache.set_max_ctx(max_ctx));
            (caches, reuse.cached_tokens)
        }
        _ => (model.new_cache(max_ctx), 0),
    };
    let chunk = params.prefill_chunk.unwrap_or(DEFAULT_PREFILL_CHUNK).max(1);

    // Prefill all but the last prompt token, evaluating the cache between chunks so no single
    // graph grows with the prompt (the Metal watchdog kills command buffers past ~10 s).
    let (body, last) = prompt_ids.split_at(prompt_ids.len() - 1);
    if let Some(images) = &images {
        multimodal::prefill(
            images,
            prompt_ids,
            cached_tokens..body.len(),
            chunk,
            &mut caches,
        )?;
    }
    let text_body = if images.is_some() {
        0..0
    } else {
        cached_tokens..body.len()
    };
    // A recurrent state cannot be cut back to a shorter prefix, so it is snapshotted where a
    // later prompt is likely to diverge: before each message of the rendered prompt and at
    // the end of the prompt (turn N+1 of a chat re-renders everything after its last
    // unchanged message).
    let cuts = if model.rewindable() || text_body.is_empty() {
        Vec::new()
    } else {
        snapshot_points(
            prompt_ids,
            text_body.clone(),
            tokenizer.token_id(MESSAGE_START),
        )
    };
    let mut snapshots = Vec::new();
    for piece in split_at_cuts(text_body, chunk, &cuts) {
        if cancel.load(Ordering::Relaxed) {
            let sequence = CachedSequence::new(prompt_ids, &[], caches);
            return Ok((cancelled(prompt_ids, cached_tokens, started), sequence));
        }
        model.forward(
            &as_input(&prompt_ids[piece.clone()]),
            &mut caches,
            Logits::Last,
        )?;
        transforms::eval(caches.iter().flat_map(|cache| cache.state()))?;
        if cuts.contains(&piece.end) {
            snapshots.push(CachedSequence {
                tokens: prompt_ids[..piece.end].to_vec(),
                caches: caches.clone(),
                snapshots: Vec::new(),
            });
        }
    }

    let mut stop_ids: Vec<u32> = params.stop_token_ids.clone();
    if !params.ignore_eos {
        stop_ids.extend_from_slice(tokenizer.eos_token_ids());
    }
    let mut history: Vec<u32> = prompt_ids.to_vec();
    // `pending` is the token fed in, still lazy: penalties see it without a host round trip.
    if params.logprobs.is_some_and(|top| top > MAX_TOP_LOGPROBS) {
        return Err(EngineError::InvalidRequest(format!(
            "at most {MAX_TOP_LOGPROBS} top log-probs per token"
        )));
    }
    let step = |input: &Array,
                caches: &mut Vec<_>,
                sampler: &mut Sampler,
                history: &[u32],
                pending: Option<&Array>,
                constraint: Option<&mut Constraint>| {
        let logits = model.forward(input, caches, Logits::Last)?;
        let mut logits = logits.index((.., -1, ..));
        if let Some(constraint) = constraint {
            // Start the forward, and build the grammar's mask on the host meanwhile. Adding it
            // before the processors equals mlx-lm's order: they keep -inf at -inf and x + 0 = x.
            transforms::async_eval([&logits])?;
            logits = constraint.apply(&logits)?;
        }
        let (token, row) = sampler.sample_pending(&logits, history, pending)?;
        let logprobs = params
            .logprobs
            .map(|top| logprob_arrays(&row, &token, top))
            .transpose()?;
        Ok::<Step, EngineError>(Step { token, logprobs })
    };

    let mut decoder = StreamDecoder::new(tokenizer);
    let mut stops = StopMatcher::new(params.stop.clone());
    let mut text = String::new();
    let mut token_ids = Vec::new();
    let mut timings = Timings::default();
    let mut last_token_at = started;
    let mut finish_reason = FinishReason::Length;
    let mut stop_sequence = None;
    let mut document_complete = false;
    let max_new = params.max_tokens.min(max_ctx - prompt_ids.len() + 1);

    let mut logprobs = params.logprobs.map(|_| Vec::new());
    let mut next = step(
        &as_input(last),
        &mut caches,
        &mut sampler,
        &history,
        None,
        constraint.as_mut(),
    )?;
    transforms::async_eval(next.arrays())?;
    for index in 0..max_new {
        let current = next;
        // Queue step n+1 before reading token n, so the device never waits on the host. Not
        // when constrained: the next mask depends on token n.
        let upcoming = if index + 1 < max_new && constraint.is_none() {
            let input = current.token.reshape(&[1, 1])?;
            let upcoming = step(
                &input,
                &mut caches,
                &mut sampler,
                &history,
                Some(&current.token),
                None,
            )?;
            transforms::async_eval(upcoming.arrays())?;
            Some(upcoming)
        } else {
            None
        };
        let token = current.token.item_cast::<u32>();
        let now = Instant::now();
        if index == 0 {
            timings.ttft_ms = ms(now - started);
        } else {
            timings.itl_ms.push(ms(now - last_token_at));
        }
        last_token_at = now;
        token_ids.push(token);
        history.push(token);
        let logprob = match (&current.logprobs, params.logprobs) {
            (Some(arrays), Some(top)) => {
                transforms::eval(arrays.iter())?;
                Some(read_logprob(tokenizer, token, arrays, top))
            }
            _ => None,
        };
        if let (Some(all), Some(one)) = (logprobs.as_mut(), &logprob) {
            all.push(one.clone());
        }

        if stop_ids.contains(&token) {
            finish_reason = FinishReason::Stop;
            break;
        }
        if let Some(constraint) = constraint.as_mut() {
            constraint.consume(token)?;
        }
        let piece = decoder.push(token);
        let matched = stops.push(&piece);
        text.push_str(&matched.text);
        on_delta(Delta {
            token_id: token,
            text: matched.text,
            logprob,
            kv_bytes: caches.iter().map(|cache| cache.nbytes() as u64).sum(),
        });
        if matched.stopped {
            finish_reason = FinishReason::Stop;
            stop_sequence = matched.matched;
            break;
        }
        // A complete document: only EOS could follow, so stop without spending a step on it.
        if constraint.as_ref().is_some_and(Constraint::is_finished) {
            finish_reason = FinishReason::Stop;
            document_complete = true;
            break;
        }
        if cancel.load(Ordering::Relaxed) {
            finish_reason = FinishReason::Cancelled;
            break;
        }
        next = match upcoming {
            Some(upcoming) => upcoming,
            None if constraint.is_some() && index + 1 < max_new => {
                let input = current.token.reshape(&[1, 1])?;
                let next = step(
                    &input,
                    &mut caches,
                    &mut sampler,
                    &history,
                    None,
                    constraint.as_mut(),
                )?;
                transforms::async_eval(next.arrays())?;
                next
            }
            None => break,
        };
    }
    if finish_reason != FinishReason::Stop || document_complete {
        // Flush what the decoder and the stop matcher held back.
        let tail = stops.push(&decoder.finish());
        let mut rest = tail.text;
        if tail.stopped {
            finish_reason = FinishReason::Stop;
            stop_sequence = tail.matched;
        } else {
            rest.push_str(&stops.finish());
        }
        if !rest.is_empty() {
            text.push_str(&rest);
            on_delta(Delta {
                token_id: *token_ids.last().unwrap_or(&0),
                text: rest,
                logprob: None,
                kv_bytes: caches.iter().map(|cache| cache.nbytes() as u64).sum(),
            });
        }
    }

    let total = started.elapsed();
    timings.total_ms = ms(total);
    timings.prefill_tps = prompt_ids.len() as f64 / (timings.ttft_ms / 1000.0).max(1e-9);
    let decode_ms: f64 = timings.itl_ms.iter().sum();
    timings.decode_tps = if timings.itl_ms.is_empty() {
        0.0
    } else {
        timings.itl_ms.len() as f64 / (decode_ms / 1000.0).max(1e-9)
    };
    let mut sequence = CachedSequence::new(prompt_ids, &token_ids, caches);
    sequence.snapshots = snapshots;
    let completion = Completion {
        text,
        prompt_ids: prompt_ids.to_vec(),
        completion_tokens: token_ids.len(),
        token_ids,
        finish_reason,
        prompt_tokens: prompt_ids.len(),
        logprobs,
        stop_sequence,
        cached_tokens,
        timings,
    };
    Ok((completion, sequence))
}

/// The token each chat message of the rendered prompt starts with (Qwen's ChatML opener).
const MESSAGE_START: &str = "<|im_start|>";

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
