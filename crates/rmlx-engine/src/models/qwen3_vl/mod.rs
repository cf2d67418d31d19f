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
        batch_image_rows, chunk_base, delta_after, image_rows, rope_index, rows_from_rider,
        rows_rider, text_rows, ChunkRows, Deepstack, ImageTokenIds, LanguageModel as TextModel,
    },
    vision::VisionModel,
};
use super::{
    chunk_start, held, host_ids, ImageInput, ImageScatter, LanguageModel, Logits, Part,
    VisionFeatures, VisionLanguageModel,
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
    /// Rank 0's (None on a pipeline's other ranks).
    vision: Option<VisionModel>,
    language: TextModel,
}

impl Model {
    pub fn load(
        dir: &Path,
        config: &ConfigFile,
        store: &mut WeightStore,
        part: Part,
    ) -> Result<Self> {
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
        part.drop_ends(store, &["vision_tower."]);
        let vision = part.ends(|| VisionModel::load(store, "vision_tower", &args.vision_config))?;
        let language = TextModel::load(store, quant, &args, rope, part)?;
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
        held(&self.vision, "the vision tower")?.forward(images)
    }

    fn forward_with_images(
        &self,
        inputs: &Array,
        features: Option<&VisionFeatures>,
        caches: &mut [KvCache],
        logits: Logits,
    ) -> Result<Array> {
        let start = chunk_start(caches);
        let pipeline = self.language.part.stage().is_some();
        if let Some(stage) = self.language.part.follower() {
            // What rank 0 embedded and positioned; the rope delta follows from the rows.
            let mut arrays = stage.receive()?.into_iter();
            let h = arrays
                .next()
                .ok_or_else(|| EngineError::Distributed("an empty pipeline message".into()))?;
            let rows = rows_from_rider(arrays.next().as_ref())?;
            let single = h.shape()[0] == 1;
            let riders = [rows_rider(&rows)];
            let delta = delta_after(&rows, start.position());
            let rows = ChunkRows::Shared(rows);
            let out = self
                .language
                .forward_embeddings(h, &rows, None, &riders, &start, caches, logits)?;
            if single {
                caches
                    .iter_mut()
                    .for_each(|cache| cache.set_rope_delta(delta));
            }
            return Ok(out);
        }
        let (base, delta) = chunk_base(caches);
        let mut h = self.language.embed()?.forward(inputs)?;
        let Some(features) = features else {
            let rows = text_rows(inputs.shape()[inputs.ndim() - 1], base);
            let riders: Vec<Array> = pipeline.then(|| rows_rider(&rows)).into_iter().collect();
            return self.language.forward_embeddings(
                h,
                &ChunkRows::Shared(rows),
                None,
                &riders,
                &start,
                caches,
                logits,
            );
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
        // One sequence's rope delta after the chunk, or each batch row's.
        let (rows, deltas) = match &ids[..] {
            [one] => {
                let positions = rope_index(one, &features.grid_thw, &self.config);
                let rows = ChunkRows::Shared(image_rows(&positions, base));
                (rows, vec![delta + positions.rope_delta])
            }
            _ => {
                let first = caches
                    .first()
                    .ok_or_else(|| EngineError::InvalidRequest("no layer caches".into()))?;
                batch_image_rows(&ids, &features.grid_thw, self.image_tokens(), first)?
            }
        };
        let riders: Vec<Array> = match pipeline {
            true => vec![rows_rider(rows.shared()?)],
            false => Vec::new(),
        };
        let deepstack = Deepstack {
            gather: &scatter.gather,
            features: &features.deepstack,
        };
        let out = self.language.forward_embeddings(
            h,
            &rows,
            Some(deepstack),
            &riders,
            &start,
            caches,
            logits,
        )?;
        for cache in caches.iter_mut() {
            cache.set_row_rope_deltas(&deltas);
        }
        Ok(out)
    }

    fn groups_images(&self) -> bool {
        self.language.part.stage().is_none()
    }
}
