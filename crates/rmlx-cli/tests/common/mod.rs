//! What the tests driving Python (the SDK and contract suites) share.

use std::path::{Path, PathBuf};

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `.venv-sdk`'s Python (scripts/sdk-venv makes it), or `None` after saying how to get it; with
/// `RMLX_REQUIRE_SDK=1` a missing venv fails instead, so `make test` never skips these.
pub fn sdk_python(what: &str) -> Option<PathBuf> {
    let python = root().join(".venv-sdk/bin/python");
    if python.exists() {
        return Some(python);
    }
    assert!(
        std::env::var("RMLX_REQUIRE_SDK").as_deref() != Ok("1"),
        "RMLX_REQUIRE_SDK=1 but .venv-sdk is missing: run scripts/sdk-venv"
    );
    eprintln!("skipped: no .venv-sdk (run scripts/sdk-venv to enable the {what})");
    None
}
