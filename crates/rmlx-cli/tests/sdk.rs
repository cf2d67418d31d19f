//! The official Python SDKs (`openai`, `anthropic`, pinned in scripts/sdk-venv) against this
//! build's `rmlx serve` on loopback: tests/sdk/test_openai_anthropic.py. Without `.venv-sdk`
//! the test says how to get it and passes, so `cargo test` stays offline; with
//! `RMLX_REQUIRE_SDK=1` a missing venv fails instead.

mod common;

use std::process::Command;

#[test]
fn official_python_sdks_against_rmlx_serve() {
    let root = common::root();
    let Some(python) = common::sdk_python("SDK tests") else {
        return;
    };
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
