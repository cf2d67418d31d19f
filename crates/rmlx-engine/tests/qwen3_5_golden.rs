//! Qwen3.5 / Qwen3.6 (`qwen3_5`, `qwen3_5_moe`) against mlx-vlm 0.7.6 goldens: one tiny
//! checkpoint per release structure (tests/fixtures/releases/qwen3.*, made by
//! scripts/fixtures/make_releases.py from the published configs, Hugging Face layout with the
//! `mtp.*` draft head, or mlx's 4-bit layout). Checked: MRoPE positions, step-0 logits and
//! teacher-forced log-probs (text and images), the cached decode path, prefill in chunks of
//! 1 / 7 / whole, and the recurrent cache's bounds.
//!
//! Which reference form: the goldens are mlx-vlm with its Gated DeltaNet prefill in the
//! sequential step form (what it runs on a Mac through its Metal kernel and what rMLX computes
//! everywhere); mlx-vlm's CPU-only chunked prefill differs from it by the amount each golden
//! records in `chunked_prefill_max_abs_logprob_diff`.

mod common;

use common::{
    fixture, ids_array, log_softmax_rows, max_diff,
    qwen_vision::{check_teacher_forced, image_input, Golden},
    rows, Tolerance,
};
use mlx_rs::Array;
use rmlx_engine::{
    models::{load_model, qwen3_5, Logits},
    EngineError,
};

/// Every fp32 release structure: dense 0.8B (tied), 2B, 4B (2 value heads per key head), 9B
/// (untied, tie flag only at the top), 27B (3 per key head), Qwen3.6-27B, and the MoE 35B-A3B
/// of both lines.
const FP32_RELEASES: &[&str] = &[
    "qwen3.5-0.8b",
    "qwen3.5-2b",
    "qwen3.5-4b",
    "qwen3.5-9b",
    "qwen3.5-27b",
    "qwen3.6-27b",
    "qwen3.5-35b-a3b",
    "qwen3.6-35b-a3b",
];

/// mlx-community 4-bit conversions (bf16 activations; the MoE one with 8-bit gates).
const QUANTIZED_RELEASES: &[&str] = &[
    "qwen3.5-9b-4bit",
    "qwen3.5-4b-mlx-4bit",
    "qwen3.6-35b-a3b-4bit",
];

/// fp32 bound against the sequential-form goldens. Measured on the CPU backend: text-only
/// cases bit-exact, image cases within 2.7e-5 (step-0 logits) and 1.4e-5 (log-probs), where
/// the vision tower sums in another order. mlx-vlm's own chunked CPU prefill is up to 1.1e-3
/// away from these goldens (each golden records it), so this bound is the sequential form's.
const FP32: Tolerance = Tolerance {
    logits: 1e-4,
    logprobs: 1e-4,
};

/// bf16 + 4-bit: measured bit-exact (the same op graph and dtypes as mlx-vlm); the bound leaves
/// room for backend reordering.
const QUANTIZED: Tolerance = Tolerance {
    logits: 0.05,
    logprobs: 0.05,
};

fn release(name: &str) -> String {
    format!("releases/{name}")
}

fn check_release(name: &str, tol: &Tolerance) {
    let golden: Golden = common::golden(&release(name));
    let loaded = load_model(&fixture(&release(name))).unwrap();
    assert!(loaded.info.vision, "{name}");
    eprintln!(
        "{name} (mlx-vlm chunked-vs-sequential prefill: {:?})",
        golden.chunked_prefill_max_abs_logprob_diff
    );
    for case in &golden.cases {
        check_teacher_forced(&loaded, &golden, case, tol);
    }
}

#[test]
fn fp32_releases_match_mlx_vlm() {
    for name in FP32_RELEASES {
        check_release(name, &FP32);
    }
}

#[test]
fn four_bit_releases_load_strictly_and_match_mlx_vlm() {
    for name in QUANTIZED_RELEASES {
        check_release(name, &QUANTIZED);
    }
}

#[test]
fn mrope_position_ids_equal_get_rope_index() {
    let dir = release("qwen3.5-0.8b");
    let golden: Golden = common::golden(&dir);
    let loaded = load_model(&fixture(&dir)).unwrap();
    let config: qwen3_5::config::Config =
        serde_json::from_str(&std::fs::read_to_string(fixture(&dir).join("config.json")).unwrap())
            .unwrap();
    assert!(config.is_linear(0) && !config.is_linear(3));
    drop(loaded);
    for case in &golden.cases {
        let grids = case.image_grid_thw.clone().unwrap_or_default();
        let tokens = rmlx_engine::models::qwen3_vl::language::ImageTokenIds {
            image: config.image_token_id,
            vision_start: config.vision_start_token_id,
            merge: config.vision_config.spatial_merge_size,
        };
        let positions = rmlx_engine::models::qwen3_vl::language::rope_index_for(
            &case.input_ids,
            &grids,
            tokens,
        );
        if let Some(expected) = &case.mrope_position_ids {
            for (row, want) in positions.rows.iter().zip(expected) {
                assert_eq!(row, want, "{}", case.name);
            }
        }
        assert_eq!(
            positions.rope_delta,
            case.mrope_rope_delta.unwrap_or(0),
            "{}",
            case.name
        );
    }
}

/// Prefill (image features with their chunk) and then one token at a time: the conv window
/// and the recurrent state carry over, and the log-probs equal mlx-vlm's generate_step.
#[test]
fn cached_decode_matches_generate_step() {
    for name in ["qwen3.5-4b", "qwen3.6-35b-a3b"] {
        let dir = release(name);
        let golden: Golden = common::golden(&dir);
        let loaded = load_model(&fixture(&dir)).unwrap();
        let vision = loaded.model.as_vision().unwrap();
        for case in golden
            .cases
            .iter()
            .filter(|c| c.name == "two_images_one_turn" || c.name == "text_only")
        {
            let features = (!case.images.is_empty()).then(|| {
                vision
                    .encode_images(&image_input(&golden, &case.images))
                    .unwrap()
            });
            let mut caches = loaded.model.new_cache(4096);
            let mut logits = vision
                .forward_with_images(
                    &ids_array(&case.input_ids),
                    features.as_ref(),
                    &mut caches,
                    Logits::Last,
                )
                .unwrap();
            assert!(caches[0].recurrent().is_some() && caches[3].recurrent().is_none());
            assert_eq!(caches[0].offset(), caches[3].offset());
            let mut got = Vec::new();
            for &id in &case.greedy_ids {
                got.push(log_softmax_rows(&logits)[0][id as usize]);
                logits = loaded
                    .model
                    .forward(&ids_array(&[id]), &mut caches, Logits::Last)
                    .unwrap();
            }
            let diff = max_diff(&got, &case.greedy_step_logprobs);
            eprintln!(
                "{name} {}: cached decode log-prob max diff {diff:e}",
                case.name
            );
            assert!(diff <= FP32.logprobs, "{name} {}: {diff}", case.name);
        }
    }
}

/// Prompt chunks of 1, 7 and the whole prompt leave the same state: the next token's logits
/// agree (the recurrence and the conv window carry exactly; attention sums may reorder).
#[test]
fn prefill_chunks_carry_conv_and_recurrent_state_exactly() {
    let dir = release("qwen3.5-27b");
    let golden: Golden = common::golden(&dir);
    let loaded = load_model(&fixture(&dir)).unwrap();
    let case = golden.cases.iter().find(|c| c.name == "text_only").unwrap();
    let (body, last) = case.input_ids.split_at(case.input_ids.len() - 1);
    let mut outcomes = Vec::new();
    for chunk in [1, 7, body.len()] {
        let mut caches = loaded.model.new_cache(4096);
        for piece in body.chunks(chunk) {
            loaded
                .model
                .forward(&ids_array(piece), &mut caches, Logits::Last)
                .unwrap();
            mlx_rs::transforms::eval(caches.iter().flat_map(|c| c.state())).unwrap();
        }
        let logits = loaded
            .model
            .forward(&ids_array(last), &mut caches, Logits::Last)
            .unwrap();
        outcomes.push(rows(&logits)[0].clone());
    }
    for (chunk, outcome) in [1, 7].iter().zip(&outcomes) {
        let diff = max_diff(outcome, &outcomes[2]);
        eprintln!("chunk {chunk} vs whole: {diff:e}");
        assert!(diff < 1e-4, "chunk {chunk}: {diff}");
    }
    let diff = max_diff(&outcomes[2], &case.step0_logits);
    assert!(diff <= FP32.logits, "whole prefill vs golden: {diff}");
}

/// A long prompt prefilled in one piece takes the chunked Gated DeltaNet form; token by token
/// it takes the sequential steps: the next token's logits agree to float32 reassociation.
#[test]
fn chunked_prefill_equals_the_sequential_steps() {
    for name in ["qwen3.5-27b", "qwen3.6-35b-a3b"] {
        let loaded = load_model(&fixture(&release(name))).unwrap();
        let ids: Vec<u32> = (0..300).map(|i| (i * 37 + 11) % 900).collect();
        let next = |chunk: usize| {
            let mut caches = loaded.model.new_cache(4096);
            for piece in ids.chunks(chunk) {
                loaded
                    .model
                    .forward(&ids_array(piece), &mut caches, Logits::Last)
                    .unwrap();
                mlx_rs::transforms::eval(caches.iter().flat_map(|c| c.state())).unwrap();
            }
            let logits = loaded
                .model
                .forward(&ids_array(&[5]), &mut caches, Logits::Last)
                .unwrap();
            rows(&logits)[0].clone()
        };
        let (chunked, sequential) = (next(ids.len()), next(100));
        let diff = max_diff(&chunked, &sequential);
        eprintln!("{name}: chunked vs sequential prefill of 300 tokens: {diff:e}");
        assert!(diff < 1e-3, "{name}: {diff}");
    }
}

/// The recurrent layers count positions like the attention layers, so the context bound is
/// the same typed error, and a recurrent state refuses to be cut back.
#[test]
fn recurrent_caches_keep_the_context_bound_and_cannot_rewind() {
    let loaded = load_model(&fixture(&release("qwen3.5-0.8b"))).unwrap();
    let mut caches = loaded.model.new_cache(4);
    loaded
        .model
        .forward(&ids_array(&[1, 2, 3]), &mut caches, Logits::Last)
        .unwrap();
    assert!(!caches[0].can_truncate_to(2) && caches[0].can_truncate_to(3));
    assert!(caches[3].can_truncate_to(2));
    let error = loaded
        .model
        .forward(&ids_array(&[4, 5]), &mut caches, Logits::Last)
        .err()
        .unwrap();
    assert!(
        matches!(
            error,
            EngineError::ContextOverflow {
                prompt_tokens: 5,
                max_ctx: 4
            }
        ),
        "{error}"
    );
}

/// The draft head every release ships (`mtp.*`) is recognised and set aside; any other extra
/// tensor still fails the strict load, named.
#[test]
fn mtp_tensors_are_set_aside_and_other_leftovers_fail() {
    let source = fixture(&release("qwen3.5-0.8b"));
    let weights = Array::load_safetensors(source.join("model.safetensors")).unwrap();
    assert!(
        weights.keys().any(|name| name.starts_with("mtp.")),
        "the fixture ships mtp.*"
    );
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&source).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    // MLX reads lazily: materialise before the copy is overwritten.
    mlx_rs::transforms::eval(weights.values()).unwrap();
    let mut extra = weights;
    extra.insert(
        "model.language_model.stray.weight".into(),
        Array::from_slice(&[1.0f32], &[1]),
    );
    Array::save_safetensors(&extra, None, dir.path().join("model.safetensors")).unwrap();
    let error = load_model(dir.path()).err().unwrap().to_string();
    assert!(error.contains("stray"), "{error}");
    assert!(!error.contains("mtp."), "{error}");
}
