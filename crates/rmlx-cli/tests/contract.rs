//! The OpenAPI contract against this build's `rmlx serve` on loopback: tests/api/test_contract.py
//! (the served document equals docs/openapi.yaml, every documented method and path is routed,
//! and schemathesis finds nothing) and tests/api/test_mixed_traffic.py (400 random requests of
//! four clients at once, every one answered, constrained answers valid). The imitation hub for
//! the download routes runs here, in this process. Without `.venv-sdk` the test says how to get
//! it and passes, so `cargo test` stays offline; with `RMLX_REQUIRE_SDK=1` a missing venv fails
//! instead.

mod common;

use std::process::Command;

#[test]
fn openapi_contract_against_rmlx_serve() {
    let root = common::root();
    let Some(python) = common::sdk_python("contract tests") else {
        return;
    };
    let hub = rmlx_hub::testing::fixture_hub();
    let status = Command::new(python)
        .args([
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "tests/api",
        ])
        .current_dir(&root)
        .env("RMLX_BIN", env!("CARGO_BIN_EXE_rmlx"))
        .env("RMLX_TEST_HUB", hub.url())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .status()
        .expect("python runs");
    assert!(
        status.success(),
        "tests/api failed (see the pytest output above)"
    );
}
