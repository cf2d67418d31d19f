//! `rmlx serve`: the OpenAI- and Anthropic-compatible server on the local engine. The server
//! lives in `rmlx-server`; this file only turns flags into its `ServerConfig`.

use std::path::PathBuf;

use rmlx_server::ServerConfig;

use crate::{parse_speculative, DEFAULT_SPECULATIVE};

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Model folder to serve under its folder name (repeatable).
    #[arg(long = "model")]
    models: Vec<PathBuf>,
    /// Folder whose subfolders (with config.json) are served as `name` or `org/name`; downloads
    /// from the admin routes land here [default: $RMLX_MODELS_DIR or ~/.rmlx/models, as `rmlx pull`]
    #[arg(long, value_name = "DIR")]
    models_dir: Option<PathBuf>,
    /// Hugging Face hub cache to serve as `org/name` (default $HF_HOME/hub or ~/.cache/huggingface/hub).
    #[arg(long)]
    hf_cache: Option<PathBuf>,
    /// Address to bind; the default keeps the server on this machine.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port; 0 picks a free one (printed on the first stdout line).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Cap on every model's context, in tokens.
    #[arg(long)]
    max_ctx: Option<usize>,
    /// Models kept resident at once.
    #[arg(long, default_value_t = 1)]
    max_loaded: usize,
    /// Require this key (`Authorization: Bearer`, or `x-api-key` on /v1/messages).
    #[arg(long)]
    api_key: Option<String>,
    /// Browser origin allowed by CORS (repeatable; `*` for any). Off when not given.
    #[arg(long = "cors-origin")]
    cors_origins: Vec<String>,
    /// Requests waiting for the engine before new ones get 429.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Requests decoding together in one batch (continuous batching; 1 runs them one after
    /// another).
    #[arg(long, default_value_t = rmlx_engine::engine::DEFAULT_MAX_BATCH)]
    max_batch: usize,
    /// Seconds between a stream's keep-alives while its request waits or its prompt prefills;
    /// a stream whose request is still queued after one answers anyway (agents abort requests
    /// whose headers are late). 0 sends none and holds a stream's headers until it starts.
    #[arg(long, value_name = "SECONDS", default_value_t = rmlx_server::DEFAULT_HEARTBEAT.as_secs_f64())]
    heartbeat: f64,
    /// Largest request body, in MB (images arrive inline as base64).
    #[arg(long, default_value_t = 64)]
    max_body_mb: usize,
    /// MB of finished requests' KV the prefix cache keeps for reuse (0 turns it off)
    /// [default: a 128k-token agent session of the loaded model's KV, at least 1024, at most
    /// half the memory its weights leave; docs/SERVER.md]
    #[arg(long)]
    prefix_cache_mb: Option<u64>,
    /// MB of recurrent-model snapshots (Qwen3.5 / 3.6: KV + Gated DeltaNet state at each
    /// message boundary) the prefix cache keeps (0 turns them off) [default: two 128k-token
    /// sessions' snapshots, at least 2048, within the same half]
    #[arg(long)]
    prefix_snapshot_mb: Option<u64>,
    /// Store the full-attention layers' KV cache quantized, 8 or 4 bits (affine, groups of 64
    /// along the head): about half or a quarter of bf16 [default: dense]
    #[arg(long, value_name = "8|4")]
    kv_bits: Option<i32>,
    /// GB the disk prefix cache may hold: finished prefixes kept on disk, read back on a RAM
    /// miss and after a restart; least recently used files go first; 0 turns it off
    /// [default: min(16, 10 % of the free disk)]
    #[arg(long, value_name = "GB", env = "RMLX_PREFIX_DISK_GB")]
    prefix_disk_gb: Option<f64>,
    /// Speculative decoding: `lookup` drafts the tokens that followed the conversation's last
    /// few tokens where they occurred before, checked in one forward (greedy output unchanged,
    /// sampled output keeps its distribution); `mtp` drafts with the model's own
    /// multi-token-prediction head (Qwen3.5 / 3.6 checkpoints that ship one; lookup otherwise);
    /// `draft` with `--draft-model`; `auto` uses the head, the draft model or lookup where it
    /// measures a gain and switches itself off elsewhere
    #[arg(long, value_name = "auto|off|lookup|mtp|draft", value_parser = parse_speculative, env = "RMLX_SPECULATIVE", default_value = DEFAULT_SPECULATIVE)]
    speculative: rmlx_engine::speculative::SpeculativeMode,
    /// A small model of the same tokenizer that drafts for every model served (`--speculative
    /// draft` or `auto`), e.g. Qwen3.5-0.8B for a Qwen3.5 / 3.6; a model of another tokenizer
    /// then fails to load, saying so
    #[arg(long, value_name = "DIR", env = "RMLX_DRAFT_MODEL")]
    draft_model: Option<PathBuf>,
    /// Folder of the disk prefix cache [default: ~/.rmlx/cache]
    #[arg(long, value_name = "DIR", env = "RMLX_PREFIX_DISK_DIR")]
    prefix_disk_dir: Option<PathBuf>,
    /// Keep Claude Code's `x-anthropic-billing-header` system block in the prompt (left out by
    /// default: its per-request value would end every prefix-cache hit at the system prompt).
    #[arg(long)]
    keep_billing_header: bool,
    /// Hub base URL for the admin download routes [default: $HF_ENDPOINT or
    /// https://huggingface.co]; $HF_TOKEN is sent as a bearer token when set.
    #[arg(long, value_name = "URL")]
    hub_url: Option<String>,
    /// Serve the web UI from this folder (a build of ui/) at `/` instead of the one built in.
    #[arg(long)]
    ui_dir: Option<PathBuf>,
    /// Serve no web UI at `/` (the API only).
    #[arg(long, conflicts_with = "ui_dir")]
    no_ui: bool,
    /// Load the first --model at start and warm it up (and each model loaded through
    /// `/v1/models/{id}/load`): the kernels a first burst of requests would otherwise build one
    /// by one (minutes on a GPU the first time) are built before anyone waits. `off`: load on
    /// the first request, build kernels as they come.
    #[arg(long, value_name = "on|off", default_value = "on", value_parser = ["on", "off"])]
    warm_up: String,
    #[command(flatten)]
    cluster: crate::cluster::DistributedArgs,
}

pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    if args
        .prefix_disk_gb
        .is_some_and(|gb| !(gb >= 0.0 && gb.is_finite()))
    {
        anyhow::bail!("--prefix-disk-gb must be 0 (off) or a positive number of GB");
    }
    let part = match &args.cluster.distributed {
        Some(_) => {
            let [model] = &args.models[..] else {
                anyhow::bail!("--distributed serves exactly one --model, the one every rank holds");
            };
            crate::check_model_dir(model)?;
            args.cluster.part(model)?
        }
        None => rmlx_engine::models::Part::default(),
    };
    if let Some(stage) = part.follower() {
        return crate::follow_pipeline(&args.models[0], stage, &part, false);
    }
    let distributed = part.stage().is_some();
    // Rank 0 ends the followers' loops however serving ends.
    let _stop = part.stage.clone().map(crate::StopFollowers);
    // Only the pipeline's model: another would need its own plan on every rank.
    let (models_dir, hf_cache) = match distributed {
        true => (None, None),
        false => (
            args.models_dir.or_else(rmlx_hub::default_models_dir),
            args.hf_cache,
        ),
    };
    let disk_on = args.prefix_disk_gb != Some(0.0) && !distributed;
    let config = ServerConfig {
        host: args.host,
        port: args.port,
        models: args.models,
        models_dir,
        hub_url: args.hub_url,
        hf_cache,
        max_ctx: args.max_ctx,
        heartbeat: std::time::Duration::try_from_secs_f64(args.heartbeat).map_err(|_| {
            anyhow::anyhow!("--heartbeat: {} is not a number of seconds", args.heartbeat)
        })?,
        keep_billing_header: args.keep_billing_header,
        max_loaded: args.max_loaded,
        api_key: args.api_key,
        cors_origins: args.cors_origins,
        max_queue: args.max_queue,
        max_batch: args.max_batch,
        max_body_mb: args.max_body_mb,
        prefix_cache_bytes: args.prefix_cache_mb.map(|mb| mb << 20),
        prefix_snapshot_bytes: args.prefix_snapshot_mb.map(|mb| mb << 20),
        kv_bits: args.kv_bits,
        prefix_disk_dir: disk_on
            .then(|| {
                args.prefix_disk_dir
                    .or_else(rmlx_engine::disk_cache::default_root)
            })
            .flatten(),
        prefix_disk_bytes: args.prefix_disk_gb.map(|gb| (gb * 1e9) as u64),
        speculative: args.speculative,
        draft_model: args.draft_model,
        ui_dir: args.ui_dir,
        embedded_ui: !args.no_ui,
        warm_up: args.warm_up == "on",
        part,
    };
    // RMLX_STEP_PROFILE=1: where the decode steps' time went, printed when the server stops
    // (what `rmlx bench --step-profile` shows, for the requests a client sent).
    let profile = std::env::var("RMLX_STEP_PROFILE").as_deref() == Ok("1");
    if profile {
        rmlx_engine::profile::enable();
    }
    let served = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(rmlx_server::serve(config));
    if profile {
        let lines = crate::bench::step_lines(&rmlx_engine::profile::take());
        lines.iter().for_each(|line| eprintln!("{line}"));
    }
    served
}
