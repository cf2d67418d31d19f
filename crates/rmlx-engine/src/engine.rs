//! The engine thread: it alone owns the models and every MLX array (they are not `Sync`).
//! Requests are admitted in arrival order (nobody starves) into one running batch per model:
//! each decode step runs every running request's next token in one forward (continuous
//! batching: requests join and leave between steps), and a new request's prompt is prefilled
//! one chunk at a time between those steps, so no stream stalls longer than one chunk. Each
//! request gets a stream of events and a cancel flag checked between steps; dropping the
//! handle cancels (a disconnected client stops costing compute). Reference: mlx-lm
//! `generate.py` (`BatchGenerator`) and `server.py`; text-generation-inference's router
//! (validate first, stream events).

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
    cache::{KvCache, KvStorage},
    chat::{ChatTokenizer, TemplateOptions},
    constrain::{ConstraintFactory, Grammars},
    disk_cache::DiskCache,
    error::{EngineError, Result},
    generate::{self, Completion, DecodeRow, FinishReason, GenerateParams, Prefill, Sequence},
    metrics::{Metrics, MetricsSnapshot, PrefixSource},
    models::{self, LoadedModel, ModelInfo},
    prefix_cache::{self, ModelFootprint, PrefixCache},
};

/// What to feed the model.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Messages rendered through the model's chat template.
    Chat {
        messages: Vec<serde_json::Value>,
        options: TemplateOptions,
    },
    /// Raw text, tokenized as is (BOS added when the tokenizer wants it).
    Text(String),
    /// Token ids, used as is.
    Ids(Vec<u32>),
}

/// One generation. Build it with `..Request::default()`: fields get added over time.
#[derive(Debug, Clone)]
pub struct Request {
    pub model: PathBuf,
    /// The name metrics file this request under; default the model folder's name.
    pub model_id: Option<String>,
    pub prompt: Prompt,
    /// Text appended to the prompt (after a chat prompt's generation prompt) before tokenizing:
    /// the start of the assistant's turn, part of the prompt, not of the answer (a forced
    /// `<tool_call>`, Anthropic's assistant prefill).
    pub assistant_prefill: Option<String>,
    /// Decoded images, in the order their content parts appear (or, with no parts, placed by
    /// the splice fallback inside the final user turn).
    pub images: Vec<image::RgbImage>,
    /// The caller's id for this request (the server's response id): metrics list it.
    pub request_id: Option<String>,
    /// Gemma 4's soft-token budget per image for this request (70, 140, 280, 560 or 1120);
    /// None uses the checkpoint's processor setting.
    pub image_soft_tokens: Option<usize>,
    pub params: GenerateParams,
    /// Fault injection for tests: this request's work panics at that step, as a bug would.
    #[doc(hidden)]
    pub panic_at: Option<Step>,
}

/// A step of the engine loop (see [`Request::panic_at`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Admit,
    Prefill,
    Decode,
}

/// Panics when the request asked for a panic at `step` (only tests do).
fn injected_panic(panic_at: Option<Step>, step: Step) {
    if panic_at == Some(step) {
        panic!("injected panic at {step:?} (Request::panic_at)");
    }
}

impl Default for Request {
    fn default() -> Self {
        Self {
            model: PathBuf::new(),
            model_id: None,
            prompt: Prompt::Ids(Vec::new()),
            assistant_prefill: None,
            images: Vec::new(),
            request_id: None,
            image_soft_tokens: None,
            params: GenerateParams::default(),
            panic_at: None,
        }
    }
}

impl Request {
    fn metrics_id(&self) -> String {
        self.model_id
            .clone()
            .unwrap_or_else(|| folder_name(&self.model))
    }
}

fn folder_name(path: &Path) -> String {
    path.file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

#[derive(Debug)]
pub enum Event {
    /// The prompt was tokenized and fits: generation is starting.
    Started {
        prompt_tokens: usize,
        max_ctx: usize,
    },
    /// Newly completed text for one token (with its log-probs when asked for).
    Delta {
        token_id: u32,
        text: String,
        logprob: Option<crate::generate::TokenLogprob>,
    },
    Done(Completion),
    Error(EngineError),
}

/// A running request: its events, and cancellation on demand or on drop.
pub struct RequestHandle {
    pub events: mpsc::Receiver<Event>,
    cancel: Arc<AtomicBool>,
}

impl RequestHandle {
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// Waits for the end, returning the completion or the error.
    pub fn wait(self) -> Result<Completion> {
        for event in self.events.iter() {
            match event {
                Event::Done(completion) => return Ok(completion),
                Event::Error(error) => return Err(error),
                _ => {}
            }
        }
        Err(EngineError::EngineStopped)
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.cancel();
    }
}

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
    /// Holds every disk-cache read back this long (tests: a slow disk).
    #[doc(hidden)]
    pub disk_read_delay: Option<std::time::Duration>,
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
            disk_read_delay: None,
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
                    admitting: None,
                    batch: None,
                    joining: false,
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

struct Resident {
    loaded: LoadedModel,
    tokenizer: ChatTokenizer,
    /// What it needs in memory (sizes the prefix cache's default budgets).
    footprint: ModelFootprint,
    /// Built on the first constrained request: most models never see one.
    constraints: Option<ConstraintFactory>,
}

impl Resident {
    /// The request's `response_format` constraint and freeform tools' grammars.
    fn grammars(&mut self, params: &GenerateParams) -> Result<Grammars> {
        if params.response_format.is_text()
            && params.tool_grammars.is_empty()
            && params.reasoning_budget.is_none()
        {
            return Ok(Grammars::default());
        }
        let factory = match &mut self.constraints {
            Some(factory) => factory,
            slot => slot.insert(ConstraintFactory::from_tokenizer(
                &self.tokenizer,
                self.loaded.model.vocab_size(),
                self.tokenizer.eos_token_ids(),
            )?),
        };
        Ok(Grammars {
            format: factory.constraint(&params.response_format)?,
            tools: factory
                .tool_grammars(&params.tool_grammars, params.reasoning_budget.as_ref())?,
        })
    }
}

/// A model's weights, KV per token and recurrent state, from its folder.
fn footprint(dir: &Path) -> Result<ModelFootprint> {
    let io = |error: std::io::Error| EngineError::Io {
        path: dir.to_path_buf(),
        message: error.to_string(),
    };
    let text = std::fs::read_to_string(dir.join("config.json")).map_err(io)?;
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|error| EngineError::Io {
            path: dir.join("config.json"),
            message: error.to_string(),
        })?;
    Ok(ModelFootprint {
        weights: crate::runtime::memory_needed(dir).map_err(io)?,
        kv_per_token: models::structure::kv_bytes_per_token(&config),
        // Sliding windows count with the recurrent state: past the window the prefix cache
        // keeps them as snapshots.
        recurrent_state: models::structure::fixed_state_bytes(&config),
    })
}

struct EngineThread {
    models: HashMap<PathBuf, Resident>,
    /// Resident model keys, least recently used first.
    lru: Vec<PathBuf>,
    max_loaded: usize,
    memory_budget: Option<u64>,
    prefix: PrefixCache,
    /// The budgets asked for (None: sized from memory and the resident models).
    prefix_budgets: (Option<u64>, Option<u64>),
    /// How new requests' caches store keys and values (`EngineOptions::kv_bits`).
    kv_storage: KvStorage,
    /// The disk cache and each model's fingerprint (`EngineOptions::prefix_disk_dir`).
    disk: Option<DiskCache>,
    fingerprints: HashMap<PathBuf, String>,
    /// The model id metrics know each cached model by.
    prefix_ids: HashMap<PathBuf, String>,
    metrics: Arc<Metrics>,
    queued: Arc<AtomicUsize>,
    waiting: Arc<AtomicUsize>,
    /// The resident models as `Engine::loaded` reports them, LRU order.
    published: Arc<std::sync::Mutex<Vec<ModelInfo>>>,
    max_batch: usize,
    /// Jobs taken from the channel and not yet handled, in arrival order.
    pending: VecDeque<Job>,
    /// Requests whose prefix the disk cache's reader is reading; others decode meanwhile.
    loading: Vec<Loading>,
    /// Requests whose prefix has been read, to start before any pending job.
    ready: VecDeque<(Loading, crate::disk_cache::store::Loaded)>,
    /// The request whose prompt is being prefilled, a chunk per turn of the loop.
    admitting: Option<Admission>,
    /// The requests decoding together.
    batch: Option<Batch>,
    /// Set while a prefilled request's caches join the batch's: a panic then leaves the batch
    /// half joined (see `guarded`).
    joining: bool,
}

/// What a request carries from submission to its end.
struct Ticket {
    events: mpsc::Sender<Event>,
    cancel: Arc<AtomicBool>,
    model_id: String,
    request_id: Option<String>,
    /// Whether its KV goes to the prefix cache when it ends (not when cancelled).
    keep_kv: bool,
    /// With images: the prompt as the prefix cache keys it, each image's soft tokens (one id for
    /// every image) replaced by ids drawn from a digest of its pixels.
    image_key: Option<Vec<u32>>,
    /// The engine's count of unfinished requests, settled when this one ends.
    queued: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
    /// Set by [`Ticket::settle`]; a ticket dropped open was lost to a panic (see `Drop`).
    closed: bool,
    panic_at: Option<Step>,
}

impl Ticket {
    /// The request's end, first half: its counters settle (the caller then publishes the
    /// gauges), so the client, told by [`Ticket::send_last`], sees them idle.
    fn settle(&mut self) {
        self.closed = true;
        settle(&self.queued);
    }

    fn send_last(self, last: Event) {
        let _ = self.events.send(last);
    }
}

impl Drop for Ticket {
    /// Only a panic on the engine thread drops a ticket unclosed (its step's locals unwind):
    /// the client still gets a typed error and the counters still settle.
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        let error = EngineError::Internal(
            "the engine stopped serving this request after a bug (the server log has the \
             panic); the next request is unaffected"
                .into(),
        );
        self.metrics.record_error(error.kind());
        settle(&self.queued);
        let _ = self.events.send(Event::Error(error));
    }
}

/// One request fewer unfinished; MLX's buffer cache goes back to the system when none is left.
fn settle(queued: &AtomicUsize) {
    if queued.fetch_sub(1, Ordering::SeqCst) == 1 {
        crate::runtime::release_cached_memory();
    }
}

/// A finished sequence for the disk: its tokens as the cache keys them, its caches and the
/// tips to write (position, the caches holding that prefix).
struct DiskOffer {
    tokens: Vec<u32>,
    caches: Vec<KvCache>,
    tips: Vec<(usize, Vec<KvCache>)>,
}

/// A request waiting for the disk cache's reader (see [`EngineThread::start`]).
struct Loading {
    read: u64,
    request: Request,
    ticket: Ticket,
    /// When the request was first admitted: its TTFT counts the read.
    admitted: std::time::Instant,
    /// Its prompt as rendered then.
    rendered: Vec<u32>,
}

/// What [`EngineThread::start`] made of a request: its prefill, or a disk read to wait for.
// Made and moved once per request: the size difference costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
enum Started {
    Prefill(PathBuf, Prefill, Grammars, Option<Vec<u32>>),
    /// The plan, and the prompt as rendered (before images are placed).
    Read(crate::disk_cache::Plan, Vec<u32>),
}

struct Admission {
    key: PathBuf,
    ticket: Ticket,
    prefill: Prefill,
    constraint: Grammars,
}

/// One model's running requests: `rows[b]` owns row `b` of every layer's cache.
struct Batch {
    key: PathBuf,
    /// Positions of KV the rows may hold together: the first row's context.
    context: usize,
    caches: Vec<KvCache>,
    rows: Vec<Row>,
}

impl Batch {
    /// Columns every row's KV spans (the padded length).
    fn columns(&self) -> usize {
        self.caches
            .first()
            .map_or(0, |cache| cache.offset().max(0) as usize)
    }
}

struct Row {
    sequence: Sequence,
    ticket: Ticket,
}

impl DecodeRow for Row {
    fn sequence(&mut self) -> &mut Sequence {
        &mut self.sequence
    }
    fn cancelled(&self) -> bool {
        self.ticket.cancel.load(Ordering::Relaxed)
    }
    fn emit(&mut self, delta: generate::Delta) {
        send_delta(&self.ticket.events, delta);
    }
}

fn send_delta(events: &mpsc::Sender<Event>, delta: generate::Delta) {
    let _ = events.send(Event::Delta {
        token_id: delta.token_id,
        text: delta.text,
        logprob: delta.logprob,
    });
}

impl EngineThread {
    fn publish_resident(&self) {
        let infos = self
            .lru
            .iter()
            .map(|key| self.models[key].loaded.info.clone())
            .collect();
        *self.published.lock().unwrap_or_else(|p| p.into_inner()) = infos;
    }

    fn run(mut self, inbox: mpsc::Receiver<Job>) {
        let mut open = true;
        loop {
            // Block only with nothing to do; otherwise take what has arrived and go on.
            let idle = self.batch.is_none()
                && self.admitting.is_none()
                && self.pending.is_empty()
                && self.ready.is_empty();
            if idle && !self.loading.is_empty() {
                // Only disk reads to wait for: look for them and for new jobs in turn.
                crate::profile::idle();
                if let Some(loaded) = self
                    .disk
                    .as_ref()
                    .and_then(|disk| disk.wait(std::time::Duration::from_millis(2)))
                {
                    self.take_read(loaded);
                }
            } else if idle {
                if !open {
                    break;
                }
                // Time spent idle is not time between decode steps.
                crate::profile::idle();
                match inbox.recv() {
                    Ok(job) => self.pending.push_back(job),
                    Err(_) => break,
                }
            }
            loop {
                match inbox.try_recv() {
                    Ok(job) => self.pending.push_back(job),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            self.guarded(Self::admit);
            self.guarded(Self::prefill_step);
            self.guarded(Self::decode_step);
            self.publish_in_flight();
        }
    }

    /// Runs one step of the loop; a panic in it (a bug) costs only the requests that step held:
    /// their tickets unwind and tell their clients (see `Ticket`'s `Drop`), and the thread goes
    /// on serving. Without this, one bad request would leave every later one unanswered.
    fn guarded(&mut self, step: fn(&mut Self)) {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(self)));
        if outcome.is_err() {
            // A batch left half joined is in no known state: its requests fail too.
            if std::mem::take(&mut self.joining) {
                drop(self.batch.take());
            }
            self.publish_in_flight();
        }
    }

    /// Handles jobs at the head of the queue while they can go now: a request joins when no
    /// other prompt is prefilling and the batch runs its model with room to spare; a job that
    /// needs another model (or to unload the running one) waits until the batch drains, and
    /// everything behind it waits too.
    fn admit(&mut self) {
        if let Some(disk) = &self.disk {
            for loaded in disk.poll() {
                self.take_read(loaded);
            }
        }
        // Requests whose prefix came off the disk go first (they arrived before anything
        // pending); one that cannot go yet holds the queue, as a pending job would.
        while let Some((loading, _)) = self.ready.front() {
            if self.admitting.is_some() || !self.batch_takes(&loading.request.model) {
                return;
            }
            let (loading, loaded) = self.ready.pop_front().expect("looked at above");
            let Loading {
                request,
                mut ticket,
                admitted,
                rendered,
                ..
            } = loading;
            match self.start(&request, Some((loaded, rendered))) {
                Ok(Started::Prefill(key, mut prefill, constraint, image_key)) => {
                    prefill.count_from(admitted);
                    ticket.image_key = image_key;
                    self.begin(key, ticket, prefill, constraint)
                }
                Ok(Started::Read(..)) => unreachable!("a read prefix is never read again"),
                Err(error) => self.fail(ticket, error),
            }
        }
        while let Some(job) = self.pending.front() {
            let busy = self.batch.is_some() || self.admitting.is_some();
            let running = self
                .batch
                .as_ref()
                .map(|batch| &batch.key)
                .or(self.admitting.as_ref().map(|admission| &admission.key));
            match job {
                Job::Generate { cancel, .. } if cancel.load(Ordering::Relaxed) => {}
                Job::Generate { request, .. } => {
                    if self.admitting.is_some() || !self.batch_takes(&request.model) {
                        return;
                    }
                }
                Job::Info { model, .. } => {
                    let resident = model
                        .canonicalize()
                        .is_ok_and(|key| self.models.contains_key(&key));
                    if busy && !resident {
                        return;
                    }
                }
                Job::Unload { model, .. } => {
                    let key = model.canonicalize().ok();
                    if running.is_some() && key.as_ref() == running {
                        return;
                    }
                }
            }
            let job = self.pending.pop_front().expect("looked at above");
            match job {
                Job::Generate {
                    request,
                    events,
                    cancel,
                } => {
                    self.waiting.fetch_sub(1, Ordering::SeqCst);
                    if cancel.load(Ordering::Relaxed) {
                        settle(&self.queued);
                        continue;
                    }
                    let mut ticket = Ticket {
                        events,
                        cancel,
                        model_id: request.metrics_id(),
                        request_id: request.request_id.clone(),
                        keep_kv: true,
                        image_key: None,
                        queued: self.queued.clone(),
                        metrics: self.metrics.clone(),
                        closed: false,
                        panic_at: request.panic_at,
                    };
                    injected_panic(ticket.panic_at, Step::Admit);
                    match self.start(&request, None) {
                        Ok(Started::Prefill(key, prefill, constraint, image_key)) => {
                            ticket.image_key = image_key;
                            self.begin(key, ticket, prefill, constraint)
                        }
                        Ok(Started::Read(plan, rendered)) => {
                            let read = self.disk.as_mut().expect("planned").request(&plan);
                            self.loading.push(Loading {
                                read,
                                request: *request,
                                ticket,
                                admitted: std::time::Instant::now(),
                                rendered,
                            });
                        }
                        Err(error) => self.fail(ticket, error),
                    }
                }
                Job::Info { model, reply } => {
                    let _ = reply.send(self.resident(&model).map(|r| r.loaded.info.clone()));
                }
                Job::Unload { model, reply } => {
                    let _ = reply.send(self.unload(&model));
                }
            }
        }
    }

    /// Whether a request for `model` may start now as far as the batch goes: none runs, or it
    /// runs that model with room to spare.
    fn batch_takes(&self, model: &Path) -> bool {
        self.batch.as_ref().is_none_or(|batch| {
            model.canonicalize().ok().as_ref() == Some(&batch.key)
                && batch.rows.len() < self.max_batch
        })
    }

    /// A request's prefill begins: the client learns its prompt's size.
    fn begin(&mut self, key: PathBuf, ticket: Ticket, prefill: Prefill, constraint: Grammars) {
        let _ = ticket.events.send(Event::Started {
            prompt_tokens: prefill.prompt_tokens(),
            max_ctx: prefill.max_ctx(),
        });
        self.admitting = Some(Admission {
            key,
            ticket,
            prefill,
            constraint,
        });
    }

    /// A disk read finished: its request is ready to start (or, cancelled meanwhile, ends).
    fn take_read(&mut self, loaded: crate::disk_cache::store::Loaded) {
        let Some(at) = self.loading.iter().position(|l| l.read == loaded.id) else {
            return;
        };
        let loading = self.loading.swap_remove(at);
        if loading.ticket.cancel.load(Ordering::Relaxed) {
            let mut ticket = loading.ticket;
            ticket.settle();
            self.publish_in_flight();
            return;
        }
        self.ready.push_back((loading, loaded));
    }

    fn fail(&self, mut ticket: Ticket, error: EngineError) {
        self.metrics.record_error(error.kind());
        ticket.settle();
        self.publish_in_flight();
        ticket.send_last(Event::Error(error));
    }

    fn publish_in_flight(&self) {
        let rows = self.batch.as_ref().map_or(0, |batch| batch.rows.len());
        let kv: u64 = self
            .batch
            .iter()
            .flat_map(|batch| &batch.caches)
            .chain(self.admitting.iter().flat_map(|a| a.prefill.caches()))
            .map(|cache| cache.nbytes() as u64)
            .sum();
        self.metrics
            .set_in_flight(rows + self.admitting.is_some() as usize, kv);
    }

    /// One prefill chunk of the admitted request; a finished prompt joins the batch.
    fn prefill_step(&mut self) {
        let Some(mut admission) = self.admitting.take() else {
            return;
        };
        injected_panic(admission.ticket.panic_at, Step::Prefill);
        if admission.ticket.cancel.load(Ordering::Relaxed) {
            let (completion, _) = admission.prefill.cancelled();
            self.finish_request(&admission.key, admission.ticket, completion, None);
            return;
        }
        let Some(resident) = self.models.get(&admission.key) else {
            self.fail(admission.ticket, EngineError::EngineStopped);
            return;
        };
        let model = resident.loaded.model.as_ref();
        if !admission.prefill.is_done() {
            if let Err(error) = admission.prefill.step(model) {
                self.fail(admission.ticket, error);
                return;
            }
        }
        if !admission.prefill.is_done() {
            self.admitting = Some(admission);
            return;
        }
        // The rows of a batch share one context's worth of KV (what `fits` reserves); a prompt
        // that would take the padded batch past it waits, prefilled, until rows leave.
        if let Some(batch) = &self.batch {
            let columns = batch
                .columns()
                .max(admission.prefill.caches()[0].offset() as usize);
            if (batch.rows.len() + 1) * columns > batch.context {
                self.admitting = Some(admission);
                return;
            }
        }
        let Admission {
            key,
            ticket,
            prefill,
            constraint,
        } = admission;
        let (sequence, caches) = match prefill.into_sequence(model, &resident.tokenizer, constraint)
        {
            Ok(parts) => parts,
            Err(error) => return self.fail(ticket, error),
        };
        let row = Row { sequence, ticket };
        match self.batch.as_mut() {
            None => {
                self.batch = Some(Batch {
                    key,
                    context: row.sequence.context(),
                    caches,
                    rows: vec![row],
                })
            }
            Some(batch) => {
                self.joining = true;
                let joined = batch
                    .caches
                    .iter_mut()
                    .zip(&caches)
                    .try_for_each(|(running, new)| running.join(new));
                self.joining = false;
                match joined {
                    Ok(()) => batch.rows.push(row),
                    Err(error) => {
                        // The batch's caches may be half joined: every request in it fails.
                        let batch = self.batch.take().expect("matched above");
                        for row in batch.rows {
                            self.fail(row.ticket, error.for_each_request());
                        }
                        self.fail(row.ticket, error);
                    }
                }
            }
        }
    }

    /// One decode step of the batch, then the requests that ended leave it.
    fn decode_step(&mut self) {
        let Some(mut batch) = self.batch.take() else {
            return;
        };
        for row in &batch.rows {
            injected_panic(row.ticket.panic_at, Step::Decode);
        }
        let Some(resident) = self.models.get(&batch.key) else {
            for row in batch.rows {
                self.fail(row.ticket, EngineError::EngineStopped);
            }
            return;
        };
        let model = resident.loaded.model.as_ref();
        let tokenizer = &resident.tokenizer;
        if let Err(error) =
            generate::decode_iteration(model, tokenizer, &mut batch.caches, &mut batch.rows)
        {
            for row in batch.rows {
                self.fail(row.ticket, error.for_each_request());
            }
            return;
        }
        if !batch.rows.iter().any(|row| row.sequence.is_finished()) {
            self.batch = Some(batch);
            return;
        }
        let single = batch.rows.len() == 1;
        let mut keep = Vec::new();
        let mut ended = Vec::new();
        for (index, row) in std::mem::take(&mut batch.rows).into_iter().enumerate() {
            if row.sequence.is_finished() {
                ended.push((index, row));
            } else {
                keep.push(index);
                batch.rows.push(row);
            }
        }
        let mut finished = Vec::new();
        for (index, row) in ended {
            // Only a request whose KV can be reused takes its row out of the batch.
            let reusable = row.ticket.keep_kv && !row.ticket.cancel.load(Ordering::Relaxed);
            let caches = if !reusable {
                Ok(Vec::new())
            } else if single && !batch.caches.iter().any(KvCache::is_batched) {
                Ok(std::mem::take(&mut batch.caches))
            } else {
                // A batched cache's arrays are slices of bigger buffers (rows and padding
                // dropped): the prefix cache gets a copy of just this row, so its byte count
                // is what it holds.
                batch.caches.iter().map(|cache| cache.row(index)).collect()
            };
            let Row {
                sequence,
                mut ticket,
            } = row;
            match caches {
                Ok(caches) => {
                    let mut emit = |delta: generate::Delta| send_delta(&ticket.events, delta);
                    let (completion, cached) = sequence.finish(tokenizer, caches, &mut emit);
                    ticket.keep_kv &= reusable;
                    finished.push((ticket, completion, cached));
                }
                Err(error) => self.fail(ticket, error),
            }
        }
        let key = batch.key.clone();
        if keep.is_empty() {
            self.batch = None;
        } else {
            match batch
                .caches
                .iter_mut()
                .try_for_each(|cache| cache.retain_rows(&keep))
            {
                Ok(()) => self.batch = Some(batch),
                Err(error) => {
                    for row in batch.rows {
                        self.fail(row.ticket, error.for_each_request());
                    }
                }
            }
        }
        for (ticket, completion, cached) in finished {
            self.finish_request(&key, ticket, completion, Some(cached));
        }
    }

    /// Records a finished request, offers its KV (and snapshots) to the prefix cache, and
    /// tells the client.
    fn finish_request(
        &mut self,
        key: &Path,
        mut ticket: Ticket,
        completion: Completion,
        cached: Option<generate::CachedSequence>,
    ) {
        self.metrics
            .record_completion(&ticket.model_id, ticket.request_id.as_deref(), &completion);
        let reusable = completion.finish_reason != FinishReason::Cancelled && ticket.keep_kv;
        // For the disk, after the client has its answer (clones share the arrays).
        let mut for_disk = None;
        if let (true, Some(sequence)) = (reusable, cached) {
            let keyed = |tokens: Vec<u32>| image_keyed(tokens, ticket.image_key.as_deref());
            if self.disk.is_some() {
                for_disk = Some(self.disk_offer(key, &sequence, keyed(sequence.tokens.clone())));
            }
            self.prefix
                .retire_windowed_prefixes(key, &keyed(sequence.tokens.clone()));
            let mut evicted = 0;
            for snapshot in sequence.snapshots {
                evicted += self
                    .prefix
                    .insert(key, keyed(snapshot.tokens), snapshot.caches);
            }
            evicted += self
                .prefix
                .insert(key, keyed(sequence.tokens), sequence.caches);
            self.metrics
                .record_prefix_evictions(&ticket.model_id, evicted);
            self.prefix_ids
                .insert(key.to_path_buf(), ticket.model_id.clone());
        }
        self.publish_prefix_usage();
        ticket.settle();
        self.publish_in_flight();
        ticket.send_last(Event::Done(completion));
        if let Some(offer) = for_disk {
            self.offer_to_disk(key, offer);
        }
    }

    /// What of a finished sequence goes to the disk: its blocks, and tips where a later turn
    /// will want to start. The last message boundary (where the answer's opener begins: the
    /// turn's prompt less its generation prompt, which a client's re-rendered history always
    /// shares) for every model; the end too where only the full-length KV's tail is needed.
    /// Recurrent and windowed models have their state at the boundary only as a snapshot
    /// (taken during prefill), and a tip of theirs is large (a window or a recurrent state), so
    /// they keep one tip per turn.
    fn disk_offer(
        &self,
        key: &Path,
        sequence: &generate::CachedSequence,
        tokens: Vec<u32>,
    ) -> DiskOffer {
        let resident = &self.models[key];
        let model = resident.loaded.model.as_ref();
        let opener = resident.tokenizer.token_id(model.message_opener());
        let end = tokens.len();
        let boundary = opener.and_then(|opener| (1..end).rev().find(|&at| tokens[at] == opener));
        let kv_only = model.rewindable() && !model.windowed();
        let mut tips = Vec::new();
        if kv_only {
            tips.extend(boundary.map(|at| (at, sequence.caches.clone())));
            tips.push((end, sequence.caches.clone()));
        } else {
            let at = boundary.or(sequence.snapshots.last().map(|s| s.tokens.len()));
            tips.extend(
                sequence
                    .snapshots
                    .iter()
                    .find(|snapshot| Some(snapshot.tokens.len()) == at)
                    .map(|snapshot| (snapshot.tokens.len(), snapshot.caches.clone())),
            );
        }
        DiskOffer {
            tokens,
            caches: sequence.caches.clone(),
            tips,
        }
    }

    /// Queues what the disk does not hold yet of a finished sequence (encoded here, written by
    /// the disk cache's thread).
    fn offer_to_disk(&mut self, key: &Path, offer: DiskOffer) {
        let Some(fingerprint) = self.fingerprint(key) else {
            return;
        };
        let Some(disk) = self.disk.as_mut() else {
            return;
        };
        let tips: Vec<(usize, &[KvCache])> = offer
            .tips
            .iter()
            .map(|(at, caches)| (*at, &caches[..]))
            .collect();
        if let Err(error) = disk.offer(&fingerprint, &offer.tokens, &offer.caches, &tips) {
            eprintln!("rmlx: a prefix was not written to disk: {error}");
        }
    }

    fn unload(&mut self, dir: &Path) -> bool {
        let Ok(key) = dir.canonicalize() else {
            return false;
        };
        self.lru.retain(|resident| *resident != key);
        self.prefix.forget_model(&key);
        self.metrics.set_prefix_cache_usage(self.prefix.usage());
        let removed = self.models.remove(&key).is_some();
        self.metrics
            .set_model_prefix_bytes(self.prefix_ids.get(&key), 0);
        self.refresh_prefix_budgets();
        self.publish_resident();
        // The weights' buffers go back to the system, not to MLX's buffer cache, unless a
        // running batch may reuse them (unloading another model while one decodes).
        if removed && self.batch.is_none() && self.admitting.is_none() {
            crate::runtime::release_cached_memory();
        }
        removed
    }

    /// Sizes the prefix cache's budgets that were not set for the resident models.
    fn refresh_prefix_budgets(&mut self) {
        let footprints: Vec<ModelFootprint> =
            self.models.values().map(|model| model.footprint).collect();
        let memory = self.memory_budget.or_else(crate::runtime::total_memory);
        let auto = prefix_cache::auto_budgets(&footprints, memory);
        let budgets = prefix_cache::Budgets {
            kv: self.prefix_budgets.0.unwrap_or(auto.kv),
            snapshots: self.prefix_budgets.1.unwrap_or(auto.snapshots),
        };
        if budgets != self.prefix.budgets() {
            self.prefix.set_budgets(budgets);
            self.publish_prefix_usage();
        }
    }

    /// `/metrics/cache`'s prefix figures: the totals and each cached model's bytes.
    fn publish_prefix_usage(&self) {
        self.metrics.set_prefix_cache_usage(self.prefix.usage());
        for (path, id) in &self.prefix_ids {
            self.metrics
                .set_model_prefix_bytes(Some(id), self.prefix.model_bytes(path));
        }
    }

    /// Refuses, with the numbers, a model whose weights cannot fit next to what is resident;
    /// loading it anyway would swap the machine to a halt (unified memory on a Mac).
    fn check_fits(&self, dir: &Path) -> Result<()> {
        let Some(available) = self.memory_budget.or_else(crate::runtime::available_memory) else {
            return Ok(());
        };
        let needed = crate::runtime::memory_needed(dir).map_err(|error| EngineError::Io {
            path: dir.to_path_buf(),
            message: error.to_string(),
        })?;
        if needed > available {
            return Err(EngineError::ModelTooLarge {
                model: dir.to_path_buf(),
                needed,
                available,
            });
        }
        Ok(())
    }

    fn resident(&mut self, dir: &Path) -> Result<&Resident> {
        let key = dir.canonicalize().map_err(|error| EngineError::Io {
            path: dir.to_path_buf(),
            message: error.to_string(),
        })?;
        if !self.models.contains_key(&key) {
            // Make room first: two large models side by side may not fit in memory.
            while self.lru.len() >= self.max_loaded {
                let oldest = self.lru[0].clone();
                self.unload(&oldest);
            }
            self.check_fits(&key)?;
            let tokenizer = ChatTokenizer::from_dir(&key)?;
            let loaded = models::load_model(&key)?;
            let footprint = footprint(&key)?;
            self.models.insert(
                key.clone(),
                Resident {
                    loaded,
                    tokenizer,
                    footprint,
                    constraints: None,
                },
            );
            self.refresh_prefix_budgets();
        }
        if self.lru.last() != Some(&key) {
            self.lru.retain(|resident| *resident != key);
            self.lru.push(key.clone());
            self.publish_resident();
        }
        Ok(&self.models[&key])
    }

    /// Everything before the first prefill chunk: the model resident, the prompt rendered
    /// and checked against the context, the images encoded, the prefix cache consulted.
    /// Renders and checks a request and looks for its prefix: in RAM, else on disk (a read to
    /// wait for, unless `read` already holds what the disk had for it).
    fn start(
        &mut self,
        request: &Request,
        read: Option<(crate::disk_cache::store::Loaded, Vec<u32>)>,
    ) -> Result<Started> {
        let model_id = request.metrics_id();
        self.resident(&request.model)?;
        let key = self.lru.last().expect("just made resident").clone();
        let fingerprint = self.fingerprint(&key);
        // Before any compute: a bad schema is the request's error.
        let constraint = self
            .models
            .get_mut(&key)
            .expect("just made resident")
            .grammars(&request.params)?;
        let resident = &self.models[&key];
        let tokenizer = &resident.tokenizer;
        // Before rendering: a text-only template may not even accept image parts.
        if !request.images.is_empty() && resident.loaded.model.as_vision().is_none() {
            return Err(EngineError::InvalidRequest(format!(
                "this model ({}) has no vision: send text only",
                resident.loaded.info.model_type
            )));
        }
        let prefill = request.assistant_prefill.as_deref().unwrap_or("");
        // A request back from a disk read keeps its rendering (a long prompt's template and
        // tokenizer take a while).
        let (read, rendered) = match read {
            Some((loaded, rendered)) => (Some(loaded), Some(rendered)),
            None => (None, None),
        };
        let prompt_ids = match (rendered, &request.prompt) {
            (Some(rendered), _) => rendered,
            (None, Prompt::Chat { messages, options }) => {
                tokenizer
                    .encode_chat_prefilled(messages, options, prefill)?
                    .1
            }
            (None, Prompt::Text(text)) => tokenizer.encode_plain(&format!("{text}{prefill}"))?,
            (None, Prompt::Ids(ids)) => [ids.clone(), tokenizer.encode(prefill, false)?].concat(),
        };
        // With images the prompt is expanded below; a disk read needs it as rendered.
        let rendered = (!request.images.is_empty()).then(|| prompt_ids.clone());
        let model = resident.loaded.model.as_ref();
        let vocab = model.vocab_size() as u32;
        if let Some(bad) = prompt_ids.iter().find(|&&id| id >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        // The sampler would find it only at the first decode step, failing the whole batch.
        if let Some(&bad) = request
            .params
            .sampling
            .logit_bias
            .keys()
            .find(|&&id| id >= vocab)
        {
            return Err(EngineError::Sample(
                crate::sample::SampleError::TokenOutOfRange {
                    token: bad,
                    vocab: vocab as usize,
                    what: "logit_bias",
                },
            ));
        }
        let (prompt_ids, images) = if request.images.is_empty() {
            (prompt_ids, None)
        } else {
            let started = std::time::Instant::now();
            // Count the image tokens from the image sizes alone: a prompt over the context is
            // refused before any resize, vision tower or prefill work.
            let counted = crate::multimodal::place_images(
                &resident.loaded.info.path,
                &resident.loaded.info.model_type,
                tokenizer,
                prompt_ids.clone(),
                &request.images,
                request.image_soft_tokens,
                false,
            )?;
            generate::effective_context(model, &request.params, counted.ids.len())?;
            let prepared =
                prepare_images(&resident.loaded, tokenizer, prompt_ids, request, started)?;
            (prepared.0, Some(prepared.1))
        };
        generate::effective_context(model, &request.params, prompt_ids.len())?;
        // Image soft tokens are one id for every image: the cache keys them by their pixels.
        let image_key = images
            .as_ref()
            .map(|pending| image_key(&prompt_ids, &pending.spans, &request.images));
        let lookup_key = image_key.as_deref().unwrap_or(&prompt_ids);
        let blocks = images
            .as_ref()
            .map_or(&[][..], |pending| &pending.blocks[..]);
        let mut reuse = self
            .prefix
            .lookup(&key, lookup_key)
            .and_then(|reuse| outside_blocks(reuse, blocks));
        let in_ram = reuse.as_ref().map_or(0, |reuse| reuse.cached_tokens);
        let mut source = match reuse {
            Some(_) => PrefixSource::Ram,
            None => PrefixSource::None,
        };
        match (read, &self.disk, &fingerprint) {
            (Some(read), _, _) => {
                let fresh = model.new_cache(model.max_position_embeddings());
                let rebuilt = crate::disk_cache::restore::rebuild(fresh, &read.files, lookup_key);
                match rebuilt {
                    Ok((caches, tokens)) if tokens > in_ram => {
                        let from_disk = prefix_cache::Reuse {
                            caches,
                            cached_tokens: tokens,
                        };
                        if let Some(from_disk) = outside_blocks(from_disk, blocks) {
                            reuse = Some(from_disk);
                            source = PrefixSource::Disk;
                        }
                    }
                    Ok(_) => {}
                    Err(error) => eprintln!("rmlx: a disk-cache prefix was not used: {error}"),
                }
            }
            (None, Some(disk), Some(fingerprint)) => {
                let needs_tip = !model.rewindable() || model.windowed();
                if let Some(plan) = disk.plan(fingerprint, lookup_key, needs_tip) {
                    if plan.tokens > in_ram {
                        let rendered = rendered.unwrap_or_else(|| prompt_ids.clone());
                        return Ok(Started::Read(plan, rendered));
                    }
                }
            }
            _ => {}
        }
        self.metrics.record_prefix_lookup(&model_id, source);
        // Images wholly inside the reused prefix need no vision tower.
        let cached = reuse.as_ref().map_or(0, |reuse| reuse.cached_tokens);
        let images = match images {
            Some(pending) => {
                let first = pending
                    .blocks
                    .iter()
                    .take_while(|b| b.end <= cached)
                    .count();
                pending.encode(first)?
            }
            None => None,
        };
        let resident = &self.models[&key];
        let mut params = request.params.clone();
        params.kv_storage = self.kv_storage;
        let prefill = Prefill::new(
            resident.loaded.model.as_ref(),
            &resident.tokenizer,
            &prompt_ids,
            &params,
            reuse,
            images,
        )?;
        Ok(Started::Prefill(key, prefill, constraint, image_key))
    }

    /// The disk cache's key for a resident model (None without a disk cache, or when its folder
    /// cannot be read).
    fn fingerprint(&mut self, key: &Path) -> Option<String> {
        self.disk.as_ref()?;
        if let Some(fingerprint) = self.fingerprints.get(key) {
            return Some(fingerprint.clone());
        }
        let fingerprint = crate::disk_cache::fingerprint(key, self.kv_storage).ok()?;
        self.fingerprints
            .insert(key.to_path_buf(), fingerprint.clone());
        Some(fingerprint)
    }
}

/// The prompt as the prefix cache keys it: each image's soft tokens (`spans`, in image order)
/// replaced by ids no vocabulary uses (the top bit set), drawn from a digest of the image's
/// size and pixels and the token's place in it. Two prompts then share a key prefix exactly as
/// far as their text and their images agree.
fn image_key(
    prompt: &[u32],
    spans: &[std::ops::Range<usize>],
    images: &[image::RgbImage],
) -> Vec<u32> {
    use std::hash::{Hash, Hasher};
    let mut key = prompt.to_vec();
    for (span, image) in spans.iter().zip(images) {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (image.width(), image.height(), span.len()).hash(&mut hasher);
        image.as_raw().hash(&mut hasher);
        let digest = hasher.finish();
        let seed = (digest ^ (digest >> 32)) as u32;
        for (k, slot) in key[span.clone()].iter_mut().enumerate() {
            *slot = 0x8000_0000 | (seed.wrapping_add(k as u32) & 0x7fff_ffff);
        }
    }
    key
}

/// A reused prefix that ends inside an image block is cut back to the block's start: the block
/// is prefilled whole (its positions come from its opener, and its tokens may see each other).
fn outside_blocks(
    mut reuse: crate::prefix_cache::Reuse,
    blocks: &[std::ops::Range<usize>],
) -> Option<crate::prefix_cache::Reuse> {
    let cut = reuse.cached_tokens;
    let Some(block) = blocks
        .iter()
        .find(|block| block.start < cut && cut < block.end)
    else {
        return Some(reuse);
    };
    let start = block.start as i32;
    if start == 0
        || !reuse
            .caches
            .iter()
            .all(|cache| cache.can_truncate_to(start))
    {
        return None;
    }
    reuse
        .caches
        .iter_mut()
        .for_each(|cache| cache.truncate(start));
    reuse.cached_tokens = block.start;
    Some(reuse)
}

/// A finished request's tokens as the prefix cache keys them (see [`image_key`]).
fn image_keyed(mut tokens: Vec<u32>, key: Option<&[u32]>) -> Vec<u32> {
    if let Some(key) = key {
        let shared = key.len().min(tokens.len());
        tokens[..shared].copy_from_slice(&key[..shared]);
    }
    tokens
}

/// Images preprocessed and placed, waiting for the vision tower (which runs only after the
/// expanded prompt has been checked against the context).
struct PendingImages<'a> {
    model: &'a dyn crate::models::VisionLanguageModel,
    input: crate::models::ImageInput,
    spans: Vec<std::ops::Range<usize>>,
    blocks: Vec<std::ops::Range<usize>>,
    /// When image work began: the request's TTFT counts from here.
    started: std::time::Instant,
}

impl<'a> PendingImages<'a> {
    /// Runs the vision tower on images `first..` (those before are in the reused KV); None when
    /// every image is.
    fn encode(self, first: usize) -> Result<Option<crate::multimodal::ImagePrefill>> {
        if first >= self.blocks.len() {
            return Ok(None);
        }
        let input = match first {
            0 => self.input,
            _ => self.input.from_image(first),
        };
        Ok(Some(crate::multimodal::ImagePrefill {
            features: self.model.encode_images(&input)?,
            first_image: first,
            spans: self.spans,
            blocks: self.blocks,
            started: Some(self.started),
        }))
    }
}

/// Preprocesses the request's images for the model's family and expands their blocks in the
/// prompt (see [`crate::multimodal::place_images`]); the tower runs later.
fn prepare_images<'a>(
    loaded: &'a LoadedModel,
    tokenizer: &ChatTokenizer,
    prompt_ids: Vec<u32>,
    request: &Request,
    started: std::time::Instant,
) -> Result<(Vec<u32>, PendingImages<'a>)> {
    let model = loaded.model.as_vision().ok_or_else(|| {
        EngineError::InvalidRequest(format!(
            "this model ({}) has no vision: send text only",
            loaded.info.model_type
        ))
    })?;
    let placed = crate::multimodal::place_images(
        &loaded.info.path,
        &loaded.info.model_type,
        tokenizer,
        prompt_ids,
        &request.images,
        request.image_soft_tokens,
        true,
    )?;
    Ok((
        placed.ids,
        PendingImages {
            model,
            input: placed.input.expect("pixels were asked for"),
            spans: placed.spans,
            blocks: placed.blocks,
            started,
        },
    ))
}
