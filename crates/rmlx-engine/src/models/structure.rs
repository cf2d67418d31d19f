//! What a config.json says about a checkpoint's structure, without loading weights: the
//! release structure in words (for `rmlx info` and `/v1/models`) and the KV cache's bytes per
//! token (for honest fitting: every expert's weights are in the files, the KV grows with the
//! context). Reference: mlx-lm `cache.py` (a K and a V per attention layer), mlx-vlm
//! `gemma4/language.py` (KV-shared layers keep no cache; full layers use the global head size).

use serde_json::Value;

/// The text model's part of a config (`text_config` for the vision-language families).
fn text(config: &Value) -> &Value {
    config
        .get("text_config")
        .filter(|text| text.is_object())
        .unwrap_or(config)
}

fn int(value: &Value, key: &str) -> Option<u64> {
    value.get(key).and_then(Value::as_u64)
}

/// e.g. "gemma4, MoE 128 experts top-8, k_eq_v, audio tower (not used)".
pub fn describe(config: &Value) -> String {
    let model_type = config["model_type"].as_str().unwrap_or("unknown");
    let text = text(config);
    let mut parts = vec![model_type.to_string()];
    let experts = int(text, "num_experts").filter(|&n| n > 0);
    let top_k = int(text, "num_experts_per_tok").or_else(|| int(text, "top_k_experts"));
    let moe_enabled = text
        .get("enable_moe_block")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    if let (Some(experts), Some(top_k), true) = (experts, top_k, moe_enabled) {
        parts.push(format!("MoE {experts} experts top-{top_k}"));
    }
    let shared = int(text, "num_kv_shared_layers").unwrap_or(0);
    if shared > 0 {
        parts.push(format!("KV-shared last {shared} layers"));
    }
    if text.get("use_double_wide_mlp").and_then(Value::as_bool) == Some(true) {
        parts.push("double-wide MLP".into());
    }
    if int(text, "hidden_size_per_layer_input").unwrap_or(0) > 0 {
        parts.push("per-layer inputs".into());
    }
    if text.get("attention_k_eq_v").and_then(Value::as_bool) == Some(true) {
        parts.push("k_eq_v".into());
    }
    if let Some(types) = text.get("layer_types").and_then(Value::as_array) {
        let sliding = types
            .iter()
            .filter(|t| t.as_str() == Some("sliding_attention"))
            .count();
        let linear = types
            .iter()
            .filter(|t| t.as_str() == Some("linear_attention"))
            .count();
        if sliding > 0 {
            parts.push(format!(
                "{sliding} sliding + {} full attention layers",
                types.len() - sliding
            ));
        }
        if linear > 0 {
            parts.push(format!(
                "{linear} Gated DeltaNet + {} full attention layers",
                types.len() - linear
            ));
        }
    }
    if config.get("vision_config").is_some_and(Value::is_object) {
        parts.push("vision tower".into());
    }
    if config.get("audio_config").is_some_and(Value::is_object) {
        parts.push("audio tower (not used)".into());
    }
    let tied = config
        .get("tie_word_embeddings")
        .or_else(|| text.get("tie_word_embeddings"))
        .and_then(Value::as_bool);
    if tied == Some(false) {
        parts.push("untied lm_head".into());
    }
    parts.join(", ")
}

/// Bytes the KV cache takes per position of context: a K and a V row for every layer that keeps
/// its own full-length cache, in the activations' dtype (float32 checkpoints compute in float32,
/// the rest in their 16-bit type). Sliding-window layers keep only their window
/// ([`window_state_bytes`]).
pub fn kv_bytes_per_token(config: &Value) -> u64 {
    cached_layer_rows(config, false, None)
}

/// [`kv_bytes_per_token`] as a cache stores it with `kv_bits` (`--kv-bits`): each group of a
/// head's values (64, or the head's width where smaller; `KvStorage`) takes `bits` per value
/// plus a scale and a bias in the activations' dtype; heads MLX cannot group stay dense.
pub fn kv_bytes_per_token_stored(config: &Value, kv_bits: Option<i32>) -> u64 {
    cached_layer_rows(config, false, kv_bits)
}

/// Bytes of one activation value: float32 checkpoints compute in float32, the rest in 16 bits.
fn activation_bytes(config: &Value) -> u64 {
    let text = text(config);
    let dtype = text
        .get("torch_dtype")
        .or_else(|| text.get("dtype"))
        .or_else(|| config.get("torch_dtype"))
        .and_then(Value::as_str);
    if dtype == Some("float32") {
        4
    } else {
        2
    }
}

/// Bytes Gemma 4's sliding-window layers keep per sequence whatever the context: their window
/// (`sliding_window - 1` positions plus the rollback slack, `KvCache::windowed`). Between
/// chunks a prefill holds a chunk and a growth step more.
pub fn window_state_bytes(config: &Value) -> u64 {
    let window = int(text(config), "sliding_window").unwrap_or(0);
    if window == 0 {
        return 0;
    }
    let kept = window - 1 + crate::cache::WINDOW_SLACK as u64;
    cached_layer_rows(config, true, None) * kept
}

/// Bytes per position the sliding-window layers would take kept full-length (as they were
/// before windows).
pub fn sliding_bytes_per_token(config: &Value) -> u64 {
    cached_layer_rows(config, true, None)
}

/// What a sequence holds whatever its length: recurrent states and sliding windows.
pub fn fixed_state_bytes(config: &Value) -> u64 {
    recurrent_state_bytes(config) + window_state_bytes(config)
}

/// Bytes of one position's K and V over the cached layers: the sliding-window ones (`sliding`)
/// or the full-length ones, dense or stored at `kv_bits`.
fn cached_layer_rows(config: &Value, sliding: bool, kv_bits: Option<i32>) -> u64 {
    let text = text(config);
    let layers = int(text, "num_hidden_layers").unwrap_or(0);
    let heads = int(text, "num_attention_heads").unwrap_or(1);
    let kv_heads = int(text, "num_key_value_heads").unwrap_or(heads);
    let head_dim = int(text, "head_dim")
        .or_else(|| int(text, "hidden_size").map(|hidden| hidden / heads.max(1)))
        .unwrap_or(0);
    let global_head_dim = int(text, "global_head_dim").unwrap_or(head_dim);
    let global_kv_heads = int(text, "num_global_key_value_heads")
        .filter(|_| text.get("attention_k_eq_v").and_then(Value::as_bool) == Some(true))
        .unwrap_or(kv_heads);
    let shared = int(text, "num_kv_shared_layers").unwrap_or(0);
    let bytes = activation_bytes(config);
    let types = text.get("layer_types").and_then(Value::as_array);
    (0..layers.saturating_sub(shared))
        .map(|layer| {
            let kind = types
                .and_then(|types| types.get(layer as usize))
                .and_then(Value::as_str);
            // Linear-attention layers (Qwen3.5) keep a fixed state instead of a KV.
            if kind == Some("linear_attention") || (kind == Some("sliding_attention")) != sliding {
                return 0;
            }
            let full = kind == Some("full_attention");
            // Gemma's full layers use their own (global) head size and KV heads.
            let (kv, dim) = if full && types.is_some() {
                (global_kv_heads, global_head_dim)
            } else {
                (kv_heads, head_dim)
            };
            layer_kv_bytes(kv, dim, bytes, kv_bits)
        })
        .sum()
}

/// One layer's K and V for one position: `kv` heads of `dim`, dense (`bytes` a value) or at
/// `kv_bits` (per group of 64 or the head's width: `group * bits / 8` packed bytes, a scale
/// and a bias; heads MLX cannot group stay dense).
fn layer_kv_bytes(kv: u64, dim: u64, bytes: u64, kv_bits: Option<i32>) -> u64 {
    let group = 64.min(dim);
    match kv_bits {
        Some(bits) if group >= 32 && dim.is_multiple_of(group) => {
            2 * kv * (dim / group) * (group * bits as u64 / 8 + 2 * bytes)
        }
        _ => 2 * kv * dim * bytes,
    }
}

/// Bytes per position of context the multi-token-prediction draft head's KV takes when it is
/// loaded (Qwen3.5 / 3.6 `mtp_num_hidden_layers`: full-attention decoder layers whose caches
/// follow the trunk's, one entry per trunk position), stored as the trunk's (`kv_bits`).
pub fn draft_head_kv_bytes_per_token(config: &Value, kv_bits: Option<i32>) -> u64 {
    let text = text(config);
    let layers = int(text, "mtp_num_hidden_layers").unwrap_or(0);
    if layers == 0 {
        return 0;
    }
    let heads = int(text, "num_attention_heads").unwrap_or(1);
    let kv = int(text, "num_key_value_heads").unwrap_or(heads);
    let dim = int(text, "head_dim")
        .or_else(|| int(text, "hidden_size").map(|hidden| hidden / heads.max(1)))
        .unwrap_or(0);
    layers * layer_kv_bytes(kv, dim, activation_bytes(config), kv_bits)
}

/// Bytes of the fixed per-sequence state of the linear-attention layers (Qwen3.5's Gated
/// DeltaNet): the conv window in the activations' dtype and the float32 delta-rule state,
/// whatever the context length. 0 for attention-only models.
pub fn recurrent_state_bytes(config: &Value) -> u64 {
    let text = text(config);
    let Some(types) = text.get("layer_types").and_then(Value::as_array) else {
        return 0;
    };
    let linear = types
        .iter()
        .filter(|t| t.as_str() == Some("linear_attention"))
        .count() as u64;
    let key_heads = int(text, "linear_num_key_heads").unwrap_or(0);
    let value_heads = int(text, "linear_num_value_heads").unwrap_or(0);
    let key_dim = int(text, "linear_key_head_dim").unwrap_or(0);
    let value_dim = int(text, "linear_value_head_dim").unwrap_or(0);
    let kernel = int(text, "linear_conv_kernel_dim").unwrap_or(1);
    let dtype = text.get("dtype").or_else(|| text.get("torch_dtype"));
    let bytes = if dtype.and_then(Value::as_str) == Some("float32") {
        4
    } else {
        2
    };
    let conv_dim = 2 * key_heads * key_dim + value_heads * value_dim;
    let conv = kernel.saturating_sub(1) * conv_dim * bytes;
    let state = value_heads * value_dim * key_dim * 4;
    linear * (conv + state)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn real(release: &str) -> Value {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/real-configs")
            .join(release)
            .join("config.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    /// Qwen3.6-27B's head is one full-attention layer (4 KV heads of 256, bf16): one more
    /// layer's KV beside the trunk's 16; models without a head add nothing.
    #[test]
    fn the_draft_head_keeps_one_layer_of_kv() {
        let qwen = real("Qwen__Qwen3.6-27B");
        assert_eq!(draft_head_kv_bytes_per_token(&qwen, None), 2 * 4 * 256 * 2);
        assert_eq!(kv_bytes_per_token(&qwen), 16 * 2 * 4 * 256 * 2);
        assert_eq!(
            draft_head_kv_bytes_per_token(&qwen, Some(8)),
            2 * 4 * (256 / 64) * (64 + 2 * 2)
        );
        assert_eq!(
            draft_head_kv_bytes_per_token(&real("Qwen__Qwen3-4B"), None),
            0
        );
    }

    #[test]
    fn describes_the_release_structures() {
        assert_eq!(
            describe(&real("Qwen__Qwen3-30B-A3B")),
            "qwen3_moe, MoE 128 experts top-8, untied lm_head"
        );
        assert_eq!(
            describe(&real("google__gemma-4-26B-A4B-it")),
            "gemma4, MoE 128 experts top-8, k_eq_v, 25 sliding + 5 full attention layers, vision tower"
        );
        assert_eq!(
            describe(&real("google__gemma-4-E2B-it")),
            "gemma4, KV-shared last 20 layers, double-wide MLP, per-layer inputs, \
             28 sliding + 7 full attention layers, vision tower, audio tower (not used)"
        );
        assert_eq!(describe(&real("Qwen__Qwen3-0.6B")), "qwen3");
        assert_eq!(
            describe(&real("Qwen__Qwen3.6-35B-A3B")),
            "qwen3_5_moe, MoE 256 experts top-8, 30 Gated DeltaNet + 10 full attention layers, \
             vision tower, untied lm_head"
        );
    }

    /// Qwen3.6-35B-A3B (qwen3_5.md §11): 10 full layers × K and V × 2 heads × 256 × bf16 =
    /// 20 KiB a token; 30 Gated DeltaNet layers × (32 × 128 × 128 fp32 state + 3 × 8192 bf16
    /// conv rows) = 62.9 + 1.5 MB a sequence, whatever its length.
    #[test]
    fn linear_layers_keep_a_fixed_state_instead_of_kv() {
        let config = real("Qwen__Qwen3.6-35B-A3B");
        assert_eq!(kv_bytes_per_token(&config), 10 * 2 * 2 * 256 * 2);
        assert_eq!(kv_bytes_per_token(&config), 20 * 1024);
        let conv_dim = 2 * 16 * 128 + 32 * 128;
        assert_eq!(
            recurrent_state_bytes(&config),
            30 * (32 * 128 * 128 * 4 + 3 * conv_dim * 2)
        );
        assert_eq!(recurrent_state_bytes(&real("Qwen__Qwen3-4B")), 0);
    }

    #[test]
    fn kv_per_token_counts_each_caching_layer() {
        // Qwen3-4B: 36 layers × K and V × 8 heads × 128 × bf16.
        assert_eq!(
            kv_bytes_per_token(&real("Qwen__Qwen3-4B")),
            36 * 2 * 8 * 128 * 2
        );
        // Gemma 4 31B: 10 full k_eq_v layers (4 global KV heads × 512) grow with the context;
        // the 50 sliding layers (16 KV heads × 256) keep their 1024-token window (1023 + 32).
        let gemma_31b = real("google__gemma-4-31B-it");
        assert_eq!(kv_bytes_per_token(&gemma_31b), 10 * 2 * 4 * 512 * 2);
        assert_eq!(window_state_bytes(&gemma_31b), 50 * 2 * 16 * 256 * 2 * 1055);
        // ~0.86 GB of windows, ~80 KiB per token after.
        assert_eq!(
            fixed_state_bytes(&gemma_31b),
            window_state_bytes(&gemma_31b)
        );
        // Gemma 4 E2B: only the first 15 layers keep a cache (12 sliding of a 512 window, 3
        // full; 1 KV head).
        let e2b = real("google__gemma-4-E2B-it");
        assert_eq!(kv_bytes_per_token(&e2b), 3 * 2 * 512 * 2);
        assert_eq!(window_state_bytes(&e2b), 12 * 2 * 256 * 2 * (512 - 1 + 32));
        assert_eq!(window_state_bytes(&real("Qwen__Qwen3-4B")), 0);
        // Stored at 8 / 4 bits: per 64 values 64 or 32 bytes plus a bf16 scale and bias.
        let qwen = real("Qwen__Qwen3-4B");
        assert_eq!(kv_bytes_per_token_stored(&qwen, None), 36 * 2 * 8 * 128 * 2);
        assert_eq!(
            kv_bytes_per_token_stored(&qwen, Some(8)),
            36 * 2 * 8 * 2 * 68
        );
        assert_eq!(
            kv_bytes_per_token_stored(&qwen, Some(4)),
            36 * 2 * 8 * 2 * 36
        );
    }
}
