//! Qwen3-VL (`model_type: qwen3_vl`): the vision tower's features replace the prompt's
//! `<|image_pad|>` embeddings (count checked, scattered on device), deepstack features join
//! the first decoder layers, and MRoPE positions come from the image grids.
//! Reference: mlx-vlm `models/qwen3_vl/qwen3_vl.py` (`get_input_embeddings`, `masked_scatter`).

pub mod config;
pub mod language;
pub mod vision;

use std::path::Path;

use mlx_rs::Array;

use self::{
    config::Config,
    language::{
        chunk_base, image_rows, rope_index, text_rows, Deepstack, LanguageModel as TextModel,
    },
    vision::VisionModel,
};
use super::{
    host_ids, ImageInput, ImageScatter, LanguageModel, Logits, VisionFeatures, VisionLanguageModel,
};
use crate::{
    cache::KvCache,
    config::ConfigFile,
    error::{EngineError, Result},
    weights::WeightStore,
};

pub use language::MropePositions;

pub struct Model {
    config: Config,
    vision: VisionModel,
    language: TextModel,
}

impl Model {
    pub fn load(dir: &Path, config: &ConfigFile, store: &mut WeightStore) -> Result<Self> {
        let args: Config = config.family(dir)?;
        args.check_activations(dir)?;
        let rope = args.rope(dir)?;
        let quant = config.base.quantization.as_ref();
        // The Hugging Face releases name the parts `model.language_model`, `model.visual` and
        // `lm_head`; mlx conversions `language_model.model`, `vision_tower` and
        // `language_model.lm_head` (mlx-vlm's sanitize renames the same way).
        if store
            .shape_of("model.language_model.embed_tokens.weight")
            .is_some()
        {
            store.rename_prefix("model.language_model.", "language_model.model.");
            store.rename_prefix("model.visual.", "vision_tower.");
            store.rename_prefix("lm_head.", "language_model.lm_head.");
        }
        // The vision tower is never quantized by mlx-vlm's convert; loading it dense makes a
        // stray quantized tower a strict-loading error instead of a silent mis-read.
        let vision = VisionModel::load(store, "vision_tower", &args.vision_config)?;
        let language = TextModel::load(store, quant, &args, rope)?;
        Ok(Self {
            config: args,
            vision,
            language,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// mlx-vlm's `get_rope_index` for one prompt (rows t, h, w and the rope delta).
    pub fn rope_index(&self, ids: &[u32], grids: &[[i32; 3]]) -> MropePositions {
        rope_index(ids, grids, &self.config)
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
        self.language.args.vocab_size as usize
    }

    fn max_position_embeddings(&self) -> usize {
        self.language.args.max_position_embeddings
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
            return self
                .language
                .forward_embeddings(h, &rows, None, caches, logits);
        };
        let ids = host_ids(inputs)?;
        let scatter = ImageScatter::new(&ids, self.config.image_token_id);
        h = scatter.apply(&h, &features.embeds)?;
        if let Some(bad) = features
            .deepstack
            .iter()
            .find(|d| d.shape()[0] != features.embeds.shape()[0])
        {
            return Err(EngineError::ImageTokenMismatch {
                tokens: scatter.count,
                features: bad.shape()[0] as usize,
            });
        }

        let positions = rope_index(&ids, &features.grid_thw, &self.config);
        let rows = image_rows(&positions, base);
        let rows = [&rows[0][..], &rows[1][..], &rows[2][..]];
        let deepstack = Deepstack {
            gather: &scatter.gather,
            features: &features.deepstack,
        };
        let out = self
            .language
            .forward_embeddings(h, &rows, Some(deepstack), caches, logits)?;
        for cache in caches.iter_mut() {
            cache.set_rope_delta(delta + positions.rope_delta);
        }
        Ok(out)
    }
}
