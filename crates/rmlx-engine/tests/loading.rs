//! Strict loading and early refusals: each broken checkpoint gives a typed error naming the
//! file and tensor; an over-long prompt is refused before any compute.

use std::{
    cell::Cell,
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
    sync::atomic::AtomicBool,
};

use mlx_rs::Array;
use rmlx_engine::{
    cache::KvCache,
    chat::ChatTokenizer,
    generate::{generate, GenerateParams},
    models::{load_model, LanguageModel, Logits},
    quant::QuantError,
    EngineError,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// A writable copy of a fixture checkpoint.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    dir
}

fn rewrite_weights(file: &Path, edit: impl FnOnce(&mut HashMap<String, Array>)) {
    let mut arrays = Array::load_safetensors(file).unwrap();
    // MLX reads lazily: materialise before the file is overwritten.
    mlx_rs::transforms::eval(arrays.values()).unwrap();
    edit(&mut arrays);
    Array::save_safetensors(&arrays, None, file).unwrap();
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    fs::write(path, serde_json::to_string(&config).unwrap()).unwrap();
}

fn load_error(dir: &Path) -> EngineError {
    match load_model(dir) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(error) => error,
    }
}

#[test]
fn truncated_safetensors_names_file_and_tensor() {
    let dir = copy_fixture("qwen3-tiny");
    let file = dir.path().join("model.safetensors");
    let bytes = fs::read(&file).unwrap();
    fs::write(&file, &bytes[..bytes.len() - 1000]).unwrap();
    let error = load_error(dir.path());
    let message = error.to_string();
    assert!(matches!(error, EngineError::Tensor { .. }), "{message}");
    assert!(
        message.contains("model.safetensors") && message.contains("truncated"),
        "{message}"
    );
    // The last tensor in file order is the one cut short; every message names a tensor.
    assert!(message.contains("tensor `"), "{message}");

    fs::write(&file, &bytes[..4]).unwrap();
    let message = load_error(dir.path()).to_string();
    assert!(
        message.contains("model.safetensors") && message.contains("not a safetensors file"),
        "{message}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let dir = copy_fixture("qwen3-tiny");
    rewrite_weights(&dir.path().join("model.safetensors"), |arrays| {
        arrays.remove("model.layers.1.mlp.up_proj.weight");
    });
    // With the index, the index itself disagrees with the file.
    let message = load_error(dir.path()).to_string();
    assert!(
        message.contains("model.layers.1.mlp.up_proj.weight") && message.contains("index"),
        "{message}"
    );
    // Without it, the layer that needs the tensor reports it.
    fs::remove_file(dir.path().join("model.safetensors.index.json")).unwrap();
    let error = load_error(dir.path());
    assert!(
        matches!(&error, EngineError::MissingTensor { tensor, .. } if tensor == "model.layers.1.mlp.up_proj.weight"),
        "{error}"
    );
}

#[test]
fn shape_and_dtype_mismatches_are_named() {
    let dir = copy_fixture("qwen3-tiny");
    fs::remove_file(dir.path().join("model.safetensors.index.json")).unwrap();
    let file = dir.path().join("model.safetensors");
    rewrite_weights(&file, |arrays| {
        arrays.insert(
            "model.norm.weight".into(),
            Array::from_slice(&[1.0f32; 32], &[32]),
        );
    });
    let message = load_error(dir.path()).to_string();
    assert!(
        message.contains("model.norm.weight") && message.contains("shape [32], expected [64]"),
        "{message}"
    );
    assert!(message.contains("model.safetensors"), "{message}");

    rewrite_weights(&file, |arrays| {
        arrays.insert(
            "model.norm.weight".into(),
            Array::from_slice(&[1i32; 64], &[64]),
        );
    });
    let message = load_error(dir.path()).to_string();
    assert!(
        message.contains("model.norm.weight") && message.contains("dtype"),
        "{message}"
    );
}

#[test]
fn leftover_tensors_are_an_error() {
    let dir = copy_fixture("qwen3-tiny");
    fs::remove_file(dir.path().join("model.safetensors.index.json")).unwrap();
    rewrite_weights(&dir.path().join("model.safetensors"), |arrays| {
        arrays.insert(
            "model.layers.9.extra.weight".into(),
            Array::from_slice(&[0.0f32; 4], &[4]),
        );
    });
    let error = load_error(dir.path());
    assert!(
        matches!(&error, EngineError::UnusedTensors { tensors } if tensors[0].0 == "model.layers.9.extra.weight"),
        "{error}"
    );
}

#[test]
fn unknown_model_type_and_quant_mode_are_typed_errors() {
    let dir = copy_fixture("qwen3-tiny");
    edit_config(dir.path(), |config| config["model_type"] = "llama9".into());
    assert!(matches!(load_error(dir.path()), EngineError::UnknownModelType(t) if t == "llama9"));

    let dir = copy_fixture("qwen3-tiny-4bit");
    edit_config(dir.path(), |config| {
        config["quantization"]["mode"] = "int3".into()
    });
    assert!(matches!(
        load_error(dir.path()),
        EngineError::Quant(QuantError::UnknownMode(mode)) if mode == "int3"
    ));

    let dir = copy_fixture("qwen3-tiny");
    edit_config(dir.path(), |config| {
        config.as_object_mut().unwrap().remove("hidden_size");
    });
    let message = load_error(dir.path()).to_string();
    assert!(
        message.contains("config.json") && message.contains("hidden_size"),
        "{message}"
    );
}

/// Zero or non-dividing head counts once reached MLX as an integer division by zero, a SIGFPE that
/// no Rust error handling catches; now they are a config error before any weight is read.
#[test]
fn broken_head_counts_are_config_errors() {
    let cases: [(&str, &str, i64); 3] = [
        ("qwen3-tiny", "num_key_value_heads", 0),
        ("qwen3-tiny", "num_key_value_heads", 3),
        ("releases/gemma-4-31b-it", "num_global_key_value_heads", 0),
    ];
    for (name, key, value) in cases {
        let dir = copy_fixture(name);
        edit_config(dir.path(), |config| {
            let block = if config.get("text_config").is_some() {
                &mut config["text_config"]
            } else {
                config
            };
            block[key] = value.into();
        });
        let message = load_error(dir.path()).to_string();
        assert!(
            message.contains("config.json") && message.contains(key),
            "{name} {key}={value}: {message}"
        );
    }
}

/// Counts forward passes of a real model, to prove a refusal happened before any compute.
struct Counting<'a> {
    inner: &'a dyn LanguageModel,
    calls: Cell<usize>,
}

impl LanguageModel for Counting<'_> {
    fn forward(
        &self,
        inputs: &Array,
        caches: &mut [KvCache],
        logits: Logits,
    ) -> rmlx_engine::Result<Array> {
        self.calls.set(self.calls.get() + 1);
        self.inner.forward(inputs, caches, logits)
    }
    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_position_embeddings(&self) -> usize {
        self.inner.max_position_embeddings()
    }
}

#[test]
fn prompt_over_the_context_is_refused_before_compute() {
    let loaded = load_model(&fixture("qwen3-tiny")).unwrap();
    let tokenizer = ChatTokenizer::from_dir(&fixture("qwen3-tiny")).unwrap();
    let model = Counting {
        inner: loaded.model.as_ref(),
        calls: Cell::new(0),
    };
    let prompt: Vec<u32> = (0..10).collect();
    let params = GenerateParams {
        max_ctx: Some(4),
        ..GenerateParams::default()
    };
    let error = generate(
        &model,
        &tokenizer,
        &prompt,
        &params,
        &AtomicBool::new(false),
        |_| {},
    )
    .unwrap_err();
    assert!(
        matches!(
            error,
            EngineError::ContextOverflow {
                prompt_tokens: 10,
                max_ctx: 4
            }
        ),
        "{error}"
    );
    assert_eq!(model.calls.get(), 0);
    // The default context is the model's max_position_embeddings (2048 in the fixture).
    let long: Vec<u32> = (0..2049).map(|i| i % 900).collect();
    let error = generate(
        &model,
        &tokenizer,
        &long,
        &GenerateParams::default(),
        &AtomicBool::new(false),
        |_| {},
    )
    .unwrap_err();
    assert!(
        matches!(
            error,
            EngineError::ContextOverflow {
                prompt_tokens: 2049,
                max_ctx: 2048
            }
        ),
        "{error}"
    );
    assert_eq!(model.calls.get(), 0);
    // A prompt that fits runs, and generation stops with `length` when the context fills.
    let params = GenerateParams {
        max_ctx: Some(12),
        max_tokens: 100,
        ignore_eos: true,
        ..GenerateParams::default()
    };
    let completion = generate(
        &model,
        &tokenizer,
        &prompt,
        &params,
        &AtomicBool::new(false),
        |_| {},
    )
    .unwrap();
    assert_eq!(completion.completion_tokens, 3);
    assert!(model.calls.get() > 0);
}

/// Gemma 4 E2B's audio tower (in the Google layout) is checked against `audio_config` and set
/// aside: a missing tower tensor, one of the wrong shape, or a stray tensor under its prefix
/// is refused by name; the intact checkpoint loads (tests/gemma4_golden.rs runs it).
#[test]
fn gemma4_audio_tower_is_checked_strictly_before_it_is_set_aside() {
    let name = "releases/gemma-4-e2b-it";
    let norm = "model.audio_tower.layers.1.norm_out.weight";

    let dir = copy_fixture(name);
    rewrite_weights(&dir.path().join("model.safetensors"), |arrays| {
        arrays.remove(norm).unwrap();
    });
    let message = load_error(dir.path()).to_string();
    assert!(
        message.contains("audio_tower.layers.1.norm_out.weight"),
        "{message}"
    );

    let dir = copy_fixture(name);
    rewrite_weights(&dir.path().join("model.safetensors"), |arrays| {
        arrays.insert(norm.into(), Array::from_slice(&[1.0f32; 3], &[3]));
    });
    let message = load_error(dir.path()).to_string();
    assert!(
        message.contains("audio_tower.layers.1.norm_out.weight") && message.contains("[3]"),
        "{message}"
    );

    let dir = copy_fixture(name);
    rewrite_weights(&dir.path().join("model.safetensors"), |arrays| {
        arrays.insert(
            "model.audio_tower.layers.9.norm_out.weight".into(),
            Array::from_slice(&[1.0f32; 64], &[64]),
        );
    });
    let message = load_error(dir.path()).to_string();
    assert!(
        message.contains("audio_tower.layers.9.norm_out.weight"),
        "{message}"
    );

    let loaded = load_model(&fixture(name)).unwrap();
    assert!(loaded.info.structure.contains("audio tower (not used)"));
}

/// Experts stacked (Qwen3-30B-A3B's per-expert tensors) or re-laid-out (fused `gate_up_proj`)
/// at load are built then, once, and are not counted twice in the checkpoint's size.
#[test]
fn experts_built_at_load_count_once() {
    for name in [
        "releases/qwen3-30b-a3b",
        "releases/qwen3-vl-30b-a3b-instruct",
        "releases/gemma-4-26b-a4b",
    ] {
        let dir = fixture(name);
        let on_disk: u64 = Array::load_safetensors(dir.join("model.safetensors"))
            .unwrap()
            .values()
            .map(|array| array.nbytes() as u64)
            .sum();
        let loaded = load_model(&dir).unwrap();
        // Gemma's audio tower and the unused KV-shared projections are set aside, not loaded.
        assert!(loaded.info.weight_bytes <= on_disk, "{name}");
        assert!(
            loaded.info.weight_bytes * 10 >= on_disk * 9,
            "{name}: {} of {on_disk}",
            loaded.info.weight_bytes
        );
    }
}
