//! `rmlx doctor` runs real MLX operations, and a missing MLX library is a message, not a crash.

use std::process::Command;

fn rmlx() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rmlx"))
}

#[test]
fn doctor_evaluates_real_mlx_operations() {
    let output = rmlx().args(["doctor", "--json"]).output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["matmul"], serde_json::json!([3.5, 3.0, 7.5, 5.0]));
    assert_eq!(report["quantized_matmul_shape"], serde_json::json!([1, 64]));
    assert_eq!(report["runtime"]["mlx_version"], "0.32.2");
    let device = report["runtime"]["default_device"].as_str().unwrap();
    assert!(device.starts_with("Device("), "{device}");
    let library = report["runtime"]["library"].as_str().unwrap();
    assert!(library.ends_with("libmlxc.so") || library.ends_with("libmlxc.dylib"));
}

/// MLX CUDA's shape caches would throw after enough new shapes (a long-running server meets
/// them): the process turns that check off, unless the user chose.
#[test]
fn mlx_cache_thrashing_check_is_off_unless_chosen() {
    let setting = |env: Option<&str>| {
        let mut command = rmlx();
        command
            .args(["doctor", "--json"])
            .env_remove("MLX_ENABLE_CACHE_THRASHING_CHECK");
        if let Some(value) = env {
            command.env("MLX_ENABLE_CACHE_THRASHING_CHECK", value);
        }
        let output = command.output().unwrap();
        assert!(output.status.success());
        let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        report["mlx_settings"]["MLX_ENABLE_CACHE_THRASHING_CHECK"].clone()
    };
    assert_eq!(setting(None), "0");
    assert_eq!(setting(Some("1")), "1");
}

/// The ring backend is in every MLX build (rmlx cluster check runs on it here).
#[test]
fn doctor_lists_the_distributed_backends() {
    let output = rmlx().args(["doctor", "--json"]).output().unwrap();
    assert!(output.status.success());
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["distributed_backends"]["ring"], true, "{report}");
    assert!(
        report["distributed_backends"]["jaccl"].is_boolean(),
        "{report}"
    );
}

#[test]
fn missing_mlx_library_is_a_clear_message() {
    let empty = std::env::temp_dir().join(format!("rmlx-no-mlx-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let output = rmlx()
        .arg("doctor")
        .env("RMLX_MLX_LIB_DIR", &empty)
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("MLX runtime library"), "{stderr}");
    assert!(stderr.contains(&empty.display().to_string()), "{stderr}");
    assert!(stderr.contains("make bootstrap"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    std::fs::remove_dir_all(&empty).ok();
}
