//! Depth control: how many tokens a request drafts per step, from what it measured. A step of
//! k + 1 tokens keeps on average E(k) = 1 + a + a² + … + a^k of them (a: the chance the next draft
//! is kept, given the one before was), and costs c(k) against a plain step's c(0); the controller
//! drafts the k in 0..=K with the most tokens per unit of cost, E(k) / c(k). In a batch of B rows
//! the wider step costs every row: it is the batch's tokens per unit of cost, (B − 1 + E(k)) /
//! (B · c(k)), so drafting pays in a batch only where the wider step is nearly free; costs are
//! kept per batch size class (what a step costs alone says little about a step of 8 rows). Where speculation
//! loses (drafts seldom right, or a compute-bound machine where the wider step costs nearly k + 1
//! plain ones) that is k = 0, plain decode: the row then probes one drafting step at growing
//! intervals, so a proposer that turned right again is noticed.
//! Reference: Ollama `x/mlxrunner/speculate_depth.go` (committed tokens per wall-second from
//! measured per-depth cost), oMLX `batch_policy.py` (parks after losing decisions).

/// Weight of history in the running estimates (each step's observation gets 1 − this).
const KEEP: f64 = 0.9;
/// How much more per unit of cost drafting must keep than plain decode to be chosen: what a
/// row measures leaves out what its wider step costs the other rows of its batch.
const MARGIN: f64 = 0.1;
/// Plain steps before the first probe after the controller switched drafting off; each probe
/// that still loses doubles the wait, up to [`MAX_PROBE_EVERY`].
const FIRST_PROBE_EVERY: usize = 16;
pub const MAX_PROBE_EVERY: usize = 256;

#[derive(Debug, Clone)]
pub struct DepthControl {
    max: usize,
    /// Decayed counts of drafts kept and drafts tried (each kept one, and the first rejected).
    kept: f64,
    tried: f64,
    /// Running cost of a step of `width` tokens, `width - 1` the index (0: a plain step), ms,
    /// per batch size class ([`size_class`]): a step's cost depends on how many rows share it.
    costs: [Vec<Option<f64>>; SIZE_CLASSES],
    /// The batch size of the latest step asked for (what plain steps' costs are filed under).
    rows: usize,
    /// Plain steps since drafting last stopped paying, and the wait before the next probe.
    idle: usize,
    probe_every: usize,
}

impl DepthControl {
    /// Up to `max` drafts per step; it starts drafting (a light prior: half a draft kept in
    /// one) and measures from there.
    pub fn new(max: usize) -> Self {
        Self {
            max,
            kept: 0.5,
            tried: 1.0,
            costs: std::array::from_fn(|_| vec![None; max + 1]),
            rows: 1,
            idle: 0,
            probe_every: FIRST_PROBE_EVERY,
        }
    }

    /// The chance a draft is kept given the one before was, as measured.
    pub fn acceptance(&self) -> f64 {
        self.kept / self.tried.max(1e-9)
    }

    /// A step of `width` tokens against a plain step; before both are measured, a prior that
    /// fits a bandwidth-bound step (each extra token 10 % of a plain step). Never below 1: a
    /// wider step does more work, and a tiny model's measured steps are mostly noise.
    fn relative_cost(&self, width: usize, rows: usize) -> f64 {
        let costs = &self.costs[size_class(rows)];
        match (costs[0], costs.get(width - 1).copied().flatten()) {
            (Some(plain), Some(wide)) if plain > 0.0 => (wide / plain).max(1.0),
            _ => 1.0 + 0.1 * (width - 1) as f64,
        }
    }

    /// The depth that keeps the most tokens per unit of cost now, for a row decoding in a
    /// batch of `rows` (0: plain decode).
    pub fn best_depth(&self, rows: usize) -> usize {
        let rows = rows.max(1) as f64;
        let a = self.acceptance();
        let mut expected = 1.0;
        let mut power = 1.0;
        // Drafting must beat plain decode by a margin, not by noise in the measured costs.
        let (mut best, mut best_rate) = (0, 1.0 + MARGIN);
        for k in 1..=self.max {
            power *= a;
            expected += power;
            let cost = self.relative_cost(k + 1, rows as usize);
            let rate = (rows - 1.0 + expected) / (rows * cost);
            if rate > best_rate {
                (best, best_rate) = (k, rate);
            }
        }
        best
    }

    /// Drafts to ask for this step in a batch of `rows`: the best depth, or while that is 0, a
    /// probe of depth 1 once the wait since the last has passed (`rows` times longer in a batch).
    pub fn next_depth(&mut self, rows: usize) -> usize {
        self.rows = rows.max(1);
        let best = self.best_depth(rows);
        if best > 0 || self.max == 0 {
            self.idle = 0;
            self.probe_every = FIRST_PROBE_EVERY;
            return best;
        }
        self.idle += 1;
        // A probe widens the step of every row of the batch: among more rows, probe less often.
        if self.idle < self.probe_every * rows.max(1) {
            return 0;
        }
        self.idle = 0;
        self.probe_every = (self.probe_every * 2).min(MAX_PROBE_EVERY);
        1
    }

    /// A speculative step that drafted `drafted` tokens, kept `kept` of them, and took `ms`
    /// for `width` tokens per row.
    pub fn observe_step(&mut self, drafted: usize, kept: usize, width: usize, ms: f64) {
        if drafted > 0 {
            let rejected = usize::from(kept < drafted);
            self.kept = KEEP * self.kept + kept as f64;
            self.tried = KEEP * self.tried + (kept + rejected) as f64;
        }
        self.observe_cost(width, ms);
    }

    /// A plain step's cost (the gap before its token).
    pub fn observe_plain(&mut self, ms: f64) {
        self.observe_cost(1, ms);
    }

    fn observe_cost(&mut self, width: usize, ms: f64) {
        let class = size_class(self.rows);
        if let Some(slot) = self.costs[class].get_mut(width.max(1) - 1) {
            *slot = Some(match *slot {
                Some(cost) => KEEP * cost + (1.0 - KEEP) * ms,
                None => ms,
            });
        }
    }
}

/// Batch sizes whose steps cost alike: 1, 2-3, 4-7, 8 and more.
const SIZE_CLASSES: usize = 4;

fn size_class(rows: usize) -> usize {
    match rows {
        0 | 1 => 0,
        2..=3 => 1,
        4..=7 => 2,
        _ => 3,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drafts never kept: drafting stops within 8 steps, then probes at doubling intervals.
    #[test]
    fn an_always_wrong_proposer_is_switched_off_and_probed_rarely() {
        let mut control = DepthControl::new(4);
        let mut steps_until_off = None;
        for step in 0..8 {
            let k = control.next_depth(1);
            if k == 0 {
                steps_until_off = Some(step);
                break;
            }
            // Bandwidth-bound costs: a wider step costs little more.
            control.observe_step(k, 0, k + 1, 10.0 + k as f64);
            control.observe_plain(10.0);
        }
        let off = steps_until_off.expect("drafting still on after 8 wrong steps");
        assert!(off <= 8, "{off}");
        // The next 1000 steps: probes only, ever rarer.
        let mut probes = Vec::new();
        for step in 0..1000 {
            let k = control.next_depth(1);
            if k > 0 {
                probes.push(step);
                control.observe_step(k, 0, k + 1, 11.0);
            } else {
                control.observe_plain(10.0);
            }
        }
        assert!(probes.len() <= 14, "{} probes: {probes:?}", probes.len());
        let gaps: Vec<usize> = probes.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.windows(2).all(|w| w[1] >= w[0]), "{gaps:?}");
        assert_eq!(*gaps.last().unwrap(), MAX_PROBE_EVERY);
    }

    /// Drafts always kept on a bandwidth-bound machine: the full depth. On a compute-bound one
    /// (a step of k + 1 tokens costs k + 1 plain ones) nothing pays, even when drafts are right
    /// half the time.
    #[test]
    fn depth_follows_acceptance_and_cost() {
        let mut control = DepthControl::new(4);
        for _ in 0..20 {
            let k = control.next_depth(1);
            control.observe_step(k, k, k + 1, 10.0 + k as f64);
            control.observe_plain(10.0);
        }
        assert_eq!(control.best_depth(1), 4);

        let mut control = DepthControl::new(4);
        for step in 0..40 {
            let k = control.next_depth(1).max(1);
            control.observe_step(k, usize::from(step % 2 == 0), k + 1, 10.0 * (k + 1) as f64);
            control.observe_plain(10.0);
        }
        assert_eq!(control.best_depth(1), 0);
    }

    /// In a batch the wider step costs every row: drafts always kept and a step of 5 tokens
    /// costing 1.6 plain ones pays alone, not among 8 rows.
    #[test]
    fn a_batch_drafts_only_where_the_wider_step_is_nearly_free() {
        let mut control = DepthControl::new(4);
        for _ in 0..20 {
            let k = control.next_depth(1).max(1);
            control.observe_step(k, k, k + 1, 10.0 + 1.5 * k as f64);
            control.observe_plain(10.0);
        }
        assert!(control.best_depth(1) > 0);
        assert_eq!(control.best_depth(8), 0);
    }

    /// A proposer that turns right again after a wrong spell is picked up by a probe.
    #[test]
    fn a_probe_turns_drafting_back_on() {
        let mut control = DepthControl::new(4);
        while control.next_depth(1) > 0 {
            control.observe_step(1, 0, 2, 11.0);
            control.observe_plain(10.0);
        }
        let mut on_again = None;
        for step in 0..200 {
            let k = control.next_depth(1);
            if k > 0 {
                control.observe_step(k, k, k + 1, 10.0 + k as f64);
                if control.best_depth(1) > 0 {
                    on_again = Some(step);
                    break;
                }
            } else {
                control.observe_plain(10.0);
            }
        }
        assert!(on_again.is_some(), "drafting never came back");
    }
}
