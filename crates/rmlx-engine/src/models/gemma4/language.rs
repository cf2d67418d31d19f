//! Gemma 4 text decoder: sliding-window and full-attention layers (own head sizes and RoPE),
//! q/k/v norms with attention scale 1, KV-shared layers that reuse the last earlier layer of
//! their type, per-layer input embeddings gated into every layer, a learned layer scalar, and
//! tanh logit softcapping. Image soft tokens attend to their whole image both ways during
//! prefill when the config asks for it. Reference: mlx-vlm `models/gemma4/language.py` (same
//! order: norms, MLP, attention, decoder layer, model).

use std::ops::Range;

use mlx_rs::{fast, ops, ops::indexing::IndexOp, Array};

use super::config::{Config, LayerRope, TextConfig};
use crate::{
    attention::{attend_fetched, Mask},
    cache::{Fetched, KvCache, RopeOffset},
    config::QuantizationConfig,
    error::{EngineError, Result},
    models::{
        chunk_start, held, stage_output,
        switch::{combine, GluActivation, SwitchGlu, SwitchLinear},
        Logits, Part,
    },
    nn::{geglu, rope, scalar, Embedding, GatedMlp, Linear, RmsNorm},
    weights::{DtypeKind, WeightStore},
};

/// GeGLU MLP; KV-shared layers are twice as wide when `use_double_wide_mlp` is set.
struct Mlp(GatedMlp);

impl Mlp {
    fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        prefix: &str,
        dim: i32,
        hidden: i32,
    ) -> Result<Self> {
        Ok(Self(GatedMlp::load(store, quant, prefix, dim, hidden)?))
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        self.0.forward(x, geglu)
    }
}

/// RoPE of one layer type: plain for sliding layers; `proportional` rotates the first
/// `partial_rotary_factor` of the pairs (frequencies over the whole head) and leaves the rest
/// (infinite period) as they are.
enum Rotary {
    Plain { dims: i32, theta: f32 },
    Proportional { dims: i32, freqs: Array },
}

impl Rotary {
    fn new(rope: &LayerRope, head_dim: i32) -> Result<Self> {
        if !rope.proportional {
            return Ok(Rotary::Plain {
                dims: head_dim,
                theta: rope.theta,
            });
        }
        let rotated = 2 * ((rope.partial_rotary_factor * head_dim as f32) as i32 / 2);
        let angles = rotated / 2;
        let exponents = ops::divide(
            &ops::arange::<_, f32>(0, 2 * angles, 2)?,
            Array::from_f32(head_dim as f32),
        )?;
        let rotating = ops::power(Array::from_f32(rope.theta), &exponents)?;
        let still = ops::full::<f32>(&[head_dim / 2 - angles], Array::from_f32(f32::INFINITY))?;
        let freqs = ops::concatenate(&[rotating, still], 0)?;
        freqs.eval()?;
        Ok(Rotary::Proportional {
            dims: head_dim,
            freqs,
        })
    }

    fn apply(&self, x: &Array, offset: &RopeOffset) -> Result<Array> {
        match self {
            Rotary::Plain { dims, theta } => rope(x, *dims, false, Some(*theta), 1.0, offset, None),
            Rotary::Proportional { dims, freqs } => {
                rope(x, *dims, false, None, 1.0, offset, Some(freqs))
            }
        }
    }
}

/// Masks and key windows of one forward: full layers see every cached key; sliding layers
/// see the last `window` positions, so decode slices the keys instead of masking them.
struct ChunkMasks {
    full: Mask,
    sliding: Mask,
    /// First cached key a sliding layer can see from this chunk.
    sliding_start: i32,
}

impl ChunkMasks {
    /// `images`: each batch row's soft-token spans inside this chunk (chunk-relative) that
    /// attend both ways (empty: none).
    /// `cache`: the first layer's, whose rows (a padded batch) the decode masks follow.
    fn new(cache: &KvCache, len: i32, window: i32, images: &[Vec<Range<usize>>]) -> Result<Self> {
        let offset = cache.offset();
        let has_images = images.iter().any(|spans| !spans.is_empty());
        // The row that ends first sees furthest back (rows end together unless a speculative
        // step left the batch ragged; then each row's own window is masked).
        let sliding_start = (cache.shortest_end() - window + 1).max(0);
        if cache.is_ragged() || (len > 1 && cache.is_padded()) {
            let end = offset + len;
            let with_images = |visible: Array, key_start: i32| -> Result<Array> {
                match has_images {
                    true => Ok(ops::logical_or(
                        &visible,
                        &Self::same_image(offset, len, key_start, images)?,
                    )?),
                    false => Ok(visible),
                }
            };
            return Ok(Self {
                full: Mask::Array(with_images(cache.rows_mask(0, end, len, None)?, 0)?),
                sliding: Mask::Array(with_images(
                    cache.rows_mask(sliding_start, end, len, Some(window))?,
                    sliding_start,
                )?),
                sliding_start,
            });
        }
        if len == 1 {
            let padding = |start| -> Result<Mask> {
                Ok(match cache.padding_mask(start, offset + 1)? {
                    Some(mask) => Mask::Array(mask),
                    None => Mask::None,
                })
            };
            return Ok(Self {
                full: padding(0)?,
                sliding: padding(sliding_start)?,
                sliding_start,
            });
        }
        let full = if !has_images {
            Mask::Causal
        } else {
            Mask::Array(Self::array(offset, len, 0, None, images)?)
        };
        let sliding = if !has_images && sliding_start == 0 && offset + len <= window {
            Mask::Causal
        } else {
            Mask::Array(Self::array(
                offset,
                len,
                sliding_start,
                Some(window),
                images,
            )?)
        };
        Ok(Self {
            full,
            sliding,
            sliding_start,
        })
    }

    /// `[B, 1, len, keys]` booleans (B: the rows of `images`, 1 without images): key k is
    /// visible from query q when k <= q (within the window), or when both sit in the same
    /// image span of the row. Built on device: O(len × keys).
    fn array(
        offset: i32,
        len: i32,
        key_start: i32,
        window: Option<i32>,
        images: &[Vec<Range<usize>>],
    ) -> Result<Array> {
        let end = offset + len;
        let queries = ops::arange::<_, i32>(offset, end, 1)?.reshape(&[1, 1, len, 1])?;
        let keys =
            ops::arange::<_, i32>(key_start, end, 1)?.reshape(&[1, 1, 1, end - key_start])?;
        let mut visible = ops::le(&keys, &queries)?;
        if let Some(window) = window {
            let near = ops::lt(&ops::subtract(&queries, &keys)?, Array::from_int(window))?;
            visible = ops::logical_and(&visible, &near)?;
        }
        if images.iter().any(|spans| !spans.is_empty()) {
            visible =
                ops::logical_or(&visible, &Self::same_image(offset, len, key_start, images)?)?;
        }
        Ok(visible)
    }

    /// `[B, 1, len, keys]`: whether query q and key k of a row sit in the same image span of
    /// that row's chunk (the chunk's columns are `offset..offset + len` in every row; keys
    /// before it are text).
    fn same_image(
        offset: i32,
        len: i32,
        key_start: i32,
        images: &[Vec<Range<usize>>],
    ) -> Result<Array> {
        let rows = images.len().max(1) as i32;
        // Block id per chunk position (-1 for text), row by row.
        let mut blocks = vec![-1i32; rows as usize * len as usize];
        for (row, spans) in images.iter().enumerate() {
            let own = &mut blocks[row * len as usize..(row + 1) * len as usize];
            for (id, span) in spans.iter().enumerate() {
                for slot in &mut own[span.clone()] {
                    *slot = id as i32;
                }
            }
        }
        let query_blocks = Array::from_slice(&blocks, &[rows, 1, len, 1]);
        let before = offset - key_start;
        let key_blocks = Array::from_slice(&blocks, &[rows, 1, 1, len]);
        let key_blocks = ops::concatenate(
            &[
                ops::full::<i32>(&[rows, 1, 1, before], Array::from_int(-1))?,
                key_blocks,
            ],
            -1,
        )?;
        Ok(ops::logical_and(
            &ops::ne(&query_blocks, Array::from_int(-1))?,
            &ops::eq(&query_blocks, &key_blocks)?,
        )?)
    }
}

/// A layer's own key and value projections. `v_proj` is None on `attention_k_eq_v` full
/// layers: their values are the raw key projection (before k_norm and RoPE).
struct KeyValue {
    k_proj: Linear,
    v_proj: Option<Linear>,
    k_norm: RmsNorm,
}

struct Attention {
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    sliding: bool,
    q_proj: Linear,
    /// None on KV-shared layers: they reuse an earlier layer's keys and values.
    kv: Option<KeyValue>,
    o_proj: Linear,
    q_norm: RmsNorm,
    eps: f32,
    rotary: Rotary,
}

impl Attention {
    fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        prefix: &str,
        args: &TextConfig,
        layer_type: &str,
        rope: &LayerRope,
        shared: bool,
    ) -> Result<Self> {
        let sliding = layer_type == "sliding_attention";
        let head_dim = match args.global_head_dim {
            Some(global) if !sliding && global > 0 => global,
            _ => args.head_dim,
        };
        // Full layers of k_eq_v checkpoints have their own (global) KV head count and no v_proj.
        let k_eq_v = args.attention_k_eq_v && !sliding;
        let kv_heads = match args.num_global_key_value_heads {
            Some(global) if k_eq_v => global,
            _ => args.num_key_value_heads,
        };
        let (heads, dim) = (args.num_attention_heads, args.hidden_size);
        let linear = |store: &mut WeightStore, name: &str, i: i32, o: i32| {
            Linear::load(store, quant, &format!("{prefix}.{name}"), i, o, false)
        };
        let q_proj = linear(store, "q_proj", dim, heads * head_dim)?;
        let kv = if shared {
            None
        } else {
            Some(KeyValue {
                k_proj: linear(store, "k_proj", dim, kv_heads * head_dim)?,
                v_proj: if k_eq_v {
                    None
                } else {
                    Some(linear(store, "v_proj", dim, kv_heads * head_dim)?)
                },
                k_norm: RmsNorm::load(
                    store,
                    &format!("{prefix}.k_norm"),
                    head_dim,
                    args.rms_norm_eps,
                )?,
            })
        };
        Ok(Self {
            n_heads: heads,
            n_kv_heads: kv_heads,
            head_dim,
            sliding,
            q_proj,
            kv,
            o_proj: linear(store, "o_proj", heads * head_dim, dim)?,
            q_norm: RmsNorm::load(
                store,
                &format!("{prefix}.q_norm"),
                head_dim,
                args.rms_norm_eps,
            )?,
            eps: args.rms_norm_eps,
            rotary: Rotary::new(rope, head_dim)?,
        })
    }

    /// Returns the output and the keys/values it attended to (for the layers sharing them).
    fn forward(
        &self,
        x: &Array,
        cache: Option<&mut KvCache>,
        shared: Option<&Fetched>,
        offset: &RopeOffset,
        masks: &ChunkMasks,
    ) -> Result<(Array, Fetched)> {
        let (batch, len) = (x.shape()[0], x.shape()[1]);
        let split =
            |projected: Array, heads: i32| projected.reshape(&[batch, len, heads, self.head_dim]);
        let queries = self
            .q_norm
            .forward(&split(self.q_proj.forward(x)?, self.n_heads)?)?
            .transpose_axes(&[0, 2, 1, 3])?;
        let queries = self.rotary.apply(&queries, offset)?;
        let fetched = match (shared, &self.kv) {
            (Some(shared), _) => shared.clone(),
            (None, Some(own)) => {
                let raw_keys = split(own.k_proj.forward(x)?, self.n_kv_heads)?;
                let raw_values = match &own.v_proj {
                    Some(v_proj) => split(v_proj.forward(x)?, self.n_kv_heads)?,
                    None => raw_keys.clone(),
                };
                let keys = own
                    .k_norm
                    .forward(&raw_keys)?
                    .transpose_axes(&[0, 2, 1, 3])?;
                let keys = self.rotary.apply(&keys, offset)?;
                let values =
                    fast::rms_norm(raw_values, None, self.eps)?.transpose_axes(&[0, 2, 1, 3])?;
                let cache = cache.ok_or_else(|| {
                    EngineError::InvalidRequest("a Gemma 4 attention layer has no cache".into())
                })?;
                let fetched = cache.update_and_fetch_stored(&keys, &values)?;
                if self.sliding && masks.sliding_start > 0 {
                    // The cache's arrays begin at its base (a windowed cache dropped the rest).
                    fetched.columns_from(masks.sliding_start - cache.base())
                } else {
                    fetched
                }
            }
            (None, None) => {
                return Err(EngineError::InvalidRequest(
                    "a KV-shared Gemma 4 layer ran before the layer it shares".into(),
                ))
            }
        };
        let mask = if self.sliding {
            &masks.sliding
        } else {
            &masks.full
        };
        let output = attend_fetched(&queries, &fetched, 1.0, mask)?
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[batch, len, -1])?;
        Ok((self.o_proj.forward(&output)?, fetched))
    }
}

/// Gemma's expert router: the residual RMS-normalised with `scale / sqrt(hidden)`, projected
/// to one score per expert, the top-k kept, a softmax over those k, times each expert's scale.
struct Router {
    proj: Linear,
    /// `router.scale / sqrt(hidden)`, formed once at load in the weights' dtype.
    norm_weight: Array,
    per_expert_scale: Array,
    top_k: i32,
    experts: i32,
    eps: f32,
}

impl Router {
    fn route(&self, h: &Array) -> Result<(Array, Array)> {
        let scores = self
            .proj
            .forward(&fast::rms_norm(h, Some(&self.norm_weight), self.eps)?)?;
        let first = self.experts - self.top_k;
        let indices = ops::argpartition_axis(&scores, first, -1)?.index((.., .., first..));
        let weights = ops::softmax_axis(&scores.take_along_axis(&indices, -1)?, -1, None)?;
        let weights = ops::multiply(&weights, self.per_expert_scale.take_axis(&indices, 0)?)?;
        Ok((indices, weights))
    }
}

/// The 26B-A4B MoE block beside the dense MLP: its router, experts and three extra norms.
struct MoeBlock {
    router: Router,
    experts: SwitchGlu,
    pre_feedforward_layernorm_2: RmsNorm,
    post_feedforward_layernorm_1: RmsNorm,
    post_feedforward_layernorm_2: RmsNorm,
}

impl MoeBlock {
    fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        prefix: &str,
        args: &TextConfig,
        dir: &std::path::Path,
    ) -> Result<Self> {
        let missing = |key: &str| {
            super::config::config_error(dir, &format!("enable_moe_block needs text_config.{key}"))
        };
        let experts = args.num_experts.ok_or_else(|| missing("num_experts"))?;
        let top_k = args.top_k_experts.ok_or_else(|| missing("top_k_experts"))?;
        let inter = args
            .moe_intermediate_size
            .or(args.expert_intermediate_size)
            .ok_or_else(|| missing("moe_intermediate_size"))?;
        let hidden = args.hidden_size;
        let norm = |store: &mut WeightStore, name: &str| {
            RmsNorm::load(
                store,
                &format!("{prefix}.{name}"),
                hidden,
                args.rms_norm_eps,
            )
        };
        let router = Router {
            proj: Linear::load(
                store,
                quant,
                &format!("{prefix}.router.proj"),
                hidden,
                experts,
                false,
            )?,
            norm_weight: {
                let scale = store.take(
                    &format!("{prefix}.router.scale"),
                    &[hidden],
                    DtypeKind::Float,
                )?;
                let root = scalar((hidden as f64).powf(-0.5), &scale)?;
                store.derived(ops::multiply(&scale, root)?)?
            },
            per_expert_scale: store.take(
                &format!("{prefix}.router.per_expert_scale"),
                &[experts],
                DtypeKind::Float,
            )?,
            top_k,
            experts,
            eps: args.rms_norm_eps,
        };
        let fused = format!("{prefix}.experts.gate_up_proj");
        let experts_glu = if store.contains(&fused) {
            // The Google release: gate and up fused along axis 1 (gate first), [E, out, in].
            let gate_up = store.take(&fused, &[experts, 2 * inter, hidden], DtypeKind::Float)?;
            let down = store.take(
                &format!("{prefix}.experts.down_proj"),
                &[experts, hidden, inter],
                DtypeKind::Float,
            )?;
            SwitchGlu {
                gate_proj: SwitchLinear::dense(store.derived(gate_up.index((.., ..inter, ..)))?),
                up_proj: SwitchLinear::dense(store.derived(gate_up.index((.., inter.., ..)))?),
                down_proj: SwitchLinear::dense(down),
                activation: GluActivation::GeluApprox,
            }
        } else {
            let linear = |store: &mut WeightStore, name: &str, i: i32, o: i32| {
                SwitchLinear::load(
                    store,
                    quant,
                    &format!("{prefix}.experts.switch_glu.{name}"),
                    experts,
                    i,
                    o,
                )
            };
            SwitchGlu {
                gate_proj: linear(store, "gate_proj", hidden, inter)?,
                up_proj: linear(store, "up_proj", hidden, inter)?,
                down_proj: linear(store, "down_proj", inter, hidden)?,
                activation: GluActivation::GeluApprox,
            }
        };
        Ok(Self {
            router,
            experts: experts_glu,
            pre_feedforward_layernorm_2: norm(store, "pre_feedforward_layernorm_2")?,
            post_feedforward_layernorm_1: norm(store, "post_feedforward_layernorm_1")?,
            post_feedforward_layernorm_2: norm(store, "post_feedforward_layernorm_2")?,
        })
    }

    /// The experts' normed contribution for residual `h`.
    fn forward(&self, h: &Array) -> Result<Array> {
        let (indices, weights) = self.router.route(h)?;
        let routed = self
            .experts
            .forward(&self.pre_feedforward_layernorm_2.forward(h)?, &indices)?;
        self.post_feedforward_layernorm_2
            .forward(&combine(&routed, &weights)?)
    }
}

/// What the per-layer input embeddings add to a layer (2B/4B-style checkpoints).
struct PerLayerGate {
    input_gate: Linear,
    projection: Linear,
    post_norm: RmsNorm,
}

struct DecoderLayer {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    per_layer: Option<PerLayerGate>,
    moe: Option<MoeBlock>,
    layer_scalar: Array,
}

impl DecoderLayer {
    fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        prefix: &str,
        config: &Config,
        index: usize,
        dir: &std::path::Path,
    ) -> Result<Self> {
        let args = &config.text_config;
        let layer_type = &args.layer_types[index];
        let shared = index >= config.first_kv_shared_layer();
        let norm = |store: &mut WeightStore, name: &str, dim: i32| {
            RmsNorm::load(store, &format!("{prefix}.{name}"), dim, args.rms_norm_eps)
        };
        let wide = if shared && args.use_double_wide_mlp {
            2
        } else {
            1
        };
        let per_layer = if args.hidden_size_per_layer_input > 0 {
            let width = args.hidden_size_per_layer_input;
            Some(PerLayerGate {
                input_gate: Linear::load(
                    store,
                    quant,
                    &format!("{prefix}.per_layer_input_gate"),
                    args.hidden_size,
                    width,
                    false,
                )?,
                projection: Linear::load(
                    store,
                    quant,
                    &format!("{prefix}.per_layer_projection"),
                    width,
                    args.hidden_size,
                    false,
                )?,
                post_norm: norm(store, "post_per_layer_input_norm", args.hidden_size)?,
            })
        } else {
            None
        };
        Ok(Self {
            self_attn: Attention::load(
                store,
                quant,
                &format!("{prefix}.self_attn"),
                args,
                layer_type,
                &config.rope(layer_type, dir)?,
                shared,
            )?,
            mlp: Mlp::load(
                store,
                quant,
                &format!("{prefix}.mlp"),
                args.hidden_size,
                args.intermediate_size * wide,
            )?,
            input_layernorm: norm(store, "input_layernorm", args.hidden_size)?,
            post_attention_layernorm: norm(store, "post_attention_layernorm", args.hidden_size)?,
            pre_feedforward_layernorm: norm(store, "pre_feedforward_layernorm", args.hidden_size)?,
            post_feedforward_layernorm: norm(
                store,
                "post_feedforward_layernorm",
                args.hidden_size,
            )?,
            per_layer,
            moe: if args.enable_moe_block {
                Some(MoeBlock::load(store, quant, prefix, args, dir)?)
            } else {
                None
            },
            layer_scalar: store.take(&format!("{prefix}.layer_scalar"), &[1], DtypeKind::Float)?,
        })
    }

    fn forward(
        &self,
        x: &Array,
        cache: Option<&mut KvCache>,
        shared: Option<&Fetched>,
        per_layer_input: Option<&Array>,
        offset: &RopeOffset,
        masks: &ChunkMasks,
    ) -> Result<(Array, Fetched)> {
        let (attended, kv) = self.self_attn.forward(
            &self.input_layernorm.forward(x)?,
            cache,
            shared,
            offset,
            masks,
        )?;
        let h = ops::add(x, self.post_attention_layernorm.forward(&attended)?)?;
        let fed = self
            .mlp
            .forward(&self.pre_feedforward_layernorm.forward(&h)?)?;
        // With experts, the dense and routed outputs are each normed, summed, and normed again.
        let fed = match &self.moe {
            Some(moe) => ops::add(
                moe.post_feedforward_layernorm_1.forward(&fed)?,
                moe.forward(&h)?,
            )?,
            None => fed,
        };
        let mut h = ops::add(&h, self.post_feedforward_layernorm.forward(&fed)?)?;
        if let (Some(gate), Some(input)) = (&self.per_layer, per_layer_input) {
            let gated = geglu(&gate.input_gate.forward(&h)?, input)?;
            let projected = gate.post_norm.forward(&gate.projection.forward(&gated)?)?;
            h = ops::add(&h, &projected)?;
        }
        Ok((ops::multiply(&h, &self.layer_scalar)?, kv))
    }
}

/// The per-layer input embedding table and the projection of the hidden state that joins it.
struct PerLayerInputs {
    embed_tokens_per_layer: Embedding,
    model_projection: Linear,
    projection_norm: RmsNorm,
    width: i32,
}

pub struct LanguageModel {
    pub(super) args: TextConfig,
    pub(super) part: Part,
    /// Rank 0's (None on a pipeline's other ranks), as are `per_layer` and `norm`.
    embed_tokens: Option<Embedding>,
    per_layer: Option<PerLayerInputs>,
    /// None where another pipeline rank computes the layer.
    layers: Vec<Option<DecoderLayer>>,
    norm: Option<RmsNorm>,
    /// Layer whose keys/values each layer attends to (itself unless KV-shared).
    kv_source: Vec<usize>,
    first_shared: usize,
}

impl LanguageModel {
    pub fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        config: &Config,
        dir: &std::path::Path,
        part: Part,
    ) -> Result<Self> {
        // Config::validate has refused untied checkpoints (the logits use embed_tokens).
        let args = config.text_config.clone();
        let prefix = "language_model.model";
        part.drop_ends(
            store,
            &[
                "language_model.model.embed_tokens.",
                "language_model.model.embed_tokens_per_layer.",
                "language_model.model.per_layer_model_projection.",
                "language_model.model.per_layer_projection_norm.",
                "language_model.model.norm.",
            ],
        );
        let embed_tokens = part.ends(|| {
            Embedding::load(
                store,
                quant,
                &format!("{prefix}.embed_tokens"),
                args.vocab_size,
                args.hidden_size,
            )
        })?;
        let per_layer = if args.hidden_size_per_layer_input > 0 && part.has_ends() {
            let width = args.hidden_size_per_layer_input;
            let total = args.num_hidden_layers * width;
            Some(PerLayerInputs {
                embed_tokens_per_layer: Embedding::load(
                    store,
                    quant,
                    &format!("{prefix}.embed_tokens_per_layer"),
                    args.vocab_size_per_layer_input.unwrap_or(args.vocab_size),
                    total,
                )?,
                model_projection: Linear::load(
                    store,
                    quant,
                    &format!("{prefix}.per_layer_model_projection"),
                    args.hidden_size,
                    total,
                    false,
                )?,
                projection_norm: RmsNorm::load(
                    store,
                    &format!("{prefix}.per_layer_projection_norm"),
                    width,
                    args.rms_norm_eps,
                )?,
                width,
            })
        } else {
            None
        };
        let layers = (0..args.num_hidden_layers as usize)
            .map(|i| {
                let layer = format!("{prefix}.layers.{i}");
                part.layer(i, store, &layer, |store| {
                    DecoderLayer::load(store, quant, &layer, config, i, dir)
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = part.ends(|| {
            RmsNorm::load(
                store,
                &format!("{prefix}.norm"),
                args.hidden_size,
                args.rms_norm_eps,
            )
        })?;
        let first_shared = config.first_kv_shared_layer();
        let kv_source = (0..layers.len())
            .map(|i| {
                if i < first_shared {
                    return i;
                }
                let kind = &args.layer_types[i];
                (0..first_shared)
                    .rev()
                    .find(|&j| &args.layer_types[j] == kind)
                    .expect("validated: every shared layer has a source")
            })
            .collect();
        Ok(Self {
            args,
            part,
            embed_tokens,
            per_layer,
            layers,
            norm,
            kv_source,
            first_shared,
        })
    }

    /// Layers that keep a KV cache (the KV-shared ones keep none).
    pub fn cached_layers(&self) -> usize {
        self.first_shared
    }

    /// One cache per cached layer: a sliding layer's keeps only its window (mlx-lm's
    /// `RotatingKVCache`), a full layer's the whole context.
    pub fn new_caches(&self, max_ctx: usize) -> Vec<KvCache> {
        let window = self.args.sliding_window.max(1) as usize;
        self.args.layer_types[..self.first_shared]
            .iter()
            .map(|kind| match kind.as_str() == "sliding_attention" {
                true => KvCache::windowed(max_ctx, window),
                false => KvCache::new(max_ctx),
            })
            .collect()
    }

    /// `embed_tokens(ids) * sqrt(hidden)`, the scale in the table's dtype.
    pub(super) fn embed(&self, ids: &Array) -> Result<Array> {
        let h = held(&self.embed_tokens, "the embeddings")?.forward(ids)?;
        let scale = scalar((self.args.hidden_size as f64).sqrt(), &h)?;
        Ok(ops::multiply(&h, &scale)?)
    }

    /// Per-layer inputs `[B, L, layers, width]`: the token's per-layer embedding (image and
    /// audio tokens use id 0, as the reference does) joined with a projection of `h`.
    fn per_layer_inputs(&self, per_layer_ids: &Array, h: &Array) -> Result<Option<Array>> {
        let Some(p) = &self.per_layer else {
            return Ok(None);
        };
        let (batch, len) = (h.shape()[0], h.shape()[1]);
        let layers = self.layers.len() as i32;
        let shape = [batch, len, layers, p.width];
        let tokens = p.embed_tokens_per_layer.forward(per_layer_ids)?;
        let tokens =
            ops::multiply(&tokens, scalar((p.width as f64).sqrt(), &tokens)?)?.reshape(&shape)?;
        let projected = p.model_projection.forward(h)?;
        let projected = ops::multiply(
            &projected,
            scalar((self.args.hidden_size as f64).powf(-0.5), &projected)?,
        )?
        .reshape(&shape)?;
        let projected = p.projection_norm.forward(&projected)?;
        let joined = ops::add(&projected, &tokens)?;
        Ok(Some(ops::multiply(
            &joined,
            scalar(0.5f64.sqrt(), &joined)?,
        )?))
    }

    /// Embeddings `h` `[B, L, hidden]` (images already in place) through the decoder.
    /// `images` are each row's chunk-relative soft-token spans that attend both ways.
    pub(super) fn forward_embeddings(
        &self,
        h: Array,
        per_layer_ids: &Array,
        images: &[Vec<Range<usize>>],
        caches: &mut [KvCache],
        logits: Logits,
    ) -> Result<Array> {
        let per_layer = self.per_layer_inputs(per_layer_ids, &h)?;
        self.decode(h, per_layer, images, caches, logits)
    }

    /// A pipeline follower's forward: the hidden state, per-layer inputs and image spans rank
    /// 0 made, through this rank's layers.
    pub(super) fn forward_received(&self, caches: &mut [KvCache], logits: Logits) -> Result<Array> {
        let stage = self
            .part
            .follower()
            .ok_or_else(|| EngineError::Internal("not a pipeline follower".into()))?;
        let mut arrays = stage.receive()?.into_iter();
        let missing = || EngineError::Distributed("a Gemma 4 chunk came incomplete".into());
        let h = arrays.next().ok_or_else(missing)?;
        let per_layer = arrays.next().ok_or_else(missing)?;
        let spans = arrays.next().ok_or_else(missing)?;
        let spans: Vec<Range<usize>> = match spans.size() {
            0 => Vec::new(),
            _ => spans
                .as_dtype(mlx_rs::Dtype::Int32)?
                .as_slice::<i32>()
                .chunks(2)
                .map(|pair| pair[0] as usize..pair[1] as usize)
                .collect(),
        };
        let per_layer = (per_layer.size() > 0).then_some(per_layer);
        self.decode(h, per_layer, &[spans], caches, logits)
    }

    /// The decoder from embeddings `h` and their per-layer inputs: this process's layers
    /// (across ranks the others', whose caches move in step, empty), then the logits where
    /// the output layer is (None-shaped `no_logits` on a pipeline's other ranks).
    fn decode(
        &self,
        mut h: Array,
        per_layer: Option<Array>,
        images: &[Vec<Range<usize>>],
        caches: &mut [KvCache],
        logits: Logits,
    ) -> Result<Array> {
        if caches.len() != self.first_shared {
            return Err(EngineError::InvalidRequest(format!(
                "Gemma 4 needs {} layer caches, got {}",
                self.first_shared,
                caches.len()
            )));
        }
        let (batch, len) = (h.shape()[0], h.shape()[1]);
        let start = chunk_start(caches);
        let first = caches
            .first()
            .ok_or_else(|| EngineError::InvalidRequest("Gemma 4 needs its layer caches".into()))?;
        let offset = first.rope_offset();
        let masks = ChunkMasks::new(first, len, self.args.sliding_window, images)?;
        let mut shared: Vec<Option<Fetched>> = vec![None; self.layers.len()];
        for (index, layer) in self.layers.iter().enumerate() {
            let Some(layer) = layer else {
                if index < self.first_shared {
                    caches[index].shadow_step(batch, len)?;
                }
                continue;
            };
            let source = self.kv_source[index];
            let input = per_layer
                .as_ref()
                .map(|all| all.index((.., .., index as i32, ..)));
            let (cache, reused) = if index < self.first_shared {
                (Some(&mut caches[index]), None)
            } else {
                (None, shared[source].as_ref())
            };
            let (out, kv) = layer.forward(&h, cache, reused, input.as_ref(), &offset, &masks)?;
            h = out;
            if index < self.first_shared {
                shared[index] = Some(kv);
            }
        }
        let riders = match self.part.stage() {
            Some(_) => {
                // A pipeline takes image prompts one at a time (`groups_images`).
                if images.len() > 1 {
                    return Err(EngineError::Distributed(
                        "a pipeline prefills image prompts one at a time".into(),
                    ));
                }
                let spans: Vec<i32> = images
                    .iter()
                    .flatten()
                    .flat_map(|span| [span.start as i32, span.end as i32])
                    .collect();
                vec![
                    per_layer.unwrap_or(ops::zeros::<f32>(&[0])?),
                    Array::from_slice(&spans, &[spans.len() as i32]),
                ]
            }
            None => Vec::new(),
        };
        let Some(mut h) = stage_output(&self.part, h, &riders, logits, &start)? else {
            return crate::distributed::pipeline::no_logits();
        };
        let len = h.shape()[1];
        if logits != Logits::All && len > 1 {
            h = h.index((.., (len - 1)..));
        }
        let h = held(&self.norm, "the final norm")?.forward(&h)?;
        let out = held(&self.embed_tokens, "the embeddings")?.as_linear(&h)?;
        match self.args.final_logit_softcapping {
            Some(cap) if cap > 0.0 => {
                let cap_array = scalar(cap as f64, &out)?;
                Ok(ops::multiply(
                    ops::tanh(&ops::divide(&out, &cap_array)?)?,
                    &cap_array,
                )?)
            }
            _ => Ok(out),
        }
    }
}
