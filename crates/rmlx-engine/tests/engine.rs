//! The engine thread: streamed deltas add up to the final text, cancellation between steps,
//! a dropped handle stops its work, a full queue is refused, requests run in order, and an
//! assistant prefill is part of the prompt.

use std::path::PathBuf;

use rmlx_engine::{
    chat::ChatTokenizer,
    engine::{Engine, Event, Prompt, Request},
    generate::{FinishReason, GenerateParams},
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

#[test]
fn full_queue_is_refused_and_accepted_requests_finish_in_order() {
    let engine = Engine::start(2).unwrap();
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
        prefix_cache_bytes: 0,
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
