//! The job registry a server holds (docs/MODELS-API.md `/admin/downloads`), driven the way async
//! handlers would: start, watch progress, pause, resume, cancel, list, against the imitation hub.
//! Reference: huggingface_hub `file_download.py` (the download each job runs).

use std::time::Duration;

use rmlx_hub::{
    testing::{fixture, TestHub},
    DownloadManager, HubClient, HubConfig, HubError, JobState,
};

const REPO: &str = "test/qwen3-tiny";

fn manager(hub: &TestHub, models_dir: &std::path::Path) -> DownloadManager {
    let client = HubClient::new(HubConfig {
        endpoint: hub.url().to_string(),
        token: None,
    })
    .unwrap();
    DownloadManager::new(client, models_dir)
}

fn slow_hub() -> TestHub {
    let hub = TestHub::start();
    hub.add_repo(REPO, fixture("qwen3-tiny"));
    hub.set(|switches| switches.trickle = Some(Duration::from_millis(10)));
    hub
}

/// Waits (through the watch channel, as a UI event loop would) until the weights are arriving.
async fn until_running_with_bytes(manager: &DownloadManager, id: &str) {
    let mut updates = manager.subscribe();
    tokio::time::timeout(
        Duration::from_secs(10),
        updates.wait_for(|jobs| {
            jobs.iter().any(|job| {
                job.id == id
                    && job.state == JobState::Running
                    && job
                        .files
                        .iter()
                        .any(|file| file.name == "model.safetensors" && file.bytes_done > 0)
            })
        }),
    )
    .await
    .expect("progress within 10 s")
    .unwrap();
}

#[tokio::test]
async fn start_pause_resume_to_done() {
    let hub = slow_hub();
    let models = tempfile::tempdir().unwrap();
    let manager = manager(&hub, models.path());
    let job = manager.start(REPO, None).unwrap();
    assert_eq!((job.id.as_str(), job.revision.as_str()), ("dl-1", "main"));
    assert!(job.state.is_active());
    // Starting the same repository again does not start a second writer.
    assert_eq!(manager.start(REPO, Some("main")).unwrap().id, "dl-1");
    assert_eq!(manager.list().len(), 1);

    until_running_with_bytes(&manager, &job.id).await;
    let paused = manager.pause(&job.id).await.unwrap();
    assert_eq!(paused.state, JobState::Paused);
    assert!(paused.bytes_done > 0 && paused.bytes_done < paused.bytes_total);
    assert!(matches!(
        manager.pause(&job.id).await,
        Err(HubError::InvalidState {
            action: "pause",
            state: "paused",
            ..
        })
    ));
    // The job JSON of the contract.
    let value = serde_json::to_value(&paused).unwrap();
    assert_eq!(value["state"], "paused");
    assert_eq!(value["files"].as_array().unwrap().len(), 8);
    assert!(value["model_id"].is_null());

    hub.set(|switches| switches.trickle = None);
    let resumed = manager.resume(&job.id).unwrap();
    assert_eq!(resumed.state, JobState::Queued);
    let done = tokio::time::timeout(Duration::from_secs(10), manager.wait(&job.id))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.state, JobState::Done, "{:?}", done.error);
    assert_eq!(done.model_id.as_deref(), Some(REPO));
    assert_eq!(done.bytes_done, done.bytes_total);
    assert!(models.path().join(REPO).join("config.json").is_file());
    assert!(
        hub.requests().iter().any(|request| request.range.is_some()),
        "the resume used Range"
    );
    assert_eq!(manager.subscribe().borrow().clone(), manager.list());
    assert!(matches!(
        manager.cancel(&job.id).await,
        Err(HubError::InvalidState {
            action: "cancel",
            ..
        })
    ));
    assert_eq!(manager.forget(&job.id).unwrap().id, job.id);
    assert!(manager.list().is_empty());
}

#[tokio::test]
async fn cancel_running_and_paused_jobs_removes_partials() {
    let hub = slow_hub();
    let models = tempfile::tempdir().unwrap();
    let manager = manager(&hub, models.path());
    let partial = models.path().join(REPO).join("model.safetensors.partial");

    let running = manager.start(REPO, None).unwrap();
    until_running_with_bytes(&manager, &running.id).await;
    let cancelled = manager.cancel(&running.id).await.unwrap();
    assert_eq!(cancelled.state, JobState::Cancelled);
    assert!(!partial.exists());

    let paused = manager.start(REPO, None).unwrap();
    assert_ne!(paused.id, running.id, "a cancelled job is not reused");
    until_running_with_bytes(&manager, &paused.id).await;
    manager.pause(&paused.id).await.unwrap();
    assert!(partial.exists());
    let cancelled = manager.cancel(&paused.id).await.unwrap();
    assert_eq!(cancelled.state, JobState::Cancelled);
    assert!(!partial.exists());
    // Finished files stay (a later pull skips them); nothing partial counts any more.
    let finished: u64 = cancelled
        .files
        .iter()
        .filter(|file| file.state == rmlx_hub::FileState::Done)
        .map(|file| file.size)
        .sum();
    assert_eq!(cancelled.bytes_done, finished);
    assert!(cancelled
        .files
        .iter()
        .all(|file| file.state == rmlx_hub::FileState::Done
            || (file.state == rmlx_hub::FileState::Pending && file.bytes_done == 0)));
    // Cancelling twice is harmless; resuming a cancelled job is not allowed.
    assert_eq!(
        manager.cancel(&paused.id).await.unwrap().state,
        JobState::Cancelled
    );
    assert!(matches!(
        manager.resume(&paused.id),
        Err(HubError::InvalidState { .. })
    ));
}

#[tokio::test]
async fn bad_requests_fail_early_or_as_failed_jobs() {
    let hub = slow_hub();
    let models = tempfile::tempdir().unwrap();
    let manager = manager(&hub, models.path());
    assert!(matches!(
        manager.start("org/..", None),
        Err(HubError::InvalidRepoId { .. })
    ));
    assert!(matches!(
        manager.start("no-slash", None),
        Err(HubError::InvalidRepoId { .. })
    ));
    assert!(manager.get("dl-404").is_none());
    assert!(matches!(
        manager.resume("dl-404"),
        Err(HubError::JobNotFound(_))
    ));

    let missing = manager.start("test/missing", None).unwrap();
    let failed = manager.wait(&missing.id).await.unwrap();
    assert_eq!(failed.state, JobState::Failed);
    assert!(failed.error.unwrap().contains("repository not found"));
}
