//! Qwen3-VL text decoder: Qwen3 blocks (q/k RMSNorm, SwiGLU) with interleaved MRoPE over
//! three position rows (t, h, w), deepstack features added at the image positions after the
//! first layers, and `get_rope_index` for text+image prompts. Reference: mlx-vlm
//! `models/qwen3_vl/language.py` and `rope_utils.py` (`MRoPERotaryEmbedding`, interleaved).

use mlx_rs::{ops, ops::indexing::IndexOp, Array};

use super::{
    config::{Config, Rope, TextConfig},
    vision::inv_freq,
};
use crate::{
    cache::KvCache,
    config::QuantizationConfig,
    error::Result,
    models::{
        batch_and_len, held,
        qwen3::{Attention, AttentionShape, FeedForward, Mlp},
        qwen3_moe::SparseMoeBlock,
        stage_output, ChunkStart, Logits, Part,
    },
    nn::{rotate_half, Embedding, Linear, RmsNorm},
    weights::WeightStore,
};

/// Per-token rotary positions of a prompt: rows t, h, w, and the delta that maps later cache
/// offsets to rotary positions (`position = offset + delta`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MropePositions {
    pub rows: [Vec<i32>; 3],
    pub rope_delta: i32,
}

/// mlx-vlm's `get_rope_index` for one prompt with images (no video): text runs count up on all
/// three rows; each image block holds (t, h/merge, w/merge) coordinates offset by the position
/// after the preceding text; the next text resumes at the block's max + 1.
pub fn rope_index(ids: &[u32], grids: &[[i32; 3]], config: &Config) -> MropePositions {
    let tokens = ImageTokenIds {
        image: config.image_token_id,
        vision_start: config.vision_start_token_id,
        merge: config.vision_config.spatial_merge_size,
    };
    rope_index_for(ids, grids, tokens)
}

/// The ids and merge size `get_rope_index` reads (Qwen3-VL and Qwen3.5 share the function).
#[derive(Debug, Clone, Copy)]
pub struct ImageTokenIds {
    pub image: u32,
    pub vision_start: u32,
    pub merge: i32,
}

/// How many image blocks `ids` open (a vision-start token followed by an image token), as
/// `get_rope_index` counts them.
fn image_count(ids: &[u32], tokens: ImageTokenIds) -> usize {
    ids.windows(2)
        .filter(|pair| pair[0] == tokens.vision_start && pair[1] == tokens.image)
        .count()
}

/// [`rope_index`] for any family with Qwen3-VL's image blocks.
pub fn rope_index_for(ids: &[u32], grids: &[[i32; 3]], tokens: ImageTokenIds) -> MropePositions {
    let len = ids.len();
    let merge = tokens.merge;
    let image_nums = image_count(ids, tokens);
    if grids.is_empty() || image_nums == 0 {
        let positions: Vec<i32> = (0..len as i32).collect();
        return MropePositions {
            rows: [positions.clone(), positions.clone(), positions],
            rope_delta: 0,
        };
    }
    let mut rows: [Vec<i32>; 3] = Default::default();
    let mut next = 0; // max of the previous run + 1
    let mut start = 0;
    for &[t, h, w] in grids.iter().take(image_nums) {
        let Some(found) = ids[start..].iter().position(|&id| id == tokens.image) else {
            break;
        };
        let end = start + found;
        let text_len = (end - start) as i32;
        for row in rows.iter_mut() {
            row.extend(next..next + text_len);
        }
        let (gh, gw) = (h / merge, w / merge);
        let base = next + text_len;
        let mut block_max = base;
        for ti in 0..t {
            for hi in 0..gh {
                for wi in 0..gw {
                    rows[0].push(base + ti);
                    rows[1].push(base + hi);
                    rows[2].push(base + wi);
                    block_max = block_max.max(base + ti.max(hi).max(wi));
                }
            }
        }
        next = block_max + 1;
        start = end + (t * gh * gw) as usize;
    }
    if start < len {
        let text_len = (len - start) as i32;
        for row in rows.iter_mut() {
            row.extend(next..next + text_len);
        }
        next += text_len;
    }
    MropePositions {
        rows,
        rope_delta: next - len as i32,
    }
}

/// Where the next chunk starts in rotary positions, and the rope delta the caches carry: the
/// caches hold `offset` tokens, and tokens after an image prompt sit at offset + delta (image
/// blocks use fewer positions than tokens). A chunk's own image blocks shift by the same base.
pub(crate) fn chunk_base(caches: &[KvCache]) -> (i32, i32) {
    let (offset, delta) = caches
        .first()
        .map_or((0, 0), |cache| (cache.offset(), cache.rope_delta()));
    (offset + delta, delta)
}

/// The three rotary rows of a text chunk of `len` tokens: one count from `base` on every row.
pub(crate) fn text_rows(len: i32, base: i32) -> [Vec<i32>; 3] {
    let row: Vec<i32> = (base..base + len).collect();
    [row.clone(), row.clone(), row]
}

/// `get_rope_index`'s rows of a chunk with images, moved to start at `base`.
pub(crate) fn image_rows(positions: &MropePositions, base: i32) -> [Vec<i32>; 3] {
    positions
        .rows
        .clone()
        .map(|row| row.into_iter().map(|p| p + base).collect())
}

/// A chunk's rotary positions. `Shared`: one sequence's rows t, h, w; in a batch of text,
/// each batch row counts from its own cache base instead (`KvCache::row_rope_bases`).
/// `PerRow`: a batch chunk holding images, every batch row's own three rows.
pub(crate) enum ChunkRows {
    Shared([Vec<i32>; 3]),
    PerRow(Vec<[Vec<i32>; 3]>),
}

impl ChunkRows {
    /// The rows that ride to the next pipeline rank: a pipeline takes image prompts one at a
    /// time (`VisionLanguageModel::groups_images`), so a batch's are never sent.
    pub(crate) fn shared(&self) -> Result<&[Vec<i32>; 3]> {
        match self {
            Self::Shared(rows) => Ok(rows),
            Self::PerRow(_) => Err(crate::error::EngineError::Distributed(
                "a pipeline prefills image prompts one at a time".into(),
            )),
        }
    }
}

/// The positions of a batch chunk holding images (`ids` per batch row, `grids` every image's
/// in row order) and each row's rope delta after it: `get_rope_index` row by row, from each
/// row's base in `cache` (its offset plus its delta so far).
pub(crate) fn batch_image_rows(
    ids: &[Vec<u32>],
    grids: &[[i32; 3]],
    tokens: ImageTokenIds,
    cache: &KvCache,
) -> Result<(ChunkRows, Vec<i32>)> {
    let counts: Vec<usize> = ids.iter().map(|row| image_count(row, tokens)).collect();
    let grids = crate::models::grids_per_row(grids, &counts)?;
    let (bases, deltas) = (cache.row_rope_bases(), cache.row_rope_deltas());
    let mut rows = Vec::with_capacity(ids.len());
    let mut after = Vec::with_capacity(ids.len());
    for (b, row_ids) in ids.iter().enumerate() {
        let positions = rope_index_for(row_ids, &grids[b], tokens);
        rows.push(image_rows(&positions, bases[b]));
        after.push(deltas[b] + positions.rope_delta);
    }
    Ok((ChunkRows::PerRow(rows), after))
}

/// A chunk's rotary rows as they ride to the next pipeline rank: `[3, L]` int32.
pub(crate) fn rows_rider(rows: &[Vec<i32>; 3]) -> Array {
    let flat: Vec<i32> = rows.iter().flatten().copied().collect();
    Array::from_slice(&flat, &[3, rows[0].len() as i32])
}

/// [`rows_rider`] read back on the receiving rank.
pub(crate) fn rows_from_rider(rider: Option<&Array>) -> Result<[Vec<i32>; 3]> {
    let rider = rider.ok_or_else(|| {
        crate::error::EngineError::Distributed("the rotary rows did not come with the chunk".into())
    })?;
    let len = rider.shape()[1] as usize;
    let flat = rider.as_dtype(mlx_rs::Dtype::Int32)?;
    let flat = flat.as_slice::<i32>();
    Ok([0, 1, 2].map(|row| flat[row * len..(row + 1) * len].to_vec()))
}

/// The rope delta the caches carry after a one-sequence chunk at `rows` that started at
/// cache offset `offset`: later tokens continue after the chunk's highest position (what rank
/// 0 sets from the images' grid, which a follower does not have).
pub(crate) fn delta_after(rows: &[Vec<i32>; 3], offset: i32) -> i32 {
    let len = rows[0].len() as i32;
    let highest = rows.iter().flatten().copied().max().unwrap_or(offset - 1);
    highest + 1 - offset - len
}

/// Interleaved MRoPE: frequency `i` takes its position from row `selector[i]` (h at
/// i ≡ 1 mod 3 and w at i ≡ 2 mod 3 within their sections, t elsewhere).
pub(super) fn position_selector(section: [i32; 3], freq_dim: i32) -> Vec<usize> {
    let mut selector = vec![0; freq_dim as usize];
    for (row, offset) in [(1usize, 1i32), (2, 2)] {
        let mut i = offset;
        while i < (section[row] * 3).min(freq_dim) {
            selector[i as usize] = row;
            i += 3;
        }
    }
    selector
}

/// cos/sin `[1, 1, L, rotary_dim]` for positions `rows` (t, h, w) of `L` tokens. Qwen3-VL
/// rotates whole heads; Qwen3.5 only the first `rotary_dim` dims (the rest pass through).
pub(crate) struct RotaryAngles {
    cos: Array,
    sin: Array,
}

impl RotaryAngles {
    pub(crate) fn new(rows: &[&[i32]; 3], rope: &Rope, head_dim: i32) -> Result<Self> {
        Self::of_rows(&[*rows], rope, head_dim)
    }

    /// `[B, 1, L, rotary_dim]` for batch rows that each have their own rows t, h, w.
    fn of_rows(batch: &[[&[i32]; 3]], rope: &Rope, head_dim: i32) -> Result<Self> {
        let len = batch.first().map_or(0, |rows| rows[0].len());
        let freq_dim = head_dim / 2;
        let selector = position_selector(rope.mrope_section, freq_dim);
        let mut positions = Vec::with_capacity(batch.len() * len * freq_dim as usize);
        for rows in batch {
            let (t, h, w) = (rows[0], rows[1], rows[2]);
            for ((&t, &h), &w) in t.iter().zip(h).zip(w) {
                let axes = [t, h, w];
                positions.extend(selector.iter().map(|&row| axes[row] as f32));
            }
        }
        let shape = [batch.len() as i32, len as i32, freq_dim];
        let positions = Array::from_slice(&positions, &shape);
        let freqs = ops::multiply(&positions, inv_freq(head_dim, rope.theta)?)?;
        let angles = ops::concatenate(&[&freqs, &freqs], -1)?.reshape(&[
            batch.len() as i32,
            1,
            len as i32,
            head_dim,
        ])?;
        Ok(Self {
            cos: ops::cos(&angles)?,
            sin: ops::sin(&angles)?,
        })
    }

    /// The angles of a decoding batch's text tokens, `[B, 1, L, rotary_dim]`: row `b` counts
    /// from `bases[b]` on all three axes (its offset plus its rope delta).
    pub(crate) fn per_row(bases: &[i32], len: i32, rope: &Rope, head_dim: i32) -> Result<Self> {
        let positions: Vec<f32> = bases
            .iter()
            .flat_map(|&base| (base..base + len).map(|p| p as f32))
            .collect();
        let batch = bases.len() as i32;
        let positions = Array::from_slice(&positions, &[batch, len, 1]);
        let freqs = ops::multiply(&positions, inv_freq(head_dim, rope.theta)?)?;
        let angles =
            ops::concatenate(&[&freqs, &freqs], -1)?.reshape(&[batch, 1, len, head_dim])?;
        Ok(Self {
            cos: ops::cos(&angles)?,
            sin: ops::sin(&angles)?,
        })
    }

    /// [`Self::new`] for one sequence; for a batch, [`Self::per_row`] over text or every
    /// row's own rows where the chunk holds images.
    pub(crate) fn for_chunk(
        rows: &ChunkRows,
        caches: &[KvCache],
        rope: &Rope,
        head_dim: i32,
    ) -> Result<Self> {
        let rows = match rows {
            ChunkRows::PerRow(batch) => {
                let batch: Vec<[&[i32]; 3]> = batch
                    .iter()
                    .map(|rows| [&rows[0][..], &rows[1][..], &rows[2][..]])
                    .collect();
                return Self::of_rows(&batch, rope, head_dim);
            }
            ChunkRows::Shared(rows) => rows,
        };
        match caches.first().filter(|cache| cache.batch_size() > 1) {
            Some(cache) => Self::per_row(
                &cache.row_rope_bases(),
                rows[0].len() as i32,
                rope,
                head_dim,
            ),
            None => Self::new(&[&rows[0][..], &rows[1][..], &rows[2][..]], rope, head_dim),
        }
    }

    pub(crate) fn apply(&self, x: &Array) -> Result<Array> {
        // mlx-vlm casts cos/sin to the activations' dtype before rotating.
        let cos = self.cos.as_dtype(x.dtype())?;
        let sin = self.sin.as_dtype(x.dtype())?;
        let rotary_dim = cos.shape()[3];
        let head_dim = x.shape()[3];
        let (rotated, passed) = if rotary_dim < head_dim {
            (
                x.index((.., .., .., ..rotary_dim)),
                Some(x.index((.., .., .., rotary_dim..))),
            )
        } else {
            (x.clone(), None)
        };
        let out = ops::add(
            ops::multiply(&rotated, &cos)?,
            ops::multiply(rotate_half(&rotated)?, &sin)?,
        )?;
        Ok(match passed {
            Some(passed) => ops::concatenate(&[out, passed], -1)?,
            None => out,
        })
    }
}

struct DecoderLayer {
    self_attn: Attention,
    mlp: FeedForward,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        prefix: &str,
        args: &TextConfig,
        index: usize,
    ) -> Result<Self> {
        let norm = |store: &mut WeightStore, name: &str| {
            RmsNorm::load(
                store,
                &format!("{prefix}.{name}"),
                args.hidden_size,
                args.rms_norm_eps,
            )
        };
        Ok(Self {
            self_attn: Attention::load(
                store,
                quant,
                &format!("{prefix}.self_attn"),
                AttentionShape {
                    hidden: args.hidden_size,
                    heads: args.num_attention_heads,
                    kv_heads: args.num_key_value_heads,
                    head_dim: args.head_dim,
                    eps: args.rms_norm_eps,
                },
            )?,
            // qwen3_vl_moe: routed experts where the config places them, the dense MLP elsewhere.
            mlp: match args.moe().filter(|moe| moe.is_sparse(index)) {
                Some(moe) => FeedForward::Experts(SparseMoeBlock::load(
                    store,
                    quant,
                    &format!("{prefix}.mlp"),
                    args.hidden_size,
                    &moe,
                )?),
                None => FeedForward::Dense(Mlp::load(
                    store,
                    quant,
                    &format!("{prefix}.mlp"),
                    args.hidden_size,
                    args.intermediate_size,
                )?),
            },
            input_layernorm: norm(store, "input_layernorm")?,
            post_attention_layernorm: norm(store, "post_attention_layernorm")?,
        })
    }

    fn forward(&self, x: &Array, rotary: &RotaryAngles, cache: &mut KvCache) -> Result<Array> {
        let h = ops::add(
            x,
            self.self_attn
                .forward(&self.input_layernorm.forward(x)?, cache, |x, _| {
                    rotary.apply(x)
                })?,
        )?;
        Ok(ops::add(
            &h,
            self.mlp
                .forward(&self.post_attention_layernorm.forward(&h)?)?,
        )?)
    }
}

/// Where deepstack features go: `gather[pos]` is 0 for text and 1 + the feature row for an
/// image token, into `[zeros; features]`, so one gather and add injects them on device.
pub(super) struct Deepstack<'a> {
    pub gather: &'a Array,
    pub features: &'a [Array],
}

pub struct LanguageModel {
    pub(super) args: TextConfig,
    pub(super) rope: Rope,
    pub(super) part: Part,
    /// Rank 0's (None on a pipeline's other ranks), as are `norm` and `lm_head`.
    embed_tokens: Option<Embedding>,
    /// None where another pipeline rank computes the layer.
    layers: Vec<Option<DecoderLayer>>,
    norm: Option<RmsNorm>,
    lm_head: Option<Linear>,
}

impl LanguageModel {
    pub fn load(
        store: &mut WeightStore,
        quant: Option<&QuantizationConfig>,
        config: &Config,
        rope: Rope,
        part: Part,
    ) -> Result<Self> {
        let args = config.text_config.clone();
        let tied = config.tied();
        if tied {
            store.discard_prefix("language_model.lm_head.");
        }
        let embed_tokens = load_embeddings(store, quant, &part, args.vocab_size, args.hidden_size)?;
        let layers = (0..args.num_hidden_layers as usize)
            .map(|i| {
                let prefix = format!("language_model.model.layers.{i}");
                part.layer(i, store, &prefix, |store| {
                    DecoderLayer::load(store, quant, &prefix, &args, i)
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = part.ends(|| {
            RmsNorm::load(
                store,
                "language_model.model.norm",
                args.hidden_size,
                args.rms_norm_eps,
            )
        })?;
        let lm_head = if tied || !part.has_ends() {
            None
        } else {
            Some(Linear::load(
                store,
                quant,
                "language_model.lm_head",
                args.hidden_size,
                args.vocab_size,
                false,
            )?)
        };
        Ok(Self {
            args,
            rope,
            part,
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The token embeddings (rank 0's).
    pub(super) fn embed(&self) -> Result<&Embedding> {
        held(&self.embed_tokens, "the embeddings")
    }

    /// Embeddings `[B, L, hidden]` at rotary positions `rows` through the decoder to logits;
    /// across ranks `riders` go on with the hidden state, `position` is the chunk's start and
    /// the other ranks return no logits.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_embeddings(
        &self,
        mut h: Array,
        rows: &ChunkRows,
        deepstack: Option<Deepstack>,
        riders: &[Array],
        start: &ChunkStart,
        caches: &mut [KvCache],
        logits: Logits,
    ) -> Result<Array> {
        let (batch, len) = batch_and_len(&h);
        let rotary = RotaryAngles::for_chunk(rows, caches, &self.rope, self.args.head_dim)?;
        let padded = match &deepstack {
            Some(ds) => {
                let zeros = ops::zeros_dtype(&[1, self.args.hidden_size], h.dtype())?;
                ds.features
                    .iter()
                    .map(|f| Ok(ops::concatenate(&[&zeros, &f.as_dtype(h.dtype())?], 0)?))
                    .collect::<Result<Vec<_>>>()?
            }
            None => Vec::new(),
        };
        for (index, (layer, cache)) in self.layers.iter().zip(caches.iter_mut()).enumerate() {
            let Some(layer) = layer else {
                // The plan keeps the deepstack layers on rank 0, which has the features.
                if padded.get(index).is_some() {
                    return Err(crate::error::EngineError::Distributed(format!(
                        "layer {index} adds image features but another rank holds it"
                    )));
                }
                cache.shadow_step(batch, len)?;
                continue;
            };
            h = layer.forward(&h, &rotary, cache)?;
            if let (Some(ds), Some(table)) = (&deepstack, padded.get(index)) {
                let rows = table.take_axis(ds.gather, 0)?.reshape(h.shape())?;
                h = ops::add(&h, &rows)?;
            }
        }
        let Some(mut h) = stage_output(&self.part, h, riders, logits, start)? else {
            return crate::distributed::pipeline::no_logits();
        };
        if logits != Logits::All && h.shape()[1] > 1 {
            let last = h.shape()[1] - 1;
            h = h.index((.., last..));
        }
        let h = held(&self.norm, "the final norm")?.forward(&h)?;
        match &self.lm_head {
            Some(head) => head.forward(&h),
            None => self.embed()?.as_linear(&h),
        }
    }
}

/// The text model's embeddings under `language_model.` (Qwen3-VL, Qwen3.5 / 3.6) where this
/// process holds a pipeline's ends; elsewhere they, the final norm and the output layer are
/// dropped unread.
pub(crate) fn load_embeddings(
    store: &mut WeightStore,
    quant: Option<&QuantizationConfig>,
    part: &Part,
    vocab: i32,
    hidden: i32,
) -> Result<Option<Embedding>> {
    part.drop_ends(
        store,
        &[
            "language_model.model.embed_tokens.",
            "language_model.model.norm.",
            "language_model.lm_head.",
        ],
    );
    part.ends(|| {
        Embedding::load(
            store,
            quant,
            "language_model.model.embed_tokens",
            vocab,
            hidden,
        )
    })
}
