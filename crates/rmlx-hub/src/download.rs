//! One repository download: list the revision's files, fetch each into `{file}.partial`
//! (resuming with `Range`), verify size and hash while streaming, and rename into place. The
//! state lives in a [`Job`] (the job JSON of docs/MODELS-API.md) that is reported after every
//! change, so the CLI draws a progress bar from it and the server keeps it in its job list.
//! Reference: huggingface_hub `file_download.py` (`http_get` resumes `.incomplete` files with
//! `Range: bytes={resume_size}-`; `hf_hub_download` verifies and moves them into place).

use std::{
    io::Read,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use reqwest::{header, StatusCode};
use serde::{Deserialize, Serialize};
use sha1::Digest as _;
use tokio::{io::AsyncWriteExt, sync::watch};

use crate::{
    api::{check_status, Expected, HubClient, RemoteFile},
    error::{describe, HubError, Result},
    paths::{check_file_name, check_revision, create_dir_inside, RepoId, PARTIAL_SUFFIX},
};

/// Byte-count-only progress is reported at most this often (state changes always are): enough
/// for a progress bar and the UI's ~4 updates a second, without a callback per network chunk.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Queued,
    Listing,
    Running,
    Paused,
    Verifying,
    Done,
    Failed,
    Cancelled,
}

impl JobState {
    /// A task is (or is about to be) working on it.
    pub fn is_active(self) -> bool {
        matches!(
            self,
            Self::Queued | Self::Listing | Self::Running | Self::Verifying
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Listing => "listing",
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Verifying => "verifying",
            Self::Done => "done",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum FileState {
    Pending,
    Running,
    Done,
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FileProgress {
    pub name: String,
    pub size: u64,
    pub bytes_done: u64,
    pub state: FileState,
}

/// A download as docs/MODELS-API.md shows it: `{id, repo, revision, state, bytes_done,
/// bytes_total, files, error, model_id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Job {
    pub id: String,
    pub repo: String,
    pub revision: String,
    pub state: JobState,
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub files: Vec<FileProgress>,
    pub error: Option<String>,
    /// `org/name`, set once the job is `done`.
    pub model_id: Option<String>,
}

impl Job {
    pub fn new(id: impl Into<String>, repo: &RepoId, revision: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            repo: repo.to_string(),
            revision: revision.into(),
            state: JobState::Queued,
            bytes_done: 0,
            bytes_total: 0,
            files: Vec::new(),
            error: None,
            model_id: None,
        }
    }

    /// The file being downloaded or verified, if any.
    pub fn current_file(&self) -> Option<&FileProgress> {
        self.files
            .iter()
            .find(|file| file.state == FileState::Running)
    }
}

/// What a [`Control`] asks of a running download.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Run,
    /// Stop soon, keep `.partial` files.
    Pause,
    /// Stop soon, remove `.partial` files.
    Cancel,
}

/// Pauses or cancels a download from elsewhere (another task, a signal handler). Clones share
/// the signal. The download notices at its next network read, within milliseconds.
#[derive(Debug, Clone)]
pub struct Control {
    signal: Arc<watch::Sender<Signal>>,
}

impl Default for Control {
    fn default() -> Self {
        Self::new()
    }
}

impl Control {
    pub fn new() -> Self {
        Self {
            signal: Arc::new(watch::Sender::new(Signal::Run)),
        }
    }

    pub fn pause(&self) {
        self.set(Signal::Pause);
    }

    pub fn cancel(&self) {
        self.set(Signal::Cancel);
    }

    fn set(&self, signal: Signal) {
        // Cancel wins over a later pause; `send_replace` works with no receiver yet.
        if self.signal() != Signal::Cancel {
            self.signal.send_replace(signal);
        }
    }

    pub fn signal(&self) -> Signal {
        *self.signal.borrow()
    }

    fn check(&self) -> Result<()> {
        match self.signal() {
            Signal::Run => Ok(()),
            Signal::Pause => Err(HubError::Paused),
            Signal::Cancel => Err(HubError::Cancelled),
        }
    }

    /// Resolves once asked to stop, with the matching error.
    async fn stopped(&self) -> HubError {
        let mut receiver = self.signal.subscribe();
        // The sender lives in `self`, so this cannot fail.
        let _ = receiver.wait_for(|signal| *signal != Signal::Run).await;
        self.check().err().unwrap_or(HubError::Paused)
    }
}

/// Runs `future` unless the control asks to stop first.
async fn unless_stopped<T>(
    control: &Control,
    future: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::select! {
        biased;
        stop = control.stopped() => Err(stop),
        value = future => value,
    }
}

/// Downloads `job.repo` at `job.revision` into `{models_dir}/{org}/{name}` and returns that
/// folder. `on_change` sees the job after each change (throttled to [`PROGRESS_EVERY`] for
/// byte counts) and last with its final state: `done`, `paused` (partials kept), `cancelled`
/// (partials removed) or `failed` (with `error`). Files already complete are skipped, so calling
/// this again for a paused or failed job resumes it.
pub async fn download(
    client: &HubClient,
    models_dir: &Path,
    job: &mut Job,
    control: &Control,
    mut on_change: impl FnMut(&Job) + Send,
) -> Result<PathBuf> {
    job.error = None;
    job.model_id = None;
    let repo = match RepoId::parse(&job.repo) {
        Ok(repo) => repo,
        Err(error) => return Err(finish(job, error, &mut on_change)),
    };
    let mut run = Run {
        client,
        repo: &repo,
        job,
        control,
        on_change: &mut on_change,
        last_report: Instant::now(),
    };
    let result = run.all_files(models_dir).await;
    let Run { job, on_change, .. } = run;
    match result {
        Ok(model_dir) => {
            job.state = JobState::Done;
            job.model_id = Some(repo.to_string());
            on_change(job);
            Ok(model_dir)
        }
        Err(error) => {
            let error = match error {
                // Removed only now that no file handle is open.
                HubError::Cancelled => match remove_partials(models_dir, &repo) {
                    Ok(_) => HubError::Cancelled,
                    Err(error) => error,
                },
                other => other,
            };
            Err(finish(job, error, on_change))
        }
    }
}

/// Records how a job ended and reports it one last time.
fn finish(job: &mut Job, error: HubError, on_change: &mut impl FnMut(&Job)) -> HubError {
    let file_state = match &error {
        HubError::Paused | HubError::Cancelled => FileState::Pending,
        _ => FileState::Failed,
    };
    for file in &mut job.files {
        if file.state == FileState::Running {
            file.state = file_state;
        }
    }
    job.state = match &error {
        HubError::Paused => JobState::Paused,
        HubError::Cancelled => JobState::Cancelled,
        _ => JobState::Failed,
    };
    if job.state == JobState::Cancelled {
        // Nothing partial is left on disk, so nothing counts as done but finished files.
        for file in &mut job.files {
            if file.state != FileState::Done {
                file.bytes_done = 0;
            }
        }
        job.bytes_done = job.files.iter().map(|file| file.bytes_done).sum();
    }
    job.error = (job.state == JobState::Failed).then(|| error.to_string());
    on_change(job);
    error
}

struct Run<'a, F: FnMut(&Job)> {
    client: &'a HubClient,
    repo: &'a RepoId,
    job: &'a mut Job,
    control: &'a Control,
    on_change: &'a mut F,
    last_report: Instant,
}

impl<F: FnMut(&Job)> Run<'_, F> {
    fn report(&mut self) {
        self.last_report = Instant::now();
        (self.on_change)(self.job);
    }

    fn set_state(&mut self, state: JobState) {
        self.job.state = state;
        self.report();
    }

    fn add_bytes(&mut self, index: usize, bytes: u64) {
        self.job.files[index].bytes_done += bytes;
        self.job.bytes_done += bytes;
        if self.last_report.elapsed() >= PROGRESS_EVERY {
            self.report();
        }
    }

    /// Sets a file's byte count outright (resume found a partial, a restart dropped it).
    fn set_bytes(&mut self, index: usize, bytes: u64) {
        let file = &mut self.job.files[index];
        self.job.bytes_done = self.job.bytes_done - file.bytes_done + bytes;
        file.bytes_done = bytes;
    }

    async fn all_files(&mut self, models_dir: &Path) -> Result<PathBuf> {
        check_revision(&self.job.revision)?;
        self.control.check()?;
        self.set_state(JobState::Listing);
        let revision = self.job.revision.clone();
        let listing =
            unless_stopped(self.control, self.client.list_files(self.repo, &revision)).await?;
        // Every name is checked before anything is written, so a bad listing writes nothing.
        for file in &listing.files {
            check_file_name(&file.name)?;
        }
        let mut files = listing.files;
        // config.json last: `rmlx serve` lists a folder as a model once it has one, so a model
        // must not show up (and be loaded) while its weights are still partial.
        files.sort_by_key(|file| file.name == "config.json");
        self.job.files = files
            .iter()
            .map(|file| FileProgress {
                name: file.name.clone(),
                size: file.size,
                bytes_done: 0,
                state: FileState::Pending,
            })
            .collect();
        self.job.bytes_total = files.iter().map(|file| file.size).sum();
        self.job.bytes_done = 0;

        std::fs::create_dir_all(models_dir).map_err(|error| HubError::io(models_dir, error))?;
        let model_dir = create_dir_inside(
            models_dir,
            &Path::new(self.repo.org()).join(self.repo.name()),
        )?;
        // Finished files from an earlier run count as done (they were verified before the rename).
        for (index, file) in files.iter().enumerate() {
            let dest = model_dir.join(&file.name);
            let complete = std::fs::symlink_metadata(&dest)
                .is_ok_and(|meta| meta.is_file() && meta.len() == file.size);
            if complete {
                self.set_bytes(index, file.size);
                self.job.files[index].state = FileState::Done;
            }
        }
        self.set_state(JobState::Running);
        // Files come from the commit the listing resolved, not a branch that may move meanwhile.
        let revision = listing.commit.unwrap_or(revision);
        for (index, file) in files.iter().enumerate() {
            if self.job.files[index].state == FileState::Done {
                continue;
            }
            self.control.check()?;
            self.file(&model_dir, &revision, index, file).await?;
        }
        Ok(model_dir)
    }

    /// One file, retried once from zero when a resumed download fails its hash: the partial may
    /// be from another version of the file (the branch moved between two runs).
    async fn file(
        &mut self,
        model_dir: &Path,
        revision: &str,
        index: usize,
        file: &RemoteFile,
    ) -> Result<()> {
        let relative = Path::new(&file.name);
        let folder = match relative.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => create_dir_inside(model_dir, parent)?,
            _ => model_dir.to_path_buf(),
        };
        let leaf = relative.file_name().expect("checked by check_file_name");
        let dest = folder.join(leaf);
        let mut partial_name = leaf.to_os_string();
        partial_name.push(PARTIAL_SUFFIX);
        let partial = folder.join(partial_name);
        // A symlink here would make us write (append) wherever it points.
        if let Ok(meta) = std::fs::symlink_metadata(&partial) {
            if !meta.is_file() {
                return Err(HubError::PathEscape {
                    path: partial,
                    root: model_dir.to_path_buf(),
                });
            }
        }
        self.job.files[index].state = FileState::Running;
        self.report();
        let url = self.client.file_url(self.repo, revision, &file.name);
        let mut retried = false;
        loop {
            let resumed = std::fs::metadata(&partial).is_ok_and(|meta| meta.len() > 0);
            match self.fetch(&url, &partial, index, file).await {
                // The bad partial is gone already; this time the file comes whole.
                Err(HubError::HashMismatch { .. }) if resumed && !retried => retried = true,
                Err(error) => return Err(error),
                Ok(()) => break,
            }
        }
        std::fs::rename(&partial, &dest).map_err(|error| HubError::io(&dest, error))?;
        self.job.files[index].state = FileState::Done;
        self.set_state(JobState::Running);
        Ok(())
    }
}

impl<F: FnMut(&Job)> Run<'_, F> {
    /// Brings `partial` to the file's full size (appending when the server honours the range)
    /// and checks its hash. Restarts from zero when the server will not continue the partial.
    async fn fetch(
        &mut self,
        url: &reqwest::Url,
        partial: &Path,
        index: usize,
        file: &RemoteFile,
    ) -> Result<()> {
        let url_text = url.to_string();
        let mut restarts = 0;
        loop {
            let mut offset = match std::fs::metadata(partial) {
                Ok(meta) => meta.len(),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => 0,
                Err(error) => return Err(HubError::io(partial, error)),
            };
            if offset > file.size {
                remove_file(partial)?;
                offset = 0;
            }
            let mut hasher = FileHasher::new(&file.expected, file.size);
            if offset > 0 {
                // The hash covers the whole file, so the bytes already here are hashed first.
                hasher = unless_stopped(self.control, hash_prefix(partial, hasher)).await?;
            }
            self.set_bytes(index, offset);
            self.report();
            if offset == file.size {
                return self.verify(partial, file, hasher);
            }
            let mut request = self.client.get(url.clone());
            if offset > 0 {
                request = request.header(header::RANGE, format!("bytes={offset}-"));
            }
            let send = async {
                request.send().await.map_err(|error| HubError::Connection {
                    url: url_text.clone(),
                    reason: describe(error),
                })
            };
            let mut response = unless_stopped(self.control, send).await?;
            check_status(&response, self.repo, &self.job.revision, Some(&file.name))?;
            let status = response.status();
            let append = match status {
                StatusCode::PARTIAL_CONTENT if content_range_start(&response) == Some(offset) => {
                    offset > 0
                }
                // 416 although the partial is short, or a range we did not ask for: the server
                // and the partial disagree, so start the file over (twice at most).
                StatusCode::PARTIAL_CONTENT | StatusCode::RANGE_NOT_SATISFIABLE => {
                    if restarts == 2 {
                        return Err(HubError::Http {
                            status: status.as_u16(),
                            url: url_text,
                        });
                    }
                    restarts += 1;
                    remove_file(partial)?;
                    continue;
                }
                // 200: the whole file (a server or CDN that ignores Range); overwrite the partial.
                _ => false,
            };
            if !append && offset > 0 {
                offset = 0;
                hasher = FileHasher::new(&file.expected, file.size);
                self.set_bytes(index, 0);
            }
            let mut out = tokio::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(append)
                .truncate(!append)
                .open(partial)
                .await
                .map_err(|error| HubError::io(partial, error))?;
            let streamed = self
                .stream(
                    &mut response,
                    (&mut out, partial),
                    &mut hasher,
                    &mut offset,
                    index,
                    file,
                )
                .await;
            // Whatever happened, the bytes written so far reach the disk before we return: a
            // paused or interrupted download resumes from them. tokio's File writes in the
            // background, so without this flush the last chunk could land after a rename/delete.
            let flushed = out.flush().await;
            let synced = match (&streamed, &flushed) {
                (Ok(()), Ok(())) => out.sync_all().await,
                _ => Ok(()),
            };
            drop(out);
            match streamed {
                Err(error @ HubError::SizeMismatch { .. }) => {
                    remove_file(partial)?;
                    return Err(error);
                }
                Err(HubError::Connection { reason, .. }) => {
                    return Err(HubError::Interrupted {
                        file: file.name.clone(),
                        url: url_text,
                        bytes: offset,
                        size: file.size,
                        reason,
                    })
                }
                Err(error) => return Err(error),
                Ok(()) => {}
            }
            flushed
                .and(synced)
                .map_err(|error| HubError::io(partial, error))?;
            if offset < file.size {
                return Err(HubError::Incomplete {
                    file: file.name.clone(),
                    url: url_text,
                    bytes: offset,
                    size: file.size,
                });
            }
            return self.verify(partial, file, hasher);
        }
    }

    /// Copies the body to `out`, hashing as it goes; stops at the control's request.
    async fn stream(
        &mut self,
        response: &mut reqwest::Response,
        (out, partial): (&mut tokio::fs::File, &Path),
        hasher: &mut FileHasher,
        offset: &mut u64,
        index: usize,
        file: &RemoteFile,
    ) -> Result<()> {
        loop {
            let chunk = tokio::select! {
                biased;
                stop = self.control.stopped() => return Err(stop),
                chunk = response.chunk() => chunk,
            };
            let chunk = match chunk {
                Ok(Some(chunk)) => chunk,
                Ok(None) => return Ok(()),
                Err(error) => {
                    return Err(HubError::Connection {
                        url: response.url().to_string(),
                        reason: describe(error),
                    })
                }
            };
            let len = chunk.len() as u64;
            if *offset + len > file.size {
                return Err(HubError::SizeMismatch {
                    file: file.name.clone(),
                    expected: file.size,
                    actual: *offset + len,
                });
            }
            out.write_all(&chunk)
                .await
                .map_err(|error| HubError::io(partial, error))?;
            // Hashing here (a few hundred µs per chunk at most) saves reading the file again.
            hasher.update(&chunk);
            *offset += len;
            self.add_bytes(index, len);
        }
    }

    fn verify(&mut self, partial: &Path, file: &RemoteFile, hasher: FileHasher) -> Result<()> {
        self.set_state(JobState::Verifying);
        let (algorithm, expected) = match &file.expected {
            Expected::Sha256(hash) => ("sha256", hash),
            Expected::GitBlobSha1(hash) => ("git blob sha1", hash),
        };
        let actual = hasher.finish();
        if &actual != expected {
            remove_file(partial)?;
            self.set_bytes(index_of(self.job, &file.name), 0);
            return Err(HubError::HashMismatch {
                file: file.name.clone(),
                algorithm,
                expected: expected.clone(),
                actual,
            });
        }
        Ok(())
    }
}

fn index_of(job: &Job, name: &str) -> usize {
    job.files
        .iter()
        .position(|file| file.name == name)
        .expect("a listed file")
}

/// `Content-Range: bytes START-END/TOTAL` → START.
fn content_range_start(response: &reqwest::Response) -> Option<u64> {
    let value = response
        .headers()
        .get(header::CONTENT_RANGE)?
        .to_str()
        .ok()?;
    let range = value.strip_prefix("bytes ")?;
    range.split(['-', '/']).next()?.trim().parse().ok()
}

fn remove_file(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
            Err(HubError::io(path, error))
        }
        _ => Ok(()),
    }
}

/// The hash a file is checked against, fed as bytes arrive.
pub(crate) enum FileHasher {
    Sha256(sha2::Sha256),
    GitBlobSha1(sha1::Sha1),
}

impl FileHasher {
    pub(crate) fn new(expected: &Expected, size: u64) -> Self {
        match expected {
            Expected::Sha256(_) => Self::Sha256(sha2::Sha256::new()),
            Expected::GitBlobSha1(_) => {
                // git hashes a blob as `blob {size}\0` + content (`git hash-object`).
                let mut hasher = sha1::Sha1::new();
                hasher.update(format!("blob {size}\0").as_bytes());
                Self::GitBlobSha1(hasher)
            }
        }
    }

    pub(crate) fn update(&mut self, bytes: &[u8]) {
        match self {
            Self::Sha256(hasher) => hasher.update(bytes),
            Self::GitBlobSha1(hasher) => hasher.update(bytes),
        }
    }

    pub(crate) fn finish(self) -> String {
        match self {
            Self::Sha256(hasher) => hex(&hasher.finalize()),
            Self::GitBlobSha1(hasher) => hex(&hasher.finalize()),
        }
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Feeds the bytes of an existing partial to the hasher, off the async threads (it can be GBs).
async fn hash_prefix(partial: &Path, mut hasher: FileHasher) -> Result<FileHasher> {
    let path = partial.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let mut input = std::fs::File::open(&path).map_err(|error| HubError::io(&path, error))?;
        let mut buffer = vec![0u8; 1 << 20];
        loop {
            match input.read(&mut buffer) {
                Ok(0) => return Ok(hasher),
                Ok(n) => hasher.update(&buffer[..n]),
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) => return Err(HubError::io(&path, error)),
            }
        }
    })
    .await
    .expect("hashing does not panic")
}

/// Removes the `.partial` files of a repository's download (cancel), then the model folder and
/// its org folder if that leaves them empty. Symlinks are not followed, and a model folder that
/// resolves outside `models_dir` is left alone. Returns how many partials were removed.
pub fn remove_partials(models_dir: &Path, repo: &RepoId) -> Result<usize> {
    let model_dir = repo.model_dir(models_dir);
    let (Ok(root), Ok(resolved)) = (models_dir.canonicalize(), model_dir.canonicalize()) else {
        return Ok(0);
    };
    if !resolved.starts_with(&root) || !resolved.is_dir() {
        return Ok(0);
    }
    let mut removed = 0;
    let mut folders = vec![model_dir.clone()];
    while let Some(folder) = folders.pop() {
        let entries = std::fs::read_dir(&folder).map_err(|error| HubError::io(&folder, error))?;
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_dir() {
                folders.push(path);
            } else if path.to_string_lossy().ends_with(PARTIAL_SUFFIX) {
                remove_file(&path)?;
                removed += 1;
            }
        }
    }
    // Only empty folders go: `remove_dir` refuses the others, which is what we want.
    let _ = std::fs::remove_dir(&model_dir);
    let _ = std::fs::remove_dir(models_dir.join(repo.org()));
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn git_blob_hash_matches_git_hash_object() {
        // `printf 'hello\n' | git hash-object --stdin`
        let expected = Expected::GitBlobSha1("ce013625030ba8dba906f756967f9e9ca394464a".into());
        let mut hasher = FileHasher::new(&expected, 6);
        hasher.update(b"hello\n");
        assert_eq!(hasher.finish(), "ce013625030ba8dba906f756967f9e9ca394464a");
    }

    #[test]
    fn job_serializes_to_the_contract_shape() {
        let mut job = Job::new("dl-1", &RepoId::parse("org/name").unwrap(), "main");
        job.files.push(FileProgress {
            name: "config.json".into(),
            size: 10,
            bytes_done: 0,
            state: FileState::Pending,
        });
        let value = serde_json::to_value(&job).unwrap();
        assert_eq!(
            value,
            serde_json::json!({
                "id": "dl-1", "repo": "org/name", "revision": "main", "state": "queued",
                "bytes_done": 0, "bytes_total": 0,
                "files": [{"name": "config.json", "size": 10, "bytes_done": 0, "state": "pending"}],
                "error": null, "model_id": null
            })
        );
    }
}
