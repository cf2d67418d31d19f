//! The memory figures `fits`, `rmlx info` and `rmlx bench --kv-table` print
//! (`models::structure`) are what the engine allocates. On shrunk releases (the fixtures
//! compute in float32, so their config is read as float32): after a prompt and decode steps
//! that end on a growth step, the full-length layers hold exactly `kv_bytes_per_token_stored`
//! per position, dense and at 8 and 4 bits, and Gemma 4's sliding layers no more than their
//! window (`window_state_bytes`) plus one growth step.

mod common;

use common::{fixture, ids_array};
use rmlx_engine::{
    cache::{KvCache, GROWTH_STEP},
    models::{load_model, structure, Logits},
};
use serde_json::Value;

/// The fixture's config as it runs: float32 activations.
fn float32_config(dir: &str) -> Value {
    let text = std::fs::read_to_string(fixture(dir).join("config.json")).unwrap();
    let mut config: Value = serde_json::from_str(&text).unwrap();
    config["torch_dtype"] = Value::from("float32");
    if let Some(text) = config.get_mut("text_config") {
        text["torch_dtype"] = Value::from("float32");
        text["dtype"] = Value::from("float32");
    }
    config
}

#[test]
fn structure_figures_are_what_the_caches_allocate() {
    let (prompt_len, steps) = (3 * GROWTH_STEP as usize, GROWTH_STEP as usize);
    let positions = prompt_len + steps;
    for dir in [
        "head-sizes/qwen3-hd128",
        "releases/gemma-4-31b-it",
        "releases/gemma-4-e2b-it",
    ] {
        let config = float32_config(dir);
        let loaded = load_model(&fixture(dir)).unwrap();
        let model = loaded.model.as_ref();
        let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| 10 + i % 300).collect();
        for bits in [None, Some(8), Some(4)] {
            let mut caches = model.new_cache(positions);
            if let Some(bits) = bits {
                common::quantize_caches(&mut caches, bits);
            }
            model
                .forward(&ids_array(&prompt), &mut caches, Logits::Last)
                .unwrap();
            for _ in 0..steps {
                model
                    .forward(&ids_array(&[11]), &mut caches, Logits::Last)
                    .unwrap();
            }
            let bytes = |windowed: bool| -> u64 {
                caches
                    .iter()
                    .filter(|cache| cache.is_windowed() == windowed)
                    .map(KvCache::nbytes)
                    .sum::<usize>() as u64
            };
            let want = structure::kv_bytes_per_token_stored(&config, bits) * positions as u64;
            assert_eq!(bytes(false), want, "{dir} {bits:?}: full-length layers");
            let window = structure::window_state_bytes(&config);
            let per_token = structure::sliding_bytes_per_token(&config);
            assert!(
                bytes(true) <= window + per_token * GROWTH_STEP as u64,
                "{dir}: windows hold {} bytes, the figure is {window}",
                bytes(true)
            );
            assert_eq!(window > 0, dir.contains("gemma"), "{dir}");
        }
    }
}
