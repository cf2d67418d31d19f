//! A request's random stream, kept on the host: MLX's keys (`random.key`, `random.split`) and
//! its uniform draws, bit for bit, so a sampled step queues no random ops of its own (eight
//! sampled rows used to add ~ten tiny device ops each per step) and a batch draws every row's
//! token in one set of ops over `[B, vocab]`, each row still from its own seeded stream.
//! Reference: MLX 0.32 `random.cpp` (`key`, `split`, `uniform`, `categorical_inverse_cdf`) on
//! the Threefry-2x32 generator of Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"
//! (SC 2011); the test below checks every value against MLX itself.

use mlx_rs::{
    ops::{cumsum, exp, maximum, select},
    Array, Dtype,
};

use super::SampleError;

/// One request's key: each draw splits it, as `key, sub = mx.random.split(key)` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyStream {
    key: [u32; 2],
}

impl KeyStream {
    /// `mx.random.key(seed)`: the seed's high and low words.
    pub fn new(seed: u64) -> Self {
        Self {
            key: [(seed >> 32) as u32, seed as u32],
        }
    }

    /// `key, sub = split(key)`: the stream moves to `key`, `sub` is this draw's key.
    pub fn next_key(&mut self) -> [u32; 2] {
        // `split(key, 2)` is `bits([2, 2])`: counters (0, 2) and (1, 3) give the words in
        // that order, first words to the first key.
        let (a, c) = threefry(self.key, [0, 2]);
        let (b, d) = threefry(self.key, [1, 3]);
        self.key = [a, b];
        [c, d]
    }

    /// The next draw's key as an MLX key array (`uint32 [2]`), for ops that take one.
    pub fn next_key_array(&mut self) -> Array {
        Array::from_slice(&self.next_key(), &[2])
    }

    /// `mx.random.uniform(shape=[1], key=sub)` with the next key: a float32 in [0, 1).
    pub fn next_uniform(&mut self) -> f32 {
        uniform(self.next_key())
    }
}

/// Threefry-2x32 with 20 rounds: the words `counter` hashes to under `key`.
fn threefry(key: [u32; 2], counter: [u32; 2]) -> (u32, u32) {
    const ROTATIONS: [[u32; 4]; 2] = [[13, 15, 26, 6], [17, 29, 16, 24]];
    let schedule = [key[0], key[1], key[0] ^ key[1] ^ 0x1BD1_1BDA];
    let mut x = [
        counter[0].wrapping_add(schedule[0]),
        counter[1].wrapping_add(schedule[1]),
    ];
    for round in 0..5 {
        for rotation in ROTATIONS[round % 2] {
            x[0] = x[0].wrapping_add(x[1]);
            x[1] = x[1].rotate_left(rotation) ^ x[0];
        }
        x[0] = x[0].wrapping_add(schedule[(round + 1) % 3]);
        x[1] = x[1]
            .wrapping_add(schedule[(round + 2) % 3])
            .wrapping_add(round as u32 + 1);
    }
    (x[0], x[1])
}

/// MLX's float32 uniform from one key: its first 32 bits over `u32::MAX` (as float32), kept
/// below 1.
fn uniform(key: [u32; 2]) -> f32 {
    let bits = threefry(key, [0, 0]).0;
    let below_one = f32::from_bits(1.0f32.to_bits() - 1);
    (bits as f32 / u32::MAX as f32).min(below_one)
}

/// One token per row of `logits` `[rows, vocab]`, row `r` drawn with `uniforms[r]` by the
/// inverse CDF, MLX's `categorical` for a single row (`categorical_inverse_cdf`) op for op,
/// along the last axis. Returns uint32 `[rows]`.
pub fn inverse_cdf(logits: &Array, uniforms: &[f32]) -> Result<Array, SampleError> {
    let rows = uniforms.len() as i32;
    let x = logits.as_dtype(Dtype::Float32)?;
    let top = x.max_axis(-1, true)?;
    // Where the top is infinite, exp(x - top) is NaN: the draw is uniform over the top entries.
    let weights = select(
        top.is_inf()?,
        x.eq(&top)?.as_dtype(Dtype::Float32)?,
        exp(x.subtract(&top)?)?,
    )?;
    let below = cumsum(&weights, -1, false, false)?;
    let target = Array::from_slice(uniforms, &[rows, 1]).multiply(weights.sum_axis(-1, true)?)?;
    // `searchsorted(below, target, right) - 1` on a non-decreasing row is the count of entries
    // at or under the target, less one (never below 0: a NaN row stays in the vocabulary).
    let count = below.le(&target)?.sum_axis(-1, false)?;
    let drawn = maximum(&count, Array::from_int(1))?.subtract(Array::from_int(1))?;
    // Never past the last entry with weight: the target (a sum in another order than the
    // running one) can pass the flat tail of filtered entries by a rounding, and MLX would
    // then draw the vocabulary's last id (often a padded one).
    let vocab = *weights.shape().last().unwrap_or(&1);
    let positions = Array::arange::<i32, i32>(None, vocab, None)?;
    let last = weights
        .gt(Array::from_f32(0.0))?
        .multiply(&positions)?
        .max_axis(-1, false)?;
    Ok(mlx_rs::ops::minimum(&drawn, &last)?.as_dtype(Dtype::Uint32)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys and uniforms of several seeds' streams equal MLX's, draw after draw.
    #[test]
    fn the_stream_is_mlx_own() {
        for seed in [0u64, 1, 42, (1 << 40) + 7, u64::MAX] {
            let mut stream = KeyStream::new(seed);
            let mut key = mlx_rs::random::key(seed).unwrap();
            for draw in 0..40 {
                let (next, sub) = mlx_rs::random::split(&key, 2).unwrap();
                let host = stream.next_key();
                assert_eq!(sub.as_slice::<u32>(), &host, "seed {seed}, draw {draw}");
                assert_eq!(
                    next.as_slice::<u32>(),
                    &stream.key,
                    "seed {seed}, draw {draw}"
                );
                let mlx = mlx_rs::random::uniform::<_, f32>(0.0, 1.0, &[1], Some(&sub)).unwrap();
                assert_eq!(
                    mlx.item_exact::<f32>().to_bits(),
                    uniform(host).to_bits(),
                    "seed {seed}, draw {draw}"
                );
                key = next;
            }
        }
    }

    /// A row's draw equals `mx.random.categorical` with the same key, in float32 and bf16,
    /// for peaked and flat rows, and for rows with `-inf` (filtered) entries.
    #[test]
    fn inverse_cdf_draws_what_mlx_categorical_draws() {
        let mut stream = KeyStream::new(7);
        for case in 0..60u64 {
            let scale = [0.5f32, 3.0, 12.0][case as usize % 3];
            let normal = mlx_rs::random::normal::<f32>(
                &[1, 300],
                None,
                None,
                Some(&mlx_rs::random::key(case).unwrap()),
            )
            .unwrap()
            .multiply(Array::from_f32(scale))
            .unwrap();
            let logits = if case % 4 == 3 {
                let cut = normal.lt(Array::from_f32(0.0)).unwrap();
                select(&cut, Array::from_f32(f32::NEG_INFINITY), &normal).unwrap()
            } else {
                normal
            };
            for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                let logits = logits.as_dtype(dtype).unwrap();
                let key = stream.next_key();
                let mlx = mlx_rs::random::categorical(
                    &logits,
                    -1,
                    None,
                    Some(&Array::from_slice(&key, &[2])),
                )
                .unwrap();
                let ours = inverse_cdf(&logits, &[uniform(key)]).unwrap();
                assert_eq!(ours.shape(), &[1]);
                assert_eq!(
                    ours.as_slice::<u32>(),
                    mlx.as_slice::<u32>(),
                    "case {case}, {dtype:?}"
                );
            }
        }
    }

    /// A target past the running sum's flat tail (the rounding case) draws the last entry with
    /// weight, not a filtered one after it.
    #[test]
    fn a_draw_never_lands_past_the_last_kept_token() {
        let logits = Array::from_slice(
            &[0.0f32, 1.0, f32::NEG_INFINITY, f32::NEG_INFINITY],
            &[1, 4],
        );
        let top = inverse_cdf(&logits, &[f32::from_bits(1.0f32.to_bits() - 1)]).unwrap();
        assert_eq!(top.as_slice::<u32>(), &[1]);
        // A uniform of exactly 1 (beyond MLX's range) stands for a sum rounded up.
        let past = inverse_cdf(&logits, &[1.0]).unwrap();
        assert_eq!(past.as_slice::<u32>(), &[1]);
        let first = inverse_cdf(&logits, &[0.0]).unwrap();
        assert_eq!(first.as_slice::<u32>(), &[0]);
    }

    /// Rows drawn together equal each row drawn alone.
    #[test]
    fn rows_draw_as_they_would_alone() {
        let logits = mlx_rs::random::normal::<f32>(
            &[5, 200],
            None,
            None,
            Some(&mlx_rs::random::key(3).unwrap()),
        )
        .unwrap()
        .multiply(Array::from_f32(4.0))
        .unwrap();
        let mut stream = KeyStream::new(11);
        let uniforms: Vec<f32> = (0..5).map(|_| stream.next_uniform()).collect();
        let together = inverse_cdf(&logits, &uniforms).unwrap();
        for (row, &u) in uniforms.iter().enumerate() {
            use mlx_rs::ops::indexing::IndexOp;
            let r = row as i32;
            let alone = inverse_cdf(&logits.index(r..r + 1), &[u]).unwrap();
            assert_eq!(alone.as_slice::<u32>()[0], together.as_slice::<u32>()[row]);
        }
    }
}
