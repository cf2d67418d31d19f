//! Token sampling on device, with mlx-lm 0.32.2's semantics and order (`sample_utils.py`,
//! `generate.py::generate_step`): logits processors on raw logits, log-softmax, then either argmax
//! (temperature 0) or top-p -> min-p -> top-k -> categorical(logprobs / temperature).
//!
//! Everything stays a lazy MLX array, so the decode loop can queue step n+1 before it reads the
//! token of step n. Each `Sampler` owns its PRNG stream (MLX's keys, kept on the host:
//! `random.rs`), which keeps seeded requests reproducible when several requests share the
//! engine thread (MLX's global seed would couple them) and lets a batch draw every row's token
//! in one set of ops ([`draw_rows`]) with the tokens each row would draw alone.

mod defaults;
mod filters;
mod processors;
mod random;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use mlx_rs::{ops::indexing::IndexOp, Array};
use serde::{Deserialize, Serialize};

pub use defaults::SamplingDefaults;
pub use filters::{apply_min_p, apply_top_k, apply_top_p, greedy, log_softmax, temperature_scaled};
use processors::LogitsProcessors;
pub use random::{inverse_cdf, KeyStream};

/// mlx-lm's default window of the repetition, presence and frequency penalties.
pub const DEFAULT_CONTEXT_SIZE: usize = 20;

/// What a request asks of the sampler. `Default` is greedy decoding with nothing else enabled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 = greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling; 1.0 = off. Must be in (0, 1].
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 = off (as is k >= vocab).
    pub top_k: usize,
    /// Drop tokens below `min_p` times the top probability; 0 = off. In [0, 1].
    pub min_p: f32,
    /// min-p never drops this many of the most likely tokens (>= 1).
    pub min_tokens_to_keep: usize,
    /// Sign-aware multiplicative penalty on ids in the window; None or 1.0 = off. > 0.
    pub repetition_penalty: Option<f32>,
    /// Window (last n ids of prompt + output) of the repetition penalty; 0 = the whole history,
    /// as mlx-lm's `tokens[-0:]` slice gives.
    pub repetition_context_size: usize,
    /// Subtracted once from each id present in the window (OpenAI); 0 = off.
    pub presence_penalty: f32,
    pub presence_context_size: usize,
    /// Subtracted once per occurrence of an id in the window (OpenAI); 0 = off.
    pub frequency_penalty: f32,
    pub frequency_context_size: usize,
    /// Added to the raw logit of each id (OpenAI `logit_bias`).
    pub logit_bias: BTreeMap<u32, f32>,
    /// The same seed gives the same tokens; None seeds from the clock.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            min_tokens_to_keep: 1,
            repetition_penalty: None,
            repetition_context_size: DEFAULT_CONTEXT_SIZE,
            presence_penalty: 0.0,
            presence_context_size: DEFAULT_CONTEXT_SIZE,
            frequency_penalty: 0.0,
            frequency_context_size: DEFAULT_CONTEXT_SIZE,
            logit_bias: BTreeMap::new(),
            seed: None,
        }
    }
}

/// Errors from sampling: bad parameters are caught by `validate` before MLX sees them.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SampleError {
    #[error("invalid sampling parameter {name} = {value}: must be {expected}")]
    InvalidParam {
        name: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("{what} token id {token} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange {
        token: u32,
        vocab: usize,
        what: &'static str,
    },
    #[error("logits must have shape [vocab] or [rows, vocab], got {0:?}")]
    BadShape(Vec<i32>),
    #[error("MLX failed while sampling: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

fn invalid(name: &'static str, value: impl ToString, expected: &'static str) -> SampleError {
    SampleError::InvalidParam {
        name,
        value: value.to_string(),
        expected,
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0) with no processors.
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether a penalty reads the token history (logit bias does not). The decode loop can
    /// still pipeline with one: pass the unread token to `Sampler::sample_pending`.
    pub fn needs_history(&self) -> bool {
        self.repetition_penalty.is_some_and(|p| p != 1.0)
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// Check every value is in range; the first bad one is reported.
    pub fn validate(&self) -> Result<(), SampleError> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(invalid("temperature", t, "a finite number >= 0"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("top_p", self.top_p, "in (0, 1]"));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(invalid("min_p", self.min_p, "in [0, 1]"));
        }
        if self.min_tokens_to_keep < 1 {
            return Err(invalid(
                "min_tokens_to_keep",
                self.min_tokens_to_keep,
                ">= 1",
            ));
        }
        if let Some(p) = self.repetition_penalty {
            if !(p.is_finite() && p > 0.0) {
                return Err(invalid("repetition_penalty", p, "a finite number > 0"));
            }
        }
        if !self.presence_penalty.is_finite() {
            return Err(invalid("presence_penalty", self.presence_penalty, "finite"));
        }
        if !self.frequency_penalty.is_finite() {
            return Err(invalid(
                "frequency_penalty",
                self.frequency_penalty,
                "finite",
            ));
        }
        if let Some((id, bias)) = self.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            return Err(invalid(
                "logit_bias",
                format!("{bias} (token {id})"),
                "finite",
            ));
        }
        Ok(())
    }
}

/// One request's sampler: its processors, filters and PRNG key.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    processors: LogitsProcessors,
    /// Every draw splits a key off this stream.
    keys: KeyStream,
    /// `bias_row`'s row and the (vocab, dtype) it was built for.
    bias_row: std::cell::OnceCell<((usize, mlx_rs::Dtype), Array)>,
}

impl Sampler {
    /// Validate `params` and build the sampler.
    pub fn new(params: &SamplingParams) -> Result<Self, SampleError> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(clock_seed);
        Ok(Self {
            params: params.clone(),
            processors: LogitsProcessors::new(params),
            keys: KeyStream::new(seed),
            bias_row: std::cell::OnceCell::new(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Run the logits processors (logit bias, repetition, presence, frequency) on raw logits
    /// `[vocab]` or `[rows, vocab]`; `history` is prompt + generated ids. Returns `[rows, vocab]`.
    pub fn process(&self, logits: &Array, history: &[u32]) -> Result<Array, SampleError> {
        self.process_pending(logits, history, None)
    }

    /// Like `process`, when the newest id is still a lazy array (`pending`, one uint32 id)
    /// because the decode loop has not read it yet: history + pending form the window.
    pub fn process_pending(
        &self,
        logits: &Array,
        history: &[u32],
        pending: Option<&Array>,
    ) -> Result<Array, SampleError> {
        let logits = as_rows(logits)?;
        if self.processors.is_empty() {
            return Ok(logits);
        }
        self.processors.apply(&logits, history, pending)
    }

    /// Process, then draw one token per row (each row its own uniform of the stream, in row
    /// order). Returns the lazy token ids (uint32 `[rows]`) and the log-probabilities
    /// `[rows, vocab]` they were drawn from, before any top-p/min-p/top-k filter (what mlx-lm's
    /// `generate_step` returns and OpenAI `logprobs` reports).
    pub fn sample(
        &mut self,
        logits: &Array,
        history: &[u32],
    ) -> Result<(Array, Array), SampleError> {
        self.sample_pending(logits, history, None)
    }

    /// Greedy with no processor but a logit bias: the token is the argmax of the log-probs of
    /// logits + [`Sampler::bias_row`], so a batch of such rows is sampled in one op over all
    /// rows.
    pub fn is_batchable_greedy(&self) -> bool {
        self.params.is_greedy() && self.is_batchable()
    }

    /// Greedy or sampled with no processor but a logit bias: the token is drawn from the
    /// log-probs of logits + [`Sampler::bias_row`], so a batch of such rows draws its tokens
    /// together ([`draw_rows`]).
    pub fn is_batchable(&self) -> bool {
        self.processors.is_bias_only()
    }

    /// The logit bias as a dense `[1, vocab]` row of `dtype`, built on first use and kept (a
    /// batch adds the rows' biases to its logits in one op); `None` without a bias.
    pub fn bias_row(
        &self,
        vocab: usize,
        dtype: mlx_rs::Dtype,
    ) -> Result<Option<Array>, SampleError> {
        if let Some((cached, row)) = self.bias_row.get() {
            if *cached == (vocab, dtype) {
                return Ok(Some(row.clone()));
            }
        }
        let Some(row) = self.processors.bias_row(vocab, dtype)? else {
            return Ok(None);
        };
        // Evaluated once, so later steps read it instead of rebuilding it.
        row.eval()?;
        let _ = self.bias_row.set(((vocab, dtype), row.clone()));
        Ok(Some(row))
    }

    /// `sample` with the newest id still lazy; see `process_pending`.
    pub fn sample_pending(
        &mut self,
        logits: &Array,
        history: &[u32],
        pending: Option<&Array>,
    ) -> Result<(Array, Array), SampleError> {
        let logits = self.process_pending(logits, history, pending)?;
        let logprobs = log_softmax(&logits)?;
        if self.params.is_greedy() {
            return Ok((greedy(&logprobs)?, logprobs));
        }
        let scaled = temperature_scaled(&self.filter(&logprobs)?, self.params.temperature)?;
        let uniforms: Vec<f32> = (0..scaled.shape()[0])
            .map(|_| self.keys.next_uniform())
            .collect();
        Ok((inverse_cdf(&scaled, &uniforms)?, logprobs))
    }

    /// The top-p -> min-p -> top-k chain of mlx-lm's `make_sampler`, each only when enabled.
    pub fn filter(&self, logprobs: &Array) -> Result<Array, SampleError> {
        Filters::of(&self.params).apply(logprobs)
    }

    /// A fresh PRNG key for one draw (each call advances the request's stream).
    pub(crate) fn next_key(&mut self) -> Result<Array, SampleError> {
        Ok(self.keys.next_key_array())
    }

    /// How this request draws its next token in a batch ([`draw_rows`]); a sampled row's
    /// stream moves on by one draw, as `sample` would move it.
    pub fn row_draw(&mut self) -> RowDraw {
        if self.params.is_greedy() {
            return RowDraw::Argmax;
        }
        RowDraw::Sample {
            filters: Filters::of(&self.params),
            temperature: self.params.temperature,
            uniform: self.keys.next_uniform(),
        }
    }
}

/// The filters a sampled row applies to its log-probs: top-p, min-p, top-k.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Filters {
    top_p: f32,
    min_p: f32,
    min_tokens_to_keep: usize,
    top_k: usize,
}

impl Filters {
    fn of(params: &SamplingParams) -> Self {
        Self {
            top_p: params.top_p,
            min_p: params.min_p,
            min_tokens_to_keep: params.min_tokens_to_keep,
            top_k: params.top_k,
        }
    }

    fn top_p_on(&self) -> bool {
        self.top_p > 0.0 && self.top_p < 1.0
    }

    /// Whether no filter is on (the log-probs pass unchanged).
    fn is_off(&self) -> bool {
        !self.top_p_on() && self.min_p == 0.0 && self.top_k == 0
    }

    fn apply(&self, logprobs: &Array) -> Result<Array, SampleError> {
        let mut out = logprobs.clone();
        if self.top_p_on() {
            out = apply_top_p(&out, self.top_p)?;
        }
        if self.min_p != 0.0 {
            out = apply_min_p(&out, self.min_p, self.min_tokens_to_keep)?;
        }
        if self.top_k > 0 {
            out = apply_top_k(&out, self.top_k)?;
        }
        Ok(out)
    }
}

/// How one row of a batch draws its token: the argmax (greedy rows, and rows whose token is
/// not kept), or a sample with its filters, temperature and its stream's next uniform.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowDraw {
    Argmax,
    Sample {
        filters: Filters,
        temperature: f32,
        uniform: f32,
    },
}

/// One token per row of `logprobs` `[B, vocab]` (log-softmaxed after any logit bias), each
/// what its row would draw alone (`Sampler::sample`), in ops over the whole batch: one argmax,
/// each distinct filter chain once, one temperature product, one inverse-CDF draw. uint32 `[B]`.
pub fn draw_rows(logprobs: &Array, draws: &[RowDraw]) -> Result<Array, SampleError> {
    let argmax = greedy(logprobs)?;
    if draws.iter().all(|draw| *draw == RowDraw::Argmax) {
        return Ok(argmax);
    }
    let rows = draws.len() as i32;
    let filters_of = |draw: &RowDraw| match draw {
        RowDraw::Sample { filters, .. } => Some(*filters),
        RowDraw::Argmax => None,
    };
    let mut chains: Vec<Filters> = Vec::new();
    for filters in draws.iter().filter_map(filters_of) {
        if !filters.is_off() && !chains.contains(&filters) {
            chains.push(filters);
        }
    }
    let filtered = match chains[..] {
        [] => logprobs.clone(),
        // Filters work row by row: one chain (the model's recommendation, which requests that
        // set none share) runs over the whole batch and is kept where its rows are.
        [filters] => {
            let chain = filters.apply(logprobs)?;
            let mine: Vec<bool> = draws
                .iter()
                .map(|d| filters_of(d) == Some(filters))
                .collect();
            match mine.iter().all(|&m| m) {
                true => chain,
                false => {
                    mlx_rs::ops::select(Array::from_slice(&mine, &[rows, 1]), &chain, logprobs)?
                }
            }
        }
        // Several: each row its own (a chain per row over the whole batch would sort it again
        // for every chain).
        _ => {
            let own: Vec<Array> = draws
                .iter()
                .enumerate()
                .map(|(row, draw)| {
                    let at = row as i32;
                    let row = logprobs.index(at..at + 1);
                    match filters_of(draw).filter(|filters| !filters.is_off()) {
                        Some(filters) => filters.apply(&row),
                        None => Ok(row),
                    }
                })
                .collect::<Result<_, _>>()?;
            mlx_rs::ops::concatenate(&own, 0)?
        }
    };
    // `temperature_scaled`'s factor per row (1 where the argmax is taken).
    let factors: Vec<f32> = draws
        .iter()
        .map(|draw| match draw {
            RowDraw::Sample { temperature, .. } => (1.0 / *temperature as f64) as f32,
            RowDraw::Argmax => 1.0,
        })
        .collect();
    let factors = Array::from_slice(&factors, &[rows, 1]).as_dtype(logprobs.dtype())?;
    let uniforms: Vec<f32> = draws
        .iter()
        .map(|draw| match draw {
            RowDraw::Sample { uniform, .. } => *uniform,
            RowDraw::Argmax => 0.0,
        })
        .collect();
    let drawn = inverse_cdf(&filtered.multiply(&factors)?, &uniforms)?;
    let sampled: Vec<bool> = draws.iter().map(|d| filters_of(d).is_some()).collect();
    if sampled.iter().all(|&s| s) {
        return Ok(drawn);
    }
    Ok(mlx_rs::ops::select(
        Array::from_slice(&sampled, &[rows]),
        &drawn,
        &argmax,
    )?)
}

/// `[vocab]` becomes `[1, vocab]`; `[rows, vocab]` is kept.
fn as_rows(logits: &Array) -> Result<Array, SampleError> {
    match *logits.shape() {
        [vocab] if vocab > 0 => Ok(logits.reshape(&[1, vocab])?),
        [rows, vocab] if rows > 0 && vocab > 0 => Ok(logits.clone()),
        _ => Err(SampleError::BadShape(logits.shape().to_vec())),
    }
}

/// A seed for requests without one: the clock, mixed with a counter so that two samplers made
/// in the same nanosecond still differ.
fn clock_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    nanos ^ count.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}
