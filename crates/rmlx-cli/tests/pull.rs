//! `rmlx pull` end to end, as a subprocess against the imitation hub (`rmlx_hub::testing` on
//! 127.0.0.1, no internet) serving tests/fixtures/qwen3-tiny: a pull, an interrupted pull that a
//! rerun resumes with Range, a corrupted file, bad ids, the env defaults, and `rmlx serve`
//! killed (SIGKILL) mid-download then restarted.
//! Reference: huggingface_hub `commands/download.py` (the CLI this mirrors).

use std::{
    path::Path,
    process::{Command, Output},
};

mod common;

use common::http;
use rmlx_hub::testing::{fixture, fixture_hub, repo_files, TestHub, COMMIT, FIXTURE_REPO};

const REPO: &str = FIXTURE_REPO;
const WEIGHTS: &str = "model.safetensors";

fn hub() -> TestHub {
    fixture_hub()
}

/// `rmlx` with none of the user's hub settings leaking in.
fn rmlx() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rmlx"));
    for key in ["HF_TOKEN", "HF_ENDPOINT", "RMLX_MODELS_DIR"] {
        command.env_remove(key);
    }
    command
}

fn pull(hub: &TestHub, models_dir: &Path, repo: &str) -> Output {
    rmlx()
        .args(["pull", repo, "--hub-url", hub.url(), "--models-dir"])
        .arg(models_dir)
        .output()
        .unwrap()
}

/// The `Range` header of each request the hub saw for the weights file.
fn weight_ranges(hub: &TestHub) -> Vec<Option<String>> {
    hub.requests()
        .into_iter()
        .filter(|request| {
            request
                .path
                .ends_with(&format!("/resolve/{COMMIT}/{WEIGHTS}"))
        })
        .map(|request| request.range)
        .collect()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn assert_identical(model_dir: &Path) {
    for (name, path) in repo_files(&fixture("qwen3-tiny")) {
        let got = std::fs::read(model_dir.join(&name)).unwrap();
        assert!(got == std::fs::read(path).unwrap(), "{name} differs");
        assert!(!model_dir.join(format!("{name}.partial")).exists());
    }
}

#[test]
fn pull_downloads_the_repository_and_says_where() {
    let hub = hub();
    let models = tempfile::tempdir().unwrap();
    let output = pull(&hub, models.path(), REPO);
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(output.status.success(), "{stderr}");
    let model_dir = models.path().join(REPO);
    assert_identical(&model_dir);
    assert!(
        stdout.contains(&format!("pulled {REPO} into {}", model_dir.display())),
        "{stdout}"
    );
    assert!(stdout.contains(&format!("model id: {REPO}")), "{stdout}");
    // Not a terminal: one progress line per file.
    assert!(
        stderr.contains("pulling test/qwen3-tiny (8 files, 1.1 MB)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("  model.safetensors (823.3 KB)"),
        "{stderr}"
    );
}

#[test]
fn an_interrupted_pull_resumes_on_the_next_run() {
    let hub = hub();
    let models = tempfile::tempdir().unwrap();
    hub.set(|switches| switches.cut = Some((WEIGHTS.into(), 400_000)));
    let output = pull(&hub, models.path(), REPO);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert!(stderr.contains("run again to resume"), "{stderr}");
    let model_dir = models.path().join(REPO);
    let kept = std::fs::metadata(model_dir.join(format!("{WEIGHTS}.partial")))
        .unwrap()
        .len();
    assert!(kept > 0 && kept <= 400_000, "kept {kept}");
    assert!(!model_dir.join(WEIGHTS).exists());

    hub.set(|switches| switches.cut = None);
    hub.clear_requests();
    let output = pull(&hub, models.path(), REPO);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_identical(&model_dir);
    assert_eq!(weight_ranges(&hub), vec![Some(format!("bytes={kept}-"))]);
    assert!(text(&output.stderr).contains("already here"));
}

#[test]
fn a_corrupted_file_fails_the_pull_and_is_not_kept() {
    let hub = hub();
    let models = tempfile::tempdir().unwrap();
    hub.set(|switches| switches.corrupt = Some(WEIGHTS.into()));
    let output = pull(&hub, models.path(), REPO);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("model.safetensors: sha256 mismatch (expected "),
        "{stderr}"
    );
    let model_dir = models.path().join(REPO);
    assert!(!model_dir.join(WEIGHTS).exists());
    assert!(!model_dir.join(format!("{WEIGHTS}.partial")).exists());
    assert!(!model_dir.join("config.json").exists());
}

#[test]
fn bad_and_unknown_repositories_are_clear_errors() {
    let hub = hub();
    let models = tempfile::tempdir().unwrap();
    let output = pull(&hub, models.path(), "../escape");
    assert_eq!(output.status.code(), Some(1));
    assert!(text(&output.stderr).contains("invalid repository id `../escape`"));
    let output = pull(&hub, models.path(), "test/missing");
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("repository not found: test/missing"),
        "{stderr}"
    );
    assert!(stderr.contains(hub.url()), "{stderr}");
    assert_eq!(std::fs::read_dir(models.path()).unwrap().count(), 0);
}

#[test]
fn hub_url_models_dir_and_token_come_from_the_environment() {
    let hub = hub();
    hub.set(|switches| switches.token = Some("hf_secret".into()));
    let models = tempfile::tempdir().unwrap();
    let output = rmlx()
        .args(["pull", REPO])
        .env("HF_ENDPOINT", hub.url())
        .env("RMLX_MODELS_DIR", models.path())
        .env("HF_TOKEN", "hf_secret")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_identical(&models.path().join(REPO));

    let output = rmlx()
        .args(["pull", REPO, "--hub-url", hub.url(), "--models-dir"])
        .arg(models.path().join("other"))
        .output()
        .unwrap();
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("access denied (HTTP 401)"), "{stderr}");
    assert!(stderr.contains("HF_TOKEN"), "{stderr}");
}

/// `rmlx serve` downloading into `models_dir`, and the port it listens on (its first line).
fn serve(hub: &TestHub, models_dir: &Path) -> (std::process::Child, u16) {
    serve_limited(hub, models_dir, None)
}

/// [`serve`], under `prlimit --fsize` when a file-size limit is given.
fn serve_limited(
    hub: &TestHub,
    models_dir: &Path,
    fsize: Option<u64>,
) -> (std::process::Child, u16) {
    let mut command = match fsize {
        Some(bytes) => {
            let mut command = Command::new("prlimit");
            command
                .arg(format!("--fsize={bytes}"))
                .arg(env!("CARGO_BIN_EXE_rmlx"));
            for key in ["HF_TOKEN", "HF_ENDPOINT", "RMLX_MODELS_DIR"] {
                command.env_remove(key);
            }
            command
        }
        None => rmlx(),
    };
    let mut child = command
        .args([
            "serve",
            "--port",
            "0",
            "--hub-url",
            hub.url(),
            "--models-dir",
        ])
        .arg(models_dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let port = common::listening_port(&mut child);
    (child, port)
}

/// The server killed with SIGKILL in the middle of a download (no chance to clean up), then
/// started again: the same download continues its partial file with a Range request and ends
/// with files identical to the hub's.
#[test]
fn a_server_killed_mid_download_resumes_after_a_restart() {
    let hub = hub();
    let models = tempfile::tempdir().unwrap();
    let model_dir = models.path().join(REPO);
    let partial = model_dir.join(format!("{WEIGHTS}.partial"));
    hub.set(|switches| switches.trickle = Some(std::time::Duration::from_millis(40)));
    let (mut server, port) = serve(&hub, models.path());
    let body = format!(r#"{{"repo": "{REPO}"}}"#);
    let (status, job) = http(port, "POST", "/admin/downloads", Some(&body));
    assert_eq!(status, 202, "{job}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::fs::metadata(&partial).map_or(0, |meta| meta.len()) < 100_000 {
        assert!(
            std::time::Instant::now() < deadline,
            "the download never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    server.kill().unwrap(); // SIGKILL
    server.wait().unwrap();
    let kept = std::fs::metadata(&partial).unwrap().len();
    let total = std::fs::metadata(fixture("qwen3-tiny").join(WEIGHTS))
        .unwrap()
        .len();
    assert!(kept > 0 && kept < total, "kept {kept} of {total}");
    assert!(!model_dir.join(WEIGHTS).exists());

    hub.set(|switches| switches.trickle = None);
    hub.clear_requests();
    let (mut server, port) = serve(&hub, models.path());
    let (status, job) = http(port, "POST", "/admin/downloads", Some(&body));
    assert_eq!(status, 202, "{job}");
    let id = job["id"].as_str().unwrap().to_string();
    let job = loop {
        let (_, job) = http(port, "GET", &format!("/admin/downloads/{id}"), None);
        match job["state"].as_str() {
            Some("done") => break job,
            Some("failed" | "cancelled") => panic!("{job}"),
            _ => {}
        }
        assert!(std::time::Instant::now() < deadline, "never done: {job}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    server.kill().unwrap();
    server.wait().unwrap();
    assert_eq!(job["model_id"], REPO);
    assert_identical(&model_dir);
    let ranges = weight_ranges(&hub);
    // The restart asked only for what the killed server had not written (a partial file
    // may hold a little more than its last flush: never less than `kept`).
    assert_eq!(ranges.len(), 1, "{ranges:?}");
    let from: u64 = ranges[0]
        .as_deref()
        .and_then(|range| {
            range
                .strip_prefix("bytes=")?
                .strip_suffix('-')?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("{ranges:?}"));
    assert!(
        from >= kept && from < total,
        "resumed from {from}, kept {kept} of {total}"
    );
}

/// A models folder on a 600 KB tmpfs (made here; the tests run as root): the weights do not
/// fit, so the download fails with a clear error, and the half-written model is not listed.
/// Where mounting is refused, the server runs under `prlimit --fsize` instead (a write past
/// the limit fails with EFBIG: rmlx ignores SIGXFSZ), so the test never skips.
#[test]
fn a_full_disk_fails_the_download_clearly_and_lists_no_half_model() {
    let hub = hub();
    let scratch = tempfile::tempdir().unwrap();
    let models = scratch.path().join("models");
    std::fs::create_dir_all(&models).unwrap();
    // RMLX_TEST_NO_MOUNT=1 takes the prlimit path even where mounting works.
    let mounted = std::env::var_os("RMLX_TEST_NO_MOUNT").is_none()
        && Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=600k", "tmpfs"])
            .arg(&models)
            .status()
            .is_ok_and(|status| status.success());
    struct Unmount(Option<std::path::PathBuf>);
    impl Drop for Unmount {
        fn drop(&mut self) {
            if let Some(path) = &self.0 {
                let _ = Command::new("umount").arg(path).status();
            }
        }
    }
    let _unmount = Unmount(mounted.then(|| models.clone()));
    let limit = (!mounted).then_some(600_000);
    let (mut server, port) = serve_limited(&hub, &models, limit);
    let body = format!(r#"{{"repo": "{REPO}"}}"#);
    let (status, job) = http(port, "POST", "/admin/downloads", Some(&body));
    assert_eq!(status, 202, "{job}");
    let id = job["id"].as_str().unwrap().to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let job = loop {
        let (_, job) = http(port, "GET", &format!("/admin/downloads/{id}"), None);
        match job["state"].as_str() {
            Some("failed") => break job,
            Some("done") => panic!("a 600 KB disk took the whole model: {job}"),
            _ => {}
        }
        assert!(std::time::Instant::now() < deadline, "never failed: {job}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let error = job["error"].as_str().unwrap_or_default();
    eprintln!("full disk (mounted tmpfs: {mounted}): {error}");
    assert!(error.contains(WEIGHTS), "{job}");
    assert!(
        error.contains("No space left") || error.contains("too large"),
        "{job}"
    );
    let (status, listed) = http(port, "GET", "/v1/models", None);
    assert_eq!(status, 200);
    let ids: Vec<_> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].clone())
        .collect();
    assert!(!ids.contains(&serde_json::json!(REPO)), "{ids:?}");
    assert!(!models.join(REPO).join(WEIGHTS).exists());
    // The server is still serving.
    assert_eq!(http(port, "GET", "/health", None).0, 200);
    server.kill().unwrap();
    server.wait().unwrap();
}

/// `rmlx pull --mtp`: only the release's `mtp.*` tensors cross the network (its headers and
/// each tensor's bytes, by `Range: bytes=N-M`), and they land beside a 4-bit conversion that
/// lacks them as a quantized split drafter that `rmlx info` then reports and `rmlx generate
/// --speculative mtp` drafts with, its answer the plain one.
#[test]
fn pull_mtp_takes_only_the_head_by_ranges() {
    let hub = TestHub::start();
    hub.add_repo("Qwen/Qwen3.6-35B-A3B", fixture("releases/qwen3.6-35b-a3b"));
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("conversion");
    std::fs::create_dir(&model).unwrap();
    for (name, path) in repo_files(&fixture("releases/qwen3.6-35b-a3b-4bit")) {
        std::fs::copy(path, model.join(name)).unwrap();
    }
    let info = |model: &Path| -> serde_json::Value {
        let out = rmlx()
            .args(["info", "--json", "--model"])
            .arg(model)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    assert_eq!(info(&model)["draft_head"], false);
    let out = rmlx()
        .args([
            "pull",
            "--mtp",
            "Qwen/Qwen3.6-35B-A3B",
            "--hub-url",
            hub.url(),
            "--model",
        ])
        .arg(&model)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("mtp.* tensors"),
        "{}",
        text(&out.stdout)
    );
    // Every weights request asked for a bounded range, and far fewer bytes than the file.
    let size = std::fs::metadata(fixture("releases/qwen3.6-35b-a3b").join(WEIGHTS))
        .unwrap()
        .len();
    let ranges = weight_ranges(&hub);
    assert!(ranges.len() > 2, "{ranges:?}");
    let mut read = 0;
    for range in &ranges {
        let range = range.as_deref().expect("a Range header");
        let (start, end) = range
            .strip_prefix("bytes=")
            .and_then(|r| r.split_once('-'))
            .expect("bytes=N-M");
        read += end.parse::<u64>().unwrap() + 1 - start.parse::<u64>().unwrap();
    }
    assert!(read * 4 < size, "read {read} of {size}");
    assert!(model.join("mtp/model.safetensors").is_file());
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("mtp/config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "qwen3_5_mtp");
    assert_eq!(config["quantization"]["bits"], 4);
    assert_eq!(info(&model)["draft_head"], true);
    let generate = |mode: &str| -> serde_json::Value {
        let out = rmlx()
            .args(["generate", "--model"])
            .arg(&model)
            .args([
                "--prompt",
                "Count to ten.",
                "--max-tokens",
                "24",
                "--ignore-eos",
            ])
            .args(["--temperature", "0", "--speculative", mode, "--json"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let plain = generate("off");
    let drafted = generate("mtp");
    assert_eq!(plain["token_ids"], drafted["token_ids"]);
    assert!(
        drafted["timings"]["draft_tokens"].as_u64().unwrap() > 0,
        "{drafted}"
    );
    // Not a release: refused by name.
    let out = rmlx()
        .args([
            "pull",
            "--mtp",
            "Qwen/Qwen3.6-35B-A3B",
            "--hub-url",
            hub.url(),
            "--model",
        ])
        .arg(dir.path().join("missing"))
        .output()
        .unwrap();
    assert!(!out.status.success());
}
