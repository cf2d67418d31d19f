//! The multi-token-prediction head Qwen3.5 / Qwen3.6 ship beside the trunk (`mtp.*`): the
//! embedding of the next token and the trunk's final-norm hidden state at a position, each
//! RMS-normed, concatenated (embedding first) and projected by `fc`; then one full-attention
//! decoder layer shaped like the trunk's (dense or MoE, its own KV cache); then a norm. The
//! shared lm_head scores the result as a draft of the token after next, and the result stands
//! in for the trunk's hidden state when the head is applied again for a deeper draft.
//! Reference: mlx-vlm `speculative/drafters/qwen3_5_mtp/qwen3_5_mtp.py`
//! (`Qwen3_5MTPDraftModel._forward_hidden`, `sanitize`); vLLM `qwen3_5_mtp.py`.

use mlx_rs::{ops, Array};

use super::{
    config::{Config, MoeConfig},
    language::DecoderLayer,
};
use crate::{
    cache::KvCache,
    config::QuantizationConfig,
    error::Result,
    models::qwen3_vl::language::RotaryAngles,
    nn::{Linear, RmsNorm},
    weights::WeightStore,
};

pub struct MtpHead {
    fc: Linear,
    pre_fc_norm_embedding: RmsNorm,
    pre_fc_norm_hidden: RmsNorm,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
}

impl MtpHead {
    /// The head's tensors under `mtp.`, norms already shifted to mlx's convention (see the
    /// family's `sanitize`). Its layers are full-attention layers however the trunk's first
    /// layers are built.
    pub fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        config: &Config,
        moe: Option<&MoeConfig>,
        layers: usize,
    ) -> Result<Self> {
        let text = &config.text_config;
        let (hidden, eps) = (text.hidden_size, text.rms_norm_eps);
        let norm = |store: &mut WeightStore, name: &str| {
            RmsNorm::load(store, &format!("mtp.{name}"), hidden, eps)
        };
        Ok(Self {
            fc: Linear::load(store, quant, "mtp.fc", 2 * hidden, hidden, false)?,
            pre_fc_norm_embedding: norm(store, "pre_fc_norm_embedding")?,
            pre_fc_norm_hidden: norm(store, "pre_fc_norm_hidden")?,
            layers: (0..layers)
                .map(|index| {
                    let prefix = format!("mtp.layers.{index}");
                    DecoderLayer::load(store, quant, config, moe, &prefix, false)
                })
                .collect::<Result<_>>()?,
            norm: norm(store, "norm")?,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// `embeds` `[B, T, H]` (the next tokens' embeddings) paired with `hidden` `[B, T, H]` at
    /// positions `rotary`, appended to `caches` (one per head layer); returns the head's normed
    /// outputs `[B, T, H]`.
    pub(crate) fn forward(
        &self,
        embeds: &Array,
        hidden: &Array,
        rotary: &RotaryAngles,
        caches: &mut [KvCache],
    ) -> Result<Array> {
        let joined = ops::concatenate(
            &[
                self.pre_fc_norm_embedding.forward(embeds)?,
                self.pre_fc_norm_hidden
                    .forward(&hidden.as_dtype(embeds.dtype())?)?,
            ],
            -1,
        )?;
        let mut h = self.fc.forward(&joined)?;
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            h = layer.forward(&h, rotary, cache)?;
        }
        self.norm.forward(&h)
    }
}
