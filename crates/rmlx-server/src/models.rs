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
use serde_json::{json, Value};

use rmlx_engine::engine::Engine;

use crate::{
    error::ApiError,
    registry::{canonical, read_config, ModelEntry, Source},
    AppState,
};

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// One `/v1/models` entry. `available` is the memory available now, read once per listing.
fn model_json(
    state: &AppState,
    entry: &ModelEntry,
    resident: &[PathBuf],
    available: Option<u64>,
) -> Value {
    let info = state.registry.info(entry);
    let config = read_config(&entry.path).unwrap_or(Value::Null);
    json!({
        "id": entry.id,
        "object": "model",
        "created": entry.created,
        "owned_by": entry.owned_by,
        "context_length": state.registry.context_length(entry),
        "loaded": resident.contains(&canonical(&entry.path)),
        // Before a model is loaded its config says whether it has a vision tower.
        "vision": info.as_ref().map_or_else(|| crate::convert::config_has_vision(&config), |info| info.vision),
        "model_type": config["model_type"].as_str(),
        "parameters": info.as_ref().map(|info| info.parameters),
        "quantization": quantization(&config),
        "size_bytes": folder_size(&entry.path, 0),
        "source": entry.source.as_str(),
        "deletable": entry.source != Source::Model,
        "structure": rmlx_engine::models::structure::describe(&config),
        "fits": available.and_then(|available| fits(&entry.path, &config, &state.config, available)),
    })
}

/// `{bits, group_size, mode}` from config.json's `quantization` (mlx-lm's key; `mode` defaults
/// to affine as there), or null for an unquantized model.
fn quantization(config: &Value) -> Value {
    let table = &config["quantization"];
    if !table.is_object() {
        return Value::Null;
    }
    json!({
        "bits": table["bits"],
        "group_size": table["group_size"],
        "mode": table["mode"].as_str().unwrap_or("affine"),
    })
}

/// Bytes on disk, following file symlinks (a hub cache snapshot links into `blobs/`) but not
/// folder symlinks, which could loop.
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

/// Every expert's weights plus a tenth, the KV cache at the server's `--max-ctx` (the model's
/// context when unset; a batch's rows share it) and a recurrent state per `--max-batch` row
/// against the memory available now: `no` when it does not fit, `tight` within a quarter of
/// the limit.
fn fits(
    dir: &std::path::Path,
    config: &Value,
    server: &crate::ServerConfig,
    available: u64,
) -> Option<&'static str> {
    let needed =
        rmlx_engine::runtime::memory_needed_at(dir, config, server.max_ctx, server.max_batch)
            .ok()?;
    Some(if needed > available {
        "no"
    } else if needed > available / 4 * 3 {
        "tight"
    } else {
        "yes"
    })
}

fn memory_json(available: Option<u64>) -> Value {
    json!({
        "total_bytes": rmlx_engine::runtime::total_memory(),
        "available_bytes": available,
    })
}

/// Runs a blocking engine call (it waits its turn on the engine thread) off the async workers.
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

pub async fn list(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let resident = resident(&state).await?;
    let available = rmlx_engine::runtime::available_memory();
    let data: Vec<Value> = state
        .registry
        .list()
        .iter()
        .map(|entry| model_json(&state, entry, &resident, available))
        .collect();
    Ok(Json(
        json!({"object": "list", "data": data, "memory": memory_json(available)}),
    ))
}

pub async fn retrieve(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let entry = state.registry.resolve(&id)?;
    let resident = resident(&state).await?;
    let available = rmlx_engine::runtime::available_memory();
    Ok(Json(model_json(&state, &entry, &resident, available)))
}

/// `{id}/load` loads now (what the first request would otherwise do; the engine may evict its
/// least recently used model to make room); `{id}/unload` frees it and its prefix-cache KV.
pub async fn admin(
    State(state): State<AppState>,
    Path(rest): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if let Some(id) = rest.strip_suffix("/load") {
        let entry = state.registry.resolve(id)?;
        let path = entry.path.clone();
        let info = on_engine(&state, move |engine| engine.model_info(&path)).await?;
        state.registry.remember(&info);
        let resident = resident(&state).await?;
        let available = rmlx_engine::runtime::available_memory();
        let mut body = model_json(&state, &entry, &resident, available);
        body["parameters"] = json!(info.parameters);
        body["model_type"] = json!(info.model_type);
        return Ok(Json(body));
    }
    if let Some(id) = rest.strip_suffix("/unload") {
        let entry = state.registry.resolve(id)?;
        let path = entry.path.clone();
        let unloaded = on_engine(&state, move |engine| engine.unload(&path)).await?;
        return Ok(Json(json!({"id": entry.id, "unloaded": unloaded})));
    }
    Err(ApiError::NotFound(format!(
        "no route POST /v1/models/{rest}"
    )))
}

/// Unloads the model, then removes its folder (its whole repository folder in the hub cache).
/// `--model` folders are refused; so is a model whose download is still running.
pub async fn delete(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
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
    Ok(Json(
        json!({"id": entry.id, "object": "model", "deleted": true}),
    ))
}

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::NotFound(format!("no route for {}", uri.path()))
}
