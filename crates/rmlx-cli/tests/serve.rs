//! `rmlx serve` start-up failures are clear errors, not panics.

use std::{net::TcpListener, path::PathBuf, process::Command};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3-tiny")
}

fn serve(args: &[&str]) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .arg("serve")
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    (output.status.success(), stderr)
}

#[test]
fn port_in_use_is_a_clear_error() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let model = fixture();
    let (ok, stderr) = serve(&["--model", model.to_str().unwrap(), "--port", &port]);
    assert!(!ok);
    assert!(stderr.contains("already in use"), "{stderr}");
}

#[test]
fn a_folder_without_config_is_refused() {
    let (ok, stderr) = serve(&["--model", "/nonexistent/model", "--port", "0"]);
    assert!(!ok);
    assert!(stderr.contains("not a model folder"), "{stderr}");
}
