//! The gated delta rule (Yang et al. 2024) as MLX ops: per token and value head,
//! `S ← g·S; δ = (v − S·k)·β; S ← S + δ ⊗ k; y = S·q`, the state `[B, Hv, Dv, Dk]` in float32.
//! This sequential form is what the references compute on a Mac (their Metal kernel) and on
//! any backend for decode; it carries the state exactly across prefill chunks.
//! Reference: mlx-vlm `models/qwen3_5/gated_delta.py` (`_gated_delta_step_ops`,
//! `gated_delta_ops`, `compute_g`), mlx-lm `models/gated_delta.py`.

use mlx_rs::{ops, ops::indexing::IndexOp, Array, Dtype};

use crate::error::Result;

/// `g = exp(−exp(A_log) · softplus(a + dt_bias))` in float32 (`a + dt_bias` in the activations'
/// dtype first, as the reference adds them).
pub fn decay(a_log: &Array, a: &Array, dt_bias: &Array) -> Result<Array> {
    let shifted = ops::add(a, dt_bias)?;
    // mlx `nn.softplus(x)` = `logaddexp(x, 0)`, the 0 taking x's dtype.
    let softplus = ops::logaddexp(&shifted, Array::from_f32(0.0).as_dtype(shifted.dtype())?)?;
    let rate = ops::exp(a_log.as_dtype(Dtype::Float32)?)?;
    Ok(ops::exp(ops::negative(ops::multiply(&rate, &softplus)?)?)?)
}

/// One token for every head: q, k `[B, H, Dk]`, v `[B, H, Dv]`, g and beta `[B, H]`, state
/// `[B, H, Dv, Dk]` → (y `[B, H, Dv]` in q's dtype, new state).
fn step(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array)> {
    let state = ops::multiply(state, g.expand_dims_axes(&[-1, -2])?)?;
    let k_row = k.expand_dims(-2)?;
    let remembered = ops::multiply(&state, &k_row)?.sum_axis(-1, false)?;
    let delta = ops::multiply(ops::subtract(v, &remembered)?, beta.expand_dims(-1)?)?;
    let state = ops::add(&state, ops::multiply(&k_row, delta.expand_dims(-1)?)?)?;
    let y = ops::multiply(&state, q.expand_dims(-2)?)?.sum_axis(-1, false)?;
    Ok((y.as_dtype(q.dtype())?, state))
}

/// The recurrence over a chunk: q, k `[B, T, Hk, Dk]`, v `[B, T, Hv, Dv]`, g (float32) and beta
/// `[B, T, Hv]`, state `[B, Hv, Dv, Dk]` → (y `[B, T, Hv, Dv]`, state after the chunk). Value
/// head h reads key head `h / (Hv / Hk)`. Built lazily: the caller evaluates once per chunk.
pub fn gated_delta_ops(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array)> {
    let (len, key_heads) = (q.shape()[1], q.shape()[2]);
    let value_heads = v.shape()[2];
    let repeat = value_heads / key_heads;
    let (q, k) = if repeat > 1 {
        (
            Array::repeat_axis::<f32>(q.clone(), repeat, 2)?,
            Array::repeat_axis::<f32>(k.clone(), repeat, 2)?,
        )
    } else {
        (q.clone(), k.clone())
    };
    let mut state = state.clone();
    let mut ys = Vec::with_capacity(len as usize);
    for t in 0..len {
        let (y, next) = step(
            &q.index((.., t)),
            &k.index((.., t)),
            &v.index((.., t)),
            &g.index((.., t)),
            &beta.index((.., t)),
            &state,
        )?;
        ys.push(y);
        state = next;
    }
    Ok((ops::stack(&ys, 1)?, state))
}

/// The depthwise causal conv over `input` `[B, K − 1 + T, C]` (the cached window, then the
/// chunk) with `weight` `[C, K, 1]`: `out_t = Σ_j w[c, j] · input[t + j]` → `[B, T, C]`.
/// A bf16/fp16 decode step sums in float32 as mlx-vlm's `_qwen3_5_decode_depthwise_conv` does;
/// everything else is MLX's grouped conv1d.
pub fn causal_conv(input: &Array, weight: &Array) -> Result<Array> {
    let (window, channels) = (input.shape()[1], input.shape()[2]);
    let kernel = weight.shape()[1];
    let half = matches!(weight.dtype(), Dtype::Bfloat16 | Dtype::Float16);
    if window == kernel && half {
        let taps = weight
            .index((.., .., 0))
            .transpose()?
            .as_dtype(Dtype::Float32)?;
        let out = ops::multiply(input.as_dtype(Dtype::Float32)?, &taps)?.sum_axis(1, true)?;
        return Ok(out.as_dtype(input.dtype())?);
    }
    Ok(ops::conv1d(input, weight, 1, 0, 1, channels)?)
}

#[cfg(test)]
mod tests {
    use mlx_rs::random;

    use super::*;

    fn randn(shape: &[i32], seed: u64) -> Array {
        let key = random::key(seed).unwrap();
        random::normal::<f32>(shape, None, None, &key).unwrap()
    }

    fn host(a: &Array) -> Vec<f32> {
        let a = a.as_dtype(Dtype::Float32).unwrap();
        a.eval().unwrap();
        a.as_slice::<f32>().to_vec()
    }

    fn inputs(len: i32) -> [Array; 6] {
        let (b, hk, hv, dk, dv) = (1, 2, 4, 8, 4);
        let unit = |x: Array| {
            let norm =
                ops::sqrt(ops::multiply(&x, &x).unwrap().sum_axis(-1, true).unwrap()).unwrap();
            ops::divide(&x, &norm).unwrap()
        };
        let q = unit(randn(&[b, len, hk, dk], 1));
        let k = unit(randn(&[b, len, hk, dk], 2));
        let v = randn(&[b, len, hv, dv], 3);
        let g = ops::sigmoid(randn(&[b, len, hv], 4)).unwrap();
        let beta = ops::sigmoid(randn(&[b, len, hv], 5)).unwrap();
        let state = ops::multiply(randn(&[b, hv, dv, dk], 6), Array::from_f32(0.1)).unwrap();
        [q, k, v, g, beta, state]
    }

    /// The ops form against the rule written out on the host in f64.
    #[test]
    fn ops_form_equals_the_delta_rule_on_the_host() {
        let len = 5;
        let [q, k, v, g, beta, state] = inputs(len);
        let (y, out_state) = gated_delta_ops(&q, &k, &v, &g, &beta, &state).unwrap();
        let (hk, hv, dk, dv) = (2usize, 4usize, 8usize, 4usize);
        let (qh, kh, vh, gh, bh) = (host(&q), host(&k), host(&v), host(&g), host(&beta));
        let mut s: Vec<f64> = host(&state).iter().map(|&x| x as f64).collect();
        let (yh, sh) = (host(&y), host(&out_state));
        let mut worst = 0f64;
        for t in 0..len as usize {
            for h in 0..hv {
                let kv_head = h / (hv / hk);
                let qk = |src: &[f32], i: usize| src[(t * hk + kv_head) * dk + i] as f64;
                let at = |r: usize, c: usize| (h * dv + r) * dk + c;
                let (gt, bt) = (gh[t * hv + h] as f64, bh[t * hv + h] as f64);
                for r in 0..dv {
                    for c in 0..dk {
                        s[at(r, c)] *= gt;
                    }
                    let remembered: f64 = (0..dk).map(|c| s[at(r, c)] * qk(&kh, c)).sum();
                    let delta = (vh[(t * hv + h) * dv + r] as f64 - remembered) * bt;
                    for c in 0..dk {
                        s[at(r, c)] += qk(&kh, c) * delta;
                    }
                    let out: f64 = (0..dk).map(|c| s[at(r, c)] * qk(&qh, c)).sum();
                    worst = worst.max((out - yh[(t * hv + h) * dv + r] as f64).abs());
                }
            }
        }
        for (a, b) in s.iter().zip(&sh) {
            worst = worst.max((a - *b as f64).abs());
        }
        assert!(worst < 1e-5, "max difference {worst}");
    }

    /// Splitting a prompt into chunks carries the state exactly: 1 / 3 / whole agree.
    #[test]
    fn chunks_carry_the_state_exactly() {
        let len = 7;
        let [q, k, v, g, beta, state] = inputs(len);
        let (whole, whole_state) = gated_delta_ops(&q, &k, &v, &g, &beta, &state).unwrap();
        for chunk in [1, 3] {
            let mut state = state.clone();
            let mut ys = Vec::new();
            let mut start = 0;
            while start < len {
                let end = (start + chunk).min(len);
                let part = |x: &Array| x.index((.., start..end));
                let (y, next) = gated_delta_ops(
                    &part(&q),
                    &part(&k),
                    &part(&v),
                    &part(&g),
                    &part(&beta),
                    &state,
                )
                .unwrap();
                next.eval().unwrap();
                ys.push(y);
                state = next;
                start = end;
            }
            let chunked = ops::concatenate(&ys, 1).unwrap();
            assert_eq!(host(&chunked), host(&whole), "chunk {chunk}");
            assert_eq!(host(&state), host(&whole_state), "chunk {chunk}");
        }
    }

    /// The float32 decode conv equals MLX's conv1d on the same window (fp32 weights).
    #[test]
    fn decode_conv_equals_conv1d() {
        let input = randn(&[1, 4, 6], 7);
        let weight = randn(&[6, 4, 1], 8);
        let reference = ops::conv1d(&input, &weight, 1, 0, 1, 6).unwrap();
        let half = causal_conv(
            &input.as_dtype(Dtype::Bfloat16).unwrap(),
            &weight.as_dtype(Dtype::Bfloat16).unwrap(),
        )
        .unwrap();
        assert_eq!(half.shape(), &[1, 1, 6]);
        let diff = host(&reference)
            .iter()
            .zip(host(&half))
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 0.1, "bf16 decode conv off by {diff}");
    }
}
