//! Layers shared by every family: Linear and Embedding (dense or quantized in any mode) and
//! RMSNorm. Reference: mlx `nn/layers/{linear,embedding,quantized,normalization}.py`.

use mlx_rs::{fast, ops, ops::indexing::IndexOp, Array};

use crate::{
    config::QuantizationConfig,
    error::Result,
    quant::{self, QuantSpec},
    weights::{DtypeKind, WeightStore},
};

/// Packed weights of a quantized layer with `rows` outputs over `cols` inputs.
pub struct QuantWeights {
    pub weight: Array,
    pub scales: Array,
    pub biases: Option<Array>,
    pub spec: QuantSpec,
}

impl QuantWeights {
    fn load(
        store: &mut WeightStore,
        prefix: &str,
        rows: i32,
        cols: i32,
        spec: QuantSpec,
    ) -> Result<Self> {
        Self::load_stacked(store, prefix, &[], rows, cols, spec)
    }

    /// Like `load` with leading dims before `[rows, cols]` (MoE experts stacked on axis 0).
    pub(crate) fn load_stacked(
        store: &mut WeightStore,
        prefix: &str,
        lead: &[i32],
        rows: i32,
        cols: i32,
        spec: QuantSpec,
    ) -> Result<Self> {
        let packed = cols * spec.bits / 32;
        let groups = cols / spec.group_size;
        let fp_mode = !spec.mode.has_biases();
        let shape = |last: i32| [lead, &[rows, last]].concat();
        let weight = store.take(
            &format!("{prefix}.weight"),
            &shape(packed),
            DtypeKind::Uint32,
        )?;
        let scales = store.take(
            &format!("{prefix}.scales"),
            &shape(groups),
            DtypeKind::Scales { fp_mode },
        )?;
        let biases = if fp_mode {
            None
        } else {
            // Same dtype rule as affine scales; not counted as parameters.
            Some(store.take(
                &format!("{prefix}.biases"),
                &shape(groups),
                DtypeKind::Scales { fp_mode },
            )?)
        };
        let copies: u64 = lead.iter().map(|&dim| dim as u64).product();
        store.count_parameters(copies * rows as u64 * cols as u64);
        Ok(Self {
            weight,
            scales,
            biases,
            spec,
        })
    }
}

/// mlx-lm quantizes a layer exactly when the config has a quantization block and the
/// checkpoint carries `{path}.scales` (and the per-layer entry is not `false`).
pub(crate) fn quant_spec(
    store: &WeightStore,
    quantization: Option<&QuantizationConfig>,
    prefix: &str,
) -> Result<Option<QuantSpec>> {
    match quantization {
        Some(config) if store.contains(&format!("{prefix}.scales")) => config.spec_for(prefix),
        _ => Ok(None),
    }
}

pub enum Linear {
    Dense {
        weight: Array,
        bias: Option<Array>,
    },
    Quantized {
        packed: QuantWeights,
        bias: Option<Array>,
    },
}

impl Linear {
    pub fn load(
        store: &mut WeightStore,
        quantization: Option<&QuantizationConfig>,
        prefix: &str,
        in_dim: i32,
        out_dim: i32,
        has_bias: bool,
    ) -> Result<Self> {
        let bias = if has_bias {
            Some(store.take(&format!("{prefix}.bias"), &[out_dim], DtypeKind::Float)?)
        } else {
            None
        };
        Ok(match quant_spec(store, quantization, prefix)? {
            Some(spec) => Linear::Quantized {
                packed: QuantWeights::load(store, prefix, out_dim, in_dim, spec)?,
                bias,
            },
            None => Linear::Dense {
                weight: store.take(
                    &format!("{prefix}.weight"),
                    &[out_dim, in_dim],
                    DtypeKind::Float,
                )?,
                bias,
            },
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (out, bias) = match self {
            // mlx's nn.Linear adds the bias inside the matmul (one rounding in bf16).
            Linear::Dense {
                weight,
                bias: Some(bias),
            } => return Ok(ops::addmm(bias, x, ops::transpose(weight)?, 1.0, 1.0)?),
            Linear::Dense { weight, bias } => (ops::matmul(x, ops::transpose(weight)?)?, bias),
            Linear::Quantized { packed, bias } => (
                quant::quantized_matmul(
                    x,
                    &packed.weight,
                    &packed.scales,
                    packed.biases.as_ref(),
                    true,
                    packed.spec,
                )?,
                bias,
            ),
        };
        Ok(match bias {
            Some(bias) => ops::add(&out, bias)?,
            None => out,
        })
    }
}

pub enum Embedding {
    Dense { weight: Array },
    Quantized { packed: QuantWeights },
}

impl Embedding {
    pub fn load(
        store: &mut WeightStore,
        quantization: Option<&QuantizationConfig>,
        prefix: &str,
        vocab: i32,
        dim: i32,
    ) -> Result<Self> {
        Ok(match quant_spec(store, quantization, prefix)? {
            Some(spec) => Embedding::Quantized {
                packed: QuantWeights::load(store, prefix, vocab, dim, spec)?,
            },
            None => Embedding::Dense {
                weight: store.take(&format!("{prefix}.weight"), &[vocab, dim], DtypeKind::Float)?,
            },
        })
    }

    /// Rows for `ids` ([B, L] → [B, L, dim]). Quantized tables take the packed rows first and
    /// dequantize only those: O(seq) work and memory, never a vocab×seq product.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        match self {
            Embedding::Dense { weight } => Ok(weight.take_axis(ids, 0)?),
            Embedding::Quantized { packed } => {
                let weight = packed.weight.take_axis(ids, 0)?;
                let scales = packed.scales.take_axis(ids, 0)?;
                let biases = packed
                    .biases
                    .as_ref()
                    .map(|b| b.take_axis(ids, 0))
                    .transpose()?;
                Ok(quant::dequantize(
                    &weight,
                    &scales,
                    biases.as_ref(),
                    packed.spec,
                )?)
            }
        }
    }

    /// The tied output projection `x @ table.T`, through quantized matmul when packed.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        match self {
            Embedding::Dense { weight } => Ok(ops::matmul(x, ops::transpose(weight)?)?),
            Embedding::Quantized { packed } => Ok(quant::quantized_matmul(
                x,
                &packed.weight,
                &packed.scales,
                packed.biases.as_ref(),
                true,
                packed.spec,
            )?),
        }
    }
}

pub struct RmsNorm {
    weight: Array,
    eps: f32,
}

impl RmsNorm {
    pub fn load(store: &mut WeightStore, prefix: &str, dim: i32, eps: f32) -> Result<Self> {
        let weight = store.take(&format!("{prefix}.weight"), &[dim], DtypeKind::Float)?;
        Ok(Self { weight, eps })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(fast::rms_norm(x, Some(&self.weight), self.eps)?)
    }
}

/// SwiGLU's gate: silu(gate) * up.
pub fn swiglu(gate: &Array, up: &Array) -> Result<Array> {
    let silu = ops::multiply(gate, ops::sigmoid(gate)?)?;
    Ok(ops::multiply(&silu, up)?)
}

/// LayerNorm with weight and bias (vision towers).
pub struct LayerNorm {
    weight: Array,
    bias: Array,
    eps: f32,
}

impl LayerNorm {
    pub fn load(store: &mut WeightStore, prefix: &str, dim: i32, eps: f32) -> Result<Self> {
        let weight = store.take(&format!("{prefix}.weight"), &[dim], DtypeKind::Float)?;
        let bias = store.take(&format!("{prefix}.bias"), &[dim], DtypeKind::Float)?;
        Ok(Self { weight, bias, eps })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(fast::layer_norm(x, &self.weight, &self.bias, self.eps)?)
    }
}

/// A Python float in an mlx expression is a weak scalar: it takes the array's dtype. (mlx-rs's
/// `nn::gelu*` use f32 constants, which lift a bf16 tower to f32 and moved the 4-bit
/// checkpoint's logits by ~0.5 against mlx-vlm.)
pub fn scalar(value: f64, like: &Array) -> Result<Array> {
    Ok(Array::from_f32(value as f32).as_dtype(like.dtype())?)
}

/// mlx `nn.gelu`: `x * (1 + erf(x / sqrt(2))) / 2`.
pub fn gelu(x: &Array) -> Result<Array> {
    let inner = ops::erf(ops::divide(x, scalar(std::f64::consts::SQRT_2, x)?)?)?;
    let out = ops::multiply(x, ops::add(scalar(1.0, x)?, &inner)?)?;
    Ok(ops::divide(&out, scalar(2.0, x)?)?)
}

/// mlx `nn.gelu_approx`: `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))`.
pub fn gelu_approx(x: &Array) -> Result<Array> {
    let cubic = ops::multiply(scalar(0.044715, x)?, ops::power(x, scalar(3.0, x)?)?)?;
    let inner = ops::multiply(
        scalar((2.0 / std::f64::consts::PI).sqrt(), x)?,
        ops::add(x, &cubic)?,
    )?;
    let half_x = ops::multiply(scalar(0.5, x)?, x)?;
    Ok(ops::multiply(
        &half_x,
        ops::add(scalar(1.0, x)?, ops::tanh(&inner)?)?,
    )?)
}

/// `concat(-x2, x1)` over the last axis (the non-interleaved rotary pairing).
pub fn rotate_half(x: &Array) -> Result<Array> {
    let half = x.shape()[x.ndim() - 1] / 2;
    let x1 = x.index((.., .., .., ..half));
    let x2 = x.index((.., .., .., half..));
    Ok(ops::concatenate(&[ops::negative(&x2)?, x1], -1)?)
}

/// `fast::rope` at a cache's offset: one number for a single sequence, one per row for a
/// padded batch (MLX rotates row `b` from `offset[b]`).
pub fn rope(
    x: &Array,
    dims: i32,
    traditional: bool,
    base: Option<f32>,
    scale: f32,
    offset: &crate::cache::RopeOffset,
    freqs: Option<&Array>,
) -> Result<Array> {
    use crate::cache::RopeOffset;
    Ok(match offset {
        RopeOffset::At(at) => mlx_rs::fast::rope(x, dims, traditional, base, scale, *at, freqs)?,
        RopeOffset::PerRow(rows) => {
            mlx_rs::fast::rope_dynamic(x, dims, traditional, base, scale, rows, freqs)?
        }
    })
}
