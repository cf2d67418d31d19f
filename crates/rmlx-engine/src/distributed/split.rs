//! Which layers each rank of a pipeline holds (issue 33 b): contiguous ranges in rank order,
//! balanced by the bytes each rank keeps. Rank 0 also keeps everything outside the language
//! layers (embeddings, the final norm and lm_head, the vision tower, a draft head), since it
//! embeds, samples and sees the images. Layers that read another layer's output other than
//! through the hidden state stay on one rank: Gemma 4's KV-shared layers with the layers whose
//! KV they read, Qwen3-VL's first layers with the vision features they add (on rank 0).
//! Reference: mlx-lm `models/pipeline.py` (`PipelineMixin.pipeline`: layers split evenly by
//! count, or by the given split; here by bytes, as mixed-size Macs need).

use std::{collections::BTreeMap, ops::Range, path::Path};

use serde_json::Value;

/// The weights of a checkpoint by where they go: each language layer's, and the rest.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerBytes {
    pub layers: Vec<u64>,
    /// Everything outside the language layers (kept by rank 0).
    pub rest: u64,
}

impl LayerBytes {
    /// The weight bytes rank `rank` keeps when it holds `layers`.
    pub fn of_rank(&self, rank: usize, layers: Range<usize>) -> u64 {
        self.layers[layers].iter().sum::<u64>() + if rank == 0 { self.rest } else { 0 }
    }
}

/// Layer ranges that one rank must hold whole, with why.
#[derive(Debug, Clone, PartialEq)]
pub struct Together {
    pub layers: Range<usize>,
    pub why: &'static str,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SplitError {
    #[error("{0}")]
    Read(String),
    #[error(
        "the split {split:?} gives {given} layers; the model has {layers} (one count per rank, \
         adding up to the model's layers)"
    )]
    Count {
        split: Vec<usize>,
        given: usize,
        layers: usize,
    },
    #[error(
        "the split {split:?} cuts layers {}-{} apart ({why}); move the boundary out of that range",
        layers.start,
        layers.end - 1
    )]
    Cut {
        split: Vec<usize>,
        layers: Range<usize>,
        why: &'static str,
    },
    #[error("{ranks} ranks cannot each hold a layer of a model with {layers} that must stay together as it does")]
    TooManyRanks { ranks: usize, layers: usize },
}

/// The text model's part of a config (`text_config` for the vision-language families).
fn text(config: &Value) -> &Value {
    config
        .get("text_config")
        .filter(|text| text.is_object())
        .unwrap_or(config)
}

/// The language layer a tensor belongs to: `…model.layers.N.…` or `…language_model.layers.N.…`
/// (a vision or audio tower's `layers`, and a draft head's, are not language layers).
fn language_layer(name: &str) -> Option<usize> {
    let parts: Vec<&str> = name.split('.').collect();
    parts.windows(3).find_map(|window| match window {
        [owner, "layers", index] if matches!(*owner, "model" | "language_model") => {
            index.parse().ok()
        }
        _ => None,
    })
}

/// The model in `dir` split over `ranks`: each rank's layers (see [`plan`]) and the bytes
/// they were balanced by.
pub fn plan_model(
    dir: &Path,
    ranks: usize,
    split: Option<&[usize]>,
) -> Result<(Vec<Range<usize>>, LayerBytes), SplitError> {
    let path = dir.join("config.json");
    let config: Value = std::fs::read(&path)
        .map_err(|e| e.to_string())
        .and_then(|bytes| serde_json::from_slice(&bytes).map_err(|e| e.to_string()))
        .map_err(|e| SplitError::Read(format!("{}: {e}", path.display())))?;
    let bytes = layer_bytes(dir, &config)?;
    let ranges = plan(&bytes, ranks, split, &together(&config))?;
    Ok((ranges, bytes))
}

/// Bytes per language layer and outside them, from the safetensors headers in `dir` (no
/// weight is read); `config` is its config.json.
pub fn layer_bytes(dir: &Path, config: &Value) -> Result<LayerBytes, SplitError> {
    let read = |what: String| SplitError::Read(what);
    let count = text(config)["num_hidden_layers"]
        .as_u64()
        .ok_or_else(|| read(format!("{}: no num_hidden_layers", dir.display())))?
        as usize;
    let mut layers = vec![0u64; count];
    let mut rest = 0u64;
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| read(format!("{}: {e}", dir.display())))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
        .collect();
    files.sort();
    for path in files {
        let header = super::fingerprint::safetensors_header(&path)
            .map_err(|e| read(format!("{}: {e}", path.display())))?;
        let tensors: BTreeMap<String, Value> = serde_json::from_slice(&header[8..])
            .map_err(|e| read(format!("{}: {e}", path.display())))?;
        for (name, tensor) in tensors.iter().filter(|(name, _)| *name != "__metadata__") {
            let offsets = &tensor["data_offsets"];
            let (Some(start), Some(end)) = (offsets[0].as_u64(), offsets[1].as_u64()) else {
                return Err(read(format!(
                    "{}: {name} has no data_offsets",
                    path.display()
                )));
            };
            let bytes = end.saturating_sub(start);
            match language_layer(name) {
                Some(index) if index < count => layers[index] += bytes,
                Some(index) => {
                    return Err(read(format!(
                        "{}: {name} is layer {index} of a model with {count}",
                        path.display()
                    )))
                }
                None => rest += bytes,
            }
        }
    }
    Ok(LayerBytes { layers, rest })
}

/// The ranges of layers that must not be split, from the config.
pub fn together(config: &Value) -> Vec<Together> {
    let text = text(config);
    let count = text["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    let mut ranges = Vec::new();
    // Gemma 4: the last `num_kv_shared_layers` read the KV of the last earlier layer of their
    // own kind (sliding or full attention).
    let shared = text["num_kv_shared_layers"].as_u64().unwrap_or(0) as usize;
    if shared > 0 && shared < count {
        let first_shared = count - shared;
        let types: Vec<&str> = text["layer_types"]
            .as_array()
            .map(|types| types.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let source = types
            .iter()
            .skip(first_shared)
            .filter_map(|kind| types[..first_shared].iter().rposition(|t| t == kind))
            .min()
            .unwrap_or(first_shared.saturating_sub(1));
        ranges.push(Together {
            layers: source..count,
            why: "KV-shared layers and the layers whose KV they read",
        });
    }
    // Qwen3-VL: the vision tower's deepstack features are added to the first layers.
    let deepstack = config["vision_config"]["deepstack_visual_indexes"]
        .as_array()
        .map_or(0, Vec::len);
    if deepstack > 0 {
        ranges.push(Together {
            layers: 0..deepstack.min(count),
            why: "the layers that add the vision tower's deepstack features, with it on rank 0",
        });
    }
    ranges
}

/// Whether a boundary before layer `at` falls inside a range that must stay whole.
fn cuts(at: usize, together: &[Together]) -> Option<&Together> {
    together
        .iter()
        .find(|range| range.layers.start < at && at < range.layers.end)
}

/// Contiguous layer ranges, one per rank in rank order: the hostfile's `split` (checked), or
/// the cut that makes the largest rank's bytes (rank 0's include `rest`) the smallest.
pub fn plan(
    bytes: &LayerBytes,
    ranks: usize,
    split: Option<&[usize]>,
    together: &[Together],
) -> Result<Vec<Range<usize>>, SplitError> {
    let count = bytes.layers.len();
    if let Some(split) = split {
        let given: usize = split.iter().sum();
        if given != count || split.len() != ranks {
            return Err(SplitError::Count {
                split: split.to_vec(),
                given,
                layers: count,
            });
        }
        let mut ranges = Vec::with_capacity(ranks);
        let mut start = 0;
        for &layers in split {
            ranges.push(start..start + layers);
            start += layers;
        }
        for range in &ranges[1..] {
            if let Some(kept) = cuts(range.start, together) {
                return Err(SplitError::Cut {
                    split: split.to_vec(),
                    layers: kept.layers.clone(),
                    why: kept.why,
                });
            }
        }
        return Ok(ranges);
    }
    // best[r][i]: the smallest largest-rank load over ranks r.. holding layers i..; a table of
    // ranks x layers (a few hundred cells), each trying every allowed end of rank r's range.
    let allowed = |at: usize| at == count || cuts(at, together).is_none();
    let mut best = vec![vec![None::<(u64, usize)>; count + 1]; ranks + 1];
    best[ranks][count] = Some((0, count));
    for rank in (0..ranks).rev() {
        for start in 0..count {
            let mut choice: Option<(u64, usize)> = None;
            let later = &best[rank + 1];
            for (end, after) in later.iter().enumerate().skip(start + 1) {
                let Some((rest_load, _)) = after.filter(|_| allowed(end)) else {
                    continue;
                };
                let worst = bytes.of_rank(rank, start..end).max(rest_load);
                if choice.is_none_or(|(held, _)| worst < held) {
                    choice = Some((worst, end));
                }
            }
            best[rank][start] = choice;
        }
    }
    let mut ranges = Vec::with_capacity(ranks);
    let mut start = 0;
    for from in best.iter().take(ranks) {
        let (_, end) = from[start].ok_or(SplitError::TooManyRanks {
            ranks,
            layers: count,
        })?;
        ranges.push(start..end);
        start = end;
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/releases")
            .join(name)
    }

    fn config(name: &str) -> Value {
        serde_json::from_slice(&std::fs::read(fixture(name).join("config.json")).unwrap()).unwrap()
    }

    /// Every tensor of a release fixture lands in one layer or the rest (headers only).
    #[test]
    fn every_tensor_counts_once() {
        let bytes = layer_bytes(&fixture("qwen3-4b"), &config("qwen3-4b")).unwrap();
        let size: u64 = std::fs::metadata(fixture("qwen3-4b").join("model.safetensors"))
            .unwrap()
            .len();
        let total = bytes.layers.iter().sum::<u64>() + bytes.rest;
        assert!(total <= size && size - total < 1 << 20, "{total} of {size}");
        assert!(bytes.layers.windows(2).all(|w| w[0] == w[1]), "{bytes:?}");
        let ranges = plan(&bytes, 2, None, &together(&config("qwen3-4b"))).unwrap();
        assert_eq!(ranges, vec![0..1, 1..2]);
    }

    /// Balanced by bytes: rank 0, which also keeps the embeddings and lm_head, holds fewer
    /// layers; without them, equal layers split evenly.
    #[test]
    fn ranks_get_equal_bytes_not_equal_layers() {
        let bytes = LayerBytes {
            layers: vec![10; 8],
            rest: 25,
        };
        // Rank 0: 25 + 3 x 10 = 55, rank 1: 50 (2 and 6 layers would be 45 and 60).
        assert_eq!(plan(&bytes, 2, None, &[]).unwrap(), vec![0..3, 3..8]);
        let even = LayerBytes {
            layers: vec![10; 9],
            rest: 0,
        };
        assert_eq!(plan(&even, 3, None, &[]).unwrap(), vec![0..3, 3..6, 6..9]);
        // A heavy last layer moves the cut: 60 and 60 bytes, not 40 or 50 and 80 or 70.
        let mut uneven = even.clone();
        uneven.layers[8] = 40;
        assert_eq!(plan(&uneven, 2, None, &[]).unwrap(), vec![0..6, 6..9]);
    }

    /// Gemma 4 E2B: its KV-shared layers and their sources stay on one rank, by plan or by a
    /// split that respects them; a split cutting them is refused, naming the range.
    #[test]
    fn gemma_kv_shared_layers_stay_together() {
        let config = config("gemma-4-e2b-it");
        let kept = together(&config);
        assert_eq!(kept.len(), 1, "{kept:?}");
        // 10 layers, the last 5 shared: they read layer 3 (sliding) and layer 4 (full).
        assert_eq!(kept[0].layers, 3..10);
        let bytes = layer_bytes(&fixture("gemma-4-e2b-it"), &config).unwrap();
        let ranges = plan(&bytes, 2, None, &kept).unwrap();
        assert!(ranges[1].start <= 3, "{ranges:?}");
        assert!(plan(&bytes, 2, Some(&[3, 7]), &kept).is_ok());
        let error = plan(&bytes, 2, Some(&[5, 5]), &kept).unwrap_err();
        assert!(matches!(error, SplitError::Cut { .. }), "{error}");
        assert!(error.to_string().contains("layers 3-9"), "{error}");
        let error = plan(&bytes, 2, Some(&[5, 4]), &kept).unwrap_err();
        assert!(error.to_string().contains("gives 9 layers"), "{error}");
        // Five ranks cannot each hold a layer when seven of ten must stay together.
        let error = plan(&bytes, 5, None, &kept).unwrap_err();
        assert!(matches!(error, SplitError::TooManyRanks { .. }), "{error}");
    }

    /// The releases' own configs: E2B's last 20 of 35 layers read layers 13 and 14, E4B's last
    /// 18 of 42 read 22 and 23; Qwen3-VL-8B adds deepstack features in its first three.
    #[test]
    fn the_releases_keep_their_layers_together() {
        let real = |name: &str| -> Value {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/real-configs")
                .join(name)
                .join("config.json");
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
        };
        let ranges = |name: &str| -> Vec<Range<usize>> {
            together(&real(name))
                .into_iter()
                .map(|t| t.layers)
                .collect()
        };
        assert_eq!(ranges("google__gemma-4-E2B-it"), vec![13..35]);
        assert_eq!(ranges("google__gemma-4-E4B-it"), vec![22..42]);
        assert_eq!(ranges("Qwen__Qwen3-VL-8B-Instruct"), vec![0..3]);
        assert!(ranges("google__gemma-4-31B-it").is_empty());
        assert!(ranges("Qwen__Qwen3.6-35B-A3B").is_empty());
    }

    /// Qwen3-VL: the layers that take the deepstack features stay on rank 0 with the tower,
    /// whose bytes count there; vision tensors are not language layers.
    #[test]
    fn qwen3_vl_deepstack_layers_stay_on_rank_0() {
        let config = config("qwen3-vl-2b-instruct");
        let kept = together(&config);
        assert_eq!(kept[0].layers, 0..3, "{kept:?}");
        let bytes = layer_bytes(&fixture("qwen3-vl-2b-instruct"), &config).unwrap();
        assert_eq!(bytes.layers.len(), 4);
        let ranges = plan(&bytes, 2, None, &kept).unwrap();
        assert_eq!(ranges, vec![0..3, 3..4]);
        assert_eq!(
            language_layer("model.visual.blocks.2.attn.qkv.weight"),
            None
        );
        assert_eq!(
            language_layer("model.vision_tower.encoder.layers.1.mlp.fc1.weight"),
            None
        );
        assert_eq!(language_layer("mtp.layers.0.mlp.gate_proj.weight"), None);
        assert_eq!(
            language_layer("model.language_model.layers.12.mlp.gate_proj.weight"),
            Some(12)
        );
        assert_eq!(
            language_layer("language_model.model.layers.3.self_attn.q_proj.weight"),
            Some(3)
        );
    }
}
