//! `GET /health`, `GET /v1/models[/{id}]`, `POST /v1/models/{id}/load|unload`,
//! `DELETE /v1/models/{id}`, and the JSON 404.
//! Reference: OpenAI "Models" API (list/retrieve/delete objects), plus the model manager's fields
//! of docs/MODELS-API.md (size, quantization, source, deletable, fits, memory).

use std::path::PathBuf;

use axum::{
    extract::{Path, State},
    http::Uri,
    Json,
};
use serde_json::Value;
use utoipa::IntoParams;

use rmlx_engine::engine::Engine;

use crate::{
    api::{
        CodexModel, CodexReasoningLevel, CodexTruncationPolicy, Deleted, Fits, Health,
        HealthStatus, ListObject, MemoryInfo, ModelList, ModelObject, ModelObjectType, ModelSource,
        Quantization, RankHealth, Unloaded,
    },
    error::ApiError,
    registry::{canonical, read_config, ModelEntry, Source},
    AppState,
};

/// Always answers, even with --api-key set; across machines it lists the ranks, and says 503
/// once one was lost (the process then exits for its supervisor to restart it).
#[utoipa::path(get, path = "/health", tag = "server", security(()),
    responses((status = 200, description = "The server is up", body = Health),
        (status = 503, description = "A rank of the pipeline was lost", body = Health)))]
pub async fn health() -> (axum::http::StatusCode, Json<Health>) {
    let ranks = rank_health();
    let error = rmlx_engine::distributed::health::failure();
    let (code, status) = match error {
        Some(_) => (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            HealthStatus::Failed,
        ),
        None => (axum::http::StatusCode::OK, HealthStatus::Ok),
    };
    (
        code,
        Json(Health {
            status,
            ranks,
            error,
        }),
    )
}

/// The pipeline's ranks (`/health`, `/metrics/cache`); empty in one process.
pub fn rank_health() -> Vec<RankHealth> {
    rmlx_engine::distributed::health::ranks()
        .into_iter()
        .map(|rank| RankHealth {
            rank: rank.rank,
            endpoint: rank.endpoint,
            layers: rank.layers,
            last_heartbeat_ms: rank.last_heartbeat_ms,
        })
        .collect()
}

/// One `/v1/models` entry. `available` is the memory available now, read once per listing.
fn model_object(
    state: &AppState,
    entry: &ModelEntry,
    resident: &[PathBuf],
    available: Option<u64>,
) -> ModelObject {
    let info = state.registry.info(entry);
    let config = read_config(&entry.path).unwrap_or(Value::Null);
    let draft_head = info.as_ref().map_or_else(
        || rmlx_engine::models::ships_draft_head_at(&entry.path),
        |info| info.draft_head,
    );
    let serving = serving(&state.config, draft_head);
    ModelObject {
        id: entry.id.clone(),
        object: ModelObjectType::Model,
        created: entry.created,
        owned_by: entry.owned_by.clone(),
        context_length: state.registry.context_length(entry),
        loaded: resident.contains(&canonical(&entry.path)),
        vision: info.as_ref().map_or_else(
            || crate::convert::config_has_vision(&config),
            |info| info.vision,
        ),
        draft_head,
        draft_model: state
            .config
            .draft_model
            .as_ref()
            .map(|draft| draft.display().to_string()),
        model_type: config["model_type"].as_str().map(Into::into),
        parameters: info.as_ref().map(|info| info.parameters),
        quantization: quantization(&config),
        size_bytes: folder_size(&entry.path, 0),
        source: match entry.source {
            Source::Model => ModelSource::Model,
            Source::ModelsDir => ModelSource::ModelsDir,
            Source::HfCache => ModelSource::HfCache,
        },
        deletable: entry.source != Source::Model,
        structure: rmlx_engine::models::structure::describe(&config),
        fits: available.and_then(|available| fits(&entry.path, &config, &serving, available)),
        max_context_fits: available.and_then(|available| {
            rmlx_engine::runtime::largest_context_that_fits(
                &entry.path,
                &config,
                &serving,
                available,
            )
            .ok()
            .map(|fits| fits.unwrap_or(0))
        }),
        load_seconds: info.as_ref().map(|info| info.load_seconds),
        warm_up_seconds: state
            .engine
            .warmed_up(&entry.path)
            .map(|warm_up| warm_up.seconds),
    }
}

fn quantization(config: &Value) -> Option<Quantization> {
    let table = config["quantization"].as_object()?;
    Some(Quantization {
        bits: table.get("bits").and_then(Value::as_u64),
        group_size: table.get("group_size").and_then(Value::as_u64),
        mode: table
            .get("mode")
            .and_then(Value::as_str)
            .unwrap_or("affine")
            .into(),
    })
}

fn folder_size(dir: &std::path::Path, depth: usize) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|entry| {
            let path = entry.path();
            match entry.file_type() {
                Ok(kind) if kind.is_dir() && depth < 8 => folder_size(&path, depth + 1),
                Ok(kind) if kind.is_file() || kind.is_symlink() => std::fs::metadata(&path)
                    .ok()
                    .filter(|meta| meta.is_file())
                    .map_or(0, |meta| meta.len()),
                _ => 0,
            }
        })
        .sum()
}

/// How this server holds a model (its context cap, batch rows, KV bits, explicit prefix-cache
/// budgets; `draft_head`: the checkpoint ships one).
fn serving(server: &crate::ServerConfig, draft_head: bool) -> rmlx_engine::runtime::Serving {
    use rmlx_engine::speculative::SpeculativeMode;
    rmlx_engine::runtime::Serving {
        max_ctx: server.max_ctx,
        rows: server.max_batch,
        kv_bits: server.kv_bits,
        reserved: server.prefix_cache_bytes.unwrap_or(0)
            + server.prefix_snapshot_bytes.unwrap_or(0),
        // Loaded with speculation on (its KV then counts), unless drafting is off; never
        // across ranks.
        draft_head: draft_head
            && server.speculative != SpeculativeMode::Off
            && server.part.stage().is_none(),
        share: rmlx_engine::runtime::StageShare::of(&server.part),
    }
}

/// Every expert's weights plus a tenth, the KV cache at the server's `--max-ctx` (the model's
/// context when unset; a batch's rows share it; stored with its KV bits), the fixed state of
/// each `--max-batch` row (recurrent states, sliding windows) and explicit prefix-cache budgets
/// against the memory available now: `no` when it does not fit, `tight` within a quarter of
/// the limit.
fn fits(
    dir: &std::path::Path,
    config: &Value,
    serving: &rmlx_engine::runtime::Serving,
    available: u64,
) -> Option<Fits> {
    let needed = rmlx_engine::runtime::memory_needed_at(dir, config, serving).ok()?;
    Some(if needed > available {
        Fits::No
    } else if needed > available / 4 * 3 {
        Fits::Tight
    } else {
        Fits::Yes
    })
}

fn memory(available: Option<u64>) -> MemoryInfo {
    MemoryInfo {
        total_bytes: rmlx_engine::runtime::total_memory(),
        available_bytes: available,
    }
}

/// Runs a blocking engine call (it waits its turn on the engine thread) off the async workers.
/// A model id in a path.
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
struct ModelId {
    /// The model's id, as `GET /v1/models` lists it (`org/name` ids send `/` as `%2F`).
    #[param(value_type = crate::constraints::ModelId)]
    id: String,
}

async fn on_engine<T: Send + 'static>(
    state: &AppState,
    call: impl FnOnce(&Engine) -> rmlx_engine::Result<T> + Send + 'static,
) -> Result<T, ApiError> {
    let engine = state.engine.clone();
    tokio::task::spawn_blocking(move || call(&engine))
        .await
        .map_err(|error| ApiError::Internal(error.to_string()))?
        .map_err(ApiError::from)
}

/// Canonical folders of the models the engine holds now (its LRU decides, up to
/// `--max-loaded`); their infos are kept for context and vision in listings.
async fn resident(state: &AppState) -> Result<Vec<PathBuf>, ApiError> {
    let infos = on_engine(state, Engine::loaded).await?;
    for info in &infos {
        state.registry.remember(info);
    }
    Ok(infos.iter().map(|info| canonical(&info.path)).collect())
}

/// Every model the server can run, loaded or not, and the machine's memory.
#[utoipa::path(get, path = "/v1/models", tag = "models",
    responses((status = 200, description = "The models", body = ModelList)))]
pub async fn list(State(state): State<AppState>) -> Result<Json<ModelList>, ApiError> {
    let resident = resident(&state).await?;
    let available = rmlx_engine::runtime::available_memory();
    let data: Vec<ModelObject> = state
        .registry
        .list()
        .iter()
        .map(|entry| model_object(&state, entry, &resident, available))
        .collect();
    let models = data.iter().enumerate().map(codex_model).collect();
    Ok(Json(ModelList {
        object: ListObject::List,
        data,
        memory: memory(available),
        models,
    }))
}

/// A model as Codex reads its metadata, listed in `GET /v1/models` order (its `priority`).
fn codex_model((priority, model): (usize, &ModelObject)) -> CodexModel {
    let level = |effort: &str, description: &str| CodexReasoningLevel {
        effort: effort.into(),
        description: description.into(),
    };
    let mut input_modalities = vec!["text".to_string()];
    if model.vision {
        input_modalities.push("image".into());
    }
    CodexModel {
        slug: model.id.clone(),
        display_name: model.id.clone(),
        description: format!(
            "{} on rMLX",
            model.model_type.as_deref().unwrap_or("a local model")
        ),
        supported_reasoning_levels: vec![
            level("none", "Thinking off"),
            level("low", "Thinking on"),
            level("medium", "Thinking on"),
            level("high", "Thinking on"),
        ],
        shell_type: "default".into(),
        visibility: "list".into(),
        supported_in_api: true,
        priority: priority as i32,
        supports_reasoning_summaries: true,
        support_verbosity: false,
        truncation_policy: CodexTruncationPolicy {
            mode: "bytes".into(),
            limit: 10_000,
        },
        supports_parallel_tool_calls: true,
        context_window: model.context_length,
        max_context_window: model.context_length,
        effective_context_window_percent: 95,
        experimental_supported_tools: Vec::new(),
        input_modalities,
    }
}

/// One model.
#[utoipa::path(get, path = "/v1/models/{id}", tag = "models", params(ModelId),
    responses((status = 200, description = "The model", body = ModelObject)))]
pub async fn retrieve(
    State(state): State<AppState>,
    ModelPath(id): ModelPath,
) -> Result<Json<ModelObject>, ApiError> {
    let entry = state.registry.resolve(&id)?;
    let resident = resident(&state).await?;
    let available = rmlx_engine::runtime::available_memory();
    Ok(Json(model_object(&state, &entry, &resident, available)))
}

/// The model id of a `/v1/models/...` path: `{id}`, or `{id}/{name}` for `org/name`.
pub struct ModelPath(String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for ModelPath {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        let Path(segments) = Path::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map_err(|rejection| ApiError::BadRequest(rejection.to_string()))?;
        let id: Vec<String> = segments.into_iter().map(|(_, value)| value).collect();
        Ok(Self(id.join("/")))
    }
}

/// Loads now what the first request would otherwise load (the engine may evict its least
/// recently used model to make room), then warms it up (unless the server runs with
/// `--warm-up off`): the kernels its first requests need are built before they come.
#[utoipa::path(post, path = "/v1/models/{id}/load", tag = "models",
    params(ModelId), responses((status = 200, description = "The model, loaded", body = ModelObject)))]
pub async fn load(
    State(state): State<AppState>,
    ModelPath(id): ModelPath,
) -> Result<Json<ModelObject>, ApiError> {
    let entry = state.registry.resolve(&id)?;
    let path = entry.path.clone();
    let warm_up = state.config.warm_up;
    let info = on_engine(&state, move |engine| {
        // Requests that come while it loads wait for the warm-up too.
        let _hold = warm_up.then(|| engine.hold_for_warm_up());
        let info = engine.model_info(&path)?;
        if warm_up {
            engine.warm_up(&path)?;
        }
        Ok(info)
    })
    .await?;
    state.registry.remember(&info);
    let resident = resident(&state).await?;
    let available = rmlx_engine::runtime::available_memory();
    let mut body = model_object(&state, &entry, &resident, available);
    body.parameters = Some(info.parameters);
    body.model_type = Some(info.model_type);
    Ok(Json(body))
}

/// Frees the model and its prefix-cache KV.
#[utoipa::path(post, path = "/v1/models/{id}/unload", tag = "models",
    params(ModelId), responses((status = 200, description = "Whether it was loaded", body = Unloaded)))]
pub async fn unload(
    State(state): State<AppState>,
    ModelPath(id): ModelPath,
) -> Result<Json<Unloaded>, ApiError> {
    let entry = state.registry.resolve(&id)?;
    let path = entry.path.clone();
    let unloaded = on_engine(&state, move |engine| engine.unload(&path)).await?;
    Ok(Json(Unloaded {
        id: entry.id,
        unloaded,
    }))
}

/// Unloads the model, then removes its folder (its whole repository folder in the hub cache).
/// A `--model` folder is never deleted, and a model whose download is still running is not:
/// both are conflicts with the server's state (409), not malformed requests.
#[utoipa::path(delete, path = "/v1/models/{id}", tag = "models", params(ModelId),
    responses(
        (status = 200, description = "The model's folder is gone", body = Deleted),
        (status = 409, description = "The model was given with --model (rmlx serve does not \
            delete folders it was pointed at), or a download into it is still running",
            body = crate::api::OpenAiError),
    ))]
pub async fn delete(
    State(state): State<AppState>,
    ModelPath(id): ModelPath,
) -> Result<Json<Deleted>, ApiError> {
    let entry = state.registry.resolve(&id)?;
    let folder = state.registry.deletable_folder(&entry)?;
    if let Ok(downloads) = &state.downloads {
        if let Some(job) = downloads
            .list()
            .into_iter()
            .find(|job| job.repo == entry.id && job.state.is_active())
        {
            return Err(ApiError::Conflict(format!(
                "model `{}` is being downloaded (job `{}`); cancel the download first",
                entry.id, job.id
            )));
        }
    }
    let path = entry.path.clone();
    on_engine(&state, move |engine| engine.unload(&path)).await?;
    let models_dir = state
        .registry
        .models_dir()
        .map(std::path::Path::to_path_buf);
    let removed = folder.clone();
    tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        // remove_dir_all removes symlinks inside without following them.
        std::fs::remove_dir_all(&removed)?;
        // `org/` of an `org/name` download goes too once it is empty (never the root itself).
        if let (Some(root), Some(parent)) = (models_dir, removed.parent()) {
            if parent != root && parent.starts_with(&root) {
                let _ = std::fs::remove_dir(parent);
            }
        }
        Ok(())
    })
    .await
    .map_err(|error| ApiError::Internal(error.to_string()))?
    .map_err(|error| ApiError::Internal(format!("cannot delete {}: {error}", folder.display())))?;
    Ok(Json(Deleted {
        id: entry.id,
        object: ModelObjectType::Model,
        deleted: true,
    }))
}

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::NotFound(format!("no route for {}", uri.path()))
}
