//! Qwen3 against mlx-lm 0.32.2 goldens (tests/fixtures, made by scripts/fixtures/make_qwen3.py):
//! teacher-forced logits and log-probs within stated tolerances, free-running greedy ids while
//! the reference's top-2 margin is clear of numeric noise, and cache/chunking invariance.

use std::{path::PathBuf, sync::atomic::AtomicBool};

use mlx_rs::{ops, Array, Dtype};
use rmlx_engine::{
    chat::ChatTokenizer,
    generate::{generate, FinishReason, GenerateParams},
    models::{load_model, LanguageModel, Logits},
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

#[derive(serde::Deserialize)]
struct Golden {
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    input_ids: Vec<u32>,
    step0_logits: Vec<f32>,
    greedy_ids: Vec<u32>,
    teacher_forced_logprobs: Vec<f32>,
    greedy_step_logprobs: Vec<f32>,
    top1_top2_margins: Vec<f32>,
}

fn golden(dir: &str) -> Golden {
    let text = std::fs::read_to_string(fixture(dir).join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids_array(ids: &[u32]) -> Array {
    let ids: Vec<i32> = ids.iter().map(|&id| id as i32).collect();
    Array::from_slice(&ids, &[1, ids.len() as i32])
}

/// Rows of f32 values from a `[1, L, V]` array.
fn rows(array: &Array) -> Vec<Vec<f32>> {
    let array = array.as_dtype(Dtype::Float32).unwrap();
    array.eval().unwrap();
    let vocab = array.shape()[2] as usize;
    array
        .as_slice::<f32>()
        .chunks(vocab)
        .map(<[f32]>::to_vec)
        .collect()
}

fn log_softmax(logits: &Array) -> Array {
    let logits = logits.as_dtype(Dtype::Float32).unwrap();
    ops::subtract(&logits, ops::logsumexp_axis(&logits, -1, true).unwrap()).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Tolerances. Measured: every golden here matches bit for bit (max diff 0) on the CPU backend,
/// since the ops are the reference's ops in the reference's order. The bounds leave room for
/// backend-level reordering: fp32 1e-5; bf16 activations (quantized checkpoints) under two bf16
/// ulps at |logit| ~ 4.
struct Tolerance {
    logits: f32,
    logprobs: f32,
    /// Greedy ids are compared only while the reference's top-2 margin exceeds this.
    margin: f32,
}

const FP32: Tolerance = Tolerance {
    logits: 1e-5,
    logprobs: 1e-5,
    margin: 1e-3,
};
const QUANTIZED: Tolerance = Tolerance {
    logits: 0.05,
    logprobs: 0.05,
    margin: 0.1,
};

fn check_checkpoint(dir: &str, golden_dir: &str, tolerance: Tolerance) {
    let loaded = load_model(&fixture(dir)).unwrap();
    let model = loaded.model.as_ref();
    let tokenizer = ChatTokenizer::from_dir(&fixture(dir)).unwrap();
    for case in golden(golden_dir).cases {
        // Teacher forcing: prompt + the reference's greedy continuation in one forward pass.
        let mut sequence = case.input_ids.clone();
        sequence.extend_from_slice(&case.greedy_ids);
        let mut cache = model.new_cache(4096);
        let logits = model
            .forward(&ids_array(&sequence), &mut cache, Logits::All)
            .unwrap();
        let prompt_len = case.input_ids.len();
        let logit_rows = rows(&logits);
        let step0 = &logit_rows[prompt_len - 1];
        let diff = max_diff(step0, &case.step0_logits);
        assert!(
            diff <= tolerance.logits,
            "{dir}/{}: step-0 logits differ by {diff}",
            case.name
        );

        let logprob_rows = rows(&log_softmax(&logits));
        let mut worst_logprob = 0.0f32;
        for (step, (&token, &want)) in case
            .greedy_ids
            .iter()
            .zip(&case.teacher_forced_logprobs)
            .enumerate()
        {
            let got = logprob_rows[prompt_len - 1 + step][token as usize];
            worst_logprob = worst_logprob.max((got - want).abs());
            assert!(
                (got - want).abs() <= tolerance.logprobs,
                "{dir}/{} step {step}: log-prob {got} vs {want}",
                case.name
            );
        }

        // Free-running greedy through the real decode loop, compared while margins are clear.
        let params = GenerateParams {
            max_tokens: case.greedy_ids.len(),
            ignore_eos: true,
            ..GenerateParams::default()
        };
        let completion = generate(
            model,
            &tokenizer,
            &case.input_ids,
            &params,
            &AtomicBool::new(false),
            |_| {},
        )
        .unwrap();
        assert_eq!(completion.finish_reason, FinishReason::Length);
        let identical = completion
            .token_ids
            .iter()
            .zip(&case.greedy_ids)
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!(
            "{dir}/{}: step-0 logits max diff {diff:.2e}, teacher-forced log-prob max diff {worst_logprob:.2e}, \
             greedy ids identical for {identical}/{} steps",
            case.name,
            case.greedy_ids.len()
        );
        let clear = case
            .top1_top2_margins
            .iter()
            .take_while(|&&margin| margin > tolerance.margin)
            .count();
        assert_eq!(
            completion.token_ids[..clear],
            case.greedy_ids[..clear],
            "{dir}/{}: greedy ids differ within the first {clear} clear-margin steps",
            case.name
        );
    }
}

#[test]
fn fp32_matches_mlx_lm() {
    check_checkpoint("qwen3-tiny", "qwen3-tiny", FP32);
}

#[test]
fn sharded_fp32_matches_the_same_golden() {
    check_checkpoint("qwen3-tiny-sharded", "qwen3-tiny", FP32);
}

#[test]
fn affine_4bit_tied_matches_mlx_lm() {
    check_checkpoint("qwen3-tiny-4bit", "qwen3-tiny-4bit", QUANTIZED);
}

#[test]
fn mxfp4_matches_mlx_lm() {
    check_checkpoint("qwen3-tiny-mxfp4", "qwen3-tiny-mxfp4", QUANTIZED);
}

// The tiny checkpoints of the real releases (tests/fixtures/releases, made from the published
// configs by scripts/fixtures/make_releases.py), each against its own mlx-lm golden.

#[test]
fn qwen3_0_6b_release_matches_mlx_lm() {
    check_checkpoint("releases/qwen3-0.6b", "releases/qwen3-0.6b", FP32);
}

#[test]
fn qwen3_4b_release_matches_mlx_lm() {
    check_checkpoint("releases/qwen3-4b", "releases/qwen3-4b", FP32);
}

#[test]
fn qwen3_4b_instruct_2507_release_matches_mlx_lm() {
    check_checkpoint(
        "releases/qwen3-4b-instruct-2507",
        "releases/qwen3-4b-instruct-2507",
        FP32,
    );
    check_checkpoint(
        "releases/qwen3-4b-instruct-2507-4bit",
        "releases/qwen3-4b-instruct-2507-4bit",
        QUANTIZED,
    );
}

/// Qwen3-30B-A3B as released (one tensor per expert, stacked at load like mlx-lm's sanitize)
/// and its mlx-lm 4-bit conversion (8-bit router): the shared MoE layer against mlx-lm.
#[test]
fn qwen3_30b_a3b_release_matches_mlx_lm() {
    check_checkpoint("releases/qwen3-30b-a3b", "releases/qwen3-30b-a3b", FP32);
    check_checkpoint(
        "releases/qwen3-30b-a3b-4bit",
        "releases/qwen3-30b-a3b-4bit",
        QUANTIZED,
    );
}

/// One token at a time the experts run unsorted; a whole prompt (≥ 64 token-expert pairs) takes
/// the sorted-indices path: both give the same logits, as do chunk sizes in between.
#[test]
fn moe_sorted_and_unsorted_expert_paths_agree() {
    for dir in ["releases/qwen3-30b-a3b", "releases/qwen3-30b-a3b-4bit"] {
        let loaded = load_model(&fixture(dir)).unwrap();
        let model = loaded.model.as_ref();
        let case = &golden(dir).cases[3];
        let ids = &case.input_ids;
        let whole = chunked_logits(model, ids, ids.len());
        let bound = if dir.ends_with("4bit") { 0.05 } else { 1e-4 };
        for chunk in [1, 7, 16] {
            let chunked = chunked_logits(model, ids, chunk);
            for (position, (a, b)) in whole.iter().zip(&chunked).enumerate() {
                let diff = max_diff(a, b);
                assert!(
                    diff < bound,
                    "{dir} chunk {chunk}, position {position}: {diff}"
                );
            }
        }
    }
}

/// Logits for every position of `ids`, fed through the cache in chunks of `chunk`.
fn chunked_logits(model: &dyn LanguageModel, ids: &[u32], chunk: usize) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(4096);
    let mut out = Vec::new();
    for piece in ids.chunks(chunk) {
        let logits = model
            .forward(&ids_array(piece), &mut cache, Logits::All)
            .unwrap();
        out.extend(rows(&logits));
    }
    out
}

#[test]
fn cache_and_chunk_sizes_do_not_change_logits() {
    let loaded = load_model(&fixture("qwen3-tiny")).unwrap();
    let model = loaded.model.as_ref();
    let case = &golden("qwen3-tiny").cases[0];
    let mut ids = case.input_ids.clone();
    ids.extend_from_slice(&case.greedy_ids);
    let whole = chunked_logits(model, &ids, ids.len());
    for chunk in [1, 7] {
        let chunked = chunked_logits(model, &ids, chunk);
        for (position, (a, b)) in whole.iter().zip(&chunked).enumerate() {
            let diff = max_diff(a, b);
            assert!(diff < 1e-4, "chunk {chunk}, position {position}: {diff}");
        }
    }
    // Last-position logits equal the last row of the full projection.
    let mut cache = model.new_cache(4096);
    let last = model
        .forward(&ids_array(&ids), &mut cache, Logits::Last)
        .unwrap();
    assert_eq!(last.shape(), &[1, 1, 1024]);
    assert!(max_diff(&rows(&last)[0], whole.last().unwrap()) < 1e-5);
    // And the generate loop's prefill chunking gives the same greedy ids for chunk 1, 7, whole.
    let tokenizer = ChatTokenizer::from_dir(&fixture("qwen3-tiny")).unwrap();
    let mut outputs = Vec::new();
    for chunk in [1, 7, 4096] {
        let params = GenerateParams {
            max_tokens: 8,
            ignore_eos: true,
            prefill_chunk: Some(chunk),
            ..GenerateParams::default()
        };
        let completion = generate(
            model,
            &tokenizer,
            &case.input_ids,
            &params,
            &AtomicBool::new(false),
            |_| {},
        )
        .unwrap();
        outputs.push(completion.token_ids);
    }
    assert_eq!(outputs[0], outputs[1]);
    assert_eq!(outputs[0], outputs[2]);
}

#[test]
fn prefix_cache_reuse_gives_the_logits_of_a_fresh_run() {
    use rmlx_engine::prefix_cache::PrefixCache;
    let dir = fixture("qwen3-tiny");
    let loaded = load_model(&dir).unwrap();
    let model = loaded.model.as_ref();
    let case = &golden("qwen3-tiny").cases[3]; // the long multi-turn prompt
    let ids = &case.input_ids;
    let fresh = chunked_logits(model, ids, ids.len());

    // A finished request that shared the first 40 tokens, then went elsewhere for 15 more.
    let mut earlier: Vec<u32> = ids[..40].to_vec();
    earlier.extend((0..15).map(|i| 100 + i));
    let mut caches = model.new_cache(4096);
    model
        .forward(&ids_array(&earlier), &mut caches, Logits::All)
        .unwrap();
    let mut prefix = PrefixCache::new(1 << 30, 1 << 30);
    assert_eq!(prefix.insert(&dir, earlier, caches), 0);

    for attempt in 0..2 {
        let reuse = prefix.lookup(&dir, ids).expect("shares 40 tokens");
        assert_eq!(reuse.cached_tokens, 40);
        let mut caches = reuse.caches;
        let logits = model
            .forward(&ids_array(&ids[40..]), &mut caches, Logits::All)
            .unwrap();
        for (offset, row) in rows(&logits).iter().enumerate() {
            let diff = max_diff(row, &fresh[40 + offset]);
            assert!(
                diff < 1e-5,
                "attempt {attempt}, position {}: {diff}",
                40 + offset
            );
        }
    }
    // A prompt equal to a stored sequence still computes its last token.
    let mut caches = model.new_cache(4096);
    model
        .forward(&ids_array(ids), &mut caches, Logits::All)
        .unwrap();
    prefix.insert(&dir, ids.clone(), caches);
    assert_eq!(
        prefix.lookup(&dir, ids).unwrap().cached_tokens,
        ids.len() - 1
    );
    // Other models never share entries.
    assert!(prefix.lookup(&fixture("qwen3-tiny-4bit"), ids).is_none());
}

#[test]
fn reported_logprobs_match_the_reference_and_rank_alternatives() {
    let dir = fixture("qwen3-tiny");
    let loaded = load_model(&dir).unwrap();
    let tokenizer = ChatTokenizer::from_dir(&dir).unwrap();
    let case = &golden("qwen3-tiny").cases[0];
    let params = GenerateParams {
        max_tokens: case.greedy_ids.len(),
        ignore_eos: true,
        logprobs: Some(5),
        ..GenerateParams::default()
    };
    let mut streamed = Vec::new();
    let completion = generate(
        loaded.model.as_ref(),
        &tokenizer,
        &case.input_ids,
        &params,
        &AtomicBool::new(false),
        |delta| streamed.extend(delta.logprob),
    )
    .unwrap();
    let logprobs = completion.logprobs.unwrap();
    assert_eq!(logprobs, streamed);
    assert_eq!(logprobs.len(), case.greedy_ids.len());
    for (step, entry) in logprobs.iter().enumerate() {
        assert_eq!(entry.token_id, case.greedy_ids[step]);
        let diff = (entry.logprob - case.greedy_step_logprobs[step]).abs();
        assert!(
            diff < 1e-5,
            "step {step}: {} vs {}",
            entry.logprob,
            case.greedy_step_logprobs[step]
        );
        assert_eq!(entry.top.len(), 5);
        // Greedy picks the most likely token: it heads its own list.
        assert_eq!(entry.top[0].token_id, entry.token_id);
        assert!(entry
            .top
            .windows(2)
            .all(|pair| pair[0].logprob >= pair[1].logprob));
        assert_eq!(
            entry.token,
            tokenizer.decode(&[entry.token_id], false).unwrap()
        );
    }
    let too_many = GenerateParams {
        logprobs: Some(21),
        ..params
    };
    let error = generate(
        loaded.model.as_ref(),
        &tokenizer,
        &case.input_ids,
        &too_many,
        &AtomicBool::new(false),
        |_| {},
    );
    assert!(error.is_err());
}
