//! The gated delta rule (Yang et al. 2024) as MLX ops: per token and value head,
//! `S ← g·S; δ = (v − S·k)·β; S ← S + δ ⊗ k; y = S·q`, the state `[B, Hv, Dv, Dk]` in float32.
//! The sequential form is what the references compute on a Mac (their Metal kernel) and on
//! any backend for decode; it carries the state exactly across prefill chunks. Long prefill
//! pieces take the chunked form (as mlx-vlm does without its kernel), equal up to float32
//! reassociation.
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
/// `[B, H, Dv, Dk]` → (y `[B, H, Dv]` in q's dtype, new state). Compiled (shapeless): the
/// elementwise work between its two reductions fuses, so a token costs a few kernels instead of
/// a dozen (decode and a speculative step's tokens are launch-bound on a GPU).
/// `MLX_DISABLE_COMPILE=1` runs the plain ops.
fn step(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array)> {
    let inputs = [q, k, v, g, beta, state].map(Array::clone);
    let outputs = STEP.with(|compiled| (compiled.borrow_mut())(&inputs))?;
    let [y, state]: [Array; 2] = outputs.try_into().map_err(|_| {
        crate::error::EngineError::InvalidRequest("the delta rule's step gave no pair".into())
    })?;
    Ok((y, state))
}

type CompiledStep = Box<
    dyn for<'a> FnMut(&'a [Array]) -> std::result::Result<Vec<Array>, mlx_rs::error::Exception>,
>;

thread_local! {
    // One compiled function per thread for its life: MLX caches the trace under its id.
    static STEP: std::cell::RefCell<CompiledStep> = std::cell::RefCell::new(Box::new(
        mlx_rs::transforms::compile::compile(
            |inputs: &[Array]| -> std::result::Result<Vec<Array>, mlx_rs::error::Exception> {
                let [q, k, v, g, beta, state] = inputs else {
                    unreachable!("the step is called with its six inputs")
                };
                let (y, state) = plain_step(q, k, v, g, beta, state)?;
                Ok(vec![y, state])
            },
            true,
        ),
    ));
}

fn plain_step(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> std::result::Result<(Array, Array), mlx_rs::error::Exception> {
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
    if let Some(result) = metal_kernel(q, k, v, g, beta, state) {
        return result;
    }
    if q.shape()[1] >= CHUNKED_FROM {
        return chunked_ops(q, k, v, g, beta, state);
    }
    sequential_ops(q, k, v, g, beta, state)
}

/// The state after the first `kept` steps of a speculative step whose recurrence inputs were
/// `[q, k, v, g, beta]` (`[B, T, ...]`), from `before`. `apply` (`[B, kept]` booleans) marks,
/// when rows keep different counts, the steps each row applies: a step left out neither decays
/// (g = 1) nor writes (β = 0), so the state passes it unchanged, bit for bit. Only the kept
/// steps run (one where every draft was rejected), with the step's own kernel and ops (the
/// Metal kernel on a Mac's GPU) and no model forward.
pub fn replay_kept(
    inputs: &[Array],
    before: &Array,
    kept: i32,
    apply: Option<&Array>,
) -> Result<Array> {
    let [q, k, v, g, beta] = inputs else {
        return Err(crate::error::EngineError::InvalidRequest(
            "a speculative step's recurrence needs q, k, v, g and beta".into(),
        ));
    };
    let first = |x: &Array| -> Array {
        match x.shape()[1] == kept {
            true => x.clone(),
            false => x.index((.., ..kept)),
        }
    };
    let (g, beta) = match apply {
        Some(apply) => {
            let apply = apply.expand_dims(-1)?;
            (
                ops::select(&apply, first(g), Array::from_f32(1.0).as_dtype(g.dtype())?)?,
                ops::select(
                    &apply,
                    first(beta),
                    Array::from_f32(0.0).as_dtype(beta.dtype())?,
                )?,
            )
        }
        None => (first(g), first(beta)),
    };
    let (_, state) = gated_delta_ops(&first(q), &first(k), &first(v), &g, &beta, before)?;
    Ok(state)
}

/// Prefill pieces at least this long take the chunked form elsewhere than on a Mac's GPU: it
/// replaces T small steps by a few dozen matmuls. Shorter pieces (decode, short turns, the
/// golden prompts) take the sequential steps, the form the references' goldens are made with.
pub const CHUNKED_FROM: i32 = 4 * CHUNK;

/// On a Mac's GPU one Metal kernel runs the whole chunk (checked against the ops form first);
/// None elsewhere, or where the kernel does not take the shapes.
#[allow(unused_variables)]
fn metal_kernel(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Option<Result<(Array, Array)>> {
    #[cfg(target_os = "macos")]
    if on_gpu() {
        return super::metal::try_apply(q, k, v, g, beta, state);
    }
    None
}

#[cfg(target_os = "macos")]
fn on_gpu() -> bool {
    mlx_rs::Device::try_default()
        .and_then(|device| device.get_type())
        .is_ok_and(|kind| matches!(kind, mlx_rs::DeviceType::Gpu))
}

/// The recurrence as MLX ops, one token at a time (the reference the kernel is checked with).
pub fn sequential_ops(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array)> {
    let (y, mut states) = sequential_states(q, k, v, g, beta, state)?;
    let last = states.pop().unwrap_or_else(|| state.clone());
    Ok((y, last))
}

/// A speculative step's recurrence: y and the state after each of its tokens (None on a Mac's
/// GPU, whose kernel gives only the last: the cache then replays the kept steps). Keeping every
/// token's state lets a rollback pick the kept one instead of running the steps again, which on
/// a launch-bound GPU costs as many kernels as the tokens kept.
pub fn speculative_ops(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array, Option<Vec<Array>>)> {
    if let Some(result) = metal_kernel(q, k, v, g, beta, state) {
        let (y, last) = result?;
        return Ok((y, last, None));
    }
    let (y, states) = sequential_states(q, k, v, g, beta, state)?;
    let last = states.last().cloned().unwrap_or_else(|| state.clone());
    Ok((y, last, Some(states)))
}

/// [`sequential_ops`]' y and the state after every token.
fn sequential_states(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Vec<Array>)> {
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
    let mut states: Vec<Array> = Vec::with_capacity(len as usize);
    let mut ys = Vec::with_capacity(len as usize);
    for t in 0..len {
        let (y, next) = step(
            &q.index((.., t)),
            &k.index((.., t)),
            &v.index((.., t)),
            &g.index((.., t)),
            &beta.index((.., t)),
            states.last().unwrap_or(state),
        )?;
        ys.push(y);
        states.push(next);
    }
    Ok((ops::stack(&ys, 1)?, states))
}

/// Tokens per block of the chunked form.
pub const CHUNK: i32 = 64;

/// The same recurrence computed a block of [`CHUNK`] tokens at a time (the WY form of the delta
/// rule, Yang et al. 2024): inside a block every update is written in terms of the block's
/// starting state, which turns the T sequential steps into matmuls, one forward substitution
/// over the block's rows (batched over all blocks and heads) and T / CHUNK state hand-overs.
/// Everything in float32; equal to [`sequential_ops`] up to float32 reassociation. mlx-vlm
/// prefills this way on backends without its Metal kernel (`gated_delta_chunked`).
///
/// With Γ_i the running product of the decays and u_j each token's effective write,
/// `S_i = Γ_i S_0 + Σ_{j≤i} (Γ_i/Γ_j) u_j k_jᵀ`, and the writes solve the unit lower-triangular
/// system `u_j + Σ_{l<j} β_j (Γ_j/Γ_l)(k_l·k_j) u_l = β_j (v_j − Γ_j S_0 k_j)`.
pub fn chunked_ops(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array)> {
    let [batch, len, key_heads, key_dim] = dims4(q);
    let [_, _, value_heads, value_dim] = dims4(v);
    let out_dtype = q.dtype();
    let repeat = value_heads / key_heads;
    let widen = |x: &Array| -> Result<Array> {
        let x = x.as_dtype(Dtype::Float32)?;
        Ok(if repeat > 1 {
            Array::repeat_axis::<f32>(x, repeat, 2)?
        } else {
            x
        })
    };
    let (mut q, mut k) = (widen(q)?, widen(k)?);
    let mut v = v.as_dtype(Dtype::Float32)?;
    let mut g = g.as_dtype(Dtype::Float32)?;
    let mut beta = beta.as_dtype(Dtype::Float32)?;
    // Padding tokens neither decay (g = 1) nor write (β = 0): the state passes them unchanged.
    let pad = (CHUNK - len % CHUNK) % CHUNK;
    if pad > 0 {
        let extend = |x: &Array, fill: f32| -> Result<Array> {
            let mut shape = x.shape().to_vec();
            shape[1] = pad;
            let tail = ops::full::<f32>(&shape, Array::from_f32(fill))?;
            Ok(ops::concatenate(&[x, &tail], 1)?)
        };
        q = extend(&q, 0.0)?;
        k = extend(&k, 0.0)?;
        v = extend(&v, 0.0)?;
        g = extend(&g, 1.0)?;
        beta = extend(&beta, 0.0)?;
    }
    let blocks = (len + pad) / CHUNK;
    // [B, T, H, D] → [B, H, blocks, C, D]; [B, T, H] → [B, H, blocks, C].
    let rows = |x: &Array, dim: i32| -> Result<Array> {
        Ok(x.reshape(&[batch, blocks, CHUNK, value_heads, dim])?
            .transpose_axes(&[0, 3, 1, 2, 4])?)
    };
    let per_token = |x: &Array| -> Result<Array> {
        Ok(x.reshape(&[batch, blocks, CHUNK, value_heads])?
            .transpose_axes(&[0, 3, 1, 2])?)
    };
    let (q, k, v) = (rows(&q, key_dim)?, rows(&k, key_dim)?, rows(&v, value_dim)?);
    let (g, beta) = (per_token(&g)?, per_token(&beta)?);

    // log Γ within each block; a decay that underflowed to 0 is held at 1e-6 so logs stay finite.
    let log_g = ops::log(ops::maximum(&g, Array::from_f32(1e-6))?)?;
    let log_cum = log_g.cumsum(-1, None, None)?;
    let cum = ops::exp(&log_cum)?;
    let inclusive = ops::tri::<f32>(CHUNK, None, Some(0))?;
    let strict = ops::tri::<f32>(CHUNK, None, Some(-1))?;
    // Γ_i / Γ_j for j ≤ i; above the diagonal the exponent is pinned low before exp (it would
    // overflow, and inf · 0 is NaN).
    let exponent = ops::subtract(log_cum.expand_dims(-1)?, log_cum.expand_dims(-2)?)?;
    let ratio = ops::exp(ops::select(
        &ops::gt(&inclusive, Array::from_f32(0.0))?,
        &exponent,
        Array::from_f32(-1e30),
    )?)?;
    let k_t = k.swap_axes(-1, -2)?;
    let beta_col = beta.expand_dims(-1)?;
    let coupling = ops::multiply(
        ops::multiply(&beta_col, &ratio)?,
        ops::multiply(ops::matmul(&k, &k_t)?, &strict)?,
    )?;
    // Right-hand sides solved together: β v (the writes' own part) and β Γ k (what the block's
    // starting state contributes, applied to S_0 below).
    let rhs = ops::concatenate(
        &[
            ops::multiply(&beta_col, &v)?,
            ops::multiply(ops::multiply(&beta, &cum)?.expand_dims(-1)?, &k)?,
        ],
        -1,
    )?;
    let solved = forward_substitute(&coupling, &rhs)?;
    let parts = solved.split_at_indices(&[value_dim], -1)?;
    let (writes, state_part) = (&parts[0], &parts[1]);
    let attend = ops::multiply(ops::multiply(&ratio, ops::matmul(&q, &k_t)?)?, &inclusive)?;
    let from_writes = ops::matmul(&attend, writes)?;
    let query_state = ops::subtract(
        ops::multiply(cum.expand_dims(-1)?, &q)?,
        ops::matmul(&attend, state_part)?,
    )?;
    let last = log_cum.index((.., .., .., (CHUNK - 1)..));
    let to_end = ops::exp(ops::subtract(&last, &log_cum)?)?;
    let decay_all = ops::exp(&last)?;

    let mut state = state.as_dtype(Dtype::Float32)?;
    let mut ys = Vec::with_capacity(blocks as usize);
    for block in 0..blocks {
        let at = |x: &Array| x.index((.., .., block));
        let start_t = state.swap_axes(-1, -2)?;
        ys.push(ops::add(
            at(&from_writes),
            ops::matmul(at(&query_state), &start_t)?,
        )?);
        let block_writes = ops::subtract(at(writes), ops::matmul(at(state_part), &start_t)?)?;
        let scaled = ops::multiply(at(&to_end).expand_dims(-1)?, &block_writes)?;
        state = ops::add(
            ops::multiply(at(&decay_all).expand_dims(-1)?, &state)?,
            ops::matmul(scaled.swap_axes(-1, -2)?, at(&k))?,
        )?;
    }
    let y = ops::stack(&ys, 2)?
        .transpose_axes(&[0, 2, 3, 1, 4])?
        .reshape(&[batch, len + pad, value_heads, value_dim])?
        .index((.., ..len))
        .as_dtype(out_dtype)?;
    Ok((y, state))
}

/// Solves `(I + L) x = rhs` for strictly lower-triangular `L` `[.., C, C]` row by row
/// (`x_i = rhs_i − L_i,<i · x_<i`), batched over the leading axes.
fn forward_substitute(lower: &Array, rhs: &Array) -> Result<Array> {
    let size = lower.shape()[lower.ndim() - 1];
    let mut solved = rhs.index((.., .., .., 0..1));
    for row in 1..size {
        let coefficients = lower.index((.., .., .., row..row + 1, ..row));
        let next = ops::subtract(
            rhs.index((.., .., .., row..row + 1)),
            ops::matmul(&coefficients, &solved)?,
        )?;
        solved = ops::concatenate(&[&solved, &next], -2)?;
    }
    Ok(solved)
}

fn dims4(x: &Array) -> [i32; 4] {
    let shape = x.shape();
    [shape[0], shape[1], shape[2], shape[3]]
}

/// A random input of the recurrence's shapes (batch 1, `len` tokens, value heads twice the key
/// heads, unit-norm q and k as the layer makes them, gates in (0, 1)): what the kernel's
/// first-use check and the tests run both forms on. `[q, k, v, g, beta, state]`.
pub fn sample_inputs(len: i32, key_dim: i32, value_dim: i32) -> Result<[Array; 6]> {
    let (key_heads, value_heads) = (2, 4);
    let randn = |shape: &[i32], seed: u64| -> Result<Array> {
        let key = mlx_rs::random::key(seed)?;
        Ok(mlx_rs::random::normal::<f32>(shape, None, None, &key)?)
    };
    let unit = |x: Array| -> Result<Array> {
        let norm = ops::sqrt(ops::multiply(&x, &x)?.sum_axis(-1, true)?)?;
        Ok(ops::divide(&x, &norm)?)
    };
    Ok([
        unit(randn(&[1, len, key_heads, key_dim], 1)?)?,
        unit(randn(&[1, len, key_heads, key_dim], 2)?)?,
        randn(&[1, len, value_heads, value_dim], 3)?,
        ops::sigmoid(randn(&[1, len, value_heads], 4)?)?,
        ops::sigmoid(randn(&[1, len, value_heads], 5)?)?,
        ops::multiply(
            randn(&[1, value_heads, value_dim, key_dim], 6)?,
            Array::from_f32(0.1),
        )?,
    ])
}

/// The depthwise conv's taps from mlx's conv1d weight `[C, K, 1]` (made once, at load): `K`
/// float32 vectors `[C]`, tap `j` weighing position `t + j` of the window.
pub fn conv_taps(weight: &Array) -> Result<Vec<Array>> {
    (0..weight.shape()[1])
        .map(|tap| Ok(weight.index((.., tap, 0)).as_dtype(Dtype::Float32)?))
        .collect()
}

/// `silu` of the depthwise causal conv over `input` `[B, K − 1 + T, C]` (the cached window,
/// then the chunk): `out_t = silu(Σ_j taps[j] · input[t + j])` → `[B, T, C]`. The sum runs in
/// float32 and rounds to the input's dtype once, before the SiLU, as mlx's conv1d (float32
/// accumulation) and then `nn.silu` do in the references (mlx-vlm's decode conv sums in float32
/// too). One compiled elementwise kernel over K shifted views instead of MLX's conv1d: on CUDA
/// that builds a cuDNN graph for every new input shape (each batch width, verify width and
/// prefill length), slow on first use and held in a cache of 128 shapes.
pub fn causal_conv_silu(input: &Array, taps: &[Array]) -> Result<Array> {
    let len = input.shape()[1] - (taps.len() as i32 - 1);
    let mut inputs: Vec<Array> = (0..taps.len() as i32)
        .map(|tap| input.index((.., tap..tap + len, ..)))
        .collect();
    inputs.extend(taps.iter().cloned());
    let mut outputs = CONV_SILU.with(|compiled| (compiled.borrow_mut())(&inputs))?;
    Ok(outputs.remove(0))
}

thread_local! {
    // Shapeless: every batch width, verify width and prefill length runs the same trace.
    static CONV_SILU: std::cell::RefCell<CompiledStep> = std::cell::RefCell::new(Box::new(
        mlx_rs::transforms::compile::compile(
            |inputs: &[Array]| -> std::result::Result<Vec<Array>, mlx_rs::error::Exception> {
                let (windows, taps) = inputs.split_at(inputs.len() / 2);
                Ok(vec![plain_conv_silu(windows, taps)?])
            },
            true,
        ),
    ));
}

fn plain_conv_silu(
    windows: &[Array],
    taps: &[Array],
) -> std::result::Result<Array, mlx_rs::error::Exception> {
    let mut sum = ops::multiply(windows[0].as_dtype(Dtype::Float32)?, &taps[0])?;
    for (window, tap) in windows.iter().zip(taps).skip(1) {
        sum = ops::add(&sum, ops::multiply(window.as_dtype(Dtype::Float32)?, tap)?)?;
    }
    let conv = sum.as_dtype(windows[0].dtype())?;
    ops::multiply(&conv, ops::sigmoid(&conv)?)
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
        let a = a.as_dtype(Dtype::Float32).unwrap().contiguous().unwrap();
        a.eval().unwrap();
        a.as_slice::<f32>().to_vec()
    }

    fn inputs(len: i32) -> [Array; 6] {
        sample_inputs(len, 8, 4).unwrap()
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

    /// The compiled step equals the plain ops at every shape it meets (shapeless: traced once,
    /// then run at other batch sizes and head counts), in float32 and with bf16 activations.
    #[test]
    fn compiled_step_equals_the_plain_ops() {
        for (batch, heads, dk, dv, dtype) in [
            (1, 4, 8, 4, Dtype::Float32),
            (3, 6, 16, 8, Dtype::Float32),
            (2, 4, 8, 4, Dtype::Bfloat16),
        ] {
            let q = randn(&[batch, heads, dk], 1).as_dtype(dtype).unwrap();
            let k = randn(&[batch, heads, dk], 2).as_dtype(dtype).unwrap();
            let v = randn(&[batch, heads, dv], 3).as_dtype(dtype).unwrap();
            let g = ops::sigmoid(randn(&[batch, heads], 4)).unwrap();
            let beta = ops::sigmoid(randn(&[batch, heads], 5)).unwrap();
            let state = randn(&[batch, heads, dv, dk], 6);
            let (y, next) = step(&q, &k, &v, &g, &beta, &state).unwrap();
            let (plain_y, plain_next) = plain_step(&q, &k, &v, &g, &beta, &state).unwrap();
            assert_eq!(y.dtype(), dtype);
            assert_eq!(y.shape(), plain_y.shape());
            assert_eq!(next.shape(), plain_next.shape());
            let worst = |a: &Array, b: &Array| {
                host(a)
                    .iter()
                    .zip(host(b))
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max)
            };
            assert!(worst(&next, &plain_next) < 1e-6, "{batch}x{heads} state");
            let tolerance = if dtype == Dtype::Float32 { 1e-6 } else { 1e-2 };
            assert!(worst(&y, &plain_y) < tolerance, "{batch}x{heads} y");
        }
    }

    /// A rollback's two forms agree: replaying the kept steps (a Mac's GPU kernel keeps only
    /// the last state) gives, bit for bit, the state the sequential form kept after that
    /// token, for every count kept alike and for rows keeping different counts.
    #[test]
    fn replayed_steps_equal_the_kept_states() {
        let len = 4;
        let [q, k, v, g, beta, state] = inputs(len);
        // A second row whose values and state differ.
        let pair = |x: &Array, other: Array| ops::concatenate(&[x.clone(), other], 0).unwrap();
        let v = pair(&v, ops::negative(&v).unwrap());
        let state = pair(
            &state,
            ops::multiply(&state, Array::from_f32(-2.0)).unwrap(),
        );
        let (q, k, g, beta) = (
            pair(&q, q.clone()),
            pair(&k, k.clone()),
            pair(&g, g.clone()),
            pair(&beta, beta.clone()),
        );
        let (_, last, states) = speculative_ops(&q, &k, &v, &g, &beta, &state).unwrap();
        let states = states.expect("the sequential form keeps every token's state");
        assert_eq!(states.len(), len as usize);
        assert_eq!(host(&last), host(&states[len as usize - 1]));
        let inputs = [q, k, v, g, beta];
        for kept in 1..=len {
            let replayed = replay_kept(&inputs, &state, kept, None).unwrap();
            assert_eq!(
                host(&replayed),
                host(&states[kept as usize - 1]),
                "kept {kept}"
            );
        }
        // Row 0 keeps 3, row 1 keeps 1: a mask over the 3 steps replayed.
        let apply = Array::from_slice(&[true, true, true, true, false, false], &[2, 3]);
        let replayed = replay_kept(&inputs, &state, 3, Some(&apply)).unwrap();
        let row = |x: &Array, b: i32| host(&x.index(b..b + 1));
        assert_eq!(row(&replayed, 0), row(&states[2], 0));
        assert_eq!(row(&replayed, 1), row(&states[0], 1));
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

    /// The chunked form equals the sequential one (float32 reassociation only), across a block
    /// boundary, with padding, and carrying a starting state; bf16 inputs come back as bf16.
    #[test]
    fn chunked_form_equals_the_sequential_steps() {
        for len in [5, 64, 150] {
            let [q, k, v, g, beta, state] = inputs(len);
            let (y, out) = sequential_ops(&q, &k, &v, &g, &beta, &state).unwrap();
            let (yc, outc) = chunked_ops(&q, &k, &v, &g, &beta, &state).unwrap();
            assert_eq!(yc.shape(), y.shape());
            let worst = |a: &Array, b: &Array| {
                host(a)
                    .iter()
                    .zip(host(b))
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max)
            };
            let (dy, ds) = (worst(&y, &yc), worst(&out, &outc));
            assert!(dy < 1e-4 && ds < 1e-4, "len {len}: y {dy}, state {ds}");
        }
        let [q, k, v, g, beta, state] = inputs(70);
        let half = |x: &Array| x.as_dtype(Dtype::Bfloat16).unwrap();
        let (y, _) =
            chunked_ops(&half(&q), &half(&k), &half(&v), &g, &half(&beta), &state).unwrap();
        assert_eq!(y.dtype(), Dtype::Bfloat16);
    }

    /// The compiled conv + SiLU equals MLX's conv1d then SiLU (what mlx-lm and mlx-vlm run) at
    /// a decode window, verify widths and a prefill piece, two rows: within float32 rounding in
    /// float32, within one bf16 rounding in bf16.
    #[test]
    fn conv_silu_equals_conv1d_then_silu() {
        let channels = 6;
        let weight = randn(&[channels, 4, 1], 8);
        for (len, seed) in [(1, 1), (2, 2), (5, 3), (70, 4)] {
            let input = randn(&[2, 3 + len, channels], 10 + seed);
            for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                let (input, weight) = (
                    input.as_dtype(dtype).unwrap(),
                    weight.as_dtype(dtype).unwrap(),
                );
                let conv = ops::conv1d(
                    input.as_dtype(Dtype::Float32).unwrap(),
                    weight.as_dtype(Dtype::Float32).unwrap(),
                    1,
                    0,
                    1,
                    channels,
                )
                .unwrap()
                .as_dtype(dtype)
                .unwrap();
                let reference = ops::multiply(&conv, ops::sigmoid(&conv).unwrap()).unwrap();
                let taps = conv_taps(&weight).unwrap();
                let fused = causal_conv_silu(&input, &taps).unwrap();
                assert_eq!(fused.shape(), &[2, len, channels]);
                assert_eq!(fused.dtype(), dtype);
                let tolerance = if dtype == Dtype::Float32 { 1e-5 } else { 2e-2 };
                let diff = host(&reference)
                    .iter()
                    .zip(host(&fused))
                    .map(|(a, b)| (a - b).abs() / a.abs().max(1.0))
                    .fold(0f32, f32::max);
                assert!(diff < tolerance, "{dtype:?}, {len} tokens: off by {diff}");
            }
        }
    }
}
