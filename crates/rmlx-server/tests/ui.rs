//! The web UI at `/`, from `--ui-dir` or built into the binary: served without the API key (the
//! page must load before the user can type one), while the API beside it still requires it.

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

/// The UI built into the binary (`build.rs` embeds ui/dist, which `make` builds first): `/` is
/// the app's page with its hashed assets, served with their types and without the key; an
/// unknown path is the API's JSON 404; `--ui-dir` and `--no-ui` (embedded_ui off) win over it.
#[tokio::test]
async fn the_built_in_ui_is_served_at_the_root() {
    assert!(
        rmlx_server::ui::embedded(),
        "ui/dist was not built before the server: run `make ui-build` and build again"
    );
    let (app, _) = router(ServerConfigExt::with(|c| {
        c.api_key = Some("k".into());
        c.embedded_ui = true;
    }));
    let page = get(&app, "/").await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(page.headers["content-type"], "text/html; charset=utf-8");
    let shipped = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ui/dist/index.html"),
    )
    .unwrap();
    assert_eq!(
        page.text, shipped,
        "the page is the one ui/dist (the app) ships"
    );
    // Vite writes relative asset paths (`./assets/…`): the page works under any prefix.
    let script = page
        .text
        .split('"')
        .find(|part| part.starts_with("./assets/") && part.ends_with(".js"))
        .expect("the page loads a script from ./assets/");
    let asset = get(&app, &script[1..]).await;
    assert_eq!(asset.status, StatusCode::OK);
    assert_eq!(
        asset.headers["content-type"],
        "text/javascript; charset=utf-8"
    );
    assert!(asset.headers["cache-control"]
        .to_str()
        .unwrap()
        .contains("immutable"));
    let missing = get(&app, "/assets/nope.js").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert!(missing.json()["error"].is_object());
    assert_eq!(
        get(&app, "/v1/models").await.status,
        StatusCode::UNAUTHORIZED
    );

    let (api_only, _) = router(config());
    assert_eq!(get(&api_only, "/").await.status, StatusCode::NOT_FOUND);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("index.html"), "<title>other</title>").unwrap();
    let (other, _) = router(ServerConfigExt::with(|c| {
        c.embedded_ui = true;
        c.ui_dir = Some(dir.path().to_path_buf());
    }));
    assert_eq!(get(&other, "/").await.text, "<title>other</title>");
}
