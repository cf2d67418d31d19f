//! `rmlx cluster check`: joins the group a hostfile describes, checks that every rank runs the
//! same rMLX, MLX and model, and times the links. Run it on every machine (or once per rank on
//! one machine) before serving across them; docs/DISTRIBUTED.md has the hostfile.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::Context;
use mlx_rs::Array;
use rmlx_engine::distributed::{
    fingerprint::model_fingerprint,
    health,
    pipeline::{Bells, Stage},
    split, Group, Hostfile,
};

#[derive(clap::Args)]
pub struct ClusterArgs {
    #[command(subcommand)]
    command: ClusterCommand,
}

#[derive(clap::Subcommand)]
enum ClusterCommand {
    /// Join the group, agree on versions and the model, and time the links.
    Check(CheckArgs),
}

#[derive(clap::Args)]
struct CheckArgs {
    /// The cluster's hostfile (backend, hosts, port; docs/DISTRIBUTED.md).
    hostfile: PathBuf,
    /// This process's rank in the hostfile [default: $MLX_RANK].
    #[arg(long)]
    rank: Option<usize>,
    /// A model folder every rank must hold the same (config, tokenizer, weight headers).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Seconds to wait for the other ranks to join; past it the process exits with status 3.
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    join_timeout: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// This process's rank: `--rank`, else `$MLX_RANK` (what `mlx.launch` sets).
pub fn rank(given: Option<usize>) -> anyhow::Result<usize> {
    match given {
        Some(rank) => Ok(rank),
        None => std::env::var("MLX_RANK")
            .context("give --rank N (or set MLX_RANK)")?
            .parse()
            .context("MLX_RANK is not a rank number"),
    }
}

/// `rmlx generate` / `rmlx serve` across machines.
#[derive(clap::Args)]
pub struct DistributedArgs {
    /// Run the model across the machines of this hostfile, one process per rank
    /// (docs/DISTRIBUTED.md): rank 0 answers (serves HTTP), the others compute their layers.
    /// Across ranks speculative decoding drafts by prompt lookup only, and the disk prefix
    /// cache is off.
    #[arg(long, value_name = "HOSTFILE")]
    pub distributed: Option<PathBuf>,
    /// This process's rank in the hostfile [default: $MLX_RANK, as `mlx.launch` sets it].
    #[arg(long, requires = "distributed")]
    pub rank: Option<usize>,
    /// With --distributed: seconds to wait for the other ranks to join (then exit status 3).
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    pub join_timeout: u64,
}

impl DistributedArgs {
    /// This process's part of `model`: the whole of it, or (with --distributed) its stage,
    /// after joining the group.
    pub fn part(&self, model: &Path) -> anyhow::Result<rmlx_engine::models::Part> {
        let stage = match &self.distributed {
            Some(hostfile) => Some(join_pipeline(
                hostfile,
                self.rank,
                model,
                Duration::from_secs(self.join_timeout),
            )?),
            None => None,
        };
        Ok(rmlx_engine::models::Part { stage })
    }
}

/// Joins the group `hostfile` describes to run `model` across it: every rank agrees on the
/// rMLX and MLX versions and the model, and holds the layers of the plan (the hostfile's
/// `split`, or one balanced by weight bytes).
pub fn join_pipeline(
    hostfile: &Path,
    rank: Option<usize>,
    model: &Path,
    join_timeout: Duration,
) -> anyhow::Result<Arc<Stage>> {
    let hostfile = Hostfile::read(hostfile)?;
    let rank = self::rank(rank)?;
    // Read before joining: a rank that cannot read its model fails alone.
    let fingerprint = model_fingerprint(model)
        .with_context(|| format!("cannot read the model folder {}", model.display()))?;
    let (ranges, _) = split::plan_model(model, hostfile.size(), hostfile.split.as_deref())?;
    let group = Group::join(&hostfile, rank, join_timeout)?;
    group.agree("the rMLX version", env!("CARGO_PKG_VERSION"))?;
    group.agree(
        "the MLX version",
        &rmlx_engine::runtime::runtime_info()?.mlx_version,
    )?;
    group.agree(
        "the model (config, tokenizer, weight headers)",
        &fingerprint,
    )?;
    // MLX's ring blocks for ever on a stopped peer: a heartbeat of our own notices it.
    health::start(
        &hostfile,
        rank,
        &ranges,
        health::DEFAULT_GRACE,
        join_timeout,
    )
    .context("cannot start the ranks' heartbeat")?;
    let bells = Bells::connect(&hostfile, rank, join_timeout)
        .context("cannot connect the ranks' doorbells")?;
    Ok(Arc::new(
        Stage::new(Arc::new(group), ranges).with_bells(bells),
    ))
}

pub fn cluster(args: ClusterArgs) -> anyhow::Result<()> {
    match args.command {
        ClusterCommand::Check(args) => check(args),
    }
}

fn check(args: CheckArgs) -> anyhow::Result<()> {
    let hostfile = Hostfile::read(&args.hostfile)?;
    let rank = rank(args.rank)?;
    // Computed before joining: a rank that cannot read its model fails alone, not mid-check.
    let model = match &args.model {
        Some(dir) => Some(
            model_fingerprint(dir)
                .with_context(|| format!("cannot read the model folder {}", dir.display()))?,
        ),
        None => None,
    };
    // Which layers this rank would hold in a pipeline (the hostfile's split, checked, or one
    // balanced by bytes): a split that cuts layers which must stay together fails here.
    let layers = match &args.model {
        Some(dir) => {
            let (ranges, bytes) =
                split::plan_model(dir, hostfile.size(), hostfile.split.as_deref())?;
            let range = ranges[rank].clone();
            Some((range.clone(), bytes.of_rank(rank, range)))
        }
        None => None,
    };
    let joined_at = std::time::Instant::now();
    let group = Group::join(&hostfile, rank, Duration::from_secs(args.join_timeout))?;
    let join_s = joined_at.elapsed().as_secs_f64();
    let mlx = rmlx_engine::runtime::runtime_info()?.mlx_version;
    group.agree("the rMLX version", env!("CARGO_PKG_VERSION"))?;
    group.agree("the MLX version", &mlx)?;
    if let Some(model) = &model {
        group.agree("the model (config, tokenizer, weight headers)", model)?;
    }
    let size = group.size();
    // Every collective checked against what it must give.
    let mine = Array::from_slice(&[rank as f32 + 1.0, 10.0 * (rank as f32 + 1.0)], &[2]);
    let sum = group.all_sum(&mine)?.as_slice::<f32>().to_vec();
    let total = (size * (size + 1) / 2) as f32;
    anyhow::ensure!(
        sum == [total, 10.0 * total],
        "all_sum gave {sum:?}, not {:?}",
        [total, 10.0 * total]
    );
    let ranks = group
        .all_gather(&Array::from_slice(&[rank as i32], &[1]))?
        .as_slice::<i32>()
        .to_vec();
    anyhow::ensure!(
        ranks == (0..size as i32).collect::<Vec<_>>(),
        "all_gather gave {ranks:?}"
    );
    // Around the ring: each rank sends to the next and receives from the one before.
    let (next, before) = ((rank + 1) % size, (rank + size - 1) % size);
    group.send(&Array::from_slice(&[100 * rank as i32], &[1]), next)?;
    let got = group.recv(&[1], mlx_rs::Dtype::Int32, before)?;
    group.send(&Array::from_slice(&[0.5 + rank as f32, 2.0], &[1, 2]), next)?;
    let like = group.recv_like(&Array::from_slice(&[0f32; 2], &[1, 2]), before)?;
    anyhow::ensure!(
        got.as_slice::<i32>() == [100 * before as i32]
            && like.as_slice::<f32>() == [0.5 + before as f32, 2.0],
        "rank {before} sent {:?} and {:?}",
        got.as_slice::<i32>(),
        like.as_slice::<f32>()
    );
    // The latency of a small all_sum (what each decode step of a pipeline pays once).
    let probe = Array::from_slice(&vec![1i32; size.max(2)], &[size.max(2) as i32]);
    let mut times: Vec<f64> = (0..20)
        .map(|_| {
            let started = std::time::Instant::now();
            group
                .all_sum(&probe)
                .map(|_| started.elapsed().as_secs_f64() * 1e3)
        })
        .collect::<Result<_, _>>()?;
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let report = serde_json::json!({
        "rank": rank,
        "size": size,
        "backend": hostfile.backend.mlx_name(),
        "endpoint": hostfile.endpoint(rank),
        "join_s": join_s,
        "rmlx_version": env!("CARGO_PKG_VERSION"),
        "mlx_version": mlx,
        "model_fingerprint": model,
        "layers": layers.as_ref().map(|(range, _)| [range.start, range.end]),
        "weight_bytes": layers.as_ref().map(|(_, bytes)| bytes),
        "all_sum": sum,
        "all_gather": ranks,
        "received_from": before,
        "small_all_sum_ms": median,
    });
    if args.json {
        println!("{report}");
    } else {
        println!(
            "rank {rank} of {size} ({}, {}): joined in {join_s:.2} s; rMLX {}, MLX {mlx}{} agreed; \
             all_sum, all_gather, send/recv checked; a small all_sum takes {median:.2} ms",
            hostfile.backend.mlx_name(),
            hostfile.endpoint(rank),
            env!("CARGO_PKG_VERSION"),
            if model.is_some() { " and the model" } else { "" },
        );
        if let Some((range, bytes)) = &layers {
            println!(
                "rank {rank} would hold layers {}-{} ({:.2} GB of weights{})",
                range.start,
                range.end - 1,
                *bytes as f64 / 1e9,
                if rank == 0 {
                    ", with the embeddings, the output layer and any vision tower"
                } else {
                    ""
                }
            );
        }
    }
    Ok(())
}
