//! Gemma 4's audio tower (E2B, E4B), checked and set aside: audio input is not supported, so
//! its weights are not read into memory, but every tensor the tower has must be present with
//! the shape its `audio_config` implies and nothing else may sit under its prefixes: a
//! malformed file fails here, naming the tensor, instead of loading with pieces missing.
//! Reference: mlx-vlm `models/gemma4/audio.py` (AudioEncoder, SubSampleConvProjection,
//! ConformerBlock) and `gemma4.py` (sanitize's conv layouts; `embed_audio`).

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{
    error::{EngineError, Result},
    weights::WeightStore,
};

/// Accepted shapes per tensor name (a conv may be stored in PyTorch's or MLX's layout).
type Expected = BTreeMap<String, Vec<Vec<i64>>>;

fn size(config: &Value, key: &str) -> Result<i64> {
    config[key].as_i64().ok_or_else(|| EngineError::Config {
        path: "config.json".into(),
        message: format!("audio_config.{key} is missing"),
    })
}

/// Every tensor of the tower and of `embed_audio`, from the config.
fn expected(audio: &Value, text_hidden: i64) -> Result<Expected> {
    let hidden = size(audio, "hidden_size")?;
    let layers = size(audio, "num_hidden_layers")?;
    let heads = size(audio, "num_attention_heads")?;
    let kernel = size(audio, "conv_kernel_size")?;
    let channels: Vec<i64> = audio["subsampling_conv_channels"]
        .as_array()
        .map(|list| list.iter().filter_map(Value::as_i64).collect())
        .unwrap_or_default();
    let [c0, c1] = channels[..] else {
        return Err(EngineError::Config {
            path: "config.json".into(),
            message: "audio_config.subsampling_conv_channels must list two sizes".into(),
        });
    };
    let clipped = audio["use_clipped_linears"].as_bool().unwrap_or(false);
    let output = audio["output_proj_dims"].as_i64();
    let mut map = Expected::new();
    let mut add = |name: String, shapes: Vec<Vec<i64>>| {
        map.insert(name, shapes);
    };
    let conv = "audio_tower.subsample_conv_projection";
    add(
        format!("{conv}.layer0.conv.weight"),
        vec![vec![c0, 1, 3, 3], vec![c0, 3, 3, 1]],
    );
    add(format!("{conv}.layer0.norm.weight"), vec![vec![c0]]);
    add(
        format!("{conv}.layer1.conv.weight"),
        vec![vec![c1, c0, 3, 3], vec![c1, 3, 3, c0]],
    );
    add(format!("{conv}.layer1.norm.weight"), vec![vec![c1]]);
    // 128 mel bins after two stride-2 convolutions.
    add(
        format!("{conv}.input_proj_linear.weight"),
        vec![vec![hidden, 32 * c1]],
    );
    let linear = |add: &mut dyn FnMut(String, Vec<Vec<i64>>), name: String, out: i64, inp: i64| {
        add(format!("{name}.linear.weight"), vec![vec![out, inp]]);
        if clipped {
            for bound in ["input_min", "input_max", "output_min", "output_max"] {
                add(format!("{name}.{bound}"), vec![vec![]]);
            }
        }
    };
    for layer in 0..layers {
        let prefix = format!("audio_tower.layers.{layer}");
        for ff in ["feed_forward1", "feed_forward2"] {
            for norm in ["pre_layer_norm", "post_layer_norm"] {
                add(format!("{prefix}.{ff}.{norm}.weight"), vec![vec![hidden]]);
            }
            linear(
                &mut add,
                format!("{prefix}.{ff}.ffw_layer_1"),
                4 * hidden,
                hidden,
            );
            linear(
                &mut add,
                format!("{prefix}.{ff}.ffw_layer_2"),
                hidden,
                4 * hidden,
            );
        }
        for proj in ["q_proj", "k_proj", "v_proj", "post"] {
            linear(
                &mut add,
                format!("{prefix}.self_attn.{proj}"),
                hidden,
                hidden,
            );
        }
        add(
            format!("{prefix}.self_attn.relative_k_proj.weight"),
            vec![vec![hidden, hidden]],
        );
        add(
            format!("{prefix}.self_attn.per_dim_scale"),
            vec![vec![hidden / heads]],
        );
        add(
            format!("{prefix}.lconv1d.pre_layer_norm.weight"),
            vec![vec![hidden]],
        );
        linear(
            &mut add,
            format!("{prefix}.lconv1d.linear_start"),
            2 * hidden,
            hidden,
        );
        add(
            format!("{prefix}.lconv1d.depthwise_conv1d.weight"),
            vec![vec![hidden, 1, kernel], vec![hidden, kernel, 1]],
        );
        add(
            format!("{prefix}.lconv1d.conv_norm.weight"),
            vec![vec![hidden]],
        );
        linear(
            &mut add,
            format!("{prefix}.lconv1d.linear_end"),
            hidden,
            hidden,
        );
        for norm in ["norm_pre_attn", "norm_post_attn", "norm_out"] {
            add(format!("{prefix}.{norm}.weight"), vec![vec![hidden]]);
        }
    }
    let audio_out = match output {
        Some(out) => {
            add(
                "audio_tower.output_proj.weight".into(),
                vec![vec![out, hidden]],
            );
            add("audio_tower.output_proj.bias".into(), vec![vec![out]]);
            out
        }
        None => hidden,
    };
    add(
        "embed_audio.embedding_projection.weight".into(),
        vec![vec![text_hidden, audio_out]],
    );
    Ok(map)
}

/// Checks the tower's tensors against `audio_config` and discards them.
pub fn check_and_skip(store: &mut WeightStore, audio: &Value, text_hidden: i32) -> Result<()> {
    let mut expected = expected(audio, text_hidden as i64)?;
    // An mlx-vlm conversion quantizes embed_audio (its skip rule misses it): packed weight,
    // scales and biases in place of the float matrix.
    let projection = "embed_audio.embedding_projection";
    if store.contains(&format!("{projection}.scales")) {
        for part in ["weight", "scales", "biases"] {
            let name = format!("{projection}.{part}");
            if let Some(shape) = store.shape_of(&name) {
                if shape.first() != Some(&text_hidden) {
                    return Err(tensor_error(
                        store,
                        &name,
                        format!("shape {shape:?}, expected {text_hidden} rows"),
                    ));
                }
                store.discard(&name);
            }
        }
        expected.remove(&format!("{projection}.weight"));
    }
    for name in store.names() {
        if !(name.starts_with("audio_tower.") || name.starts_with("embed_audio.")) {
            continue;
        }
        let shape: Vec<i64> = store
            .shape_of(&name)
            .unwrap_or_default()
            .iter()
            .map(|&dim| dim as i64)
            .collect();
        match expected.remove(&name) {
            Some(shapes) if shapes.contains(&shape) => store.discard(&name),
            Some(shapes) => {
                return Err(tensor_error(
                    store,
                    &name,
                    format!("shape {shape:?}, expected one of {shapes:?} from audio_config"),
                ))
            }
            None => {
                return Err(tensor_error(
                    store,
                    &name,
                    "not part of the audio tower that audio_config describes".into(),
                ))
            }
        }
    }
    if let Some(missing) = expected.keys().next() {
        return Err(EngineError::MissingTensor {
            tensor: missing.clone(),
            files: "the checkpoint's safetensors files (the audio tower is incomplete)".into(),
        });
    }
    Ok(())
}

fn tensor_error(store: &WeightStore, name: &str, message: String) -> EngineError {
    EngineError::Tensor {
        file: store.file_of(name).unwrap_or_default(),
        tensor: name.to_string(),
        message,
    }
}
