//! The prefix cache on disk: finished prefixes outlive the process, so an agent's next turn
//! after a restart of the app or the server is read back instead of prefilled again.
//!
//! Layout: `ROOT/<model fingerprint>/<block hash>.safetensors` and `tip-<hash>.safetensors`
//! (see [`format`]). A block's hash chains its parent's with its [`BLOCK_TOKENS`] token ids
//! (image soft tokens are the prefix cache's pixel-digest ids), so a block names the whole
//! prefix up to its end; a tip is keyed by its anchor block and its own ids.
//! The fingerprint covers the model's config, tokenizer files, every safetensors header and
//! size, its folder name (the hub revision in a Hugging Face cache) and how the KV is stored, so
//! another model, a changed checkpoint or another `--kv-bits` never meets these files. It reads
//! the headers only: well under a second for any checkpoint.
//! Arrays are made and read on the engine thread; files are written and read as plain bytes by
//! threads of their own ([`store`]), so no request waits on the disk and MLX stays on one thread.
//! Reference: vllm-mlx / oMLX block caches (a hash chain over token blocks), mlx-lm
//! `save_prompt_cache` (safetensors of the cache arrays with metadata).

pub mod format;
pub mod restore;
pub mod store;

use std::{
    io::Read,
    path::{Path, PathBuf},
};

use sha2::{Digest, Sha256};

pub use format::{decode_block, encode_block, encode_tip, DecodedBlock};
pub use store::{DiskCache, DiskStats, Plan, StatsReader};

use crate::cache::KvStorage;

/// Positions per block (the caches' growth step).
pub const BLOCK_TOKENS: usize = 256;
/// The format's name in every file's metadata.
pub const FORMAT: &str = "rmlx-prefix-v2";

/// A model as the disk cache keys it: hex SHA-256 over its config, tokenizer files, every
/// safetensors file's name, size and header, its folder name, the KV storage, and whether its
/// draft head is loaded (its caches then follow the trunk's in every file).
pub fn fingerprint(dir: &Path, storage: KvStorage, draft_head: bool) -> std::io::Result<String> {
    fingerprint_with_draft(dir, storage, draft_head, None)
}

/// [`fingerprint`] of a model paired with a separate draft model (whose caches the entries
/// carry too): the draft model's own fingerprint goes into the key.
pub fn fingerprint_with_draft(
    dir: &Path,
    storage: KvStorage,
    draft_head: bool,
    draft_model: Option<&Path>,
) -> std::io::Result<String> {
    let mut hash = Sha256::new();
    hash.update(FORMAT.as_bytes());
    if draft_head {
        hash.update(b"draft-head");
    }
    if let Some(draft) = draft_model {
        hash.update(b"draft-model");
        hash.update(fingerprint_with_draft(draft, storage, false, None)?.as_bytes());
    }
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

/// The default folder: `~/.rmlx/cache`.
pub fn default_root() -> Option<PathBuf> {
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".rmlx").join("cache"))
}

/// The default budget: min(16 GB, 10 % of the free space where `root` lives (or would)).
pub fn default_budget(root: &Path) -> u64 {
    const CAP: u64 = 16_000_000_000;
    let mut probe = root.to_path_buf();
    while !probe.exists() {
        if !probe.pop() {
            break;
        }
    }
    free_bytes(&probe).map_or(CAP, |free| (free / 10).min(CAP))
}

/// Free bytes on the file system holding `path`, for an unprivileged user.
pub fn free_bytes(path: &Path) -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
        // SAFETY: a zeroed statvfs is a valid out-parameter; `path` is NUL-terminated.
        let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(path.as_ptr(), &mut stat) } != 0 {
            return None;
        }
        Some(stat.f_bavail as u64 * stat.f_frsize as u64)
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        None
    }
}
