//! The engine thread's state and loop, and the resident models.

use std::{
    collections::{HashMap, VecDeque},
    path::{Path, PathBuf},
    sync::{atomic::AtomicUsize, mpsc, Arc},
};

use crate::{
    cache::KvStorage,
    chat::ChatTokenizer,
    constrain::{ConstraintFactory, Grammars},
    disk_cache::DiskCache,
    error::{EngineError, Result},
    generate::GenerateParams,
    metrics::Metrics,
    models::{self, LoadedModel, ModelInfo},
    prefix_cache::{self, ModelFootprint, PrefixCache},
};

use super::{
    admission::{Admission, Loading},
    batch::Batch,
    Job,
};

pub(super) struct Resident {
    pub(super) loaded: LoadedModel,
    pub(super) tokenizer: ChatTokenizer,
    /// What it needs in memory (sizes the prefix cache's default budgets).
    footprint: ModelFootprint,
    /// Built on the first constrained request: most models never see one.
    constraints: Option<ConstraintFactory>,
    /// What decode steps cost on this model, shared by its requests' depth control.
    pub(super) step_costs: crate::speculative::depth::SharedCosts,
}

impl Resident {
    /// The request's `response_format` constraint and freeform tools' grammars.
    pub(super) fn grammars(&mut self, params: &GenerateParams) -> Result<Grammars> {
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

/// A model's weights and recurrent state, from its folder, and the KV per token it holds as
/// loaded (`kv_per_token`: its draft head's included, dense) stored as `storage` keeps it.
fn footprint(
    dir: &Path,
    kv_per_token: u64,
    storage: KvStorage,
    part: &models::Part,
) -> Result<ModelFootprint> {
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
    // `--kv-bits` shrinks every cached layer alike (draft heads and draft models too): scaled
    // by the trunk's stored-to-dense ratio.
    let kv_per_token = match storage {
        KvStorage::Dense => kv_per_token,
        KvStorage::Quantized { bits, .. } => {
            let dense = models::structure::kv_bytes_per_token(&config).max(1);
            let stored = models::structure::kv_bytes_per_token_stored(&config, Some(bits));
            (kv_per_token as u128 * stored as u128 / dense as u128) as u64
        }
    };
    Ok(ModelFootprint {
        weights: crate::runtime::memory_needed_for(dir, part).map_err(io)?,
        kv_per_token,
        // Sliding windows count with the recurrent state: past the window the prefix cache
        // keeps them as snapshots.
        recurrent_state: models::structure::fixed_state_bytes(&config),
    })
}

/// The KV a set of rows can come to hold, as a batch pads it: every row to the longest, grown
/// until the longest answer still to come ends.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Reach {
    pub(super) rows: usize,
    /// Positions the longest row holds now.
    pub(super) columns: usize,
    /// Tokens the longest answer may still add.
    pub(super) growth: usize,
}

impl Reach {
    pub(super) fn row(columns: usize, growth: usize) -> Self {
        Self {
            rows: 1,
            columns,
            growth,
        }
    }

    /// A prompt's whole length and the answer it may take.
    pub(super) fn of(prefill: &crate::generate::Prefill) -> Self {
        Self::row(prefill.prompt_tokens(), prefill.max_new())
    }

    pub(super) fn with(self, other: Reach) -> Self {
        Self {
            rows: self.rows + other.rows,
            columns: self.columns.max(other.columns),
            growth: self.growth.max(other.growth),
        }
    }

    fn reach(&self) -> usize {
        self.rows * (self.columns + self.growth)
    }

    /// The positions its rows hold now.
    fn now(&self) -> usize {
        self.rows * self.columns
    }

    /// The rule before memory counted (what `fits` in `/v1/models` reserves): the rows as they
    /// are now share one context's worth of KV.
    fn within_context(&self, context: usize) -> bool {
        self.now() <= context
    }
}

pub(super) struct EngineThread {
    pub(super) models: HashMap<PathBuf, Resident>,
    /// Resident model keys, least recently used first.
    pub(super) lru: Vec<PathBuf>,
    pub(super) max_loaded: usize,
    pub(super) memory_budget: Option<u64>,
    /// `memory_budget`, else the memory MLX computes in (`runtime::working_memory`), as of the
    /// last load or unload: what the prefix cache and the rows' KV are sized from.
    pub(super) kv_memory: Option<u64>,
    pub(super) prefix: PrefixCache,
    /// The budgets asked for (None: sized from memory and the resident models).
    pub(super) prefix_budgets: (Option<u64>, Option<u64>),
    /// How new requests' caches store keys and values (`EngineOptions::kv_bits`).
    pub(super) kv_storage: KvStorage,
    /// Speculative decoding for requests that do not choose (`EngineOptions::speculative`).
    pub(super) speculative: crate::speculative::SpeculativeMode,
    /// Paired with every model loaded (`EngineOptions::draft_model`).
    pub(super) draft_model: Option<PathBuf>,
    /// This process's part of every model it loads (`EngineOptions::part`).
    pub(super) part: models::Part,
    /// The disk cache and each model's fingerprint (`EngineOptions::prefix_disk_dir`).
    pub(super) disk: Option<DiskCache>,
    pub(super) fingerprints: HashMap<PathBuf, String>,
    /// The model id metrics know each cached model by.
    pub(super) prefix_ids: HashMap<PathBuf, String>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) queued: Arc<AtomicUsize>,
    pub(super) waiting: Arc<AtomicUsize>,
    /// The resident models as `Engine::loaded` reports them, LRU order.
    pub(super) published: Arc<std::sync::Mutex<Vec<ModelInfo>>>,
    pub(super) max_batch: usize,
    /// Jobs taken from the channel and not yet handled, in arrival order.
    pub(super) pending: VecDeque<Job>,
    /// Requests whose prefix the disk cache's reader is reading; others decode meanwhile.
    pub(super) loading: Vec<Loading>,
    /// Requests whose prefix has been read, to start before any pending job.
    pub(super) ready: VecDeque<(Loading, crate::disk_cache::store::Loaded)>,
    /// Requests whose prompts are being prefilled (a piece per turn of the loop) or wait,
    /// prefilled, for room in the batch; in arrival order.
    pub(super) admitting: Vec<Admission>,
    /// Prompts prefilling together, their caches joined (see `group.rs`).
    pub(super) group: Option<super::group::Group>,
    /// The requests decoding together.
    pub(super) batch: Option<Batch>,
    /// Set while a prefilled request's caches join the batch's: a panic then leaves the batch
    /// half joined (see `guarded`).
    pub(super) joining: bool,
    /// Set while the group's caches are joined or stepped, likewise.
    pub(super) grouping: bool,
    /// Warm-ups running (`warm_up.rs`): their requests go ahead of others, which wait until
    /// every warm-up has ended, so a first request meets a model whose kernels are built and
    /// a batch it has to itself.
    pub(super) warming: Arc<AtomicUsize>,
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

    pub(super) fn run(mut self, inbox: mpsc::Receiver<Job>) {
        let mut open = true;
        loop {
            // Block only with nothing to do; otherwise take what has arrived and go on.
            let idle = self.batch.is_none()
                && self.admitting.is_empty()
                && self.group.is_none()
                && (self.pending.is_empty() || self.held())
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
                    Ok(job) => self.queue(job),
                    Err(_) => break,
                }
            }
            loop {
                match inbox.try_recv() {
                    Ok(job) => self.queue(job),
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

    /// A job joins the queue: a warm-up's request ahead of every job not the warm-up's.
    fn queue(&mut self, job: Job) {
        let warming = self.warming.load(std::sync::atomic::Ordering::SeqCst) > 0;
        match job {
            Job::Wake => {}
            job if job.is_warm_up() => self.insert_before(job, |queued| !queued.is_warm_up()),
            // During a warm-up, a load or an unload goes ahead of the requests it holds: the
            // warm-up's own load must not wait behind a request that waits for the warm-up.
            job if warming && !matches!(job, Job::Generate { .. }) => self
                .insert_before(job, |queued| {
                    matches!(queued, Job::Generate { .. }) && !queued.is_warm_up()
                }),
            job => self.pending.push_back(job),
        }
    }

    /// Puts `job` before the first queued job that `later` picks (at the end if none).
    fn insert_before(&mut self, job: Job, later: impl Fn(&Job) -> bool) {
        let at = self
            .pending
            .iter()
            .position(later)
            .unwrap_or(self.pending.len());
        self.pending.insert(at, job);
    }

    /// Whether the queue's first job waits for a warm-up to end.
    pub(super) fn held(&self) -> bool {
        self.warming.load(std::sync::atomic::Ordering::SeqCst) > 0
            && self
                .pending
                .front()
                .is_some_and(|job| matches!(job, Job::Generate { .. }) && !job.is_warm_up())
    }

    /// Runs one step of the loop; a panic in it (a bug) costs only the requests that step held:
    /// their tickets unwind and tell their clients (see `Ticket`'s `Drop`), and the thread goes
    /// on serving. Without this, one bad request would leave every later one unanswered.
    fn guarded(&mut self, step: fn(&mut Self)) {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(self)));
        if outcome.is_err() {
            // A batch left half joined is in no known state: its requests fail too; so do
            // the members of a group whose step or join broke off.
            if std::mem::take(&mut self.joining) {
                drop(self.batch.take());
            }
            if std::mem::take(&mut self.grouping) {
                drop(self.group.take());
            }
            self.publish_in_flight();
        }
    }

    pub(super) fn publish_in_flight(&self) {
        let rows = self.batch.as_ref().map_or(0, |batch| batch.rows.len());
        let kv: u64 = self
            .batch
            .iter()
            .flat_map(|batch| &batch.caches)
            .chain(self.admitting.iter().flat_map(|a| a.prefill.caches()))
            .chain(self.group.iter().flat_map(|group| &group.caches))
            .map(|cache| cache.nbytes() as u64)
            .sum();
        let prefilling = self.admitting.len() + self.group.as_ref().map_or(0, |g| g.members.len());
        self.metrics.set_in_flight(rows + prefilling, kv);
    }

    pub(super) fn unload(&mut self, dir: &Path) -> bool {
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
        if removed && self.batch.is_none() && self.admitting.is_empty() && self.group.is_none() {
            crate::runtime::release_cached_memory();
        }
        removed
    }

    /// KV positions the rows of the model at `key` may reach together beyond the one-context
    /// rule (`Reach::within_context`), so that agents' long prompts (25k tokens against Qwen3's
    /// 40,960) decode side by side instead of one after the other: half of what the weights,
    /// the prefix cache and every row's fixed state leave of `kv_memory`; the rest is for
    /// activations, the OS and other apps. None where memory is unknown.
    pub(super) fn kv_room(&self, key: &Path) -> Option<usize> {
        let memory = self.kv_memory?;
        let resident = self.models.get(key)?;
        let per_token = resident.footprint.kv_per_token.max(1);
        let weights: u64 = self.models.values().map(|m| m.footprint.weights).sum();
        let prefix = self.prefix.budgets();
        let states = self.max_batch as u64 * resident.footprint.recurrent_state;
        let room = memory.saturating_sub(weights + prefix.kv + prefix.snapshots + states) / 2;
        Some((room / per_token) as usize)
    }

    /// Whether a prompt may enter the rows `entering` (the batch's or the prefill group's, the
    /// entrant counted) beside the others' `beside`: `entering` within one context as before,
    /// or both within the memory for KV at the most they can reach.
    pub(super) fn kv_admits(
        &self,
        key: &Path,
        context: usize,
        entering: Reach,
        beside: Reach,
    ) -> bool {
        entering.within_context(context)
            || entering.reach() + beside.reach() <= self.kv_room(key).unwrap_or(0)
    }

    /// Whether one more request may start beside what the batch, the prefill group and the
    /// prompts prefilling or waiting to join hold: one context's worth of KV or less as they
    /// are now, or less than the memory for KV (`kv_room`) at the most they can reach (the
    /// newcomer may go past it by one prompt's reach, as one context could). Prompts waiting
    /// prefilled hold their KV: without this, `max_batch` long prompts would all prefill and
    /// wait. Waiting prompts count as they hold (their own tokens, unpadded).
    pub(super) fn kv_takes_another(&self, key: &Path) -> bool {
        let Some(room) = self.kv_room(key) else {
            // Memory unknown: `max_batch` alone bounds it, as before memory counted.
            return true;
        };
        let batch = self.batch.as_ref().map(|batch| batch.reach());
        let group = self.group.as_ref().map(|group| group.reach());
        let (batch, group) = (batch.unwrap_or_default(), group.unwrap_or_default());
        let waiting = self.admitting.iter().map(|a| Reach::of(&a.prefill));
        let (mut now, mut reach) = (batch.now() + group.now(), batch.reach() + group.reach());
        for prompt in waiting {
            now += prompt.now();
            reach += prompt.reach();
        }
        let members = self.group.iter().flat_map(|group| &group.members);
        let context = self
            .admitting
            .iter()
            .chain(members)
            .map(|admission| admission.prefill.max_ctx())
            .chain(self.batch.as_ref().map(|batch| batch.context))
            .min()
            .unwrap_or(usize::MAX);
        now <= context || reach < room
    }

    /// Sizes the prefix cache's budgets that were not set for the resident models.
    fn refresh_prefix_budgets(&mut self) {
        let footprints: Vec<ModelFootprint> =
            self.models.values().map(|model| model.footprint).collect();
        // Read once per load or unload: on CUDA it asks the driver.
        self.kv_memory = self.memory_budget.or_else(crate::runtime::working_memory);
        let auto = prefix_cache::auto_budgets(&footprints, self.kv_memory);
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
    pub(super) fn publish_prefix_usage(&self) {
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
        let needed_at = |dir: &Path| {
            crate::runtime::memory_needed(dir).map_err(|error| EngineError::Io {
                path: dir.to_path_buf(),
                message: error.to_string(),
            })
        };
        // A draft model is loaded beside the model: both must fit.
        let draft = match &self.draft_model {
            Some(draft) => needed_at(draft)?,
            None => 0,
        };
        let own = crate::runtime::memory_needed_for(dir, &self.part).map_err(|error| {
            EngineError::Io {
                path: dir.to_path_buf(),
                message: error.to_string(),
            }
        })?;
        let needed = own + draft;
        if needed > available {
            return Err(EngineError::ModelTooLarge {
                model: dir.to_path_buf(),
                needed,
                available,
            });
        }
        Ok(())
    }

    pub(super) fn resident(&mut self, dir: &Path) -> Result<&Resident> {
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
            // The draft head costs memory and prefill: loaded only when speculation is on.
            let options = models::LoadOptions {
                // The head reads the trunk's last hidden states, which across ranks stay on
                // the last rank: a pipeline drafts by prompt lookup only.
                draft_head: self.speculative != crate::speculative::SpeculativeMode::Off
                    && self.part.stage().is_none(),
                part: self.part.clone(),
            };
            let mut loaded = models::load_model_with(&key, options)?;
            if let Some(draft) = &self.draft_model {
                loaded = models::draft_model::attach(loaded, draft)?;
            }
            let mut footprint = footprint(
                &key,
                loaded.info.kv_bytes_per_token,
                self.kv_storage,
                &self.part,
            )?;
            if let Some(draft) = &self.draft_model {
                footprint.weights +=
                    crate::runtime::memory_needed(draft).map_err(|error| EngineError::Io {
                        path: draft.clone(),
                        message: error.to_string(),
                    })?;
            }
            self.models.insert(
                key.clone(),
                Resident {
                    loaded,
                    tokenizer,
                    footprint,
                    constraints: None,
                    step_costs: Default::default(),
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
}
