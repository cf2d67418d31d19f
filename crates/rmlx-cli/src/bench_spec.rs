//! `rmlx bench --draft-accuracy`: the mechanism of speculative decoding, measured. Random
//! weights give no real acceptance, so each stream's proposer knows the stream's plain greedy
//! continuation (from the plain run just before, same prompt) and drafts each token right with
//! probability p, independently. Per run and stream: a plain run (timed, it also gives the
//! continuation), then the speculative one on the same prompt (the prefix cache is off, so it
//! recomputes everything). Decode tok/s is the engine's (tokens after the first over the time
//! since the first). `--draft-depth k` fixes the depth (no control: the verify cost of a step
//! of k + 1 tokens shows at p = 0 as plain / speculative); without it `auto` chooses.
//! Every run's answer is one token repeated, forced by a logit bias of +10^4 (the forward is
//! whole; only the argmax is decided): a random bf16 model's top two logits are often within
//! one bf16 step of each other, so a step of k + 1 tokens (which reduces in another order than
//! a step of one) flips near-ties and the plain continuation would stop being the one to draft
//! after a few tokens. The fp32 exactness tests (crates/rmlx-engine/tests/speculative.rs) check
//! real answers token for token.

use std::sync::Arc;

use rmlx_engine::{
    engine::{Engine, Prompt, Request},
    generate::{Completion, GenerateParams},
    sample::SamplingParams,
    speculative::{Drafter, SpeculativeMode, SpeculativeParams},
};

/// The one token every bench answer repeats (see the module doc), and its logit bias.
fn forced_sampling(vocab: usize) -> SamplingParams {
    SamplingParams {
        logit_bias: [((vocab / 3) as u32, 1e4)].into_iter().collect(),
        ..SamplingParams::default()
    }
}

use crate::bench::{median_and_spread, prompt_ids, BenchArgs};

/// splitmix64: a uniform draw in [0, 1) for (seed, position, draft index).
fn uniform(seed: u64, generated: usize, index: usize) -> f64 {
    let mut z = seed ^ ((generated as u64) << 20) ^ (index as u64);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) as f64 / u64::MAX as f64
}

/// Drafts `plain`'s continuation, each token right with probability `p` (else the next id).
fn drafter(plain: Vec<u32>, prompt_len: usize, p: f64, vocab: u32, seed: u64) -> Drafter {
    Drafter(Arc::new(move |history: &[u32], max: usize| {
        let generated = history.len().saturating_sub(prompt_len);
        plain
            .iter()
            .skip(generated)
            .take(max)
            .enumerate()
            .map(
                |(index, &token)| match uniform(seed, generated, index) < p {
                    true => token,
                    false => (token + 1) % vocab,
                },
            )
            .collect()
    }))
}

pub fn bench_speculative(args: &BenchArgs, engine: &Engine, vocab: usize) -> anyhow::Result<()> {
    let model = args.model.clone().expect("checked by the caller");
    let concurrency = args.concurrency.max(1);
    // The draft head's arm runs in an engine that loaded the head; the plain arm in one without
    // (a loaded head is primed during every prefill).
    let head_engine = match args.draft_head {
        true => {
            anyhow::ensure!(
                args.draft_accuracy.iter().all(|&p| p == 0.0 || p == 1.0),
                "--draft-head takes --draft-accuracy 1 (forced answers) or 0 (free ones)"
            );
            let engine = Engine::start_with(rmlx_engine::engine::EngineOptions {
                max_queue: concurrency,
                prefix_cache_bytes: Some(0),
                prefix_snapshot_bytes: Some(0),
                kv_bits: args.kv_bits,
                speculative: SpeculativeMode::Mtp,
                ..Default::default()
            })?;
            anyhow::ensure!(
                engine.model_info(&model)?.draft_head_loaded,
                "{} has no draft head (mtp.*)",
                model.display()
            );
            Some(engine)
        }
        false => None,
    };
    let run_all = |engine: &Engine, prompts: &[Vec<u32>], params: Vec<GenerateParams>| {
        answer_all(
            engine,
            &model,
            prompts.iter().cloned().zip(params).collect(),
        )
    };
    let forced = |p: f64| !args.draft_head || p > 0.5;
    let plain_params = |p: f64| GenerateParams {
        max_tokens: args.gen_tokens,
        ignore_eos: true,
        sampling: match forced(p) {
            true => forced_sampling(vocab),
            false => SamplingParams::default(),
        },
        prefill_chunk: args.prefill_chunk,
        speculative: SpeculativeParams {
            mode: Some(SpeculativeMode::Off),
            ..SpeculativeParams::default()
        },
        ..GenerateParams::default()
    };
    let depths: Vec<Option<usize>> = match args.draft_depth.is_empty() {
        true => vec![None],
        false => args.draft_depth.iter().copied().map(Some).collect(),
    };
    let spec_params =
        |depth: Option<usize>, plain: &Completion, prompt_len: usize, p: f64, seed: u64| {
            let drafter = (!args.draft_head)
                .then(|| drafter(plain.token_ids.clone(), prompt_len, p, vocab as u32, seed));
            GenerateParams {
                speculative: SpeculativeParams {
                    mode: Some(match (depth, args.draft_head) {
                        (None, _) => SpeculativeMode::Auto,
                        (Some(_), true) => SpeculativeMode::Mtp,
                        (Some(_), false) => SpeculativeMode::Lookup,
                    }),
                    max_draft: depth.unwrap_or(args.draft_tokens),
                    drafter,
                    costs: None,
                },
                ..plain_params(p)
            }
        };
    let cells = depths
        .iter()
        .flat_map(|&depth| args.draft_accuracy.iter().map(move |&p| (depth, p)));
    for (depth, p) in cells {
        let mut pairs = Vec::new();
        let mut peaks = Vec::new();
        let mut profile = crate::bench::StepProfile::new();
        // Run 0 is the warm-up at the measured shape (both engines' kernels compiled).
        for run in 0..=args.runs.max(1) as u64 {
            let seeds: Vec<u64> = (0..concurrency as u64)
                .map(|s| args.seed + (run * concurrency as u64 + s) * 7919 + (p * 1000.0) as u64)
                .collect();
            let prompts: Vec<Vec<u32>> = seeds
                .iter()
                .map(|&seed| prompt_ids(args.prompt_tokens, vocab, seed))
                .collect();
            let profiled = args.step_profile && run > 0;
            if profiled {
                rmlx_engine::profile::enable();
            }
            // Each arm's peak above what was held when it started (both engines' weights).
            let arm_peak = |run: &dyn Fn() -> anyhow::Result<Vec<Completion>>| {
                rmlx_engine::metrics::reset_mlx_peak();
                let (resting, _, _) = rmlx_engine::metrics::mlx_memory();
                let completions = run()?;
                let (_, peak, _) = rmlx_engine::metrics::mlx_memory();
                anyhow::Ok((completions, peak.saturating_sub(resting)))
            };
            let (plain, plain_peak) =
                arm_peak(&|| run_all(engine, &prompts, vec![plain_params(p); concurrency]))?;
            let params: Vec<GenerateParams> = plain
                .iter()
                .zip(&seeds)
                .map(|(completion, &seed)| {
                    spec_params(depth, completion, args.prompt_tokens, p, seed)
                })
                .collect();
            let (speculative, spec_peak) = arm_peak(&|| {
                run_all(
                    head_engine.as_ref().unwrap_or(engine),
                    &prompts,
                    params.clone(),
                )
            })?;
            if profiled {
                for (shape, phases) in rmlx_engine::profile::take() {
                    let total = profile.entry(shape).or_default();
                    total.steps += phases.steps;
                    total.build += phases.build;
                    total.submit += phases.submit;
                    total.read += phases.read;
                    total.between += phases.between;
                }
            }
            for (row, (a, b)) in plain.iter().zip(&speculative).enumerate() {
                let first = a
                    .token_ids
                    .iter()
                    .zip(&b.token_ids)
                    .position(|(x, y)| x != y);
                anyhow::ensure!(
                    a.token_ids == b.token_ids || !forced(p),
                    "speculative output differs from plain (p {p}, run {run}, stream {row}): \
                     {} / {} tokens, first difference at {first:?} ({:?} / {:?}); {} drafted, \
                     {} kept; prefilled with {} / {}, batched with {} / {}",
                    a.token_ids.len(),
                    b.token_ids.len(),
                    first.map(|at| a.token_ids[at]),
                    first.map(|at| b.token_ids[at]),
                    b.timings.draft_tokens,
                    b.timings.accepted_tokens,
                    a.timings.prefilled_with,
                    b.timings.prefilled_with,
                    a.batched_with,
                    b.batched_with,
                );
            }
            if run > 0 {
                pairs.push((plain, speculative));
                peaks.push((plain_peak, spec_peak));
            }
        }
        let tps = |completions: &Vec<Completion>| {
            completions
                .iter()
                .map(|c| c.timings.decode_tps)
                .sum::<f64>()
                / completions.len() as f64
        };
        let plain_tps = median_and_spread(pairs.iter().map(|(a, _)| tps(a)).collect());
        let spec_tps = median_and_spread(pairs.iter().map(|(_, b)| tps(b)).collect());
        let ratio = median_and_spread(pairs.iter().map(|(a, b)| tps(b) / tps(a)).collect());
        let (drafted, kept): (usize, usize) = pairs
            .iter()
            .flat_map(|(_, b)| b.iter())
            .map(|c| (c.timings.draft_tokens, c.timings.accepted_tokens))
            .fold((0, 0), |(d, k), (a, b)| (d + a, k + b));
        let generated: usize = pairs
            .iter()
            .flat_map(|(_, b)| b.iter())
            .map(|c| c.completion_tokens)
            .sum();
        let triple = |(median, min, max): (f64, f64, f64)| serde_json::json!([median, min, max]);
        let ttft = |completions: &Vec<Completion>| {
            completions.iter().map(|c| c.timings.ttft_ms).sum::<f64>() / completions.len() as f64
        };
        let plain_ttft = median_and_spread(pairs.iter().map(|(a, _)| ttft(a)).collect());
        let spec_ttft = median_and_spread(pairs.iter().map(|(_, b)| ttft(b)).collect());
        let most = |peaks: Vec<u64>| peaks.into_iter().max().unwrap_or(0);
        let row = serde_json::json!({
            "p": p,
            "depth": depth.map_or("auto".to_string(), |k| k.to_string()),
            "max_draft": depth.unwrap_or(args.draft_tokens),
            "concurrency": concurrency,
            "runs": pairs.len(),
            "plain_decode_tps": triple(plain_tps),
            "speculative_decode_tps": triple(spec_tps),
            "ratio": triple(ratio),
            "drafted_per_token": drafted as f64 / generated.max(1) as f64,
            "acceptance": kept as f64 / drafted.max(1) as f64,
            "draft_head": args.draft_head,
            "plain_ttft_ms": triple(plain_ttft),
            "speculative_ttft_ms": triple(spec_ttft),
            "plain_peak_over_rest_bytes": most(peaks.iter().map(|p| p.0).collect()),
            "speculative_peak_over_rest_bytes": most(peaks.iter().map(|p| p.1).collect()),
            "step_profile": args.step_profile.then(|| crate::bench::step_rows(&profile)),
        });
        if args.json {
            println!("{row}");
        } else {
            if args.step_profile {
                crate::bench::step_lines(&profile)
                    .iter()
                    .for_each(|line| println!("{line}"));
            }
            println!(
                "p {p:.2}, depth {}: plain {:.1} tok/s, speculative {:.1} tok/s, ratio {:.3} ({:.3}-{:.3}); {:.2} drafted per token, {:.0} % kept",
                depth.map_or("auto".to_string(), |k| k.to_string()),
                plain_tps.0,
                spec_tps.0,
                ratio.0,
                ratio.1,
                ratio.2,
                drafted as f64 / generated.max(1) as f64,
                100.0 * kept as f64 / drafted.max(1) as f64
            );
            println!(
                "  TTFT plain {:.1} ms, speculative {:.1} ms; peak over resting memory plain {:.1} MB, speculative {:.1} MB",
                plain_ttft.0,
                spec_ttft.0,
                most(peaks.iter().map(|p| p.0).collect()) as f64 / 1e6,
                most(peaks.iter().map(|p| p.1).collect()) as f64 / 1e6,
            );
        }
    }
    Ok(())
}

/// `--ragged-check` (see the flag): per run, fresh prompts through three arms in turn, plain,
/// aligned and ragged; decode tok/s per stream (mean over streams), medians over runs.
pub fn bench_ragged(args: &BenchArgs, engine: &Engine, vocab: usize) -> anyhow::Result<()> {
    let model = args.model.clone().expect("checked by the caller");
    let concurrency = args.concurrency.max(2);
    let prompt_len = args.prompt_tokens;
    let arm = |prompts: &[Vec<u32>], drafts: &[Option<u32>]| {
        let requests = prompts
            .iter()
            .zip(drafts)
            .map(|(prompt, &first)| {
                let drafter = first.map(|token| {
                    Drafter(Arc::new(move |history: &[u32], _: usize| {
                        match history.len() == prompt_len {
                            true => vec![token],
                            false => Vec::new(),
                        }
                    }))
                });
                let params = GenerateParams {
                    max_tokens: args.gen_tokens,
                    ignore_eos: true,
                    sampling: forced_sampling(vocab),
                    speculative: SpeculativeParams {
                        mode: Some(match drafter {
                            Some(_) => SpeculativeMode::Lookup,
                            None => SpeculativeMode::Off,
                        }),
                        max_draft: 1,
                        drafter,
                        costs: None,
                    },
                    ..GenerateParams::default()
                };
                (prompt.clone(), params)
            })
            .collect();
        answer_all(engine, &model, requests)
    };
    let tps = |completions: &[Completion]| {
        completions
            .iter()
            .map(|c| c.timings.decode_tps)
            .sum::<f64>()
            / completions.len() as f64
    };
    let mut arms: [Vec<f64>; 3] = Default::default();
    for run in 0..=args.runs.max(1) as u64 {
        let prompts: Vec<Vec<u32>> = (0..concurrency as u64)
            .map(|s| prompt_ids(prompt_len, vocab, args.seed + run * 101 + s))
            .collect();
        let plain = arm(&prompts, &vec![None; concurrency])?;
        let firsts: Vec<u32> = plain.iter().map(|c| c.token_ids[0]).collect();
        let aligned: Vec<Option<u32>> = firsts.iter().map(|&t| Some(t)).collect();
        let ragged: Vec<Option<u32>> = firsts
            .iter()
            .enumerate()
            .map(|(row, &t)| (row % 2 == 0).then_some(t))
            .collect();
        let aligned_run = arm(&prompts, &aligned)?;
        let ragged_run = arm(&prompts, &ragged)?;
        for (name, other) in [("aligned", &aligned_run), ("ragged", &ragged_run)] {
            for (row, (a, b)) in plain.iter().zip(other.iter()).enumerate() {
                let first = a
                    .token_ids
                    .iter()
                    .zip(&b.token_ids)
                    .position(|(x, y)| x != y);
                anyhow::ensure!(
                    first.is_none(),
                    "the {name} arm's row {row} differs from plain at token {first:?} (run {run})"
                );
            }
        }
        if run > 0 {
            arms[0].push(tps(&plain));
            arms[1].push(tps(&aligned_run));
            arms[2].push(tps(&ragged_run));
        }
    }
    let ratio = median_and_spread(arms[2].iter().zip(&arms[1]).map(|(r, a)| r / a).collect());
    let [plain, aligned, ragged] = arms.map(median_and_spread);
    let triple = |(median, min, max): (f64, f64, f64)| serde_json::json!([median, min, max]);
    println!(
        "{}",
        serde_json::json!({
            "concurrency": concurrency,
            "gen_tokens": args.gen_tokens,
            "plain_decode_tps": triple(plain),
            "aligned_decode_tps": triple(aligned),
            "ragged_decode_tps": triple(ragged),
            "ragged_over_aligned": triple(ratio),
        })
    );
    Ok(())
}

/// Submits every (prompt, params) at once and waits for all the answers, in order.
fn answer_all(
    engine: &Engine,
    model: &std::path::Path,
    requests: Vec<(Vec<u32>, GenerateParams)>,
) -> anyhow::Result<Vec<Completion>> {
    let handles = requests
        .into_iter()
        .map(|(prompt, params)| {
            engine.submit(Request {
                model: model.to_path_buf(),
                prompt: Prompt::Ids(prompt),
                params,
                ..Request::default()
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(handles
        .into_iter()
        .map(|handle| handle.wait())
        .collect::<Result<Vec<_>, _>>()?)
}
