//! Prefill in chunks, then decode with MLX's async evaluation pipelined one step ahead, with
//! stop handling and per-request timings. Reference: mlx-lm `generate.py` (`generate_step`,
//! `stream_generate`).
//!
//! Files: `params.rs` (a request's settings and its answer), `solo.rs` (one request alone),
//! `prefill.rs`, `sequence.rs` (one request's decode state), `batch.rs` (a batch's decode step), `verify.rs` (a speculative step), `settle.rs` (its sampled, penalised
//! and constrained rows),
//! `head.rs` (the model's own draft head in the decode loop), `draft.rs` (a separate draft model
//! in it), `finite.rs` (a debugging check for NaN logits).

mod batch;
mod draft;
mod finite;
mod head;
mod params;
mod prefill;
mod sequence;
mod settle;
mod solo;
mod verify;

use mlx_rs::Array;

pub(crate) use batch::{decode_iteration, DecodeRow};
pub use params::{
    effective_context, Completion, Delta, FinishReason, GenerateParams, Timings, TokenLogprob,
    TopLogprob, DEFAULT_PREFILL_CHUNK, MAX_TOP_LOGPROBS,
};
pub use prefill::{group_len, step_together, Prefill, GROUP_TOKENS};
pub use sequence::{CachedSequence, Sequence};
pub use solo::{generate, generate_reusing};
pub use verify::draft_reads;

fn as_input(ids: &[u32]) -> Array {
    let ids: Vec<i32> = ids.iter().map(|&id| id as i32).collect();
    Array::from_slice(&ids, &[1, ids.len() as i32])
}

fn one() -> usize {
    1
}

fn ms(duration: std::time::Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}
