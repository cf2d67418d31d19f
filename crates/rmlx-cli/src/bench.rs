//! `rmlx bench`: prefill and decode speed on random prompt ids, one stream or several at once.
//! Honest by construction: the warm-up runs the measured shape (every stream's full prompt and
//! generation), every timed run draws fresh prompt ids and the prefix cache is off, so no run
//! is served from an earlier one; medians come with their spread.
//! Reference: mlx-lm `benchmark.py` (warm-up at the measured shape, averaged trials).

use std::{path::PathBuf, sync::mpsc, time::Instant};

use rmlx_engine::{
    engine::{Engine, EngineOptions, Event, Prompt, Request, DEFAULT_MAX_BATCH},
    generate::{GenerateParams, Timings},
    sample::SamplingParams,
};

#[derive(clap::Args)]
pub struct BenchArgs {
    #[arg(long, required_unless_present = "kv_table")]
    pub model: Option<PathBuf>,
    /// Store the full-attention layers' KV cache at 8 or 4 bits (as `rmlx serve --kv-bits`).
    #[arg(long, value_name = "8|4")]
    pub kv_bits: Option<i32>,
    /// Instead of timing: the KV memory of these release folders (their config.json) per token
    /// and at 32k / 128k of context, sliding layers full-length (before windows) and windowed,
    /// dense and at 8 / 4 bits, as a Markdown table (docs/PERFORMANCE.md).
    #[arg(long, num_args = 1.., value_name = "DIR")]
    kv_table: Vec<PathBuf>,
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Stream s's prompt is `prompt_tokens + s * prompt_spread` tokens long (a burst's prompts
    /// differ in length, as agents' sub-requests do); 0: all alike.
    #[arg(long, default_value_t = 0)]
    pub prompt_spread: usize,
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// Timed runs after the warm-up; medians and min-max are reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Requests sent at once in each run (each with its own prompt).
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Requests decoding together (the engine's batch cap, as `rmlx serve --max-batch`).
    #[arg(long, default_value_t = DEFAULT_MAX_BATCH)]
    max_batch: usize,
    /// Seed of the first timed run's prompt ids (run r, stream s: seed + r * concurrency + s;
    /// the warm-up uses seed - 1 and below). scripts/bench/bench.py draws the same ids.
    #[arg(long, default_value_t = 1000)]
    pub seed: u64,
    /// Also print where the timed runs' decode steps spent their time, by batch width
    /// (building the graph, handing it to MLX, waiting for tokens, the loop between steps).
    #[arg(long)]
    pub step_profile: bool,
    /// Sample at this temperature (0: greedy). Agents' requests sample (Claude Code, the
    /// SDKs' default temperature 1); each stream is seeded from its prompt's seed.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// With --temperature: nucleus sampling (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// With --temperature: keep the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long)]
    pub json: bool,
    /// Instead of the plain bench: speculative decoding against plain decode, with a proposer
    /// whose every drafted token is right with probability p (comma-separated values; see
    /// `bench_spec.rs`). The output must equal plain decode's, token for token.
    #[arg(long, value_delimiter = ',', value_name = "P")]
    pub draft_accuracy: Vec<f64>,
    /// With --draft-accuracy: the most tokens `auto` drafts per step.
    #[arg(long, default_value_t = rmlx_engine::speculative::DEFAULT_MAX_DRAFT)]
    pub draft_tokens: usize,
    /// Instead of the plain bench: what a ragged batch costs. `--concurrency` streams decode
    /// plainly after one speculative first step in which every row (aligned) or every other
    /// row (ragged) keeps one right draft; the ragged rows then end a column apart for the
    /// whole decode (see `bench_spec.rs`).
    #[arg(long)]
    pub ragged_check: bool,
    /// With --draft-accuracy: draft exactly this many per step (no depth control; comma-
    /// separated depths are measured one after another).
    #[arg(long, value_delimiter = ',', value_name = "K")]
    pub draft_depth: Vec<usize>,
    /// With --draft-accuracy: the drafts come from the model's own draft head (Qwen3.5 / 3.6
    /// MTP), in an engine of its own beside the plain one. P picks the answers: 1 forces every
    /// answer to one token by a logit bias, which the head's drafts get too (every draft
    /// right); 0 leaves them free (a random head: every draft wrong; bf16 near-ties may then
    /// part the two answers, so they are not compared).
    #[arg(long)]
    pub draft_head: bool,
}

/// The LCG of scripts/bench/bench.py's `prompt_ids`, from state `seed`.
pub fn prompt_ids(count: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut state = seed;
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// One stream of a run, as the client saw it.
struct Stream {
    prompt_tokens: usize,
    ttft_ms: f64,
    tokens: usize,
    timings: Timings,
}

/// One run: `concurrency` requests submitted at once.
struct Run {
    wall_s: f64,
    streams: Vec<Stream>,
}

impl Run {
    fn aggregate_tps(&self) -> f64 {
        self.streams.iter().map(|s| s.tokens).sum::<usize>() as f64 / self.wall_s.max(1e-9)
    }
}

pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    if !args.kv_table.is_empty() {
        return kv_table(&args.kv_table);
    }
    let model = args
        .model
        .clone()
        .expect("clap requires --model without --kv-table");
    crate::check_model_dir(&model)?;
    let concurrency = args.concurrency.max(1);
    let engine = Engine::start_with(EngineOptions {
        max_queue: concurrency,
        max_batch: args.max_batch.max(1),
        prefix_cache_bytes: Some(0),
        prefix_snapshot_bytes: Some(0),
        kv_bits: args.kv_bits,
        // Plain decode, as the peers it is compared with run (and no draft head primed);
        // --draft-accuracy measures speculation against it.
        speculative: rmlx_engine::speculative::SpeculativeMode::Off,
        ..EngineOptions::default()
    })?;
    let vocab = engine.model_info(&model)?.vocab_size;
    if args.ragged_check {
        return crate::bench_spec::bench_ragged(&args, &engine, vocab);
    }
    if !args.draft_accuracy.is_empty() {
        return crate::bench_spec::bench_speculative(&args, &engine, vocab);
    }
    let run = |seeds: Vec<u64>| -> anyhow::Result<Run> {
        let started = Instant::now();
        let waiters = seeds
            .into_iter()
            .enumerate()
            .map(|(stream, seed)| {
                let length = args.prompt_tokens + stream * args.prompt_spread;
                let request = Request {
                    model: model.clone(),
                    prompt: Prompt::Ids(prompt_ids(length, vocab, seed)),
                    params: GenerateParams {
                        max_tokens: args.gen_tokens,
                        ignore_eos: true,
                        prefill_chunk: args.prefill_chunk,
                        sampling: SamplingParams {
                            temperature: args.temperature,
                            top_p: args.top_p,
                            top_k: args.top_k,
                            seed: Some(seed),
                            ..SamplingParams::default()
                        },
                        ..GenerateParams::default()
                    },
                    ..Request::default()
                };
                let handle = engine.submit(request)?;
                // Each stream is read on its own thread, so its first token is timed when
                // it arrives, not when the streams before it finish.
                let (done, result) = mpsc::channel();
                std::thread::spawn(move || {
                    let mut first = None;
                    for event in handle.events.iter() {
                        match event {
                            Event::Delta { .. } => {
                                first.get_or_insert_with(|| started.elapsed());
                            }
                            Event::Done(completion) => {
                                let ttft = first.unwrap_or_else(|| started.elapsed());
                                let _ = done.send(Ok(Stream {
                                    prompt_tokens: length,
                                    ttft_ms: ttft.as_secs_f64() * 1000.0,
                                    tokens: completion.completion_tokens,
                                    timings: completion.timings,
                                }));
                                return;
                            }
                            Event::Error(error) => {
                                let _ = done.send(Err(error));
                                return;
                            }
                            Event::Started { .. } => {}
                        }
                    }
                });
                Ok(result)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let streams = waiters
            .into_iter()
            .map(|waiter| Ok(waiter.recv()??))
            .collect::<anyhow::Result<Vec<Stream>>>()?;
        Ok(Run {
            wall_s: started.elapsed().as_secs_f64(),
            streams,
        })
    };
    let n = concurrency as u64;
    // The warm-up: the measured shape with its own ids (below the timed runs' seeds).
    run((0..n).map(|s| args.seed.saturating_sub(1 + s)).collect())?;
    if args.step_profile {
        rmlx_engine::profile::enable();
    }
    let runs = (0..args.runs.max(1) as u64)
        .map(|r| run((0..n).map(|s| args.seed + r * n + s).collect()))
        .collect::<anyhow::Result<Vec<Run>>>()?;
    let steps = args.step_profile.then(rmlx_engine::profile::take);
    // MLX's peak since the engine started: the warm-up ran the measured shape too.
    let peak = engine.metrics().mlx_peak_bytes;
    report(&args, concurrency, &runs, steps.as_ref(), peak);
    Ok(())
}

/// `--kv-table`: a Markdown row per release folder (see the flag). "Before" is what every
/// layer kept before sliding windows (each sliding layer full-length), "after" the windows.
fn kv_table(dirs: &[PathBuf]) -> anyhow::Result<()> {
    use rmlx_engine::models::structure;
    let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
    println!("| release | KV per token before / after (KiB) | windows | 32k before | 32k after: 16 / 8 / 4 bits | 128k before | 128k after: 16 / 8 / 4 bits |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for dir in dirs {
        let text = std::fs::read_to_string(dir.join("config.json"))?;
        let config: serde_json::Value = serde_json::from_str(&text)?;
        let windows = structure::window_state_bytes(&config);
        let full = structure::kv_bytes_per_token(&config);
        let before = full + structure::sliding_bytes_per_token(&config);
        let after = |bits: Option<i32>, context: u64| {
            structure::kv_bytes_per_token_stored(&config, bits) * context + windows
        };
        let at = |context: u64| {
            format!(
                "{:.2} / {:.2} / {:.2} GiB",
                gib(after(None, context)),
                gib(after(Some(8), context)),
                gib(after(Some(4), context))
            )
        };
        println!(
            "| {} | {:.0} / {:.0} | {:.2} GiB | {:.2} GiB | {} | {:.2} GiB | {} |",
            dir.file_name().unwrap_or_default().to_string_lossy(),
            before as f64 / 1024.0,
            full as f64 / 1024.0,
            gib(windows),
            gib(before * 32 * 1024),
            at(32 * 1024),
            gib(before * 128 * 1024),
            at(128 * 1024),
        );
    }
    Ok(())
}

pub type StepProfile =
    std::collections::BTreeMap<rmlx_engine::profile::StepShape, rmlx_engine::profile::Phases>;

/// Milliseconds per step of each phase, by batch width.
pub fn step_rows(profile: &StepProfile) -> Vec<serde_json::Value> {
    profile
        .iter()
        .map(|((rows, width), phases)| {
            let per =
                |d: std::time::Duration| d.as_secs_f64() * 1000.0 / phases.steps.max(1) as f64;
            serde_json::json!({
                "rows": rows,
                "tokens_per_row": width,
                "steps": phases.steps,
                "build_ms": per(phases.build),
                "submit_ms": per(phases.submit),
                "read_ms": per(phases.read),
                "between_ms": per(phases.between),
                "step_ms": per(phases.build + phases.submit + phases.read + phases.between),
            })
        })
        .collect()
}

pub fn median_and_spread(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    (
        values[values.len() / 2],
        values[0],
        values[values.len() - 1],
    )
}

fn percentile(mut values: Vec<f64>, q: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    values[((q * (values.len() - 1) as f64).round() as usize).min(values.len() - 1)]
}

fn report(
    args: &BenchArgs,
    concurrency: usize,
    runs: &[Run],
    steps: Option<&StepProfile>,
    peak: u64,
) {
    let streams = || runs.iter().flat_map(|run| &run.streams);
    let ttfts: Vec<f64> = streams().map(|s| s.ttft_ms).collect();
    let ttft = median_and_spread(ttfts.clone());
    let prefill = median_and_spread(
        streams()
            .map(|s| s.prompt_tokens as f64 / (s.ttft_ms / 1000.0).max(1e-9))
            .collect(),
    );
    let decode = median_and_spread(streams().map(|s| s.timings.decode_tps).collect());
    let aggregate = median_and_spread(runs.iter().map(Run::aggregate_tps).collect());
    let (p50, p95) = (percentile(ttfts.clone(), 0.5), percentile(ttfts, 0.95));
    if args.json {
        let triple = |(median, min, max): (f64, f64, f64)| serde_json::json!([median, min, max]);
        println!(
            "{}",
            serde_json::json!({
                "prompt_tokens": args.prompt_tokens,
                "prompt_spread": args.prompt_spread,
                "gen_tokens": args.gen_tokens,
                "concurrency": concurrency,
                "runs": runs.len(),
                "ttft_ms": ttft.0,
                "prefill_tps": prefill.0,
                "decode_tps": decode.0,
                "aggregate_tps": aggregate.0,
                "ttft_p50_ms": p50,
                "ttft_p95_ms": p95,
                "spread": {
                    "ttft_ms": triple(ttft),
                    "prefill_tps": triple(prefill),
                    "decode_tps": triple(decode),
                    "aggregate_tps": triple(aggregate),
                },
                "step_profile": steps.map(step_rows),
                "kv_bits": args.kv_bits,
                "temperature": args.temperature,
                "peak_memory_bytes": peak,
            })
        );
        return;
    }
    let cell = |(median, min, max): (f64, f64, f64)| format!("{median:.1} ({min:.1}-{max:.1})");
    println!(
        "prompt {} tokens, {} generated, {concurrency} stream(s), {} run(s) after a warm-up at this shape (medians, min-max):",
        args.prompt_tokens,
        args.gen_tokens,
        runs.len()
    );
    println!(
        "  TTFT            {} ms (p50 {p50:.1}, p95 {p95:.1})",
        cell(ttft)
    );
    println!("  prefill         {} tok/s per stream", cell(prefill));
    println!("  decode          {} tok/s per stream", cell(decode));
    println!("  all streams     {} tok/s", cell(aggregate));
    println!(
        "  peak memory     {:.1} MB (MLX, {} KV)",
        peak as f64 / 1e6,
        args.kv_bits
            .map_or("dense".to_string(), |bits| format!("{bits}-bit"))
    );
    if let Some(profile) = steps {
        step_lines(profile)
            .iter()
            .for_each(|line| println!("{line}"));
    }
}

/// The step profile, a line per batch width (also what `rmlx serve` prints at exit with
/// `RMLX_STEP_PROFILE=1`).
pub fn step_lines(profile: &StepProfile) -> Vec<String> {
    let mut lines = vec![
        "  decode steps (ms per step: build graph / async_eval / wait for tokens / loop between; a step feeding k + 1 tokens per row is a speculative one, its rollback counted as between):"
            .to_string(),
    ];
    for row in step_rows(profile) {
        lines.push(format!(
            "    {:>2} rows x {} tokens  {:>6} steps  {:.3} / {:.3} / {:.3} / {:.3} = {:.3}",
            row["rows"],
            row["tokens_per_row"],
            row["steps"],
            row["build_ms"].as_f64().unwrap_or(0.0),
            row["submit_ms"].as_f64().unwrap_or(0.0),
            row["read_ms"].as_f64().unwrap_or(0.0),
            row["between_ms"].as_f64().unwrap_or(0.0),
            row["step_ms"].as_f64().unwrap_or(0.0),
        ));
    }
    lines
}
