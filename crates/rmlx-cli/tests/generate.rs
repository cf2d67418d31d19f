//! `rmlx generate` and `rmlx info` on the tiny fixtures: golden ids through the whole CLI,
//! streaming text equal to the JSON text, and clear errors without panics.

use std::{path::PathBuf, process::Command};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn rmlx(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .args(args)
        .output()
        .unwrap()
}

fn golden_case(dir: &str, name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(dir).join("golden.json")).unwrap();
    let golden: serde_json::Value = serde_json::from_str(&text).unwrap();
    golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap()
        .clone()
}

fn generate_json(args: &[&str]) -> serde_json::Value {
    let output = rmlx(args);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert_eq!(
        stdout.trim().lines().count(),
        1,
        "exactly one JSON object: {stdout}"
    );
    serde_json::from_str(stdout.trim()).unwrap()
}

#[test]
fn generate_json_reproduces_golden_ids() {
    for (dir, case, extra) in [
        ("qwen3-tiny", "plain_user", vec![]),
        ("qwen3-tiny", "system_user_non_ascii", vec![]),
        (
            "qwen3-tiny",
            "no_thinking",
            vec!["--enable-thinking", "false"],
        ),
        ("qwen3-tiny-4bit", "plain_user", vec![]),
        ("qwen3-tiny-mxfp4", "plain_user", vec![]),
    ] {
        let golden = golden_case(dir, case);
        let messages = golden["messages"].as_array().unwrap();
        let model = fixture(dir);
        let mut args = vec![
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--json",
            "--ignore-eos",
            "--max-tokens",
            "24",
        ];
        let system;
        if messages[0]["role"] == "system" {
            system = messages[0]["content"].as_str().unwrap().to_string();
            args.extend(["--system", &system]);
        }
        let prompt = messages.last().unwrap()["content"].as_str().unwrap();
        args.extend(["--prompt", prompt]);
        args.extend(extra);
        let out = generate_json(&args);
        assert_eq!(
            out["prompt_ids"], golden["input_ids"],
            "{dir}/{case} prompt ids"
        );
        assert_eq!(
            out["token_ids"], golden["greedy_ids"],
            "{dir}/{case} greedy ids"
        );
        assert_eq!(out["finish_reason"], "length");
        assert_eq!(
            out["prompt_tokens"],
            golden["input_ids"].as_array().unwrap().len()
        );
        assert_eq!(out["completion_tokens"], 24);
        let timings = &out["timings"];
        assert!(timings["ttft_ms"].as_f64().unwrap() > 0.0);
        assert_eq!(timings["itl_ms"].as_array().unwrap().len(), 23);
        assert!(timings["prefill_tps"].as_f64().unwrap() > 0.0);
        assert!(timings["decode_tps"].as_f64().unwrap() > 0.0);
        // At least the weights were resident at the peak.
        let weights: u64 = std::fs::read_dir(&model)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
            .map(|path| std::fs::metadata(path).unwrap().len())
            .sum();
        let peak = out["peak_memory_bytes"].as_u64().unwrap();
        assert!(peak >= weights, "{dir}: peak {peak} < weights {weights}");
    }
}

#[test]
fn streamed_text_equals_json_text() {
    let model = fixture("qwen3-tiny");
    let base = [
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "Tell me about Zürich 🙂",
        "--max-tokens",
        "40",
        "--ignore-eos",
    ];
    let streamed = rmlx(&base);
    assert!(streamed.status.success());
    let mut args = base.to_vec();
    args.push("--json");
    let json = generate_json(&args);
    let text = String::from_utf8(streamed.stdout).unwrap();
    assert_eq!(
        text.strip_suffix('\n').unwrap(),
        json["text"].as_str().unwrap()
    );
}

#[test]
fn seeded_sampling_is_reproducible() {
    let model = fixture("qwen3-tiny");
    let args = [
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "Hi",
        "--max-tokens",
        "16",
        "--ignore-eos",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--top-k",
        "50",
        "--seed",
        "42",
        "--json",
    ];
    let first = generate_json(&args);
    assert_eq!(first["token_ids"], generate_json(&args)["token_ids"]);
    let mut other = args.to_vec();
    let seed_at = other.len() - 2;
    other[seed_at] = "43";
    assert_ne!(first["token_ids"], generate_json(&other)["token_ids"]);
}

#[test]
fn info_describes_the_checkpoint() {
    let model = fixture("qwen3-tiny-4bit");
    let output = rmlx(&["info", "--model", model.to_str().unwrap(), "--json"]);
    assert!(output.status.success());
    let info: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(info["model_type"], "qwen3");
    assert_eq!(info["quantization"], "affine 4-bit, group 64");
    assert_eq!(info["context_length"], 2048);
    assert_eq!(info["vision"], false);
    // Tied 4-bit: embeddings 1024x64 + 2 layers x (attention 4*64*64 + MLP 3*64*128 + norms) + final norm.
    let per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 16 + 2 * 64;
    assert_eq!(info["parameters"], 1024 * 64 + 2 * per_layer + 64);
}

#[test]
fn errors_are_messages_not_panics() {
    let model = fixture("qwen3-tiny");
    let fixtures_root = fixture("");
    let cases: [(&[&str], &str); 4] = [
        (
            &["generate", "--model", "/nonexistent", "--prompt", "x"],
            "not a model folder",
        ),
        (
            &[
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--prompt",
                "hello there",
                "--max-ctx",
                "3",
            ],
            "context holds 3",
        ),
        (
            &[
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--prompt",
                "x",
                "--temperature=-1",
            ],
            "temperature",
        ),
        (
            &["info", "--model", fixtures_root.to_str().unwrap()],
            "not a model folder",
        ),
    ];
    for (args, expected) in cases {
        let output = rmlx(args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn stop_string_split_across_tokens_is_never_emitted() {
    // The golden greedy text contains "...ilmany red open..."; "y re" spans two tokens.
    let model = fixture("qwen3-tiny");
    let golden = golden_case("qwen3-tiny", "plain_user");
    let full = golden["greedy_text"].as_str().unwrap();
    let cut = full.find("y re").unwrap();
    let base = [
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "24",
        "--stop",
        "y re",
    ];
    let mut args = base.to_vec();
    args.push("--json");
    let out = generate_json(&args);
    assert_eq!(out["finish_reason"], "stop");
    assert_eq!(out["stop_sequence"], "y re");
    assert_eq!(out["text"], &full[..cut]);
    assert!(out["completion_tokens"].as_u64().unwrap() < 24);
    // Streaming prints the same text, the stop string held back until it could be ruled out.
    let streamed = rmlx(&base);
    assert_eq!(
        String::from_utf8(streamed.stdout)
            .unwrap()
            .trim_end_matches('\n'),
        &full[..cut]
    );
}

/// The tiny checkpoints of the real text releases (tests/fixtures/releases): each loads through
/// the CLI, reproduces its mlx-lm golden ids, and `rmlx info` names its structure.
#[test]
fn every_text_release_reproduces_its_golden_and_shows_in_info() {
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("releases/releases.json")).unwrap())
            .unwrap();
    let mut checked = 0;
    for (name, entry) in index.as_object().unwrap() {
        if !matches!(entry["model_type"].as_str(), Some("qwen3" | "qwen3_moe")) {
            continue;
        }
        let dir = format!("releases/{name}");
        let golden = golden_case(&dir, "plain_user");
        let model = fixture(&dir);
        let prompt = golden["messages"][0]["content"].as_str().unwrap();
        let out = generate_json(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--json",
            "--ignore-eos",
            "--max-tokens",
            "24",
            "--prompt",
            prompt,
        ]);
        assert_eq!(out["prompt_ids"], golden["input_ids"], "{name} prompt ids");
        assert_eq!(out["token_ids"], golden["greedy_ids"], "{name} greedy ids");

        let info = rmlx(&["info", "--model", model.to_str().unwrap()]);
        assert!(
            info.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&info.stderr)
        );
        let text = String::from_utf8(info.stdout).unwrap();
        let model_type = entry["model_type"].as_str().unwrap();
        let structure_line = text
            .lines()
            .find(|line| line.starts_with("structure:"))
            .unwrap_or_else(|| panic!("{name}: no structure line in {text}"));
        assert!(
            structure_line.contains(model_type),
            "{name}: {structure_line}"
        );
        if model_type == "qwen3_moe" {
            assert!(
                structure_line.contains("MoE 16 experts top-8"),
                "{name}: {structure_line}"
            );
        }
        assert!(text.contains("KV cache:"), "{name}: {text}");
        checked += 1;
    }
    assert!(checked >= 6, "checked {checked} text releases");
}

/// `rmlx bench` reports medians with their spread for one stream and for several at once
/// (every stream generating its full count, so the aggregate counts them all).
#[test]
fn bench_reports_single_and_concurrent_streams() {
    let model = fixture("qwen3-tiny");
    for concurrency in ["1", "3"] {
        let report = generate_json(&[
            "bench",
            "--model",
            model.to_str().unwrap(),
            "--prompt-tokens",
            "24",
            "--gen-tokens",
            "6",
            "--runs",
            "2",
            "--concurrency",
            concurrency,
            "--step-profile",
            "--json",
        ]);
        assert_eq!(report["concurrency"], concurrency.parse::<u64>().unwrap());
        // The step profile covers the timed runs' decode steps only, by batch width: every
        // stream's 5 steps after its first token (the first comes from its prefill).
        let widths = report["step_profile"].as_array().expect("a step profile");
        let steps: u64 = widths
            .iter()
            .map(|w| w["rows"].as_u64().unwrap() * w["steps"].as_u64().unwrap())
            .sum();
        let streams = concurrency.parse::<u64>().unwrap();
        assert!(steps >= 2 * streams * 5, "{widths:?}");
        assert!(
            widths
                .iter()
                .all(|w| w["rows"].as_u64().unwrap() <= streams),
            "{widths:?}"
        );
        for width in widths {
            let parts: f64 = ["build_ms", "submit_ms", "read_ms", "between_ms"]
                .iter()
                .map(|key| width[key].as_f64().unwrap())
                .sum();
            assert!(
                (parts - width["step_ms"].as_f64().unwrap()).abs() < 1e-6,
                "{width}"
            );
            assert!(width["build_ms"].as_f64().unwrap() > 0.0, "{width}");
        }
        assert_eq!(report["runs"], 2);
        for key in ["ttft_ms", "prefill_tps", "decode_tps", "aggregate_tps"] {
            let [median, min, max] = [0, 1, 2].map(|i| report["spread"][key][i].as_f64().unwrap());
            assert!(
                min > 0.0 && min <= median && median <= max,
                "{key}: {report}"
            );
            assert_eq!(report[key].as_f64().unwrap(), median);
        }
        assert!(report["ttft_p50_ms"].as_f64().unwrap() <= report["ttft_p95_ms"].as_f64().unwrap());
    }
}

/// `rmlx generate --draft-model`: Qwen3.5-0.8B drafts for Qwen3.6-35B-A3B (the release pair),
/// greedy output unchanged, drafts counted and kept per position; a draft model of another
/// tokenizer is refused with a message naming both.
#[test]
fn a_draft_model_drafts_for_generate() {
    let target = fixture("releases/qwen3.6-35b-a3b");
    let draft = fixture("releases/qwen3.5-0.8b");
    let (target, draft) = (target.to_str().unwrap(), draft.to_str().unwrap());
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            target,
            "--prompt",
            "Count to ten.",
            "--max-tokens",
            "16",
            "--ignore-eos",
            "--temperature",
            "0",
            "--json",
        ];
        args.extend_from_slice(extra);
        generate_json(&args)
    };
    let plain = run(&[]);
    let drafted = run(&["--draft-model", draft, "--speculative", "draft"]);
    assert_eq!(plain["token_ids"], drafted["token_ids"]);
    let timings = &drafted["timings"];
    assert!(timings["draft_tokens"].as_u64().unwrap() > 0, "{drafted}");
    let at: u64 = timings["drafted_at"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert_eq!(at, timings["draft_tokens"].as_u64().unwrap());
    let gemma = fixture("releases/gemma-4-e2b-it");
    let output = rmlx(&[
        "generate",
        "--model",
        target,
        "--prompt",
        "hi",
        "--draft-model",
        gemma.to_str().unwrap(),
        "--speculative",
        "draft",
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("tokenizer") && stderr.contains("gemma-4-e2b-it"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `rmlx bench --draft-accuracy` with the draft head reports both arms: decode speeds and
/// their ratio, the head's acceptance on forced answers (every draft right but one past the
/// last token), and each arm's TTFT and peak memory (what priming the head costs a prompt).
#[test]
fn speculative_bench_reports_both_arms() {
    let model = fixture("releases/qwen3.6-27b");
    let report = generate_json(&[
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--prompt-tokens",
        "96",
        "--gen-tokens",
        "9",
        "--runs",
        "1",
        "--draft-head",
        "--draft-accuracy",
        "1",
        "--draft-depth",
        "2",
        "--json",
    ]);
    assert_eq!(report["draft_head"], true, "{report}");
    assert_eq!(report["depth"], "2", "{report}");
    for key in [
        "plain_decode_tps",
        "speculative_decode_tps",
        "ratio",
        "plain_ttft_ms",
        "speculative_ttft_ms",
    ] {
        let [median, min, max] = [0, 1, 2].map(|i| report[key][i].as_f64().unwrap());
        assert!(
            min > 0.0 && min <= median && median <= max,
            "{key}: {report}"
        );
    }
    // Forced answers bias the head's drafts too: only drafts past the last token are lost
    // (a random head's free drafts would all be wrong).
    assert!(report["acceptance"].as_f64().unwrap() >= 0.6, "{report}");
    for key in [
        "plain_peak_over_rest_bytes",
        "speculative_peak_over_rest_bytes",
    ] {
        assert!(report[key].as_u64().unwrap() > 0, "{key}: {report}");
    }
}
