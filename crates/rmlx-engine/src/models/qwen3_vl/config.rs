//! Qwen3-VL config.json (`model_type: qwen3_vl`): the text decoder's fields under
//! `text_config`, the vision tower's under `vision_config`, the image token ids at the top.
//! Reference: mlx-vlm `models/qwen3_vl/config.py`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct TextConfig {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub rope_theta: Option<f32>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// transformers >= 5 nests rope_theta and mrope_section here.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub attention_bias: bool,
    /// The MoE keys of `qwen3_vl_moe` (Qwen3-VL-30B-A3B); absent in the dense releases.
    #[serde(default)]
    pub num_experts: Option<i32>,
    #[serde(default)]
    pub num_experts_per_tok: Option<i32>,
    #[serde(default)]
    pub moe_intermediate_size: Option<i32>,
    #[serde(default)]
    pub decoder_sparse_step: Option<i32>,
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<i32>>,
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
}

impl TextConfig {
    /// The experts' settings when the config has them (mlx-vlm's defaults otherwise).
    pub fn moe(&self) -> Option<crate::models::qwen3_moe::MoeConfig> {
        Some(crate::models::qwen3_moe::MoeConfig {
            num_experts: self.num_experts?,
            num_experts_per_tok: self.num_experts_per_tok?,
            moe_intermediate_size: self.moe_intermediate_size?,
            decoder_sparse_step: self.decoder_sparse_step.unwrap_or(1),
            mlp_only_layers: self.mlp_only_layers.clone().unwrap_or_default(),
            norm_topk_prob: self.norm_topk_prob.unwrap_or(true),
        })
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct VisionConfig {
    pub depth: i32,
    pub hidden_size: i32,
    pub num_heads: i32,
    pub intermediate_size: i32,
    pub patch_size: i32,
    pub temporal_patch_size: i32,
    pub spatial_merge_size: i32,
    pub in_channels: i32,
    pub out_hidden_size: i32,
    pub num_position_embeddings: i32,
    #[serde(default)]
    pub deepstack_visual_indexes: Vec<i32>,
    #[serde(default)]
    pub hidden_act: Option<String>,
}

impl VisionConfig {
    /// Values per patch row of `pixel_values`: `C * T * P * P`.
    pub fn patch_dim(&self) -> i32 {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
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
    /// Top-level copy some checkpoints carry; the text config's value is the default.
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
}

/// The rotary settings of the text decoder, resolved and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f32,
    /// Frequencies per position axis (t, h, w); they sum to `head_dim / 2`.
    pub mrope_section: [i32; 3],
}

impl Config {
    pub fn tied(&self) -> bool {
        self.tie_word_embeddings
            .unwrap_or(self.text_config.tie_word_embeddings)
    }

    /// The activations are fixed in the implementation (as in mlx-vlm): other values are refused.
    pub fn check_activations(&self, dir: &Path) -> Result<()> {
        let text_act = self.text_config.hidden_act.as_deref().unwrap_or("silu");
        let vision_act = self
            .vision_config
            .hidden_act
            .as_deref()
            .unwrap_or("gelu_pytorch_tanh");
        if text_act != "silu"
            || vision_act != "gelu_pytorch_tanh"
            || self.text_config.attention_bias
        {
            return Err(config_error(
                dir,
                &format!(
                    "unsupported Qwen3-VL variant: text hidden_act `{text_act}`, vision hidden_act \
                     `{vision_act}`, attention_bias {}",
                    self.text_config.attention_bias
                ),
            ));
        }
        Ok(())
    }

    /// Only the interleaved MRoPE Qwen3-VL ships is implemented; anything else is refused
    /// rather than silently run with the wrong rotary layout.
    pub fn rope(&self, dir: &Path) -> Result<Rope> {
        let text = &self.text_config;
        let nested = text.rope_parameters.as_ref().filter(|v| !v.is_null());
        let scaling = text
            .rope_scaling
            .as_ref()
            .filter(|v| !v.is_null())
            .or(nested);
        let theta = text
            .rope_theta
            .or_else(|| {
                nested
                    .and_then(|p| p["rope_theta"].as_f64())
                    .map(|v| v as f32)
            })
            .ok_or_else(|| config_error(dir, "text_config.rope_theta is missing"))?;
        let kind = scaling
            .and_then(|s| s.get("rope_type").or(s.get("type")))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        if !matches!(kind, "default" | "mrope") {
            return Err(config_error(
                dir,
                &format!("rope type `{kind}` is not supported for qwen3_vl"),
            ));
        }
        // mlx-vlm's default when the config names none.
        let section: Vec<i32> = match scaling.and_then(|s| s.get("mrope_section")) {
            Some(value) => serde_json::from_value(value.clone())
                .map_err(|error| config_error(dir, &format!("mrope_section: {error}")))?,
            None => vec![24, 20, 20],
        };
        let mrope_section: [i32; 3] = section
            .try_into()
            .map_err(|_| config_error(dir, "mrope_section must have 3 entries"))?;
        if mrope_section.iter().sum::<i32>() * 2 != text.head_dim {
            return Err(config_error(
                dir,
                &format!(
                    "mrope_section {mrope_section:?} does not cover head_dim {}",
                    text.head_dim
                ),
            ));
        }
        Ok(Rope {
            theta,
            mrope_section,
        })
    }
}

pub(super) fn config_error(dir: &Path, message: &str) -> EngineError {
    EngineError::Config {
        path: dir.join("config.json"),
        message: message.to_string(),
    }
}
