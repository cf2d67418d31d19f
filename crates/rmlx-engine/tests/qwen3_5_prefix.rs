//! The prefix cache for a state that cannot be rewound (Qwen3.5 / 3.6's Gated DeltaNet): a
//! 6-turn tool-using agent conversation through the engine, each turn rendered by the
//! release's own template. Every turn's `cached_tokens` equals the longest snapshot stored so
//! far that is a prefix of its prompt (snapshots sit before each `<|im_start|>` of an earlier
//! prompt, at the end of its prompt, and after its answer), and its answer and log-probs equal
//! an engine without a prefix cache. Hit rates with and without `preserve_thinking` are printed.

mod common;

use common::fixture;
use rmlx_engine::{
    chat::{ChatTokenizer, TemplateOptions},
    engine::{Engine, EngineOptions, Prompt, Request},
    generate::{Completion, GenerateParams},
};
use serde_json::{json, Value};

const MODEL: &str = "releases/qwen3.6-27b";

fn tools() -> Value {
    json!([{"type": "function", "function": {
        "name": "read_file",
        "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}}])
}

fn options(preserve_thinking: bool) -> TemplateOptions {
    let mut extra = serde_json::Map::new();
    if preserve_thinking {
        extra.insert("preserve_thinking".into(), json!(true));
    }
    TemplateOptions {
        add_generation_prompt: true,
        tools: Some(tools()),
        extra,
        ..Default::default()
    }
}

fn request(messages: &[Value], preserve_thinking: bool) -> Request {
    Request {
        model: fixture(MODEL),
        prompt: Prompt::Chat {
            messages: messages.to_vec(),
            options: options(preserve_thinking),
        },
        params: GenerateParams {
            max_tokens: 6,
            ignore_eos: true,
            logprobs: Some(1),
            ..GenerateParams::default()
        },
        ..Request::default()
    }
}

/// What the conversation's next assistant message says: the answer as reasoning (the prompt
/// opened `<think>`), then a tool call, as an agent's client sends it back.
fn assistant_turn(completion: &Completion, turn: usize) -> Value {
    json!({
        "role": "assistant",
        "reasoning_content": completion.text,
        "content": "",
        "tool_calls": [{"type": "function", "function": {
            "name": "read_file", "arguments": {"path": format!("src/file_{turn}.rs")}}}],
    })
}

/// The prefixes the cache should hold after serving `prompt` with answer `generated`.
fn snapshots_of(prompt: &[u32], generated: &[u32], message_start: u32) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> = (1..prompt.len() - 1)
        .filter(|&at| prompt[at] == message_start)
        .map(|at| prompt[..at].to_vec())
        .collect();
    out.push(prompt[..prompt.len() - 1].to_vec());
    let mut held = prompt.to_vec();
    held.extend(generated);
    out.push(held);
    out
}

/// Runs the 6-turn conversation on `cached` and on `reference` (no prefix cache); returns the
/// share of prompt tokens served from the cache.
fn conversation(cached: &Engine, reference: &Engine, preserve_thinking: bool) -> f64 {
    let tokenizer = ChatTokenizer::from_dir(&fixture(MODEL)).unwrap();
    let message_start = tokenizer.token_id("<|im_start|>").unwrap();
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. Read files before answering."}),
        json!({"role": "user", "content": "Where is the prefix cache implemented?"}),
    ];
    let mut stored: Vec<Vec<u32>> = Vec::new();
    let (mut prompt_total, mut cached_total) = (0, 0);
    for turn in 0..6 {
        let completion = cached
            .submit(request(&messages, preserve_thinking))
            .unwrap()
            .wait()
            .unwrap();
        let uncached = reference
            .submit(request(&messages, preserve_thinking))
            .unwrap()
            .wait()
            .unwrap();
        let prompt = &completion.prompt_ids;
        assert_eq!(prompt, &uncached.prompt_ids);
        let usable = prompt.len() - 1;
        let expected = stored
            .iter()
            .filter(|s| s.len() <= usable && prompt.starts_with(s))
            .map(Vec::len)
            .max()
            .unwrap_or(0);
        assert_eq!(
            completion.cached_tokens,
            expected,
            "turn {turn}: cached {} of {} tokens, the longest stored snapshot is {expected}",
            completion.cached_tokens,
            prompt.len()
        );
        common::assert_same_as_uncached(&format!("turn {turn}"), &completion, &uncached, 1e-4);
        eprintln!(
            "preserve_thinking {preserve_thinking}, turn {turn}: {} of {} prompt tokens cached",
            completion.cached_tokens,
            prompt.len()
        );
        prompt_total += prompt.len();
        cached_total += completion.cached_tokens;
        stored.extend(snapshots_of(prompt, &completion.token_ids, message_start));
        messages.push(assistant_turn(&completion, turn));
        messages.push(json!({"role": "tool", "content": format!("fn step_{turn}() {{}}")}));
        if turn == 3 {
            // The user steps in: earlier turns now render without their reasoning unless
            // preserve_thinking keeps it.
            messages.push(json!({"role": "user", "content": "Also check the tests."}));
        }
    }
    cached_total as f64 / prompt_total as f64
}

#[test]
fn agent_turns_reuse_their_longest_snapshot_and_answer_as_without_the_cache() {
    let reference = Engine::start_with(EngineOptions {
        prefix_cache_bytes: Some(0),
        prefix_snapshot_bytes: Some(0),
        ..Default::default()
    })
    .unwrap();
    let mut rates = Vec::new();
    for preserve_thinking in [false, true] {
        let cached = Engine::start(4).unwrap();
        let rate = conversation(&cached, &reference, preserve_thinking);
        let metrics = cached.metrics();
        eprintln!(
            "preserve_thinking {preserve_thinking}: hit rate {:.1} % of prompt tokens, {} snapshots \
             ({} bytes) kept",
            rate * 100.0,
            metrics.prefix_snapshots,
            metrics.prefix_snapshot_bytes
        );
        assert!(metrics.prefix_snapshots > 0 && metrics.prefix_snapshot_bytes > 0);
        assert_eq!(
            metrics.models[0].prefix_cache_hits, 5,
            "every turn after the first hits"
        );
        rates.push(rate);
    }
    assert!(rates[0] > 0.5, "hit rate {:.3}", rates[0]);
    assert!(
        rates[1] >= rates[0],
        "preserve_thinking keeps more: {rates:?}"
    );
}

#[test]
fn snapshots_obey_their_budget_and_leave_kv_entries_alone() {
    let engine = Engine::start_with(EngineOptions {
        prefix_snapshot_bytes: Some(1),
        ..Default::default()
    })
    .unwrap();
    let messages = [json!({"role": "user", "content": "hi"})];
    engine
        .submit(request(&messages, false))
        .unwrap()
        .wait()
        .unwrap();
    let again = engine
        .submit(request(&messages, false))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        again.cached_tokens, 0,
        "nothing fits a 1-byte snapshot budget"
    );
    let metrics = engine.metrics();
    assert_eq!(
        (metrics.prefix_snapshots, metrics.prefix_snapshot_bytes),
        (0, 0)
    );
}
