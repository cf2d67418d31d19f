//! Model families by config.json `model_type`, one file each, behind one trait.

pub mod draft_model;
pub mod gemma4;
pub mod ignored_keys;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_moe;
pub mod qwen3_vl;
pub mod structure;
pub mod switch;

use std::path::{Path, PathBuf};

use mlx_rs::{ops, Array};

pub use crate::distributed::pipeline::Part;
use crate::{
    cache::KvCache,
    config::ConfigFile,
    distributed::pipeline,
    error::{EngineError, Result},
    weights::WeightStore,
};

/// Which positions to project to logits: all (teacher forcing, tests), the last (generation),
/// or none: a prefill piece whose logits nobody reads, only its caches (one process builds the
/// last position's lazily and never evaluates them; across ranks the last rank sends nothing
/// back, so rank 0 goes on to the next piece while the others compute this one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
    None,
}

pub trait LanguageModel {
    /// Token ids `[B, L]` (int32/uint32) through the model, appending to `caches`; returns
    /// logits `[B, L or 1, vocab]`.
    fn forward(&self, inputs: &Array, caches: &mut [KvCache], logits: Logits) -> Result<Array>;
    fn num_layers(&self) -> usize;
    fn vocab_size(&self) -> usize;
    fn max_position_embeddings(&self) -> usize;

    /// Fresh per-layer caches sized for at most `max_ctx` positions.
    fn new_cache(&self, max_ctx: usize) -> Vec<KvCache> {
        (0..self.num_layers())
            .map(|_| KvCache::new(max_ctx))
            .collect()
    }

    /// Whether every layer's cache can be cut back to a shorter prefix (a KV cache can; a
    /// recurrent state cannot, so the prefix cache keeps snapshots for those models).
    fn rewindable(&self) -> bool {
        true
    }

    /// Whether some layer keeps only a window of positions (`KvCache::windowed`): past the
    /// window its cache cannot be cut back far, so the prefix cache snapshots the start of the
    /// prompt's last message.
    fn windowed(&self) -> bool {
        false
    }

    /// The token each message of the rendered chat prompt starts with (where snapshots are
    /// taken): ChatML's, unless the family's template opens turns otherwise.
    fn message_opener(&self) -> &'static str {
        "<|im_start|>"
    }

    /// The image entry points of a vision-language model; None for text-only families.
    fn as_vision(&self) -> Option<&dyn VisionLanguageModel> {
        None
    }

    /// The model's own draft head when it ships one and it was loaded (Qwen3.5 / 3.6 MTP).
    /// Its caches then follow the model's `num_layers()` in every cache list.
    fn draft_head(&self) -> Option<&dyn DraftHead> {
        None
    }

    /// A separate draft model paired with this one (`draft_model::attach`); its caches follow
    /// this model's own.
    fn draft_model(&self) -> Option<&draft_model::DraftModel> {
        None
    }
}

/// A draft head reading the trunk's final-norm hidden states: for each position, the hidden
/// state paired with the token after it gives a draft of the token after that
/// (`speculative/head.rs` runs it).
pub trait DraftHead {
    /// Caches the head keeps after the trunk's (one per head layer).
    fn head_layers(&self) -> usize;

    /// A prefill piece (`inputs` `[B, L]`, with its image features if any) through the trunk,
    /// then the head over each position's hidden state paired with `next` `[B, L]` (the token
    /// after each input).
    fn prime(
        &self,
        inputs: &Array,
        features: Option<&VisionFeatures>,
        next: &Array,
        caches: &mut [KvCache],
    ) -> Result<()>;

    /// `token` `[1, 1]` paired with a zero hidden state at the next position of the head's
    /// `caches`: a reused prefix's head holds one position fewer than its trunk (the hidden
    /// state there is not kept), and the prompt's token after the prefix fills it alone.
    fn take_in_alone(&self, token: &Array, caches: &mut [KvCache]) -> Result<()>;

    /// [`LanguageModel::forward`] that also returns the final-norm hidden states of every input
    /// position, `[B, L, H]` (text only).
    fn forward_hidden(
        &self,
        inputs: &Array,
        caches: &mut [KvCache],
        logits: Logits,
    ) -> Result<(Array, Array)>;

    /// The head over `tokens` `[B, T]` paired with `hidden` `[B, T, H]`, at the next positions
    /// of `caches` (the head's own, not the trunk's); returns its outputs `[B, T, H]` (each a stand-in for the trunk's hidden
    /// state at the next position).
    fn head_forward(&self, tokens: &Array, hidden: &Array, caches: &mut [KvCache])
        -> Result<Array>;

    /// The shared lm_head's logits of head outputs.
    fn head_logits(&self, outputs: &Array) -> Result<Array>;
}

/// Preprocessed images of one prompt, in prompt order.
pub struct ImageInput {
    /// `[patches, C*T*P*P]` float32 rows of every image, concatenated.
    pub pixel_values: Array,
    /// `(t, h, w)` patch grid of each image.
    pub grid_thw: Vec<[i32; 3]>,
}

impl ImageInput {
    /// Images `first..` alone (those before it are already in a reused KV cache): each image's
    /// patch rows are `t * h * w` of its grid.
    pub fn from_image(&self, first: usize) -> ImageInput {
        let rows: i32 = self.grid_thw[..first]
            .iter()
            .map(|[t, h, w]| t * h * w)
            .sum();
        ImageInput {
            pixel_values: mlx_rs::ops::indexing::IndexOp::index(&self.pixel_values, rows..),
            grid_thw: self.grid_thw[first..].to_vec(),
        }
    }
}

/// What a vision tower hands the language model.
pub struct VisionFeatures {
    /// `[image tokens, hidden]`, one row per image soft token, images in order.
    pub embeds: Array,
    /// Extra per-layer features (Qwen3-VL deepstack), each shaped like `embeds`.
    pub deepstack: Vec<Array>,
    pub grid_thw: Vec<[i32; 3]>,
}

/// A model that sees images: the vision tower runs apart from prefill so callers can check
/// the context before any vision compute, then pass the features with the prompt ids.
pub trait VisionLanguageModel: LanguageModel {
    fn encode_images(&self, images: &ImageInput) -> Result<VisionFeatures>;

    /// Like [`LanguageModel::forward`] for a prompt chunk whose image soft tokens (which must
    /// number exactly the feature rows) take `features`; text-only when `features` is None.
    fn forward_with_images(
        &self,
        inputs: &Array,
        features: Option<&VisionFeatures>,
        caches: &mut [KvCache],
        logits: Logits,
    ) -> Result<Array>;

    /// Whether `forward_with_images` takes a batch of rows (prompts with images prefilled
    /// together); a pipeline's ranks take image prompts one at a time.
    fn groups_images(&self) -> bool {
        false
    }
}

/// The prompt ids on the host, one list per batch row (they are small; image features never
/// leave the device).
pub(crate) fn host_ids(inputs: &Array) -> Result<Vec<Vec<u32>>> {
    let shape = inputs.shape();
    if shape.len() != 2 || shape[0] < 1 {
        return Err(EngineError::InvalidRequest(format!(
            "image prompts take ids shaped [rows, length], got {shape:?}"
        )));
    }
    let ids = inputs.as_type::<u32>()?;
    ids.eval()?;
    let len = shape[1].max(1) as usize;
    Ok(ids
        .as_slice::<u32>()
        .chunks(len)
        .map(<[u32]>::to_vec)
        .collect())
}

/// Splits `grids` (every image of a batch chunk, in row order) into each row's, given how many
/// images each row's ids hold; the counts must add up exactly.
pub(crate) fn grids_per_row(grids: &[[i32; 3]], counts: &[usize]) -> Result<Vec<Vec<[i32; 3]>>> {
    if counts.iter().sum::<usize>() != grids.len() {
        return Err(EngineError::InvalidRequest(format!(
            "the chunk holds {} image blocks but {} image grids came with it",
            counts.iter().sum::<usize>(),
            grids.len()
        )));
    }
    let mut rest = grids;
    Ok(counts
        .iter()
        .map(|&count| {
            let (row, after) = rest.split_at(count);
            rest = after;
            row.to_vec()
        })
        .collect())
}

/// Where a chunk's image soft tokens take their features: `gather[pos]` is 0 for text and
/// 1 + the feature row for an image token, so placing them is one gather and select on
/// device (never a seq × seq product).
pub(crate) struct ImageScatter {
    pub gather: Array,
    pub count: usize,
}

impl ImageScatter {
    /// `rows`: the chunk's ids per batch row; features are taken in row order.
    pub fn new(rows: &[Vec<u32>], image_token: u32) -> Self {
        let mut next = 0;
        let gather: Vec<i32> = rows
            .iter()
            .flatten()
            .map(|&id| {
                if id == image_token {
                    next += 1;
                    next
                } else {
                    0
                }
            })
            .collect();
        Self {
            gather: Array::from_slice(&gather, &[gather.len() as i32]),
            count: next as usize,
        }
    }

    /// `h` `[B, L, hidden]` with the image positions replaced by `features` `[count, hidden]`;
    /// the counts must agree exactly.
    pub fn apply(&self, h: &Array, features: &Array) -> Result<Array> {
        let rows = features.shape()[0] as usize;
        if rows != self.count {
            return Err(EngineError::ImageTokenMismatch {
                tokens: self.count,
                features: rows,
            });
        }
        let is_image =
            ops::gt(&self.gather, Array::from_int(0))?.reshape(&[h.shape()[0], h.shape()[1], 1])?;
        let feature_rows = ops::maximum(
            ops::subtract(&self.gather, Array::from_int(1))?,
            Array::from_int(0),
        )?;
        let scattered = features
            .as_dtype(h.dtype())?
            .take_axis(&feature_rows, 0)?
            .reshape(h.shape())?;
        Ok(ops::select(&is_image, &scattered, h)?)
    }
}

/// What `rmlx info` and `/v1/models` report about a checkpoint.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelInfo {
    pub path: PathBuf,
    pub model_type: String,
    pub parameters: u64,
    pub quantization: Option<String>,
    pub context_length: usize,
    pub vocab_size: usize,
    pub vision: bool,
    pub weight_bytes: u64,
    /// The release structure recognised, e.g. "qwen3_moe, MoE 128 experts top-8".
    pub structure: String,
    /// KV cache bytes per position of context.
    pub kv_bytes_per_token: u64,
    /// Fixed per-sequence state of linear-attention layers (0 for attention-only models).
    pub recurrent_state_bytes: u64,
    /// What sliding-window layers keep per sequence (their window; 0 without such layers).
    pub window_state_bytes: u64,
    /// Whether the checkpoint ships a multi-token-prediction draft head (`mtp.*`, or a sidecar
    /// beside it: `models::qwen3_5::mtp::Sidecar`).
    pub draft_head: bool,
    /// Whether that head was loaded (speculative decoding on).
    pub draft_head_loaded: bool,
    /// The separate draft model paired with this one (`--draft-model`), if any.
    pub draft_model: Option<PathBuf>,
    /// Seconds its load took: config, weights read and evaluated (what a first request waits
    /// for before any warm-up).
    pub load_seconds: f64,
}

/// A model ready to run, with its facts.
pub struct LoadedModel {
    pub model: Box<dyn LanguageModel>,
    pub info: ModelInfo,
}

/// The config.json `model_type`s rMLX loads.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "qwen3",
    "qwen3_moe",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "gemma4",
];

/// What to load besides the model itself.
#[derive(Clone, Default)]
pub struct LoadOptions {
    /// The draft head a checkpoint ships (Qwen3.5 / 3.6 `mtp.*`), for speculative decoding.
    pub draft_head: bool,
    /// One pipeline stage's part of the model instead of all of it (issue 33).
    pub part: Part,
}

/// The layer loop's input: `embed()` (the embeddings and what later layers also read) in one
/// process and on rank 0; on a follower, what the previous rank sent.
pub(crate) fn stage_input(
    part: &Part,
    embed: impl FnOnce() -> Result<(Array, Vec<Array>)>,
) -> Result<(Array, Vec<Array>)> {
    match part.follower() {
        Some(stage) => {
            let mut arrays = stage.receive()?.into_iter();
            let h = arrays
                .next()
                .ok_or_else(|| EngineError::Distributed("an empty pipeline message".into()))?;
            Ok((h, arrays.collect()))
        }
        None => embed(),
    }
}

/// After this process's layers: the hidden state to finish on (one process; rank 0 once the
/// last rank sent it back), or None on a follower, which passed it on.
/// `start`: where the chunk started and which caches it ran on ([`chunk_start`]).
pub(crate) fn stage_output(
    part: &Part,
    h: Array,
    riders: &[Array],
    logits: Logits,
    start: &ChunkStart,
) -> Result<Option<Array>> {
    match part.stage() {
        Some(stage) => stage.pass_on(&h, riders, logits, start.0, &start.1),
        None => Ok(Some(h)),
    }
}

/// Where a chunk starts (the first cache's offset before the forward) and its caches' ids in
/// rank 0's log (`cache_mirror`; empty in one process).
pub(crate) struct ChunkStart(i32, Vec<i32>);

pub(crate) fn chunk_start(caches: &[KvCache]) -> ChunkStart {
    let ids = match crate::cache_mirror::enabled() {
        true => caches
            .iter()
            .map(|cache| cache.mirror_id().unwrap_or(0))
            .collect(),
        false => Vec::new(),
    };
    ChunkStart(caches.first().map_or(0, KvCache::offset), ids)
}

impl ChunkStart {
    pub(crate) fn position(&self) -> i32 {
        self.0
    }
}

/// `[B, L]` of a layer loop's hidden state (what a shadow layer's cache advances by).
pub(crate) fn batch_and_len(h: &Array) -> (i32, i32) {
    (h.shape()[0], h.shape()[1])
}

/// A part only rank 0 holds (embeddings, norm, output layer).
pub(crate) fn held<'a, T>(part: &'a Option<T>, what: &str) -> Result<&'a T> {
    part.as_ref().ok_or_else(|| pipeline::not_held(what))
}

/// [`load_model_with`] without the optional parts.
pub fn load_model(dir: &Path) -> Result<LoadedModel> {
    load_model_with(dir, LoadOptions::default())
}

/// Reads config.json, builds the family's model strictly from the weights (every parameter
/// filled, nothing left over) and evaluates the weights once so the file reads happen here.
pub fn load_model_with(dir: &Path, options: LoadOptions) -> Result<LoadedModel> {
    let started = std::time::Instant::now();
    let part = options.part.clone();
    let config = ConfigFile::read(dir)?;
    let model_type = config.base.model_type.clone();
    // Refuse an unknown family before reading any weights.
    if !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
        return Err(EngineError::UnknownModelType(model_type));
    }
    check_head_geometry(dir, &config.json)?;
    let mut store = WeightStore::open(dir)?;
    let ships_draft_head = store.names().iter().any(|name| name.starts_with("mtp."))
        || (model_type.starts_with("qwen3_5") && qwen3_5::mtp::find_sidecar(dir).is_some());
    debug_assert_eq!(ships_draft_head, ships_draft_head_at(dir));
    let model: Box<dyn LanguageModel> = match model_type.as_str() {
        "qwen3" => Box::new(qwen3::Model::load(dir, &config, &mut store, part)?),
        "qwen3_moe" => Box::new(qwen3_moe::load(dir, &config, &mut store, part)?),
        // qwen3_vl_moe is Qwen3-VL with experts in the text decoder (mlx-vlm `qwen3_vl_moe`).
        "qwen3_vl" | "qwen3_vl_moe" => Box::new(qwen3_vl::Model::load(
            dir,
            &config,
            &mut store,
            part.clone(),
        )?),
        // qwen3_5_moe is Qwen3.5 with routed experts in every layer (mlx-vlm `qwen3_5_moe`).
        "qwen3_5" | "qwen3_5_moe" => Box::new(qwen3_5::Model::load(
            dir,
            &config,
            &mut store,
            options.draft_head,
            part.clone(),
        )?),
        "gemma4" => Box::new(gemma4::Model::load(dir, &config, &mut store, part.clone())?),
        _ => unreachable!("checked above"),
    };
    let summary = store.finish()?;
    crate::runtime::eval(summary.arrays.iter())?;
    let quantization = config.base.quantization.as_ref().map(|q| {
        format!(
            "{} {}-bit, group {}",
            q.mode.as_deref().unwrap_or("affine"),
            q.bits,
            q.group_size
        )
    });
    let info = ModelInfo {
        path: dir.to_path_buf(),
        model_type,
        parameters: summary.parameters,
        quantization,
        context_length: config
            .base
            .max_position_embeddings
            .unwrap_or(model.max_position_embeddings()),
        vocab_size: model.vocab_size(),
        vision: config.json.get("vision_config").is_some(),
        weight_bytes: summary.bytes,
        structure: structure::describe(&config.json),
        // A loaded draft head keeps its own KV per position beside the trunk's.
        kv_bytes_per_token: structure::kv_bytes_per_token(&config.json)
            + match model.draft_head() {
                Some(_) => structure::draft_head_kv_bytes_per_token(&config.json, None),
                None => 0,
            },
        recurrent_state_bytes: structure::recurrent_state_bytes(&config.json),
        window_state_bytes: structure::window_state_bytes(&config.json),
        draft_head: ships_draft_head,
        draft_head_loaded: model.draft_head().is_some(),
        draft_model: None,
        load_seconds: started.elapsed().as_secs_f64(),
    };
    Ok(LoadedModel { model, info })
}

/// Whether the checkpoint in `dir` ships a multi-token-prediction draft head (Qwen3.5 / 3.6
/// `mtp.*` in its weights, or a sidecar beside them), read from the index or the safetensors
/// headers without loading anything: for model listings.
pub fn ships_draft_head_at(dir: &Path) -> bool {
    let Ok(config) = crate::config::read_json(&dir.join("config.json")) else {
        return false;
    };
    if !config["model_type"]
        .as_str()
        .is_some_and(|kind| kind.starts_with("qwen3_5"))
    {
        return false;
    }
    if qwen3_5::mtp::find_sidecar(dir).is_some() {
        return true;
    }
    if let Ok(index) = crate::config::read_json(&dir.join("model.safetensors.index.json")) {
        return index["weight_map"]
            .as_object()
            .is_some_and(|map| map.keys().any(|name| name.starts_with("mtp.")));
    }
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("model") && name.ends_with(".safetensors")
        })
        .any(|file| {
            crate::weights::check_header(&file)
                .is_ok_and(|names| names.iter().any(|name| name.starts_with("mtp.")))
        })
}

/// Zero or non-dividing head counts would reach MLX as a division by zero (a SIGFPE that kills
/// the process); every family shares these keys, at the top level or under `text_config`.
fn check_head_geometry(dir: &Path, json: &serde_json::Value) -> Result<()> {
    let text = json.get("text_config").unwrap_or(json);
    let count = |key: &str| text.get(key).and_then(serde_json::Value::as_i64);
    let error = |message: String| EngineError::Config {
        path: dir.join("config.json"),
        message,
    };
    for key in [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "head_dim",
    ] {
        if let Some(value) = count(key).filter(|v| *v <= 0) {
            return Err(error(format!("{key} must be positive, not {value}")));
        }
    }
    let heads = count("num_attention_heads").unwrap_or(1);
    for key in ["num_key_value_heads", "num_global_key_value_heads"] {
        match count(key) {
            Some(kv) if kv <= 0 || heads % kv != 0 => {
                return Err(error(format!(
                    "{key} {kv} must be positive and divide num_attention_heads {heads}"
                )))
            }
            _ => {}
        }
    }
    Ok(())
}

/// The keys of a config.json that no part of rMLX's loader reads, as dotted paths (e.g.
/// `text_config.attention_dropout`), for the key-coverage test: a release that adds a switch
/// must not pass silently. A key counts as read when the family's config type (or the shared
/// [`crate::config::BaseConfig`]) has a field for it; this is found by deserialising the
/// family's type and serialising it back (fields kept as raw JSON count as read whole).
pub fn unread_config_keys(json: &serde_json::Value) -> Result<Vec<String>> {
    fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(
        json: &serde_json::Value,
    ) -> Result<serde_json::Value> {
        let typed: T =
            serde_json::from_value(json.clone()).map_err(|error| EngineError::Config {
                path: PathBuf::from("config.json"),
                message: error.to_string(),
            })?;
        serde_json::to_value(typed).map_err(|error| EngineError::Config {
            path: PathBuf::from("config.json"),
            message: error.to_string(),
        })
    }
    fn unread(
        path: &str,
        given: &serde_json::Value,
        read: &serde_json::Value,
        out: &mut Vec<String>,
    ) {
        let (Some(given), Some(read)) = (given.as_object(), read.as_object()) else {
            return;
        };
        for (key, value) in given {
            let dotted = if path.is_empty() {
                key.clone()
            } else {
                format!("{path}.{key}")
            };
            match read.get(key) {
                Some(read_value) => unread(&dotted, value, read_value, out),
                None => out.push(dotted),
            }
        }
    }
    let model_type = json["model_type"].as_str().unwrap_or_default();
    let family = match model_type {
        "qwen3" => round_trip::<qwen3::Config>(json)?,
        "qwen3_moe" => round_trip::<qwen3_moe::Config>(json)?,
        "qwen3_vl" | "qwen3_vl_moe" => round_trip::<qwen3_vl::config::Config>(json)?,
        "qwen3_5" | "qwen3_5_moe" => round_trip::<qwen3_5::config::Config>(json)?,
        "gemma4" => round_trip::<gemma4::config::Config>(json)?,
        other => return Err(EngineError::UnknownModelType(other.to_string())),
    };
    let base = round_trip::<crate::config::BaseConfig>(json)?;
    let mut read = family;
    if let (Some(read), Some(base)) = (read.as_object_mut(), base.as_object()) {
        for (key, value) in base {
            read.entry(key.clone()).or_insert_with(|| value.clone());
        }
    }
    let mut out = Vec::new();
    unread("", json, &read, &mut out);
    Ok(out)
}
