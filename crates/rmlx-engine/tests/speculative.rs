//! Speculative decoding is exact: greedy output with drafts equals plain greedy output token
//! for token (log-probs within 1e-5) on the fp32 release fixtures of every family (KV, MoE,
//! Gated DeltaNet hybrids, Gemma 4's sliding windows and KV-shared layers), solo and in a batch
//! of rows with different proposers. The proposers are adversaries of known accuracy: an oracle
//! (always right: every draft kept), an always-wrong one (none kept), and one right for j tokens
//! then wrong with j cycling through 0..=k, so every cache kind is cut back by every length.
//! A solo step is one host synchronisation (counted). Prompt lookup and its depth control keep
//! output exact; stops inside drafts end where plain decode ends; the prefix cache stores only
//! kept tokens.

mod common;

use std::sync::Arc;

use common::{
    adversary::{drafter, Adversary, Solo, MAX_DRAFT},
    assert_same, fixture, text_ids,
};
use rmlx_engine::{
    engine::{Engine, EngineOptions, Prompt, Request},
    generate::{Completion, GenerateParams},
    sample::SamplingParams,
    speculative::{Drafter, SpeculativeMode, SpeculativeParams},
};

fn params(max_tokens: usize, drafter: Option<Drafter>) -> GenerateParams {
    GenerateParams {
        max_tokens,
        ignore_eos: true,
        logprobs: Some(2),
        speculative: SpeculativeParams {
            mode: Some(SpeculativeMode::Off),
            max_draft: MAX_DRAFT,
            drafter,
            costs: None,
        },
        ..GenerateParams::default()
    }
}

/// Every adversary alone equals plain greedy, and draft counts show what was exercised.
fn check_solo(dir: &str, prompt_len: usize, max_tokens: usize) {
    let solo = Solo::open(dir);
    let model = solo.model();
    let prompt = text_ids(prompt_len, 7, 10, 900);
    let run = |params: &GenerateParams| solo.run(&prompt, params);
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
    let solo = Solo::open(dir);
    let model = solo.model();
    let vocab = model.vocab_size() as u32;
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|row| text_ids(prompt_len + 3 * row, 11 + row as u32, 10, 900))
        .collect();
    let plains: Vec<Completion> = prompts
        .iter()
        .map(|prompt| solo.run(prompt, &params(max_tokens, None)))
        .collect();
    drop(solo);
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

/// Seeded sampled rows that do not draft, beside a greedy row whose oracle drafts every step:
/// in each speculative step they draw their one token together (verify.rs), each the token it
/// draws alone, log-probs included.
#[test]
fn sampled_rows_beside_a_drafting_row_answer_as_they_do_alone() {
    let dir = "releases/qwen3-0.6b";
    let solo = Solo::open(dir);
    let vocab = solo.model().vocab_size() as u32;
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|row| text_ids(20 + 3 * row, 11 + row as u32, 10, 900))
        .collect();
    // Row 0 answers three times longer, so the others' steps are speculative ones.
    let mut rows: Vec<GenerateParams> = vec![params(48, None)];
    for (seed, temperature, top_k) in [(1, 1.0, 0), (2, 0.8, 0), (3, 1.2, 10)] {
        let mut sampled = params(16, None);
        sampled.sampling = SamplingParams {
            temperature,
            top_k,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        rows.push(sampled);
    }
    let plains: Vec<Completion> = prompts
        .iter()
        .zip(&rows)
        .map(|(prompt, params)| solo.run(prompt, params))
        .collect();
    drop(solo);
    let oracle = drafter(
        plains[0].token_ids.clone(),
        prompts[0].len(),
        Adversary::Oracle,
        vocab,
    );
    rows[0] = params(48, Some(oracle));
    let engine = Engine::start_with(EngineOptions {
        max_queue: 8,
        ..EngineOptions::default()
    })
    .unwrap();
    let hold = engine.hold_for_warm_up();
    let handles: Vec<_> = prompts
        .iter()
        .zip(&rows)
        .map(|(prompt, params)| {
            let request = Request {
                model: fixture(dir),
                prompt: Prompt::Ids(prompt.clone()),
                params: params.clone(),
                ..Request::default()
            };
            engine.submit(request).unwrap()
        })
        .collect();
    drop(hold);
    for (row, (handle, plain)) in handles.into_iter().zip(&plains).enumerate() {
        let completion = handle.wait().unwrap();
        assert_eq!(completion.batched_with, 4, "row {row}");
        assert_same(plain, &completion, &format!("row {row}"));
        if row == 0 {
            let timings = &completion.timings;
            assert!(timings.accepted_tokens >= 36, "{timings:?}");
        }
    }
}

#[test]
fn batched_rows_with_mixed_proposers_equal_their_solo_runs() {
    check_batch("releases/qwen3-0.6b", 20, 16);
    check_batch("releases/qwen3.5-0.8b", 20, 16);
    check_batch("releases/gemma-4-e2b-it", 80, 24);
}

/// The solo and batch checks again with every short step (verify steps, short prompts)
/// attending over its cache's whole buffer, the unwritten and rolled-back columns masked, as
/// MLX CUDA runs them (`attention::reads_whole_buffer`): in a child process of this test
/// binary, since `RMLX_ATTEND_WHOLE_BUFFER` is read once per process.
#[test]
fn short_steps_over_the_whole_buffer_stay_exact() {
    common::rerun_in_child_with(
        "RMLX_ATTEND_WHOLE_BUFFER",
        &[
            "qwen3_kv_and_moe_solo",
            "qwen3_5_gated_deltanet_solo",
            "batched_rows_with_mixed_proposers_equal_their_solo_runs",
        ],
    );
}

/// The ragged batch check again with every one-query step under a mask computed by grouped
/// matmuls over each KV head's query heads instead of MLX's SDPA (`RMLX_GROUPED_ONE_QUERY=1`,
/// CUDA's default; engine.rs checks every family's padded batch the same way): each
/// row must still equal its solo run, whose unmasked steps take SDPA. In a child process, as
/// above.
#[test]
fn masked_one_query_steps_grouped_over_kv_heads_stay_exact() {
    common::rerun_in_child_with(
        "RMLX_GROUPED_ONE_QUERY",
        &["one_draft_then_plain_steps_in_a_batch"],
    );
}

/// One host synchronisation per speculative step: a run's decode evaluations, less those of
/// a run that only prefilled, equal its steps.
#[test]
fn a_speculative_step_waits_on_the_device_once() {
    let dir = "releases/qwen3-0.6b";
    let solo = Solo::open(dir);
    let prompt = text_ids(24, 5, 10, 900);
    let quiet = |max_tokens: usize, drafter: Option<Drafter>| {
        let mut params = params(max_tokens, drafter);
        params.logprobs = None;
        let before = rmlx_engine::runtime::evals();
        let completion = solo.run(&prompt, &params);
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

/// Prompt lookup reads a row's newest token before queuing its next step (a wait on the device)
/// only where a draft is possible: where the token before the newest occurred earlier in the
/// conversation (every match spans both). Elsewhere the step stays queued ahead of the read, as
/// plain decode's is: on a GPU a wait adds the step's build time to every step (the Qwen3.6
/// shape's serve decode under `auto` at 0.69x mlx-vlm, H100 session 23).
#[test]
fn lookup_waits_for_the_newest_token_only_where_a_draft_is_possible() {
    let dir = "releases/qwen3-0.6b";
    let solo = Solo::open(dir);
    let prompt = text_ids(24, 5, 10, 900);
    let max_tokens = 40;
    let plain = solo.run(&prompt, &params(max_tokens, None));
    let all: Vec<u32> = prompt.iter().chain(&plain.token_ids).copied().collect();
    // The step that computes token p feeds token p - 1; it may draft where token p - 2
    // occurred before.
    let possible = (prompt.len() + 1..all.len())
        .filter(|&p| all[..p - 2].contains(&all[p - 2]))
        .count();
    assert!(possible * 2 < max_tokens, "{possible} of {max_tokens}");
    for mode in [SpeculativeMode::Lookup, SpeculativeMode::Auto] {
        let mut lookup = params(max_tokens, None);
        lookup.logprobs = None;
        lookup.speculative.mode = Some(mode);
        let before = rmlx_engine::generate::draft_reads();
        let speculative = solo.run(&prompt, &lookup);
        let reads = rmlx_engine::generate::draft_reads() - before;
        assert_eq!(speculative.token_ids, plain.token_ids, "{mode:?}");
        assert!(
            reads <= possible,
            "{mode:?}: {reads} reads, {possible} possible"
        );
        eprintln!("{mode:?}: {reads} reads, {possible} possible");
    }
}

/// Prompt lookup on a prompt that repeats itself: exact on every family, and drafts are kept
/// at lookup's fixed depth (the tiny random models repeat their own output more than the
/// prompt; `auto` may switch off before a repeat, and the Qwen3.5 fixture's
/// answer has no repeated pair, so only its exactness is checked).
#[test]
fn prompt_lookup_is_exact_and_its_drafts_are_kept() {
    let mut kept = 0;
    for dir in [
        "releases/qwen3-0.6b",
        "releases/qwen3.5-0.8b",
        "releases/gemma-4-e2b-it",
        "releases/qwen3-vl-2b-instruct",
    ] {
        let solo = Solo::open(dir);
        let phrase = text_ids(12, 3, 10, 900);
        let prompt: Vec<u32> = phrase.iter().cycle().take(12 * 6).copied().collect();
        let plain = solo.run(&prompt, &params(96, None));
        for mode in [SpeculativeMode::Lookup, SpeculativeMode::Auto] {
            let mut lookup = params(96, None);
            lookup.speculative.mode = Some(mode);
            let speculative = solo.run(&prompt, &lookup);
            assert_same(&plain, &speculative, &format!("{dir} {mode:?}"));
            let timings = &speculative.timings;
            eprintln!(
                "{dir} {mode:?}: {} drafted, {} kept",
                timings.draft_tokens, timings.accepted_tokens
            );
            if mode == SpeculativeMode::Lookup && !dir.contains("qwen3.5") {
                assert!(timings.accepted_tokens > 0, "{dir} {mode:?}: no draft kept");
            }
            kept += timings.accepted_tokens;
        }
    }
    assert!(kept > 0);
}

/// `auto` with a proposer that is always wrong drafts for a few steps, then only probes.
#[test]
fn auto_stops_drafting_when_drafts_are_wrong() {
    let dir = "releases/qwen3-0.6b";
    let solo = Solo::open(dir);
    let prompt = text_ids(20, 9, 10, 900);
    let plain = solo.run(&prompt, &params(80, None));
    let wrong = drafter(
        plain.token_ids.clone(),
        prompt.len(),
        Adversary::AlwaysWrong,
        1024,
    );
    let mut auto = params(80, Some(wrong));
    auto.speculative.mode = Some(SpeculativeMode::Auto);
    let speculative = solo.run(&prompt, &auto);
    assert_same(&plain, &speculative, "auto, always wrong");
    // At most 8 steps before it stops (4 drafts each), then probes of 1 after 8, 16, 32 plain
    // steps: far fewer than the 4 per step `lookup`'s fixed depth would draft.
    let drafted = speculative.timings.draft_tokens;
    assert!((1..=8 * 4 + 3).contains(&drafted), "{drafted} drafted");
}

/// A stop token or a stop string inside the drafts ends the answer where plain decode ends it.
#[test]
fn stops_inside_drafts_end_the_answer_where_plain_decode_does() {
    let dir = "releases/qwen3.5-0.8b";
    let solo = Solo::open(dir);
    let prompt = text_ids(20, 13, 10, 900);
    let free = solo.run(&prompt, &params(24, None));
    let oracle = drafter(free.token_ids.clone(), prompt.len(), Adversary::Oracle, 1);
    let stop_token = free.token_ids[6];
    let stop_text = solo
        .tokenizer
        .decode(&free.token_ids[9..11], false)
        .unwrap();
    type Set = Box<dyn Fn(&mut GenerateParams)>;
    let cases: [(&str, Set); 2] = [
        (
            "stop token",
            Box::new(move |p: &mut GenerateParams| p.stop_token_ids = vec![stop_token]),
        ),
        (
            "stop string",
            Box::new(move |p: &mut GenerateParams| p.stop = vec![stop_text.clone()]),
        ),
    ];
    for (what, set) in cases {
        let mut plain_params = params(24, None);
        set(&mut plain_params);
        let plain = solo.run(&prompt, &plain_params);
        let mut spec_params = params(24, Some(oracle.clone()));
        set(&mut spec_params);
        let speculative = solo.run(&prompt, &spec_params);
        assert!(
            plain.token_ids.len() < 24,
            "{what}: the plain run did not stop early"
        );
        assert_same(&plain, &speculative, what);
        assert_eq!(plain.text, speculative.text, "{what}");
        assert_eq!(plain.finish_reason, speculative.finish_reason, "{what}");
        assert_eq!(plain.stop_sequence, speculative.stop_sequence, "{what}");
    }
}

/// The prefix cache keeps only the tokens a speculative answer kept: the next turn reuses
/// them and answers as a cold run does (a KV family and a Gated DeltaNet hybrid).
#[test]
fn the_next_turn_reuses_a_speculative_answer_exactly() {
    for dir in ["releases/qwen3-0.6b", "releases/qwen3.5-0.8b"] {
        let solo = Solo::open(dir);
        let model = solo.model();
        let vocab = model.vocab_size() as u32;
        let first = text_ids(24, 21, 10, 900);
        let plain_first = solo.run(&first, &params(20, None));
        let mut second = first.clone();
        second.extend(&plain_first.token_ids);
        second.extend(text_ids(6, 22, 10, 900));
        let plain_second = solo.run(&second, &params(12, None));
        drop(solo);
        let engine = Engine::start(4).unwrap();
        let run = |prompt: &[u32], max_tokens: usize, drafts: Drafter| {
            engine
                .submit(Request {
                    model: fixture(dir),
                    prompt: Prompt::Ids(prompt.to_vec()),
                    params: params(max_tokens, Some(drafts)),
                    ..Request::default()
                })
                .unwrap()
                .wait()
                .unwrap()
        };
        let answer = run(
            &first,
            20,
            drafter(
                plain_first.token_ids.clone(),
                first.len(),
                Adversary::RightThenWrong,
                vocab,
            ),
        );
        assert_same(&plain_first, &answer, &format!("{dir} turn 1"));
        let next = run(
            &second,
            12,
            drafter(
                plain_second.token_ids.clone(),
                second.len(),
                Adversary::Oracle,
                vocab,
            ),
        );
        assert!(
            next.cached_tokens >= first.len(),
            "{dir}: turn 2 reused {} tokens",
            next.cached_tokens
        );
        assert_same(&plain_second, &next, &format!("{dir} turn 2"));
    }
}

/// One right draft at the first step, then plain steps to the end (the ragged bench's rows).
#[test]
fn one_draft_then_plain_steps_to_the_end() {
    let dir = "head-sizes/qwen3-hd128";
    let solo = Solo::open(dir);
    for (prompt_len, max_tokens) in [(128, 128), (128, 100), (100, 156)] {
        let prompt = text_ids(prompt_len, 17, 10, 400);
        let mut plain_params = params(max_tokens, None);
        plain_params.logprobs = None;
        let plain = solo.run(&prompt, &plain_params);
        let first = plain.token_ids[0];
        let once = Drafter(Arc::new(move |history: &[u32], _| {
            match history.len() == prompt_len {
                true => vec![first],
                false => Vec::new(),
            }
        }));
        let mut spec_params = params(max_tokens, Some(once));
        spec_params.logprobs = None;
        spec_params.speculative.max_draft = 1;
        let speculative = solo.run(&prompt, &spec_params);
        let differs = plain
            .token_ids
            .iter()
            .zip(&speculative.token_ids)
            .position(|(a, b)| a != b);
        assert_eq!(differs, None, "prompt {prompt_len}, {max_tokens} tokens");
    }
}

/// The same in a batch of eight through the engine (rows join one by one, so the batch is
/// padded): every row, or every other row, keeps one draft at its first step.
#[test]
fn one_draft_then_plain_steps_in_a_batch() {
    let dir = "head-sizes/qwen3-hd128";
    let engine = Engine::start_with(EngineOptions {
        max_queue: 8,
        prefix_cache_bytes: Some(0),
        prefix_snapshot_bytes: Some(0),
        ..EngineOptions::default()
    })
    .unwrap();
    for (prompt_len, max_tokens) in [(128usize, 128usize), (100, 156)] {
        let prompts: Vec<Vec<u32>> = (0..8)
            .map(|s| text_ids(prompt_len, 1000 + s, 0, 1024))
            .collect();
        let run = |drafts: Vec<Option<u32>>| -> Vec<Completion> {
            let handles: Vec<_> = prompts
                .iter()
                .zip(drafts)
                .map(|(prompt, first)| {
                    let drafter = first.map(|token| {
                        Drafter(Arc::new(move |history: &[u32], _: usize| {
                            match history.len() == prompt_len {
                                true => vec![token],
                                false => Vec::new(),
                            }
                        }))
                    });
                    let mut params = params(max_tokens, drafter);
                    params.logprobs = None;
                    params.speculative.max_draft = 1;
                    engine
                        .submit(Request {
                            model: fixture(dir),
                            prompt: Prompt::Ids(prompt.clone()),
                            params,
                            ..Request::default()
                        })
                        .unwrap()
                })
                .collect();
            handles.into_iter().map(|h| h.wait().unwrap()).collect()
        };
        let plain = run(vec![None; 8]);
        let firsts: Vec<Option<u32>> = plain.iter().map(|c| Some(c.token_ids[0])).collect();
        let every_other: Vec<Option<u32>> = firsts
            .iter()
            .enumerate()
            .map(|(row, first)| first.filter(|_| row % 2 == 0))
            .collect();
        for (name, drafts) in [("all", firsts.clone()), ("every other", every_other)] {
            let speculative = run(drafts);
            for (row, (a, b)) in plain.iter().zip(&speculative).enumerate() {
                let differs = a
                    .token_ids
                    .iter()
                    .zip(&b.token_ids)
                    .position(|(x, y)| x != y);
                assert_eq!(
                    differs, None,
                    "{name}: row {row}, prompt {prompt_len}, {max_tokens} tokens"
                );
            }
        }
    }
}

/// A conversation with an image (its soft tokens in the prompt, MRoPE positions after them for
/// Qwen): drafted answers equal plain ones, alone and batched beside a text row.
#[test]
fn images_in_the_prompt_speculate_exactly() {
    use rmlx_engine::chat::TemplateOptions;
    let picture = image::open(fixture("vision-images").join("gradient_64x48.png"))
        .unwrap()
        .to_rgb8();
    for dir in ["releases/qwen3-vl-2b-instruct", "releases/gemma-4-e2b-it"] {
        let engine = Engine::start(8).unwrap();
        let request = |image: bool, text: &str, drafter: Option<Drafter>| Request {
            model: fixture(dir),
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
            images: if image {
                vec![picture.clone()]
            } else {
                Vec::new()
            },
            params: params(16, drafter),
            ..Request::default()
        };
        let answer = |request: Request| engine.submit(request).unwrap().wait().unwrap();
        let with_image = answer(request(true, "What is in the picture?", None));
        let text_only = answer(request(false, "Name three rivers of Europe.", None));
        let vocab = 1024;
        let oracle = |plain: &Completion, adversary| {
            Some(drafter(
                plain.token_ids.clone(),
                plain.prompt_ids.len(),
                adversary,
                vocab,
            ))
        };
        let alone = answer(request(
            true,
            "What is in the picture?",
            oracle(&with_image, Adversary::RightThenWrong),
        ));
        assert_same(&with_image, &alone, &format!("{dir} image alone"));
        assert!(alone.timings.accepted_tokens > 0);
        let handles = [
            request(
                true,
                "What is in the picture?",
                oracle(&with_image, Adversary::Oracle),
            ),
            request(
                false,
                "Name three rivers of Europe.",
                oracle(&text_only, Adversary::RightThenWrong),
            ),
            request(
                true,
                "What is in the picture?",
                oracle(&with_image, Adversary::AlwaysWrong),
            ),
        ]
        .map(|request| engine.submit(request).unwrap());
        let [a, b, c] = handles.map(|handle| handle.wait().unwrap());
        assert_same(&with_image, &a, &format!("{dir} image oracle, batched"));
        assert_same(
            &text_only,
            &b,
            &format!("{dir} text beside images, batched"),
        );
        assert_same(
            &with_image,
            &c,
            &format!("{dir} image always wrong, batched"),
        );
        assert!(
            a.batched_with > 1 || b.batched_with > 1,
            "{dir}: nothing batched"
        );
    }
}

/// A cancel during speculative decoding stops the answer between steps, as without drafts: the
/// tokens it gave are the plain answer's first ones.
#[test]
fn cancel_stops_a_speculative_answer_between_steps() {
    let dir = "releases/qwen3-0.6b";
    let solo = Solo::open(dir);
    let prompt = text_ids(16, 41, 10, 900);
    let plain = solo.run(&prompt, &params(1500, None));
    drop(solo);
    let engine = Engine::start(4).unwrap();
    let oracle = drafter(plain.token_ids.clone(), prompt.len(), Adversary::Oracle, 1);
    let handle = engine
        .submit(Request {
            model: fixture(dir),
            prompt: Prompt::Ids(prompt.clone()),
            params: params(1500, Some(oracle)),
            ..Request::default()
        })
        .unwrap();
    loop {
        if let rmlx_engine::engine::Event::Delta { .. } = handle.events.recv().unwrap() {
            break;
        }
    }
    handle.cancel();
    let completion = handle.wait().unwrap();
    assert_eq!(
        completion.finish_reason,
        rmlx_engine::generate::FinishReason::Cancelled
    );
    let given = completion.completion_tokens;
    assert!(given < 1500, "{given}");
    assert_eq!(completion.token_ids[..], plain.token_ids[..given]);
}

/// `auto` is the engine's default: a request that does not choose drafts by prompt lookup when
/// greedy or sampled without a seed, and a seeded sampled request decodes plainly (a depth
/// chosen from timings would make its answer differ between runs): the same answer twice,
/// equal to an engine with speculation off. Each drafting request starts on a fresh engine:
/// its first step then drafts from the controller's prior, whatever this machine's timings.
#[test]
fn auto_is_the_default_and_leaves_seeded_sampling_plain() {
    let dir = "releases/gemma-4-e2b-it";
    let phrase = text_ids(12, 3, 10, 900);
    let prompt: Vec<u32> = phrase.iter().cycle().take(12 * 6).copied().collect();
    let engine = |speculative: Option<SpeculativeMode>| {
        let mut options = EngineOptions {
            max_queue: 4,
            prefix_cache_bytes: Some(0),
            prefix_snapshot_bytes: Some(0),
            ..EngineOptions::default()
        };
        if let Some(mode) = speculative {
            options.speculative = mode;
        }
        Engine::start_with(options).unwrap()
    };
    let (default, off) = (engine(None), engine(Some(SpeculativeMode::Off)));
    let ask = |engine: &Engine, temperature: f32, seed: Option<u64>| -> Completion {
        let mut params = params(64, None);
        params.speculative.mode = None;
        params.sampling.temperature = temperature;
        params.sampling.seed = seed;
        let request = Request {
            model: fixture(dir),
            prompt: Prompt::Ids(prompt.clone()),
            params,
            ..Request::default()
        };
        engine.submit(request).unwrap().wait().unwrap()
    };
    let greedy = ask(&default, 0.0, None);
    assert_same(&ask(&off, 0.0, None), &greedy, "greedy, auto by default");
    assert!(greedy.timings.draft_tokens > 0, "auto did not draft");
    let seeded = ask(&default, 0.9, Some(7));
    assert_eq!(
        seeded.timings.draft_tokens, 0,
        "a seeded sampled row drafted"
    );
    assert_eq!(ask(&default, 0.9, Some(7)).token_ids, seeded.token_ids);
    assert_eq!(ask(&off, 0.9, Some(7)).token_ids, seeded.token_ids);
    // On an engine of its own: what the greedy request measured on this busy machine may
    // already say drafting does not pay, and its first steps would then decode plainly.
    drop(default);
    let unseeded = ask(&engine(None), 0.01, None);
    assert!(
        unseeded.timings.draft_tokens > 0,
        "an unseeded sampled row did not draft"
    );
}
