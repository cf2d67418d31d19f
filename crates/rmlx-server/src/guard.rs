//! Request guards: the Host allow-list (a web page on a rebinding domain must not reach a
//! loopback server), the API key, CORS only for listed origins, and re-shaping errors for the
//! Anthropic routes. Reference: axum `examples/error-handling`, tower-http `cors`.

use axum::{
    extract::{Request, State},
    http::{header, HeaderValue, Method},
    middleware::Next,
    response::{IntoResponse, Response},
};
use tower_http::cors::{AllowOrigin, Any, CorsLayer};

use crate::{
    error::{Api, ApiError},
    AppState,
};

/// Anthropic's routes answer errors in Anthropic's shape; everything else in OpenAI's.
pub fn api_of(path: &str) -> Api {
    if path.starts_with("/v1/messages") {
        Api::Anthropic
    } else {
        Api::OpenAi
    }
}

/// Every error response passes here once, so this is also where the errors the server answers
/// itself (before the engine) are counted for `/metrics/cache`.
pub async fn shape_errors(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let api = api_of(request.uri().path());
    let response = next.run(request).await;
    let Some(error) = response.extensions().get::<ApiError>() else {
        return response;
    };
    if error.counted_by_server() {
        state.server_errors.record(error.kind());
    }
    match api {
        Api::Anthropic => error.response(Api::Anthropic),
        Api::OpenAi => response,
    }
}

/// Host names we answer to: loopback names, the bound host, and IP literals when bound to all
/// interfaces (an IP literal cannot be DNS-rebound; a LAN client uses one).
fn host_allowed(host: &str, bound: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or_default()
    } else {
        host.rsplit_once(':').map_or(host, |(name, _port)| name)
    }
    .to_ascii_lowercase();
    let bound = bound.trim_start_matches('[').trim_end_matches(']');
    if ["localhost", "127.0.0.1", "::1"].contains(&name.as_str())
        || name.eq_ignore_ascii_case(bound)
    {
        return true;
    }
    let all_interfaces = matches!(bound, "0.0.0.0" | "::");
    all_interfaces && name.parse::<std::net::IpAddr>().is_ok()
}

pub async fn check_host(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|value| value.to_str().ok())
        .map(str::to_string)
        .or_else(|| request.uri().authority().map(|a| a.to_string()));
    match host {
        None => ApiError::BadRequest("missing Host header".into()).into_response(),
        Some(host) if !host_allowed(&host, &state.config.host) => ApiError::Forbidden(format!(
            "Host `{host}` is not allowed: this server answers to localhost, 127.0.0.1, [::1] and {}",
            state.config.host
        ))
        .into_response(),
        Some(_) => next.run(request).await,
    }
}

/// With `--api-key`: OpenAI routes take `Authorization: Bearer`, Anthropic routes also
/// `x-api-key`. `/health` and CORS preflights stay open.
pub async fn require_key(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(expected) = state.config.api_key.as_deref() else {
        return next.run(request).await;
    };
    if request.uri().path() == "/health" || request.method() == Method::OPTIONS {
        return next.run(request).await;
    }
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(str::trim);
    let x_api_key = match api_of(request.uri().path()) {
        Api::Anthropic => headers.get("x-api-key").and_then(|v| v.to_str().ok()),
        Api::OpenAi => None,
    };
    let given: Vec<&str> = [bearer, x_api_key].into_iter().flatten().collect();
    if given.is_empty() {
        return ApiError::Unauthorized(
            "missing API key: send `Authorization: Bearer <key>` (or `x-api-key` on /v1/messages)"
                .into(),
        )
        .into_response();
    }
    if !given
        .iter()
        .any(|key| constant_time_eq(key.as_bytes(), expected.as_bytes()))
    {
        return ApiError::Unauthorized("invalid API key".into()).into_response();
    }
    next.run(request).await
}

/// Comparison time independent of where the first difference is.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// CORS stays off (browsers refuse cross-origin reads) unless origins are listed; `*` allows any.
pub fn cors(origins: &[String]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|origin| origin == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(
            origins
                .iter()
                .filter_map(|origin| HeaderValue::from_str(origin.trim_end_matches('/')).ok()),
        )
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers(Any),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_allow_list() {
        for host in [
            "localhost",
            "localhost:8080",
            "127.0.0.1:1",
            "[::1]:8080",
            "LOCALHOST",
        ] {
            assert!(host_allowed(host, "127.0.0.1"), "{host}");
        }
        for host in [
            "evil.com",
            "evil.com:8080",
            "127.0.0.1.evil.com",
            "192.168.1.2:8080",
        ] {
            assert!(!host_allowed(host, "127.0.0.1"), "{host}");
        }
        assert!(host_allowed("myhost.lan:8080", "myhost.lan"));
        assert!(host_allowed("192.168.1.2:8080", "0.0.0.0"));
        assert!(!host_allowed("evil.com", "0.0.0.0"));
    }
}
