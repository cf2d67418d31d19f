//! The OpenAPI 3.1 document of `rmlx serve`, derived (utoipa) from the request and response
//! types the handlers use and the routes' own annotations: served at `/openapi.json`, committed
//! as docs/openapi.yaml (a test fails when that file is stale). Every operation gets the error
//! responses the server's error layer can give, in its API's shape (Anthropic's on
//! `/v1/messages*`, OpenAI's elsewhere), as `guard::shape_errors` chooses them.

use std::sync::OnceLock;

use axum::{
    http::header,
    response::{IntoResponse, Response},
};
use serde_json::{json, Map, Value};
use utoipa::{
    openapi::{
        security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme},
        SecurityRequirement,
    },
    Modify, OpenApi,
};

use crate::{anthropic, api, constraints, downloads, metrics, models, openai, responses};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "rMLX local server",
        description = "OpenAI- and Anthropic-compatible API of `rmlx serve` (127.0.0.1 by default), \
            plus the model manager's routes, download jobs and metrics. Unknown request fields are \
            ignored. With `--api-key`, every route but `/health` needs `Authorization: Bearer KEY` \
            (or `x-api-key: KEY` on `/v1/messages*`). Streams are Server-Sent Events: each `data:` \
            line of an OpenAI stream is the schema named in the route, then `data: [DONE]`; each \
            Anthropic event is a `MessageStreamEvent` and each Responses event a \
            `ResponseStreamEvent`, whose `event:` name is its `type`.",
        license(name = "MIT OR Apache-2.0"),
    ),
    paths(
        models::health,
        models::list,
        models::retrieve,
        models::delete,
        models::load,
        models::unload,
        openai::chat_completions,
        openai::completions,
        responses::create,
        anthropic::messages,
        anthropic::count_tokens,
        downloads::list,
        downloads::start,
        downloads::get,
        downloads::cancel,
        downloads::pause,
        downloads::resume,
        metrics::cache,
        metrics::clear_disk,
        metrics::prometheus,
        openapi_json,
    ),
    components(schemas(
        api::ChatCompletionChunk,
        api::TextCompletion,
        api::MessageStreamEvent,
        responses::types::ResponseStreamEvent,
        api::OpenAiError,
        api::AnthropicError,
    )),
    modifiers(&Security),
    tags(
        (name = "openai", description = "OpenAI-compatible generation"),
        (name = "anthropic", description = "Anthropic-compatible generation"),
        (name = "models", description = "Models on disk and in memory"),
        (name = "downloads", description = "Model downloads from the Hugging Face hub (needs --models-dir)"),
        (name = "server", description = "Health, metrics and this document"),
    ),
)]
pub struct ApiDoc;

/// The statuses the error layers can answer any route with.
const ERROR_STATUSES: [(&str, &str); 9] = [
    (
        "400",
        "Malformed JSON, wrong types or values, a prompt over the context, a missing Host",
    ),
    (
        "401",
        "The API key is missing or wrong (only with --api-key)",
    ),
    (
        "403",
        "The Host header is not one this server answers to (DNS-rebinding guard)",
    ),
    ("404", "Unknown model, download job or route"),
    (
        "409",
        "A conflict with the server's state (a download running, a job in the wrong state, \
         a --model folder to delete)",
    ),
    ("413", "The body is over --max-body-mb"),
    ("429", "The queue is full (--max-queue); retry later"),
    ("500", "The engine failed"),
    (
        "503",
        "Memory for this request could not be had (code out_of_memory); only this request failed",
    ),
];

struct Security;

impl Modify for Security {
    fn modify(&self, document: &mut utoipa::openapi::OpenApi) {
        let components = document.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        components.add_security_scheme(
            "x_api_key",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::new("x-api-key"))),
        );
        // Optional: a server started without --api-key takes requests without one.
        document.security = Some(vec![
            SecurityRequirement::default(),
            SecurityRequirement::new("bearer", Vec::<String>::new()),
            SecurityRequirement::new("x_api_key", Vec::<String>::new()),
        ]);
    }
}

/// The error responses, once per API shape under `components.responses`, referenced by every
/// operation that does not answer that status itself.
fn add_errors(document: &mut Value) {
    let mut responses = Map::new();
    for (shape, schema) in [("OpenAi", "OpenAiError"), ("Anthropic", "AnthropicError")] {
        for (status, description) in ERROR_STATUSES {
            responses.insert(
                format!("{shape}{status}"),
                json!({"description": description, "content": {"application/json": {
                    "schema": {"$ref": format!("#/components/schemas/{schema}")}}}}),
            );
        }
    }
    let Some(paths) = document["paths"].as_object_mut() else {
        return;
    };
    for (path, item) in paths.iter_mut() {
        let shape = if path.starts_with("/v1/messages") {
            "Anthropic"
        } else {
            "OpenAi"
        };
        let Some(item) = item.as_object_mut() else {
            continue;
        };
        for operation in item.values_mut() {
            let Some(answers) = operation["responses"].as_object_mut() else {
                continue;
            };
            for (status, _) in ERROR_STATUSES {
                answers.entry(status).or_insert_with(
                    || json!({"$ref": format!("#/components/responses/{shape}{status}")}),
                );
            }
        }
    }
    document["components"]["responses"] = Value::Object(responses);
}

/// utoipa 5 writes a Link's fields in snake case (`operation_id`); OpenAPI's are camel case.
fn fix_links(value: &mut Value) {
    match value {
        Value::Object(map) => {
            if let Some(Value::Object(links)) = map.get_mut("links") {
                for link in links.values_mut() {
                    let Some(link) = link.as_object_mut() else {
                        continue;
                    };
                    for (from, to) in [
                        ("operation_id", "operationId"),
                        ("operation_ref", "operationRef"),
                        ("request_body", "requestBody"),
                    ] {
                        if let Some(field) = link.remove(from) {
                            link.insert(to.to_string(), field);
                        }
                    }
                }
            }
            map.values_mut().for_each(fix_links);
        }
        Value::Array(items) => items.iter_mut().for_each(fix_links),
        _ => {}
    }
}

/// Merges each `json_component!`'s JSON Schema into its schema object.
fn expand_json_schemas(value: &mut Value) {
    match value {
        Value::Object(map) => {
            if let Some(Value::Object(schema)) = map.remove(constraints::JSON_SCHEMA_KEY) {
                map.extend(schema);
            }
            map.values_mut().for_each(expand_json_schemas);
        }
        Value::Array(items) => items.iter_mut().for_each(expand_json_schemas),
        _ => {}
    }
}

/// The document, built once.
pub fn document() -> &'static Value {
    static DOCUMENT: OnceLock<Value> = OnceLock::new();
    DOCUMENT.get_or_init(|| {
        let mut document = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
        add_errors(&mut document);
        fix_links(&mut document);
        expand_json_schemas(&mut document);
        if let Some(Value::Array(all)) =
            document.pointer_mut("/components/schemas/ChatRequest/allOf")
        {
            all.push(openai::chat_request_rules());
        }
        document
    })
}

/// docs/openapi.yaml as it should read (`rmlx openapi` writes it; a test compares).
pub fn yaml() -> String {
    let mut out = String::from(
        "# Generated from the server's types by `rmlx openapi > docs/openapi.yaml`; do not edit.\n",
    );
    write_yaml(document(), 0, &mut out);
    out
}

/// Block-style YAML with every string double-quoted (JSON's escapes are YAML's): a YAML 1.1
/// reader would otherwise take a bare `yes` or `no` (the `fits` values) for a boolean.
fn write_yaml(value: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (key, item) in map {
                out.push_str(&format!("{pad}{}:", yaml_key(key)));
                write_child(item, indent, out);
            }
        }
        Value::Array(items) if !items.is_empty() => {
            for item in items {
                out.push_str(&format!("{pad}-"));
                write_child(item, indent, out);
            }
        }
        scalar => out.push_str(&format!("{pad}{scalar}\n")),
    }
}

/// What follows `key:` or `-`: a scalar (or empty collection) on the same line, else the nested
/// block two spaces in.
fn write_child(value: &Value, indent: usize, out: &mut String) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            out.push('\n');
            write_yaml(value, indent + 2, out);
        }
        Value::Array(items) if !items.is_empty() => {
            out.push('\n');
            write_yaml(value, indent + 2, out);
        }
        scalar => out.push_str(&format!(" {scalar}\n")),
    }
}

/// A key as it is when YAML reads it back as the same string, else quoted.
fn yaml_key(key: &str) -> String {
    let plain = key
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == '$')
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.$".contains(c))
        && !["y", "n", "yes", "no", "on", "off", "true", "false", "null"]
            .contains(&key.to_ascii_lowercase().as_str());
    match plain {
        true => key.to_string(),
        false => Value::String(key.to_string()).to_string(),
    }
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "server",
    responses((status = 200, description = "This OpenAPI 3.1 document", content_type = "application/json",
        body = Object)))]
pub async fn openapi_json() -> Response {
    static JSON: OnceLock<String> = OnceLock::new();
    let body = JSON.get_or_init(|| document().to_string());
    ([(header::CONTENT_TYPE, "application/json")], body.clone()).into_response()
}
