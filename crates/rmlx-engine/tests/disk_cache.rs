//! The disk prefix cache (`disk_cache`): a finished request's whole blocks and tips land under
//! the model's fingerprint, once; each block holds exactly the KV a fresh prefill computes for
//! its positions, chained to its parent; another model, a changed config or another KV storage
//! is another fingerprint; a corrupt or truncated file does not decode. After a restart a
//! conversation's next turn is read back (for a KV family, Qwen3.5 / 3.6, Gemma 4's sliding
//! windows and a conversation with a picture) and answers as an uncached engine does; a damaged
//! block is a miss and goes; another model or `--kv-bits` never hits; a slow read does not
//! stall the streams decoding meanwhile.

mod common;

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use common::{fixture, ids_array};
use rmlx_engine::{
    cache::KvStorage,
    chat::{ChatTokenizer, TemplateOptions},
    disk_cache::{self, BLOCK_TOKENS},
    engine::{Engine, EngineOptions, Event, Prompt, Request, RequestHandle},
    generate::GenerateParams,
    models::{load_model, Logits},
};
use serde_json::{json, Value};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rmlx-disk-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The files under `dir`, each with its inode: a file written again (temp file, rename) gets a
/// new one, while a hit only touches its time.
fn blocks(dir: &Path) -> Vec<(PathBuf, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut out: Vec<_> = walk(dir)
        .into_iter()
        .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
        .map(|path| {
            let inode = std::fs::metadata(&path).unwrap().ino();
            (path, inode)
        })
        .collect();
    out.sort();
    out
}

fn is_tip(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|name| name.to_string_lossy().starts_with("tip-"))
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .flat_map(|entry| match entry.path().is_dir() {
            true => walk(&entry.path()),
            false => vec![entry.path()],
        })
        .collect()
}

fn run(model: &str, disk: &Path, prompt: &[u32], kv_bits: Option<i32>) {
    let engine = Engine::start_with(EngineOptions {
        prefix_disk_dir: Some(disk.to_path_buf()),
        kv_bits,
        ..EngineOptions::default()
    })
    .unwrap();
    answer(&engine, model, prompt.to_vec(), 4);
    // Dropping the engine finishes the queued writes.
}

#[test]
fn finished_prefixes_become_chained_blocks_once_per_fingerprint() {
    let disk = scratch("blocks");
    let model = "qwen3-tiny";
    let prompt = common::text_ids(600, 17, 10, 500);
    run(model, &disk, &prompt, None);
    let written = blocks(&disk);
    // 600 prompt + 3 fed answer tokens: two whole blocks, and a tip at the end (the prompt
    // has no message opener).
    let tips = written.iter().filter(|(path, _)| is_tip(path)).count();
    assert_eq!((written.len() - tips, tips), (2, 1), "{written:?}");
    let fingerprint = disk_cache::fingerprint(&fixture(model), KvStorage::Dense, false).unwrap();
    assert!(written
        .iter()
        .all(|(path, _)| path.starts_with(disk.join(&fingerprint))));

    // Each block is the KV a fresh prefill computes for its positions, chained to its parent.
    let loaded = load_model(&fixture(model)).unwrap();
    let mut caches = loaded.model.new_cache(4096);
    loaded
        .model
        .forward(&ids_array(&prompt), &mut caches, Logits::Last)
        .unwrap();
    let hashes = disk_cache::chain(&prompt);
    for (index, hash) in hashes.iter().take(2).enumerate() {
        let path = disk
            .join(&fingerprint)
            .join(format!("{}.safetensors", disk_cache::hex(hash)));
        let block = disk_cache::decode_block(&std::fs::read(&path).unwrap()).unwrap();
        let ids: Vec<String> = prompt[index * BLOCK_TOKENS..(index + 1) * BLOCK_TOKENS]
            .iter()
            .map(u32::to_string)
            .collect();
        assert_eq!(block.metadata["tokens"], ids.join(","));
        let parent = index.checked_sub(1).map_or([0u8; 32], |at| hashes[at]);
        assert_eq!(block.metadata["parent"], disk_cache::hex(&parent));
        for (layer, cache) in caches.iter().enumerate() {
            let start = (index * BLOCK_TOKENS) as i32;
            let parts = cache
                .export_columns(start, start + BLOCK_TOKENS as i32)
                .unwrap()
                .unwrap();
            for (part, want) in parts.iter().enumerate() {
                let got = &block.tensors[&format!("layer.{layer}.part.{part}")];
                let equal = mlx_rs::ops::array_eq(got, want, None)
                    .unwrap()
                    .item_exact::<bool>();
                assert!(equal, "block {index} layer {layer} part {part}");
            }
        }
    }

    // The same conversation again writes nothing new.
    run(model, &disk, &prompt, None);
    assert_eq!(blocks(&disk), written);
    // Another KV storage and another model are other fingerprints.
    run(model, &disk, &prompt, Some(8));
    run("qwen3-tiny-4bit", &disk, &prompt, None);
    let folders: std::collections::BTreeSet<_> = blocks(&disk)
        .iter()
        .map(|(path, _)| path.parent().unwrap().to_path_buf())
        .collect();
    assert_eq!(folders.len(), 3, "{folders:?}");
    let _ = std::fs::remove_dir_all(&disk);
}

#[test]
fn a_changed_checkpoint_is_another_fingerprint_and_damage_does_not_decode() {
    let copy = scratch("model");
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(fixture("qwen3-tiny")).unwrap().flatten() {
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    let before = disk_cache::fingerprint(&copy, KvStorage::Dense, false).unwrap();
    assert_eq!(
        before,
        disk_cache::fingerprint(&copy, KvStorage::Dense, false).unwrap()
    );
    let config = copy.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("\"rms_norm_eps\"", " \"rms_norm_eps\""),
    )
    .unwrap();
    assert_ne!(
        before,
        disk_cache::fingerprint(&copy, KvStorage::Dense, false).unwrap()
    );

    let disk = scratch("damage");
    run(
        "qwen3-tiny",
        &disk,
        &common::text_ids(300, 5, 10, 500),
        None,
    );
    let (path, _) = blocks(&disk)
        .into_iter()
        .find(|(path, _)| !is_tip(path))
        .unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert!(disk_cache::decode_block(&bytes).is_ok());
    let mut flipped = bytes.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    assert!(disk_cache::decode_block(&flipped).is_err(), "a flipped bit");
    assert!(
        disk_cache::decode_block(&bytes[..bytes.len() / 2]).is_err(),
        "truncated"
    );
    assert!(disk_cache::decode_block(&bytes[..4]).is_err(), "no header");
    let _ = std::fs::remove_dir_all(&disk);
    let _ = std::fs::remove_dir_all(&copy);
}

fn disk_engine(disk: &Path, kv_bits: Option<i32>, read_delay: Option<Duration>) -> Engine {
    Engine::start_with(EngineOptions {
        prefix_disk_dir: Some(disk.to_path_buf()),
        kv_bits,
        disk_read_delay: read_delay,
        ..EngineOptions::default()
    })
    .unwrap()
}

/// One request on an engine with the disk cache in `disk`; the engine stops after it (its
/// queued writes finish, its RAM cache is gone).
fn on_disk(
    disk: &Path,
    kv_bits: Option<i32>,
    request: Request,
) -> rmlx_engine::generate::Completion {
    disk_engine(disk, kv_bits, None)
        .submit(request)
        .unwrap()
        .wait()
        .unwrap()
}

fn uncached_engine() -> Engine {
    Engine::start_with(EngineOptions {
        prefix_cache_bytes: Some(0),
        prefix_snapshot_bytes: Some(0),
        ..EngineOptions::default()
    })
    .unwrap()
}

/// Turn 1 of a chat: a long first message (several windows of the Gemma fixture, past a block)
/// with `picture` before it when given.
fn chat_turn(model: &str, messages: &[Value], picture: Option<&str>, max_tokens: usize) -> Request {
    Request {
        model: fixture(model),
        prompt: Prompt::Chat {
            messages: messages.to_vec(),
            options: TemplateOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        },
        images: picture
            .map(|name| {
                image::open(fixture("vision-images").join(name))
                    .unwrap()
                    .to_rgb8()
            })
            .into_iter()
            .collect(),
        params: GenerateParams {
            max_tokens,
            ignore_eos: true,
            logprobs: Some(1),
            ..GenerateParams::default()
        },
        ..Request::default()
    }
}

fn first_message(picture: bool) -> Value {
    let words = [
        "river", "stone", "maple", "quiet", "lantern", "harbor", "copper",
    ];
    let text: Vec<&str> = (0..420).map(|i| words[i * 5 % words.len()]).collect();
    let text = text.join(" ");
    match picture {
        true => json!([{"type": "image"}, {"type": "text", "text": text}]),
        false => json!(text),
    }
}

/// The conversation's two turns: turn 1, and turn 2 with turn 1's answer and a question.
fn two_turns(model: &str, picture: Option<&str>, answer: Option<&str>) -> Request {
    let mut messages = vec![json!({"role": "user", "content": first_message(picture.is_some())})];
    if let Some(answer) = answer {
        messages.push(json!({"role": "assistant", "content": answer}));
        messages.push(json!({"role": "user", "content": "And what comes next?"}));
    }
    chat_turn(model, &messages, picture, 8)
}

/// Where turn 1's answer begins: its prompt less the generation prompt (the last opener).
fn last_boundary(model: &str, opener: &str, prompt: &[u32]) -> usize {
    let tokenizer = ChatTokenizer::from_dir(&fixture(model)).unwrap();
    let opener = tokenizer.token_id(opener).unwrap();
    (1..prompt.len() - 1)
        .rev()
        .find(|&at| prompt[at] == opener)
        .unwrap()
}

#[test]
fn a_restart_answers_the_next_turn_from_disk_as_uncached() {
    // (fixture, message opener, picture)
    let cases = [
        ("qwen3-tiny", "<|im_start|>", None),
        ("releases/qwen3.6-27b", "<|im_start|>", None),
        ("gemma4-tiny", "<|turn>", None),
        ("qwen3-vl-tiny", "<|im_start|>", Some("gradient_64x48.png")),
        (
            "releases/qwen3.6-35b-a3b",
            "<|im_start|>",
            Some("noise_80x100.png"),
        ),
    ];
    let reference = uncached_engine();
    for (model, opener, picture) in cases {
        let disk = scratch(&format!("restart-{}", model.replace('/', "-")));
        let turn1 = {
            let engine = disk_engine(&disk, None, None);
            engine
                .submit(two_turns(model, picture, None))
                .unwrap()
                .wait()
                .unwrap()
            // The engine stops here: its queued writes finish, its RAM cache is gone.
        };
        let (before, bytes_before) = (blocks(&disk), bytes_under(&disk));
        let restarted = disk_engine(&disk, None, None);
        let turn2 = two_turns(model, picture, Some(&turn1.text));
        let completion = restarted.submit(turn2.clone()).unwrap().wait().unwrap();
        let uncached = reference.submit(turn2).unwrap().wait().unwrap();
        drop(restarted);
        // What turn 2 wrote: blocks for its new positions and its tips, nothing of turn 1's
        // again (every earlier file keeps its inode).
        let after = blocks(&disk);
        assert!(
            before.iter().all(|file| after.contains(file)),
            "{model}: a file was rewritten"
        );
        let added: Vec<_> = after.iter().filter(|file| !before.contains(file)).collect();
        let tips = added.iter().filter(|(path, _)| is_tip(path)).count();
        let new_tokens = completion.prompt_ids.len() + 8 - completion.cached_tokens;
        eprintln!(
            "{model}: turn 2 wrote {} bytes: {} blocks and {tips} tips for {new_tokens} new positions",
            bytes_under(&disk) - bytes_before,
            added.len() - tips
        );
        assert!(
            tips <= 2 && added.len() - tips <= new_tokens / BLOCK_TOKENS + 1,
            "{added:?}"
        );
        let boundary = last_boundary(model, opener, &turn1.prompt_ids);
        eprintln!(
            "{model}: turn 2 after a restart: {} of {} prompt tokens from disk (turn 1's prompt \
             less its generation prompt: {boundary})",
            completion.cached_tokens,
            completion.prompt_ids.len()
        );
        assert!(
            completion.cached_tokens >= boundary,
            "{model}: {} cached, turn 1's last message starts at {boundary}",
            completion.cached_tokens
        );
        common::assert_same_as_uncached(model, &completion, &uncached, 1e-4);
        let _ = std::fs::remove_dir_all(&disk);
    }
}

#[test]
fn a_damaged_block_is_a_miss_that_goes_and_the_answer_is_right() {
    let model = "qwen3-tiny";
    let disk = scratch("damaged");
    let turn1 = on_disk(&disk, None, two_turns(model, None, None));
    // Block 0 of the prompt: every later block and tip hangs off it.
    let fingerprint = disk_cache::fingerprint(&fixture(model), KvStorage::Dense, false).unwrap();
    let first = disk.join(&fingerprint).join(format!(
        "{}.safetensors",
        disk_cache::hex(&disk_cache::chain(&turn1.prompt_ids)[0])
    ));
    let mut bytes = std::fs::read(&first).unwrap();
    let middle = bytes.len() - 100;
    bytes[middle] ^= 0x40;
    std::fs::write(&first, &bytes).unwrap();

    let turn2 = two_turns(model, None, Some(&turn1.text));
    let completion = on_disk(&disk, None, turn2.clone());
    let uncached = uncached_engine().submit(turn2).unwrap().wait().unwrap();
    assert_eq!(
        completion.cached_tokens, 0,
        "a damaged chain serves nothing"
    );
    common::assert_same_as_uncached("after a damaged block", &completion, &uncached, 1e-4);
    // The damaged file went; the turn's fresh prefill wrote a good one in its place.
    let rewritten = std::fs::read(&first).unwrap();
    assert_ne!(rewritten, bytes);
    assert!(disk_cache::decode_block(&rewritten).is_ok());
    let _ = std::fs::remove_dir_all(&disk);
}

#[test]
fn another_model_or_kv_bits_never_hits() {
    let disk = scratch("isolation");
    let turn1 = on_disk(&disk, None, two_turns("qwen3-tiny", None, None));
    // The same conversation: on the same model it hits; at 8 bits or on another checkpoint
    // (same tokenizer and ids) it never does.
    let next = |model: &str| two_turns(model, None, Some(&turn1.text));
    let same = on_disk(&disk, None, next("qwen3-tiny"));
    assert!(same.cached_tokens > 0);
    let quantized_kv = on_disk(&disk, Some(8), next("qwen3-tiny"));
    assert_eq!(quantized_kv.cached_tokens, 0, "--kv-bits 8 after dense KV");
    let other = on_disk(&disk, None, next("qwen3-tiny-4bit"));
    assert_eq!(other.cached_tokens, 0, "another checkpoint");
    let _ = std::fs::remove_dir_all(&disk);
}

/// A request whose prefix is on disk waits for its read (made slow here: 2 s) in a loading
/// state while a running stream keeps decoding; the read is not on the engine thread, so the
/// stream's longest gap during the read stays far below the read's time.
/// A request for `model` whose answer runs until the context ends it (thousands of tokens).
fn endless_answer(model: &str) -> Request {
    Request {
        model: fixture(model),
        prompt: Prompt::Ids(common::text_ids(40, 3, 10, 500)),
        params: GenerateParams {
            max_tokens: 100_000,
            ignore_eos: true,
            ..GenerateParams::default()
        },
        ..Request::default()
    }
}

#[test]
fn a_disk_read_does_not_stall_a_running_stream() {
    let model = "qwen3-tiny";
    let disk = scratch("stall");
    let turn1 = on_disk(&disk, None, two_turns(model, None, None));
    let delay = Duration::from_secs(2);
    let engine = disk_engine(&disk, None, Some(delay));
    let stream = engine.submit(endless_answer(model)).unwrap();
    // A thread of its own takes the stream's tokens as they come and times each.
    let times = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Instant>::new()));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (times, stop) = (times.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match stream.events.recv_timeout(Duration::from_millis(50)) {
                    Ok(Event::Delta { .. }) => times.lock().unwrap().push(Instant::now()),
                    Ok(Event::Done(_) | Event::Error(_)) => break,
                    _ => {}
                }
            }
        })
    };
    // The stream is decoding before the disk request arrives.
    while times.lock().unwrap().len() < 5 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let submitted = Instant::now();
    let from_disk = engine
        .submit(two_turns(model, None, Some(&turn1.text)))
        .unwrap();
    let started = loop {
        match from_disk
            .events
            .recv_timeout(Duration::from_secs(60))
            .unwrap()
        {
            Event::Started { .. } => break Instant::now(),
            Event::Error(error) => panic!("{error}"),
            _ => {}
        }
    };
    let completion = from_disk.wait().unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    watcher.join().unwrap();
    assert!(completion.cached_tokens > 0, "served from disk");
    assert!(started - submitted >= delay, "the read took its time");
    assert!(
        completion.timings.ttft_ms >= delay.as_millis() as f64,
        "the TTFT counts the read: {} ms",
        completion.timings.ttft_ms
    );
    let times = times.lock().unwrap();
    let during: Vec<Instant> = times
        .iter()
        .copied()
        .filter(|&t| t >= submitted && t <= started)
        .collect();
    let longest = during
        .windows(2)
        .map(|pair| pair[1] - pair[0])
        .chain([during.first().map_or(delay, |&t| t - submitted)])
        .max()
        .unwrap();
    eprintln!(
        "while the disk read took {:?}, the running stream produced {} tokens, longest gap {longest:?}",
        started - submitted,
        during.len()
    );
    assert!(
        during.len() >= 50,
        "the stream stalled: {} tokens",
        during.len()
    );
    assert!(
        longest < delay / 2,
        "the stream waited {longest:?} during a {delay:?} read"
    );
    let _ = std::fs::remove_dir_all(&disk);
}

/// An engine where a request whose prefix was read from disk waits for another model's batch
/// (a long answer) to drain: the engine, that request and the other answer, which is running.
fn ready_behind_another_model(disk: &Path) -> (Engine, RequestHandle, RequestHandle) {
    let model = "qwen3-tiny";
    let turn1 = on_disk(disk, None, two_turns(model, None, None));
    let engine = disk_engine(disk, None, Some(Duration::from_millis(300)));
    // Its read begins; then a long answer of another model starts while it reads.
    let from_disk = engine
        .submit(two_turns(model, None, Some(&turn1.text)))
        .unwrap();
    let other = engine.submit(endless_answer("qwen3-tiny-4bit")).unwrap();
    loop {
        match other.events.recv_timeout(Duration::from_secs(60)).unwrap() {
            Event::Delta { .. } => break,
            Event::Error(error) => panic!("{error}"),
            _ => {}
        }
    }
    // The read is done by now: the request waits for the other model's batch.
    std::thread::sleep(Duration::from_millis(600));
    (engine, from_disk, other)
}

/// Waits (10 s at most) for the queue to hold `depth` requests, then checks that `other`, the
/// long answer the queue waited behind, is still running: what left did not wait for it.
fn queue_shrinks_before_the_other_ends(engine: &Engine, depth: usize, other: &RequestHandle) {
    let cancelled = Instant::now();
    while engine.queue_depth() > depth {
        assert!(
            cancelled.elapsed() < Duration::from_secs(10),
            "the cancelled request still waits behind the other model's batch"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // It ends at the fixture's context, seconds later.
    let ended = other
        .events
        .try_iter()
        .any(|event| matches!(event, Event::Done(_) | Event::Error(_)));
    assert!(
        !ended,
        "the cancelled request ended only after the other model's answer"
    );
}

/// A request cancelled while its prefix, read from disk, waits for another model's batch to
/// drain ends at once: it no longer holds the queue until that batch ends (and then loads its
/// model and rebuilds its caches for a client that left).
#[test]
fn a_cancelled_request_waiting_after_its_disk_read_ends_at_once() {
    let disk = scratch("cancel-ready");
    let (engine, from_disk, other) = ready_behind_another_model(&disk);
    assert_eq!(engine.queue_depth(), 2);
    from_disk.cancel();
    queue_shrinks_before_the_other_ends(&engine, 1, &other);
    drop(other);
    let _ = std::fs::remove_dir_all(&disk);
}

/// Requests cancelled in the queue behind one that waits, its disk read done, for another
/// model's batch give back their places at once (the waiting one held the queue before the
/// cancelled were swept, so a full queue refused new requests until that batch ended).
#[test]
fn cancelled_requests_behind_a_waiting_disk_read_give_back_their_places() {
    let disk = scratch("cancel-behind-ready");
    let (engine, from_disk, other) = ready_behind_another_model(&disk);
    let behind = engine.submit(endless_answer("qwen3-tiny")).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(engine.queue_depth(), 3);
    behind.cancel();
    queue_shrinks_before_the_other_ends(&engine, 2, &other);
    drop((from_disk, other));
    let _ = std::fs::remove_dir_all(&disk);
}

fn budget_engine(disk: &Path, budget: u64) -> Engine {
    let engine = Engine::start_with(EngineOptions {
        prefix_disk_dir: Some(disk.to_path_buf()),
        prefix_disk_bytes: Some(budget),
        ..EngineOptions::default()
    })
    .unwrap();
    // The start-up scan runs on the writer thread: wait for its index.
    while !engine.disk_stats().unwrap().scanned {
        std::thread::sleep(Duration::from_millis(5));
    }
    engine
}

fn answer(engine: &Engine, model: &str, prompt: Vec<u32>, max_tokens: usize) {
    engine
        .submit(Request {
            model: fixture(model),
            prompt: Prompt::Ids(prompt),
            params: GenerateParams {
                max_tokens,
                ignore_eos: true,
                ..GenerateParams::default()
            },
            ..Request::default()
        })
        .unwrap()
        .wait()
        .unwrap();
}

fn bytes_under(dir: &Path) -> u64 {
    walk(dir)
        .iter()
        .map(|path| std::fs::metadata(path).unwrap().len())
        .sum()
}

/// The budget holds at every write under a stream of distinct conversations on two models,
/// the least recently used going first (across models); a restart's scan keeps every valid
/// file (same inodes), deletes a damaged one, leaves files that are not the cache's alone, and
/// evicts down to a smaller budget.
#[test]
fn the_budget_holds_and_a_restart_keeps_what_is_valid() {
    let disk = scratch("budget");
    let conversation = |seed: u32| common::text_ids(700, seed, 10, 500);
    // One conversation's files, measured.
    let one = {
        let probe = scratch("budget-probe");
        drop({
            let engine = budget_engine(&probe, u64::MAX);
            answer(&engine, "qwen3-tiny", conversation(1), 2);
            engine
        });
        let bytes = bytes_under(&probe);
        let _ = std::fs::remove_dir_all(&probe);
        bytes
    };
    let budget = one * 5 / 2;
    let engine = budget_engine(&disk, budget);
    answer(&engine, "qwen3-tiny", conversation(1), 2);
    let first_model =
        disk_cache::fingerprint(&fixture("qwen3-tiny"), KvStorage::Dense, false).unwrap();
    for seed in 2..9 {
        answer(&engine, "qwen3-tiny-4bit", conversation(seed), 2);
        let stats = engine.disk_stats().unwrap();
        assert!(stats.bytes_on_disk <= budget, "{stats:?}");
    }
    drop(engine);
    let stats_files = blocks(&disk);
    assert!(
        bytes_under(&disk) <= budget,
        "{} > {budget}",
        bytes_under(&disk)
    );
    assert!(
        !disk.join(&first_model).exists() || walk(&disk.join(&first_model)).is_empty(),
        "the oldest conversation (another model's) went first"
    );
    // The newest conversation is whole: its two blocks and its tip.
    let newest = disk_cache::chain(&conversation(8));
    for hash in &newest[..2] {
        let name = format!("{}.safetensors", disk_cache::hex(hash));
        assert!(stats_files.iter().any(|(path, _)| path.ends_with(&name)));
    }

    // A restart: a damaged file among valid ones, and files that are not the cache's.
    let folder = stats_files[0].0.parent().unwrap().to_path_buf();
    std::fs::write(folder.join("tip-damaged.safetensors"), b"not a block").unwrap();
    std::fs::write(disk.join("notes.txt"), b"mine").unwrap();
    std::fs::create_dir_all(disk.join("photos")).unwrap();
    std::fs::write(disk.join("photos").join("a.safetensors"), b"mine too").unwrap();
    let engine = budget_engine(&disk, budget);
    let stats = engine.disk_stats().unwrap();
    assert_eq!(stats.files as usize, stats_files.len(), "{stats:?}");
    drop(engine);
    let cache_files: Vec<_> = blocks(&disk)
        .into_iter()
        .filter(|(path, _)| !path.starts_with(disk.join("photos")))
        .collect();
    assert_eq!(cache_files, stats_files, "valid files kept as they were");
    assert!(disk.join("notes.txt").exists() && disk.join("photos/a.safetensors").exists());

    // A smaller budget: the scan evicts down to it, least recently used first.
    let engine = budget_engine(&disk, one);
    let stats = engine.disk_stats().unwrap();
    assert!(
        stats.bytes_on_disk <= one && stats.evicted_files > 0,
        "{stats:?}"
    );
    drop(engine);
    let _ = std::fs::remove_dir_all(&disk);
}

/// A quantized KV cache (`--kv-bits 8`, on a checkpoint with real 128-wide heads) goes to disk
/// as its packed triples and comes back bit for bit: turn 2 after a restart answers as an
/// uncached engine at 8 bits.
#[test]
fn a_quantized_kv_cache_restarts_from_disk() {
    let model = "head-sizes/qwen3-hd128";
    let disk = scratch("quantized");
    let prompt = common::text_ids(700, 11, 10, 500);
    let request = |ids: Vec<u32>| Request {
        model: fixture(model),
        prompt: Prompt::Ids(ids),
        params: GenerateParams {
            max_tokens: 6,
            ignore_eos: true,
            logprobs: Some(1),
            ..GenerateParams::default()
        },
        ..Request::default()
    };
    let turn1 = on_disk(&disk, Some(8), request(prompt.clone()));
    let next: Vec<u32> = [prompt, turn1.token_ids, common::text_ids(40, 12, 10, 500)].concat();
    let completion = on_disk(&disk, Some(8), request(next.clone()));
    let uncached = Engine::start_with(EngineOptions {
        prefix_cache_bytes: Some(0),
        prefix_snapshot_bytes: Some(0),
        kv_bits: Some(8),
        ..EngineOptions::default()
    })
    .unwrap()
    .submit(request(next))
    .unwrap()
    .wait()
    .unwrap();
    assert!(
        completion.cached_tokens >= 700,
        "{}",
        completion.cached_tokens
    );
    common::assert_same_as_uncached("8-bit KV from disk", &completion, &uncached, 1e-4);
    let _ = std::fs::remove_dir_all(&disk);
}
