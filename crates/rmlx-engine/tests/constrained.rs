//! `response_format` through the real decode loop on the random-weight Qwen3 fixture, whose
//! unconstrained output is gibberish: greedy and sampled `json_object` answers parse as objects
//! and stop, a `json_schema` answer validates, truncation is `length`, the engine refuses a bad
//! schema before any compute, and unconstrained greedy ids still match the mlx-lm golden. A
//! freeform tool's triggered grammar holds only what follows its trigger, each time it shows.

use std::{path::PathBuf, sync::atomic::AtomicBool};

use rmlx_engine::{
    chat::ChatTokenizer,
    constrain::{
        GrammarSyntax, ReasoningBudget, ResponseFormat, ToolInputGrammar, TriggeredGrammar,
    },
    engine::{Engine, Event, Prompt, Request},
    generate::{generate, Completion, FinishReason, GenerateParams},
    models::{load_model, LoadedModel},
    sample::SamplingParams,
    EngineError,
};
use serde_json::{json, Value};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3-tiny")
}

#[derive(serde::Deserialize)]
struct Golden {
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    input_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    top1_top2_margins: Vec<f32>,
}

fn golden() -> Golden {
    let text = std::fs::read_to_string(fixture().join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

struct Fixture {
    loaded: LoadedModel,
    tokenizer: ChatTokenizer,
    prompt: Vec<u32>,
}

impl Fixture {
    fn new() -> Self {
        Self {
            loaded: load_model(&fixture()).unwrap(),
            tokenizer: ChatTokenizer::from_dir(&fixture()).unwrap(),
            prompt: golden().cases.remove(0).input_ids,
        }
    }

    fn run(&self, params: &GenerateParams) -> Completion {
        generate(
            self.loaded.model.as_ref(),
            &self.tokenizer,
            &self.prompt,
            params,
            &AtomicBool::new(false),
            |_| {},
        )
        .unwrap()
    }
}

fn params(format: ResponseFormat, sampling: SamplingParams, max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        sampling,
        response_format: format,
        ..GenerateParams::default()
    }
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

/// Random weights almost never pick `"` or `}` (2 of 1000 ids), so a key could run to any
/// length: a logit bias makes closing likely. Validity is still the grammar's doing: the same
/// bias without a constraint gives no JSON (checked below).
fn nudged(mut sampling: SamplingParams) -> SamplingParams {
    sampling.logit_bias = [(1, 10.0), (92, 10.0)].into();
    sampling
}

/// The completion's text as a JSON object; it must have stopped on its own.
fn object(completion: &Completion) -> serde_json::Map<String, Value> {
    assert_eq!(
        completion.finish_reason,
        FinishReason::Stop,
        "{:?} after {} tokens",
        completion.text,
        completion.completion_tokens
    );
    match serde_json::from_str::<Value>(&completion.text) {
        Ok(Value::Object(object)) => object,
        other => panic!("{:?} is not a JSON object: {other:?}", completion.text),
    }
}

#[test]
fn json_object_greedy_and_sampled_answers_are_objects() {
    let fixture = Fixture::new();
    let greedy = fixture.run(&params(
        ResponseFormat::JsonObject,
        nudged(SamplingParams::greedy()),
        400,
    ));
    object(&greedy);
    let unconstrained = fixture.run(&params(
        ResponseFormat::Text,
        nudged(SamplingParams::greedy()),
        greedy.completion_tokens,
    ));
    assert!(serde_json::from_str::<Value>(&unconstrained.text).is_err());
    for seed in [0, 1, 4, 5] {
        let sampling = nudged(seeded(seed));
        let completion = fixture.run(&params(ResponseFormat::JsonObject, sampling.clone(), 400));
        object(&completion);
        // Seeded constrained sampling is reproducible too.
        let again = fixture.run(&params(ResponseFormat::JsonObject, sampling, 400));
        assert_eq!(again.token_ids, completion.token_ids);
    }
}

#[test]
fn json_schema_answers_validate() {
    let fixture = Fixture::new();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["cat", "dog", "axolotl"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 30}
        },
        "required": ["name", "kind", "age"],
        "additionalProperties": false
    });
    let format = ResponseFormat::json_schema(schema, true);
    for sampling in [SamplingParams::greedy(), seeded(7), seeded(8)] {
        let answer = object(&fixture.run(&params(format.clone(), sampling, 400)));
        let mut keys: Vec<&str> = answer.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["age", "kind", "name"], "{answer:?}");
        let name = answer["name"].as_str().expect("name is a string");
        assert!(name.chars().count() <= 12, "{name:?}");
        assert!(["cat", "dog", "axolotl"].contains(&answer["kind"].as_str().unwrap()));
        let age = answer["age"].as_i64().expect("age is an integer");
        assert!((0..=30).contains(&age), "{age}");
    }
}

#[test]
fn max_tokens_truncation_is_length() {
    let fixture = Fixture::new();
    let completion = fixture.run(&params(
        ResponseFormat::JsonObject,
        SamplingParams::greedy(),
        2,
    ));
    assert_eq!(completion.finish_reason, FinishReason::Length);
    assert_eq!(completion.completion_tokens, 2);
    assert!(completion.text.starts_with('{'), "{:?}", completion.text);
    assert!(serde_json::from_str::<Value>(&completion.text).is_err());
}

#[test]
fn unconstrained_greedy_still_matches_the_golden() {
    let fixture = Fixture::new();
    let case = golden().cases.remove(0);
    let completion = fixture.run(&GenerateParams {
        max_tokens: case.greedy_ids.len(),
        ignore_eos: true,
        ..GenerateParams::default()
    });
    // As in qwen3_golden.rs: compared while the reference's top-2 margin is clear of noise.
    let clear = case
        .top1_top2_margins
        .iter()
        .take_while(|&&margin| margin > 1e-3)
        .count();
    assert!(clear > 0);
    assert_eq!(completion.token_ids[..clear], case.greedy_ids[..clear]);
}

fn engine_request(format: ResponseFormat) -> Request {
    Request {
        model: fixture(),
        prompt: Prompt::Ids(golden().cases.remove(0).input_ids),
        params: params(format, nudged(SamplingParams::greedy()), 400),
        ..Request::default()
    }
}

#[test]
fn the_engine_constrains_and_refuses_bad_schemas_before_starting() {
    let engine = Engine::start(4).unwrap();
    // Twice: the second request reuses the resident model's factory.
    for _ in 0..2 {
        let completion = engine
            .submit(engine_request(ResponseFormat::JsonObject))
            .unwrap()
            .wait()
            .unwrap();
        object(&completion);
    }

    let bad = ResponseFormat::json_schema(json!({"type": "no-such-type"}), true);
    let handle = engine.submit(engine_request(bad)).unwrap();
    match handle.events.recv().unwrap() {
        Event::Error(EngineError::InvalidRequest(message)) => {
            assert!(
                message.contains("JSON schema does not compile"),
                "{message}"
            )
        }
        other => panic!("expected an invalid-request error first, got {other:?}"),
    }
}

/// The random model under a logit bias writes `x` forever. A grammar triggered by `xx` (as a
/// tool's grammar is by its call's opening) with closing `!` turns that into calls: each `xx`
/// is followed by an input of the grammar and `!`, after which the output is free again (more
/// `x`s, so the next call). Both syntaxes, each through the engine's resident factory and a
/// one-off one; a grammar that does not compile is the request's error, naming the tool.
#[test]
fn a_triggered_grammar_holds_only_what_follows_its_trigger() {
    let model = Fixture::new();
    let x = model.tokenizer.encode("x", false).unwrap()[0];
    let mut sampling = SamplingParams::greedy();
    sampling.logit_bias = [(x, 100.0)].into();
    let mut params = params(ResponseFormat::Text, sampling, 48);
    assert_eq!(model.run(&params).text, "x".repeat(48), "the bias alone");

    let digits = |input: &str| input.len() == 3 && input.bytes().all(|b| b.is_ascii_digit());
    let colors = |input: &str| {
        input
            .split(',')
            .all(|word| ["red", "green", "blue"].contains(&word))
    };
    let lark = "start: word (\",\" word)*\nword: \"red\" | \"green\" | \"blue\"\n";
    let cases: [(GrammarSyntax, &str, InputCheck); 2] = [
        (GrammarSyntax::Regex, "[0-9]{3}", &digits),
        (GrammarSyntax::Lark, lark, &colors),
    ];
    let engine = Engine::start(4).unwrap();
    for (syntax, definition, valid) in cases {
        params.tool_grammars = vec![TriggeredGrammar {
            trigger: "xx".into(),
            input: ToolInputGrammar {
                tool: "t".into(),
                syntax,
                definition: definition.into(),
                closing: "!".into(),
            },
        }];
        let request = Request {
            model: fixture(),
            prompt: Prompt::Ids(model.prompt.clone()),
            params: params.clone(),
            ..Request::default()
        };
        let resident = engine.submit(request).unwrap().wait().unwrap().text;
        for text in [model.run(&params).text, resident] {
            eprintln!("{syntax:?}: {text:?}");
            let calls: Vec<&str> = text.split('!').collect();
            let (last, whole) = calls.split_last().unwrap();
            assert!(
                whole.len() >= 2,
                "{syntax:?}: fewer than two calls in {text:?}"
            );
            for call in whole {
                let input = call
                    .strip_prefix("xx")
                    .unwrap_or_else(|| panic!("{text:?}"));
                assert!(
                    valid(input),
                    "{syntax:?}: {input:?} is outside the grammar in {text:?}"
                );
            }
            assert!(last.starts_with('x') || last.is_empty(), "{text:?}");
        }
    }

    params.tool_grammars[0].input.definition = "start: (".into();
    let request = Request {
        model: fixture(),
        prompt: Prompt::Ids(model.prompt.clone()),
        params,
        ..Request::default()
    };
    match engine.submit(request).unwrap().events.recv().unwrap() {
        Event::Error(EngineError::InvalidRequest(message)) => {
            assert!(
                message.contains("grammar of custom tool `t` does not compile"),
                "{message}"
            )
        }
        other => panic!("expected an invalid-request error first, got {other:?}"),
    }
}

/// Whether a tool's input is in its grammar (written out by hand for each test grammar).
type InputCheck<'a> = &'a dyn Fn(&str) -> bool;

/// A reasoning budget: the prompt opened the reasoning, and after `tokens` of it the family's
/// end of thinking is written (the random model would never close it), then the answer goes on
/// free; a budget the model's own closing beats changes nothing.
#[test]
fn a_spent_reasoning_budget_closes_the_reasoning() {
    let model = Fixture::new();
    let budget = |tokens: usize| ReasoningBudget {
        tokens,
        open: "<think>".into(),
        close: "</think>".into(),
        starts_open: true,
        forced: "\n</think>\n\n".into(),
    };
    let mut params = params(ResponseFormat::Text, SamplingParams::greedy(), 24);
    let free = model.run(&params);
    assert!(!free.text.contains("</think>"), "{:?}", free.text);
    for tokens in [1, 5] {
        params.reasoning_budget = Some(budget(tokens));
        let capped = model.run(&params);
        assert_eq!(capped.token_ids[..tokens], free.token_ids[..tokens]);
        let thought = model
            .tokenizer
            .decode(&capped.token_ids[..tokens], false)
            .unwrap();
        let rest = capped
            .text
            .strip_prefix(&thought)
            .unwrap_or_else(|| panic!("{capped:?}"));
        assert!(
            rest.starts_with("\n</think>\n\n"),
            "{tokens}: {:?}",
            capped.text
        );
        assert!(
            rest.len() > "\n</think>\n\n".len(),
            "the answer goes on: {:?}",
            capped.text
        );
    }
    // Reasoning that never opens is not counted.
    params.reasoning_budget = Some(ReasoningBudget {
        starts_open: false,
        ..budget(1)
    });
    assert_eq!(model.run(&params).token_ids, free.token_ids);
}
