//! Qwen3.5 / Qwen3.6 (`model_type: qwen3_5`, `qwen3_5_moe`): the hybrid Gated DeltaNet text
//! decoder with the Qwen3-VL vision tower (no deepstack); images replace the `<|image_pad|>`
//! embeddings and set the MRoPE positions as in Qwen3-VL.
//! Reference: mlx-vlm `models/qwen3_5/qwen3_5.py` (`sanitize`, `get_input_embeddings`) and
//! `models/qwen3_5_moe/qwen3_5_moe.py`.

pub mod config;
pub mod gated_delta;
pub mod language;
pub mod mtp;
// Compiled everywhere so it is type-checked on Linux; only macOS calls it.
#[cfg_attr(not(target_os = "macos"), allow(dead_code))]
pub mod metal;

use std::path::Path;

use mlx_rs::Array;

use self::{config::Config, language::LanguageModel as TextModel, mtp::MtpHead};
use super::{
    chunk_start, held, host_ids,
    qwen3_vl::{
        language::{
            batch_image_rows, chunk_base, delta_after, image_rows, rope_index_for, rows_from_rider,
            rows_rider, text_rows, ChunkRows, ImageTokenIds, RotaryAngles,
        },
        vision::VisionModel,
        MropePositions,
    },
    DraftHead, ImageInput, ImageScatter, LanguageModel, Logits, Part, VisionFeatures,
    VisionLanguageModel,
};
use crate::{cache::KvCache, config::ConfigFile, error::Result, weights::WeightStore};

pub struct Model {
    config: Config,
    /// Rank 0's (None on a pipeline's other ranks).
    vision: Option<VisionModel>,
    language: TextModel,
    /// The multi-token-prediction head, when loaded (see [`Model::load`]).
    mtp: Option<MtpHead>,
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

/// The draft head's zero-centred norms in a Hugging Face file (mlx-vlm's MTP `sanitize`).
const SHIFTED_HEAD_NORMS: &[&str] = &[
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
];

/// mlx-vlm's `sanitize`, in place on the store: Hugging Face names to mlx's, the conv1d weight
/// `[C, 1, K]` to `[C, K, 1]`, and +1 on the zero-centred norms of a Hugging Face file (never
/// on an mlx conversion: it already added it). The draft head (`mtp.*`) is set aside unless
/// `keep_head`; kept, its norms are shifted as the trunk's are (exactly once). The vision
/// tower's Conv3d is transposed by its own loader. `head_shift`: a sidecar head's own rule
/// (see `mtp::Sidecar`) instead of the file's.
fn sanitize(
    store: &mut WeightStore,
    tied: bool,
    keep_head: bool,
    head_shift: Option<bool>,
) -> Result<()> {
    let names = store.names();
    let unconverted_conv = names.iter().any(|name| {
        name.ends_with("conv1d.weight")
            && !name.starts_with("mtp.")
            && store
                .shape_of(name)
                .is_some_and(|shape| shape.last() != Some(&1))
    });
    // The head's names are the same in both layouts: the trunk's say which one the file is.
    let hugging_face_file =
        unconverted_conv || !names.iter().any(|name| name.starts_with("language_model."));
    for name in names.iter().filter(|name| name.starts_with("mtp.")) {
        if !keep_head {
            store.discard(name);
        } else if head_shift.unwrap_or(hugging_face_file)
            && SHIFTED_HEAD_NORMS.iter().any(|s| name.ends_with(s))
        {
            store.transform(name, |w| {
                if w.ndim() != 1 {
                    return Ok(w.clone());
                }
                Ok(mlx_rs::ops::add(w, crate::nn::scalar(1.0, w)?)?)
            })?;
        }
    }
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
    /// `with_head`: load the multi-token-prediction head when the file ships one (it costs a
    /// decoder layer of memory and of prefill); otherwise its tensors are set aside.
    pub fn load(
        dir: &Path,
        config: &ConfigFile,
        store: &mut WeightStore,
        with_head: bool,
        part: Part,
    ) -> Result<Self> {
        let args: Config = config.family(dir)?;
        let model_type = config.base.model_type.as_str();
        args.validate(dir, model_type)?;
        let rope = args.rope(dir)?;
        let moe = args.moe(dir, model_type)?;
        let quant = config.base.quantization.as_ref();
        let ships_head = store.names().iter().any(|name| name.starts_with("mtp."));
        // A conversion without the head may keep it beside (see `mtp::Sidecar`).
        let sidecar = match (with_head && !ships_head, mtp::find_sidecar(dir)) {
            (true, Some(sidecar)) => Some(mtp::add_sidecar(store, &sidecar)?),
            _ => None,
        };
        let head_layers = (ships_head || sidecar.is_some())
            .then(|| args.text_config.mtp_num_hidden_layers.unwrap_or(1).max(1) as usize)
            .filter(|_| with_head);
        let head_shift = sidecar.as_ref().map(|head| head.shift_norms);
        sanitize(store, args.tied(), head_layers.is_some(), head_shift)?;
        // The converters never quantize the tower: loading it dense makes a quantized one a
        // strict-loading error rather than a silent mis-read.
        part.drop_ends(store, &["vision_tower."]);
        let vision = part.ends(|| VisionModel::load(store, "vision_tower", &args.vision_config))?;
        let language = TextModel::load(store, quant, &args, moe.as_ref(), rope, part)?;
        let head_quant = sidecar
            .as_ref()
            .and_then(|head| head.quantization.as_ref())
            .or(quant);
        let mtp = head_layers
            .map(|layers| MtpHead::load(store, head_quant, &args, moe.as_ref(), layers))
            .transpose()?;
        Ok(Self {
            config: args,
            vision,
            language,
            mtp,
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

    /// The trunk's caches, then the head's (when loaded).
    fn new_cache(&self, max_ctx: usize) -> Vec<KvCache> {
        let head = self.mtp.as_ref().map_or(0, MtpHead::num_layers);
        (0..self.num_layers() + head)
            .map(|_| KvCache::new(max_ctx))
            .collect()
    }

    fn draft_head(&self) -> Option<&dyn DraftHead> {
        self.mtp.as_ref().map(|_| self as &dyn DraftHead)
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
        let chunk = match self.language.part.follower() {
            None => self.embed_chunk(inputs, features, caches)?,
            // What rank 0 embedded and positioned; the delta follows from the rows.
            Some(stage) => {
                let mut arrays = stage.receive()?.into_iter();
                let h = arrays.next().ok_or_else(|| {
                    crate::error::EngineError::Distributed("an empty pipeline message".into())
                })?;
                let rows = rows_from_rider(arrays.next().as_ref())?;
                let delta = (h.shape()[0] == 1).then(|| vec![delta_after(&rows, start.position())]);
                Chunk {
                    h,
                    rows: ChunkRows::Shared(rows),
                    deltas: delta,
                }
            }
        };
        let riders = match self.language.part.stage() {
            Some(_) => vec![rows_rider(chunk.rows.shared()?)],
            None => Vec::new(),
        };
        let out = self.language.forward_embeddings(
            chunk.h.clone(),
            &chunk.rows,
            &riders,
            &start,
            caches,
            logits,
        )?;
        self.set_rope_delta(&chunk, caches);
        Ok(out)
    }

    fn groups_images(&self) -> bool {
        self.language.part.stage().is_none()
    }
}

/// A chunk's input embeddings (image features placed) and rotary positions.
struct Chunk {
    h: Array,
    rows: ChunkRows,
    /// The caches' rope delta after the chunk (each batch row's), when its images change it.
    deltas: Option<Vec<i32>>,
}

impl Model {
    fn embed_chunk(
        &self,
        inputs: &Array,
        features: Option<&VisionFeatures>,
        caches: &[KvCache],
    ) -> Result<Chunk> {
        let (base, delta) = chunk_base(caches);
        let h = self.language.embed()?.forward(inputs)?;
        let Some(features) = features else {
            return Ok(Chunk {
                h,
                rows: ChunkRows::Shared(text_rows(inputs.shape()[inputs.ndim() - 1], base)),
                deltas: None,
            });
        };
        let ids = host_ids(inputs)?;
        let scatter = ImageScatter::new(&ids, self.config.image_token_id);
        let h = scatter.apply(&h, &features.embeds)?;
        let (rows, deltas) = match &ids[..] {
            [one] => {
                let positions = rope_index_for(one, &features.grid_thw, self.image_tokens());
                let rows = ChunkRows::Shared(image_rows(&positions, base));
                (rows, vec![delta + positions.rope_delta])
            }
            _ => {
                let first = caches.first().ok_or_else(|| {
                    crate::error::EngineError::InvalidRequest("no layer caches".into())
                })?;
                batch_image_rows(&ids, &features.grid_thw, self.image_tokens(), first)?
            }
        };
        Ok(Chunk {
            h,
            rows,
            deltas: Some(deltas),
        })
    }

    fn set_rope_delta(&self, chunk: &Chunk, caches: &mut [KvCache]) {
        if let Some(deltas) = &chunk.deltas {
            caches
                .iter_mut()
                .for_each(|cache| cache.set_row_rope_deltas(deltas));
        }
    }

    fn head(&self) -> &MtpHead {
        self.mtp
            .as_ref()
            .expect("draft_head() is Some only with a head")
    }
}

impl DraftHead for Model {
    fn head_layers(&self) -> usize {
        self.head().num_layers()
    }

    fn prime(
        &self,
        inputs: &Array,
        features: Option<&VisionFeatures>,
        next: &Array,
        caches: &mut [KvCache],
    ) -> Result<()> {
        let trunk_layers = self.num_layers();
        let (trunk, head) = caches.split_at_mut(trunk_layers);
        let chunk = self.embed_chunk(inputs, features, trunk)?;
        let rotary = RotaryAngles::for_chunk(
            &chunk.rows,
            trunk,
            &self.language.rope,
            self.language.rotary_dim,
        )?;
        let hidden = self.language.trunk(chunk.h.clone(), &rotary, trunk)?;
        // Pair i: the hidden state at input i with the token after it, at input i's position.
        let embeds = self.language.embed()?.forward(next)?;
        self.head().forward(&embeds, &hidden, &rotary, head)?;
        self.set_rope_delta(&chunk, caches);
        Ok(())
    }

    fn forward_hidden(
        &self,
        inputs: &Array,
        caches: &mut [KvCache],
        logits: Logits,
    ) -> Result<(Array, Array)> {
        let chunk = self.embed_chunk(inputs, None, caches)?;
        let rotary = RotaryAngles::for_chunk(
            &chunk.rows,
            caches,
            &self.language.rope,
            self.language.rotary_dim,
        )?;
        let hidden = self.language.trunk(chunk.h, &rotary, caches)?;
        let scored = if logits != Logits::All && hidden.shape()[1] > 1 {
            let last = hidden.shape()[1] - 1;
            mlx_rs::ops::indexing::IndexOp::index(&hidden, (.., last..))
        } else {
            hidden.clone()
        };
        Ok((self.language.project(&scored)?, hidden))
    }

    fn head_forward(
        &self,
        tokens: &Array,
        hidden: &Array,
        caches: &mut [KvCache],
    ) -> Result<Array> {
        let len = tokens.shape()[1];
        let (base, _) = chunk_base(caches);
        let rows = ChunkRows::Shared(text_rows(len, base));
        let rotary =
            RotaryAngles::for_chunk(&rows, caches, &self.language.rope, self.language.rotary_dim)?;
        let embeds = self.language.embed()?.forward(tokens)?;
        self.head().forward(&embeds, hidden, &rotary, caches)
    }

    fn take_in_alone(&self, token: &Array, caches: &mut [KvCache]) -> Result<()> {
        let zeros = mlx_rs::ops::zeros_like(&self.language.embed()?.forward(token)?)?;
        self.head_forward(token, &zeros, caches)?;
        Ok(())
    }

    fn head_logits(&self, outputs: &Array) -> Result<Array> {
        self.language.project(outputs)
    }
}
