//! The model manager's server side (docs/MODELS-API.md): `/admin/downloads` against the
//! imitation hub, the extra `/v1/models` fields, and `DELETE /v1/models/{id}`; model ids and
//! folders never escape the models folders.

mod common;

use std::{path::Path, time::Duration};

use axum::{http::Method, Router};
use common::{get, post, send, ServerConfigExt, MODEL};
use rmlx_hub::testing::{fixture, fixture_hub, repo_files, TestHub, FIXTURE_REPO};
use rmlx_server::ServerConfig;
use serde_json::{json, Value};

const ENCODED: &str = "test%2Fqwen3-tiny";

/// A server on the fixture (`--model`), a fresh models folder and an empty hub cache, whose
/// downloads come from `hub`.
fn server(hub: &TestHub, models: &Path) -> Router {
    let config = ServerConfigExt::with(|config| {
        config.models_dir = Some(models.to_path_buf());
        config.hub_url = Some(hub.url().to_string());
    });
    common::router(config).0
}

/// Polls the job until it leaves the active states (what the browser UI does).
async fn settle(router: &Router, id: &str) -> Value {
    for _ in 0..600 {
        let job = get(router, &format!("/admin/downloads/{id}")).await.json();
        if !["queued", "listing", "running", "verifying"].contains(&job["state"].as_str().unwrap())
        {
            return job;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("download {id} did not finish in 30 s");
}

/// Polls until the weights file has bytes on the way.
async fn until_weights_arrive(router: &Router, id: &str) {
    for _ in 0..400 {
        let job = get(router, &format!("/admin/downloads/{id}")).await.json();
        let arriving = job["files"].as_array().unwrap().iter().any(|file| {
            file["name"] == "model.safetensors" && file["bytes_done"].as_u64().unwrap() > 0
        });
        if job["state"] == "running" && arriving {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no bytes arrived for {id}");
}

/// A download from a hub that sends its bytes slowly, caught while the weights arrive.
async fn slow_download(models: &Path) -> (TestHub, Router, String) {
    let hub = fixture_hub();
    hub.set(|switches| switches.trickle = Some(Duration::from_millis(10)));
    let router = server(&hub, models);
    let id = start(&router, json!({"repo": FIXTURE_REPO})).await;
    until_weights_arrive(&router, &id).await;
    (hub, router, id)
}

/// Starts a download; its job id.
async fn start(router: &Router, body: Value) -> String {
    let reply = post(router, "/admin/downloads", &body).await;
    assert_eq!(reply.status, 202, "{}", reply.text);
    reply.json()["id"].as_str().unwrap().to_string()
}

async fn delete(router: &Router, path: &str) -> common::Reply {
    send(router, Method::DELETE, path, None, &[]).await
}

fn listed(models: &Value, id: &str) -> Option<Value> {
    models["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|model| model["id"] == id)
        .cloned()
}

fn greedy(model: &str) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "temperature": 0,
    })
}

#[tokio::test]
async fn a_downloaded_model_is_listed_chats_like_its_source_and_deletes() {
    let hub = fixture_hub();
    let models = tempfile::tempdir().unwrap();
    let router = server(&hub, models.path());

    let id = start(&router, json!({"repo": FIXTURE_REPO})).await;
    let job = settle(&router, &id).await;
    assert_eq!(job["state"], "done", "{job}");
    assert_eq!(job["model_id"], FIXTURE_REPO);
    assert_eq!(job["bytes_done"], job["bytes_total"]);
    let list = get(&router, "/admin/downloads").await.json();
    assert_eq!(list["data"][0]["id"], id.as_str());

    let folder = models.path().join(FIXTURE_REPO);
    let mut total = 0;
    for (name, source) in repo_files(&fixture("qwen3-tiny")) {
        let bytes = std::fs::read(&source).unwrap();
        total += bytes.len() as u64;
        assert_eq!(std::fs::read(folder.join(&name)).unwrap(), bytes, "{name}");
    }

    let overview = get(&router, "/v1/models").await.json();
    let memory = &overview["memory"];
    assert!(memory["total_bytes"].as_u64().unwrap() >= memory["available_bytes"].as_u64().unwrap());
    let downloaded = listed(&overview, FIXTURE_REPO).expect("the download is listed");
    assert_eq!(downloaded["source"], "models_dir");
    assert_eq!(downloaded["deletable"], true);
    assert_eq!(downloaded["size_bytes"], total);
    assert_eq!(downloaded["model_type"], "qwen3");
    assert_eq!(downloaded["quantization"], Value::Null);
    assert_eq!(downloaded["fits"], "yes");
    assert_eq!(downloaded["owned_by"], "test");
    let given = listed(&overview, MODEL).unwrap();
    assert_eq!(
        (&given["source"], &given["deletable"]),
        (&json!("model"), &json!(false))
    );

    // Same weights, same greedy answer, through the id the download got.
    let theirs = post(&router, "/v1/chat/completions", &greedy(MODEL)).await;
    let ours = post(&router, "/v1/chat/completions", &greedy(FIXTURE_REPO)).await;
    assert_eq!(ours.status, 200, "{}", ours.text);
    assert_eq!(
        ours.json()["choices"][0]["message"]["content"],
        theirs.json()["choices"][0]["message"]["content"]
    );
    let loaded = listed(&get(&router, "/v1/models").await.json(), FIXTURE_REPO).unwrap();
    assert_eq!(loaded["loaded"], true);
    assert!(loaded["parameters"].as_u64().unwrap() > 0);

    // The id arrives percent-encoded from the UI; deleting unloads and removes `org/` too.
    let deleted = delete(&router, &format!("/v1/models/{ENCODED}")).await;
    assert_eq!(deleted.status, 200, "{}", deleted.text);
    assert_eq!(
        deleted.json(),
        json!({"id": FIXTURE_REPO, "object": "model", "deleted": true})
    );
    assert!(!models.path().join("test").exists());
    assert!(models.path().exists());
    assert!(listed(&get(&router, "/v1/models").await.json(), FIXTURE_REPO).is_none());
    let again = delete(&router, &format!("/v1/models/{ENCODED}")).await;
    assert_eq!(again.status, 404, "{}", again.text);

    // A finished job is cleared from the list by DELETE; the job is then gone.
    let cleared = delete(&router, &format!("/admin/downloads/{id}")).await;
    assert_eq!(cleared.json()["state"], "done");
    assert_eq!(
        get(&router, &format!("/admin/downloads/{id}")).await.status,
        404
    );
}

#[tokio::test]
async fn a_quantized_download_reports_its_quantization() {
    let hub = TestHub::start();
    hub.add_repo("test/qwen3-tiny-4bit", fixture("qwen3-tiny-4bit"));
    let models = tempfile::tempdir().unwrap();
    let router = server(&hub, models.path());
    let id = start(
        &router,
        json!({"repo": "test/qwen3-tiny-4bit", "revision": "main"}),
    )
    .await;
    let job = settle(&router, &id).await;
    assert_eq!(job["state"], "done", "{job}");
    let model = listed(
        &get(&router, "/v1/models").await.json(),
        "test/qwen3-tiny-4bit",
    )
    .unwrap();
    assert_eq!(
        model["quantization"],
        json!({"bits": 4, "group_size": 64, "mode": "affine"})
    );
}

#[tokio::test]
async fn a_paused_download_is_not_a_model_until_it_resumes() {
    let models = tempfile::tempdir().unwrap();
    let (hub, router, id) = slow_download(models.path()).await;
    // The same repository again answers the running job instead of a second writer.
    let twice = post(&router, "/admin/downloads", &json!({"repo": FIXTURE_REPO})).await;
    assert_eq!(twice.json()["id"], id.as_str());

    let paused = post(&router, &format!("/admin/downloads/{id}/pause"), &json!({})).await;
    assert_eq!(paused.json()["state"], "paused", "{}", paused.text);
    let partial = models
        .path()
        .join(FIXTURE_REPO)
        .join("model.safetensors.partial");
    assert!(partial.is_file());
    assert!(listed(&get(&router, "/v1/models").await.json(), FIXTURE_REPO).is_none());
    let missing = delete(&router, &format!("/v1/models/{ENCODED}")).await;
    assert_eq!(missing.status, 404, "{}", missing.text);
    let twice = post(&router, &format!("/admin/downloads/{id}/pause"), &json!({})).await;
    assert_eq!(twice.status, 409, "{}", twice.text);

    hub.set(|switches| switches.trickle = None);
    hub.clear_requests();
    let resumed = post(
        &router,
        &format!("/admin/downloads/{id}/resume"),
        &json!({}),
    )
    .await;
    assert_eq!(resumed.status, 200, "{}", resumed.text);
    assert_eq!(settle(&router, &id).await["state"], "done");
    // It continued from the partial file rather than starting over.
    assert!(hub
        .requests()
        .iter()
        .any(|request| request.path.ends_with("/model.safetensors")
            && request
                .range
                .as_deref()
                .is_some_and(|range| range != "bytes=0-")));
    assert!(listed(&get(&router, "/v1/models").await.json(), FIXTURE_REPO).is_some());
}

#[tokio::test]
async fn cancelling_removes_partials_and_a_corrupt_file_fails_the_job() {
    let models = tempfile::tempdir().unwrap();
    let (hub, router, id) = slow_download(models.path()).await;
    let cancelled = delete(&router, &format!("/admin/downloads/{id}")).await;
    assert_eq!(cancelled.json()["state"], "cancelled", "{}", cancelled.text);
    // Stopped and gone: a deleted job is not listed or found any more.
    assert_eq!(
        get(&router, &format!("/admin/downloads/{id}")).await.status,
        404
    );
    let leftovers: Vec<_> = walk(models.path())
        .into_iter()
        .filter(|path| path.to_string_lossy().ends_with(".partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    hub.set(|switches| {
        switches.trickle = None;
        switches.corrupt = Some("model.safetensors".into());
    });
    let id = start(&router, json!({"repo": FIXTURE_REPO})).await;
    let job = settle(&router, &id).await;
    assert_eq!(job["state"], "failed", "{job}");
    assert!(job["error"].as_str().unwrap().contains("mismatch"), "{job}");
    assert!(listed(&get(&router, "/v1/models").await.json(), FIXTURE_REPO).is_none());
}

#[tokio::test]
async fn bad_requests_get_typed_errors() {
    let hub = fixture_hub();
    let models = tempfile::tempdir().unwrap();
    let router = server(&hub, models.path());
    for (body, status) in [
        (json!({"repo": "../evil"}), 400),
        (json!({"repo": "/etc/passwd"}), 400),
        (json!({"repo": "a/b/c"}), 400),
        (json!({"repo": 5}), 400),
        (json!({"repo": FIXTURE_REPO, "revision": "../main"}), 400),
        (
            json!({"repo": FIXTURE_REPO, "revision": "main branch"}),
            400,
        ),
        (json!({"repo": FIXTURE_REPO, "extra": 1}), 400),
        (json!({}), 400),
    ] {
        let reply = post(&router, "/admin/downloads", &body).await;
        assert_eq!(reply.status, status, "{body}: {}", reply.text);
        assert!(reply.json()["error"]["message"].is_string());
    }
    let malformed = send(
        &router,
        Method::POST,
        "/admin/downloads",
        Some("{".into()),
        &[],
    )
    .await;
    assert_eq!(malformed.status, 400);
    assert_eq!(get(&router, "/admin/downloads/dl-99").await.status, 404);
    let unknown = post(&router, "/admin/downloads/dl-99/pause", &json!({})).await;
    assert_eq!(unknown.status, 404);
    let action = post(&router, "/admin/downloads/dl-99/explode", &json!({})).await;
    assert_eq!(action.status, 404);
    assert!(walk(models.path()).is_empty(), "nothing was written");

    // A repository the hub does not have fails the job with the hub's answer.
    let id = start(&router, json!({"repo": "test/absent"})).await;
    let job = settle(&router, &id).await;
    assert_eq!(job["state"], "failed");
    assert!(
        job["error"].as_str().unwrap().contains("not found"),
        "{job}"
    );

    // Without a models folder there is nowhere to download to.
    let bare = common::router(common::config()).0;
    let reply = post(&bare, "/admin/downloads", &json!({"repo": FIXTURE_REPO})).await;
    assert_eq!(reply.status, 400);
    assert!(reply.text.contains("--models-dir"), "{}", reply.text);
}

#[tokio::test]
async fn deletes_stay_inside_the_model_folders() {
    let hub = fixture_hub();
    let root = tempfile::tempdir().unwrap();
    let (models, cache, outside) = (
        root.path().join("models"),
        root.path().join("hub"),
        root.path().join("outside"),
    );
    // A model outside every root, reachable only through a symlink in the models folder.
    copy_model(&fixture("qwen3-tiny"), &outside);
    std::fs::create_dir_all(&models).unwrap();
    std::os::unix::fs::symlink(&outside, models.join("escape")).unwrap();
    // A hub-cache model: snapshot files are symlinks into blobs/.
    let repo = cache.join("models--org--cached");
    let snapshot = repo.join("snapshots/abc");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "abc").unwrap();
    std::fs::copy(fixture("qwen3-tiny/config.json"), repo.join("blobs/1")).unwrap();
    std::os::unix::fs::symlink(repo.join("blobs/1"), snapshot.join("config.json")).unwrap();

    let router = common::router(ServerConfigExt::with(|config| {
        config.models_dir = Some(models.clone());
        config.hf_cache = Some(cache.clone());
        config.hub_url = Some(hub.url().to_string());
    }))
    .0;
    let overview = get(&router, "/v1/models").await.json();
    assert!(listed(&overview, "escape").is_none(), "{overview}");
    let cached = listed(&overview, "org/cached").unwrap();
    assert_eq!(cached["source"], "hf_cache");
    assert_eq!(
        cached["size_bytes"],
        std::fs::metadata(fixture("qwen3-tiny/config.json"))
            .unwrap()
            .len()
    );

    for (id, status) in [
        ("escape", 404),
        ("..%2Foutside", 400),
        ("%2Fetc", 400),
        ("org%2F..%2F..%2Foutside", 400),
        // A --model folder: a conflict with how the server was started, not a bad request.
        (MODEL, 409),
    ] {
        let reply = delete(&router, &format!("/v1/models/{id}")).await;
        assert_eq!(reply.status, status, "{id}: {}", reply.text);
    }
    let refused = delete(&router, &format!("/v1/models/{MODEL}")).await.json();
    assert_eq!(refused["error"]["code"], "conflict", "{refused}");
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("was given with --model")
            && message.contains("does not delete folders it was pointed at"),
        "{message}"
    );
    assert!(fixture("qwen3-tiny/config.json").is_file());
    // Loading goes through the same resolution: nothing outside the roots loads either.
    for (id, status) in [
        ("escape", 404),
        ("..%2Foutside", 400),
        ("%2Fetc", 400),
        ("org%2F..%2F..%2Foutside", 400),
    ] {
        let reply = post(&router, &format!("/v1/models/{id}/load"), &json!({})).await;
        assert_eq!(reply.status, status, "load {id}: {}", reply.text);
    }
    assert!(outside.join("model.safetensors").is_file());
    assert!(fixture("qwen3-tiny/model.safetensors").is_file());
    assert!(models.join("escape").exists());

    // A hub-cache model goes with its whole repository folder; the blobs are not followed out.
    let deleted = delete(&router, "/v1/models/org%2Fcached").await;
    assert_eq!(deleted.status, 200, "{}", deleted.text);
    assert!(!repo.exists());
    assert!(cache.exists() && fixture("qwen3-tiny/config.json").is_file());
}

#[tokio::test]
async fn admin_routes_need_the_key_when_one_is_set() {
    let hub = fixture_hub();
    let models = tempfile::tempdir().unwrap();
    let router = common::router(ServerConfigExt::with(|config| {
        config.models_dir = Some(models.path().to_path_buf());
        config.hub_url = Some(hub.url().to_string());
        config.api_key = Some("sesame".into());
    }))
    .0;
    let body = Some(json!({"repo": FIXTURE_REPO}).to_string());
    let refused = send(&router, Method::POST, "/admin/downloads", body.clone(), &[]).await;
    assert_eq!(refused.status, 401);
    assert_eq!(
        send(&router, Method::GET, "/admin/downloads", None, &[])
            .await
            .status,
        401
    );
    let delete = delete(&router, &format!("/v1/models/{MODEL}")).await;
    assert_eq!(delete.status, 401);
    assert!(hub.requests().is_empty());
    let key = [("authorization", "Bearer sesame")];
    let accepted = send(&router, Method::POST, "/admin/downloads", body, &key).await;
    assert_eq!(accepted.status, 202, "{}", accepted.text);
}

fn copy_model(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for (name, path) in repo_files(from) {
        std::fs::copy(path, to.join(name)).unwrap();
    }
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(walk(&path));
        } else {
            found.push(path);
        }
    }
    found
}

/// The app's settings change: same engine and loaded model, new config; the download jobs stay
/// when the folder and hub do, and a new folder gets its own (empty) job list.
#[tokio::test]
async fn a_reconfigured_state_keeps_the_engine_and_chosen_downloads() {
    let hub = fixture_hub();
    let (first, second) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (router, state) = common::router(ServerConfigExt::with(|config| {
        config.models_dir = Some(first.path().to_path_buf());
        config.hub_url = Some(hub.url().to_string());
    }));
    let id = start(&router, json!({"repo": FIXTURE_REPO})).await;
    assert_eq!(settle(&router, &id).await["state"], "done");
    let loaded = post(&router, &format!("/v1/models/{MODEL}/load"), &json!({})).await;
    assert_eq!(loaded.status, 200, "{}", loaded.text);

    let capped = state.config.as_ref().clone();
    let kept = state
        .reconfigured(
            ServerConfig {
                max_ctx: Some(256),
                ..capped
            },
            true,
        )
        .unwrap();
    let kept_router = rmlx_server::app(kept.clone());
    let jobs = get(&kept_router, "/admin/downloads").await.json();
    assert_eq!(jobs["data"][0]["id"], id.as_str());
    let model = listed(&get(&kept_router, "/v1/models").await.json(), MODEL).unwrap();
    assert_eq!(
        (&model["loaded"], &model["context_length"]),
        (&json!(true), &json!(256))
    );

    let moved = ServerConfig {
        models_dir: Some(second.path().to_path_buf()),
        ..state.config.as_ref().clone()
    };
    let fresh = rmlx_server::app(state.reconfigured(moved, false).unwrap());
    assert_eq!(
        get(&fresh, "/admin/downloads").await.json()["data"],
        json!([])
    );
    let overview = get(&fresh, "/v1/models").await.json();
    assert!(listed(&overview, FIXTURE_REPO).is_none(), "{overview}");
}
