//! docs/openapi.yaml is the document the server's types generate (`rmlx openapi` writes it), so
//! a change to a request or response type that is not written back fails here. The routes
//! themselves are checked against a real server by tests/api (crates/rmlx-cli/tests/contract.rs).

use std::path::Path;

#[test]
fn committed_document_is_current() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.yaml");
    let current = rmlx_server::openapi::yaml();
    if std::env::var("RMLX_WRITE_OPENAPI").as_deref() == Ok("1") {
        std::fs::write(&path, &current).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == current,
        "docs/openapi.yaml is stale: run `cargo run -p rmlx-cli -- openapi > docs/openapi.yaml` \
         (or this test with RMLX_WRITE_OPENAPI=1)"
    );
}

#[test]
fn document_names_every_route_and_both_error_shapes() {
    let document: serde_json::Value =
        serde_json::to_value(rmlx_server::openapi::document()).unwrap();
    assert_eq!(document["openapi"], "3.1.0");
    let paths = document["paths"].as_object().unwrap();
    let mut operations: Vec<String> = paths
        .iter()
        .flat_map(|(path, item)| {
            item.as_object()
                .unwrap()
                .keys()
                .filter(|key| ["get", "post", "delete", "put", "patch"].contains(&key.as_str()))
                .map(move |method| format!("{} {path}", method.to_uppercase()))
        })
        .collect();
    operations.sort();
    assert_eq!(
        operations,
        [
            "DELETE /admin/cache/disk",
            "DELETE /admin/downloads/{id}",
            "DELETE /v1/models/{id}",
            "GET /admin/downloads",
            "GET /admin/downloads/{id}",
            "GET /health",
            "GET /metrics",
            "GET /metrics/cache",
            "GET /openapi.json",
            "GET /v1/models",
            "GET /v1/models/{id}",
            "POST /admin/downloads",
            "POST /admin/downloads/{id}/pause",
            "POST /admin/downloads/{id}/resume",
            "POST /v1/chat/completions",
            "POST /v1/completions",
            "POST /v1/messages",
            "POST /v1/messages/count_tokens",
            "POST /v1/models/{id}/load",
            "POST /v1/models/{id}/unload",
            "POST /v1/responses",
        ]
    );
    // Errors are shared responses, one set per API shape.
    let error_of = |path: &str, method: &str| {
        let reference = document["paths"][path][method]["responses"]["400"]["$ref"]
            .as_str()
            .unwrap()
            .trim_start_matches("#/components/responses/")
            .to_string();
        document["components"]["responses"][&reference]["content"]["application/json"]["schema"]
            ["$ref"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(
        error_of("/v1/messages", "post"),
        "#/components/schemas/AnthropicError"
    );
    assert_eq!(
        error_of("/v1/chat/completions", "post"),
        "#/components/schemas/OpenAiError"
    );
}

/// Every string of `pieces` up to `depth` pieces long.
fn strings(pieces: &[&str], depth: usize) -> Vec<String> {
    let mut all = vec![String::new()];
    let mut last = all.clone();
    for _ in 0..depth {
        last = last
            .iter()
            .flat_map(|s| pieces.iter().map(move |piece| format!("{s}{piece}")))
            .collect();
        all.extend(last.iter().cloned());
    }
    all
}

/// The download body's patterns take exactly what the hub's checks take (the model id and
/// image patterns are checked against the server's own in `constraints`).
#[test]
fn download_patterns_are_the_hubs_checks() {
    let document = rmlx_server::openapi::document();
    let properties = &document["components"]["schemas"]["StartDownload"]["properties"];
    let pattern = |field: &str| {
        fancy_regex::Regex::new(properties[field]["pattern"].as_str().unwrap()).unwrap()
    };
    let repo = pattern("repo");
    for id in strings(&["a", "/", ".", "..", "-", "_", "é", " "], 4) {
        assert_eq!(
            repo.is_match(&id).unwrap(),
            rmlx_hub::RepoId::parse(&id).is_ok(),
            "{id:?}"
        );
    }
    let revision = pattern("revision");
    let pieces = [
        "a", "/", ".", "@", "{", "~", " ", "\u{a0}", "\u{1f}", "\u{feff}", "é", "\\",
    ];
    let mut revisions = strings(&pieces, 3);
    revisions.extend([
        "x".repeat(256),
        "x".repeat(257),
        "é".repeat(256),
        "é".repeat(257),
    ]);
    for name in revisions {
        assert_eq!(
            revision.is_match(&name).unwrap(),
            rmlx_hub::check_revision(&name).is_ok(),
            "{name:?}"
        );
    }
}
