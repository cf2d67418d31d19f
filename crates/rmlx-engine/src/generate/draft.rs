//! A separate draft model in the decode loop (`models::draft_model`). Its caches follow the
//! target's in every cache list and hold committed tokens only: prefill primes them with the
//! prompt's pieces, and before drafting every row gives the draft model the tokens it lacks
//! (`catch_up`: the tokens kept since, ending with the one the target feeds next) in one
//! forward for the batch, each row right-padded and cut back to its own. The logits at each
//! row's last token give its first draft; each deeper draft is one more single-token step of the
//! batch, all taken back at once afterwards (`KvCache::take_back`), so the draft model never
//! keeps a token the target has not. Rows that do not draft catch up every
//! [`CATCH_UP_EVERY`] tokens, and before a request's caches go to the prefix cache.
//! Reference: mlx-lm `generate.py` (`speculative_generate_step`: greedy drafts from the draft
//! model, its cache trimmed to the accepted tokens).

use mlx_rs::{ops, ops::indexing::IndexOp, Array, Dtype};

use crate::{
    cache::KvCache,
    error::Result,
    models::{draft_model::DraftModel, LanguageModel, Logits},
};

use super::{
    batch::{with_bias_rows, DecodeRow},
    sequence::Sequence,
};

/// Tokens a row may lag behind before the draft model takes them in although the row is not
/// drafting; also the widest catch-up forward (a sliding window's slack must cover a padded
/// row's columns: 32 positions).
pub(super) const CATCH_UP_EVERY: usize = 16;

/// Where each row's draft caches end: every draft cache of a row holds the same tokens.
fn ends(caches: &[KvCache]) -> Vec<usize> {
    caches
        .first()
        .map(|cache| {
            cache
                .row_offsets()
                .into_iter()
                .map(|end| end.max(0) as usize)
                .collect()
        })
        .unwrap_or_default()
}

/// Committed tokens row `sequence` has not given the draft model (its caches end at `end`).
fn lag(sequence: &Sequence, end: usize) -> usize {
    sequence.history.len().saturating_sub(end)
}

/// Whether some row lags far enough behind that the draft model should take its tokens in now.
pub(super) fn lags<R: DecodeRow>(caches: &[KvCache], rows: &mut [R]) -> bool {
    let ends = ends(caches);
    rows.iter_mut()
        .zip(ends)
        .any(|(row, end)| lag(row.sequence(), end) >= CATCH_UP_EVERY)
}

/// Every row gives the draft model the tokens it lacks, in forwards of at most
/// [`CATCH_UP_EVERY`] columns, each row cut back to its own. Returns the draft's logits after
/// each row's last token, `[B, 1, V]` (a row that lacked nothing gets zeros, which nothing
/// uses), limited to the target's `vocab` so no draft names a token the target lacks.
pub(super) fn catch_up<R: DecodeRow>(
    draft: &DraftModel,
    caches: &mut [KvCache],
    rows: &mut [R],
    vocab: usize,
) -> Result<Array> {
    let ends = ends(caches);
    let mut fed: Vec<usize> = ends.clone();
    let mut last: Vec<Option<Array>> = (0..rows.len()).map(|_| None).collect();
    loop {
        let counts: Vec<usize> = rows
            .iter_mut()
            .zip(&fed)
            .map(|(row, &end)| lag(row.sequence(), end).min(CATCH_UP_EVERY))
            .collect();
        let width = counts.iter().copied().max().unwrap_or(0);
        if width == 0 {
            break;
        }
        let mut tokens = Vec::with_capacity(rows.len() * width);
        for ((row, &count), &end) in rows.iter_mut().zip(&counts).zip(&fed) {
            let history = &row.sequence().history;
            tokens.extend(history[end..end + count].iter().map(|&t| t as i32));
            tokens.extend(std::iter::repeat_n(0, width - count));
        }
        let input = Array::from_slice(&tokens, &[rows.len() as i32, width as i32]);
        caches.iter_mut().for_each(KvCache::begin_speculative);
        let logits = draft.model.forward(&input, caches, Logits::All)?;
        let kept: Vec<i32> = counts.iter().map(|&count| count as i32).collect();
        for cache in caches.iter_mut() {
            cache.keep_written(width as i32, &kept)?;
        }
        for (b, &count) in counts.iter().enumerate() {
            if count > 0 {
                let (b, at) = (b as i32, count as i32 - 1);
                last[b as usize] = Some(logits.index((b..b + 1, at..at + 1)));
                fed[b as usize] += count;
            }
        }
    }
    let draft_vocab = draft.model.vocab_size() as i32;
    let columns = draft_vocab.min(vocab as i32);
    let zeros = || ops::zeros_dtype(&[1, 1, draft_vocab], Dtype::Float32);
    let rows_logits = last
        .into_iter()
        .map(|logits| logits.map_or_else(zeros, Ok))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let dtype = rows_logits
        .iter()
        .map(Array::dtype)
        .find(|&dtype| dtype != Dtype::Float32)
        .unwrap_or(Dtype::Float32);
    let rows_logits = rows_logits
        .iter()
        .map(|logits| logits.as_dtype(dtype))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(ops::concatenate(&rows_logits, 0)?.index((.., .., ..columns)))
}

/// Drafts made on the device (the model's draft head, a draft model): `[B, depth]` int32, and
/// for sampled rows the distributions they were drawn from (`[B, depth, C]` float32, zeros for
/// the other rows), which the rejection rule divides by.
pub(super) struct DeviceDrafts {
    pub(super) tokens: Array,
    pub(super) sampled: Option<(Array, Vec<bool>)>,
}

/// Which rows draw their drafts (rather than take the argmax): those `ours` drafts for whose
/// sampler is not greedy.
pub(super) fn sampled_rows<R: DecodeRow>(
    rows: &mut [R],
    ours: fn(&crate::speculative::Proposer) -> bool,
) -> Vec<bool> {
    rows.iter_mut()
        .map(|row| {
            let sequence = row.sequence();
            sequence.proposer.as_ref().is_some_and(ours) && !sequence.sampler.params().is_greedy()
        })
        .collect()
}

/// One draft per row from a proposer's logits `[B, 1, C]` (logit biases applied here): a
/// greedy row's argmax, a sampled row's draw from the distribution processed as the row's own
/// (filters, temperature) with the row's PRNG stream. Returns the tokens `[B, 1]` and, when
/// some row drew, every row's distribution `[B, 1, C]` (zeros for the argmax rows).
pub(super) fn pick<R: DecodeRow>(
    logits: &Array,
    rows: &mut [R],
    sampled: &[bool],
) -> Result<(Array, Option<Array>)> {
    let biased = with_bias_rows(logits, rows)?;
    let argmax = ops::indexing::argmax_axis(&biased, -1, None)?.as_dtype(Dtype::Int32)?;
    if !sampled.iter().any(|&s| s) {
        return Ok((argmax, None));
    }
    let columns = biased.shape()[2];
    let mut tokens = Vec::with_capacity(rows.len());
    let mut qs = Vec::with_capacity(rows.len());
    for (b, row) in rows.iter_mut().enumerate() {
        let at = b as i32;
        if !sampled[b] {
            tokens.push(argmax.index(at..at + 1));
            qs.push(ops::zeros_dtype(&[1, 1, columns], Dtype::Float32)?);
            continue;
        }
        let sampler = &mut row.sequence().sampler;
        let logprobs = crate::sample::log_softmax(&biased.index((at..at + 1, 0, ..)))?;
        let temperature = sampler.params().temperature;
        let scaled = crate::sample::temperature_scaled(&sampler.filter(&logprobs)?, temperature)?
            .as_dtype(Dtype::Float32)?;
        let token = mlx_rs::random::categorical(&scaled, -1, None, Some(&sampler.next_key()?))?;
        tokens.push(token.as_dtype(Dtype::Int32)?.reshape(&[1, 1])?);
        qs.push(ops::softmax_axis(&scaled, -1, None)?.reshape(&[1, 1, columns])?);
    }
    Ok((
        ops::concatenate(&tokens, 0)?,
        Some(ops::concatenate(&qs, 0)?),
    ))
}

/// Gathers `depth` steps of [`pick`]'s outputs into [`DeviceDrafts`].
pub(super) fn gather(
    tokens: Vec<Array>,
    distributions: Vec<Array>,
    sampled: Vec<bool>,
) -> Result<DeviceDrafts> {
    let sampled = match distributions.is_empty() {
        true => None,
        false => Some((ops::concatenate(&distributions, 1)?, sampled)),
    };
    Ok(DeviceDrafts {
        tokens: ops::concatenate(&tokens, 1)?,
        sampled,
    })
}

/// `depth` drafts for every row: each row catches up, the draft model's logits after its last
/// token give the first draft, and each deeper one is a further single-token step, taken back
/// afterwards. Greedy rows draft the argmax, sampled rows draw from the draft's distribution
/// processed as theirs (q), so the rejection rule keeps about Σ min(p, q) of their drafts
/// rather than p(argmax q) ([`pick`]).
pub(super) fn draft<R: DecodeRow>(
    draft: &DraftModel,
    caches: &mut [KvCache],
    rows: &mut [R],
    depth: usize,
    vocab: usize,
) -> Result<DeviceDrafts> {
    let mut logits = catch_up(draft, caches, rows, vocab)?;
    let marks: Vec<_> = caches.iter().map(KvCache::mark).collect();
    let sampled = sampled_rows(rows, crate::speculative::Proposer::is_draft_model);
    let mut drafts = Vec::with_capacity(depth);
    let mut distributions = Vec::new();
    for step in 0..depth {
        if step > 0 {
            let previous: &Array = &drafts[step - 1];
            let columns = logits.shape()[2];
            logits =
                draft
                    .model
                    .forward(previous, caches, Logits::Last)?
                    .index((.., .., ..columns));
        }
        let (tokens, q) = pick(&logits, rows, &sampled)?;
        drafts.push(tokens);
        distributions.extend(q);
    }
    if depth > 1 {
        for (cache, mark) in caches.iter_mut().zip(marks) {
            cache.take_back(mark, depth as i32 - 1)?;
        }
    }
    gather(drafts, distributions, sampled)
}

/// Before a request's caches go to the prefix cache: the draft model takes in every committed
/// token the target's caches hold, so the draft's caches end where the target's do.
pub(super) fn settle(
    model: &dyn LanguageModel,
    sequence: &mut Sequence,
    caches: &mut [KvCache],
) -> Result<()> {
    let Some(draft) = model.draft_model() else {
        return Ok(());
    };
    let own = crate::models::draft_model::own_caches(model, caches.len());
    if caches.len() != own + draft.caches || own == 0 {
        return Ok(());
    }
    let (target, draft_caches) = caches.split_at_mut(own);
    let held = target[0].offset().max(0) as usize;
    let end = ends(draft_caches).first().copied().unwrap_or(0);
    if end >= held || held > sequence.history.len() {
        return Ok(());
    }
    // In prefill-sized pieces: a request that never drafted may lag by its whole answer.
    for piece in sequence.history[end..held].chunks(super::DEFAULT_PREFILL_CHUNK) {
        draft
            .model
            .forward(&super::as_input(piece), draft_caches, Logits::Last)?;
        crate::runtime::eval(draft_caches.iter().flat_map(|cache| cache.state()))?;
    }
    Ok(())
}
