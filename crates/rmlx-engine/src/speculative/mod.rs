//! Speculative decoding: a proposer guesses a row's next tokens, one forward of the model checks
//! them all (`generate/verify.rs`), and the row keeps the guesses the model agrees with plus the
//! model's own next token. Greedy output is unchanged token for token: a guess is kept only where
//! it equals the argmax the plain step would have taken. Sampled output keeps its distribution:
//! guesses are kept by the rejection rule (`accept.rs`).
//! Reference: ../shared/research/speculative-decoding.md (the MLX peers, their traps); vLLM's
//! n-gram proposer and Hugging Face's `prompt_lookup_num_tokens` for prompt lookup.
//!
//! Files: `lookup.rs` (drafts from n-grams already in the conversation), `accept.rs` (the
//! rejection rule for sampled rows), `depth.rs` (how many
//! tokens to draft per step, from measured acceptance and step costs).

pub mod accept;
pub mod depth;
pub mod lookup;

use std::sync::Arc;

/// Which proposer a request's decode uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpeculativeMode {
    /// Plain decode: one token per step.
    #[default]
    Off,
    /// Prompt lookup at the full depth whenever it finds a match.
    Lookup,
    /// The model's own draft head (Qwen3.5 / 3.6 MTP) at the full depth; prompt lookup for a
    /// model without one.
    Mtp,
    /// A separate draft model (`--draft-model`) at the full depth; prompt lookup without one.
    Draft,
    /// The model's draft head if it has one, else a draft model if one is paired with it, else
    /// prompt lookup, its depth chosen per request
    /// from measured acceptance and step costs (`depth.rs`): it switches itself off where it
    /// loses. A sampled request with a seed decodes plainly: a depth chosen from timings would
    /// make its answer differ between runs. The engine's default.
    Auto,
}

impl SpeculativeMode {
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "off" => Some(Self::Off),
            "lookup" => Some(Self::Lookup),
            "mtp" => Some(Self::Mtp),
            "draft" => Some(Self::Draft),
            "auto" => Some(Self::Auto),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Lookup => "lookup",
            Self::Mtp => "mtp",
            Self::Draft => "draft",
            Self::Auto => "auto",
        }
    }
}

/// Tokens drafted per step at most, unless a request says otherwise.
pub const DEFAULT_MAX_DRAFT: usize = 4;

/// A request's speculative decoding.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SpeculativeParams {
    /// None: the engine's default (`EngineOptions::speculative`, `auto`; off when run alone).
    #[serde(default)]
    pub mode: Option<SpeculativeMode>,
    /// Tokens drafted per step at most (k).
    #[serde(default = "default_max_draft")]
    pub max_draft: usize,
    /// A proposer given by the caller instead of `mode`'s (tests pass oracles and adversaries).
    #[serde(skip)]
    pub drafter: Option<Drafter>,
    /// The model's step costs as its earlier requests measured them (the engine passes its
    /// resident model's); None: this request measures its own from scratch.
    #[serde(skip)]
    pub costs: Option<depth::SharedCosts>,
}

fn default_max_draft() -> usize {
    DEFAULT_MAX_DRAFT
}

impl Default for SpeculativeParams {
    fn default() -> Self {
        Self {
            mode: None,
            max_draft: DEFAULT_MAX_DRAFT,
            drafter: None,
            costs: None,
        }
    }
}

/// Drafts at most `max` tokens to follow `history` (the prompt and every token generated so
/// far; its last token is the one the next step feeds).
pub type DraftFn = dyn Fn(&[u32], usize) -> Vec<u32> + Send + Sync;

#[derive(Clone)]
pub struct Drafter(pub Arc<DraftFn>);

impl std::fmt::Debug for Drafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Drafter")
    }
}

/// A request's proposer, built from its [`SpeculativeParams`].
pub(crate) enum Proposer {
    Lookup(lookup::PromptLookup),
    Given(Drafter),
    /// The model's draft head: its drafts are made on the device for the whole batch
    /// (`generate/head.rs`), not here.
    Head,
    /// A separate draft model, also on the device for the whole batch (`generate/draft.rs`).
    DraftModel,
}

impl Proposer {
    /// The proposer and, for `auto`, its depth control. `has_head`: the model's draft head is
    /// loaded; `has_draft_model`: a draft model is paired with it; `seeded_sampling`: the
    /// request samples with a seed, so `auto` leaves it plain (its depth would follow timings,
    /// and the seed would no longer give one answer).
    pub(crate) fn new(
        params: &SpeculativeParams,
        has_head: bool,
        has_draft_model: bool,
        seeded_sampling: bool,
    ) -> Option<(Self, Option<depth::DepthControl>)> {
        let mode = params.mode.unwrap_or_default();
        let plain =
            mode == SpeculativeMode::Off || (mode == SpeculativeMode::Auto && seeded_sampling);
        if params.max_draft == 0 || (params.drafter.is_none() && plain) {
            return None;
        }
        let head = has_head && matches!(mode, SpeculativeMode::Mtp | SpeculativeMode::Auto);
        let draft_model = has_draft_model
            && (mode == SpeculativeMode::Draft || (mode == SpeculativeMode::Auto && !has_head));
        let proposer = match &params.drafter {
            Some(drafter) => Self::Given(drafter.clone()),
            None if head => Self::Head,
            None if draft_model => Self::DraftModel,
            None => Self::Lookup(lookup::PromptLookup),
        };
        let control = (mode == SpeculativeMode::Auto)
            .then(|| depth::DepthControl::sharing(params.max_draft, params.costs.clone()));
        Some((proposer, control))
    }

    pub(crate) fn is_head(&self) -> bool {
        matches!(self, Self::Head)
    }

    pub(crate) fn is_draft_model(&self) -> bool {
        matches!(self, Self::DraftModel)
    }

    /// Whether the drafts are made on the device (head, draft model), not by `propose`.
    pub(crate) fn drafts_on_device(&self) -> bool {
        self.is_head() || self.is_draft_model()
    }

    /// Whether drafts are possible once the `unknown` newest tokens after `known` are read
    /// (prompt lookup can rule some histories out; other proposers are asked anyway).
    pub(crate) fn may_draft_after(&self, known: &[u32], unknown: usize) -> bool {
        match self {
            Self::Lookup(_) => lookup::PromptLookup::may_match(known, unknown),
            Self::Given(_) | Self::Head | Self::DraftModel => true,
        }
    }

    pub(crate) fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        let mut draft = match self {
            Self::Lookup(lookup) => lookup.propose(history, max),
            Self::Given(drafter) => (drafter.0)(history, max),
            Self::Head | Self::DraftModel => Vec::new(),
        };
        draft.truncate(max);
        draft
    }
}
