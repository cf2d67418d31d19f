//! Checks against `tests/fixtures/sampler_golden.json` (mlx-lm 0.32.2 `sample_utils` outputs,
//! made by `scripts/fixtures/make_qwen3.py`), plus seeding and distribution checks.

use std::collections::BTreeMap;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};
use serde_json::Value;

use super::*;

fn golden() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/sampler_golden.json"
    );
    let text = std::fs::read_to_string(path).expect("read sampler_golden.json");
    serde_json::from_str(&text).expect("parse sampler_golden.json")
}

/// `[[float | null]]` -> (values, shape); null is a masked token (-inf).
fn rows(value: &Value) -> (Vec<f32>, [i32; 2]) {
    let rows = value.as_array().expect("rows");
    let mut out = Vec::new();
    for row in rows {
        for x in row.as_array().expect("row") {
            out.push(match x {
                Value::Null => f32::NEG_INFINITY,
                x => x.as_f64().expect("number") as f32,
            });
        }
    }
    let n = rows.len() as i32;
    let vocab = out.len() as i32 / n;
    (out, [n, vocab])
}

fn rows_array(value: &Value) -> Array {
    let (data, shape) = rows(value);
    Array::from_slice(&data, &shape)
}

fn to_f32(array: &Array) -> Vec<f32> {
    let array = array.as_dtype(Dtype::Float32).unwrap();
    array.eval().unwrap();
    array.as_slice::<f32>().to_vec()
}

/// Same -inf mask, finite values within 1e-5.
fn assert_matches(what: &str, got: &Array, want: &Value) {
    let (want, shape) = rows(want);
    assert_eq!(got.shape(), &shape[..], "{what}: shape");
    let got = to_f32(got);
    let masked = want.iter().filter(|x| x.is_infinite()).count();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        if w.is_infinite() {
            assert_eq!(g, w, "{what}[{i}]: want -inf, got {g}");
        } else {
            assert!((g - w).abs() <= 1e-5, "{what}[{i}]: got {g}, want {w}");
        }
    }
    // Guard against a vacuous pass: report what the golden masks.
    eprintln!("{what}: {} values match, {masked} masked", got.len());
}

fn history(g: &Value) -> Vec<u32> {
    g["inputs"]["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn sampler(params: SamplingParams) -> Sampler {
    Sampler::new(&params).expect("valid params")
}

fn sampling(temperature: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: Some(7),
        ..SamplingParams::default()
    }
}

#[test]
fn log_softmax_matches_golden() {
    let g = golden();
    let logprobs = log_softmax(&rows_array(&g["inputs"]["logits"])).unwrap();
    assert_matches("logprobs", &logprobs, &g["logprobs"]);
}

#[test]
fn filters_match_golden() {
    let g = golden();
    let lp = rows_array(&g["logprobs"]);
    let cases = [
        (
            "top_p",
            SamplingParams {
                top_p: 0.9,
                ..sampling(1.0)
            },
        ),
        (
            "min_p",
            SamplingParams {
                min_p: 0.1,
                ..sampling(1.0)
            },
        ),
        (
            "min_p_keep3",
            SamplingParams {
                min_p: 0.5,
                min_tokens_to_keep: 3,
                ..sampling(1.0)
            },
        ),
        (
            "top_k",
            SamplingParams {
                top_k: 5,
                ..sampling(1.0)
            },
        ),
        (
            "chain_top_p_min_p_top_k",
            SamplingParams {
                top_p: 0.9,
                min_p: 0.1,
                top_k: 5,
                ..sampling(1.0)
            },
        ),
    ];
    for (name, params) in cases {
        let filtered = sampler(params).filter(&lp).unwrap();
        assert_matches(name, &filtered, &g[name]["output"]);
    }
    // The plain functions, with the golden's own parameters.
    assert_matches(
        "apply_top_p",
        &apply_top_p(&lp, 0.9).unwrap(),
        &g["top_p"]["output"],
    );
    assert_matches(
        "apply_min_p",
        &apply_min_p(&lp, 0.5, 3).unwrap(),
        &g["min_p_keep3"]["output"],
    );
    assert_matches(
        "apply_top_k",
        &apply_top_k(&lp, 5).unwrap(),
        &g["top_k"]["output"],
    );
}

#[test]
fn filters_keep_what_they_promise() {
    let g = golden();
    let lp = rows_array(&g["logprobs"]);
    let kept = |a: &Array| {
        to_f32(a)
            .chunks(64)
            .map(|r| r.iter().filter(|x| x.is_finite()).count())
            .collect::<Vec<_>>()
    };
    assert_eq!(kept(&apply_top_k(&lp, 5).unwrap()), vec![5, 5]);
    assert!(kept(&apply_min_p(&lp, 0.5, 3).unwrap())
        .iter()
        .all(|&n| n >= 3));
    // Off switches: top_k >= vocab and min_p keep >= vocab keep everything.
    assert_eq!(kept(&apply_top_k(&lp, 64).unwrap()), vec![64, 64]);
    assert_eq!(kept(&apply_min_p(&lp, 1.0, 64).unwrap()), vec![64, 64]);
}

#[test]
fn temperature_matches_golden() {
    let g = golden();
    let t = &g["temperature"];
    let temp = t["temp"].as_f64().unwrap() as f32;
    let scaled = temperature_scaled(&rows_array(&g["logprobs"]), temp).unwrap();
    assert_matches("scaled_logprobs", &scaled, &t["scaled_logprobs"]);
    assert_matches(
        "scaled_log_softmax",
        &log_softmax(&scaled).unwrap(),
        &t["scaled_log_softmax"],
    );
}

#[test]
fn greedy_is_argmax() {
    let g = golden();
    let want: Vec<u32> = g["greedy_argmax"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let logits = rows_array(&g["inputs"]["logits"]);
    let mut s = sampler(SamplingParams::default());
    let (token, logprobs) = s.sample(&logits, &[]).unwrap();
    token.eval().unwrap();
    assert_eq!(token.dtype(), Dtype::Uint32);
    assert_eq!(token.as_slice::<u32>(), &want[..]);
    assert_matches("greedy logprobs", &logprobs, &g["logprobs"]);

    // A single [vocab] row gives a [1] token and a [1, vocab] logprobs row.
    let row = Array::from_slice(&to_f32(&logits)[64..], &[64]);
    let (token, logprobs) = s.sample(&row, &[]).unwrap();
    assert_eq!(token.shape(), &[1]);
    assert_eq!(logprobs.shape(), &[1, 64]);
    assert_eq!(token.item_exact::<u32>(), want[1]);
}

fn processor_params(case: &Value) -> SamplingParams {
    let num = |k: &str| case.get(k).and_then(Value::as_f64).map(|x| x as f32);
    let size = |k: &str| {
        case.get(k)
            .or_else(|| case.get("context_size"))
            .and_then(Value::as_u64)
            .map_or(DEFAULT_CONTEXT_SIZE, |x| x as usize)
    };
    let logit_bias: BTreeMap<u32, f32> = case
        .get("logit_bias")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.parse().unwrap(), v.as_f64().unwrap() as f32))
                .collect()
        })
        .unwrap_or_default();
    SamplingParams {
        repetition_penalty: num("repetition_penalty"),
        repetition_context_size: size("repetition_context_size"),
        presence_penalty: num("presence_penalty").unwrap_or(0.0),
        presence_context_size: size("presence_context_size"),
        frequency_penalty: num("frequency_penalty").unwrap_or(0.0),
        frequency_context_size: size("frequency_context_size"),
        logit_bias,
        ..SamplingParams::default()
    }
}

#[test]
fn processors_match_golden() {
    let g = golden();
    let logits = rows_array(&g["inputs"]["logits"]);
    let history = history(&g);
    let cases = g["processors"].as_object().unwrap();
    assert_eq!(cases.len(), 5);
    for (name, case) in cases {
        let params = processor_params(case);
        let out = sampler(params).process(&logits, &history).unwrap();
        assert_matches(name, &out, &case["output"]);
        // The processors must have changed something, or the comparison proves little.
        assert_ne!(to_f32(&out), to_f32(&logits), "{name} changed nothing");
    }
}

#[test]
fn penalties_count_distinct_ids_versus_occurrences() {
    // id 1 appears 3 times, id 2 once; the logits are all 1.0.
    let logits = Array::from_slice(&[1.0f32; 4], &[4]);
    let history = [1, 2, 1, 1];
    let out = |p: SamplingParams| to_f32(&sampler(p).process(&logits, &history).unwrap());
    let presence = out(SamplingParams {
        presence_penalty: 0.5,
        ..SamplingParams::default()
    });
    assert_eq!(presence, vec![1.0, 0.5, 0.5, 1.0]);
    let frequency = out(SamplingParams {
        frequency_penalty: 0.25,
        ..SamplingParams::default()
    });
    assert_eq!(frequency, vec![1.0, 0.25, 0.75, 1.0]);
    let repetition = out(SamplingParams {
        repetition_penalty: Some(2.0),
        ..SamplingParams::default()
    });
    assert_eq!(repetition, vec![1.0, 0.5, 0.5, 1.0]);
    // A window of 2 sees [1, 1] only.
    let windowed = out(SamplingParams {
        frequency_penalty: 0.25,
        frequency_context_size: 2,
        ..SamplingParams::default()
    });
    assert_eq!(windowed, vec![1.0, 0.5, 1.0, 1.0]);
    // Context size 0 is the whole history (mlx-lm's `tokens[-0:]`); empty history: no-op.
    let whole = out(SamplingParams {
        frequency_penalty: 0.25,
        frequency_context_size: 0,
        ..SamplingParams::default()
    });
    assert_eq!(whole, frequency);
    let p = SamplingParams {
        frequency_penalty: 0.25,
        ..SamplingParams::default()
    };
    assert_eq!(
        to_f32(&sampler(p).process(&logits, &[]).unwrap()),
        vec![1.0; 4]
    );
}

#[test]
fn pending_token_joins_the_window() {
    let g = golden();
    let logits = rows_array(&g["inputs"]["logits"]);
    let history = history(&g);
    let params = processor_params(&g["processors"]["all"]);
    let s = sampler(params);
    let (done, last) = history.split_at(history.len() - 1);
    let pending = Array::from_slice(last, &[1]);
    let lazy = s.process_pending(&logits, done, Some(&pending)).unwrap();
    assert_matches("all (pending)", &lazy, &g["processors"]["all"]["output"]);
    // Only the pending id in the history.
    let alone = s.process_pending(&logits, &[], Some(&pending)).unwrap();
    assert_eq!(to_f32(&alone), to_f32(&s.process(&logits, last).unwrap()));
}

#[test]
fn bf16_logits_stay_bf16() {
    let g = golden();
    let logits = rows_array(&g["inputs"]["logits"]);
    let history = history(&g);
    let params = SamplingParams {
        top_k: 5,
        top_p: 0.9,
        min_p: 0.1,
        ..processor_params(&g["processors"]["all"])
    };
    let bf16 = logits.as_dtype(Dtype::Bfloat16).unwrap();
    let mut s = sampler(SamplingParams {
        temperature: 0.7,
        seed: Some(1),
        ..params
    });
    let processed = s.process(&bf16, &history).unwrap();
    assert_eq!(processed.dtype(), Dtype::Bfloat16);
    let want = to_f32(&rows_array(&g["processors"]["all"]["output"]));
    for (got, want) in to_f32(&processed).iter().zip(&want) {
        assert!(
            (got - want).abs() <= 0.05 * want.abs().max(1.0),
            "{got} vs {want}"
        );
    }
    let (token, logprobs) = s.sample(&bf16, &history).unwrap();
    assert_eq!(logprobs.dtype(), Dtype::Bfloat16);
    assert_eq!(token.shape(), &[2]);
}

fn draws(params: &SamplingParams, logits: &Array, n: usize) -> Vec<u32> {
    let mut s = sampler(params.clone());
    (0..n)
        .map(|_| {
            let (token, _) = s.sample(logits, &[]).unwrap();
            token.item_exact::<u32>()
        })
        .collect()
}

#[test]
fn seeds_are_reproducible_and_distinct() {
    let g = golden();
    let logits = rows_array(&g["inputs"]["logits"]).try_index(0).unwrap();
    let a = draws(&sampling(1.0), &logits, 50);
    let b = draws(&sampling(1.0), &logits, 50);
    assert_eq!(a, b, "same seed, same ids");
    let c = draws(
        &SamplingParams {
            seed: Some(8),
            ..sampling(1.0)
        },
        &logits,
        50,
    );
    assert_ne!(a, c, "another seed, other ids");
    // Not a constant sequence (the key advances each step).
    assert!(a.iter().any(|&t| t != a[0]));
    // Unseeded samplers differ from each other.
    let unseeded = SamplingParams {
        seed: None,
        ..sampling(1.0)
    };
    assert_ne!(draws(&unseeded, &logits, 50), draws(&unseeded, &logits, 50));
}

#[test]
fn draws_follow_the_distribution() {
    let probs = [0.1f32, 0.2, 0.3, 0.4];
    let logits: Vec<f32> = probs.iter().map(|p| p.ln() + 3.0).collect();
    let logits = Array::from_slice(&logits, &[1, 4]);
    let n = 2000;
    let ids = draws(&sampling(1.0), &logits, n);
    let mut counts = [0usize; 4];
    for id in ids {
        counts[id as usize] += 1;
    }
    for (count, p) in counts.iter().zip(probs) {
        let freq = *count as f32 / n as f32;
        // 3 standard deviations of a binomial share at n = 2000 is at most 0.033.
        assert!((freq - p).abs() < 0.035, "counts {counts:?}");
    }
}

#[test]
fn filtered_draws_stay_inside_the_mask() {
    let g = golden();
    let logits = rows_array(&g["inputs"]["logits"]).try_index(0).unwrap();
    let argmax = g["greedy_argmax"][0].as_u64().unwrap() as u32;
    let top1 = SamplingParams {
        top_k: 1,
        ..sampling(1.5)
    };
    assert!(draws(&top1, &logits, 50).iter().all(|&t| t == argmax));
    // top_k 5: the five ids the golden keeps, and more than one of them.
    let keep: Vec<u32> = rows(&g["top_k"]["output"])
        .0
        .iter()
        .take(64)
        .enumerate()
        .filter(|(_, x)| x.is_finite())
        .map(|(i, _)| i as u32)
        .collect();
    let top5 = SamplingParams {
        top_k: 5,
        ..sampling(2.0)
    };
    let ids = draws(&top5, &logits, 100);
    assert!(
        ids.iter().all(|t| keep.contains(t)),
        "{ids:?} outside {keep:?}"
    );
    assert!(ids.iter().any(|&t| t != ids[0]));
}

#[test]
fn validation_rejects_out_of_range_values() {
    let base = SamplingParams::default;
    let bad = [
        (
            "temperature",
            SamplingParams {
                temperature: -0.1,
                ..base()
            },
        ),
        (
            "temperature",
            SamplingParams {
                temperature: f32::NAN,
                ..base()
            },
        ),
        (
            "temperature",
            SamplingParams {
                temperature: f32::INFINITY,
                ..base()
            },
        ),
        (
            "top_p",
            SamplingParams {
                top_p: 0.0,
                ..base()
            },
        ),
        (
            "top_p",
            SamplingParams {
                top_p: 1.5,
                ..base()
            },
        ),
        (
            "top_p",
            SamplingParams {
                top_p: f32::NAN,
                ..base()
            },
        ),
        (
            "min_p",
            SamplingParams {
                min_p: -0.1,
                ..base()
            },
        ),
        (
            "min_p",
            SamplingParams {
                min_p: 1.1,
                ..base()
            },
        ),
        (
            "min_tokens_to_keep",
            SamplingParams {
                min_tokens_to_keep: 0,
                ..base()
            },
        ),
        (
            "repetition_penalty",
            SamplingParams {
                repetition_penalty: Some(0.0),
                ..base()
            },
        ),
        (
            "repetition_penalty",
            SamplingParams {
                repetition_penalty: Some(-1.0),
                ..base()
            },
        ),
        (
            "repetition_penalty",
            SamplingParams {
                repetition_penalty: Some(f32::NAN),
                ..base()
            },
        ),
        (
            "presence_penalty",
            SamplingParams {
                presence_penalty: f32::NAN,
                ..base()
            },
        ),
        (
            "frequency_penalty",
            SamplingParams {
                frequency_penalty: f32::NAN,
                ..base()
            },
        ),
        (
            "logit_bias",
            SamplingParams {
                logit_bias: BTreeMap::from([(3, f32::NAN)]),
                ..base()
            },
        ),
    ];
    for (want, params) in bad {
        match params.validate() {
            Err(SampleError::InvalidParam { name, .. }) => assert_eq!(name, want),
            other => panic!("{want}: expected InvalidParam, got {other:?}"),
        }
        assert!(Sampler::new(&params).is_err());
    }
    let good = SamplingParams {
        temperature: 0.7,
        top_p: 1.0,
        min_p: 1.0,
        repetition_penalty: Some(1.0),
        presence_penalty: -2.0,
        ..base()
    };
    assert_eq!(good.validate(), Ok(()));
}

#[test]
fn bad_ids_and_shapes_are_typed_errors() {
    let logits = Array::from_slice(&[0.0f32; 8], &[1, 8]);
    let s = sampler(SamplingParams {
        presence_penalty: 1.0,
        ..SamplingParams::default()
    });
    assert!(matches!(
        s.process(&logits, &[1, 8]),
        Err(SampleError::TokenOutOfRange { token: 8, .. })
    ));
    let s = sampler(SamplingParams {
        logit_bias: BTreeMap::from([(9, 1.0)]),
        ..SamplingParams::default()
    });
    assert!(matches!(
        s.process(&logits, &[]),
        Err(SampleError::TokenOutOfRange { token: 9, .. })
    ));
    let cube = Array::from_slice(&[0.0f32; 8], &[2, 2, 2]);
    assert!(matches!(
        s.process(&cube, &[]),
        Err(SampleError::BadShape(_))
    ));
}

#[test]
fn params_deserialize_with_defaults() {
    let p: SamplingParams = serde_json::from_str("{}").unwrap();
    assert_eq!(p, SamplingParams::default());
    assert!(p.is_greedy());
    assert!(!p.needs_history());
    let penalised = SamplingParams {
        repetition_penalty: Some(1.1),
        ..p.clone()
    };
    assert!(penalised.needs_history());
    let p: SamplingParams = serde_json::from_str(
        r#"{"temperature": 0.6, "top_k": 20, "logit_bias": {"3": 2.5}, "seed": 42}"#,
    )
    .unwrap();
    assert_eq!(p.top_k, 20);
    assert_eq!(p.logit_bias, BTreeMap::from([(3, 2.5)]));
    assert_eq!(p.seed, Some(42));
    assert_eq!(p.repetition_context_size, 20);
    let round: SamplingParams = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!(round, p);
}

/// The key schedule is mlx's own: made with mlx 0.32.2 (Python, CPU) on golden row 0 by
/// `key = mx.random.key(7)`, then 12 times `key, sub = mx.random.split(key);
/// mx.random.categorical(logprobs * (1 / 0.7), key=sub)`.
#[test]
fn seeded_draws_match_mlx_python() {
    let g = golden();
    let logits = rows_array(&g["inputs"]["logits"]).try_index(0).unwrap();
    let want = vec![5, 57, 5, 5, 5, 5, 45, 5, 5, 5, 57, 57];
    assert_eq!(draws(&sampling(0.7), &logits, 12), want);
}

/// Rows drawn together (`draw_rows`) get, draw after draw, the tokens each row's sampler
/// draws alone: greedy rows, plain sampled rows and rows with each filter, at different
/// temperatures and seeds, in bf16 (where filters see ties) and float32; one chain shared by
/// the sampled rows beside greedy ones (a model's recommendation), and several.
#[test]
fn rows_drawn_together_draw_what_each_draws_alone() {
    let recommended = |seed: u64| SamplingParams {
        top_p: 0.95,
        top_k: 20,
        seed: Some(seed),
        ..sampling(0.6)
    };
    let shared = [
        SamplingParams::default(),
        recommended(1),
        recommended(2),
        SamplingParams::default(),
        recommended(3),
    ];
    rows_draw_as_alone(&shared);
    let several = [
        SamplingParams::default(),
        sampling(1.0),
        SamplingParams {
            top_p: 0.8,
            seed: Some(3),
            ..sampling(0.7)
        },
        SamplingParams {
            top_k: 5,
            seed: Some(4),
            ..sampling(1.3)
        },
        SamplingParams {
            min_p: 0.1,
            min_tokens_to_keep: 2,
            seed: Some(5),
            ..sampling(0.9)
        },
        SamplingParams {
            top_p: 0.8,
            seed: Some(6),
            ..sampling(1.0)
        },
    ];
    rows_draw_as_alone(&several);
}

fn rows_draw_as_alone(params: &[SamplingParams]) {
    let vocab = 96;
    for dtype in [Dtype::Bfloat16, Dtype::Float32] {
        let mut together: Vec<Sampler> = params.iter().cloned().map(sampler).collect();
        let mut alone: Vec<Sampler> = params.iter().cloned().map(sampler).collect();
        let mut differed = 0;
        for step in 0..30u64 {
            let key = mlx_rs::random::key(100 + step).unwrap();
            let shape = [params.len() as i32, vocab];
            let logits = mlx_rs::random::normal::<f32>(&shape, None, None, &key)
                .unwrap()
                .multiply(Array::from_f32(2.5))
                .unwrap()
                .as_dtype(dtype)
                .unwrap();
            let logprobs = log_softmax(&logits).unwrap();
            let draws: Vec<RowDraw> = together.iter_mut().map(Sampler::row_draw).collect();
            let drawn = draw_rows(&logprobs, &draws).unwrap();
            drawn.eval().unwrap();
            assert_eq!(drawn.dtype(), Dtype::Uint32);
            for (row, sampler) in alone.iter_mut().enumerate() {
                let own = logits.try_index(row as i32..row as i32 + 1).unwrap();
                let (token, _) = sampler.sample(&own, &[]).unwrap();
                let token = token.item_exact::<u32>();
                assert_eq!(
                    drawn.as_slice::<u32>()[row],
                    token,
                    "{dtype:?}, step {step}, row {row}"
                );
                let argmax = greedy(&logprobs.try_index(row as i32).unwrap()).unwrap();
                differed += usize::from(argmax.item_exact::<u32>() != token);
            }
        }
        // Sampled rows left the argmax often: the draws were not all greedy.
        assert!(differed > 20, "{dtype:?}: {differed} draws left the argmax");
    }
}
