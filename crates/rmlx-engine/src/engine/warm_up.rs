//! The warm-up after a model loads (issue 32 a): MLX builds kernels at run time for each new
//! layout and, on CUDA, each quantized-matmul tile (rows of 16, 32 or 64: ~20-40 s apiece the
//! first time on an H100, kept on disk after). A user's first requests would pay for them one
//! by one. The warm-up sends the shapes a server meets (a full prefill chunk and its tail,
//! short prompts, a burst of `max_batch` prompts prefilled together whose rows then finish one
//! at a time, a speculative step) through the real request path, before anyone waits on it.
//! Its requests are the engine's own: no metrics, nothing kept in the prefix cache.

use std::{
    path::Path,
    sync::{atomic::Ordering, Arc},
    time::Instant,
};

use crate::{
    error::Result,
    generate::{GenerateParams, DEFAULT_PREFILL_CHUNK},
    speculative::{Drafter, SpeculativeMode, SpeculativeParams},
};

use super::{Engine, Job, Prompt, Request, RequestHandle};

/// Holds requests back while it lives (`EngineThread::held`), except a warm-up's own;
/// dropped, it wakes the engine thread to start them. [`Engine::hold_for_warm_up`] gives one
/// to a caller that must hold requests from before the warm-up starts (a server whose
/// listener is open while it loads the model to warm up).
pub struct Warming(Engine);

impl Warming {
    fn begin(engine: &Engine) -> Self {
        engine.inner.warming.fetch_add(1, Ordering::SeqCst);
        Self(engine.clone())
    }
}

impl Drop for Warming {
    fn drop(&mut self) {
        self.0.inner.warming.fetch_sub(1, Ordering::SeqCst);
        let _ = self.0.jobs().send(Job::Wake);
    }
}

/// What a warm-up ran and how long it took.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WarmUp {
    pub seconds: f64,
    /// Requests sent (each generating a few tokens).
    pub requests: usize,
    /// The widest batch it decoded (the engine's `max_batch`).
    pub max_batch: usize,
    /// Whether a speculative step ran (the engine speculates).
    pub speculative: bool,
}

/// Prompt ids drawn from the middle of the vocabulary (ordinary tokens, not specials), fresh
/// per `seed` so no prompt reuses another's prefix.
fn prompt(vocab: usize, len: usize, seed: usize) -> Vec<u32> {
    let (low, span) = (vocab / 8, (vocab / 2).max(2));
    let mut state = (seed as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (low + (state as usize % span)).min(vocab - 1) as u32
        })
        .collect()
}

impl Engine {
    /// Loads `model` if needed, then runs the warm-up. Requests sent meanwhile wait until it
    /// ends (its own requests go ahead of them), as they would for the load.
    pub fn warm_up(&self, model: &Path) -> Result<WarmUp> {
        // Held from before the load: a request that came while the model loads would
        // otherwise start between the load and the warm-up, and meet every new shape first.
        let _holding = Warming::begin(self);
        let info = self.model_info(model)?;
        let started = Instant::now();
        let vocab = info.vocab_size.max(2);
        let context = info.context_length.max(64);
        let max_batch = self.inner.max_batch;
        let send = |ids: Vec<u32>, max_tokens: usize, spec: SpeculativeParams| {
            let params = GenerateParams {
                max_tokens,
                ignore_eos: true,
                speculative: spec,
                ..GenerateParams::default()
            };
            self.submit(Request {
                model: model.to_path_buf(),
                prompt: Prompt::Ids(ids),
                params,
                warm_up: true,
                ..Request::default()
            })
        };
        let plain = || SpeculativeParams {
            mode: Some(SpeculativeMode::Off),
            ..SpeculativeParams::default()
        };
        let wait_all = |handles: Vec<RequestHandle>| -> Result<()> {
            for handle in handles {
                handle.wait()?;
            }
            Ok(())
        };
        let mut requests = 0;
        // One at a time: a full chunk and its tail, then pieces under 16 and 32 rows.
        let long = (DEFAULT_PREFILL_CHUNK + 40).min(context / 2);
        for (len, seed) in [(long, 1), (12, 2), (24, 3)] {
            wait_all(vec![send(prompt(vocab, len, seed), 3, plain())?])?;
            requests += 1;
        }
        // A burst prefilled together; each row asks one token more than the last, so the batch
        // decodes at every width from `max_batch` down to one.
        let burst = (0..max_batch)
            .map(|i| send(prompt(vocab, 16 + 3 * i, 10 + i), 2 + i, plain()))
            .collect::<Result<Vec<_>>>()?;
        requests += burst.len();
        wait_all(burst)?;
        // A speculative step of every depth, each rolled back (the drafts are never right):
        // the model's own draft model or head where it has one, else drafts made up here.
        let speculates = self.inner.speculative != SpeculativeMode::Off;
        if speculates {
            let spec = if info.draft_head_loaded {
                SpeculativeParams {
                    mode: Some(SpeculativeMode::Mtp),
                    ..SpeculativeParams::default()
                }
            } else if info.draft_model.is_some() {
                SpeculativeParams {
                    mode: Some(SpeculativeMode::Draft),
                    ..SpeculativeParams::default()
                }
            } else {
                let wrong = vocab as u32 / 4;
                SpeculativeParams {
                    mode: Some(SpeculativeMode::Lookup),
                    drafter: Some(Drafter(Arc::new(move |history: &[u32], max: usize| {
                        vec![wrong; history.len() % max.max(1) + 1]
                    }))),
                    ..SpeculativeParams::default()
                }
            };
            wait_all(vec![send(prompt(vocab, 20, 40), 8, spec)?])?;
            requests += 1;
        }
        let warm_up = WarmUp {
            seconds: started.elapsed().as_secs_f64(),
            requests,
            max_batch,
            speculative: speculates,
        };
        self.inner
            .warm_ups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(model.canonicalize().unwrap_or(info.path), warm_up.clone());
        Ok(warm_up)
    }

    /// Holds every request but a warm-up's own until the returned guard is dropped.
    pub fn hold_for_warm_up(&self) -> Warming {
        Warming::begin(self)
    }

    /// The model's last warm-up, if one ran.
    pub fn warmed_up(&self, model: &Path) -> Option<WarmUp> {
        let key = model.canonicalize().ok()?;
        let warm_ups = self
            .inner
            .warm_ups
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        warm_ups.get(&key).cloned()
    }
}
