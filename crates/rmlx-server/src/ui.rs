//! The web UI built into the binary (`build.rs` embeds `ui/dist`): `/` is its `index.html`,
//! every other file by its path under `ui/dist`, with its content type. Hashed asset names
//! change with their content, so those may be cached for good; the page itself is revalidated.
//! Reference: tower-http `ServeDir` (what `--ui-dir` uses), which this mirrors for a built-in map.

use axum::{
    body::Body,
    http::{header, HeaderValue, Response, StatusCode, Uri},
    response::IntoResponse,
};

mod files {
    include!(concat!(env!("OUT_DIR"), "/ui_files.rs"));
}

/// Whether this build carries a UI (it does when `ui/dist` was built before the server).
pub fn embedded() -> bool {
    !files::FILES.is_empty()
}

fn content_type(name: &str) -> &'static str {
    match name.rsplit('.').next().unwrap_or("") {
        "html" => "text/html; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "json" | "webmanifest" => "application/json",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "ico" => "image/x-icon",
        "woff2" => "font/woff2",
        "woff" => "font/woff",
        "txt" => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    }
}

/// Serves `uri` from the embedded files; a path that is not one of them is a 404.
pub async fn serve(uri: Uri) -> impl IntoResponse {
    let path = uri.path().trim_start_matches('/');
    let name = if path.is_empty() { "index.html" } else { path };
    let Some((name, bytes)) = files::FILES.iter().find(|(file, _)| *file == name) else {
        return crate::models::not_found(uri).await.into_response();
    };
    let cache = if name.starts_with("assets/") {
        "public, max-age=31536000, immutable"
    } else {
        "no-cache"
    };
    let mut response = Response::new(Body::from(*bytes));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(content_type(name)),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static(cache));
    *response.status_mut() = StatusCode::OK;
    response.into_response()
}
