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
            GluActivation::GeluApprox => crate::nn::geglu(&gate, &up)?,
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

#[cfg(test)]
mod tests {
    use mlx_rs::{random, Dtype};

    use super::*;
    use crate::quant::{QuantMode, QuantSpec};

    fn max_diff(a: &Array, b: &Array) -> f32 {
        let diff = ops::abs(ops::subtract(a, b).unwrap())
            .unwrap()
            .max(None)
            .unwrap();
        diff.eval().unwrap();
        diff.item_exact::<f32>()
    }

    /// Quantized experts through `gather_qmm` equal the dequantized experts through
    /// `gather_mm`, in every mode, on the decode (unsorted) and prefill (sorted) paths.
    #[test]
    fn quantized_experts_equal_their_dequantized_weights_in_every_mode() {
        let (experts, hidden, inter) = (6, 64, 64);
        let key = random::key(11).unwrap();
        let weights = |seed: u64, out: i32, inp: i32| {
            let key = random::key(seed).unwrap();
            random::normal::<f32>(&[experts, out, inp], None, None, &key).unwrap()
        };
        let x = random::normal::<f32>(&[1, 24, hidden], None, None, &key).unwrap();
        let indices = random::randint::<_, i32>(0, experts, &[1, 24, 3], &key).unwrap();
        for mode in [
            QuantMode::Affine,
            QuantMode::Mxfp4,
            QuantMode::Mxfp8,
            QuantMode::Nvfp4,
        ] {
            let spec = QuantSpec::defaults(mode);
            let mut quantized = Vec::new();
            let mut dense = Vec::new();
            for (seed, (out, inp)) in [(inter, hidden), (inter, hidden), (hidden, inter)]
                .into_iter()
                .enumerate()
            {
                let w = weights(seed as u64 + 1, out, inp);
                let packed = quant::quantize(&w, spec).unwrap();
                let restored =
                    quant::dequantize(&packed.weight, &packed.scales, packed.biases.as_ref(), spec)
                        .unwrap()
                        .as_dtype(Dtype::Float32)
                        .unwrap();
                dense.push(SwitchLinear::dense(restored));
                quantized.push(SwitchLinear::Quantized {
                    packed: QuantWeights {
                        weight: packed.weight,
                        scales: packed.scales,
                        biases: packed.biases,
                        spec,
                    },
                });
            }
            let glu = |mut layers: Vec<SwitchLinear>| SwitchGlu {
                down_proj: layers.pop().unwrap(),
                up_proj: layers.pop().unwrap(),
                gate_proj: layers.pop().unwrap(),
                activation: GluActivation::Silu,
            };
            let (quantized, dense) = (glu(quantized), glu(dense));
            // 24 tokens × 3 experts = 72 pairs: the sorted path; one token: the unsorted one.
            for (x, indices) in [
                (x.clone(), indices.clone()),
                (x.index((.., ..1, ..)), indices.index((.., ..1, ..))),
            ] {
                let want = dense.forward(&x, &indices).unwrap();
                let got = quantized.forward(&x, &indices).unwrap();
                assert_eq!(got.shape(), &[1, x.shape()[1], 3, hidden]);
                let diff = max_diff(&got, &want);
                assert!(diff < 1e-3, "{mode:?}: {diff}");
            }
        }
    }

    /// The sorted (prefill) path and the token-order (decode) path compute the same rows.
    #[test]
    fn sorted_and_unsorted_paths_agree_per_token() {
        let key = random::key(5).unwrap();
        let (experts, hidden) = (8, 32);
        let glu = SwitchGlu {
            gate_proj: SwitchLinear::dense(
                random::normal::<f32>(&[experts, 16, hidden], None, None, &key).unwrap(),
            ),
            up_proj: SwitchLinear::dense(
                random::normal::<f32>(&[experts, 16, hidden], None, None, &random::key(6).unwrap())
                    .unwrap(),
            ),
            down_proj: SwitchLinear::dense(
                random::normal::<f32>(&[experts, hidden, 16], None, None, &random::key(7).unwrap())
                    .unwrap(),
            ),
            activation: GluActivation::GeluApprox,
        };
        let x = random::normal::<f32>(&[1, 40, hidden], None, None, &key).unwrap();
        let indices = random::randint::<_, i32>(0, experts, &[1, 40, 2], &key).unwrap();
        let together = glu.forward(&x, &indices).unwrap();
        for token in [0, 17, 39] {
            let alone = glu
                .forward(
                    &x.index((.., token..token + 1, ..)),
                    &indices.index((.., token..token + 1, ..)),
                )
                .unwrap();
            let diff = max_diff(&alone, &together.index((.., token..token + 1, .., ..)));
            assert!(diff < 1e-4, "token {token}: {diff}");
        }
    }
}
