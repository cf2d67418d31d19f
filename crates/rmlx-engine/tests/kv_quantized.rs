//! The quantized KV cache (`--kv-bits 8|4`, `KvStorage::Quantized`) on checkpoints with the
//! released head sizes (tests/fixtures/head-sizes: Qwen3 with heads of 128 and of 256, 4 query
//! heads over 1 KV head; scripts/fixtures/make_head_sizes.py).
//! - Accuracy: teacher-forced log-probs against the dense (fp32) cache, a prompt prefilled in
//!   chunks then 48 decode steps, stay within a stated bound: a numerical bound on random
//!   weights, not a quality claim.
//! - The two attention paths over the same quantized cache agree: prefill chunks dequantize one
//!   layer into the fused SDPA, single queries use quantized matmuls (mlx-lm's
//!   `quantized_scaled_dot_product_attention`), so a prompt fed one token at a time gives the
//!   logits of the prompt prefilled whole.
//! - A batch and the prefix cache: batched rows equal their solo runs, a repeated conversation
//!   is served from the cache with the same answers.

mod common;

use common::{fixture, ids_array, log_softmax_rows, max_diff, rows};
use rmlx_engine::{
    cache::{KvCache, KvStorage},
    engine::{Engine, EngineOptions, Prompt, Request},
    generate::{Completion, GenerateParams},
    models::{load_model, LanguageModel, Logits},
};

const FIXTURES: [&str; 2] = ["head-sizes/qwen3-hd128", "head-sizes/qwen3-hd256"];
/// Against the dense cache, on these random-weight fixtures (what mlx-lm's own quantized cache
/// gives there: 8-bit 0.044 / 0.078, 4-bit 1.28 / 0.84 for heads of 128 / 256). A numerical bound
/// on random weights, not a quality claim: random attention has no outlier-free structure.
const BOUND: [(i32, f32); 2] = [(8, 0.1), (4, 1.5)];
/// Our prefill dequantizes into the fused SDPA where mlx-lm multiplies quantized: the same
/// quantized values in another summation order.
const QUANTIZED_VS_MLX_LM: f32 = 1e-3;

fn text_ids(len: usize, seed: u32) -> Vec<u32> {
    common::text_ids(len, seed, 10, 500)
}

fn caches(model: &dyn rmlx_engine::models::LanguageModel, bits: Option<i32>) -> Vec<KvCache> {
    let mut caches = model.new_cache(4096);
    if let Some(bits) = bits {
        common::quantize_caches(&mut caches, bits);
    }
    caches
}

/// The logits of `prompt` fed one token at a time (every position through the quantized
/// matmuls) equal those of the prompt prefilled whole (dequantized into the fused SDPA).
fn one_by_one_equals_whole(
    what: &str,
    model: &dyn LanguageModel,
    prompt: &[u32],
    bits: i32,
) -> Vec<KvCache> {
    let mut whole = caches(model, Some(bits));
    let a = rows(
        &model
            .forward(&ids_array(prompt), &mut whole, Logits::All)
            .unwrap(),
    );
    let mut single = caches(model, Some(bits));
    for (at, &id) in prompt.iter().enumerate() {
        let b = rows(
            &model
                .forward(&ids_array(&[id]), &mut single, Logits::Last)
                .unwrap(),
        );
        let diff = max_diff(&a[at], &b[0]);
        assert!(
            diff <= 1e-4,
            "{what} {bits}-bit: position {at} differs by {diff}"
        );
    }
    whole
}

/// Log-probs of `fed` after `prompt` (prefilled in chunks of 64), the tokens fed one by one.
fn teacher_forced(dir: &str, bits: Option<i32>, prompt: &[u32], fed: &[u32]) -> Vec<Vec<f32>> {
    let loaded = load_model(&fixture(dir)).unwrap();
    let model = loaded.model.as_ref();
    let mut caches = caches(model, bits);
    let mut out = Vec::new();
    let mut logits = None;
    for piece in prompt.chunks(64) {
        logits = Some(
            model
                .forward(&ids_array(piece), &mut caches, Logits::Last)
                .unwrap(),
        );
    }
    let mut logits = logits.unwrap();
    for &id in fed {
        out.push(log_softmax_rows(&logits)[0].clone());
        logits = model
            .forward(&ids_array(&[id]), &mut caches, Logits::Last)
            .unwrap();
    }
    out
}

#[derive(serde::Deserialize)]
struct Golden {
    prompt_len: usize,
    fed_ids: Vec<u32>,
    /// "dense", "8bit", "4bit": mlx-lm's log-prob of each fed token.
    logprobs: std::collections::HashMap<String, Vec<f32>>,
}

#[test]
fn quantized_kv_log_probs_match_mlx_lm_and_stay_within_their_bound() {
    for dir in FIXTURES {
        let golden: Golden = common::golden(dir);
        let prompt = text_ids(golden.prompt_len, 5);
        let fed = &golden.fed_ids;
        let pick = |rows: Vec<Vec<f32>>| -> Vec<f32> {
            rows.iter()
                .zip(fed)
                .map(|(row, &id)| row[id as usize])
                .collect()
        };
        let dense = pick(teacher_forced(dir, None, &prompt, fed));
        let diff = max_diff(&dense, &golden.logprobs["dense"]);
        assert!(diff <= 1e-4, "{dir} dense: {diff} from mlx-lm");
        for (bits, bound) in BOUND {
            let got = pick(teacher_forced(dir, Some(bits), &prompt, fed));
            let reference = &golden.logprobs[&format!("{bits}bit")];
            let (vs_mlx_lm, vs_dense) = (max_diff(&got, reference), max_diff(&got, &dense));
            eprintln!(
                "{dir} {bits}-bit KV: max teacher-forced log-prob diff {vs_dense:.4} from the dense \
                 cache (mlx-lm's quantized cache: {:.4}), {vs_mlx_lm:.2e} from mlx-lm's",
                max_diff(reference, &golden.logprobs["dense"])
            );
            assert!(
                vs_mlx_lm <= QUANTIZED_VS_MLX_LM,
                "{dir} {bits}-bit: {vs_mlx_lm} from mlx-lm"
            );
            assert!(vs_dense <= bound, "{dir} {bits}-bit: {vs_dense} > {bound}");
        }
    }
}

#[test]
fn quantized_matmul_attention_equals_the_dequantized_fused_path() {
    let prompt = text_ids(150, 9);
    for dir in FIXTURES {
        let loaded = load_model(&fixture(dir)).unwrap();
        let model = loaded.model.as_ref();
        for bits in [8, 4] {
            // Whole: one chunk (dequantized into the fused SDPA). One by one: every position
            // through the quantized matmuls.
            one_by_one_equals_whole(dir, model, &prompt, bits);
        }
    }
}

/// Gemma 4 with its full-attention layers quantized (their heads are 32 wide here, grouped by
/// 32), its sliding ones windowed and dense, E2B's KV-shared layers reading the quantized keys of
/// the layer they share: a prompt fed one token at a time gives the logits of the prompt
/// prefilled whole, and the full layers' caches hold quantized parts.
#[test]
fn gemma4_full_layers_quantize_beside_dense_windows() {
    let prompt = text_ids(200, 3);
    for dir in ["gemma4-tiny", "releases/gemma-4-e2b-it"] {
        let loaded = load_model(&fixture(dir)).unwrap();
        let model = loaded.model.as_ref();
        let whole = one_by_one_equals_whole(dir, model, &prompt, 8);
        assert!(whole
            .iter()
            .any(|c| matches!(c.storage(), KvStorage::Quantized { group_size: 32, .. })));
        assert!(whole
            .iter()
            .all(|c| !c.is_windowed() || c.storage() == KvStorage::Dense));
    }
}

fn request(dir: &str, text: &str, max_tokens: usize) -> Request {
    Request {
        model: fixture(dir),
        prompt: Prompt::Chat {
            messages: vec![serde_json::json!({"role": "user", "content": text})],
            options: rmlx_engine::chat::TemplateOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        },
        params: GenerateParams {
            max_tokens,
            ignore_eos: true,
            logprobs: Some(1),
            ..GenerateParams::default()
        },
        ..Request::default()
    }
}

fn engine(max_batch: usize, prefix: bool) -> Engine {
    Engine::start_with(EngineOptions {
        max_batch,
        kv_bits: Some(8),
        prefix_cache_bytes: (!prefix).then_some(0),
        prefix_snapshot_bytes: (!prefix).then_some(0),
        ..EngineOptions::default()
    })
    .unwrap()
}

#[test]
fn quantized_rows_batch_and_reuse_the_prefix_cache_as_alone() {
    let dir = FIXTURES[0];
    let turns = [
        ("Hi", 30),
        ("a longer question with more words in it, and more", 12),
        ("2+2?", 24),
    ];
    let alone = engine(1, false);
    let solo: Vec<Completion> = turns
        .iter()
        .map(|&(text, max)| {
            alone
                .submit(request(dir, text, max))
                .unwrap()
                .wait()
                .unwrap()
        })
        .collect();
    drop(alone);
    let batched_engine = engine(4, true);
    for round in ["first", "repeated"] {
        let handles: Vec<_> = turns
            .iter()
            .map(|&(text, max)| batched_engine.submit(request(dir, text, max)).unwrap())
            .collect();
        let batched: Vec<Completion> = handles.into_iter().map(|h| h.wait().unwrap()).collect();
        for (index, (s, b)) in solo.iter().zip(&batched).enumerate() {
            assert_eq!(s.token_ids, b.token_ids, "{round} #{index}");
            let (s, b) = (s.logprobs.as_ref().unwrap(), b.logprobs.as_ref().unwrap());
            for (x, y) in s.iter().zip(b) {
                assert!((x.logprob - y.logprob).abs() <= 1e-4, "{round} #{index}");
            }
            if round == "repeated" {
                assert!(batched[index].cached_tokens > 0, "#{index}: nothing cached");
            }
        }
        if round == "first" {
            assert!(batched.iter().any(|c| c.batched_with >= 2), "never batched");
        }
    }
}

/// The batch's memory for KV counts what a quantized cache stores (`--kv-bits 8`), not the
/// dense bytes: two prompts past half the context, with memory for both rows stored 8-bit but
/// for under one context's dense KV, decode side by side and equal their solo runs.
#[test]
fn quantized_rows_are_counted_as_stored_in_the_memory_for_kv() {
    let dir = FIXTURES[0];
    let request = |seed: u32| Request {
        model: fixture(dir),
        prompt: Prompt::Ids(text_ids(100, seed)),
        params: GenerateParams {
            max_tokens: 4,
            max_ctx: Some(160),
            ignore_eos: true,
            ..GenerateParams::default()
        },
        ..Request::default()
    };
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(dir).join("config.json")).unwrap())
            .unwrap();
    let stored = rmlx_engine::models::structure::kv_bytes_per_token_stored(&config, Some(8));
    let dense = rmlx_engine::models::structure::kv_bytes_per_token(&config);
    let weights = rmlx_engine::runtime::memory_needed(&fixture(dir)).unwrap();
    // Each row reaches 104 positions: 260 stored hold both; as dense bytes under 160.
    let budget = weights + 2 * 260 * stored;
    assert!(
        260 * stored / dense < 160,
        "{stored} stored, {dense} dense bytes a position"
    );
    let engine = |max_batch: usize, memory_budget: Option<u64>| {
        Engine::start_with(EngineOptions {
            max_batch,
            kv_bits: Some(8),
            prefix_cache_bytes: Some(0),
            prefix_snapshot_bytes: Some(0),
            memory_budget,
            ..EngineOptions::default()
        })
        .unwrap()
    };
    let alone = engine(1, None);
    let solo: Vec<Completion> = (0..2)
        .map(|i| alone.submit(request(i)).unwrap().wait().unwrap())
        .collect();
    let together = engine(4, Some(budget));
    let hold = together.hold_for_warm_up();
    let handles: Vec<_> = (0..2)
        .map(|i| together.submit(request(i)).unwrap())
        .collect();
    together.model_info(&fixture(dir)).unwrap();
    drop(hold);
    for (index, (solo, handle)) in solo.iter().zip(handles).enumerate() {
        let answer = handle.wait().unwrap();
        assert_eq!(answer.token_ids, solo.token_ids, "row {index}");
        assert_eq!(answer.batched_with, 2, "row {index} ran alone");
    }
}
