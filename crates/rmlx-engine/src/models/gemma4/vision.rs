//! Gemma 4 vision tower: 16×16 patches projected by one matmul, 2-D learned positions looked
//! up by index (never a one-hot × table product), ViT blocks with q/k/v norms, clipped
//! linears and a 2-D rotary split across the head, k×k average pooling to the image's soft
//! tokens, then the embedder into the text model's width. Every image runs alone, so no
//! padding or mask is needed. Reference: mlx-vlm `models/gemma4/vision.py` and
//! `gemma4.py` (`MultimodalEmbedder`).

use mlx_rs::{fast, ops, ops::indexing::IndexOp, Array, Dtype};

use super::config::VisionConfig;
use crate::{
    attention::{vision_attention, TileConfig},
    error::{EngineError, Result},
    models::ImageInput,
    nn::{geglu, rotate_half, scalar, Linear, RmsNorm},
    weights::{DtypeKind, WeightStore},
};

/// A linear layer whose input and output are clamped to bounds stored in the checkpoint
/// (Gemma 4's QAT towers); a plain linear when the config has no clipping.
struct ClippableLinear {
    linear: Linear,
    /// `[input_min, input_max, output_min, output_max]` scalars.
    bounds: Option<[Array; 4]>,
}

impl ClippableLinear {
    fn load(
        store: &mut WeightStore,
        prefix: &str,
        inputs: i32,
        outputs: i32,
        clipped: bool,
    ) -> Result<Self> {
        let linear = Linear::load(
            store,
            None,
            &format!("{prefix}.linear"),
            inputs,
            outputs,
            false,
        )?;
        let bounds = if clipped {
            let mut take =
                |name: &str| store.take(&format!("{prefix}.{name}"), &[], DtypeKind::Float);
            Some([
                take("input_min")?,
                take("input_max")?,
                take("output_min")?,
                take("output_max")?,
            ])
        } else {
            None
        };
        Ok(Self { linear, bounds })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        let Some([in_min, in_max, out_min, out_max]) = &self.bounds else {
            return self.linear.forward(x);
        };
        let x = ops::minimum(ops::maximum(x, in_min)?, in_max)?;
        let y = self.linear.forward(&x)?;
        Ok(ops::minimum(ops::maximum(&y, out_min)?, out_max)?)
    }
}

/// RMS norm computed in float32 and cast back (the tower's q/k norms and the unscaled v norm).
fn rms_norm_f32(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    let x32 = x.as_dtype(Dtype::Float32)?;
    let variance = ops::mean_axis(&ops::square(&x32)?, -1, true)?;
    let mut normed = ops::multiply(
        &x32,
        ops::rsqrt(&ops::add(&variance, Array::from_f32(eps))?)?,
    )?;
    if let Some(weight) = weight {
        normed = ops::multiply(&normed, weight.as_dtype(Dtype::Float32)?)?;
    }
    Ok(normed.as_dtype(x.dtype())?)
}

/// cos/sin `[1, L, 1, channels]` of the 2-D rotary: the head splits into an x half and a y
/// half, each rotated (rotate-half style) by its own coordinate.
struct Rotary2d {
    cos: [Array; 2],
    sin: [Array; 2],
    channels: i32,
}

impl Rotary2d {
    fn new(xs: &[i32], ys: &[i32], head_dim: i32, theta: f32) -> Result<Self> {
        let channels = 2 * (head_dim / 4);
        let half = channels / 2;
        let len = xs.len() as i32;
        let exponents = ops::multiply(
            Array::from_f32(2.0 / channels as f32),
            ops::arange::<_, f32>(0, half, 1)?,
        )?;
        let timescale = ops::power(Array::from_f32(theta), &exponents)?;
        let angles = |coords: &[i32]| -> Result<(Array, Array)> {
            let positions: Vec<f32> = coords.iter().map(|&c| c as f32).collect();
            let positions = Array::from_slice(&positions, &[len, 1]);
            let angle = ops::divide(&positions, &timescale)?;
            let doubled = ops::concatenate(&[&angle, &angle], -1)?;
            let doubled = doubled.reshape(&[1, len, 1, channels])?;
            Ok((ops::cos(&doubled)?, ops::sin(&doubled)?))
        };
        let (cos_x, sin_x) = angles(xs)?;
        let (cos_y, sin_y) = angles(ys)?;
        Ok(Self {
            cos: [cos_x, cos_y],
            sin: [sin_x, sin_y],
            channels,
        })
    }

    /// Rotates `[B, L, heads, head_dim]`; rotate-half never mixes the x and y parts.
    fn apply(&self, x: &Array) -> Result<Array> {
        let mut parts = Vec::with_capacity(2);
        for axis in 0..2 {
            let start = axis as i32 * self.channels;
            let part = x.index((.., .., .., start..start + self.channels));
            let cos = self.cos[axis].as_dtype(x.dtype())?;
            let sin = self.sin[axis].as_dtype(x.dtype())?;
            parts.push(ops::add(
                ops::multiply(&part, &cos)?,
                ops::multiply(rotate_half(&part)?, &sin)?,
            )?);
        }
        Ok(ops::concatenate(&parts, -1)?)
    }
}

struct VisionAttention {
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    eps: f32,
    q_proj: ClippableLinear,
    k_proj: ClippableLinear,
    v_proj: ClippableLinear,
    o_proj: ClippableLinear,
    q_norm: Array,
    k_norm: Array,
}

impl VisionAttention {
    fn load(store: &mut WeightStore, prefix: &str, config: &VisionConfig) -> Result<Self> {
        let (dim, heads, kv_heads, head_dim) = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        );
        let clip = config.use_clipped_linears;
        let linear = |store: &mut WeightStore, name: &str, i: i32, o: i32| {
            ClippableLinear::load(store, &format!("{prefix}.{name}"), i, o, clip)
        };
        let norm = |store: &mut WeightStore, name: &str| {
            store.take(
                &format!("{prefix}.{name}.weight"),
                &[head_dim],
                DtypeKind::Float,
            )
        };
        Ok(Self {
            heads,
            kv_heads,
            head_dim,
            eps: config.rms_norm_eps,
            q_proj: linear(store, "q_proj", dim, heads * head_dim)?,
            k_proj: linear(store, "k_proj", dim, kv_heads * head_dim)?,
            v_proj: linear(store, "v_proj", dim, kv_heads * head_dim)?,
            o_proj: linear(store, "o_proj", heads * head_dim, dim)?,
            q_norm: norm(store, "q_norm")?,
            k_norm: norm(store, "k_norm")?,
        })
    }

    fn forward(&self, x: &Array, rotary: &Rotary2d, tiles: TileConfig) -> Result<Array> {
        let (batch, len) = (x.shape()[0], x.shape()[1]);
        let split = |y: Array, heads: i32| y.reshape(&[batch, len, heads, self.head_dim]);
        let q = split(self.q_proj.forward(x)?, self.heads)?;
        let k = split(self.k_proj.forward(x)?, self.kv_heads)?;
        let v = split(self.v_proj.forward(x)?, self.kv_heads)?;
        let q = rotary.apply(&rms_norm_f32(&q, Some(&self.q_norm), self.eps)?)?;
        let k = rotary.apply(&rms_norm_f32(&k, Some(&self.k_norm), self.eps)?)?;
        let v = rms_norm_f32(&v, None, self.eps)?;
        let [q, k, v] = [q, k, v].map(|a| a.transpose_axes(&[0, 2, 1, 3]));
        let out = vision_attention(&q?, &k?, &v?, 1.0, tiles)?;
        let out = out
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[batch, len, -1])?;
        self.o_proj.forward(&out)
    }
}

struct VisionBlock {
    self_attn: VisionAttention,
    gate_proj: ClippableLinear,
    up_proj: ClippableLinear,
    down_proj: ClippableLinear,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
}

impl VisionBlock {
    fn load(store: &mut WeightStore, prefix: &str, config: &VisionConfig) -> Result<Self> {
        let (dim, hidden, clip) = (
            config.hidden_size,
            config.intermediate_size,
            config.use_clipped_linears,
        );
        let mlp = |store: &mut WeightStore, name: &str, i: i32, o: i32| {
            ClippableLinear::load(store, &format!("{prefix}.mlp.{name}"), i, o, clip)
        };
        let norm = |store: &mut WeightStore, name: &str| {
            RmsNorm::load(store, &format!("{prefix}.{name}"), dim, config.rms_norm_eps)
        };
        Ok(Self {
            self_attn: VisionAttention::load(store, &format!("{prefix}.self_attn"), config)?,
            gate_proj: mlp(store, "gate_proj", dim, hidden)?,
            up_proj: mlp(store, "up_proj", dim, hidden)?,
            down_proj: mlp(store, "down_proj", hidden, dim)?,
            input_layernorm: norm(store, "input_layernorm")?,
            post_attention_layernorm: norm(store, "post_attention_layernorm")?,
            pre_feedforward_layernorm: norm(store, "pre_feedforward_layernorm")?,
            post_feedforward_layernorm: norm(store, "post_feedforward_layernorm")?,
        })
    }

    fn forward(&self, x: &Array, rotary: &Rotary2d, tiles: TileConfig) -> Result<Array> {
        let attended = self
            .self_attn
            .forward(&self.input_layernorm.forward(x)?, rotary, tiles)?;
        let h = ops::add(x, self.post_attention_layernorm.forward(&attended)?)?;
        let normed = self.pre_feedforward_layernorm.forward(&h)?;
        let gated = geglu(
            &self.gate_proj.forward(&normed)?,
            &self.up_proj.forward(&normed)?,
        )?;
        let fed = self.down_proj.forward(&gated)?;
        Ok(ops::add(
            &h,
            self.post_feedforward_layernorm.forward(&fed)?,
        )?)
    }
}

pub struct VisionModel {
    patch_size: i32,
    pooling: i32,
    hidden: i32,
    head_dim: i32,
    rope_theta: f32,
    position_embedding_size: i32,
    input_proj: Linear,
    /// `[2, positions, hidden]`: row 0 indexed by x, row 1 by y.
    position_table: Array,
    layers: Vec<VisionBlock>,
    standardize: Option<(Array, Array)>,
    /// `embed_vision`: unscaled RMS norm, then the projection to the text width.
    embed_eps: f32,
    embedding_projection: Linear,
    tiles: TileConfig,
}

impl VisionModel {
    pub fn load(store: &mut WeightStore, config: &VisionConfig, text_hidden: i32) -> Result<Self> {
        if config.head_dim % 4 != 0 {
            return Err(EngineError::InvalidRequest(format!(
                "Gemma 4 vision head_dim {} must split into two rotary halves",
                config.head_dim
            )));
        }
        let dim = config.hidden_size;
        let patch_dim = 3 * config.patch_size * config.patch_size;
        let prefix = "vision_tower";
        let input_proj = Linear::load(
            store,
            None,
            &format!("{prefix}.patch_embedder.input_proj"),
            patch_dim,
            dim,
            false,
        )?;
        let position_table = store.take(
            &format!("{prefix}.patch_embedder.position_embedding_table"),
            &[2, config.position_embedding_size, dim],
            DtypeKind::Float,
        )?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| VisionBlock::load(store, &format!("{prefix}.encoder.layers.{i}"), config))
            .collect::<Result<Vec<_>>>()?;
        let standardize = if config.standardize {
            Some((
                store.take(&format!("{prefix}.std_bias"), &[dim], DtypeKind::Float)?,
                store.take(&format!("{prefix}.std_scale"), &[dim], DtypeKind::Float)?,
            ))
        } else {
            None
        };
        let embedding_projection = Linear::load(
            store,
            None,
            "embed_vision.embedding_projection",
            dim,
            text_hidden,
            false,
        )?;
        Ok(Self {
            patch_size: config.patch_size,
            pooling: config.pooling_kernel_size,
            hidden: dim,
            head_dim: config.head_dim,
            rope_theta: config.rope_theta(),
            position_embedding_size: config.position_embedding_size,
            input_proj,
            position_table,
            layers,
            standardize,
            embed_eps: config.rms_norm_eps,
            embedding_projection,
            tiles: TileConfig::default(),
        })
    }

    /// Values per patch row: 16×16 pixels × RGB, channels fastest.
    pub fn patch_dim(&self) -> i32 {
        3 * self.patch_size * self.patch_size
    }

    /// Soft-token features `[tokens, text hidden]` of every image, in order.
    pub fn forward(&self, images: &ImageInput) -> Result<Array> {
        let mut outputs = Vec::with_capacity(images.grid_thw.len());
        let mut row = 0;
        for &[_, grid_h, grid_w] in &images.grid_thw {
            let patches = grid_h * grid_w;
            let pixels = images.pixel_values.index(row..row + patches);
            outputs.push(self.encode_one(&pixels, grid_h, grid_w)?);
            row += patches;
        }
        if row != images.pixel_values.shape()[0] {
            return Err(EngineError::InvalidRequest(format!(
                "the image grids cover {row} patches, pixel_values has {}",
                images.pixel_values.shape()[0]
            )));
        }
        let features = ops::concatenate(&outputs, 0)?;
        let normed = fast::rms_norm(&features, None, self.embed_eps)?;
        self.embedding_projection.forward(&normed)
    }

    /// One image's `[patches, patch_dim]` rows (values in [0, 1], row-major patches) to its
    /// pooled `[grid_h/k × grid_w/k, hidden]` features.
    fn encode_one(&self, pixels: &Array, grid_h: i32, grid_w: i32) -> Result<Array> {
        let k = self.pooling;
        if grid_h % k != 0 || grid_w % k != 0 {
            return Err(EngineError::InvalidRequest(format!(
                "a {grid_h}×{grid_w} patch grid does not pool by {k}"
            )));
        }
        if grid_h.max(grid_w) > self.position_embedding_size {
            return Err(EngineError::InvalidRequest(format!(
                "a {grid_h}×{grid_w} patch grid exceeds the tower's {} positions",
                self.position_embedding_size
            )));
        }
        let patches = grid_h * grid_w;
        let xs: Vec<i32> = (0..patches).map(|p| p % grid_w).collect();
        let ys: Vec<i32> = (0..patches).map(|p| p / grid_w).collect();

        // The tower sees 2 * (x - 0.5), in float32, cast to its weights' dtype.
        let pixels = pixels.as_dtype(Dtype::Float32)?;
        let centred = ops::multiply(
            Array::from_f32(2.0),
            ops::subtract(&pixels, Array::from_f32(0.5))?,
        )?;
        let projected = self
            .input_proj
            .forward(&centred.as_dtype(self.position_table.dtype())?)?;
        let by_x = self
            .position_table
            .index(0)
            .take_axis(Array::from_slice(&xs, &[patches]), 0)?;
        let by_y = self
            .position_table
            .index(1)
            .take_axis(Array::from_slice(&ys, &[patches]), 0)?;
        let mut h = ops::add(&projected, ops::add(&by_x, &by_y)?)?.reshape(&[1, patches, -1])?;

        let rotary = Rotary2d::new(&xs, &ys, self.head_dim, self.rope_theta)?;
        for layer in &self.layers {
            h = layer.forward(&h, &rotary, self.tiles)?;
        }

        // k×k average pooling over the patch grid in float32, each patch weighted by 1/k²
        // before the sum as in the reference's einsum (summing first rounds differently in bf16).
        let weighted = ops::multiply(
            h.as_dtype(Dtype::Float32)?,
            Array::from_f32(1.0 / (k * k) as f32),
        )?;
        let pooled = weighted
            .reshape(&[grid_h / k, k, grid_w / k, k, self.hidden])?
            .sum_axes(&[1, 3], false)?
            .as_dtype(h.dtype())?
            .reshape(&[-1, self.hidden])?;
        let mut pooled = ops::multiply(&pooled, scalar((self.hidden as f64).sqrt(), &pooled)?)?;
        if let Some((bias, scale)) = &self.standardize {
            pooled = ops::multiply(ops::subtract(&pooled, bias)?, scale)?;
        }
        Ok(pooled)
    }
}
