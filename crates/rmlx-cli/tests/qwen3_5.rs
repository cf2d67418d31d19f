//! Every Qwen3.5 / Qwen3.6 release structure (tests/fixtures/releases/qwen3.*: dense and MoE,
//! fp32 in the Hugging Face layout and the mlx-community 4-bit conversions) through the CLI:
//! `rmlx generate --json` renders the golden's prompt ids token for token, text and image, and
//! gives mlx-vlm's greedy ids at every step up to the first whose top-2 margin is under 0.05
//! (where a rounding difference may legitimately pick the other token); `rmlx info` names the
//! hybrid structure and its fixed per-sequence state.

use std::{path::PathBuf, process::Command};

use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn releases() -> Vec<(String, String)> {
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("releases/releases.json")).unwrap())
            .unwrap();
    index
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, entry)| {
            entry["model_type"]
                .as_str()
                .is_some_and(|t| t.starts_with("qwen3_5"))
        })
        .map(|(name, entry)| (name.clone(), entry["model_type"].as_str().unwrap().into()))
        .collect()
}

fn case(name: &str, case: &str) -> Value {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(&format!("releases/{name}/golden.json"))).unwrap(),
    )
    .unwrap();
    golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == case)
        .unwrap()
        .clone()
}

fn rmlx(args: &[String]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .args(args)
        .output()
        .unwrap()
}

fn generate(name: &str, prompt: &str, image: Option<&str>) -> Value {
    let mut args: Vec<String> = vec![
        "generate".into(),
        "--model".into(),
        fixture(&format!("releases/{name}")).display().to_string(),
        "--prompt".into(),
        prompt.into(),
        "--json".into(),
        "--ignore-eos".into(),
        "--max-tokens".into(),
        "16".into(),
    ];
    if let Some(image) = image {
        args.push("--image".into());
        args.push(fixture("vision-images").join(image).display().to_string());
    }
    let output = rmlx(&args);
    assert!(
        output.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// Prompt ids equal; greedy ids equal up to the first step under the margin. (Measured on the
/// CPU backend: all 16 ids equal in all 22 cases, low-margin steps included.)
fn check(name: &str, out: &Value, golden: &Value) -> usize {
    assert_eq!(
        out["prompt_ids"], golden["input_ids"],
        "{name} {}: prompt ids",
        golden["name"]
    );
    let got: Vec<u64> = serde_json::from_value(out["token_ids"].clone()).unwrap();
    let want: Vec<u64> = serde_json::from_value(golden["greedy_ids"].clone()).unwrap();
    let margins: Vec<f64> = serde_json::from_value(golden["top1_top2_margins"].clone()).unwrap();
    let clear = margins.iter().take_while(|&&m| m >= 0.05).count();
    assert_eq!(
        got[..clear],
        want[..clear],
        "{name} {}: greedy ids differ within the first {clear} clear steps",
        golden["name"]
    );
    let equal = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
    eprintln!("  {name} {}: {equal}/16 ids equal", golden["name"]);
    clear
}

#[test]
fn every_release_structure_reproduces_its_golden_through_the_cli() {
    let releases = releases();
    assert_eq!(releases.len(), 11, "{releases:?}");
    for (name, _) in &releases {
        let text = case(name, "text_only");
        let prompt = text["messages"][0]["content"].as_str().unwrap();
        let clear_text = check(name, &generate(name, prompt, None), &text);
        let image = case(name, "single_image");
        let question = image["messages"][0]["content"][1]["text"].as_str().unwrap();
        let clear_image = check(
            name,
            &generate(name, question, Some("gradient_64x48.png")),
            &image,
        );
        eprintln!("{name}: text {clear_text}/16 and image {clear_image}/16 steps compared");
    }
}

#[test]
fn info_names_the_hybrid_structure_and_its_state() {
    for (name, model_type) in releases() {
        let output = rmlx(&[
            "info".into(),
            "--model".into(),
            fixture(&format!("releases/{name}")).display().to_string(),
        ]);
        assert!(output.status.success(), "{name}");
        let text = String::from_utf8(output.stdout).unwrap();
        let structure = text.lines().find(|l| l.starts_with("structure:")).unwrap();
        assert!(
            structure.contains(&model_type)
                && structure.contains("3 Gated DeltaNet + 1 full attention layers")
                && structure.contains("vision tower"),
            "{name}: {structure}"
        );
        if model_type == "qwen3_5_moe" {
            assert!(
                structure.contains("MoE 16 experts top-8"),
                "{name}: {structure}"
            );
        }
        assert!(text.contains("linear state:"), "{name}: {text}");
    }
}
