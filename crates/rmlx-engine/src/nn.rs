//! Layers shared by every family: Linear and Embedding (dense or quantized in any mode) and
//! RMSNorm. Reference: mlx `nn/layers/{linear,embedding,quantized,normalization}.py`.

use std::cell::RefCell;

use mlx_rs::{
    error::Exception, fast, ops, ops::indexing::IndexOp, transforms::compile::compile, Array,
};

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
        /// `weight.T`, an evaluated view: no transpose node in every step's graph.
        weight_t: Array,
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
            None => {
                let weight = store.take(
                    &format!("{prefix}.weight"),
                    &[out_dim, in_dim],
                    DtypeKind::Float,
                )?;
                Linear::Dense {
                    weight_t: store.view(ops::transpose(&weight)?),
                    bias,
                }
            }
        })
    }

    /// The projection onto outputs `rows` alone, as views of this one's weights (no copy).
    /// Biased layers are never fused, so there is no bias to slice.
    fn output_rows(&self, rows: std::ops::Range<i32>) -> Linear {
        match self {
            Linear::Dense { weight_t, .. } => Linear::Dense {
                weight_t: weight_t.index((.., rows)),
                bias: None,
            },
            Linear::Quantized { packed, .. } => Linear::Quantized {
                packed: QuantWeights {
                    weight: packed.weight.index(rows.clone()),
                    scales: packed.scales.index(rows.clone()),
                    biases: packed.biases.as_ref().map(|biases| biases.index(rows)),
                    spec: packed.spec,
                },
                bias: None,
            },
        }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (out, bias) = match self {
            // mlx's nn.Linear adds the bias inside the matmul (one rounding in bf16).
            Linear::Dense {
                weight_t,
                bias: Some(bias),
            } => return Ok(ops::addmm(bias, x, weight_t, 1.0, 1.0)?),
            Linear::Dense { weight_t, bias } => (ops::matmul(x, weight_t)?, bias),
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

/// Projections of one input run as one matmul (issue 32 d): their weights concatenated along
/// the outputs at load, the product split back into views (no copy; the consumers read them as
/// they are). A decode step on a GPU is bound by kernel launches, and each matmul also reads the
/// input again. Parts stay apart where the checkpoint stores them differently (a mixed-bit
/// recipe, other dtypes, biases) or `RMLX_FUSE_PROJECTIONS=0` (benchmarks).
pub enum Projections {
    Fused { linear: Linear, splits: Vec<i32> },
    Apart(Vec<Linear>),
}

impl Projections {
    /// `{prefix}.weight` (and its quantized triple) of each of `prefixes`, `[out, in_dim]`.
    pub fn load(
        store: &mut WeightStore,
        quantization: Option<&QuantizationConfig>,
        prefixes: &[String],
        in_dim: i32,
        out_dims: &[i32],
    ) -> Result<Self> {
        let specs = prefixes
            .iter()
            .map(|prefix| quant_spec(store, quantization, prefix))
            .collect::<Result<Vec<_>>>()?;
        let dtypes: Vec<_> = prefixes
            .iter()
            .map(|prefix| store.dtype(&format!("{prefix}.weight")))
            .collect();
        let alike = specs.windows(2).all(|pair| pair[0] == pair[1])
            && dtypes.windows(2).all(|pair| pair[0] == pair[1]);
        let biased = prefixes
            .iter()
            .any(|prefix| store.contains(&format!("{prefix}.bias")));
        if !alike || biased || prefixes.len() < 2 || !fuse_projections() {
            return Ok(Self::Apart(
                prefixes
                    .iter()
                    .zip(out_dims)
                    .map(|(prefix, &out)| {
                        Linear::load(store, quantization, prefix, in_dim, out, false)
                    })
                    .collect::<Result<_>>()?,
            ));
        }
        let linear = match specs[0] {
            None => {
                let parts = store.fusing(|store| {
                    prefixes
                        .iter()
                        .zip(out_dims)
                        .map(|(prefix, &out)| {
                            store.take(
                                &format!("{prefix}.weight"),
                                &[out, in_dim],
                                DtypeKind::Float,
                            )
                        })
                        .collect::<Result<Vec<_>>>()
                })?;
                let whole = store.derived_now(ops::concatenate(&parts, 0)?)?;
                Linear::Dense {
                    weight_t: store.view(ops::transpose(&whole)?),
                    bias: None,
                }
            }
            Some(spec) => {
                let parts = store.fusing(|store| {
                    prefixes
                        .iter()
                        .zip(out_dims)
                        .map(|(prefix, &out)| QuantWeights::load(store, prefix, out, in_dim, spec))
                        .collect::<Result<Vec<_>>>()
                })?;
                let mut joined =
                    |pick: fn(&QuantWeights) -> Option<&Array>| -> Result<Option<Array>> {
                        let arrays: Option<Vec<&Array>> = parts.iter().map(pick).collect();
                        arrays
                            .map(|arrays| store.derived_now(ops::concatenate(&arrays, 0)?))
                            .transpose()
                    };
                let weight = joined(|part| Some(&part.weight))?.expect("every part has weights");
                let scales = joined(|part| Some(&part.scales))?.expect("every part has scales");
                let biases = joined(|part| part.biases.as_ref())?;
                Linear::Quantized {
                    packed: QuantWeights {
                        weight,
                        scales,
                        biases,
                        spec,
                    },
                    bias: None,
                }
            }
        };
        let splits = out_dims[..out_dims.len() - 1]
            .iter()
            .scan(0, |end, &out| {
                *end += out;
                Some(*end)
            })
            .collect();
        Ok(Self::Fused { linear, splits })
    }

    /// Each of the `N` projections of `x`, in the order loaded.
    pub fn forward<const N: usize>(&self, x: &Array) -> Result<[Array; N]> {
        let outputs = match self {
            // A prompt chunk's products, each its own buffer: a consumer can then write into
            // one of them (SwiGLU into the gate's), where views of one product cannot be taken
            // over (at Qwen3-4B's MLP, 40 MB more per 2,048-token chunk at the peak). Only
            // decode's few rows, launch-bound, need the single matmul.
            Self::Fused { linear, splits } if rows(x) >= APART_ROWS => {
                let ends = splits.iter().copied().chain([out_dim(linear)]);
                let starts = [0].into_iter().chain(splits.iter().copied());
                starts
                    .zip(ends)
                    .map(|(start, end)| linear.output_rows(start..end).forward(x))
                    .collect::<Result<_>>()?
            }
            Self::Fused { linear, splits } => linear.forward(x)?.split_at_indices(splits, -1)?,
            Self::Apart(parts) => parts
                .iter()
                .map(|linear| linear.forward(x))
                .collect::<Result<_>>()?,
        };
        let count = outputs.len();
        outputs.try_into().map_err(|_| {
            crate::EngineError::Internal(format!("{count} projections loaded, {N} asked for"))
        })
    }
}

/// Rows of input (tokens of all rows) from which fused projections run apart (see
/// [`Projections::forward`]).
const APART_ROWS: i32 = 256;

/// Rows of `x` `[..., in_dim]`: every position of every batch row.
fn rows(x: &Array) -> i32 {
    let shape = x.shape();
    shape[..shape.len() - 1].iter().product()
}

/// Outputs of a loaded projection (the fused weight's rows).
fn out_dim(linear: &Linear) -> i32 {
    match linear {
        Linear::Dense { weight_t, .. } => weight_t.shape()[1],
        Linear::Quantized { packed, .. } => packed.weight.shape()[0],
    }
}

/// A gated MLP, `down(activation(gate(x), up(x)))`, gate and up as one matmul (SwiGLU in the
/// Qwen families, GeGLU in Gemma 4).
pub struct GatedMlp {
    gate_up: Projections,
    down_proj: Linear,
}

impl GatedMlp {
    pub fn load(
        store: &mut WeightStore,
        quantization: Option<&QuantizationConfig>,
        prefix: &str,
        dim: i32,
        hidden: i32,
    ) -> Result<Self> {
        Ok(Self {
            gate_up: Projections::load(
                store,
                quantization,
                &[format!("{prefix}.gate_proj"), format!("{prefix}.up_proj")],
                dim,
                &[hidden, hidden],
            )?,
            down_proj: Linear::load(
                store,
                quantization,
                &format!("{prefix}.down_proj"),
                hidden,
                dim,
                false,
            )?,
        })
    }

    /// `activation(gate, up)` is the fused gate (`swiglu`, `geglu`).
    pub fn forward(
        &self,
        x: &Array,
        activation: fn(&Array, &Array) -> Result<Array>,
    ) -> Result<Array> {
        let [gate, up] = self.gate_up.forward(x)?;
        self.down_proj.forward(&activation(&gate, &up)?)
    }
}

/// Whether projections of one input load as one matmul (`RMLX_FUSE_PROJECTIONS=0`: apart).
fn fuse_projections() -> bool {
    static ANSWER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ANSWER.get_or_init(|| std::env::var("RMLX_FUSE_PROJECTIONS").as_deref() != Ok("0"))
}

pub enum Embedding {
    /// The table and its evaluated transposed view (the tied output projection's).
    Dense {
        weight: Array,
        weight_t: Array,
    },
    Quantized {
        packed: QuantWeights,
    },
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
            None => {
                let weight =
                    store.take(&format!("{prefix}.weight"), &[vocab, dim], DtypeKind::Float)?;
                let weight_t = store.view(ops::transpose(&weight)?);
                Embedding::Dense { weight, weight_t }
            }
        })
    }

    /// Rows for `ids` ([B, L] → [B, L, dim]). Quantized tables take the packed rows first and
    /// dequantize only those: O(seq) work and memory, never a vocab×seq product.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        match self {
            Embedding::Dense { weight, .. } => Ok(weight.take_axis(ids, 0)?),
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
            Embedding::Dense { weight_t, .. } => Ok(ops::matmul(x, weight_t)?),
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

type Fused2 = Box<dyn for<'a> FnMut((&'a Array, &'a Array)) -> Result<Array, Exception>>;
type Fused1 = Box<dyn for<'a> FnMut(&'a Array) -> Result<Array, Exception>>;

thread_local! {
    // One compiled function per thread, kept for the thread's life: MLX caches the traced
    // graph under the function's id, so a function compiled per call would trace every call.
    static SWIGLU: RefCell<Fused2> = RefCell::new(Box::new(compile(
        |(gate, up): (&Array, &Array)| plain_swiglu(gate, up),
        true,
    )));
    static GELU_APPROX: RefCell<Fused1> =
        RefCell::new(Box::new(compile(|x: &Array| plain_gelu_approx(x), true)));
    static GEGLU: RefCell<Fused2> = RefCell::new(Box::new(compile(
        |(gate, up): (&Array, &Array)| ops::multiply(plain_gelu_approx(gate)?, up),
        true,
    )));
}

/// SwiGLU's gate `silu(gate) * up` as one fused kernel instead of three, as mlx-lm's
/// `activations.swiglu` (compiled, shapeless). `MLX_DISABLE_COMPILE=1` runs the plain ops.
pub fn swiglu(gate: &Array, up: &Array) -> Result<Array> {
    Ok(SWIGLU.with(|fused| (fused.borrow_mut())((gate, up)))?)
}

fn plain_swiglu(gate: &Array, up: &Array) -> Result<Array, Exception> {
    let silu = ops::multiply(gate, ops::sigmoid(gate)?)?;
    ops::multiply(&silu, up)
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

/// Copies host values into a new MLX array; an allocation MLX refuses is `OutOfMemory`, not a
/// crash. mlx-rs's `from_slice` cannot report it: mlx-c then hands back an empty array (and
/// stashes the message) that would fail at its first use, far from the cause. Used for the big
/// per-request uploads (image pixels), where a refusal is likely.
pub fn upload(data: &[f32], shape: &[i32]) -> Result<Array> {
    let array = Array::from_slice(data, shape);
    if array.as_ptr().ctx.is_null() {
        return Err(crate::EngineError::OutOfMemory(format!(
            "MLX cannot allocate {:.1} MB for an array of shape {shape:?}",
            std::mem::size_of_val(data) as f64 / 1e6
        )));
    }
    Ok(array)
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

/// mlx `nn.gelu_approx`: `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))`, one
/// fused kernel (mlx compiles it, shapeless) instead of eight.
pub fn gelu_approx(x: &Array) -> Result<Array> {
    Ok(GELU_APPROX.with(|fused| (fused.borrow_mut())(x))?)
}

/// Gemma's gated MLP `gelu_approx(gate) * up`, one fused kernel.
pub fn geglu(gate: &Array, up: &Array) -> Result<Array> {
    Ok(GEGLU.with(|fused| (fused.borrow_mut())((gate, up)))?)
}

fn plain_gelu_approx(x: &Array) -> Result<Array, Exception> {
    let weak = |value: f64| Array::from_f32(value as f32).as_dtype(x.dtype());
    let cubic = ops::multiply(weak(0.044715)?, ops::power(x, weak(3.0)?)?)?;
    let inner = ops::multiply(
        weak((2.0 / std::f64::consts::PI).sqrt())?,
        ops::add(x, &cubic)?,
    )?;
    let half_x = ops::multiply(weak(0.5)?, x)?;
    ops::multiply(&half_x, ops::add(weak(1.0)?, ops::tanh(&inner)?)?)
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

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::{random, Dtype};

    fn max_diff(a: &Array, b: &Array) -> f32 {
        let diff = ops::subtract(
            a.as_dtype(Dtype::Float32).unwrap(),
            b.as_dtype(Dtype::Float32).unwrap(),
        );
        ops::abs(diff.unwrap())
            .unwrap()
            .max(None)
            .unwrap()
            .item_exact::<f32>()
    }

    /// Projections loaded as one matmul give what they give apart (dense fp32, and 4-bit when
    /// both parts share the recipe); parts quantized differently stay apart.
    #[test]
    fn fused_projections_equal_the_projections_apart() {
        let dir = std::env::temp_dir().join(format!("rmlx-projections-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = random::key(11).unwrap();
        let keys = random::split(&key, 3).unwrap();
        let (in_dim, outs) = (64, [48, 80]);
        let weights = [
            random::normal::<f32>(&[outs[0], in_dim], None, None, &keys.0).unwrap(),
            random::normal::<f32>(&[outs[1], in_dim], None, None, &keys.1).unwrap(),
        ];
        let x = random::normal::<f32>(&[2, 3, in_dim], None, None, None).unwrap();
        let spec = QuantSpec::defaults(quant::QuantMode::Affine);
        let config: QuantizationConfig =
            serde_json::from_value(serde_json::json!({"group_size": 64, "bits": 4})).unwrap();
        // (which parts are quantized, fused expected)
        for (quantized, fused) in [
            ([false, false], true),
            ([true, true], true),
            ([true, false], false),
        ] {
            let mut tensors = std::collections::HashMap::new();
            for (index, weight) in weights.iter().enumerate() {
                let name = ["a", "b"][index];
                if quantized[index] {
                    let packed = quant::quantize(weight, spec).unwrap();
                    tensors.insert(format!("{name}.weight"), packed.weight);
                    tensors.insert(format!("{name}.scales"), packed.scales);
                    tensors.insert(format!("{name}.biases"), packed.biases.unwrap());
                } else {
                    tensors.insert(format!("{name}.weight"), weight.clone());
                }
            }
            Array::save_safetensors(&tensors, None, dir.join("model.safetensors")).unwrap();
            let quantization = quantized.iter().any(|&q| q).then_some(&config);
            let prefixes = ["a".to_string(), "b".to_string()];
            let mut store = WeightStore::open(&dir).unwrap();
            let together =
                Projections::load(&mut store, quantization, &prefixes, in_dim, &outs).unwrap();
            let summary = store.finish().unwrap();
            crate::runtime::eval(summary.arrays.iter()).unwrap();
            assert_eq!(
                matches!(together, Projections::Fused { .. }),
                fused,
                "{quantized:?}"
            );
            let mut store = WeightStore::open(&dir).unwrap();
            let apart: Vec<Linear> = prefixes
                .iter()
                .zip(outs)
                .map(|(prefix, out)| {
                    Linear::load(&mut store, quantization, prefix, in_dim, out, false).unwrap()
                })
                .collect();
            // A few rows (one matmul, split) and a prompt chunk's (a matmul per part).
            let chunk =
                random::normal::<f32>(&[2, APART_ROWS / 2, in_dim], None, None, None).unwrap();
            for x in [&x, &chunk] {
                let [a, b] = together.forward(x).unwrap();
                let rows = x.shape()[1];
                assert_eq!(
                    (a.shape(), b.shape()),
                    (&[2, rows, 48][..], &[2, rows, 80][..])
                );
                assert!(
                    max_diff(&a, &apart[0].forward(x).unwrap()) < 1e-5,
                    "{quantized:?} {rows}"
                );
                assert!(
                    max_diff(&b, &apart[1].forward(x).unwrap()) < 1e-5,
                    "{quantized:?} {rows}"
                );
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The compiled activations equal the plain ops they fuse, in fp32 and bf16, at every
    /// shape (they are shapeless) and on strided input.
    #[test]
    fn fused_activations_equal_the_plain_ops() {
        let key = random::key(7).unwrap();
        let (first, second) = random::split(&key, 2).unwrap();
        for (dtype, tolerance) in [(Dtype::Float32, 1e-6), (Dtype::Bfloat16, 0.0)] {
            for shape in [[1, 1, 96], [2, 5, 96], [3, 7, 33]] {
                let normal = |k: &Array| {
                    random::normal::<f32>(&shape, None, Some(2.0), k)
                        .unwrap()
                        .as_dtype(dtype)
                        .unwrap()
                };
                let gate = normal(&first);
                let up = normal(&second);
                let checks = [
                    (
                        swiglu(&gate, &up).unwrap(),
                        plain_swiglu(&gate, &up).unwrap(),
                    ),
                    (
                        gelu_approx(&gate).unwrap(),
                        plain_gelu_approx(&gate).unwrap(),
                    ),
                    (
                        geglu(&gate, &up).unwrap(),
                        ops::multiply(plain_gelu_approx(&gate).unwrap(), &up).unwrap(),
                    ),
                ];
                for (fused, plain) in checks {
                    assert_eq!(fused.dtype(), dtype);
                    assert_eq!(fused.shape(), plain.shape());
                    let diff = max_diff(&fused, &plain);
                    assert!(diff <= tolerance, "{dtype:?} {shape:?}: {diff}");
                }
            }
        }
        // A strided view (the transposed gate) is read as it is laid out.
        let gate = random::normal::<f32>(&[8, 6], None, None, &first).unwrap();
        let up = random::normal::<f32>(&[6, 8], None, None, &second).unwrap();
        let view = gate.t();
        assert!(
            max_diff(
                &swiglu(&view, &up).unwrap(),
                &plain_swiglu(&view, &up).unwrap()
            ) <= 1e-6
        );
    }
}
