//! The published configs of the releases rMLX names (tests/fixtures/real-configs, copied from
//! shared/models/real-configs with their hashes) against the loader and the tiny fixtures:
//! (i) every key of every release is read by the loader or listed, with a reason, in
//! `models::ignored_keys`, and that list names no structural switch of the README's tables;
//! (ii) each fixture's config.json differs from its release's only in the listed dimension and
//! token-id keys (tests/fixtures/releases/keys.json, written by make_releases.py);
//! (iii) formats MLX does not load are refused with an error naming the format.

use std::{collections::BTreeSet, path::PathBuf};

use rmlx_engine::{
    error::EngineError,
    models::{ignored_keys::IGNORED_CONFIG_KEYS, load_model, unread_config_keys},
};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn read(path: PathBuf) -> Value {
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

/// The releases issues 13 and 14 name: each must load (none is pending any more once its family
/// lands; a release still listed in PENDING must be refused today, so the list cannot go stale).
const RELEASES: &[&str] = &[
    "google__gemma-4-E2B-it",
    "google__gemma-4-E4B-it",
    "google__gemma-4-26B-A4B",
    "google__gemma-4-26B-A4B-it",
    "google__gemma-4-31B-it",
    "mlx-community__gemma-4-26B-A4B-it-qat-4bit",
    "Qwen__Qwen3-0.6B",
    "Qwen__Qwen3-4B",
    "Qwen__Qwen3-4B-Instruct-2507",
    "Qwen__Qwen3-30B-A3B",
    "mlx-community__Qwen3-4B-Instruct-2507-4bit",
    "Qwen__Qwen3-VL-2B-Instruct",
    "Qwen__Qwen3-VL-4B-Instruct",
    "Qwen__Qwen3-VL-8B-Instruct",
    "Qwen__Qwen3-VL-30B-A3B-Instruct",
    "Qwen__Qwen3.5-0.8B",
    "Qwen__Qwen3.5-2B",
    "Qwen__Qwen3.5-4B",
    "Qwen__Qwen3.5-9B",
    "Qwen__Qwen3.5-27B",
    "Qwen__Qwen3.5-35B-A3B",
    "Qwen__Qwen3.6-27B",
    "Qwen__Qwen3.6-35B-A3B",
    "mlx-community__Qwen3.5-9B-4bit",
];

/// Model types whose loader has not landed yet (issue 13 steps c-e).
const PENDING_TYPES: &[&str] = &[];

#[test]
fn every_release_key_is_read_or_ignored_for_a_reason() {
    let ignored: BTreeSet<&str> = IGNORED_CONFIG_KEYS.iter().map(|(key, _)| *key).collect();
    assert_eq!(
        ignored.len(),
        IGNORED_CONFIG_KEYS.len(),
        "a key is listed twice"
    );
    for (key, reason) in IGNORED_CONFIG_KEYS {
        assert!(reason.len() > 10, "`{key}` needs a reason");
    }
    let mut used_ignores = BTreeSet::new();
    for release in RELEASES {
        let json = read(
            fixtures()
                .join("real-configs")
                .join(release)
                .join("config.json"),
        );
        let model_type = json["model_type"].as_str().unwrap();
        if PENDING_TYPES.contains(&model_type) {
            assert!(
                matches!(
                    unread_config_keys(&json),
                    Err(EngineError::UnknownModelType(_))
                ),
                "{release}: {model_type} is listed as pending but has a loader"
            );
            continue;
        }
        let unread = unread_config_keys(&json).unwrap_or_else(|e| panic!("{release}: {e}"));
        let unlisted: Vec<&String> = unread
            .iter()
            .filter(|key| !ignored.contains(key.as_str()))
            .collect();
        assert!(
            unlisted.is_empty(),
            "{release}: config keys neither read by the loader nor listed in \
             models/ignored_keys.rs: {unlisted:?}"
        );
        used_ignores.extend(unread);
    }
    let stale: Vec<&&str> = ignored
        .iter()
        .filter(|key| !used_ignores.contains(**key))
        .collect();
    assert!(
        stale.is_empty(),
        "ignored keys no release carries unread (remove them): {stale:?}"
    );
}

/// Backquoted names in the first column of the README's switch tables (section 1-4 tables whose
/// header row starts with `| switch |`).
fn switch_table_keys() -> BTreeSet<String> {
    let readme = std::fs::read_to_string(fixtures().join("real-configs/README.md")).unwrap();
    let mut keys = BTreeSet::new();
    let mut in_table = false;
    for line in readme.lines() {
        if line.starts_with("| switch |") {
            in_table = true;
            continue;
        }
        if !line.starts_with('|') {
            in_table = false;
            continue;
        }
        if in_table {
            let first = line.split('|').nth(1).unwrap_or_default();
            for (index, piece) in first.split('`').enumerate() {
                if index % 2 == 1 {
                    keys.insert(piece.to_string());
                }
            }
        }
    }
    keys
}

#[test]
fn no_structural_switch_is_ignored() {
    let switches = switch_table_keys();
    assert!(
        switches.contains("attention_k_eq_v") && switches.contains("num_kv_shared_layers"),
        "the README's switch tables were not found: {switches:?}"
    );
    // The tables describe the text models: top-level and text_config keys.
    for (key, _) in IGNORED_CONFIG_KEYS {
        let last = key.rsplit('.').next().unwrap();
        let text_level = !key.contains('.') || key.starts_with("text_config.");
        if !text_level {
            continue;
        }
        assert!(
            !switches.contains(last),
            "`{key}` is a structural switch in the README's tables: the loader must read it"
        );
    }
}

/// Keys (at any depth) on which `fixture` and `real` differ, as dotted paths.
fn differing_keys(path: &str, fixture: &Value, real: &Value, out: &mut Vec<String>) {
    match (fixture.as_object(), real.as_object()) {
        (Some(a), Some(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                let dotted = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match (a.get(key), b.get(key)) {
                    (Some(x), Some(y)) => differing_keys(&dotted, x, y, out),
                    _ => out.push(dotted),
                }
            }
        }
        _ if fixture != real => out.push(path.to_string()),
        _ => {}
    }
}

#[test]
fn fixtures_differ_from_their_release_only_in_dimensions() {
    let keys = read(fixtures().join("releases/keys.json"));
    let allowed: BTreeSet<&str> = ["dimension_keys", "token_id_keys"]
        .iter()
        .flat_map(|list| keys[list].as_array().unwrap())
        .map(|key| key.as_str().unwrap())
        .collect();
    let index = read(fixtures().join("releases/releases.json"));
    let index = index.as_object().unwrap();
    assert!(
        index.len() >= 6,
        "releases.json lists {} fixtures",
        index.len()
    );
    for (fixture, entry) in index {
        let release = entry["release"].as_str().unwrap();
        // A conversion derived with mlx-lm's recipe adds the blocks mlx-lm writes.
        let derived = entry.get("derived").is_some();
        let mine = read(
            fixtures()
                .join("releases")
                .join(fixture)
                .join("config.json"),
        );
        let real = read(
            fixtures()
                .join("real-configs")
                .join(release)
                .join("config.json"),
        );
        let mut differing = Vec::new();
        differing_keys("", &mine, &real, &mut differing);
        let layers = mine
            .get("text_config")
            .unwrap_or(&mine)
            .get("num_hidden_layers")
            .and_then(Value::as_u64)
            .unwrap();
        // A per-layer quantization entry of a layer the shrunk model does not have.
        let dropped_layer = |path: &str| {
            path.starts_with("quantization")
                && path
                    .split(".layers.")
                    .nth(1)
                    .and_then(|rest| rest.split('.').next())
                    .and_then(|n| n.parse::<u64>().ok())
                    .is_some_and(|n| n >= layers)
        };
        let bad: Vec<&String> = differing
            .iter()
            .filter(|path| {
                let last = path.rsplit('.').next().unwrap();
                let quantization = path.starts_with("quantization");
                !(allowed.contains(last) || derived && quantization || dropped_layer(path))
            })
            .collect();
        assert!(
            bad.is_empty(),
            "{fixture}: keys differ from {release} beyond the dimension keys: {bad:?}"
        );
    }
}

#[test]
fn checkpoints_in_formats_mlx_does_not_load_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    // NVIDIA ModelOpt: hf_quant_config.json beside a config with quant_method modelopt.
    let nvidia = fixtures().join("real-configs/nvidia__Gemma-4-31B-IT-NVFP4");
    for name in ["config.json", "hf_quant_config.json"] {
        std::fs::copy(nvidia.join(name), dir.path().join(name)).unwrap();
    }
    let error = load_model(dir.path()).err().expect("refused").to_string();
    assert!(
        error.contains("NVIDIA ModelOpt") && error.contains("NVFP4"),
        "{error}"
    );
    std::fs::remove_file(dir.path().join("hf_quant_config.json")).unwrap();
    let error = load_model(dir.path()).err().expect("refused").to_string();
    assert!(error.contains("quant_method: modelopt"), "{error}");

    // Google's QAT mobile checkpoints: `quant_method: gemma`.
    let mut config = read(fixtures().join("real-configs/google__gemma-4-E2B-it/config.json"));
    config["quantization_config"] = read(fixtures().join(
        "real-configs/google__gemma-4-E2B-it-qat-mobile-transformers/quantization_config.partial.json",
    ));
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&config).unwrap(),
    )
    .unwrap();
    let error = load_model(dir.path()).err().expect("refused").to_string();
    assert!(error.contains("quant_method: gemma"), "{error}");
}

#[test]
fn an_unknown_family_is_refused_with_every_supported_type_listed() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
    let error = load_model(dir.path()).err().expect("refused").to_string();
    for family in rmlx_engine::models::SUPPORTED_MODEL_TYPES {
        assert!(error.contains(family), "{error}");
    }
    assert!(
        error.contains("gemma4") && error.contains("qwen3_moe"),
        "{error}"
    );
}
