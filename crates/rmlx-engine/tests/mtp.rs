//! The multi-token-prediction head of Qwen3.5 / Qwen3.6 (`mtp.*`): its draft logits equal
//! mlx-vlm 0.7.6's `qwen3_5_mtp` drafter on every release fixture that ships it (golden files
//! from scripts/fixtures/make_mtp_golden.py, which also records how far a wrong norm shift or a
//! pre-norm hidden state would land), and decoding with it is exact: greedy output with the
//! head's drafts equals plain greedy output token for token, alone, in a batch beside rows that
//! do not use it, after a reused prefix, and with an image in the prompt.

mod common;

use common::{answer_all, assert_same, fixture, ids_array, text_ids};
use std::collections::HashMap;

use mlx_rs::Array;
use rmlx_engine::{
    cache::KvCache,
    chat::ChatTokenizer,
    engine::{Engine, EngineOptions, Prompt, Request},
    generate::{generate, Completion, GenerateParams},
    models::{load_model, load_model_with, LoadOptions, LoadedModel, Logits},
    speculative::{SpeculativeMode, SpeculativeParams},
};

/// Max |logit| difference allowed against mlx-vlm (fp32 on the same CPU backend; observed
/// differences are a few 1e-6).
const TOLERANCE: f32 = 1e-3;

/// The Hugging Face release fixtures with the head, dense and MoE, Qwen3.5 and Qwen3.6.
const HEADED: &[&str] = &[
    "releases/qwen3.5-0.8b",
    "releases/qwen3.5-2b",
    "releases/qwen3.5-4b",
    "releases/qwen3.5-9b",
    "releases/qwen3.5-27b",
    "releases/qwen3.5-35b-a3b",
    "releases/qwen3.6-27b",
    "releases/qwen3.6-35b-a3b",
];

#[derive(serde::Deserialize)]
struct Golden {
    input_ids: Vec<u32>,
    bonus_token: u32,
    draft_tokens: Vec<u32>,
    draft_logits: Vec<Vec<f32>>,
    top1_top2_margins: Vec<f32>,
    unshifted_norms_max_abs_diff: f32,
    pre_norm_hidden_max_abs_diff: f32,
}

fn with_head(dir: &str) -> LoadedModel {
    load_model_with(
        &fixture(dir),
        LoadOptions {
            draft_head: true,
            ..LoadOptions::default()
        },
    )
    .unwrap()
}

fn argmax(logits: &Array) -> u32 {
    let row = common::rows(logits).pop().unwrap();
    let mut best = 0;
    for (i, &value) in row.iter().enumerate() {
        if value > row[best] {
            best = i;
        }
    }
    best as u32
}

/// mlx-vlm's procedure through rMLX's head, on the model in `dir` (whose trunk is `golden`'s):
/// the trunk prefills the prompt but its last token while the head is primed, the last token
/// gives the target's next token and hidden state, then the head drafts from that pair and from
/// its own outputs. Returns the largest logit difference; checks tokens where margins allow.
fn head_against_golden(dir: &std::path::Path, golden: &Golden, what: &str) -> f32 {
    let loaded = load_model_with(
        dir,
        LoadOptions {
            draft_head: true,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let model = loaded.model.as_ref();
    let head = model.draft_head().expect("a head to load");
    assert!(loaded.info.draft_head && loaded.info.draft_head_loaded);
    let ids = &golden.input_ids;
    let n = ids.len();
    let mut caches = model.new_cache(4096);
    assert_eq!(caches.len(), model.num_layers() + head.head_layers());
    head.prime(
        &ids_array(&ids[..n - 1]),
        None,
        &ids_array(&ids[1..]),
        &mut caches,
    )
    .unwrap();
    let (logits, hidden) = head
        .forward_hidden(&ids_array(&ids[n - 1..]), &mut caches, Logits::Last)
        .unwrap();
    assert_eq!(
        argmax(&logits),
        golden.bonus_token,
        "{what}: the target's token"
    );
    let trunk = model.num_layers();
    let mut token = golden.bonus_token;
    let mut hidden = hidden;
    let mut worst = 0.0f32;
    for (step, want) in golden.draft_logits.iter().enumerate() {
        let output = head
            .head_forward(&ids_array(&[token]), &hidden, &mut caches[trunk..])
            .unwrap();
        let logits = head.head_logits(&output).unwrap();
        let got = common::rows(&logits).pop().unwrap();
        worst = worst.max(common::max_diff(&got, want));
        token = argmax(&logits);
        if golden.top1_top2_margins[step] > 2.0 * TOLERANCE && worst < TOLERANCE {
            assert_eq!(token, golden.draft_tokens[step], "{what} draft {step}");
        }
        hidden = output;
    }
    let held = caches[trunk].offset() as usize;
    assert_eq!(
        held,
        n + golden.draft_logits.len() - 1,
        "{what}: head entries"
    );
    worst
}

fn mtp_golden(dir: &str) -> Golden {
    let text = std::fs::read_to_string(fixture(dir).join("mtp_golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn head_drafts_match_mlx_vlm() {
    for dir in HEADED {
        let golden = mtp_golden(dir);
        // Either mistake would move the logits far past the tolerance.
        assert!(golden.unshifted_norms_max_abs_diff > 100.0 * TOLERANCE);
        assert!(golden.pre_norm_hidden_max_abs_diff > 100.0 * TOLERANCE);
        let worst = head_against_golden(&fixture(dir), &golden, dir);
        assert!(worst < TOLERANCE, "{dir}: max |diff| {worst}");
    }
}

/// A copy of `source` without its `mtp.*` tensors (as mlx conversions ship), and those tensors.
fn without_head(source: &str) -> (tempfile::TempDir, HashMap<String, Array>) {
    let source = fixture(source);
    let weights = Array::load_safetensors(source.join("model.safetensors")).unwrap();
    mlx_rs::transforms::eval(weights.values()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&source).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    let (head, trunk): (HashMap<_, _>, HashMap<_, _>) = weights
        .into_iter()
        .partition(|(name, _)| name.starts_with("mtp."));
    Array::save_safetensors(&trunk, None, dir.path().join("model.safetensors")).unwrap();
    (dir, head)
}

/// The head's zero-centred norms (Hugging Face) plus one: mlx's convention.
fn shifted(head: &HashMap<String, Array>) -> HashMap<String, Array> {
    head.iter()
        .map(|(name, array)| {
            let norm = array.ndim() == 1 && name.ends_with("norm.weight")
                || name.ends_with("pre_fc_norm_embedding.weight")
                || name.ends_with("pre_fc_norm_hidden.weight");
            let value = match norm {
                true => mlx_rs::ops::add(array, Array::from_f32(1.0)).unwrap(),
                false => array.clone(),
            };
            (name["mtp.".len()..].to_string(), value)
        })
        .collect()
}

/// A conversion without `mtp.*` finds its head beside it, in each layout peers ship, the norms
/// shifted exactly once: `mtp.safetensors` with the release's names (zero-centred norms) or with
/// mlx's, and mlx-vlm's split drafter folder. Each gives the drafts of the release's own head.
#[test]
fn sidecar_heads_give_the_release_heads_drafts() {
    let source = "releases/qwen3.6-35b-a3b";
    let golden = mtp_golden(source);
    let (dir, head) = without_head(source);
    let plain = load_model(dir.path()).unwrap();
    assert!(!plain.info.draft_head, "no head before a sidecar");
    drop(plain);
    let sidecar = dir.path().join("mtp.safetensors");
    Array::save_safetensors(&head, None, &sidecar).unwrap();
    let worst = head_against_golden(dir.path(), &golden, "mtp.safetensors, release names");
    assert!(worst < TOLERANCE, "release names: {worst}");
    Array::save_safetensors(&shifted(&head), None, &sidecar).unwrap();
    let worst = head_against_golden(dir.path(), &golden, "mtp.safetensors, mlx names");
    assert!(worst < TOLERANCE, "mlx names: {worst}");
    std::fs::remove_file(&sidecar).unwrap();
    let folder = dir.path().join("mtp");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(
        folder.join("config.json"),
        r#"{"model_type": "qwen3_5_mtp"}"#,
    )
    .unwrap();
    Array::save_safetensors(&shifted(&head), None, folder.join("model.safetensors")).unwrap();
    let worst = head_against_golden(dir.path(), &golden, "split drafter folder");
    assert!(worst < TOLERANCE, "split folder: {worst}");
    // The mixed names of a broken sidecar are refused, naming the file.
    std::fs::remove_dir_all(&folder).unwrap();
    let mut mixed = shifted(&head);
    mixed.insert("mtp.extra.weight".into(), Array::from_f32(0.0));
    Array::save_safetensors(&mixed, None, &sidecar).unwrap();
    let error = load_model_with(
        dir.path(),
        LoadOptions {
            draft_head: true,
            ..LoadOptions::default()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(error.contains("mtp.safetensors"), "{error}");
}

/// Without the option the head is set aside, as before: no head caches, nothing loaded.
#[test]
fn the_head_loads_only_when_asked() {
    let loaded = load_model(&fixture("releases/qwen3.6-27b")).unwrap();
    assert!(loaded.model.draft_head().is_none());
    assert!(loaded.info.draft_head && !loaded.info.draft_head_loaded);
    assert_eq!(loaded.model.new_cache(64).len(), loaded.model.num_layers());
    // A conversion without `mtp.*` has no head to load.
    let converted = with_head("releases/qwen3.5-9b-4bit");
    assert!(converted.model.draft_head().is_none() && !converted.info.draft_head);
}

fn params(max_tokens: usize, mode: SpeculativeMode) -> GenerateParams {
    GenerateParams {
        max_tokens,
        ignore_eos: true,
        logprobs: Some(2),
        speculative: SpeculativeParams {
            mode: Some(mode),
            max_draft: 4,
            drafter: None,
            costs: None,
        },
        ..GenerateParams::default()
    }
}

fn run(loaded: &LoadedModel, dir: &str, prompt: &[u32], params: &GenerateParams) -> Completion {
    run_in(loaded, &fixture(dir), prompt, params)
}

/// [`run`] for a model in any folder (its tokenizer read from there).
fn run_in(
    loaded: &LoadedModel,
    folder: &std::path::Path,
    prompt: &[u32],
    params: &GenerateParams,
) -> Completion {
    let tokenizer = ChatTokenizer::from_dir(folder).unwrap();
    let cancel = std::sync::atomic::AtomicBool::new(false);
    generate(
        loaded.model.as_ref(),
        &tokenizer,
        prompt,
        params,
        &cancel,
        |_| {},
    )
    .unwrap()
}

/// A random head's drafts are never the trunk's argmax. A logit bias of this size on one token
/// (applied to the head's drafts as to the trunk's choice) makes both pick it often but not
/// always on these fixtures: some drafts are kept, some not, so the head takes in steps that
/// kept every count of tokens.
const PARTIAL_BIAS: (u32, f32) = (300, 12.0);

fn biased(mut params: GenerateParams, bias: Option<(u32, f32)>) -> GenerateParams {
    params.sampling.logit_bias = bias.into_iter().collect();
    params
}

/// Every release structure, alone: the head's drafts (at the full depth and under `auto`)
/// leave greedy output as a model loaded without the head gives it, with no draft kept and
/// with some kept.
#[test]
fn mtp_greedy_equals_plain_on_every_release_structure() {
    for dir in HEADED {
        let prompt = text_ids(28, 31, 10, 900);
        let plain_model = load_model(&fixture(dir)).unwrap();
        let loaded = with_head(dir);
        for bias in [None, Some(PARTIAL_BIAS)] {
            let plain_params = biased(params(32, SpeculativeMode::Off), bias);
            let plain = run(&plain_model, dir, &prompt, &plain_params);
            let modes = [
                SpeculativeMode::Off,
                SpeculativeMode::Mtp,
                SpeculativeMode::Auto,
            ];
            for mode in modes {
                let answer = run(&loaded, dir, &prompt, &biased(params(32, mode), bias));
                let what = format!("{dir} {mode:?} bias {bias:?}");
                assert_same(&plain, &answer, &what);
                let timings = &answer.timings;
                if mode == SpeculativeMode::Mtp {
                    assert!(timings.draft_tokens >= 4, "{what}: nothing drafted");
                    if bias.is_some() {
                        assert!(
                            timings.accepted_tokens > 0
                                && timings.accepted_tokens < timings.draft_tokens,
                            "{what}: {} of {} kept",
                            timings.accepted_tokens,
                            timings.draft_tokens
                        );
                    }
                }
            }
        }
    }
}

fn engine(mode: SpeculativeMode) -> Engine {
    Engine::start_with(EngineOptions {
        max_queue: 8,
        speculative: mode,
        ..EngineOptions::default()
    })
    .unwrap()
}

fn submit(engine: &Engine, dir: &str, prompt: &[u32], params: GenerateParams) -> Completion {
    engine
        .submit(Request {
            model: fixture(dir),
            prompt: Prompt::Ids(prompt.to_vec()),
            params,
            ..Request::default()
        })
        .unwrap()
        .wait()
        .unwrap()
}

/// A batch of rows with different prompts (so different pending counts and ragged heads),
/// the head drafting for some, prompt lookup or nothing for others: each row equals its plain
/// solo run.
#[test]
fn batched_rows_with_and_without_the_head_equal_their_solo_runs() {
    for dir in ["releases/qwen3.5-0.8b", "releases/qwen3.6-35b-a3b"] {
        let plain_model = load_model(&fixture(dir)).unwrap();
        let prompts: Vec<Vec<u32>> = (0..4)
            .map(|row| text_ids(20 + 5 * row, 51 + row as u32, 10, 900))
            .collect();
        // Rows 0 and 2 keep some of the head's drafts, so rows end at different columns.
        let bias = |row: usize| row.is_multiple_of(2).then_some(PARTIAL_BIAS);
        let plains: Vec<Completion> = prompts
            .iter()
            .enumerate()
            .map(|(row, prompt)| {
                let params = biased(params(24, SpeculativeMode::Off), bias(row));
                run(&plain_model, dir, prompt, &params)
            })
            .collect();
        drop(plain_model);
        let engine = engine(SpeculativeMode::Mtp);
        let modes = [
            SpeculativeMode::Mtp,
            SpeculativeMode::Off,
            SpeculativeMode::Auto,
            SpeculativeMode::Lookup,
        ];
        let rows = prompts
            .iter()
            .zip(modes)
            .enumerate()
            .map(|(row, (prompt, mode))| (prompt.clone(), biased(params(24, mode), bias(row))))
            .collect();
        let answers = answer_all(&engine, &fixture(dir), rows);
        let mut batched = false;
        let mut kept = 0;
        for (row, (answer, plain)) in answers.into_iter().zip(&plains).enumerate() {
            batched |= answer.batched_with > 1;
            kept += answer.timings.accepted_tokens;
            assert_same(plain, &answer, &format!("{dir} batch row {row}"));
        }
        assert!(batched, "{dir}: nothing ran batched");
        assert!(kept > 0, "{dir}: no draft kept in the batch");
    }
}

/// Turn 2 reuses turn 1's caches, the head's included (its last entry re-paired): the answer
/// equals a cold plain run's, and turn 1's stored head caches end where the trunk's do.
#[test]
fn the_next_turn_reuses_the_head_caches_exactly() {
    let dir = "releases/qwen3.6-27b";
    let plain_model = load_model(&fixture(dir)).unwrap();
    let first = text_ids(24, 61, 10, 900);
    let turn = |max_tokens, mode| biased(params(max_tokens, mode), Some(PARTIAL_BIAS));
    let plain_first = run(&plain_model, dir, &first, &turn(20, SpeculativeMode::Off));
    let mut second = first.clone();
    second.extend(&plain_first.token_ids);
    second.extend(text_ids(6, 62, 10, 900));
    let plain_second = run(&plain_model, dir, &second, &turn(12, SpeculativeMode::Off));
    drop(plain_model);
    let engine = engine(SpeculativeMode::Mtp);
    let answer = submit(&engine, dir, &first, turn(20, SpeculativeMode::Mtp));
    assert_same(&plain_first, &answer, "turn 1");
    assert!(answer.timings.accepted_tokens > 0, "turn 1 kept no draft");
    let next = submit(&engine, dir, &second, turn(12, SpeculativeMode::Mtp));
    assert!(
        next.cached_tokens >= first.len(),
        "turn 2 reused {} tokens",
        next.cached_tokens
    );
    assert_same(&plain_second, &next, "turn 2");
}

/// The head's caches after a request: as long as the trunk's, every pending state taken in.
#[test]
fn a_finished_request_leaves_the_head_caches_as_long_as_the_trunk() {
    let dir = "releases/qwen3.5-2b";
    let loaded = with_head(dir);
    let tokenizer = ChatTokenizer::from_dir(&fixture(dir)).unwrap();
    let prompt = text_ids(30, 71, 10, 900);
    for mode in [SpeculativeMode::Off, SpeculativeMode::Mtp] {
        // With drafts kept, steps leave several hidden states pending at once.
        let params = biased(params(40, mode), Some(PARTIAL_BIAS));
        let cancel = std::sync::atomic::AtomicBool::new(false);
        let (completion, cached) = rmlx_engine::generate::generate_reusing(
            loaded.model.as_ref(),
            &tokenizer,
            &prompt,
            &params,
            None,
            Default::default(),
            None,
            &cancel,
            |_| {},
        )
        .unwrap();
        let trunk = loaded.model.num_layers();
        let held = cached.tokens.len() as i32;
        assert!(held as usize >= prompt.len() + completion.token_ids.len() - 1);
        let heads: Vec<&KvCache> = cached.caches[trunk..].iter().collect();
        assert_eq!(heads.len(), 1);
        assert_eq!(heads[0].offset(), held, "{mode:?}");
        assert_eq!(cached.caches[0].offset(), held, "{mode:?}");
    }
}

/// An image in the prompt (MRoPE positions after it): the head is primed at the trunk's
/// positions and its drafts leave the answer as plain decode gives it.
#[test]
fn images_in_the_prompt_with_the_head_are_exact() {
    use rmlx_engine::chat::TemplateOptions;
    let picture = image::open(fixture("vision-images").join("gradient_64x48.png"))
        .unwrap()
        .to_rgb8();
    let dir = "releases/qwen3.6-35b-a3b";
    let request = |mode| Request {
        model: fixture(dir),
        prompt: Prompt::Chat {
            messages: vec![serde_json::json!({"role": "user", "content": [
                {"type": "image"}, {"type": "text", "text": "What is in the picture?"}]})],
            options: TemplateOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        },
        images: vec![picture.clone()],
        params: params(16, mode),
        ..Request::default()
    };
    let plain = Engine::start(4)
        .unwrap()
        .submit(request(SpeculativeMode::Off))
        .unwrap()
        .wait()
        .unwrap();
    let engine = engine(SpeculativeMode::Mtp);
    let answer = engine
        .submit(request(SpeculativeMode::Mtp))
        .unwrap()
        .wait()
        .unwrap();
    assert_same(&plain, &answer, "image, mtp");
    assert!(answer.timings.draft_tokens > 0);
}

/// The release's head written beside a conversion as `rmlx pull --mtp` does (a split drafter in
/// `mtp/`): unquantized it gives the release head's drafts; beside the 4-bit conversion it is
/// quantized as that conversion's layers (its 8-bit router too) and decodes exactly.
#[test]
fn a_release_head_written_beside_a_conversion() {
    let source = "releases/qwen3.6-35b-a3b";
    let golden = mtp_golden(source);
    let (dir, head) = without_head(source);
    let release = dir.path().join("release-head.safetensors");
    Array::save_safetensors(&head, None, &release).unwrap();
    let written =
        rmlx_engine::models::qwen3_5::mtp::write_split_drafter(dir.path(), &release).unwrap();
    assert!(written.folder.join("model.safetensors").is_file());
    let worst = head_against_golden(dir.path(), &golden, "written, unquantized");
    assert!(worst < TOLERANCE, "written: {worst}");

    let converted = tempfile::tempdir().unwrap();
    let conversion = fixture("releases/qwen3.6-35b-a3b-4bit");
    for entry in std::fs::read_dir(&conversion).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), converted.path().join(entry.file_name())).unwrap();
    }
    rmlx_engine::models::qwen3_5::mtp::write_split_drafter(converted.path(), &release).unwrap();
    let split = Array::load_safetensors(converted.path().join("mtp/model.safetensors")).unwrap();
    assert!(split.contains_key("fc.scales"), "fc quantized");
    assert!(split.contains_key("layers.0.mlp.switch_mlp.gate_proj.scales"));
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(converted.path().join("mtp/config.json")).unwrap())
            .unwrap();
    assert_eq!(
        config["quantization"]["layers.0.mlp.gate"]["bits"], 8,
        "{config}"
    );
    let dir = converted.path().to_str().unwrap();
    let plain = run(
        &load_model(converted.path()).unwrap(),
        dir,
        &text_ids(28, 31, 10, 900),
        &biased(params(24, SpeculativeMode::Off), Some(PARTIAL_BIAS)),
    );
    let loaded = load_model_with(
        converted.path(),
        LoadOptions {
            draft_head: true,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    assert!(loaded.model.draft_head().is_some());
    let answer = run(
        &loaded,
        dir,
        &text_ids(28, 31, 10, 900),
        &biased(params(24, SpeculativeMode::Mtp), Some(PARTIAL_BIAS)),
    );
    assert_same(&plain, &answer, "4-bit conversion with a written head");
    assert!(answer.timings.draft_tokens > 0);
}

/// Every 4-bit conversion structure (dense Qwen3.5, the MoE Qwen3.6) with the release's head
/// written beside it (`rmlx pull --mtp`'s split drafter, quantized as the conversion): greedy
/// output with the head equals plain decode, alone (`mtp`, `auto`) and in a batch of rows that
/// keep different counts of drafts.
#[test]
fn four_bit_conversions_with_written_heads_are_exact() {
    let pairs = [
        ("releases/qwen3.5-4b-mlx-4bit", "releases/qwen3.5-4b"),
        ("releases/qwen3.5-9b-4bit", "releases/qwen3.5-9b"),
        ("releases/qwen3.6-35b-a3b-4bit", "releases/qwen3.6-35b-a3b"),
    ];
    for (conversion, release) in pairs {
        let (_release_copy, head) = without_head(release);
        let dir = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(fixture(conversion)).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
        let release_head = dir.path().join("release-head.safetensors");
        Array::save_safetensors(&head, None, &release_head).unwrap();
        rmlx_engine::models::qwen3_5::mtp::write_split_drafter(dir.path(), &release_head).unwrap();
        std::fs::remove_file(&release_head).unwrap();
        let run_at = |loaded: &LoadedModel, prompt: &[u32], params: &GenerateParams| {
            run_in(loaded, dir.path(), prompt, params)
        };
        let plain_model = load_model(dir.path()).unwrap();
        let loaded = load_model_with(
            dir.path(),
            LoadOptions {
                draft_head: true,
                ..LoadOptions::default()
            },
        )
        .unwrap();
        assert!(loaded.info.draft_head_loaded, "{conversion}");
        let prompts: Vec<Vec<u32>> = (0..3)
            .map(|row| text_ids(20 + 5 * row, 71 + row as u32, 10, 900))
            .collect();
        let bias = |row: usize| (row != 1).then_some(PARTIAL_BIAS);
        let plains: Vec<Completion> = prompts
            .iter()
            .enumerate()
            .map(|(row, prompt)| {
                run_at(
                    &plain_model,
                    prompt,
                    &biased(params(24, SpeculativeMode::Off), bias(row)),
                )
            })
            .collect();
        for mode in [SpeculativeMode::Mtp, SpeculativeMode::Auto] {
            let answer = run_at(&loaded, &prompts[0], &biased(params(24, mode), bias(0)));
            assert_same(&plains[0], &answer, &format!("{conversion} {mode:?} alone"));
            if mode == SpeculativeMode::Mtp {
                let timings = &answer.timings;
                assert!(
                    timings.accepted_tokens > 0 && timings.accepted_tokens < timings.draft_tokens,
                    "{conversion}: {timings:?}"
                );
            }
        }
        drop((plain_model, loaded));
        let engine = engine(SpeculativeMode::Mtp);
        let handles: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(row, prompt)| {
                engine
                    .submit(Request {
                        model: dir.path().to_path_buf(),
                        prompt: Prompt::Ids(prompt.clone()),
                        params: biased(params(24, SpeculativeMode::Mtp), bias(row)),
                        ..Request::default()
                    })
                    .unwrap()
            })
            .collect();
        let mut batched = false;
        for (row, (handle, plain)) in handles.into_iter().zip(&plains).enumerate() {
            let answer = handle.wait().unwrap();
            batched |= answer.batched_with > 1;
            assert_same(plain, &answer, &format!("{conversion} batch row {row}"));
        }
        assert!(batched, "{conversion}: nothing ran batched");
    }
}
