//! The files of the disk prefix cache: blocks and tips, as safetensors with metadata.
//!
//! A **block** holds [`BLOCK_TOKENS`] consecutive positions of every full-length attention
//! layer (dense or quantized parts, as the cache stores them). A **tip** holds what a prefix
//! ending at any position `p` needs beyond its whole blocks: the full-length layers' columns
//! after the last whole block, each sliding layer's window (the positions its next query
//! sees) and each linear-attention layer's recurrent state at `p`. Metadata names the format,
//! the fingerprint, the token ids the file covers, the layers it holds, how each stores its KV,
//! the rotary-offset history and a SHA-256 of the data.
//! Reference: mlx-lm `save_prompt_cache` (safetensors of cache arrays with metadata).

use std::collections::BTreeMap;

use mlx_rs::{Array, Dtype};
use serde_json::json;
use sha2::{Digest, Sha256};

use super::{hex, BLOCK_TOKENS, FORMAT};
use crate::{
    cache::{KvCache, KvStorage},
    error::{EngineError, Result},
};

/// One file ready to write: its name and contents.
pub struct Encoded {
    pub name: String,
    pub bytes: Vec<u8>,
}

/// What a layer's cache contributes: columns to blocks, or a state only a tip can hold.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Role {
    /// Full-length KV: its columns go into blocks.
    Columns,
    /// A linear-attention layer's recurrent state.
    Recurrent,
    /// A sliding-window layer's window.
    Window,
}

pub fn role(cache: &KvCache) -> Role {
    if cache.recurrent().is_some() {
        Role::Recurrent
    } else if cache.is_windowed() {
        Role::Window
    } else {
        Role::Columns
    }
}

/// A tip's file name: its anchor (the hash of the blocks before it) and its own token ids.
pub fn tip_name(anchor: &[u8; 32], tail: &[u32]) -> String {
    let mut hash = Sha256::new();
    hash.update(anchor);
    hash.update(b"tip");
    tail.iter().for_each(|id| hash.update(id.to_le_bytes()));
    format!("tip-{}.safetensors", hex(&hash.finalize()))
}

pub fn block_name(hash: &[u8; 32]) -> String {
    format!("{}.safetensors", hex(hash))
}

/// The hash the blocks before position `blocks * BLOCK_TOKENS` chain to (zeros for none).
pub fn anchor(hashes: &[[u8; 32]], blocks: usize) -> [u8; 32] {
    blocks.checked_sub(1).map_or([0u8; 32], |at| hashes[at])
}

fn common_metadata(
    fingerprint: &str,
    kind: &str,
    caches: &[KvCache],
    end: i32,
) -> BTreeMap<String, String> {
    let mut metadata = BTreeMap::new();
    metadata.insert("format".to_string(), FORMAT.to_string());
    metadata.insert("fingerprint".to_string(), fingerprint.to_string());
    metadata.insert("kind".to_string(), kind.to_string());
    // How each layer stores its KV (a quantized one resolves its group at the first token).
    let kv: Vec<serde_json::Value> = caches
        .iter()
        .map(|cache| match cache.storage() {
            KvStorage::Dense => serde_json::Value::Null,
            KvStorage::Quantized { bits, group_size } => json!([bits, group_size]),
        })
        .collect();
    metadata.insert("kv".to_string(), json!(kv).to_string());
    let rope: Vec<(i32, i32)> = caches
        .first()
        .map(|cache| cache.rope_history().to_vec())
        .unwrap_or_default()
        .into_iter()
        .filter(|&(at, _)| at <= end)
        .collect();
    metadata.insert("rope".to_string(), json!(rope).to_string());
    metadata
}

/// A layer's stored parts as `layer.{i}.part.{j}` tensors ([`super::restore`] reads them back).
fn push_parts(tensors: &mut Vec<(String, Array)>, layer: usize, parts: Vec<Array>) {
    for (part, array) in parts.into_iter().enumerate() {
        tensors.push((format!("layer.{layer}.part.{part}"), array));
    }
}

fn ids(tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Block `index` of a finished sequence (`tokens`, held by `caches`; `hashes` its
/// [`super::chain`]), encoded on the engine thread. None when the model has no full-length
/// layer or a cache cannot give those columns.
pub fn encode_block(
    fingerprint: &str,
    tokens: &[u32],
    hashes: &[[u8; 32]],
    caches: &[KvCache],
    index: usize,
) -> Result<Option<Encoded>> {
    let (start, end) = (index * BLOCK_TOKENS, (index + 1) * BLOCK_TOKENS);
    let mut tensors = Vec::new();
    let mut layers = Vec::new();
    for (layer, cache) in caches.iter().enumerate() {
        if role(cache) != Role::Columns {
            continue;
        }
        let Some(parts) = cache.export_columns(start as i32, end as i32)? else {
            return Ok(None);
        };
        layers.push(layer);
        push_parts(&mut tensors, layer, parts);
    }
    if layers.is_empty() {
        return Ok(None);
    }
    let mut metadata = common_metadata(fingerprint, "block", caches, end as i32);
    metadata.insert("block".to_string(), index.to_string());
    metadata.insert("parent".to_string(), hex(&anchor(hashes, index)));
    metadata.insert("tokens".to_string(), ids(&tokens[start..end]));
    metadata.insert("layers".to_string(), json!(layers).to_string());
    Ok(Some(Encoded {
        name: block_name(&hashes[index]),
        bytes: safetensors_bytes(&tensors, metadata)?,
    }))
}

/// The tip of the prefix `tokens[..position]`: `caches` hold exactly that prefix for every
/// recurrent or windowed layer (a snapshot taken there) and at least it for the full-length
/// ones. None when a cache cannot give what the tip needs.
pub fn encode_tip(
    fingerprint: &str,
    tokens: &[u32],
    hashes: &[[u8; 32]],
    caches: &[KvCache],
    position: usize,
) -> Result<Option<Encoded>> {
    let blocks = position / BLOCK_TOKENS;
    let first = (blocks * BLOCK_TOKENS) as i32;
    let p = position as i32;
    if position == 0 || position > tokens.len() || hashes.len() < blocks {
        return Ok(None);
    }
    let mut tensors = Vec::new();
    let (mut layers, mut recurrent, mut windows) = (Vec::new(), Vec::new(), BTreeMap::new());
    for (layer, cache) in caches.iter().enumerate() {
        match role(cache) {
            Role::Columns => {
                layers.push(layer);
                if p > first {
                    let Some(parts) = cache.export_columns(first, p)? else {
                        return Ok(None);
                    };
                    push_parts(&mut tensors, layer, parts);
                }
            }
            Role::Recurrent => {
                let Some(state) = cache.recurrent().filter(|_| cache.offset() == p) else {
                    return Ok(None);
                };
                recurrent.push(layer);
                let own = |array: &Array| crate::cache::contiguous(array);
                tensors.push((format!("layer.{layer}.conv"), own(&state.conv)?));
                tensors.push((format!("layer.{layer}.state"), own(&state.state)?));
            }
            Role::Window => {
                let keep = cache.window_keep().unwrap_or(p);
                let start = cache.base().max(p - keep).max(0);
                if cache.offset() != p {
                    return Ok(None);
                }
                let Some(parts) = cache.export_columns(start, p)? else {
                    return Ok(None);
                };
                windows.insert(layer.to_string(), start);
                push_parts(&mut tensors, layer, parts);
            }
        }
    }
    let anchor = anchor(hashes, blocks);
    let tail = &tokens[blocks * BLOCK_TOKENS..position];
    let mut metadata = common_metadata(fingerprint, "tip", caches, p);
    metadata.insert("blocks".to_string(), blocks.to_string());
    metadata.insert("anchor".to_string(), hex(&anchor));
    metadata.insert("position".to_string(), position.to_string());
    metadata.insert("tokens".to_string(), ids(tail));
    metadata.insert("layers".to_string(), json!(layers).to_string());
    metadata.insert("recurrent".to_string(), json!(recurrent).to_string());
    metadata.insert("windows".to_string(), json!(windows).to_string());
    Ok(Some(Encoded {
        name: tip_name(&anchor, tail),
        bytes: safetensors_bytes(&tensors, metadata)?,
    }))
}

/// One tensor of a file: where its bytes are, relative to the data section.
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<i32>,
    pub range: std::ops::Range<usize>,
}

/// A file's header: metadata and tensor specs, without its data.
pub struct Header {
    pub metadata: BTreeMap<String, String>,
    pub tensors: Vec<TensorSpec>,
    /// Where the data section starts in the file.
    pub data_start: usize,
}

impl Header {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).map(String::as_str)
    }

    /// A metadata entry holding JSON.
    pub fn json<T: serde::de::DeserializeOwned>(&self, key: &str) -> Result<T> {
        serde_json::from_str(self.get(key).unwrap_or("null"))
            .map_err(|_| corrupt(&format!("metadata `{key}`")))
    }

    /// Token ids the file covers.
    pub fn tokens(&self) -> Result<Vec<u32>> {
        match self.get("tokens") {
            None | Some("") => Ok(Vec::new()),
            Some(list) => list
                .split(',')
                .map(|id| id.parse().map_err(|_| corrupt("token ids")))
                .collect(),
        }
    }
}

fn corrupt(what: &str) -> EngineError {
    EngineError::InvalidRequest(format!("a corrupt disk-cache file: {what}"))
}

/// The size of a file's header (8 bytes of length, then the JSON), from its first 8 bytes.
pub fn header_len(first: &[u8]) -> Result<usize> {
    let length: [u8; 8] = first
        .get(..8)
        .ok_or_else(|| corrupt("no header"))?
        .try_into()
        .expect("8 bytes");
    let len = u64::from_le_bytes(length);
    if len > 64 << 20 {
        return Err(corrupt("header size"));
    }
    Ok(8 + len as usize)
}

/// Parses a file's header (`bytes` may stop after it); the data is not checked.
pub fn parse_header(bytes: &[u8]) -> Result<Header> {
    let data_start = header_len(bytes)?;
    let header = bytes
        .get(8..data_start)
        .ok_or_else(|| corrupt("header cut short"))?;
    let header: serde_json::Value =
        serde_json::from_slice(header).map_err(|_| corrupt("header not JSON"))?;
    let metadata: BTreeMap<String, String> = header
        .get("__metadata__")
        .and_then(|m| serde_json::from_value(m.clone()).ok())
        .ok_or_else(|| corrupt("no metadata"))?;
    if metadata.get("format").map(String::as_str) != Some(FORMAT) {
        return Err(corrupt("another format"));
    }
    let mut tensors = Vec::new();
    for (name, info) in header.as_object().into_iter().flatten() {
        if name == "__metadata__" {
            continue;
        }
        let dtype =
            dtype_of(info["dtype"].as_str().unwrap_or("")).ok_or_else(|| corrupt("dtype"))?;
        let shape: Vec<i32> = info["shape"]
            .as_array()
            .map(|dims| {
                dims.iter()
                    .filter_map(|d| d.as_i64())
                    .map(|d| d as i32)
                    .collect()
            })
            .ok_or_else(|| corrupt("shape"))?;
        let range = match info["data_offsets"].as_array().map(Vec::as_slice) {
            Some([from, to]) => {
                from.as_u64().unwrap_or(0) as usize..to.as_u64().unwrap_or(0) as usize
            }
            _ => return Err(corrupt("offsets")),
        };
        let want = shape.iter().map(|&d| d.max(0) as usize).product::<usize>() * dtype_bytes(dtype);
        if range.end < range.start || range.len() != want {
            return Err(corrupt("size"));
        }
        tensors.push(TensorSpec {
            name: name.clone(),
            dtype,
            shape,
            range,
        });
    }
    Ok(Header {
        metadata,
        tensors,
        data_start,
    })
}

/// Checks that the whole data section is there and matches its checksum (plain bytes: the
/// disk cache's reader thread does this, not the engine thread).
pub fn verify(bytes: &[u8], header: &Header) -> Result<()> {
    let data = bytes
        .get(header.data_start..)
        .ok_or_else(|| corrupt("data cut short"))?;
    if header.tensors.iter().any(|t| t.range.end > data.len()) {
        return Err(corrupt("data cut short"));
    }
    if header.get("sha256") != Some(hex(&Sha256::digest(data)).as_str()) {
        return Err(corrupt("checksum"));
    }
    Ok(())
}

/// The arrays of a verified file, by name (MLX copies the bytes: call on the engine thread).
pub fn arrays(bytes: &[u8], header: &Header) -> Result<BTreeMap<String, Array>> {
    let data = &bytes[header.data_start..];
    let mut out = BTreeMap::new();
    for tensor in &header.tensors {
        let raw = data
            .get(tensor.range.clone())
            .ok_or_else(|| corrupt("data cut short"))?;
        // SAFETY: `raw` holds exactly the shape's elements of `dtype` (checked when parsed);
        // MLX copies it.
        let array =
            unsafe { Array::from_raw_data(raw.as_ptr().cast(), &tensor.shape, tensor.dtype) };
        out.insert(tensor.name.clone(), array);
    }
    Ok(out)
}

/// A file read back and checked: its metadata and arrays by name.
pub struct DecodedBlock {
    pub metadata: BTreeMap<String, String>,
    pub tensors: BTreeMap<String, Array>,
}

/// Reads a whole file's bytes; a truncated or corrupt one is an error (a miss for the caller).
pub fn decode_block(bytes: &[u8]) -> Result<DecodedBlock> {
    let header = parse_header(bytes)?;
    verify(bytes, &header)?;
    let tensors = arrays(bytes, &header)?;
    Ok(DecodedBlock {
        metadata: header.metadata,
        tensors,
    })
}

/// A safetensors file: the JSON header (names sorted, then `__metadata__` with the data's
/// SHA-256), then the arrays' bytes.
fn safetensors_bytes(
    tensors: &[(String, Array)],
    mut metadata: BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let mut data = Vec::new();
    let mut header = serde_json::Map::new();
    for (name, array) in tensors {
        array.eval()?;
        let start = data.len();
        let raw = array.view::<u8>()?;
        raw.eval()?;
        data.extend_from_slice(raw.as_slice::<u8>());
        header.insert(
            name.clone(),
            json!({
                "dtype": dtype_name(array.dtype())?,
                "shape": array.shape(),
                "data_offsets": [start, data.len()],
            }),
        );
    }
    metadata.insert("sha256".to_string(), hex(&Sha256::digest(&data)));
    header.insert("__metadata__".to_string(), json!(metadata));
    let mut json = serde_json::to_vec(&serde_json::Value::Object(header))
        .map_err(|error| EngineError::InvalidRequest(error.to_string()))?;
    // safetensors pads the header with spaces to 8 bytes.
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut bytes = Vec::with_capacity(8 + json.len() + data.len());
    bytes.extend_from_slice(&(json.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&json);
    bytes.extend_from_slice(&data);
    Ok(bytes)
}

fn dtype_name(dtype: Dtype) -> Result<&'static str> {
    Ok(match dtype {
        Dtype::Float32 => "F32",
        Dtype::Float16 => "F16",
        Dtype::Bfloat16 => "BF16",
        Dtype::Uint32 => "U32",
        other => {
            return Err(EngineError::InvalidRequest(format!(
                "the disk cache does not store {other:?} arrays"
            )))
        }
    })
}

fn dtype_bytes(dtype: Dtype) -> usize {
    match dtype {
        Dtype::Float16 | Dtype::Bfloat16 => 2,
        _ => 4,
    }
}

fn dtype_of(name: &str) -> Option<Dtype> {
    Some(match name {
        "F32" => Dtype::Float32,
        "F16" => Dtype::Float16,
        "BF16" => Dtype::Bfloat16,
        "U32" => Dtype::Uint32,
        _ => return None,
    })
}
