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
/// The share of plain decode's time probes may take while drafting is off.
const PROBE_BUDGET: f64 = 0.02;

/// Step costs per batch size class and width (see [`DepthControl`]'s `costs`).
type CostTable = [Vec<Option<f64>>; SIZE_CLASSES];

/// What one model's requests measured, shared by the next ones: what a step of k + 1 tokens
/// costs belongs to the machine and the model, not to one request (on a GPU where a
/// speculative step costs 2.5 plain ones, a new request does not spend its first steps
/// relearning that), and the share of drafts kept so far is a fair first guess for the next
/// request (an agent's turns look alike), worth [`PRIOR_DRAFTS`] drafts of its own evidence.
#[derive(Debug, Clone, Default)]
pub struct SharedCosts(std::sync::Arc<std::sync::Mutex<Shared>>);

#[derive(Debug, Clone, Default)]
struct Shared {
    costs: Option<CostTable>,
    /// Decayed counts of drafts kept and tried, over all requests.
    kept: f64,
    tried: f64,
}

/// How many drafts' worth of weight the model's acceptance has in a new request's estimate.
const PRIOR_DRAFTS: f64 = 2.0;

impl SharedCosts {
    fn snapshot(&self) -> Shared {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn record_acceptance(&self, kept: f64, tried: f64) {
        let mut shared = self.0.lock().unwrap_or_else(|e| e.into_inner());
        shared.kept = KEEP * shared.kept + kept;
        shared.tried = KEEP * shared.tried + tried;
    }

    fn record(&self, class: usize, index: usize, ms: f64) {
        let mut shared = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let table = shared
            .costs
            .get_or_insert_with(|| std::array::from_fn(|_| Vec::new()));
        let row = &mut table[class];
        if row.len() <= index {
            row.resize(index + 1, None);
        }
        // One slow step (a kernel compiled for a new shape, a prefill between steps) moves the
        // shared estimate by at most what a doubling would: requests that trust a cost too
        // high never draft at that width again to correct it.
        row[index] = Some(match row[index] {
            Some(cost) => KEEP * cost + (1.0 - KEEP) * ms.min(2.0 * cost),
            None => ms,
        });
    }
}

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
    /// The model's costs, read at the start and fed with every step measured.
    shared: Option<SharedCosts>,
}

impl DepthControl {
    /// Up to `max` drafts per step; it starts drafting (a light prior: half a draft kept in
    /// one) and measures from there.
    pub fn new(max: usize) -> Self {
        Self::sharing(max, None)
    }

    /// Like [`Self::new`], starting from the step costs other requests on the same model
    /// measured, and adding its own to them.
    pub fn sharing(max: usize, shared: Option<SharedCosts>) -> Self {
        let mut costs: CostTable = std::array::from_fn(|_| vec![None; max + 1]);
        let (mut kept, mut tried) = (0.5, 1.0);
        if let Some(known) = shared.as_ref().map(SharedCosts::snapshot) {
            for (own, known) in costs.iter_mut().zip(known.costs.into_iter().flatten()) {
                for (slot, cost) in own.iter_mut().zip(known) {
                    *slot = cost;
                }
            }
            if known.tried > 0.0 {
                (kept, tried) = (PRIOR_DRAFTS * known.kept / known.tried, PRIOR_DRAFTS);
            }
        }
        Self {
            max,
            kept,
            tried,
            costs,
            rows: 1,
            idle: 0,
            probe_every: FIRST_PROBE_EVERY,
            shared,
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
        if self.idle < self.probe_wait(rows) * rows.max(1) {
            return 0;
        }
        self.idle = 0;
        self.probe_every = (self.probe_every * 2).min(MAX_PROBE_EVERY);
        1
    }

    /// Another row of the batch widened this step while this row's choice was plain decode:
    /// the row drafts one token in columns the step computes anyway, a probe that costs
    /// nothing, and its wait for a probe of its own starts again. In a batch the rows' probes
    /// then come together, one widened step for all where each row's own would widen one each.
    pub fn join_widened(&mut self) -> usize {
        if self.max == 0 {
            return 0;
        }
        self.idle = 0;
        1
    }

    /// Plain steps to wait before the next probe: the doubling interval, or longer where a
    /// probe costs more than [`PROBE_BUDGET`] of the steps it waits (a draft head's probe first
    /// takes in every pair since its last step: three plain steps on the H100).
    fn probe_wait(&self, rows: usize) -> usize {
        let extra = self.relative_cost(2, rows) - 1.0;
        self.probe_every.max((extra / PROBE_BUDGET).ceil() as usize)
    }

    /// A speculative step that drafted `drafted` tokens, kept `kept` of them, and took `ms`
    /// for `width` tokens per row.
    pub fn observe_step(&mut self, drafted: usize, kept: usize, width: usize, ms: f64) {
        if drafted > 0 {
            let rejected = usize::from(kept < drafted);
            let tried = (kept + rejected) as f64;
            self.kept = KEEP * self.kept + kept as f64;
            self.tried = KEEP * self.tried + tried;
            if let Some(shared) = &self.shared {
                shared.record_acceptance(kept as f64, tried);
            }
        }
        self.observe_cost(width, ms);
    }

    /// A plain step's cost (the gap before its token).
    pub fn observe_plain(&mut self, ms: f64) {
        self.observe_cost(1, ms);
    }

    fn observe_cost(&mut self, width: usize, ms: f64) {
        let class = size_class(self.rows);
        let index = width.max(1) - 1;
        if let Some(slot) = self.costs[class].get_mut(index) {
            let measured_before = slot.is_some();
            *slot = Some(match *slot {
                Some(cost) => KEEP * cost + (1.0 - KEEP) * ms,
                None => ms,
            });
            // A request's first step at a width often carries one-time costs (kernels compiled
            // for the shape): the model's shared costs take its later ones.
            if let (Some(shared), true) = (&self.shared, measured_before) {
                shared.record(class, index, ms);
            }
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

    /// Costs and acceptance measured by one request start the next: where a speculative step
    /// costs 2.5 plain ones and drafts were never kept, a new request does not draft at all
    /// until a probe says its drafts are kept (alone it would first draft at full depth); where
    /// they were all kept, it drafts at full depth from its first step.
    #[test]
    fn a_new_request_starts_from_the_models_measured_costs() {
        let kept_before = SharedCosts::default();
        let mut first = DepthControl::sharing(4, Some(kept_before.clone()));
        for _ in 0..10 {
            let k = first.next_depth(1).max(1);
            first.observe_step(k, k, k + 1, 10.0 + 15.0 * k as f64 / 4.0);
            first.observe_plain(10.0);
        }
        assert!(DepthControl::sharing(4, Some(kept_before)).next_depth(1) > 0);

        let shared = SharedCosts::default();
        let mut first = DepthControl::sharing(4, Some(shared.clone()));
        assert!(
            first.next_depth(1) > 0,
            "the prior drafts before any cost is known"
        );
        for k in 1..=4 {
            first.observe_step(k, 0, k + 1, 25.0);
        }
        first.observe_plain(10.0);
        let mut next = DepthControl::sharing(4, Some(shared));
        assert_eq!(next.next_depth(1), 0, "starts from the measured 2.5x");
        assert!(DepthControl::new(4).next_depth(1) > 0);
        // Probes whose drafts are all kept turn it back on (a few, against the model's history
        // of none kept).
        let mut on = false;
        for _ in 0..300 {
            match next.next_depth(1) {
                0 => next.observe_plain(10.0),
                k => {
                    next.observe_step(k, k, k + 1, 25.0);
                    on |= next.best_depth(1) > 0;
                }
            }
        }
        assert!(on, "kept drafts never turned it on");
    }

    /// Requests of 128 tokens on a model whose drafts are never kept: where a probe costs
    /// three plain steps, each request waits long enough before probing that probes take about
    /// 2 % of the time (a cheap probe keeps the doubling schedule: three per request).
    #[test]
    fn costly_probes_wait_longer() {
        let probes = |probe_ms: f64| {
            let shared = SharedCosts::default();
            let (mut probes, mut spent) = (0, 0.0);
            for _ in 0..10 {
                let mut control = DepthControl::sharing(4, Some(shared.clone()));
                for _ in 0..128 {
                    match control.next_depth(1) {
                        0 => {
                            control.observe_plain(10.0);
                            spent += 10.0;
                        }
                        k => {
                            probes += 1;
                            control.observe_step(k, 0, k + 1, probe_ms);
                            spent += probe_ms;
                        }
                    }
                }
            }
            (probes, spent / (10.0 * 128.0 * 10.0) - 1.0)
        };
        let (cheap, _) = probes(11.0);
        let (costly, overhead) = probes(30.0);
        assert!(cheap >= 25, "{cheap} cheap probes");
        assert!(
            2 * costly <= cheap,
            "{costly} costly probes, {cheap} cheap ones"
        );
        assert!(overhead < 0.04, "probing took {overhead:.3} more time");
    }

    /// Eight rows whose drafts are always wrong, in one batch: rows that chose plain decode
    /// join a step another row widens, so their probes come together and the batch widens
    /// about as rarely as one row alone probes; each row probing on its own clock would widen
    /// it several times as often.
    #[test]
    fn rows_of_a_batch_probe_together() {
        let widened = |join: bool| {
            let mut controls: Vec<DepthControl> = (0..8).map(|_| DepthControl::new(4)).collect();
            // Rows arrive one step apart, so their clocks start apart.
            let mut widened = 0;
            for step in 0..4000 {
                let live = (step + 1).min(8);
                let mut depths: Vec<usize> = controls[..live]
                    .iter_mut()
                    .map(|control| control.next_depth(live))
                    .collect();
                if join && depths.iter().any(|&depth| depth > 0) {
                    for (control, depth) in controls.iter_mut().zip(&mut depths) {
                        if *depth == 0 {
                            *depth = control.join_widened();
                        }
                    }
                }
                let width = 1 + depths.iter().copied().max().unwrap_or(0);
                widened += usize::from(width > 1);
                for (control, &depth) in controls.iter_mut().zip(&depths) {
                    match depth {
                        0 => control.observe_plain(10.0),
                        _ => control.observe_step(depth, 0, width, 11.0),
                    }
                }
            }
            widened
        };
        let (together, apart) = (widened(true), widened(false));
        assert!(together <= 20, "{together} widened steps");
        assert!(apart >= 2 * together, "{apart} apart, {together} together");
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
