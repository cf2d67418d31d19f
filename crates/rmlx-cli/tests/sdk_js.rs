//! The official TypeScript `openai` SDK (pinned in tests/sdk/js/package-lock.json) against this
//! build's `rmlx serve` on loopback: tests/sdk/js/openai.test.mjs under `node --test`. Without
//! its node_modules the test says how to get them and passes (`cargo test` stays offline);
//! with `RMLX_REQUIRE_SDK=1` that is a failure.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
};

#[test]
fn official_typescript_sdk_against_rmlx_serve() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let js = root.join("tests/sdk/js");
    if !js.join("node_modules/openai").exists() {
        assert!(
            std::env::var("RMLX_REQUIRE_SDK").as_deref() != Ok("1"),
            "RMLX_REQUIRE_SDK=1 but tests/sdk/js/node_modules is missing: run scripts/sdk-node"
        );
        eprintln!("skipped: run scripts/sdk-node to enable the TypeScript SDK test");
        return;
    }
    let empty_hub = root.join("target/sdk-empty-hub-js");
    std::fs::create_dir_all(&empty_hub).unwrap();
    let mut server = Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .args(["serve", "--port", "0", "--api-key", "js-key", "--model"])
        .arg(root.join("tests/fixtures/qwen3-tiny"))
        .arg("--hf-cache")
        .arg(&empty_hub)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line.trim().rsplit(' ').next().unwrap().to_string();
    assert!(url.starts_with("http://127.0.0.1:"), "{line}");
    let status = Command::new("node")
        .args(["--test", "openai.test.mjs"])
        .current_dir(&js)
        .env("RMLX_URL", format!("{url}/v1"))
        .env("RMLX_MODEL", "qwen3-tiny")
        .env("RMLX_API_KEY", "js-key")
        .status();
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        status.expect("node runs").success(),
        "tests/sdk/js failed (see above)"
    );
}
