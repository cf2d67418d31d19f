//! The two hub endpoints a download needs: the file listing of a revision and a file's bytes.
//! References: huggingface_hub `hf_api.py` (`model_info(..., files_metadata=True)` →
//! `GET /api/models/{repo}/revision/{revision}?blobs=true`, `RepoSibling`: `rfilename`, `size`,
//! `blobId`, `lfs.sha256`) and `file_download.py` (`hf_hub_url`:
//! `{endpoint}/{repo}/resolve/{revision}/{filename}`, the revision quoted as one segment).

use std::time::Duration;

use reqwest::{StatusCode, Url};
use serde::Deserialize;

use crate::{
    error::{describe, HubError, Result},
    paths::{check_revision, RepoId},
};

/// The public hub; `HF_ENDPOINT` (as in huggingface_hub) points elsewhere, e.g. a mirror.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Where the hub is and who we are to it.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// Base URL, e.g. `https://huggingface.co` (a path prefix is kept: mirrors use one).
    pub endpoint: String,
    /// Sent as `Authorization: Bearer` (private and gated repositories).
    pub token: Option<String>,
}

impl Default for HubConfig {
    fn default() -> Self {
        Self {
            endpoint: DEFAULT_ENDPOINT.to_string(),
            token: None,
        }
    }
}

impl HubConfig {
    /// `HF_ENDPOINT` and `HF_TOKEN` from the environment, as huggingface_hub reads them.
    pub fn from_env() -> Self {
        let non_empty = |key| std::env::var(key).ok().filter(|value| !value.is_empty());
        Self {
            endpoint: non_empty("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.to_string()),
            token: non_empty("HF_TOKEN"),
        }
    }
}

/// A file of a revision, as the listing describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFile {
    /// Path inside the repository (`/`-separated); checked before use as a local path.
    pub name: String,
    pub size: u64,
    pub expected: Expected,
}

/// How a file's bytes are verified once downloaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expected {
    /// LFS files (weights): the sha256 of the content, hex.
    Sha256(String),
    /// Plain git files (configs, tokenizers): the git blob id, sha1 of `"blob {size}\0" + bytes`.
    GitBlobSha1(String),
}

/// What the listing says about a revision.
#[derive(Debug, Clone)]
pub struct Listing {
    /// The commit the revision resolved to, when the hub said (files are then fetched from that
    /// commit so a branch moving mid-download cannot mix two versions).
    pub commit: Option<String>,
    pub files: Vec<RemoteFile>,
}

#[derive(Deserialize)]
struct RawInfo {
    sha: Option<String>,
    siblings: Option<Vec<RawSibling>>,
}

#[derive(Deserialize)]
struct RawSibling {
    rfilename: String,
    size: Option<u64>,
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    lfs: Option<RawLfs>,
}

#[derive(Deserialize)]
struct RawLfs {
    sha256: String,
}

/// A hub client; cheap to clone (reqwest shares its connection pool).
#[derive(Debug, Clone)]
pub struct HubClient {
    http: reqwest::Client,
    endpoint: Url,
    token: Option<String>,
}

impl HubClient {
    pub fn new(config: HubConfig) -> Result<Self> {
        let mut endpoint = Url::parse(config.endpoint.trim_end_matches('/')).map_err(|error| {
            HubError::InvalidEndpoint {
                url: config.endpoint.clone(),
                reason: error.to_string(),
            }
        })?;
        if endpoint.cannot_be_a_base() || !matches!(endpoint.scheme(), "http" | "https") {
            return Err(HubError::InvalidEndpoint {
                url: config.endpoint,
                reason: "not an http(s) base URL".into(),
            });
        }
        // Segments are pushed onto the endpoint's path; a trailing empty one would double `/`.
        endpoint
            .path_segments_mut()
            .expect("checked above")
            .pop_if_empty();
        let http = reqwest::Client::builder()
            .user_agent(concat!("rmlx/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(30))
            // A stalled transfer fails (and can be resumed) instead of hanging forever.
            .read_timeout(Duration::from_secs(60))
            .build()
            .map_err(|error| HubError::Connection {
                url: config.endpoint.clone(),
                reason: describe(error),
            })?;
        Ok(Self {
            http,
            endpoint,
            token: config.token.filter(|token| !token.is_empty()),
        })
    }

    pub fn endpoint(&self) -> &str {
        self.endpoint.as_str()
    }

    fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.endpoint.clone();
        url.path_segments_mut()
            .expect("checked in new")
            .extend(segments);
        url
    }

    /// `{hub}/api/models/{org}/{name}/revision/{revision}?blobs=true`
    pub fn listing_url(&self, repo: &RepoId, revision: &str) -> Url {
        let mut url = self.url(&[
            "api",
            "models",
            repo.org(),
            repo.name(),
            "revision",
            revision,
        ]);
        url.set_query(Some("blobs=true"));
        url
    }

    /// `{hub}/{org}/{name}/resolve/{revision}/{file}` (each part of the file name a segment).
    pub fn file_url(&self, repo: &RepoId, revision: &str, file: &str) -> Url {
        let mut segments = vec![repo.org(), repo.name(), "resolve", revision];
        segments.extend(file.split('/'));
        self.url(&segments)
    }

    pub(crate) fn get(&self, url: Url) -> reqwest::RequestBuilder {
        let request = self.http.get(url);
        match &self.token {
            // reqwest drops Authorization when a redirect leaves the host (the CDN), as it should.
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    /// The files of `repo` at `revision`, with their sizes and hashes.
    pub async fn list_files(&self, repo: &RepoId, revision: &str) -> Result<Listing> {
        check_revision(revision)?;
        let url = self.listing_url(repo, revision);
        let url_text = url.to_string();
        let response = self
            .get(url)
            .send()
            .await
            .map_err(|error| HubError::Connection {
                url: url_text.clone(),
                reason: describe(error),
            })?;
        check_status(&response, repo, revision, None)?;
        let body = response
            .bytes()
            .await
            .map_err(|error| HubError::Connection {
                url: url_text.clone(),
                reason: describe(error),
            })?;
        let bad = |reason: String| HubError::BadListing {
            url: url_text.clone(),
            reason,
        };
        let info: RawInfo = serde_json::from_slice(&body)
            .map_err(|error| bad(format!("not a model listing: {error}")))?;
        let siblings = info
            .siblings
            .ok_or_else(|| bad("no `siblings` (file list)".into()))?;
        let mut files = Vec::with_capacity(siblings.len());
        for sibling in siblings {
            let name = sibling.rfilename;
            let size = sibling
                .size
                .ok_or_else(|| bad(format!("no size for {name}")))?;
            let expected = match (sibling.lfs, sibling.blob_id) {
                (Some(lfs), _) => Expected::Sha256(lfs.sha256.to_ascii_lowercase()),
                (None, Some(blob)) => Expected::GitBlobSha1(blob.to_ascii_lowercase()),
                (None, None) => return Err(bad(format!("no blobId or lfs.sha256 for {name}"))),
            };
            files.push(RemoteFile {
                name,
                size,
                expected,
            });
        }
        if files.is_empty() {
            return Err(bad("the repository has no files".into()));
        }
        let commit = info
            .sha
            .filter(|sha| sha.len() == 40 && sha.bytes().all(|b| b.is_ascii_hexdigit()));
        Ok(Listing { commit, files })
    }
}

/// Maps a failed status to the typed error, as `hf_raise_for_status` does: the hub answers 401
/// (not 404) for a missing repository when no token is sent, and says which in `X-Error-Code`.
pub(crate) fn check_status(
    response: &reqwest::Response,
    repo: &RepoId,
    revision: &str,
    file: Option<&str>,
) -> Result<()> {
    let status = response.status();
    if status.is_success() || status == StatusCode::RANGE_NOT_SATISFIABLE {
        return Ok(());
    }
    let url = response.url().to_string();
    let code = response
        .headers()
        .get("x-error-code")
        .and_then(|value| value.to_str().ok())
        .unwrap_or("");
    Err(match (code, status.as_u16(), file) {
        ("RepoNotFound", ..) => HubError::RepoNotFound {
            repo: repo.to_string(),
            url,
        },
        ("RevisionNotFound", ..) => HubError::RevisionNotFound {
            repo: repo.to_string(),
            revision: revision.to_string(),
            url,
        },
        ("EntryNotFound", _, Some(file)) | (_, 404, Some(file)) => HubError::FileNotFound {
            file: file.to_string(),
            url,
        },
        (_, 404, None) => HubError::RepoNotFound {
            repo: repo.to_string(),
            url,
        },
        ("GatedRepo", status, _) => HubError::Unauthorized {
            status,
            url,
            hint: "the repository is gated: accept its terms on the hub and set HF_TOKEN",
        },
        (_, status @ (401 | 403), _) => HubError::Unauthorized {
            status,
            url,
            hint: "set HF_TOKEN to a token that can read this repository",
        },
        (_, status, _) => HubError::Http { status, url },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_must_be_http_urls() {
        for bad in ["", "huggingface.co", "ftp://x", "mailto:a@b"] {
            let result = HubClient::new(HubConfig {
                endpoint: bad.into(),
                token: None,
            });
            assert!(
                matches!(result, Err(HubError::InvalidEndpoint { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn urls_encode_revision_and_keep_a_mirror_prefix() {
        let client = HubClient::new(HubConfig {
            endpoint: "https://mirror.example/hf/".into(),
            token: None,
        })
        .unwrap();
        let repo = RepoId::parse("Qwen/Qwen3-0.6B").unwrap();
        assert_eq!(
            client.listing_url(&repo, "refs/pr/1").as_str(),
            "https://mirror.example/hf/api/models/Qwen/Qwen3-0.6B/revision/refs%2Fpr%2F1?blobs=true"
        );
        assert_eq!(
            client
                .file_url(&repo, "main", "sub dir/model.safetensors")
                .as_str(),
            "https://mirror.example/hf/Qwen/Qwen3-0.6B/resolve/main/sub%20dir/model.safetensors"
        );
    }
}
