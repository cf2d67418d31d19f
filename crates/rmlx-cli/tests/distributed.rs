//! A model across machines (issue 33), with the real binary and two processes on loopback:
//! `rmlx cluster check` forms a ring over MLX's distributed layer, agrees on versions and the
//! model, and passes every collective; a rank whose peer never comes exits within its
//! watchdog, naming the peer; ranks holding different models refuse to go on. `rmlx generate`
//! and `rmlx serve` split each family across two ranks and answer as one process does; the
//! server batches, reuses prefixes and cancels across ranks; a follower killed or stopped
//! mid-stream ends the stream with an error and every process exits.

mod common;

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

/// Six consecutive free loopback ports: two ranks' MLX ring (port + rank), heartbeats
/// (port + 2 + rank) and doorbells (port + 4 + rank).
fn free_ports() -> u16 {
    for _ in 0..200 {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = first.local_addr().unwrap().port();
        if port < u16::MAX - 6
            && (1..6).all(|i| std::net::TcpListener::bind(("127.0.0.1", port + i)).is_ok())
        {
            return port;
        }
    }
    panic!("no six consecutive free ports");
}

/// A fresh hostfile for two ranks on loopback. Its name is unique within the test binary too:
/// tests run in parallel threads of one process and each removes its own file when done.
fn hostfile(name: &str) -> (PathBuf, u16) {
    static MADE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let port = free_ports();
    let serial = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!(
        "rmlx-cluster-{name}-{}-{serial}.json",
        std::process::id()
    ));
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
    // A server's stdout was taken to read its port.
    if let Some(mut stdout) = child.stdout.take() {
        let _ = stdout.read_to_string(&mut out);
    }
    if let Some(mut stderr) = child.stderr.take() {
        let _ = stderr.read_to_string(&mut err);
    }
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
        .args(["--temperature", "0", "--json"])
        .args(extra)
        .env_remove("MLX_RANK")
        .env_remove("MLX_HOSTFILE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// `rmlx generate` of `model` with `args` on both ranks of a fresh two-rank hostfile (with
/// its `split`, if given): rank 0's answer and rank 1's report.
fn generate_on_two_ranks(
    model: &str,
    args: &[&str],
    split: Option<[usize; 2]>,
) -> (serde_json::Value, serde_json::Value) {
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
    let [leader, follower] = [0, 1].map(|rank| {
        let mut command = generate(model, args);
        command.arg("--distributed").arg(&hostfile).args([
            "--rank",
            &rank.to_string(),
            "--join-timeout",
            "60",
        ]);
        command.spawn().unwrap()
    });
    let leader = answer(leader, &format!("{model} rank 0"));
    let follower = answer(follower, &format!("{model} rank 1"));
    let _ = std::fs::remove_file(&hostfile);
    (leader, follower)
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
        let mut args = vec![
            "--prompt",
            "Tell me about the sea and the sky",
            "--max-tokens",
            "10",
        ];
        args.extend(extra.iter().copied());
        let one = answer(generate(model, &args).spawn().unwrap(), model);
        let (leader, follower) = generate_on_two_ranks(model, &args, split);
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
        // At most what its layers' tensors take in the files (Gemma 4's KV-shared layers ship
        // k / v projections nobody reads), and most of it.
        let (loaded, planned) = (
            follower["weight_bytes"].as_u64().unwrap(),
            planned.1.of_rank(1, range),
        );
        assert!(
            loaded <= planned && loaded * 10 >= planned * 9,
            "{model}: the follower loaded {loaded} bytes, its layers hold {planned}"
        );
        if let Some(split) = split {
            assert_eq!(layers, serde_json::json!([split[0], split[0] + split[1]]));
        }
    }
}

/// `rmlx serve` of one fixture: alone, or as `rank` of `hostfile`.
fn serve(model: &str, distributed: Option<(&Path, usize)>, extra: &[&str]) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rmlx"));
    command
        .arg("serve")
        .arg("--model")
        .arg(fixture(model))
        .args(["--port", "0", "--prefix-disk-gb", "0"])
        .args(extra)
        .env_remove("MLX_RANK")
        .env_remove("MLX_HOSTFILE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some((hostfile, rank)) = distributed {
        command.arg("--distributed").arg(hostfile).args([
            "--rank",
            &rank.to_string(),
            "--join-timeout",
            "60",
        ]);
    }
    command.spawn().unwrap()
}

fn chat(port: u16, model: &str, text: &str) -> serde_json::Value {
    let body = serde_json::json!({
        "model": Path::new(model).file_name().unwrap().to_str().unwrap(),
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
    });
    let (status, reply) = common::http(
        port,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
    );
    assert_eq!(status, 200, "{reply}");
    reply
}

/// The answer's content blocks (a thinking model's random weights may never leave its
/// thinking: the whole block list is compared).
fn message(port: u16, model: &str, text: &str) -> serde_json::Value {
    let body = serde_json::json!({
        "model": Path::new(model).file_name().unwrap().to_str().unwrap(),
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
    });
    let (status, reply) = common::http(port, "POST", "/v1/messages", Some(&body.to_string()));
    assert_eq!(status, 200, "{reply}");
    reply["content"].clone()
}

/// The answer's text and reasoning (Qwen3.6's template opens with thinking).
fn content(reply: &serde_json::Value) -> String {
    let message = &reply["choices"][0]["message"];
    let text = format!("{}|{}", message["content"], message["reasoning_content"]);
    assert!(text.len() > 12, "{reply}");
    text
}

/// A streamed chat request: its SSE `data:` lines as they come, through `on_line` (which
/// returns false to stop reading: the connection is then dropped).
fn stream(port: u16, model: &str, text: &str, mut on_line: impl FnMut(&str) -> bool) {
    use std::io::{BufRead, Write};
    let body = serde_json::json!({
        "model": Path::new(model).file_name().unwrap().to_str().unwrap(),
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 3000,
        "temperature": 0,
        "stream": true,
    })
    .to_string();
    let mut socket = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(
        socket,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    for line in std::io::BufReader::new(socket).lines() {
        let Ok(line) = line else { return };
        if line.starts_with("data:") && !on_line(&line) {
            return;
        }
    }
}

/// Issue 33 (c): `rmlx serve` on two ranks answers as one process does through both APIs,
/// batches concurrent requests, reuses a prefix, goes on after a client drops a stream
/// mid-answer, lists both ranks in `/health`, and its follower exits when rank 0 stops. The
/// Qwen3.6 fixture: recurrent layers (snapshots for the prefix cache), experts, rank 1 holding
/// three of its four layers on copies of rank 0's caches.
#[test]
fn two_ranks_serve_what_one_process_does() {
    let model = "releases/qwen3.6-35b-a3b";
    let prompts = [
        "Tell me about the sea",
        "What is a river",
        "Name three colours of the sky",
    ];
    let mut one = serve(model, None, &[]);
    let port = common::listening_port(&mut one);
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| content(&chat(port, model, p)))
        .collect();
    let alone_again = content(&chat(port, model, &format!("{} again", prompts[0])));
    let alone_anthropic = message(port, model, prompts[1]);
    let _ = one.kill();
    let _ = one.wait();

    let (hostfile, _) = hostfile("serve");
    let follower = serve(model, Some((&hostfile, 1)), &[]);
    let mut leader = serve(model, Some((&hostfile, 0)), &[]);
    let port = common::listening_port(&mut leader);
    let (status, health) = common::http(port, "GET", "/health", None);
    assert_eq!(status, 200);
    assert_eq!(
        health["ranks"][1]["layers"],
        serde_json::json!([1, 4]),
        "{health}"
    );
    // The dashboard's feed lists them too, the follower's heartbeat fresh.
    let (_, metrics) = common::http(port, "GET", "/metrics/cache", None);
    assert_eq!(
        metrics["ranks"].as_array().map(Vec::len),
        Some(2),
        "{metrics}"
    );
    assert!(
        metrics["ranks"][1]["last_heartbeat_ms"].as_u64() < Some(3000),
        "{metrics}"
    );
    // Three at once: one batch across both ranks.
    let replies: Vec<serde_json::Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| scope.spawn(move || chat(port, model, p)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let texts: Vec<String> = replies.iter().map(content).collect();
    assert_eq!(texts, alone);
    assert!(
        replies
            .iter()
            .any(|reply| reply["timings"]["batched_with"].as_u64() >= Some(2)),
        "{replies:?}"
    );
    // A prefix the cache holds (the first turn's), and the other API.
    assert_eq!(
        content(&chat(port, model, &format!("{} again", prompts[0]))),
        alone_again
    );
    assert_eq!(message(port, model, prompts[1]), alone_anthropic);
    // A client that leaves mid-stream, while another request decodes beside it.
    std::thread::scope(|scope| {
        let dropped = scope.spawn(|| {
            let mut seen = 0;
            stream(port, model, "Write a long story", |_| {
                seen += 1;
                seen < 6
            });
        });
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(content(&chat(port, model, prompts[2])), alone[2]);
        dropped.join().unwrap();
    });
    assert_eq!(content(&chat(port, model, prompts[0])), alone[0]);
    let (status, health) = common::http(port, "GET", "/health", None);
    assert_eq!((status, &health["status"]), (200, &serde_json::json!("ok")));
    // Rank 0 stopping ends the follower's loop.
    unsafe_signal(leader.id(), "TERM");
    let (leader_status, _, leader_err) = finish(leader, Duration::from_secs(20));
    let (follower_status, _, follower_err) = finish(follower, Duration::from_secs(20));
    let _ = std::fs::remove_file(&hostfile);
    assert_eq!(leader_status, Some(0), "{leader_err}");
    assert_eq!(follower_status, Some(0), "{follower_err}");
}

/// Sends a signal by name through `kill` (the tests need no libc crate).
fn unsafe_signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Issue 33 (d): a follower that dies (killed) or hangs (stopped) mid-stream: the stream ends
/// with an error event naming the lost rank, `/health` says 503, and rank 0 exits with status
/// 4 within 10 s; a stopped follower, once continued, finds rank 0 gone and exits too.
#[test]
fn a_lost_follower_ends_the_stream_and_every_process_exits() {
    let model = "releases/qwen3-4b";
    for how in ["KILL", "STOP"] {
        let (hostfile, _) = hostfile(&format!("lost-{how}"));
        let follower = serve(model, Some((&hostfile, 1)), &["--warm-up", "off"]);
        let mut leader = serve(model, Some((&hostfile, 0)), &["--warm-up", "off"]);
        let port = common::listening_port(&mut leader);
        let mut signalled = None;
        let mut error = None;
        stream(port, model, "Write a long story", |line| {
            if line.contains("\"error\"") {
                error = Some(line.to_string());
                return false;
            }
            if signalled.is_none() && line.contains("\"content\"") {
                unsafe_signal(follower.id(), how);
                signalled = Some(Instant::now());
            }
            !line.contains("[DONE]")
        });
        let signalled = signalled.expect("the stream started");
        let error = error.unwrap_or_else(|| panic!("{how}: the stream ended without an error"));
        assert!(error.contains("rank 1"), "{how}: {error}");
        assert!(error.contains("unavailable"), "{how}: {error}");
        let (status, health) = common::http(port, "GET", "/health", None);
        assert_eq!(status, 503, "{how}: {health}");
        assert_eq!(health["status"], "failed");
        let (leader_status, _, leader_err) = finish(leader, Duration::from_secs(10));
        assert!(
            signalled.elapsed() < Duration::from_secs(10),
            "{how}: rank 0 took {:?}",
            signalled.elapsed()
        );
        assert_eq!(leader_status, Some(4), "{how}: {leader_err}");
        if how == "STOP" {
            unsafe_signal(follower.id(), "CONT");
        }
        let (follower_status, _, follower_err) = finish(follower, Duration::from_secs(10));
        if how == "STOP" {
            assert!(
                matches!(follower_status, Some(code) if code != 0),
                "{follower_err}"
            );
        }
        let _ = std::fs::remove_file(&hostfile);
    }
}

/// Issue 33 (d): `rmlx serve --distributed` whose peer never comes exits within its join
/// watchdog (5 s here), naming the peer it waited for.
#[test]
fn a_server_whose_peer_never_comes_exits_within_its_watchdog() {
    let (hostfile, port) = hostfile("serve-alone");
    let started = Instant::now();
    let mut command = Command::new(env!("CARGO_BIN_EXE_rmlx"));
    command
        .arg("serve")
        .arg("--model")
        .arg(fixture("releases/qwen3-4b"))
        .args(["--port", "0", "--distributed"])
        .arg(&hostfile)
        .args(["--rank", "0", "--join-timeout", "5"])
        .env_remove("MLX_RANK")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let (status, _, err) = finish(command.spawn().unwrap(), Duration::from_secs(30));
    let _ = std::fs::remove_file(&hostfile);
    assert_eq!(status, Some(3), "{err}");
    assert!(started.elapsed() < Duration::from_secs(15));
    assert!(err.contains(&format!("127.0.0.1:{}", port + 1)), "{err}");
}

/// Drafts rolled back across ranks: prompt lookup drafts where the answer repeats, the model
/// rejects some, and every rank's caches go back by rank 0's log (`keep_written`); the two
/// ranks' greedy answer and drafts are the one process's.
#[test]
fn two_ranks_roll_back_rejected_drafts_as_one_process_does() {
    let model = "releases/qwen3-4b";
    let args = [
        "--prompt",
        "hello there, tell me",
        "--max-tokens",
        "30",
        "--speculative",
        "lookup",
    ];
    let one = answer(generate(model, &args).spawn().unwrap(), "one process");
    let (drafted, kept) = (
        one["timings"]["draft_tokens"].as_u64().unwrap(),
        one["timings"]["accepted_tokens"].as_u64().unwrap(),
    );
    assert!(
        drafted > kept,
        "drafts {drafted}, kept {kept}: none rejected"
    );
    let (leader, _) = generate_on_two_ranks(model, &args, None);
    assert_eq!(leader["token_ids"], one["token_ids"]);
    assert_eq!(
        leader["timings"]["draft_tokens"],
        one["timings"]["draft_tokens"]
    );
    assert_eq!(
        leader["timings"]["accepted_tokens"],
        one["timings"]["accepted_tokens"]
    );
}
