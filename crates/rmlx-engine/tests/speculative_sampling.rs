//! Speculative decoding under processors and sampling (generate/settle.rs). Greedy rows with a
//! penalty or a JSON-schema grammar speculate with each position processed as a plain step
//! would (the history plus the drafts before it; the grammar advanced through them and rolled
//! back): their output equals plain decode token for token, log-probs included, with an oracle,
//! an always-wrong and a right-then-wrong proposer. Sampled rows apply the rejection rule: over
//! many seeds the tokens speculative steps emit follow plain sampling's law (two-sample
//! chi-square), and the draft head drafts for sampled rows too.

mod common;

use std::sync::{
    atomic::{AtomicBool, AtomicUsize, Ordering},
    Arc,
};

use common::{
    adversary::{drafter, Adversary, Solo, MAX_DRAFT},
    assert_same, fixture, text_ids, two_sample_p_value,
};
use rmlx_engine::{
    chat::ChatTokenizer,
    constrain::ResponseFormat,
    generate::{generate, GenerateParams},
    models::{load_model, load_model_with, LoadOptions, LoadedModel},
    sample::SamplingParams,
    speculative::{Drafter, SpeculativeMode, SpeculativeParams},
};
use serde_json::json;

fn with_drafter(mut params: GenerateParams, drafter: Option<Drafter>) -> GenerateParams {
    params.speculative = SpeculativeParams {
        mode: Some(SpeculativeMode::Off),
        max_draft: MAX_DRAFT,
        drafter,
        costs: None,
    };
    params
}

/// `params` plain, then with each adversary: the same tokens, log-probs and end.
fn check_exact(solo: &Solo, prompt: &[u32], params: GenerateParams, what: &str) {
    let plain = solo.run(prompt, &with_drafter(params.clone(), None));
    let vocab = solo.loaded.model.vocab_size() as u32;
    for adversary in [
        Adversary::Oracle,
        Adversary::AlwaysWrong,
        Adversary::RightThenWrong,
    ] {
        let drafts = drafter(plain.token_ids.clone(), prompt.len(), adversary, vocab);
        let speculative = solo.run(prompt, &with_drafter(params.clone(), Some(drafts)));
        let what = format!("{what} {adversary:?}");
        assert_same(&plain, &speculative, &what);
        assert_eq!(plain.finish_reason, speculative.finish_reason, "{what}");
        let timings = &speculative.timings;
        // Per draft position: the counts add up, and a draft is kept only after the one before.
        assert_eq!(
            timings.drafted_at.iter().sum::<usize>(),
            timings.draft_tokens
        );
        assert_eq!(
            timings.accepted_at.iter().sum::<usize>(),
            timings.accepted_tokens
        );
        assert!(
            timings.accepted_at.windows(2).all(|w| w[1] <= w[0]),
            "{timings:?}"
        );
        match adversary {
            Adversary::Oracle => {
                assert!(timings.draft_tokens > 0, "{what}: nothing drafted");
                assert_eq!(timings.accepted_tokens, timings.draft_tokens, "{what}");
                assert_eq!(timings.accepted_at, timings.drafted_at, "{what}");
            }
            Adversary::AlwaysWrong => assert_eq!(timings.accepted_tokens, 0, "{what}"),
            Adversary::RightThenWrong => assert!(
                timings.accepted_tokens > 0 && timings.accepted_tokens < timings.draft_tokens,
                "{what}: {timings:?}"
            ),
        }
    }
}

fn greedy(max_tokens: usize, sampling: SamplingParams) -> GenerateParams {
    GenerateParams {
        max_tokens,
        ignore_eos: true,
        logprobs: Some(2),
        sampling,
        ..GenerateParams::default()
    }
}

/// Each penalty reads the history: at a draft's position it must count the drafts before it.
#[test]
fn penalised_greedy_rows_speculate_exactly() {
    let penalties = [
        (
            "repetition",
            SamplingParams {
                repetition_penalty: Some(1.8),
                repetition_context_size: 20,
                ..SamplingParams::greedy()
            },
        ),
        (
            "presence",
            SamplingParams {
                presence_penalty: 1.5,
                presence_context_size: 20,
                ..SamplingParams::greedy()
            },
        ),
        (
            "frequency",
            SamplingParams {
                frequency_penalty: 3.0,
                frequency_context_size: 20,
                ..SamplingParams::greedy()
            },
        ),
    ];
    // A KV model and a Gated DeltaNet hybrid with MoE. A logit bias makes one token the
    // argmax wherever nothing penalises it, so the penalties decide (and read the drafts).
    for dir in ["releases/qwen3-0.6b", "releases/qwen3.6-35b-a3b"] {
        let solo = Solo::open(dir);
        let prompt = text_ids(24, 7, 10, 900);
        let biased = |sampling: &SamplingParams| SamplingParams {
            logit_bias: [(17, 6.0)].into(),
            ..sampling.clone()
        };
        for (name, sampling) in &penalties {
            let sampling = biased(sampling);
            // The penalty must change the answer, or this would test nothing.
            let plain = solo.run(&prompt, &greedy(24, biased(&SamplingParams::greedy())));
            let penalised = solo.run(&prompt, &greedy(24, sampling.clone()));
            assert_ne!(plain.token_ids, penalised.token_ids, "{dir} {name}");
            check_exact(
                &solo,
                &prompt,
                greedy(24, sampling.clone()),
                &format!("{dir} {name}"),
            );
        }
    }
}

/// The grammar's mask at each draft's position follows the drafts before it; drafts it refuses
/// are cut, and the grammar is back where it was for the tokens kept.
#[test]
fn constrained_greedy_rows_speculate_exactly() {
    let solo = Solo::open("qwen3-tiny");
    let prompt = text_ids(16, 3, 10, 900);
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["cat", "dog", "axolotl"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 30}
        },
        "required": ["name", "kind", "age"],
        "additionalProperties": false
    });
    let mut params = greedy(200, SamplingParams::greedy());
    params.ignore_eos = false;
    // Random weights seldom close a string: the bias makes `"` and `}` likely (as in
    // tests/constrained.rs), the grammar decides.
    params.sampling.logit_bias = [(1, 10.0), (92, 10.0)].into();
    params.response_format = ResponseFormat::json_schema(schema, true);
    let plain = solo.run(&prompt, &with_drafter(params.clone(), None));
    let text: serde_json::Value = serde_json::from_str(&plain.text).expect("a JSON answer");
    assert!(text.is_object(), "{text}");
    check_exact(&solo, &prompt, params, "json schema");
}

/// A sampled row whose every draft the grammar refuses: each round is left with no draft to
/// check (the rejection rule over no drafts once killed the server with a SIGFPE in MLX's
/// scan); the answers still follow the grammar and no draft is kept.
#[test]
fn constrained_sampled_rows_survive_refused_drafts() {
    let solo = Solo::open("qwen3-tiny");
    let prompt = text_ids(16, 3, 10, 900);
    let kinds = ["cat", "dog", "axolotl"];
    let vocab = solo.loaded.model.vocab_size() as u32;
    // A token the grammar never allows in an answer from `kinds`: one holding a brace.
    let refused = (0..vocab)
        .find(|&id| {
            solo.tokenizer
                .decode(&[id], false)
                .is_ok_and(|text| text.contains('{'))
        })
        .expect("a token with a brace");
    let rounds = Arc::new(AtomicUsize::new(0));
    let counted = rounds.clone();
    let refused_drafts = Drafter(Arc::new(move |_: &[u32], max: usize| {
        counted.fetch_add(1, Ordering::Relaxed);
        vec![refused; max]
    }));
    let mut params = with_drafter(
        GenerateParams {
            max_tokens: 12,
            sampling: SamplingParams {
                temperature: 1.0,
                ..SamplingParams::default()
            },
            ..GenerateParams::default()
        },
        Some(refused_drafts),
    );
    params.response_format = ResponseFormat::json_schema(json!({"enum": kinds}), true);
    for seed in 0..6 {
        params.sampling.seed = Some(seed);
        let answer = solo.run(&prompt, &params);
        let text: serde_json::Value = serde_json::from_str(&answer.text).expect("a JSON answer");
        assert!(kinds.iter().any(|kind| text == *kind), "{text}");
        assert_eq!(answer.timings.accepted_tokens, 0, "seed {seed}");
    }
    assert!(
        rounds.load(Ordering::Relaxed) > 0,
        "no speculative round ran"
    );
}

const SEEDS: u64 = 600;

/// Tokens 1-3 of `SEEDS` sampled answers (the first from the prefill, the next two from a
/// speculative step when drafting), and the drafts checked and kept over all of them.
fn sampled_answers(
    solo: &Solo,
    prompt: &[u32],
    params: &GenerateParams,
    first_seed: u64,
) -> (Vec<Vec<u32>>, usize, usize) {
    let (mut drafted, mut kept) = (0, 0);
    let answers = (first_seed..first_seed + SEEDS)
        .map(|seed| {
            let mut params = params.clone();
            params.sampling.seed = Some(seed);
            let answer = solo.run(prompt, &params);
            drafted += answer.timings.draft_tokens;
            kept += answer.timings.accepted_tokens;
            answer.token_ids[..3].to_vec()
        })
        .collect();
    (answers, drafted, kept)
}

/// Top-2 sampling at temperature 1 (at most 8 answers of 3 tokens) with drafts from the greedy
/// continuation of the first token, each draft kept with its probability under the target (at
/// least one half): speculative answers follow plain sampling's law.
#[test]
fn sampled_rows_keep_plain_samplings_law() {
    let solo = Solo::open("releases/qwen3-0.6b");
    let prompt = text_ids(8, 5, 10, 900);
    let sampling = SamplingParams {
        temperature: 1.0,
        top_k: 2,
        ..SamplingParams::default()
    };
    // The two first tokens sampling can give, and the greedy continuation after each.
    let mut first = greedy(1, SamplingParams::greedy());
    first.speculative.mode = Some(SpeculativeMode::Off);
    let top = solo.run(&prompt, &first).logprobs.unwrap()[0].top.clone();
    let continuations: Vec<(u32, Vec<u32>)> = top
        .iter()
        .map(|alternative| {
            let mut after = prompt.clone();
            after.push(alternative.token_id);
            let greedy_rest = solo.run(
                &after,
                &with_drafter(greedy(3, SamplingParams::greedy()), None),
            );
            (alternative.token_id, greedy_rest.token_ids)
        })
        .collect();
    let prompt_len = prompt.len();
    let table = continuations.clone();
    let guess = Drafter(Arc::new(move |history: &[u32], max: usize| {
        let generated = &history[prompt_len..];
        let Some((_, rest)) = table
            .iter()
            .find(|(first, _)| Some(first) == generated.first())
        else {
            return Vec::new();
        };
        // Following the greedy path drafted so far, else its next tokens anyway (a wrong guess).
        let done = generated.len() - 1;
        rest.iter().skip(done).take(max).copied().collect()
    }));
    let params = GenerateParams {
        max_tokens: 4,
        ignore_eos: true,
        sampling,
        ..GenerateParams::default()
    };
    let (plain, _, _) = sampled_answers(&solo, &prompt, &with_drafter(params.clone(), None), 0);
    let (speculative, drafted, kept) =
        sampled_answers(&solo, &prompt, &with_drafter(params, Some(guess)), SEEDS);
    // Drafts were checked, most kept, some refused.
    assert!(drafted > SEEDS as usize, "{drafted}");
    assert!(kept > drafted / 3 && kept < drafted, "{drafted} {kept}");
    let p = two_sample_p_value(&plain, &speculative);
    assert!(p > 1e-4, "speculative sampling's law differs: p = {p}");
    // The same test sees a skew: answers whose second token is always the greedy draft.
    let skewed: Vec<Vec<u32>> = speculative
        .iter()
        .map(|answer| {
            let (_, rest) = continuations
                .iter()
                .find(|(first, _)| *first == answer[0])
                .unwrap();
            vec![answer[0], rest[0], answer[2]]
        })
        .collect();
    let p = two_sample_p_value(&plain, &skewed);
    assert!(p < 1e-4, "a skewed law passed: p = {p}");
}

/// The draft head drafts for sampled rows by drawing from its own distribution processed as
/// the row's (q), kept by min(1, p/q). Both trunk and head are made to put their top 3 on the
/// same three tokens (a logit bias), each weighing them its own way: answers' first three
/// tokens follow plain sampling's law (two-sample chi-square), and some drafts are kept, some
/// not.
#[test]
fn the_draft_head_draws_for_sampled_rows_and_keeps_the_law() {
    const HEAD_SEEDS: u64 = 250;
    let dir = "releases/qwen3.5-0.8b";
    let tokenizer = ChatTokenizer::from_dir(&fixture(dir)).unwrap();
    let prompt = text_ids(12, 5, 10, 900);
    let answers = |loaded: &LoadedModel, mode, first: u64| {
        let (mut drafted, mut kept) = (0, 0);
        let answers: Vec<Vec<u32>> = (first..first + HEAD_SEEDS)
            .map(|seed| {
                let mut params = GenerateParams {
                    max_tokens: 4,
                    ignore_eos: true,
                    sampling: SamplingParams {
                        temperature: 1.0,
                        top_k: 3,
                        logit_bias: [(300, 20.0), (301, 20.0), (302, 20.0)].into(),
                        seed: Some(seed),
                        ..SamplingParams::default()
                    },
                    ..GenerateParams::default()
                };
                params.speculative = SpeculativeParams {
                    mode: Some(mode),
                    max_draft: 2,
                    drafter: None,
                    costs: None,
                };
                let answer = generate(
                    loaded.model.as_ref(),
                    &tokenizer,
                    &prompt,
                    &params,
                    &AtomicBool::new(false),
                    |_| {},
                )
                .unwrap();
                drafted += answer.timings.draft_tokens;
                kept += answer.timings.accepted_tokens;
                answer.token_ids[..3].to_vec()
            })
            .collect();
        (answers, drafted, kept)
    };
    let plain_model = load_model(&fixture(dir)).unwrap();
    let (plain, _, _) = answers(&plain_model, SpeculativeMode::Off, 0);
    drop(plain_model);
    let loaded = load_model_with(
        &fixture(dir),
        LoadOptions {
            draft_head: true,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let (drafted_answers, drafted, kept) = answers(&loaded, SpeculativeMode::Mtp, HEAD_SEEDS);
    assert!(
        drafted > HEAD_SEEDS as usize && kept > 0 && kept < drafted,
        "{drafted} drafted, {kept} kept"
    );
    let p = two_sample_p_value(&plain, &drafted_answers);
    assert!(p > 1e-4, "the head's drafts skewed the law: p = {p}");
}

/// A batch of a penalised greedy row, a seeded sampled row, a biased greedy row with a presence
/// penalty and a plain greedy row, each drafting with its own adversary, on a Gated DeltaNet
/// hybrid: each row equals its run alone (the greedy ones token for token with plain decode;
/// the sampled one with its speculative run alone: the same drafts and draws, per row).
#[test]
fn mixed_rows_in_a_batch_equal_their_solo_runs() {
    use rmlx_engine::engine::{Engine, EngineOptions, Prompt, Request};
    let dir = "releases/qwen3.5-0.8b";
    let solo = Solo::open(dir);
    let vocab = solo.loaded.model.vocab_size() as u32;
    let max_tokens = 16;
    let rows: Vec<(SamplingParams, Adversary)> = vec![
        (
            SamplingParams {
                repetition_penalty: Some(1.8),
                logit_bias: [(17, 6.0)].into(),
                ..SamplingParams::greedy()
            },
            Adversary::RightThenWrong,
        ),
        (
            SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                seed: Some(11),
                ..SamplingParams::default()
            },
            Adversary::RightThenWrong,
        ),
        (
            SamplingParams {
                presence_penalty: 1.5,
                logit_bias: [(17, 6.0)].into(),
                ..SamplingParams::greedy()
            },
            Adversary::AlwaysWrong,
        ),
        (SamplingParams::greedy(), Adversary::Oracle),
    ];
    let prompts: Vec<Vec<u32>> = (0..rows.len())
        .map(|row| text_ids(20 + 3 * row, 11 + row as u32, 10, 900))
        .collect();
    // Each row alone: plain, then with its drafter (built from the plain answer).
    let mut alone = Vec::new();
    for (prompt, (sampling, adversary)) in prompts.iter().zip(&rows) {
        let params = greedy(max_tokens, sampling.clone());
        let plain = solo.run(prompt, &with_drafter(params.clone(), None));
        let drafts = drafter(plain.token_ids.clone(), prompt.len(), *adversary, vocab);
        let params = with_drafter(params, Some(drafts));
        let speculative = solo.run(prompt, &params);
        if sampling.is_greedy() {
            assert_same(&plain, &speculative, &format!("{adversary:?} alone"));
        }
        alone.push((speculative, params));
    }
    drop(solo);
    let engine = Engine::start_with(EngineOptions {
        max_queue: 8,
        ..EngineOptions::default()
    })
    .unwrap();
    let handles: Vec<_> = prompts
        .iter()
        .zip(&alone)
        .map(|(prompt, (_, params))| {
            engine
                .submit(Request {
                    model: fixture(dir),
                    prompt: Prompt::Ids(prompt.clone()),
                    params: params.clone(),
                    ..Request::default()
                })
                .unwrap()
        })
        .collect();
    for (row, (handle, (solo_answer, _))) in handles.into_iter().zip(&alone).enumerate() {
        let batched = handle.wait().unwrap();
        assert!(batched.batched_with > 1, "row {row} ran alone");
        assert_same(solo_answer, &batched, &format!("batch row {row}"));
        assert!(
            batched.timings.draft_tokens > 0,
            "row {row} drafted nothing"
        );
    }
}
