//! A prefix read back from the disk becomes caches again (on the engine thread: MLX copies
//! the bytes): full-length layers get their blocks' columns (and the tip's) joined in order,
//! sliding layers their window, linear-attention layers their recurrent state.
//! Reference: mlx-lm `load_prompt_cache` (cache state from safetensors arrays).

use std::collections::BTreeMap;

use mlx_rs::{ops, Array};

use super::{format::Header, BLOCK_TOKENS};
use crate::{
    cache::{KvCache, KvStorage, RecurrentState},
    error::{EngineError, Result},
};

/// Takes a layer's `layer.{i}.part.{j}` arrays out of a file's, in part order.
fn take_parts(arrays: &mut BTreeMap<String, Array>, layer: usize) -> Vec<Array> {
    let mut found = Vec::new();
    while let Some(array) = arrays.remove(&format!("layer.{layer}.part.{}", found.len())) {
        found.push(array);
    }
    found
}

fn mismatch(what: &str) -> EngineError {
    EngineError::InvalidRequest(format!("a disk-cache prefix does not fit: {what}"))
}

/// Rebuilds `fresh` (the model's new caches, one per layer) from `files` (blocks in order,
/// then at most one tip, as [`super::store::Plan`] named them) for a prompt starting with
/// `prompt`; returns the caches and the positions they hold. Any disagreement (token ids, a
/// layer missing or of another kind, shapes) is an error: the caller counts a miss.
pub fn rebuild(
    mut fresh: Vec<KvCache>,
    files: &[(Header, Vec<u8>)],
    prompt: &[u32],
) -> Result<(Vec<KvCache>, usize)> {
    let layers = fresh.len();
    // Per layer: the parts' pieces in position order.
    let mut pieces: Vec<Vec<Vec<Array>>> = vec![Vec::new(); layers];
    let mut recurrent: BTreeMap<usize, RecurrentState> = BTreeMap::new();
    let mut windows: BTreeMap<usize, i32> = BTreeMap::new();
    let mut position = 0usize;
    let mut last: Option<&Header> = None;
    for (index, (header, bytes)) in files.iter().enumerate() {
        let kind = header.get("kind").unwrap_or("");
        let tip = kind == "tip";
        if (tip && index + 1 != files.len()) || (!tip && kind != "block") {
            return Err(mismatch("the files' order"));
        }
        let tokens = header.tokens()?;
        let start = if tip {
            header
                .get("blocks")
                .and_then(|b| b.parse::<usize>().ok())
                .filter(|&b| b == index)
                .ok_or_else(|| mismatch("the tip's anchor"))?
                * BLOCK_TOKENS
        } else {
            if tokens.len() != BLOCK_TOKENS {
                return Err(mismatch("a block's length"));
            }
            index * BLOCK_TOKENS
        };
        let end = start + tokens.len();
        if start != position || prompt.get(start..end) != Some(&tokens[..]) {
            return Err(mismatch("the token ids"));
        }
        let mut arrays = super::format::arrays(bytes, header)?;
        let columns: Vec<usize> = header.json("layers")?;
        for &layer in &columns {
            let slot = pieces.get_mut(layer).ok_or_else(|| mismatch("a layer"))?;
            let found = take_parts(&mut arrays, layer);
            if found.is_empty() && end > start {
                return Err(mismatch("a layer's columns"));
            }
            if !found.is_empty() {
                slot.push(found);
            }
        }
        if tip {
            for layer in header.json::<Vec<usize>>("recurrent")? {
                let mut take = |what: &str| {
                    arrays
                        .remove(&format!("layer.{layer}.{what}"))
                        .ok_or_else(|| mismatch("a recurrent state"))
                };
                let (conv, state) = (take("conv")?, take("state")?);
                recurrent.insert(layer, RecurrentState { conv, state });
            }
            for (layer, base) in header.json::<BTreeMap<String, i32>>("windows")? {
                let layer: usize = layer.parse().map_err(|_| mismatch("a window"))?;
                let found = take_parts(&mut arrays, layer);
                *pieces.get_mut(layer).ok_or_else(|| mismatch("a layer"))? = vec![found];
                windows.insert(layer, base);
            }
        }
        if !arrays.is_empty() {
            return Err(mismatch("arrays no layer took"));
        }
        position = end;
        last = Some(header);
    }
    let last = last.ok_or_else(|| mismatch("no files"))?;
    let kv: Vec<Option<(i32, i32)>> = last.json("kv")?;
    let rope: Vec<(i32, i32)> = last.json("rope")?;
    if kv.len() != layers {
        return Err(mismatch("the layer count"));
    }
    let at = position as i32;
    for (layer, cache) in fresh.iter_mut().enumerate() {
        let storage = match kv[layer] {
            None => KvStorage::Dense,
            Some((bits, group_size)) => KvStorage::Quantized { bits, group_size },
        };
        if let Some(state) = recurrent.remove(&layer) {
            cache.restore(KvStorage::Dense, Vec::new(), 0, at, Some(state), &rope)?;
            continue;
        }
        let window = windows.get(&layer).copied();
        if window.is_some() != cache.is_windowed() {
            return Err(mismatch("a sliding layer"));
        }
        let pieces = std::mem::take(&mut pieces[layer]);
        let count = pieces.first().map_or(0, Vec::len);
        if count == 0 || pieces.iter().any(|p| p.len() != count) {
            return Err(mismatch("a layer's parts"));
        }
        let parts = (0..count)
            .map(|part| {
                let run: Vec<&Array> = pieces.iter().map(|p| &p[part]).collect();
                match run.as_slice() {
                    [one] => Ok((*one).clone()),
                    many => Ok(ops::concatenate(many, 2)?),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        cache.restore(storage, parts, window.unwrap_or(0), at, None, &rope)?;
    }
    crate::runtime::eval(fresh.iter().flat_map(KvCache::state))?;
    Ok((fresh, position))
}
