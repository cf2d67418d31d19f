//! docs/SERVER.md against the server: the ```json example under the `/metrics/cache` heading
//! has exactly the keys (recursively; arrays through their first element) that the endpoint
//! serves after a request.

mod common;

use std::collections::BTreeSet;

use axum::http::StatusCode;
use common::*;
use rmlx_server::ServerConfig;
use serde_json::{json, Value};

/// Keys of a JSON value, recursively: object keys as paths, arrays through their first element.
fn key_paths(value: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                let path = format!("{prefix}.{key}");
                out.insert(path.clone());
                // error_counts is keyed by error kind: its keys are data, not shape.
                if key != "error_counts" {
                    key_paths(child, &path, out);
                }
            }
        }
        Value::Array(items) => {
            if let Some(first) = items.first() {
                key_paths(first, &format!("{prefix}[]"), out);
            }
        }
        _ => {}
    }
}

/// The first ```json block after the `/metrics/cache` heading of docs/SERVER.md.
fn documented_shape() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/SERVER.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let heading = doc
        .lines()
        .position(|line| line.starts_with('#') && line.contains("/metrics/cache"))
        .expect("a /metrics/cache heading in docs/SERVER.md");
    let rest: Vec<&str> = doc.lines().skip(heading + 1).collect();
    let start = rest
        .iter()
        .position(|l| l.trim() == "```json")
        .expect("a ```json block")
        + 1;
    let end = start
        + rest[start..]
            .iter()
            .position(|l| l.trim() == "```")
            .unwrap();
    serde_json::from_str(&rest[start..end].join("\n")).expect("the documented JSON parses")
}

#[tokio::test]
async fn documented_shape_matches_the_endpoint() {
    // With the disk cache on, so its object is checked too.
    let disk = tempfile::tempdir().unwrap();
    let (app, _) = router(ServerConfig {
        prefix_disk_dir: Some(disk.path().to_path_buf()),
        ..config()
    });
    let reply = post(
        &app,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let (mut live, mut documented) = (BTreeSet::new(), BTreeSet::new());
    let metrics = get(&app, "/metrics/cache").await;
    assert_eq!(metrics.status, StatusCode::OK);
    key_paths(&metrics.json(), "", &mut live);
    key_paths(&documented_shape(), "", &mut documented);
    assert_eq!(documented, live);
}
