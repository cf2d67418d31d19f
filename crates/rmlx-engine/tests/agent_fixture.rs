//! The scripted-answer fixtures the coding-agent tests run on (tests/fixtures/agents, made by
//! scripts/fixtures/make_agents.py for Qwen3-30B-A3B and make_agents_qwen3_6.py for
//! Qwen3.6-35B-A3B): rMLX's forward gives the reference's greedy ids exactly (mlx-lm's, and
//! mlx-vlm's for Qwen3.6), teacher forced, on every short case (plain turn, each agent's tool
//! call, the answer that copies the tool's nonce). The scripts' margins are wide by
//! construction, so exact ids are the right check. The long cases (7.5k-token prompts) and the
//! cases with a picture are checked by the scripts against the reference and run through rMLX
//! by the agents themselves (tests/agents).

use std::path::PathBuf;

use mlx_rs::{ops, Array};
use rmlx_engine::{
    chat::ChatTokenizer,
    models::{load_model, Logits},
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/agents")
        .join(name)
}

#[derive(serde::Deserialize)]
struct Golden {
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    text: String,
}

fn ids_array(ids: &[u32]) -> Array {
    let ids: Vec<i32> = ids.iter().map(|&id| id as i32).collect();
    Array::from_slice(&ids, &[1, ids.len() as i32])
}

#[test]
fn scripted_qwen3_moe_answers_as_mlx_lm() {
    answers_as_reference("qwen3-30b-a3b-scripted");
}

#[test]
fn scripted_qwen3_6_answers_as_mlx_vlm() {
    answers_as_reference("qwen3.6-35b-a3b-scripted");
}

fn answers_as_reference(name: &str) {
    let dir = fixture(name);
    let golden: Golden =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let loaded = load_model(&dir).unwrap();
    let model = loaded.model.as_ref();
    let tokenizer = ChatTokenizer::from_dir(&dir).unwrap();
    let cases: Vec<&Case> = golden
        .cases
        .iter()
        .filter(|case| case.name.starts_with("short-"))
        .collect();
    assert_eq!(cases.len(), 8, "the golden lost cases");
    for case in cases {
        // The prompt in chunks (as the engine prefills), then the reference's answer teacher
        // forced: each position's argmax must be the reference's next id.
        let mut cache = model.new_cache(case.prompt_ids.len() + case.greedy_ids.len() + 8);
        let mut last = None;
        for piece in case.prompt_ids.chunks(512) {
            last = Some(
                model
                    .forward(&ids_array(piece), &mut cache, Logits::Last)
                    .unwrap(),
            );
        }
        let answer = &case.greedy_ids[..case.greedy_ids.len() - 1];
        let forced = model
            .forward(&ids_array(answer), &mut cache, Logits::All)
            .unwrap();
        let logits = ops::concatenate(&[last.unwrap(), forced], 1).unwrap();
        let got = ops::indexing::argmax_axis(&logits, -1, false).unwrap();
        got.eval().unwrap();
        let got: Vec<u32> = got.as_slice::<u32>().to_vec();
        assert_eq!(got, case.greedy_ids, "{}: greedy ids differ", case.name);
        let text = tokenizer.decode(answer, false).unwrap();
        assert_eq!(text, case.text, "{}", case.name);
    }
}
