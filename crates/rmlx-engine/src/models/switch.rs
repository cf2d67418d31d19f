//! The mixture-of-experts layer every MoE family shares: experts stacked on axis 0 and run
//! through `gather_mm` / `gather_qmm` so a token reads only its chosen experts' weights, with
//! the sorted-indices path for long inputs, plus the softmax top-k router of the Qwen families.
//! Reference: mlx-lm `models/switch_layers.py` (SwitchLinear, SwitchGLU, _gather_sort) and
//! `models/qwen3_moe.py` (Qwen3MoeSparseMoeBlock).

use mlx_rs::{ops, ops::indexing::IndexOp, Array};

use crate::{
    config::QuantizationConfig,
    error::Result,
    nn::{quant_spec, swiglu, Linear, QuantWeights},
    quant,
    weights::{DtypeKind, WeightStore},
};

/// `[experts, out, in]` weights, dense or packed in any MLX quantization mode.
pub enum SwitchLinear {
    Dense { weight: Array },
    Quantized { packed: QuantWeights },
}

impl SwitchLinear {
    /// Takes `{prefix}.weight` (+ scales/biases when quantized) shaped `[experts, out, in]`.
    pub fn load(
        store: &mut WeightStore,
        quantization: Option<&QuantizationConfig>,
        prefix: &str,
        experts: i32,
        in_dim: i32,
        out_dim: i32,
    ) -> Result<Self> {
        Ok(match quant_spec(store, quantization, prefix)? {
            Some(spec) => Self::Quantized {
                packed: QuantWeights::load_stacked(
                    store,
                    prefix,
                    &[experts],
                    out_dim,
                    in_dim,
                    spec,
                )?,
            },
            None => Self::Dense {
                weight: store.take(
                    &format!("{prefix}.weight"),
                    &[experts, out_dim, in_dim],
                    DtypeKind::Float,
                )?,
            },
        })
    }

    /// Dense experts from a stacked array the family built at load time (HF per-expert files).
    pub fn dense(weight: Array) -> Self {
        Self::Dense { weight }
    }

    /// `x` `[..., 1, in]` through the experts `indices` `[...]` → `[..., 1, out]`.
    fn forward(&self, x: &Array, indices: &Array, sorted: bool) -> Result<Array> {
        Ok(match self {
            Self::Dense { weight } => {
                quant::gather_mm(x, &weight.swap_axes(-1, -2)?, indices, sorted)?
            }
            Self::Quantized { packed } => quant::gather_qmm(
                x,
                &packed.weight,
                &packed.scales,
                packed.biases.as_ref(),
                indices,
                sorted,
                packed.spec,
            )?,
        })
    }
}

/// The activation between an expert's gate and up projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GluActivation {
    /// `silu(gate) * up` (Qwen).
    Silu,
    /// `gelu_approx(gate) * up` (Gemma's `gelu_pytorch_tanh`).
    GeluApprox,
}

/// Gated experts: `down(act(gate(x)) * up(x))` for each of a token's top-k experts.
pub struct SwitchGlu {
    pub gate_proj: SwitchLinear,
    pub up_proj: SwitchLinear,
    pub down_proj: SwitchLinear,
    pub activation: GluActivation,
}

/// mlx-lm sorts the (token, expert) pairs by expert once there are this many, so each expert's
/// weights are read in one run (prefill); decode keeps token order.
const SORT_THRESHOLD: usize = 64;

impl SwitchGlu {
    /// `x` `[B, L, hidden]`, `indices` `[B, L, k]` → `[B, L, k, hidden]` (not yet weighted).
    pub fn forward(&self, x: &Array, indices: &Array) -> Result<Array> {
        let x = x.expand_dims_axes(&[-2, -3])?;
        let sort = indices.size() >= SORT_THRESHOLD;
        let (x, idx, inverse) = if sort {
            let top_k = indices.shape()[indices.ndim() - 1];
            let flat = indices.flatten(None, None)?;
            let order = ops::argsort_axis(&flat, 0)?;
            let inverse = ops::argsort_axis(&order, 0)?;
            let rows = ops::floor_divide(&order, Array::from_int(top_k))?;
            let tokens = x.flatten(0, -3)?.take_axis(&rows, 0)?;
            (tokens, flat.take_axis(&order, 0)?, Some(inverse))
        } else {
            (x, indices.clone(), None)
        };
        let up = self.up_proj.forward(&x, &idx, sort)?;
        let gate = self.gate_proj.forward(&x, &idx, sort)?;
        let hidden = match self.activation {
            GluActivation::Silu => swiglu(&gate, &up)?,
            GluActivation::GeluApprox => ops::multiply(crate::nn::gelu_approx(&gate)?, &up)?,
        };
        let mut out = self.down_proj.forward(&hidden, &idx, sort)?;
        if let Some(inverse) = inverse {
            out = out.take_axis(&inverse, 0)?;
            let mut shape = indices.shape().to_vec();
            shape.extend_from_slice(&out.shape()[1..]);
            out = out.reshape(&shape)?;
        }
        Ok(out.squeeze_axes(&[-2])?)
    }
}

/// The Qwen MoE router: softmax over the experts (precise), the top-k, optionally renormalised.
pub struct SoftmaxTopK {
    pub gate: Linear,
    pub experts: i32,
    pub top_k: i32,
    pub normalize: bool,
}

impl SoftmaxTopK {
    /// `(indices [B, L, k], scores [B, L, k])` in the router's dtype.
    pub fn route(&self, x: &Array) -> Result<(Array, Array)> {
        let gates = ops::softmax_axis(&self.gate.forward(x)?, -1, true)?;
        let first = self.experts - self.top_k;
        let indices = ops::argpartition_axis(&gates, first, -1)?.index((.., .., first..));
        let mut scores = gates.take_along_axis(&indices, -1)?;
        if self.normalize {
            scores = ops::divide(&scores, scores.sum_axis(-1, true)?)?;
        }
        Ok((indices, scores))
    }
}

/// Experts' outputs `[B, L, k, hidden]` weighted by `scores` `[B, L, k]` and summed, kept in
/// the experts' dtype (mlx-lm's `(y * scores[..., None]).sum(-2).astype(y.dtype)`).
pub fn combine(expert_out: &Array, scores: &Array) -> Result<Array> {
    let weighted = ops::multiply(expert_out, scores.expand_dims(-1)?)?;
    Ok(weighted.sum_axis(-2, false)?.as_dtype(expert_out.dtype())?)
}
