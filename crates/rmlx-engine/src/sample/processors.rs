//! mlx-lm 0.32.2 `make_logits_processors`: logit bias, then the repetition, presence and
//! frequency penalties, each over the last `context_size` ids of the history (prompt included).
//! They run on raw logits `[rows, vocab]` before the log-softmax.

use mlx_rs::ops::indexing::{put_along_axis, scatter_add_single, take_axis};
use mlx_rs::ops::{broadcast_to, concatenate, full, select};
use mlx_rs::Array;

use super::filters::scalar;
use super::{SampleError, SamplingParams};

/// The enabled processors of one request; the bias arrays are built once.
#[derive(Debug, Clone)]
pub(crate) struct LogitsProcessors {
    /// (ids `[n]` uint32, biases `[n]` float32, largest id) of `logit_bias`.
    bias: Option<(Array, Array, u32)>,
    repetition: Option<(f32, usize)>,
    presence: Option<(f32, usize)>,
    frequency: Option<(f32, usize)>,
}

/// The ids a penalty looks at: the last `context_size` of history (+ the still-lazy `pending`
/// token). `context_size == 0` means the whole history: mlx-lm slices `tokens[-0:]`.
struct Window<'a> {
    history: &'a [u32],
    pending: Option<&'a Array>,
}

impl Window<'_> {
    fn len(&self) -> usize {
        self.history.len() + usize::from(self.pending.is_some())
    }

    /// The window as a uint32 index array `[n]`, or `None` when it is empty.
    fn ids(&self, context_size: usize, vocab: usize) -> Result<Option<Array>, SampleError> {
        if self.len() == 0 {
            return Ok(None);
        }
        let wanted = if context_size == 0 {
            self.len()
        } else {
            context_size.min(self.len())
        };
        let from_history = wanted - usize::from(self.pending.is_some());
        let tail = &self.history[self.history.len() - from_history..];
        // Out-of-range indices are undefined behaviour in MLX's gather and scatter.
        if let Some(&token) = tail.iter().find(|&&t| t as usize >= vocab) {
            return Err(SampleError::TokenOutOfRange {
                token,
                vocab,
                what: "history",
            });
        }
        let host = Array::from_slice(tail, &[tail.len() as i32]);
        Ok(Some(match self.pending {
            None => host,
            Some(pending) if tail.is_empty() => {
                pending.reshape(&[1])?.as_dtype(mlx_rs::Dtype::Uint32)?
            }
            Some(pending) => concatenate(
                &[
                    host,
                    pending.reshape(&[1])?.as_dtype(mlx_rs::Dtype::Uint32)?,
                ],
                0,
            )?,
        }))
    }
}

impl LogitsProcessors {
    pub(crate) fn new(params: &SamplingParams) -> Self {
        let bias = (!params.logit_bias.is_empty()).then(|| {
            let ids: Vec<u32> = params.logit_bias.keys().copied().collect();
            let values: Vec<f32> = params.logit_bias.values().copied().collect();
            let max_id = ids.iter().copied().max().unwrap_or(0);
            let n = ids.len() as i32;
            (
                Array::from_slice(&ids, &[n]),
                Array::from_slice(&values, &[n]),
                max_id,
            )
        });
        // mlx-lm skips a penalty that is None or 0; a repetition penalty of 1 changes nothing.
        let repetition = params
            .repetition_penalty
            .filter(|&p| p != 0.0 && p != 1.0)
            .map(|p| (p, params.repetition_context_size));
        let additive = |p: f32, size: usize| (p != 0.0).then_some((p, size));
        Self {
            bias,
            repetition,
            presence: additive(params.presence_penalty, params.presence_context_size),
            frequency: additive(params.frequency_penalty, params.frequency_context_size),
        }
    }

    /// No penalty reads the history: at most a logit bias, which a batch can add as one row.
    pub(crate) fn is_bias_only(&self) -> bool {
        self.repetition.is_none() && self.presence.is_none() && self.frequency.is_none()
    }

    /// The logit bias as a dense `[1, vocab]` row of `dtype` (zero elsewhere), built the way
    /// `apply` adds it (so `logits + row` equals it); `None` without a bias.
    pub(crate) fn bias_row(
        &self,
        vocab: usize,
        dtype: mlx_rs::Dtype,
    ) -> Result<Option<Array>, SampleError> {
        let Some((ids, values, max_id)) = &self.bias else {
            return Ok(None);
        };
        if *max_id as usize >= vocab {
            return Err(SampleError::TokenOutOfRange {
                token: *max_id,
                vocab,
                what: "logit_bias",
            });
        }
        let zeros = mlx_rs::ops::zeros_dtype(&[1, vocab as i32], dtype)?;
        Ok(Some(scatter_add(&zeros, ids, values)?))
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.bias.is_none()
            && self.repetition.is_none()
            && self.presence.is_none()
            && self.frequency.is_none()
    }

    /// Apply every enabled processor to `logits` `[rows, vocab]`, in mlx-lm's order.
    pub(crate) fn apply(
        &self,
        logits: &Array,
        history: &[u32],
        pending: Option<&Array>,
    ) -> Result<Array, SampleError> {
        let vocab = logits.shape()[1] as usize;
        let window = Window { history, pending };
        let mut logits = logits.clone();
        if let Some((ids, values, max_id)) = &self.bias {
            if *max_id as usize >= vocab {
                return Err(SampleError::TokenOutOfRange {
                    token: *max_id,
                    vocab,
                    what: "logit_bias",
                });
            }
            logits = scatter_add(&logits, ids, values)?;
        }
        if let Some((penalty, size)) = self.repetition {
            if let Some(ids) = window.ids(size, vocab)? {
                logits = repetition_penalty(&logits, &ids, penalty)?;
            }
        }
        if let Some((penalty, size)) = self.presence {
            if let Some(ids) = window.ids(size, vocab)? {
                logits = presence_penalty(&logits, &ids, penalty)?;
            }
        }
        if let Some((penalty, size)) = self.frequency {
            if let Some(ids) = window.ids(size, vocab)? {
                let n = ids.shape()[0];
                let per_hit = full::<f32>(&[n], Array::from_f32(-penalty))?;
                logits = scatter_add(&logits, &ids, &per_hit)?;
            }
        }
        Ok(logits)
    }
}

/// `logits.at[:, ids].add(values)`: repeated ids accumulate (frequency penalty, logit bias).
fn scatter_add(logits: &Array, ids: &Array, values: &Array) -> Result<Array, SampleError> {
    let rows = logits.shape()[0];
    let n = ids.shape()[0];
    // A single-axis scatter wants updates shaped ids + logits-with-axis-1-of-size-1.
    let updates = broadcast_to(
        values.as_dtype(logits.dtype())?.reshape(&[n, 1, 1])?,
        &[n, rows, 1],
    )?;
    Ok(scatter_add_single(logits, ids, &updates, 1)?)
}

/// `logits[:, ids] = f(logits[:, ids])`: a scatter assignment, so a repeated id is changed once.
fn assign(logits: &Array, ids: &Array, values: &Array) -> Result<Array, SampleError> {
    let rows = logits.shape()[0];
    let n = ids.shape()[0];
    let ids = broadcast_to(ids.reshape(&[1, n])?, &[rows, n])?;
    Ok(put_along_axis(logits, &ids, values, 1)?)
}

/// Sign-aware multiplicative penalty (CTRL, arXiv:1909.05858): negative logits are multiplied by
/// the penalty, the others divided.
fn repetition_penalty(logits: &Array, ids: &Array, penalty: f32) -> Result<Array, SampleError> {
    let selected = take_axis(logits, ids, 1)?;
    let p = scalar(penalty, logits.dtype())?;
    let zero = scalar(0.0, logits.dtype())?;
    let penalised = select(
        selected.lt(&zero)?,
        selected.multiply(&p)?,
        selected.divide(&p)?,
    )?;
    assign(logits, ids, &penalised)
}

/// OpenAI `presence_penalty`: subtract the penalty once from each id present in the window.
fn presence_penalty(logits: &Array, ids: &Array, penalty: f32) -> Result<Array, SampleError> {
    let selected = take_axis(logits, ids, 1)?;
    let lowered = selected.subtract(scalar(penalty, logits.dtype())?)?;
    assign(logits, ids, &lowered)
}
