//! What can go wrong while downloading from the hub, as typed errors a server can map to status
//! codes and a CLI can print as is. Every network error names its URL, every file error its file.
//! Reference: huggingface_hub `utils/_http.py` (`hf_raise_for_status`: which status and
//! `X-Error-Code` mean "repository not found", "revision not found", "gated").

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("invalid repository id `{id}`: {reason} (expected `org/name` with letters, digits, `.`, `_`, `-`)")]
    InvalidRepoId { id: String, reason: &'static str },

    #[error("invalid revision `{0}`")]
    InvalidRevision(String),

    /// A file name from the hub's listing that could land outside the model folder.
    #[error("refusing the hub's file name `{name}`: {reason}")]
    UnsafeFileName { name: String, reason: &'static str },

    /// A folder on the way to a file resolves (through a symlink) outside the model folder.
    #[error("refusing to write through {path}: it leads outside {root}")]
    PathEscape { path: PathBuf, root: PathBuf },

    #[error("repository not found: {repo} ({url}); private and gated repositories need HF_TOKEN")]
    RepoNotFound { repo: String, url: String },

    #[error("revision `{revision}` not found in {repo} ({url})")]
    RevisionNotFound {
        repo: String,
        revision: String,
        url: String,
    },

    #[error("file not found on the hub: {file} ({url})")]
    FileNotFound { file: String, url: String },

    #[error("access denied (HTTP {status}) for {url}: {hint}")]
    Unauthorized {
        status: u16,
        url: String,
        hint: &'static str,
    },

    #[error("HTTP {status} from {url}")]
    Http { status: u16, url: String },

    #[error("cannot reach {url}: {reason}")]
    Connection { url: String, reason: String },

    /// The connection broke mid-file; the `.partial` keeps what arrived and a rerun resumes it.
    #[error("download of {file} interrupted at {bytes} of {size} bytes ({url}): {reason}; run again to resume")]
    Interrupted {
        file: String,
        url: String,
        bytes: u64,
        size: u64,
        reason: String,
    },

    /// The server ended the body early without an error.
    #[error("download of {file} ended at {bytes} of {size} bytes ({url}); run again to resume")]
    Incomplete {
        file: String,
        url: String,
        bytes: u64,
        size: u64,
    },

    #[error("invalid hub URL `{url}`: {reason}")]
    InvalidEndpoint { url: String, reason: String },

    #[error("unexpected answer from {url}: {reason}")]
    BadListing { url: String, reason: String },

    #[error("{file}: expected {expected} bytes, got {actual}")]
    SizeMismatch {
        file: String,
        expected: u64,
        actual: u64,
    },

    /// The bytes arrived but are not the file the listing announced; the partial is deleted.
    #[error("{file}: {algorithm} mismatch (expected {expected}, got {actual}); the download was discarded")]
    HashMismatch {
        file: String,
        algorithm: &'static str,
        expected: String,
        actual: String,
    },

    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// Stopped on request; `.partial` files are kept for a later resume.
    #[error("download paused")]
    Paused,

    /// Stopped on request; `.partial` files were removed.
    #[error("download cancelled")]
    Cancelled,

    #[error("{repo} is already being downloaded (job `{id}`)")]
    AlreadyDownloading { repo: String, id: String },

    #[error("no tokio runtime to run the download on")]
    NoRuntime,

    #[error("no download job `{0}`")]
    JobNotFound(String),

    #[error("cannot {action} download `{id}`: it is {state}")]
    InvalidState {
        id: String,
        action: &'static str,
        state: &'static str,
    },
}

impl HubError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

/// A reqwest error with its causes ("error sending request: connection refused"), without the
/// URL, which our messages name themselves.
pub(crate) fn describe(error: reqwest::Error) -> String {
    let error = error.without_url();
    let mut text = error.to_string();
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

pub type Result<T, E = HubError> = std::result::Result<T, E>;
