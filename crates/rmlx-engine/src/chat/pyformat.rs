//! Python's text forms of template values, after CPython `Lib/json/encoder.py` (the `tojson`
//! filter HF installs: `json.dumps(x, ensure_ascii=False, ...)`) and `str()`/`repr()` (what jinja2
//! prints for `{{ value }}`).
//!
//! minijinja's own `tojson` writes compact `{"a":1}` and HTML-escapes `<>&'`, and it prints
//! `true`/`none`/`{"a": 1}` where jinja2 prints `True`/`None`/`{'a': 1}`; templates such as
//! Qwen3's print tool schemas and arguments this way, so the bytes have to be Python's.

use std::fmt::Write;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

struct Style {
    ensure_ascii: bool,
    /// `None` = one line; `Some(unit)` = newline plus `unit` per level, as Python's `indent`.
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// The filter: `x | tojson`, `tojson(x, indent=2)`, `tojson(x, separators=(",", ":"))`, ...
/// Positional arguments follow HF's signature order (ensure_ascii, indent, separators, sort_keys).
pub(crate) fn tojson(
    value: &Value,
    ensure_ascii: Option<bool>,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.or(ensure_ascii);
    let indent = kwargs.get::<Option<Value>>("indent")?.or(indent);
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
    };
    // Python drops the space after "," when indenting, since the newline separates items.
    let (mut item_sep, mut key_sep) = match indent {
        Some(_) => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    if let Some(seps) = separators.filter(|v| !v.is_none() && !v.is_undefined()) {
        let pair: Vec<Value> = seps.try_iter()?.collect();
        match pair.as_slice() {
            [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                item_sep = a.to_string();
                key_sep = b.to_string();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson separators must be two strings",
                ))
            }
        }
    }
    let style = Style {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

fn newline(out: &mut String, style: &Style, depth: usize) {
    if let Some(unit) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(unit);
        }
    }
}

fn write_value(out: &mut String, value: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => write!(out, "{value}").unwrap(),
        ValueKind::Number => out.push_str(&py_float_repr(f64::try_from(value.clone())?)),
        ValueKind::String => write_string(out, value.as_str().unwrap_or_default(), style),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, depth + 1);
                write_value(out, item, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, style, depth + 1);
                // Python turns int/bool/None keys into strings too.
                let key_text = match key.as_str() {
                    Some(s) => s.to_owned(),
                    None if key.is_none() => "null".to_owned(),
                    None => key.to_string(),
                };
                write_string(out, &key_text, style);
                out.push_str(&style.key_sep);
                write_value(out, &value.get_item(key)?, style, depth + 1)?;
            }
            newline(out, style, depth);
            out.push('}');
        }
        // Bytes, plain objects, ...: Python would raise; their string form is the useful answer.
        _ => write_string(out, &value.to_string(), style),
    }
    Ok(())
}

fn write_string(out: &mut String, s: &str, style: &Style) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => write!(out, "\\u{:04x}", c as u32).unwrap(),
            c if style.ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    write!(out, "\\u{unit:04x}").unwrap();
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, fixed notation for exponents in [-4, 16),
/// otherwise `d.ddde+XX`; always a `.0` when integral.
pub(crate) fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    // Rust's `{:e}` is also shortest round-trip: "-1.5e-7", "1e16", "0e0".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} always has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = sign.to_owned();
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.push_str(&"0".repeat(int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.push_str(&"0".repeat((-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs()).unwrap();
    }
    out
}

/// The formatter for `{{ value }}`: jinja2 prints `str(value)`, minijinja its own spelling.
pub(crate) fn py_formatter(
    out: &mut minijinja::Output,
    state: &minijinja::State,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Bool | ValueKind::None | ValueKind::Seq | ValueKind::Map => {
            out.write_str(&py_str(value)).map_err(Error::from)
        }
        ValueKind::Number if !value.is_integer() => {
            out.write_str(&py_str(value)).map_err(Error::from)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `str(x)`: strings as they are, containers as their `repr`.
pub(crate) fn py_str(value: &Value) -> String {
    match value.as_str() {
        Some(s) => s.to_owned(),
        None => {
            let mut out = String::new();
            write_repr(&mut out, value);
            out
        }
    }
}

fn write_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if value.is_integer() => write!(out, "{value}").unwrap(),
        ValueKind::Number => match f64::try_from(value.clone()) {
            Ok(f) if f.is_nan() => out.push_str("nan"),
            Ok(f) if f.is_infinite() => out.push_str(if f > 0.0 { "inf" } else { "-inf" }),
            Ok(f) => out.push_str(&py_float_repr(f)),
            Err(_) => write!(out, "{value}").unwrap(),
        },
        ValueKind::String => write_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &item);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &key);
                out.push_str(": ");
                write_repr(out, &value.get_item(&key).unwrap_or_default());
            }
            out.push('}');
        }
        _ => write!(out, "{value}").unwrap(),
    }
}

/// `repr(str)`: single quotes unless the text has a `'` and no `"`.
fn write_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..=0xa0).contains(&(c as u32)) => {
                write!(out, "\\x{:02x}", c as u32).unwrap()
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &str, ctx: serde_json::Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        env.set_formatter(py_formatter);
        env.render_str(template, Value::from_serialize(&ctx))
            .unwrap()
    }

    #[test]
    fn python_float_repr() {
        let cases = [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.5, "0.5"),
            (123.25, "123.25"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (0.0001, "0.0001"),
            (1e-5, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (0.1 + 0.2, "0.30000000000000004"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "{f:e}");
        }
    }

    #[test]
    fn default_style_matches_json_dumps() {
        // json.dumps({"b": [1, 2.0, None, True], "a": "x\"<é>\n", "e": {}, "l": []},
        //            ensure_ascii=False)
        let ctx = serde_json::json!({"x": {"b": [1, 2.0, null, true], "a": "x\"<é>\n", "e": {}, "l": []}});
        assert_eq!(
            render("{{ x | tojson }}", ctx),
            r#"{"b": [1, 2.0, null, true], "a": "x\"<é>\n", "e": {}, "l": []}"#
        );
    }

    #[test]
    fn indent_sort_keys_separators_and_ascii() {
        let ctx = serde_json::json!({"x": {"b": [1, {"c": null}], "a": "é🙂\u{1}"}});
        // json.dumps(x, indent=2, sort_keys=True, ensure_ascii=False)
        assert_eq!(
            render("{{ x | tojson(indent=2, sort_keys=true) }}", ctx.clone()),
            "{\n  \"a\": \"é🙂\\u0001\",\n  \"b\": [\n    1,\n    {\n      \"c\": null\n    }\n  ]\n}"
        );
        // json.dumps(x, separators=(",", ":"), ensure_ascii=True)
        assert_eq!(
            render(
                "{{ x | tojson(separators=(',', ':'), ensure_ascii=true) }}",
                ctx
            ),
            r#"{"b":[1,{"c":null}],"a":"\u00e9\ud83d\ude42\u0001"}"#
        );
    }

    #[test]
    fn printed_values_use_python_str() {
        // python: str(x) for each value, as jinja2's {{ }} prints them
        let ctx = serde_json::json!({"d": {"k": [1, 2.5, null, true, "it's"], "q": "a'b\"c\n"},
                                     "b": false, "n": null, "f": 3.0, "s": "plain 'text'"});
        assert_eq!(
            render("{{ d }}|{{ b }}|{{ n }}|{{ f }}|{{ s }}|{{ [] }}", ctx),
            r#"{'k': [1, 2.5, None, True, "it's"], 'q': 'a\'b"c\n'}|False|None|3.0|plain 'text'|[]"#
        );
    }
}
