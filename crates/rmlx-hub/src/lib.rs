//! rmlx-hub: downloads a model repository from the Hugging Face hub (or a mirror, or the test
//! imitation) into `{models_dir}/{org}/{name}`, resumably and verified, for `rmlx pull` and the
//! server's download jobs. The contract is docs/MODELS-API.md ("Downloader").
//! References: huggingface_hub `hf_api.py` (file listing with `blobs=true`) and
//! `file_download.py` (resolve URLs, `Range` resume, verify-then-move).
//!
//! - [`HubClient`]: the hub endpoints (listing, file URLs), token, typed HTTP errors.
//! - [`download`]: one job, reported through a callback; [`Control`] pauses or cancels it.
//! - [`DownloadManager`]: the jobs a server holds, driven from async handlers.
//! - [`fetch_tensors`]: chosen tensors of a repository by byte ranges (`rmlx pull --mtp`).

mod api;
mod download;
mod error;
mod manager;
mod paths;
mod tensors;
#[cfg(feature = "test-hub")]
pub mod testing;

pub use api::{Expected, HubClient, HubConfig, Listing, RemoteFile, DEFAULT_ENDPOINT};
pub use download::{
    download, remove_partials, Control, FileProgress, FileState, Job, JobState, Signal,
};
pub use error::{HubError, Result};
pub use manager::DownloadManager;
pub use paths::{check_file_name, check_revision, default_models_dir, RepoId, PARTIAL_SUFFIX};
pub use tensors::{fetch_tensors, RemoteTensor};
