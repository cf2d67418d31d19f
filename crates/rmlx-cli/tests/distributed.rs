//! The group of a cluster (issue 33 a), with the real binary: two `rmlx cluster check`
//! processes on loopback form a ring over MLX's distributed layer, agree on versions and the
//! model, and pass every collective; a rank whose peer never comes exits within its watchdog,
//! naming the peer; ranks holding different models refuse to go on.

use std::{
    io::Read,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Two consecutive free loopback ports (rank i listens on port + i).
fn free_ports() -> u16 {
    for _ in 0..100 {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = first.local_addr().unwrap().port();
        if port < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
    panic!("no two consecutive free ports");
}

fn hostfile(name: &str) -> (PathBuf, u16) {
    let port = free_ports();
    let path =
        std::env::temp_dir().join(format!("rmlx-cluster-{name}-{}.json", std::process::id()));
    let text = serde_json::json!({
        "backend": "ring",
        "port": port,
        "hosts": [{"ip": "127.0.0.1"}, {"ip": "127.0.0.1"}],
    });
    std::fs::write(&path, text.to_string()).unwrap();
    (path, port)
}

fn check(hostfile: &Path, rank: usize, model: Option<&str>, timeout: u64) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rmlx"));
    command
        .args(["cluster", "check", "--json", "--rank", &rank.to_string()])
        .args(["--join-timeout", &timeout.to_string()])
        .arg(hostfile)
        .env_remove("MLX_RANK")
        .env_remove("MLX_HOSTFILE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(model) = model {
        command.arg("--model").arg(fixture(model));
    }
    command.spawn().unwrap()
}

/// Waits for `child` at most `limit` (then kills it: a test must never hang); its status,
/// stdout and stderr.
fn finish(mut child: Child, limit: Duration) -> (Option<i32>, String, String) {
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status, out, err)
}

#[test]
fn two_ranks_join_agree_and_pass_every_collective() {
    let (hostfile, port) = hostfile("ok");
    let follower = check(&hostfile, 1, Some("qwen3-tiny"), 60);
    let leader = check(&hostfile, 0, Some("qwen3-tiny"), 60);
    let reports: Vec<serde_json::Value> = [leader, follower]
        .into_iter()
        .map(|child| {
            let (status, out, err) = finish(child, Duration::from_secs(90));
            assert_eq!(status, Some(0), "stdout: {out}\nstderr: {err}");
            serde_json::from_str(out.trim()).unwrap()
        })
        .collect();
    for (rank, report) in reports.iter().enumerate() {
        assert_eq!(report["rank"], rank, "{report}");
        assert_eq!(report["size"], 2);
        assert_eq!(
            report["endpoint"],
            format!("127.0.0.1:{}", port as usize + rank)
        );
        assert_eq!(report["all_sum"], serde_json::json!([3.0, 30.0]));
        assert_eq!(report["all_gather"], serde_json::json!([0, 1]));
        assert_eq!(report["received_from"], 1 - rank);
        assert!(report["small_all_sum_ms"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(
        reports[0]["model_fingerprint"],
        reports[1]["model_fingerprint"]
    );
    assert!(reports[0]["model_fingerprint"].as_str().unwrap().len() == 64);
    // The pipeline's layers: rank 0's from the first, rank 1's to the last, none twice.
    let (first, second) = (&reports[0]["layers"], &reports[1]["layers"]);
    assert_eq!(first[0], 0, "{first}");
    assert_eq!(first[1], second[0], "{first} {second}");
    assert!(second[1].as_u64().unwrap() > second[0].as_u64().unwrap());
    assert!(
        reports[0]["weight_bytes"].as_u64().unwrap() > reports[1]["weight_bytes"].as_u64().unwrap()
    );
    let _ = std::fs::remove_file(hostfile);
}

/// A hostfile split that cuts Gemma 4's KV-shared layers from the layers whose KV they read is
/// refused before joining, naming the range to keep whole.
#[test]
fn a_split_that_cuts_shared_layers_is_refused_before_joining() {
    let (hostfile, port) = hostfile("split");
    let text = serde_json::json!({
        "backend": "ring",
        "port": port,
        "hosts": [{"ip": "127.0.0.1"}, {"ip": "127.0.0.1"}],
        "split": [5, 5],
    });
    std::fs::write(&hostfile, text.to_string()).unwrap();
    let started = std::time::Instant::now();
    let (status, out, err) = finish(
        check(&hostfile, 0, Some("releases/gemma-4-e2b-it"), 60),
        Duration::from_secs(30),
    );
    assert_eq!(status, Some(1), "stdout: {out}\nstderr: {err}");
    assert!(err.contains("cuts layers 3-9 apart"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "it waited to join first"
    );
    let _ = std::fs::remove_file(hostfile);
}

#[test]
fn a_rank_whose_peer_never_comes_exits_within_its_watchdog() {
    let (hostfile, port) = hostfile("alone");
    let started = Instant::now();
    let (status, out, err) = finish(check(&hostfile, 0, None, 5), Duration::from_secs(30));
    let took = started.elapsed();
    assert_eq!(status, Some(3), "stdout: {out}\nstderr: {err}");
    assert!(took < Duration::from_secs(12), "exited after {took:?}");
    assert!(
        err.contains(&format!("rank 1 at 127.0.0.1:{}", port + 1)),
        "the peer is not named: {err}"
    );
    let _ = std::fs::remove_file(hostfile);
}

#[test]
fn ranks_holding_different_models_refuse_to_go_on() {
    let (hostfile, _) = hostfile("models");
    let follower = check(&hostfile, 1, Some("qwen3-vl-tiny"), 60);
    let leader = check(&hostfile, 0, Some("qwen3-tiny"), 60);
    for child in [leader, follower] {
        let (status, out, err) = finish(child, Duration::from_secs(90));
        assert_eq!(status, Some(1), "stdout: {out}\nstderr: {err}");
        assert!(
            err.contains("the ranks disagree on the model"),
            "stderr: {err}"
        );
    }
    let _ = std::fs::remove_file(hostfile);
}

/// `rmlx generate` of `model` as one process (`extra` arguments after the prompt's).
fn generate(model: &str, extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rmlx"));
    command
        .arg("generate")
        .arg("--model")
        .arg(fixture(model))
        .args(["--max-tokens", "10", "--temperature", "0", "--json"])
        .args(extra)
        .env_remove("MLX_RANK")
        .env_remove("MLX_HOSTFILE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

fn answer(child: Child, what: &str) -> serde_json::Value {
    let (status, out, err) = finish(child, Duration::from_secs(120));
    assert_eq!(status, Some(0), "{what}: {err}");
    serde_json::from_str(out.trim()).unwrap_or_else(|_| panic!("{what}: {out} / {err}"))
}

/// Issue 33 (b): each family split across two ranks over loopback answers as one process
/// does, token for token (fp32, greedy): the second rank loads only its layers' tensors and
/// runs them on what rank 0 sends. Gemma 4 E2B's split puts its KV-shared layers and their
/// sources on rank 1 (rank 0 keeps the per-layer input tables, which ride along); the
/// Qwen3-VL request carries an image (rotary rows ride along, deepstack stays on rank 0).
#[test]
fn two_ranks_generate_what_one_process_does() {
    let image = fixture("vision-images/resized/qwen3_vl-noise_80x100-256x288.png");
    let image = image.to_str().unwrap();
    // (fixture, extra arguments, the hostfile's split)
    type Case<'a> = (&'a str, Vec<&'a str>, Option<[usize; 2]>);
    let cases: [Case; 4] = [
        ("releases/qwen3-4b", vec![], None),
        ("releases/qwen3.6-35b-a3b", vec![], None),
        ("releases/gemma-4-e2b-it", vec![], Some([3, 7])),
        (
            "releases/qwen3-vl-2b-instruct",
            vec!["--image", image],
            None,
        ),
    ];
    for (model, extra, split) in cases {
        let mut args = vec!["--prompt", "Tell me about the sea and the sky"];
        args.extend(extra.iter().copied());
        let one = answer(generate(model, &args).spawn().unwrap(), model);
        let (hostfile, port) = hostfile("generate");
        if let Some(split) = split {
            let text = serde_json::json!({
                "backend": "ring",
                "port": port,
                "hosts": [{"ip": "127.0.0.1"}, {"ip": "127.0.0.1"}],
                "split": split,
            });
            std::fs::write(&hostfile, text.to_string()).unwrap();
        }
        let ranks = [0, 1].map(|rank| {
            let mut command = generate(model, &args);
            command.arg("--distributed").arg(&hostfile).args([
                "--rank",
                &rank.to_string(),
                "--join-timeout",
                "60",
            ]);
            command.spawn().unwrap()
        });
        let [leader, follower] = ranks;
        let leader = answer(leader, &format!("{model} rank 0"));
        let follower = answer(follower, &format!("{model} rank 1"));
        let _ = std::fs::remove_file(&hostfile);
        assert_eq!(leader["token_ids"], one["token_ids"], "{model}");
        assert_eq!(leader["text"], one["text"], "{model}");
        assert_eq!(one["token_ids"].as_array().unwrap().len(), 10, "{model}");
        // One forward per prefill chunk and per generated token after the first.
        assert!(
            follower["forwards"].as_u64().unwrap() >= 10,
            "{model}: {follower}"
        );
        // The follower holds exactly its layers' weights: what `cluster check` plans for it.
        let layers = follower["layers"].clone();
        let planned = rmlx_engine::distributed::split::plan_model(
            &fixture(model),
            2,
            split.as_ref().map(|split| &split[..]),
        )
        .unwrap();
        let range = planned.0[1].clone();
        assert_eq!(
            layers,
            serde_json::json!([range.start, range.end]),
            "{model}"
        );
        assert_eq!(
            follower["weight_bytes"].as_u64().unwrap(),
            planned.1.of_rank(1, range),
            "{model}: the follower loaded other ranks' tensors"
        );
        if let Some(split) = split {
            assert_eq!(layers, serde_json::json!([split[0], split[0] + split[1]]));
        }
    }
}
