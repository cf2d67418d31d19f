//! The prefix cache on disk, step one: the format, the keys and the writer (the lookup that
//! reads blocks back on a RAM miss comes next; until then nothing reads them).
//!
//! Layout: `ROOT/<model fingerprint>/<block hash>.safetensors`. A block holds the keys and values
//! of [`BLOCK_TOKENS`] consecutive positions of every cached layer, as the cache stores them
//! (dense or quantized parts), in a safetensors file whose metadata carries the format, the
//! fingerprint, the parent block's hash, the block's tokens and a SHA-256 of the data. A block's
//! hash chains its parent's with its token ids (image soft tokens are the prefix cache's
//! pixel-digest ids), so a block names the whole prefix up to its end.
//! The fingerprint covers the model's config, tokenizer files, every safetensors header and
//! size, its folder name (the hub revision in a Hugging Face cache) and how the KV is stored, so
//! another model, a changed checkpoint or another `--kv-bits` never meets these files. It reads
//! the headers only: well under a second for any checkpoint.
//! Arrays are sliced and copied to bytes on the engine thread; the writer thread only writes
//! bytes (temp file + rename), so no request waits on the disk.
//! Reference: vllm-mlx / oMLX block caches (a hash chain over token blocks), mlx-lm
//! `save_prompt_cache` (safetensors of the cache arrays with metadata).

use std::{
    collections::{BTreeMap, HashSet},
    io::{Read, Write},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc, Arc,
    },
};

use mlx_rs::{Array, Dtype};
use sha2::{Digest, Sha256};

use crate::{
    cache::{KvCache, KvStorage},
    error::{EngineError, Result},
};

/// Positions per block (the caches' growth step).
pub const BLOCK_TOKENS: usize = 256;
/// The format's name in every block's metadata.
pub const FORMAT: &str = "rmlx-prefix-block-v1";

/// A model as the disk cache keys it: hex SHA-256 over its config, tokenizer files, every
/// safetensors file's name, size and header, its folder name and the KV storage.
pub fn fingerprint(dir: &Path, storage: KvStorage) -> std::io::Result<String> {
    let mut hash = Sha256::new();
    hash.update(FORMAT.as_bytes());
    let name = dir
        .file_name()
        .map(|name| name.to_string_lossy().into_owned());
    hash.update(name.unwrap_or_default().as_bytes());
    hash.update(format!("{storage:?}").as_bytes());
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .collect();
    files.sort();
    for path in files {
        let file_name = path.file_name().unwrap_or_default().to_string_lossy();
        let keyed = matches!(
            file_name.as_ref(),
            "config.json" | "tokenizer.json" | "tokenizer_config.json" | "chat_template.jinja"
        );
        if keyed {
            hash.update(file_name.as_bytes());
            hash.update(std::fs::read(&path)?);
        } else if file_name.ends_with(".safetensors") {
            // The header (names, dtypes, shapes, offsets) and the size, not the weights.
            let mut file = std::fs::File::open(&path)?;
            let size = file.metadata()?.len();
            let mut length = [0u8; 8];
            file.read_exact(&mut length)?;
            let header_len = u64::from_le_bytes(length).min(size.saturating_sub(8));
            let mut header = vec![0u8; header_len as usize];
            file.read_exact(&mut header)?;
            hash.update(file_name.as_bytes());
            hash.update(size.to_le_bytes());
            hash.update(&header);
        }
    }
    Ok(hex(&hash.finalize()))
}

/// The hash after each whole block of `tokens`: `h_i = SHA-256(h_{i-1} || ids of block i)`.
pub fn chain(tokens: &[u32]) -> Vec<[u8; 32]> {
    let mut parent = [0u8; 32];
    tokens
        .chunks_exact(BLOCK_TOKENS)
        .map(|block| {
            let mut hash = Sha256::new();
            hash.update(parent);
            block.iter().for_each(|id| hash.update(id.to_le_bytes()));
            parent = hash.finalize().into();
            parent
        })
        .collect()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One block ready to write: its file name and contents.
pub struct Block {
    pub name: String,
    pub bytes: Vec<u8>,
}

/// Block `index` of a finished sequence (`tokens`, held by `caches`; `hashes` its [`chain`]),
/// encoded on the engine thread. None when a cache cannot give those columns (a recurrent
/// state, or a window that dropped them): such models are stored as snapshots instead (a later
/// step).
pub fn encode_block(
    fingerprint: &str,
    tokens: &[u32],
    hashes: &[[u8; 32]],
    caches: &[KvCache],
    index: usize,
) -> Result<Option<Block>> {
    let (start, end) = (index * BLOCK_TOKENS, (index + 1) * BLOCK_TOKENS);
    let mut tensors = Vec::new();
    for (layer, cache) in caches.iter().enumerate() {
        let Some(parts) = cache.export_columns(start as i32, end as i32)? else {
            return Ok(None);
        };
        for (part, array) in parts.into_iter().enumerate() {
            tensors.push((format!("layer.{layer}.part.{part}"), array));
        }
    }
    let mut metadata = BTreeMap::new();
    metadata.insert("format".to_string(), FORMAT.to_string());
    metadata.insert("fingerprint".to_string(), fingerprint.to_string());
    metadata.insert("block".to_string(), index.to_string());
    let parent = index.checked_sub(1).map_or([0u8; 32], |at| hashes[at]);
    metadata.insert("parent".to_string(), hex(&parent));
    let ids: Vec<String> = tokens[start..end].iter().map(u32::to_string).collect();
    metadata.insert("tokens".to_string(), ids.join(","));
    let storage = caches.first().map_or(KvStorage::Dense, KvCache::storage);
    metadata.insert("storage".to_string(), format!("{storage:?}"));
    Ok(Some(Block {
        name: format!("{}.safetensors", hex(&hashes[index])),
        bytes: safetensors_bytes(&tensors, metadata)?,
    }))
}

/// A block read back: its metadata and arrays by name. The checksum is verified.
pub struct DecodedBlock {
    pub metadata: BTreeMap<String, String>,
    pub tensors: BTreeMap<String, Array>,
}

/// Reads a block's bytes; a truncated or corrupt one is an error (a miss for the caller).
pub fn decode_block(bytes: &[u8]) -> Result<DecodedBlock> {
    let corrupt =
        |what: &str| EngineError::InvalidRequest(format!("a corrupt disk-cache block: {what}"));
    let length: [u8; 8] = bytes
        .get(..8)
        .ok_or_else(|| corrupt("no header"))?
        .try_into()
        .unwrap();
    let header_len = u64::from_le_bytes(length) as usize;
    let header = bytes
        .get(8..8 + header_len)
        .ok_or_else(|| corrupt("header cut short"))?;
    let header: serde_json::Value =
        serde_json::from_slice(header).map_err(|_| corrupt("header not JSON"))?;
    let data = &bytes[8 + header_len..];
    let metadata: BTreeMap<String, String> = header
        .get("__metadata__")
        .and_then(|m| serde_json::from_value(m.clone()).ok())
        .ok_or_else(|| corrupt("no metadata"))?;
    if metadata.get("format").map(String::as_str) != Some(FORMAT) {
        return Err(corrupt("another format"));
    }
    if metadata.get("sha256") != Some(&hex(&Sha256::digest(data))) {
        return Err(corrupt("checksum"));
    }
    let mut tensors = BTreeMap::new();
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
        let (from, to) = match info["data_offsets"].as_array().map(Vec::as_slice) {
            Some([from, to]) => (
                from.as_u64().unwrap_or(0) as usize,
                to.as_u64().unwrap_or(0) as usize,
            ),
            _ => return Err(corrupt("offsets")),
        };
        let raw = data
            .get(from..to)
            .ok_or_else(|| corrupt("data cut short"))?;
        let want = shape.iter().map(|&d| d as usize).product::<usize>() * dtype_bytes(dtype);
        if raw.len() != want {
            return Err(corrupt("size"));
        }
        // SAFETY: `raw` holds exactly the shape's elements of `dtype`; MLX copies it.
        let array = unsafe { Array::from_raw_data(raw.as_ptr().cast(), &shape, dtype) };
        tensors.insert(name.clone(), array);
    }
    Ok(DecodedBlock { metadata, tensors })
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
            serde_json::json!({
                "dtype": dtype_name(array.dtype())?,
                "shape": array.shape(),
                "data_offsets": [start, data.len()],
            }),
        );
    }
    metadata.insert("sha256".to_string(), hex(&Sha256::digest(&data)));
    header.insert("__metadata__".to_string(), serde_json::json!(metadata));
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

/// The writer thread: blocks arrive as bytes and are written atomically (a temp file in the
/// same folder, then a rename), each once.
pub struct DiskWriter {
    root: PathBuf,
    jobs: Option<mpsc::Sender<(String, Block)>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Block files known to be on disk or queued, per fingerprint folder.
    known: HashSet<(String, String)>,
    written: Arc<AtomicU64>,
}

impl DiskWriter {
    pub fn spawn(root: PathBuf) -> std::io::Result<Self> {
        std::fs::create_dir_all(&root)?;
        let (jobs, inbox) = mpsc::channel::<(String, Block)>();
        let written = Arc::new(AtomicU64::new(0));
        let (folder_root, counter) = (root.clone(), written.clone());
        let thread = std::thread::Builder::new()
            .name("rmlx-disk-cache".into())
            .spawn(move || {
                let mut warned = false;
                for (folder, block) in inbox {
                    match write_atomically(&folder_root.join(&folder), &block) {
                        Ok(()) => {
                            counter.fetch_add(block.bytes.len() as u64, Ordering::Relaxed);
                        }
                        // One warning; serving goes on (a full disk stops nothing else).
                        Err(error) if !warned => {
                            eprintln!("rmlx: the disk prefix cache stopped writing: {error}");
                            warned = true;
                        }
                        Err(_) => {}
                    }
                }
            })?;
        Ok(Self {
            root,
            jobs: Some(jobs),
            thread: Some(thread),
            known: HashSet::new(),
            written,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// Encodes (here, on the caller's thread) and queues the whole blocks of `tokens` that are
    /// not on disk yet; returns how many were queued.
    pub fn offer(
        &mut self,
        fingerprint: &str,
        tokens: &[u32],
        caches: &[KvCache],
    ) -> Result<usize> {
        let folder = self.root.join(fingerprint);
        let mut queued = 0;
        let hashes = chain(tokens);
        for (index, hash) in hashes.iter().enumerate() {
            let name = format!("{}.safetensors", hex(hash));
            let key = (fingerprint.to_string(), name.clone());
            if self.known.contains(&key) || folder.join(&name).exists() {
                self.known.insert(key);
                continue;
            }
            let Some(block) = encode_block(fingerprint, tokens, &hashes, caches, index)? else {
                break;
            };
            self.known.insert(key);
            if let Some(jobs) = &self.jobs {
                if jobs.send((fingerprint.to_string(), block)).is_ok() {
                    queued += 1;
                }
            }
        }
        Ok(queued)
    }
}

impl Drop for DiskWriter {
    /// Finishes the queued writes.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn write_atomically(folder: &Path, block: &Block) -> std::io::Result<()> {
    std::fs::create_dir_all(folder)?;
    let target = folder.join(&block.name);
    let temp = folder.join(format!(".{}.{}.partial", block.name, std::process::id()));
    let mut file = std::fs::File::create(&temp)?;
    file.write_all(&block.bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&temp, &target)
}
