//! Test proposers of known accuracy for speculative decoding, and a fixture run alone: shared
//! by the speculative tests (tests/speculative.rs, tests/speculative_sampling.rs).

use std::sync::{atomic::AtomicBool, Arc};

use rmlx_engine::{
    chat::ChatTokenizer,
    generate::{generate, Completion, GenerateParams},
    models::{load_model, LoadedModel},
    speculative::Drafter,
};

use super::fixture;

pub const MAX_DRAFT: usize = 4;

/// A fixture loaded for requests run alone on the test thread.
pub struct Solo {
    pub loaded: LoadedModel,
    pub tokenizer: ChatTokenizer,
}

impl Solo {
    pub fn open(dir: &str) -> Self {
        Self {
            loaded: load_model(&fixture(dir)).unwrap(),
            tokenizer: ChatTokenizer::from_dir(&fixture(dir)).unwrap(),
        }
    }

    pub fn model(&self) -> &dyn rmlx_engine::models::LanguageModel {
        self.loaded.model.as_ref()
    }

    pub fn run(&self, prompt: &[u32], params: &GenerateParams) -> Completion {
        let cancel = AtomicBool::new(false);
        generate(
            self.model(),
            &self.tokenizer,
            prompt,
            params,
            &cancel,
            |_| {},
        )
        .unwrap()
    }
}

/// How a test proposer's drafts relate to the plain continuation.
#[derive(Clone, Copy, Debug)]
pub enum Adversary {
    Oracle,
    AlwaysWrong,
    /// Right for `(generated so far) % (MAX_DRAFT + 1)` tokens, then wrong.
    RightThenWrong,
}

/// Drafts built from the plain run's tokens: `plain[g..]` is what follows a history holding
/// `g` generated tokens after the `prompt_len` prompt tokens.
pub fn drafter(plain: Vec<u32>, prompt_len: usize, adversary: Adversary, vocab: u32) -> Drafter {
    Drafter(Arc::new(move |history: &[u32], max: usize| {
        let generated = history.len() - prompt_len;
        let right: Vec<u32> = plain.iter().skip(generated).take(max).copied().collect();
        let wrong = |token: u32| (token + 1 + generated as u32) % vocab;
        match adversary {
            Adversary::Oracle => right,
            Adversary::AlwaysWrong => right.iter().map(|&t| wrong(t)).collect(),
            Adversary::RightThenWrong => {
                let keep = generated % (MAX_DRAFT + 1);
                right
                    .iter()
                    .enumerate()
                    .map(|(i, &t)| if i < keep { t } else { wrong(t) })
                    .collect()
            }
        }
    }))
}
