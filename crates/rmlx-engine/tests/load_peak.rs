//! Loading fuses each layer's gate and up projections into one weight (`nn::Projections`,
//! issue 32 d) layer by layer: the load's peak stays within the weights plus one layer's
//! parts. Alone in its test binary: MLX's peak counter belongs to the whole process.

use std::{collections::HashMap, fs, path::PathBuf};

use mlx_rs::{random, Array};
use rmlx_engine::{metrics, models::load_model};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// The Qwen3-4B release fixture's config with 8 wider layers (fp32, random weights): each
/// layer's gate and up parts are 2 MiB, far above what else a load allocates in passing.
#[test]
fn fusing_projections_holds_one_layers_parts_at_most() {
    let (hidden, inter, layers, heads, kv_heads, head_dim, vocab) = (256, 1024, 8, 4, 2, 64, 1024);
    let dir = tempfile::tempdir().unwrap();
    let source = fixture("releases/qwen3-4b");
    let mut config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(source.join("config.json")).unwrap()).unwrap();
    for (key, value) in [
        ("hidden_size", hidden),
        ("intermediate_size", inter),
        ("num_hidden_layers", layers),
        ("max_window_layers", layers),
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("head_dim", head_dim),
        ("vocab_size", vocab),
    ] {
        config[key] = serde_json::json!(value);
    }
    assert_eq!(config["tie_word_embeddings"], true);
    fs::write(dir.path().join("config.json"), config.to_string()).unwrap();

    let key = random::key(5).unwrap();
    let mut tensors: HashMap<String, Array> = HashMap::new();
    let mut add = |name: String, shape: &[i32]| {
        let weight = random::normal::<f32>(shape, None, None, &key).unwrap();
        tensors.insert(name, weight);
    };
    add("model.embed_tokens.weight".into(), &[vocab, hidden]);
    add("model.norm.weight".into(), &[hidden]);
    for layer in 0..layers {
        let at = |name: &str| format!("model.layers.{layer}.{name}.weight");
        add(at("self_attn.q_proj"), &[heads * head_dim, hidden]);
        add(at("self_attn.k_proj"), &[kv_heads * head_dim, hidden]);
        add(at("self_attn.v_proj"), &[kv_heads * head_dim, hidden]);
        add(at("self_attn.o_proj"), &[hidden, heads * head_dim]);
        add(at("self_attn.q_norm"), &[head_dim]);
        add(at("self_attn.k_norm"), &[head_dim]);
        add(at("mlp.gate_proj"), &[inter, hidden]);
        add(at("mlp.up_proj"), &[inter, hidden]);
        add(at("mlp.down_proj"), &[hidden, inter]);
        add(at("input_layernorm"), &[hidden]);
        add(at("post_attention_layernorm"), &[hidden]);
    }
    let weights: u64 = tensors.values().map(|array| array.nbytes() as u64).sum();
    let metadata = HashMap::from([("format".to_string(), "mlx".to_string())]);
    Array::save_safetensors(
        &tensors,
        Some(&metadata),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    drop(tensors);

    let (before, _, _) = metrics::mlx_memory();
    metrics::reset_mlx_peak();
    let loaded = load_model(dir.path()).unwrap();
    let (_, peak, _) = metrics::mlx_memory();
    let layer_parts = 2 * (inter * hidden) as u64 * 4;
    let extra = peak.saturating_sub(before + weights);
    assert!(
        extra <= layer_parts * 3 / 2,
        "the load's peak passed the weights by {extra} bytes, one layer's parts are {layer_parts}"
    );
    assert_eq!(loaded.info.weight_bytes, weights);
}
