//! Downloads against the imitation hub (`rmlx_hub::testing`, 127.0.0.1, no internet) serving
//! tests/fixtures/qwen3-tiny: complete, resumed, corrupted, refused, paused and cancelled.
//! Reference: huggingface_hub `file_download.py` (resume with Range, verify, move into place).

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use rmlx_hub::{
    download,
    testing::{fixture, fixture_hub, repo_files, TestHub, FIXTURE_REPO},
    Control, FileState, HubClient, HubConfig, HubError, Job, JobState, RepoId,
};

const REPO: &str = FIXTURE_REPO;
const WEIGHTS: &str = "model.safetensors";

fn hub() -> TestHub {
    fixture_hub()
}

fn client(hub: &TestHub, token: Option<&str>) -> HubClient {
    HubClient::new(HubConfig {
        endpoint: hub.url().to_string(),
        token: token.map(str::to_string),
    })
    .unwrap()
}

/// One download of `repo` into `models_dir`; returns the outcome, the final job and every state
/// the job reported.
async fn pull(
    client: &HubClient,
    models_dir: &Path,
    repo: &str,
    control: &Control,
    mut watch: impl FnMut(&Job) + Send,
) -> (Result<PathBuf, HubError>, Job, Vec<JobState>) {
    let mut job = Job::new("t", &RepoId::parse(repo).unwrap(), "main");
    let mut states = Vec::new();
    let result = download(client, models_dir, &mut job, control, |job: &Job| {
        if states.last() != Some(&job.state) {
            states.push(job.state);
        }
        watch(job);
    })
    .await;
    (result, job, states)
}

fn assert_identical(model_dir: &Path) {
    for (name, path) in repo_files(&fixture("qwen3-tiny")) {
        let got = std::fs::read(model_dir.join(&name))
            .unwrap_or_else(|error| panic!("{name} missing: {error}"));
        assert!(
            got == std::fs::read(path).unwrap(),
            "{name} differs from the fixture"
        );
    }
    assert_eq!(partials(model_dir), Vec::<PathBuf>::new());
}

fn partials(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                found.extend(partials(&path));
            } else if path.to_string_lossy().ends_with(".partial") {
                found.push(path);
            }
        }
    }
    found
}

fn file_requests(hub: &TestHub, file: &str) -> Vec<Option<String>> {
    hub.requests()
        .into_iter()
        .filter(|request| {
            request
                .path
                .ends_with(&format!("/resolve/{}/{file}", rmlx_hub::testing::COMMIT))
        })
        .map(|request| request.range)
        .collect()
}

#[tokio::test]
async fn downloads_a_repository_byte_identical() {
    let hub = hub();
    let models = tempfile::tempdir().unwrap();
    let models_dir = models.path().join("models"); // created on demand
    let (result, job, states) = pull(
        &client(&hub, None),
        &models_dir,
        REPO,
        &Control::new(),
        |_| {},
    )
    .await;
    let model_dir = result.unwrap();
    assert_eq!(model_dir, models_dir.join("test/qwen3-tiny"));
    assert_identical(&model_dir);
    assert_eq!(job.state, JobState::Done);
    assert_eq!(job.model_id.as_deref(), Some(REPO));
    assert_eq!(job.bytes_done, job.bytes_total);
    assert_eq!(job.files.len(), 8);
    assert!(job.files.iter().all(|file| file.state == FileState::Done));
    assert_eq!(job.error, None);
    assert_eq!(states.first(), Some(&JobState::Listing));
    assert!(states.contains(&JobState::Running) && states.contains(&JobState::Verifying));
    // config.json comes last, so `rmlx serve` never lists a half-downloaded model.
    let last = hub.requests().last().unwrap().path.clone();
    assert!(last.ends_with("/config.json"), "{last}");
    // The listing asked for blob metadata; files came from the listed commit.
    assert!(hub.requests()[0]
        .path
        .ends_with("/api/models/test/qwen3-tiny/revision/main"));

    // A second run finds everything in place and downloads nothing.
    hub.clear_requests();
    let (result, job, _) = pull(
        &client(&hub, None),
        &models_dir,
        REPO,
        &Control::new(),
        |_| {},
    )
    .await;
    result.unwrap();
    assert_eq!(job.bytes_done, job.bytes_total);
    assert_eq!(
        hub.requests().len(),
        1,
        "only the listing: {:?}",
        hub.requests()
    );
}

#[tokio::test]
async fn an_interrupted_download_resumes_with_a_range_request() {
    let hub = hub();
    let models = tempfile::tempdir().unwrap();
    hub.set(|switches| switches.cut = Some((WEIGHTS.into(), 300_000)));
    let (result, job, _) = pull(
        &client(&hub, None),
        models.path(),
        REPO,
        &Control::new(),
        |_| {},
    )
    .await;
    let error = result.unwrap_err();
    assert!(
        matches!(error, HubError::Interrupted { ref file, .. } if file == WEIGHTS),
        "{error}"
    );
    assert!(error.to_string().contains(hub.url()), "{error}");
    assert_eq!(job.state, JobState::Failed);
    assert!(job.error.as_deref().unwrap().contains("interrupted"));
    let model_dir = models.path().join(REPO);
    let partial = model_dir.join(format!("{WEIGHTS}.partial"));
    let kept = std::fs::metadata(&partial).unwrap().len();
    assert!(kept > 0 && kept <= 300_000, "kept {kept} bytes");
    assert!(!model_dir.join(WEIGHTS).exists());

    hub.set(|switches| switches.cut = None);
    hub.clear_requests();
    let (result, job, _) = pull(
        &client(&hub, None),
        models.path(),
        REPO,
        &Control::new(),
        |_| {},
    )
    .await;
    assert_identical(&result.unwrap());
    assert_eq!(job.state, JobState::Done);
    assert_eq!(
        file_requests(&hub, WEIGHTS),
        vec![Some(format!("bytes={kept}-"))]
    );
}

#[tokio::test]
async fn a_server_that_ignores_range_restarts_the_file() {
    let hub = hub();
    let models = tempfile::tempdir().unwrap();
    hub.set(|switches| switches.cut = Some((WEIGHTS.into(), 100_000)));
    let (result, ..) = pull(
        &client(&hub, None),
        models.path(),
        REPO,
        &Control::new(),
        |_| {},
    )
    .await;
    assert!(result.is_err());
    hub.set(|switches| {
        switches.cut = None;
        switches.ignore_range = true; // answers 200 with the whole file
    });
    let (result, ..) = pull(
        &client(&hub, None),
        models.path(),
        REPO,
        &Control::new(),
        |_| {},
    )
    .await;
    assert_identical(&result.unwrap());
}

#[tokio::test]
async fn a_partial_of_another_version_is_redownloaded_once() {
    let hub = hub();
    let models = tempfile::tempdir().unwrap();
    let model_dir = models.path().join(REPO);
    std::fs::create_dir_all(&model_dir).unwrap();
    std::fs::write(
        model_dir.join("tokenizer.json.partial"),
        b"not the tokenizer",
    )
    .unwrap();
    hub.clear_requests();
    let (result, ..) = pull(
        &client(&hub, None),
        models.path(),
        REPO,
        &Control::new(),
        |_| {},
    )
    .await;
    assert_identical(&result.unwrap());
    // First a resume from byte 17, which fails its hash, then the whole file.
    assert_eq!(
        file_requests(&hub, "tokenizer.json"),
        vec![Some("bytes=17-".to_string()), None]
    );
}

#[tokio::test]
async fn corrupted_files_are_detected_and_discarded() {
    for (file, algorithm) in [(WEIGHTS, "sha256"), ("tokenizer.json", "git blob sha1")] {
        let hub = hub();
        let models = tempfile::tempdir().unwrap();
        hub.set(|switches| switches.corrupt = Some(file.into()));
        let (result, job, _) = pull(
            &client(&hub, None),
            models.path(),
            REPO,
            &Control::new(),
            |_| {},
        )
        .await;
        match result.unwrap_err() {
            HubError::HashMismatch {
                file: named,
                algorithm: used,
                expected,
                actual,
            } => {
                assert_eq!((named.as_str(), used), (file, algorithm));
                assert_ne!(expected, actual);
            }
            other => panic!("{file}: expected a hash mismatch, got {other}"),
        }
        assert_eq!(job.state, JobState::Failed);
        let model_dir = models.path().join(REPO);
        assert!(!model_dir.join(file).exists(), "{file} must not be left");
        assert_eq!(partials(&model_dir), Vec::<PathBuf>::new());
        assert!(!model_dir.join("config.json").exists());
    }
}

#[tokio::test]
async fn unknown_repositories_and_bad_tokens_are_clear_errors() {
    let hub = hub();
    let models = tempfile::tempdir().unwrap();
    let models_dir = models.path().join("models");
    let (result, job, _) = pull(
        &client(&hub, None),
        &models_dir,
        "test/nope",
        &Control::new(),
        |_| {},
    )
    .await;
    let error = result.unwrap_err();
    assert!(matches!(error, HubError::RepoNotFound { .. }), "{error}");
    let message = error.to_string();
    assert!(
        message.contains("repository not found: test/nope"),
        "{message}"
    );
    assert!(
        message.contains(&format!("{}/api/models/test/nope", hub.url())),
        "{message}"
    );
    assert_eq!(job.state, JobState::Failed);
    assert!(
        !models_dir.exists(),
        "nothing is written for a missing repository"
    );

    hub.set(|switches| switches.token = Some("secret".into()));
    let (result, ..) = pull(
        &client(&hub, None),
        &models_dir,
        REPO,
        &Control::new(),
        |_| {},
    )
    .await;
    assert!(matches!(
        result,
        Err(HubError::Unauthorized { status: 401, .. })
    ));
    let (result, ..) = pull(
        &client(&hub, Some("secret")),
        &models_dir,
        REPO,
        &Control::new(),
        |_| {},
    )
    .await;
    assert_identical(&result.unwrap());
    assert!(hub
        .requests()
        .iter()
        .any(|request| request.authorization.as_deref() == Some("Bearer secret")));

    let closed = HubClient::new(HubConfig {
        endpoint: "http://127.0.0.1:9".into(), // discard port: nothing listens
        token: None,
    })
    .unwrap();
    let (result, ..) = pull(&closed, &models_dir, REPO, &Control::new(), |_| {}).await;
    let error = result.unwrap_err();
    assert!(matches!(error, HubError::Connection { .. }), "{error}");
    assert!(
        error.to_string().contains("http://127.0.0.1:9/api/models"),
        "{error}"
    );
}

#[tokio::test]
async fn hostile_names_and_paths_write_nothing() {
    let sandbox = tempfile::tempdir().unwrap();
    let models_dir = sandbox.path().join("models");
    std::fs::create_dir(&models_dir).unwrap();
    let hub = hub();

    // A repo id that climbs out.
    let mut job = Job::new("t", &RepoId::parse("a/b").unwrap(), "main");
    job.repo = "../escape".into();
    let result = download(
        &client(&hub, None),
        &models_dir,
        &mut job,
        &Control::new(),
        |_| {},
    )
    .await;
    assert!(matches!(result, Err(HubError::InvalidRepoId { .. })));
    assert_eq!(job.state, JobState::Failed);
    assert!(hub.requests().is_empty(), "refused before any request");

    // File names from the hub that would land outside the model folder.
    for name in [
        "../evil",
        "/abs",
        "sub/../../evil",
        "a\\..\\evil",
        "x.partial",
    ] {
        hub.set(|switches| switches.extra_names = vec![name.into()]);
        let (result, ..) = pull(
            &client(&hub, None),
            &models_dir,
            REPO,
            &Control::new(),
            |_| {},
        )
        .await;
        assert!(
            matches!(result, Err(HubError::UnsafeFileName { name: ref got, .. }) if got == name),
            "{name}: {result:?}"
        );
        assert_eq!(std::fs::read_dir(&models_dir).unwrap().count(), 0, "{name}");
    }
    hub.set(|switches| switches.extra_names.clear());

    // A model folder (or org folder) that is a symlink to somewhere else.
    #[cfg(unix)]
    for link in ["test", "test/qwen3-tiny"] {
        let outside = tempfile::tempdir().unwrap();
        let link_path = models_dir.join(link);
        std::fs::create_dir_all(link_path.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(outside.path(), &link_path).unwrap();
        let (result, ..) = pull(
            &client(&hub, None),
            &models_dir,
            REPO,
            &Control::new(),
            |_| {},
        )
        .await;
        assert!(
            matches!(result, Err(HubError::PathEscape { .. })),
            "{link}: {result:?}"
        );
        assert_eq!(
            std::fs::read_dir(outside.path()).unwrap().count(),
            0,
            "{link}"
        );
        std::fs::remove_file(&link_path).unwrap();
    }

    // A `.partial` planted as a symlink to a file outside.
    #[cfg(unix)]
    {
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().join("victim");
        std::fs::write(&target, b"keep me").unwrap();
        let model_dir = models_dir.join(REPO);
        std::fs::create_dir_all(&model_dir).unwrap();
        std::os::unix::fs::symlink(&target, model_dir.join(format!("{WEIGHTS}.partial"))).unwrap();
        let (result, ..) = pull(
            &client(&hub, None),
            &models_dir,
            REPO,
            &Control::new(),
            |_| {},
        )
        .await;
        assert!(
            matches!(result, Err(HubError::PathEscape { .. })),
            "{result:?}"
        );
        assert_eq!(std::fs::read(&target).unwrap(), b"keep me");
    }
    let leaked: Vec<_> = std::fs::read_dir(sandbox.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(leaked, vec![std::ffi::OsString::from("models")]);
}

/// Trickles the weights so a pause or cancel lands mid-file.
fn slow_hub() -> TestHub {
    let hub = hub();
    hub.set(|switches| switches.trickle = Some(Duration::from_millis(10)));
    hub
}

/// Signals the control once the weights have started arriving.
fn stop_mid_weights(control: &Control, cancel: bool) -> impl FnMut(&Job) + Send {
    let control = control.clone();
    move |job: &Job| {
        let weights = job.files.iter().find(|file| file.name == WEIGHTS);
        if weights.is_some_and(|file| file.bytes_done > 0 && file.state == FileState::Running) {
            if cancel {
                control.cancel();
            } else {
                control.pause();
            }
        }
    }
}

#[tokio::test]
async fn pause_keeps_the_partial_and_resume_finishes_it() {
    let hub = slow_hub();
    let models = tempfile::tempdir().unwrap();
    let control = Control::new();
    let (result, job, _) = pull(
        &client(&hub, None),
        models.path(),
        REPO,
        &control,
        stop_mid_weights(&control, false),
    )
    .await;
    assert!(matches!(result, Err(HubError::Paused)), "{result:?}");
    assert_eq!(job.state, JobState::Paused);
    assert_eq!(job.error, None);
    let partial = models.path().join(REPO).join(format!("{WEIGHTS}.partial"));
    let kept = std::fs::metadata(&partial).unwrap().len();
    assert!(kept > 0 && kept < 823_289, "kept {kept}");
    let weights = job.files.iter().find(|file| file.name == WEIGHTS).unwrap();
    assert_eq!(
        (weights.bytes_done, weights.state),
        (kept, FileState::Pending)
    );

    hub.set(|switches| switches.trickle = None);
    hub.clear_requests();
    let (result, job, _) = pull(
        &client(&hub, None),
        models.path(),
        REPO,
        &Control::new(),
        |_| {},
    )
    .await;
    assert_identical(&result.unwrap());
    assert_eq!(job.state, JobState::Done);
    assert_eq!(
        file_requests(&hub, WEIGHTS),
        vec![Some(format!("bytes={kept}-"))]
    );
}

#[tokio::test]
async fn cancel_removes_the_partials() {
    let hub = slow_hub();
    let models = tempfile::tempdir().unwrap();
    let control = Control::new();
    let (result, job, _) = pull(
        &client(&hub, None),
        models.path(),
        REPO,
        &control,
        stop_mid_weights(&control, true),
    )
    .await;
    assert!(matches!(result, Err(HubError::Cancelled)), "{result:?}");
    assert_eq!(job.state, JobState::Cancelled);
    assert_eq!(partials(models.path()), Vec::<PathBuf>::new());
    assert!(!models.path().join(REPO).join(WEIGHTS).exists());
    assert!(!models.path().join(REPO).join("config.json").exists());
}
