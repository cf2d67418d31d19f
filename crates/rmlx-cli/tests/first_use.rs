//! First use after loading (issue 32 a): MLX compiles fused kernels at run time (the CPU and
//! CUDA backends from C++/CUDA source, Metal from its shaders), named by the fused graph and its
//! inputs' layout, not their sizes. A model whose kernels were keyed by shape would compile again
//! for every new batch width and prompt length: minutes on a GPU for a user's first requests.
//! Here, per cache family, a server with an empty kernel cache ($TMPDIR/mlx) serves a first
//! request, then bursts of new batch widths and new prompt lengths, and the kernels it compiled
//! are counted after each. The first burst (widths 2-3, the first prompts prefilled together)
//! may add a few: strided layouts of the fused steps, one each (the Gated DeltaNet's conv and
//! delta rule: 4). After that, new prompt lengths and widths add none.
//! With the warm-up (`rmlx serve --warm-up on`, the default) the server builds them after
//! loading, before any request: then no request adds a kernel, and the warm-up's own requests
//! leave no trace in the metrics or the prefix cache.

mod common;

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use common::http;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The compiled kernels (shared libraries on the CPU backend) under `dir`.
fn kernels(dir: &Path) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path
                .extension()
                .is_some_and(|ext| ext == "so" || ext == "dylib")
            {
                found.insert(path.file_name().unwrap().to_string_lossy().into_owned());
            }
        }
    }
    found
}

fn kernels_compiled_per_new_shape(release: &str, warm_up: bool, extra: &[&str]) {
    let temp = std::env::temp_dir().join(format!(
        "rmlx-first-use-{release}-{warm_up}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&temp);
    std::fs::create_dir_all(&temp).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .args([
            "serve",
            "--port",
            "0",
            "--no-ui",
            "--prefix-disk-gb",
            "0",
            "--warm-up",
            if warm_up { "on" } else { "off" },
        ])
        .args(extra)
        .arg("--model")
        .arg(fixture(&format!("releases/{release}")))
        // MLX keeps its compiled kernels under the temporary folder: this one starts empty.
        .env("TMPDIR", &temp)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut server = Server(child);
    let port = common::listening_port(&mut server.0);
    // Prompts of `words` distinct-ish words (fresh ids each: no prefix reuse), 6 tokens each.
    let ask = move |words: usize, seed: usize| {
        let text: Vec<String> = (0..words)
            .map(|i| format!("w{}", (i * 7 + seed) % 301))
            .collect();
        let body = serde_json::json!({
            "model": release,
            "max_tokens": 6,
            "messages": [{"role": "user", "content": text.join(" ")}],
        });
        let (status, reply) = http(
            port,
            "POST",
            "/v1/chat/completions",
            Some(&body.to_string()),
        );
        assert_eq!(status, 200, "{reply}");
        reply["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let burst = |count: usize, words: usize, seed: usize| {
        std::thread::scope(|scope| {
            for i in 0..count {
                scope.spawn(move || ask(words + i, seed + i));
            }
        });
    };
    if warm_up {
        // The server holds requests from its start, before the model has loaded: one sent at
        // once is answered after the warm-up, and is the only one the metrics count.
        let early = ask(20, 1);
        let (status, list) = http(port, "GET", "/v1/models", None);
        assert_eq!(status, 200, "{list}");
        assert!(
            list["data"]
                .as_array()
                .unwrap()
                .iter()
                .any(|model| model["id"] == release && model["warm_up_seconds"].is_f64()),
            "{release}: a request sent at start was answered before the warm-up ended: {list}"
        );
        let warmed = warmed_up(port, release);
        let warm = kernels(&temp);
        assert!(
            !warm.is_empty(),
            "{release}: no kernel found under {temp:?}"
        );
        // The warm-up's requests are the engine's own.
        let (status, metrics) = http(port, "GET", "/metrics/cache", None);
        assert_eq!(status, 200, "{metrics}");
        assert_eq!(metrics["tokens_in"], early, "{release}: {metrics}");
        burst(3, 20, 10);
        ask(37, 50);
        burst(5, 60, 100);
        let after: Vec<_> = kernels(&temp).difference(&warm).cloned().collect();
        assert!(
            after.is_empty(),
            "{release}: requests after a {warmed:.2} s warm-up compiled {after:?}"
        );
        drop(server);
        let _ = std::fs::remove_dir_all(&temp);
        return;
    }
    ask(20, 1);
    let first = kernels(&temp);
    // Proves the count looks where MLX writes (every family fuses at least its activation).
    assert!(
        !first.is_empty(),
        "{release}: no kernel found under {temp:?}"
    );
    burst(3, 20, 10);
    let widths = kernels(&temp);
    let added: Vec<_> = widths.difference(&first).collect();
    assert!(
        added.len() <= 4,
        "{release}: batch widths 2-3 compiled {} kernels: {added:?}",
        added.len()
    );
    ask(37, 50);
    burst(5, 60, 100);
    let lengths = kernels(&temp);
    let added: Vec<_> = lengths.difference(&widths).collect();
    assert!(
        added.is_empty(),
        "{release}: new prompt lengths and widths 4-5 compiled {added:?}"
    );
    drop(server);
    let _ = std::fs::remove_dir_all(&temp);
}

/// Polls `/v1/models` until the model's warm-up has run; its seconds.
fn warmed_up(port: u16, id: &str) -> f64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    loop {
        let (status, list) = http(port, "GET", "/v1/models", None);
        assert_eq!(status, 200, "{list}");
        let entry = list["data"]
            .as_array()
            .and_then(|data| data.iter().find(|model| model["id"] == id))
            .cloned()
            .unwrap_or_else(|| panic!("{id} not listed: {list}"));
        if let Some(seconds) = entry["warm_up_seconds"].as_f64() {
            assert_eq!(entry["loaded"], true, "{entry}");
            return seconds;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{id}: no warm-up after 300 s: {entry}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Full attention (KV cache): Qwen3-4B.
#[test]
fn kv_model_compiles_little_per_new_shape() {
    kernels_compiled_per_new_shape("qwen3-4b", false, &[]);
}

/// Gated DeltaNet + full attention + the MTP draft head: Qwen3.6-27B.
#[test]
fn recurrent_model_compiles_little_per_new_shape() {
    kernels_compiled_per_new_shape("qwen3.6-27b", false, &[]);
}

/// Sliding windows and shared KV: Gemma 4 E2B.
#[test]
fn sliding_window_model_compiles_little_per_new_shape() {
    kernels_compiled_per_new_shape("gemma-4-e2b-it", false, &[]);
}

#[test]
fn kv_model_warmed_up_compiles_nothing_for_requests() {
    kernels_compiled_per_new_shape("qwen3-4b", true, &[]);
}

/// Drafting with its head at full depth. On this CPU a verify step builds what a prefill piece
/// does; on CUDA its rows pick their own matmul tiles, which the warm-up's speculative step builds.
#[test]
fn recurrent_model_warmed_up_compiles_nothing_for_requests() {
    kernels_compiled_per_new_shape("qwen3.6-27b", true, &["--speculative", "mtp"]);
}

#[test]
fn sliding_window_model_warmed_up_compiles_nothing_for_requests() {
    kernels_compiled_per_new_shape("gemma-4-e2b-it", true, &[]);
}
