//! A model's recommended sampling, from its `generation_config.json`: what a request that does
//! not choose gets (Qwen3: temperature 0.6, top-k 20, top-p 0.95; Gemma 4: 1.0, 64, 0.95).
//! Sampling a Qwen3 at temperature 1 from the whole vocabulary (the APIs' own defaults) picks
//! the tail's tokens that those filters exist to cut: stray words in an agent's code.
//! Reference: vLLM `--generation-config auto` (`get_diff_sampling_param`: the fields a config
//! sets become the defaults), HF `GenerationConfig` (`do_sample: false` is greedy).

use serde_json::Value;

/// The sampling fields a model's generation config sets (None: the API's default stands).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl SamplingDefaults {
    /// From a parsed `generation_config.json`; fields of the wrong type or out of range are
    /// ignored (the API's default then stands), as a request's bad value would be refused.
    pub fn from_generation_config(config: &Value) -> Self {
        let real = |key: &str| config.get(key).and_then(Value::as_f64).map(|v| v as f32);
        let in_range = |value: Option<f32>, ok: fn(f32) -> bool| value.filter(|&v| ok(v));
        // `do_sample: false` is greedy whatever the temperature says (HF's rule).
        let greedy = config.get("do_sample").and_then(Value::as_bool) == Some(false);
        Self {
            temperature: match greedy {
                true => Some(0.0),
                false => in_range(real("temperature"), |t| t.is_finite() && t >= 0.0),
            },
            top_p: in_range(real("top_p"), |p| p > 0.0 && p <= 1.0),
            top_k: config
                .get("top_k")
                .and_then(Value::as_u64)
                .map(|k| k as usize),
            min_p: in_range(real("min_p"), |p| (0.0..=1.0).contains(&p)),
            repetition_penalty: in_range(real("repetition_penalty"), |p| p.is_finite() && p > 0.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_fields_a_config_sets_are_the_defaults() {
        let qwen3 = json!({"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                           "eos_token_id": [993, 991]});
        assert_eq!(
            SamplingDefaults::from_generation_config(&qwen3),
            SamplingDefaults {
                temperature: Some(0.6),
                top_p: Some(0.95),
                top_k: Some(20),
                ..SamplingDefaults::default()
            }
        );
        let greedy = json!({"do_sample": false, "temperature": 0.6, "top_p": 0.9});
        let greedy = SamplingDefaults::from_generation_config(&greedy);
        assert_eq!(greedy.temperature, Some(0.0));
        assert_eq!(greedy.top_p, Some(0.9));
        // Nothing set, or nothing usable: the API's defaults stand.
        let bad = json!({"temperature": -1.0, "top_p": 0.0, "top_k": "20", "min_p": 2.0});
        assert_eq!(
            SamplingDefaults::from_generation_config(&bad),
            SamplingDefaults::default()
        );
        assert_eq!(
            SamplingDefaults::from_generation_config(&json!({})),
            SamplingDefaults::default()
        );
    }

    /// The releases' own files, read where the tokenizer reads them.
    #[test]
    fn the_releases_recommend_what_their_cards_say() {
        let releases =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/releases");
        for (release, want) in [
            ("qwen3-0.6b", (0.6, 0.95, 20)),
            ("qwen3-4b-instruct-2507", (0.7, 0.8, 20)),
            ("qwen3.6-35b-a3b", (1.0, 0.95, 20)),
            ("gemma-4-e2b-it", (1.0, 0.95, 64)),
        ] {
            let tokenizer = crate::chat::ChatTokenizer::from_dir(&releases.join(release)).unwrap();
            let got = tokenizer.sampling_defaults();
            let got = (
                got.temperature.unwrap(),
                got.top_p.unwrap(),
                got.top_k.unwrap(),
            );
            assert_eq!(got, want, "{release}");
        }
    }
}
