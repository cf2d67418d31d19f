//! `rmlx`: the engine on the command line (generate, info, bench, doctor, serve, pull).

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::ExitCode,
};

mod bench;
mod bench_spec;
mod cluster;
mod launch;
mod pull;
mod serve;

use anyhow::Context;
use clap::{Parser, Subcommand};
use rmlx_engine::{
    chat::TemplateOptions,
    engine::{Engine, Event, Prompt, Request},
    generate::GenerateParams,
    sample::SamplingParams,
};

#[derive(Parser)]
#[command(name = "rmlx", version, about = "Run MLX models locally")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a reply to a prompt, streaming it to stdout.
    Generate(GenerateArgs),
    /// Describe a model folder: architecture, parameters, quantization, context, vision.
    Info {
        #[arg(long)]
        model: PathBuf,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Time prefill and decode on random prompt ids (scripts/bench/run compares with mlx-lm).
    Bench(bench::BenchArgs),
    /// Serve OpenAI- and Anthropic-compatible HTTP APIs on 127.0.0.1.
    Serve(serve::ServeArgs),
    /// Download a model from the Hugging Face hub into the models folder (reruns resume).
    Pull(pull::PullArgs),
    /// Run a coding agent (claude, codex, qwen) against rMLX: uses the server listening on the
    /// port or starts one, and sets the agent up for it.
    Launch(launch::LaunchArgs),
    /// Print the server's OpenAPI 3.1 document as YAML (what docs/openapi.yaml holds).
    Openapi,
    /// Machines serving one model together: `rmlx cluster check HOSTFILE --rank N` joins the
    /// group, agrees on versions and the model, and times the links (docs/DISTRIBUTED.md).
    Cluster(cluster::ClusterArgs),
    /// Check the MLX runtime: library, version, device, and a few real operations.
    Doctor {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// Model folder (config.json, *.safetensors, tokenizer files).
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt: String,
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long)]
    repetition_penalty: Option<f32>,
    #[arg(long)]
    seed: Option<u64>,
    /// Context limit; default the model's max_position_embeddings.
    #[arg(long)]
    max_ctx: Option<usize>,
    /// Prompt tokens per prefill chunk.
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// Store the full-attention layers' KV cache quantized, 8 or 4 bits [default: dense]
    #[arg(long, value_name = "8|4")]
    kv_bits: Option<i32>,
    /// Speculative decoding: `lookup` drafts the tokens that followed the conversation's last
    /// few tokens where they occurred before, checked in one forward (greedy output unchanged,
    /// sampled output keeps its distribution); `mtp` drafts with the model's own
    /// multi-token-prediction head (Qwen3.5 / 3.6 checkpoints that ship one; lookup otherwise);
    /// `draft` with `--draft-model`; `auto` uses the head, the draft model or lookup where it
    /// measures a gain and switches itself off elsewhere
    #[arg(long, value_name = "auto|off|lookup|mtp|draft", value_parser = parse_speculative, default_value = DEFAULT_SPECULATIVE)]
    speculative: rmlx_engine::speculative::SpeculativeMode,
    /// A small model of the same tokenizer that drafts for this one (`--speculative draft` or
    /// `auto`), e.g. Qwen3-0.6B for a Qwen3, Qwen3.5-0.8B for a Qwen3.5 / 3.6, Gemma 4 E2B for a
    /// Gemma 4
    #[arg(long, value_name = "DIR", env = "RMLX_DRAFT_MODEL")]
    draft_model: Option<PathBuf>,
    /// Keep going through end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Stop strings (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Send the prompt as is, without the chat template.
    #[arg(long)]
    raw: bool,
    /// An image file to ask about (repeatable; vision models only).
    #[arg(long = "image", value_name = "PATH")]
    images: Vec<PathBuf>,
    /// Gemma 4: soft tokens per image (70, 140, 280, 560 or 1120; more sees finer detail).
    #[arg(long, value_name = "N")]
    image_soft_tokens: Option<usize>,
    /// Turn the template's thinking mode on or off (Qwen3).
    #[arg(long)]
    enable_thinking: Option<bool>,
    /// Print exactly one JSON object (text, ids, usage, timings) instead of streaming.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    cluster: cluster::DistributedArgs,
}

/// `--speculative`'s default: the engine's.
const DEFAULT_SPECULATIVE: &str = "auto";

/// `--speculative auto|off|lookup|mtp|draft`.
pub(crate) fn parse_speculative(
    text: &str,
) -> Result<rmlx_engine::speculative::SpeculativeMode, String> {
    rmlx_engine::speculative::SpeculativeMode::parse(text)
        .ok_or_else(|| format!("`{text}` is none of auto, off, lookup, mtp, draft"))
}

fn main() -> ExitCode {
    // A bug must still read as a message, not a backtrace (RUST_BACKTRACE=1 shows one).
    if std::env::var_os("RUST_BACKTRACE").is_none() {
        std::panic::set_hook(Box::new(|info| {
            eprintln!(
                "rmlx: internal error: {info} (please report it; RUST_BACKTRACE=1 shows where)"
            );
        }));
    }
    // Past a file-size limit (`ulimit -f`) the kernel sends SIGXFSZ, which would end the
    // process mid-download; ignored, the write fails with EFBIG and the job reports it.
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to SIG_IGN before any thread starts.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    rmlx_engine::runtime::prepare_environment();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate(args),
        Command::Info { model, json } => info(&model, json),
        Command::Bench(args) => bench::bench(args),
        Command::Doctor { json } => doctor(json),
        Command::Openapi => {
            print!("{}", rmlx_server::openapi::yaml());
            Ok(())
        }
        Command::Serve(args) => serve::serve(args),
        Command::Pull(args) => pull::pull(args),
        Command::Launch(args) => launch::launch(args),
        Command::Cluster(args) => cluster::cluster(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("rmlx: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn check_model_dir(model: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(
        model.join("config.json").is_file(),
        "{} is not a model folder (no config.json)",
        model.display()
    );
    Ok(())
}

fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    check_model_dir(&args.model)?;
    let part = args.cluster.part(&args.model)?;
    if let Some(stage) = part.follower() {
        return follow_pipeline(&args.model, stage, &part, args.json);
    }
    // Rank 0 ends the followers' loops however its own work ends.
    let _stop = part.stage.clone().map(StopFollowers);
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..SamplingParams::default()
    };
    let prompt = if args.raw {
        Prompt::Text(args.prompt)
    } else {
        let mut messages = Vec::new();
        if let Some(system) = args.system {
            messages.push(serde_json::json!({"role": "system", "content": system}));
        }
        // Image parts first, as chat UIs send them; the template places each one.
        let content = if args.images.is_empty() {
            serde_json::json!(args.prompt)
        } else {
            let mut parts: Vec<serde_json::Value> = args
                .images
                .iter()
                .map(|_| serde_json::json!({"type": "image"}))
                .collect();
            parts.push(serde_json::json!({"type": "text", "text": args.prompt}));
            serde_json::Value::Array(parts)
        };
        messages.push(serde_json::json!({"role": "user", "content": content}));
        Prompt::Chat {
            messages,
            options: TemplateOptions {
                add_generation_prompt: true,
                enable_thinking: args.enable_thinking,
                ..TemplateOptions::default()
            },
        }
    };
    let limits = rmlx_engine::vision::ImageLimits::default();
    let images = args
        .images
        .iter()
        .map(|path| {
            rmlx_engine::vision::decode_image_source(
                &path.to_string_lossy(),
                rmlx_engine::vision::SourcePolicy::AllowFiles,
                &limits,
            )
            .with_context(|| format!("image {}", path.display()))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let request = Request {
        model: args.model,
        prompt,
        images,
        image_soft_tokens: args.image_soft_tokens,
        params: GenerateParams {
            max_tokens: args.max_tokens,
            sampling,
            ignore_eos: args.ignore_eos,
            stop: args.stop,
            max_ctx: args.max_ctx,
            prefill_chunk: args.prefill_chunk,
            ..GenerateParams::default()
        },
        ..Request::default()
    };
    let distributed = part.stage().is_some();
    let engine = Engine::start_with(rmlx_engine::engine::EngineOptions {
        max_queue: 1,
        kv_bits: args.kv_bits,
        speculative: args.speculative,
        draft_model: args.draft_model.filter(|_| !distributed),
        part,
        ..Default::default()
    })?;
    let handle = engine.submit(request)?;
    let mut stdout = std::io::stdout().lock();
    for event in handle.events.iter() {
        match event {
            Event::Delta { text, .. } if !args.json => {
                stdout.write_all(text.as_bytes())?;
                stdout.flush()?;
            }
            Event::Done(completion) => {
                // MLX's high-water mark over this process's one request: weights, KV cache and
                // activations (what "will it fit" questions are about).
                let peak = engine.metrics().mlx_peak_bytes;
                if args.json {
                    let mut value = serde_json::to_value(&completion)?;
                    value["peak_memory_bytes"] = serde_json::json!(peak);
                    serde_json::to_writer(&mut stdout, &value)?;
                }
                writeln!(stdout)?;
                if !args.json {
                    let t = &completion.timings;
                    eprintln!(
                        "[{} prompt + {} generated tokens, {:?}; TTFT {:.1} ms, prefill {:.1} tok/s, decode {:.1} tok/s; peak memory {:.1} MB]",
                        completion.prompt_tokens,
                        completion.completion_tokens,
                        completion.finish_reason,
                        t.ttft_ms,
                        t.prefill_tps,
                        t.decode_tps,
                        peak as f64 / 1e6
                    );
                }
                return Ok(());
            }
            Event::Error(error) => return Err(error.into()),
            _ => {}
        }
    }
    anyhow::bail!("the engine stopped without an answer")
}

/// A follower rank of `rmlx generate` or `rmlx serve --distributed`: its layers for each of
/// rank 0's forwards, until rank 0 ends; `json` prints what it did as one object.
fn follow_pipeline(
    model: &Path,
    stage: &rmlx_engine::distributed::pipeline::Stage,
    part: &rmlx_engine::models::Part,
    json: bool,
) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    // This rank's share must fit here, as rank 0's engine checks its own.
    if let Some(available) = rmlx_engine::runtime::available_memory() {
        let needed = rmlx_engine::runtime::memory_needed_for(model, part)?;
        anyhow::ensure!(
            needed <= available,
            "rank {}'s layers need about {:.1} GB but only {:.1} GB of memory is available",
            stage.rank(),
            needed as f64 / 1e9,
            available as f64 / 1e9
        );
    }
    eprintln!(
        "rmlx: rank {} of {} holds layers {}-{}; following rank 0",
        stage.rank(),
        stage.size(),
        stage.own_layers().start,
        stage.own_layers().end - 1
    );
    let loaded = rmlx_engine::models::load_model_with(
        model,
        rmlx_engine::models::LoadOptions {
            part: part.clone(),
            ..Default::default()
        },
    )
    .context("cannot load this rank's layers")?;
    // Cache sizes and storage come with rank 0's cache log.
    let forwards = rmlx_engine::distributed::pipeline::follow(loaded.model.as_ref(), stage)?;
    let layers = stage.own_layers();
    if json {
        println!(
            "{}",
            serde_json::json!({
                "rank": stage.rank(),
                "layers": [layers.start, layers.end],
                "weight_bytes": loaded.info.weight_bytes,
                "forwards": forwards,
            })
        );
    }
    eprintln!(
        "rank {}: layers {}-{} ({:.2} GB of weights), {forwards} forwards in {:.1} s",
        stage.rank(),
        layers.start,
        layers.end - 1,
        loaded.info.weight_bytes as f64 / 1e9,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Rank 0's end of the pipeline's work, however `rmlx generate` or `rmlx serve` ends.
struct StopFollowers(std::sync::Arc<rmlx_engine::distributed::pipeline::Stage>);

impl Drop for StopFollowers {
    fn drop(&mut self) {
        if let Err(error) = self.0.stop_followers() {
            eprintln!("rmlx: could not stop the other ranks: {error}");
        }
    }
}

fn info(model: &Path, json: bool) -> anyhow::Result<()> {
    use rmlx_engine::runtime::Serving;
    check_model_dir(model)?;
    let engine = Engine::start(1)?;
    let info = engine.model_info(model).context("cannot load the model")?;
    if json {
        println!("{}", serde_json::to_string(&info)?);
        return Ok(());
    }
    println!("model:         {}", info.path.display());
    println!("architecture:  {}", info.model_type);
    println!("structure:     {}", info.structure);
    println!(
        "parameters:    {} ({})",
        info.parameters,
        human_count(info.parameters)
    );
    println!(
        "quantization:  {}",
        info.quantization.as_deref().unwrap_or("none")
    );
    println!("context:       {} tokens", info.context_length);
    println!("vision:        {}", if info.vision { "yes" } else { "no" });
    println!(
        "draft head:    {}",
        if info.draft_head {
            "yes (multi-token prediction, mtp.*: `--speculative mtp` or `auto` drafts with it)"
        } else {
            "no"
        }
    );
    println!("weights:       {:.1} MB", info.weight_bytes as f64 / 1e6);
    let kv_at_context = info.kv_bytes_per_token * info.context_length as u64;
    println!(
        "KV cache:      {} bytes per token, {:.1} MB at the full {}-token context",
        info.kv_bytes_per_token,
        kv_at_context as f64 / 1e6,
        info.context_length
    );
    if info.recurrent_state_bytes > 0 {
        println!(
            "linear state:  {:.1} MB per sequence (Gated DeltaNet conv + recurrent state)",
            info.recurrent_state_bytes as f64 / 1e6
        );
    }
    if info.window_state_bytes > 0 {
        println!(
            "windows:       {:.1} MB per sequence (sliding-window layers keep only their window)",
            info.window_state_bytes as f64 / 1e6
        );
    }
    let fixed = info.recurrent_state_bytes + info.window_state_bytes;
    println!(
        "memory:        {:.1} MB to serve the full context (weights + a tenth + KV + state)",
        (info.weight_bytes + info.weight_bytes / 10 + kv_at_context + fixed) as f64 / 1e6
    );
    if let Some(available) = rmlx_engine::runtime::available_memory() {
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(model.join("config.json"))?)?;
        let serving = rmlx_engine::runtime::Serving {
            rows: 1,
            ..Default::default()
        };
        let longest = |kv_bits| {
            rmlx_engine::runtime::largest_context_that_fits(
                model,
                &config,
                &Serving { kv_bits, ..serving },
                available,
            )
        };
        let shown = |fits: Option<u64>| match fits {
            Some(tokens) => format!("{tokens} tokens"),
            None => "nothing (the weights do not fit)".to_string(),
        };
        println!(
            "fits now:      {} of context in the {:.1} GB available ({} with --kv-bits 8, {} with --kv-bits 4)",
            shown(longest(None)?),
            available as f64 / 1e9,
            shown(longest(Some(8))?),
            shown(longest(Some(4))?)
        );
    }
    Ok(())
}

fn human_count(count: u64) -> String {
    match count {
        0..=999_999 => format!("{:.1}K", count as f64 / 1e3),
        1_000_000..=999_999_999 => format!("{:.1}M", count as f64 / 1e6),
        _ => format!("{:.2}B", count as f64 / 1e9),
    }
}

/// Loads MLX, evaluates a matmul, a softmax and a 4-bit quantized matmul, and reports where.
fn doctor(json: bool) -> anyhow::Result<()> {
    use mlx_rs::{ops, Array};
    use rmlx_engine::quant::{self, QuantMode, QuantSpec};
    let info = rmlx_engine::runtime::runtime_info()?;
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]);
    let b = Array::from_slice(&[0.5f32, -1.0, 1.5, 2.0], &[2, 2]);
    let product = ops::matmul(&a, &b)?;
    let softmax = ops::softmax_axis(&product, -1, None)?;
    let w = mlx_rs::random::normal::<f32>(&[64, 64], None, None, None)?;
    let spec = QuantSpec::defaults(QuantMode::Affine);
    let q = quant::quantize(&w, spec)?;
    let x = mlx_rs::random::normal::<f32>(&[1, 64], None, None, None)?;
    let y = quant::quantized_matmul(&x, &q.weight, &q.scales, q.biases.as_ref(), true, spec)?;
    mlx_rs::transforms::eval([&product, &softmax, &y])?;
    let product_values = product.as_slice::<f32>().to_vec();
    let row_sum = softmax.as_slice::<f32>()[0] + softmax.as_slice::<f32>()[1];
    // What `main` set for MLX (see `prepare_environment`), as this process runs with it.
    let check = rmlx_engine::runtime::CACHE_THRASHING_CHECK;
    let thrashing = std::env::var(check).unwrap_or_default();
    let distributed = rmlx_engine::distributed::backends_available();
    if json {
        let value = serde_json::json!({
            "runtime": info,
            "matmul": product_values,
            "softmax_row_sums": [row_sum],
            "quantized_matmul_shape": y.shape(),
            "mlx_settings": { check: thrashing },
            "distributed_backends": distributed.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
        });
        println!("{value}");
    } else {
        println!(
            "MLX {} (pinned {}) from {}",
            info.mlx_version,
            info.compiled_mlx_version,
            info.library.display()
        );
        println!("default device: {}", info.default_device);
        println!("{check}={thrashing}");
        println!(
            "metal: {}  cuda: {}",
            info.metal_available, info.cuda_available
        );
        println!("matmul [[1,2],[3,4]] x [[0.5,-1],[1.5,2]] = {product_values:?}");
        println!(
            "4-bit affine quantized matmul 1x64 @ 64x64: shape {:?}",
            y.shape()
        );
        let backends: Vec<String> = distributed
            .iter()
            .map(|(name, on)| format!("{name} {}", if *on { "yes" } else { "no" }))
            .collect();
        println!("distributed backends: {}", backends.join(", "));
    }
    if info.mlx_version != info.compiled_mlx_version {
        eprintln!(
            "warning: loaded MLX {} differs from the pinned {}",
            info.mlx_version, info.compiled_mlx_version
        );
    }
    Ok(())
}
