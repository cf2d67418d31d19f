//! The masks of attention over a KV cache, and query-tiled attention for vision towers: a large image is thousands of patches attending
//! to each other in one bidirectional block, and one SDPA over all of them is one huge graph
//! (the seed's large-image crashes; the Metal watchdog kills command buffers past ~10 s).
//! Tiling the queries bounds each piece of work and its scores to `tile × seq`.
//! Reference: mlx-vlm's vision attention (one `scaled_dot_product_attention` call), which the
//! tiled form must equal.

use mlx_rs::{
    fast::{self, ScaledDotProductAttentionMask},
    ops,
    ops::indexing::IndexOp,
    Array, Dtype,
};

use crate::{
    cache::{Fetched, KvCache},
    error::Result,
};

/// The mask of one attention call.
pub(crate) enum Mask {
    None,
    Causal,
    Array(Array),
}

impl Mask {
    pub(crate) fn as_sdpa(&self) -> Option<ScaledDotProductAttentionMask<'_>> {
        match self {
            Mask::None => None,
            Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
            Mask::Array(mask) => Some(ScaledDotProductAttentionMask::Array(mask)),
        }
    }
}

/// `len` new queries against keys `start..cache.offset()` of an updated cache: causal for a
/// prompt chunk, none for one query, the padding mask for one query of a padded batch, and
/// each row's own causal mask for a speculative step of a padded or ragged batch.
pub(crate) fn cached_mask(cache: &KvCache, len: i32, start: i32) -> Result<Mask> {
    if len > 1 {
        if cache.is_padded() || cache.is_ragged() {
            return Ok(Mask::Array(cache.rows_mask(
                start,
                cache.offset(),
                len,
                None,
            )?));
        }
        return Ok(Mask::Causal);
    }
    Ok(match cache.padding_mask(start, cache.offset())? {
        Some(mask) => Mask::Array(mask),
        None => Mask::None,
    })
}

/// Appends this step's `keys` / `values` to `cache` and attends `queries` `[B, heads, L, dim]`
/// to everything it holds, under [`cached_mask`] (see [`attend_fetched`] for a quantized cache).
/// A short step (a speculative verify) on CUDA attends over the cache's whole buffer instead
/// (see [`reads_whole_buffer`]).
pub(crate) fn attend_update(
    queries: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    cache: &mut KvCache,
) -> Result<Array> {
    let whole = reads_whole_buffer(queries);
    attend_update_over(queries, keys, values, scale, cache, whole)
}

fn attend_update_over(
    queries: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    cache: &mut KvCache,
    whole_buffer: bool,
) -> Result<Array> {
    let len = queries.shape()[2];
    if !whole_buffer {
        let fetched = cache.update_and_fetch_stored(keys, values)?;
        let mask = cached_mask(cache, len, 0)?;
        return attend_fetched(queries, &fetched, scale, &mask);
    }
    let fetched = cache.update_and_fetch_buffer(keys, values)?;
    let (start, end, through) = (cache.base(), cache.offset(), cache.capacity());
    let mask = cache.rows_mask_through(start, end, through, len, None)?;
    attend_fetched(queries, &fetched, scale, &Mask::Array(mask))
}

/// The longest step [`reads_whole_buffer`] applies to: verify steps and short prompt tails
/// (a mask of `len` × buffer columns per row stays small).
const SHORT_STEP: i32 = 32;

/// Whether a step of 2..=[`SHORT_STEP`] queries attends over its cache's whole buffer, the
/// columns past the written ones masked, rather than over exactly the written ones. MLX 0.32.2's
/// CUDA backend (`supports_sdpa_cudnn`) runs attention of two or more fp16 / bf16 queries at
/// head_dim <= 128 through cuDNN, which builds a graph for each exact (query, key) shape: every
/// speculative step at a new cache length built one (verify steps of 69-72 ms against 9-23 ms
/// plain on the H100, session 23). Over the whole buffer the key length changes only when the
/// buffer grows ([`crate::cache::GROWTH_STEP`]). Elsewhere (Metal, the CPU, other head sizes)
/// kernels do not depend on lengths and the exact columns are read. `RMLX_ATTEND_WHOLE_BUFFER`
/// = 1 / 0 forces it on / off (A/B runs; tests on this CPU).
fn reads_whole_buffer(queries: &Array) -> bool {
    let shape = queries.shape();
    let (len, dim) = (shape[2], shape[3]);
    if !(2..=SHORT_STEP).contains(&len) {
        return false;
    }
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| {
        std::env::var("RMLX_ATTEND_WHOLE_BUFFER")
            .ok()
            .map(|value| value.trim() == "1")
    });
    forced.unwrap_or_else(|| {
        let half = matches!(queries.dtype(), Dtype::Float16 | Dtype::Bfloat16);
        half && dim <= 128 && dim % 8 == 0 && crate::runtime::on_cuda_gpu()
    })
}

/// Attention over keys and values as a cache stores them. Dense: the fused SDPA. Quantized:
/// one query reads them through quantized matmuls (its scores are one row per head); a prompt
/// chunk gets this layer's keys and values dequantized into the fused SDPA, one layer's dense
/// copy at a time, since the quantized form would materialise the chunk's whole score matrix
/// (mlx-lm's `quantized_scaled_dot_product_attention` does, and peaks above a bf16 cache).
pub(crate) fn attend_fetched(
    queries: &Array,
    fetched: &Fetched,
    scale: f32,
    mask: &Mask,
) -> Result<Array> {
    let (keys, values, bits, group_size) = match fetched {
        Fetched::Dense { keys, values } => {
            if let Some(visible) = grouped_one_query_mask(queries, mask) {
                return grouped_one_query(queries, keys, values, scale, visible);
            }
            return Ok(fast::scaled_dot_product_attention(
                queries,
                keys,
                values,
                scale,
                mask.as_sdpa(),
                None,
            )?);
        }
        Fetched::Quantized {
            keys,
            values,
            bits,
            group_size,
        } => (keys, values, *bits, *group_size),
    };
    // MLX 0.32.2's CUDA backend has no quantized_matmul for these shapes (it refuses
    // 1x32769x512x32 at Gemma 4 31B's full layers): there the one query dequantizes too.
    if queries.shape()[2] > 1 || crate::runtime::on_cuda_gpu() {
        let dense = |[packed, scales, biases]: &[Array; 3]| {
            ops::dequantize(packed, scales, biases, group_size, bits)
        };
        if let Some(visible) = grouped_one_query_mask(queries, mask) {
            return grouped_one_query(queries, &dense(keys)?, &dense(values)?, scale, visible);
        }
        return Ok(fast::scaled_dot_product_attention(
            queries,
            dense(keys)?,
            dense(values)?,
            scale,
            mask.as_sdpa(),
            None,
        )?);
    }
    quantized_attention(queries, keys, values, scale, mask, (bits, group_size))
}

/// The mask of a one-query step that [`grouped_one_query`] computes instead of MLX's SDPA: on
/// MLX's CUDA backend, unless `RMLX_GROUPED_ONE_QUERY=0` (`=1` turns it on elsewhere). MLX
/// 0.32's CUDA backend has no fused kernel for one query under a mask array (a padded or ragged
/// batch's decode step: its vector kernel refuses array masks and cuDNN takes one query only
/// unmasked), so SDPA runs its unfused fallback, whose matmuls broadcast the keys and values
/// over each KV head's query heads. On an H100 the grouped form took a 4-row bf16 step of the
/// Qwen3-4B shape from 10.6-11.4 ms to 7.2-10.8 ms (docs/PERFORMANCE.md, session 28). Metal's
/// vector kernel takes masks, and on the CPU both cost the same: there SDPA stays.
fn grouped_one_query_mask<'m>(queries: &Array, mask: &'m Mask) -> Option<&'m Array> {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| {
        let switch = std::env::var("RMLX_GROUPED_ONE_QUERY").ok();
        grouped_one_query_wanted(switch.as_deref(), crate::runtime::on_cuda_gpu())
    });
    match mask {
        Mask::Array(visible) if on && queries.shape()[2] == 1 => Some(visible),
        _ => None,
    }
}

/// `RMLX_GROUPED_ONE_QUERY` as set (`1` on, `0` off), else on where MLX runs on CUDA.
fn grouped_one_query_wanted(switch: Option<&str>, cuda: bool) -> bool {
    match switch.map(str::trim) {
        Some("1") => true,
        Some("0") => false,
        _ => cuda,
    }
}

/// One query per row attending under a mask `[B, 1, 1, L]`: each KV head's query heads are
/// the rows of one matmul against its keys (`[B, KV heads, repeats, D] @ [B, KV heads, D, L]`),
/// so no operand is broadcast; then the masked softmax (in f32) and one matmul with the values.
fn grouped_one_query(
    queries: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    visible: &Array,
) -> Result<Array> {
    let shape = queries.shape();
    let (batch, heads, dim) = (shape[0], shape[1], shape[3]);
    let kv_heads = keys.shape()[1];
    let repeats = heads / kv_heads.max(1);
    let queries = ops::multiply(queries, crate::nn::scalar(scale as f64, queries)?)?
        .reshape(&[batch, kv_heads, repeats, dim])?;
    let scores = ops::matmul(&queries, keys.swap_axes(-1, -2)?)?;
    let hidden = crate::nn::scalar(f64::NEG_INFINITY, &scores)?;
    let scores = ops::select(visible, &scores, &hidden)?;
    let weights = ops::softmax_axis(&scores, -1, true)?;
    let out = ops::matmul(&weights, values)?;
    Ok(out.reshape(&[batch, heads, 1, -1])?)
}

/// `softmax(q kᵀ · scale) v` with `k`, `v` quantized (mlx-lm `base.py`
/// `quantized_scaled_dot_product_attention`): query heads grouped over their KV head.
fn quantized_attention(
    queries: &Array,
    keys: &[Array; 3],
    values: &[Array; 3],
    scale: f32,
    mask: &Mask,
    (bits, group_size): (i32, i32),
) -> Result<Array> {
    let shape = queries.shape().to_vec();
    let (batch, heads, len, dim) = (shape[0], shape[1], shape[2], shape[3]);
    let kv_heads = keys[0].shape()[1];
    let repeats = heads / kv_heads.max(1);
    let mut queries = ops::multiply(queries, crate::nn::scalar(scale as f64, queries)?)?;
    let grouped = |part: &Array| -> Result<Array> {
        Ok(match repeats > 1 {
            true => ops::expand_dims(part, 2)?,
            false => part.clone(),
        })
    };
    if repeats > 1 {
        queries = queries.reshape(&[batch, kv_heads, repeats, len, dim])?;
    }
    let [kw, ks, kb] = [grouped(&keys[0])?, grouped(&keys[1])?, grouped(&keys[2])?];
    let [vw, vs, vb] = [
        grouped(&values[0])?,
        grouped(&values[1])?,
        grouped(&values[2])?,
    ];
    let mut scores = ops::quantized_matmul(&queries, &kw, &ks, &kb, true, group_size, bits)?;
    if let Mask::Array(visible) = mask {
        let visible = match repeats > 1 {
            true => ops::expand_dims(visible, 2)?,
            false => visible.clone(),
        };
        let hidden = crate::nn::scalar(f64::NEG_INFINITY, &scores)?;
        scores = ops::select(&visible, &scores, &hidden)?;
    }
    let weights = ops::softmax_axis(&scores, -1, true)?;
    let out = ops::quantized_matmul(&weights, &vw, &vs, &vb, false, group_size, bits)?;
    Ok(out.reshape(&[batch, heads, len, -1])?)
}

/// When and how to tile: tiling starts above `threshold` query positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileConfig {
    pub tile: i32,
    pub threshold: i32,
    /// Evaluate each tile before building the next, so no single graph holds them all.
    pub eval_each_tile: bool,
}

impl Default for TileConfig {
    fn default() -> Self {
        Self {
            tile: 1024,
            threshold: 4096,
            eval_each_tile: true,
        }
    }
}

/// Bidirectional attention `softmax(q kᵀ · scale) v` over `[B, heads, L, D]` arrays, split
/// along the query axis when `L` passes the threshold. Keys and values are never split: every
/// query still sees every patch, so the result equals the untiled call.
pub fn vision_attention(
    queries: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    config: TileConfig,
) -> Result<Array> {
    let len = queries.shape()[2];
    if len <= config.threshold || config.tile <= 0 {
        return Ok(fast::scaled_dot_product_attention(
            queries, keys, values, scale, None, None,
        )?);
    }
    let mut tiles = Vec::new();
    let mut start = 0;
    while start < len {
        let end = (start + config.tile).min(len);
        let tile = queries.index((.., .., start..end, ..));
        let out = fast::scaled_dot_product_attention(&tile, keys, values, scale, None, None)?;
        if config.eval_each_tile {
            crate::runtime::eval([&out])?;
        }
        tiles.push(out);
        start = end;
    }
    Ok(ops::concatenate(&tiles, 2)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::random;

    fn max_diff(a: &Array, b: &Array) -> f32 {
        ops::abs(ops::subtract(a, b).unwrap())
            .unwrap()
            .max(None)
            .unwrap()
            .item_exact::<f32>()
    }

    fn randn(shape: &[i32], seed: u64) -> Array {
        let key = random::key(seed).unwrap();
        random::normal::<f32>(shape, None, None, &key).unwrap()
    }

    #[test]
    fn tiled_equals_one_sdpa_for_any_length() {
        for (len, tile) in [(96, 32), (100, 32), (257, 64), (33, 64)] {
            let q = randn(&[1, 4, len, 16], 1);
            let k = randn(&[1, 4, len, 16], 2);
            let v = randn(&[1, 4, len, 16], 3);
            let scale = 0.25;
            let whole = fast::scaled_dot_product_attention(&q, &k, &v, scale, None, None).unwrap();
            let config = TileConfig {
                tile,
                threshold: 0,
                eval_each_tile: len % 2 == 0,
            };
            let tiled = vision_attention(&q, &k, &v, scale, config).unwrap();
            assert_eq!(tiled.shape(), whole.shape());
            let diff = max_diff(&tiled, &whole);
            assert!(diff < 1e-5, "len {len}, tile {tile}: {diff}");
        }
    }

    /// A short step over the whole buffer (what CUDA runs, see [`reads_whole_buffer`]) equals
    /// the same step over exactly the written columns: alone, after a rolled-back step left
    /// stale columns past the end, in a left-padded batch and in a ragged one, and over an
    /// 8-bit cache (dequantized whole, its unwritten columns included).
    #[test]
    fn a_short_step_over_the_whole_buffer_equals_the_written_columns() {
        let (heads, kv_heads) = (4, 2);
        // Heads of 32 and more are quantized (narrower ones stay dense).
        let dim = |cache: &KvCache| match cache.storage() {
            crate::cache::KvStorage::Dense => 16,
            crate::cache::KvStorage::Quantized { .. } => 64,
        };
        let step = |cache: &mut KvCache, len: i32, seed: u64, whole: bool| {
            let rows = cache.batch_size().max(1) as i32;
            let dim = dim(cache);
            let q = randn(&[rows, heads, len, dim], seed);
            let k = randn(&[rows, kv_heads, len, dim], seed + 1);
            let v = randn(&[rows, kv_heads, len, dim], seed + 2);
            attend_update_over(&q, &k, &v, 0.25, cache, whole).unwrap()
        };
        let compare = |cache: &KvCache, len: i32, seed: u64, what: &str| {
            let (mut exact, mut whole) = (cache.clone(), cache.clone());
            let want = step(&mut exact, len, seed, false);
            let got = step(&mut whole, len, seed, true);
            assert_eq!(got.shape(), want.shape(), "{what}");
            let diff = max_diff(&got, &want);
            assert!(diff < 1e-5, "{what}: {diff}");
            // The buffer read is longer than what was written: the masked columns mattered.
            assert!(whole.capacity() > whole.offset(), "{what}");
        };
        let mut alone = KvCache::new(4096);
        step(&mut alone, 300, 10, false);
        compare(&alone, 3, 20, "alone");
        step(&mut alone, 4, 30, false);
        alone.truncate(301); // a rejected draft's columns stay in the buffer
        compare(&alone, 2, 40, "after a rollback");

        let mut batch = KvCache::new(4096);
        step(&mut batch, 40, 50, false);
        let mut longer = KvCache::new(4096);
        step(&mut longer, 70, 60, false);
        batch.join(&longer).unwrap();
        assert!(batch.is_padded());
        compare(&batch, 3, 70, "padded batch");
        step(&mut batch, 3, 80, false);
        batch.keep_written(3, &[1, 3]).unwrap();
        assert!(batch.is_ragged());
        compare(&batch, 4, 90, "ragged batch");

        let mut eight_bit = KvCache::new(4096);
        eight_bit.set_storage(crate::cache::KvStorage::quantized(8).unwrap());
        step(&mut eight_bit, 100, 100, false);
        assert!(matches!(
            eight_bit.storage(),
            crate::cache::KvStorage::Quantized { bits: 8, .. }
        ));
        compare(&eight_bit, 3, 110, "8-bit cache");
    }

    /// The grouped one-query form equals MLX's SDPA under the same mask: GQA repeats of 1, 2
    /// and 4, a left-padded batch's mask and a ragged one's (fp32).
    #[test]
    fn one_query_grouped_over_kv_heads_equals_sdpa() {
        let rows = 3;
        for (heads, kv_heads) in [(4, 4), (4, 2), (8, 2)] {
            let q = randn(&[rows, heads, 1, 16], 1);
            let k = randn(&[rows, kv_heads, 37, 16], 2);
            let v = randn(&[rows, kv_heads, 37, 16], 3);
            // Row 1 left-padded by 5 columns, row 2 ending 4 columns early (ragged).
            let cols = ops::arange::<_, i32>(0, 37, None)
                .unwrap()
                .reshape(&[1, 1, 1, 37])
                .unwrap();
            let first = Array::from_slice(&[0, 5, 0], &[rows, 1, 1, 1]);
            let end = Array::from_slice(&[37, 37, 33], &[rows, 1, 1, 1]);
            let visible = ops::logical_and(
                ops::ge(&cols, &first).unwrap(),
                ops::lt(&cols, &end).unwrap(),
            )
            .unwrap();
            let want = fast::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                0.25,
                Some(ScaledDotProductAttentionMask::Array(&visible)),
                None,
            )
            .unwrap();
            let got = grouped_one_query(&q, &k, &v, 0.25, &visible).unwrap();
            assert_eq!(got.shape(), want.shape());
            let diff = max_diff(&got, &want);
            assert!(diff < 1e-5, "{heads} heads over {kv_heads}: {diff}");
        }
    }

    /// On by default only on CUDA (where it was measured faster); the switch overrides.
    #[test]
    fn grouped_one_query_is_cudas_default_and_the_switch_overrides_it() {
        for cuda in [false, true] {
            assert_eq!(grouped_one_query_wanted(None, cuda), cuda);
            assert_eq!(grouped_one_query_wanted(Some(""), cuda), cuda);
            assert!(grouped_one_query_wanted(Some(" 1"), cuda));
            assert!(!grouped_one_query_wanted(Some("0"), cuda));
        }
        // This CPU build computes with SDPA unless asked.
        assert!(!crate::runtime::on_cuda_gpu());
    }

    #[test]
    fn below_the_threshold_nothing_is_split() {
        let q = randn(&[1, 2, 10, 8], 4);
        let config = TileConfig {
            tile: 3,
            threshold: 10,
            eval_each_tile: false,
        };
        let out = vision_attention(&q, &q, &q, 0.3, config).unwrap();
        let whole = fast::scaled_dot_product_attention(&q, &q, &q, 0.3, None, None).unwrap();
        let equal = ops::array_eq(&out, &whole, None)
            .unwrap()
            .item_exact::<bool>();
        assert!(equal);
    }
}
