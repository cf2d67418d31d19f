//! `rmlx launch claude|codex|qwen`: runs a coding agent against rMLX in one command. Uses the
//! server already listening (the app's Local API server or `rmlx serve`) or starts one, picks the
//! model, and runs the agent with its set-up for this server: base URL, key, model names,
//! context window, telemetry and update checks off where the agent has a switch. The set-up per
//! agent is what docs/SERVER.md ("Coding agents") and tests/agents use.
//! Reference: Ollama's `ollama launch` (one command from install to a working agent).

use std::{
    io::{Read, Write},
    net::TcpStream,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

#[derive(clap::Args)]
pub struct LaunchArgs {
    /// The agent: `claude` (Claude Code), `codex` (Codex CLI) or `qwen` (Qwen Code).
    agent: Agent,
    /// The model: a served id, or a model folder (served under its folder name; a server
    /// started here loads it) [default: the server's first model].
    #[arg(long)]
    model: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The server's port (the app's Local API server and `rmlx serve` default to 8080).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// The server's API key, when it has one [default: $RMLX_API_KEY].
    #[arg(long)]
    api_key: Option<String>,
    /// Arguments for the agent itself (after `--`).
    #[arg(last = true)]
    args: Vec<String>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Agent {
    Claude,
    Codex,
    Qwen,
}

impl Agent {
    fn command(self) -> &'static str {
        match self {
            Agent::Claude => "claude",
            Agent::Codex => "codex",
            Agent::Qwen => "qwen",
        }
    }

    fn install_hint(self) -> &'static str {
        match self {
            Agent::Claude => "Claude Code: npm install -g @anthropic-ai/claude-code",
            Agent::Codex => {
                "Codex CLI: npm install -g @openai/codex (or brew install --cask codex)"
            }
            Agent::Qwen => "Qwen Code: npm install -g @qwen-code/qwen-code",
        }
    }
}

/// What the agent is pointed at.
struct Target {
    base: String,
    key: String,
    model: String,
    context: Option<u64>,
}

/// The environment and leading arguments that set `agent` up for `target`.
fn setup(agent: Agent, target: &Target) -> (Vec<(String, String)>, Vec<String>) {
    let base = &target.base;
    let model = &target.model;
    let pairs = |list: &[(&str, &str)]| {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<Vec<_>>()
    };
    match agent {
        Agent::Claude => {
            let env = pairs(&[
                ("ANTHROPIC_BASE_URL", base),
                ("ANTHROPIC_API_KEY", &target.key),
                ("ANTHROPIC_MODEL", model),
                ("ANTHROPIC_SMALL_FAST_MODEL", model),
                ("ANTHROPIC_DEFAULT_OPUS_MODEL", model),
                ("ANTHROPIC_DEFAULT_SONNET_MODEL", model),
                ("ANTHROPIC_DEFAULT_HAIKU_MODEL", model),
                ("CLAUDE_CODE_SUBAGENT_MODEL", model),
                ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
                ("DISABLE_AUTOUPDATER", "1"),
                ("DISABLE_TELEMETRY", "1"),
                ("DISABLE_ERROR_REPORTING", "1"),
            ]);
            (env, Vec::new())
        }
        Agent::Codex => {
            // `-c` overrides leave the user's config.toml as it is.
            let mut args = vec![
                format!("model={}", toml_string(model)),
                "model_provider=\"rmlx\"".into(),
                "model_providers.rmlx.name=\"rMLX\"".into(),
                format!(
                    "model_providers.rmlx.base_url={}",
                    toml_string(&format!("{base}/v1"))
                ),
                "model_providers.rmlx.wire_api=\"responses\"".into(),
                "model_providers.rmlx.env_key=\"RMLX_API_KEY\"".into(),
                "analytics.enabled=false".into(),
                "feedback.enabled=false".into(),
            ];
            // Codex does not read a custom provider's model list: the window is said here.
            if let Some(context) = target.context {
                args.push(format!("model_context_window={context}"));
            }
            let args = args.into_iter().flat_map(|a| ["-c".into(), a]).collect();
            (pairs(&[("RMLX_API_KEY", &target.key)]), args)
        }
        Agent::Qwen => (
            pairs(&[
                ("OPENAI_BASE_URL", &format!("{base}/v1")),
                ("OPENAI_API_KEY", &target.key),
                ("OPENAI_MODEL", model),
            ]),
            vec![
                "--auth-type".into(),
                "openai".into(),
                "--model".into(),
                model.clone(),
            ],
        ),
    }
}

fn toml_string(text: &str) -> String {
    serde_json::to_string(text).expect("a string serializes")
}

/// A GET to the server: (status, JSON body). Plain HTTP/1.1 on loopback, no client library.
fn get(host: &str, port: u16, path: &str, key: Option<&str>) -> std::io::Result<(u16, Value)> {
    let mut stream = TcpStream::connect((host, port))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let auth = key
        .map(|key| format!("Authorization: Bearer {key}\r\n"))
        .unwrap_or_default();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}Connection: close\r\n\r\n"
    )?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply)?;
    let reply = String::from_utf8_lossy(&reply);
    let status = reply
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    Ok((status, serde_json::from_str(body).unwrap_or(Value::Null)))
}

/// The served models, or None when nothing listens there.
fn models(host: &str, port: u16, key: Option<&str>) -> Result<Option<Vec<Value>>> {
    let (status, body) = match get(host, port, "/v1/models", key) {
        Ok(reply) => reply,
        Err(error) if error.kind() == std::io::ErrorKind::ConnectionRefused => return Ok(None),
        Err(error) => return Err(error).context(format!("asking {host}:{port} for its models")),
    };
    match status {
        200 => Ok(Some(body["data"].as_array().cloned().unwrap_or_default())),
        401 => bail!(
            "the server on {host}:{port} wants an API key: pass --api-key or set RMLX_API_KEY"
        ),
        _ => bail!("{host}:{port} answered {status} to GET /v1/models: is it rMLX?"),
    }
}

/// `PATH`'s executable `name`, if any.
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// Starts `rmlx serve` on the port (loading `model` when it is a folder) and waits for it.
fn start_server(args: &LaunchArgs, key: Option<&str>) -> Result<Child> {
    let exe = std::env::current_exe().context("finding the rmlx executable")?;
    let mut command = Command::new(exe);
    command
        .args([
            "serve",
            "--host",
            &args.host,
            "--port",
            &args.port.to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    if let Some(key) = key {
        command.args(["--api-key", key]);
    }
    if let Some(model) = args.model.as_deref().filter(|m| PathBuf::from(m).is_dir()) {
        command.args(["--model", model]);
    }
    let mut child = command.spawn().context("starting rmlx serve")?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(Some(_)) = models(&args.host, args.port, key) {
            return Ok(child);
        }
        if let Some(status) = child.try_wait()? {
            bail!(
                "rmlx serve stopped ({status}) before it listened on port {}",
                args.port
            );
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!(
                "rmlx serve did not answer on port {} within 120 s",
                args.port
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn launch(args: LaunchArgs) -> Result<()> {
    let agent = args.agent;
    let Some(binary) = on_path(agent.command()) else {
        bail!(
            "`{}` is not installed (not on PATH). Install {}",
            agent.command(),
            agent.install_hint()
        );
    };
    let key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("RMLX_API_KEY").ok());
    let mut server = None;
    let served = match models(&args.host, args.port, key.as_deref())? {
        Some(models) => {
            eprintln!(
                "rmlx launch: using the server on {}:{}",
                args.host, args.port
            );
            models
        }
        None => {
            eprintln!(
                "rmlx launch: starting rmlx serve on {}:{}",
                args.host, args.port
            );
            server = Some(start_server(&args, key.as_deref())?);
            models(&args.host, args.port, key.as_deref())?.unwrap_or_default()
        }
    };
    let result = run_agent(&args, &binary, key, &served);
    if let Some(mut server) = server {
        let _ = server.kill();
        let _ = server.wait();
    }
    let status = result?;
    match status.code() {
        Some(0) => Ok(()),
        Some(code) => std::process::exit(code),
        None => Err(anyhow!("{} was stopped by a signal", agent.command())),
    }
}

fn run_agent(
    args: &LaunchArgs,
    binary: &PathBuf,
    key: Option<String>,
    served: &[Value],
) -> Result<std::process::ExitStatus> {
    let wanted = args.model.as_deref().map(|model| {
        // A folder is served under its folder name.
        let path = PathBuf::from(model);
        match path.is_dir() {
            true => path.file_name().map_or(model.to_string(), |name| {
                name.to_string_lossy().into_owned()
            }),
            false => model.to_string(),
        }
    });
    let entry = match &wanted {
        Some(id) => served
            .iter()
            .find(|m| m["id"].as_str() == Some(id))
            .ok_or_else(|| {
                let ids: Vec<&str> = served.iter().filter_map(|m| m["id"].as_str()).collect();
                anyhow!(
                    "the server has no model `{id}` (it has: {})",
                    ids.join(", ")
                )
            })?,
        None => served.first().ok_or_else(|| {
            anyhow!("the server has no models: pass --model with a model folder or id")
        })?,
    };
    let target = Target {
        base: format!("http://{}:{}", args.host, args.port),
        // Agents want some key even when the server has none.
        key: key.unwrap_or_else(|| "rmlx".into()),
        model: entry["id"].as_str().unwrap_or_default().to_string(),
        context: entry["context_length"].as_u64(),
    };
    let (env, leading) = setup(args.agent, &target);
    eprintln!("rmlx launch: {} with", args.agent.command());
    for (name, value) in &env {
        let shown = if name.ends_with("API_KEY") && value != "rmlx" {
            "(your key)"
        } else {
            value
        };
        eprintln!("  {name}={shown}");
    }
    if !leading.is_empty() {
        eprintln!("  arguments: {}", leading.join(" "));
    }
    Command::new(binary)
        .args(&leading)
        .args(&args.args)
        .envs(env)
        .status()
        .with_context(|| format!("running {}", binary.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target {
            base: "http://127.0.0.1:8080".into(),
            key: "k".into(),
            model: "qwen3-4b".into(),
            context: Some(40960),
        }
    }

    #[test]
    fn each_agent_is_pointed_at_the_server() {
        let (env, args) = setup(Agent::Claude, &target());
        assert!(env.contains(&("ANTHROPIC_BASE_URL".into(), "http://127.0.0.1:8080".into())));
        assert!(env.contains(&("ANTHROPIC_MODEL".into(), "qwen3-4b".into())));
        assert!(args.is_empty());
        let (env, args) = setup(Agent::Codex, &target());
        assert_eq!(env, [("RMLX_API_KEY".to_string(), "k".to_string())]);
        assert!(args.contains(&"model_providers.rmlx.base_url=\"http://127.0.0.1:8080/v1\"".into()));
        assert!(args.contains(&"model_context_window=40960".into()));
        assert_eq!(args.iter().filter(|a| *a == "-c").count(), args.len() / 2);
        let (env, args) = setup(Agent::Qwen, &target());
        assert!(env.contains(&("OPENAI_BASE_URL".into(), "http://127.0.0.1:8080/v1".into())));
        assert_eq!(args, ["--auth-type", "openai", "--model", "qwen3-4b"]);
    }
}
