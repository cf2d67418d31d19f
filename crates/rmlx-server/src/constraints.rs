//! What the server enforces of request fields, as the OpenAPI components the request types
//! point at (`#[schema(value_type = ...)]`): model ids as the registry takes them, token counts,
//! the sampling ranges the engine checks (`SamplingParams::validate`), token ids. Each bound is
//! the server's own, so the document refuses exactly what the server refuses where a schema can
//! say it (docs/SERVER.md lists the refusals it cannot state).

use std::collections::BTreeMap;

use utoipa::{
    openapi::{
        schema::{AdditionalProperties, KnownFormat, ObjectBuilder, Schema, SchemaFormat, Type},
        RefOr,
    },
    PartialSchema, ToSchema,
};

use crate::error::ApiError;

/// One part of a model id: not empty, not `.` or `..`, no `/`, backslash or NUL.
macro_rules! id_part {
    () => {
        r"(?:[^/\\\x00.][^/\\\x00]*|\.[^/\\\x00.][^/\\\x00]*|\.\.[^/\\\x00]+)"
    };
}

/// A model id (`registry::check_id`): relative, `/`-separated parts, none empty, `.` or `..`,
/// no backslash or NUL.
pub const MODEL_ID_PATTERN: &str = concat!("^", id_part!(), "(?:/", id_part!(), ")*$");

/// A `logit_bias` key: a token id in decimal (`u32::from_str` also takes a leading `+`).
pub const TOKEN_ID_KEY_PATTERN: &str = r"^\+?[0-9]+$";

/// Whitespace as Rust's `str::trim` sees it (Unicode `White_Space`), which `convert` trims off
/// an image reference.
macro_rules! space {
    () => {
        r"[\t\n\x0B\x0C\r \u0085\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000]*"
    };
}

/// Standard base64 with the unused bits of its last quantum zero, its padding optional (all of
/// it, some or none) and ASCII whitespace anywhere in it (line-wrapped): what
/// `convert::is_base64` and the engine's decoder take.
macro_rules! base64 {
    () => {
        concat!(
            r"(?:(?:[A-Za-z0-9+/][\t\n\x0C\r ]*){4})*",
            r"(?:[A-Za-z0-9+/][\t\n\x0C\r ]*[AQgw][\t\n\x0C\r ]*(?:=[\t\n\x0C\r ]*){0,2}",
            r"|(?:[A-Za-z0-9+/][\t\n\x0C\r ]*){2}[AEIMQUYcgkosw048][\t\n\x0C\r ]*(?:=[\t\n\x0C\r ]*)?)?"
        )
    };
}

/// An inline image as `convert::refuse_image` and the engine's decoder let it through: a
/// `data:` URI whose header (before its first comma) ends in `;base64` and whose payload is
/// base64 (ASCII whitespace before it), or bare base64 that does not start with `/` (taken for
/// a file path) unless with `/9j/` (a JPEG's). Remote URLs and file paths are refused. Whether
/// the bytes are an image is the decoder's call (a 400 the document cannot state).
pub const IMAGE_REF_PATTERN: &str = concat!(
    "^",
    space!(),
    r"(?:data:[^,]*;base64,[\t\n\x0C\r ]*|(?!/(?!9j/)))",
    base64!(),
    space!(),
    "$"
);

const F32_MAX: f64 = f32::MAX as f64;

fn number(minimum: Option<f64>, maximum: f64, description: &str) -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::Number)
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::Float)))
        .minimum(minimum)
        .maximum(Some(maximum))
        .description(Some(description))
}

fn int64(description: &str) -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::Integer)
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
        .minimum(Some(i64::MIN as isize))
        .maximum(Some(i64::MAX as isize))
        .description(Some(description))
}

/// The extension key a [`json_component!`] carries its JSON Schema under; `openapi::document`
/// merges it into the schema object (utoipa's types have no `not`, `const`, `if` / `then`).
pub const JSON_SCHEMA_KEY: &str = "x-rmlx-json-schema";

/// A component whose schema is written as JSON (for keywords utoipa's types lack), after the
/// components it refers to (`#/components/schemas/NAME`), which are registered with it.
#[macro_export]
macro_rules! json_component {
    ($(#[$doc:meta])* $vis:vis $name:ident [$($dep:ty),* $(,)?] => $json:expr) => {
        $(#[$doc])*
        $vis struct $name;

        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                let mut object = utoipa::openapi::schema::Object::with_type(
                    utoipa::openapi::schema::SchemaType::AnyValue,
                );
                object.extensions = Some(utoipa::openapi::extensions::Extensions::from_iter([(
                    $crate::constraints::JSON_SCHEMA_KEY,
                    $json,
                )]));
                utoipa::openapi::schema::Schema::Object(object).into()
            }
        }

        impl utoipa::ToSchema for $name {
            #[allow(unused_variables)]
            fn schemas(
                schemas: &mut Vec<(
                    String,
                    utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
                )>,
            ) {
                $(
                    schemas.push((
                        <$dep as utoipa::ToSchema>::name().into_owned(),
                        <$dep as utoipa::PartialSchema>::schema(),
                    ));
                    <$dep as utoipa::ToSchema>::schemas(schemas);
                )*
            }
        }
    };
}

/// A component whose schema is `$schema`.
macro_rules! component {
    ($(#[$doc:meta])* $name:ident => $schema:expr) => {
        $(#[$doc])*
        pub struct $name;

        impl PartialSchema for $name {
            fn schema() -> RefOr<Schema> {
                $schema.into()
            }
        }

        impl ToSchema for $name {}
    };
}

component!(
    /// A model id as `GET /v1/models` lists it.
    ModelId => ObjectBuilder::new()
        .schema_type(Type::String)
        .min_length(Some(1))
        .pattern(Some(MODEL_ID_PATTERN))
        .description(Some(
            "A model id as `GET /v1/models` lists it: `name` or `org/name` (parts separated \
             by `/`, none empty, `.` or `..`; no backslash or NUL).",
        ))
);

component!(
    /// Tokens to generate at most.
    MaxTokens => ObjectBuilder::new()
        .schema_type(Type::Integer)
        .minimum(Some(1))
        .maximum(Some(usize::MAX))
        .description(Some(
            "Tokens to generate at most: at least 1 (the answer also ends where the context \
             does).",
        ))
);

component!(
    Temperature => number(Some(0.0), F32_MAX, "0 is greedy; at least 0.")
);

component!(
    TopP => number(None, 1.0, "Nucleus sampling: more than 0, at most 1 (1 is off).")
        .exclusive_minimum(Some(0.0))
);

component!(
    MinP => number(
        Some(0.0),
        1.0,
        "Drops tokens below this fraction of the top probability: 0 (off) to 1.",
    )
);

component!(
    Penalty => number(
        Some(-F32_MAX),
        F32_MAX,
        "Subtracted from the logits of tokens already in the window (0 is off).",
    )
);

component!(
    RepetitionPenalty => number(
        None,
        F32_MAX,
        "Multiplicative penalty on tokens in the window: more than 0 (1 is off).",
    )
    .exclusive_minimum(Some(0.0))
);

component!(
    TopK => int64("Keeps the k most likely tokens; 0 or less keeps every token.")
);

component!(
    Seed => int64("The same seed gives the same tokens.")
);

component!(
    LogitBias => ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some(
            "Token id (in decimal, as a key) to a bias added to its logit. An id past the \
             model's vocabulary is refused (400).",
        ))
        .property_names(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .pattern(Some(TOKEN_ID_KEY_PATTERN)),
        ))
        .additional_properties(Some(AdditionalProperties::RefOr(RefOr::T(Schema::Object(
            number(Some(-F32_MAX), F32_MAX, "The bias.").build(),
        )))))
);

component!(
    /// A token id of the legacy `prompt`.
    TokenId => ObjectBuilder::new()
        .schema_type(Type::Integer)
        .minimum(Some(0))
        .maximum(Some(u32::MAX as usize))
        .description(Some(
            "A token id; one past the model's vocabulary is refused (400).",
        ))
);

component!(
    /// An inline image.
    ImageRef => ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(IMAGE_REF_PATTERN))
        .description(Some(
            "An image inline: a data URI (`data:image/png;base64,...`) or bare base64 (PNG, \
             JPEG, WebP, GIF, BMP, TIFF). Never fetched: remote URLs and file paths are \
             refused; bytes that are not an image are a 400 `bad image`.",
        ))
);

json_component!(
    /// A JSON Schema given to the constrained decoder.
    pub SchemaDocument [] => serde_json::json!({
        "anyOf": [{"type": "object"}, {"const": true}],
        "description": "A JSON Schema: an object, or `true` (`false` admits no answer); one \
            the constrained decoder cannot compile is refused (400)."
    })
);

component!(
    /// `n`: this server makes one choice per request.
    ChoiceCount => ObjectBuilder::new()
        .schema_type(Type::Integer)
        .minimum(Some(1))
        .maximum(Some(1))
        .description(Some("Must be 1: one choice per request."))
);

/// `logit_bias` as the sampler takes it: keys are token ids in decimal. A key of digits too
/// large for a token id is a token past the vocabulary (what the engine says of an id past the
/// model's), anything else is not a token id.
pub fn logit_bias(bias: Option<&BTreeMap<String, f32>>) -> Result<BTreeMap<u32, f32>, ApiError> {
    bias.into_iter()
        .flatten()
        .map(|(key, bias)| match key.parse::<u32>() {
            Ok(id) => Ok((id, *bias)),
            Err(_)
                if key
                    .trim_start_matches('+')
                    .bytes()
                    .all(|b| b.is_ascii_digit())
                    && key.len() > 1 =>
            {
                Err(ApiError::BadRequest(format!(
                    "logit_bias token id {key} is outside the vocabulary"
                )))
            }
            Err(_) => Err(ApiError::BadRequest(format!(
                "logit_bias key `{key}` is not a token id"
            ))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pattern takes exactly the ids `registry::check_id` takes.
    #[test]
    fn model_id_pattern_is_what_the_registry_takes() {
        let pattern = regex::Regex::new(MODEL_ID_PATTERN).unwrap();
        let pieces = ["a", ".", "..", "/", "\\", "\0", "é", " ", "b.", "-"];
        let mut ids = vec![String::new()];
        for _ in 0..4 {
            let longer: Vec<String> = ids
                .iter()
                .flat_map(|id| pieces.iter().map(move |piece| format!("{id}{piece}")))
                .collect();
            ids.extend(longer);
        }
        for id in &ids {
            assert_eq!(
                pattern.is_match(id),
                crate::registry::check_id(id).is_ok(),
                "{id:?}"
            );
        }
    }

    /// What the server lets through as an image reference: `refuse_image` finds it inline
    /// base64 (its answer is then "no vision") and the engine's decoder reads its base64 (it
    /// may still not be an image).
    fn server_takes_image(reference: &str) -> bool {
        use rmlx_engine::vision::{decode_image_source, ImageError, ImageLimits, SourcePolicy};
        let gate = crate::convert::refuse_image(reference, "m").to_string();
        let decoded =
            decode_image_source(reference, SourcePolicy::InlineOnly, &ImageLimits::default());
        gate.contains("has no vision")
            && !matches!(
                decoded,
                Err(ImageError::BadEncoding(_) | ImageError::RemoteUrl | ImageError::FilePath)
            )
    }

    #[test]
    fn image_pattern_is_what_the_server_takes() {
        let pattern = fancy_regex::Regex::new(IMAGE_REF_PATTERN).unwrap();
        let pieces = [
            "data:",
            "DATA:",
            "image/png",
            ";base64",
            ",",
            "QUJD",
            "QQ==",
            "QR==",
            "QUI=",
            "QQ",
            "QQ=",
            "/9j/",
            " ",
            "\u{a0}",
            "\u{b}",
            "\n",
            "\u{1c}",
            "http://",
            "file:",
            ".",
            "=",
            "a",
        ];
        let mut references = vec![String::new()];
        for _ in 0..3 {
            let longer: Vec<String> = references
                .iter()
                .flat_map(|r| pieces.iter().map(move |piece| format!("{r}{piece}")))
                .collect();
            references.extend(longer);
        }
        references.extend(
            [
                "data:image/png;base64,iVBORw0KGgo=",
                "data:image/jpeg;base64,/9j/4AAQ",
                "  data:a;b;base64, \tQUJD\u{3000}",
                "data:a,b;base64,QUJD",
                "data:;base64x;base64,QUJD",
                "/9j/4AAQ",
                "https://x.org/cat.png",
                "QUJD\nQUJD",
            ]
            .map(String::from),
        );
        for reference in &references {
            assert_eq!(
                pattern.is_match(reference).unwrap(),
                server_takes_image(reference),
                "{reference:?}"
            );
        }
    }

    #[test]
    fn logit_bias_keys() {
        let map = |key: &str| BTreeMap::from([(key.to_string(), 1.0f32)]);
        assert_eq!(logit_bias(Some(&map("42"))).unwrap()[&42], 1.0);
        assert_eq!(logit_bias(Some(&map("+7"))).unwrap()[&7], 1.0);
        let too_big = logit_bias(Some(&map("99999999999"))).unwrap_err();
        assert!(too_big.to_string().contains("outside the vocabulary"));
        for bad in ["", "x", "-1", "+", "1.5"] {
            let error = logit_bias(Some(&map(bad))).unwrap_err();
            assert!(error.to_string().contains("not a token id"), "{bad}");
        }
    }
}
