//! The model's own draft head in the decode loop (Qwen3.5 / 3.6 MTP, `models::DraftHead`).
//!
//! The head's caches follow the trunk's in every cache list and hold one entry per trunk
//! position: the trunk's hidden state there paired with the token after it. Prefill primes them
//! piece by piece (`DraftHead::prime`). A decode or verify step leaves each row's new hidden
//! states pending here until the tokens after them are read; the head takes them in
//! (`catch_up`) right before it drafts, when they pile up, and when the request ends (so the
//! prefix cache stores the head's caches as long as the trunk's). Drafting applies the head to
//! its own output for deeper drafts; those entries are dropped at once, so the head's caches
//! only ever hold pairs the target computed.
//! Reference: mlx-vlm `speculative/drafters/qwen3_5_mtp` (`prefill_from_target_hidden`,
//! `draft_block`, `accept_verified_tokens`), which keeps a draft's own entries once accepted;
//! here they are replaced by the verified hidden states.

use mlx_rs::{ops::indexing::IndexOp, Array, Dtype};

use crate::{
    cache::KvCache,
    error::Result,
    models::{DraftHead, LanguageModel},
};

use super::{batch::DecodeRow, sequence::Sequence};

/// Pending hidden states that make the decode loop take them in even when no row drafts: a
/// row that never speculates (sampled, or depth control off) keeps its head's caches current
/// at one short head forward per this many steps.
pub(super) const CATCH_UP_EVERY: usize = 64;

/// A row's trunk hidden states (`[1, n, H]` pieces, oldest first) the head has not taken in.
#[derive(Default)]
pub(crate) struct Pending {
    pieces: Vec<Array>,
    count: usize,
}

impl Pending {
    pub(super) fn push(&mut self, hidden: Array) {
        self.count += hidden.shape()[1] as usize;
        self.pieces.push(hidden);
    }

    pub(super) fn count(&self) -> usize {
        self.count
    }

    /// The oldest `n` as one `[1, n, H]` array; the rest stay.
    fn take(&mut self, n: usize) -> Result<Array> {
        let all = match self.pieces.len() {
            1 => self.pieces[0].clone(),
            _ => mlx_rs::ops::concatenate(&self.pieces, 1)?,
        };
        let n = n as i32;
        self.pieces = if self.count as i32 > n {
            vec![all.index((.., n..))]
        } else {
            Vec::new()
        };
        self.count -= n as usize;
        Ok(all.index((.., ..n)))
    }
}

/// The trunk's caches in `caches` (the head's follow; a family may share caches between layers,
/// so this is not always its layer count).
pub(super) fn trunk_layers(model: &dyn LanguageModel, caches: &[KvCache]) -> usize {
    caches.len() - model.draft_head().map_or(0, |head| head.head_layers())
}

/// Pairs row `sequence` can give the head now: pending hidden states whose next token is read
/// (`head_end`: the position the head's cache of that row ends at).
fn available(sequence: &Sequence, head_end: usize) -> usize {
    let known = sequence.history.len().saturating_sub(head_end + 1);
    sequence.head.count().min(known)
}

/// Queues each row's hidden states `hidden[b, ..kept[b]]` after a step (`hidden` `[B, T, H]`).
pub(super) fn keep_hidden<R: DecodeRow>(rows: &mut [R], hidden: &Array, kept: &[i32]) {
    for (b, (row, &kept)) in rows.iter_mut().zip(kept).enumerate() {
        let b = b as i32;
        row.sequence()
            .head
            .push(hidden.index((b..b + 1, ..kept.max(1))));
    }
}

/// The head takes in every pair the rows can give (a row whose `wanted` is false gives none):
/// one forward for the batch, each row right-padded to the longest, its cache keeping only its
/// own. Returns the head's output at each row's last pair, `[B, 1, H]` (a row that gave none
/// gets its first column, which nothing uses), or None when no row gave any.
pub(super) fn catch_up<R: DecodeRow>(
    head: &dyn DraftHead,
    trunk: usize,
    caches: &mut [KvCache],
    rows: &mut [R],
    wanted: impl Fn(usize) -> bool,
) -> Result<Option<Array>> {
    let head_caches = &mut caches[trunk..];
    let Some(first) = head_caches.first() else {
        return Ok(None);
    };
    let ends = first.row_offsets();
    let counts: Vec<usize> = rows
        .iter_mut()
        .enumerate()
        .map(|(b, row)| match wanted(b) {
            true => available(row.sequence(), ends[b].max(0) as usize),
            false => 0,
        })
        .collect();
    let width = counts.iter().copied().max().unwrap_or(0);
    if width == 0 {
        return Ok(None);
    }
    // Widths rounded up to a power of two (where the context has room): a width is a shape,
    // MLX compiles kernels per shape (seconds each on CUDA), and how many pairs are pending
    // depends on when rows probe, so unrounded widths would keep meeting new ones.
    let room = head_caches
        .iter()
        .map(KvCache::room)
        .min()
        .unwrap_or(0)
        .max(0) as usize;
    let width = width.next_power_of_two().min(room.max(width));
    let mut tokens = Vec::with_capacity(rows.len() * width);
    let mut hidden = Vec::with_capacity(rows.len());
    let mut size = None;
    for (b, (row, &count)) in rows.iter_mut().zip(&counts).enumerate() {
        let sequence = row.sequence();
        let end = ends[b].max(0) as usize;
        tokens.extend(
            sequence.history[(end + 1).min(sequence.history.len())..]
                .iter()
                .take(count)
                .map(|&token| token as i32),
        );
        tokens.extend(std::iter::repeat_n(0, width - count));
        let taken = match count {
            0 => None,
            n => Some(sequence.head.take(n)?),
        };
        if let Some(taken) = &taken {
            size = Some((taken.shape()[2], taken.dtype()));
        }
        hidden.push((taken, count));
    }
    let (size, dtype) = size.expect("width > 0: some row gave a pair");
    let pieces = hidden
        .into_iter()
        .map(|(taken, count)| {
            let pad = (width - count) as i32;
            let padding = || mlx_rs::ops::zeros_dtype(&[1, pad, size], dtype);
            Ok(match taken {
                Some(taken) if pad == 0 => taken,
                Some(taken) => mlx_rs::ops::concatenate(&[taken, padding()?], 1)?,
                None => padding()?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let hidden = mlx_rs::ops::concatenate(&pieces, 0)?;
    let tokens = Array::from_slice(&tokens, &[rows.len() as i32, width as i32]);
    let outputs = head.head_forward(&tokens, &hidden, head_caches)?;
    let kept: Vec<i32> = counts.iter().map(|&count| count as i32).collect();
    for cache in head_caches.iter_mut() {
        cache.keep_written(width as i32, &kept)?;
    }
    let last: Vec<i32> = counts
        .iter()
        .map(|&count| count.saturating_sub(1) as i32)
        .collect();
    let last = Array::from_slice(&last, &[rows.len() as i32, 1, 1]);
    Ok(Some(outputs.take_along_axis(&last, 1)?))
}

/// `depth` drafts for every row, `[B, depth]` int32: the head takes in each row's pending
/// pairs, its output at the last one scores the first draft, and each further draft comes from
/// the head applied to the previous draft and its own output. Greedy rows draft the argmax,
/// sampled rows draw from the head's distribution processed as theirs (`draft::pick`). Logit
/// biases apply as in the target's step. Rows that draft fewer use a prefix.
pub(super) fn draft<R: DecodeRow>(
    head: &dyn DraftHead,
    trunk: usize,
    caches: &mut [KvCache],
    rows: &mut [R],
    depth: usize,
) -> Result<super::draft::DeviceDrafts> {
    let count = rows.len() as i32;
    let mut output = match catch_up(head, trunk, caches, rows, |_| true)? {
        Some(output) => output,
        // No row has a pair to give (nothing decoded yet): drafts from nothing, all rejected.
        None => {
            return Ok(super::draft::DeviceDrafts {
                tokens: mlx_rs::ops::zeros_dtype(&[count, depth as i32], Dtype::Int32)?,
                sampled: None,
            })
        }
    };
    let sampled = super::draft::sampled_rows(rows, crate::speculative::Proposer::is_head);
    let mut drafts = Vec::with_capacity(depth);
    let mut distributions = Vec::new();
    for step in 0..depth {
        if step > 0 {
            let previous: &Array = &drafts[step - 1];
            output = head.head_forward(previous, &output, &mut caches[trunk..])?;
        }
        let (tokens, q) = super::draft::pick(&head.head_logits(&output)?, rows, &sampled)?;
        drafts.push(tokens);
        distributions.extend(q);
    }
    if depth > 1 {
        // The deeper drafts' own entries go: the head keeps only pairs the target computed.
        let none = vec![0; rows.len()];
        for cache in caches[trunk..].iter_mut() {
            cache.keep_written(depth as i32 - 1, &none)?;
        }
    }
    super::draft::gather(drafts, distributions, sampled)
}

/// Before a request's caches go to the prefix cache: the head takes in every pending pair it
/// can, so its caches end where the trunk's do.
pub(super) fn settle(
    model: &dyn LanguageModel,
    sequence: &mut Sequence,
    caches: &mut [KvCache],
) -> Result<()> {
    let Some(head) = model.draft_head() else {
        return Ok(());
    };
    if caches.len() != model.num_layers() + head.head_layers() || sequence.head.count() == 0 {
        return Ok(());
    }
    let trunk = trunk_layers(model, caches);
    struct Alone<'s>(&'s mut Sequence);
    impl DecodeRow for Alone<'_> {
        fn sequence(&mut self) -> &mut Sequence {
            self.0
        }
        fn cancelled(&self) -> bool {
            false
        }
        fn emit(&mut self, _: super::Delta) {}
    }
    let mut row = [Alone(sequence)];
    catch_up(head, trunk, caches, &mut row, |_| true)?;
    crate::runtime::eval(caches[trunk..].iter().flat_map(|cache| cache.state()))
}
