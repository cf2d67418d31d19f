//! Per-layer KV cache that grows in steps of 256 positions (as mlx-lm's `KVCache`) but never past
//! the request's effective context, so memory follows the prompt, not a fixed constant.
//! Linear-attention layers (Qwen3.5's Gated DeltaNet) keep a fixed-size recurrent state in the
//! same slot instead: it cannot be rewound, only replaced by a snapshot taken at a given length.
//! Several requests decoding together share one cache per layer (`join`, `retain_rows`,
//! `row`): rows are left-padded so every row's next token lands in the same column, and the
//! padding is masked out of attention.
//! A sliding-window layer's cache (`windowed`) keeps only the positions its next queries can
//! see: before growing it drops the columns older than the window (plus a little slack for a
//! speculative rollback), so its memory is bounded by the window and a prefill chunk, not the
//! context. Positions stay absolute (`offset`, paddings); the arrays start at `base`.
//! A speculative step writes several tokens per row and then keeps a prefix of them per row
//! (`keep_written`): KV caches cut back by offset, windows within their slack, and a linear-
//! attention layer replays the kept steps' recurrence from the inputs it stashed during the
//! step (`stash_steps`). Rows that keep different counts end at different columns (`lags`):
//! each row then writes its next tokens at its own end (one scatter) and attention masks each
//! row past its own end, so no row's history is ever copied to realign it.
//! A quantized cache (`--kv-bits 8|4`) stores keys and values as MLX affine-quantized triples
//! (packed words, scales, biases; groups along the head dim) and attention reads them through
//! quantized matmuls (`attention::attend_update`); every column operation applies to each part.
//! Reference: mlx-lm `models/cache.py` (`KVCache.update_and_fetch`, `RotatingKVCache`,
//! `ArraysCache`, `BatchKVCache`: `extend`, `filter`, `extract`).

use mlx_rs::{ops, ops::indexing::IndexOp, Array, Stream};

use crate::{
    cache_mirror::MirrorId,
    error::{EngineError, Result},
};

/// Positions added per growth step (mlx-lm uses the same).
pub const GROWTH_STEP: i32 = 256;

/// Positions a windowed cache keeps beyond what its next query sees, so a rejected draft of up
/// to this many tokens can be cut back without a snapshot.
pub const WINDOW_SLACK: i32 = 32;

/// `(position, delta)` pairs: from `position` on, rotary positions were cache positions plus
/// `delta` (see `KvCache::rope_history`).
type RopeHistory = Vec<(i32, i32)>;

/// How a cache stores keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvStorage {
    /// As computed (the activations' dtype).
    #[default]
    Dense,
    /// MLX affine quantization along the head dim: `bits` per value, groups of `group_size`.
    Quantized { bits: i32, group_size: i32 },
}

impl KvStorage {
    /// `--kv-bits`: 8 or 4 bits, in groups of 64 or of the head size where that is smaller
    /// (chosen at the first write; MLX groups are 32, 64 or 128 wide).
    pub fn quantized(bits: i32) -> Result<Self> {
        if bits != 8 && bits != 4 {
            return Err(EngineError::InvalidRequest(format!(
                "KV bits must be 8 or 4, not {bits}"
            )));
        }
        Ok(Self::Quantized {
            bits,
            group_size: 0,
        })
    }

    /// The group for heads of `dim` (keys and values alike); None where MLX cannot group
    /// them (heads under 32 wide: only tiny test checkpoints have them).
    fn group_for(dim: i32) -> Option<i32> {
        let group_size = 64.min(dim);
        (group_size >= 32 && dim % group_size == 0).then_some(group_size)
    }
}

/// What attention reads after an update: the keys and values as stored.
#[derive(Clone)]
pub enum Fetched {
    Dense {
        keys: Array,
        values: Array,
    },
    /// `[packed, scales, biases]` each, `[B, heads, positions, ..]`.
    Quantized {
        keys: [Array; 3],
        values: [Array; 3],
        bits: i32,
        group_size: i32,
    },
}

impl Fetched {
    /// The columns from `start` on (what a sliding layer's queries see of them).
    pub fn columns_from(self, start: i32) -> Fetched {
        let cut = |array: Array| array.index((.., .., start.., ..));
        match self {
            Fetched::Dense { keys, values } => Fetched::Dense {
                keys: cut(keys),
                values: cut(values),
            },
            Fetched::Quantized {
                keys,
                values,
                bits,
                group_size,
            } => Fetched::Quantized {
                keys: keys.map(cut),
                values: values.map(cut),
                bits,
                group_size,
            },
        }
    }
}

/// Clones share the arrays; MLX copies on the next write to a shared buffer, so a clone taken
/// from the prefix cache never changes the stored entry.
#[derive(Clone)]
pub struct KvCache {
    /// The stored columns: `[keys, values]`, or the keys' and the values' quantized triples;
    /// empty before the first token.
    parts: Vec<Array>,
    storage: KvStorage,
    offset: i32,
    max_ctx: i32,
    /// MRoPE models (Qwen3-VL): rotary position minus cache position for tokens after an
    /// image prompt (image blocks use fewer positions than tokens). 0 for text models.
    rope_delta: i32,
    /// `(position, delta)`: from `position` on the delta was `delta` (one entry per image chunk,
    /// whose piece of prefill ends at its block's end), so a cut back to a shorter prefix
    /// restores the delta of the position it keeps.
    rope_history: RopeHistory,
    /// A linear-attention layer's state after `offset` tokens (None for attention layers).
    recurrent: Option<RecurrentState>,
    /// None for one request's cache; Some when this cache holds a batch's rows.
    rows: Option<Rows>,
    /// A sliding-window layer's window: a query at position p sees keys p - window + 1 ..= p.
    window: Option<i32>,
    /// Set for the forward of a speculative step: a linear-attention layer then stashes its
    /// step's inputs here, so `keep_written` can rewind its state to any prefix of the step.
    speculating: bool,
    stashed: Option<StepInputs>,
    /// First position the arrays hold (column 0); positions before it were dropped (windowed
    /// caches only).
    base: i32,
    /// Rank 0 of a pipeline: this cache's id in the log the other ranks follow
    /// (`cache_mirror`); unset in one process.
    mirror: MirrorId,
}

/// The rows of a batched cache. Row `b` holds its tokens in columns
/// `left_padding[b]..offset - lags[b]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Rows {
    left_padding: Vec<i32>,
    /// Columns between each row's end and `offset` (the furthest row's end): a row that kept
    /// fewer tokens of a speculative step than another ends earlier. All 0 otherwise.
    lags: Vec<i32>,
    /// Each row's `rope_delta`.
    rope_deltas: Vec<i32>,
    /// Each row's `rope_history`.
    rope_histories: Vec<RopeHistory>,
}

/// Where rotary positions start: one number for a single sequence (or rows that agree), one
/// per row for a padded batch.
pub enum RopeOffset {
    At(i32),
    PerRow(Array),
}

/// What a Gated DeltaNet layer carries between tokens: the last `kernel - 1` inputs of its
/// causal conv (activation dtype) and the delta-rule state `[B, Hv, Dv, Dk]` (float32).
#[derive(Clone)]
pub struct RecurrentState {
    pub conv: Array,
    pub state: Array,
}

/// What a linear-attention layer keeps of a speculative step of `T` tokens: its state before
/// the step, the conv's input window `[B, kernel - 1 + T, C]`, and either the state after each
/// token (`states`: rewinding to `kept[b]` tokens picks row b's) or, where the step's form gives
/// only the last (a Mac's GPU kernel), the recurrence's per-token inputs: rewinding then replays
/// only the recurrence (`replay`, given those inputs, the state before, how many steps some row
/// keeps and, where rows differ, a mask of each row's), never the model.
#[derive(Clone)]
pub struct StepInputs {
    pub before: Array,
    pub conv_input: Array,
    pub states: Option<Vec<Array>>,
    pub inputs: Vec<Array>,
    pub replay: fn(&[Array], &Array, i32, Option<&Array>) -> Result<Array>,
}

impl KvCache {
    pub fn new(max_ctx: usize) -> Self {
        Self::with_window(max_ctx, None)
    }

    fn with_window(max_ctx: usize, window: Option<i32>) -> Self {
        let max_ctx = max_ctx.min(i32::MAX as usize) as i32;
        Self {
            mirror: MirrorId::new(max_ctx, window),
            ..Self::unmirrored(max_ctx, window)
        }
    }

    /// A cache no log knows (made only to be given an id of its own, as `row` does).
    fn unmirrored(max_ctx: i32, window: Option<i32>) -> Self {
        Self {
            mirror: MirrorId::default(),
            window,
            parts: Vec::new(),
            storage: KvStorage::Dense,
            offset: 0,
            max_ctx,
            rope_delta: 0,
            rope_history: Vec::new(),
            recurrent: None,
            rows: None,
            base: 0,
            speculating: false,
            stashed: None,
        }
    }

    /// A sliding-window layer's cache: it holds the last `window - 1 + WINDOW_SLACK` positions
    /// (plus the chunk being prefilled and one growth step), whatever the context.
    pub fn windowed(max_ctx: usize, window: usize) -> Self {
        Self::with_window(max_ctx, Some(window.clamp(1, i32::MAX as usize) as i32))
    }

    /// This cache's id in rank 0's log (`cache_mirror`), if it is logged.
    pub fn mirror_id(&self) -> Option<i32> {
        self.mirror.id()
    }

    /// Stores keys and values as `storage` from now on. Only before the first token: stored
    /// columns are not converted.
    pub fn set_storage(&mut self, storage: KvStorage) {
        if self.parts.is_empty() {
            self.storage = storage;
            self.mirror.storage(storage);
        }
    }

    pub fn storage(&self) -> KvStorage {
        self.storage
    }

    /// Copies of the stored parts' columns for positions `start..end` (the disk cache's
    /// blocks); None where this cache cannot give them: a recurrent state, a batch, positions a
    /// window dropped or not yet written.
    pub fn export_columns(&self, start: i32, end: i32) -> Result<Option<Vec<Array>>> {
        if self.recurrent.is_some() || self.rows.is_some() || start < self.base || end > self.offset
        {
            return Ok(None);
        }
        let (from, to) = (start - self.base, end - self.base);
        let parts = self
            .parts
            .iter()
            .map(|part| contiguous(&part.index((.., .., from..to, ..))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(parts))
    }

    /// Positions a window keeps before the next token (None: not windowed); a snapshot of a
    /// windowed cache needs only these.
    pub fn window_keep(&self) -> Option<i32> {
        self.keep()
    }

    /// `(position, delta)` entries of the rotary offset (see the field); the disk cache stores
    /// them with a prefix.
    pub fn rope_history(&self) -> &[(i32, i32)] {
        &self.rope_history
    }

    /// Makes this fresh cache hold a prefix read back from the disk: `parts` (as
    /// [`Self::export_columns`] gave them, concatenated) hold positions `base..offset` in
    /// `storage`, or `recurrent` is a linear-attention layer's state after `offset` tokens.
    /// Anything that does not fit this cache (a window where none is, parts of another length
    /// or count) is an error, which the caller treats as a miss.
    pub fn restore(
        &mut self,
        storage: KvStorage,
        parts: Vec<Array>,
        base: i32,
        offset: i32,
        recurrent: Option<RecurrentState>,
        rope_history: &[(i32, i32)],
    ) -> Result<()> {
        let wrong = |what: &str| {
            EngineError::InvalidRequest(format!("a disk-cache prefix does not fit: {what}"))
        };
        if !self.parts.is_empty() || self.recurrent.is_some() || self.rows.is_some() {
            return Err(wrong("the cache is not fresh"));
        }
        if self.mirror.id().is_some() {
            return Err(wrong(
                "prefixes are not read back from the disk across ranks",
            ));
        }
        if offset > self.max_ctx || base < 0 || base > offset {
            return Err(wrong("positions"));
        }
        if base > 0 && self.window.is_none() {
            return Err(wrong("a window on a full-length layer"));
        }
        let count = match storage {
            KvStorage::Dense => 2,
            KvStorage::Quantized { .. } => 6,
        };
        let held = offset - base;
        match (&recurrent, parts.len()) {
            (Some(_), 0) => {}
            (None, n) if n == count => {
                if parts
                    .iter()
                    .any(|part| part.ndim() != 4 || part.shape()[0] != 1 || part.shape()[2] != held)
                {
                    return Err(wrong("the stored columns' shapes"));
                }
            }
            _ => return Err(wrong("the stored parts")),
        }
        self.storage = storage;
        self.parts = parts;
        self.base = base;
        self.offset = offset;
        self.recurrent = recurrent;
        self.rope_history = rope_history
            .iter()
            .copied()
            .filter(|&(at, _)| at <= offset)
            .collect();
        self.rope_delta = self.rope_history.last().map_or(0, |&(_, delta)| delta);
        Ok(())
    }

    /// Whether this is a sliding-window layer's cache.
    pub fn is_windowed(&self) -> bool {
        self.window.is_some()
    }

    /// First position the arrays returned by `update_and_fetch` hold (0 unless a windowed
    /// cache dropped older ones).
    pub fn base(&self) -> i32 {
        self.base
    }

    /// Positions before the next token a windowed cache must keep.
    fn keep(&self) -> Option<i32> {
        self.window.map(|window| window - 1 + WINDOW_SLACK)
    }

    /// Rows this cache holds (1 for a single request's cache).
    pub fn batch_size(&self) -> usize {
        self.rows.as_ref().map_or(1, |rows| rows.left_padding.len())
    }

    /// Whether this cache has held a batch's rows (joined, even if one row is left).
    pub fn is_batched(&self) -> bool {
        self.rows.is_some()
    }

    /// Whether some row starts after column 0, so attention must mask the columns before it.
    pub fn is_padded(&self) -> bool {
        self.rows
            .as_ref()
            .is_some_and(|rows| rows.left_padding.iter().any(|&pad| pad > 0))
    }

    /// Whether some row ends before `offset` (it kept fewer tokens of a speculative step).
    pub fn is_ragged(&self) -> bool {
        self.rows
            .as_ref()
            .is_some_and(|rows| rows.lags.iter().any(|&lag| lag > 0))
    }

    /// Tokens each row holds: the next token's position in that row.
    pub fn row_offsets(&self) -> Vec<i32> {
        match &self.rows {
            Some(rows) => rows
                .left_padding
                .iter()
                .zip(&rows.lags)
                .map(|(pad, lag)| self.offset - lag - pad)
                .collect(),
            None => vec![self.offset],
        }
    }

    /// The column after the last token of the row that ends first (`offset` unless ragged).
    pub fn shortest_end(&self) -> i32 {
        self.row_ends().into_iter().min().unwrap_or(self.offset)
    }

    /// The column after each row's last token (`offset` for every row unless ragged).
    fn row_ends(&self) -> Vec<i32> {
        match &self.rows {
            Some(rows) => rows.lags.iter().map(|lag| self.offset - lag).collect(),
            None => vec![self.offset],
        }
    }

    /// Each row's next MRoPE position: its offset plus its rope delta.
    pub fn row_rope_bases(&self) -> Vec<i32> {
        match &self.rows {
            Some(rows) => self
                .row_offsets()
                .iter()
                .zip(&rows.rope_deltas)
                .map(|(offset, delta)| offset + delta)
                .collect(),
            None => vec![self.offset + self.rope_delta],
        }
    }

    /// Each row's rope delta (see [`Self::rope_delta`]).
    pub fn row_rope_deltas(&self) -> Vec<i32> {
        match &self.rows {
            Some(rows) => rows.rope_deltas.clone(),
            None => vec![self.rope_delta],
        }
    }

    /// Sets each row's rope delta after a batch chunk with images (one per row, recorded in
    /// each row's history at its own offset). One process only: a pipeline's mirror logs
    /// single-sequence deltas, and it takes image prompts one at a time.
    pub fn set_row_rope_deltas(&mut self, deltas: &[i32]) {
        let offsets = self.row_offsets();
        match &mut self.rows {
            Some(rows) => {
                for (b, &delta) in deltas.iter().enumerate().take(rows.rope_deltas.len()) {
                    rows.rope_deltas[b] = delta;
                    rows.rope_histories[b].push((offsets[b], delta));
                }
                // One row left: its own fields agree with it (as `keep_rows` leaves them).
                if let ([delta], [history]) = (&rows.rope_deltas[..], &rows.rope_histories[..]) {
                    self.rope_delta = *delta;
                    self.rope_history = history.clone();
                }
            }
            None => {
                if let Some(&delta) = deltas.first() {
                    self.set_rope_delta(delta);
                }
            }
        }
    }

    /// The `offset` of `fast::rope` for the next tokens.
    pub fn rope_offset(&self) -> RopeOffset {
        if !self.is_padded() && !self.is_ragged() {
            return RopeOffset::At(self.offset);
        }
        let offsets = self.row_offsets();
        RopeOffset::PerRow(STEP_ARRAYS.with(|memo| {
            let mut memo = memo.borrow_mut();
            match &memo.offsets {
                Some((key, array)) if *key == offsets => array.clone(),
                _ => {
                    let array = Array::from_slice(&offsets, &[offsets.len() as i32]);
                    memo.offsets = Some((offsets, array.clone()));
                    array
                }
            }
        }))
    }

    /// Which of key columns `start..end` each row's one new query may attend to (the cache
    /// already holds it: `end` is the offset), `[B, 1, 1, end - start]`; None when every
    /// column holds a token of every row.
    pub fn padding_mask(&self, start: i32, end: i32) -> Result<Option<Array>> {
        if !self.is_padded() && !self.is_ragged() {
            return Ok(None);
        }
        self.rows_mask(start, end, 1, None).map(Some)
    }

    /// Which of key columns `start..end` the `len` newest queries of each row see once the
    /// cache holds them (`end`: the offset after they are written), `[B, 1, len, end - start]`:
    /// a row's query at its column q sees its own columns from its first token through q, and
    /// with a `window` only the last `window` of them. Built on device from paddings and ends.
    pub fn rows_mask(&self, start: i32, end: i32, len: i32, window: Option<i32>) -> Result<Array> {
        self.rows_mask_through(start, end, end, len, window)
    }

    /// [`Self::rows_mask`] over columns `start..through` (`through` >= `end`): the columns at
    /// and past `end` are no query's.
    pub fn rows_mask_through(
        &self,
        start: i32,
        end: i32,
        through: i32,
        len: i32,
        window: Option<i32>,
    ) -> Result<Array> {
        let (pads, lags) = match &self.rows {
            Some(rows) => (rows.left_padding.clone(), rows.lags.clone()),
            None => (vec![0], vec![0]),
        };
        let key: RowsMaskKey = (pads.clone(), lags.clone(), start, end, through, len, window);
        if let Some(mask) = STEP_ARRAYS.with(|memo| {
            memo.borrow()
                .rows_masks
                .iter()
                .find(|(held, _)| *held == key)
                .map(|(_, mask)| mask.clone())
        }) {
            return Ok(mask);
        }
        let batch = pads.len() as i32;
        let keys = through - start;
        // Row b's query t sits at column end - lag_b - len + t.
        let firsts: Vec<i32> = lags.iter().map(|lag| end - lag - len).collect();
        let firsts = Array::from_slice(&firsts, &[batch, 1, 1, 1]);
        let steps = ops::arange::<_, i32>(0, len, None)?.reshape(&[1, 1, len, 1])?;
        let queries = ops::add(&firsts, &steps)?;
        let columns = ops::arange::<_, i32>(start, through, None)?.reshape(&[1, 1, 1, keys])?;
        let pads = Array::from_slice(&pads, &[batch, 1, 1, 1]);
        let mut visible =
            ops::logical_and(ops::ge(&columns, &pads)?, ops::le(&columns, &queries)?)?;
        if let Some(window) = window {
            let near = ops::lt(&ops::subtract(&queries, &columns)?, Array::from_int(window))?;
            visible = ops::logical_and(&visible, &near)?;
        }
        STEP_ARRAYS.with(|memo| {
            let masks = &mut memo.borrow_mut().rows_masks;
            if masks.len() == 4 {
                masks.remove(0);
            }
            masks.push((key, visible.clone()));
        });
        Ok(visible)
    }

    /// Appends the rows of `other` (one request's cache, or another batch) after this cache's.
    /// The side holding fewer positions is left-padded, so both end at the same column; a row
    /// with nothing cached yet gets zeros (masked keys, a fresh recurrent state).
    pub fn join(&mut self, other: &KvCache) -> Result<()> {
        self.join_rows(other)?;
        self.mirror.join(&other.mirror);
        Ok(())
    }

    fn join_rows(&mut self, other: &KvCache) -> Result<()> {
        let (mine, theirs) = (self.batch_size() as i32, other.batch_size() as i32);
        let end = self.offset.max(other.offset);
        let (pad_mine, pad_theirs) = (end - self.offset, end - other.offset);
        // The joined arrays start where both sides still hold data (or padding): a side that
        // dropped old positions cannot give them back, and no query sees them any more.
        let start = |cache: &KvCache, pad: i32| if cache.base > 0 { cache.base + pad } else { 0 };
        let base = start(self, pad_mine).max(start(other, pad_theirs));
        if !self.parts.is_empty() || !other.parts.is_empty() {
            if !self.parts.is_empty() && !other.parts.is_empty() && self.storage != other.storage {
                return Err(EngineError::InvalidRequest(
                    "caches stored differently cannot decode together".into(),
                ));
            }
            let count = self.parts.len().max(other.parts.len());
            let mut parts = Vec::with_capacity(count);
            for index in 0..count {
                let (mine_kv, theirs_kv) = (self.parts.get(index), other.parts.get(index));
                let like = mine_kv.or(theirs_kv).expect("one side holds keys");
                parts.push(ops::concatenate(
                    &[
                        aligned(
                            mine_kv,
                            like,
                            mine,
                            (self.base, self.offset),
                            pad_mine,
                            base,
                        )?,
                        aligned(
                            theirs_kv,
                            like,
                            theirs,
                            (other.base, other.offset),
                            pad_theirs,
                            base,
                        )?,
                    ],
                    0,
                )?);
            }
            if self.parts.is_empty() {
                self.storage = other.storage;
            }
            self.parts = parts;
        }
        self.base = base;
        if let Some(like) = self.recurrent.as_ref().or(other.recurrent.as_ref()) {
            // A row with nothing prefilled yet starts from the zero state, as a new cache does.
            let stack = |mine_state: Option<&Array>, theirs_state: Option<&Array>, like: &Array| {
                let fresh = |rows: i32| -> Result<Array> {
                    let mut shape = like.shape().to_vec();
                    shape[0] = rows;
                    Ok(ops::zeros_dtype(&shape, like.dtype())?)
                };
                let mine_state = match mine_state {
                    Some(state) => state.clone(),
                    None => fresh(mine)?,
                };
                let theirs_state = match theirs_state {
                    Some(state) => state.clone(),
                    None => fresh(theirs)?,
                };
                Ok::<_, EngineError>(ops::concatenate(&[mine_state, theirs_state], 0)?)
            };
            let (held, given) = (self.recurrent.as_ref(), other.recurrent.as_ref());
            let state = RecurrentState {
                conv: stack(held.map(|r| &r.conv), given.map(|r| &r.conv), &like.conv)?,
                state: stack(held.map(|r| &r.state), given.map(|r| &r.state), &like.state)?,
            };
            self.recurrent = Some(state);
        }
        // Each row keeps its lag: both sides end at `end` less their own lags.
        let mut rows = self.row_layout();
        let theirs_rows = other.row_layout();
        rows.left_padding
            .iter_mut()
            .for_each(|pad| *pad += pad_mine);
        rows.left_padding
            .extend(theirs_rows.left_padding.iter().map(|pad| pad + pad_theirs));
        rows.lags.extend(theirs_rows.lags);
        rows.rope_deltas.extend(theirs_rows.rope_deltas);
        rows.rope_histories.extend(theirs_rows.rope_histories);
        self.rows = Some(rows);
        self.offset = end;
        // Each row's own context is enforced by its request (its token budget).
        self.max_ctx = i32::MAX;
        Ok(())
    }

    fn row_layout(&self) -> Rows {
        match &self.rows {
            Some(rows) => rows.clone(),
            None => Rows {
                left_padding: vec![0],
                lags: vec![0],
                rope_deltas: vec![self.rope_delta],
                rope_histories: vec![self.rope_history.clone()],
            },
        }
    }

    /// Keeps only rows `keep` (in that order), then drops the leading columns no row uses.
    pub fn retain_rows(&mut self, keep: &[usize]) -> Result<()> {
        self.keep_rows(keep)?;
        self.mirror.retain(keep);
        Ok(())
    }

    fn keep_rows(&mut self, keep: &[usize]) -> Result<()> {
        let Rows {
            left_padding: pads,
            lags,
            rope_deltas: deltas,
            rope_histories: histories,
        } = self.row_layout();
        if keep.len() == pads.len() && keep.iter().enumerate().all(|(i, &row)| i == row) {
            return Ok(());
        }
        if keep.is_empty() {
            *self = Self::new(0);
            return Ok(());
        }
        let index: Vec<i32> = keep.iter().map(|&row| row as i32).collect();
        let index = Array::from_slice(&index, &[index.len() as i32]);
        let take = |array: &Array| array.take_axis(&index, 0);
        let trim = keep.iter().map(|&row| pads[row]).min().unwrap_or(0);
        // Positions shift down by `trim`; the columns before it that the arrays still hold go.
        let dropped = (trim - self.base).max(0);
        let drop_columns = |array: Array| -> Array {
            if dropped > 0 {
                array.index((.., .., dropped.., ..))
            } else {
                array
            }
        };
        self.parts = self
            .parts
            .iter()
            .map(|part| Ok(drop_columns(take(part)?)))
            .collect::<Result<_>>()?;
        if let Some(state) = &self.recurrent {
            self.recurrent = Some(RecurrentState {
                conv: take(&state.conv)?,
                state: take(&state.state)?,
            });
        }
        // The kept rows' furthest end becomes the offset (columns past it hold no token).
        let shortest_lag = keep.iter().map(|&row| lags[row]).min().unwrap_or(0);
        self.rows = Some(Rows {
            left_padding: keep.iter().map(|&row| pads[row] - trim).collect(),
            lags: keep.iter().map(|&row| lags[row] - shortest_lag).collect(),
            rope_deltas: keep.iter().map(|&row| deltas[row]).collect(),
            rope_histories: keep.iter().map(|&row| histories[row].clone()).collect(),
        });
        self.offset -= trim + shortest_lag;
        self.base = (self.base - trim).max(0);
        if let [only] = keep {
            self.rope_delta = deltas[*only];
            self.rope_history = histories[*only].clone();
        }
        Ok(())
    }

    /// Row `row` as one request's cache of its own (its columns copied out, no padding).
    pub fn row(&self, row: usize) -> Result<KvCache> {
        let Rows {
            left_padding: pads,
            lags,
            rope_deltas: deltas,
            rope_histories: histories,
        } = self.row_layout();
        let (pad, b) = (pads[row], row as i32);
        let end = self.offset - lags[row];
        // The row's tokens are positions pad..end of the batch; the arrays hold them from `first`.
        let first = pad.max(self.base);
        let own = |array: &Array, columns: bool| -> Result<Array> {
            let rows = array.index(b..b + 1);
            let rows = if columns {
                rows.index((.., .., (first - self.base)..(end - self.base), ..))
            } else {
                rows
            };
            contiguous(&rows)
        };
        let mut cache = KvCache::unmirrored(0, None);
        cache.mirror = self.mirror.row(row);
        cache.storage = self.storage;
        cache.window = self.window;
        cache.base = first - pad;
        cache.offset = end - pad;
        cache.max_ctx = cache.offset;
        cache.rope_delta = deltas[row];
        cache.rope_history = histories[row].clone();
        cache.parts = self
            .parts
            .iter()
            .map(|part| own(part, true))
            .collect::<Result<_>>()?;
        if let Some(state) = &self.recurrent {
            cache.recurrent = Some(RecurrentState {
                conv: own(&state.conv, false)?,
                state: own(&state.state, false)?,
            });
        }
        // Evaluated now: a lazy copy would keep the whole batch's buffers alive as its inputs.
        crate::runtime::eval(cache.state())?;
        Ok(cache)
    }

    /// The recurrent state of a linear-attention layer, None before its first token.
    pub fn recurrent(&self) -> Option<&RecurrentState> {
        self.recurrent.as_ref()
    }

    /// Stores a linear-attention layer's state after `advanced` more tokens. The context bound
    /// holds as for keys and values.
    pub fn set_recurrent(&mut self, state: RecurrentState, advanced: i32) -> Result<()> {
        let end = self.offset + advanced;
        if end > self.max_ctx {
            return Err(EngineError::ContextOverflow {
                prompt_tokens: end as usize,
                max_ctx: self.max_ctx as usize,
            });
        }
        self.recurrent = Some(state);
        self.offset = end;
        Ok(())
    }

    /// Marks the next forward as a speculative step: a linear-attention layer stashes its
    /// step's inputs (see [`StepInputs`]) until [`Self::keep_written`].
    pub fn begin_speculative(&mut self) {
        self.mirror.speculate();
        self.speculating = true;
        self.stashed = None;
    }

    /// Whether the running forward is a speculative step (a linear-attention layer then calls
    /// [`Self::stash_steps`]).
    pub fn is_speculating(&self) -> bool {
        self.speculating
    }

    pub fn stash_steps(&mut self, steps: StepInputs) {
        self.stashed = Some(steps);
    }

    /// After a speculative step that wrote `written` tokens for every row, keeps the first
    /// `kept[b]` (1..=written; 0 too for an attention cache) of row `b`'s: attention caches
    /// forget the rest by moving the row's end (a windowed cache's slack covers any step, see
    /// [`WINDOW_SLACK`]); a linear-attention layer replays the kept steps' recurrence from what
    /// it stashed and takes its conv window ending at the last kept token. Rows keeping
    /// different counts become ragged.
    pub fn keep_written(&mut self, written: i32, kept: &[i32]) -> Result<()> {
        self.keep_step(written, kept)?;
        self.mirror.keep(written, kept);
        Ok(())
    }

    fn keep_step(&mut self, written: i32, kept: &[i32]) -> Result<()> {
        self.speculating = false;
        let stashed = self.stashed.take();
        let rows = self.batch_size();
        // A recurrent state can only go back within the step it stashed (to its state before).
        let least = if self.recurrent.is_some() && stashed.is_none() {
            1
        } else {
            0
        };
        if kept.len() != rows || kept.iter().any(|&k| k < least || k > written) {
            return Err(EngineError::InvalidRequest(format!(
                "a speculative step kept {kept:?} of {written} tokens for {rows} rows"
            )));
        }
        if kept.iter().all(|&k| k == written) {
            return Ok(());
        }
        if let Some(steps) = stashed {
            let batch = rows as i32;
            let kept_rows = Array::from_slice(kept, &[batch, 1]);
            let deepest = kept.iter().copied().max().unwrap_or(0);
            let uniform = kept.iter().all(|&k| k == deepest);
            let state = match (&steps.states, deepest) {
                // Every row keeps none (a draft model's catch-up of rows that lacked nothing).
                (_, 0) if uniform => steps.before.clone(),
                (Some(states), _) if uniform => states[deepest as usize - 1].clone(),
                (Some(states), _) => {
                    // Row b's state after its kept[b] tokens (0: the state before the step).
                    let all: Vec<&Array> = std::iter::once(&steps.before)
                        .chain(&states[..deepest as usize])
                        .collect();
                    let all = ops::stack(&all, 1)?;
                    let index = kept_rows.reshape(&[batch, 1, 1, 1, 1])?;
                    all.take_along_axis(&index, 1)?.squeeze_axes(&[1])?
                }
                (None, _) => {
                    // Only the steps some row keeps replay; a mask only where rows keep
                    // different counts.
                    let apply = match uniform {
                        true => None,
                        false => {
                            let step_index =
                                ops::arange::<_, i32>(0, deepest, None)?.reshape(&[1, deepest])?;
                            Some(ops::lt(&step_index, &kept_rows)?)
                        }
                    };
                    (steps.replay)(&steps.inputs, &steps.before, deepest, apply.as_ref())?
                }
            };
            // The conv keeps the `kernel - 1` inputs ending at the last kept token.
            let window = steps.conv_input.shape()[1] - written;
            let channels = steps.conv_input.shape()[2];
            let taps = ops::arange::<_, i32>(0, window, None)?.reshape(&[1, window, 1])?;
            let index = ops::add(&taps, kept_rows.reshape(&[batch, 1, 1])?)?;
            let index = ops::broadcast_to(&index, &[batch, window, channels])?;
            let conv = steps.conv_input.take_along_axis(&index, 1)?;
            self.recurrent = Some(RecurrentState { conv, state });
        } else if self.recurrent.is_some() {
            return Err(EngineError::InvalidRequest(
                "a linear-attention layer kept no inputs of its speculative step".into(),
            ));
        }
        let ends: Vec<i32> = self
            .row_ends()
            .iter()
            .zip(kept)
            .map(|(end, kept)| end - written + kept)
            .collect();
        let furthest = ends.iter().copied().max().unwrap_or(self.offset);
        match self.rows.as_mut() {
            Some(layout) => {
                layout.lags = ends.iter().map(|end| furthest - end).collect();
                self.offset = furthest;
            }
            None => self.cut_to(furthest),
        }
        Ok(())
    }

    /// What [`Self::take_back`] needs to undo single-token steps taken from here: a recurrent
    /// layer's state (the others forget by offset).
    pub fn mark(&self) -> Option<RecurrentState> {
        self.recurrent.clone()
    }

    /// Undoes the last `steps` single-token steps of every row, taken since `mark` (a draft
    /// model's deeper drafts): a recurrent layer takes its marked state back, the others move
    /// each row's end back.
    pub fn take_back(&mut self, mark: Option<RecurrentState>, steps: i32) -> Result<()> {
        match (mark, self.recurrent.is_some()) {
            (Some(state), _) => {
                self.recurrent = Some(state);
                self.offset -= steps;
                Ok(())
            }
            (None, false) => self.keep_written(steps, &vec![0; self.batch_size()]),
            (None, true) => Err(EngineError::InvalidRequest(
                "a recurrent state was stepped without a mark to take it back to".into(),
            )),
        }
    }

    /// Whether the cache can be cut back to `len` positions: a KV cache always can, a recurrent
    /// state only to the length it was taken at.
    pub fn can_truncate_to(&self, len: i32) -> bool {
        if len >= self.offset {
            return true;
        }
        // A windowed cache that dropped positions still serves a cut whose next query sees
        // only what it kept.
        let window_held = match self.window {
            Some(window) => self.base == 0 || len - window + 1 >= self.base,
            None => true,
        };
        self.recurrent.is_none() && window_held
    }

    /// Positions already stored (the next token's position).
    pub fn offset(&self) -> i32 {
        self.offset
    }

    /// See the field: what MRoPE models add to the offset to get the next rotary position.
    pub fn rope_delta(&self) -> i32 {
        self.rope_delta
    }

    pub fn set_rope_delta(&mut self, delta: i32) {
        self.mirror.rope(delta);
        self.rope_delta = delta;
        self.rope_history.push((self.offset, delta));
    }

    /// Forgets every position from `len` on (the arrays stay; later writes overwrite them).
    /// A recurrent state cannot forget tokens: callers check [`Self::can_truncate_to`] first.
    pub fn truncate(&mut self, len: i32) {
        debug_assert!(
            self.can_truncate_to(len),
            "a recurrent state cannot be rewound"
        );
        self.mirror.truncate(len);
        self.cut_to(len);
    }

    /// Moves the offset back to `len` (a recurrent state, if any, already holds that length).
    fn cut_to(&mut self, len: i32) {
        self.offset = self.offset.min(len.max(0));
        let offset = self.offset;
        if self.rope_history.last().is_some_and(|&(at, _)| at > offset) {
            self.rope_history.retain(|&(at, _)| at <= offset);
            self.rope_delta = self.rope_history.last().map_or(0, |&(_, delta)| delta);
        }
    }

    /// Frees the positions past the offset: the arrays become copies of exactly what is held
    /// (a prefix-cache entry cut to fit its budget must not keep the whole buffers alive).
    pub fn compact(&mut self) -> Result<()> {
        self.compact_parts()?;
        self.mirror.compact();
        Ok(())
    }

    fn compact_parts(&mut self) -> Result<()> {
        let end = self.offset - self.base;
        for array in &mut self.parts {
            if array.shape()[2] == end {
                continue;
            }
            // A concatenation always writes a new buffer (a slice alone may stay a view of the
            // old one, and `contiguous` may share it when the slice is already contiguous).
            let half = end / 2;
            let copy = ops::concatenate(
                &[
                    array.index((.., .., ..half, ..)),
                    array.index((.., .., half..end, ..)),
                ],
                2,
            )?;
            crate::runtime::eval([&copy])?;
            *array = copy;
        }
        Ok(())
    }

    /// Lets the cache grow to `len` positions where its bound was lower (a batch row's caches
    /// come out of [`Self::row`] bounded by what they hold).
    pub fn allow_up_to(&mut self, len: i32) {
        self.mirror.allow(len);
        self.max_ctx = self.max_ctx.max(len);
    }

    /// Re-targets a reused cache to another request's context.
    pub fn set_max_ctx(&mut self, max_ctx: usize) {
        self.max_ctx = max_ctx.min(i32::MAX as usize) as i32;
        self.mirror.max_ctx(self.max_ctx);
    }

    /// Positions that may still be written before the context is full.
    pub fn room(&self) -> i32 {
        self.max_ctx.saturating_sub(self.offset).max(0)
    }

    /// Positions allocated (what the cache holds in memory).
    pub fn capacity(&self) -> i32 {
        self.parts
            .first()
            .map_or(0, |keys| self.base + keys.shape()[2])
    }

    /// A layer another pipeline rank computes: its cache here holds zero-width keys and values
    /// but moves as the real one does (offsets, rows, paddings), so every cache operation and
    /// mask reads the same positions on every rank at no cost.
    pub fn shadow_step(&mut self, batch: i32, len: i32) -> Result<()> {
        let empty = ops::zeros::<f32>(&[batch, 1, len, 0])?;
        self.update_and_fetch_stored(&empty, &empty).map(drop)
    }

    /// Appends `[B, heads, L, dim]` keys/values and returns everything stored so far (a dense
    /// cache's; see [`Self::update_and_fetch_stored`]).
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        match self.update_and_fetch_stored(keys, values)? {
            Fetched::Dense { keys, values } => Ok((keys, values)),
            Fetched::Quantized { .. } => Err(EngineError::InvalidRequest(
                "this layer's attention cannot read a quantized KV cache".into(),
            )),
        }
    }

    /// Appends `[B, heads, L, dim]` keys/values (quantized first when the cache stores them
    /// so) and returns every stored column as stored.
    pub fn update_and_fetch_stored(&mut self, keys: &Array, values: &Array) -> Result<Fetched> {
        let stop = self.update_stored(keys, values)?;
        Ok(self.fetched(Some(stop)))
    }

    /// Like [`Self::update_and_fetch_stored`], but returns the whole buffer: columns
    /// `base()..capacity()`, the ones past `offset()` not written yet (or left by a rolled-back
    /// step), for a caller that masks them (see `attention::attend_update`).
    pub fn update_and_fetch_buffer(&mut self, keys: &Array, values: &Array) -> Result<Fetched> {
        self.update_stored(keys, values)?;
        Ok(self.fetched(None))
    }

    /// Writes `keys` / `values` after the stored columns; returns the written columns' end
    /// within the buffer.
    fn update_stored(&mut self, keys: &Array, values: &Array) -> Result<i32> {
        let new = keys.shape()[2];
        let end = self.offset + new;
        if end > self.max_ctx {
            return Err(EngineError::ContextOverflow {
                prompt_tokens: end as usize,
                max_ctx: self.max_ctx as usize,
            });
        }
        if let KvStorage::Quantized {
            bits,
            group_size: 0,
        } = self.storage
        {
            // Heads MLX cannot group stay dense.
            let dim = keys.shape()[3].min(values.shape()[3]);
            self.storage = match KvStorage::group_for(dim) {
                Some(group_size) => KvStorage::Quantized { bits, group_size },
                None => KvStorage::Dense,
            };
        }
        let incoming = match self.storage {
            KvStorage::Dense => vec![keys.clone(), values.clone()],
            KvStorage::Quantized { bits, group_size } => {
                let (kw, ks, kb) = ops::quantize(keys, group_size, bits)?;
                let (vw, vs, vb) = ops::quantize(values, group_size, bits)?;
                vec![kw, ks, kb, vw, vs, vb]
            }
        };
        if end > self.capacity() {
            self.drop_outside_window();
            self.grow(&incoming, end)?;
        }
        let (start, stop) = (self.offset - self.base, end - self.base);
        let stored = match self.is_ragged() {
            // Each row writes at its own end.
            true => {
                let starts: Vec<i32> = self.row_ends().iter().map(|end| end - self.base).collect();
                self.parts
                    .iter()
                    .zip(&incoming)
                    .map(|(part, new)| put_rows(part, new, &starts))
                    .collect::<Result<Vec<_>>>()?
            }
            false => self
                .parts
                .iter()
                .zip(&incoming)
                .map(|(part, new)| slice_update_seq(part, new, start, stop))
                .collect::<Result<Vec<_>>>()?,
        };
        self.offset = end;
        self.parts = stored;
        Ok(stop)
    }

    /// The stored parts through buffer column `stop` (all of them: `None`).
    fn fetched(&self, stop: Option<i32>) -> Fetched {
        let fetched: Vec<Array> = self
            .parts
            .iter()
            .map(|part| match stop.filter(|&stop| stop != part.shape()[2]) {
                None => part.clone(),
                Some(stop) => part.index((.., .., ..stop, ..)),
            })
            .collect();
        match (self.storage, <[Array; 6]>::try_from(fetched)) {
            (KvStorage::Quantized { bits, group_size }, Ok([kw, ks, kb, vw, vs, vb])) => {
                Fetched::Quantized {
                    keys: [kw, ks, kb],
                    values: [vw, vs, vb],
                    bits,
                    group_size,
                }
            }
            (_, Err(mut dense)) if dense.len() == 2 => {
                let values = dense.pop().expect("two parts");
                let keys = dense.pop().expect("two parts");
                Fetched::Dense { keys, values }
            }
            _ => unreachable!("a cache holds two dense or six quantized parts"),
        }
    }

    /// A windowed cache lets go of the positions no later query can see (the next growth
    /// copies only what is left).
    fn drop_outside_window(&mut self) {
        let Some(keep) = self.keep() else {
            return;
        };
        // The row that ends first decides: its next query sees the furthest back.
        let first = (self.shortest_end() - keep).max(0);
        if first <= self.base {
            return;
        }
        let skip = first - self.base;
        for array in &mut self.parts {
            *array = array.index((.., .., skip.., ..));
        }
        self.base = first;
    }

    /// Grows to hold `needed` positions, rounded up to whole steps, capped at `max_ctx`;
    /// `incoming` (the parts about to be written) give each part's shape and dtype.
    fn grow(&mut self, incoming: &[Array], needed: i32) -> Result<()> {
        let steps = (needed - self.offset + GROWTH_STEP - 1) / GROWTH_STEP;
        let target = (self.offset + steps * GROWTH_STEP).min(self.max_ctx);
        let extra = target - self.offset;
        let held = self.offset - self.base;
        let old = std::mem::take(&mut self.parts);
        for (index, like) in incoming.iter().enumerate() {
            let [batch, heads, _, dim] = dims4(like);
            let fresh = ops::zeros_dtype(&[batch, heads, extra, dim], like.dtype())?;
            self.parts.push(match old.get(index) {
                Some(part) => ops::concatenate(&[part.index((.., .., ..held, ..)), fresh], 2)?,
                None => fresh,
            });
        }
        Ok(())
    }

    /// The arrays to evaluate between prefill chunks.
    pub fn state(&self) -> Vec<&Array> {
        let recurrent = self
            .recurrent
            .iter()
            .flat_map(|state| [&state.conv, &state.state]);
        self.parts.iter().chain(recurrent).collect()
    }

    /// Bytes the cache holds (allocated, not just used).
    pub fn nbytes(&self) -> usize {
        self.state().iter().map(|array| array.nbytes()).sum()
    }
}

/// The last padding mask and per-row RoPE offsets built on this thread (the engine thread):
/// every layer of a decode step asks for the same ones, since all its caches hold the same
/// rows, and each is an upload plus a few ops that a 36-layer step would otherwise repeat 36
/// times.
#[derive(Default)]
struct StepArrays {
    offsets: Option<(Vec<i32>, Array)>,
    /// The last few [`KvCache::rows_mask`]s (a Gemma step asks for two: full and sliding).
    rows_masks: Vec<(RowsMaskKey, Array)>,
}

/// (left paddings, lags, first column, end column, last column + 1, queries, window).
type RowsMaskKey = (Vec<i32>, Vec<i32>, i32, i32, i32, i32, Option<i32>);

thread_local! {
    static STEP_ARRAYS: std::cell::RefCell<StepArrays> = std::cell::RefCell::default();
}

/// One side of a join, `[rows, heads, end - first, dim]` for joined positions `first..end`
/// (end = pad + offset): the side's arrays hold its positions `held.0..held.1`, which land
/// `pad` later; joined positions before them are zero padding (zeros shaped like `like` when
/// the side holds nothing).
fn aligned(
    array: Option<&Array>,
    like: &Array,
    rows: i32,
    held: (i32, i32),
    pad: i32,
    first: i32,
) -> Result<Array> {
    let [_, heads, _, dim] = dims4(like);
    let (base, offset) = held;
    let zeros = |columns: i32| ops::zeros_dtype(&[rows, heads, columns, dim], like.dtype());
    let end = pad + offset;
    let Some(array) = array.filter(|_| offset > base) else {
        return Ok(zeros(end - first)?);
    };
    // Joined position p is the side's position p - pad, its column p - pad - base.
    let from = (first - pad - base).max(0);
    let taken = array.index((.., .., from..(offset - base), ..));
    let zeros_before = (pad + base + from) - first;
    if zeros_before == 0 {
        return Ok(taken);
    }
    Ok(ops::concatenate(&[zeros(zeros_before)?, taken], 2)?)
}

/// A copy of `array` in its own buffer: a row taken out of a batch must not keep the batch's
/// buffer alive (the prefix cache counts its bytes). A slice may share its parent's buffer, a
/// product never does, and `x * 1` is exact.
pub(crate) fn contiguous(array: &Array) -> Result<Array> {
    Ok(ops::multiply(array, crate::nn::scalar(1.0, array)?)?)
}

fn dims4(array: &Array) -> [i32; 4] {
    let shape = array.shape();
    [shape[0], shape[1], shape[2], shape[3]]
}

/// `dst[b, :, starts[b]..starts[b] + L, :] = update[b]` for every row, in one scatter (in place
/// when MLX can donate `dst`, as for a slice update).
fn put_rows(dst: &Array, update: &Array, starts: &[i32]) -> Result<Array> {
    let [batch, _, len, _] = dims4(update);
    let starts = Array::from_slice(starts, &[batch, 1, 1, 1]);
    let steps = ops::arange::<_, i32>(0, len, None)?.reshape(&[1, 1, len, 1])?;
    let index = ops::broadcast_to(&ops::add(&starts, &steps)?, update.shape())?;
    Ok(dst.put_along_axis(&index, update, 2)?)
}

/// `dst[:, :, start:end, :] = update` as a new array (MLX updates in place when it can).
fn slice_update_seq(dst: &Array, update: &Array, start: i32, end: i32) -> Result<Array> {
    let [batch, heads, _, dim] = dims4(dst);
    let starts = [0, 0, start, 0];
    let stops = [batch, heads, end, dim];
    let strides = [1, 1, 1, 1];
    let stream = Stream::thread_local_or_default();
    // SAFETY: handles are live for the call and the output becomes an owned Array.
    unsafe {
        let mut out = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlx_slice_update(
            &mut out,
            dst.as_ptr(),
            update.as_ptr(),
            starts.as_ptr(),
            4,
            stops.as_ptr(),
            4,
            strides.as_ptr(),
            4,
            stream.as_ptr(),
        );
        let out = Array::from_ptr(out);
        if status != 0 {
            return Err(EngineError::Mlx(
                "slice_update of the KV cache failed".into(),
            ));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(len: i32, fill: f32) -> Array {
        ops::full::<f32>(&[1, 2, len, 4], Array::from_f32(fill)).unwrap()
    }

    /// A batch row's cache comes out bounded by what it holds; a lagging cache of the same
    /// row (the draft head's) may be let grow to the trunk's length, and no further.
    #[test]
    fn a_row_taken_out_of_a_batch_grows_only_where_allowed() {
        let mut lagging = KvCache::new(100);
        lagging.update_and_fetch(&kv(5, 1.0), &kv(5, 1.0)).unwrap();
        let mut batch = lagging.clone();
        batch.join(&KvCache::new(100)).unwrap();
        let mut row = batch.row(0).unwrap();
        assert!(matches!(
            row.update_and_fetch(&kv(2, 2.0), &kv(2, 2.0)),
            Err(EngineError::ContextOverflow { .. })
        ));
        row.allow_up_to(7);
        row.update_and_fetch(&kv(2, 2.0), &kv(2, 2.0)).unwrap();
        assert_eq!(row.offset(), 7);
        assert!(row.update_and_fetch(&kv(1, 3.0), &kv(1, 3.0)).is_err());
        // A bound already higher stays.
        let mut roomy = KvCache::new(100);
        roomy.allow_up_to(7);
        roomy.update_and_fetch(&kv(50, 1.0), &kv(50, 1.0)).unwrap();
    }

    /// A cut back restores the rotary delta of the position it keeps (set at each image
    /// chunk's end), through a batch row too.
    #[test]
    fn truncating_restores_the_rope_delta_of_the_kept_prefix() {
        let kv = |n: i32| Array::from_slice(&vec![1.0f32; (n * 4) as usize], &[1, 1, n, 4]);
        let mut cache = KvCache::new(100);
        cache.update_and_fetch(&kv(10), &kv(10)).unwrap();
        cache.set_rope_delta(-6); // an image in the first 10 tokens
        cache.update_and_fetch(&kv(10), &kv(10)).unwrap();
        cache.set_rope_delta(-9); // another ending at 20
        cache.update_and_fetch(&kv(5), &kv(5)).unwrap();
        let row = {
            let mut batch = cache.clone();
            batch.join(&KvCache::new(100)).unwrap();
            batch.row(0).unwrap()
        };
        for mut cut in [cache, row] {
            cut.truncate(22);
            assert_eq!(cut.rope_delta(), -9);
            cut.truncate(15);
            assert_eq!(cut.rope_delta(), -6);
            cut.truncate(4);
            assert_eq!(cut.rope_delta(), 0);
        }
    }

    /// `[1, 1, n, 1]` holding the positions `from..from + n` (plus `tag`) as values.
    fn positions(from: i32, n: i32, tag: f32) -> Array {
        let values: Vec<f32> = (from..from + n).map(|p| p as f32 + tag).collect();
        Array::from_slice(&values, &[1, 1, n, 1])
    }

    /// The values a cache's arrays hold for row `row`, positions `base..offset`.
    fn held(cache: &KvCache, row: i32) -> Vec<f32> {
        let keys = &cache.parts[0];
        let used = keys.index((row..row + 1, .., ..(cache.offset - cache.base), ..));
        let used = contiguous(&used).unwrap();
        used.as_slice::<f32>().to_vec()
    }

    /// A windowed cache drops what its next query cannot see and stays bounded; joined with a
    /// cache at another offset, decoded, and taken apart again (`row`, `retain_rows`), each
    /// row still holds its own latest positions in order; a cut is allowed only where the
    /// window it needs is still held.
    #[test]
    fn windowed_cache_keeps_its_window_through_joins_and_rows() {
        let (window, keep) = (8, 8 - 1 + WINDOW_SLACK);
        let mut long = KvCache::windowed(10_000, window as usize);
        for start in (0..600).step_by(50) {
            let chunk = positions(start, 50, 0.0);
            let (keys, _) = long.update_and_fetch(&chunk, &chunk).unwrap();
            // What comes back starts at the base and ends at the new tokens.
            assert_eq!(keys.shape()[2], start + 50 - long.base());
        }
        assert!(long.base() > 0 && long.base() <= 600 - keep);
        assert!(long.capacity() - long.base() <= keep + 50 + GROWTH_STEP);
        let want: Vec<f32> = (long.base()..600).map(|p| p as f32).collect();
        assert_eq!(held(&long, 0), want);
        assert!(long.can_truncate_to(600 - 8) && !long.can_truncate_to(long.base()));
        assert!(KvCache::new(100).can_truncate_to(0));

        let mut short = KvCache::windowed(10_000, window as usize);
        let chunk = positions(0, 100, 0.5);
        short.update_and_fetch(&chunk, &chunk).unwrap();
        let mut batch = long.clone();
        batch.join(&short).unwrap();
        // A decode step past another growth: both rows write their next position.
        for step in 0..300 {
            let next = ops::concatenate(
                &[positions(600 + step, 1, 0.0), positions(100 + step, 1, 0.5)],
                0,
            )
            .unwrap();
            batch.update_and_fetch(&next, &next).unwrap();
        }
        assert!(batch.capacity() - batch.base() <= keep + 1 + GROWTH_STEP);
        let (first, second) = (batch.row(0).unwrap(), batch.row(1).unwrap());
        assert_eq!((first.offset(), second.offset()), (900, 400));
        for (row, tag, offset) in [(first, 0.0, 900), (second, 0.5, 400)] {
            // At least the window before the next token, in order.
            assert!(offset - row.base() >= keep);
            let want: Vec<f32> = (row.base()..offset).map(|p| p as f32 + tag).collect();
            assert_eq!(held(&row, 0), want);
        }
        batch.retain_rows(&[1]).unwrap();
        assert_eq!(batch.row_offsets(), vec![400]);
        let last = held(&batch, 0);
        assert_eq!(last.last(), Some(&399.5));
        assert!(last.len() as i32 >= keep);
    }

    #[test]
    fn grows_in_steps_and_never_past_max_ctx() {
        let mut cache = KvCache::new(600);
        assert_eq!(cache.capacity(), 0);
        let (keys, _) = cache.update_and_fetch(&kv(10, 1.0), &kv(10, 1.0)).unwrap();
        assert_eq!((cache.offset(), cache.capacity()), (10, 256));
        assert_eq!(keys.shape(), &[1, 2, 10, 4]);
        cache
            .update_and_fetch(&kv(300, 2.0), &kv(300, 2.0))
            .unwrap();
        assert_eq!((cache.offset(), cache.capacity()), (310, 522));
        // The next step would pass 600: capped there.
        let (keys, values) = cache
            .update_and_fetch(&kv(290, 3.0), &kv(290, 3.0))
            .unwrap();
        assert_eq!((cache.offset(), cache.capacity()), (600, 600));
        assert_eq!(keys.shape(), &[1, 2, 600, 4]);
        // Old entries survive every growth; new ones land after them.
        let first = keys
            .index((.., .., 0, ..))
            .sum(None)
            .unwrap()
            .item_exact::<f32>();
        let middle = values
            .index((.., .., 309, ..))
            .sum(None)
            .unwrap()
            .item_exact::<f32>();
        let last = keys
            .index((.., .., 599, ..))
            .sum(None)
            .unwrap()
            .item_exact::<f32>();
        assert_eq!((first, middle, last), (8.0, 16.0, 24.0));
        let overflow = cache
            .update_and_fetch(&kv(1, 0.0), &kv(1, 0.0))
            .unwrap_err();
        assert!(matches!(
            overflow,
            EngineError::ContextOverflow {
                prompt_tokens: 601,
                max_ctx: 600
            }
        ));
        assert_eq!(cache.nbytes(), 2 * 600 * 2 * 4 * 4);
    }
}
