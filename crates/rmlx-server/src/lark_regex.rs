//! A Lark grammar as one regular expression, when it is regular: every rule and terminal is
//! inlined into `start`, so a grammar without recursion becomes a regex. Qwen3's JSON call format
//! writes a freeform tool's input as a JSON string, and a grammar can hold a JSON string only as
//! a regex (llguidance quotes a string `pattern` into JSON escapes; a context-free grammar has no
//! such mapping). Codex's `apply_patch` grammar is of this kind: no rule refers to itself.
//!
//! The subset read: rules and terminals (`name:` / `NAME:`, `?` / `!` prefixes, `.priority`),
//! alternatives on continuation lines, `"literal"` (with `i`), `"a".."z"` ranges, `/regex/flags`,
//! groups, `[optional]`, `?` `*` `+`, `~ n` and `~ n..m`, `-> alias` (dropped), `//` comments and
//! `%import common.NAME` for Lark's common terminals. Anything else (`%ignore`, templates,
//! recursion) is `Err`: the grammar is then shown to the model, not enforced.
//! Reference: Lark's grammar reference (`lark-parser` docs, `grammars/common.lark`).

use std::collections::HashMap;

/// The regex (Rust `regex` syntax) of `grammar`'s `start` language, or why there is none.
pub fn lark_to_regex(grammar: &str) -> Result<String, String> {
    let definitions = definitions(grammar)?;
    let mut inliner = Inliner {
        definitions: &definitions,
        done: HashMap::new(),
        open: Vec::new(),
    };
    inliner.regex("start")
}

/// Lark's `common.lark` terminals a grammar may import, as regexes.
fn common(name: &str) -> Option<&'static str> {
    Some(match name {
        "LF" => r"\n",
        "CR" => r"\r",
        "NEWLINE" => r"(?:\r?\n)+",
        "WS" => r"[ \t\f\r\n]+",
        "WS_INLINE" => r"[ \t]+",
        "DIGIT" => r"[0-9]",
        "HEXDIGIT" => r"[a-fA-F0-9]",
        "INT" => r"[0-9]+",
        "SIGNED_INT" => r"[+-]?[0-9]+",
        "DECIMAL" => r"(?:[0-9]+\.[0-9]*|\.[0-9]+)",
        "NUMBER" => {
            r"(?:(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+(?:[eE][+-]?[0-9]+)?)"
        }
        "LCASE_LETTER" => r"[a-z]",
        "UCASE_LETTER" => r"[A-Z]",
        "LETTER" => r"[a-zA-Z]",
        "WORD" => r"[a-zA-Z]+",
        "CNAME" => r"[_a-zA-Z][_a-zA-Z0-9]*",
        "ESCAPED_STRING" => r#""(?:[^"\\]|\\.)*""#,
        _ => return None,
    })
}

/// `name -> expansion text`, continuation lines joined; imports as ready regexes.
enum Definition {
    Lark(String),
    Regex(String),
}

fn definitions(grammar: &str) -> Result<HashMap<String, Definition>, String> {
    let mut out: HashMap<String, Definition> = HashMap::new();
    let mut current: Option<String> = None;
    for raw in grammar.lines() {
        let line = strip_comment(raw);
        let trimmed = line.trim();
        if trimmed.is_empty() {
            continue;
        }
        if let Some(directive) = trimmed.strip_prefix('%') {
            current = None;
            let mut words = directive.split_whitespace();
            match (words.next(), words.next()) {
                (Some("import"), Some(path)) => {
                    for (name, regex) in imports(path, words.collect::<Vec<_>>().join(" "))? {
                        out.insert(name, Definition::Regex(regex.to_string()));
                    }
                }
                _ => return Err(format!("`%{directive}` has no regular form")),
            }
            continue;
        }
        if let Some(rest) = trimmed.strip_prefix('|') {
            let name = current.as_ref().ok_or("a `|` line continues no rule")?;
            if let Some(Definition::Lark(body)) = out.get_mut(name) {
                body.push_str(" | ");
                body.push_str(rest);
            }
            continue;
        }
        let (head, body) = split_definition(trimmed)
            .ok_or_else(|| format!("`{trimmed}` is not a rule or terminal definition"))?;
        out.insert(head.clone(), Definition::Lark(body.to_string()));
        current = Some(head);
    }
    Ok(out)
}

/// `%import common.NAME`, `%import common.NAME -> ALIAS`, `%import common (A, B)`.
fn imports(path: &str, rest: String) -> Result<Vec<(String, &'static str)>, String> {
    let unknown = |name: &str| format!("`%import {name}` is not one of Lark's common terminals");
    if let Some(name) = path.strip_prefix("common.") {
        let regex = common(name).ok_or_else(|| unknown(path))?;
        let alias = rest.trim().strip_prefix("->").map(str::trim);
        return Ok(vec![(alias.unwrap_or(name).to_string(), regex)]);
    }
    let list = format!("{path} {rest}");
    let names = list
        .strip_prefix("common")
        .map(str::trim)
        .and_then(|list| list.strip_prefix('('))
        .and_then(|list| list.trim_end().strip_suffix(')'))
        .ok_or_else(|| unknown(&list))?;
    names
        .split(',')
        .map(|name| {
            let name = name.trim();
            Ok((name.to_string(), common(name).ok_or_else(|| unknown(name))?))
        })
        .collect()
}

/// Drops a `//` comment, leaving `//` inside strings and regexes alone.
fn strip_comment(line: &str) -> &str {
    let bytes = line.as_bytes();
    let (mut in_string, mut in_regex, mut i) = (false, false, 0);
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if in_string || in_regex => i += 1,
            b'"' if !in_regex => in_string = !in_string,
            b'/' if !in_string && !in_regex && bytes.get(i + 1) == Some(&b'/') => {
                return &line[..i]
            }
            b'/' if !in_string => in_regex = !in_regex,
            _ => {}
        }
        i += 1;
    }
    line
}

/// `?name.2: body` as (`name`, `body`).
fn split_definition(line: &str) -> Option<(String, &str)> {
    let colon = line.find(':')?;
    let head = line[..colon].trim().trim_start_matches(['?', '!']);
    let name = head.split('.').next()?.trim();
    let valid = !name.is_empty()
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit());
    valid.then(|| (name.to_string(), &line[colon + 1..]))
}

struct Inliner<'a> {
    definitions: &'a HashMap<String, Definition>,
    done: HashMap<String, String>,
    /// Names being inlined: meeting one again is recursion.
    open: Vec<String>,
}

impl Inliner<'_> {
    fn regex(&mut self, name: &str) -> Result<String, String> {
        if let Some(done) = self.done.get(name) {
            return Ok(done.clone());
        }
        if self.open.iter().any(|open| open == name) {
            return Err(format!(
                "`{name}` refers to itself: the language is not regular"
            ));
        }
        let regex = match self.definitions.get(name) {
            None => return Err(format!("`{name}` is not defined")),
            Some(Definition::Regex(regex)) => format!("(?:{regex})"),
            Some(Definition::Lark(body)) => {
                self.open.push(name.to_string());
                let tokens = tokenize(body)?;
                let mut parser = Parser {
                    tokens: &tokens,
                    at: 0,
                    inliner: self,
                };
                let regex = parser.alternatives()?;
                if parser.at != tokens.len() {
                    return Err(format!("`{name}`: unexpected {:?}", tokens[parser.at]));
                }
                self.open.pop();
                format!("(?:{regex})")
            }
        };
        self.done.insert(name.to_string(), regex.clone());
        Ok(regex)
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    /// A literal's text (escapes read), case-insensitive when `true`.
    Literal(String, bool),
    Regex(String),
    Name(String),
    Number(usize),
    Punct(&'static str),
}

fn tokenize(body: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = body.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            ' ' | '\t' => i += 1,
            '"' => {
                let (text, next) = literal(&chars, i + 1)?;
                let insensitive = chars.get(next) == Some(&'i');
                out.push(Token::Literal(text, insensitive));
                i = next + usize::from(insensitive);
            }
            '/' => {
                let mut j = i + 1;
                let mut regex = String::new();
                while j < chars.len() && chars[j] != '/' {
                    if chars[j] == '\\' && j + 1 < chars.len() {
                        // `\/` is a slash; other escapes stay as the regex wrote them.
                        if chars[j + 1] != '/' {
                            regex.push('\\');
                        }
                        j += 1;
                    }
                    regex.push(chars[j]);
                    j += 1;
                }
                if j >= chars.len() {
                    return Err("a /regex/ is not closed".into());
                }
                j += 1;
                let mut flags = String::new();
                while j < chars.len() && "imslux".contains(chars[j]) {
                    flags.push(chars[j]);
                    j += 1;
                }
                // Rust's regex takes i, m, s, x, u inline; Lark's `l` (locale) has no meaning here.
                flags.retain(|f| f != 'l');
                out.push(Token::Regex(if flags.is_empty() {
                    regex
                } else {
                    format!("(?{flags}:{regex})")
                }));
                i = j;
            }
            '-' if chars.get(i + 1) == Some(&'>') => {
                // `-> alias`: names the tree node, nothing to match.
                i += 2;
                while chars.get(i) == Some(&' ') {
                    i += 1;
                }
                while chars
                    .get(i)
                    .is_some_and(|c| c.is_ascii_alphanumeric() || *c == '_')
                {
                    i += 1;
                }
            }
            '.' if chars.get(i + 1) == Some(&'.') => {
                out.push(Token::Punct(".."));
                i += 2;
            }
            '|' | '(' | ')' | '[' | ']' | '?' | '*' | '+' | '~' => {
                let punct = ["|", "(", ")", "[", "]", "?", "*", "+", "~"]
                    .into_iter()
                    .find(|p| p.starts_with(c))
                    .expect("listed");
                out.push(Token::Punct(punct));
                i += 1;
            }
            c if c.is_ascii_digit() => {
                let start = i;
                while chars.get(i).is_some_and(char::is_ascii_digit) {
                    i += 1;
                }
                let number: String = chars[start..i].iter().collect();
                out.push(Token::Number(number.parse().map_err(|_| "a bad count")?));
            }
            c if c.is_ascii_alphabetic() || c == '_' => {
                let start = i;
                while chars
                    .get(i)
                    .is_some_and(|c| c.is_ascii_alphanumeric() || *c == '_')
                {
                    i += 1;
                }
                out.push(Token::Name(chars[start..i].iter().collect()));
            }
            other => return Err(format!("`{other}` has no regular form here")),
        }
    }
    Ok(out)
}

/// A `"..."` literal's text from `at` (after the opening quote), and the index after it.
fn literal(chars: &[char], mut at: usize) -> Result<(String, usize), String> {
    let mut text = String::new();
    while at < chars.len() {
        match chars[at] {
            '"' => return Ok((text, at + 1)),
            '\\' => {
                let escaped = *chars.get(at + 1).ok_or("a literal ends in `\\`")?;
                text.push(match escaped {
                    'n' => '\n',
                    't' => '\t',
                    'r' => '\r',
                    'f' => '\x0c',
                    '0' => '\0',
                    other => other,
                });
                at += 2;
            }
            c => {
                text.push(c);
                at += 1;
            }
        }
    }
    Err("a literal is not closed".into())
}

struct Parser<'t, 'i, 'a> {
    tokens: &'t [Token],
    at: usize,
    inliner: &'i mut Inliner<'a>,
}

impl Parser<'_, '_, '_> {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    fn eat(&mut self, punct: &str) -> bool {
        let found = matches!(self.peek(), Some(Token::Punct(p)) if *p == punct);
        self.at += usize::from(found);
        found
    }

    fn alternatives(&mut self) -> Result<String, String> {
        let mut options = vec![self.sequence()?];
        while self.eat("|") {
            options.push(self.sequence()?);
        }
        Ok(options.join("|"))
    }

    fn sequence(&mut self) -> Result<String, String> {
        let mut out = String::new();
        while let Some(token) = self.peek() {
            if matches!(token, Token::Punct("|" | ")" | "]")) {
                break;
            }
            out.push_str(&self.repeated()?);
        }
        Ok(out)
    }

    fn repeated(&mut self) -> Result<String, String> {
        let atom = self.atom()?;
        if self.eat("?") {
            return Ok(format!("(?:{atom})?"));
        }
        if self.eat("*") {
            return Ok(format!("(?:{atom})*"));
        }
        if self.eat("+") {
            return Ok(format!("(?:{atom})+"));
        }
        if self.eat("~") {
            let low = self.number()?;
            let high = if self.eat("..") { self.number()? } else { low };
            return Ok(format!("(?:{atom}){{{low},{high}}}"));
        }
        Ok(atom)
    }

    fn number(&mut self) -> Result<usize, String> {
        match self.peek() {
            Some(Token::Number(n)) => {
                let n = *n;
                self.at += 1;
                Ok(n)
            }
            other => Err(format!("a count was expected, not {other:?}")),
        }
    }

    fn atom(&mut self) -> Result<String, String> {
        let token = self.peek().cloned().ok_or("an expression ends early")?;
        self.at += 1;
        match token {
            Token::Punct("(") => {
                let inner = self.alternatives()?;
                self.eat(")").then_some(()).ok_or("a `(` is not closed")?;
                Ok(format!("(?:{inner})"))
            }
            Token::Punct("[") => {
                let inner = self.alternatives()?;
                self.eat("]").then_some(()).ok_or("a `[` is not closed")?;
                Ok(format!("(?:{inner})?"))
            }
            Token::Literal(text, insensitive) => {
                if self.eat("..") {
                    let Some(Token::Literal(high, _)) = self.peek().cloned() else {
                        return Err("a range needs a literal after `..`".into());
                    };
                    self.at += 1;
                    let (Some(low), Some(high)) = (single(&text), single(&high)) else {
                        return Err("a range's ends are single characters".into());
                    };
                    return Ok(format!(
                        "[{}-{}]",
                        regex_syntax_escape(low),
                        regex_syntax_escape(high)
                    ));
                }
                let escaped: String = text.chars().map(regex_syntax_escape).collect();
                Ok(match insensitive {
                    true => format!("(?i:{escaped})"),
                    false => format!("(?:{escaped})"),
                })
            }
            Token::Regex(regex) => Ok(format!("(?:{regex})")),
            Token::Name(name) => self.inliner.regex(&name),
            other => Err(format!("unexpected {other:?}")),
        }
    }
}

fn single(text: &str) -> Option<char> {
    let mut chars = text.chars();
    let c = chars.next()?;
    chars.next().is_none().then_some(c)
}

/// One character as a regex matching exactly it.
fn regex_syntax_escape(c: char) -> String {
    match c {
        '\n' => r"\n".into(),
        '\t' => r"\t".into(),
        '\r' => r"\r".into(),
        c if r"\.+*?()|[]{}^$#&-~".contains(c) => format!("\\{c}"),
        c => c.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(grammar: &str) -> regex::Regex {
        let regex = lark_to_regex(grammar).unwrap();
        regex::Regex::new(&format!("^(?:{regex})$")).unwrap()
    }

    /// A patch language in the shape of Codex's `apply_patch` grammar: rules over terminals,
    /// alternatives on `|` lines, `?` `+`, regex terminals, an imported LF, an alias.
    const PATCH: &str = r#"
start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk
    | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF  // no body
update_hunk: "*** Update File: " filename LF change?
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change: (("@@" | "@@ " /(.+)/) LF | ("+" | "-" | " ") /(.*)/ LF)+

%import common.LF
"#;

    #[test]
    fn a_regular_grammar_matches_what_it_describes_and_nothing_else() {
        let patch = matcher(PATCH);
        for good in [
            "*** Begin Patch\n*** Delete File: a.txt\n*** End Patch",
            "*** Begin Patch\n*** Add File: b.py\n+print(1)\n+\n*** End Patch\n",
            "*** Begin Patch\n*** Update File: c.rs\n@@ fn main\n-a\n+b\n c\n*** End Patch",
        ] {
            assert!(patch.is_match(good), "{good:?}");
        }
        for bad in [
            "*** Begin Patch\n*** End Patch",
            "*** Begin Patch\n*** Add File: b.py\n*** End Patch",
            "*** Begin Patch\n*** Remove File: a\n*** End Patch",
            "Begin Patch",
        ] {
            assert!(!patch.is_match(bad), "{bad:?}");
        }
    }

    #[test]
    fn literals_ranges_counts_flags_and_imports() {
        let m = matcher("start: \"a\"..\"c\" ~ 2..3 SEP? WORD \"x\"i /y+/i\nSEP: \"-\" | \".\"\n%import common (WORD)\n");
        assert!(!m.is_match("abc-hello"), "the `x` is missing");
        assert!(m.is_match("ab-helloXyY"));
        assert!(m.is_match("cca.woRdxyyy"));
        assert!(!m.is_match("a-helloxy"), "two to three of a..c");
        let quoted = matcher(r#"start: "a.b" "\"" "\n""#);
        assert!(quoted.is_match("a.b\"\n") && !quoted.is_match("axb\"\n"));
        let optional = matcher("start: \"k\" [\"=\" /[0-9]+/]");
        assert!(optional.is_match("k") && optional.is_match("k=12") && !optional.is_match("k="));
    }

    #[test]
    fn what_has_no_regular_form_is_an_error() {
        for (grammar, why) in [
            ("start: \"(\" start \")\" | \"x\"", "refers to itself"),
            (
                "start: a\na: \"[\" b \"]\"\nb: a | \"x\"",
                "refers to itself",
            ),
            (
                "start: WORD\n%import common.WORD\n%ignore \" \"",
                "no regular form",
            ),
            ("start: missing", "not defined"),
            ("rule: \"x\"", "`start` is not defined"),
            ("start: %json {}", "no regular form"),
        ] {
            let error = lark_to_regex(grammar).unwrap_err();
            assert!(error.contains(why), "{grammar:?}: {error}");
        }
    }
}
