//! Gemma 4 against mlx-vlm 0.7.6 goldens (tests/fixtures/gemma4-tiny*, made by
//! scripts/fixtures/make_vision.py): images through our own preprocessing (its pixels are
//! hash-equal to the reference's, tested in `vision::preprocess::gemma4`), step-0 logits and
//! teacher-forced log-probs of every case (sliding windows, KV-shared layers, per-layer
//! inputs, bidirectional image spans, softcapping), the KV-cache decode path, chunked prefill
//! that never splits an image, the mirror shift, and the mxfp4 QAT-style checkpoint.

use std::{collections::HashMap, ops::Range};

mod common;

use common::{fixture, ids_array, log_softmax_rows, max_diff, rows, Tolerance};
use mlx_rs::Array;
use rmlx_engine::{
    models::{load_model, ImageInput, LoadedModel, Logits, VisionFeatures},
    multimodal::{prefill, ImagePrefill},
    vision::preprocess::Gemma4ImageConfig,
    EngineError,
};

const IMAGE_TOKEN: u32 = 995;
const BOI: u32 = 993;
const EOI: u32 = 994;

#[derive(serde::Deserialize)]
struct Golden {
    preprocessed_images: HashMap<String, Preprocessed>,
    flip_check: FlipCheck,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct FlipCheck {
    step0_logits_max_abs_diff: f32,
}

#[derive(serde::Deserialize)]
struct Preprocessed {
    file: String,
    patch_grid_hw: [i32; 2],
    num_soft_tokens: usize,
}

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    images: Vec<String>,
    input_ids: Vec<u32>,
    step0_logits: Vec<f32>,
    greedy_ids: Vec<u32>,
    greedy_step_logprobs: Vec<f32>,
    teacher_forced_logprobs: Vec<f32>,
    top1_top2_margins: Vec<f32>,
}

fn golden(dir: &str) -> Golden {
    common::golden(dir)
}

/// The images of a case, through our preprocessing from the original PNGs.
fn image_input(dir: &str, golden: &Golden, names: &[String]) -> ImageInput {
    let config = Gemma4ImageConfig::load(&fixture(dir)).unwrap();
    let mut rows = Vec::new();
    let mut grid_thw = Vec::new();
    for name in names {
        let record = &golden.preprocessed_images[name];
        let image = image::open(fixture(&record.file)).unwrap().to_rgb8();
        let processed = config.preprocess(&image, None).unwrap();
        assert_eq!(processed.num_soft_tokens, record.num_soft_tokens, "{name}");
        let [h, w] = record.patch_grid_hw;
        assert_eq!(processed.patch_grid_hw, [h as usize, w as usize], "{name}");
        processed.patch_rows(config.patch_size, &mut rows).unwrap();
        grid_thw.push([1, h, w]);
    }
    let patches = (rows.len() / 768) as i32;
    ImageInput {
        pixel_values: Array::from_slice(&rows, &[patches, 768]),
        grid_thw,
    }
}

/// Measured on the CPU backend (fp32): step-0 logits within 6.7e-6 and log-probs within
/// 4.8e-6 of mlx-vlm (the tower attends in another summation order); text-only exact.
const FP32: Tolerance = Tolerance {
    logits: 1e-4,
    logprobs: 1e-4,
};

fn features(
    loaded: &LoadedModel,
    dir: &str,
    golden: &Golden,
    case: &Case,
) -> Option<VisionFeatures> {
    let vision = loaded.model.as_vision().expect("gemma4 sees images");
    (!case.images.is_empty()).then(|| {
        vision
            .encode_images(&image_input(dir, golden, &case.images))
            .unwrap()
    })
}

/// One forward over prompt + greedy ids[..15]: step-0 logits and teacher-forced log-probs
/// against the golden; returns the step-0 logits.
fn check_teacher_forced(
    loaded: &LoadedModel,
    dir: &str,
    golden: &Golden,
    case: &Case,
    tol: &Tolerance,
) -> Vec<f32> {
    let vision = loaded.model.as_vision().unwrap();
    let features = features(loaded, dir, golden, case);
    // A continuation that generates the image token itself: mlx-vlm's teacher-forced pass
    // scatters image features into it too (its masked_scatter wraps around to the first row),
    // which generation never does, so rows from that position on are not comparable.
    let fed = case.greedy_ids.len() - 1;
    let fed = case.greedy_ids[..fed]
        .iter()
        .position(|&id| id == IMAGE_TOKEN)
        .unwrap_or(fed);
    let mut ids = case.input_ids.clone();
    ids.extend(&case.greedy_ids[..fed]);
    let mut caches = loaded.model.new_cache(4096);
    let logits = vision
        .forward_with_images(
            &ids_array(&ids),
            features.as_ref(),
            &mut caches,
            Logits::All,
        )
        .unwrap();
    let prompt = case.input_ids.len();
    let step0 = rows(&logits)[prompt - 1].clone();
    let diff = max_diff(&step0, &case.step0_logits);
    eprintln!("{dir} {}: step-0 logits max diff {diff:e}", case.name);
    assert!(
        diff <= tol.logits,
        "{}: step-0 logits differ by {diff}",
        case.name
    );
    let logprobs = log_softmax_rows(&logits);
    let got: Vec<f32> = case.greedy_ids[..=fed]
        .iter()
        .enumerate()
        .map(|(i, &id)| logprobs[prompt - 1 + i][id as usize])
        .collect();
    let diff = max_diff(&got, &case.teacher_forced_logprobs[..=fed]);
    eprintln!(
        "{dir} {}: teacher-forced log-prob max diff {diff:e}",
        case.name
    );
    assert!(
        diff <= tol.logprobs,
        "{}: log-probs differ by {diff}",
        case.name
    );
    step0
}

/// Image soft-token spans and whole blocks (`<|image>` … `<image|>`) of a prompt.
fn spans_and_blocks(ids: &[u32]) -> (Vec<Range<usize>>, Vec<Range<usize>>) {
    let mut spans: Vec<Range<usize>> = Vec::new();
    for (at, &id) in ids.iter().enumerate() {
        if id == IMAGE_TOKEN {
            match spans.last_mut() {
                Some(span) if span.end == at => span.end = at + 1,
                _ => spans.push(at..at + 1),
            }
        }
    }
    let blocks = spans
        .iter()
        .map(|span| {
            assert_eq!(ids[span.start - 1], BOI);
            assert_eq!(ids[span.end], EOI);
            span.start - 1..span.end + 1
        })
        .collect();
    (spans, blocks)
}

/// Prefill in chunks of `chunk` (image blocks kept whole), then decode the golden's greedy
/// ids one at a time; returns each step's log-prob of the golden token and our argmax.
fn cached_decode(
    loaded: &LoadedModel,
    features: Option<VisionFeatures>,
    case: &Case,
    chunk: usize,
) -> (Vec<f32>, Vec<u32>) {
    let model = loaded.model.as_ref();
    let mut caches = model.new_cache(4096);
    let prompt = &case.input_ids;
    let last = prompt.len() - 1;
    match features {
        Some(features) => {
            let (spans, blocks) = spans_and_blocks(prompt);
            let images = ImagePrefill {
                features,
                first_image: 0,
                spans,
                blocks,
                started: None,
            };
            prefill(
                model.as_vision().unwrap(),
                &images,
                prompt,
                0..last,
                chunk,
                &mut caches,
            )
            .unwrap();
        }
        None => {
            for start in (0..last).step_by(chunk) {
                let end = (start + chunk).min(last);
                model
                    .forward(&ids_array(&prompt[start..end]), &mut caches, Logits::Last)
                    .unwrap();
            }
        }
    }
    let mut logits = model
        .forward(&ids_array(&prompt[last..]), &mut caches, Logits::Last)
        .unwrap();
    let (mut logprobs, mut argmax) = (Vec::new(), Vec::new());
    for &id in &case.greedy_ids {
        let row = &log_softmax_rows(&logits)[0];
        logprobs.push(row[id as usize]);
        let best = row
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b });
        argmax.push(best.0 as u32);
        logits = model
            .forward(&ids_array(&[id]), &mut caches, Logits::Last)
            .unwrap();
    }
    (logprobs, argmax)
}

#[test]
fn fp32_logits_and_logprobs_match_mlx_vlm_and_the_mirror_moves_them() {
    let dir = "gemma4-tiny";
    let golden = golden(dir);
    let loaded = load_model(&fixture(dir)).unwrap();
    assert!(loaded.info.vision);
    assert_eq!(loaded.info.model_type, "gemma4");
    // Six layers, the last two KV-shared: four caches.
    assert_eq!(loaded.model.new_cache(64).len(), 4);
    let mut step0 = HashMap::new();
    for case in &golden.cases {
        step0.insert(
            case.name.clone(),
            check_teacher_forced(&loaded, dir, &golden, case, &FP32),
        );
    }
    let flip = max_diff(&step0["single_image"], &step0["single_image_mirrored"]);
    let want = golden.flip_check.step0_logits_max_abs_diff;
    assert!(
        (flip - want).abs() < 1e-3,
        "mirroring moved logits by {flip}, golden {want}"
    );
}

#[test]
fn kv_cache_decode_and_every_chunk_size_match_the_golden() {
    // The prompts (98-209 tokens) are longer than the 64-token sliding window, so decode
    // exercises the window; chunk 1 and 7 put boundaries inside image blocks, which prefill
    // moves to the block edges.
    let dir = "gemma4-tiny";
    let golden = golden(dir);
    let loaded = load_model(&fixture(dir)).unwrap();
    for case in &golden.cases {
        for chunk in [1, 7, 4096] {
            let features = features(&loaded, dir, &golden, case);
            let (logprobs, argmax) = cached_decode(&loaded, features, case, chunk);
            let diff = max_diff(&logprobs, &case.greedy_step_logprobs);
            eprintln!(
                "{} chunk {chunk}: decode log-prob max diff {diff:e}",
                case.name
            );
            assert!(diff <= FP32.logprobs, "{} chunk {chunk}: {diff}", case.name);
            for (step, (&got, &want)) in argmax.iter().zip(&case.greedy_ids).enumerate() {
                // Exact ids wherever the reference's own top-2 margin leaves room.
                if case.top1_top2_margins[step] > 1e-3 {
                    assert_eq!(got, want, "{} chunk {chunk} step {step}", case.name);
                }
            }
        }
    }
}

#[test]
fn bidirectional_image_attention_is_what_the_golden_needs() {
    // With image spans attending causally only, the logits move well past the tolerance:
    // the golden's bidirectional spans are load-bearing, not an accident of the fixture.
    let dir = "gemma4-tiny";
    let golden = golden(dir);
    let loaded = load_model(&fixture(dir)).unwrap();
    let case = golden
        .cases
        .iter()
        .find(|c| c.name == "single_image")
        .unwrap();
    let features = features(&loaded, dir, &golden, case).unwrap();
    let vision = loaded.model.as_vision().unwrap();
    // Split right after the first soft token: the rest of the block is a later chunk, so the
    // first soft token cannot see it (what a chunker that splits images would do).
    let (spans, _) = spans_and_blocks(&case.input_ids);
    let cut = spans[0].start + 1;
    let mut caches = loaded.model.new_cache(4096);
    let first = VisionFeatures {
        embeds: mlx_rs::ops::indexing::IndexOp::index(&features.embeds, 0..1),
        deepstack: Vec::new(),
        grid_thw: features.grid_thw.clone(),
    };
    let rest = VisionFeatures {
        embeds: mlx_rs::ops::indexing::IndexOp::index(&features.embeds, 1..),
        deepstack: Vec::new(),
        grid_thw: features.grid_thw.clone(),
    };
    vision
        .forward_with_images(
            &ids_array(&case.input_ids[..cut]),
            Some(&first),
            &mut caches,
            Logits::Last,
        )
        .unwrap();
    let split = vision
        .forward_with_images(
            &ids_array(&case.input_ids[cut..]),
            Some(&rest),
            &mut caches,
            Logits::Last,
        )
        .unwrap();
    let diff = max_diff(&rows(&split)[0], &case.step0_logits);
    assert!(
        diff > 100.0 * FP32.logits,
        "splitting the image changed nothing ({diff})"
    );
}

#[test]
fn image_token_count_must_equal_the_features() {
    let dir = "gemma4-tiny";
    let golden = golden(dir);
    let loaded = load_model(&fixture(dir)).unwrap();
    let vision = loaded.model.as_vision().unwrap();
    let two = golden
        .cases
        .iter()
        .find(|c| c.name == "two_images_one_turn")
        .unwrap();
    let one = vision
        .encode_images(&image_input(dir, &golden, &two.images[..1]))
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
                tokens: 126,
                features: 63
            }
        ),
        "{error}"
    );
}

#[test]
fn mxfp4_checkpoint_loads_strictly_and_matches() {
    // mxfp4 language model (embeddings and the per-layer table included), bf16 tower.
    // Measured: bit-exact on the CPU backend (pooling weights each patch before summing, as
    // the reference's einsum: summing first moved logits by 0.2). The bound stays under the
    // reference's own KV-cache-vs-full-forward spread of 0.03.
    let dir = "gemma4-tiny-mxfp4";
    let golden = golden(dir);
    let loaded = load_model(&fixture(dir)).unwrap();
    assert_eq!(
        loaded.info.quantization.as_deref(),
        Some("mxfp4 4-bit, group 32")
    );
    let tolerance = Tolerance {
        logits: 0.02,
        logprobs: 0.02,
    };
    for case in &golden.cases {
        check_teacher_forced(&loaded, dir, &golden, case, &tolerance);
    }
}

/// Every Gemma 4 release, built from its published config (tests/fixtures/releases): E2B and
/// E4B with their audio towers (checked and set aside), KV-shared spans and per-layer inputs
/// (E2B's double-wide MLP), 26B-A4B base and -it with the MoE block beside the dense MLP and
/// k_eq_v full layers, the dense k_eq_v 31B, all in the Google release's layout, and the
/// mlx-community QAT 4-bit conversion (8-bit router and MLP) in mlx's.
const RELEASES: [(&str, f32); 6] = [
    ("gemma-4-e2b-it", 1e-4),
    ("gemma-4-e4b-it", 1e-4),
    ("gemma-4-26b-a4b", 1e-4),
    ("gemma-4-26b-a4b-it", 1e-4),
    ("gemma-4-31b-it", 1e-4),
    ("gemma-4-26b-a4b-it-qat-4bit", 0.05),
];

#[test]
fn releases_match_mlx_vlm() {
    for (release, bound) in RELEASES {
        let dir = format!("releases/{release}");
        let golden = golden(&dir);
        let loaded = load_model(&fixture(&dir)).unwrap();
        assert!(loaded.info.vision, "{release}");
        let tolerance = Tolerance {
            logits: bound,
            logprobs: bound,
        };
        let mut step0 = HashMap::new();
        for case in &golden.cases {
            step0.insert(
                case.name.clone(),
                check_teacher_forced(&loaded, &dir, &golden, case, &tolerance),
            );
        }
        let flip = max_diff(&step0["single_image"], &step0["single_image_mirrored"]);
        let want = golden.flip_check.step0_logits_max_abs_diff;
        assert!(
            (flip - want).abs() < 0.05_f32.max(bound),
            "{release}: flip {flip} vs {want}"
        );
    }
}

/// The cached decode path of the structures new to the releases (KV-shared layers with the
/// audio tower set aside; experts and k_eq_v): chunk 1, 7 and whole prefill give the
/// golden's decode log-probs, and greedy ids where the reference's margin is clear.
#[test]
fn release_decode_and_chunking_match_the_golden() {
    for release in ["gemma-4-e2b-it", "gemma-4-26b-a4b-it"] {
        let dir = format!("releases/{release}");
        let golden = golden(&dir);
        let loaded = load_model(&fixture(&dir)).unwrap();
        for case in golden
            .cases
            .iter()
            .filter(|case| matches!(case.name.as_str(), "two_images_one_turn" | "text_only"))
        {
            for chunk in [1, 7, 4096] {
                let features = features(&loaded, &dir, &golden, case);
                let (logprobs, argmax) = cached_decode(&loaded, features, case, chunk);
                let diff = max_diff(&logprobs, &case.greedy_step_logprobs);
                eprintln!(
                    "{release} {} chunk {chunk}: decode log-prob max diff {diff:e}",
                    case.name
                );
                assert!(
                    diff <= FP32.logprobs,
                    "{release} {} chunk {chunk}: {diff}",
                    case.name
                );
                for (step, (&got, &want)) in argmax.iter().zip(&case.greedy_ids).enumerate() {
                    if case.top1_top2_margins[step] > 1e-3 {
                        assert_eq!(
                            got, want,
                            "{release} {} chunk {chunk} step {step}",
                            case.name
                        );
                    }
                }
            }
        }
    }
}
