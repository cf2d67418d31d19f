//! Gemma 4 config.json (`model_type: gemma4`): the text decoder under `text_config`, the
//! vision tower under `vision_config`, image token ids at the top, the audio tower's settings
//! under `audio_config` (its weights are checked and set aside: audio input is not supported).
//! Reference: mlx-vlm `models/gemma4/config.py`.

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
    /// Head size of the full-attention layers (the sliding ones use `head_dim`).
    #[serde(default)]
    pub global_head_dim: Option<i32>,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    pub sliding_window: i32,
    pub layer_types: Vec<String>,
    #[serde(default)]
    pub num_kv_shared_layers: i32,
    #[serde(default)]
    pub hidden_size_per_layer_input: i32,
    #[serde(default)]
    pub vocab_size_per_layer_input: Option<i32>,
    #[serde(default)]
    pub final_logit_softcapping: Option<f32>,
    #[serde(default)]
    pub use_double_wide_mlp: bool,
    #[serde(default)]
    pub attention_k_eq_v: bool,
    #[serde(default)]
    pub enable_moe_block: bool,
    /// `"vision"`: image soft tokens attend to each other both ways during prefill.
    #[serde(default)]
    pub use_bidirectional_attention: Option<String>,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub hidden_activation: Option<String>,
    #[serde(default)]
    pub attention_bias: bool,
    /// MoE block (26B-A4B): experts, their top-k and width (`moe_intermediate_size` in the
    /// release; `expert_intermediate_size` is its null twin in the dense releases).
    #[serde(default)]
    pub num_experts: Option<i32>,
    #[serde(default)]
    pub top_k_experts: Option<i32>,
    #[serde(default)]
    pub moe_intermediate_size: Option<i32>,
    #[serde(default)]
    pub expert_intermediate_size: Option<i32>,
    /// KV heads of the full-attention layers when `attention_k_eq_v` is set.
    #[serde(default)]
    pub num_global_key_value_heads: Option<i32>,
}

fn default_max_positions() -> usize {
    131072
}

fn default_true() -> bool {
    true
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct VisionConfig {
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f32,
    pub patch_size: i32,
    pub pooling_kernel_size: i32,
    pub position_embedding_size: i32,
    #[serde(default)]
    pub use_clipped_linears: bool,
    #[serde(default)]
    pub standardize: bool,
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub hidden_activation: Option<String>,
    #[serde(default)]
    pub attention_bias: bool,
}

impl VisionConfig {
    /// Base of the tower's 2-D rotary (mlx-vlm's default is 100).
    pub fn rope_theta(&self) -> f32 {
        self.rope_parameters
            .as_ref()
            .and_then(|p| p["rope_theta"].as_f64())
            .unwrap_or(100.0) as f32
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Config {
    pub text_config: TextConfig,
    pub vision_config: VisionConfig,
    pub image_token_id: u32,
    #[serde(default)]
    pub audio_token_id: Option<u32>,
    #[serde(default)]
    pub video_token_id: Option<u32>,
    #[serde(default)]
    pub audio_config: Option<serde_json::Value>,
    /// The top-level copy of the text model's tie flag.
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
}

/// The rotary setting of one layer type.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerRope {
    pub theta: f32,
    /// Rotated share of the head (`proportional` RoPE leaves the rest unrotated).
    pub partial_rotary_factor: f32,
    pub proportional: bool,
}

impl Config {
    /// Checks what this implementation covers; anything else is a clear config error.
    pub fn validate(&self, dir: &Path) -> Result<()> {
        let text = &self.text_config;
        if text.enable_moe_block {
            let top_k = text.top_k_experts.unwrap_or(0);
            let experts = text.num_experts.unwrap_or(0);
            if top_k < 1 || top_k > experts {
                return Err(config_error(
                    dir,
                    &format!("top_k_experts {top_k} must be between 1 and num_experts {experts}"),
                ));
            }
        }
        let activations = [
            text.hidden_activation.as_deref(),
            self.vision_config.hidden_activation.as_deref(),
        ];
        if let Some(other) = activations
            .into_iter()
            .flatten()
            .find(|act| *act != "gelu_pytorch_tanh")
        {
            return Err(config_error(
                dir,
                &format!(
                    "hidden_activation `{other}` is not supported (Gemma 4 uses gelu_pytorch_tanh)"
                ),
            ));
        }
        if text.attention_bias || self.vision_config.attention_bias {
            return Err(config_error(dir, "attention_bias: true is not supported"));
        }
        if self.tie_word_embeddings == Some(false) || !text.tie_word_embeddings {
            return Err(config_error(
                dir,
                "Gemma 4 with an untied lm_head is not supported",
            ));
        }
        if text.layer_types.len() != text.num_hidden_layers as usize {
            return Err(config_error(
                dir,
                "text_config.layer_types must name every layer",
            ));
        }
        if let Some(bad) = text
            .layer_types
            .iter()
            .find(|t| !matches!(t.as_str(), "sliding_attention" | "full_attention"))
        {
            return Err(config_error(dir, &format!("unknown layer type `{bad}`")));
        }
        let shared_start = self.first_kv_shared_layer();
        for layer in shared_start..text.num_hidden_layers as usize {
            let kind = &text.layer_types[layer];
            if !text.layer_types[..shared_start].contains(kind) {
                return Err(config_error(
                    dir,
                    &format!("KV-shared layer {layer} has no earlier {kind} layer to share"),
                ));
            }
        }
        for kind in ["sliding_attention", "full_attention"] {
            self.rope(kind, dir)?;
        }
        Ok(())
    }

    /// Layers from here on reuse the KV of the last earlier layer of their type.
    pub fn first_kv_shared_layer(&self) -> usize {
        let text = &self.text_config;
        (text.num_hidden_layers - text.num_kv_shared_layers).max(0) as usize
    }

    pub fn rope(&self, layer_type: &str, dir: &Path) -> Result<LayerRope> {
        let params = self
            .text_config
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get(layer_type));
        // mlx-vlm's defaults when the config names none.
        let (default_theta, default_kind) = match layer_type {
            "full_attention" => (1_000_000.0, "proportional"),
            _ => (10_000.0, "default"),
        };
        let theta = params
            .and_then(|p| p["rope_theta"].as_f64())
            .unwrap_or(default_theta) as f32;
        let kind = params
            .and_then(|p| p.get("rope_type").or(p.get("type")))
            .and_then(|t| t.as_str())
            .unwrap_or(default_kind);
        let partial_rotary_factor = params
            .and_then(|p| p["partial_rotary_factor"].as_f64())
            .unwrap_or(1.0) as f32;
        let factor = params.and_then(|p| p["factor"].as_f64()).unwrap_or(1.0);
        match kind {
            "default" if partial_rotary_factor == 1.0 => Ok(LayerRope {
                theta,
                partial_rotary_factor,
                proportional: false,
            }),
            "proportional" if factor == 1.0 => Ok(LayerRope {
                theta,
                partial_rotary_factor,
                proportional: true,
            }),
            other => Err(config_error(
                dir,
                &format!(
                    "{layer_type} rope `{other}` (factor {factor}, partial {partial_rotary_factor}) \
                     is not supported"
                ),
            )),
        }
    }

    pub fn bidirectional_images(&self) -> bool {
        self.text_config.use_bidirectional_attention.as_deref() == Some("vision")
    }
}

pub(super) fn config_error(dir: &Path, message: &str) -> EngineError {
    EngineError::Config {
        path: dir.join("config.json"),
        message: message.to_string(),
    }
}
