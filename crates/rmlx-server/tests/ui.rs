//! `--ui-dir`: the built web UI is served at `/` without the API key (the page must load
//! before the user can type one), while the API beside it still requires the key.

mod common;

use axum::http::{Method, StatusCode};
use common::*;

#[tokio::test]
async fn the_ui_loads_without_the_key_and_the_api_still_needs_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("index.html"),
        "<!doctype html><title>rMLX</title>",
    )
    .unwrap();
    std::fs::create_dir(dir.path().join("assets")).unwrap();
    std::fs::write(dir.path().join("assets/app.js"), "console.log(1)").unwrap();
    let (app, _) = router(ServerConfigExt::with(|c| {
        c.api_key = Some("k".into());
        c.ui_dir = Some(dir.path().to_path_buf());
    }));
    let page = get(&app, "/").await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.text.contains("<title>rMLX</title>"));
    assert_eq!(get(&app, "/assets/app.js").await.text, "console.log(1)");
    assert_eq!(get(&app, "/missing.js").await.status, StatusCode::NOT_FOUND);
    assert_eq!(
        get(&app, "/v1/models").await.status,
        StatusCode::UNAUTHORIZED
    );
    let listed = send(
        &app,
        Method::GET,
        "/v1/models",
        None,
        &[("authorization", "Bearer k")],
    )
    .await;
    assert_eq!(listed.status, StatusCode::OK);
    // Without a UI folder, `/` is the API's JSON 404.
    let (plain, _) = router(config());
    let reply = get(&plain, "/").await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
    assert!(reply.json()["error"].is_object());
}
