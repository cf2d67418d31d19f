//! The engine thread: it alone owns the models and every MLX array (they are not `Sync`).
//! Requests are admitted in arrival order (nobody starves) into one running batch per model:
//! each decode step runs every running request's next token in one forward (continuous
//! batching: requests join and leave between steps), and a new request's prompt is prefilled
//! one chunk at a time between those steps, so no stream stalls longer than one chunk. Each
//! request gets a stream of events and a cancel flag checked between steps; dropping the
//! handle cancels (a disconnected client stops costing compute). Reference: mlx-lm
//! `generate.py` (`BatchGenerator`) and `server.py`; text-generation-inference's router
//! (validate first, stream events).
//!
//! Files: `request.rs` (what a client sends and gets back), `ticket.rs` (a request on the
//! thread), `thread_loop.rs` (the loop, the resident models), `admission.rs`, `batch.rs` (prefill
//! and decode steps), `disk.rs` (the disk prefix cache), `images.rs`, `warm_up.rs` (kernels
//! built before the first request).

mod admission;
mod batch;
mod disk;
mod group;
mod images;
mod request;
mod thread_loop;
mod ticket;
mod warm_up;

use std::{
    collections::{HashMap, VecDeque},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        mpsc, Arc,
    },
    thread,
};

use crate::{
    cache::KvStorage,
    disk_cache::DiskCache,
    error::{EngineError, Result},
    metrics::{Metrics, MetricsSnapshot},
    models::ModelInfo,
    prefix_cache::{self, PrefixCache},
};

pub use request::{Event, Prompt, Request, RequestHandle, Step};
use thread_loop::EngineThread;
pub use warm_up::{WarmUp, Warming};

enum Job {
    Generate {
        request: Box<Request>,
        events: mpsc::Sender<Event>,
        cancel: Arc<AtomicBool>,
    },
    Info {
        model: PathBuf,
        reply: mpsc::Sender<Result<ModelInfo>>,
    },
    Unload {
        model: PathBuf,
        reply: mpsc::Sender<bool>,
    },
    /// Nothing to do but look again: a warm-up ended, so requests it held may start.
    Wake,
}

impl Job {
    /// A request of the engine's own warm-up (`warm_up.rs`).
    fn is_warm_up(&self) -> bool {
        matches!(self, Job::Generate { request, .. } if request.warm_up)
    }
}

/// Requests decoding together by default. On this CPU a batch of 8 tiny-Qwen3 streams gives
/// the most tokens per second (docs/PERFORMANCE.md, "Batching"); mlx-lm's server batches up to
/// 8 as well (`--decode-concurrency`).
pub const DEFAULT_MAX_BATCH: usize = 8;

/// How the engine thread is sized.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Requests that may wait; more are refused with `QueueFull`.
    pub max_queue: usize,
    /// Requests decoding together at most (1: one after another).
    pub max_batch: usize,
    /// Models kept resident; the least recently used is unloaded past this.
    pub max_loaded: usize,
    /// Bytes of KV the prefix cache keeps for reuse (0 turns it off); None sizes it for agent
    /// sessions from the machine's memory and the resident models (`prefix_cache::auto_budgets`).
    pub prefix_cache_bytes: Option<u64>,
    /// Bytes of recurrent-model snapshots (Qwen3.5: KV + Gated DeltaNet state at message
    /// boundaries) the prefix cache keeps, apart from the KV entries (0 turns them off); None:
    /// sized as `prefix_cache_bytes` is.
    pub prefix_snapshot_bytes: Option<u64>,
    /// Memory a model may take; None = what the OS reports available when it loads.
    pub memory_budget: Option<u64>,
    /// Bits of the quantized KV cache of full-attention layers (8 or 4); None keeps it dense.
    pub kv_bits: Option<i32>,
    /// Where finished prefixes are also kept on disk (`disk_cache`), to be read back on a RAM
    /// miss, also after a restart; None: not at all.
    pub prefix_disk_dir: Option<PathBuf>,
    /// Bytes the disk cache may hold (least recently used files go first); None: min(16 GB,
    /// 10 % of the free disk).
    pub prefix_disk_bytes: Option<u64>,
    /// Speculative decoding for requests that do not choose (`GenerateParams::speculative`).
    pub speculative: crate::speculative::SpeculativeMode,
    /// A draft model paired with every model this engine loads (`--draft-model`): it must
    /// share their tokenizer, checked at load.
    pub draft_model: Option<PathBuf>,
    /// Holds every disk-cache read back this long (tests: a slow disk).
    #[doc(hidden)]
    pub disk_read_delay: Option<std::time::Duration>,
    /// Rank 0 of a pipeline across machines (issue 33): models load with only this rank's
    /// layers and every forward runs through the other ranks.
    pub part: crate::models::Part,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            max_queue: 64,
            max_batch: DEFAULT_MAX_BATCH,
            max_loaded: 1,
            prefix_cache_bytes: None,
            prefix_snapshot_bytes: None,
            memory_budget: None,
            kv_bits: None,
            prefix_disk_dir: None,
            prefix_disk_bytes: None,
            speculative: crate::speculative::SpeculativeMode::Auto,
            draft_model: None,
            disk_read_delay: None,
            part: crate::models::Part::default(),
        }
    }
}

/// A handle to the engine thread; cheap to clone, `Send + Sync`. When the last clone drops,
/// the thread finishes its queue, frees the models and is joined: MLX must not be torn down
/// by process exit while another thread still frees arrays.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<thread::JoinHandle<()>>,
    /// Requests submitted and not finished (waiting or running).
    queued: Arc<AtomicUsize>,
    /// Requests submitted and not yet admitted into prefill.
    waiting: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
    resident: Arc<std::sync::Mutex<Vec<ModelInfo>>>,
    max_queue: usize,
    /// Requests decoding together at most (the warm-up fills a batch this wide).
    max_batch: usize,
    /// Speculative decoding for requests that do not choose (the warm-up steps it if on).
    speculative: crate::speculative::SpeculativeMode,
    /// Each model's last warm-up (its folder, canonical).
    warm_ups: std::sync::Mutex<HashMap<PathBuf, WarmUp>>,
    /// Warm-ups running: while any does, other requests wait (see `EngineThread::warming`).
    warming: Arc<AtomicUsize>,
    disk_stats: Option<crate::disk_cache::StatsReader>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Engine {
    /// Starts the engine thread with room for `max_queue` waiting requests.
    pub fn start(max_queue: usize) -> Result<Self> {
        Self::start_with(EngineOptions {
            max_queue,
            ..EngineOptions::default()
        })
    }

    pub fn start_with(options: EngineOptions) -> Result<Self> {
        mlx_sys::load().map_err(|error| EngineError::Mlx(error.to_string()))?;
        if let Some(warning) = crate::runtime::version_drift() {
            eprintln!("rmlx: {warning}");
        }
        let max_queue = options.max_queue.max(1);
        // macOS: keep the weights wired up to Metal's recommended working set, as mlx-lm does.
        #[cfg(target_os = "macos")]
        crate::runtime::wire_memory();
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        crate::runtime::map_large_buffers();
        let kv_storage = match options.kv_bits {
            Some(bits) => KvStorage::quantized(bits)?,
            None => KvStorage::Dense,
        };
        let disk = match &options.prefix_disk_dir {
            Some(dir) => {
                let budget = options
                    .prefix_disk_bytes
                    .unwrap_or_else(|| crate::disk_cache::default_budget(dir));
                Some(
                    DiskCache::open(dir.clone(), budget, options.disk_read_delay).map_err(
                        |error| EngineError::Io {
                            path: dir.clone(),
                            message: error.to_string(),
                        },
                    )?,
                )
            }
            None => None,
        };
        let disk_stats = disk.as_ref().map(DiskCache::stats_reader);
        let (jobs, inbox) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let waiting = Arc::new(AtomicUsize::new(0));
        let worker_waiting = waiting.clone();
        let metrics = Arc::new(Metrics::default());
        let (worker_metrics, worker_queued) = (metrics.clone(), queued.clone());
        let resident = Arc::new(std::sync::Mutex::new(Vec::new()));
        let worker_resident = resident.clone();
        let warming = Arc::new(AtomicUsize::new(0));
        let worker_warming = warming.clone();
        // Models are not Send: the thread builds its state itself and never hands it out.
        let thread = thread::Builder::new()
            .name("rmlx-engine".into())
            .spawn(move || {
                if let Err(error) = crate::runtime::prepare_thread() {
                    // Every request will report it; nothing can run on this thread.
                    eprintln!("rmlx engine: {error}");
                }
                EngineThread {
                    models: HashMap::new(),
                    lru: Vec::new(),
                    max_loaded: options.max_loaded.max(1),
                    memory_budget: options.memory_budget,
                    kv_memory: None,
                    prefix: PrefixCache::new(
                        options
                            .prefix_cache_bytes
                            .unwrap_or(prefix_cache::MIN_KV_BUDGET),
                        options
                            .prefix_snapshot_bytes
                            .unwrap_or(prefix_cache::MIN_SNAPSHOT_BUDGET),
                    ),
                    prefix_budgets: (options.prefix_cache_bytes, options.prefix_snapshot_bytes),
                    kv_storage,
                    speculative: options.speculative,
                    draft_model: options.draft_model.clone(),
                    part: options.part.clone(),
                    disk,
                    fingerprints: HashMap::new(),
                    prefix_ids: HashMap::new(),
                    metrics: worker_metrics,
                    queued: worker_queued,
                    waiting: worker_waiting,
                    published: worker_resident,
                    max_batch: options.max_batch.max(1),
                    pending: VecDeque::new(),
                    loading: Vec::new(),
                    ready: VecDeque::new(),
                    admitting: Vec::new(),
                    group: None,
                    batch: None,
                    joining: false,
                    grouping: false,
                    warming: worker_warming,
                }
                .run(inbox)
            })
            .map_err(|error| {
                EngineError::Mlx(format!("cannot start the engine thread: {error}"))
            })?;
        Ok(Self {
            inner: Arc::new(Inner {
                jobs: Some(jobs),
                thread: Some(thread),
                queued,
                waiting,
                metrics,
                resident,
                max_queue,
                max_batch: options.max_batch.max(1),
                speculative: options.speculative,
                warm_ups: Default::default(),
                warming,
                disk_stats,
            }),
        })
    }

    fn jobs(&self) -> &mpsc::Sender<Job> {
        self.inner.jobs.as_ref().expect("present until drop")
    }

    /// Queues a request; a full queue is refused at once rather than waiting unbounded.
    pub fn submit(&self, request: Request) -> Result<RequestHandle> {
        let (events, receiver) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let job = Job::Generate {
            request: Box::new(request),
            events,
            cancel: cancel.clone(),
        };
        let max_queue = self.inner.max_queue;
        let admitted =
            self.inner
                .waiting
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |waiting| {
                    (waiting < max_queue).then_some(waiting + 1)
                });
        if admitted.is_err() {
            let error = EngineError::QueueFull(max_queue);
            self.inner.metrics.record_error(error.kind());
            return Err(error);
        }
        self.inner.queued.fetch_add(1, Ordering::SeqCst);
        match self.jobs().send(job) {
            Ok(()) => Ok(RequestHandle {
                events: receiver,
                cancel,
            }),
            Err(_) => {
                self.inner.queued.fetch_sub(1, Ordering::SeqCst);
                self.inner.waiting.fetch_sub(1, Ordering::SeqCst);
                let error = EngineError::EngineStopped;
                self.inner.metrics.record_error(error.kind());
                Err(error)
            }
        }
    }

    /// Runs `make_job` on the engine thread and waits for its reply.
    fn ask<T>(&self, make_job: impl FnOnce(mpsc::Sender<T>) -> Job) -> Result<T> {
        let (reply, receiver) = mpsc::channel();
        self.jobs()
            .send(make_job(reply))
            .map_err(|_| EngineError::EngineStopped)?;
        receiver.recv().map_err(|_| EngineError::EngineStopped)
    }

    /// Loads the model (if needed) and describes it.
    pub fn model_info(&self, model: &Path) -> Result<ModelInfo> {
        let model = model.to_path_buf();
        self.ask(|reply| Job::Info { model, reply })?
    }

    /// Unloads a resident model (and its prefix-cache entries); false if it was not loaded.
    pub fn unload(&self, model: &Path) -> Result<bool> {
        let model = model.to_path_buf();
        self.ask(|reply| Job::Unload { model, reply })
    }

    /// The resident models, most recently used last.
    pub fn loaded(&self) -> Result<Vec<ModelInfo>> {
        // Published by the engine thread, so listing never waits behind a generation.
        Ok(self
            .inner
            .resident
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone())
    }

    /// Requests waiting or running.
    pub fn queue_depth(&self) -> usize {
        self.inner.queued.load(Ordering::SeqCst)
    }

    /// The engine's metrics now (queue depth counts waiting requests only).
    /// Deletes every file of the disk prefix cache; the bytes freed (None when it is off).
    pub fn clear_disk_cache(&self) -> Option<u64> {
        self.inner.disk_stats.as_ref().map(|reader| reader.clear())
    }

    /// The disk prefix cache's counters (None when it is off).
    pub fn disk_stats(&self) -> Option<crate::disk_cache::DiskStats> {
        self.inner.disk_stats.as_ref().map(|reader| reader.stats())
    }

    pub fn metrics(&self) -> MetricsSnapshot {
        let mut snapshot = self.inner.metrics.snapshot();
        snapshot.disk_cache = self.disk_stats();
        snapshot.queue_depth = self.queue_depth().saturating_sub(snapshot.in_flight);
        snapshot
    }
}
