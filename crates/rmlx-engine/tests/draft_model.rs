//! A separate draft model (`--draft-model`, models/draft_model.rs, generate/draft.rs): greedy
//! output with its drafts equals plain decode token for token for every family's release
//! structure (the release pairs users run: Qwen3-0.6B for Qwen3-30B-A3B, Qwen3.5-0.8B for
//! Qwen3.6-35B-A3B, Qwen3-VL-2B for Qwen3-VL-8B, Gemma 4 E2B for Gemma 4 31B), alone, in a batch
//! of rows with other proposers, and on the next turn from the prefix cache; a model drafting
//! for itself keeps every draft; a draft model of another tokenizer is refused at load.

mod common;

use std::sync::atomic::AtomicBool;

use common::{answer_all, assert_same, fixture, text_ids};
use rmlx_engine::{
    chat::ChatTokenizer,
    engine::{Engine, EngineOptions, Prompt, Request},
    generate::{generate, Completion, GenerateParams},
    models::{draft_model, load_model, LoadedModel},
    speculative::{SpeculativeMode, SpeculativeParams},
};

/// (target, draft) of each family, as released.
const PAIRS: &[(&str, &str)] = &[
    ("releases/qwen3-30b-a3b", "releases/qwen3-0.6b"),
    ("releases/qwen3.6-35b-a3b", "releases/qwen3.5-0.8b"),
    (
        "releases/qwen3-vl-8b-instruct",
        "releases/qwen3-vl-2b-instruct",
    ),
    ("releases/gemma-4-31b-it", "releases/gemma-4-e2b-it"),
];

/// A logit bias that makes target and draft both pick one token often but not always, so
/// some drafts are kept and some not (random weights otherwise never agree). Gemma 4 caps its
/// logits (30 tanh(x / 30)) and its random logits are small: a smaller bias does there what
/// this one does elsewhere.
const PARTIAL_BIAS: (u32, f32) = (300, 12.0);

fn partial_bias(target: &str) -> f32 {
    match target.contains("gemma") {
        true => 3.0,
        false => PARTIAL_BIAS.1,
    }
}

fn params(max_tokens: usize, mode: SpeculativeMode, bias: Option<f32>) -> GenerateParams {
    let mut params = GenerateParams {
        max_tokens,
        ignore_eos: true,
        logprobs: Some(2),
        speculative: SpeculativeParams {
            mode: Some(mode),
            max_draft: 3,
            drafter: None,
            costs: None,
        },
        ..GenerateParams::default()
    };
    if let Some(bias) = bias {
        params.sampling.logit_bias = [(PARTIAL_BIAS.0, bias)].into();
    }
    params
}

fn run(loaded: &LoadedModel, dir: &str, prompt: &[u32], params: &GenerateParams) -> Completion {
    let tokenizer = ChatTokenizer::from_dir(&fixture(dir)).unwrap();
    generate(
        loaded.model.as_ref(),
        &tokenizer,
        prompt,
        params,
        &AtomicBool::new(false),
        |_| {},
    )
    .unwrap()
}

fn paired(target: &str, draft: &str) -> LoadedModel {
    draft_model::attach(load_model(&fixture(target)).unwrap(), &fixture(draft)).unwrap()
}

#[test]
fn every_family_with_its_draft_model_is_exact_alone() {
    for &(target, draft) in PAIRS {
        let plain_model = load_model(&fixture(target)).unwrap();
        let loaded = paired(target, draft);
        assert_eq!(
            loaded.info.draft_model.as_deref(),
            Some(fixture(draft).as_path())
        );
        // Its caches ride beside the target's in every row: the batch's KV budget counts them.
        let draft_alone = load_model(&fixture(draft)).unwrap();
        assert_eq!(
            loaded.info.kv_bytes_per_token,
            plain_model.info.kv_bytes_per_token + draft_alone.info.kv_bytes_per_token,
            "{target} drafted by {draft}"
        );
        drop(draft_alone);
        let prompt = text_ids(40, 13, 10, 900);
        for bias in [None, Some(partial_bias(target))] {
            let plain = run(
                &plain_model,
                target,
                &prompt,
                &params(20, SpeculativeMode::Off, bias),
            );
            for mode in [SpeculativeMode::Draft, SpeculativeMode::Auto] {
                let answer = run(&loaded, target, &prompt, &params(20, mode, bias));
                let what = format!("{target} drafted by {draft}, {mode:?}, bias {bias:?}");
                assert_same(&plain, &answer, &what);
                if mode == SpeculativeMode::Draft {
                    let timings = &answer.timings;
                    assert!(timings.draft_tokens > 0, "{what}: nothing drafted");
                    if bias.is_some() {
                        assert!(
                            timings.accepted_tokens > 0
                                && timings.accepted_tokens < timings.draft_tokens,
                            "{what}: {timings:?}"
                        );
                    }
                }
            }
        }
    }
}

/// The draft model is the target itself: every draft is the target's own argmax.
#[test]
fn a_model_drafting_for_itself_keeps_every_draft() {
    let dir = "releases/qwen3.5-0.8b";
    let plain_model = load_model(&fixture(dir)).unwrap();
    let loaded = paired(dir, dir);
    let prompt = text_ids(30, 17, 10, 900);
    let plain = run(
        &plain_model,
        dir,
        &prompt,
        &params(24, SpeculativeMode::Off, None),
    );
    let answer = run(
        &loaded,
        dir,
        &prompt,
        &params(24, SpeculativeMode::Draft, None),
    );
    assert_same(&plain, &answer, "self-drafted");
    let timings = &answer.timings;
    assert!(timings.draft_tokens >= 15, "{timings:?}");
    assert_eq!(timings.accepted_tokens, timings.draft_tokens);
}

#[test]
fn a_draft_model_of_another_tokenizer_is_refused_at_load() {
    let target = load_model(&fixture("releases/qwen3-0.6b")).unwrap();
    let error = draft_model::attach(target, &fixture("releases/gemma-4-e2b-it"))
        .err()
        .expect("a Gemma draft for a Qwen model")
        .to_string();
    assert!(
        error.contains("gemma-4-e2b-it") && error.contains("qwen3-0.6b"),
        "{error}"
    );
    assert!(error.contains("tokenizer"), "{error}");
}

fn engine(draft: &str) -> Engine {
    Engine::start_with(EngineOptions {
        max_queue: 8,
        draft_model: Some(fixture(draft)),
        ..EngineOptions::default()
    })
    .unwrap()
}

/// Rows drafting with the draft model, prompt lookup, `auto` and none share a batch; the rows
/// that keep drafts keep different counts. Each equals its plain run alone.
#[test]
fn batched_rows_with_a_draft_model_equal_their_plain_runs() {
    let (target, draft) = PAIRS[1];
    let plain_model = load_model(&fixture(target)).unwrap();
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|row| text_ids(20 + 5 * row, 51 + row as u32, 10, 900))
        .collect();
    let bias = |row: usize| row.is_multiple_of(2).then_some(PARTIAL_BIAS.1);
    let plains: Vec<Completion> = prompts
        .iter()
        .enumerate()
        .map(|(row, prompt)| {
            run(
                &plain_model,
                target,
                prompt,
                &params(24, SpeculativeMode::Off, bias(row)),
            )
        })
        .collect();
    drop(plain_model);
    let engine = engine(draft);
    let modes = [
        SpeculativeMode::Draft,
        SpeculativeMode::Off,
        SpeculativeMode::Draft,
        SpeculativeMode::Lookup,
    ];
    let rows = prompts
        .iter()
        .zip(modes)
        .enumerate()
        .map(|(row, (prompt, mode))| (prompt.clone(), params(24, mode, bias(row))))
        .collect();
    let answers = answer_all(&engine, &fixture(target), rows);
    let (mut batched, mut kept) = (false, 0);
    for (row, (answer, plain)) in answers.into_iter().zip(&plains).enumerate() {
        batched |= answer.batched_with > 1;
        kept += answer.timings.accepted_tokens;
        assert_same(plain, &answer, &format!("batch row {row}"));
    }
    assert!(batched, "nothing ran batched");
    assert!(kept > 0, "no draft kept in the batch");
}

/// Turn 2 starts from turn 1's caches, the draft model's included (settled to the target's
/// length before they were stored): the answer equals a cold plain run's.
#[test]
fn the_next_turn_reuses_the_draft_models_caches_exactly() {
    let (target, draft) = PAIRS[0];
    let plain_model = load_model(&fixture(target)).unwrap();
    let first = text_ids(24, 61, 10, 900);
    let plain_first = run(
        &plain_model,
        target,
        &first,
        &params(20, SpeculativeMode::Off, Some(PARTIAL_BIAS.1)),
    );
    let mut second = first.clone();
    second.extend(&plain_first.token_ids);
    second.extend(text_ids(12, 62, 10, 900));
    let plain_second = run(
        &plain_model,
        target,
        &second,
        &params(20, SpeculativeMode::Off, Some(PARTIAL_BIAS.1)),
    );
    drop(plain_model);
    // Turn 1 drafting, or not drafting at all (the draft model then lags by the whole answer
    // and catches up before the entry is stored), alone or beside another request (its caches
    // then come out of the batch bounded by what they hold, and must still catch up).
    for (first_mode, beside) in [
        (SpeculativeMode::Draft, false),
        (SpeculativeMode::Off, false),
        (SpeculativeMode::Off, true),
    ] {
        let engine = engine(draft);
        let ask = |prompt: &[u32], mode| {
            engine
                .submit(Request {
                    model: fixture(target),
                    prompt: Prompt::Ids(prompt.to_vec()),
                    params: params(20, mode, Some(PARTIAL_BIAS.1)),
                    ..Request::default()
                })
                .unwrap()
                .wait()
                .unwrap()
        };
        let answer_first = match beside {
            false => ask(&first, first_mode),
            true => {
                // The other answers longer: turn 1's row leaves the batch while it runs.
                let other = text_ids(30, 63, 10, 900);
                let rows = vec![
                    (first.clone(), params(20, first_mode, Some(PARTIAL_BIAS.1))),
                    (other, params(40, first_mode, Some(PARTIAL_BIAS.1))),
                ];
                let mut answers = answer_all(&engine, &fixture(target), rows);
                assert!(answers[0].batched_with > 1, "turn 1 ran alone");
                answers.swap_remove(0)
            }
        };
        assert_same(&plain_first, &answer_first, "turn 1");
        let answer_second = ask(&second, SpeculativeMode::Draft);
        assert!(
            answer_second.cached_tokens > first.len(),
            "{first_mode:?}, beside another: {beside}: {}",
            answer_second.cached_tokens
        );
        assert_same(
            &plain_second,
            &answer_second,
            &format!("turn 2 after {first_mode:?}"),
        );
        assert!(answer_second.timings.draft_tokens > 0);
    }
}

/// Self-drafting in a batch of rows of different lengths (some drafting, one not, so the draft
/// model's caches grow ragged and catch up unevenly): every row keeps every draft, so the
/// draft model's caches held exactly each row's tokens throughout.
#[test]
fn self_drafting_rows_in_a_batch_keep_every_draft() {
    let dir = "releases/qwen3.5-0.8b";
    let engine = engine(dir);
    let modes = [
        SpeculativeMode::Draft,
        SpeculativeMode::Off,
        SpeculativeMode::Draft,
        SpeculativeMode::Draft,
    ];
    let handles: Vec<_> = modes
        .iter()
        .enumerate()
        .map(|(row, &mode)| {
            engine
                .submit(Request {
                    model: fixture(dir),
                    prompt: Prompt::Ids(text_ids(18 + 7 * row, 81 + row as u32, 10, 900)),
                    params: params(20 + 4 * row, mode, None),
                    ..Request::default()
                })
                .unwrap()
        })
        .collect();
    for (row, handle) in handles.into_iter().enumerate() {
        let answer = handle.wait().unwrap();
        let timings = &answer.timings;
        assert!(answer.batched_with > 1, "row {row} ran alone");
        if modes[row] == SpeculativeMode::Draft {
            assert!(timings.draft_tokens > 0, "row {row}");
            assert_eq!(
                timings.accepted_tokens, timings.draft_tokens,
                "row {row}: {timings:?}"
            );
        }
    }
}

/// A picture in the prompt: the draft model takes in the prompt's token ids only (no image
/// features), so its drafts there are weaker, never wrong: answers with an image, and a text
/// row beside them in a batch, equal the plain ones (Qwen3-VL drafted by Qwen3-VL-2B, Gemma 4
/// 31B by E2B: both vision families).
#[test]
fn images_in_the_prompt_with_a_draft_model_are_exact() {
    use rmlx_engine::chat::TemplateOptions;
    let picture = image::open(fixture("vision-images").join("gradient_64x48.png"))
        .unwrap()
        .to_rgb8();
    for &(target, draft) in &[PAIRS[2], PAIRS[3]] {
        let request = |image: bool, text: &str, mode| Request {
            model: fixture(target),
            prompt: Prompt::Chat {
                messages: vec![match image {
                    true => serde_json::json!({"role": "user", "content": [
                        {"type": "image"}, {"type": "text", "text": text}]}),
                    false => serde_json::json!({"role": "user", "content": text}),
                }],
                options: TemplateOptions {
                    add_generation_prompt: true,
                    ..Default::default()
                },
            },
            images: match image {
                true => vec![picture.clone()],
                false => Vec::new(),
            },
            params: params(16, mode, Some(partial_bias(target))),
            ..Request::default()
        };
        let plain_engine = Engine::start(8).unwrap();
        let answer =
            |engine: &Engine, request: Request| engine.submit(request).unwrap().wait().unwrap();
        let with_image = answer(
            &plain_engine,
            request(true, "What is in the picture?", SpeculativeMode::Off),
        );
        let text_only = answer(
            &plain_engine,
            request(false, "Name three rivers.", SpeculativeMode::Off),
        );
        drop(plain_engine);
        let engine = engine(draft);
        let handles = [
            request(true, "What is in the picture?", SpeculativeMode::Draft),
            request(false, "Name three rivers.", SpeculativeMode::Draft),
        ]
        .map(|request| engine.submit(request).unwrap());
        let [a, b] = handles.map(|handle| handle.wait().unwrap());
        assert_same(&with_image, &a, &format!("{target} image, drafted"));
        assert_same(&text_only, &b, &format!("{target} text beside it, drafted"));
        assert!(a.timings.draft_tokens > 0 && b.timings.draft_tokens > 0);
    }
}

/// Sampled rows draw their drafts from the draft model's distribution processed as theirs (q)
/// and keep them with probability min(1, p/q). Both models' top 3 are made the same three
/// tokens (a logit bias), each model weighing them its own way, so p and q overlap without
/// being equal: over 300 seeds each, answers' first three tokens follow plain sampling's law
/// (two-sample chi-square). A model drafting for itself under sampling keeps nearly every
/// draft (q = p up to rounding), where drafting its argmax would keep only p(argmax).
#[test]
fn sampled_rows_draw_drafts_from_the_draft_model_and_keep_the_law() {
    const SEEDS: u64 = 300;
    let sampled = |mode| {
        let mut params = params(4, mode, None);
        params.logprobs = None;
        params.sampling.temperature = 1.0;
        params.sampling.top_k = 3;
        params.sampling.logit_bias = [(300, 20.0), (301, 20.0), (302, 20.0)].into();
        params
    };
    let answers = |loaded: &LoadedModel, dir: &str, mode, first: u64| {
        let prompt = text_ids(8, 5, 10, 900);
        let (mut drafted, mut kept) = (0, 0);
        let answers: Vec<Vec<u32>> = (first..first + SEEDS)
            .map(|seed| {
                let mut params = sampled(mode);
                params.sampling.seed = Some(seed);
                let answer = run(loaded, dir, &prompt, &params);
                drafted += answer.timings.draft_tokens;
                kept += answer.timings.accepted_tokens;
                answer.token_ids[..3].to_vec()
            })
            .collect();
        (answers, drafted, kept)
    };
    let (target, draft) = ("releases/qwen3-4b", "releases/qwen3-0.6b");
    let plain_model = load_model(&fixture(target)).unwrap();
    let (plain, _, _) = answers(&plain_model, target, SpeculativeMode::Off, 0);
    drop(plain_model);
    let loaded = paired(target, draft);
    let (drafted_answers, drafted, kept) = answers(&loaded, target, SpeculativeMode::Draft, SEEDS);
    assert!(
        drafted > SEEDS as usize && kept > 0 && kept < drafted,
        "{drafted} drafted, {kept} kept"
    );
    let p = common::two_sample_p_value(&plain, &drafted_answers);
    assert!(p > 1e-4, "the draft model's drafts skewed the law: p = {p}");
    // The same test sees a skew: the second token always the first of the three.
    let skewed: Vec<Vec<u32>> = drafted_answers
        .iter()
        .map(|answer| vec![answer[0], 300, answer[2]])
        .collect();
    assert!(common::two_sample_p_value(&plain, &skewed) < 1e-4);

    let own = paired(draft, draft);
    let (_, drafted, kept) = answers(&own, draft, SpeculativeMode::Draft, 0);
    assert!(
        kept as f64 >= 0.98 * drafted as f64,
        "self-drafting under sampling kept {kept} of {drafted}"
    );
}

/// A model with its own draft head and a draft model beside it: rows drafting with the head
/// and rows drafting with the draft model share a batch (each row takes its own proposer's
/// drafts); each equals its plain run.
#[test]
fn head_rows_and_draft_model_rows_share_a_batch_exactly() {
    let (target, draft) = PAIRS[1];
    let plain_model = load_model(&fixture(target)).unwrap();
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|row| text_ids(20 + 4 * row, 91 + row as u32, 10, 900))
        .collect();
    let plains: Vec<Completion> = prompts
        .iter()
        .map(|prompt| {
            run(
                &plain_model,
                target,
                prompt,
                &params(20, SpeculativeMode::Off, Some(PARTIAL_BIAS.1)),
            )
        })
        .collect();
    drop(plain_model);
    let engine = Engine::start_with(EngineOptions {
        max_queue: 8,
        speculative: SpeculativeMode::Mtp,
        draft_model: Some(fixture(draft)),
        ..EngineOptions::default()
    })
    .unwrap();
    let modes = [
        SpeculativeMode::Mtp,
        SpeculativeMode::Draft,
        SpeculativeMode::Draft,
        SpeculativeMode::Mtp,
    ];
    let rows = prompts
        .iter()
        .zip(modes)
        .map(|(prompt, mode)| (prompt.clone(), params(20, mode, Some(PARTIAL_BIAS.1))))
        .collect();
    let answers = answer_all(&engine, &fixture(target), rows);
    for (row, (answer, plain)) in answers.into_iter().zip(&plains).enumerate() {
        assert!(answer.batched_with > 1, "row {row} ran alone");
        assert!(answer.timings.draft_tokens > 0, "row {row} drafted nothing");
        assert_same(plain, &answer, &format!("row {row} ({:?})", modes[row]));
    }
}
