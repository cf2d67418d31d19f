//! What a request carries on the engine thread from submission to its end.

use std::sync::{
    atomic::{AtomicBool, AtomicUsize, Ordering},
    mpsc, Arc,
};

use crate::{error::EngineError, metrics::Metrics};

use super::{Event, Step};

/// What a request carries from submission to its end.
pub(super) struct Ticket {
    pub(super) events: mpsc::Sender<Event>,
    pub(super) cancel: Arc<AtomicBool>,
    pub(super) model_id: String,
    pub(super) request_id: Option<String>,
    /// Whether its KV goes to the prefix cache when it ends (not when cancelled).
    pub(super) keep_kv: bool,
    /// With images: the prompt as the prefix cache keys it, each image's soft tokens (one id for
    /// every image) replaced by ids drawn from a digest of its pixels.
    pub(super) image_key: Option<Vec<u32>>,
    /// The engine's count of unfinished requests, settled when this one ends.
    pub(super) queued: Arc<AtomicUsize>,
    pub(super) metrics: Arc<Metrics>,
    /// Set by [`Ticket::settle`]; a ticket dropped open was lost to a panic (see `Drop`).
    pub(super) closed: bool,
    pub(super) panic_at: Option<Step>,
    /// The engine's own warm-up (`warm_up.rs`): kept out of metrics and the prefix cache.
    pub(super) warm_up: bool,
}

impl Ticket {
    /// The request's end, first half: its counters settle (the caller then publishes the
    /// gauges), so the client, told by [`Ticket::send_last`], sees them idle.
    pub(super) fn settle(&mut self) {
        self.closed = true;
        settle(&self.queued);
    }

    pub(super) fn send_last(self, last: Event) {
        let _ = self.events.send(last);
    }
}

impl Drop for Ticket {
    /// Only a panic on the engine thread drops a ticket unclosed (its step's locals unwind):
    /// the client still gets a typed error and the counters still settle.
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        let error = EngineError::Internal(
            "the engine stopped serving this request after a bug (the server log has the \
             panic); the next request is unaffected"
                .into(),
        );
        self.metrics.record_error(error.kind());
        settle(&self.queued);
        let _ = self.events.send(Event::Error(error));
    }
}

/// One request fewer unfinished; MLX's buffer cache goes back to the system when none is left.
pub(super) fn settle(queued: &AtomicUsize) {
    if queued.fetch_sub(1, Ordering::SeqCst) == 1 {
        crate::runtime::release_cached_memory();
    }
}
