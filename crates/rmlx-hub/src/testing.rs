//! An imitation of the Hugging Face hub's file API on 127.0.0.1, for tests (feature `test-hub`):
//! this crate's tests and `rmlx pull`'s end-to-end tests run against it, offline. It serves
//! folders (the repo fixtures) the way the hub does: the listing of
//! `GET /api/models/{org}/{name}/revision/{rev}?blobs=true` (sizes; `*.safetensors` as LFS files
//! with `lfs.sha256`, the rest with their git blob id), and file bytes from
//! `GET /{org}/{name}/resolve/{rev}/{file}` honouring `Range: bytes=N-` and `bytes=N-M`. Switches make it
//! misbehave: cut the connection mid-file, corrupt a file, list hostile file names, require a
//! token, or trickle bytes slowly (for pause). Every request is recorded.
//! Reference: huggingface_hub `hf_api.py` (`RepoSibling`, `BlobLfsInfo`) and `utils/_http.py`
//! (`X-Error-Code` values).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    body::{Body, Bytes},
    extract::{Request, State},
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    Router,
};

use crate::{api::Expected, download::FileHasher};

/// A commit id the listing reports (files are then requested at it, as the real client does).
pub const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// How the imitation misbehaves; change it between requests with [`TestHub::set`].
#[derive(Debug, Clone, Default)]
pub struct Switches {
    /// Each response for this file drops the connection after this many body bytes.
    pub cut: Option<(String, u64)>,
    /// This file is served with one byte flipped (its listed hash stays the true one).
    pub corrupt: Option<String>,
    /// Extra names in every listing (never served), e.g. `../evil` or `/abs`.
    pub extra_names: Vec<String>,
    /// Answer 401 unless `Authorization: Bearer {token}` comes with the request.
    pub token: Option<String>,
    /// Send bodies in 16 KiB pieces with this pause between them.
    pub trickle: Option<Duration>,
    /// Answer file requests with 200 and the whole file even when a range was asked for.
    pub ignore_range: bool,
}

/// A request as the imitation saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub path: String,
    pub range: Option<String>,
    pub authorization: Option<String>,
}

#[derive(Default)]
struct Shared {
    repos: Mutex<HashMap<String, PathBuf>>,
    switches: Mutex<Switches>,
    requests: Mutex<Vec<Recorded>>,
}

/// The running imitation; stops when dropped.
pub struct TestHub {
    url: String,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestHub {
    /// Starts serving on a free port, on its own thread and runtime, so it works from plain and
    /// `#[tokio::test]` tests alike (and outlives nothing: dropping it stops everything).
    pub fn start() -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        listener.set_nonblocking(true).expect("nonblocking");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let shared = Arc::new(Shared::default());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let state = shared.clone();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                let app = Router::new().fallback(handle).with_state(state);
                // Open keep-alive connections would hold a graceful shutdown forever; dropping
                // the runtime after `stopped` ends them instead.
                tokio::select! {
                    _ = axum::serve(listener, app) => {}
                    _ = stopped => {}
                }
            });
        });
        Self {
            url,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Serves `dir`'s files as repository `id` (`org/name`).
    pub fn add_repo(&self, id: &str, dir: impl Into<PathBuf>) -> &Self {
        self.shared
            .repos
            .lock()
            .unwrap()
            .insert(id.to_string(), dir.into());
        self
    }

    /// Base URL, e.g. `http://127.0.0.1:41234` (what `--hub-url` / `HF_ENDPOINT` take).
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn set(&self, change: impl FnOnce(&mut Switches)) {
        change(&mut self.shared.switches.lock().unwrap());
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.requests.lock().unwrap().clone()
    }

    pub fn clear_requests(&self) {
        self.shared.requests.lock().unwrap().clear();
    }
}

impl Drop for TestHub {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The repo id the test suites serve the tiny Qwen3 fixture under.
pub const FIXTURE_REPO: &str = "test/qwen3-tiny";

/// A running imitation hub serving `tests/fixtures/qwen3-tiny` as [`FIXTURE_REPO`].
pub fn fixture_hub() -> TestHub {
    let hub = TestHub::start();
    hub.add_repo(FIXTURE_REPO, fixture("qwen3-tiny"));
    hub
}

/// A fixture folder of the workspace's `tests/fixtures` (e.g. `qwen3-tiny`).
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Files of `dir` (recursively) as `(relative name, path)`, sorted like the hub's listing.
pub fn repo_files(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut found = Vec::new();
    let mut folders = vec![dir.to_path_buf()];
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder)
            .expect("fixture folder")
            .flatten()
        {
            let path = entry.path();
            if path.is_dir() {
                folders.push(path);
            } else {
                let relative = path.strip_prefix(dir).expect("below dir");
                let name = relative.to_string_lossy().replace('\\', "/");
                found.push((name, path));
            }
        }
    }
    found.sort();
    found
}

fn is_lfs(name: &str) -> bool {
    name.ends_with(".safetensors")
}

fn hash(expected: &Expected, bytes: &[u8]) -> String {
    let mut hasher = FileHasher::new(expected, bytes.len() as u64);
    hasher.update(bytes);
    hasher.finish()
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    let mut response = (status, format!("{{\"error\":\"{message}\"}}")).into_response();
    if !code.is_empty() {
        response
            .headers_mut()
            .insert("x-error-code", HeaderValue::from_str(code).unwrap());
    }
    response
}

async fn handle(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let path = request.uri().path().to_string();
    let header_text = |name| {
        request
            .headers()
            .get(name)
            .and_then(|value: &HeaderValue| value.to_str().ok())
            .map(str::to_string)
    };
    let range = header_text(header::RANGE);
    let authorization = header_text(header::AUTHORIZATION);
    shared.requests.lock().unwrap().push(Recorded {
        path: path.clone(),
        range: range.clone(),
        authorization: authorization.clone(),
    });
    let switches = shared.switches.lock().unwrap().clone();
    if let Some(token) = &switches.token {
        if authorization.as_deref() != Some(&format!("Bearer {token}")) {
            return error(StatusCode::UNAUTHORIZED, "", "Invalid credentials");
        }
    }
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        ["api", "models", org, name, "revision", _revision] => {
            let repo = format!("{org}/{name}");
            match shared.repos.lock().unwrap().get(&repo).cloned() {
                Some(dir) => listing(&dir, &switches),
                None => error(
                    StatusCode::NOT_FOUND,
                    "RepoNotFound",
                    "Repository not found",
                ),
            }
        }
        [org, name, "resolve", _revision, file @ ..] if !file.is_empty() => {
            let repo = format!("{org}/{name}");
            let Some(dir) = shared.repos.lock().unwrap().get(&repo).cloned() else {
                return error(
                    StatusCode::NOT_FOUND,
                    "RepoNotFound",
                    "Repository not found",
                );
            };
            let name = file.join("/");
            let served = repo_files(&dir)
                .into_iter()
                .find(|(listed, _)| *listed == name);
            match served {
                Some((_, path)) => serve_file(&name, &path, range.as_deref(), &switches),
                None => error(StatusCode::NOT_FOUND, "EntryNotFound", "Entry not found"),
            }
        }
        _ => error(StatusCode::NOT_FOUND, "", "Not found"),
    }
}

fn listing(dir: &Path, switches: &Switches) -> Response {
    let mut siblings: Vec<serde_json::Value> = repo_files(dir)
        .into_iter()
        .map(|(name, path)| {
            let bytes = std::fs::read(path).expect("fixture file");
            let size = bytes.len() as u64;
            let blob = hash(&Expected::GitBlobSha1(String::new()), &bytes);
            if is_lfs(&name) {
                let sha256 = hash(&Expected::Sha256(String::new()), &bytes);
                // The real hub's blobId of an LFS file is the pointer file's; nothing checks it.
                serde_json::json!({
                    "rfilename": name, "size": size, "blobId": blob,
                    "lfs": {"sha256": sha256, "size": size, "pointerSize": 134}
                })
            } else {
                serde_json::json!({"rfilename": name, "size": size, "blobId": blob})
            }
        })
        .collect();
    for name in &switches.extra_names {
        siblings.push(serde_json::json!({
            "rfilename": name, "size": 4,
            "blobId": hash(&Expected::GitBlobSha1(String::new()), b"evil")
        }));
    }
    let body = serde_json::json!({"id": "imitation", "sha": COMMIT, "siblings": siblings});
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn serve_file(name: &str, path: &Path, range: Option<&str>, switches: &Switches) -> Response {
    let mut bytes = std::fs::read(path).expect("fixture file");
    if switches.corrupt.as_deref() == Some(name) && !bytes.is_empty() {
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xff;
    }
    let len = bytes.len() as u64;
    // The forms clients send: `bytes=N-` (a resume) and `bytes=N-M` (a header or a tensor).
    let asked = range
        .filter(|_| !switches.ignore_range)
        .and_then(|range| range.strip_prefix("bytes="))
        .and_then(|range| range.split_once('-'))
        .and_then(|(start, end)| {
            let start = start.parse::<u64>().ok()?;
            match end {
                "" => Some((start, None)),
                end => end.parse::<u64>().ok().map(|end| (start, Some(end))),
            }
        });
    let start = asked.map(|(start, _)| start);
    let end = asked
        .and_then(|(_, end)| end)
        .map_or(len, |end| (end + 1).min(len));
    let (status, start) = match start {
        Some(start) if start >= len || start >= end => {
            let mut response = StatusCode::RANGE_NOT_SATISFIABLE.into_response();
            response.headers_mut().insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&format!("bytes */{len}")).unwrap(),
            );
            return response;
        }
        Some(start) => (StatusCode::PARTIAL_CONTENT, start),
        None => (StatusCode::OK, 0),
    };
    let body = Bytes::from(bytes).slice(start as usize..end as usize);
    let cut = switches
        .cut
        .as_ref()
        .filter(|(file, _)| file == name)
        .map(|(_, after)| *after);
    let mut response = Response::new(Body::from_stream(body_stream(
        body.clone(),
        cut,
        switches.trickle,
    )));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    // The full length is announced even when the body will be cut: that is what makes the
    // client see a broken transfer rather than a short file.
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len() as u64));
    headers.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if status == StatusCode::PARTIAL_CONTENT {
        let range = format!("bytes {start}-{}/{len}", end - 1);
        headers.insert(
            header::CONTENT_RANGE,
            HeaderValue::from_str(&range).unwrap(),
        );
    }
    response
}

/// The body in pieces; with `cut`, an error after that many bytes, which makes hyper drop the
/// connection mid-body.
fn body_stream(
    body: Bytes,
    cut: Option<u64>,
    trickle: Option<Duration>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    const PIECE: usize = 16 * 1024;
    let end = cut.map_or(body.len(), |cut| (cut as usize).min(body.len()));
    futures_util::stream::unfold(0usize, move |sent| {
        let body = body.clone();
        async move {
            if sent == usize::MAX {
                return None;
            }
            if sent >= end {
                // The whole body went out: done, unless the connection is to be cut.
                cut?;
                // Let the bytes already sent reach the client before the connection drops.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let broken = std::io::Error::new(std::io::ErrorKind::BrokenPipe, "cut on purpose");
                return Some((Err(broken), usize::MAX));
            }
            if let Some(pause) = trickle {
                if sent > 0 {
                    tokio::time::sleep(pause).await;
                }
            }
            let piece = if trickle.is_some() { PIECE } else { end - sent };
            let next = (sent + piece).min(end);
            Some((Ok(body.slice(sent..next)), next))
        }
    })
}
