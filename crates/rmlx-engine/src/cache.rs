//! Per-layer KV cache that grows in steps of 256 positions (as mlx-lm's `KVCache`) but never past
//! the request's effective context, so memory follows the prompt, not a fixed constant.
//! Linear-attention layers (Qwen3.5's Gated DeltaNet) keep a fixed-size recurrent state in the
//! same slot instead: it cannot be rewound, only replaced by a snapshot taken at a given length.
//! Reference: mlx-lm `models/cache.py` (`KVCache.update_and_fetch`, `ArraysCache`).

use mlx_rs::{ops, ops::indexing::IndexOp, Array, Stream};

use crate::error::{EngineError, Result};

/// Positions added per growth step (mlx-lm uses the same).
pub const GROWTH_STEP: i32 = 256;

/// Clones share the arrays; MLX copies on the next write to a shared buffer, so a clone taken
/// from the prefix cache never changes the stored entry.
#[derive(Clone)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: i32,
    max_ctx: i32,
    /// MRoPE models (Qwen3-VL): rotary position minus cache position for tokens after an
    /// image prompt (image blocks use fewer positions than tokens). 0 for text models.
    rope_delta: i32,
    /// A linear-attention layer's state after `offset` tokens (None for attention layers).
    recurrent: Option<RecurrentState>,
}

/// What a Gated DeltaNet layer carries between tokens: the last `kernel - 1` inputs of its
/// causal conv (activation dtype) and the delta-rule state `[B, Hv, Dv, Dk]` (float32).
#[derive(Clone)]
pub struct RecurrentState {
    pub conv: Array,
    pub state: Array,
}

impl KvCache {
    pub fn new(max_ctx: usize) -> Self {
        Self {
            keys: None,
            values: None,
            offset: 0,
            max_ctx: max_ctx.min(i32::MAX as usize) as i32,
            rope_delta: 0,
            recurrent: None,
        }
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

    /// Whether the cache can be cut back to `len` positions: a KV cache always can, a recurrent
    /// state only to the length it was taken at.
    pub fn can_truncate_to(&self, len: i32) -> bool {
        self.recurrent.is_none() || len >= self.offset
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
        self.rope_delta = delta;
    }

    /// Forgets every position from `len` on (the arrays stay; later writes overwrite them).
    /// A recurrent state cannot forget tokens: callers check [`Self::can_truncate_to`] first.
    pub fn truncate(&mut self, len: i32) {
        debug_assert!(
            self.can_truncate_to(len),
            "a recurrent state cannot be rewound"
        );
        self.offset = self.offset.min(len.max(0));
    }

    /// Re-targets a reused cache to another request's context.
    pub fn set_max_ctx(&mut self, max_ctx: usize) {
        self.max_ctx = max_ctx.min(i32::MAX as usize) as i32;
    }

    /// Positions allocated (what the cache holds in memory).
    pub fn capacity(&self) -> i32 {
        self.keys.as_ref().map_or(0, |keys| keys.shape()[2])
    }

    /// Appends `[B, heads, L, dim]` keys/values and returns everything stored so far.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let new = keys.shape()[2];
        let end = self.offset + new;
        if end > self.max_ctx {
            return Err(EngineError::ContextOverflow {
                prompt_tokens: end as usize,
                max_ctx: self.max_ctx as usize,
            });
        }
        if end > self.capacity() {
            self.grow(keys, values, end)?;
        }
        let start = self.offset;
        let stored_keys = slice_update_seq(self.keys.as_ref().unwrap(), keys, start, end)?;
        let stored_values = slice_update_seq(self.values.as_ref().unwrap(), values, start, end)?;
        self.offset = end;
        let fetched = if end == stored_keys.shape()[2] {
            (stored_keys.clone(), stored_values.clone())
        } else {
            (
                stored_keys.index((.., .., ..end, ..)),
                stored_values.index((.., .., ..end, ..)),
            )
        };
        self.keys = Some(stored_keys);
        self.values = Some(stored_values);
        Ok(fetched)
    }

    /// Grows to hold `needed` positions, rounded up to whole steps, capped at `max_ctx`.
    fn grow(&mut self, keys: &Array, values: &Array, needed: i32) -> Result<()> {
        let steps = (needed - self.offset + GROWTH_STEP - 1) / GROWTH_STEP;
        let target = (self.offset + steps * GROWTH_STEP).min(self.max_ctx);
        let [batch, heads, _, key_dim] = dims4(keys);
        let value_dim = values.shape()[3];
        let extra = target - self.offset;
        let new_keys = ops::zeros_dtype(&[batch, heads, extra, key_dim], keys.dtype())?;
        let new_values = ops::zeros_dtype(&[batch, heads, extra, value_dim], values.dtype())?;
        let (keys, values) = match (self.keys.take(), self.values.take()) {
            (Some(old_keys), Some(old_values)) => (
                ops::concatenate(&[old_keys.index((.., .., ..self.offset, ..)), new_keys], 2)?,
                ops::concatenate(
                    &[old_values.index((.., .., ..self.offset, ..)), new_values],
                    2,
                )?,
            ),
            _ => (new_keys, new_values),
        };
        self.keys = Some(keys);
        self.values = Some(values);
        Ok(())
    }

    /// The arrays to evaluate between prefill chunks.
    pub fn state(&self) -> Vec<&Array> {
        let recurrent = self
            .recurrent
            .iter()
            .flat_map(|state| [&state.conv, &state.state]);
        self.keys
            .iter()
            .chain(self.values.iter())
            .chain(recurrent)
            .collect()
    }

    /// Bytes the cache holds (allocated, not just used).
    pub fn nbytes(&self) -> usize {
        self.state().iter().map(|array| array.nbytes()).sum()
    }
}

fn dims4(array: &Array) -> [i32; 4] {
    let shape = array.shape();
    [shape[0], shape[1], shape[2], shape[3]]
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
