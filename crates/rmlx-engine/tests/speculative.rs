//! Speculative decoding is exact: greedy output with drafts equals plain greedy output token
//! for token (log-probs within 1e-5) on the fp32 release fixtures of every family (KV, MoE,
//! Gated DeltaNet hybrids, Gemma 4's sliding windows and KV-shared layers), solo and in a batch
//! of rows with different proposers. The proposers are adversaries of known accuracy: an oracle
//! (always right: every draft kept), an always-wrong one (none kept), and one right for j tokens
//! then wrong with j cycling through 0..=k, so every cache kind is cut back by every length.
//! A solo step is one host synchronisation (counted).

mod common;

use std::sync::{atomic::AtomicBool, Arc};

use common::{fixture, text_ids};
use rmlx_engine::{
    chat::ChatTokenizer,
    engine::{Engine, EngineOptions, Prompt, Request},
    generate::{generate, Completion, GenerateParams},
    models::load_model,
    speculative::{Drafter, SpeculativeMode, SpeculativeParams},
};

const MAX_DRAFT: usize = 4;

/// How a test proposer's drafts relate to the plain continuation.
#[derive(Clone, Copy, Debug)]
enum Adversary {
    Oracle,
    AlwaysWrong,
    /// Right for `(generated so far) % (MAX_DRAFT + 1)` tokens, then wrong.
    RightThenWrong,
}

/// Drafts built from the plain run's tokens: `plain[g..]` is what follows a history holding
/// `g` generated tokens after the `prompt_len` prompt tokens.
fn drafter(plain: Vec<u32>, prompt_len: usize, adversary: Adversary, vocab: u32) -> Drafter {
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

fn params(max_tokens: usize, drafter: Option<Drafter>) -> GenerateParams {
    GenerateParams {
        max_tokens,
        ignore_eos: true,
        logprobs: Some(2),
        speculative: SpeculativeParams {
            mode: SpeculativeMode::Off,
            max_draft: MAX_DRAFT,
            drafter,
        },
        ..GenerateParams::default()
    }
}

fn assert_same(plain: &Completion, other: &Completion, what: &str) {
    assert_eq!(plain.token_ids, other.token_ids, "{what}: tokens differ");
    let (a, b) = (
        plain.logprobs.as_ref().unwrap(),
        other.logprobs.as_ref().unwrap(),
    );
    for (i, (a, b)) in a.iter().zip(b).enumerate() {
        assert!(
            (a.logprob - b.logprob).abs() < 1e-5,
            "{what}: token {i} log-prob {} vs {}",
            a.logprob,
            b.logprob
        );
        for (x, y) in a.top.iter().zip(&b.top) {
            assert_eq!(x.token_id, y.token_id, "{what}: token {i} alternatives");
            assert!(
                (x.logprob - y.logprob).abs() < 1e-5,
                "{what}: token {i} alternatives"
            );
        }
    }
}

/// Every adversary alone equals plain greedy, and draft counts show what was exercised.
fn check_solo(dir: &str, prompt_len: usize, max_tokens: usize) {
    let loaded = load_model(&fixture(dir)).unwrap();
    let model = loaded.model.as_ref();
    let tokenizer = ChatTokenizer::from_dir(&fixture(dir)).unwrap();
    let prompt = text_ids(prompt_len, 7, 10, 900);
    let cancel = AtomicBool::new(false);
    let run = |params: &GenerateParams| {
        generate(model, &tokenizer, &prompt, params, &cancel, |_| {}).unwrap()
    };
    let plain = run(&params(max_tokens, None));
    let vocab = model.vocab_size() as u32;
    for adversary in [
        Adversary::Oracle,
        Adversary::AlwaysWrong,
        Adversary::RightThenWrong,
    ] {
        let drafts = drafter(plain.token_ids.clone(), prompt.len(), adversary, vocab);
        let speculative = run(&params(max_tokens, Some(drafts)));
        assert_same(&plain, &speculative, &format!("{dir} {adversary:?}"));
        let timings = &speculative.timings;
        assert!(
            timings.draft_tokens > 0,
            "{dir} {adversary:?}: nothing drafted"
        );
        match adversary {
            Adversary::Oracle => assert_eq!(timings.accepted_tokens, timings.draft_tokens),
            Adversary::AlwaysWrong => assert_eq!(timings.accepted_tokens, 0),
            Adversary::RightThenWrong => assert!(
                timings.accepted_tokens > 0 && timings.accepted_tokens < timings.draft_tokens
            ),
        }
    }
}

#[test]
fn qwen3_kv_and_moe_solo() {
    check_solo("releases/qwen3-0.6b", 24, 20);
    check_solo("releases/qwen3-30b-a3b", 24, 20);
}

#[test]
fn qwen3_5_gated_deltanet_solo() {
    check_solo("releases/qwen3.5-0.8b", 24, 20);
    check_solo("releases/qwen3.6-35b-a3b", 24, 20);
}

#[test]
fn gemma4_sliding_windows_solo() {
    // Past the window (64) and its slack (32), so windows drop columns while drafts are cut.
    check_solo("releases/gemma-4-e2b-it", 90, 24);
    check_solo("releases/gemma-4-31b-it", 90, 24);
}

/// A batch: rows with different prompts, proposers (none among them) and joins, each equal to
/// its plain solo run.
fn check_batch(dir: &str, prompt_len: usize, max_tokens: usize) {
    let loaded = load_model(&fixture(dir)).unwrap();
    let model = loaded.model.as_ref();
    let tokenizer = ChatTokenizer::from_dir(&fixture(dir)).unwrap();
    let vocab = model.vocab_size() as u32;
    let cancel = AtomicBool::new(false);
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|row| text_ids(prompt_len + 3 * row, 11 + row as u32, 10, 900))
        .collect();
    let plains: Vec<Completion> = prompts
        .iter()
        .map(|prompt| {
            generate(
                model,
                &tokenizer,
                prompt,
                &params(max_tokens, None),
                &cancel,
                |_| {},
            )
            .unwrap()
        })
        .collect();
    drop(loaded);
    let adversaries = [
        Some(Adversary::Oracle),
        None,
        Some(Adversary::RightThenWrong),
        Some(Adversary::AlwaysWrong),
    ];
    let engine = Engine::start_with(EngineOptions {
        max_queue: 8,
        ..EngineOptions::default()
    })
    .unwrap();
    let handles: Vec<_> = prompts
        .iter()
        .zip(&plains)
        .zip(adversaries)
        .map(|((prompt, plain), adversary)| {
            let drafts = adversary
                .map(|adversary| drafter(plain.token_ids.clone(), prompt.len(), adversary, vocab));
            engine
                .submit(Request {
                    model: fixture(dir),
                    prompt: Prompt::Ids(prompt.clone()),
                    params: params(max_tokens, drafts),
                    ..Request::default()
                })
                .unwrap()
        })
        .collect();
    for (row, (handle, plain)) in handles.into_iter().zip(&plains).enumerate() {
        let completion = handle.wait().unwrap();
        assert!(completion.batched_with > 1, "{dir} row {row} ran alone");
        assert_same(plain, &completion, &format!("{dir} batch row {row}"));
    }
}

#[test]
fn batched_rows_with_mixed_proposers_equal_their_solo_runs() {
    check_batch("releases/qwen3-0.6b", 20, 16);
    check_batch("releases/qwen3.5-0.8b", 20, 16);
    check_batch("releases/gemma-4-e2b-it", 80, 24);
}

/// One host synchronisation per speculative step: a run's decode evaluations, less those of
/// a run that only prefilled, equal its steps.
#[test]
fn a_speculative_step_waits_on_the_device_once() {
    let dir = "releases/qwen3-0.6b";
    let loaded = load_model(&fixture(dir)).unwrap();
    let model = loaded.model.as_ref();
    let tokenizer = ChatTokenizer::from_dir(&fixture(dir)).unwrap();
    let prompt = text_ids(24, 5, 10, 900);
    let cancel = AtomicBool::new(false);
    let quiet = |max_tokens: usize, drafter: Option<Drafter>| {
        let mut params = params(max_tokens, drafter);
        params.logprobs = None;
        let before = rmlx_engine::runtime::evals();
        let completion = generate(model, &tokenizer, &prompt, &params, &cancel, |_| {}).unwrap();
        (completion, rmlx_engine::runtime::evals() - before)
    };
    let (plain, _) = quiet(21, None);
    let oracle = drafter(plain.token_ids.clone(), prompt.len(), Adversary::Oracle, 1);
    // One token: a plain step after the prefill (no room to draft).
    let (_, prefill_only) = quiet(1, Some(oracle.clone()));
    let (speculative, evals) = quiet(21, Some(oracle));
    assert_eq!(speculative.token_ids, plain.token_ids);
    // 21 tokens = 4 steps of 1 + 4 drafts, then one token left: a plain step.
    assert_eq!(speculative.timings.draft_tokens, 16);
    assert_eq!(evals - prefill_only, 4);
}
