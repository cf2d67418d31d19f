//! One speculative step of a batch: every row feeds its next token and its drafts (none for
//! some rows) in one forward; a greedy row keeps the drafts the model agrees with plus the
//! model's own next token, a row without drafts gets its one token as in a plain step, and every
//! cache keeps exactly the tokens its row kept (`KvCache::keep_written`).
//!
//! Ragged rows: a row with fewer drafts is right-padded to the step's width with tokens it never
//! keeps. Rows that keep different counts then end at different columns; the caches remember
//! each row's end, the next step writes each row at its own end (one scatter per cache part)
//! and masks each row past it, so no row's history is copied to realign the batch. The cost is
//! the columns between a row's end and the longest row's, masked like left padding.
//! Reference: mlx-vlm `speculative` (`_speculative_walk`: greedy acceptance); Ollama
//! `x/mlxrunner/speculate.go` (one forward over `[current, d0..dn-1]`, one host read per round).

use std::rc::Rc;

use mlx_rs::{ops::indexing::IndexOp, Array, Dtype};

use crate::{
    cache::KvCache,
    chat::ChatTokenizer,
    error::Result,
    models::{LanguageModel, Logits},
    sample::RowDraw,
};

use super::{
    batch::{read_all, with_bias_rows, BatchTokens, DecodeRow},
    sequence::logprob_arrays,
    settle::Settling,
};

/// A step's drafts: each row's from a host proposer (empty for the others), and those made on
/// the device (the model's draft head, a separate draft model) for the rows they draft for.
pub(super) struct Drafts {
    host: Vec<Vec<u32>>,
    /// `[B, K]` int32 and how many of its row's each row drafts (0: not a device row).
    device: Option<(Array, Vec<usize>)>,
    /// The distributions a draft model's sampled rows drew their drafts from (`[B, K, C]`),
    /// and which rows those are; the other device drafts are point masses.
    sampled: Option<(Array, Vec<bool>)>,
}

impl Drafts {
    fn width(&self) -> usize {
        let host = self.host.iter().map(Vec::len).max().unwrap_or(0);
        let device = self
            .device
            .as_ref()
            .map_or(0, |(_, depths)| depths.iter().copied().max().unwrap_or(0));
        1 + host.max(device)
    }
}

thread_local! {
    static DRAFT_READS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Times a row's unread tokens were read on this thread so that its host proposer could draft
/// (each a wait on the device before the next step is queued; tests count them).
pub fn draft_reads() -> usize {
    DRAFT_READS.with(std::cell::Cell::get)
}

/// Drafts for every row that speculates, or None when no row drafts anything (the step is
/// then a plain one). A drafting row's unread tokens are read first: its proposer needs its
/// last token, and the draft head needs the tokens after its pending hidden states.
pub(super) fn drafts<R: DecodeRow>(
    model: &dyn LanguageModel,
    caches: &mut [KvCache],
    rows: &mut [R],
    tokenizer: &ChatTokenizer,
    kv_bytes: u64,
) -> Result<Option<Drafts>> {
    let count = rows.len();
    let mut host = vec![Vec::new(); count];
    let mut head_depths = vec![0; count];
    let mut model_depths = vec![0; count];
    let mut any = false;
    let mut depths: Vec<usize> = rows
        .iter_mut()
        .map(|row| row.sequence().draft_depth(count))
        .collect();
    // A step some row widens computes the extra columns for every row: the rows that chose
    // plain decode draft in them too (a free probe), so a batch's probes come together.
    if depths.iter().any(|&depth| depth > 0) {
        for (row, depth) in rows.iter_mut().zip(&mut depths) {
            if *depth == 0 {
                *depth = row.sequence().join_widened_step();
            }
        }
    }
    for (b, row) in rows.iter_mut().enumerate() {
        let depth = depths[b];
        // Reading a row's newest token waits for the device, which then idles while the next
        // step is built (on a GPU, a launch-bound step's build time added to every step): not
        // for a row whose proposer cannot draft after it anyway.
        if depth == 0 || !row.sequence().may_draft() {
            continue;
        }
        if !row.sequence().unread.is_empty() {
            DRAFT_READS.with(|reads| reads.set(reads.get() + 1));
        }
        read_all(row, tokenizer, kv_bytes, 0)?;
        let sequence = row.sequence();
        let most = depth.min(sequence.params.speculative.max_draft);
        match sequence.proposer.as_ref() {
            Some(proposer) if proposer.is_head() => {
                head_depths[b] = most;
                any = true;
            }
            Some(proposer) if proposer.is_draft_model() => {
                model_depths[b] = most;
                any = true;
            }
            _ => {
                host[b] = sequence.propose(depth);
                any |= !host[b].is_empty();
            }
        }
    }
    if !any {
        return Ok(None);
    }
    let own = crate::models::draft_model::own_caches(model, caches.len());
    let (caches, draft_caches) = caches.split_at_mut(own);
    let deepest = |depths: &[usize]| depths.iter().copied().max().unwrap_or(0);
    let from_head = match model.draft_head().filter(|_| deepest(&head_depths) > 0) {
        Some(head) => {
            // The head takes in every row's pairs, so the others' unread tokens come first too.
            for row in rows.iter_mut() {
                read_all(row, tokenizer, kv_bytes, 0)?;
            }
            let trunk = super::head::trunk_layers(model, caches);
            Some(super::head::draft(
                head,
                trunk,
                caches,
                rows,
                deepest(&head_depths),
            )?)
        }
        None => None,
    };
    let from_model = match model.draft_model().filter(|_| deepest(&model_depths) > 0) {
        Some(draft) => {
            // Every row catches up (the batch's draft caches move together).
            for row in rows.iter_mut() {
                read_all(row, tokenizer, kv_bytes, 0)?;
            }
            let depth = deepest(&model_depths);
            let vocab = model.vocab_size();
            Some(super::draft::draft(
                draft,
                draft_caches,
                rows,
                depth,
                vocab,
            )?)
        }
        None => None,
    };
    let depths: Vec<usize> = head_depths
        .iter()
        .zip(&model_depths)
        .map(|(&head, &model)| head.max(model))
        .collect();
    let by_model: Vec<bool> = model_depths.iter().map(|&depth| depth > 0).collect();
    let (device, sampled) = match (from_head, from_model) {
        (None, None) => (None, None),
        (Some(drafts), None) | (None, Some(drafts)) => (Some(drafts.tokens), drafts.sampled),
        (Some(head), Some(drafted)) => {
            let both = combine(head, drafted, &by_model, model.vocab_size())?;
            (Some(both.tokens), both.sampled)
        }
    };
    Ok(Some(Drafts {
        host,
        device: device.map(|tokens| (tokens, depths)),
        sampled,
    }))
}

/// The head's and the draft model's drafts in one batch: each row takes its own proposer's
/// (`by_model`), tokens `[B, K]` and distributions `[B, K, vocab]` padded to the wider.
fn combine(
    head: super::draft::DeviceDrafts,
    drafted: super::draft::DeviceDrafts,
    by_model: &[bool],
    vocab: usize,
) -> Result<super::draft::DeviceDrafts> {
    let count = by_model.len() as i32;
    let width = head.tokens.shape()[1].max(drafted.tokens.shape()[1]);
    let pad = |array: Array, axis: usize, to: i32| -> Result<Array> {
        let mut shape = array.shape().to_vec();
        let short = to - shape[axis];
        if short == 0 {
            return Ok(array);
        }
        shape[axis] = short;
        let zeros = mlx_rs::ops::zeros_dtype(&shape, array.dtype())?;
        Ok(mlx_rs::ops::concatenate(&[array, zeros], axis as i32)?)
    };
    let rows = Array::from_slice(by_model, &[count, 1]);
    let tokens = mlx_rs::ops::select(
        &rows,
        &pad(drafted.tokens, 1, width)?,
        &pad(head.tokens, 1, width)?,
    )?;
    let sampled = match (head.sampled, drafted.sampled) {
        (None, None) => None,
        (head, drafted) => {
            let full = |sampled: Option<(Array, Vec<bool>)>| -> Result<(Array, Vec<bool>)> {
                match sampled {
                    Some((q, rows)) => Ok((pad(pad(q, 1, width)?, 2, vocab as i32)?, rows)),
                    None => Ok((
                        mlx_rs::ops::zeros_dtype(&[count, width, vocab as i32], Dtype::Float32)?,
                        vec![false; count as usize],
                    )),
                }
            };
            let (head_q, head_rows) = full(head)?;
            let (model_q, model_rows) = full(drafted)?;
            let q = mlx_rs::ops::select(&rows.reshape(&[count, 1, 1])?, &model_q, &head_q)?;
            let sampled_rows = by_model
                .iter()
                .enumerate()
                .map(|(b, &model)| if model { model_rows[b] } else { head_rows[b] })
                .collect();
            Some((q, sampled_rows))
        }
    };
    Ok(super::draft::DeviceDrafts { tokens, sampled })
}

/// The speculative step (see the module doc) with its `drafts`; `clock` started before they
/// were made.
pub(super) fn verify_iteration<R: DecodeRow>(
    model: &dyn LanguageModel,
    tokenizer: &ChatTokenizer,
    caches: &mut [KvCache],
    rows: &mut [R],
    drafts: &Drafts,
    kv_bytes: u64,
    mut clock: Option<crate::profile::StepClock>,
) -> Result<()> {
    let count = rows.len();
    let width = drafts.width();
    // Rows that did not draft may still hold a pipelined step's token unread: it comes before
    // anything this step gives them (the step waits on the device anyway).
    for row in rows.iter_mut() {
        read_all(row, tokenizer, kv_bytes, 0)?;
    }
    let mut inputs = Vec::with_capacity(count);
    for (b, (row, draft)) in rows.iter_mut().zip(&drafts.host).enumerate() {
        let sequence = row.sequence();
        sequence.batched_with = sequence.batched_with.max(count);
        let first = sequence.input.as_dtype(Dtype::Int32)?.reshape(&[1, 1])?;
        let rest = match &drafts.device {
            Some((tokens, depths)) if depths[b] > 0 => {
                // The head drafted the batch's deepest count for every row: this row's extra
                // ones are padding it never keeps, like the zeros below.
                let own = tokens.index(b as i32..b as i32 + 1);
                let pad = width as i32 - 1 - own.shape()[1];
                match pad {
                    0 => own,
                    _ => mlx_rs::ops::concatenate(
                        &[own, mlx_rs::ops::zeros_dtype(&[1, pad], Dtype::Int32)?],
                        1,
                    )?,
                }
            }
            _ => {
                let mut rest: Vec<i32> = draft.iter().map(|&token| token as i32).collect();
                // Padding the row never keeps (its step ends at its last draft).
                rest.resize(width - 1, 0);
                Array::from_slice(&rest, &[1, width as i32 - 1])
            }
        };
        inputs.push(mlx_rs::ops::concatenate(&[first, rest], 1)?);
    }
    let input = mlx_rs::ops::concatenate(&inputs, 0)?;
    let own = crate::models::draft_model::own_caches(model, caches.len());
    let caches = &mut caches[..own];
    let trunk = super::head::trunk_layers(model, caches);
    caches[..trunk]
        .iter_mut()
        .for_each(KvCache::begin_speculative);
    let (logits, hidden) = match model.draft_head() {
        Some(head) => {
            let (logits, hidden) = head.forward_hidden(&input, caches, Logits::All)?;
            (logits, Some(hidden))
        }
        None => (model.forward(&input, caches, Logits::All)?, None),
    };
    // The plain batched step's ops at every position: bias, log-softmax, argmax (the same
    // tie-break), so a kept draft is exactly the token the plain step would have chosen.
    let logprobs = crate::sample::log_softmax(&with_bias_rows(&logits, rows)?)?;
    let argmax = crate::sample::greedy(&logprobs)?;
    // Sampled, constrained or penalised rows: with drafts, each position processed as a plain
    // step would (settle.rs); without, one token from the first position.
    let mut sampled = vec![false; count];
    let undrafted = |b: usize| {
        drafts.host[b].is_empty()
            && drafts
                .device
                .as_ref()
                .is_none_or(|(_, depths)| depths[b] == 0)
    };
    // Sampled rows without drafts and without penalties draw their one token together, as in
    // a plain step (batch.rs), from the first position.
    let together: Vec<bool> = rows
        .iter_mut()
        .enumerate()
        .map(|(b, row)| {
            let sequence = row.sequence();
            sequence.wants_step()
                && !sequence.is_batchable_greedy()
                && sequence.is_batchable()
                && undrafted(b)
        })
        .collect();
    let drawn = if together.iter().filter(|&&t| t).count() > 1 {
        let first = logprobs.index((.., 0, ..));
        let draws: Vec<RowDraw> = rows
            .iter_mut()
            .zip(&together)
            .map(|(row, &together)| match together {
                true => row.sequence().sampler.row_draw(),
                false => RowDraw::Argmax,
            })
            .collect();
        let batch = Rc::new(BatchTokens::new(crate::sample::draw_rows(&first, &draws)?));
        for (b, row) in rows.iter_mut().enumerate().filter(|(b, _)| together[*b]) {
            row.sequence().take_batched(&batch, b, &first)?;
            sampled[b] = true;
        }
        Some(batch)
    } else {
        None
    };
    let mut settling: Vec<Option<Settling>> = (0..count).map(|_| None).collect();
    for (b, row) in rows.iter_mut().enumerate() {
        let sequence = row.sequence();
        if !sequence.wants_step() || sequence.is_batchable_greedy() || sampled[b] {
            continue;
        }
        let at = b as i32;
        let head_depth = drafts.device.as_ref().map_or(0, |(_, depths)| depths[b]);
        let host = &drafts.host[b];
        if undrafted(b) {
            sequence.sample(&logits.index((at..at + 1, 0, ..)))?;
            sampled[b] = true;
            continue;
        }
        let own = logits.index(at);
        settling[b] = Some(match &drafts.device {
            Some((tokens, _)) if head_depth > 0 => {
                let device = tokens.index(at..at + 1);
                let q = match &drafts.sampled {
                    Some((q, rows)) if rows[b] => Some(q.index(at..at + 1)),
                    _ => None,
                };
                sequence.settle(&own, None, Some(&device), q.as_ref(), head_depth)?
            }
            _ => sequence.settle(&own, Some(host), None, None, host.len())?,
        });
    }
    // The step's one wait for the device (rows without log-probs read nothing else).
    let head_tokens = drafts.device.as_ref().map(|(tokens, _)| tokens);
    let settled = settling.iter().flatten().flat_map(Settling::arrays);
    let waited: Vec<&Array> = std::iter::once(&argmax)
        .chain(drawn.as_ref().map(|batch| &batch.tokens))
        .chain(head_tokens)
        .chain(settled)
        .collect();
    if let Some(clock) = clock.as_mut() {
        clock.built();
        // Profiled, the step is handed over first (where a GPU encodes its kernels), so the
        // wait that follows is only the device's.
        crate::runtime::async_eval(waited.iter().copied())?;
        clock.submitted();
    }
    crate::runtime::eval(waited.iter().copied())?;
    let now = std::time::Instant::now();
    if let Some(clock) = clock {
        clock.finish(count, width);
    }
    let chosen: Vec<u32> = argmax.as_slice::<u32>().to_vec();
    let head_drafts: Option<(Vec<i32>, usize)> = head_tokens.map(|tokens| {
        (
            tokens.as_slice::<i32>().to_vec(),
            tokens.shape()[1] as usize,
        )
    });
    let mut kept = Vec::with_capacity(count);
    for (b, (row, draft)) in rows.iter_mut().zip(&drafts.host).enumerate() {
        let head_draft: Vec<u32>;
        let draft = match (&head_drafts, &drafts.device) {
            (Some((tokens, deepest)), Some((_, depths))) if depths[b] > 0 => {
                let own = &tokens[b * deepest..b * deepest + depths[b]];
                head_draft = own.iter().map(|&token| token as u32).collect();
                &head_draft
            }
            _ => draft,
        };
        if sampled[b] || !row.sequence().wants_step() {
            // One token (or none for a finished row that only feeds its last one).
            kept.push(1);
            continue;
        }
        let sequence = row.sequence();
        let (tokens, agreed, logprobs) = match &settling[b] {
            Some(settling) => settling.tokens(draft, sequence.params.logprobs)?,
            None => {
                let targets = &chosen[b * width..(b + 1) * width];
                let agreed = draft
                    .iter()
                    .zip(targets)
                    .take_while(|(draft, target)| draft == target)
                    .count();
                let tokens = targets[..=agreed].to_vec();
                let logprobs: Vec<Option<[Array; 3]>> = match sequence.params.logprobs {
                    Some(top) => tokens
                        .iter()
                        .enumerate()
                        .map(|(t, &token)| {
                            let at = logprobs.index((b as i32, t as i32, ..));
                            let token = Array::from_slice(&[token], &[1]);
                            logprob_arrays(&at, &token, top).map(Some)
                        })
                        .collect::<Result<_>>()?,
                    None => Vec::new(),
                };
                (tokens, agreed, logprobs)
            }
        };
        let tokens = &tokens[..];
        // Drafts checked (a grammar cuts those it refuses).
        let checked = settling[b]
            .as_ref()
            .map_or(draft.len(), |settling| settling.usable().min(draft.len()));
        sequence.drafted += checked;
        if let Some(control) = sequence.depth.as_mut().filter(|_| !draft.is_empty()) {
            // On the clock plain steps are measured by: the gap since the row's last token.
            let step_ms = (now - sequence.last_token_at).as_secs_f64() * 1000.0;
            control.observe_step(checked, agreed, width, step_ms);
        }
        let cancelled = row.cancelled();
        let mut deltas = Vec::new();
        let taken = row.sequence().take_verified(
            tokens,
            &logprobs,
            tokenizer,
            kv_bytes,
            cancelled,
            &mut |delta| deltas.push(delta),
        )?;
        deltas.into_iter().for_each(|delta| row.emit(delta));
        // Drafts taken (the model's own token, the last one taken, is not a draft).
        let sequence = row.sequence();
        let kept_drafts = taken.min(agreed);
        sequence.accepted += kept_drafts;
        count_at(&mut sequence.drafted_at, checked);
        count_at(&mut sequence.accepted_at, kept_drafts);
        // The caches keep the fed token and every taken token but the last (fed next).
        kept.push(taken.max(1) as i32);
    }
    for cache in caches[..trunk].iter_mut() {
        cache.keep_written(width as i32, &kept)?;
    }
    if let Some(hidden) = &hidden {
        super::head::keep_hidden(rows, hidden, &kept);
    }
    for (row, sampled) in rows.iter_mut().zip(sampled) {
        if sampled {
            read_all(row, tokenizer, kv_bytes, 0)?;
        }
    }
    Ok(())
}

/// Adds one to each of the first `n` positions of `counts`, growing it as needed.
fn count_at(counts: &mut Vec<usize>, n: usize) {
    if counts.len() < n {
        counts.resize(n, 0);
    }
    counts[..n].iter_mut().for_each(|count| *count += 1);
}
