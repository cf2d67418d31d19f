//! Qwen3.5 text decoder: three Gated DeltaNet layers to one gated full-attention layer, each
//! followed by a SwiGLU MLP (`qwen3_5`) or routed experts plus a gated shared expert
//! (`qwen3_5_moe`). Reference: mlx-vlm `models/qwen3_5/language.py` (Qwen3_5GatedDeltaNet,
//! Qwen3_5Attention, Qwen3_5DecoderLayer, Qwen3_5Model) and `models/qwen3_5_moe/language.py`
//! (Qwen3_5MoeSparseMoeBlock); mlx-lm `models/qwen3_5.py` computes the same.

use mlx_rs::{fast, ops, ops::indexing::IndexOp, Array, Dtype};

use super::{
    config::{Config, LinearShape, MoeConfig},
    gated_delta,
};
use crate::{
    attention::attend_update,
    cache::{KvCache, RecurrentState, StepInputs},
    config::QuantizationConfig,
    error::Result,
    models::{
        batch_and_len, held,
        qwen3::Mlp,
        qwen3_vl::{
            config::Rope,
            language::{load_embeddings, ChunkRows, RotaryAngles},
        },
        stage_output,
        switch::{combine, GluActivation, SoftmaxTopK, SwitchGlu, SwitchLinear},
        ChunkStart, Logits, Part,
    },
    nn::{scalar, Embedding, Linear, Projections, RmsNorm},
    weights::{DtypeKind, WeightStore},
};

/// The linear-attention mixer: a causal depthwise conv over q | k | v, L2-normalised q and k,
/// the gated delta rule, then an RMS norm gated by `silu(z)` (in float32).
struct GatedDeltaNet {
    shape: LinearShape,
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` as one matmul where they can be.
    in_proj: Projections,
    /// The depthwise conv's K taps, each `[conv_dim]` in float32 (see `gated_delta::conv_taps`).
    conv_taps: Vec<Array>,
    dt_bias: Array,
    /// Kept in float32 by the converters.
    a_log: Array,
    norm: RmsNorm,
    out_proj: Linear,
}

impl GatedDeltaNet {
    fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        prefix: &str,
        hidden: i32,
        shape: LinearShape,
        eps: f32,
    ) -> Result<Self> {
        let key_total = shape.key_heads * shape.key_dim;
        let value_total = shape.value_heads * shape.value_dim;
        let linear = |store: &mut WeightStore, name: &str, inputs: i32, outputs: i32| {
            Linear::load(
                store,
                quant,
                &format!("{prefix}.{name}"),
                inputs,
                outputs,
                false,
            )
        };
        let vector = |store: &mut WeightStore, name: &str| {
            store.take(
                &format!("{prefix}.{name}"),
                &[shape.value_heads],
                DtypeKind::Float,
            )
        };
        let conv1d = store.take(
            &format!("{prefix}.conv1d.weight"),
            &[shape.conv_dim(), shape.kernel, 1],
            DtypeKind::Float,
        )?;
        let conv_taps = gated_delta::conv_taps(&conv1d)?
            .into_iter()
            .map(|tap| store.derived(tap))
            .collect::<Result<_>>()?;
        Ok(Self {
            shape,
            conv_taps,
            in_proj: Projections::load(
                store,
                quant,
                &["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
                    .map(|name| format!("{prefix}.{name}")),
                hidden,
                &[
                    2 * key_total + value_total,
                    value_total,
                    shape.value_heads,
                    shape.value_heads,
                ],
            )?,
            dt_bias: vector(store, "dt_bias")?,
            a_log: vector(store, "A_log")?,
            norm: RmsNorm::load(store, &format!("{prefix}.norm"), shape.value_dim, eps)?,
            out_proj: linear(store, "out_proj", value_total, hidden)?,
        })
    }

    fn forward(&self, x: &Array, cache: &mut KvCache) -> Result<Array> {
        let (batch, len) = (x.shape()[0], x.shape()[1]);
        let LinearShape {
            key_heads,
            value_heads,
            key_dim,
            value_dim,
            kernel,
        } = self.shape;
        let conv_dim = self.shape.conv_dim();
        let [qkv, z, b, a] = self.in_proj.forward(x)?;
        let z = z.reshape(&[batch, len, value_heads, value_dim])?;

        let (conv_state, state) = match cache.recurrent() {
            Some(held) => (held.conv.clone(), held.state.clone()),
            None => (
                ops::zeros_dtype(&[batch, kernel - 1, conv_dim], x.dtype())?,
                ops::zeros_dtype(&[batch, value_heads, value_dim, key_dim], Dtype::Float32)?,
            ),
        };
        let conv_input = ops::concatenate(&[&conv_state, &qkv], 1)?;
        let window = conv_input.shape()[1];
        let next_conv = conv_input
            .index((.., (window - (kernel - 1))..))
            .contiguous()?;
        let conv_out = gated_delta::causal_conv_silu(&conv_input, &self.conv_taps)?;

        let key_total = key_heads * key_dim;
        let parts = conv_out.split_at_indices(&[key_total, 2 * key_total], -1)?;
        let q = parts[0].reshape(&[batch, len, key_heads, key_dim])?;
        let k = parts[1].reshape(&[batch, len, key_heads, key_dim])?;
        let v = parts[2].reshape(&[batch, len, value_heads, value_dim])?;
        // L2-normalise q and k (rms_norm · Dk^-1/2) and fold the Dk^-1/2 readout scale into q,
        // with mlx-vlm's eps 1e-6 on the mean square.
        let inv_scale = (key_dim as f64).powf(-0.5);
        let q = ops::multiply(
            scalar(inv_scale * inv_scale, &q)?,
            fast::rms_norm(&q, None, 1e-6)?,
        )?;
        let k = ops::multiply(scalar(inv_scale, &k)?, fast::rms_norm(&k, None, 1e-6)?)?;
        let beta = ops::sigmoid(&b)?;
        let g = gated_delta::decay(&self.a_log, &a, &self.dt_bias)?;
        let (y, state) = match cache.is_speculating() {
            true => {
                let (y, last, states) =
                    gated_delta::speculative_ops(&q, &k, &v, &g, &beta, &state)?;
                // Kept so that a speculative step can be cut back to any prefix without a
                // forward: every token's state where the form gives them, else its inputs.
                cache.stash_steps(StepInputs {
                    before: state,
                    conv_input: conv_input.clone(),
                    inputs: match states {
                        Some(_) => Vec::new(),
                        None => vec![q, k, v, g, beta],
                    },
                    states,
                    replay: gated_delta::replay_kept,
                });
                (y, last)
            }
            false => gated_delta::gated_delta_ops(&q, &k, &v, &g, &beta, &state)?,
        };
        cache.set_recurrent(
            RecurrentState {
                conv: next_conv,
                state,
            },
            len,
        )?;

        // RMSNormGated: rms_norm(y) · silu(z), the product in float32 (`_precise_swiglu`).
        let normed = self.norm.forward(&y)?;
        let z32 = z.as_dtype(Dtype::Float32)?;
        let gate = ops::multiply(&z32, ops::sigmoid(&z32)?)?;
        let out = ops::multiply(&gate, normed.as_dtype(Dtype::Float32)?)?.as_dtype(y.dtype())?;
        self.out_proj
            .forward(&out.reshape(&[batch, len, value_heads * value_dim])?)
    }
}

/// Full attention whose q_proj also emits a per-head output gate: `o_proj(attn · σ(gate))`,
/// with q/k RMSNorm and MRoPE on the first `rotary_dim` dims of each head.
struct GatedAttention {
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
}

impl GatedAttention {
    fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        prefix: &str,
        config: &Config,
    ) -> Result<Self> {
        let text = &config.text_config;
        let (hidden, heads, kv_heads, head_dim) = (
            text.hidden_size,
            text.num_attention_heads,
            text.num_key_value_heads,
            text.head_dim,
        );
        let linear = |store: &mut WeightStore, name: &str, inputs: i32, outputs: i32| {
            Linear::load(
                store,
                quant,
                &format!("{prefix}.{name}"),
                inputs,
                outputs,
                false,
            )
        };
        let norm = |store: &mut WeightStore, name: &str| {
            RmsNorm::load(
                store,
                &format!("{prefix}.{name}"),
                head_dim,
                text.rms_norm_eps,
            )
        };
        Ok(Self {
            heads,
            kv_heads,
            head_dim,
            scale: (head_dim as f32).powf(-0.5),
            q_proj: linear(store, "q_proj", hidden, 2 * heads * head_dim)?,
            k_proj: linear(store, "k_proj", hidden, kv_heads * head_dim)?,
            v_proj: linear(store, "v_proj", hidden, kv_heads * head_dim)?,
            o_proj: linear(store, "o_proj", heads * head_dim, hidden)?,
            q_norm: norm(store, "q_norm")?,
            k_norm: norm(store, "k_norm")?,
        })
    }

    fn forward(&self, x: &Array, rotary: &RotaryAngles, cache: &mut KvCache) -> Result<Array> {
        let (batch, len) = (x.shape()[0], x.shape()[1]);
        // Per head the first head_dim values are the query, the next head_dim its gate.
        let projected =
            self.q_proj
                .forward(x)?
                .reshape(&[batch, len, self.heads, 2 * self.head_dim])?;
        let halves = projected.split_equal(2, -1)?;
        let gate = halves[1].reshape(&[batch, len, -1])?;
        let queries = self
            .q_norm
            .forward(&halves[0])?
            .transpose_axes(&[0, 2, 1, 3])?;
        let keys = self
            .k_norm
            .forward(&self.k_proj.forward(x)?.reshape(&[
                batch,
                len,
                self.kv_heads,
                self.head_dim,
            ])?)?
            .transpose_axes(&[0, 2, 1, 3])?;
        let values = self
            .v_proj
            .forward(x)?
            .reshape(&[batch, len, self.kv_heads, self.head_dim])?
            .transpose_axes(&[0, 2, 1, 3])?;
        let queries = rotary.apply(&queries)?;
        let keys = rotary.apply(&keys)?;
        let output = attend_update(&queries, &keys, &values, self.scale, cache)?
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[batch, len, -1])?;
        self.o_proj
            .forward(&ops::multiply(&output, ops::sigmoid(&gate)?)?)
    }
}

/// Routed experts (softmax top-k, always renormalised) plus a shared SwiGLU expert scaled by
/// `σ(shared_expert_gate(x))`.
struct SparseMoeBlock {
    router: SoftmaxTopK,
    switch_mlp: SwitchGlu,
    shared_expert: Mlp,
    shared_expert_gate: Linear,
}

impl SparseMoeBlock {
    /// Experts either stacked as mlx writes them (`switch_mlp.*`, quantized or not) or fused as
    /// the Hugging Face release ships them: `experts.gate_up_proj` `[E, 2I, H]` (gate rows
    /// first) and `experts.down_proj` `[E, H, I]`, already in mlx's orientation (mlx-vlm
    /// `qwen3_5_moe.py` sanitize splits them the same way).
    fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        prefix: &str,
        hidden: i32,
        moe: &MoeConfig,
    ) -> Result<Self> {
        let (experts, inter) = (moe.num_experts, moe.moe_intermediate_size);
        let router = SoftmaxTopK {
            gate: Linear::load(
                store,
                quant,
                &format!("{prefix}.gate"),
                hidden,
                experts,
                false,
            )?,
            experts,
            top_k: moe.top_k,
            normalize: true,
        };
        let fused = format!("{prefix}.experts.gate_up_proj");
        let switch_mlp = if store.contains(&fused) {
            let gate_up = store.take(&fused, &[experts, 2 * inter, hidden], DtypeKind::Float)?;
            let down = store.take(
                &format!("{prefix}.experts.down_proj"),
                &[experts, hidden, inter],
                DtypeKind::Float,
            )?;
            let mut half = |rows: std::ops::Range<i32>| -> Result<SwitchLinear> {
                Ok(SwitchLinear::dense(store.derived(gate_up.index((
                    ..,
                    rows,
                    ..,
                )))?))
            };
            SwitchGlu {
                gate_proj: half(0..inter)?,
                up_proj: half(inter..2 * inter)?,
                down_proj: SwitchLinear::dense(down),
                activation: GluActivation::Silu,
            }
        } else {
            let projection = |store: &mut WeightStore, name: &str, inputs: i32, outputs: i32| {
                SwitchLinear::load(
                    store,
                    quant,
                    &format!("{prefix}.switch_mlp.{name}"),
                    experts,
                    inputs,
                    outputs,
                )
            };
            SwitchGlu {
                gate_proj: projection(store, "gate_proj", hidden, inter)?,
                up_proj: projection(store, "up_proj", hidden, inter)?,
                down_proj: projection(store, "down_proj", inter, hidden)?,
                activation: GluActivation::Silu,
            }
        };
        Ok(Self {
            router,
            switch_mlp,
            shared_expert: Mlp::load(
                store,
                quant,
                &format!("{prefix}.shared_expert"),
                hidden,
                moe.shared_expert_intermediate_size,
            )?,
            shared_expert_gate: Linear::load(
                store,
                quant,
                &format!("{prefix}.shared_expert_gate"),
                hidden,
                1,
                false,
            )?,
        })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        let (indices, scores) = self.router.route(x)?;
        let routed = combine(&self.switch_mlp.forward(x, &indices)?, &scores)?;
        let shared = ops::multiply(
            ops::sigmoid(self.shared_expert_gate.forward(x)?)?,
            self.shared_expert.forward(x)?,
        )?;
        Ok(ops::add(&routed, &shared)?)
    }
}

enum Mixer {
    Linear(GatedDeltaNet),
    Attention(GatedAttention),
}

enum FeedForward {
    Dense(Mlp),
    Experts(Box<SparseMoeBlock>),
}

pub(super) struct DecoderLayer {
    mixer: Mixer,
    mlp: FeedForward,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    /// The layer at `prefix`: a Gated DeltaNet mixer when `linear`, else gated attention.
    pub(super) fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        config: &Config,
        moe: Option<&MoeConfig>,
        prefix: &str,
        linear: bool,
    ) -> Result<Self> {
        let text = &config.text_config;
        let (hidden, eps) = (text.hidden_size, text.rms_norm_eps);
        let mixer = if linear {
            Mixer::Linear(GatedDeltaNet::load(
                store,
                quant,
                &format!("{prefix}.linear_attn"),
                hidden,
                config.linear_shape(),
                eps,
            )?)
        } else {
            Mixer::Attention(GatedAttention::load(
                store,
                quant,
                &format!("{prefix}.self_attn"),
                config,
            )?)
        };
        let mlp_prefix = format!("{prefix}.mlp");
        let mlp = match moe {
            Some(moe) => FeedForward::Experts(Box::new(SparseMoeBlock::load(
                store,
                quant,
                &mlp_prefix,
                hidden,
                moe,
            )?)),
            None => FeedForward::Dense(Mlp::load(
                store,
                quant,
                &mlp_prefix,
                hidden,
                text.intermediate_size.unwrap_or_default(),
            )?),
        };
        let norm = |store: &mut WeightStore, name: &str| {
            RmsNorm::load(store, &format!("{prefix}.{name}"), hidden, eps)
        };
        Ok(Self {
            mixer,
            mlp,
            input_layernorm: norm(store, "input_layernorm")?,
            post_attention_layernorm: norm(store, "post_attention_layernorm")?,
        })
    }

    pub(super) fn forward(
        &self,
        x: &Array,
        rotary: &RotaryAngles,
        cache: &mut KvCache,
    ) -> Result<Array> {
        let normed = self.input_layernorm.forward(x)?;
        let mixed = match &self.mixer {
            Mixer::Linear(layer) => layer.forward(&normed, cache)?,
            Mixer::Attention(layer) => layer.forward(&normed, rotary, cache)?,
        };
        let h = ops::add(x, &mixed)?;
        let normed = self.post_attention_layernorm.forward(&h)?;
        let out = match &self.mlp {
            FeedForward::Dense(mlp) => mlp.forward(&normed)?,
            FeedForward::Experts(moe) => moe.forward(&normed)?,
        };
        Ok(ops::add(&h, &out)?)
    }
}

pub struct LanguageModel {
    pub(super) rope: Rope,
    pub(super) rotary_dim: i32,
    pub(super) part: Part,
    /// Rank 0's (None on a pipeline's other ranks), as are `norm` and `lm_head`.
    embed_tokens: Option<Embedding>,
    /// None where another pipeline rank computes the layer.
    layers: Vec<Option<DecoderLayer>>,
    norm: Option<RmsNorm>,
    lm_head: Option<Linear>,
}

impl LanguageModel {
    pub fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        config: &Config,
        moe: Option<&MoeConfig>,
        rope: (Rope, i32),
        part: Part,
    ) -> Result<Self> {
        let text = &config.text_config;
        let tied = config.tied();
        let embed_tokens = load_embeddings(store, quant, &part, text.vocab_size, text.hidden_size)?;
        let layers = (0..text.num_hidden_layers as usize)
            .map(|index| {
                let prefix = format!("language_model.model.layers.{index}");
                part.layer(index, store, &prefix, |store| {
                    DecoderLayer::load(store, quant, config, moe, &prefix, config.is_linear(index))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = part.ends(|| {
            RmsNorm::load(
                store,
                "language_model.model.norm",
                text.hidden_size,
                text.rms_norm_eps,
            )
        })?;
        let lm_head = if tied || !part.has_ends() {
            None
        } else {
            Some(Linear::load(
                store,
                quant,
                "language_model.lm_head",
                text.hidden_size,
                text.vocab_size,
                false,
            )?)
        };
        Ok(Self {
            rope: rope.0,
            rotary_dim: rope.1,
            part,
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The token embeddings (rank 0's).
    pub(super) fn embed(&self) -> Result<&Embedding> {
        held(&self.embed_tokens, "the embeddings")
    }

    /// Embeddings `[1, L, hidden]` at rotary positions `rows` (t, h, w) through the decoder;
    /// across ranks `riders` go on with the hidden state and `position` is the chunk's start.
    /// A pipeline's other ranks return no logits.
    pub(super) fn forward_embeddings(
        &self,
        h: Array,
        rows: &ChunkRows,
        riders: &[Array],
        start: &ChunkStart,
        caches: &mut [KvCache],
        logits: Logits,
    ) -> Result<Array> {
        let rotary = RotaryAngles::for_chunk(rows, caches, &self.rope, self.rotary_dim)?;
        let h = self.layers_forward(h, &rotary, caches)?;
        let Some(mut h) = stage_output(&self.part, h, riders, logits, start)? else {
            return crate::distributed::pipeline::no_logits();
        };
        if logits != Logits::All && h.shape()[1] > 1 {
            let last = h.shape()[1] - 1;
            h = h.index((.., last..));
        }
        let h = held(&self.norm, "the final norm")?.forward(&h)?;
        self.project(&h)
    }

    /// This process's decoder layers (the others' caches move in step, empty).
    fn layers_forward(
        &self,
        mut h: Array,
        rotary: &RotaryAngles,
        caches: &mut [KvCache],
    ) -> Result<Array> {
        let (batch, len) = batch_and_len(&h);
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            match layer {
                Some(layer) => h = layer.forward(&h, rotary, cache)?,
                None => cache.shadow_step(batch, len)?,
            }
        }
        Ok(h)
    }

    /// The decoder layers and the final norm: the hidden states the lm_head scores (and the
    /// draft head reads), every position (one process: the head is not loaded across ranks).
    pub(super) fn trunk(
        &self,
        h: Array,
        rotary: &RotaryAngles,
        caches: &mut [KvCache],
    ) -> Result<Array> {
        let h = self.layers_forward(h, rotary, caches)?;
        held(&self.norm, "the final norm")?.forward(&h)
    }

    /// The lm_head (the embedding when tied) over final-norm hidden states.
    pub(super) fn project(&self, h: &Array) -> Result<Array> {
        match &self.lm_head {
            Some(head) => head.forward(h),
            None => self.embed()?.as_linear(h),
        }
    }
}
