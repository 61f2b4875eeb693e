//! Reading the Trainer's YAML / JSON files (`--config train.yaml`, a hyperparameter-search file) into typed structs,
//! with errors as strict and as plain as the `accel` CLI's: the file and the position once, the key a misspelling
//! was meant to be, what a key expects (`num_train_epochs: expected a number …, got `two``), the line where an
//! unclosed `[` opens. The message texts come from the `config-errors` crate, shared with the CLI.

use std::path::Path;

use config_errors::{clean_parser_message, key_and_value_at, unclosed_bracket_hint, unknown_key};
use serde::de::DeserializeOwned;

use crate::error::TrainerError;

/// What a key of a typed struct accepts, in words, for the keys whose parser message does not say it
/// (`invalid floating point`); `None` keeps the parser's message.
pub(crate) type Expects<'a> = &'a dyn Fn(&str) -> Option<&'static str>;

/// Parses `text` (the contents of `path`; JSON when the file name ends in `.json`, YAML otherwise) as `T`, a
/// struct read from a mapping of keys. In three passes, so that each error is said in its own terms: the syntax
/// (a malformed file), the shape (an empty file, or a list or a scalar instead of a mapping), then the keys and
/// values against `T`. Returns `T` and the keys the file sets (from the syntax pass, so the file is not read a
/// third time for them).
pub(crate) fn parse<T: DeserializeOwned>(
    path: &Path,
    text: &str,
    expects: Expects<'_>,
) -> Result<(T, Vec<String>), TrainerError> {
    let error = |reason: String| TrainerError::ConfigFile { path: path.to_path_buf(), reason };
    let empty = || {
        error(
            "the file is empty (or holds only comments); write one `key: value` per line (in JSON, an object \
             `{\"key\": value}`)"
                .to_string(),
        )
    };
    if text.trim().is_empty() {
        return Err(empty());
    }
    let json = is_json(path);
    let syntax: Result<serde_json::Value, (Option<(usize, usize)>, String)> =
        if json { serde_json::from_str(text).map_err(|e| json_failure(&e)) } else { yaml(text) };
    let keys = match syntax {
        Err((at, message)) => return Err(error(syntax_reason(text, at, &message))),
        Ok(serde_json::Value::Object(map)) => map.into_iter().map(|(k, _)| k).collect(),
        Ok(serde_json::Value::Null) if !json => return Err(empty()),
        Ok(other) => {
            let got = match other {
                serde_json::Value::Array(_) => "a list".to_string(),
                serde_json::Value::Null => "nothing (null)".to_string(),
                scalar => format!("the value `{scalar}`"),
            };
            return Err(error(format!(
                "expected a mapping of keys to values (one `key: value` per line; in JSON, an object \
                 `{{\"key\": value}}`), got {got}"
            )));
        }
    };
    let typed: Result<T, (Option<(usize, usize)>, String)> =
        if json { serde_json::from_str(text).map_err(|e| json_failure(&e)) } else { yaml(text) };
    let value = typed.map_err(|(at, message)| error(reason(text, at, &message, expects)))?;
    Ok((value, keys))
}

/// A YAML parse of `text`, or the error's position and bare message (no snippet: it names the source `<input>`;
/// no position: the caller gives it once).
fn yaml<T: DeserializeOwned>(text: &str) -> Result<T, (Option<(usize, usize)>, String)> {
    use serde_saphyr::MessageFormatter;
    serde_saphyr::from_str(text).map_err(|e| {
        let message = serde_saphyr::DefaultMessageFormatter.format_message(e.without_snippet()).into_owned();
        let at = e.location().filter(|l| l.line() > 0).map(|l| (l.line() as usize, l.column() as usize));
        (at, message)
    })
}

/// serde_json's error as a position (line, column; none at the end of the input) and its message.
fn json_failure(e: &serde_json::Error) -> (Option<(usize, usize)>, String) {
    ((e.line() > 0 && e.column() > 0).then(|| (e.line(), e.column())), e.to_string())
}

/// A syntax error: the position once, and where an unclosed `[` / `{` opened.
fn syntax_reason(text: &str, at: Option<(usize, usize)>, message: &str) -> String {
    let message = clean_parser_message(message);
    match at {
        Some((line, column)) => {
            let hint = unclosed_bracket_hint(text, line).unwrap_or_default();
            format!("line {line}, column {column}: {message}{hint}")
        }
        None => message,
    }
}

/// Whether `path` is read as JSON (`.json`, any case) rather than YAML.
fn is_json(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"))
}

/// The error text for a key or value the typed struct refuses (the file's syntax and shape were checked before):
/// an unknown key with the closest known one; a value of the wrong kind in words, naming the key; a value outside
/// an enum's choices, naming the key.
fn reason(text: &str, at: Option<(usize, usize)>, message: &str, expects: Expects<'_>) -> String {
    let message = clean_parser_message(message);
    if let Some(rest) = message.strip_prefix("unknown field `") {
        if let Some((key, known)) = rest.split_once('`') {
            let candidates = expected_names(known);
            let names: Vec<&str> = candidates.iter().map(String::as_str).collect();
            return format!(
                "{}; the file's format has no such key, and a misspelled setting would otherwise be silently \
                 replaced by its default",
                unknown_key(text, key, &names)
            );
        }
    }
    let Some((line, column)) = at else { return message };
    let position = format!("line {line}, column {column}: ");
    let Some((key, value)) = key_and_value_at(text, line, column) else { return format!("{position}{message}") };
    match expects(key) {
        Some(expected) if message.starts_with("invalid") || message.starts_with("expected") => {
            format!("{position}{key}: expected {expected}, got `{value}`")
        }
        _ if message.starts_with("unknown variant") => format!("{position}{key}: {message}"),
        _ => format!("{position}{message}"),
    }
}

/// The names in serde's "expected one of `a`, `b`" / "expected `a` or `b`" (backticks optional).
fn expected_names(list: &str) -> Vec<String> {
    let list = list.trim_start_matches(',').trim();
    let list = list.strip_prefix("expected").unwrap_or(list).trim();
    let list = list.strip_prefix("one of").unwrap_or(list);
    list.split(", ")
        .flat_map(|p| p.split(" or "))
        .map(|n| n.trim().trim_matches('`').to_string())
        .filter(|n| !n.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn number(key: &str) -> Option<&'static str> {
        (key == "num_train_epochs").then_some("a number")
    }

    #[test]
    fn a_type_error_names_the_key_what_it_expects_and_the_value() {
        let yaml = "learning_rate: 1e-3\nnum_train_epochs: two # epochs\n";
        let r = reason(yaml, Some((2, 19)), "error: line 2 column 19: invalid floating point", &number);
        assert_eq!(r, "line 2, column 19: num_train_epochs: expected a number, got `two`");
        let json = r#"{"seed": 1, "num_train_epochs": "two"}"#;
        let r = reason(json, Some((1, 38)), "invalid type: string \"two\", expected f64 at line 1 column 38", &number);
        assert_eq!(r, "line 1, column 38: num_train_epochs: expected a number, got `\"two\"`");
        // A key without a description keeps the parser's message, with the position once.
        let r = reason("seed: x\n", Some((1, 7)), "line 1 column 7: invalid i64", &number);
        assert_eq!(r, "line 1, column 7: invalid i64");
    }

    #[test]
    fn an_unknown_key_names_its_line_and_the_closest_key() {
        let msg = "unknown field `num_train_epoch`, expected one of output_dir, num_train_epochs, max_steps";
        let r = reason("seed: 1\nnum_train_epoch: 2\n", Some((2, 1)), msg, &number);
        assert!(r.starts_with("line 2: unknown key `num_train_epoch` (did you mean `num_train_epochs`?)"), "{r}");
        let msg = "unknown field `n_trails`, expected `metric` or `n_trials`";
        let r = reason("n_trails: 3\n", None, msg, &number);
        assert!(r.starts_with("line 1: unknown key `n_trails` (did you mean `n_trials`?)"), "{r}");
    }

    #[test]
    fn an_unclosed_bracket_says_where_it_opens() {
        let r = syntax_reason("num_train_epochs: [2\nseed: 1\n", Some((2, 1)), "did not find expected ',' or ']'");
        assert!(r.starts_with("line 2, column 1: did not find expected ',' or ']' (line 1 opens a `[`"), "{r}");
    }

    #[test]
    fn an_enum_value_names_its_key() {
        let r = reason(
            "eval_strategy: sometimes\n",
            Some((1, 16)),
            "unknown variant `sometimes`, expected one of no, steps",
            &number,
        );
        assert_eq!(r, "line 1, column 16: eval_strategy: unknown variant `sometimes`, expected one of no, steps");
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Args {
        num_train_epochs: Option<f64>,
        seed: Option<u64>,
        report_to: Option<Vec<String>>,
    }

    fn parse_file(name: &str, text: &str) -> String {
        parse::<Args>(Path::new(name), text, &number).unwrap_err().to_string()
    }

    #[test]
    fn malformed_files_are_syntax_errors_not_errors_of_a_key() {
        // A list, an empty file, a scalar: the shape, not a key.
        for (name, text) in [("l.yaml", "- num_train_epochs: 2\n"), ("l.json", r#"[{"num_train_epochs": 2}]"#)] {
            let e = parse_file(name, text);
            assert!(e.ends_with("expected a mapping of keys to values (one `key: value` per line; in JSON, an object `{\"key\": value}`), got a list"), "{e}");
        }
        for (name, text) in [("e.yaml", ""), ("e.yaml", "# only a comment\n"), ("e.json", "  \n")] {
            let e = parse_file(name, text);
            assert!(e.contains("the file is empty"), "{name} {text:?}: {e}");
        }
        assert!(parse_file("s.yaml", "3\n").ends_with("got the value `3`"));
        // An unclosed JSON bracket is a syntax error at its position, not a type error of the next key.
        let e = parse_file("b.json", "{\"report_to\": [\"jsonl\",\n\"num_train_epochs\": 2}");
        assert!(
            e.contains("b.json: line 2, column 19: expected `,` or `]`") && !e.contains("expected a number"),
            "{e}"
        );
        // A key indented under a scalar is a YAML syntax error on its own line.
        let e = parse_file("i.yaml", "seed: 1\n  num_train_epochs: 0.1\n");
        assert!(e.contains("i.yaml: line 2") && !e.contains("seed: expected"), "{e}");
        // A key written twice says so in plain words.
        let e = parse_file("d.yaml", "seed: 1\nseed: 2\n");
        assert!(e.ends_with("`seed` is set twice (by its name or an alias); keep one of the two"), "{e}");
    }
}
