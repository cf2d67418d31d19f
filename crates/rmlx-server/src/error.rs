//! One error type for every route, mapped to a status and each API's JSON shape. Reference: axum
//! `examples/error-handling` (one enum, one `IntoResponse`), with the bodies the official SDKs
//! parse: OpenAI `{"error":{"message","type","code"}}`, Anthropic
//! `{"type":"error","error":{"type","message"}}`.

use axum::{
    body::Bytes,
    extract::{FromRequest, Request},
    http::StatusCode,
    response::{IntoResponse, Response},
    Json,
};
use rmlx_engine::EngineError;
use serde::de::DeserializeOwned;

use crate::api;

#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// Malformed JSON, wrong types, unsupported values, bad images.
    #[error("{0}")]
    BadRequest(String),
    /// Decided by the engine from the tokenized prompt, before any compute.
    #[error("this request has {prompt_tokens} prompt tokens but the model's context holds {max_ctx}; shorten the messages or raise --max-ctx")]
    ContextLength {
        prompt_tokens: usize,
        max_ctx: usize,
    },
    #[error("{0}")]
    Unauthorized(String),
    /// The Host header is not one of ours (DNS-rebinding guard).
    #[error("{0}")]
    Forbidden(String),
    #[error("model `{0}` not found; GET /v1/models lists the available ids")]
    ModelNotFound(String),
    #[error("{0}")]
    NotFound(String),
    #[error("request body is larger than the limit of {0} MB (raise it with --max-body-mb)")]
    PayloadTooLarge(usize),
    #[error("{0}")]
    QueueFull(String),
    /// The resource is busy in a way the request cannot override (a download running, a job
    /// in the wrong state).
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NotImplemented(String),
    /// Memory for this request could not be had (an image's buffers, MLX's allocator); the
    /// server goes on, and a smaller request, or this one later, can succeed.
    #[error("{0}")]
    OutOfMemory(String),
    /// The server cannot answer now (a pipeline rank was lost; the process is exiting for its
    /// supervisor to restart it).
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
    /// An error the engine reported, and so already counted in its metrics; the server's own
    /// error counter skips these.
    #[error(transparent)]
    FromEngine(Box<ApiError>),
}

/// Which API's error shape a response takes; chosen from the request path in `app`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    OpenAi,
    Anthropic,
}

impl ApiError {
    /// Marks an error that came back from the engine (see `FromEngine`).
    pub fn from_engine(error: EngineError) -> Self {
        Self::FromEngine(Box::new(error.into()))
    }

    /// The error itself, past the `FromEngine` marker.
    fn plain(&self) -> &Self {
        match self {
            Self::FromEngine(inner) => inner.plain(),
            other => other,
        }
    }

    /// Whether the server should count this error (the engine counted it otherwise).
    pub fn counted_by_server(&self) -> bool {
        !matches!(self, Self::FromEngine(_))
    }

    /// The `error_counts` key for an error the server answered itself.
    pub fn kind(&self) -> &'static str {
        match self.plain() {
            Self::BadRequest(_) => "invalid_request",
            Self::ContextLength { .. } => "context_length_exceeded",
            Self::Unauthorized(_) => "unauthorized",
            Self::Forbidden(_) => "forbidden_host",
            Self::ModelNotFound(_) => "model_not_found",
            Self::NotFound(_) => "not_found",
            Self::PayloadTooLarge(_) => "request_too_large",
            Self::QueueFull(_) => "queue_full",
            Self::Conflict(_) => "conflict",
            Self::NotImplemented(_) => "not_implemented",
            Self::OutOfMemory(_) => "out_of_memory",
            Self::Unavailable(_) => "unavailable",
            Self::Internal(_) | Self::FromEngine(_) => "internal",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self.plain() {
            Self::BadRequest(_) | Self::ContextLength { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::ModelNotFound(_) | Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::QueueFull(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            Self::OutOfMemory(_) | Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) | Self::FromEngine(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's (`type`, `code`) pair.
    fn openai_kind(&self) -> (&'static str, Option<&'static str>) {
        match self.plain() {
            Self::BadRequest(_) => ("invalid_request_error", None),
            Self::ContextLength { .. } => {
                ("invalid_request_error", Some("context_length_exceeded"))
            }
            Self::Unauthorized(_) => ("invalid_request_error", Some("invalid_api_key")),
            Self::Forbidden(_) => ("invalid_request_error", Some("forbidden_host")),
            Self::ModelNotFound(_) => ("invalid_request_error", Some("model_not_found")),
            Self::NotFound(_) => ("invalid_request_error", Some("not_found")),
            Self::PayloadTooLarge(_) => ("invalid_request_error", Some("request_too_large")),
            Self::QueueFull(_) => ("rate_limit_error", Some("queue_full")),
            Self::Conflict(_) => ("invalid_request_error", Some("conflict")),
            Self::NotImplemented(_) => ("invalid_request_error", Some("not_implemented")),
            Self::OutOfMemory(_) => ("server_error", Some("out_of_memory")),
            Self::Unavailable(_) => ("server_error", Some("unavailable")),
            Self::Internal(_) | Self::FromEngine(_) => ("server_error", None),
        }
    }

    fn anthropic_kind(&self) -> &'static str {
        match self.plain() {
            Self::BadRequest(_)
            | Self::ContextLength { .. }
            | Self::NotImplemented(_)
            | Self::Conflict(_) => "invalid_request_error",
            Self::Unauthorized(_) => "authentication_error",
            Self::Forbidden(_) => "permission_error",
            Self::ModelNotFound(_) | Self::NotFound(_) => "not_found_error",
            Self::PayloadTooLarge(_) => "request_too_large",
            Self::QueueFull(_) => "rate_limit_error",
            Self::OutOfMemory(_) | Self::Unavailable(_) => "overloaded_error",
            Self::Internal(_) | Self::FromEngine(_) => "api_error",
        }
    }

    /// The JSON body in one API's shape (also the payload of a mid-stream SSE error).
    pub fn body(&self, api: Api) -> serde_json::Value {
        let body = match api {
            Api::OpenAi => {
                let (kind, code) = self.openai_kind();
                let (prompt_tokens, context_length) = match self.plain() {
                    Self::ContextLength {
                        prompt_tokens,
                        max_ctx,
                    } => (Some(*prompt_tokens), Some(*max_ctx)),
                    _ => (None, None),
                };
                serde_json::to_value(api::OpenAiError {
                    error: api::OpenAiErrorDetail {
                        message: self.to_string(),
                        kind: kind.into(),
                        param: None,
                        code: code.map(Into::into),
                        prompt_tokens,
                        context_length,
                    },
                })
            }
            Api::Anthropic => serde_json::to_value(api::AnthropicError {
                kind: api::ErrorType::Error,
                error: api::AnthropicErrorDetail {
                    kind: self.anthropic_kind().into(),
                    message: match self.plain() {
                        // Anthropic's own words: Claude Code compacts its history on them.
                        Self::ContextLength {
                            prompt_tokens,
                            max_ctx,
                        } => format!(
                            "prompt is too long: {prompt_tokens} tokens > {max_ctx} maximum"
                        ),
                        _ => self.to_string(),
                    },
                },
            }),
        };
        body.unwrap_or_default()
    }

    pub fn response(&self, api: Api) -> Response {
        let mut response = (self.status(), Json(self.body(api))).into_response();
        // Kept so the outer shape layer can re-render it for the Anthropic routes.
        response.extensions_mut().insert(self.clone());
        response
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.response(Api::OpenAi)
    }
}

impl From<EngineError> for ApiError {
    fn from(error: EngineError) -> Self {
        match error {
            EngineError::ContextOverflow {
                prompt_tokens,
                max_ctx,
            } => Self::ContextLength {
                prompt_tokens,
                max_ctx,
            },
            EngineError::QueueFull(queued) => Self::QueueFull(format!(
                "the server is busy ({queued} requests queued); retry later or raise --max-queue"
            )),
            EngineError::InvalidRequest(message) => Self::BadRequest(message),
            error @ EngineError::OutOfMemory(_) => Self::OutOfMemory(format!(
                "{error}; this request was dropped and the server goes on (free memory, send a \
                 smaller image or prompt, or retry)"
            )),
            EngineError::Sample(error) => Self::BadRequest(error.to_string()),
            EngineError::Distributed(message) => Self::Unavailable(format!(
                "the model runs across machines and {message}; the server is restarting"
            )),
            // Rendering failures come from the messages (roles, shapes) the client sent.
            EngineError::Chat(error @ rmlx_engine::chat::ChatError::TemplateRender { .. }) => {
                Self::BadRequest(error.to_string())
            }
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<rmlx_hub::HubError> for ApiError {
    fn from(error: rmlx_hub::HubError) -> Self {
        use rmlx_hub::HubError::*;
        match error {
            InvalidRepoId { .. } | InvalidRevision(_) => Self::BadRequest(error.to_string()),
            JobNotFound(_) => Self::NotFound(error.to_string()),
            InvalidState { .. } | AlreadyDownloading { .. } => Self::Conflict(error.to_string()),
            other => Self::Internal(other.to_string()),
        }
    }
}

/// A JSON body parsed into our error shape: axum's own `Json` answers rejections in plain text
/// and 415/422, the SDKs expect a JSON 400 (or 413 past the body limit).
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let limit_mb = request
            .extensions()
            .get::<BodyLimitMb>()
            .map_or(0, |limit| limit.0);
        room_for_body(&request)?;
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|rejection| {
                if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::PayloadTooLarge(limit_mb)
                } else {
                    ApiError::BadRequest(format!("cannot read the request body: {rejection}"))
                }
            })?;
        // An object, as the document states: serde would also read a struct from an array.
        if bytes.iter().find(|byte| !byte.is_ascii_whitespace()) != Some(&b'{') {
            return Err(ApiError::BadRequest(
                "invalid JSON body: expected a JSON object".into(),
            ));
        }
        serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|error| ApiError::BadRequest(format!("invalid JSON body: {error}")))
    }
}

/// Refuses a large body the host has no memory to parse: the body, the JSON's copy of its
/// strings (a data URI's base64 is most of such a body), the base64 without line breaks, its
/// decoded bytes and the decoded image take about five times its length, and a refused allocation in any of them would abort the server rather than fail the
/// request. Asked for and given back before the body is read (another thread may still take the
/// memory in between: this narrows the window, it does not close it).
fn room_for_body(request: &Request) -> Result<(), ApiError> {
    let Some(length) = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<usize>().ok())
    else {
        return Ok(());
    };
    if length < 1 << 20 {
        return Ok(());
    }
    let needed = length.saturating_mul(5);
    Vec::<u8>::new().try_reserve_exact(needed).map_err(|_| {
        ApiError::OutOfMemory(format!(
            "out of memory: a {:.1} MB request needs about {:.1} MB to read; this request was \
             dropped and the server goes on (free memory, send a smaller image, or retry)",
            length as f64 / 1e6,
            needed as f64 / 1e6
        ))
    })
}

/// The configured body limit, for the 413 message.
#[derive(Clone, Copy)]
pub struct BodyLimitMb(pub usize);

/// Integer request fields that also take integral floats (`2.0`): JSON Schema, and so our
/// OpenAPI document, calls them integers, and Python's `json.dumps` writes floats that way.
pub mod whole {
    use serde::{de::Error, Deserialize, Deserializer};
    use serde_json::Number;

    const TWO_POW_63: f64 = 9_223_372_036_854_775_808.0;

    fn integer<E: Error, T: TryFrom<i128>>(number: &Number) -> Result<T, E> {
        let value = match (number.as_i64(), number.as_u64(), number.as_f64()) {
            (Some(i), _, _) => i128::from(i),
            (None, Some(u), _) => i128::from(u),
            // Below 2^63 only: an integer literal past i64 / u64 arrives here already rounded
            // (-2^63 - 1 reads as -2^63), and must not pass for a value in range.
            (None, None, Some(f)) if f.fract() == 0.0 && f.abs() < TWO_POW_63 => f as i128,
            (None, None, Some(f)) if f.fract() == 0.0 => {
                return Err(E::custom(format!("{number} is out of range")))
            }
            _ => return Err(E::custom(format!("expected an integer, got {number}"))),
        };
        T::try_from(value).map_err(|_| E::custom(format!("{value} is out of range")))
    }

    pub fn required<'de, D: Deserializer<'de>, T: TryFrom<i128>>(
        deserializer: D,
    ) -> Result<T, D::Error> {
        integer(&Number::deserialize(deserializer)?)
    }

    pub fn optional<'de, D: Deserializer<'de>, T: TryFrom<i128>>(
        deserializer: D,
    ) -> Result<Option<T>, D::Error> {
        Option::<Number>::deserialize(deserializer)?
            .map(|number| integer(&number))
            .transpose()
    }
}

/// Object request fields (`stream_options`, `reasoning`, `text`): serde's derive would also
/// read a struct from an array of its fields, which the document does not allow.
pub mod object {
    use serde::{de::DeserializeOwned, de::Error, Deserialize, Deserializer};
    use serde_json::{Map, Value};

    pub fn optional<'de, D: Deserializer<'de>, T: DeserializeOwned>(
        deserializer: D,
    ) -> Result<Option<T>, D::Error> {
        Option::<Map<String, Value>>::deserialize(deserializer)?
            .map(|map| serde_json::from_value(Value::Object(map)).map_err(D::Error::custom))
            .transpose()
    }
}

/// 32-bit float request fields (sampling parameters, logit biases), read as JSON numbers and
/// narrowed to `f32`: a number past `f32::MAX` is refused rather than turned into infinity, and
/// an inexact one rounds away from zero, so every range the engine checks in `f32` (`top_p` in
/// (0, 1], `temperature` >= 0, ...) holds of the number the client sent, as the document's
/// bounds state it (a rounding to the nearest `f32` would take `1e-50` for 0 and `1 + 1e-10`
/// for 1).
pub mod real {
    use std::collections::BTreeMap;

    use serde::{de::Error, Deserialize, Deserializer};

    /// `value` as an `f32` no nearer zero than it is; None past `f32::MAX`.
    pub fn narrow(value: f64) -> Option<f32> {
        // JSON has no NaN; a value past f32::MAX would become infinity.
        if value.is_nan() || value.abs() > f64::from(f32::MAX) {
            return None;
        }
        let near = value as f32;
        Some(match f64::from(near).abs() < value.abs() {
            // One step further from zero (the sign bit stays as it is).
            true => f32::from_bits(near.to_bits() + 1),
            false => near,
        })
    }

    fn checked<E: Error>(value: f64) -> Result<f32, E> {
        narrow(value).ok_or_else(|| E::custom(format!("{value} is out of range (a 32-bit float)")))
    }

    pub fn optional<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<f32>, D::Error> {
        Option::<f64>::deserialize(deserializer)?
            .map(checked)
            .transpose()
    }

    /// A map of floats (`logit_bias`).
    pub fn map<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<BTreeMap<String, f32>>, D::Error> {
        Option::<BTreeMap<String, f64>>::deserialize(deserializer)?
            .map(|map| {
                map.into_iter()
                    .map(|(key, value)| Ok((key, checked(value)?)))
                    .collect()
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct Fields {
        #[serde(default, deserialize_with = "super::whole::optional")]
        signed: Option<i64>,
        #[serde(default, deserialize_with = "super::whole::optional")]
        count: Option<usize>,
        #[serde(default, deserialize_with = "super::real::optional")]
        real: Option<f32>,
    }

    fn read(json: &str) -> Result<Fields, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn integers_take_integral_floats_inside_their_range_only() {
        assert_eq!(read(r#"{"count": 2.0}"#).unwrap().count, Some(2));
        assert!(read(r#"{"count": 2.5}"#).is_err());
        assert_eq!(
            read(r#"{"signed": -9223372036854775808}"#).unwrap().signed,
            Some(i64::MIN)
        );
        // Past i64 the literal reads as a float rounded onto -2^63: refused, not taken as MIN.
        assert!(read(r#"{"signed": -9223372036854775809}"#).is_err());
        assert!(read(r#"{"signed": 9223372036854775808}"#).is_err());
        assert_eq!(
            read(r#"{"count": 18446744073709551615}"#).unwrap().count,
            Some(usize::MAX)
        );
        assert!(read(r#"{"count": 18446744073709551616}"#).is_err());
        assert!(read(r#"{"count": -1}"#).is_err());
    }

    #[test]
    fn floats_narrow_away_from_zero_and_refuse_past_f32() {
        let real = |json: &str| read(json).map(|fields| fields.real);
        assert_eq!(real(r#"{"real": 0.5}"#).unwrap(), Some(0.5));
        assert_eq!(real(r#"{"real": 3}"#).unwrap(), Some(3.0));
        assert!(real(r#"{"real": 1e-50}"#).unwrap().unwrap() > 0.0);
        assert!(real(r#"{"real": -1e-50}"#).unwrap().unwrap() < 0.0);
        assert!(real(r#"{"real": 1.0000000001}"#).unwrap().unwrap() > 1.0);
        assert_eq!(real(r#"{"real": 0.99999999999}"#).unwrap(), Some(1.0));
        assert_eq!(
            real(r#"{"real": 3.4028234663852886e38}"#).unwrap(),
            Some(f32::MAX)
        );
        assert!(real(r#"{"real": 3.5e38}"#).is_err());
        assert!(real(r#"{"real": -1e300}"#).is_err());
        assert_eq!(real(r#"{"real": null}"#).unwrap(), None);
    }
}
