//! Qwen3-VL against mlx-vlm 0.7.6 goldens (tests/fixtures/qwen3-vl-tiny*, made by
//! scripts/fixtures/make_vision.py): pixel rows rebuilt from the committed resized PNGs, MRoPE
//! position ids, step-0 logits and teacher-forced log-probs, the KV-cache decode path (rope
//! delta), the mirrored-image logit shift, text-only prompts and the token/feature count check.

use std::collections::HashMap;

mod common;

use common::{
    fixture, ids_array, log_softmax_rows, max_diff, qwen_patchify as patchify,
    qwen_vision::{check_teacher_forced, image_input, Golden},
    Tolerance,
};
use rmlx_engine::{
    models::{load_model, qwen3_vl::config::Config, qwen3_vl::language::rope_index, Logits},
    EngineError,
};

fn golden(dir: &str) -> Golden {
    common::golden(dir)
}

#[test]
fn pixel_rows_rebuilt_from_the_resized_pngs_equal_the_reference() {
    let golden = golden("qwen3-vl-tiny");
    for (name, record) in &golden.preprocessed_images {
        let (rows, grid) = patchify(&record.resized_file);
        assert_eq!(grid, record.grid_thw, "{name}");
        assert_eq!(
            rows.len(),
            record.pixel_values.shape[0] * record.pixel_values.shape[1]
        );
        assert_eq!(&rows[..64], &record.pixel_values.first64[..], "{name}");
        let sum: f64 = rows.iter().map(|&v| v as f64).sum();
        assert!(
            (sum - record.pixel_values.sum).abs() < 1e-6,
            "{name}: {sum}"
        );
    }
}

#[test]
fn mrope_position_ids_equal_get_rope_index() {
    let golden = golden("qwen3-vl-tiny");
    let config: Config = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen3-vl-tiny/config.json")).unwrap(),
    )
    .unwrap();
    for case in &golden.cases {
        let grids = case.image_grid_thw.clone().unwrap_or_default();
        let positions = rope_index(&case.input_ids, &grids, &config);
        if let Some(expected) = &case.mrope_position_ids {
            for (row, want) in positions.rows.iter().zip(expected) {
                assert_eq!(row, want, "{}", case.name);
            }
        }
        assert_eq!(
            Some(positions.rope_delta),
            case.mrope_rope_delta.or(Some(0)),
            "{}",
            case.name
        );
    }
}

/// Measured on the CPU backend: step-0 logits within 9.1e-6, log-probs within 5.8e-6 (the
/// conv and attention sum in a different order than the reference's); text-only exact.
const FP32: Tolerance = Tolerance {
    logits: 1e-4,
    logprobs: 1e-4,
};

/// Every golden conversation of `dir` in fp32, and the mirrored picture moves the step-0 logits
/// as much as it moves the reference's.
fn check_fp32_checkpoint(dir: &str) {
    let golden = golden(dir);
    let loaded = load_model(&fixture(dir)).unwrap();
    assert!(loaded.info.vision, "{dir}");
    let mut step0 = HashMap::new();
    for case in &golden.cases {
        eprint!("{dir} ");
        step0.insert(
            case.name.clone(),
            check_teacher_forced(&loaded, &golden, case, &FP32),
        );
    }
    let flip = max_diff(&step0["single_image"], &step0["single_image_mirrored"]);
    let want = golden.flip_check.step0_logits_max_abs_diff;
    assert!(
        (flip - want).abs() < 1e-3,
        "{dir}: mirroring moved logits by {flip}, golden {want}"
    );
}

#[test]
fn fp32_logits_and_logprobs_match_mlx_vlm_and_the_mirror_moves_them() {
    check_fp32_checkpoint("qwen3-vl-tiny");
}

#[test]
fn decode_steps_use_the_rope_delta() {
    // Prefill with the image, then one token at a time through the plain text forward: the
    // positions after the prompt are offset + rope_delta, as in mlx-vlm's generate_step.
    let golden = golden("qwen3-vl-tiny");
    let loaded = load_model(&fixture("qwen3-vl-tiny")).unwrap();
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
        assert_eq!(caches[0].rope_delta(), case.mrope_rope_delta.unwrap_or(0));
        let mut got = Vec::new();
        for &id in &case.greedy_ids {
            got.push(log_softmax_rows(&logits)[0][id as usize]);
            logits = loaded
                .model
                .forward(&ids_array(&[id]), &mut caches, Logits::Last)
                .unwrap();
        }
        let diff = max_diff(&got, &case.greedy_step_logprobs);
        eprintln!("{}: KV-cache decode log-prob max diff {diff:e}", case.name);
        assert!(diff <= FP32.logprobs, "{}: {diff}", case.name);
    }
}

#[test]
fn image_token_count_must_equal_the_features() {
    let golden = golden("qwen3-vl-tiny");
    let loaded = load_model(&fixture("qwen3-vl-tiny")).unwrap();
    let vision = loaded.model.as_vision().unwrap();
    let two = golden
        .cases
        .iter()
        .find(|c| c.name == "two_images_one_turn")
        .unwrap();
    let one = vision
        .encode_images(&image_input(&golden, &two.images[..1]))
        .unwrap();
    let mut caches = loaded.model.new_cache(4096);
    let error = vision
        .forward_with_images(
            &ids_array(&two.input_ids),
            Some(&one),
            &mut caches,
            Logits::Last,
        )
        .err()
        .unwrap();
    assert!(
        matches!(
            error,
            EngineError::ImageTokenMismatch {
                tokens: 142,
                features: 70
            }
        ),
        "{error}"
    );
}

#[test]
fn four_bit_checkpoint_loads_strictly_and_matches() {
    // bf16 activations and 4-bit weights. Measured: bit-exact on the CPU backend (the ops and
    // their dtypes are mlx-vlm's); the bound leaves room for backend reordering, well under the
    // reference's own cache-vs-full noise of 0.06.
    let golden = golden("qwen3-vl-tiny-4bit");
    let loaded = load_model(&fixture("qwen3-vl-tiny-4bit")).unwrap();
    let tolerance = Tolerance {
        logits: 0.02,
        logprobs: 0.02,
    };
    for case in &golden.cases {
        check_teacher_forced(&loaded, &golden, case, &tolerance);
    }
}

/// The Qwen3-VL releases (2B, 4B, 8B and the 30B-A3B MoE), each built from its published config
/// in the Hugging Face layout it ships in (`model.language_model.*`, `model.visual.*`, PyTorch
/// Conv3d patch embedding, fused `experts.gate_up_proj`): every golden conversation's step-0
/// logits and teacher-forced log-probs within the fp32 bound, and the mirror moves the logits.
#[test]
fn releases_match_mlx_vlm() {
    for release in [
        "qwen3-vl-2b-instruct",
        "qwen3-vl-4b-instruct",
        "qwen3-vl-8b-instruct",
        "qwen3-vl-30b-a3b-instruct",
    ] {
        check_fp32_checkpoint(&format!("releases/{release}"));
    }
}
