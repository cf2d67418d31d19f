//! Qwen3 (`model_type: qwen3`): GQA attention with per-head q/k RMSNorm, SwiGLU MLP.
//! Reference: mlx-lm `models/qwen3.py` (same order: config, attention, MLP, block, model).

use std::path::Path;

use mlx_rs::{ops, ops::indexing::IndexOp, Array};
use serde::{Deserialize, Serialize};

use super::{
    batch_and_len, chunk_start, held, stage_input, stage_output, LanguageModel, Logits, Part,
};
use crate::distributed::pipeline::no_logits;
use crate::{
    attention::attend_update,
    cache::{KvCache, RopeOffset},
    config::{ConfigFile, QuantizationConfig},
    error::{EngineError, Result},
    nn::{rope, swiglu, Embedding, GatedMlp, Linear, RmsNorm},
    weights::WeightStore,
};

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Config {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub max_position_embeddings: usize,
    pub head_dim: i32,
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub rope_theta: Option<f32>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// transformers >= 5 nests rope_theta and rope_scaling here.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    /// Structural switches of the transformers class that mlx-lm's Qwen3 fixes: read so a
    /// checkpoint that turns one on is refused instead of computed wrongly.
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub use_sliding_window: bool,
    #[serde(default)]
    pub sliding_window: Option<i32>,
    #[serde(default)]
    pub max_window_layers: Option<i32>,
}

impl Config {
    /// Refuses the switches this implementation (like mlx-lm's) does not compute.
    pub(crate) fn validate(&self, path: &Path) -> Result<()> {
        if self.attention_bias {
            return Err(config_error(path, "attention_bias: true is not supported"));
        }
        if let Some(act) = self.hidden_act.as_deref().filter(|act| *act != "silu") {
            return Err(config_error(
                path,
                &format!("hidden_act `{act}` is not supported (Qwen3 uses silu)"),
            ));
        }
        if self.use_sliding_window {
            return Err(config_error(
                path,
                "use_sliding_window: true is not supported (no released Qwen3 sets it)",
            ));
        }
        Ok(())
    }

    /// RoPE base and position scale; scaling types other than linear are refused, not ignored.
    pub(crate) fn rope(&self, path: &Path) -> Result<(f32, f32)> {
        let nested = self.rope_parameters.as_ref();
        let base = self
            .rope_theta
            .or_else(|| {
                nested
                    .and_then(|p| p["rope_theta"].as_f64())
                    .map(|v| v as f32)
            })
            .ok_or_else(|| config_error(path, "rope_theta is missing"))?;
        let scaling = self
            .rope_scaling
            .as_ref()
            .or(nested)
            .filter(|s| !s.is_null());
        let kind = scaling
            .and_then(|s| s.get("rope_type").or(s.get("type")))
            .and_then(|t| t.as_str());
        let scale = match kind {
            None | Some("default") => 1.0,
            Some("linear") => {
                let factor = scaling.and_then(|s| s["factor"].as_f64()).unwrap_or(1.0);
                1.0 / factor as f32
            }
            Some(other) => {
                return Err(config_error(
                    path,
                    &format!("rope_scaling type `{other}` is not supported yet"),
                ))
            }
        };
        Ok((base, scale))
    }
}

fn config_error(path: &Path, message: &str) -> EngineError {
    EngineError::Config {
        path: path.join("config.json"),
        message: message.to_string(),
    }
}

/// Head geometry of a Qwen3 attention layer (the text model's and Qwen3-VL's decoder share it).
pub(crate) struct AttentionShape {
    pub hidden: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub eps: f32,
}

/// GQA attention with per-head q/k RMSNorm; the rotary step is the caller's (plain RoPE for
/// Qwen3, interleaved MRoPE for Qwen3-VL), so both decoders share everything else.
pub(crate) struct Attention {
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    scale: f32,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
}

impl Attention {
    pub(crate) fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        prefix: &str,
        shape: AttentionShape,
    ) -> Result<Self> {
        let AttentionShape {
            hidden,
            heads,
            kv_heads,
            head_dim,
            eps,
        } = shape;
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
        Ok(Self {
            n_heads: heads,
            n_kv_heads: kv_heads,
            head_dim,
            scale: (head_dim as f32).powf(-0.5),
            q_proj: linear(store, "q_proj", hidden, heads * head_dim)?,
            k_proj: linear(store, "k_proj", hidden, kv_heads * head_dim)?,
            v_proj: linear(store, "v_proj", hidden, kv_heads * head_dim)?,
            o_proj: linear(store, "o_proj", heads * head_dim, hidden)?,
            q_norm: RmsNorm::load(store, &format!("{prefix}.q_norm"), head_dim, eps)?,
            k_norm: RmsNorm::load(store, &format!("{prefix}.k_norm"), head_dim, eps)?,
        })
    }

    /// `rotate(x, offset)` positions `[B, heads, L, dim]` queries/keys starting at `offset`.
    pub(crate) fn forward(
        &self,
        x: &Array,
        cache: &mut KvCache,
        rotate: impl Fn(&Array, &RopeOffset) -> Result<Array>,
    ) -> Result<Array> {
        let (batch, len) = (x.shape()[0], x.shape()[1]);
        let heads =
            |projected: Array, count: i32| projected.reshape(&[batch, len, count, self.head_dim]);
        let queries = self
            .q_norm
            .forward(&heads(self.q_proj.forward(x)?, self.n_heads)?)?
            .transpose_axes(&[0, 2, 1, 3])?;
        let keys = self
            .k_norm
            .forward(&heads(self.k_proj.forward(x)?, self.n_kv_heads)?)?
            .transpose_axes(&[0, 2, 1, 3])?;
        let values =
            heads(self.v_proj.forward(x)?, self.n_kv_heads)?.transpose_axes(&[0, 2, 1, 3])?;

        let offset = cache.rope_offset();
        let queries = rotate(&queries, &offset)?;
        let keys = rotate(&keys, &offset)?;
        // One query needs no mask (but a padded batch's); a chunk is causal against everything
        // cached before it.
        let output = attend_update(&queries, &keys, &values, self.scale, cache)?;
        let output = output
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[batch, len, -1])?;
        self.o_proj.forward(&output)
    }
}

/// SwiGLU MLP, shared with the Qwen3-VL text decoder (and Qwen3.5's dense layers and shared
/// experts).
pub(crate) struct Mlp(GatedMlp);

impl Mlp {
    pub(crate) fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        prefix: &str,
        dim: i32,
        hidden: i32,
    ) -> Result<Self> {
        Ok(Self(GatedMlp::load(store, quant, prefix, dim, hidden)?))
    }

    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        self.0.forward(x, swiglu)
    }
}

/// A decoder layer's feed-forward: the SwiGLU MLP, or experts (`qwen3_moe`).
pub(crate) enum FeedForward {
    Dense(Mlp),
    Experts(super::qwen3_moe::SparseMoeBlock),
}

impl FeedForward {
    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        match self {
            Self::Dense(mlp) => mlp.forward(x),
            Self::Experts(moe) => moe.forward(x),
        }
    }
}

struct TransformerBlock {
    self_attn: Attention,
    /// RoPE base and position scale.
    rope: (f32, f32),
    mlp: FeedForward,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl TransformerBlock {
    fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        prefix: &str,
        args: &Config,
        rope: (f32, f32),
        mlp: FeedForward,
    ) -> Result<Self> {
        Ok(Self {
            self_attn: Attention::load(
                store,
                quant,
                &format!("{prefix}.self_attn"),
                AttentionShape {
                    hidden: args.hidden_size,
                    heads: args.num_attention_heads,
                    kv_heads: args.num_key_value_heads,
                    head_dim: args.head_dim,
                    eps: args.rms_norm_eps,
                },
            )?,
            rope,
            mlp,
            input_layernorm: RmsNorm::load(
                store,
                &format!("{prefix}.input_layernorm"),
                args.hidden_size,
                args.rms_norm_eps,
            )?,
            post_attention_layernorm: RmsNorm::load(
                store,
                &format!("{prefix}.post_attention_layernorm"),
                args.hidden_size,
                args.rms_norm_eps,
            )?,
        })
    }

    fn forward(&self, x: &Array, cache: &mut KvCache) -> Result<Array> {
        let (base, scale) = self.rope;
        let dims = self.self_attn.head_dim;
        let rotate =
            |x: &Array, offset: &RopeOffset| rope(x, dims, false, Some(base), scale, offset, None);
        let h = ops::add(
            x,
            self.self_attn
                .forward(&self.input_layernorm.forward(x)?, cache, rotate)?,
        )?;
        Ok(ops::add(
            &h,
            self.mlp
                .forward(&self.post_attention_layernorm.forward(&h)?)?,
        )?)
    }
}

pub struct Model {
    args: Config,
    part: Part,
    /// Rank 0's (None on a pipeline's other ranks), as are `norm` and `lm_head`.
    embed_tokens: Option<Embedding>,
    /// None where another pipeline rank computes the layer.
    layers: Vec<Option<TransformerBlock>>,
    norm: Option<RmsNorm>,
    lm_head: Option<Linear>,
}

impl Model {
    pub fn load(
        dir: &Path,
        config: &ConfigFile,
        store: &mut WeightStore,
        part: Part,
    ) -> Result<Self> {
        let args: Config = config.family(dir)?;
        let quant = config.base.quantization.as_ref();
        let (hidden, intermediate) = (args.hidden_size, args.intermediate_size);
        Self::load_with(dir, config, store, args, part, |store, prefix, _| {
            Ok(FeedForward::Dense(Mlp::load(
                store,
                quant,
                prefix,
                hidden,
                intermediate,
            )?))
        })
    }

    /// Loads the decoder with each layer's feed-forward built by `mlp(store, "…mlp", layer)`
    /// (dense for `qwen3`, experts where `qwen3_moe` places them).
    pub(crate) fn load_with(
        dir: &Path,
        config: &ConfigFile,
        store: &mut WeightStore,
        args: Config,
        part: Part,
        mut mlp: impl FnMut(&mut WeightStore, &str, usize) -> Result<FeedForward>,
    ) -> Result<Self> {
        args.validate(dir)?;
        let rope = args.rope(dir)?;
        let quant = config.base.quantization.as_ref();
        // sanitize: a tied model ignores a stray lm_head, as mlx-lm does.
        if args.tie_word_embeddings {
            store.discard_prefix("lm_head.");
        }
        part.drop_ends(store, &["model.embed_tokens.", "model.norm.", "lm_head."]);
        let embed_tokens = part.ends(|| {
            Embedding::load(
                store,
                quant,
                "model.embed_tokens",
                args.vocab_size,
                args.hidden_size,
            )
        })?;
        let layers = (0..args.num_hidden_layers as usize)
            .map(|index| {
                let prefix = format!("model.layers.{index}");
                part.layer(index, store, &prefix, |store| {
                    let ffn = mlp(store, &format!("{prefix}.mlp"), index)?;
                    TransformerBlock::load(store, quant, &prefix, &args, rope, ffn)
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm =
            part.ends(|| RmsNorm::load(store, "model.norm", args.hidden_size, args.rms_norm_eps))?;
        let lm_head = if args.tie_word_embeddings || !part.has_ends() {
            None
        } else {
            Some(Linear::load(
                store,
                quant,
                "lm_head",
                args.hidden_size,
                args.vocab_size,
                false,
            )?)
        };
        Ok(Self {
            args,
            part,
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }
}

impl LanguageModel for Model {
    fn forward(&self, inputs: &Array, caches: &mut [KvCache], logits: Logits) -> Result<Array> {
        let (mut h, _) = stage_input(&self.part, || {
            Ok((
                held(&self.embed_tokens, "the embeddings")?.forward(inputs)?,
                Vec::new(),
            ))
        })?;
        let (batch, len) = batch_and_len(&h);
        let start = chunk_start(caches);
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            match layer {
                Some(layer) => h = layer.forward(&h, cache)?,
                None => cache.shadow_step(batch, len)?,
            }
        }
        let Some(mut h) = stage_output(&self.part, h, &[], logits, &start)? else {
            return no_logits();
        };
        if logits != Logits::All && h.shape()[1] > 1 {
            let last = h.shape()[1] - 1;
            h = h.index((.., last..));
        }
        let h = held(&self.norm, "the final norm")?.forward(&h)?;
        match &self.lm_head {
            Some(head) => head.forward(&h),
            None => held(&self.embed_tokens, "the embeddings")?.as_linear(&h),
        }
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn vocab_size(&self) -> usize {
        self.args.vocab_size as usize
    }

    fn max_position_embeddings(&self) -> usize {
        self.args.max_position_embeddings
    }
}
