//! Reading the Trainer's YAML / JSON files (`--config train.yaml`, a hyperparameter-search file) into typed structs,
//! with errors as strict and as plain as the `accel` CLI's: the file and the position once, the key a misspelling
//! was meant to be, what a key expects (`num_train_epochs: expected a number …, got `two``), the line where an
//! unclosed `[` opens. The message texts come from [`accel::config_errors`], shared with the CLI.

use std::path::Path;

use accel::config_errors::{clean_parser_message, unclosed_bracket_hint, unknown_key};
use serde::de::DeserializeOwned;

use crate::error::TrainerError;

/// What a key of a typed struct accepts, in words, for the keys whose parser message does not say it
/// (`invalid floating point`); `None` keeps the parser's message.
pub(crate) type Expects<'a> = &'a dyn Fn(&str) -> Option<&'static str>;

/// Parses `text` (the contents of `path`; JSON when the file name ends in `.json`, YAML otherwise) as `T`.
pub(crate) fn parse<T: DeserializeOwned>(path: &Path, text: &str, expects: Expects<'_>) -> Result<T, TrainerError> {
    let failure = if is_json(path) {
        match serde_json::from_str(text) {
            Ok(v) => return Ok(v),
            Err(e) => ((e.line() > 0).then(|| (e.line(), e.column())), e.to_string()),
        }
    } else {
        match serde_saphyr::from_str(text) {
            Ok(v) => return Ok(v),
            Err(e) => {
                use serde_saphyr::MessageFormatter;
                // The bare message: no snippet (it names the source `<input>`) and no position (given once).
                let message = serde_saphyr::DefaultMessageFormatter.format_message(e.without_snippet());
                let at = e.location().filter(|l| l.line() > 0).map(|l| (l.line() as usize, l.column() as usize));
                (at, message.into_owned())
            }
        }
    };
    let (at, message) = failure;
    Err(TrainerError::ConfigFile { path: path.to_path_buf(), reason: reason(text, at, &message, expects) })
}

/// Whether `path` is read as JSON (`.json`, any case) rather than YAML.
pub(crate) fn is_json(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"))
}

/// The error text for a parser's `message` at `at` (line, column): unknown keys with the closest known one, type
/// errors in words, syntax errors with the position once and the unclosed-bracket hint.
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
    if let Some(hint) = unclosed_bracket_hint(text, line) {
        return format!("{position}{message}{hint}");
    }
    let type_error = message.starts_with("invalid") || message.starts_with("expected");
    if let (true, Some((key, value))) = (type_error, key_and_value_at(text, line, column)) {
        if let Some(expected) = expects(key) {
            return format!("{position}{key}: expected {expected}, got `{value}`");
        }
    }
    format!("{position}{message}")
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

/// The `key` and value written at (or just before) `column` of `line`: the last `key:` at or before the column, or
/// the line's first when the column points at the key itself.
fn key_and_value_at(text: &str, line: usize, column: usize) -> Option<(&str, &str)> {
    let l = text.lines().nth(line.checked_sub(1)?)?;
    let upto = l.char_indices().nth(column).map_or(l.len(), |(i, _)| i);
    let colon = l[..upto].rfind(':').or_else(|| l.find(':'))?;
    let before = l[..colon].trim_end().trim_end_matches(['"', '\'']);
    let key = before.rsplit(['{', ',', ' ', '"', '\'', '\t']).next()?;
    let after = l[colon + 1..].split(" #").next()?.trim();
    let value = after.split([',', '}']).next()?.trim();
    (!key.is_empty() && !value.is_empty()).then_some((key, value))
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
        let r = reason("num_train_epochs: [2\nseed: 1\n", Some((2, 1)), "did not find expected ',' or ']'", &number);
        assert!(r.starts_with("line 2, column 1: did not find expected ',' or ']' (line 1 opens a `[`"), "{r}");
    }
}
