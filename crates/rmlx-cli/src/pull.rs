//! `rmlx pull org/name`: downloads a model repository from the Hugging Face hub into the models
//! folder (`{models_dir}/{org}/{name}`, served by `rmlx serve --models-dir` as `org/name`). The
//! downloader is `rmlx-hub`; this file turns flags into its config and draws the progress.
//! `rmlx pull --mtp REPO --model DIR` takes only a release's draft head (`mtp.*`) by byte
//! ranges and writes it beside the conversion in DIR (`rmlx_engine::models::qwen3_5::mtp`).
//! Reference: huggingface_hub `commands/download.py` (`huggingface-cli download`: `HF_ENDPOINT`,
//! `HF_TOKEN`, rerun to resume).

use std::{
    collections::HashSet,
    io::{IsTerminal, Write},
    path::PathBuf,
    time::Instant,
};

use anyhow::Context;
use rmlx_hub::{download, Control, FileState, HubClient, HubConfig, Job, JobState, RepoId};

#[derive(clap::Args)]
pub struct PullArgs {
    /// Hugging Face repository, `org/name` (e.g. mlx-community/Qwen3-0.6B-4bit).
    repo: String,
    /// Branch, tag or commit.
    #[arg(long, default_value = "main")]
    revision: String,
    /// Models folder; the model lands in DIR/org/name [default: $RMLX_MODELS_DIR or ~/.rmlx/models]
    #[arg(long, value_name = "DIR")]
    models_dir: Option<PathBuf>,
    /// Hub base URL [default: $HF_ENDPOINT or https://huggingface.co]. $HF_TOKEN is sent as a
    /// bearer token when set.
    #[arg(long, value_name = "URL")]
    hub_url: Option<String>,
    /// Fetch only the multi-token-prediction head (`mtp.*`) of REPO (a Qwen3.5 / 3.6 release),
    /// by byte ranges, and write it beside the conversion in --model, quantized as that
    /// conversion quantized its layers (`--speculative mtp` or `auto` then drafts with it).
    #[arg(long, requires = "model")]
    mtp: bool,
    /// With --mtp: the local conversion (a folder) that lacks the head.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
}

pub fn pull(args: PullArgs) -> anyhow::Result<()> {
    let repo = RepoId::parse(&args.repo)?;
    if args.mtp {
        let model = args
            .model
            .clone()
            .expect("clap requires --model with --mtp");
        return pull_head(&args, &repo, &model);
    }
    let models_dir = match args.models_dir {
        Some(dir) => dir,
        None => rmlx_hub::default_models_dir()
            .context("no HOME to put ~/.rmlx/models in; pass --models-dir")?,
    };
    let mut config = HubConfig::from_env();
    if let Some(url) = args.hub_url {
        config.endpoint = url;
    }
    let client = HubClient::new(config)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let mut job = Job::new("pull", &repo, &args.revision);
    let mut progress = Progress::new(std::io::stderr().is_terminal());
    // Ctrl-C simply ends the process: `.partial` files only ever grow by bytes written, and the
    // next run re-hashes them before resuming, so nothing needs saving on the way out.
    let result = runtime.block_on(download(
        &client,
        &models_dir,
        &mut job,
        &Control::new(),
        |job: &Job| progress.update(job),
    ));
    let model_dir = result.with_context(|| format!("cannot pull {repo}"))?;
    // Absolute (not canonical: symlinks such as macOS's /tmp stay as the user wrote them).
    let model_dir = std::path::absolute(&model_dir).unwrap_or(model_dir);
    let models_dir = std::path::absolute(&models_dir).unwrap_or(models_dir);
    println!("pulled {repo} into {}", model_dir.display());
    println!(
        "model id: {repo} (serve it with: rmlx serve --models-dir {})",
        models_dir.display()
    );
    Ok(())
}

/// The progress line on a terminal (bar, bytes, rate, current file); one line per finished file
/// otherwise, so logs stay readable.
struct Progress {
    tty: bool,
    started: Option<(Instant, u64)>,
    reported: HashSet<String>,
    drawn: bool,
}

impl Progress {
    fn new(tty: bool) -> Self {
        Self {
            tty,
            started: None,
            reported: HashSet::new(),
            drawn: false,
        }
    }

    fn update(&mut self, job: &Job) {
        let mut stderr = std::io::stderr().lock();
        match job.state {
            JobState::Running | JobState::Verifying => {}
            _ => {
                if self.drawn {
                    let _ = write!(stderr, "\r\x1b[2K");
                    self.drawn = false;
                }
                return;
            }
        }
        if self.started.is_none() {
            // Files already complete (an earlier run) do not count toward the rate.
            self.started = Some((Instant::now(), job.bytes_done));
            let present = job.files.iter().filter(|f| f.state == FileState::Done);
            self.reported.extend(present.map(|file| file.name.clone()));
            let resumed = if job.bytes_done > 0 {
                format!(", {} already here", human_bytes(job.bytes_done))
            } else {
                String::new()
            };
            let _ = writeln!(
                stderr,
                "pulling {} ({} files, {}{resumed})",
                job.repo,
                job.files.len(),
                human_bytes(job.bytes_total)
            );
        }
        let (since, base) = self.started.expect("set above");
        let elapsed = since.elapsed().as_secs_f64();
        let rate = if elapsed > 0.2 {
            (job.bytes_done.saturating_sub(base)) as f64 / elapsed
        } else {
            0.0
        };
        if self.tty {
            let fraction = if job.bytes_total > 0 {
                job.bytes_done as f64 / job.bytes_total as f64
            } else {
                1.0
            };
            let filled = (fraction * 24.0).round() as usize;
            let current = match (job.state, job.current_file()) {
                (JobState::Verifying, Some(file)) => format!("verifying {}", file.name),
                (_, Some(file)) => file.name.clone(),
                _ => String::new(),
            };
            let _ = write!(
                stderr,
                "\r\x1b[2K[{}{}] {:>3.0}% {} / {}  {}/s  {current}",
                "#".repeat(filled),
                "-".repeat(24 - filled.min(24)),
                fraction * 100.0,
                human_bytes(job.bytes_done),
                human_bytes(job.bytes_total),
                human_bytes(rate as u64),
            );
            let _ = stderr.flush();
            self.drawn = true;
        } else {
            for file in &job.files {
                if file.state == FileState::Done && self.reported.insert(file.name.clone()) {
                    let _ = writeln!(
                        stderr,
                        "  {} ({}), {} / {} at {}/s",
                        file.name,
                        human_bytes(file.size),
                        human_bytes(job.bytes_done),
                        human_bytes(job.bytes_total),
                        human_bytes(rate as u64)
                    );
                }
            }
        }
    }
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KB", "MB", "GB", "TB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit < UNITS.len() - 1 {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// `--mtp`: the release's `mtp.*` tensors by byte ranges (headers, then each tensor), written
/// as a split drafter in `model/mtp` (see `rmlx_engine::models::qwen3_5::mtp`).
fn pull_head(args: &PullArgs, repo: &RepoId, model: &std::path::Path) -> anyhow::Result<()> {
    crate::check_model_dir(model)?;
    let mut config = HubConfig::from_env();
    if let Some(url) = &args.hub_url {
        config.endpoint = url.clone();
    }
    let client = HubClient::new(config)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    eprintln!("reading {repo}'s safetensors headers for mtp.* ...");
    let (tensors, read) = runtime
        .block_on(rmlx_hub::fetch_tensors(
            &client,
            repo,
            &args.revision,
            |name| name.starts_with("mtp."),
        ))
        .with_context(|| format!("cannot fetch the head of {repo}"))?;
    anyhow::ensure!(
        !tensors.is_empty(),
        "{repo} has no mtp.* tensors (a Qwen3.5 / 3.6 release ships them; conversions drop them)"
    );
    if let Some(other) = tensors
        .iter()
        .find(|tensor| !matches!(tensor.dtype.as_str(), "BF16" | "F16" | "F32"))
    {
        anyhow::bail!(
            "{repo} stores {} as {} (an FP8 or otherwise quantized release): take the head of \
             its BF16 release instead",
            other.name,
            other.dtype
        );
    }
    let staging = model.join(".mtp-release.safetensors");
    std::fs::write(&staging, safetensors_bytes(&tensors)?)
        .with_context(|| format!("cannot write {}", staging.display()))?;
    let written = rmlx_engine::models::qwen3_5::mtp::write_split_drafter(model, &staging);
    let _ = std::fs::remove_file(&staging);
    let written = written.context("cannot write the head beside the conversion")?;
    println!(
        "{} mtp.* tensors of {repo} ({} read) written to {} ({} tensors, {})",
        tensors.len(),
        human_bytes(read),
        written.folder.display(),
        written.tensors,
        human_bytes(written.bytes)
    );
    Ok(())
}

/// One safetensors file of `tensors` (header padded to 8 bytes, data in order).
fn safetensors_bytes(tensors: &[rmlx_hub::RemoteTensor]) -> anyhow::Result<Vec<u8>> {
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for tensor in tensors {
        let end = offset + tensor.data.len() as u64;
        header.insert(
            tensor.name.clone(),
            serde_json::json!({"dtype": tensor.dtype, "shape": tensor.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut text = serde_json::to_vec(&header)?;
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + text.len() + offset as usize);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    for tensor in tensors {
        out.extend_from_slice(&tensor.data);
    }
    Ok(out)
}
