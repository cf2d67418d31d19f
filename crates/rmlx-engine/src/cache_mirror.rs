//! The other ranks' copies of rank 0's caches (issue 33 c). Rank 0's engine makes, joins,
//! splits, cuts and drops caches as it batches, reuses prefixes and rolls back drafts; a
//! pipeline's other ranks hold the same caches for their own layers. So on rank 0 every cache
//! carries an id, and each operation the engine applies to a cache outside a forward is
//! written to a log; the log rides with the next forward, and each follower applies it to its
//! copies (`Mirrors`) before running its layers on the caches the forward names. What a forward
//! itself writes (keys, values, recurrent states) the follower's own forward writes.
//! One process never turns the log on: ids stay unset and nothing is written.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicI32, Ordering},
        Mutex,
    },
};

use crate::{
    cache::{KvCache, KvStorage},
    error::{EngineError, Result},
};

static MIRRORING: AtomicBool = AtomicBool::new(false);
static NEXT_ID: AtomicI32 = AtomicI32::new(1);
static LOG: Mutex<Vec<i32>> = Mutex::new(Vec::new());

/// Operation codes of the log; each is followed by its operands.
mod op {
    /// id, max_ctx, window (0: none)
    pub const NEW: i32 = 1;
    /// source id, new id
    pub const CLONE: i32 = 2;
    /// id
    pub const DROP: i32 = 3;
    /// id, other id
    pub const JOIN: i32 = 4;
    /// id, count, rows...
    pub const RETAIN: i32 = 5;
    /// source id, row, new id
    pub const ROW: i32 = 6;
    /// id, len
    pub const TRUNCATE: i32 = 7;
    /// id, written, count, kept...
    pub const KEEP: i32 = 8;
    /// id
    pub const COMPACT: i32 = 9;
    /// id, delta
    pub const ROPE: i32 = 10;
    /// id, bits (0: dense), group size
    pub const STORAGE: i32 = 11;
    /// id, max_ctx
    pub const MAX_CTX: i32 = 12;
    /// id, len
    pub const ALLOW: i32 = 13;
    /// id
    pub const SPECULATE: i32 = 14;
}

/// Turns the log on for this process (rank 0 of a pipeline), before any cache is made.
pub fn enable() {
    MIRRORING.store(true, Ordering::SeqCst);
}

pub fn enabled() -> bool {
    MIRRORING.load(Ordering::Relaxed) && !REPLAYING.with(std::cell::Cell::get)
}

thread_local! {
    /// Set while [`Mirrors::apply`] runs: the copies it makes are not rank 0's to log (one
    /// process plays both sides in the tests).
    static REPLAYING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The operations logged since the last call.
pub fn take_log() -> Vec<i32> {
    std::mem::take(&mut *LOG.lock().expect("not poisoned"))
}

fn log(words: &[i32]) {
    LOG.lock().expect("not poisoned").extend_from_slice(words);
}

fn fresh_id() -> i32 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// A cache's id on rank 0 (None in one process, and on the followers, which keep copies).
/// Cloning a cache gives the clone a new id and logs it; dropping one logs that too.
#[derive(Debug, Default)]
pub struct MirrorId(Option<i32>);

impl MirrorId {
    /// The id of a new cache, logged with what a follower needs to make the same one.
    pub(crate) fn new(max_ctx: i32, window: Option<i32>) -> Self {
        if !enabled() {
            return Self(None);
        }
        let id = fresh_id();
        log(&[op::NEW, id, max_ctx, window.unwrap_or(0)]);
        Self(Some(id))
    }

    /// The id of row `row` of this cache taken out as its own.
    pub(crate) fn row(&self, row: usize) -> Self {
        match self.0 {
            Some(source) => {
                let id = fresh_id();
                log(&[op::ROW, source, row as i32, id]);
                Self(Some(id))
            }
            None => Self(None),
        }
    }

    pub fn id(&self) -> Option<i32> {
        self.0
    }

    pub(crate) fn join(&self, other: &MirrorId) {
        if let (Some(id), Some(other)) = (self.0, other.0) {
            log(&[op::JOIN, id, other]);
        }
    }

    pub(crate) fn retain(&self, keep: &[usize]) {
        if let Some(id) = self.0 {
            let mut words = vec![op::RETAIN, id, keep.len() as i32];
            words.extend(keep.iter().map(|&row| row as i32));
            log(&words);
        }
    }

    pub(crate) fn keep(&self, written: i32, kept: &[i32]) {
        if let Some(id) = self.0 {
            let mut words = vec![op::KEEP, id, written, kept.len() as i32];
            words.extend_from_slice(kept);
            log(&words);
        }
    }

    pub(crate) fn storage(&self, storage: KvStorage) {
        if let Some(id) = self.0 {
            let (bits, group) = match storage {
                KvStorage::Dense => (0, 0),
                KvStorage::Quantized { bits, group_size } => (bits, group_size),
            };
            log(&[op::STORAGE, id, bits, group]);
        }
    }

    /// One of the operations that take the id and one number (or none).
    fn simple(&self, code: i32, value: Option<i32>) {
        if let Some(id) = self.0 {
            match value {
                Some(value) => log(&[code, id, value]),
                None => log(&[code, id]),
            }
        }
    }

    pub(crate) fn truncate(&self, len: i32) {
        self.simple(op::TRUNCATE, Some(len));
    }

    pub(crate) fn compact(&self) {
        self.simple(op::COMPACT, None);
    }

    pub(crate) fn rope(&self, delta: i32) {
        self.simple(op::ROPE, Some(delta));
    }

    pub(crate) fn max_ctx(&self, max_ctx: i32) {
        self.simple(op::MAX_CTX, Some(max_ctx));
    }

    pub(crate) fn allow(&self, len: i32) {
        self.simple(op::ALLOW, Some(len));
    }

    pub(crate) fn speculate(&self) {
        self.simple(op::SPECULATE, None);
    }
}

impl Clone for MirrorId {
    fn clone(&self) -> Self {
        match self.0 {
            Some(source) => {
                let id = fresh_id();
                log(&[op::CLONE, source, id]);
                Self(Some(id))
            }
            None => Self(None),
        }
    }
}

impl Drop for MirrorId {
    fn drop(&mut self) {
        if let Some(id) = self.0 {
            log(&[op::DROP, id]);
        }
    }
}

/// A follower's copies of rank 0's caches, by id.
#[derive(Default)]
pub struct Mirrors {
    caches: HashMap<i32, KvCache>,
}

impl Mirrors {
    pub fn len(&self) -> usize {
        self.caches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.caches.is_empty()
    }

    /// Applies rank 0's logged operations in order.
    pub fn apply(&mut self, log: &[i32]) -> Result<()> {
        REPLAYING.with(|replaying| replaying.set(true));
        let applied = self.replay(log);
        REPLAYING.with(|replaying| replaying.set(false));
        applied
    }

    fn replay(&mut self, log: &[i32]) -> Result<()> {
        let bad = |what: &str| EngineError::Distributed(format!("cache log: {what}"));
        let mut reader = Reader { log, at: 0 };
        let mut word = |count: usize| reader.take(count).ok_or_else(|| bad("cut short"));
        let unknown = |id: i32| bad(&format!("no cache {id}"));
        while let Ok(code) = word(1).map(|words| words[0]) {
            match code {
                op::NEW => {
                    let &[id, max_ctx, window] = word(3)? else {
                        unreachable!()
                    };
                    let cache = match window {
                        0 => KvCache::new(max_ctx as usize),
                        window => KvCache::windowed(max_ctx as usize, window as usize),
                    };
                    self.caches.insert(id, cache);
                }
                op::CLONE => {
                    let &[source, id] = word(2)? else {
                        unreachable!()
                    };
                    let cache = self
                        .caches
                        .get(&source)
                        .ok_or_else(|| unknown(source))?
                        .clone();
                    self.caches.insert(id, cache);
                }
                op::DROP => {
                    let id = word(1)?[0];
                    self.caches.remove(&id);
                }
                op::JOIN => {
                    let &[id, other] = word(2)? else {
                        unreachable!()
                    };
                    let other = self
                        .caches
                        .get(&other)
                        .ok_or_else(|| unknown(other))?
                        .clone();
                    self.get(id)?.join(&other)?;
                }
                op::RETAIN => {
                    let &[id, count] = word(2)? else {
                        unreachable!()
                    };
                    let keep: Vec<usize> = word(count as usize)?
                        .iter()
                        .map(|&row| row as usize)
                        .collect();
                    self.get(id)?.retain_rows(&keep)?;
                }
                op::ROW => {
                    let &[source, row, id] = word(3)? else {
                        unreachable!()
                    };
                    let cache = self
                        .caches
                        .get(&source)
                        .ok_or_else(|| unknown(source))?
                        .row(row as usize)?;
                    self.caches.insert(id, cache);
                }
                op::TRUNCATE => {
                    let &[id, len] = word(2)? else { unreachable!() };
                    self.get(id)?.truncate(len);
                }
                op::KEEP => {
                    let &[id, written, count] = word(3)? else {
                        unreachable!()
                    };
                    let kept = word(count as usize)?.to_vec();
                    self.get(id)?.keep_written(written, &kept)?;
                }
                op::COMPACT => {
                    let id = word(1)?[0];
                    self.get(id)?.compact()?;
                }
                op::ROPE => {
                    let &[id, delta] = word(2)? else {
                        unreachable!()
                    };
                    self.get(id)?.set_rope_delta(delta);
                }
                op::STORAGE => {
                    let &[id, bits, group_size] = word(3)? else {
                        unreachable!()
                    };
                    let storage = match bits {
                        0 => KvStorage::Dense,
                        bits => KvStorage::Quantized { bits, group_size },
                    };
                    self.get(id)?.set_storage(storage);
                }
                op::MAX_CTX => {
                    let &[id, max_ctx] = word(2)? else {
                        unreachable!()
                    };
                    self.get(id)?.set_max_ctx(max_ctx as usize);
                }
                op::ALLOW => {
                    let &[id, len] = word(2)? else { unreachable!() };
                    self.get(id)?.allow_up_to(len);
                }
                op::SPECULATE => {
                    let id = word(1)?[0];
                    self.get(id)?.begin_speculative();
                }
                other => return Err(bad(&format!("unknown operation {other}"))),
            }
        }
        Ok(())
    }

    fn get(&mut self, id: i32) -> Result<&mut KvCache> {
        self.caches
            .get_mut(&id)
            .ok_or_else(|| EngineError::Distributed(format!("cache log: no cache {id}")))
    }
}

/// Words of a log read in order.
struct Reader<'a> {
    log: &'a [i32],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, count: usize) -> Option<&'a [i32]> {
        let words = self.log.get(self.at..self.at + count)?;
        self.at += count;
        Some(words)
    }
}

impl Mirrors {
    /// The caches a forward names, taken out to run it (given back with [`Self::put_back`]).
    pub fn take(&mut self, ids: &[i32]) -> Result<Vec<KvCache>> {
        ids.iter()
            .map(|id| {
                self.caches.remove(id).ok_or_else(|| {
                    EngineError::Distributed(format!("a forward names cache {id}, not held here"))
                })
            })
            .collect()
    }

    pub fn put_back(&mut self, ids: &[i32], caches: Vec<KvCache>) {
        self.caches.extend(ids.iter().copied().zip(caches));
    }
}
