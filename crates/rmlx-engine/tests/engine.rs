//! The engine thread: streamed deltas add up to the final text, cancellation between steps,
//! a dropped handle stops its work, a full queue is refused, requests run in order, and an
//! assistant prefill is part of the prompt.

mod common;

use std::path::PathBuf;

use rmlx_engine::{
    chat::ChatTokenizer,
    constrain::ResponseFormat,
    engine::{Engine, EngineOptions, Event, Prompt, Request, Step},
    generate::{Completion, FinishReason, GenerateParams},
    sample::SamplingParams,
    EngineError,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn request(text: &str, max_tokens: usize) -> Request {
    Request {
        model: fixture("qwen3-tiny"),
        prompt: Prompt::Chat {
            messages: vec![serde_json::json!({"role": "user", "content": text})],
            options: rmlx_engine::chat::TemplateOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        },
        params: GenerateParams {
            max_tokens,
            ignore_eos: true,
            ..GenerateParams::default()
        },
        ..Request::default()
    }
}

#[test]
fn streamed_deltas_add_up_to_the_final_text() {
    let engine = Engine::start(4).unwrap();
    let handle = engine
        .submit(request("Tell me about Zürich and 東京 🙂", 60))
        .unwrap();
    let mut streamed = String::new();
    let mut started = None;
    let mut live = None;
    let completion = loop {
        match handle.events.recv().unwrap() {
            Event::Started {
                prompt_tokens,
                max_ctx,
            } => started = Some((prompt_tokens, max_ctx)),
            Event::Delta { text, .. } => {
                streamed.push_str(&text);
                live.get_or_insert_with(|| engine.metrics());
            }
            Event::Done(completion) => break completion,
            Event::Error(error) => panic!("{error}"),
        }
    };
    assert_eq!(started, Some((completion.prompt_tokens, 2048)));
    // While it ran, the gauges showed it; once done they are back to idle.
    let live = live.unwrap();
    assert_eq!(live.in_flight, 1);
    assert!(live.kv_cache_bytes > 0);
    let idle = engine.metrics();
    assert_eq!((idle.in_flight, idle.kv_cache_bytes), (0, 0));
    assert_eq!(streamed, completion.text);
    assert_eq!(completion.completion_tokens, 60);
    assert_eq!(completion.timings.itl_ms.len(), 59);
}

#[test]
fn cancel_stops_between_steps() {
    let engine = Engine::start(4).unwrap();
    let handle = engine.submit(request("Go on forever", 1500)).unwrap();
    loop {
        if let Event::Delta { .. } = handle.events.recv().unwrap() {
            break;
        }
    }
    handle.cancel();
    let completion = handle.wait().unwrap();
    assert_eq!(completion.finish_reason, FinishReason::Cancelled);
    assert!(
        completion.completion_tokens < 1500,
        "{}",
        completion.completion_tokens
    );
}

#[test]
fn dropped_handle_frees_the_engine_for_the_next_request() {
    let engine = Engine::start(4).unwrap();
    let abandoned = engine
        .submit(request("A long answer please", 1900))
        .unwrap();
    drop(abandoned);
    let started = std::time::Instant::now();
    let next = engine.submit(request("Short", 4)).unwrap().wait().unwrap();
    assert_eq!(next.completion_tokens, 4);
    // 1900 tokens would take far longer than this on any machine running the tests.
    assert!(started.elapsed().as_secs() < 20);
}

/// A bug (a panic) while serving a request, at any step of the loop, fails that request with a
/// typed error; the thread serves the next one, a stream already running goes on untouched, and
/// the counters settle.
#[test]
fn a_panic_fails_only_its_own_request() {
    let engine = Engine::start(4).unwrap();
    for step in [Step::Admit, Step::Prefill, Step::Decode] {
        // A stream that is running when the bug strikes (decoding alone: a decode-step panic
        // takes the batch it is in, so that case runs the faulty request alone).
        let running = (step != Step::Decode).then(|| {
            let handle = engine.submit(request("Keep talking", 200)).unwrap();
            loop {
                match handle.events.recv().unwrap() {
                    Event::Delta { .. } => break handle,
                    Event::Error(error) => panic!("{error}"),
                    _ => {}
                }
            }
        });
        let mut faulty = request("This one meets a bug", 8);
        faulty.panic_at = Some(step);
        let error = engine.submit(faulty).unwrap().wait().unwrap_err();
        assert!(
            matches!(error, EngineError::Internal(_)),
            "{step:?}: {error}"
        );
        if let Some(running) = running {
            let done = running.wait().unwrap();
            assert_eq!(done.completion_tokens, 200, "{step:?}");
        }
        let next = engine.submit(request("This one does not", 8)).unwrap();
        assert_eq!(next.wait().unwrap().completion_tokens, 8, "{step:?}");
        assert_eq!(engine.queue_depth(), 0, "{step:?}");
        let metrics = engine.metrics();
        assert_eq!(
            (metrics.in_flight, metrics.kv_cache_bytes),
            (0, 0),
            "{step:?}"
        );
    }
    assert_eq!(engine.metrics().error_counts["internal"], 3);
}

/// An engine that queues two requests, without speculation (rows of one batch that keep
/// drafts finish early, out of order).
fn queue_of_two() -> Engine {
    Engine::start_with(EngineOptions {
        max_queue: 2,
        speculative: rmlx_engine::speculative::SpeculativeMode::Off,
        ..EngineOptions::default()
    })
    .unwrap()
}

/// Requests cancelled while they wait behind one for another model (which waits for the
/// running batch to drain) give back their queue places at once: a full queue takes a new
/// request again while the batch still runs.
#[test]
fn cancelled_requests_give_back_their_queue_places_at_once() {
    let engine = queue_of_two();
    let mut long = request("A long answer please", 100_000);
    long.model = fixture("qwen3-tiny-4bit");
    let running = engine.submit(long).unwrap();
    loop {
        if let Event::Delta { .. } = running.events.recv().unwrap() {
            break;
        }
    }
    // Both wait: their model is not the running batch's.
    let head = engine.submit(request("first in line", 4)).unwrap();
    let behind = engine.submit(request("second in line", 4)).unwrap();
    assert!(matches!(
        engine.submit(request("one too many", 4)),
        Err(EngineError::QueueFull(2))
    ));
    drop(behind);
    let cancelled = std::time::Instant::now();
    let accepted = loop {
        match engine.submit(request("in its place", 4)) {
            Ok(handle) => break handle,
            Err(EngineError::QueueFull(2)) => {
                assert!(
                    cancelled.elapsed() < std::time::Duration::from_secs(1),
                    "the cancelled request still holds its place"
                );
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(other) => panic!("{other}"),
        }
    };
    // Still while the long answer runs (it ends at the fixture's context, seconds later).
    let ended = running
        .events
        .try_iter()
        .any(|event| matches!(event, Event::Done(_) | Event::Error(_)));
    assert!(!ended, "the place came back only when the batch drained");
    drop(running);
    assert_eq!(head.wait().unwrap().completion_tokens, 4);
    assert_eq!(accepted.wait().unwrap().completion_tokens, 4);
}

#[test]
fn full_queue_is_refused_and_accepted_requests_finish_in_order() {
    let engine = queue_of_two();
    let mut accepted = Vec::new();
    let mut refused = 0;
    for index in 0..12 {
        match engine.submit(request(&format!("request {index}"), 120)) {
            Ok(handle) => accepted.push(handle),
            Err(EngineError::QueueFull(2)) => refused += 1,
            Err(other) => panic!("{other}"),
        }
    }
    assert!(
        refused > 0,
        "12 instant submissions never filled a queue of 2"
    );
    assert!(accepted.len() >= 2);
    // Each waiter notes when its answer arrived; FIFO means arrival follows submission order.
    let waiters: Vec<_> = accepted
        .into_iter()
        .map(|handle| {
            std::thread::spawn(move || {
                handle.wait().unwrap();
                std::time::Instant::now()
            })
        })
        .collect();
    let finished_at: Vec<_> = waiters
        .into_iter()
        .map(|waiter| waiter.join().unwrap())
        .collect();
    assert!(
        finished_at.windows(2).all(|pair| pair[0] < pair[1]),
        "answers arrived out of order"
    );
    assert_eq!(engine.queue_depth(), 0);
}

/// A server holds requests from before the model it warms up has loaded: a request that
/// comes while the model loads waits for the load and the whole warm-up, not only the load.
#[test]
fn a_request_sent_while_the_model_loads_for_its_warm_up_waits_for_the_warm_up() {
    let model = fixture("qwen3-tiny");
    let engine = Engine::start(16).unwrap();
    let hold = engine.hold_for_warm_up();
    let warming = {
        let (engine, model) = (engine.clone(), model.clone());
        std::thread::spawn(move || {
            let done = engine.warm_up(&model);
            drop(hold);
            (done, std::time::Instant::now())
        })
    };
    let completion = engine
        .submit(request("Count to five", 12))
        .unwrap()
        .wait()
        .unwrap();
    let answered = std::time::Instant::now();
    let (done, warmed) = warming.join().unwrap();
    assert!(done.unwrap().requests > 0);
    assert!(
        answered > warmed,
        "the request was answered {:?} before the warm-up ended",
        warmed - answered
    );
    assert_eq!(completion.batched_with, 1, "it ran alone: {completion:?}");
}

/// The warm-up leaves nothing in the metrics or the prefix cache; a request sent during one
/// waits for it (its requests go first), then runs alone and answers as without one.
#[test]
fn a_request_sent_during_the_warm_up_waits_for_it_and_is_unchanged() {
    use rmlx_engine::speculative::SpeculativeMode;
    let model = fixture("qwen3-tiny");
    let plain = Engine::start(16).unwrap();
    let expected = plain
        .submit(request("Count to five", 12))
        .unwrap()
        .wait()
        .unwrap();
    drop(plain);
    let engine = Engine::start_with(EngineOptions {
        max_queue: 16,
        speculative: SpeculativeMode::Auto,
        ..EngineOptions::default()
    })
    .unwrap();
    let first = engine.warm_up(&model).unwrap();
    assert!(first.requests >= 3 + 8 && first.speculative, "{first:?}");
    let metrics = engine.metrics();
    assert_eq!(
        (
            metrics.tokens_in,
            metrics.recent.len(),
            metrics.prefix_cache_bytes
        ),
        (0, 0, 0),
        "{metrics:?}"
    );
    let warming = {
        let (engine, model) = (engine.clone(), model.clone());
        std::thread::spawn(move || engine.warm_up(&model))
    };
    // The second warm-up's first request is queued or running.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while engine.queue_depth() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no warm-up request seen"
        );
        std::thread::yield_now();
    }
    let completion = engine
        .submit(request("Count to five", 12))
        .unwrap()
        .wait()
        .unwrap();
    let second = engine.warmed_up(&model).expect("a warm-up ran");
    assert!(
        second.seconds != first.seconds,
        "the request ended before the second warm-up: {second:?}"
    );
    assert_eq!(completion.token_ids, expected.token_ids);
    assert_eq!(completion.batched_with, 1, "it ran alone: {completion:?}");
    assert_eq!(warming.join().unwrap().unwrap().seconds, second.seconds);
    let metrics = engine.metrics();
    assert_eq!(
        metrics.tokens_in, completion.prompt_tokens as u64,
        "{metrics:?}"
    );
}

#[test]
fn unknown_model_folder_is_an_error_event() {
    let engine = Engine::start(1).unwrap();
    let mut bad = request("hi", 4);
    bad.model = fixture("does-not-exist");
    let error = engine.submit(bad).unwrap().wait().unwrap_err();
    assert!(error.to_string().contains("does-not-exist"), "{error}");
    // The engine survives and serves the next request.
    assert_eq!(
        engine
            .submit(request("hi", 3))
            .unwrap()
            .wait()
            .unwrap()
            .completion_tokens,
        3
    );
}

#[test]
fn repeated_conversation_hits_the_prefix_cache_with_identical_answers() {
    let conversation = |turns: usize| {
        let mut messages = vec![serde_json::json!({"role": "system", "content": "You are terse."})];
        for turn in 0..turns {
            messages
                .push(serde_json::json!({"role": "user", "content": format!("Question {turn}?")}));
            messages.push(
                serde_json::json!({"role": "assistant", "content": format!("Answer {turn}.")}),
            );
        }
        messages.push(serde_json::json!({"role": "user", "content": "And now?"}));
        Request {
            prompt: Prompt::Chat {
                messages,
                options: rmlx_engine::chat::TemplateOptions {
                    add_generation_prompt: true,
                    ..Default::default()
                },
            },
            ..request("", 12)
        }
    };
    let cached = Engine::start(4).unwrap();
    let uncached = Engine::start_with(rmlx_engine::engine::EngineOptions {
        prefix_cache_bytes: Some(0),
        ..Default::default()
    })
    .unwrap();
    let first = cached.submit(conversation(1)).unwrap().wait().unwrap();
    assert_eq!(first.cached_tokens, 0);
    let second = cached.submit(conversation(2)).unwrap().wait().unwrap();
    assert!(second.cached_tokens > 10, "cached {}", second.cached_tokens);
    let reference = uncached.submit(conversation(2)).unwrap().wait().unwrap();
    assert_eq!(reference.cached_tokens, 0);
    assert_eq!(second.token_ids, reference.token_ids);

    let metrics = cached.metrics();
    let model = &metrics.models[0];
    assert_eq!((model.prefix_cache_hits, model.prefix_cache_misses), (1, 1));
    assert_eq!(model.ttft_ms.count, 2);
    assert_eq!(model.itl_ms.count, 22);
    assert_eq!(model.tokens_out, 24);
    assert_eq!(
        model.tokens_in as usize,
        first.prompt_tokens + second.prompt_tokens
    );
    assert_eq!(
        (
            metrics.in_flight,
            metrics.queue_depth,
            metrics.kv_cache_bytes
        ),
        (0, 0, 0)
    );
    assert!(metrics.prefix_cache_bytes > 0);
    // Per model, and the budgets sized for agent sessions (this machine's memory, the tiny
    // model's KV: the floors).
    assert_eq!(model.prefix_cache_bytes, metrics.prefix_cache_bytes);
    assert_eq!(
        (
            metrics.prefix_cache_budget_bytes,
            metrics.prefix_snapshot_budget_bytes
        ),
        (
            rmlx_engine::prefix_cache::MIN_KV_BUDGET,
            rmlx_engine::prefix_cache::MIN_SNAPSHOT_BUDGET
        )
    );
    assert!(metrics.mlx_active_bytes > 0);
}

#[test]
fn assistant_prefill_is_part_of_the_prompt_not_the_answer() {
    let engine = Engine::start(4).unwrap();
    let tokenizer = ChatTokenizer::from_dir(&fixture("qwen3-tiny")).unwrap();
    let plain = request("Weather in Paris?", 6);
    let Prompt::Chat { messages, options } = &plain.prompt else {
        unreachable!("request() builds a chat prompt")
    };
    let rendered = tokenizer.render(messages, options).unwrap();
    let prefill = "<tool_call>\n{\"name\": \"";
    let prefilled = Request {
        assistant_prefill: Some(prefill.into()),
        ..plain.clone()
    };
    let handle = engine.submit(prefilled).unwrap();
    let Event::Started { prompt_tokens, .. } = handle.events.recv().unwrap() else {
        panic!("the first event is Started");
    };
    let completion = handle.wait().unwrap();
    let expected = tokenizer
        .encode(&format!("{rendered}{prefill}"), false)
        .unwrap();
    assert_eq!(completion.prompt_ids, expected);
    assert_eq!(
        (prompt_tokens, completion.prompt_tokens),
        (expected.len(), expected.len())
    );
    // The answer is only what follows the prefill.
    assert_eq!(completion.completion_tokens, 6);
    assert!(!completion.text.starts_with("<tool_call>"));
    let without = engine.submit(plain).unwrap().wait().unwrap();
    assert!(expected.len() > without.prompt_ids.len());
    assert_eq!(
        without.prompt_ids,
        tokenizer.encode(&rendered, false).unwrap()
    );

    // A text prompt gets the prefill appended as well.
    let text = Request {
        prompt: Prompt::Text("Once upon".into()),
        assistant_prefill: Some(" a time".into()),
        ..request("", 2)
    };
    let completion = engine.submit(text).unwrap().wait().unwrap();
    assert_eq!(
        completion.prompt_ids,
        tokenizer.encode_plain("Once upon a time").unwrap()
    );
}

#[test]
fn a_model_that_cannot_fit_is_refused_before_loading() {
    let engine = Engine::start_with(rmlx_engine::engine::EngineOptions {
        memory_budget: Some(100_000),
        ..Default::default()
    })
    .unwrap();
    let error = engine.submit(request("hi", 4)).unwrap().wait().unwrap_err();
    match &error {
        EngineError::ModelTooLarge {
            needed, available, ..
        } => {
            assert_eq!(*available, 100_000);
            assert!(*needed > 800_000, "{needed}");
        }
        other => panic!("{other}"),
    }
    assert!(error.to_string().contains("GB"), "{error}");
    assert!(engine.loaded().unwrap().is_empty());
    assert_eq!(engine.metrics().error_counts["model_too_large"], 1);
}

#[test]
fn listing_models_does_not_wait_behind_a_generation() {
    let engine = Engine::start(4).unwrap();
    assert!(engine.loaded().unwrap().is_empty());
    let handle = engine
        .submit(request("A long answer please", 1900))
        .unwrap();
    loop {
        if let Event::Delta { .. } = handle.events.recv().unwrap() {
            break;
        }
    }
    let asked = std::time::Instant::now();
    let loaded = engine.loaded().unwrap();
    assert!(asked.elapsed().as_millis() < 500);
    assert_eq!(loaded.len(), 1);
    assert_eq!(loaded[0].model_type, "qwen3");
    handle.cancel();
    handle.wait().unwrap();
    assert!(engine.unload(&fixture("qwen3-tiny")).unwrap());
    assert!(engine.loaded().unwrap().is_empty());
}

/// One request of the batching tests: a chat turn, greedy, with the top-2 log-probs. Prompts
/// with a digit also carry a logit bias (rows with one are sampled with the batch, their bias
/// added as a row).
fn batch_request(dir: &str, text: &str, image: Option<&str>, max_tokens: usize) -> Request {
    let logit_bias = match text.chars().any(|c| c.is_ascii_digit()) {
        true => [(15, 6.0), (16, -2.5), (220, 5.0)].into_iter().collect(),
        false => Default::default(),
    };
    let content = match image {
        Some(_) => serde_json::json!([{"type": "image"}, {"type": "text", "text": text}]),
        None => serde_json::json!(text),
    };
    Request {
        model: fixture(dir),
        prompt: Prompt::Chat {
            messages: vec![serde_json::json!({"role": "user", "content": content})],
            options: rmlx_engine::chat::TemplateOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        },
        images: image
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
            logprobs: Some(2),
            sampling: SamplingParams {
                logit_bias,
                ..SamplingParams::default()
            },
            ..GenerateParams::default()
        },
        ..Request::default()
    }
}

/// Teacher-forced comparison of a batched answer with the same request run alone: while the
/// tokens agree, every log-prob (chosen and top-2) within `tolerance`; where the solo run's top-2
/// margin is at least 0.05 the greedy ids must agree, below it the batch may pick the other
/// token and the comparison ends there.
fn assert_same_answer(what: &str, solo: &Completion, batched: &Completion, tolerance: f32) {
    assert_eq!(solo.prompt_ids, batched.prompt_ids, "{what}: prompt ids");
    let (solo_lp, batched_lp) = (
        solo.logprobs.as_ref().unwrap(),
        batched.logprobs.as_ref().unwrap(),
    );
    assert_eq!(solo_lp.len(), batched_lp.len(), "{what}: token count");
    for (step, (s, b)) in solo_lp.iter().zip(batched_lp).enumerate() {
        let margin = s.top[0].logprob - s.top[1].logprob;
        if s.token_id != b.token_id {
            assert!(
                margin < 0.05,
                "{what}: step {step}: batched {} vs solo {} at margin {margin}",
                b.token_id,
                s.token_id
            );
            return;
        }
        let pairs = std::iter::once((s.logprob, b.logprob)).chain(
            s.top
                .iter()
                .zip(&b.top)
                .map(|(s, b)| (s.logprob, b.logprob)),
        );
        for (s_lp, b_lp) in pairs {
            assert!(
                (s_lp - b_lp).abs() <= tolerance,
                "{what}: step {step}: log-prob {b_lp} batched vs {s_lp} alone"
            );
        }
    }
}

/// The every-family batch check again with each padded row's one-query steps computed by
/// grouped matmuls over its KV heads instead of MLX's SDPA (`RMLX_GROUPED_ONE_QUERY=1`, CUDA's
/// default, see `attention::grouped_one_query_mask`), in a child process of this
/// test binary (the switch is read once per process): the answers still equal solo runs.
#[test]
fn padded_one_query_steps_grouped_over_kv_heads_equal_solo_runs() {
    common::rerun_in_child_with(
        "RMLX_GROUPED_ONE_QUERY",
        &["batched_requests_equal_their_solo_runs_in_every_family"],
    );
}

/// Continuous batching in every family: four requests of different prompt lengths and token
/// budgets (so rows join mid-decode, padded, and leave while others go on; with an image
/// where the family sees) each equal their solo runs, the text prompts having prefilled
/// together, and the same batch again is served from the prefix cache (pictures too) with the
/// same answers.
#[test]
fn batched_requests_equal_their_solo_runs_in_every_family() {
    // (fixture, sees images, log-prob tolerance): 1e-4 in fp32; the 4-bit checkpoint computes
    // in bf16 (its scales' dtype), where a batched matmul rounds differently at bf16's ~3 digits.
    let families: [(&str, bool, f32); 6] = [
        ("qwen3-tiny", false, 1e-4),
        ("qwen3-tiny-4bit", false, 0.1),
        ("qwen3-vl-tiny", true, 1e-4),
        ("gemma4-tiny", true, 1e-4),
        ("releases/qwen3.5-0.8b", true, 1e-4),
        ("releases/qwen3.6-35b-a3b", true, 1e-4),
    ];
    let turns: [(&str, Option<&str>, usize); 4] = [
        ("Hi", None, 12),
        (
            "Describe this picture in many words",
            Some("gradient_64x48.png"),
            5,
        ),
        ("2+2?", None, 16),
        (
            "Zürich, 東京 🙂 and a few more words to make this prompt the longest",
            None,
            9,
        ),
    ];
    for (dir, sees, tolerance) in families {
        let turns: Vec<_> = turns
            .iter()
            .filter(|(_, image, _)| sees || image.is_none())
            .collect();
        let alone = Engine::start_with(EngineOptions {
            max_batch: 1,
            prefix_cache_bytes: Some(0),
            prefix_snapshot_bytes: Some(0),
            ..EngineOptions::default()
        })
        .unwrap();
        let solo: Vec<Completion> = turns
            .iter()
            .map(|(text, image, max)| {
                let request = batch_request(dir, text, *image, *max);
                alone.submit(request).unwrap().wait().unwrap()
            })
            .collect();
        assert!(solo.iter().all(|completion| completion.batched_with == 1));
        drop(alone);
        let engine = Engine::start(16).unwrap();
        for round in ["first", "repeated"] {
            let handles: Vec<_> = turns
                .iter()
                .enumerate()
                .map(|(index, (text, image, max))| {
                    let mut request = batch_request(dir, text, *image, *max);
                    request.request_id = Some(format!("{round}-{index}"));
                    engine.submit(request).unwrap()
                })
                .collect();
            let batched: Vec<Completion> = handles
                .into_iter()
                .map(|handle| handle.wait().unwrap())
                .collect();
            let widest = batched.iter().map(|c| c.batched_with).max().unwrap();
            assert!(widest >= 3, "{dir}: at most {widest} rows decoded together");
            // The prompts, sent at once, prefilled as rows of one forward (`group.rs`).
            let together = batched
                .iter()
                .map(|c| c.timings.prefilled_with)
                .max()
                .unwrap();
            if round == "first" {
                assert!(together >= 2, "{dir}: every prompt prefilled alone");
            }
            for (index, (solo, batched)) in solo.iter().zip(&batched).enumerate() {
                let what = format!("{dir} {round} #{index}");
                assert_same_answer(&what, solo, batched, tolerance);
            }
            // Metrics stay per request: each row's own TTFT, every gap, tokens and cache hit.
            let recent = engine.metrics().recent;
            for (index, completion) in batched.iter().enumerate() {
                let id = format!("{round}-{index}");
                let record = recent
                    .iter()
                    .find(|record| record.id.as_deref() == Some(id.as_str()))
                    .unwrap_or_else(|| panic!("{dir}: no metrics for {id}"));
                assert_eq!(record.tokens_out, completion.completion_tokens);
                assert_eq!(record.tokens_in, completion.prompt_tokens);
                assert_eq!(record.cached_tokens, completion.cached_tokens);
                assert_eq!(record.itl_ms, completion.timings.itl_ms);
                assert_eq!(record.itl_ms.len() + 1, completion.completion_tokens);
                assert!(record.ttft_ms > 0.0 && record.ttft_ms == completion.timings.ttft_ms);
            }
            if round == "repeated" {
                for (completion, (_, image, _)) in batched.iter().zip(&turns) {
                    // Every prompt again, with a picture too (keyed by its pixels).
                    assert!(
                        completion.cached_tokens > 0,
                        "{dir} (image: {image:?}): nothing cached"
                    );
                }
            }
        }
        let idle = engine.metrics();
        assert_eq!((idle.in_flight, idle.kv_cache_bytes), (0, 0));
    }
}

/// An engine decoding up to `max_batch` rows together, with no prefix cache.
fn without_prefix_cache(max_batch: usize) -> Engine {
    Engine::start_with(EngineOptions {
        max_batch,
        prefix_cache_bytes: Some(0),
        prefix_snapshot_bytes: Some(0),
        ..EngineOptions::default()
    })
    .unwrap()
}

/// Gemma 4's windowed sliding layers in a batch: prompts several windows long and answers long
/// enough for every window to drop old positions many times, rows joining mid-decode at
/// different offsets and leaving at others; each equals its solo run.
#[test]
fn windowed_rows_join_and_leave_as_their_solo_runs() {
    let dir = "gemma4-tiny";
    let words = [
        "river", "stone", "maple", "quiet", "lantern", "harbor", "copper", "meadow", "signal",
    ];
    let text = |count: usize, shift: usize| {
        (0..count)
            .map(|i| words[(i * 7 + shift) % words.len()])
            .collect::<Vec<_>>()
            .join(" ")
    };
    // (prompt words, answer tokens): the 64-token window wraps in every prompt.
    let turns = [(300, 260), (60, 300), (500, 40), (150, 150)];
    let requests = |round: &str| -> Vec<Request> {
        turns
            .iter()
            .enumerate()
            .map(|(index, &(count, max))| {
                let mut request = batch_request(dir, &text(count, index), None, max);
                request.request_id = Some(format!("{round}-{index}"));
                request
            })
            .collect()
    };
    let alone = without_prefix_cache(1);
    let solo: Vec<Completion> = requests("solo")
        .into_iter()
        .map(|request| alone.submit(request).unwrap().wait().unwrap())
        .collect();
    drop(alone);
    assert!(solo.iter().all(|completion| completion.prompt_tokens > 100));
    let engine = without_prefix_cache(4);
    let handles: Vec<_> = requests("batch")
        .into_iter()
        .map(|request| engine.submit(request).unwrap())
        .collect();
    let batched: Vec<Completion> = handles.into_iter().map(|h| h.wait().unwrap()).collect();
    let widest = batched.iter().map(|c| c.batched_with).max().unwrap();
    assert!(widest >= 3, "at most {widest} rows decoded together");
    for (index, (solo, batched)) in solo.iter().zip(&batched).enumerate() {
        assert_same_answer(&format!("{dir} #{index}"), solo, batched, 1e-4);
    }
}

/// Prompts that arrive together prefill together (`group.rs`): in pieces of a few tokens, so
/// members take several steps, leave at different times and (Gated DeltaNet) snapshot their
/// state at message boundaries as rows of the group; with the draft head primed row by row
/// (Qwen3.6); one more member is cancelled mid-way. Every other answer equals its solo run, and
/// so does turn 2 of every conversation, sent together again, which reuses those snapshots and
/// prefixes from the prefix cache.
#[test]
fn prompts_prefilled_together_equal_their_solo_runs() {
    let words = [
        "river", "stone", "maple", "quiet", "lantern", "harbor", "copper",
    ];
    let text = |count: usize, shift: usize| {
        (0..count)
            .map(|i| words[(i * 5 + shift) % words.len()])
            .collect::<Vec<_>>()
            .join(" ")
    };
    let chat = |dir: &str, messages: Vec<serde_json::Value>, id: String| {
        let mut request = batch_request(dir, "", None, 6);
        request.prompt = Prompt::Chat {
            messages,
            options: rmlx_engine::chat::TemplateOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        };
        request.params.prefill_chunk = Some(16);
        request.request_id = Some(id);
        request
    };
    let first_turns = |index: usize| {
        vec![
            serde_json::json!({"role": "system", "content": text(5 + index, index)}),
            // The first prompt is the longest: the others finish (and snapshot) as later rows
            // while it is still row 0.
            serde_json::json!({"role": "user", "content": text(30 - 9 * index, index + 1)}),
        ]
    };
    for dir in ["qwen3-tiny", "gemma4-tiny", "releases/qwen3.6-35b-a3b"] {
        let alone = without_prefix_cache(1);
        let engine = Engine::start(16).unwrap();
        let mut conversations: Vec<Vec<serde_json::Value>> = (0..3).map(first_turns).collect();
        for round in ["turn 1", "turn 2"] {
            let solo: Vec<Completion> = conversations
                .iter()
                .enumerate()
                .map(|(i, messages)| {
                    let request = chat(dir, messages.clone(), format!("solo {round} {i}"));
                    alone.submit(request).unwrap().wait().unwrap()
                })
                .collect();
            let handles: Vec<_> = conversations
                .iter()
                .enumerate()
                .map(|(i, messages)| {
                    let request = chat(dir, messages.clone(), format!("{round} {i}"));
                    engine.submit(request).unwrap()
                })
                .collect();
            // One more prompt, the longest, cancelled while it prefills with the others: it
            // ends as cancelled and the rows it shared go on.
            let mut quitter = conversations[0].clone();
            quitter.push(serde_json::json!({"role": "assistant", "content": text(40, 2)}));
            quitter.push(serde_json::json!({"role": "user", "content": text(40, 4)}));
            let quitter = engine
                .submit(chat(dir, quitter, format!("{round} cancelled")))
                .unwrap();
            loop {
                match quitter.events.recv().unwrap() {
                    Event::Started { .. } => break,
                    Event::Error(error) => panic!("{error}"),
                    _ => {}
                }
            }
            quitter.cancel();
            let cancelled = quitter.wait().unwrap();
            assert_eq!(cancelled.finish_reason, FinishReason::Cancelled, "{dir}");
            let together: Vec<Completion> =
                handles.into_iter().map(|h| h.wait().unwrap()).collect();
            for (index, (solo, together)) in solo.iter().zip(&together).enumerate() {
                let what = format!("{dir} {round} #{index}");
                assert_same_answer(&what, solo, together, 1e-4);
                assert!(
                    together.timings.prefilled_with >= 2,
                    "{what}: prefilled alone ({} prompt tokens, {} cached)",
                    together.prompt_tokens,
                    together.cached_tokens
                );
                if round == "turn 2" {
                    assert!(together.cached_tokens > 0, "{what}: nothing cached");
                }
            }
            let errors = engine.metrics().error_counts;
            assert!(errors.is_empty(), "{dir} {round}: {errors:?}");
            for (messages, answer) in conversations.iter_mut().zip(&together) {
                messages.push(serde_json::json!({"role": "assistant", "content": answer.text}));
                messages.push(serde_json::json!({"role": "user", "content": text(10, 3)}));
            }
        }
    }
}

/// Prompts with images prefill together: image blocks of one length go through one forward
/// (each row its own features, rotary positions and, on Gemma 4, its spans attending both
/// ways), a block of another length goes alone, text around them groups. Every answer equals
/// its solo run; so does a second turn whose new pictures join rows with different cached
/// prefixes and rope deltas.
#[test]
fn prompts_with_images_prefilled_together_equal_their_solo_runs() {
    let first: [(&str, Option<&str>); 4] = [
        ("Describe this picture", Some("gradient_64x48.png")),
        (
            "What is in it, in a few words?",
            Some("gradient_64x48_mirror.png"),
        ),
        ("Hi there, no picture in this one at all", None),
        ("And this one?", Some("noise_80x100.png")),
    ];
    let user = |text: &str, image: bool| match image {
        true => serde_json::json!({"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": text}]}),
        false => serde_json::json!({"role": "user", "content": text}),
    };
    let request = |dir: &str, messages: &[serde_json::Value], images: &[&str], id: String| {
        let mut request = batch_request(dir, "", None, 5);
        request.prompt = Prompt::Chat {
            messages: messages.to_vec(),
            options: rmlx_engine::chat::TemplateOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        };
        request.images = images
            .iter()
            .map(|name| {
                image::open(fixture("vision-images").join(name))
                    .unwrap()
                    .to_rgb8()
            })
            .collect();
        request.request_id = Some(id);
        request
    };
    for dir in [
        "qwen3-vl-tiny",
        "gemma4-tiny",
        "releases/qwen3.5-0.8b",
        "releases/qwen3.6-35b-a3b",
    ] {
        let alone = without_prefix_cache(1);
        let engine = Engine::start(16).unwrap();
        let mut conversations: Vec<(Vec<serde_json::Value>, Vec<&str>)> = first
            .iter()
            .map(|(text, image)| {
                (
                    vec![user(text, image.is_some())],
                    image.iter().copied().collect(),
                )
            })
            .collect();
        for round in ["turn 1", "turn 2"] {
            let solo: Vec<Completion> = conversations
                .iter()
                .enumerate()
                .map(|(i, (messages, images))| {
                    let request = request(dir, messages, images, format!("solo {round} {i}"));
                    alone.submit(request).unwrap().wait().unwrap()
                })
                .collect();
            // All four queued before any starts (see the hold in
            // `prompts_prefill_together_only_within_one_context`).
            let hold = engine.hold_for_warm_up();
            let handles: Vec<_> = conversations
                .iter()
                .enumerate()
                .map(|(i, (messages, images))| {
                    let request = request(dir, messages, images, format!("{round} {i}"));
                    engine.submit(request).unwrap()
                })
                .collect();
            engine.model_info(&fixture(dir)).unwrap();
            drop(hold);
            let together: Vec<Completion> =
                handles.into_iter().map(|h| h.wait().unwrap()).collect();
            let with: Vec<usize> = together
                .iter()
                .map(|c| c.timings.images_prefilled_with)
                .collect();
            for (index, (solo, together)) in solo.iter().zip(&together).enumerate() {
                let what = format!("{dir} {round} #{index} (images prefilled with {with:?})");
                assert_same_answer(&what, solo, together, 1e-4);
                assert_eq!(
                    solo.timings.images_prefilled_with.min(1),
                    with[index].min(1)
                );
            }
            match round {
                // The two pictures of one size went in together, none with the text-only
                // prompt; the larger picture alone where its block is longer (Qwen's count
                // follows the size; Gemma 4 gives these small pictures one count).
                "turn 1" => assert!(
                    with[0] >= 2
                        && with[1] >= 2
                        && with[2] == 0
                        && (with[3] == 1) == dir.contains("qwen"),
                    "{dir} {round}: images prefilled with {with:?}"
                ),
                // Every row's new picture has one size: they went in together, after prefixes
                // of different lengths (the text before them stepped apart where it differed).
                _ => {
                    assert!(
                        with.iter().all(|&rows| rows >= 2),
                        "{dir} {round}: images prefilled with {with:?}"
                    );
                    assert!(
                        together.iter().all(|c| c.cached_tokens > 0),
                        "{dir}: nothing cached"
                    );
                }
            }
            let errors = engine.metrics().error_counts;
            assert!(errors.is_empty(), "{dir} {round}: {errors:?}");
            for ((messages, images), answer) in conversations.iter_mut().zip(&together) {
                messages.push(serde_json::json!({"role": "assistant", "content": answer.text}));
                messages.push(user("And now this picture?", true));
                images.push("gradient_64x48_mirror.png");
            }
        }
    }
}

/// An image block longer than a group step's share per row goes alone at once, beside a long
/// text prompt prefilling in pieces of one chunk: the picture's prompt is done long before
/// the text's (it used to wait: the text prompt, whose pieces can never take the whole block,
/// went alone, the group of two dissolved and formed again, and the block never stepped until
/// the text was prefilled). Both answers equal their solo runs.
#[test]
fn an_image_block_longer_than_a_chunk_does_not_wait_for_text_beside_it() {
    let dir = "qwen3-vl-tiny";
    let chunked = |mut request: Request, id: &str| {
        request.params.prefill_chunk = Some(4);
        request.params.max_tokens = 2;
        request.request_id = Some(id.to_string());
        request
    };
    let long_text = (0..300)
        .map(|i| ["river", "stone", "maple", "quiet"][i % 4])
        .collect::<Vec<_>>()
        .join(" ");
    let picture = || {
        chunked(
            batch_request(dir, "Describe it", Some("noise_80x100.png"), 2),
            "picture",
        )
    };
    let text = || chunked(batch_request(dir, &long_text, None, 2), "text");
    let alone = without_prefix_cache(1);
    let solo_picture = alone.submit(picture()).unwrap().wait().unwrap();
    let solo_text = alone.submit(text()).unwrap().wait().unwrap();
    let engine = without_prefix_cache(8);
    let hold = engine.hold_for_warm_up();
    let handles = [
        engine.submit(picture()).unwrap(),
        engine.submit(text()).unwrap(),
    ];
    engine.model_info(&fixture(dir)).unwrap();
    drop(hold);
    let [with_picture, text_only] = handles.map(|handle| handle.wait().unwrap());
    assert_same_answer("picture", &solo_picture, &with_picture, 1e-4);
    assert_same_answer("text", &solo_text, &text_only, 1e-4);
    assert!(
        text_only.prompt_tokens > 4 * with_picture.prompt_tokens,
        "{} vs {} prompt tokens",
        text_only.prompt_tokens,
        with_picture.prompt_tokens
    );
    assert!(
        with_picture.timings.ttft_ms < text_only.timings.ttft_ms,
        "the picture's prompt waited for the text: TTFT {:.1} against {:.1} ms",
        with_picture.timings.ttft_ms,
        text_only.timings.ttft_ms
    );
}

/// Members whose pieces are shorter than the group's image blocks step alone, and the group
/// steps too before they come back: two pictures of one size beside a chat of many short
/// messages (a Gated DeltaNet model cuts its pieces at every message, each shorter than a
/// block) are prefilled long before the chat is. They used to wait for all of it: the chat
/// went alone, came back to the same choice, and the group never stepped.
#[test]
fn a_group_steps_while_short_pieces_go_alone_beside_it() {
    let dir = "releases/qwen3.5-0.8b";
    let named = |mut request: Request, id: &str| {
        request.params.max_tokens = 2;
        request.request_id = Some(id.to_string());
        request
    };
    let picture = |id: &str| {
        named(
            batch_request(dir, "Describe it", Some("gradient_64x48.png"), 2),
            id,
        )
    };
    let chat = || {
        let mut request = named(batch_request(dir, "", None, 2), "chat");
        let messages: Vec<serde_json::Value> = (0..40)
            .map(|i| {
                let role = ["user", "assistant"][i % 2];
                serde_json::json!({"role": role, "content": format!("short note {i}")})
            })
            .chain(std::iter::once(
                serde_json::json!({"role": "user", "content": "and the last"}),
            ))
            .collect();
        request.prompt = Prompt::Chat {
            messages,
            options: rmlx_engine::chat::TemplateOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        };
        request
    };
    let alone = without_prefix_cache(1);
    let solo: Vec<Completion> = [picture("a"), picture("b"), chat()]
        .into_iter()
        .map(|request| alone.submit(request).unwrap().wait().unwrap())
        .collect();
    let engine = without_prefix_cache(8);
    let hold = engine.hold_for_warm_up();
    let handles = [
        engine.submit(picture("a")).unwrap(),
        engine.submit(picture("b")).unwrap(),
        engine.submit(chat()).unwrap(),
    ];
    engine.model_info(&fixture(dir)).unwrap();
    drop(hold);
    let together = handles.map(|handle| handle.wait().unwrap());
    for (index, (solo, together)) in solo.iter().zip(&together).enumerate() {
        assert_same_answer(&format!("#{index}"), solo, together, 1e-4);
    }
    let [a, b, chat] = &together;
    assert!(
        chat.prompt_tokens > 3 * a.prompt_tokens,
        "{} {}",
        chat.prompt_tokens,
        a.prompt_tokens
    );
    assert!(
        a.timings.images_prefilled_with >= 2 && b.timings.images_prefilled_with >= 2,
        "the pictures did not prefill together: {} {}",
        a.timings.images_prefilled_with,
        b.timings.images_prefilled_with
    );
    assert!(
        a.timings.ttft_ms.max(b.timings.ttft_ms) < chat.timings.ttft_ms,
        "the pictures waited for the chat: TTFT {:.1} / {:.1} against {:.1} ms",
        a.timings.ttft_ms,
        b.timings.ttft_ms,
        chat.timings.ttft_ms
    );
}

/// Prompts that arrive while a group prefills enter it mid-way: their rows are left-padded to
/// the group's columns and take the same pieces from then on; every answer equals its solo run.
#[test]
fn prompts_entering_a_group_mid_way_equal_their_solo_runs() {
    let words = [
        "river", "stone", "maple", "quiet", "lantern", "harbor", "copper",
    ];
    let text = |count: usize, shift: usize| {
        (0..count)
            .map(|i| words[(i * 3 + shift) % words.len()])
            .collect::<Vec<_>>()
            .join(" ")
    };
    for dir in ["qwen3-tiny", "releases/qwen3.6-35b-a3b"] {
        let request = |index: usize, words: usize| {
            let mut request = batch_request(dir, &text(words, index), None, 6);
            request.params.prefill_chunk = Some(8);
            request.request_id = Some(format!("mid-way {index}"));
            request
        };
        let sizes = [90, 70, 30, 50];
        let alone = without_prefix_cache(1);
        let solo: Vec<Completion> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| alone.submit(request(i, n)).unwrap().wait().unwrap())
            .collect();
        drop(alone);
        let engine = without_prefix_cache(8);
        let mut handles: Vec<_> = sizes[..2]
            .iter()
            .enumerate()
            .map(|(i, &n)| engine.submit(request(i, n)).unwrap())
            .collect();
        // The first two are prefilling (together) before the others are sent.
        for handle in &handles {
            loop {
                match handle.events.recv().unwrap() {
                    Event::Started { .. } => break,
                    Event::Error(error) => panic!("{error}"),
                    _ => {}
                }
            }
        }
        handles.extend(
            sizes[2..]
                .iter()
                .enumerate()
                .map(|(i, &n)| engine.submit(request(i + 2, n)).unwrap()),
        );
        let together: Vec<Completion> = handles.into_iter().map(|h| h.wait().unwrap()).collect();
        for (index, (solo, together)) in solo.iter().zip(&together).enumerate() {
            let what = format!("{dir} #{index}");
            assert_same_answer(&what, solo, together, 1e-4);
        }
        let grouped = together
            .iter()
            .filter(|c| c.timings.prefilled_with >= 3)
            .count();
        assert!(
            grouped >= 3,
            "{dir}: {grouped} prompts prefilled in a group of 3+"
        );
    }
}

/// A qwen3-tiny request of `words` words (35: a 108-token prompt, 15: 53 tokens) in a context
/// of 160, answering `max_tokens` tokens.
fn words_in_160(words: usize, shift: usize, max_tokens: usize) -> Request {
    let text = (0..words)
        .map(|i| ["river", "stone", "maple", "quiet"][(i + shift) % 4])
        .collect::<Vec<_>>()
        .join(" ");
    let mut request = batch_request("qwen3-tiny", &text, None, max_tokens);
    request.params.max_ctx = Some(160);
    request
}

/// `requests` submitted while the engine holds them, their model loaded, then let go at once:
/// the engine takes them all in one pass, in order.
fn submit_together(
    engine: &Engine,
    requests: &[Request],
) -> Vec<rmlx_engine::engine::RequestHandle> {
    let hold = engine.hold_for_warm_up();
    let handles = requests
        .iter()
        .map(|request| engine.submit(request.clone()).unwrap())
        .collect();
    engine.model_info(&requests[0].model).unwrap();
    drop(hold);
    handles
}

/// An engine of up to 4 rows, no prefix cache, whose memory budget leaves qwen3-tiny KV for
/// `positions` positions (half of what its weights leave; qwen3 has no fixed state per row).
fn engine_with_kv_for(positions: u64) -> Engine {
    let dir = fixture("qwen3-tiny");
    let per_token = without_prefix_cache(1)
        .model_info(&dir)
        .unwrap()
        .kv_bytes_per_token;
    let weights = rmlx_engine::runtime::memory_needed(&dir).unwrap();
    Engine::start_with(EngineOptions {
        max_batch: 4,
        prefix_cache_bytes: Some(0),
        prefix_snapshot_bytes: Some(0),
        memory_budget: Some(weights + 2 * positions * per_token),
        ..EngineOptions::default()
    })
    .unwrap()
}

/// Prompts prefill together, and decode together, only while their rows fit: within one
/// context as they are now (padded to the longest), or, beyond it, within the memory for KV
/// (half of what the weights leave of the memory budget) at the most they can reach, every row
/// padded to the longest and grown by the longest answer still to come. Two prompts of more
/// than half the context go one after the other when memory holds only one context, or more
/// than one but not the pair, or the pair but not their answers; side by side when it holds
/// all; two of less than half always together; every answer equals its solo run.
#[test]
fn prompts_prefill_and_decode_together_within_the_memory_for_kv() {
    let request = words_in_160;
    let alone = without_prefix_cache(1);
    // 35 words: 108-token prompts, two past the context of 160.
    let cases = [
        (35, 4, 100, false),
        (15, 4, 100, true),
        (35, 4, 200, false),
        (35, 4, 400, true),
        (35, 40, 260, false),
        (35, 40, 320, true),
    ];
    for (words, max_tokens, positions, together) in cases {
        let solo: Vec<Completion> = (0..2)
            .map(|i| {
                let request = request(words, i, max_tokens);
                alone.submit(request).unwrap().wait().unwrap()
            })
            .collect();
        let engine = engine_with_kv_for(positions);
        // Both wait until both are queued (a busy machine could otherwise start the first
        // before the second arrives, and this test is about what fits, not about timing).
        let hold = engine.hold_for_warm_up();
        let handles: Vec<_> = (0..2)
            .map(|i| engine.submit(request(words, i, max_tokens)).unwrap())
            .collect();
        // A query answered while the hold lasts (it goes ahead of held requests) arrives after
        // both: once it is answered, the engine has both queued. Without it the engine could
        // see the hold end before the second had reached it, and admit the first alone.
        engine.model_info(&request(words, 0, 1).model).unwrap();
        drop(hold);
        let answers: Vec<Completion> = handles.into_iter().map(|h| h.wait().unwrap()).collect();
        let prompt = answers[0].prompt_tokens;
        let what = format!(
            "{prompt}-token prompts, {max_tokens}-token answers, context 160, KV for {positions}"
        );
        for (index, (solo, answer)) in solo.iter().zip(&answers).enumerate() {
            assert_same_answer(&format!("{what} #{index}"), solo, answer, 1e-4);
            assert_eq!(answer.completion_tokens, max_tokens, "{what}");
            assert_eq!(answer.timings.prefilled_with >= 2, together, "{what}");
            assert_eq!(answer.batched_with == 2, together, "{what}");
        }
        assert_eq!(2 * prompt > 160, words == 35, "{what}");
        assert_eq!(prompt, [108, 53][usize::from(words == 15)], "{what}");
    }
}

/// A request starts prefilling only while what the others hold leaves room for KV (or they
/// hold one context or less): prefilled prompts wait holding their KV, so without this
/// `max_batch` long prompts would all prefill at once whatever the memory. Three prompts past
/// half the context: with KV for more than one of them but not two, the third starts only
/// after an answer ends (event order, not timing: the handles are polled in turn, the third's
/// first, and each event is stamped with the sweep that saw it, so a start seen no earlier than
/// an end came after it); with room for all, the three prefill and decode together.
#[test]
fn a_request_starts_only_while_memory_holds_the_kv_of_those_before_it() {
    use rmlx_engine::engine::Event;
    let request = |shift: usize| words_in_160(35, shift, 4);
    // 108-token prompts and 4-token answers: each reaches 112 positions.
    for (positions, gated) in [(200, true), (1000, false)] {
        let engine = engine_with_kv_for(positions);
        let hold = engine.hold_for_warm_up();
        let handles: Vec<_> = (0..3).map(|i| engine.submit(request(i)).unwrap()).collect();
        engine.model_info(&request(0).model).unwrap();
        drop(hold);
        let (mut started, mut done) = ([None; 3], [None; 3]);
        let mut answers: [Option<Completion>; 3] = Default::default();
        let mut sweep = 0usize;
        while done.iter().any(Option::is_none) {
            sweep += 1;
            for i in [2, 0, 1] {
                while let Ok(event) = handles[i].events.try_recv() {
                    match event {
                        Event::Started { .. } => started[i] = Some(sweep),
                        Event::Done(answer) => {
                            done[i] = Some(sweep);
                            answers[i] = Some(answer);
                        }
                        Event::Error(error) => panic!("request {i}: {error}"),
                        _ => {}
                    }
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let what = format!("KV for {positions}: started {started:?}, done {done:?}");
        let answers = answers.map(Option::unwrap);
        assert!(answers.iter().all(|a| a.completion_tokens == 4), "{what}");
        if gated {
            let first_end = done[0].min(done[1]).unwrap();
            // Seen first in its sweep, a start came after an end seen in the same sweep.
            assert!(started[2].unwrap() >= first_end, "{what}");
            assert!(answers.iter().all(|a| a.batched_with == 1), "{what}");
        } else {
            for answer in &answers {
                assert_eq!(answer.timings.prefilled_with, 3, "{what}");
                assert_eq!(answer.batched_with, 3, "{what}");
            }
        }
    }
}

/// Prompts prefill first come, first served: one that cannot join the prefilling group (its KV
/// would not fit beside it) is not overtaken by prompts that arrived after it and could, which
/// would keep the group alive while arrivals last. Two short prompts, a long one, two short
/// ones: the long one prefills once the first two have, and answers no later than the last
/// two.
#[test]
fn a_prompt_that_cannot_join_the_group_is_not_overtaken_by_later_ones() {
    use rmlx_engine::engine::Event;
    // 5 words: ~26 tokens; 35 words: 108 tokens (4-token answers). KV for 240 positions: the
    // long prompt fits beside no other row, the short ones fit four together.
    let short = |shift: usize| words_in_160(5, shift, 4);
    let requests = [
        short(0),
        short(1),
        words_in_160(35, 2, 4),
        short(3),
        short(4),
    ];
    let engine = engine_with_kv_for(240);
    let handles = submit_together(&engine, &requests);
    let mut first_token = [None; 5];
    let mut answers: [Option<Completion>; 5] = Default::default();
    let mut sweep = 0usize;
    while answers.iter().any(Option::is_none) {
        sweep += 1;
        for (i, handle) in handles.iter().enumerate() {
            while let Ok(event) = handle.events.try_recv() {
                match event {
                    Event::Delta { .. } => {
                        first_token[i].get_or_insert(sweep);
                    }
                    Event::Done(answer) => answers[i] = Some(answer),
                    Event::Error(error) => panic!("request {i}: {error}"),
                    Event::Started { .. } => {}
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let answers = answers.map(Option::unwrap);
    let prefilled_with = answers.each_ref().map(|a| a.timings.prefilled_with);
    let what = format!("first tokens {first_token:?}, prefilled with {prefilled_with:?}");
    assert_eq!(prefilled_with[..3], [2, 2, 1], "{what}");
    // The long prompt's first token comes no later than the last two's (in one step with a
    // short one that fits beside it in the batch; before, the short ones overtook it).
    assert!(first_token[2] <= first_token[3], "{what}");
    assert!(first_token[2] <= first_token[4], "{what}");
}

/// What each request of a batch keeps to itself: a seeded sampler, penalties with a logit
/// bias, a stop string, a JSON constraint (which turns pipelining off for the whole batch) and
/// a cancel flag. Run together, each gives what it gives alone; the cancelled one ends
/// cancelled and the others are unaffected.
#[test]
fn batched_requests_keep_their_own_parameters() {
    let base = |text: &str, max_tokens: usize| {
        let mut request = request(text, max_tokens);
        request.params.ignore_eos = false;
        request
    };
    let mut seeded = base("Pick a colour", 20);
    seeded.params.sampling = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(11),
        ..SamplingParams::default()
    };
    let mut penalised = base("Say something repetitive", 20);
    penalised.params.sampling = SamplingParams {
        repetition_penalty: Some(1.3),
        presence_penalty: 0.4,
        logit_bias: [(106, 4.0), (381, -100.0)].into_iter().collect(),
        ..SamplingParams::default()
    };
    let mut stopped = base("Count to ten", 40);
    stopped.params.ignore_eos = true;
    let mut json = base("Give me a JSON object", 24);
    json.params.response_format = ResponseFormat::JsonObject;
    let requests = [seeded, penalised, stopped, json];

    let alone = Engine::start_with(EngineOptions {
        max_batch: 1,
        prefix_cache_bytes: Some(0),
        ..EngineOptions::default()
    })
    .unwrap();
    let mut solo: Vec<Completion> = requests
        .iter()
        .map(|request| alone.submit(request.clone()).unwrap().wait().unwrap())
        .collect();
    // A stop string the greedy answer reaches halfway: the batched run must stop there too.
    let text = &solo[2].text;
    let cut = text
        .char_indices()
        .map(|(at, _)| at)
        .find(|&at| at >= text.len() / 2)
        .unwrap();
    let stop: String = text[cut..].chars().take(3).collect();
    let mut requests = requests.to_vec();
    requests[2].params.stop = vec![stop.clone()];
    solo[2] = alone.submit(requests[2].clone()).unwrap().wait().unwrap();
    assert_eq!(solo[2].stop_sequence.as_deref(), Some(stop.as_str()));
    drop(alone);

    let engine = Engine::start_with(EngineOptions {
        prefix_cache_bytes: Some(0),
        ..EngineOptions::default()
    })
    .unwrap();
    let handles: Vec<_> = requests
        .iter()
        .map(|request| engine.submit(request.clone()).unwrap())
        .collect();
    let doomed = engine
        .submit(request("This one is cancelled", 1500))
        .unwrap();
    loop {
        if let Event::Delta { .. } = doomed.events.recv().unwrap() {
            break;
        }
    }
    doomed.cancel();
    let batched: Vec<Completion> = handles
        .into_iter()
        .map(|handle| handle.wait().unwrap())
        .collect();
    let cancelled = doomed.wait().unwrap();
    assert_eq!(cancelled.finish_reason, FinishReason::Cancelled);
    assert!(cancelled.completion_tokens < 1500);
    assert!(batched
        .iter()
        .any(|completion| completion.batched_with >= 4));
    for (index, (solo, batched)) in solo.iter().zip(&batched).enumerate() {
        assert_eq!(batched.token_ids, solo.token_ids, "request {index}");
        assert_eq!(batched.text, solo.text, "request {index}");
        assert_eq!(batched.finish_reason, solo.finish_reason, "request {index}");
        assert_eq!(batched.stop_sequence, solo.stop_sequence, "request {index}");
    }
    assert!(
        batched[3].text.trim_start().starts_with('{'),
        "{}",
        batched[3].text
    );
}

/// Agents sample (temperature 1 by default): sampled rows of a batch draw their tokens
/// together, each from its own seeded stream, so each answer is the one it gives alone, with
/// greedy rows beside them and a penalised row (which samples on its own) among them.
#[test]
fn sampled_rows_drawn_together_answer_as_they_do_alone() {
    let sampled = |shift: usize, sampling: SamplingParams| {
        let mut request = words_in_160(12, shift, 24);
        request.params.max_ctx = None;
        request.params.sampling = sampling;
        request
    };
    let seeded = |seed: u64, temperature: f32| SamplingParams {
        temperature,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let requests = [
        sampled(0, seeded(1, 1.0)),
        sampled(1, seeded(2, 0.8)),
        sampled(
            2,
            SamplingParams {
                top_k: 8,
                ..seeded(3, 1.2)
            },
        ),
        sampled(
            3,
            SamplingParams {
                top_p: 0.9,
                min_p: 0.05,
                ..seeded(4, 1.0)
            },
        ),
        sampled(
            4,
            SamplingParams {
                logit_bias: [(106, 3.0)].into_iter().collect(),
                ..seeded(5, 1.0)
            },
        ),
        sampled(5, SamplingParams::greedy()),
        sampled(
            6,
            SamplingParams {
                repetition_penalty: Some(1.2),
                ..seeded(7, 0.9)
            },
        ),
    ];
    let alone = without_prefix_cache(1);
    let answer = |request: &Request| alone.submit(request.clone()).unwrap().wait().unwrap();
    let solo: Vec<Completion> = requests.iter().map(answer).collect();
    // The seeded rows sample: their answers are not their prompts' greedy answers.
    let left_greedy = requests[..5]
        .iter()
        .zip(&solo)
        .filter(|(request, solo)| {
            let mut greedy = (*request).clone();
            greedy.params.sampling = SamplingParams::greedy();
            answer(&greedy).token_ids != solo.token_ids
        })
        .count();
    assert!(
        left_greedy >= 4,
        "{left_greedy} of 5 sampled answers left greedy"
    );
    drop(alone);
    let engine = without_prefix_cache(8);
    let handles = submit_together(&engine, &requests);
    for (index, (handle, solo)) in handles.into_iter().zip(&solo).enumerate() {
        let batched = handle.wait().unwrap();
        assert_eq!(batched.batched_with, requests.len(), "request {index}");
        assert_eq!(batched.token_ids, solo.token_ids, "request {index}");
    }
}

/// A new request's prompt is prefilled a chunk at a time between the running batch's decode
/// steps: a running stream keeps getting tokens while a long prompt is being prefilled.
#[test]
fn a_long_prefill_does_not_stall_running_streams() {
    let engine = Engine::start(4).unwrap();
    let running = engine.submit(request("Keep talking", 1500)).unwrap();
    loop {
        if let Event::Delta { .. } = running.events.recv().unwrap() {
            break;
        }
    }
    // Short enough that both rows fit the batch's KV budget (one 2048-token context).
    let words = "river mountain garden station ".repeat(60);
    let mut long = request(&words, 2);
    long.params.prefill_chunk = Some(32);
    let long = engine.submit(long).unwrap();
    // Timestamps of the running stream's tokens, read on their own thread.
    let reader = std::thread::spawn(move || {
        let mut stamps = Vec::new();
        for event in running.events.iter() {
            if let Event::Delta { .. } = event {
                stamps.push(std::time::Instant::now());
                if stamps.len() == 400 {
                    break;
                }
            }
        }
        stamps
    });
    let mut started = None;
    let first_token = loop {
        match long.events.recv().unwrap() {
            Event::Started { prompt_tokens, .. } => {
                assert!(prompt_tokens > 500, "{prompt_tokens}");
                started = Some(std::time::Instant::now());
            }
            Event::Delta { .. } => break std::time::Instant::now(),
            Event::Error(error) => panic!("{error}"),
            Event::Done(_) => panic!("done before a token"),
        }
    };
    let started = started.expect("Started comes first");
    let stamps = reader.join().unwrap();
    // It joined the running stream rather than waiting for it to end.
    assert!(first_token < stamps[399]);
    let during = stamps
        .iter()
        .filter(|&&stamp| stamp > started && stamp < first_token)
        .count();
    // About one running token per 32-token chunk (15+ chunks); alone it would be none.
    assert!(
        during >= 10,
        "{during} tokens of the running stream during the prefill"
    );
}

/// A conversation whose first user turn holds `image`, greedy with top-2 log-probs: turn 1 is
/// that message; turn 2 adds turn 1's answer and a question, with a second picture when given.
fn image_turn(dir: &str, image: &str, answer: Option<&str>, second: Option<&str>) -> Request {
    let mut request = batch_request(dir, "What is in this picture?", Some(image), 6);
    if let (Some(answer), Prompt::Chat { messages, .. }) = (answer, &mut request.prompt) {
        messages.push(serde_json::json!({"role": "assistant", "content": answer}));
        let question = match second {
            Some(_) => {
                serde_json::json!([{"type": "image"}, {"type": "text", "text": "And this one?"}])
            }
            None => serde_json::json!("And its colours?"),
        };
        messages.push(serde_json::json!({"role": "user", "content": question}));
    }
    if let Some(name) = second {
        let picture = image::open(fixture("vision-images").join(name)).unwrap();
        request.images.push(picture.to_rgb8());
    }
    request
}

/// Images keep the prefix cache: in each vision family, turn 2 of a conversation with a
/// picture reuses turn 1's KV past the picture, and its answer equals an engine without the
/// cache (ids, and log-probs within 1e-4). The same turn with the picture mirrored (same size, so the same
/// tokens) shares only the text before it.
#[test]
fn images_in_the_history_keep_the_prefix_cache() {
    for dir in ["qwen3-vl-tiny", "gemma4-tiny", "releases/qwen3.6-35b-a3b"] {
        let cached = Engine::start(4).unwrap();
        let uncached = Engine::start_with(EngineOptions {
            prefix_cache_bytes: Some(0),
            prefix_snapshot_bytes: Some(0),
            ..EngineOptions::default()
        })
        .unwrap();
        let first = cached
            .submit(image_turn(dir, "gradient_64x48.png", None, None))
            .unwrap()
            .wait()
            .unwrap();
        let answer = first.text.clone();
        // The same picture (reused whole: no vision tower for it), the same picture and a new
        // one (only the new one is encoded), the picture mirrored.
        let cases = [
            ("gradient_64x48.png", None, true),
            ("gradient_64x48.png", Some("noise_80x100.png"), true),
            ("gradient_64x48_mirror.png", None, false),
        ];
        for (image, new_picture, past_the_picture) in cases {
            let second = cached
                .submit(image_turn(dir, image, Some(&answer), new_picture))
                .unwrap()
                .wait()
                .unwrap();
            let reference = uncached
                .submit(image_turn(dir, image, Some(&answer), new_picture))
                .unwrap()
                .wait()
                .unwrap();
            assert_eq!(reference.cached_tokens, 0);
            eprintln!(
                "{dir} {image} then {new_picture:?}: {} of {} prompt tokens cached",
                second.cached_tokens, second.prompt_tokens
            );
            match past_the_picture {
                true => assert!(
                    second.cached_tokens * 2 > second.prompt_tokens,
                    "{dir}: only {} of {} cached",
                    second.cached_tokens,
                    second.prompt_tokens
                ),
                false => assert!(
                    second.cached_tokens < first.prompt_tokens / 2,
                    "{dir}: {} cached across another picture",
                    second.cached_tokens
                ),
            }
            let what = format!("{dir} {image} then {new_picture:?}");
            assert_same_answer(&what, &reference, &second, 1e-4);
        }
    }
}
