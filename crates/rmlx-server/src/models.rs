//! `GET /health`, `GET /v1/models[/{id}]`, `POST /v1/models/{id}/load|unload`, and the JSON 404.
//! Reference: OpenAI "Models" API (list/retrieve objects), plus rMLX's context/loaded/vision.

use axum::{
    extract::{Path, State},
    http::Uri,
    Json,
};
use serde_json::{json, Value};

use crate::{error::ApiError, registry::ModelEntry, AppState};

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

fn model_json(state: &AppState, entry: &ModelEntry) -> Value {
    let info = state.registry.info(&entry.id);
    json!({
        "id": entry.id,
        "object": "model",
        "created": entry.created,
        "owned_by": entry.owned_by,
        "context_length": state.registry.context_length(entry),
        "loaded": state.registry.is_loaded(&entry.id),
        // The engine reads no images yet; a loaded model's own report wins once it does.
        "vision": info.is_some_and(|info| info.vision),
    })
}

pub async fn list(State(state): State<AppState>) -> Json<Value> {
    let data: Vec<Value> = state
        .registry
        .list()
        .iter()
        .map(|entry| model_json(&state, entry))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

pub async fn retrieve(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let entry = state.registry.resolve(&id)?;
    Ok(Json(model_json(&state, &entry)))
}

/// `{id}/load` loads now (what the first request would otherwise do); `{id}/unload` waits for
/// the engine's model LRU.
pub async fn admin(
    State(state): State<AppState>,
    Path(rest): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if let Some(id) = rest.strip_suffix("/load") {
        let entry = state.registry.resolve(id)?;
        let engine = state.engine.clone();
        let path = entry.path.clone();
        let info = tokio::task::spawn_blocking(move || engine.model_info(&path))
            .await
            .map_err(|error| ApiError::Internal(error.to_string()))??;
        state.registry.mark_loaded(&entry.id, Some(info.clone()));
        let mut body = model_json(&state, &entry);
        body["parameters"] = json!(info.parameters);
        body["quantization"] = json!(info.quantization);
        body["model_type"] = json!(info.model_type);
        return Ok(Json(body));
    }
    if let Some(id) = rest.strip_suffix("/unload") {
        state.registry.resolve(id)?;
        return Err(ApiError::NotImplemented(
            "unloading is not supported yet: the engine keeps one model resident and replaces it when another model is used".into(),
        ));
    }
    Err(ApiError::NotFound(format!(
        "no route POST /v1/models/{rest}"
    )))
}

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::NotFound(format!("no route for {}", uri.path()))
}
