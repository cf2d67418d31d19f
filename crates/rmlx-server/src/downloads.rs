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
use utoipa::{IntoParams, ToSchema};

use crate::{
    api::{JobList, ListObject},
    error::{ApiError, ApiJson},
    AppState,
};

/// A repository of the hub to download into the models folder.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StartDownload {
    /// `org/name` on the hub: letters, digits, `.`, `_` and `-` (neither part `.` or `..`).
    #[schema(
        pattern = r"^(?:[A-Za-z0-9_-][A-Za-z0-9._-]*|\.[A-Za-z0-9_-][A-Za-z0-9._-]*|\.\.[A-Za-z0-9._-]+)/(?:[A-Za-z0-9_-][A-Za-z0-9._-]*|\.[A-Za-z0-9_-][A-Za-z0-9._-]*|\.\.[A-Za-z0-9._-]+)$"
    )]
    repo: String,
    /// A branch, tag or commit (`main` when left out), as git allows it: at most 256
    /// characters, no `..`, `@{`, `//`, control characters, spaces or `~^:?*[\`, not starting
    /// or ending with `/`.
    #[serde(default)]
    #[schema(
        pattern = r"^(?!/)(?!.*/$)(?!.*//)(?!.*\.\.)(?!.*@\{)[^\x00-\x20\x7F-\xA0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000~^:?*\[\\]{1,256}$"
    )]
    revision: Option<String>,
}

/// A download job's id in a path.
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)]
struct JobId {
    /// The id `POST /admin/downloads` answered with.
    id: String,
}

fn manager(state: &AppState) -> Result<&DownloadManager, ApiError> {
    state
        .downloads
        .as_ref()
        .map_err(|why| ApiError::BadRequest(why.clone()))
}

/// Starts a download (resuming files partly here); a repository already downloading answers
/// its running job instead of starting a second one.
#[utoipa::path(post, path = "/admin/downloads", tag = "downloads", operation_id = "start_download",
    request_body = StartDownload,
    responses((status = 202, description = "The job, queued", body = Job,
        links(
            ("GetDownload" = (operation_id = "get_download", parameters(("id" = "$response.body#/id")))),
            ("PauseDownload" = (operation_id = "pause_download", parameters(("id" = "$response.body#/id")))),
            ("ResumeDownload" = (operation_id = "resume_download", parameters(("id" = "$response.body#/id")))),
            ("CancelDownload" = (operation_id = "cancel_download", parameters(("id" = "$response.body#/id"))))
        ))))]
pub async fn start(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<StartDownload>,
) -> Result<(StatusCode, Json<Job>), ApiError> {
    let job = manager(&state)?.start(&body.repo, body.revision.as_deref())?;
    Ok((StatusCode::ACCEPTED, Json(job)))
}

/// Every job this server has run, newest last.
#[utoipa::path(get, path = "/admin/downloads", tag = "downloads", operation_id = "list_downloads",
    responses((status = 200, description = "The jobs", body = JobList)))]
pub async fn list(State(state): State<AppState>) -> Result<Json<JobList>, ApiError> {
    Ok(Json(JobList {
        object: ListObject::List,
        data: manager(&state)?.list(),
    }))
}

#[utoipa::path(get, path = "/admin/downloads/{id}", tag = "downloads", operation_id = "get_download",
    params(JobId), responses((status = 200, description = "The job", body = Job)))]
pub async fn get(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Job>, ApiError> {
    manager(&state)?
        .get(&id)
        .map(Json)
        .ok_or_else(|| rmlx_hub::HubError::JobNotFound(id).into())
}

/// `POST /admin/downloads/{id}/pause` or `/resume`.
pub async fn act(
    State(state): State<AppState>,
    Path((id, action)): Path<(String, String)>,
) -> Result<Json<Job>, ApiError> {
    match action.as_str() {
        "pause" => pause(&state, &id).await,
        "resume" => resume(&state, &id),
        _ => Err(ApiError::NotFound(format!(
            "no route POST /admin/downloads/{id}/{action}"
        ))),
    }
}

/// Stops a running job, keeping its `.partial` files.
#[utoipa::path(post, path = "/admin/downloads/{id}/pause", tag = "downloads", operation_id = "pause_download",
    params(JobId), responses((status = 200, description = "The job, paused", body = Job)))]
pub(crate) async fn pause(state: &AppState, id: &str) -> Result<Json<Job>, ApiError> {
    Ok(Json(manager(state)?.pause(id).await?))
}

/// Continues a paused or failed job from its `.partial` files.
#[utoipa::path(post, path = "/admin/downloads/{id}/resume", tag = "downloads", operation_id = "resume_download",
    params(JobId), responses((status = 200, description = "The job, queued again", body = Job)))]
pub(crate) fn resume(state: &AppState, id: &str) -> Result<Json<Job>, ApiError> {
    Ok(Json(manager(state)?.resume(id)?))
}

/// Stops the job if it is not finished (removing its partial files; complete files stay) and
/// drops it from the list, so the id is gone afterwards (a model it finished stays on disk).
/// The answer is the job as it ended (`cancelled` when this stopped it).
#[utoipa::path(delete, path = "/admin/downloads/{id}", tag = "downloads", operation_id = "cancel_download",
    params(JobId), responses((status = 200, description = "The job as it ended, now gone from the list", body = Job)))]
pub async fn cancel(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Job>, ApiError> {
    let downloads = manager(&state)?;
    let finished = downloads
        .get(&id)
        .is_some_and(|job| matches!(job.state, JobState::Done | JobState::Cancelled));
    if !finished {
        downloads.cancel(&id).await?;
    }
    Ok(Json(downloads.forget(&id)?))
}
