//! What the engine measured, written once per request on the one completion path every front
//! door shares (rMLX 0.2.4 recorded TTFT only when streaming), read by the server, the app
//! and the CLI. Bounded: rings of recent samples per model, plus monotonic counters.

use std::{
    collections::{BTreeMap, VecDeque},
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Mutex,
    },
    time::{SystemTime, UNIX_EPOCH},
};

use serde::Serialize;

use crate::generate::{Completion, FinishReason};

/// Samples kept per model for TTFT, and for ITL (tokens are many, so more).
const TTFT_RING: usize = 1024;
const ITL_RING: usize = 16384;
/// Inter-token gaps kept per `recent` entry.
pub const RECENT_ITL: usize = 4096;

/// Requests listed in `recent`.
const RECENT: usize = 64;

/// A fixed-capacity ring of the newest samples.
#[derive(Debug, Default, Clone)]
struct Ring {
    samples: VecDeque<f64>,
    capacity: usize,
    /// Every sample ever added, including those rotated out.
    total: u64,
}

impl Ring {
    fn with_capacity(capacity: usize) -> Self {
        Self {
            samples: VecDeque::with_capacity(capacity.min(1024)),
            capacity,
            total: 0,
        }
    }

    fn push(&mut self, value: f64) {
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back(value);
        self.total += 1;
    }

    fn summary(&self) -> Summary {
        let mut sorted: Vec<f64> = self.samples.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        let quantile = |q: f64| {
            if sorted.is_empty() {
                0.0
            } else {
                sorted[((sorted.len() - 1) as f64 * q).round() as usize]
            }
        };
        Summary {
            count: self.total,
            p50: quantile(0.5),
            p95: quantile(0.95),
            mean: if sorted.is_empty() {
                0.0
            } else {
                sorted.iter().sum::<f64>() / sorted.len() as f64
            },
            last: self.samples.back().copied(),
        }
    }
}

/// Upper bounds (ms) of the cumulative histograms Prometheus scrapes; +Inf is implied.
pub const TTFT_BUCKETS_MS: [f64; 12] = [
    5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0,
];
pub const ITL_BUCKETS_MS: [f64; 11] = [
    1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0,
];

/// An all-time cumulative histogram (unlike the rings, it never forgets).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Histogram {
    /// `(upper bound ms, samples <= bound)`, cumulative.
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    pub sum: f64,
}

impl Histogram {
    fn new(bounds: &[f64]) -> Self {
        Self {
            buckets: bounds.iter().map(|&bound| (bound, 0)).collect(),
            count: 0,
            sum: 0.0,
        }
    }

    fn observe(&mut self, value: f64) {
        for (bound, count) in &mut self.buckets {
            if value <= *bound {
                *count += 1;
            }
        }
        self.count += 1;
        self.sum += value;
    }
}

/// Distribution of a latency in milliseconds over the kept samples; `count` is all-time.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Summary {
    pub count: u64,
    pub p50: f64,
    pub p95: f64,
    pub mean: f64,
    pub last: Option<f64>,
}

/// One finished request, as listed in `recent`.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    /// The caller's id for the request (the server's response id), when it gave one.
    pub id: Option<String>,
    pub model: String,
    pub ttft_ms: f64,
    pub itl_p50_ms: f64,
    /// Every inter-token gap, in order (capped at [`RECENT_ITL`] entries) for sparklines.
    pub itl_ms: Vec<f64>,
    pub tokens_in: usize,
    pub tokens_out: usize,
    pub cached_tokens: usize,
    /// Tokens speculative decoding drafted, and how many the model kept.
    pub draft_tokens: usize,
    pub accepted_tokens: usize,
    pub finish_reason: FinishReason,
    /// Unix time in milliseconds.
    pub ended: u64,
}

#[derive(Debug)]
struct ModelState {
    ttft: Ring,
    itl: Ring,
    ttft_histogram: Histogram,
    itl_histogram: Histogram,
    requests: u64,
    tokens_in: u64,
    tokens_out: u64,
    prefix_hits: u64,
    disk_hits: u64,
    draft_tokens: u64,
    accepted_tokens: u64,
    prefix_misses: u64,
    prefix_evictions: u64,
    prefix_bytes: u64,
}

#[derive(Debug, Default)]
struct State {
    models: BTreeMap<String, ModelState>,
    recent: VecDeque<RequestRecord>,
    errors: BTreeMap<String, u64>,
}

/// The engine's counters; shared behind an `Arc`.
#[derive(Debug, Default)]
pub struct Metrics {
    state: Mutex<State>,
    in_flight: AtomicUsize,
    kv_bytes: AtomicU64,
    prefix_cache_bytes: AtomicU64,
    prefix_snapshot_bytes: AtomicU64,
    prefix_snapshots: AtomicUsize,
    prefix_budget_bytes: AtomicU64,
    prefix_snapshot_budget_bytes: AtomicU64,
    prefix_trimmed: AtomicU64,
}

/// Per-model figures in a snapshot.
#[derive(Debug, Clone, Serialize)]
pub struct ModelSnapshot {
    pub model_id: String,
    pub requests: u64,
    pub tokens_in: u64,
    pub tokens_out: u64,
    /// Requests whose prefix came from RAM.
    pub prefix_cache_hits: u64,
    /// Requests whose prefix was read back from the disk cache (RAM had less).
    pub disk_cache_hits: u64,
    /// Requests that found no prefix in RAM or on disk.
    pub prefix_cache_misses: u64,
    /// Tokens speculative decoding drafted for finished requests, and how many were kept.
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    pub prefix_cache_evictions: u64,
    /// Bytes the prefix cache keeps for this model.
    pub prefix_cache_bytes: u64,
    pub ttft_ms: Summary,
    pub itl_ms: Summary,
    #[serde(skip)]
    pub ttft_histogram: Histogram,
    #[serde(skip)]
    pub itl_histogram: Histogram,
}

/// Everything at one instant; the JSON shape `/metrics/cache` serves (docs/SERVER.md).
#[derive(Debug, Clone, Serialize)]
pub struct MetricsSnapshot {
    pub models: Vec<ModelSnapshot>,
    pub recent: Vec<RequestRecord>,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub queue_depth: usize,
    pub in_flight: usize,
    /// KV bytes of requests running now.
    pub kv_cache_bytes: u64,
    /// KV bytes kept for reuse by the prefix cache (snapshots included).
    pub prefix_cache_bytes: u64,
    /// Recurrent-model snapshots kept (Qwen3.5 / 3.6, one per message boundary) and their bytes.
    pub prefix_snapshots: usize,
    pub prefix_snapshot_bytes: u64,
    /// The budgets of the prefix cache's KV entries and snapshots (set, or sized for agents).
    pub prefix_cache_budget_bytes: u64,
    pub prefix_snapshot_budget_bytes: u64,
    /// KV entries stored shorter than they came, to fit the budget.
    pub prefix_cache_trimmed: u64,
    pub mlx_active_bytes: u64,
    pub mlx_peak_bytes: u64,
    pub mlx_cache_bytes: u64,
    pub error_counts: BTreeMap<String, u64>,
    /// The disk prefix cache (None when off).
    pub disk_cache: Option<crate::disk_cache::DiskStats>,
}

/// Where a request's cached prefix came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefixSource {
    Ram,
    Disk,
    None,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_millis() as u64)
        .unwrap_or(0)
}

impl Metrics {
    fn with_model<T>(&self, model: &str, update: impl FnOnce(&mut ModelState) -> T) -> T {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let entry = state
            .models
            .entry(model.to_string())
            .or_insert_with(|| ModelState {
                ttft: Ring::with_capacity(TTFT_RING),
                itl: Ring::with_capacity(ITL_RING),
                ttft_histogram: Histogram::new(&TTFT_BUCKETS_MS),
                itl_histogram: Histogram::new(&ITL_BUCKETS_MS),
                requests: 0,
                tokens_in: 0,
                tokens_out: 0,
                prefix_hits: 0,
                disk_hits: 0,
                draft_tokens: 0,
                accepted_tokens: 0,
                prefix_misses: 0,
                prefix_evictions: 0,
                prefix_bytes: 0,
            });
        update(entry)
    }

    /// The one place a finished request is counted: one TTFT sample when a token came out,
    /// one ITL sample per later token, tokens as in the usage the client sees.
    pub fn record_completion(&self, model: &str, id: Option<&str>, completion: &Completion) {
        let gaps = &completion.timings.itl_ms;
        let record = RequestRecord {
            id: id.map(str::to_string),
            model: model.to_string(),
            itl_ms: gaps[..gaps.len().min(RECENT_ITL)].to_vec(),
            ttft_ms: completion.timings.ttft_ms,
            itl_p50_ms: {
                let mut itl = completion.timings.itl_ms.clone();
                itl.sort_by(f64::total_cmp);
                itl.get(itl.len() / 2).copied().unwrap_or(0.0)
            },
            tokens_in: completion.prompt_tokens,
            tokens_out: completion.completion_tokens,
            cached_tokens: completion.cached_tokens,
            draft_tokens: completion.timings.draft_tokens,
            accepted_tokens: completion.timings.accepted_tokens,
            finish_reason: completion.finish_reason,
            ended: now_ms(),
        };
        self.with_model(model, |entry| {
            entry.requests += 1;
            entry.tokens_in += completion.prompt_tokens as u64;
            entry.tokens_out += completion.completion_tokens as u64;
            entry.draft_tokens += completion.timings.draft_tokens as u64;
            entry.accepted_tokens += completion.timings.accepted_tokens as u64;
            if completion.completion_tokens > 0 {
                entry.ttft.push(completion.timings.ttft_ms);
                entry.ttft_histogram.observe(completion.timings.ttft_ms);
            }
            for &gap in &completion.timings.itl_ms {
                entry.itl.push(gap);
                entry.itl_histogram.observe(gap);
            }
        });
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        if state.recent.len() == RECENT {
            state.recent.pop_front();
        }
        state.recent.push_back(record);
    }

    /// Counts a failed request by the error's kind (e.g. `context_overflow`).
    pub fn record_error(&self, kind: &str) {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        *state.errors.entry(kind.to_string()).or_default() += 1;
    }

    pub fn record_prefix_lookup(&self, model: &str, source: PrefixSource) {
        self.with_model(model, |entry| match source {
            PrefixSource::Ram => entry.prefix_hits += 1,
            PrefixSource::Disk => entry.disk_hits += 1,
            PrefixSource::None => entry.prefix_misses += 1,
        });
    }

    pub fn record_prefix_evictions(&self, model: &str, evicted: u64) {
        self.with_model(model, |entry| entry.prefix_evictions += evicted);
    }

    /// Bytes the prefix cache keeps for `model` (None: a model no request named yet).
    pub(crate) fn set_model_prefix_bytes(&self, model: Option<&String>, bytes: u64) {
        if let Some(model) = model {
            self.with_model(model, |entry| entry.prefix_bytes = bytes);
        }
    }

    pub(crate) fn set_in_flight(&self, running: usize, kv_bytes: u64) {
        self.in_flight.store(running, Ordering::Relaxed);
        self.kv_bytes.store(kv_bytes, Ordering::Relaxed);
    }

    pub(crate) fn set_prefix_cache_usage(&self, usage: crate::prefix_cache::CacheUsage) {
        self.prefix_cache_bytes
            .store(usage.bytes + usage.snapshot_bytes, Ordering::Relaxed);
        self.prefix_snapshot_bytes
            .store(usage.snapshot_bytes, Ordering::Relaxed);
        self.prefix_snapshots
            .store(usage.snapshots, Ordering::Relaxed);
        self.prefix_budget_bytes
            .store(usage.budget_bytes, Ordering::Relaxed);
        self.prefix_snapshot_budget_bytes
            .store(usage.snapshot_budget_bytes, Ordering::Relaxed);
        self.prefix_trimmed.store(usage.trimmed, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        let state = self
            .state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let models: Vec<ModelSnapshot> = state
            .models
            .iter()
            .map(|(id, entry)| ModelSnapshot {
                model_id: id.clone(),
                requests: entry.requests,
                tokens_in: entry.tokens_in,
                tokens_out: entry.tokens_out,
                prefix_cache_hits: entry.prefix_hits,
                disk_cache_hits: entry.disk_hits,
                prefix_cache_misses: entry.prefix_misses,
                draft_tokens: entry.draft_tokens,
                accepted_tokens: entry.accepted_tokens,
                prefix_cache_evictions: entry.prefix_evictions,
                prefix_cache_bytes: entry.prefix_bytes,
                ttft_ms: entry.ttft.summary(),
                itl_ms: entry.itl.summary(),
                ttft_histogram: entry.ttft_histogram.clone(),
                itl_histogram: entry.itl_histogram.clone(),
            })
            .collect();
        let memory = mlx_memory();
        MetricsSnapshot {
            tokens_in: models.iter().map(|m| m.tokens_in).sum(),
            tokens_out: models.iter().map(|m| m.tokens_out).sum(),
            models,
            recent: state.recent.iter().cloned().collect(),
            // Filled in by `Engine::metrics`, which owns the queue.
            queue_depth: 0,
            in_flight: self.in_flight.load(Ordering::Relaxed),
            kv_cache_bytes: self.kv_bytes.load(Ordering::Relaxed),
            prefix_cache_bytes: self.prefix_cache_bytes.load(Ordering::Relaxed),
            prefix_snapshots: self.prefix_snapshots.load(Ordering::Relaxed),
            prefix_snapshot_bytes: self.prefix_snapshot_bytes.load(Ordering::Relaxed),
            prefix_cache_budget_bytes: self.prefix_budget_bytes.load(Ordering::Relaxed),
            prefix_snapshot_budget_bytes: self.prefix_snapshot_budget_bytes.load(Ordering::Relaxed),
            prefix_cache_trimmed: self.prefix_trimmed.load(Ordering::Relaxed),
            mlx_active_bytes: memory.0,
            mlx_peak_bytes: memory.1,
            mlx_cache_bytes: memory.2,
            error_counts: state.errors.clone(),
            disk_cache: None,
        }
    }
}

impl MetricsSnapshot {
    /// The Prometheus text exposition format (version 0.0.4) of this snapshot.
    pub fn to_prometheus(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let mut family = |name: &str, kind: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        family("rmlx_requests_total", "counter", "Finished requests.");
        family(
            "rmlx_tokens_in_total",
            "counter",
            "Prompt tokens of finished requests.",
        );
        family(
            "rmlx_tokens_out_total",
            "counter",
            "Generated tokens of finished requests.",
        );
        family(
            "rmlx_prefix_cache_hits_total",
            "counter",
            "Requests that reused cached prompt KV.",
        );
        family(
            "rmlx_disk_cache_hits_total",
            "counter",
            "Requests whose prompt KV was read back from the disk cache.",
        );
        family(
            "rmlx_prefix_cache_misses_total",
            "counter",
            "Requests that found no cached prefix in RAM or on disk.",
        );
        family(
            "rmlx_prefix_cache_evictions_total",
            "counter",
            "Prefix-cache entries evicted.",
        );
        family(
            "rmlx_draft_tokens_total",
            "counter",
            "Tokens speculative decoding drafted.",
        );
        family(
            "rmlx_accepted_tokens_total",
            "counter",
            "Drafted tokens the model kept.",
        );
        family(
            "rmlx_ttft_ms",
            "histogram",
            "Time to first token, milliseconds.",
        );
        family(
            "rmlx_itl_ms",
            "histogram",
            "Inter-token latency, milliseconds.",
        );
        family("rmlx_errors_total", "counter", "Failed requests by kind.");
        family(
            "rmlx_queue_depth",
            "gauge",
            "Requests waiting for the engine.",
        );
        family("rmlx_in_flight", "gauge", "Requests generating now.");
        family(
            "rmlx_kv_cache_bytes",
            "gauge",
            "KV bytes of running requests.",
        );
        family(
            "rmlx_prefix_cache_bytes",
            "gauge",
            "KV bytes kept for prefix reuse.",
        );
        family("rmlx_mlx_active_bytes", "gauge", "MLX active memory.");
        family("rmlx_mlx_peak_bytes", "gauge", "MLX peak memory.");
        family(
            "rmlx_mlx_cache_bytes",
            "gauge",
            "Freed buffers MLX keeps for reuse (given back when the engine goes idle).",
        );
        for model in &self.models {
            let label = format!("model=\"{}\"", escape_label(&model.model_id));
            for (name, value) in [
                ("rmlx_requests_total", model.requests),
                ("rmlx_tokens_in_total", model.tokens_in),
                ("rmlx_tokens_out_total", model.tokens_out),
                ("rmlx_prefix_cache_hits_total", model.prefix_cache_hits),
                ("rmlx_disk_cache_hits_total", model.disk_cache_hits),
                ("rmlx_prefix_cache_misses_total", model.prefix_cache_misses),
                (
                    "rmlx_prefix_cache_evictions_total",
                    model.prefix_cache_evictions,
                ),
                ("rmlx_draft_tokens_total", model.draft_tokens),
                ("rmlx_accepted_tokens_total", model.accepted_tokens),
            ] {
                let _ = writeln!(out, "{name}{{{label}}} {value}");
            }
            for (name, histogram) in [
                ("rmlx_ttft_ms", &model.ttft_histogram),
                ("rmlx_itl_ms", &model.itl_histogram),
            ] {
                for (bound, count) in &histogram.buckets {
                    let _ = writeln!(out, "{name}_bucket{{{label},le=\"{bound}\"}} {count}");
                }
                let _ = writeln!(
                    out,
                    "{name}_bucket{{{label},le=\"+Inf\"}} {}",
                    histogram.count
                );
                let _ = writeln!(out, "{name}_sum{{{label}}} {}", histogram.sum);
                let _ = writeln!(out, "{name}_count{{{label}}} {}", histogram.count);
            }
        }
        for (kind, count) in &self.error_counts {
            let _ = writeln!(
                out,
                "rmlx_errors_total{{kind=\"{}\"}} {count}",
                escape_label(kind)
            );
        }
        for (name, value) in [
            ("rmlx_queue_depth", self.queue_depth as u64),
            ("rmlx_in_flight", self.in_flight as u64),
            ("rmlx_kv_cache_bytes", self.kv_cache_bytes),
            ("rmlx_prefix_cache_bytes", self.prefix_cache_bytes),
            ("rmlx_mlx_active_bytes", self.mlx_active_bytes),
            ("rmlx_mlx_peak_bytes", self.mlx_peak_bytes),
            ("rmlx_mlx_cache_bytes", self.mlx_cache_bytes),
        ] {
            let _ = writeln!(out, "{name} {value}");
        }
        if let Some(disk) = &self.disk_cache {
            let _ = writeln!(out, "# HELP rmlx_disk_cache_bytes Bytes the disk prefix cache holds.\n# TYPE rmlx_disk_cache_bytes gauge");
            let _ = writeln!(out, "rmlx_disk_cache_bytes {}", disk.bytes_on_disk);
            let _ = writeln!(out, "# HELP rmlx_disk_cache_budget_bytes Bytes the disk prefix cache may hold.\n# TYPE rmlx_disk_cache_budget_bytes gauge");
            let _ = writeln!(out, "rmlx_disk_cache_budget_bytes {}", disk.budget_bytes);
            for (name, help, value) in [
                (
                    "rmlx_disk_cache_read_bytes_total",
                    "Bytes read back from the disk prefix cache.",
                    disk.read_bytes,
                ),
                (
                    "rmlx_disk_cache_written_bytes_total",
                    "Bytes written to the disk prefix cache.",
                    disk.written_bytes,
                ),
                (
                    "rmlx_disk_cache_evicted_files_total",
                    "Disk prefix cache files evicted for the budget.",
                    disk.evicted_files,
                ),
                (
                    "rmlx_disk_cache_evicted_bytes_total",
                    "Bytes evicted from the disk prefix cache.",
                    disk.evicted_bytes,
                ),
            ] {
                let _ = writeln!(
                    out,
                    "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
                );
            }
        }
        out
    }
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Starts MLX's peak-memory counter again from what is active now (for a benchmark that
/// reports one arm's peak); shared by every engine in the process.
pub fn reset_mlx_peak() {
    if mlx_sys::load().is_ok() {
        // SAFETY: MLX is loaded; the reset stores to the allocator's counter under its lock.
        unsafe { mlx_sys::mlx_reset_peak_memory() };
    }
}

/// MLX's allocator counters (active, peak, buffer cache); thread-safe reads in MLX.
pub fn mlx_memory() -> (u64, u64, u64) {
    if mlx_sys::load().is_err() {
        return (0, 0, 0);
    }
    let (mut active, mut peak, mut cache) = (0usize, 0usize, 0usize);
    // SAFETY: MLX is loaded; the getters only read atomic counters.
    unsafe {
        mlx_sys::mlx_get_active_memory(&mut active);
        mlx_sys::mlx_get_peak_memory(&mut peak);
        mlx_sys::mlx_get_cache_memory(&mut cache);
    }
    (active as u64, peak as u64, cache as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::Timings;

    fn completion(tokens: usize, ttft: f64) -> Completion {
        Completion {
            text: String::new(),
            prompt_ids: vec![1, 2, 3],
            token_ids: vec![7; tokens],
            finish_reason: FinishReason::Length,
            prompt_tokens: 3,
            completion_tokens: tokens,
            logprobs: None,
            stop_sequence: None,
            cached_tokens: 0,
            batched_with: 1,
            timings: Timings {
                ttft_ms: ttft,
                itl_ms: vec![2.0; tokens.saturating_sub(1)],
                ..Timings::default()
            },
        }
    }

    #[test]
    fn one_ttft_and_n_minus_one_itl_per_request() {
        let metrics = Metrics::default();
        metrics.record_completion("m", None, &completion(5, 10.0));
        metrics.record_completion("m", None, &completion(1, 30.0));
        metrics.record_completion("m", None, &completion(0, 0.0));
        let snapshot = metrics.snapshot();
        let model = &snapshot.models[0];
        assert_eq!(model.requests, 3);
        assert_eq!(model.ttft_ms.count, 2);
        assert_eq!(model.ttft_ms.last, Some(30.0));
        assert_eq!(model.itl_ms.count, 4);
        assert_eq!((model.tokens_in, model.tokens_out), (9, 6));
        assert_eq!(snapshot.recent.len(), 3);
    }

    #[test]
    fn prometheus_text_has_histograms_and_counters() {
        let metrics = Metrics::default();
        metrics.record_completion("org/m\"x", None, &completion(3, 12.0));
        metrics.record_error("queue_full");
        let text = metrics.snapshot().to_prometheus();
        let label = "model=\"org/m\\\"x\"";
        assert!(
            text.contains(&format!("rmlx_requests_total{{{label}}} 1")),
            "{text}"
        );
        assert!(
            text.contains(&format!("rmlx_ttft_ms_bucket{{{label},le=\"10\"}} 0")),
            "{text}"
        );
        assert!(
            text.contains(&format!("rmlx_ttft_ms_bucket{{{label},le=\"25\"}} 1")),
            "{text}"
        );
        assert!(
            text.contains(&format!("rmlx_itl_ms_count{{{label}}} 2")),
            "{text}"
        );
        assert!(
            text.contains(&format!("rmlx_itl_ms_sum{{{label}}} 4")),
            "{text}"
        );
        assert!(
            text.contains("rmlx_errors_total{kind=\"queue_full\"} 1"),
            "{text}"
        );
        assert!(text.contains("# TYPE rmlx_ttft_ms histogram"));
    }

    #[test]
    fn rings_stay_bounded_and_quantiles_are_of_the_kept_samples() {
        let mut ring = Ring::with_capacity(4);
        for value in [100.0, 1.0, 2.0, 3.0, 4.0] {
            ring.push(value);
        }
        let summary = ring.summary();
        assert_eq!(summary.count, 5);
        assert_eq!((summary.p50, summary.p95, summary.mean), (3.0, 4.0, 2.5));
    }
}
