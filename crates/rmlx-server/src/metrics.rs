//! `GET /metrics/cache` (JSON, the shape docs/SERVER.md documents) and `GET /metrics`
//! (Prometheus text), both from the engine's one `MetricsSnapshot`, plus the errors the server
//! refuses before a request reaches the engine (bad JSON, unknown model, key, body size), which
//! the engine never sees. Reference: Prometheus text exposition format 0.0.4.

use std::{collections::BTreeMap, sync::Mutex};

use axum::{
    extract::State,
    http::header,
    response::{IntoResponse, Response},
    Json,
};
use rmlx_engine::metrics::{MetricsSnapshot, Summary};

use crate::{
    api::{CacheMetrics, DiskCacheMetrics, Latency, ModelCacheMetrics, RecentRequest},
    AppState,
};

/// Errors answered by the server itself, by kind; the engine counts its own.
#[derive(Debug, Default)]
pub struct ServerErrors(Mutex<BTreeMap<String, u64>>);

impl ServerErrors {
    pub fn record(&self, kind: &str) {
        let mut counts = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *counts.entry(kind.to_string()).or_default() += 1;
    }

    fn merge_into(&self, counts: &mut BTreeMap<String, u64>) {
        for (kind, count) in self.0.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            *counts.entry(kind.clone()).or_default() += count;
        }
    }
}

/// The engine's snapshot with the server's own refusals merged into `error_counts`.
pub fn snapshot(state: &AppState) -> MetricsSnapshot {
    let mut snapshot = state.engine.metrics();
    state.server_errors.merge_into(&mut snapshot.error_counts);
    snapshot
}

fn latency(model_id: &str, summary: &Summary) -> Latency {
    Latency {
        model_id: model_id.into(),
        p50: summary.p50,
        p95: summary.p95,
        mean: summary.mean,
        count: summary.count,
    }
}

pub fn cache_metrics(snapshot: &MetricsSnapshot) -> CacheMetrics {
    let models = snapshot
        .models
        .iter()
        .map(|model| ModelCacheMetrics {
            model_id: model.model_id.clone(),
            prefix_cache_hits: model.prefix_cache_hits,
            disk_cache_hits: model.disk_cache_hits,
            prefix_cache_misses: model.prefix_cache_misses,
            prefix_cache_evictions: model.prefix_cache_evictions,
            draft_tokens: model.draft_tokens,
            accepted_tokens: model.accepted_tokens,
            prefix_cache_bytes: model.prefix_cache_bytes,
            kv_cache_bytes: snapshot.kv_cache_bytes,
            active_memory_bytes: snapshot.mlx_active_bytes,
            peak_memory_bytes: snapshot.mlx_peak_bytes,
        })
        .collect();
    let recent = snapshot
        .recent
        .iter()
        .map(|record| RecentRequest {
            id: record.id.clone(),
            model: record.model.clone(),
            ttft_ms: record.ttft_ms,
            itl_p50_ms: record.itl_p50_ms,
            itl_ms: record.itl_ms.clone(),
            tokens_in: record.tokens_in,
            cached_tokens: record.cached_tokens,
            tokens_out: record.tokens_out,
            draft_tokens: record.draft_tokens,
            accepted_tokens: record.accepted_tokens,
            ended: record.ended,
        })
        .collect();
    CacheMetrics {
        models,
        ttft: snapshot
            .models
            .iter()
            .map(|model| latency(&model.model_id, &model.ttft_ms))
            .collect(),
        itl: snapshot
            .models
            .iter()
            .map(|model| latency(&model.model_id, &model.itl_ms))
            .collect(),
        recent,
        tokens_in: snapshot.tokens_in,
        tokens_out: snapshot.tokens_out,
        queue_depth: snapshot.queue_depth,
        in_flight: snapshot.in_flight,
        kv_cache_bytes: snapshot.kv_cache_bytes,
        prefix_cache_bytes: snapshot.prefix_cache_bytes,
        prefix_snapshots: snapshot.prefix_snapshots,
        prefix_snapshot_bytes: snapshot.prefix_snapshot_bytes,
        prefix_cache_budget_bytes: snapshot.prefix_cache_budget_bytes,
        prefix_snapshot_budget_bytes: snapshot.prefix_snapshot_budget_bytes,
        prefix_cache_trimmed: snapshot.prefix_cache_trimmed,
        active_memory_bytes: snapshot.mlx_active_bytes,
        peak_memory_bytes: snapshot.mlx_peak_bytes,
        cache_memory_bytes: snapshot.mlx_cache_bytes,
        error_counts: snapshot.error_counts.clone(),
        disk_cache: snapshot.disk_cache.as_ref().map(|disk| DiskCacheMetrics {
            path: disk.root.display().to_string(),
            budget_bytes: disk.budget_bytes,
            bytes: disk.bytes_on_disk,
            files: disk.files,
            read_bytes: disk.read_bytes,
            read_ms: disk.read_ms,
            written_bytes: disk.written_bytes,
            evicted_files: disk.evicted_files,
            evicted_bytes: disk.evicted_bytes,
            writing_stopped: disk.stopped,
        }),
        ranks: crate::models::rank_health(),
        pipeline_error: rmlx_engine::distributed::health::failure(),
    }
}

/// The engine's live figures (what the app's dashboard draws).
#[utoipa::path(get, path = "/metrics/cache", tag = "server",
    responses((status = 200, description = "The metrics", body = CacheMetrics)))]
pub async fn cache(State(state): State<AppState>) -> Json<CacheMetrics> {
    Json(cache_metrics(&snapshot(&state)))
}

/// `DELETE /admin/cache/disk`: what the clear button answers.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct DiskCacheCleared {
    pub freed_bytes: u64,
}

/// Deletes every file of the disk prefix cache (all models); RAM entries stay.
#[utoipa::path(delete, path = "/admin/cache/disk", tag = "server",
    responses((status = 200, description = "The bytes freed", body = DiskCacheCleared),
        (status = 404, description = "The disk cache is off", body = crate::api::OpenAiError)))]
pub async fn clear_disk(
    State(state): State<AppState>,
) -> Result<Json<DiskCacheCleared>, crate::error::ApiError> {
    let engine = state.engine.clone();
    let freed = tokio::task::spawn_blocking(move || engine.clear_disk_cache())
        .await
        .ok()
        .flatten()
        .ok_or_else(|| {
            crate::error::ApiError::NotFound(
                "the disk prefix cache is off (--prefix-disk-gb 0)".into(),
            )
        })?;
    Ok(Json(DiskCacheCleared { freed_bytes: freed }))
}

/// The same metrics in Prometheus' text format 0.0.4.
#[utoipa::path(get, path = "/metrics", tag = "server",
    responses((status = 200, description = "Prometheus text", body = String,
        content_type = "text/plain; version=0.0.4; charset=utf-8")))]
pub async fn prometheus(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        snapshot(&state).to_prometheus(),
    )
        .into_response()
}
