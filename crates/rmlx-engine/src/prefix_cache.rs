//! Prompt prefix cache: the KV of finished requests, kept per model and reused by any later
//! request that starts with the same tokens (multi-turn chats, shared system prompts, agents
//! re-sending their history). Byte-bounded, least recently used evicted first.
//! A model with a recurrent state (Qwen3.5's Gated DeltaNet) cannot cut an entry back to a
//! shorter prefix: its entries are snapshots, each serving exactly its own tokens, kept under a
//! budget of their own. Reference: mlx-lm `server.py` (`LRUPromptCache`) and
//! `models/cache.py` (`trim`).

use std::path::{Path, PathBuf};

use crate::cache::KvCache;

struct Entry {
    model: PathBuf,
    /// The tokens whose keys/values the caches hold, in order.
    tokens: Vec<u32>,
    caches: Vec<KvCache>,
    bytes: u64,
    last_used: u64,
    /// Holds a recurrent state: serves only prompts that start with all of `tokens`.
    snapshot: bool,
}

/// A reusable prefix found for a prompt.
pub struct Reuse {
    pub caches: Vec<KvCache>,
    /// Prompt tokens already in `caches` (prefill starts after them).
    pub cached_tokens: usize,
}

pub struct PrefixCache {
    entries: Vec<Entry>,
    budget_bytes: u64,
    snapshot_budget_bytes: u64,
    clock: u64,
}

/// What the cache holds, by kind (for `/metrics/cache`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheUsage {
    pub entries: usize,
    pub bytes: u64,
    pub snapshots: usize,
    pub snapshot_bytes: u64,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixCache {
    /// `budget_bytes` bounds the KV entries, `snapshot_budget_bytes` the recurrent snapshots.
    pub fn new(budget_bytes: u64, snapshot_budget_bytes: u64) -> Self {
        Self {
            entries: Vec::new(),
            budget_bytes,
            snapshot_budget_bytes,
            clock: 0,
        }
    }

    pub fn bytes(&self) -> u64 {
        self.entries.iter().map(|entry| entry.bytes).sum()
    }

    fn class_bytes(&self, snapshot: bool) -> u64 {
        self.entries
            .iter()
            .filter(|entry| entry.snapshot == snapshot)
            .map(|entry| entry.bytes)
            .sum()
    }

    pub fn usage(&self) -> CacheUsage {
        let snapshots = self.entries.iter().filter(|entry| entry.snapshot).count();
        CacheUsage {
            entries: self.entries.len() - snapshots,
            bytes: self.class_bytes(false),
            snapshots,
            snapshot_bytes: self.class_bytes(true),
        }
    }

    /// The longest stored prefix of `prompt` for `model`. At least the last prompt token is
    /// always left to compute, because its logits start the answer.
    pub fn lookup(&mut self, model: &Path, prompt: &[u32]) -> Option<Reuse> {
        self.clock += 1;
        let usable = prompt.len().saturating_sub(1);
        let (index, shared) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, entry)| entry.model == model)
            .map(|(index, entry)| {
                let shared = common_prefix(&entry.tokens, prompt).min(usable);
                // A recurrent state (linear attention) serves only the whole entry.
                let rewindable = entry
                    .caches
                    .iter()
                    .all(|cache| cache.can_truncate_to(shared as i32));
                (index, if rewindable { shared } else { 0 })
            })
            .max_by_key(|&(_, shared)| shared)?;
        if shared == 0 {
            return None;
        }
        let entry = &mut self.entries[index];
        entry.last_used = self.clock;
        let mut caches = entry.caches.clone();
        for cache in &mut caches {
            cache.truncate(shared as i32);
        }
        Some(Reuse {
            caches,
            cached_tokens: shared,
        })
    }

    /// Keeps a finished request's KV for `tokens`; returns how many entries were evicted.
    /// An entry that is a prefix of the new one is replaced when the new one can serve it (a
    /// KV cache can be cut back; a snapshot cannot, so shorter snapshots stay).
    pub fn insert(&mut self, model: &Path, tokens: Vec<u32>, caches: Vec<KvCache>) -> u64 {
        if tokens.is_empty() {
            return 0;
        }
        self.clock += 1;
        let snapshot = !caches.iter().all(|cache| cache.can_truncate_to(0));
        self.entries.retain(|entry| {
            let served = entry.tokens.len() <= tokens.len() && tokens.starts_with(&entry.tokens);
            !(entry.model == model && served && (!snapshot || entry.tokens == tokens))
        });
        let budget = if snapshot {
            self.snapshot_budget_bytes
        } else {
            self.budget_bytes
        };
        let bytes = caches.iter().map(|cache| cache.nbytes() as u64).sum();
        if bytes > budget {
            return 0;
        }
        self.entries.push(Entry {
            model: model.to_path_buf(),
            tokens,
            caches,
            bytes,
            last_used: self.clock,
            snapshot,
        });
        let mut evicted = 0;
        while self.class_bytes(snapshot) > budget {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, entry)| entry.snapshot == snapshot)
                .min_by_key(|(_, entry)| entry.last_used)
                .map(|(index, _)| index)
                .expect("over budget means not empty");
            self.entries.remove(oldest);
            evicted += 1;
        }
        evicted
    }

    /// Drops everything kept for `model` (it was unloaded).
    pub fn forget_model(&mut self, model: &Path) {
        self.entries.retain(|entry| entry.model != model);
    }
}
