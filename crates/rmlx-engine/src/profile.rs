//! Where a decode step's wall time goes, by batch width and tokens per row (1 for a plain step;
//! 1 + drafts for a speculative one): building the lazy graph (the model's forward, the draft
//! head's drafts and the sampling ops), handing it to MLX (`async_eval`: on a GPU this is where
//! every kernel is encoded; a speculative step is handed over the same way while profiled),
//! waiting for the tokens, and the engine loop's other work between steps (prefill chunks,
//! joins, sending text; a speculative step's acceptance and cache rollback). For `rmlx bench
//! --step-profile`; off unless enabled, and then only clock reads.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex,
    },
    time::{Duration, Instant},
};

static ENABLED: AtomicBool = AtomicBool::new(false);
static STEPS: Mutex<Option<Profile>> = Mutex::new(None);

/// A step's shape: rows, and tokens each row feeds.
pub type StepShape = (usize, usize);

/// Totals of the steps taken at one shape.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Phases {
    pub steps: u64,
    /// Building the step's graph.
    pub build: Duration,
    /// `async_eval` of it.
    pub submit: Duration,
    /// Reading the tokens that were ready (waiting for the device).
    pub read: Duration,
    /// From the previous step's end to this step's start.
    pub between: Duration,
}

#[derive(Default)]
struct Profile {
    by_shape: BTreeMap<StepShape, Phases>,
    last_end: Option<Instant>,
}

/// Starts (or restarts) recording.
pub fn enable() {
    *STEPS.lock().unwrap_or_else(|e| e.into_inner()) = Some(Profile::default());
    ENABLED.store(true, Ordering::SeqCst);
}

/// Stops recording and returns the totals by step shape.
pub fn take() -> BTreeMap<StepShape, Phases> {
    ENABLED.store(false, Ordering::SeqCst);
    STEPS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .map(|profile| profile.by_shape)
        .unwrap_or_default()
}

/// The engine has nothing to do: the next step's "between" starts when work arrives, not at
/// the last step's end.
pub(crate) fn idle() {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    if let Some(profile) = STEPS.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        profile.last_end = None;
    }
}

/// The clock of one step; `None` (and free) while recording is off.
pub(crate) struct StepClock {
    start: Instant,
    built: Option<Instant>,
    submitted: Option<Instant>,
}

impl StepClock {
    pub(crate) fn start() -> Option<Self> {
        ENABLED.load(Ordering::Relaxed).then(|| Self {
            start: Instant::now(),
            built: None,
            submitted: None,
        })
    }

    pub(crate) fn built(&mut self) {
        self.built = Some(Instant::now());
    }

    pub(crate) fn submitted(&mut self) {
        self.submitted = Some(Instant::now());
    }

    /// Ends the step of `rows` rows feeding `width` tokens each (a step with nothing to
    /// compute only reads).
    pub(crate) fn finish(self, rows: usize, width: usize) {
        let end = Instant::now();
        let built = self.built.unwrap_or(self.start);
        let submitted = self.submitted.unwrap_or(built);
        let mut guard = STEPS.lock().unwrap_or_else(|e| e.into_inner());
        let Some(profile) = guard.as_mut() else {
            return;
        };
        let between = profile
            .last_end
            .map(|last| self.start.saturating_duration_since(last))
            .unwrap_or_default();
        profile.last_end = Some(end);
        let phases = profile.by_shape.entry((rows, width)).or_default();
        phases.steps += 1;
        phases.build += built - self.start;
        phases.submit += submitted - built;
        phases.read += end - submitted;
        phases.between += between;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_add_up_by_width_and_nothing_is_kept_when_off() {
        assert!(StepClock::start().is_none());
        enable();
        for rows in [1, 2, 2] {
            let mut clock = StepClock::start().expect("enabled");
            std::thread::sleep(Duration::from_millis(2));
            clock.built();
            clock.submitted();
            std::thread::sleep(Duration::from_millis(1));
            clock.finish(rows, 1);
        }
        let profile = take();
        // Other tests of this crate may decode meanwhile and add steps of their own.
        assert!(profile[&(1, 1)].steps >= 1);
        assert!(profile[&(2, 1)].steps >= 2);
        assert!(profile[&(2, 1)].build >= Duration::from_millis(4));
        assert!(profile[&(2, 1)].read >= Duration::from_millis(2));
        assert!(StepClock::start().is_none());
        assert!(take().is_empty());
    }
}
