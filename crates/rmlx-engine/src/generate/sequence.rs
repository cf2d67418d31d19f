//! One request's decode state: sampling, reading tokens back, stops, log-probs, its end.

use std::{rc::Rc, time::Instant};

use mlx_rs::{ops::indexing::IndexOp, Array};

use crate::{
    cache::KvCache,
    chat::{ChatTokenizer, StopMatcher, StreamDecoder},
    constrain::{Constraint, ToolGrammars},
    error::Result,
    models::LanguageModel,
    sample::Sampler,
    speculative::{depth::DepthControl, Proposer},
};

use super::{
    batch::BatchTokens, ms, Completion, Delta, FinishReason, GenerateParams, Timings, TokenLogprob,
    TopLogprob, MAX_TOP_LOGPROBS,
};

/// One decode step's lazy outputs: the token and, when asked, its log-prob arrays.
pub(super) struct Step {
    token: Array,
    logprobs: Option<[Array; 3]>,
    /// Where the token was sampled with the rest of its batch: row `.1` of those tokens, read
    /// to the host once for every row.
    batch: Option<(Rc<BatchTokens>, usize)>,
}

impl Step {
    pub(super) fn arrays(&self) -> impl Iterator<Item = &Array> {
        std::iter::once(&self.token).chain(self.logprobs.iter().flatten())
    }
}

/// The chosen token's log-prob and the top-`n` (ids, values), all still on device.
pub(super) fn logprob_arrays(row: &Array, token: &Array, top: usize) -> Result<[Array; 3]> {
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
    // A token the grammar or a filter ruled out is no alternative (its id would be arbitrary
    // among the ties at -inf).
    alternatives.retain(|alternative| alternative.logprob.is_finite());
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

/// One request's decode state: its sampler, constraint, stop handling, text and timings.
pub struct Sequence {
    pub(super) params: GenerateParams,
    pub(super) sampler: Sampler,
    pub(super) constraint: Option<Constraint>,
    /// Freeform tools' grammars, dormant until the model opens a call of one.
    pub(super) tools: ToolGrammars,
    pub(super) stop_ids: Vec<u32>,
    /// Prompt and read tokens: what penalties see (plus the newest token, still lazy).
    pub(super) history: Vec<u32>,
    pub(super) decoder: StreamDecoder,
    pub(super) stops: StopMatcher,
    pub(super) text: String,
    pub(super) token_ids: Vec<u32>,
    pub(super) logprobs: Option<Vec<TokenLogprob>>,
    pub(super) timings: Timings,
    pub(super) started: Instant,
    pub(super) last_token_at: Instant,
    pub(super) max_new: usize,
    pub(super) context: usize,
    pub(super) prompt_ids: Vec<u32>,
    pub(super) cached_tokens: usize,
    pub(super) snapshots: Vec<CachedSequence>,
    /// Steps built for this request (tokens sampled, read or not).
    pub(super) queued: usize,
    /// Steps whose token the host has not read yet, oldest first (at most two).
    pub(super) unread: std::collections::VecDeque<Step>,
    /// The token the next step feeds: the last prompt token, then each sampled one (lazy).
    pub(super) input: Array,
    /// Set when `input` is row `.1` of a batch's tokens: a batch whose rows all still hold
    /// their own row of the same tokens feeds them as they are, without a concatenate.
    pub(super) input_row: Option<(Rc<BatchTokens>, usize)>,
    pub(super) finish: Option<FinishReason>,
    pub(super) stop_sequence: Option<String>,
    pub(super) document_complete: bool,
    /// The most rows that decoded together while this request did.
    pub(super) batched_with: usize,
    /// Drafts this request's next tokens (None: plain decode).
    pub(super) proposer: Option<Proposer>,
    /// How many to draft per step (`auto`); None drafts `max_draft` whenever it can.
    pub(super) depth: Option<DepthControl>,
    /// Draft tokens proposed and kept so far.
    pub(super) drafted: usize,
    pub(super) accepted: usize,
    /// The same per draft position.
    pub(super) drafted_at: Vec<usize>,
    pub(super) accepted_at: Vec<usize>,
    /// Hidden states the model's draft head has yet to take in (empty without a head).
    pub(super) head: super::head::Pending,
}

impl Sequence {
    pub fn is_finished(&self) -> bool {
        self.finish.is_some()
    }

    /// Whether another token should be sampled for this request.
    pub(super) fn wants_step(&self) -> bool {
        self.finish.is_none() && self.queued < self.max_new
    }

    /// A constrained request's next mask depends on its last token: its steps cannot be
    /// queued ahead of reading.
    pub(super) fn is_constrained(&self) -> bool {
        self.constraint.is_some() || self.tools.is_watching()
    }

    /// Tokens the answer may still take (at most: a stop ends it sooner).
    pub fn remaining(&self) -> usize {
        self.max_new.saturating_sub(self.token_ids.len())
    }

    /// The request's effective context (its `max_ctx`).
    pub fn context(&self) -> usize {
        self.context
    }

    /// Samples this request's token from its row of the batch's logits (`[1, vocab]`).
    pub(super) fn sample(&mut self, logits: &Array) -> Result<()> {
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
    pub(super) fn is_batchable_greedy(&self) -> bool {
        !self.is_constrained() && self.sampler.is_batchable_greedy()
    }

    /// Whether this row's token is drawn from its log-probs after at most a logit bias,
    /// greedy or sampled ([`Sampler::is_batchable`]): such rows of a batch draw together.
    pub(super) fn is_batchable(&self) -> bool {
        !self.is_constrained() && self.sampler.is_batchable()
    }

    /// Takes row `row` of a batch sampled together (`logprobs`: the batch's `[B, vocab]`).
    pub(super) fn take_batched(
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

    /// Whether this request may draft its next tokens: it has a proposer and wants two or
    /// more. Greedy, sampled, penalised and constrained rows all speculate (settle.rs), but
    /// not a row with custom-tool grammars or a reasoning budget (they switch on from the
    /// text read so far, so a draft could cross a trigger), and the draft head or draft model,
    /// whose drafts stay on the device, only for rows whose processing does not follow the
    /// drafts (no grammar, no penalty).
    pub(super) fn can_speculate(&self) -> bool {
        let Some(proposer) = self.proposer.as_ref() else {
            return false;
        };
        let follows_drafts = self.constraint.is_some() || self.sampler.params().needs_history();
        self.tools.is_empty()
            && !(proposer.drafts_on_device() && follows_drafts)
            && self.wants_step()
            && self.max_new - self.queued >= 2
    }

    /// Tokens to draft this step in a batch of `rows` (0: a plain step): the depth control's
    /// choice, or `max_draft`, and one fewer than the tokens the request may still generate.
    pub(super) fn draft_depth(&mut self, rows: usize) -> usize {
        if !self.can_speculate() {
            return 0;
        }
        let depth = match self.depth.as_mut() {
            Some(control) => control.next_depth(rows),
            None => self.params.speculative.max_draft,
        };
        depth.min(self.max_new - self.queued - 1)
    }

    /// Drafts for a step another row widened while this one chose plain decode (see
    /// [`crate::speculative::depth::DepthControl::join_widened`]); 0 without depth control.
    pub(super) fn join_widened_step(&mut self) -> usize {
        if !self.can_speculate() {
            return 0;
        }
        let depth = self
            .depth
            .as_mut()
            .map_or(0, |control| control.join_widened());
        depth.min(self.max_new - self.queued - 1)
    }

    /// Whether this row's proposer may draft once its unread tokens are read: where it cannot
    /// (prompt lookup with nothing to find), the step stays queued ahead of the host's read.
    pub(super) fn may_draft(&self) -> bool {
        self.proposer
            .as_ref()
            .is_some_and(|proposer| proposer.may_draft_after(&self.history, self.unread.len()))
    }

    /// At most `max` drafts for the next step, every unread token read first (the caller's
    /// job: the proposer continues the last one).
    pub(super) fn propose(&mut self, max: usize) -> Vec<u32> {
        if max == 0 || !self.can_speculate() {
            return Vec::new();
        }
        match self.proposer.as_mut() {
            Some(proposer) => proposer.propose(&self.history, max),
            None => Vec::new(),
        }
    }

    /// Takes the tokens a speculative step settled for this request (the drafts the model
    /// agreed with, then its own next token), each as if read from a plain step, until the
    /// request finishes; `logprobs[i]` are token i's arrays when asked for. Returns how many
    /// it took, and feeds the last of them next.
    pub(super) fn take_verified(
        &mut self,
        tokens: &[u32],
        logprobs: &[Option<[Array; 3]>],
        tokenizer: &ChatTokenizer,
        kv_bytes: u64,
        cancelled: bool,
        emit: &mut dyn FnMut(Delta),
    ) -> Result<usize> {
        let mut taken = 0;
        for (index, &token) in tokens.iter().enumerate() {
            if self.finish.is_some() {
                break;
            }
            let logprob = match (
                logprobs.get(index).and_then(Option::as_ref),
                self.params.logprobs,
            ) {
                (Some(arrays), Some(top)) => {
                    crate::runtime::eval(arrays.iter())?;
                    Some(read_logprob(tokenizer, token, arrays, top))
                }
                _ => None,
            };
            self.take_token(false, token, logprob, tokenizer, kv_bytes, cancelled, emit)?;
            taken += 1;
        }
        self.queued += taken;
        if let Some(&last) = tokens[..taken].last() {
            self.input = Array::from_slice(&[last as i32], &[1]);
            self.input_row = None;
        }
        Ok(taken)
    }

    /// Reads the oldest unread token and handles it: timings, log-probs, stops, the delta.
    pub(super) fn read_one(
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
        let logprob = match (&current.logprobs, self.params.logprobs) {
            (Some(arrays), Some(top)) => {
                crate::runtime::eval(arrays.iter())?;
                Some(read_logprob(tokenizer, token, arrays, top))
            }
            _ => None,
        };
        self.take_token(true, token, logprob, tokenizer, kv_bytes, cancelled, emit)
    }

    /// Handles one generated token: timings, log-probs, stops, the delta. `plain_step`: the
    /// token came from a step of its own (its gap is a plain step's cost).
    #[allow(clippy::too_many_arguments)]
    fn take_token(
        &mut self,
        plain_step: bool,
        token: u32,
        logprob: Option<TokenLogprob>,
        tokenizer: &ChatTokenizer,
        kv_bytes: u64,
        cancelled: bool,
        emit: &mut dyn FnMut(Delta),
    ) -> Result<()> {
        let now = Instant::now();
        if self.token_ids.is_empty() {
            self.timings.ttft_ms = ms(now - self.started);
        } else {
            let gap = ms(now - self.last_token_at);
            self.timings.itl_ms.push(gap);
            if let (Some(control), true) = (self.depth.as_mut(), plain_step) {
                control.observe_plain(gap);
            }
        }
        self.last_token_at = now;
        self.token_ids.push(token);
        self.history.push(token);
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
        model: &dyn LanguageModel,
        tokenizer: &ChatTokenizer,
        mut caches: Vec<KvCache>,
        emit: &mut dyn FnMut(Delta),
    ) -> (Completion, CachedSequence) {
        let _ = tokenizer;
        // A batch row's caches come out bounded by what they hold (`KvCache::row`): the draft
        // head's and the draft model's, which may lag, still take in up to the trunk's length.
        if let Some(held) = caches.first().map(KvCache::offset) {
            caches.iter_mut().for_each(|cache| cache.allow_up_to(held));
        }
        let own = crate::models::draft_model::own_caches(model, caches.len());
        if let Err(error) = super::head::settle(model, &mut self, &mut caches[..own]) {
            // The head's caches then end early: a later turn's drafts see less, nothing else.
            eprintln!("rmlx: the draft head did not take in its last tokens: {error}");
        }
        if let Err(error) = super::draft::settle(model, &mut self, &mut caches) {
            // The draft model's caches then end early, and the prefix cache keeps nothing.
            eprintln!("rmlx: the draft model did not take in its last tokens: {error}");
        }
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
        timings.draft_tokens = self.drafted;
        timings.accepted_tokens = self.accepted;
        timings.drafted_at = std::mem::take(&mut self.drafted_at);
        timings.accepted_at = std::mem::take(&mut self.accepted_at);
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
    pub(super) fn new(prompt: &[u32], generated: &[u32], caches: Vec<KvCache>) -> Self {
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

pub(super) fn cancelled(prompt_ids: &[u32], cached_tokens: usize, started: Instant) -> Completion {
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
