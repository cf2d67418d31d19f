//! Prompt prefix cache: the KV of finished requests, kept per model and reused by any later
//! request that starts with the same tokens (multi-turn chats, shared system prompts, agents
//! re-sending their history). Byte-bounded, least recently used evicted first.
//! A model with a recurrent state (Qwen3.5's Gated DeltaNet) cannot cut an entry back to a
//! shorter prefix: its entries are snapshots, each serving exactly its own tokens, kept under a
//! budget of their own. Reference: mlx-lm `server.py` (`LRUPromptCache`) and
//! `models/cache.py` (`trim`).
//!
//! Budgets: by default sized for coding agents, whose sessions re-send 25-130k tokens every turn
//! ([`auto_budgets`]); a KV entry larger than its budget keeps the prefix that fits.

use std::path::{Path, PathBuf};

use crate::cache::KvCache;

/// Tokens of one agent session the default budgets hold: Claude Code and Codex sessions run past
/// 100k tokens of prompt before they compact.
pub const AGENT_SESSION_TOKENS: u64 = 128 * 1024;
/// The smallest default KV budget (the budget before agents were sized for).
pub const MIN_KV_BUDGET: u64 = 1 << 30;
/// The smallest default snapshot budget: about 30 snapshots of Qwen3.6-35B-A3B's 63 MB Gated
/// DeltaNet state (five 6-turn conversations), a few hundred for the small dense models.
pub const MIN_SNAPSHOT_BUDGET: u64 = 2 << 30;
/// A KV entry is kept only if at least this many of its tokens fit (a shorter one saves little).
const MIN_TRIMMED_TOKENS: usize = 256;

/// What a resident model needs in memory, from its config (`models::structure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelFootprint {
    /// Weights as loaded.
    pub weights: u64,
    /// KV bytes per position of context.
    pub kv_per_token: u64,
    /// A sequence's fixed recurrent state (0 without linear-attention layers).
    pub recurrent_state: u64,
}

/// The prefix cache's two budgets, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    /// KV entries (attention-only models).
    pub kv: u64,
    /// Snapshots (models with a recurrent state).
    pub snapshots: u64,
}

/// The default budgets for the resident models on a machine with `total_memory` bytes:
/// - KV: one [`AGENT_SESSION_TOKENS`] session of the largest attention-only model's KV;
/// - snapshots: two such sessions of a recurrent model (its attention layers' KV plus the
///   state; the newest turn's snapshot and the one before, since a snapshot serves only
///   prompts that contain it whole);
/// - together at most half the memory the weights leave, shared in proportion to what each
///   wants; never under [`MIN_KV_BUDGET`] / [`MIN_SNAPSHOT_BUDGET`]. Unknown memory: the floors.
pub fn auto_budgets(models: &[ModelFootprint], total_memory: Option<u64>) -> Budgets {
    let session = |model: &ModelFootprint| model.kv_per_token * AGENT_SESSION_TOKENS;
    let kv_want = models
        .iter()
        .filter(|model| model.recurrent_state == 0)
        .map(session)
        .max()
        .unwrap_or(0);
    let snapshot_want = models
        .iter()
        .filter(|model| model.recurrent_state > 0)
        .map(|model| 2 * (session(model) + model.recurrent_state))
        .max()
        .unwrap_or(0);
    let floors = Budgets {
        kv: MIN_KV_BUDGET,
        snapshots: MIN_SNAPSHOT_BUDGET,
    };
    let Some(total) = total_memory else {
        return floors;
    };
    let weights: u64 = models.iter().map(|model| model.weights).sum();
    let room = total.saturating_sub(weights) / 2;
    let wants = kv_want + snapshot_want;
    let share = |want: u64| match wants <= room {
        true => want,
        // u128: a want times the room passes u64 on large machines.
        false => (want as u128 * room as u128 / wants.max(1) as u128) as u64,
    };
    Budgets {
        kv: share(kv_want).max(floors.kv),
        snapshots: share(snapshot_want).max(floors.snapshots),
    }
}

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
    /// KV entries stored shorter than they came, to fit the budget.
    trimmed: u64,
}

/// What the cache holds, by kind, and its budgets (for `/metrics/cache`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheUsage {
    pub entries: usize,
    pub bytes: u64,
    pub snapshots: usize,
    pub snapshot_bytes: u64,
    pub budget_bytes: u64,
    pub snapshot_budget_bytes: u64,
    pub trimmed: u64,
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
            trimmed: 0,
        }
    }

    pub fn budgets(&self) -> Budgets {
        Budgets {
            kv: self.budget_bytes,
            snapshots: self.snapshot_budget_bytes,
        }
    }

    /// New budgets (the resident models changed); returns the entries evicted to fit them.
    pub fn set_budgets(&mut self, budgets: Budgets) -> u64 {
        self.budget_bytes = budgets.kv;
        self.snapshot_budget_bytes = budgets.snapshots;
        self.evict_to_fit(false) + self.evict_to_fit(true)
    }

    /// Bytes kept for `model` (KV entries and snapshots).
    pub fn model_bytes(&self, model: &Path) -> u64 {
        self.entries
            .iter()
            .filter(|entry| entry.model == model)
            .map(|entry| entry.bytes)
            .sum()
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
            budget_bytes: self.budget_bytes,
            snapshot_budget_bytes: self.snapshot_budget_bytes,
            trimmed: self.trimmed,
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
    /// KV cache can be cut back; a snapshot cannot, so shorter snapshots stay). A KV entry over
    /// the budget keeps the longest prefix that fits (a snapshot cannot be cut, so it is not kept).
    pub fn insert(&mut self, model: &Path, mut tokens: Vec<u32>, mut caches: Vec<KvCache>) -> u64 {
        if tokens.is_empty() {
            return 0;
        }
        self.clock += 1;
        let snapshot = !caches.iter().all(|cache| cache.can_truncate_to(0));
        let budget = if snapshot {
            self.snapshot_budget_bytes
        } else {
            self.budget_bytes
        };
        let mut bytes: u64 = caches.iter().map(|cache| cache.nbytes() as u64).sum();
        if bytes > budget && !snapshot {
            // Positions held (allocated in growth steps) give the bytes of one.
            let positions = caches
                .iter()
                .map(KvCache::capacity)
                .max()
                .unwrap_or(0)
                .max(1);
            let per_token = bytes.div_ceil(positions as u64).max(1);
            let fits = (budget / per_token) as usize;
            if fits < MIN_TRIMMED_TOKENS.min(tokens.len()) {
                return 0;
            }
            let keep = fits.min(tokens.len());
            tokens.truncate(keep);
            for cache in &mut caches {
                cache.truncate(keep as i32);
                if cache.compact().is_err() {
                    return 0;
                }
            }
            bytes = caches.iter().map(|cache| cache.nbytes() as u64).sum();
            self.trimmed += 1;
        }
        if bytes > budget {
            return 0;
        }
        self.entries.retain(|entry| {
            let served = entry.tokens.len() <= tokens.len() && tokens.starts_with(&entry.tokens);
            !(entry.model == model && served && (!snapshot || entry.tokens == tokens))
        });
        self.entries.push(Entry {
            model: model.to_path_buf(),
            tokens,
            caches,
            bytes,
            last_used: self.clock,
            snapshot,
        });
        self.evict_to_fit(snapshot)
    }

    /// Drops `model`'s windowed snapshots that a finished request's `tokens` extend: that
    /// conversation moved on, and its windows (the largest snapshots: a Gemma 4 31B window is
    /// ~0.86 GB) would otherwise evict each other. Call before inserting the request's own.
    pub fn retire_windowed_prefixes(&mut self, model: &Path, tokens: &[u32]) {
        self.entries.retain(|entry| {
            let older = entry.tokens.len() < tokens.len() && tokens.starts_with(&entry.tokens);
            let windowed = entry.snapshot && entry.caches.iter().any(KvCache::is_windowed);
            !(entry.model == model && windowed && older)
        });
    }

    /// Evicts the least recently used entries of one kind until it is within its budget.
    fn evict_to_fit(&mut self, snapshot: bool) -> u64 {
        let budget = if snapshot {
            self.snapshot_budget_bytes
        } else {
            self.budget_bytes
        };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::structure::{fixed_state_bytes, kv_bytes_per_token};
    use mlx_rs::{ops, Array};

    const GIB: u64 = 1 << 30;

    fn real(release: &str) -> serde_json::Value {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/real-configs")
            .join(release)
            .join("config.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    /// Every release's real layer sizes: with the memory for it (the weights, then twice what
    /// the budget wants), the default budget holds a 100k-token session: a KV entry of it, or
    /// for a recurrent model two snapshots of it.
    #[test]
    fn a_100k_session_of_every_family_fits_the_default_budget() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/real-configs");
        let mut releases = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name().into_string().unwrap();
            // The README, and releases kept for their other files.
            if !entry.path().join("config.json").exists() {
                continue;
            }
            let config = real(&name);
            let model = ModelFootprint {
                weights: 20 * GIB,
                kv_per_token: kv_bytes_per_token(&config),
                recurrent_state: fixed_state_bytes(&config),
            };
            assert!(model.kv_per_token > 0, "{name}");
            let session = 100_000 * model.kv_per_token;
            let recurrent = model.recurrent_state > 0;
            let needed = match recurrent {
                true => 2 * (session + model.recurrent_state),
                false => session,
            };
            let machine = model.weights + 2 * (needed + needed / 4);
            let budgets = auto_budgets(&[model], Some(machine));
            let budget = if recurrent {
                budgets.snapshots
            } else {
                budgets.kv
            };
            assert!(budget >= needed, "{name}: {budget} < {needed}");
            // The machine also keeps half of what the weights leave for everything else.
            assert!(
                budgets.kv.max(MIN_KV_BUDGET) + budgets.snapshots <= machine,
                "{name}"
            );
            releases += 1;
        }
        assert!(releases >= 20, "{releases} real configs");
    }

    #[test]
    fn budgets_are_shared_within_half_the_free_memory_and_never_under_the_floors() {
        // Qwen3-4B in bf16 (8 GB, 144 KiB of KV per token) wants 18 GiB for a session.
        let qwen3_4b = ModelFootprint {
            weights: 8 * GIB,
            kv_per_token: 36 * 2 * 8 * 128 * 2,
            recurrent_state: 0,
        };
        let want = qwen3_4b.kv_per_token * AGENT_SESSION_TOKENS;
        let big = auto_budgets(&[qwen3_4b], Some(128 * GIB));
        assert_eq!((big.kv, big.snapshots), (want, MIN_SNAPSHOT_BUDGET));
        // A 32 GB Mac: half of the 24 GB the weights leave.
        let small = auto_budgets(&[qwen3_4b], Some(32 * GIB));
        assert_eq!(small.kv, 12 * GIB);
        // Two resident models, one recurrent: the half is shared in proportion to the wants.
        let recurrent = ModelFootprint {
            weights: 8 * GIB,
            kv_per_token: want / AGENT_SESSION_TOKENS / 2,
            recurrent_state: GIB,
        };
        let shared = auto_budgets(&[qwen3_4b, recurrent], Some(40 * GIB));
        let recurrent_want = 2 * (want / 2 + GIB);
        let room = 12 * GIB;
        assert_eq!(
            shared.kv,
            (want as u128 * room as u128 / (want + recurrent_want) as u128) as u64
        );
        assert!(shared.kv + shared.snapshots <= room + 1);
        // Unknown memory, or too little: the floors.
        let floors = Budgets {
            kv: MIN_KV_BUDGET,
            snapshots: MIN_SNAPSHOT_BUDGET,
        };
        assert_eq!(auto_budgets(&[qwen3_4b], None), floors);
        assert_eq!(auto_budgets(&[qwen3_4b], Some(9 * GIB)), floors);
        assert_eq!(auto_budgets(&[], Some(64 * GIB)), floors);
    }

    /// A one-row cache of `tokens` positions (2 heads, dim 4) whose values count up.
    fn caches(layers: usize, tokens: i32) -> Vec<KvCache> {
        (0..layers)
            .map(|layer| {
                let mut cache = KvCache::new(4096);
                let n = 2 * tokens * 4;
                let values: Vec<f32> = (0..n).map(|i| (i + layer as i32 * n) as f32).collect();
                let keys = Array::from_slice(&values, &[1, 2, tokens, 4]);
                cache.update_and_fetch(&keys, &keys).unwrap();
                cache
            })
            .collect()
    }

    /// A sliding-window layer's cache that has dropped its oldest positions.
    fn windowed(tokens: i32) -> Vec<KvCache> {
        let mut cache = KvCache::windowed(4096, 8);
        for _ in 0..tokens / 50 {
            let keys = Array::from_slice(&[0.5f32; 50], &[1, 1, 50, 1]);
            cache.update_and_fetch(&keys, &keys).unwrap();
        }
        assert!(cache.base() > 0 && cache.offset() == tokens);
        vec![cache]
    }

    /// Windowed snapshots a later request of the same conversation extends go when its own
    /// arrive; another conversation's, KV entries and other models' stay. A windowed entry
    /// serves a shorter prompt only where its window is still held.
    #[test]
    fn a_conversation_keeps_only_its_newest_windowed_snapshots() {
        let (model, other) = (Path::new("/models/gemma"), Path::new("/models/other"));
        let mut prefix = PrefixCache::new(1 << 30, 1 << 30);
        let turn1: Vec<u32> = (0..600).collect();
        let elsewhere: Vec<u32> = (10_000..10_600).collect();
        prefix.insert(model, turn1[..400].to_vec(), windowed(400));
        prefix.insert(model, turn1.clone(), windowed(600));
        prefix.insert(model, elsewhere.clone(), windowed(600));
        prefix.insert(other, turn1.clone(), windowed(600));
        prefix.insert(model, turn1[..300].to_vec(), caches(1, 300));
        assert_eq!(prefix.usage().snapshots, 4);
        // Cut back only within the window it holds (the next query sees 7 positions back).
        let reuse = prefix.lookup(model, &(0..595).chain(7000..7010).collect::<Vec<u32>>());
        assert_eq!(reuse.map(|r| r.cached_tokens), Some(595));
        let far = prefix.lookup(model, &(0..450).chain(7000..7010).collect::<Vec<u32>>());
        assert_eq!(far.map(|r| r.cached_tokens), Some(400));

        let turn2: Vec<u32> = (0..900).collect();
        prefix.retire_windowed_prefixes(model, &turn2);
        let usage = prefix.usage();
        assert_eq!((usage.snapshots, usage.entries), (2, 1));
        assert!(prefix.lookup(model, &elsewhere).is_some());
        assert!(prefix.lookup(other, &turn2).is_some());
    }

    #[test]
    fn an_entry_over_the_budget_keeps_the_prefix_that_fits() {
        let model = Path::new("/models/m");
        let whole = caches(2, 1000);
        let whole_bytes: u64 = whole.iter().map(|c| c.nbytes() as u64).sum();
        // 1000 tokens live in 1024 allocated positions: 64 bytes per position and layer.
        assert_eq!(whole_bytes, 2 * 2 * 1024 * 2 * 4 * 4);
        let budget = whole_bytes / 2;
        let mut prefix = PrefixCache::new(budget, budget);
        let tokens: Vec<u32> = (0..1000).collect();
        assert_eq!(prefix.insert(model, tokens.clone(), whole.clone()), 0);
        let usage = prefix.usage();
        assert_eq!((usage.entries, usage.trimmed), (1, 1));
        assert!(
            usage.bytes <= budget && usage.bytes >= budget - 256,
            "{}",
            usage.bytes
        );
        assert_eq!(prefix.model_bytes(model), usage.bytes);
        // A prompt past the entry reuses what was kept, and it holds the original values.
        let reuse = prefix
            .lookup(model, &(0..2000).collect::<Vec<u32>>())
            .unwrap();
        assert_eq!(reuse.cached_tokens, 512);
        for (kept, original) in reuse.caches.iter().zip(&whole) {
            assert_eq!(kept.offset(), 512);
            assert_eq!(kept.capacity(), 512, "compacted");
            let (a, b) = (&kept.state()[0], &original.state()[0]);
            use mlx_rs::ops::indexing::IndexOp;
            let equal = ops::array_eq(
                a.index((.., .., ..512, ..)),
                b.index((.., .., ..512, ..)),
                None,
            )
            .unwrap()
            .item_exact::<bool>();
            assert!(equal);
        }
        // Too small to be worth keeping: nothing.
        let mut tiny = PrefixCache::new(1000, 1000);
        tiny.insert(model, tokens, whole);
        assert_eq!(tiny.usage().entries, 0);
        // Smaller budgets evict down to them.
        assert_eq!(
            prefix.set_budgets(Budgets {
                kv: 1,
                snapshots: 1
            }),
            1
        );
        assert_eq!(prefix.usage().entries, 0);
    }
}
