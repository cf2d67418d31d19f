//! Images through the whole CLI path (decode → family preprocessing → in-place placement →
//! vision tower → chunked prefill that never splits an image block → decode), against the
//! mlx-vlm 0.7.6 goldens in tests/fixtures/{qwen3-vl-tiny,gemma4-tiny}
//! (scripts/fixtures/make_vision.py).

use std::{path::PathBuf, process::Command};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

// The Qwen3.6 MoE release: its prefill also carries the Gated DeltaNet state across chunks.
const FAMILIES: [&str; 3] = ["qwen3-vl-tiny", "gemma4-tiny", "releases/qwen3.6-35b-a3b"];

fn golden_case(model: &str, name: &str) -> serde_json::Value {
    let path = fixture(model).join("golden.json");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|case| case["name"] == name)
        .unwrap()
        .clone()
}

fn generate(model: &str, image: &str, extra: &[&str]) -> serde_json::Value {
    let model = fixture(model);
    let image = fixture("vision-images").join(image);
    let mut args = vec![
        "generate".to_string(),
        "--model".into(),
        model.display().to_string(),
        "--image".into(),
        image.display().to_string(),
        "--prompt".into(),
        "What is in this image?".into(),
        "--json".into(),
        "--ignore-eos".into(),
        "--max-tokens".into(),
        "16".into(),
    ];
    args.extend(extra.iter().map(|arg| arg.to_string()));
    let output = Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .args(&args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn image_prompt_reproduces_the_mlx_vlm_golden() {
    for model in FAMILIES {
        for (image, case) in [
            ("gradient_64x48.png", "single_image"),
            ("gradient_64x48_mirror.png", "single_image_mirrored"),
        ] {
            let golden = golden_case(model, case);
            let out = generate(model, image, &[]);
            assert_eq!(out["prompt_ids"], golden["input_ids"], "{model}/{case}");
            assert_eq!(out["token_ids"], golden["greedy_ids"], "{model}/{case}");
        }
    }
}

#[test]
fn prefill_chunks_never_split_an_image_and_change_nothing() {
    for model in FAMILIES {
        let whole = generate(model, "gradient_64x48.png", &["--prefill-chunk", "4096"]);
        for chunk in ["1", "7", "40"] {
            let chunked = generate(model, "gradient_64x48.png", &["--prefill-chunk", chunk]);
            assert_eq!(
                chunked["token_ids"], whole["token_ids"],
                "{model} chunk {chunk}"
            );
        }
        // The mirror is a different picture: the answer changes.
        let mirrored = generate(model, "gradient_64x48_mirror.png", &[]);
        assert_ne!(mirrored["token_ids"], whole["token_ids"], "{model}");
    }
}

#[test]
fn gemma_soft_token_budget_is_per_request() {
    let default = generate("gemma4-tiny", "noise_80x100.png", &[]);
    let finer = generate(
        "gemma4-tiny",
        "noise_80x100.png",
        &["--image-soft-tokens", "140"],
    );
    let images = |out: &serde_json::Value| {
        out["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|id| **id == 995)
            .count()
    };
    // The fixture's processor budget is 70; 140 lets the 80x100 image keep more detail.
    assert_eq!(images(&default), 63);
    assert!(images(&finer) > 100, "{}", images(&finer));
    let output = Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .args(["generate", "--model"])
        .arg(fixture("gemma4-tiny"))
        .arg("--image")
        .arg(fixture("vision-images/noise_80x100.png"))
        .args(["--prompt", "hi", "--image-soft-tokens", "99"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("99"), "{stderr}");
}

#[test]
fn image_prompts_respect_the_context_and_text_models_refuse_images() {
    let model = fixture("qwen3-vl-tiny");
    let image = fixture("vision-images/gradient_64x48.png");
    let run = |model: &PathBuf, extra: &[&str]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_rmlx"));
        command.args(["generate", "--model"]).arg(model);
        command.arg("--image").arg(&image).args(["--prompt", "hi"]);
        command.args(extra).output().unwrap()
    };
    // 70 image tokens + the text cannot fit in 50 positions.
    let output = run(&model, &["--max-ctx", "50"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("context holds 50"), "{stderr}");
    let output = run(&fixture("qwen3-tiny"), &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("has no vision"), "{stderr}");
    let output = Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .args(["generate", "--model"])
        .arg(&model)
        .args(["--image", "/nonexistent.png", "--prompt", "hi"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent.png"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// The vision release fixtures (tests/fixtures/releases: Qwen3-VL 2B-30B-A3B and every Gemma 4
/// release, MoE, k_eq_v and audio towers included): an image prompt through the CLI gives the
/// mlx-vlm golden's prompt and greedy ids.
#[test]
fn vision_releases_reproduce_their_mlx_vlm_goldens() {
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("releases/releases.json")).unwrap())
            .unwrap();
    let mut checked = 0;
    for (name, entry) in index.as_object().unwrap() {
        let model_type = entry["model_type"].as_str().unwrap();
        if !(model_type.starts_with("qwen3_vl") || model_type == "gemma4") {
            continue;
        }
        let model = format!("releases/{name}");
        let golden = golden_case(&model, "single_image");
        let out = generate(&model, "gradient_64x48.png", &[]);
        assert_eq!(out["prompt_ids"], golden["input_ids"], "{name}");
        assert_eq!(out["token_ids"], golden["greedy_ids"], "{name}");
        checked += 1;
    }
    assert_eq!(checked, 10);
}
