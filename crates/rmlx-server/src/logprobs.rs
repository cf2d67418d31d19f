//! Log-probs requests in OpenAI's two forms (chat `logprobs: true` + `top_logprobs`, legacy
//! `logprobs: N`) and the stream bookkeeping: a stream carries each token's entry in the chunk
//! that first follows it, so the chunks concatenate to the non-streamed list. The response
//! shapes are `api::ChatLogprobs` and `api::LegacyLogprobs`. Reference: OpenAI API reference
//! (chat `logprobs`, completions `logprobs`).

use rmlx_engine::generate::{TokenLogprob, MAX_TOP_LOGPROBS};
use serde_json::Value;

use crate::error::ApiError;

/// Chat: `logprobs: true` with `top_logprobs: 0..=20`; `top_logprobs` alone is refused, as
/// OpenAI does, rather than silently returning nothing.
pub fn chat_request(
    logprobs: Option<&Value>,
    top: Option<&Value>,
) -> Result<Option<usize>, ApiError> {
    let top = match top {
        None | Some(Value::Null) => None,
        Some(value) => Some(top_count(value, "top_logprobs")?),
    };
    match logprobs {
        None | Some(Value::Null) | Some(Value::Bool(false)) => match top {
            Some(_) => Err(ApiError::BadRequest(
                "top_logprobs requires logprobs: true".into(),
            )),
            None => Ok(None),
        },
        Some(Value::Bool(true)) => Ok(Some(top.unwrap_or(0))),
        Some(_) => Err(ApiError::BadRequest(
            "logprobs must be a boolean on /v1/chat/completions (use top_logprobs for alternatives)"
                .into(),
        )),
    }
}

/// Legacy completions: `logprobs: n` asks for the chosen token plus `n` alternatives.
pub fn legacy_request(logprobs: Option<&Value>) -> Result<Option<usize>, ApiError> {
    match logprobs {
        None | Some(Value::Null) => Ok(None),
        Some(value) => top_count(value, "logprobs").map(Some),
    }
}

fn top_count(value: &Value, field: &str) -> Result<usize, ApiError> {
    // 2.0 counts as 2, as JSON Schema's integers do.
    let whole = value.as_u64().or_else(|| {
        value
            .as_f64()
            .filter(|f| f.fract() == 0.0 && *f >= 0.0)
            .map(|f| f as u64)
    });
    match whole {
        Some(n) if n as usize <= MAX_TOP_LOGPROBS => Ok(n as usize),
        _ => Err(ApiError::BadRequest(format!(
            "{field} must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {value}"
        ))),
    }
}

#[derive(Default)]
pub struct Pending {
    waiting: Vec<TokenLogprob>,
    sent: usize,
}

impl Pending {
    pub fn push(&mut self, entry: Option<TokenLogprob>) {
        self.waiting.extend(entry);
    }

    /// Everything waiting, now going out in a chunk.
    pub fn take(&mut self) -> Vec<TokenLogprob> {
        self.sent += self.waiting.len();
        std::mem::take(&mut self.waiting)
    }

    /// At the end: what is waiting plus the tokens that made no text event (the stop token),
    /// which only the completion lists.
    pub fn finish(&mut self, all: Option<&[TokenLogprob]>) -> Vec<TokenLogprob> {
        let mut rest = self.take();
        if let Some(all) = all {
            rest.extend(all.iter().skip(self.sent).cloned());
            self.sent = self.sent.max(all.len());
        }
        rest
    }
}

#[cfg(test)]
mod tests {
    use rmlx_engine::generate::TopLogprob;

    use serde_json::json;

    use super::*;

    fn entry(token: &str, logprob: f32) -> TokenLogprob {
        TokenLogprob {
            token_id: 1,
            token: token.into(),
            logprob,
            top: vec![TopLogprob {
                token_id: 1,
                token: token.into(),
                logprob,
            }],
        }
    }

    #[test]
    fn request_fields_are_checked() {
        assert_eq!(chat_request(None, None).unwrap(), None);
        assert_eq!(chat_request(Some(&json!(true)), None).unwrap(), Some(0));
        assert_eq!(
            chat_request(Some(&json!(true)), Some(&json!(20))).unwrap(),
            Some(20)
        );
        for (logprobs, top) in [
            (json!(true), json!(21)),
            (json!(true), json!(-1)),
            (json!(false), json!(2)),
            (Value::Null, json!(2)),
            (json!(3), Value::Null),
        ] {
            assert!(
                chat_request(Some(&logprobs), Some(&top)).is_err(),
                "{logprobs} {top}"
            );
        }
        assert_eq!(legacy_request(Some(&json!(5))).unwrap(), Some(5));
        assert!(legacy_request(Some(&json!(21))).is_err());
        assert!(legacy_request(Some(&json!(true))).is_err());
        // Integral floats are integers (JSON Schema's reading); fractions are not.
        assert_eq!(legacy_request(Some(&json!(5.0))).unwrap(), Some(5));
        assert!(legacy_request(Some(&json!(5.5))).is_err());
    }

    #[test]
    fn shapes() {
        let entries = [
            entry("Hé", -0.5),
            entry(" yo", -1.0),
            entry("x", f32::NEG_INFINITY),
        ];
        let chat = serde_json::to_value(crate::api::ChatLogprobs::of(&entries)).unwrap();
        assert_eq!(chat["content"][0]["bytes"], json!([72, 195, 169]));
        assert_eq!(chat["content"][1]["top_logprobs"][0]["token"], " yo");
        let mut offset = 0;
        let legacy =
            serde_json::to_value(crate::api::LegacyLogprobs::of(&entries, &mut offset)).unwrap();
        assert_eq!(legacy["text_offset"], json!([0, 2, 5]));
        assert_eq!(legacy["top_logprobs"][1], json!({" yo": -1.0}));
        assert_eq!(offset, 6);
        // Minus infinity is sent as OpenAI's floor, never as null.
        assert_eq!(chat["content"][2]["logprob"], json!(-9999.0));
        assert_eq!(legacy["token_logprobs"][2], json!(-9999.0));
    }

    #[test]
    fn pending_sends_each_entry_once() {
        let all = [entry("a", -1.0), entry("b", -1.0), entry("<eos>", -1.0)];
        let mut pending = Pending::default();
        pending.push(Some(all[0].clone()));
        assert_eq!(pending.take().len(), 1);
        pending.push(Some(all[1].clone()));
        let rest = pending.finish(Some(&all));
        assert_eq!(
            rest.iter().map(|e| e.token.as_str()).collect::<Vec<_>>(),
            ["b", "<eos>"]
        );
    }
}
