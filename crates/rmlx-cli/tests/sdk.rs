//! The official Python SDKs (`openai`, `anthropic`, pinned in scripts/sdk-venv) against this
//! build's `rmlx serve` on loopback: tests/sdk/test_openai_anthropic.py. Without `.venv-sdk`
//! the test says how to get it and passes, so `cargo test` stays offline; with
//! `RMLX_REQUIRE_SDK=1` a missing venv fails instead.

use std::{path::Path, process::Command};

#[test]
fn official_python_sdks_against_rmlx_serve() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = root.join(".venv-sdk/bin/python");
    if !python.exists() {
        assert!(
            std::env::var("RMLX_REQUIRE_SDK").as_deref() != Ok("1"),
            "RMLX_REQUIRE_SDK=1 but .venv-sdk is missing: run scripts/sdk-venv"
        );
        eprintln!("skipped: no .venv-sdk (run scripts/sdk-venv to enable the SDK tests)");
        return;
    }
    let status = Command::new(python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/sdk"])
        .current_dir(&root)
        .env("RMLX_BIN", env!("CARGO_BIN_EXE_rmlx"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .status()
        .expect("python runs");
    assert!(
        status.success(),
        "tests/sdk failed (see the pytest output above)"
    );
}
