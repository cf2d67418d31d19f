//! Gemma 4's sliding-window layers keep only their window (`KvCache::windowed`): every logit
//! equals the full-length KV's (what every layer kept before) on prompts several windows long,
//! prefilled in chunks of 1, 7 and whole, through decode past many drops, with the KV-shared
//! layers of E2B, and with a picture whose soft tokens outnumber the window (its span attends
//! both ways). The windowed caches are checked to have dropped and to stay bounded.
//! Reference: mlx-lm `models/cache.py` (`RotatingKVCache`) keeps the same positions.

use std::ops::Range;

mod common;

use common::{fixture, ids_array, max_diff, rows};
use mlx_rs::Array;
use rmlx_engine::{
    cache::{KvCache, GROWTH_STEP, WINDOW_SLACK},
    models::{load_model, ImageInput, LanguageModel, Logits},
    multimodal::{prefill, ImagePrefill},
    vision::preprocess::Gemma4ImageConfig,
};

const IMAGE_TOKEN: u32 = 995;
const BOI: u32 = 993;
const EOI: u32 = 994;
/// The fixtures' `sliding_window`.
const WINDOW: i32 = 64;
/// Same graph on the same keys: equal to rounding (measured 0).
const TOLERANCE: f32 = 1e-5;

/// Text ids that are no special token.
fn text_ids(len: usize, seed: u32) -> Vec<u32> {
    common::text_ids(len, seed, 100, 800)
}

/// Every cache as one full-length KV, as every layer kept before windows.
fn full_length(model: &dyn LanguageModel, max_ctx: usize) -> Vec<KvCache> {
    (0..model.new_cache(max_ctx).len())
        .map(|_| KvCache::new(max_ctx))
        .collect()
}

fn assert_windows_bounded(caches: &[KvCache], chunk: i32) {
    let windowed: Vec<&KvCache> = caches.iter().filter(|cache| cache.base() > 0).collect();
    assert!(
        !windowed.is_empty(),
        "no sliding layer dropped old positions"
    );
    for cache in windowed {
        let held = cache.capacity() - cache.base();
        assert!(
            held <= WINDOW - 1 + WINDOW_SLACK + chunk + GROWTH_STEP,
            "a windowed cache holds {held} positions"
        );
    }
}

/// Prefills `prompt` in chunks of `chunk` (logits of every position) and decodes `steps`
/// greedy tokens, into both cache sets; every row of logits must agree.
fn check_text(dir: &str, prompt: &[u32], chunk: usize, steps: usize) {
    let loaded = load_model(&fixture(dir)).unwrap();
    let model = loaded.model.as_ref();
    let max_ctx = prompt.len() + steps + 8;
    let (mut windowed, mut full) = (model.new_cache(max_ctx), full_length(model, max_ctx));
    let mut last = None;
    for (index, piece) in prompt.chunks(chunk).enumerate() {
        let ids = ids_array(piece);
        let a = rows(&model.forward(&ids, &mut windowed, Logits::All).unwrap());
        let b = rows(&model.forward(&ids, &mut full, Logits::All).unwrap());
        for (row, (a, b)) in a.iter().zip(&b).enumerate() {
            let diff = max_diff(a, b);
            assert!(
                diff <= TOLERANCE,
                "{dir} chunk {chunk}: position {} differs by {diff}",
                index * chunk + row
            );
        }
        last = a.last().cloned();
    }
    let mut logits = last.unwrap();
    for step in 0..steps {
        let next = argmax(&logits);
        let ids = ids_array(&[next]);
        let a = rows(&model.forward(&ids, &mut windowed, Logits::Last).unwrap());
        let b = rows(&model.forward(&ids, &mut full, Logits::Last).unwrap());
        let diff = max_diff(&a[0], &b[0]);
        assert!(
            diff <= TOLERANCE,
            "{dir} chunk {chunk}: decode step {step} differs by {diff}"
        );
        logits = a[0].clone();
    }
    assert_windows_bounded(&windowed, chunk as i32);
}

fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::MIN),
            |best, (i, &v)| if v > best.1 { (i, v) } else { best },
        )
        .0 as u32
}

#[test]
fn windowed_sliding_layers_give_the_full_length_logits() {
    // 500 prompt tokens (8 windows) and 200 decoded: the windows drop several times.
    let prompt = text_ids(500, 7);
    for chunk in [1, 7, prompt.len()] {
        check_text("gemma4-tiny", &prompt, chunk, 200);
    }
    // E2B: KV-shared layers read the windowed keys of the layer they share.
    check_text("releases/gemma-4-e2b-it", &prompt, 7, 200);
}

#[test]
fn an_image_longer_than_the_window_attends_as_before() {
    let dir = "gemma4-tiny";
    let loaded = load_model(&fixture(dir)).unwrap();
    let model = loaded.model.as_ref();
    let vision = model.as_vision().unwrap();
    // A 200 x 150 picture at the 140-token budget: more soft tokens than the 64-token window.
    let config = Gemma4ImageConfig::load(&fixture(dir)).unwrap();
    let picture = image::RgbImage::from_fn(200, 150, |x, y| {
        image::Rgb([(x % 256) as u8, (y * 2 % 256) as u8, ((x + y) % 256) as u8])
    });
    let processed = config.preprocess(&picture, Some(140)).unwrap();
    let soft = processed.num_soft_tokens;
    assert!(soft as i32 > WINDOW, "{soft} soft tokens");
    let [h, w] = processed.patch_grid_hw;
    let mut pixels = Vec::new();
    processed
        .patch_rows(config.patch_size, &mut pixels)
        .unwrap();
    let input = ImageInput {
        pixel_values: Array::from_slice(&pixels, &[(pixels.len() / 768) as i32, 768]),
        grid_thw: vec![[1, h as i32, w as i32]],
    };
    // 300 text tokens, the picture, 40 more.
    let mut prompt = text_ids(300, 11);
    let span: Range<usize> = prompt.len() + 1..prompt.len() + 1 + soft;
    prompt.push(BOI);
    prompt.extend(std::iter::repeat_n(IMAGE_TOKEN, soft));
    prompt.push(EOI);
    prompt.extend(text_ids(40, 13));
    let last = prompt.len() - 1;
    for chunk in [7, prompt.len()] {
        let max_ctx = prompt.len() + 80;
        let mut answers = Vec::new();
        for mut caches in [model.new_cache(max_ctx), full_length(model, max_ctx)] {
            let images = ImagePrefill {
                features: vision.encode_images(&input).unwrap(),
                first_image: 0,
                spans: std::iter::once(span.clone()).collect(),
                blocks: std::iter::once(span.start - 1..span.end + 1).collect(),
                started: None,
            };
            prefill(vision, &images, &prompt, 0..last, chunk, &mut caches).unwrap();
            let mut logits = rows(
                &model
                    .forward(&ids_array(&prompt[last..]), &mut caches, Logits::Last)
                    .unwrap(),
            );
            let mut seen = vec![logits[0].clone()];
            for _ in 0..60 {
                let next = argmax(&logits[0]);
                logits = rows(
                    &model
                        .forward(&ids_array(&[next]), &mut caches, Logits::Last)
                        .unwrap(),
                );
                seen.push(logits[0].clone());
            }
            answers.push((seen, caches));
        }
        let (windowed, full) = (&answers[0], &answers[1]);
        for (step, (a, b)) in windowed.0.iter().zip(&full.0).enumerate() {
            let diff = max_diff(a, b);
            assert!(
                diff <= TOLERANCE,
                "chunk {chunk}: step {step} differs by {diff}"
            );
        }
        assert_windows_bounded(&windowed.1, chunk.max(soft + 2) as i32);
    }
}
