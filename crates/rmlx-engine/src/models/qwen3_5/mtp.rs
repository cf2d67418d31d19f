//! The multi-token-prediction head Qwen3.5 / Qwen3.6 ship beside the trunk (`mtp.*`): the
//! embedding of the next token and the trunk's final-norm hidden state at a position, each
//! RMS-normed, concatenated (embedding first) and projected by `fc`; then one full-attention
//! decoder layer shaped like the trunk's (dense or MoE, its own KV cache); then a norm. The
//! shared lm_head scores the result as a draft of the token after next, and the result stands
//! in for the trunk's hidden state when the head is applied again for a deeper draft.
//! Reference: mlx-vlm `speculative/drafters/qwen3_5_mtp/qwen3_5_mtp.py`
//! (`Qwen3_5MTPDraftModel._forward_hidden`, `sanitize`); vLLM `qwen3_5_mtp.py`.

use std::path::{Path, PathBuf};

use mlx_rs::{ops, Array};

use super::{
    config::{Config, MoeConfig},
    language::DecoderLayer,
};
use crate::{
    cache::KvCache,
    config::QuantizationConfig,
    error::{EngineError, Result},
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

/// Where a checkpoint without `mtp.*` (most mlx conversions drop it) keeps its head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sidecar {
    /// `mtp.safetensors` or `mtp_head.safetensors` in the model folder (what `rmlx pull --mtp`
    /// writes): names with the `mtp.` prefix are a Hugging Face release's (norms zero-centred,
    /// shifted at load), names without it already mlx's.
    File(PathBuf),
    /// mlx-vlm's split drafter (`mlx_vlm.split_mtp`) in a `mtp/` subfolder: its config.json
    /// says `model_type: qwen3_5_mtp`, names carry no prefix, norms are shifted, and its
    /// quantization is its own.
    Folder(PathBuf),
}

/// The sidecar of the model in `dir`, if it has one.
pub fn find_sidecar(dir: &Path) -> Option<Sidecar> {
    for name in ["mtp.safetensors", "mtp_head.safetensors"] {
        let file = dir.join(name);
        if file.is_file() {
            return Some(Sidecar::File(file));
        }
    }
    let folder = dir.join("mtp");
    let config = crate::config::read_json(&folder.join("config.json")).ok()?;
    (config["model_type"] == "qwen3_5_mtp").then_some(Sidecar::Folder(folder))
}

/// What a sidecar added to the store: whether its norms still need the +1 shift, and the
/// quantization its tensors follow when it is not the model's.
pub struct SidecarHead {
    pub shift_norms: bool,
    pub quantization: Option<QuantizationConfig>,
}

/// Adds the sidecar's tensors to `store` under `mtp.`.
pub fn add_sidecar(store: &mut WeightStore, sidecar: &Sidecar) -> Result<SidecarHead> {
    let prefixed = |name: &str| match name.starts_with("mtp.") {
        true => name.to_string(),
        false => format!("mtp.{name}"),
    };
    match sidecar {
        Sidecar::File(file) => {
            let header = crate::weights::check_header(file)?;
            let hugging_face = header.iter().any(|name| name.starts_with("mtp."));
            if hugging_face && header.iter().any(|name| !name.starts_with("mtp.")) {
                return Err(EngineError::WeightsFile {
                    file: file.clone(),
                    message: "some tensor names carry the mtp. prefix and some do not".into(),
                });
            }
            store.add_file(file, prefixed)?;
            Ok(SidecarHead {
                shift_norms: hugging_face,
                quantization: None,
            })
        }
        Sidecar::Folder(folder) => {
            let config = crate::config::read_json(&folder.join("config.json"))?;
            let quantization = match config.get("quantization") {
                Some(block) => {
                    let mut parsed: QuantizationConfig = serde_json::from_value(block.clone())
                        .map_err(|error| EngineError::Config {
                            path: folder.join("config.json"),
                            message: format!("quantization: {error}"),
                        })?;
                    parsed.layers = std::mem::take(&mut parsed.layers)
                        .into_iter()
                        .map(|(path, entry)| (prefixed(&path), entry))
                        .collect();
                    Some(parsed)
                }
                None => None,
            };
            let mut files: Vec<PathBuf> = std::fs::read_dir(folder)
                .map_err(|error| EngineError::Io {
                    path: folder.clone(),
                    message: error.to_string(),
                })?
                .filter_map(|entry| entry.ok().map(|entry| entry.path()))
                .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
                .collect();
            files.sort();
            for file in &files {
                store.add_file(file, prefixed)?;
            }
            Ok(SidecarHead {
                shift_norms: false,
                quantization,
            })
        }
    }
}

/// What [`write_split_drafter`] wrote.
pub struct SplitDrafter {
    pub folder: PathBuf,
    pub tensors: usize,
    pub bytes: u64,
}

/// Writes a release's head (`release`: a safetensors file of its `mtp.*` tensors, as the
/// release stores them) beside the conversion in `model_dir`, as mlx-vlm's split drafter in
/// `mtp/`: names without the prefix, norms shifted to mlx's convention, fused experts split
/// into `switch_mlp`, and every projection quantized as the conversion quantized the trunk's
/// layer of the same name (its per-path entries, else its defaults), so the head costs what
/// the conversion's layers cost. An unquantized conversion gets the head in the release's dtype.
pub fn write_split_drafter(model_dir: &Path, release: &Path) -> Result<SplitDrafter> {
    let config = crate::config::read_json(&model_dir.join("config.json"))?;
    let quantization: Option<QuantizationConfig> =
        match config.get("quantization") {
            Some(block) => Some(serde_json::from_value(block.clone()).map_err(|error| {
                EngineError::Config {
                    path: model_dir.join("config.json"),
                    message: format!("quantization: {error}"),
                }
            })?),
            None => None,
        };
    let loaded = Array::load_safetensors(release).map_err(|error| EngineError::WeightsFile {
        file: release.to_path_buf(),
        message: error.to_string(),
    })?;
    let mut head: Vec<(String, Array)> = Vec::new();
    for (name, value) in loaded {
        let Some(short) = name.strip_prefix("mtp.") else {
            return Err(EngineError::Tensor {
                file: release.to_path_buf(),
                tensor: name,
                message: "not a draft-head tensor (mtp.*)".into(),
            });
        };
        let norm = short == "norm.weight"
            || SHIFTED_SPLIT_NORMS
                .iter()
                .any(|suffix| short.ends_with(suffix));
        if norm && value.ndim() == 1 {
            head.push((
                short.to_string(),
                ops::add(&value, crate::nn::scalar(1.0, &value)?)?,
            ));
        } else if let Some(prefix) = short.strip_suffix(".experts.gate_up_proj") {
            // `[E, 2I, H]`, gate rows first (the trunk's loader splits it the same way).
            let halves = value.split_equal(2, 1)?;
            head.push((
                format!("{prefix}.switch_mlp.gate_proj.weight"),
                halves[0].clone(),
            ));
            head.push((
                format!("{prefix}.switch_mlp.up_proj.weight"),
                halves[1].clone(),
            ));
        } else if let Some(prefix) = short.strip_suffix(".experts.down_proj") {
            head.push((format!("{prefix}.switch_mlp.down_proj.weight"), value));
        } else {
            head.push((short.to_string(), value));
        }
    }
    let mut out: Vec<(String, Array)> = Vec::new();
    let mut entries = serde_json::Map::new();
    for (name, value) in head {
        let spec = match (&quantization, name.strip_suffix(".weight")) {
            (Some(config), Some(path)) if value.ndim() >= 2 => trunk_spec(config, path)?,
            _ => None,
        };
        let spec = spec.filter(|spec| value.shape()[value.ndim() - 1] % spec.group_size == 0);
        match (spec, name.strip_suffix(".weight")) {
            (Some(spec), Some(path)) => {
                let packed = crate::quant::quantize(&value, spec)?;
                out.push((format!("{path}.weight"), packed.weight));
                out.push((format!("{path}.scales"), packed.scales));
                if let Some(biases) = packed.biases {
                    out.push((format!("{path}.biases"), biases));
                }
                let default = quantization.as_ref().is_some_and(|config| {
                    config.group_size == spec.group_size && config.bits == spec.bits
                });
                if !default {
                    entries.insert(
                        path.to_string(),
                        serde_json::json!({"group_size": spec.group_size, "bits": spec.bits}),
                    );
                }
            }
            _ => out.push((name, value)),
        }
    }
    crate::runtime::eval(out.iter().map(|(_, array)| array))?;
    let folder = model_dir.join("mtp");
    std::fs::create_dir_all(&folder).map_err(|error| EngineError::Io {
        path: folder.clone(),
        message: error.to_string(),
    })?;
    let bytes = out.iter().map(|(_, array)| array.nbytes() as u64).sum();
    let tensors = out.len();
    let map: std::collections::HashMap<String, Array> = out.into_iter().collect();
    let file = folder.join("model.safetensors");
    let metadata: std::collections::HashMap<String, String> =
        [("format".to_string(), "mlx".to_string())].into();
    Array::save_safetensors(&map, Some(&metadata), &file).map_err(|error| {
        EngineError::WeightsFile {
            file: file.clone(),
            message: error.to_string(),
        }
    })?;
    let mut split = serde_json::json!({"model_type": "qwen3_5_mtp"});
    if let Some(config) = &quantization {
        let mut block = serde_json::json!({
            "group_size": config.group_size,
            "bits": config.bits,
            "mode": config.mode.clone().unwrap_or_else(|| "affine".into()),
        });
        block.as_object_mut().expect("an object").extend(entries);
        split["quantization"] = block;
    }
    let text = serde_json::to_string_pretty(&split).expect("JSON") + "\n";
    std::fs::write(folder.join("config.json"), text).map_err(|error| EngineError::Io {
        path: folder.join("config.json"),
        message: error.to_string(),
    })?;
    Ok(SplitDrafter {
        folder,
        tensors,
        bytes,
    })
}

/// The head's norms a release stores zero-centred, by their names without the prefix (and its
/// final `norm.weight`).
const SHIFTED_SPLIT_NORMS: &[&str] = &[
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
];

/// How the conversion quantized the trunk's layer whose path ends as the head's `path` does
/// (after `layers.{i}.`): its per-path entry (a size, or `false`: left dense), else the
/// defaults. `fc` has no trunk counterpart: the defaults.
fn trunk_spec(config: &QuantizationConfig, path: &str) -> Result<Option<crate::quant::QuantSpec>> {
    let within = path.split_once("layers.0.").map_or(path, |(_, rest)| rest);
    let trunk = config.layers.keys().find(|key| {
        key.strip_prefix("language_model.model.layers.")
            .and_then(|rest| rest.split_once('.'))
            .is_some_and(|(index, rest)| {
                index.bytes().all(|b| b.is_ascii_digit()) && rest == within
            })
    });
    match trunk {
        Some(key) => config.spec_for(key),
        None => config.spec_for(path),
    }
}
