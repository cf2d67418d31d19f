//! The engine thread: it alone owns the models and every MLX array (they are not `Sync`).
//! Requests arrive over a bounded channel and run in arrival order (nobody starves); each gets
//! a stream of events and a cancel flag checked between steps. Dropping the handle cancels
//! (a disconnected client stops costing compute). Reference: mlx-lm `server.py`'s generation
//! thread; text-generation-inference's router (validate first, stream events).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        mpsc, Arc,
    },
    thread,
};

use crate::{
    chat::{ChatTokenizer, TemplateOptions},
    constrain::{Constraint, ConstraintFactory, ResponseFormat},
    error::{EngineError, Result},
    generate::{self, Completion, FinishReason, GenerateParams},
    metrics::{Metrics, MetricsSnapshot},
    models::{self, LoadedModel, ModelInfo},
    prefix_cache::PrefixCache,
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

/// The default snapshot budget: 2 GiB, about 30 snapshots of Qwen3.6-35B-A3B's 63 MB Gated
/// DeltaNet state (five 6-turn conversations), a few hundred for the small dense models.
pub const DEFAULT_PREFIX_SNAPSHOT_BYTES: u64 = 2 << 30;

/// How the engine thread is sized.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Requests that may wait; more are refused with `QueueFull`.
    pub max_queue: usize,
    /// Models kept resident; the least recently used is unloaded past this.
    pub max_loaded: usize,
    /// Bytes of KV the prefix cache keeps for reuse (0 turns it off).
    pub prefix_cache_bytes: u64,
    /// Bytes of recurrent-model snapshots (Qwen3.5: KV + Gated DeltaNet state at message
    /// boundaries) the prefix cache keeps, apart from the KV entries (0 turns them off).
    pub prefix_snapshot_bytes: u64,
    /// Memory a model may take; None = what the OS reports available when it loads.
    pub memory_budget: Option<u64>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            max_queue: 64,
            max_loaded: 1,
            prefix_cache_bytes: 1 << 30,
            prefix_snapshot_bytes: DEFAULT_PREFIX_SNAPSHOT_BYTES,
            memory_budget: None,
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
    jobs: Option<mpsc::SyncSender<Job>>,
    thread: Option<thread::JoinHandle<()>>,
    queued: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
    resident: Arc<std::sync::Mutex<Vec<ModelInfo>>>,
    max_queue: usize,
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
        let (jobs, inbox) = mpsc::sync_channel(max_queue);
        let queued = Arc::new(AtomicUsize::new(0));
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
                        options.prefix_cache_bytes,
                        options.prefix_snapshot_bytes,
                    ),
                    metrics: worker_metrics,
                    queued: worker_queued,
                    published: worker_resident,
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
                metrics,
                resident,
                max_queue,
            }),
        })
    }

    fn jobs(&self) -> &mpsc::SyncSender<Job> {
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
        self.inner.queued.fetch_add(1, Ordering::SeqCst);
        match self.jobs().try_send(job) {
            Ok(()) => Ok(RequestHandle {
                events: receiver,
                cancel,
            }),
            Err(error) => {
                self.inner.queued.fetch_sub(1, Ordering::SeqCst);
                let error = match error {
                    mpsc::TrySendError::Full(_) => EngineError::QueueFull(self.inner.max_queue),
                    mpsc::TrySendError::Disconnected(_) => EngineError::EngineStopped,
                };
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
    pub fn metrics(&self) -> MetricsSnapshot {
        let mut snapshot = self.inner.metrics.snapshot();
        snapshot.queue_depth = self.queue_depth().saturating_sub(snapshot.in_flight);
        snapshot
    }
}

struct Resident {
    loaded: LoadedModel,
    tokenizer: ChatTokenizer,
    /// Built on the first constrained request: most models never see one.
    constraints: Option<ConstraintFactory>,
}

impl Resident {
    /// The request's `response_format` constraint; None for plain text.
    fn constraint(&mut self, format: &ResponseFormat) -> Result<Option<Constraint>> {
        if format.is_text() {
            return Ok(None);
        }
        let factory = match &mut self.constraints {
            Some(factory) => factory,
            slot => slot.insert(ConstraintFactory::from_tokenizer(
                &self.tokenizer,
                self.loaded.model.vocab_size(),
                self.tokenizer.eos_token_ids(),
            )?),
        };
        Ok(factory.constraint(format)?)
    }
}

struct EngineThread {
    models: HashMap<PathBuf, Resident>,
    /// Resident model keys, least recently used first.
    lru: Vec<PathBuf>,
    max_loaded: usize,
    memory_budget: Option<u64>,
    prefix: PrefixCache,
    metrics: Arc<Metrics>,
    queued: Arc<AtomicUsize>,
    /// The resident models as `Engine::loaded` reports them, LRU order.
    published: Arc<std::sync::Mutex<Vec<ModelInfo>>>,
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
        for job in inbox {
            match job {
                Job::Generate {
                    request,
                    events,
                    cancel,
                } => {
                    let result = (!cancel.load(Ordering::Relaxed)).then(|| {
                        self.metrics.set_in_flight(1, 0);
                        let result = self.generate(&request, &events, &cancel);
                        if let Err(error) = &result {
                            self.metrics.record_error(error.kind());
                        }
                        self.metrics.set_in_flight(0, 0);
                        result
                    });
                    // Counters settle before the client hears the end, so it sees them idle.
                    if self.queued.fetch_sub(1, Ordering::SeqCst) == 1 {
                        crate::runtime::release_cached_memory();
                    }
                    if let Some(result) = result {
                        let _ = events.send(match result {
                            Ok(completion) => Event::Done(completion),
                            Err(error) => Event::Error(error),
                        });
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

    fn unload(&mut self, dir: &Path) -> bool {
        let Ok(key) = dir.canonicalize() else {
            return false;
        };
        self.lru.retain(|resident| *resident != key);
        self.prefix.forget_model(&key);
        self.metrics.set_prefix_cache_usage(self.prefix.usage());
        let removed = self.models.remove(&key).is_some();
        self.publish_resident();
        removed
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
            self.models.insert(
                key.clone(),
                Resident {
                    loaded,
                    tokenizer,
                    constraints: None,
                },
            );
        }
        if self.lru.last() != Some(&key) {
            self.lru.retain(|resident| *resident != key);
            self.lru.push(key.clone());
            self.publish_resident();
        }
        Ok(&self.models[&key])
    }

    fn generate(
        &mut self,
        request: &Request,
        events: &mpsc::Sender<Event>,
        cancel: &AtomicBool,
    ) -> Result<Completion> {
        let model_id = request.metrics_id();
        self.resident(&request.model)?;
        let key = self.lru.last().expect("just made resident").clone();
        // Before any compute: a bad schema is the request's error.
        let constraint = self
            .models
            .get_mut(&key)
            .expect("just made resident")
            .constraint(&request.params.response_format)?;
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
        let prompt_ids = match &request.prompt {
            Prompt::Chat { messages, options } => {
                tokenizer
                    .encode_chat_prefilled(messages, options, prefill)?
                    .1
            }
            Prompt::Text(text) => tokenizer.encode_plain(&format!("{text}{prefill}"))?,
            Prompt::Ids(ids) => [ids.clone(), tokenizer.encode(prefill, false)?].concat(),
        };
        let model = resident.loaded.model.as_ref();
        let vocab = model.vocab_size() as u32;
        if let Some(bad) = prompt_ids.iter().find(|&&id| id >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
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
        let max_ctx = generate::effective_context(model, &request.params, prompt_ids.len())?;
        // Image soft tokens are one id for every image: their KV is not reusable by ids.
        let reuse = match images {
            Some(_) => None,
            None => self.prefix.lookup(&key, &prompt_ids),
        };
        if images.is_none() {
            self.metrics
                .record_prefix_lookup(&model_id, reuse.is_some());
        }
        let has_images = images.is_some();
        let images = images.map(|pending| pending.encode()).transpose()?;
        let _ = events.send(Event::Started {
            prompt_tokens: prompt_ids.len(),
            max_ctx,
        });
        let metrics = &self.metrics;
        let (completion, sequence) = generate::generate_reusing(
            model,
            tokenizer,
            &prompt_ids,
            &request.params,
            reuse,
            constraint,
            images,
            cancel,
            |delta| {
                metrics.set_in_flight(1, delta.kv_bytes);
                let _ = events.send(Event::Delta {
                    token_id: delta.token_id,
                    text: delta.text,
                    logprob: delta.logprob,
                });
            },
        )?;
        self.metrics
            .record_completion(&model_id, request.request_id.as_deref(), &completion);
        if completion.finish_reason != FinishReason::Cancelled && !has_images {
            let mut evicted = 0;
            for snapshot in sequence.snapshots {
                evicted += self.prefix.insert(&key, snapshot.tokens, snapshot.caches);
            }
            evicted += self.prefix.insert(&key, sequence.tokens, sequence.caches);
            self.metrics.record_prefix_evictions(&model_id, evicted);
        }
        self.metrics.set_prefix_cache_usage(self.prefix.usage());
        Ok(completion)
    }
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
    fn encode(self) -> Result<crate::multimodal::ImagePrefill<'a>> {
        Ok(crate::multimodal::ImagePrefill {
            model: self.model,
            features: self.model.encode_images(&self.input)?,
            spans: self.spans,
            blocks: self.blocks,
            started: Some(self.started),
        })
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
