//! `GET /health`, `GET /v1/models[/{id}]`, `POST /v1/models/{id}/load|unload`, and the JSON 404.
//! Reference: OpenAI "Models" API (list/retrieve objects), plus rMLX's context/loaded/vision.

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
    registry::{canonical, ModelEntry},
    AppState,
};

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

fn model_json(state: &AppState, entry: &ModelEntry, resident: &[PathBuf]) -> Value {
    let info = state.registry.info(entry);
    json!({
        "id": entry.id,
        "object": "model",
        "created": entry.created,
        "owned_by": entry.owned_by,
        "context_length": state.registry.context_length(entry),
        "loaded": resident.contains(&canonical(&entry.path)),
        // Before a model is loaded its config says whether it has a vision tower.
        "vision": info.map_or_else(|| crate::convert::has_vision(&entry.path), |info| info.vision),
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
    let data: Vec<Value> = state
        .registry
        .list()
        .iter()
        .map(|entry| model_json(&state, entry, &resident))
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

pub async fn retrieve(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let entry = state.registry.resolve(&id)?;
    let resident = resident(&state).await?;
    Ok(Json(model_json(&state, &entry, &resident)))
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
        let mut body = model_json(&state, &entry, &resident);
        body["parameters"] = json!(info.parameters);
        body["quantization"] = json!(info.quantization);
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

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::NotFound(format!("no route for {}", uri.path()))
}
