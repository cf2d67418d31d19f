//! `/admin/downloads`: the model manager's download jobs (start, list, pause, resume, cancel)
//! over `rmlx-hub`'s `DownloadManager`, for the browser version of the models view. Behind the
//! API key like every route. The routes and job JSON are docs/MODELS-API.md's.

use axum::{
    extract::{Path, State},
    http::StatusCode,
    Json,
};
use rmlx_hub::{DownloadManager, Job, JobState};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::{
    error::{ApiError, ApiJson},
    AppState,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartDownload {
    /// `org/name` on the hub.
    repo: String,
    /// Branch, tag or commit; `main` when absent.
    #[serde(default)]
    revision: Option<String>,
}

fn manager(state: &AppState) -> Result<&DownloadManager, ApiError> {
    state
        .downloads
        .as_ref()
        .map_err(|why| ApiError::BadRequest(why.clone()))
}

fn job_json(job: Job) -> Json<Value> {
    Json(json!(job))
}

/// `POST /admin/downloads {repo, revision?}` → 202 and the job (state `queued`); a repository
/// already downloading answers its running job instead of starting a second one.
pub async fn start(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<StartDownload>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let job = manager(&state)?.start(&body.repo, body.revision.as_deref())?;
    Ok((StatusCode::ACCEPTED, job_json(job)))
}

pub async fn list(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    Ok(Json(
        json!({"object": "list", "data": manager(&state)?.list()}),
    ))
}

pub async fn get(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    manager(&state)?
        .get(&id)
        .map(job_json)
        .ok_or_else(|| rmlx_hub::HubError::JobNotFound(id).into())
}

/// `POST /admin/downloads/{id}/pause` keeps the `.partial` files; `/resume` continues them.
pub async fn act(
    State(state): State<AppState>,
    Path((id, action)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let downloads = manager(&state)?;
    let job = match action.as_str() {
        "pause" => downloads.pause(&id).await?,
        "resume" => downloads.resume(&id)?,
        _ => {
            return Err(ApiError::NotFound(format!(
                "no route POST /admin/downloads/{id}/{action}"
            )))
        }
    };
    Ok(job_json(job))
}

/// `DELETE /admin/downloads/{id}`: stops a job and removes its partial files (complete files
/// stay); a job already `done` or `cancelled` is dropped from the list instead (the UI's
/// "clear"; the model, if any, stays on disk).
pub async fn cancel(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let downloads = manager(&state)?;
    let finished = downloads
        .get(&id)
        .is_some_and(|job| matches!(job.state, JobState::Done | JobState::Cancelled));
    let job = if finished {
        downloads.forget(&id)?
    } else {
        downloads.cancel(&id).await?
    };
    Ok(job_json(job))
}
