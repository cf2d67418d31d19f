//! One request run alone to completion on the calling thread.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::{
    chat::ChatTokenizer, constrain::Grammars, error::Result, models::LanguageModel,
    multimodal::ImagePrefill, prefix_cache::Reuse,
};

use super::{
    decode_iteration, CachedSequence, Completion, DecodeRow, Delta, GenerateParams, Prefill,
    Sequence,
};

/// Runs one request to completion on the calling thread (the engine thread).
pub fn generate(
    model: &dyn LanguageModel,
    tokenizer: &ChatTokenizer,
    prompt_ids: &[u32],
    params: &GenerateParams,
    cancel: &AtomicBool,
    on_delta: impl FnMut(Delta),
) -> Result<Completion> {
    generate_reusing(
        model,
        tokenizer,
        prompt_ids,
        params,
        None,
        Grammars::default(),
        None,
        cancel,
        on_delta,
    )
    .map(|(completion, _)| completion)
}

/// `generate`, starting from a reused prefix's KV when given, and handing back the request's
/// caches with the tokens they hold (for the prefix cache). `grammars` enforce
/// `params.response_format` and `params.tool_grammars` (from the model's cached
/// `ConstraintFactory`); left empty, they are built for this call. The engine runs the same
/// prefill and decode steps, with other requests' rows beside this one's.
#[allow(clippy::too_many_arguments)]
pub fn generate_reusing(
    model: &dyn LanguageModel,
    tokenizer: &ChatTokenizer,
    prompt_ids: &[u32],
    params: &GenerateParams,
    reuse: Option<Reuse>,
    grammars: Grammars,
    images: Option<ImagePrefill>,
    cancel: &AtomicBool,
    on_delta: impl FnMut(Delta),
) -> Result<(Completion, CachedSequence)> {
    let mut prefill = Prefill::new(model, tokenizer, prompt_ids, params, reuse, images)?;
    while !prefill.is_done() {
        if cancel.load(Ordering::Relaxed) {
            return Ok(prefill.cancelled());
        }
        prefill.step(model)?;
    }
    let (sequence, mut caches) = prefill.into_sequence(model, tokenizer, grammars)?;
    let mut row = Solo {
        sequence,
        cancel,
        on_delta,
    };
    while !row.sequence.is_finished() {
        decode_iteration(
            model,
            tokenizer,
            &mut caches,
            std::slice::from_mut(&mut row),
        )?;
    }
    let Solo {
        sequence,
        mut on_delta,
        ..
    } = row;
    Ok(sequence.finish(model, tokenizer, caches, &mut on_delta))
}

/// The one row of a request run alone.
struct Solo<'c, F> {
    sequence: Sequence,
    cancel: &'c AtomicBool,
    on_delta: F,
}

impl<F: FnMut(Delta)> DecodeRow for Solo<'_, F> {
    fn sequence(&mut self) -> &mut Sequence {
        &mut self.sequence
    }
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
    fn emit(&mut self, delta: Delta) {
        (self.on_delta)(delta)
    }
}
