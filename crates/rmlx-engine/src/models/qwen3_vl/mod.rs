//! Qwen3-VL (`model_type: qwen3_vl`): the vision tower's features replace the prompt's
//! `<|image_pad|>` embeddings (count checked, scattered on device), deepstack features join
//! the first decoder layers, and MRoPE positions come from the image grids.
//! Reference: mlx-vlm `models/qwen3_vl/qwen3_vl.py` (`get_input_embeddings`, `masked_scatter`).

pub mod config;
pub mod language;
pub mod vision;

use std::path::Path;

use mlx_rs::{ops, Array};

use self::{
    config::Config,
    language::{rope_index, Deepstack, LanguageModel as TextModel},
    vision::VisionModel,
};
use super::{ImageInput, LanguageModel, Logits, VisionFeatures, VisionLanguageModel};
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
        let rope = args.rope(dir)?;
        let quant = config.base.quantization.as_ref();
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

/// The prompt ids on the host (they are small; the features never leave the device).
fn host_ids(inputs: &Array) -> Result<Vec<u32>> {
    let shape = inputs.shape();
    if shape.len() != 2 || shape[0] != 1 {
        return Err(EngineError::InvalidRequest(format!(
            "image prompts run one sequence at a time, got ids of shape {shape:?}"
        )));
    }
    let ids = inputs.as_type::<u32>()?;
    ids.eval()?;
    Ok(ids.as_slice::<u32>().to_vec())
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
        let (offset, delta) = caches
            .first()
            .map_or((0, 0), |cache| (cache.offset(), cache.rope_delta()));
        // Positions continue from the cache: a text run after an image prompt (or any decode
        // step) sits at offset + delta; a chunk's own image blocks shift by the same base.
        let base = offset + delta;
        let mut h = self.language.embed_tokens.forward(inputs)?;
        let Some(features) = features else {
            let len = inputs.shape()[inputs.ndim() - 1];
            let positions: Vec<i32> = (base..base + len).collect();
            let rows = [&positions[..], &positions[..], &positions[..]];
            return self
                .language
                .forward_embeddings(h, &rows, None, caches, logits);
        };
        let ids = host_ids(inputs)?;
        let image_token = self.config.image_token_id;
        let tokens = ids.iter().filter(|&&id| id == image_token).count();
        let rows_given = features.embeds.shape()[0] as usize;
        if tokens != rows_given
            || features
                .deepstack
                .iter()
                .any(|d| d.shape()[0] as usize != rows_given)
        {
            return Err(EngineError::ImageTokenMismatch {
                tokens,
                features: rows_given,
            });
        }
        // gather[pos]: 0 for text, 1 + feature row for an image token. Selecting from
        // [text embedding | features] by a mask keeps the scatter a device-side gather.
        let mut gather = Vec::with_capacity(ids.len());
        let mut next = 0;
        for &id in &ids {
            if id == image_token {
                next += 1;
                gather.push(next);
            } else {
                gather.push(0);
            }
        }
        let len = ids.len() as i32;
        let gather = Array::from_slice(&gather, &[len]);
        let is_image = ops::gt(&gather, Array::from_int(0))?.reshape(&[1, len, 1])?;
        let feature_rows = ops::maximum(
            ops::subtract(&gather, Array::from_int(1))?,
            Array::from_int(0),
        )?;
        let scattered = features
            .embeds
            .as_dtype(h.dtype())?
            .take_axis(&feature_rows, 0)?
            .reshape(h.shape())?;
        h = ops::select(&is_image, &scattered, &h)?;

        let positions = rope_index(&ids, &features.grid_thw, &self.config);
        let shifted: Vec<Vec<i32>> = positions
            .rows
            .iter()
            .map(|row| row.iter().map(|p| p + base).collect())
            .collect();
        let rows = [&shifted[0][..], &shifted[1][..], &shifted[2][..]];
        let deepstack = Deepstack {
            gather: &gather,
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
