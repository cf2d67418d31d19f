//! The sampling filters of mlx-lm 0.32.2 `sample_utils.py` (`apply_top_p`, `apply_min_p`,
//! `apply_top_k`, `greedy_sampler`, the temperature of `categorical_sampling`; its draw is in
//! `random.rs`), op for op so the outputs match its goldens. Each takes log-probabilities `[rows, vocab]` and returns them with the dropped tokens
//! set to `-inf`.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::indexing::{argmax_axis, put_along_axis, take_along_axis};
use mlx_rs::ops::{argpartition_axis, cumsum, exp, select, sort_axis};
use mlx_rs::{Array, Dtype};

use super::SampleError;

/// A scalar in `dtype`, the way a Python float stays "weak" next to an MLX array (a bf16 row
/// times 1.3 stays bf16).
pub(crate) fn scalar(value: f32, dtype: Dtype) -> Result<Array, SampleError> {
    Ok(Array::from_f32(value).as_dtype(dtype)?)
}

fn vocab_of(logprobs: &Array) -> i32 {
    *logprobs.shape().last().unwrap_or(&0)
}

/// `logits - logsumexp(logits)` along the vocabulary, as `generate_step` computes it.
pub fn log_softmax(logits: &Array) -> Result<Array, SampleError> {
    Ok(logits.subtract(logits.logsumexp_axis(-1, true)?)?)
}

/// mlx-lm `greedy_sampler`: the argmax of each row, uint32.
pub fn greedy(logprobs: &Array) -> Result<Array, SampleError> {
    Ok(argmax_axis(logprobs, -1, false)?)
}

/// mlx-lm `apply_top_p`: keep the smallest set of most likely tokens whose mass reaches `top_p`
/// (ties with the threshold are kept). The mass is summed in float32 whatever the input dtype.
pub fn apply_top_p(logprobs: &Array, top_p: f32) -> Result<Array, SampleError> {
    let sorted = sort_axis(logprobs, -1)?;
    let probs = exp(sorted.as_dtype(Dtype::Float32)?)?;
    // mass strictly above each sorted position (reverse, exclusive cumulative sum)
    let mass_above = cumsum(&probs, -1, true, false)?;
    let total = mass_above
        .try_index((.., ..1))?
        .add(probs.try_index((.., ..1))?)?;
    let limit = total.multiply(Array::from_f32(top_p))?;
    let num_dropped = mass_above.ge(&limit)?.sum_axis(-1, true)?;
    let threshold = take_along_axis(&sorted, &num_dropped, -1)?;
    mask_where(&logprobs.lt(&threshold)?, logprobs)
}

/// mlx-lm `apply_min_p`: drop tokens less likely than `min_p` times the top token, but never the
/// `min_tokens_to_keep` most likely ones.
pub fn apply_min_p(
    logprobs: &Array,
    min_p: f32,
    min_tokens_to_keep: usize,
) -> Result<Array, SampleError> {
    let vocab = vocab_of(logprobs);
    let top = logprobs.max_axis(-1, true)?;
    // Python adds `math.log(min_p)` (a double) as a weak scalar.
    let log_min_p = (min_p as f64).ln() as f32;
    let scaled_min_p = top.add(scalar(log_min_p, logprobs.dtype())?)?;
    let mut remove = logprobs.lt(&scaled_min_p)?;
    if min_tokens_to_keep > 1 {
        if min_tokens_to_keep as i64 >= vocab as i64 {
            return Ok(logprobs.clone());
        }
        let keep = min_tokens_to_keep as i32;
        let top_indices = argpartition_axis(logprobs, vocab - keep, -1)?;
        let top_indices = top_indices.try_index((.., (vocab - keep)..))?;
        remove = put_along_axis(&remove, &top_indices, Array::from_bool(false), -1)?;
    }
    mask_where(&remove, logprobs)
}

/// mlx-lm `apply_top_k`: keep the `top_k` most likely tokens. mlx-lm raises for `top_k >= vocab`;
/// keeping every token is what that request means, so that is a no-op here.
pub fn apply_top_k(logprobs: &Array, top_k: usize) -> Result<Array, SampleError> {
    let vocab = vocab_of(logprobs);
    if top_k == 0 || top_k as i64 >= vocab as i64 {
        return Ok(logprobs.clone());
    }
    let k = top_k as i32;
    let order = argpartition_axis(logprobs.negative()?, k - 1, -1)?;
    let mask_idx = order.try_index((.., k..))?;
    let neg_inf = scalar(f32::NEG_INFINITY, logprobs.dtype())?;
    Ok(put_along_axis(logprobs, &mask_idx, &neg_inf, -1)?)
}

/// `logprobs * (1/temp)`; the reciprocal is taken in double precision like Python's `1.0 / temp`.
pub fn temperature_scaled(logprobs: &Array, temperature: f32) -> Result<Array, SampleError> {
    let inv = (1.0 / temperature as f64) as f32;
    Ok(logprobs.multiply(scalar(inv, logprobs.dtype())?)?)
}

fn mask_where(mask: &Array, logprobs: &Array) -> Result<Array, SampleError> {
    let neg_inf = scalar(f32::NEG_INFINITY, logprobs.dtype())?;
    Ok(select(mask, &neg_inf, logprobs)?)
}
