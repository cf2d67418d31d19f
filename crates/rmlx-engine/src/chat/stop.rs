//! Stop strings on a text stream, after mlx-lm `server.py` (`stopping_criteria` +
//! `sequence_overlap`): text that may still grow into a stop string is held back.

/// What one [`StopMatcher::push`] allows out.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopStep {
    /// Text that can no longer be part of a stop string: safe to send.
    pub text: String,
    /// A stop string was found; `text` ends right before it and the stream is over.
    pub stopped: bool,
    /// Which stop string it was.
    pub matched: Option<String>,
}

/// Finds the first stop string in a stream of chunks; never emits any part of it.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match before any text).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    pub fn push(&mut self, chunk: &str) -> StopStep {
        if self.stopped {
            return StopStep {
                text: String::new(),
                stopped: true,
                matched: None,
            };
        }
        self.held.push_str(chunk);
        // The held text was searched before except for its tail, but a stop may start in the
        // held part and end in the new chunk, so search it all (it is short).
        let first_stop = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, stop)) = first_stop {
            let matched = Some(stop.clone());
            self.stopped = true;
            let mut text = std::mem::take(&mut self.held);
            text.truncate(at);
            return StopStep {
                text,
                stopped: true,
                matched,
            };
        }
        let keep = self.partial_stop_suffix_len();
        let text = self.held[..self.held.len() - keep].to_owned();
        self.held.drain(..self.held.len() - keep);
        StopStep {
            text,
            stopped: false,
            matched: None,
        }
    }

    /// Whatever is still held once the stream ends without a stop.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Bytes at the end of `held` that are a proper prefix of some stop string (the longest such).
    fn partial_stop_suffix_len(&self) -> usize {
        let held = self.held.as_str();
        let longest = self.stops.iter().map(|s| s.len() - 1).max().unwrap_or(0);
        (1..=longest.min(held.len()))
            .rev()
            .find(|&k| {
                let start = held.len() - k;
                held.is_char_boundary(start)
                    && self.stops.iter().any(|s| s.starts_with(&held[start..]))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds chunks, returning everything emitted and whether it stopped.
    fn run(stops: &[&str], chunks: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for chunk in chunks {
            let step = m.push(chunk);
            out.push_str(&step.text);
            if step.stopped {
                assert_eq!(
                    m.push("more"),
                    StopStep {
                        text: String::new(),
                        stopped: true,
                        matched: None,
                    }
                );
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_split_across_three_pushes_is_never_emitted() {
        let mut m = StopMatcher::new(vec!["<|END|>".into()]);
        let a = m.push("Hello <|");
        assert_eq!(
            a,
            StopStep {
                text: "Hello ".into(),
                stopped: false,
                matched: None,
            }
        );
        let b = m.push("EN");
        assert_eq!(
            b,
            StopStep {
                text: String::new(),
                stopped: false,
                matched: None,
            }
        );
        let c = m.push("D|> trailing");
        assert_eq!(
            c,
            StopStep {
                text: String::new(),
                stopped: true,
                matched: Some("<|END|>".into()),
            }
        );
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn overlapping_prefixes() {
        assert_eq!(run(&["abcd"], &["abcabc", "d"]), ("abc".into(), true));
        assert_eq!(
            run(&["abcd"], &["a", "b", "c", "a", "b", "c", "d", "x"]),
            ("abc".into(), true)
        );
        assert_eq!(run(&["aab"], &["aaaab"]), ("aa".into(), true));
        // A held prefix that turns out not to be a stop is released.
        assert_eq!(run(&["abcd"], &["abc", "abx"]), ("abcabx".into(), false));
    }

    #[test]
    fn earliest_stop_wins_and_text_before_is_kept() {
        assert_eq!(
            run(&["world", "lo w"], &["hello world!"]),
            ("hel".into(), true)
        );
        assert_eq!(
            run(&["\n\n", "END"], &["one\n", "\ntwo END"]),
            ("one".into(), true)
        );
    }

    #[test]
    fn passthrough_without_stops() {
        let chunks = ["Café ", "東京", " 🙂", ""];
        assert_eq!(run(&[], &chunks), ("Café 東京 🙂".into(), false));
        assert_eq!(run(&["zz", ""], &chunks), ("Café 東京 🙂".into(), false));
        // Held text is released at the first chunk that rules the stop out.
        let mut m = StopMatcher::new(vec!["東京!".into()]);
        assert_eq!(m.push("a東").text, "a");
        assert_eq!(m.push("京").text, "");
        assert_eq!(m.push("?").text, "東京?");
    }

    #[test]
    fn multibyte_partial_stop_held_on_char_boundaries() {
        let mut m = StopMatcher::new(vec!["🙂stop".into()]);
        assert_eq!(m.push("x🙂st").text, "x");
        assert_eq!(m.finish(), "🙂st");
    }
}
