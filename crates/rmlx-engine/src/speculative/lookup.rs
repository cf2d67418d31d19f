//! Prompt lookup: the conversation's last `n` tokens (n from `MAX_NGRAM` down to `MIN_NGRAM`)
//! found earlier in it propose what followed their latest earlier occurrence. Agents' code
//! edits repeat their input, so these drafts are often right; a miss costs nothing (no draft).
//! Reference: Hugging Face transformers `prompt_lookup_num_tokens` (`PromptLookupCandidateGenerator`),
//! vLLM's `NgramProposer`.

/// Longest suffix tried first.
pub const MAX_NGRAM: usize = 4;
/// A single repeated token says too little about what follows.
pub const MIN_NGRAM: usize = 2;
// `PromptLookup::may_match` relies on every match spanning the newest token and the one before.
const _: () = assert!(MIN_NGRAM >= 2);

#[derive(Debug, Default)]
pub struct PromptLookup;

impl PromptLookup {
    /// Whether [`Self::propose`] could find a match once the `unknown` newest tokens are
    /// known, from `known`, the history before them. Every match spans the newest token and
    /// the one before it, so with one token unknown the last known one must occur earlier;
    /// with more unknown, nothing is ruled out. A decode step that cannot draft then need not
    /// wait for its newest token to reach the host (`generate/verify.rs`).
    pub fn may_match(known: &[u32], unknown: usize) -> bool {
        match (unknown, known.split_last()) {
            (0, _) => true,
            (1, Some((last, earlier))) => earlier.contains(last),
            (1, None) => false,
            _ => true,
        }
    }

    /// Up to `max` tokens following the latest earlier occurrence of the longest matching suffix.
    pub fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        if max == 0 {
            return Vec::new();
        }
        for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
            if history.len() <= n {
                continue;
            }
            let suffix = &history[history.len() - n..];
            // Latest first: the nearest repetition is the likeliest to continue the same way.
            let found = (0..history.len() - n)
                .rev()
                .find(|&start| &history[start..start + n] == suffix);
            if let Some(start) = found {
                let from = start + n;
                let to = (from + max).min(history.len());
                return history[from..to].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_longest_match_proposes_what_followed_it() {
        let mut lookup = PromptLookup;
        // "5 6" occurs twice before the end; the later one was followed by 9 9.
        let history = [1, 5, 6, 7, 8, 5, 6, 9, 9, 3, 5, 6];
        assert_eq!(lookup.propose(&history, 3), vec![9, 9, 3]);
        // A longer suffix wins over a later short one: "2 3 4" matched at the start.
        let history = [2, 3, 4, 10, 11, 3, 4, 12, 2, 3, 4];
        assert_eq!(lookup.propose(&history, 2), vec![10, 11]);
        // Drafts stop at the end of the history.
        let history = [7, 8, 9, 7, 8];
        assert_eq!(lookup.propose(&history, 5), vec![9, 7, 8]);
    }

    /// `may_match` never rules out a history `propose` drafts for, and rules out those whose
    /// token before the newest never occurred earlier.
    #[test]
    fn may_match_rules_out_only_what_cannot_match() {
        let mut lookup = PromptLookup;
        let mut state = 7u64;
        let (mut ruled_out, mut proposed) = (0, 0);
        for _ in 0..2000 {
            let len = 3 + (state % 12) as usize;
            let history: Vec<u32> = (0..len)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 33) % 6) as u32
                })
                .collect();
            let (known, _) = history.split_at(len - 1);
            let possible = PromptLookup::may_match(known, 1);
            let drafted = !lookup.propose(&history, 3).is_empty();
            assert!(possible || !drafted, "{history:?}");
            ruled_out += usize::from(!possible);
            proposed += usize::from(drafted);
        }
        assert!(ruled_out > 100 && proposed > 100, "{ruled_out} {proposed}");
        assert!(PromptLookup::may_match(&[1, 2, 1], 1));
        assert!(!PromptLookup::may_match(&[1, 2, 3], 1));
        assert!(PromptLookup::may_match(&[1, 2, 3], 0));
        assert!(PromptLookup::may_match(&[1, 2, 3], 2));
    }

    #[test]
    fn no_repetition_no_draft() {
        let mut lookup = PromptLookup;
        assert!(lookup.propose(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(lookup.propose(&[1, 2, 1, 2], 0).is_empty());
        // A lone repeated token is not enough.
        assert!(lookup.propose(&[4, 1, 2, 4], 3).is_empty());
    }
}
