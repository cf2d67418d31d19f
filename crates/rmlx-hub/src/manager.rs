//! The download jobs a server holds: start, pause, resume, cancel, list, and a watch channel of
//! the job list for the UI's `downloads` event. Each running job is one tokio task driving
//! [`download`]; pausing or cancelling signals its [`Control`] and waits for the task to stop.
//! The job JSON and routes are those of docs/MODELS-API.md; the job shape follows the progress
//! huggingface_hub reports per file (`file_download.py`, `_download_to_tmp_and_move`).

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
};

use tokio::{runtime::Handle, sync::watch};

use crate::{
    api::HubClient,
    download::{download, remove_partials, Control, FileState, Job, JobState},
    error::{HubError, Result},
    paths::{check_revision, RepoId},
};

/// Jobs keyed by id, in the order they were started. Cheap to clone (shared state); put one in
/// the server's state and call it from async handlers.
#[derive(Clone)]
pub struct DownloadManager {
    inner: Arc<Inner>,
}

struct Inner {
    client: HubClient,
    models_dir: PathBuf,
    runtime: Option<Handle>,
    next_id: AtomicU64,
    jobs: Mutex<Vec<Entry>>,
    updates: watch::Sender<Vec<Job>>,
}

struct Entry {
    job: Job,
    control: Control,
    /// Which task run owns the job; reports from an older run (one that was paused and then
    /// resumed) are ignored.
    run: u64,
}

impl DownloadManager {
    /// Tasks are spawned on the runtime current when `start`/`resume` is called (any async
    /// handler); see [`DownloadManager::with_runtime`] to call them from outside one.
    pub fn new(client: HubClient, models_dir: impl Into<PathBuf>) -> Self {
        Self::build(client, models_dir.into(), None)
    }

    /// Spawns download tasks on `runtime` (for callers without a current runtime, e.g. a
    /// synchronous Tauri command).
    pub fn with_runtime(
        client: HubClient,
        models_dir: impl Into<PathBuf>,
        runtime: Handle,
    ) -> Self {
        Self::build(client, models_dir.into(), Some(runtime))
    }

    fn build(client: HubClient, models_dir: PathBuf, runtime: Option<Handle>) -> Self {
        Self {
            inner: Arc::new(Inner {
                client,
                models_dir,
                runtime,
                next_id: AtomicU64::new(1),
                jobs: Mutex::new(Vec::new()),
                updates: watch::Sender::new(Vec::new()),
            }),
        }
    }

    pub fn models_dir(&self) -> &Path {
        &self.inner.models_dir
    }

    pub fn client(&self) -> &HubClient {
        &self.inner.client
    }

    /// Starts downloading `repo` (`org/name`) at `revision` (default `main`) and returns the
    /// job (state `queued`). A repository already being downloaded is not downloaded twice into
    /// the same folder: its job is returned instead, resumed first if it was paused.
    pub fn start(&self, repo: &str, revision: Option<&str>) -> Result<Job> {
        let repo = RepoId::parse(repo)?;
        let revision = revision.unwrap_or("main");
        check_revision(revision)?;
        let existing = {
            let jobs = self.inner.jobs.lock().unwrap();
            jobs.iter()
                .find(|entry| {
                    entry.job.repo == repo.to_string()
                        && (entry.job.state.is_active() || entry.job.state == JobState::Paused)
                })
                .map(|entry| entry.job.clone())
        };
        if let Some(job) = existing {
            return match job.state {
                JobState::Paused => self.resume(&job.id),
                _ => Ok(job),
            };
        }
        let id = format!("dl-{}", self.inner.next_id.fetch_add(1, Ordering::Relaxed));
        let job = Job::new(id, &repo, revision);
        self.inner.jobs.lock().unwrap().push(Entry {
            job: job.clone(),
            control: Control::new(),
            run: 0,
        });
        self.spawn(&job.id)?;
        Ok(self.get(&job.id).unwrap_or(job))
    }

    /// Stops a queued/running job, keeping its `.partial` files; returns it once it has stopped
    /// (state `paused`, or `done`/`failed` if it finished first).
    pub async fn pause(&self, id: &str) -> Result<Job> {
        let control = self.with_entry(id, |entry| {
            if !entry.job.state.is_active() {
                return Err(invalid(entry, "pause"));
            }
            Ok(entry.control.clone())
        })?;
        control.pause();
        self.wait(id).await
    }

    /// Continues a paused or failed job from its `.partial` files.
    pub fn resume(&self, id: &str) -> Result<Job> {
        self.with_entry(id, |entry| match entry.job.state {
            JobState::Paused | JobState::Failed => Ok(()),
            _ => Err(invalid(entry, "resume")),
        })?;
        let repo = self.with_entry(id, |entry| Ok(entry.job.repo.clone()))?;
        if let Some(other) = self
            .list()
            .into_iter()
            .find(|job| job.id != id && job.repo == repo && job.state.is_active())
        {
            return Err(HubError::AlreadyDownloading { repo, id: other.id });
        }
        self.spawn(id)?;
        self.get(id)
            .ok_or_else(|| HubError::JobNotFound(id.to_string()))
    }

    /// Stops a job and removes its `.partial` files (files already complete stay); returns it
    /// once stopped (state `cancelled`). Cancelling a cancelled job is a no-op.
    pub async fn cancel(&self, id: &str) -> Result<Job> {
        let (state, control) = self.with_entry(id, |entry| match entry.job.state {
            JobState::Done => Err(invalid(entry, "cancel")),
            state => Ok((state, entry.control.clone())),
        })?;
        if state.is_active() {
            // The task removes the partials itself once its files are closed.
            control.cancel();
            let job = self.wait(id).await?;
            if job.state != JobState::Paused && job.state != JobState::Failed {
                return Ok(job);
            }
            // It paused or failed just before the signal arrived: clean up here instead.
        }
        let repo = self.with_entry(id, |entry| {
            RepoId::parse(&entry.job.repo).map_err(|_| invalid(entry, "cancel"))
        })?;
        let models_dir = self.inner.models_dir.clone();
        let cleanup = tokio::task::spawn_blocking(move || remove_partials(&models_dir, &repo));
        cleanup.await.expect("cleanup does not panic")?;
        self.update_entry(id, |entry| {
            entry.run += 1; // a late report from the stopped task cannot revive it
            let job = &mut entry.job;
            job.state = JobState::Cancelled;
            job.error = None;
            for file in &mut job.files {
                if file.state != FileState::Done {
                    file.state = FileState::Pending;
                    file.bytes_done = 0;
                }
            }
            job.bytes_done = job.files.iter().map(|file| file.bytes_done).sum();
        })
    }

    pub fn get(&self, id: &str) -> Option<Job> {
        let jobs = self.inner.jobs.lock().unwrap();
        jobs.iter()
            .find(|entry| entry.job.id == id)
            .map(|entry| entry.job.clone())
    }

    /// Every job, oldest first (`GET /admin/downloads`).
    pub fn list(&self) -> Vec<Job> {
        let jobs = self.inner.jobs.lock().unwrap();
        jobs.iter().map(|entry| entry.job.clone()).collect()
    }

    /// Drops a job that is not running from the list (the UI's "clear"); files are untouched.
    pub fn forget(&self, id: &str) -> Result<Job> {
        let mut jobs = self.inner.jobs.lock().unwrap();
        let index = jobs
            .iter()
            .position(|entry| entry.job.id == id)
            .ok_or_else(|| HubError::JobNotFound(id.to_string()))?;
        if jobs[index].job.state.is_active() {
            return Err(invalid(&jobs[index], "forget"));
        }
        let entry = jobs.remove(index);
        self.inner.publish(&jobs);
        Ok(entry.job)
    }

    /// The job list after every change (byte counts at most every 100 ms per job). A watch
    /// channel keeps only the newest list, so a slow reader skips versions instead of lagging;
    /// the app throttles its `downloads` event further.
    pub fn subscribe(&self) -> watch::Receiver<Vec<Job>> {
        self.inner.updates.subscribe()
    }

    /// Waits until the job is no longer queued/listing/running/verifying and returns it.
    pub async fn wait(&self, id: &str) -> Result<Job> {
        let mut updates = self.subscribe();
        loop {
            let job = self
                .get(id)
                .ok_or_else(|| HubError::JobNotFound(id.to_string()))?;
            if !job.state.is_active() {
                return Ok(job);
            }
            // The sender lives in `self.inner`, so `changed` cannot fail while we hold `self`.
            let _ = updates.changed().await;
        }
    }

    fn with_entry<T>(&self, id: &str, f: impl FnOnce(&Entry) -> Result<T>) -> Result<T> {
        let jobs = self.inner.jobs.lock().unwrap();
        let entry = jobs
            .iter()
            .find(|entry| entry.job.id == id)
            .ok_or_else(|| HubError::JobNotFound(id.to_string()))?;
        f(entry)
    }

    fn update_entry(&self, id: &str, f: impl FnOnce(&mut Entry)) -> Result<Job> {
        let mut jobs = self.inner.jobs.lock().unwrap();
        let entry = jobs
            .iter_mut()
            .find(|entry| entry.job.id == id)
            .ok_or_else(|| HubError::JobNotFound(id.to_string()))?;
        f(entry);
        let job = entry.job.clone();
        self.inner.publish(&jobs);
        Ok(job)
    }

    /// Queues the job and starts a task for it, with a fresh control and run number.
    fn spawn(&self, id: &str) -> Result<()> {
        let runtime = match &self.inner.runtime {
            Some(runtime) => runtime.clone(),
            None => Handle::try_current().map_err(|_| HubError::NoRuntime)?,
        };
        let control = Control::new();
        let mut run = 0;
        let job = self.update_entry(id, |entry| {
            entry.run += 1;
            run = entry.run;
            entry.control = control.clone();
            entry.job.state = JobState::Queued;
            entry.job.error = None;
        })?;
        let inner = self.inner.clone();
        runtime.spawn(async move {
            let mut job = job;
            let models_dir = inner.models_dir.clone();
            let report = |job: &Job| inner.report(run, job);
            // The outcome is in the job (state, error); the final report carries it.
            let _ = download(&inner.client, &models_dir, &mut job, &control, report).await;
        });
        Ok(())
    }
}

impl Inner {
    fn report(&self, run: u64, job: &Job) {
        let mut jobs = self.jobs.lock().unwrap();
        if let Some(entry) = jobs
            .iter_mut()
            .find(|entry| entry.job.id == job.id && entry.run == run)
        {
            entry.job.clone_from(job);
            self.publish(&jobs);
        }
    }

    fn publish(&self, jobs: &[Entry]) {
        self.updates
            .send_replace(jobs.iter().map(|entry| entry.job.clone()).collect());
    }
}

fn invalid(entry: &Entry, action: &'static str) -> HubError {
    HubError::InvalidState {
        id: entry.job.id.clone(),
        action,
        state: entry.job.state.as_str(),
    }
}
