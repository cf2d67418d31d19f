//! The prefix cache for Gemma 4, whose sliding-window layers keep only their window: a 3-turn
//! chat whose first message is several windows long, through the engine. Past the window an
//! entry can be cut back only where its windows still hold what the next query sees, so the
//! prefill snapshots the start of the prompt's last message (`<|turn>`) and its end. Every
//! turn after the first reuses at least the previous turn's last-message snapshot, and its
//! answer and log-probs equal an engine without a prefix cache.

mod common;

use common::fixture;
use rmlx_engine::{
    chat::{ChatTokenizer, TemplateOptions},
    engine::{Engine, EngineOptions, Prompt, Request},
    generate::GenerateParams,
};
use serde_json::{json, Value};

const MODEL: &str = "gemma4-tiny";

fn request(messages: &[Value]) -> Request {
    Request {
        model: fixture(MODEL),
        prompt: Prompt::Chat {
            messages: messages.to_vec(),
            options: TemplateOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        },
        params: GenerateParams {
            // Long answers: the windows the final entry keeps move past the last message's
            // start, so only its snapshot serves the next turn.
            max_tokens: 400,
            ignore_eos: true,
            logprobs: Some(1),
            ..GenerateParams::default()
        },
        ..Request::default()
    }
}

#[test]
fn turns_past_the_window_reuse_the_last_message_snapshot_and_answer_as_uncached() {
    let tokenizer = ChatTokenizer::from_dir(&fixture(MODEL)).unwrap();
    let opener = tokenizer.token_id("<|turn>").unwrap();
    let cached = Engine::start(16).unwrap();
    let reference = Engine::start_with(EngineOptions {
        prefix_cache_bytes: Some(0),
        prefix_snapshot_bytes: Some(0),
        ..EngineOptions::default()
    })
    .unwrap();
    let words = [
        "river", "stone", "maple", "quiet", "lantern", "harbor", "copper",
    ];
    let long: Vec<&str> = (0..400).map(|i| words[i * 5 % words.len()]).collect();
    let mut messages = vec![json!({"role": "user", "content": long.join(" ")})];
    let mut last_boundary = 0;
    for turn in 0..3 {
        let completion = cached.submit(request(&messages)).unwrap().wait().unwrap();
        let uncached = reference
            .submit(request(&messages))
            .unwrap()
            .wait()
            .unwrap();
        let prompt = &completion.prompt_ids;
        assert_eq!(prompt, &uncached.prompt_ids);
        assert!(
            prompt.len() > 300,
            "the prompt must pass the 64-token window many times"
        );
        eprintln!(
            "turn {turn}: {} of {} prompt tokens cached",
            completion.cached_tokens,
            prompt.len()
        );
        if turn > 0 {
            assert!(
                completion.cached_tokens >= last_boundary,
                "turn {turn}: cached {} tokens, the last message of the previous prompt starts at {last_boundary}",
                completion.cached_tokens
            );
        }
        common::assert_same_as_uncached(&format!("turn {turn}"), &completion, &uncached, 1e-4);
        last_boundary = (1..prompt.len() - 1)
            .rev()
            .find(|&at| prompt[at] == opener)
            .unwrap();
        messages.push(json!({"role": "assistant", "content": completion.text}));
        messages.push(json!({"role": "user", "content": format!("And turn {turn}, briefly?")}));
    }
}
