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
    error::{EngineError, Result},
    generate::{self, Completion, GenerateParams},
    models::{self, LoadedModel, ModelInfo},
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
    pub prompt: Prompt,
    pub params: GenerateParams,
}

impl Default for Request {
    fn default() -> Self {
        Self {
            model: PathBuf::new(),
            prompt: Prompt::Ids(Vec::new()),
            params: GenerateParams::default(),
        }
    }
}

#[derive(Debug)]
pub enum Event {
    /// The prompt was tokenized and fits: generation is starting.
    Started {
        prompt_tokens: usize,
        max_ctx: usize,
    },
    /// Newly completed text for one token.
    Delta {
        token_id: u32,
        text: String,
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
        mlx_sys::load().map_err(|error| EngineError::Mlx(error.to_string()))?;
        let (jobs, inbox) = mpsc::sync_channel(max_queue.max(1));
        let queued = Arc::new(AtomicUsize::new(0));
        let worker_queued = queued.clone();
        let thread = thread::Builder::new()
            .name("rmlx-engine".into())
            .spawn(move || EngineThread::default().run(inbox, worker_queued))
            .map_err(|error| {
                EngineError::Mlx(format!("cannot start the engine thread: {error}"))
            })?;
        Ok(Self {
            inner: Arc::new(Inner {
                jobs: Some(jobs),
                thread: Some(thread),
                queued,
                max_queue: max_queue.max(1),
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
                Err(match error {
                    mpsc::TrySendError::Full(_) => EngineError::QueueFull(self.inner.max_queue),
                    mpsc::TrySendError::Disconnected(_) => EngineError::EngineStopped,
                })
            }
        }
    }

    /// Loads the model (if needed) and describes it.
    pub fn model_info(&self, model: &Path) -> Result<ModelInfo> {
        let (reply, receiver) = mpsc::channel();
        self.jobs()
            .send(Job::Info {
                model: model.to_path_buf(),
                reply,
            })
            .map_err(|_| EngineError::EngineStopped)?;
        receiver.recv().map_err(|_| EngineError::EngineStopped)?
    }

    /// Requests waiting or running.
    pub fn queue_depth(&self) -> usize {
        self.inner.queued.load(Ordering::SeqCst)
    }
}

struct Resident {
    loaded: LoadedModel,
    tokenizer: ChatTokenizer,
}

#[derive(Default)]
struct EngineThread {
    models: HashMap<PathBuf, Resident>,
}

impl EngineThread {
    fn run(mut self, inbox: mpsc::Receiver<Job>, queued: Arc<AtomicUsize>) {
        for job in inbox {
            match job {
                Job::Generate {
                    request,
                    events,
                    cancel,
                } => {
                    if !cancel.load(Ordering::Relaxed) {
                        let result = self.generate(&request, &events, &cancel);
                        let _ = events.send(match result {
                            Ok(completion) => Event::Done(completion),
                            Err(error) => Event::Error(error),
                        });
                    }
                    queued.fetch_sub(1, Ordering::SeqCst);
                }
                Job::Info { model, reply } => {
                    let _ = reply.send(self.resident(&model).map(|r| r.loaded.info.clone()));
                }
            }
        }
    }

    fn resident(&mut self, dir: &Path) -> Result<&Resident> {
        let key = dir.canonicalize().map_err(|error| EngineError::Io {
            path: dir.to_path_buf(),
            message: error.to_string(),
        })?;
        if !self.models.contains_key(&key) {
            let tokenizer = ChatTokenizer::from_dir(&key)?;
            let loaded = models::load_model(&key)?;
            // One resident model for now; the server adds an LRU of several.
            self.models.clear();
            self.models
                .insert(key.clone(), Resident { loaded, tokenizer });
        }
        Ok(&self.models[&key])
    }

    fn generate(
        &mut self,
        request: &Request,
        events: &mpsc::Sender<Event>,
        cancel: &AtomicBool,
    ) -> Result<Completion> {
        let resident = self.resident(&request.model)?;
        let tokenizer = &resident.tokenizer;
        let prompt_ids = match &request.prompt {
            Prompt::Chat { messages, options } => tokenizer.encode_chat(messages, options)?.1,
            Prompt::Text(text) => tokenizer.encode_plain(text)?,
            Prompt::Ids(ids) => ids.clone(),
        };
        let model = resident.loaded.model.as_ref();
        let vocab = model.vocab_size() as u32;
        if let Some(bad) = prompt_ids.iter().find(|&&id| id >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        let max_ctx = generate::effective_context(model, &request.params, prompt_ids.len())?;
        let _ = events.send(Event::Started {
            prompt_tokens: prompt_ids.len(),
            max_ctx,
        });
        generate::generate(
            model,
            tokenizer,
            &prompt_ids,
            &request.params,
            cancel,
            |delta| {
                let _ = events.send(Event::Delta {
                    token_id: delta.token_id,
                    text: delta.text,
                });
            },
        )
    }
}
