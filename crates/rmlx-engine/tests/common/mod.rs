//! Helpers the golden tests share: fixture paths, id arrays, logits rows and diffs.
#![allow(dead_code)]

pub mod adversary;

use std::path::PathBuf;

use mlx_rs::{ops, Array, Dtype};

pub mod qwen_vision;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

pub fn golden<T: serde::de::DeserializeOwned>(dir: &str) -> T {
    let text = std::fs::read_to_string(fixture(dir).join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// `[1, L]` int32 ids.
pub fn ids_array(ids: &[u32]) -> Array {
    let ids: Vec<i32> = ids.iter().map(|&id| id as i32).collect();
    Array::from_slice(&ids, &[1, ids.len() as i32])
}

/// The last-axis rows of `[.., L, V]` logits as f32 vectors.
pub fn rows(array: &Array) -> Vec<Vec<f32>> {
    let array = array.as_dtype(Dtype::Float32).unwrap();
    array.eval().unwrap();
    let vocab = *array.shape().last().unwrap() as usize;
    array
        .as_slice::<f32>()
        .chunks(vocab)
        .map(<[f32]>::to_vec)
        .collect()
}

/// Log-softmax rows of logits, as f32 vectors.
pub fn log_softmax_rows(logits: &Array) -> Vec<Vec<f32>> {
    let logits = logits.as_dtype(Dtype::Float32).unwrap();
    rows(&ops::subtract(&logits, ops::logsumexp_axis(&logits, -1, true).unwrap()).unwrap())
}

/// `len` ids in `low..low + span`, in a fixed pseudo-random order (an LCG from `seed`; the
/// fixture scripts draw the same): text that is no special token.
pub fn text_ids(len: usize, seed: u32, low: u32, span: u32) -> Vec<u32> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            low + (state >> 8) % span
        })
        .collect()
}

/// Stores the KV of every cache but the sliding-window ones at `bits` (as the engine does for
/// `--kv-bits`).
pub fn quantize_caches(caches: &mut [rmlx_engine::cache::KvCache], bits: i32) {
    let storage = rmlx_engine::cache::KvStorage::quantized(bits).unwrap();
    caches
        .iter_mut()
        .filter(|cache| !cache.is_windowed())
        .for_each(|cache| cache.set_storage(storage));
}

/// An answer equals the uncached engine's: the same ids, every log-prob within `tolerance`.
pub fn assert_same_as_uncached(
    what: &str,
    cached: &rmlx_engine::generate::Completion,
    uncached: &rmlx_engine::generate::Completion,
    tolerance: f32,
) {
    assert_eq!(cached.token_ids, uncached.token_ids, "{what}");
    let (got, want) = (
        cached.logprobs.as_ref().unwrap(),
        uncached.logprobs.as_ref().unwrap(),
    );
    for (a, b) in got.iter().zip(want) {
        assert!(
            (a.logprob - b.logprob).abs() <= tolerance,
            "{what}: log-prob {} vs uncached {}",
            a.logprob,
            b.logprob
        );
    }
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// How far logits and log-probs may be from the golden.
pub struct Tolerance {
    pub logits: f32,
    pub logprobs: f32,
}

/// Qwen3-VL / Qwen3.5 pixel rows of a resized PNG (tests/fixtures/README.md's formula): `(f32(u8) * f32(1/255) - 0.5) / 0.5`, CHW, patches in merge-block
/// order `(bh, bw, mh, mw)`, each row `[C=3][T=2, the frame repeated][16][16]`.
pub fn qwen_patchify(path: &str) -> (Vec<f32>, [i32; 3]) {
    let image = image::open(fixture(path)).unwrap().to_rgb8();
    let (width, height) = (image.width() as usize, image.height() as usize);
    let (patch, merge, temporal) = (16usize, 2usize, 2usize);
    let (grid_h, grid_w) = (height / patch, width / patch);
    let value = |c: usize, y: usize, x: usize| {
        let byte = image.get_pixel(x as u32, y as u32)[c];
        (byte as f32 * (1.0f32 / 255.0) - 0.5f32) / 0.5f32
    };
    let mut out = Vec::with_capacity(grid_h * grid_w * 3 * temporal * patch * patch);
    for bh in 0..grid_h / merge {
        for bw in 0..grid_w / merge {
            for mh in 0..merge {
                for mw in 0..merge {
                    let (py, px) = ((bh * merge + mh) * patch, (bw * merge + mw) * patch);
                    for c in 0..3 {
                        for _ in 0..temporal {
                            for y in 0..patch {
                                for x in 0..patch {
                                    out.push(value(c, py + y, px + x));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    (out, [1, grid_h as i32, grid_w as i32])
}

/// Two answers to the same greedy request are the same: tokens equal, log-probs and the top
/// alternatives within 1e-5 (speculative decoding against plain decode).
pub fn assert_same(
    plain: &rmlx_engine::generate::Completion,
    other: &rmlx_engine::generate::Completion,
    what: &str,
) {
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

/// The two-sample chi-square p-value of two sets of answers (each answer one cell), cells
/// rare in both pooled into one.
pub fn two_sample_p_value(a: &[Vec<u32>], b: &[Vec<u32>]) -> f64 {
    use std::collections::BTreeMap;
    let mut cells: BTreeMap<&[u32], (f64, f64)> = BTreeMap::new();
    a.iter()
        .for_each(|key| cells.entry(key).or_default().0 += 1.0);
    b.iter()
        .for_each(|key| cells.entry(key).or_default().1 += 1.0);
    let mut pooled = Vec::new();
    let mut rare = (0.0, 0.0);
    for (_, (x, y)) in cells {
        if x + y < 10.0 {
            rare = (rare.0 + x, rare.1 + y);
        } else {
            pooled.push((x, y));
        }
    }
    if rare.0 + rare.1 > 0.0 {
        pooled.push(rare);
    }
    let (total_a, total_b) = (a.len() as f64, b.len() as f64);
    let statistic: f64 = pooled
        .iter()
        .map(|(x, y)| {
            let d = x * (total_b / total_a).sqrt() - y * (total_a / total_b).sqrt();
            d * d / (x + y)
        })
        .sum();
    chi_square_p_value(statistic, pooled.len() - 1)
}

/// P(χ²_k ≥ x) (the series of the regularised lower incomplete gamma function).
pub fn chi_square_p_value(x: f64, k: usize) -> f64 {
    let (a, half) = (k as f64 / 2.0, x / 2.0);
    let (mut term, mut sum, mut n) = (1.0 / a, 1.0 / a, 0.0);
    while term > 1e-17 * sum {
        n += 1.0;
        term *= half / (a + n);
        sum += term;
    }
    let mut ln_gamma = 0.0f64;
    let mut z = a;
    while z > 1.0 {
        z -= 1.0;
        ln_gamma += z.ln();
    }
    if z == 0.5 {
        ln_gamma += std::f64::consts::PI.sqrt().ln();
    }
    (1.0 - (-half + a * half.ln() - ln_gamma).exp() * sum).max(0.0)
}

/// Submits every `(prompt ids, params)` to `engine` for the model in `model` at once (so they
/// can batch), then waits for each answer, in order.
pub fn answer_all(
    engine: &rmlx_engine::engine::Engine,
    model: &std::path::Path,
    rows: Vec<(Vec<u32>, rmlx_engine::generate::GenerateParams)>,
) -> Vec<rmlx_engine::generate::Completion> {
    let handles: Vec<_> = rows
        .into_iter()
        .map(|(prompt, params)| {
            engine
                .submit(rmlx_engine::engine::Request {
                    model: model.to_path_buf(),
                    prompt: rmlx_engine::engine::Prompt::Ids(prompt),
                    params,
                    ..Default::default()
                })
                .unwrap()
        })
        .collect();
    handles
        .into_iter()
        .map(|handle| handle.wait().unwrap())
        .collect()
}

/// Runs `tests` of this test binary again in a child process with the switch `var` set to 1
/// (the engine reads such switches once per process) and asserts that every one passed. In
/// the child itself it does nothing: the caller's test is what its parent ran.
pub fn rerun_in_child_with(var: &str, tests: &[&str]) {
    if std::env::var_os(var).is_some() {
        return;
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .arg("--exact")
        .args(tests)
        .env(var, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let passed = format!("{} passed", tests.len());
    assert!(stdout.contains(&passed), "{stdout}");
}
