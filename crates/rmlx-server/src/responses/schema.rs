//! The request's shapes as the OpenAPI document describes them: the handler reads the JSON
//! itself (`input`), leniently, so these say exactly what it takes (`input.rs` is the parser
//! each rule mirrors). Item, part and tool lists are `anyOf`: a type the server ignores is any
//! object with another string `type`. Written as JSON Schema (`json_component!`) for the
//! keywords utoipa's types lack (`const`, `not`, `if` / `then`). Reference: OpenAI API
//! reference (Responses: create).

use serde_json::json;

use crate::{constraints, json_component};

const MESSAGE: &str = "#/components/schemas/ResponsesMessageItem";
const PART: &str = "#/components/schemas/ResponsesContentPart";
const FUNCTION_TOOL: &str = "#/components/schemas/ResponsesFunctionTool";
const CUSTOM_TOOL: &str = "#/components/schemas/ResponsesCustomTool";

/// The item types the server reads (others are ignored, and logged).
const ITEM_TYPES: [&str; 6] = [
    "message",
    "function_call",
    "custom_tool_call",
    "function_call_output",
    "custom_tool_call_output",
    "reasoning",
];

json_component!(
    /// `input`: one user message as a string, or items.
    pub(super) ResponsesInput [ResponsesInputItem] => json!({
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"$ref": "#/components/schemas/ResponsesInputItem"}}
        ]
    })
);

json_component!(
    /// An input item: a message (`type` may be left out), a past call, a call's output, past
    /// reasoning, or an item of another type, which is ignored.
    ResponsesInputItem [ResponsesMessageItem, ResponsesContentPart] => json!({
        "anyOf": [
            {"$ref": MESSAGE},
            {"type": "object", "required": ["type", "name"],
             "description": "A past call; `arguments` is a JSON object as a string (a \
                 `custom_tool_call` has `input` instead). `namespace` names the namespace tool \
                 it belongs to.",
             "properties": {
                "type": {"enum": ["function_call", "custom_tool_call"]},
                "name": {"type": "string"},
                "call_id": {},
                "namespace": {},
                "arguments": {},
                "input": {}}},
            {"type": "object", "required": ["type", "call_id"],
             "description": "A call's result: a string, content parts (text and inline \
                 images), or early Codex's `{content, success}`.",
             "properties": {
                "type": {"enum": ["function_call_output", "custom_tool_call_output"]},
                "call_id": {"type": "string"},
                "output": {"oneOf": [
                    {"type": "null"},
                    {"type": "string"},
                    {"type": "array", "items": {"$ref": PART}},
                    {"type": "object", "required": ["content"],
                     "properties": {"content": {"type": "string"}}}]}}},
            {"type": "object", "required": ["type"],
             "description": "Past reasoning: `encrypted_content` (what this server sent: the \
                 text itself), else the `content` text, else the summary, is rendered as that \
                 turn's reasoning.",
             "properties": {
                "type": {"const": "reasoning"},
                "encrypted_content": {},
                "summary": {},
                "content": {}}},
            {"type": "object", "required": ["type"],
             "description": "An item of another type (`web_search_call`, `item_reference`, \
                 ...): ignored.",
             "properties": {"type": {"type": "string", "not": {"enum": ITEM_TYPES}}}}
        ]
    })
);

json_component!(
    /// A message (`type` may be left out): leading `system` / `developer` messages join the
    /// system prompt; later ones stay where they are, inside the user or tool turn next to them.
    ResponsesMessageItem [ResponsesContentPart] => json!({
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "type": {"const": "message"},
            "role": {"enum": ["user", "assistant", "system", "developer"]},
            "content": {"oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"$ref": PART}}]}
        }
    })
);

json_component!(
    /// A content part: text (`input_text`, `output_text`, `text`; `refusal`), an inline image,
    /// or a part of another (non-empty) type, which is ignored.
    ResponsesContentPart [constraints::ImageRef] => json!({
        "anyOf": [
            {"type": "object", "required": ["type", "text"], "properties": {
                "type": {"enum": ["input_text", "output_text", "text"]},
                "text": {"type": "string"}}},
            {"type": "object", "required": ["type", "refusal"], "properties": {
                "type": {"const": "refusal"},
                "refusal": {"type": "string"}}},
            {"type": "object", "required": ["type", "image_url"],
             "description": "An image, inline (never fetched; a `file_id` is refused).",
             "properties": {
                "type": {"const": "input_image"},
                "image_url": {"oneOf": [
                    {"$ref": "#/components/schemas/ImageRef"},
                    {"type": "object",
                     "properties": {"url": {"$ref": "#/components/schemas/ImageRef"}}}]},
                "detail": {"type": ["string", "null"]}}},
            {"type": "object", "required": ["type"], "properties": {"type": {
                "type": "string",
                "minLength": 1,
                "not": {"enum": ["input_text", "output_text", "text", "refusal", "input_image"]}}}}
        ]
    })
);

json_component!(
    /// A tool: `function`, `custom` (freeform: one string argument), `namespace` (its tools
    /// flattened to `NAMESPACE__NAME` functions), or a built-in tool of another type, which is
    /// dropped (and logged).
    pub(super) ResponseToolIn [ResponsesFunctionTool, ResponsesCustomTool] => json!({
        "anyOf": [
            {"$ref": FUNCTION_TOOL},
            {"$ref": CUSTOM_TOOL},
            {"type": "object", "required": ["type", "name", "tools"],
             "description": "A group of tools, each seen by the model as `NAMESPACE__NAME` \
                 (Codex's rule: the namespace without trailing `_`, the name without leading \
                 `_`); calls come back with `namespace` and `name`. Nested tools of other \
                 types are dropped.",
             "properties": {
                "type": {"const": "namespace"},
                "name": {"type": "string", "minLength": 1},
                "description": {},
                "tools": {"type": "array", "items": {
                    "if": {"type": "object", "required": ["type"],
                           "properties": {"type": {"enum": ["function", "custom"]}}},
                    "then": {"required": ["name"],
                             "properties": {"name": {"type": "string", "minLength": 1}}}}}}},
            {"type": "object", "required": ["type"],
             "description": "A built-in tool (`web_search`, `image_generation`, ...): dropped.",
             "properties": {"type": {
                "type": "string",
                "not": {"enum": ["function", "custom", "namespace"]}}}}
        ]
    })
);

json_component!(
    ResponsesFunctionTool [] => json!({
        "type": "object",
        "required": ["type", "name"],
        "properties": {
            "type": {"const": "function"},
            "name": {"type": "string", "minLength": 1},
            "description": {"description": "Shown to the model when it is a string."},
            "parameters": {"description": "A JSON Schema of the arguments (absent, or not an \
                object: no arguments)."},
            "strict": {}
        }
    })
);

json_component!(
    /// A freeform tool: the model sees a function of one string argument, `input`. A `grammar`
    /// `format` (Lark or a regex) holds that input where the model writes it raw (XML calls);
    /// see docs/SERVER.md.
    ResponsesCustomTool [] => json!({
        "type": "object",
        "required": ["type", "name"],
        "properties": {
            "type": {"const": "custom"},
            "name": {"type": "string", "minLength": 1},
            "description": {},
            "format": {
                "if": {"type": "object", "required": ["type"],
                       "properties": {"type": {"const": "grammar"}}},
                "then": {"required": ["definition"], "properties": {
                    "definition": {"type": "string"},
                    "syntax": {"enum": ["lark", "regex"]}}}
            }
        }
    })
);

json_component!(
    /// `none`, `auto`, `required`, `{"type": "function" | "custom", "name", "namespace"?}` (a
    /// forced call of that tool), `{"type": "allowed_tools", "mode", "tools"}` (`mode:
    /// "required"` forces a call); an object of another `type` (a built-in tool's) means `auto`.
    pub(super) ToolChoiceIn [] => json!({
        "oneOf": [
            {"enum": ["none", "auto", "required"]},
            {"type": "object",
             "required": ["type"],
             "properties": {
                "type": {"type": "string"},
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "mode": {"type": "string"},
                "tools": {"type": "array"}},
             "allOf": [
                {"if": {"properties": {"type": {"enum": ["function", "custom"]}}},
                 "then": {"required": ["name"]}},
                {"if": {"properties": {"type": {"const": "allowed_tools"}}},
                 "then": {"required": ["tools"]}}]}
        ]
    })
);

json_component!(
    /// `text.format`: `text`, `json_object` or `json_schema` (`name`, `schema`, `strict`),
    /// enforced by constrained decoding.
    pub(super) TextFormatIn [constraints::SchemaDocument] => json!({
        "oneOf": [
            {"type": "object", "required": ["type"],
             "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type"], "properties": {
                "type": {"const": "json_schema"},
                "name": {"type": "string"},
                "description": {"type": ["string", "null"]},
                "schema": {"$ref": "#/components/schemas/SchemaDocument"},
                "strict": {"type": ["boolean", "null"]}}}
        ]
    })
);

json_component!(
    /// Only null: conversation objects are not kept.
    pub(super) NullOnly [] => json!({"type": "null"})
);
