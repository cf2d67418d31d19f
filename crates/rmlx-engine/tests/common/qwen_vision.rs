//! The mlx-vlm golden schema of the Qwen vision families (`rmlx-vision-golden/1`, written by
//! scripts/fixtures/make_vision.py and make_releases.py) and the check every family runs on it:
//! one forward over prompt + greedy ids with the case's images against the step-0 logits and
//! the teacher-forced log-probs. Shared by qwen3_vl_golden.rs and qwen3_5_golden.rs.
#![allow(dead_code)]

use std::collections::HashMap;

use mlx_rs::Array;
use rmlx_engine::models::{ImageInput, LoadedModel, Logits};

use super::{ids_array, log_softmax_rows, max_diff, qwen_patchify, rows, Tolerance};

#[derive(serde::Deserialize)]
pub struct Golden {
    pub preprocessed_images: HashMap<String, Preprocessed>,
    pub flip_check: FlipCheck,
    pub cases: Vec<Case>,
    /// Qwen3.5: how far mlx-vlm's own chunked CPU prefill is from these (sequential) goldens.
    #[serde(default)]
    pub chunked_prefill_max_abs_logprob_diff: Option<f32>,
}

#[derive(serde::Deserialize)]
pub struct FlipCheck {
    pub step0_logits_max_abs_diff: f32,
}

#[derive(serde::Deserialize)]
pub struct Preprocessed {
    pub resized_file: String,
    pub grid_thw: [i32; 3],
    pub pixel_values: PixelRecord,
}

#[derive(serde::Deserialize)]
pub struct PixelRecord {
    pub shape: [usize; 2],
    pub first64: Vec<f32>,
    pub sum: f64,
}

#[derive(serde::Deserialize)]
pub struct Case {
    pub name: String,
    pub images: Vec<String>,
    pub input_ids: Vec<u32>,
    #[serde(default)]
    pub image_grid_thw: Option<Vec<[i32; 3]>>,
    #[serde(default)]
    pub mrope_position_ids: Option<Vec<Vec<i32>>>,
    #[serde(default)]
    pub mrope_rope_delta: Option<i32>,
    pub step0_logits: Vec<f32>,
    pub greedy_ids: Vec<u32>,
    pub greedy_step_logprobs: Vec<f32>,
    pub teacher_forced_logprobs: Vec<f32>,
}

/// The pixel rows of the named images, rebuilt from their resized PNGs, in order.
pub fn image_input(golden: &Golden, names: &[String]) -> ImageInput {
    let mut pixels = Vec::new();
    let mut grid_thw = Vec::new();
    for name in names {
        let (rows, grid) = qwen_patchify(&golden.preprocessed_images[name].resized_file);
        pixels.extend(rows);
        grid_thw.push(grid);
    }
    let patches = (pixels.len() / 1536) as i32;
    ImageInput {
        pixel_values: Array::from_slice(&pixels, &[patches, 1536]),
        grid_thw,
    }
}

/// One forward over prompt + greedy ids[..n-1] with the case's images: the step-0 logits and
/// the teacher-forced log-probs within `tol` of the golden. Returns the step-0 logits.
pub fn check_teacher_forced(
    loaded: &LoadedModel,
    golden: &Golden,
    case: &Case,
    tol: &Tolerance,
) -> Vec<f32> {
    let vision = loaded.model.as_vision().expect("a vision family");
    let features = (!case.images.is_empty()).then(|| {
        vision
            .encode_images(&image_input(golden, &case.images))
            .unwrap()
    });
    let mut ids = case.input_ids.clone();
    ids.extend(&case.greedy_ids[..case.greedy_ids.len() - 1]);
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
    let logit_diff = max_diff(&step0, &case.step0_logits);
    let logprobs = log_softmax_rows(&logits);
    let got: Vec<f32> = case
        .greedy_ids
        .iter()
        .enumerate()
        .map(|(i, &id)| logprobs[prompt - 1 + i][id as usize])
        .collect();
    let diff = max_diff(&got, &case.teacher_forced_logprobs);
    eprintln!(
        "  {}: step-0 logits {logit_diff:e}, teacher-forced log-probs {diff:e}",
        case.name
    );
    assert!(
        logit_diff <= tol.logits,
        "{}: step-0 logits differ by {logit_diff}",
        case.name
    );
    assert!(
        diff <= tol.logprobs,
        "{}: log-probs differ by {diff}",
        case.name
    );
    step0
}
