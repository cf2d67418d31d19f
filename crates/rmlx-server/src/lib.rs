//! rMLX's local HTTP server: OpenAI- and Anthropic-compatible routes onto the one engine.
//! `app(state)` builds the whole router so tests drive it in-process (axum
//! `examples/testing`); `serve` binds it to a socket with graceful shutdown.

// Engine structs are always built with `..Default::default()`: they gain fields over time.
#![allow(clippy::needless_update)]

pub mod anthropic;
pub mod api;
pub mod constraints;
pub mod convert;
pub mod downloads;
pub mod error;
pub mod forced;
pub mod fuzzing;
pub mod generation;
pub mod guard;
pub mod lark_regex;
pub mod logprobs;
pub mod metrics;
pub mod models;
pub mod openai;
pub mod openapi;
pub mod parse;
pub mod registry;
pub mod responses;
mod sse;
mod turn_prefix;
pub mod ui;
pub mod xml_calls;

use std::{path::PathBuf, sync::Arc};

use anyhow::Context;
use axum::{
    extract::DefaultBodyLimit,
    middleware,
    routing::{get, post},
    Extension, Router,
};
use rmlx_engine::engine::{Engine, EngineOptions};

use crate::{error::BodyLimitMb, registry::Registry};

/// Keep-alive pace while a prompt waits or prefills: well inside agents' idle timeouts.
pub const DEFAULT_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(3);

/// Everything `rmlx serve` takes on its command line.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// `--model` folders; each is served under its folder name.
    pub models: Vec<PathBuf>,
    /// Scanned for models; the admin download routes write into it (no folder, no downloads).
    pub models_dir: Option<PathBuf>,
    /// Hub base URL for downloads; None = `$HF_ENDPOINT` or https://huggingface.co.
    pub hub_url: Option<String>,
    /// The Hugging Face hub cache; None = `$HF_HUB_CACHE`, `$HF_HOME/hub` or
    /// `~/.cache/huggingface/hub`.
    pub hf_cache: Option<PathBuf>,
    pub max_ctx: Option<usize>,
    /// How long a stream waits for its first token before it sends a keep-alive event (and
    /// again each time): Anthropic `ping`, Responses `response.in_progress`, an SSE comment for
    /// chat and text completions. Zero sends none.
    pub heartbeat: std::time::Duration,
    /// Keep Claude Code's `x-anthropic-billing-header:` system block in the prompt (left out by
    /// default: it means nothing to the model and its `cch=` changes every request, which would
    /// end every prefix-cache hit at the system prompt).
    pub keep_billing_header: bool,
    pub max_loaded: usize,
    pub api_key: Option<String>,
    pub cors_origins: Vec<String>,
    pub max_queue: usize,
    /// Requests decoding together at most (continuous batching).
    pub max_batch: usize,
    pub max_body_mb: usize,
    /// Bytes the prefix cache keeps of finished requests' KV (None: sized for agent sessions
    /// from the machine's memory and the loaded model, `prefix_cache::auto_budgets`).
    pub prefix_cache_bytes: Option<u64>,
    /// Bytes of recurrent-model snapshots (Qwen3.5 / 3.6) the prefix cache keeps (None: sized
    /// the same way).
    pub prefix_snapshot_bytes: Option<u64>,
    /// Bits of the quantized KV cache of full-attention layers (8 or 4; None: dense).
    pub kv_bits: Option<i32>,
    /// Where finished prefixes are kept on disk, to answer after a restart (None: no disk
    /// cache; `rmlx serve` and the app use `~/.rmlx/cache` unless told otherwise).
    pub prefix_disk_dir: Option<PathBuf>,
    /// Bytes the disk cache may hold (None: min(16 GB, 10 % of the free disk)).
    pub prefix_disk_bytes: Option<u64>,
    /// Speculative decoding (off, lookup, mtp or auto) for every request.
    pub speculative: rmlx_engine::speculative::SpeculativeMode,
    /// A draft model paired with every model served (`EngineOptions::draft_model`).
    pub draft_model: Option<PathBuf>,
    /// A built web UI to serve at `/` (no API key needed for its files; its API calls still
    /// send one).
    pub ui_dir: Option<PathBuf>,
    /// Without `ui_dir`: serve the UI built into the binary at `/` (`rmlx serve` does unless
    /// `--no-ui`; the app shows it in its own window instead).
    pub embedded_ui: bool,
    /// Warm a model up after loading it (`Engine::warm_up`): `serve` loads and warms the first
    /// `--model` at start, `POST /v1/models/{id}/load` the model it loads.
    pub warm_up: bool,
    /// Rank 0 of a pipeline across machines (`rmlx serve --distributed`): the model loads with
    /// only this rank's layers and every forward runs through the other ranks.
    pub part: rmlx_engine::models::Part,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            models: Vec::new(),
            models_dir: None,
            hub_url: None,
            hf_cache: None,
            max_ctx: None,
            heartbeat: DEFAULT_HEARTBEAT,
            keep_billing_header: false,
            max_loaded: 1,
            api_key: None,
            cors_origins: Vec::new(),
            max_queue: 64,
            max_batch: EngineOptions::default().max_batch,
            prefix_cache_bytes: EngineOptions::default().prefix_cache_bytes,
            prefix_snapshot_bytes: EngineOptions::default().prefix_snapshot_bytes,
            kv_bits: None,
            prefix_disk_dir: None,
            prefix_disk_bytes: None,
            speculative: EngineOptions::default().speculative,
            draft_model: None,
            ui_dir: None,
            embedded_ui: false,
            warm_up: true,
            part: Default::default(),
            // A 2560x2560 RGBA PNG is at most ~26 MB, ~35 MB as base64 in a data URI.
            max_body_mb: 64,
        }
    }
}

/// Shared by every handler; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub engine: Engine,
    pub registry: Arc<Registry>,
    pub config: Arc<ServerConfig>,
    pub server_errors: Arc<metrics::ServerErrors>,
    /// The download jobs, or why there are none (no models folder, a bad hub URL).
    pub downloads: Result<rmlx_hub::DownloadManager, String>,
    /// Responses kept for `previous_response_id` (`POST /v1/responses`).
    pub responses: Arc<responses::store::Store>,
}

impl AppState {
    /// Starts the engine thread and indexes the model folders.
    pub fn new(config: ServerConfig) -> anyhow::Result<Self> {
        let engine = Engine::start_with(EngineOptions {
            max_queue: config.max_queue,
            max_batch: config.max_batch,
            max_loaded: config.max_loaded,
            prefix_cache_bytes: config.prefix_cache_bytes,
            prefix_snapshot_bytes: config.prefix_snapshot_bytes,
            kv_bits: config.kv_bits,
            prefix_disk_dir: config.prefix_disk_dir.clone(),
            prefix_disk_bytes: config.prefix_disk_bytes,
            speculative: config.speculative,
            draft_model: config.draft_model.clone(),
            part: config.part.clone(),
            ..EngineOptions::default()
        })
        .context("cannot start the engine")?;
        Self::with_engine(config, engine, None)
    }

    /// The same engine (and its loaded models and metrics) under a new config: the app calls
    /// this when its settings change. The download jobs carry over when `keep_downloads` (the
    /// models folder and hub are unchanged), else a new manager serves the new folder.
    pub fn reconfigured(&self, config: ServerConfig, keep_downloads: bool) -> anyhow::Result<Self> {
        let downloads = match (&self.downloads, keep_downloads) {
            (Ok(manager), true) => Some(manager.clone()),
            _ => None,
        };
        let mut state = Self::with_engine(config, self.engine.clone(), downloads)?;
        state.server_errors = self.server_errors.clone();
        state.responses = self.responses.clone();
        Ok(state)
    }

    fn with_engine(
        config: ServerConfig,
        engine: Engine,
        downloads: Option<rmlx_hub::DownloadManager>,
    ) -> anyhow::Result<Self> {
        for model in &config.models {
            anyhow::ensure!(
                model.join("config.json").is_file(),
                "{} is not a model folder (no config.json)",
                model.display()
            );
        }
        let registry = Registry::new(
            &config.models,
            config.models_dir.clone(),
            config.hf_cache.clone(),
            config.max_ctx,
        );
        if let Some(id) = registry.unaddressable() {
            anyhow::bail!(
                "the --model folder name `{id}` cannot be a model id (ids are `name` or \
                 `org/name`, without backslashes); rename the folder"
            );
        }
        let downloads = downloads.map_or_else(|| downloads_for(&config), Ok);
        Ok(Self {
            engine,
            registry: Arc::new(registry),
            config: Arc::new(config),
            server_errors: Arc::default(),
            downloads,
            responses: Arc::default(),
        })
    }
}

/// Downloads land in the models folder, where the registry finds them as `org/name`.
fn downloads_for(config: &ServerConfig) -> Result<rmlx_hub::DownloadManager, String> {
    let models_dir = config.models_dir.clone().ok_or_else(|| {
        "downloads need a models folder: start the server with --models-dir".to_string()
    })?;
    let mut hub = rmlx_hub::HubConfig::from_env();
    if let Some(url) = &config.hub_url {
        hub.endpoint = url.clone();
    }
    let client = rmlx_hub::HubClient::new(hub).map_err(|error| error.to_string())?;
    Ok(rmlx_hub::DownloadManager::new(client, models_dir))
}

/// The whole API. Layers, outermost first: error shape per API (and the server's error
/// count), Host allow-list, CORS (only with `--cors-origin`), API key, body limit.
pub fn app(state: AppState) -> Router {
    let body_limit = state.config.max_body_mb;
    let routes = Router::new()
        .route("/health", get(models::health))
        .route("/v1/models", get(models::list))
        // Ids are `name` or `org/name` (`org%2Fname` works too): each path takes exactly its
        // methods, so any other is a 405 that lists them.
        .route(
            "/v1/models/{id}",
            get(models::retrieve).delete(models::delete),
        )
        .route(
            "/v1/models/{id}/{name}",
            get(models::retrieve).delete(models::delete),
        )
        .route("/v1/models/{id}/load", post(models::load))
        .route("/v1/models/{id}/{name}/load", post(models::load))
        .route("/v1/models/{id}/unload", post(models::unload))
        .route("/v1/models/{id}/{name}/unload", post(models::unload))
        .route(
            "/admin/downloads",
            get(downloads::list).post(downloads::start),
        )
        .route(
            "/admin/downloads/{id}",
            get(downloads::get).delete(downloads::cancel),
        )
        .route("/admin/downloads/{id}/{action}", post(downloads::act))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/responses", post(responses::create))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/metrics/cache", get(metrics::cache))
        .route(
            "/admin/cache/disk",
            axum::routing::delete(metrics::clear_disk),
        )
        .route("/metrics", get(metrics::prometheus))
        .route("/openapi.json", get(openapi::openapi_json));
    // Without a UI, unknown paths get the API's JSON 404 behind the key like every route.
    let embedded_ui = state.config.ui_dir.is_none() && state.config.embedded_ui && ui::embedded();
    let routes = match &state.config.ui_dir {
        Some(_) => routes,
        None if embedded_ui => routes,
        None => routes.fallback(models::not_found),
    };
    let routes = routes
        .layer(DefaultBodyLimit::max(
            body_limit.saturating_mul(1024 * 1024),
        ))
        .layer(Extension(BodyLimitMb(body_limit)))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            guard::require_key,
        ));
    // Added after the key layer, so the page and its assets load without the key.
    let routes = match &state.config.ui_dir {
        Some(dir) => routes.fallback_service(
            tower_http::services::ServeDir::new(dir).append_index_html_on_directories(true),
        ),
        None if embedded_ui => routes.fallback(ui::serve),
        None => routes,
    };
    let routes = match guard::cors(&state.config.cors_origins) {
        Some(cors) => routes.layer(cors),
        None => routes,
    };
    routes
        .layer(middleware::from_fn_with_state(
            state.clone(),
            guard::check_host,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            guard::shape_errors,
        ))
        .with_state(state)
}

/// Binds, serves until Ctrl-C or SIGTERM, then lets in-flight requests finish.
pub async fn serve(config: ServerConfig) -> anyhow::Result<()> {
    let (host, port) = (config.host.clone(), config.port);
    let listener = tokio::net::TcpListener::bind((host.as_str(), port))
        .await
        .map_err(|error| {
            if error.kind() == std::io::ErrorKind::AddrInUse {
                anyhow::anyhow!(
                    "port {port} on {host} is already in use (another rmlx serve?); pick another with --port"
                )
            } else {
                anyhow::anyhow!("cannot listen on {host}:{port}: {error}")
            }
        })?;
    let address = listener.local_addr()?;
    let config_has_ui = config.ui_dir.is_some() || (config.embedded_ui && ui::embedded());
    if config.ui_dir.is_none() && config.embedded_ui && !ui::embedded() {
        eprintln!("rmlx serve: this build has no UI inside (ui/dist was not built before it): the API only");
    }
    let state = AppState::new(config)?;
    let models: Vec<String> = state.registry.list().into_iter().map(|m| m.id).collect();
    // The first stdout line is the address: scripts using --port 0 read the port from it.
    println!("rmlx serve: listening on http://{address}");
    eprintln!(
        "rmlx serve: {} model(s): {}",
        models.len(),
        models.join(", ")
    );
    if let Err(why) = &state.downloads {
        eprintln!("rmlx serve: model downloads are off: {why}");
    }
    if config_has_ui {
        eprintln!("rmlx serve: the chat UI is at http://{address}/ (open it in a browser)");
    }
    use std::io::Write;
    std::io::stdout().flush()?;
    if let (true, Some(first)) = (state.config.warm_up, state.config.models.first()) {
        let (engine, model) = (state.engine.clone(), first.clone());
        // Beside the listener: /health answers meanwhile, requests queue behind it from the
        // first (held from here, before the task starts loading).
        let hold = engine.hold_for_warm_up();
        tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let warmed = engine.warm_up(&model);
            drop(hold);
            match warmed {
                // The model is resident now: its info is at hand, nothing loads again.
                Ok(done) => eprintln!(
                    "rmlx serve: {} loaded and warmed up in {:.1} s (load {:.1} s, warm-up {:.1} s: \
                     {} requests, batches up to {} rows{})",
                    model.display(),
                    started.elapsed().as_secs_f64(),
                    engine.model_info(&model).map_or(0.0, |info| info.load_seconds),
                    done.seconds,
                    done.requests,
                    done.max_batch,
                    if done.speculative { ", a speculative step" } else { "" }
                ),
                Err(error) => eprintln!("rmlx serve: {} not warmed up: {error}", model.display()),
            }
        });
    }
    serve_on(listener, state, shutdown_signal()).await?;
    eprintln!("rmlx serve: stopped");
    Ok(())
}

/// Serves `app(state)` on a bound listener until `shutdown` resolves, then lets in-flight
/// requests finish: what `serve` runs, and what loopback tests drive on a free port.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    axum::serve(listener, app(state))
        .with_graceful_shutdown(shutdown)
        .await
        .context("the server failed")
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
}
