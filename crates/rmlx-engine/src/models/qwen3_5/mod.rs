//! Qwen3.5 / Qwen3.6 (`model_type: qwen3_5`, `qwen3_5_moe`): the hybrid Gated DeltaNet text
//! decoder with the Qwen3-VL vision tower (no deepstack); images replace the `<|image_pad|>`
//! embeddings and set the MRoPE positions as in Qwen3-VL.
//! Reference: mlx-vlm `models/qwen3_5/qwen3_5.py` (`sanitize`, `get_input_embeddings`) and
//! `models/qwen3_5_moe/qwen3_5_moe.py`.

pub mod config;
pub mod gated_delta;
pub mod language;
// Compiled everywhere so it is type-checked on Linux; only macOS calls it.
#[cfg_attr(not(target_os = "macos"), allow(dead_code))]
pub mod metal;

use std::path::Path;

use mlx_rs::Array;

use self::{config::Config, language::LanguageModel as TextModel};
use super::{
    host_ids,
    qwen3_vl::{
        language::{chunk_base, image_rows, rope_index_for, text_rows, ImageTokenIds},
        vision::VisionModel,
        MropePositions,
    },
    ImageInput, ImageScatter, LanguageModel, Logits, VisionFeatures, VisionLanguageModel,
};
use crate::{cache::KvCache, config::ConfigFile, error::Result, weights::WeightStore};

pub struct Model {
    config: Config,
    vision: VisionModel,
    language: TextModel,
}

/// The RMSNorm weights Hugging Face stores zero-centred (`1 + w`); the Gated DeltaNet's own
/// output norm is not among them.
const SHIFTED_NORMS: &[&str] = &[
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
];

/// mlx-vlm's `sanitize`, in place on the store: the draft head (`mtp.*`) set aside, Hugging
/// Face names to mlx's, the conv1d weight `[C, 1, K]` to `[C, K, 1]`, and +1 on the
/// zero-centred norms of a Hugging Face file (never on an mlx conversion: it already added
/// it). The vision tower's Conv3d is transposed by its own loader.
fn sanitize(store: &mut WeightStore, tied: bool) -> Result<()> {
    let names = store.names();
    for name in names.iter().filter(|name| name.starts_with("mtp.")) {
        store.discard(name);
    }
    let unconverted_conv = names.iter().any(|name| {
        name.ends_with("conv1d.weight")
            && !name.starts_with("mtp.")
            && store
                .shape_of(name)
                .is_some_and(|shape| shape.last() != Some(&1))
    });
    for name in names.iter().filter(|name| !name.starts_with("mtp.")) {
        let hugging_face_name = !name.starts_with("language_model.");
        let is_norm = SHIFTED_NORMS.iter().any(|suffix| name.ends_with(suffix))
            && !name.contains("visual.")
            && !name.starts_with("vision_tower.");
        if is_norm && (unconverted_conv || hugging_face_name) {
            store.transform(name, |w| {
                if w.ndim() != 1 {
                    return Ok(w.clone());
                }
                Ok(mlx_rs::ops::add(w, crate::nn::scalar(1.0, w)?)?)
            })?;
        }
        if name.ends_with("conv1d.weight") {
            store.transform(name, |w| {
                if w.ndim() == 3 && w.shape()[2] != 1 {
                    Ok(w.swap_axes(1, 2)?)
                } else {
                    Ok(w.clone())
                }
            })?;
        }
    }
    store.rename_prefix("model.language_model.visual.", "vision_tower.");
    store.rename_prefix("model.language_model.", "language_model.model.");
    store.rename_prefix("model.visual.", "vision_tower.");
    store.rename_prefix("lm_head.", "language_model.lm_head.");
    if tied {
        for suffix in ["weight", "scales", "biases"] {
            store.discard(&format!("language_model.lm_head.{suffix}"));
        }
    }
    Ok(())
}

impl Model {
    pub fn load(dir: &Path, config: &ConfigFile, store: &mut WeightStore) -> Result<Self> {
        let args: Config = config.family(dir)?;
        let model_type = config.base.model_type.as_str();
        args.validate(dir, model_type)?;
        let rope = args.rope(dir)?;
        let moe = args.moe(dir, model_type)?;
        let quant = config.base.quantization.as_ref();
        sanitize(store, args.tied())?;
        // The converters never quantize the tower: loading it dense makes a quantized one a
        // strict-loading error rather than a silent mis-read.
        let vision = VisionModel::load(store, "vision_tower", &args.vision_config)?;
        let language = TextModel::load(store, quant, &args, moe.as_ref(), rope)?;
        Ok(Self {
            config: args,
            vision,
            language,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    fn image_tokens(&self) -> ImageTokenIds {
        ImageTokenIds {
            image: self.config.image_token_id,
            vision_start: self.config.vision_start_token_id,
            merge: self.config.vision_config.spatial_merge_size,
        }
    }

    /// mlx-vlm's `get_rope_index` for one prompt (rows t, h, w and the rope delta).
    pub fn rope_index(&self, ids: &[u32], grids: &[[i32; 3]]) -> MropePositions {
        rope_index_for(ids, grids, self.image_tokens())
    }
}

impl LanguageModel for Model {
    fn forward(&self, inputs: &Array, caches: &mut [KvCache], logits: Logits) -> Result<Array> {
        self.forward_with_images(inputs, None, caches, logits)
    }

    fn num_layers(&self) -> usize {
        self.language.num_layers()
    }

    fn vocab_size(&self) -> usize {
        self.config.text_config.vocab_size as usize
    }

    fn max_position_embeddings(&self) -> usize {
        self.config.text_config.max_position_embeddings
    }

    /// Three of every four layers carry a Gated DeltaNet state, which cannot be rewound.
    fn rewindable(&self) -> bool {
        false
    }

    fn as_vision(&self) -> Option<&dyn VisionLanguageModel> {
        Some(self)
    }
}

impl VisionLanguageModel for Model {
    fn encode_images(&self, images: &ImageInput) -> Result<VisionFeatures> {
        self.vision.forward(images)
    }

    fn forward_with_images(
        &self,
        inputs: &Array,
        features: Option<&VisionFeatures>,
        caches: &mut [KvCache],
        logits: Logits,
    ) -> Result<Array> {
        let (base, delta) = chunk_base(caches);
        let mut h = self.language.embed_tokens.forward(inputs)?;
        let Some(features) = features else {
            let rows = text_rows(inputs.shape()[inputs.ndim() - 1], base);
            let rows = [&rows[0][..], &rows[1][..], &rows[2][..]];
            return self.language.forward_embeddings(h, &rows, caches, logits);
        };
        let ids = host_ids(inputs)?;
        let scatter = ImageScatter::new(&ids, self.config.image_token_id);
        h = scatter.apply(&h, &features.embeds)?;
        let positions = rope_index_for(&ids, &features.grid_thw, self.image_tokens());
        let rows = image_rows(&positions, base);
        let rows = [&rows[0][..], &rows[1][..], &rows[2][..]];
        let out = self.language.forward_embeddings(h, &rows, caches, logits)?;
        for cache in caches.iter_mut() {
            cache.set_rope_delta(delta + positions.rope_delta);
        }
        Ok(out)
    }
}
