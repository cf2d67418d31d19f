//! Qwen3.5 / Qwen3.6 config.json (`model_type: qwen3_5` dense, `qwen3_5_moe`): the hybrid text
//! decoder under `text_config` (Gated DeltaNet and gated full-attention layers, dense MLP or
//! routed experts with a shared expert), the Qwen3-VL vision tower under `vision_config`.
//! Reference: mlx-vlm `models/qwen3_5/config.py`, `models/qwen3_5_moe/config.py`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{
    error::{EngineError, Result},
    models::qwen3_vl::config::{Rope, VisionConfig},
};

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct TextConfig {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    /// The dense MLP's width; absent in the MoE releases.
    #[serde(default)]
    pub intermediate_size: Option<i32>,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub max_position_embeddings: usize,
    /// Some releases (9B, 27B, 35B-A3B) carry the tie flag only at the top level.
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub attention_bias: bool,
    /// q_proj emits the query and a sigmoid output gate per head (every release).
    #[serde(default = "yes")]
    pub attn_output_gate: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// Layer i is full attention when `(i + 1) % interval == 0`, linear otherwise.
    pub full_attention_interval: i32,
    /// The same schedule written out; checked against the interval, never trusted alone.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    pub linear_conv_kernel_dim: i32,
    pub linear_key_head_dim: i32,
    pub linear_num_key_heads: i32,
    pub linear_num_value_heads: i32,
    pub linear_value_head_dim: i32,
    /// The recurrent state's dtype; the references keep it float32.
    #[serde(default)]
    pub mamba_ssm_dtype: Option<String>,
    pub rope_parameters: serde_json::Value,
    /// Qwen3.6 repeats `rope_parameters.partial_rotary_factor` here.
    #[serde(default)]
    pub partial_rotary_factor: Option<f32>,
    /// Qwen3.6: the Gated DeltaNet output gate, `swish` (= silu) in every release.
    #[serde(default)]
    pub output_gate_type: Option<String>,
    /// Layers that keep the dense MLP in an MoE model (empty in every release).
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<i32>>,
    #[serde(default)]
    pub num_experts: Option<i32>,
    #[serde(default)]
    pub num_experts_per_tok: Option<i32>,
    #[serde(default)]
    pub moe_intermediate_size: Option<i32>,
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<i32>,
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    /// The multi-token-prediction draft head shipped beside the trunk (`mtp.*` tensors): set
    /// aside, since rMLX does not draft speculatively.
    #[serde(default)]
    pub mtp_num_hidden_layers: Option<i32>,
    #[serde(default)]
    pub mtp_use_dedicated_embeddings: Option<bool>,
}

fn yes() -> bool {
    true
}

/// The routed experts of a `qwen3_5_moe` layer.
#[derive(Debug, Clone)]
pub struct MoeConfig {
    pub num_experts: i32,
    pub top_k: i32,
    pub moe_intermediate_size: i32,
    pub shared_expert_intermediate_size: i32,
}

/// Geometry of a Gated DeltaNet layer.
#[derive(Debug, Clone, Copy)]
pub struct LinearShape {
    pub key_heads: i32,
    pub value_heads: i32,
    pub key_dim: i32,
    pub value_dim: i32,
    pub kernel: i32,
}

impl LinearShape {
    /// Channels of the causal conv: q | k | v.
    pub fn conv_dim(&self) -> i32 {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Config {
    pub text_config: TextConfig,
    pub vision_config: VisionConfig,
    pub image_token_id: u32,
    pub video_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    /// Qwen3.6: a checkpoint without its vision tower would say true.
    #[serde(default)]
    pub language_model_only: Option<bool>,
}

impl Config {
    pub fn tied(&self) -> bool {
        self.tie_word_embeddings
            .or(self.text_config.tie_word_embeddings)
            .unwrap_or(false)
    }

    pub fn is_linear(&self, layer: usize) -> bool {
        (layer as i32 + 1) % self.text_config.full_attention_interval != 0
    }

    pub fn linear_shape(&self) -> LinearShape {
        let text = &self.text_config;
        LinearShape {
            key_heads: text.linear_num_key_heads,
            value_heads: text.linear_num_value_heads,
            key_dim: text.linear_key_head_dim,
            value_dim: text.linear_value_head_dim,
            kernel: text.linear_conv_kernel_dim,
        }
    }

    /// The experts when `model_type` is `qwen3_5_moe` (every layer routes, as in mlx-vlm).
    pub fn moe(&self, dir: &Path, model_type: &str) -> Result<Option<MoeConfig>> {
        if model_type != "qwen3_5_moe" {
            return Ok(None);
        }
        let text = &self.text_config;
        let need = |value: Option<i32>, key: &str| {
            value.ok_or_else(|| config_error(dir, &format!("text_config.{key} is missing")))
        };
        let moe = MoeConfig {
            num_experts: need(text.num_experts, "num_experts")?,
            top_k: need(text.num_experts_per_tok, "num_experts_per_tok")?,
            moe_intermediate_size: need(text.moe_intermediate_size, "moe_intermediate_size")?,
            shared_expert_intermediate_size: need(
                text.shared_expert_intermediate_size,
                "shared_expert_intermediate_size",
            )?,
        };
        if moe.top_k < 1 || moe.top_k > moe.num_experts {
            return Err(config_error(
                dir,
                &format!(
                    "num_experts_per_tok {} must be between 1 and num_experts {}",
                    moe.top_k, moe.num_experts
                ),
            ));
        }
        Ok(Some(moe))
    }

    /// Refuses what this implementation (like the references) does not compute, and a layer
    /// schedule that disagrees with `full_attention_interval`.
    pub fn validate(&self, dir: &Path, model_type: &str) -> Result<()> {
        let text = &self.text_config;
        let act = text.hidden_act.as_deref().unwrap_or("silu");
        let gate = text.output_gate_type.as_deref().unwrap_or("swish");
        let vision_act = self
            .vision_config
            .hidden_act
            .as_deref()
            .unwrap_or("gelu_pytorch_tanh");
        if act != "silu" || gate != "swish" || vision_act != "gelu_pytorch_tanh" {
            return Err(config_error(
                dir,
                &format!(
                    "unsupported Qwen3.5 variant: hidden_act `{act}`, output_gate_type `{gate}`, \
                     vision hidden_act `{vision_act}`"
                ),
            ));
        }
        if text.attention_bias || !text.attn_output_gate {
            return Err(config_error(
                dir,
                "attention_bias: true or attn_output_gate: false is not supported (no release \
                 sets them)",
            ));
        }
        if let Some(dtype) = text.mamba_ssm_dtype.as_deref().filter(|d| *d != "float32") {
            return Err(config_error(
                dir,
                &format!("mamba_ssm_dtype `{dtype}`: the recurrent state is kept in float32"),
            ));
        }
        if text.full_attention_interval < 1 {
            return Err(config_error(
                dir,
                "full_attention_interval must be at least 1",
            ));
        }
        if let Some(types) = &text.layer_types {
            let expected = |i: usize| {
                if self.is_linear(i) {
                    "linear_attention"
                } else {
                    "full_attention"
                }
            };
            if types.len() != text.num_hidden_layers as usize
                || types.iter().enumerate().any(|(i, t)| t != expected(i))
            {
                return Err(config_error(
                    dir,
                    &format!(
                        "layer_types does not follow full_attention_interval {} (full attention \
                         at every {}th layer)",
                        text.full_attention_interval, text.full_attention_interval
                    ),
                ));
            }
        }
        let shape = self.linear_shape();
        if shape.key_heads < 1 || shape.value_heads % shape.key_heads != 0 {
            return Err(config_error(
                dir,
                &format!(
                    "linear_num_value_heads {} must be a multiple of linear_num_key_heads {}",
                    shape.value_heads, shape.key_heads
                ),
            ));
        }
        if shape.kernel < 2 {
            return Err(config_error(
                dir,
                "linear_conv_kernel_dim must be at least 2",
            ));
        }
        if text.mlp_only_layers.as_ref().is_some_and(|l| !l.is_empty()) {
            return Err(config_error(
                dir,
                "mlp_only_layers is not supported (every released layer routes)",
            ));
        }
        if model_type == "qwen3_5" && text.intermediate_size.is_none() {
            return Err(config_error(
                dir,
                "text_config.intermediate_size is missing",
            ));
        }
        if !self.vision_config.deepstack_visual_indexes.is_empty() {
            return Err(config_error(
                dir,
                "deepstack_visual_indexes must be empty for Qwen3.5 (as in mlx-vlm)",
            ));
        }
        if self.language_model_only == Some(true) {
            return Err(config_error(
                dir,
                "language_model_only: true (a checkpoint without its vision tower) is not \
                 supported yet",
            ));
        }
        Ok(())
    }

    /// Rotary settings: interleaved MRoPE over the first `head_dim · partial_rotary_factor`
    /// dims of each head (the rest pass through).
    pub fn rope(&self, dir: &Path) -> Result<(Rope, i32)> {
        let text = &self.text_config;
        let params = &text.rope_parameters;
        let kind = params
            .get("rope_type")
            .or(params.get("type"))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        if !matches!(kind, "default" | "mrope") {
            return Err(config_error(
                dir,
                &format!("rope type `{kind}` is not supported for Qwen3.5"),
            ));
        }
        let theta = params["rope_theta"]
            .as_f64()
            .ok_or_else(|| config_error(dir, "rope_parameters.rope_theta is missing"))?
            as f32;
        let partial = params["partial_rotary_factor"]
            .as_f64()
            .map(|p| p as f32)
            .or(text.partial_rotary_factor)
            .unwrap_or(0.25);
        if text.partial_rotary_factor.is_some_and(|p| p != partial) {
            return Err(config_error(
                dir,
                "partial_rotary_factor disagrees with rope_parameters.partial_rotary_factor",
            ));
        }
        let rotary_dim = (text.head_dim as f32 * partial) as i32;
        let section: Vec<i32> = serde_json::from_value(params["mrope_section"].clone())
            .map_err(|error| config_error(dir, &format!("mrope_section: {error}")))?;
        let mrope_section: [i32; 3] = section
            .try_into()
            .map_err(|_| config_error(dir, "mrope_section must have 3 entries"))?;
        if rotary_dim < 2
            || rotary_dim % 2 != 0
            || mrope_section.iter().sum::<i32>() * 2 != rotary_dim
        {
            return Err(config_error(
                dir,
                &format!(
                    "mrope_section {mrope_section:?} does not cover the rotary dims {rotary_dim} \
                     (head_dim {} × partial_rotary_factor {partial})",
                    text.head_dim
                ),
            ));
        }
        Ok((
            Rope {
                theta,
                mrope_section,
            },
            rotary_dim,
        ))
    }
}

pub(super) fn config_error(dir: &Path, message: &str) -> EngineError {
    EngineError::Config {
        path: dir.join("config.json"),
        message: message.to_string(),
    }
}
