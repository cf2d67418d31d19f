//! A speculative step's rows that are not plain greedy: sampled rows, and greedy rows with a
//! penalty or a grammar. Each position's logits get what a plain step would give them there:
//! the grammar's mask after the drafts before it, the penalties over the history plus those
//! drafts, the logit bias, then log-softmax. A greedy row keeps the drafts equal to each
//! position's argmax; a sampled row applies the rejection rule (`speculative/accept.rs`) to the
//! filtered, temperature-scaled distributions, its drafts point masses. Everything stays lazy
//! until the step's one wait.

use mlx_rs::{ops, ops::indexing::IndexOp, Array, Dtype};

use crate::{error::Result, speculative::accept};

use super::sequence::{logprob_arrays, Sequence};

/// The tokens a row takes, how many of them were drafts, and their log-prob arrays.
pub(super) type Taken = (Vec<u32>, usize, Vec<Option<[Array; 3]>>);

/// One row's lazy outcome.
pub(super) struct Settling {
    /// Processed log-probs `[T', vocab]` of the positions the row can keep (what `logprobs`
    /// report: after processors and grammar, before the sampling filters).
    logprobs: Array,
    outcome: Outcome,
    /// Drafts the row may keep (its grammar can cut the rest).
    usable: usize,
}

enum Outcome {
    /// Each position's argmax (`[T']` uint32).
    Greedy(Array),
    Sampled(accept::Settled),
}

impl Settling {
    pub(super) fn arrays(&self) -> Vec<&Array> {
        match &self.outcome {
            Outcome::Greedy(argmax) => vec![argmax],
            Outcome::Sampled(settled) => vec![&settled.kept, &settled.draws],
        }
    }

    pub(super) fn usable(&self) -> usize {
        self.usable
    }

    /// After the wait: the tokens the row takes (its kept drafts, then one of the model's),
    /// how many drafts it kept, and each token's log-prob arrays when asked for.
    pub(super) fn tokens(&self, drafts: &[u32], logprobs_top: Option<usize>) -> Result<Taken> {
        let drafts = &drafts[..self.usable.min(drafts.len())];
        let tokens = match &self.outcome {
            Outcome::Greedy(argmax) => {
                let targets = argmax.as_slice::<u32>();
                let agreed = drafts
                    .iter()
                    .zip(targets)
                    .take_while(|(draft, target)| draft == target)
                    .count();
                targets[..=agreed].to_vec()
            }
            Outcome::Sampled(settled) => {
                let kept = settled.kept.as_slice::<i32>();
                let draws = settled.draws.as_slice::<u32>();
                accept::Settled::tokens(kept, draws, drafts.len() + 1, 0, drafts)
            }
        };
        let kept = tokens.len() - 1;
        let logprobs = match logprobs_top {
            Some(top) => tokens
                .iter()
                .enumerate()
                .map(|(at, &token)| {
                    let row = self.logprobs.index(at as i32);
                    logprob_arrays(&row, &Array::from_slice(&[token], &[1]), top).map(Some)
                })
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        Ok((tokens, kept, logprobs))
    }
}

impl Sequence {
    /// Builds the row's outcome from its raw logits `[T, vocab]` (T = 1 + the drafts fed) and
    /// its drafts: on the host (`host`, prompt lookup and given drafters: the grammar and the
    /// penalties follow them position by position) or on the device (`device`, `[1, n]` int32:
    /// the draft head's or draft model's, for rows whose processors do not read the history).
    /// `q` (`[1, n, C]`): the distributions sampled drafts were drawn from; None: point masses.
    pub(super) fn settle(
        &mut self,
        logits: &Array,
        host: Option<&[u32]>,
        device: Option<&Array>,
        q: Option<&Array>,
        count: usize,
    ) -> Result<Settling> {
        let masks = match (self.constraint.as_mut(), host) {
            (Some(constraint), Some(drafts)) => Some(constraint.draft_masks(drafts)?),
            _ => None,
        };
        let usable = masks.as_ref().map_or(count, |masks| masks.len() - 1);
        let positions = usable + 1;
        let logits = logits.index(..positions as i32);
        let per_position =
            host.is_some() && (masks.is_some() || self.sampler.params().needs_history());
        let processed = if per_position {
            let drafts = host.unwrap_or_default();
            let mut history = self.history.clone();
            let mut rows = Vec::with_capacity(positions);
            for at in 0..positions {
                let mut row = logits.index(at as i32..at as i32 + 1);
                if let Some(masks) = &masks {
                    row = ops::add(&row, masks[at].as_dtype(row.dtype())?)?;
                }
                rows.push(self.sampler.process(&row, &history)?);
                if let Some(&draft) = drafts.get(at) {
                    history.push(draft);
                }
            }
            ops::concatenate(&rows, 0)?
        } else {
            self.sampler.process(&logits, &self.history)?
        };
        let logprobs = crate::sample::log_softmax(&processed)?;
        let outcome = if self.sampler.params().is_greedy() {
            Outcome::Greedy(crate::sample::greedy(&logprobs)?)
        } else {
            let temperature = self.sampler.params().temperature;
            let scaled =
                crate::sample::temperature_scaled(&self.sampler.filter(&logprobs)?, temperature)?
                    .as_dtype(Dtype::Float32)?;
            let p = ops::softmax_axis(&scaled, -1, None)?.expand_dims(0)?;
            let drafts = match (host, device) {
                (Some(drafts), _) => {
                    let ids: Vec<i32> = drafts[..usable].iter().map(|&d| d as i32).collect();
                    Array::from_slice(&ids, &[1, usable as i32])
                }
                (None, Some(device)) => device.index((.., ..usable as i32)),
                (None, None) => ops::zeros_dtype(&[1, 0], Dtype::Int32)?,
            };
            // A draft model's columns stop at the smaller vocabulary: the rest have q = 0.
            let q = match q {
                Some(q) => {
                    let q = q.index((.., ..usable as i32, ..));
                    let short = p.shape()[2] - q.shape()[2];
                    Some(match short {
                        0 => q,
                        _ => ops::concatenate(
                            &[
                                q,
                                ops::zeros_dtype(&[1, usable as i32, short], Dtype::Float32)?,
                            ],
                            2,
                        )?,
                    })
                }
                None => None,
            };
            let keys = [self.sampler.next_key()?, self.sampler.next_key()?];
            Outcome::Sampled(accept::rejection_rule(
                &p,
                &drafts,
                q.as_ref(),
                [&keys[0], &keys[1]],
            )?)
        };
        Ok(Settling {
            logprobs,
            outcome,
            usable,
        })
    }
}
