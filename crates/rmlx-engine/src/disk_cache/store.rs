//! Where the disk cache's files live and move: an index of what is on disk (filled by a
//! start-up scan that deletes only damaged or foreign-format files), a writer thread (a budget
//! held by evicting the least recently used files at every write, atomic writes, a full disk
//! stops writing with one warning), a reader thread (whole files and their checksums, as
//! bytes) and the lookup's plan: the longest prefix of a prompt the disk holds.
//! Reference: oMLX's paged SSD cache and vllm-mlx's block store (LRU over block files).

use std::{
    collections::{HashMap, HashSet},
    io::Write,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc, Arc, Mutex,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use super::{
    chain,
    format::{self, anchor, block_name, Encoded, Header},
    BLOCK_TOKENS,
};
use crate::{cache::KvCache, error::Result};

type FileKey = (String, String);

struct FileEntry {
    bytes: u64,
    /// Last write or hit, in nanoseconds since the epoch (the file's mtime after a restart).
    used: u128,
    /// A tip's anchor (to find it in `tips` when it goes).
    anchor: Option<[u8; 32]>,
}

/// A tip the index knows: its file, the position it ends at and its own token ids.
#[derive(Clone, Debug)]
pub struct TipRef {
    pub name: String,
    pub position: usize,
    pub tail: Vec<u32>,
}

#[derive(Default)]
struct Index {
    files: HashMap<FileKey, FileEntry>,
    tips: HashMap<(String, [u8; 32]), Vec<TipRef>>,
    bytes: u64,
}

impl Index {
    fn insert(&mut self, key: FileKey, bytes: u64, used: u128, tip: Option<([u8; 32], TipRef)>) {
        self.remove(&key);
        let anchor = tip.as_ref().map(|(anchor, _)| *anchor);
        if let Some((anchor, tip)) = tip {
            self.tips
                .entry((key.0.clone(), anchor))
                .or_default()
                .push(tip);
        }
        self.bytes += bytes;
        self.files.insert(
            key,
            FileEntry {
                bytes,
                used,
                anchor,
            },
        );
    }

    fn remove(&mut self, key: &FileKey) -> Option<u64> {
        let entry = self.files.remove(key)?;
        self.bytes -= entry.bytes;
        if let Some(anchor) = entry.anchor {
            let tips_key = (key.0.clone(), anchor);
            if let Some(tips) = self.tips.get_mut(&tips_key) {
                tips.retain(|tip| tip.name != key.1);
                if tips.is_empty() {
                    self.tips.remove(&tips_key);
                }
            }
        }
        Some(entry.bytes)
    }

    fn least_recently_used(&self) -> Option<FileKey> {
        self.files
            .iter()
            .min_by_key(|(_, entry)| entry.used)
            .map(|(key, _)| key.clone())
    }
}

/// The disk cache's counters (`/metrics/cache`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct DiskStats {
    pub root: PathBuf,
    pub budget_bytes: u64,
    pub bytes_on_disk: u64,
    pub files: u64,
    pub written_bytes: u64,
    pub read_bytes: u64,
    /// Time the reader spent reading and checking those bytes.
    pub read_ms: f64,
    pub evicted_files: u64,
    pub evicted_bytes: u64,
    /// Writing stopped after a failed write (a full disk); reads go on.
    pub stopped: bool,
    /// The start-up scan has indexed what was on disk.
    pub scanned: bool,
}

struct Shared {
    index: Mutex<Index>,
    /// Files queued for writing and not yet done.
    pending: Mutex<HashSet<FileKey>>,
    budget: u64,
    written: AtomicU64,
    read: AtomicU64,
    read_micros: AtomicU64,
    evicted_files: AtomicU64,
    evicted_bytes: AtomicU64,
    stopped: AtomicBool,
    scanned: AtomicBool,
}

impl Shared {
    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashSet<FileKey>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Deletes the least recently used files until `incoming` more bytes fit the budget.
    fn make_room(&self, root: &Path, incoming: u64) {
        let mut index = self.index();
        while index.bytes + incoming > self.budget {
            let Some(key) = index.least_recently_used() else {
                break;
            };
            let _ = std::fs::remove_file(root.join(&key.0).join(&key.1));
            if let Some(bytes) = index.remove(&key) {
                self.evicted_files.fetch_add(1, Ordering::Relaxed);
                self.evicted_bytes.fetch_add(bytes, Ordering::Relaxed);
            }
        }
    }
}

/// What a lookup found: the files to read (blocks in order, then a tip) and the prompt tokens
/// they hold.
#[derive(Clone, Debug)]
pub struct Plan {
    pub fingerprint: String,
    pub files: Vec<String>,
    pub tokens: usize,
}

/// Files a plan read, checked, in the plan's order: all of them, or the ones before the first
/// missing or damaged file (that file is deleted).
pub struct Loaded {
    pub id: u64,
    pub files: Vec<(Header, Vec<u8>)>,
    pub complete: bool,
}

struct WriteJob {
    fingerprint: String,
    file: Encoded,
    tip: Option<([u8; 32], TipRef)>,
}

struct ReadJob {
    id: u64,
    fingerprint: String,
    files: Vec<String>,
}

/// Reads the disk cache's counters from outside the engine thread.
#[derive(Clone)]
pub struct StatsReader {
    root: PathBuf,
    shared: Arc<Shared>,
}

impl StatsReader {
    /// Deletes every file (the app's "clear" button); the budget and counters stay.
    pub fn clear(&self) -> u64 {
        let mut index = self.shared.index();
        let keys: Vec<FileKey> = index.files.keys().cloned().collect();
        let mut freed = 0;
        for key in keys {
            let _ = std::fs::remove_file(self.root.join(&key.0).join(&key.1));
            freed += index.remove(&key).unwrap_or(0);
        }
        freed
    }

    pub fn stats(&self) -> DiskStats {
        let (bytes_on_disk, files) = {
            let index = self.shared.index();
            (index.bytes, index.files.len() as u64)
        };
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        DiskStats {
            root: self.root.clone(),
            budget_bytes: self.shared.budget,
            bytes_on_disk,
            files,
            written_bytes: load(&self.shared.written),
            read_bytes: load(&self.shared.read),
            read_ms: load(&self.shared.read_micros) as f64 / 1000.0,
            evicted_files: load(&self.shared.evicted_files),
            evicted_bytes: load(&self.shared.evicted_bytes),
            stopped: self.shared.stopped.load(Ordering::Relaxed),
            scanned: self.shared.scanned.load(Ordering::Relaxed),
        }
    }
}

pub struct DiskCache {
    root: PathBuf,
    shared: Arc<Shared>,
    writes: Option<mpsc::Sender<WriteJob>>,
    writer: Option<std::thread::JoinHandle<()>>,
    reads: Option<mpsc::Sender<ReadJob>>,
    reader: Option<std::thread::JoinHandle<()>>,
    results: mpsc::Receiver<Loaded>,
    next_id: u64,
}

fn now() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

impl DiskCache {
    /// Opens (creating) `root` with a budget of `budget` bytes: the writer thread first indexes
    /// what is there. `read_delay` holds every read back that long (tests: a slow disk).
    pub fn open(root: PathBuf, budget: u64, read_delay: Option<Duration>) -> std::io::Result<Self> {
        std::fs::create_dir_all(&root)?;
        let shared = Arc::new(Shared {
            index: Mutex::new(Index::default()),
            pending: Mutex::new(HashSet::new()),
            budget,
            written: AtomicU64::new(0),
            read: AtomicU64::new(0),
            read_micros: AtomicU64::new(0),
            evicted_files: AtomicU64::new(0),
            evicted_bytes: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
            scanned: AtomicBool::new(false),
        });
        // The scan happens before the first write: the writer thread does it.
        let (writes, write_inbox) = mpsc::channel::<WriteJob>();
        let (folder, state) = (root.clone(), shared.clone());
        let writer = std::thread::Builder::new()
            .name("rmlx-disk-writer".into())
            .spawn(move || {
                scan(&folder, &state);
                state.make_room(&folder, 0);
                state.scanned.store(true, Ordering::Relaxed);
                for job in write_inbox {
                    write_job(&folder, &state, job);
                }
            })?;
        let (reads, read_inbox) = mpsc::channel::<ReadJob>();
        let (results_out, results) = mpsc::channel::<Loaded>();
        let (folder, state) = (root.clone(), shared.clone());
        let reader = std::thread::Builder::new()
            .name("rmlx-disk-reader".into())
            .spawn(move || {
                for job in read_inbox {
                    if let Some(delay) = read_delay {
                        std::thread::sleep(delay);
                    }
                    let started = std::time::Instant::now();
                    let loaded = read_job(&folder, &state, job);
                    let micros = started.elapsed().as_micros() as u64;
                    state.read_micros.fetch_add(micros, Ordering::Relaxed);
                    if results_out.send(loaded).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Self {
            root,
            shared,
            writes: Some(writes),
            writer: Some(writer),
            reads: Some(reads),
            reader: Some(reader),
            results,
            next_id: 0,
        })
    }

    /// A handle that reads the counters from any thread.
    pub fn stats_reader(&self) -> StatsReader {
        StatsReader {
            root: self.root.clone(),
            shared: self.shared.clone(),
        }
    }

    fn known(&self, key: &FileKey) -> bool {
        self.shared.index().files.contains_key(key) || self.shared.pending().contains(key)
    }

    fn queue(&self, fingerprint: &str, file: Encoded, tip: Option<([u8; 32], TipRef)>) -> bool {
        let key = (fingerprint.to_string(), file.name.clone());
        self.shared.pending().insert(key.clone());
        let job = WriteJob {
            fingerprint: fingerprint.to_string(),
            file,
            tip,
        };
        let sent = self.writes.as_ref().is_some_and(|w| w.send(job).is_ok());
        if !sent {
            self.shared.pending().remove(&key);
        }
        sent
    }

    /// Encodes (on the caller's thread: the engine's) and queues what the disk does not hold
    /// yet of a finished sequence: its whole blocks (`caches` hold `tokens`) and a tip at each
    /// `(position, caches at that position)` of `tips`. Returns the files queued.
    pub fn offer(
        &mut self,
        fingerprint: &str,
        tokens: &[u32],
        caches: &[KvCache],
        tips: &[(usize, &[KvCache])],
    ) -> Result<usize> {
        if self.shared.stopped.load(Ordering::Relaxed) {
            return Ok(0);
        }
        let mut queued = 0;
        let hashes = chain(tokens);
        for (index, hash) in hashes.iter().enumerate() {
            let key = (fingerprint.to_string(), block_name(hash));
            if self.known(&key) {
                continue;
            }
            let Some(block) = format::encode_block(fingerprint, tokens, &hashes, caches, index)?
            else {
                break;
            };
            queued += self.queue(fingerprint, block, None) as usize;
        }
        for &(position, tip_caches) in tips {
            let blocks = position / BLOCK_TOKENS;
            let anchor = anchor(&hashes, blocks);
            let tail = &tokens[blocks * BLOCK_TOKENS..position.min(tokens.len())];
            let name = format::tip_name(&anchor, tail);
            if self.known(&(fingerprint.to_string(), name)) {
                continue;
            }
            let Some(tip) = format::encode_tip(fingerprint, tokens, &hashes, tip_caches, position)?
            else {
                continue;
            };
            let reference = TipRef {
                name: tip.name.clone(),
                position,
                tail: tail.to_vec(),
            };
            queued += self.queue(fingerprint, tip, Some((anchor, reference))) as usize;
        }
        Ok(queued)
    }

    /// The longest prefix of `prompt` (less its last token, which prefill must compute) the disk
    /// holds: whole blocks (where `needs_tip` is false: every layer is full-length KV) or blocks
    /// and a tip. None when nothing is held.
    pub fn plan(&self, fingerprint: &str, prompt: &[u32], needs_tip: bool) -> Option<Plan> {
        let usable = prompt.len().saturating_sub(1);
        let hashes = chain(&prompt[..usable]);
        let index = self.shared.index();
        let held = |name: String| index.files.contains_key(&(fingerprint.to_string(), name));
        let blocks = hashes
            .iter()
            .take_while(|hash| held(block_name(hash)))
            .count();
        // Tips anchored at k blocks end before block k + 1: the first k from the top with a
        // matching tip has the longest.
        let tip = (0..=blocks).rev().find_map(|k| {
            let tips = index
                .tips
                .get(&(fingerprint.to_string(), anchor(&hashes, k)))?;
            let start = k * BLOCK_TOKENS;
            tips.iter()
                .filter(|tip| {
                    tip.position == start + tip.tail.len()
                        && tip.position <= usable
                        && prompt[start..tip.position] == tip.tail[..]
                })
                .max_by_key(|tip| tip.position)
                .map(|tip| (k, tip.clone()))
        });
        let block_tokens = if needs_tip { 0 } else { blocks * BLOCK_TOKENS };
        let names = |count: usize| hashes[..count].iter().map(block_name).collect::<Vec<_>>();
        match tip {
            Some((k, tip)) if tip.position >= block_tokens => {
                let mut files = names(k);
                files.push(tip.name);
                Some(Plan {
                    fingerprint: fingerprint.to_string(),
                    files,
                    tokens: tip.position,
                })
            }
            _ if block_tokens > 0 => Some(Plan {
                fingerprint: fingerprint.to_string(),
                files: names(blocks),
                tokens: block_tokens,
            }),
            _ => None,
        }
    }

    /// Asks the reader thread for a plan's files; the answer comes through [`Self::poll`] with
    /// the returned id.
    pub fn request(&mut self, plan: &Plan) -> u64 {
        self.next_id += 1;
        let job = ReadJob {
            id: self.next_id,
            fingerprint: plan.fingerprint.clone(),
            files: plan.files.clone(),
        };
        if let Some(reads) = &self.reads {
            let _ = reads.send(job);
        }
        self.next_id
    }

    /// Reads that have finished.
    pub fn poll(&self) -> Vec<Loaded> {
        self.results.try_iter().collect()
    }

    /// Waits up to `timeout` for a read to finish.
    pub fn wait(&self, timeout: Duration) -> Option<Loaded> {
        self.results.recv_timeout(timeout).ok()
    }
}

impl Drop for DiskCache {
    /// Finishes the queued writes; reads in flight are dropped.
    fn drop(&mut self) {
        self.reads.take();
        self.writes.take();
        if let Some(thread) = self.writer.take() {
            let _ = thread.join();
        }
        if let Some(thread) = self.reader.take() {
            let _ = thread.join();
        }
    }
}

fn write_job(root: &Path, shared: &Shared, job: WriteJob) {
    let key = (job.fingerprint.clone(), job.file.name.clone());
    let skip = shared.stopped.load(Ordering::Relaxed)
        || shared.index().files.contains_key(&key)
        || job.file.bytes.len() as u64 > shared.budget;
    if !skip {
        let bytes = job.file.bytes.len() as u64;
        shared.make_room(root, bytes);
        match write_atomically(&root.join(&job.fingerprint), &job.file) {
            Ok(()) => {
                shared.written.fetch_add(bytes, Ordering::Relaxed);
                shared.index().insert(key.clone(), bytes, now(), job.tip);
            }
            // One warning; serving goes on (a full disk stops nothing else).
            Err(error) => {
                if !shared.stopped.swap(true, Ordering::Relaxed) {
                    eprintln!(
                        "rmlx: the disk prefix cache stopped writing ({}): {error}",
                        root.display()
                    );
                }
            }
        }
    }
    shared.pending().remove(&key);
}

fn write_atomically(folder: &Path, file: &Encoded) -> std::io::Result<()> {
    std::fs::create_dir_all(folder)?;
    let target = folder.join(&file.name);
    let temp = folder.join(format!(".{}.{}.partial", file.name, std::process::id()));
    let written = (|| {
        let mut out = std::fs::File::create(&temp)?;
        out.write_all(&file.bytes)?;
        out.sync_all()
    })();
    if let Err(error) = written {
        let _ = std::fs::remove_file(&temp);
        return Err(error);
    }
    std::fs::rename(&temp, &target)
}

fn read_job(root: &Path, shared: &Shared, job: ReadJob) -> Loaded {
    let folder = root.join(&job.fingerprint);
    let mut files = Vec::new();
    for name in &job.files {
        let path = folder.join(name);
        let checked = std::fs::read(&path).ok().and_then(|bytes| {
            let header = format::parse_header(&bytes).ok()?;
            let ours = header.get("fingerprint") == Some(job.fingerprint.as_str());
            (ours && format::verify(&bytes, &header).is_ok()).then_some((header, bytes))
        });
        let key = (job.fingerprint.clone(), name.clone());
        match checked {
            Some((header, bytes)) => {
                shared.read.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                if let Some(entry) = shared.index().files.get_mut(&key) {
                    entry.used = now();
                }
                // The recency survives a restart as the file's mtime.
                if let Ok(file) = std::fs::File::options().append(true).open(&path) {
                    let _ = file.set_modified(SystemTime::now());
                }
                files.push((header, bytes));
            }
            None => {
                // Missing, truncated or corrupt: a miss, and the file goes.
                let _ = std::fs::remove_file(&path);
                shared.index().remove(&key);
                return Loaded {
                    id: job.id,
                    files,
                    complete: false,
                };
            }
        }
    }
    Loaded {
        id: job.id,
        files,
        complete: true,
    }
}

/// Indexes the files under `root`: each fingerprint folder's blocks and tips by their headers
/// (the data is checked when read). Files that are not ours are left alone; damaged ones, ours
/// in an older format, and temp files of writers that died more than an hour ago are deleted.
fn scan(root: &Path, shared: &Shared) {
    let Ok(folders) = std::fs::read_dir(root) else {
        return;
    };
    for folder in folders.flatten() {
        let fingerprint = folder.file_name().to_string_lossy().into_owned();
        let ours = fingerprint.len() == 64 && fingerprint.bytes().all(|b| b.is_ascii_hexdigit());
        if !ours || !folder.path().is_dir() {
            continue;
        }
        let Ok(files) = std::fs::read_dir(folder.path()) else {
            continue;
        };
        for file in files.flatten() {
            let name = file.file_name().to_string_lossy().into_owned();
            let path = file.path();
            let Ok(meta) = file.metadata() else {
                continue;
            };
            let modified = meta.modified().unwrap_or(UNIX_EPOCH);
            if name.ends_with(".partial") {
                let stale = modified
                    .elapsed()
                    .is_ok_and(|age| age > Duration::from_secs(3600));
                if stale {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            if !name.ends_with(".safetensors") {
                continue;
            }
            match index_entry(&path, &fingerprint, &name) {
                Some(tip) => {
                    let used = modified
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| d.as_nanos());
                    shared
                        .index()
                        .insert((fingerprint.clone(), name), meta.len(), used, tip);
                }
                None => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
    }
}

/// A file's index entry from its header: Some(None) for a block, Some(Some(tip)) for a tip,
/// None for a file that is damaged, of another format or misplaced.
#[allow(clippy::option_option)]
fn index_entry(path: &Path, fingerprint: &str, name: &str) -> Option<Option<([u8; 32], TipRef)>> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).ok()?;
    let mut first = [0u8; 8];
    file.read_exact(&mut first).ok()?;
    let len = format::header_len(&first).ok()?;
    let mut bytes = first.to_vec();
    bytes.resize(len, 0);
    file.read_exact(&mut bytes[8..]).ok()?;
    let header = format::parse_header(&bytes).ok()?;
    if header.get("fingerprint") != Some(fingerprint) {
        return None;
    }
    match header.get("kind")? {
        "block" => Some(None),
        "tip" => {
            let anchor = unhex(header.get("anchor")?)?;
            let position: usize = header.get("position")?.parse().ok()?;
            let tail = header.tokens().ok()?;
            (format::tip_name(&anchor, &tail) == name).then_some(Some((
                anchor,
                TipRef {
                    name: name.to_string(),
                    position,
                    tail,
                },
            )))
        }
        _ => None,
    }
}

fn unhex(text: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    if text.len() != 64 {
        return None;
    }
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}
