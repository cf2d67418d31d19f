//! What every config.json shares: the model type, the quantization block (with per-layer
//! overrides) and the context length. Family fields live in each model file.
//! Reference: mlx-lm `utils.py` (`load_model`'s class_predicate over `config["quantization"]`).

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::{
    error::{EngineError, Result},
    quant::{QuantMode, QuantSpec},
};

/// The `quantization` block mlx-lm writes: defaults plus per-layer entries keyed by path,
/// each either a `{group_size, bits, mode}` override or `false` (left unquantized).
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct QuantizationConfig {
    pub group_size: i32,
    pub bits: i32,
    #[serde(default)]
    pub mode: Option<String>,
    #[serde(flatten)]
    pub layers: BTreeMap<String, serde_json::Value>,
}

impl QuantizationConfig {
    /// The spec for the layer at `path`, or None when the config leaves it unquantized.
    pub fn spec_for(&self, path: &str) -> Result<Option<QuantSpec>> {
        let (group_size, bits, mode) = match self.layers.get(path) {
            Some(serde_json::Value::Bool(false)) => return Ok(None),
            Some(serde_json::Value::Object(layer)) => (
                layer
                    .get("group_size")
                    .and_then(|v| v.as_i64())
                    .map_or(self.group_size, |v| v as i32),
                layer
                    .get("bits")
                    .and_then(|v| v.as_i64())
                    .map_or(self.bits, |v| v as i32),
                layer
                    .get("mode")
                    .and_then(|v| v.as_str())
                    .map(str::to_string)
                    .or_else(|| self.mode.clone()),
            ),
            _ => (self.group_size, self.bits, self.mode.clone()),
        };
        let mode: QuantMode = mode.as_deref().unwrap_or("affine").parse()?;
        Ok(Some(QuantSpec::new(mode, group_size, bits)?))
    }

    /// Checks the default mode up front so an unknown mode fails before any tensor is read.
    pub fn validate(&self) -> Result<()> {
        let mode: QuantMode = self.mode.as_deref().unwrap_or("affine").parse()?;
        QuantSpec::new(mode, self.group_size, self.bits)?;
        Ok(())
    }
}

/// Reads a JSON file; errors name the file (missing/unreadable vs malformed).
pub fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = fs::read_to_string(path).map_err(|error| EngineError::Io {
        path: path.to_path_buf(),
        message: error.to_string(),
    })?;
    serde_json::from_str(&text).map_err(|error| EngineError::Config {
        path: path.to_path_buf(),
        message: error.to_string(),
    })
}

/// The fields every family shares; the rest of config.json is read by the family.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct BaseConfig {
    pub model_type: String,
    #[serde(default)]
    pub quantization: Option<QuantizationConfig>,
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    /// mlx-lm writes a copy of `quantization` here; Hugging Face quantizers (ModelOpt, the
    /// Gemma QAT `gemma` method, …) write their own block, which MLX cannot load as such.
    #[serde(default)]
    pub quantization_config: Option<serde_json::Value>,
}

/// Refuses checkpoints quantized in a format MLX does not load, naming the format.
fn check_format(dir: &Path, base: &BaseConfig) -> Result<()> {
    let refuse = |path: PathBuf, format: String| EngineError::Config {
        path,
        message: format!(
            "{format} checkpoints are not in MLX format; use an MLX conversion (e.g. an \
             mlx-community repository) or convert the original weights with mlx_lm.convert"
        ),
    };
    let modelopt = dir.join("hf_quant_config.json");
    if modelopt.exists() {
        let algo = read_json(&modelopt)
            .ok()
            .and_then(|json| {
                json["quantization"]["quant_algo"]
                    .as_str()
                    .map(str::to_string)
            })
            .unwrap_or_else(|| "unknown algorithm".into());
        return Err(refuse(
            modelopt,
            format!("NVIDIA ModelOpt ({algo}, hf_quant_config.json)"),
        ));
    }
    let method = base
        .quantization_config
        .as_ref()
        .and_then(|block| block.get("quant_method"))
        .and_then(|method| method.as_str());
    if let Some(method) = method {
        return Err(refuse(
            dir.join("config.json"),
            format!("`quant_method: {method}` (Hugging Face quantization)"),
        ));
    }
    Ok(())
}

/// config.json as raw JSON plus the shared fields.
pub struct ConfigFile {
    pub json: serde_json::Value,
    pub base: BaseConfig,
}

impl ConfigFile {
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let json = read_json(&path)?;
        let base: BaseConfig =
            serde_json::from_value(json.clone()).map_err(|error| EngineError::Config {
                path: path.clone(),
                message: error.to_string(),
            })?;
        check_format(dir, &base)?;
        if let Some(quantization) = &base.quantization {
            quantization.validate()?;
        }
        Ok(Self { json, base })
    }

    /// Deserialises the family's own config, naming config.json on error.
    pub fn family<T: serde::de::DeserializeOwned>(&self, dir: &Path) -> Result<T> {
        serde_json::from_value(self.json.clone()).map_err(|error| EngineError::Config {
            path: dir.join("config.json"),
            message: error.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(json: serde_json::Value) -> QuantizationConfig {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn per_layer_overrides_and_exclusions() {
        let config = block(serde_json::json!({
            "group_size": 64, "bits": 4,
            "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
            "model.layers.1.self_attn.q_proj": {"bits": 4, "group_size": 32, "mode": "mxfp4"},
            "lm_head": false
        }));
        let default = config
            .spec_for("model.layers.0.self_attn.q_proj")
            .unwrap()
            .unwrap();
        assert_eq!(
            (default.mode, default.group_size, default.bits),
            (QuantMode::Affine, 64, 4)
        );
        let eight = config.spec_for("model.layers.0.mlp.gate").unwrap().unwrap();
        assert_eq!((eight.mode, eight.bits), (QuantMode::Affine, 8));
        let fp = config
            .spec_for("model.layers.1.self_attn.q_proj")
            .unwrap()
            .unwrap();
        assert_eq!((fp.mode, fp.group_size), (QuantMode::Mxfp4, 32));
        assert_eq!(config.spec_for("lm_head").unwrap(), None);
    }

    #[test]
    fn bad_modes_and_geometry_are_refused_up_front() {
        let unknown = block(serde_json::json!({"group_size": 64, "bits": 4, "mode": "int3"}));
        assert!(matches!(
            unknown.validate(),
            Err(EngineError::Quant(crate::quant::QuantError::UnknownMode(_)))
        ));
        let geometry = block(serde_json::json!({"group_size": 64, "bits": 4, "mode": "nvfp4"}));
        assert!(matches!(
            geometry.validate(),
            Err(EngineError::Quant(
                crate::quant::QuantError::BadGeometry { .. }
            ))
        ));
        // mlx-lm writes no mode for affine checkpoints.
        let affine = block(serde_json::json!({"group_size": 32, "bits": 3}));
        assert!(affine.validate().is_ok());
    }
}
