//! Gemma 4 (`model_type: gemma4`): the vision tower's pooled features replace the prompt's
//! `<|image|>` soft tokens (count checked, scattered on device); per-layer input embeddings
//! see those positions as token 0; image soft tokens attend to their whole image during
//! prefill. Audio towers are checked against their config and set aside (audio input is
//! refused). Reference: mlx-vlm `models/gemma4/gemma4.py` (including `sanitize`).

pub mod audio;
pub mod config;
pub mod language;
pub mod vision;

use std::{ops::Range, path::Path};

use mlx_rs::{ops, Array};

use self::{config::Config, language::LanguageModel as TextModel, vision::VisionModel};
use super::{
    held, host_ids, ImageInput, ImageScatter, LanguageModel, Logits, Part, VisionFeatures,
    VisionLanguageModel,
};
use crate::{cache::KvCache, config::ConfigFile, error::Result, weights::WeightStore};

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
        args.validate(dir)?;
        sanitize(store, &args);
        if let Some(audio) = args.audio_config.as_ref().filter(|audio| audio.is_object()) {
            audio::check_and_skip(store, audio, args.text_config.hidden_size)?;
        }
        let quant = config.base.quantization.as_ref();
        // The tower and embedder stay dense in mlx-vlm's conversions (QAT fp4 included);
        // loading them dense makes a stray quantized tower a strict-loading error.
        part.drop_ends(store, &["vision_tower.", "embed_vision."]);
        let vision = part
            .ends(|| VisionModel::load(store, &args.vision_config, args.text_config.hidden_size))?;
        let language = TextModel::load(store, quant, &args, dir, part)?;
        Ok(Self {
            config: args,
            vision,
            language,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }
}

/// The Google releases' names and the tensors mlx-vlm's sanitize drops: the `model.` prefix
/// (`model.language_model.*` → `language_model.model.*`), rotary buffers, clip bounds no
/// layer uses, and the k/v projections the KV-shared layers ship but never use. The experts'
/// fused layout is read where the experts load.
fn sanitize(store: &mut WeightStore, config: &Config) {
    if store.contains("model.language_model.embed_tokens.weight") {
        store.rename_prefix("model.language_model.", "language_model.model.");
        for part in [
            "vision_tower.",
            "embed_vision.",
            "audio_tower.",
            "embed_audio.",
        ] {
            store.rename_prefix(&format!("model.{part}"), part);
        }
    }
    let clip = ["input_min", "input_max", "output_min", "output_max"];
    let vision_clipped = config.vision_config.use_clipped_linears;
    for name in store.names() {
        let leaf = name.rsplit('.').next().unwrap_or_default();
        let unused_clip = clip.contains(&leaf)
            && if name.starts_with("vision_tower.") {
                !vision_clipped
            } else {
                !name.starts_with("audio_tower.")
            };
        if name.contains("rotary_emb") || unused_clip {
            store.discard(&name);
        }
    }
    let text = &config.text_config;
    for layer in config.first_kv_shared_layer()..text.num_hidden_layers as usize {
        for part in ["k_proj", "v_proj", "k_norm", "v_norm"] {
            for suffix in ["weight", "scales", "biases"] {
                store.discard(&format!(
                    "language_model.model.layers.{layer}.self_attn.{part}.{suffix}"
                ));
            }
        }
    }
}

impl Model {
    /// Runs of image soft tokens (chunk-relative): each attends to itself both ways.
    fn image_runs(&self, ids: &[u32]) -> Vec<Range<usize>> {
        let mut runs: Vec<Range<usize>> = Vec::new();
        for (at, &id) in ids.iter().enumerate() {
            if id != self.config.image_token_id {
                continue;
            }
            match runs.last_mut() {
                Some(run) if run.end == at => run.end = at + 1,
                _ => runs.push(at..at + 1),
            }
        }
        runs
    }
}

impl LanguageModel for Model {
    fn forward(&self, inputs: &Array, caches: &mut [KvCache], logits: Logits) -> Result<Array> {
        self.forward_with_images(inputs, None, caches, logits)
    }

    fn num_layers(&self) -> usize {
        self.config.text_config.num_hidden_layers as usize
    }

    fn vocab_size(&self) -> usize {
        self.config.text_config.vocab_size as usize
    }

    fn max_position_embeddings(&self) -> usize {
        self.config.text_config.max_position_embeddings
    }

    /// KV-shared layers keep no cache of their own.
    fn new_cache(&self, max_ctx: usize) -> Vec<KvCache> {
        self.language.new_caches(max_ctx)
    }

    /// Its sliding layers keep their window only.
    fn windowed(&self) -> bool {
        true
    }

    /// Gemma 4's template opens every turn with `<|turn>` (`<|turn>user`, `<|turn>model`).
    fn message_opener(&self) -> &'static str {
        "<|turn>"
    }

    fn as_vision(&self) -> Option<&dyn VisionLanguageModel> {
        Some(self)
    }
}

impl VisionLanguageModel for Model {
    fn encode_images(&self, images: &ImageInput) -> Result<VisionFeatures> {
        Ok(VisionFeatures {
            embeds: held(&self.vision, "the vision tower")?.forward(images)?,
            deepstack: Vec::new(),
            grid_thw: images.grid_thw.clone(),
        })
    }

    fn forward_with_images(
        &self,
        inputs: &Array,
        features: Option<&VisionFeatures>,
        caches: &mut [KvCache],
        logits: Logits,
    ) -> Result<Array> {
        if self.language.part.follower().is_some() {
            return self.language.forward_received(caches, logits);
        }
        let mut h = self.language.embed(inputs)?;
        let mut bidirectional = Vec::new();
        if let Some(features) = features {
            let ids = host_ids(inputs)?;
            h = ImageScatter::new(&ids, self.config.image_token_id).apply(&h, &features.embeds)?;
            if self.config.bidirectional_images() {
                bidirectional = ids.iter().map(|row| self.image_runs(row)).collect();
            }
        }
        // On device: decode steps must not wait for their ids on the host.
        let mut media = ops::eq(inputs, Array::from_int(self.config.image_token_id as i32))?;
        for id in [self.config.audio_token_id, self.config.video_token_id]
            .into_iter()
            .flatten()
        {
            media = ops::logical_or(&media, ops::eq(inputs, Array::from_int(id as i32))?)?;
        }
        let per_layer_ids = ops::select(&media, ops::zeros_like(inputs)?, inputs)?;
        self.language
            .forward_embeddings(h, &per_layer_ids, &bidirectional, caches, logits)
    }

    fn groups_images(&self) -> bool {
        self.language.part.stage().is_none()
    }
}
