//! One decode step of a batch of rows, each its own request.

use std::{cell::OnceCell, rc::Rc};

use mlx_rs::{ops::indexing::IndexOp, Array};

use crate::{
    cache::KvCache,
    chat::ChatTokenizer,
    error::Result,
    models::{LanguageModel, Logits},
    sample::RowDraw,
};

use super::{
    sequence::{Sequence, Step},
    Delta,
};

/// One decode step's tokens for all rows of a batch (`[B]`, uint32), read to the host at most
/// once: one device read per step instead of one per row.
pub(super) struct BatchTokens {
    pub(super) tokens: Array,
    host: OnceCell<Vec<u32>>,
}

impl BatchTokens {
    pub(super) fn new(tokens: Array) -> Self {
        Self {
            tokens,
            host: OnceCell::new(),
        }
    }

    pub(super) fn get(&self, row: usize) -> Result<u32> {
        if self.host.get().is_none() {
            crate::runtime::eval([&self.tokens])?;
            let _ = self.host.set(self.tokens.as_slice::<u32>().to_vec());
        }
        Ok(self.host.get().expect("set above")[row])
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
    let bytes = kv_bytes(caches, rows.len());
    let mut clock = crate::profile::StepClock::start();
    if let Some(drafts) = super::verify::drafts(model, caches, rows, tokenizer, bytes)? {
        let bytes = kv_bytes(caches, rows.len());
        return super::verify::verify_iteration(
            model, tokenizer, caches, rows, &drafts, bytes, clock,
        );
    }
    let pipelined = !rows.iter_mut().any(|row| row.sequence().is_constrained());
    if !pipelined {
        let bytes = kv_bytes(caches, rows.len());
        for row in rows.iter_mut() {
            read_all(row, tokenizer, bytes, 0)?;
        }
    }
    let count = rows.len();
    let mut fresh = vec![false; count];
    let stepped = rows.iter_mut().any(|row| row.sequence().wants_step());
    if stepped {
        let mut queued = Vec::new();
        let head = model.draft_head();
        let own = crate::models::draft_model::own_caches(model, caches.len());
        let (caches, draft_caches) = caches.split_at_mut(own);
        let trunk = super::head::trunk_layers(model, caches);
        if let Some(head) = head.filter(|_| {
            rows.iter_mut()
                .any(|row| row.sequence().head.count() >= super::head::CATCH_UP_EVERY)
        }) {
            // Rows that do not draft keep the head current in bounded pieces.
            super::head::catch_up(head, trunk, caches, rows, |_| true)?;
            queued.extend(
                caches[trunk..]
                    .iter()
                    .flat_map(|cache| cache.state())
                    .cloned(),
            );
        }
        if let Some(draft) = model.draft_model() {
            let drafting = rows.iter_mut().any(|row| {
                let proposer = row.sequence().proposer.as_ref();
                proposer.is_some_and(crate::speculative::Proposer::is_draft_model)
            });
            if drafting && super::draft::lags(draft_caches, rows) {
                // Likewise the draft model, a bounded piece at a time, while some row drafts
                // with it (the others catch up when one does, or when their caches are stored).
                super::draft::catch_up(draft, draft_caches, rows, model.vocab_size())?;
                queued.extend(draft_caches.iter().flat_map(|cache| cache.state()).cloned());
            }
        }
        let input = batch_input(rows)?;
        let logits = match head {
            Some(head) => {
                let (logits, hidden) = head.forward_hidden(&input, caches, Logits::Last)?;
                super::head::keep_hidden(rows, &hidden, &vec![1; count]);
                logits
            }
            None => model.forward(&input, caches, Logits::Last)?,
        };
        let logits = logits.index((.., -1, ..));
        if super::finite::enabled() {
            queued.extend(super::finite::check(&logits, &input, caches, rows)?);
        }
        // Rows with no processor but a logit bias (greedy or sampled: agents sample) draw their
        // tokens together: one bias add, one log-softmax, one draw over all rows, one host
        // read, not a dozen ops a row. The others sample row by row.
        let batchable: Vec<bool> = rows
            .iter_mut()
            .map(|row| match sampled_rows_together() {
                true => row.sequence().is_batchable(),
                false => row.sequence().is_batchable_greedy(),
            })
            .collect();
        let together = if count > 1 && batchable.iter().filter(|&&b| b).count() > 1 {
            let logits = with_bias_rows(&logits, rows)?;
            let logprobs = crate::sample::log_softmax(&logits)?;
            // A row whose token is not kept (done, or sampled alone below) takes the argmax and
            // leaves its stream where it is.
            let draws: Vec<RowDraw> = rows
                .iter_mut()
                .zip(&batchable)
                .map(|(row, &batchable)| {
                    let sequence = row.sequence();
                    match batchable && sequence.wants_step() {
                        true => sequence.sampler.row_draw(),
                        false => RowDraw::Argmax,
                    }
                })
                .collect();
            let batch = Rc::new(BatchTokens::new(crate::sample::draw_rows(
                &logprobs, &draws,
            )?));
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
                Some((batch, logprobs)) if batchable[b] => {
                    sequence.take_batched(batch, b, logprobs)?
                }
                _ if count == 1 => sequence.sample(&logits)?,
                _ => sequence.sample(&logits.index(b as i32..b as i32 + 1))?,
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
    // A turn that only reads the tokens of steps queued before (every row done) is no step.
    if let Some(clock) = clock.filter(|_| stepped) {
        clock.finish(count, 1);
    }
    Ok(())
}

/// Whether sampled rows draw with the batch (`RMLX_BATCHED_SAMPLING=0`: only greedy rows do,
/// as before; for A/B runs on a GPU). Read once.
fn sampled_rows_together() -> bool {
    static ANSWER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ANSWER.get_or_init(|| std::env::var("RMLX_BATCHED_SAMPLING").as_deref() != Ok("0"))
}

/// `logits` `[B, vocab]` plus each row's logit bias (one add; unchanged when no row has one).
/// `[B, T, vocab]` logits (a speculative step's) get each row's bias at every position.
pub(super) fn with_bias_rows<R: DecodeRow>(logits: &Array, rows: &mut [R]) -> Result<Array> {
    let shape = logits.shape().to_vec();
    let (vocab, dtype) = (shape[shape.len() - 1] as usize, logits.dtype());
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
    let mut biases = mlx_rs::ops::concatenate(&rows, 0)?;
    if shape.len() == 3 {
        biases = biases.reshape(&[shape[0], 1, vocab as i32])?;
    }
    Ok(mlx_rs::ops::add(logits, biases)?)
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
pub(super) fn read_all<R: DecodeRow>(
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
