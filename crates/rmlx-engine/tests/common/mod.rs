//! Helpers the golden tests share: fixture paths, id arrays, logits rows and diffs.
#![allow(dead_code)]

use std::path::PathBuf;

use mlx_rs::{ops, Array, Dtype};

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
