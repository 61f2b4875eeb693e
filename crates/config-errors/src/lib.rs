//! Text helpers for the errors of configuration files (the `accel` CLI's Accelerate YAML, the Trainer's
//! `--config` YAML/JSON): one position per message, the key a misspelling was meant to be, the line where an
//! unclosed `[` / `{` opens. Every reader of a config file builds its messages from these, so that a user sees the
//! same kind of message whatever file is wrong.
//!
//! Positions are 1-based lines and columns of the file's text, as editors show them.

/// Drops the positions and `error:` prefixes a YAML or JSON parser writes into its own messages, so that the
/// caller gives the position once: `error: line 2 column 1: did not find expected ']'` → `did not find expected
/// ']'`; a trailing `at line 2, column 1` (or serde_json's `at line 2 column 1`) goes too. A key written twice is
/// said in the user's terms (the YAML parser's message names an option of its own API).
pub fn clean_parser_message(message: &str) -> String {
    let m = strip_positions(message);
    let twice = m
        .strip_prefix("duplicate mapping key: ")
        .map(|rest| rest.split(", set DuplicateKeyPolicy").next().unwrap_or(rest).trim())
        .or_else(|| m.strip_prefix("duplicate field `").and_then(|rest| rest.split('`').next()));
    match twice {
        Some(key) => format!("`{key}` is set twice (by its name or an alias); keep one of the two"),
        None => m,
    }
}

fn strip_positions(message: &str) -> String {
    let mut m = message.trim().to_string();
    loop {
        let before = m.clone();
        if let Some(rest) = m.strip_prefix("error:") {
            m = rest.trim_start().to_string();
        }
        if let Some(rest) = strip_position(&m) {
            m = rest.trim_start_matches(':').trim_start().to_string();
        }
        if let Some(i) = m.rfind(" at line ") {
            if strip_position(&m[i + 4..]).is_some_and(|rest| rest.trim().is_empty()) {
                m.truncate(i);
            }
        }
        if m == before {
            return m;
        }
    }
}

/// `line N column M<rest>` or `line N, column M<rest>` → `<rest>`.
fn strip_position(m: &str) -> Option<String> {
    let rest = m.strip_prefix("line ")?.trim_start_matches(|c: char| c.is_ascii_digit());
    let rest = rest.trim_start_matches(',').trim_start().strip_prefix("column ")?;
    Some(rest.trim_start_matches(|c: char| c.is_ascii_digit()).to_string())
}

/// The first line (at most `up_to`) whose `[` or `{` is not closed by the end of that line and whose next
/// non-blank line starts a new `key:` — a flow collection left open — with the bracket. Quoted text and comments
/// are skipped.
pub fn unclosed_flow_bracket(text: &str, up_to: usize) -> Option<(usize, char)> {
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate().take(up_to.min(lines.len())) {
        let mut open: Vec<char> = Vec::new();
        let mut quote: Option<char> = None;
        for c in line.chars() {
            match (quote, c) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '"' | '\'') => quote = Some(c),
                (None, '#') => break,
                (None, '[' | '{') => open.push(c),
                (None, ']' | '}') => {
                    open.pop();
                }
                _ => {}
            }
        }
        let next_starts_key = lines[i + 1..]
            .iter()
            .find(|l| !l.trim().is_empty())
            .is_some_and(|l| !l.starts_with([' ', '\t']) && l.contains(':'));
        if let (Some(&bracket), true) = (open.first(), next_starts_key) {
            return Some((i + 1, bracket));
        }
    }
    None
}

/// A YAML scanner meets an unclosed `[` / `{` only lines later and names what it found there: the hint to append
/// to its message (` (line 2 opens a `[` that is never closed: …)`) when the text has one open before
/// `error_line`.
pub fn unclosed_bracket_hint(text: &str, error_line: usize) -> Option<String> {
    let (line, bracket) = unclosed_flow_bracket(text, error_line)?;
    let close = if bracket == '[' { ']' } else { '}' };
    Some(format!(
        " (line {line} opens a `{bracket}` that is never closed: end the list with `{close}`, or write the value \
         without brackets)"
    ))
}

/// Line and column where `key` is written as a key (`key:`, `"key":`, `{key: …`), if anywhere.
pub fn key_position(text: &str, key: &str) -> Option<(usize, usize)> {
    text.lines().enumerate().find_map(|(i, line)| {
        let start = line.len() - line.trim_start_matches([' ', '\t', '{', ',']).len();
        let rest = &line[start..];
        let (quote, rest) = match rest.chars().next() {
            Some(q @ ('"' | '\'')) => (Some(q), &rest[1..]),
            _ => (None, rest),
        };
        let rest = rest.strip_prefix(key)?;
        let rest = match quote {
            Some(q) => rest.strip_prefix(q)?,
            None => rest,
        };
        rest.trim_start().starts_with(':').then_some((i + 1, start + 1))
    })
}

/// The `key` and the value written at (or just before) `column` of `line` (`  "key": two # why` → `key`, `two`),
/// for a parser error that gives a position but not the key: the last `key:` at or before the column, or the
/// line's first when the column points at the key itself. JSON's `"key": value,` is read the same way.
pub fn key_and_value_at(text: &str, line: usize, column: usize) -> Option<(&str, &str)> {
    let l = text.lines().nth(line.checked_sub(1)?)?;
    let upto = l.char_indices().nth(column).map_or(l.len(), |(i, _)| i);
    let colon = l[..upto].rfind(':').or_else(|| l.find(':'))?;
    let before = l[..colon].trim_end().trim_end_matches(['"', '\'']);
    let key = before.rsplit(['{', ',', ' ', '"', '\'', '\t']).next()?;
    let after = l[colon + 1..].split(" #").next()?.trim();
    let value = after.split([',', '}']).next()?.trim();
    (!key.is_empty() && !value.is_empty()).then_some((key, value))
}

/// The known key closest to `key` by edit distance, when close enough to be a plausible misspelling (at most a
/// third of the key's length, and at least 1 edit tolerated; `-` for `_` and case count as no edit).
pub fn did_you_mean<'a>(key: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let normalised = key.trim().to_ascii_lowercase().replace('-', "_");
    candidates
        .iter()
        .map(|c| (strsim::levenshtein(&normalised, c), *c))
        .filter(|(d, _)| *d <= (normalised.chars().count() / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// `line 2: unknown key `num_proceses` (did you mean `num_processes`?)`: the line where `text` writes the key
/// (omitted when it cannot be found) and the closest of `candidates` (omitted when none is close).
pub fn unknown_key(text: &str, key: &str, candidates: &[&str]) -> String {
    let at = key_position(text, key).map_or(String::new(), |(l, _)| format!("line {l}: "));
    let hint = did_you_mean(key, candidates).map_or(String::new(), |k| format!(" (did you mean `{k}`?)"));
    format!("{at}unknown key `{key}`{hint}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parser_messages_lose_their_repeated_position() {
        assert_eq!(
            clean_parser_message("error: line 2 column 1: did not find expected ']'"),
            "did not find expected ']'"
        );
        assert_eq!(clean_parser_message("unexpected end at line 4, column 1"), "unexpected end");
        assert_eq!(clean_parser_message("unknown field `x` at line 1 column 5"), "unknown field `x`");
        assert_eq!(
            clean_parser_message("duplicate mapping key: seed, set DuplicateKeyPolicy in Options if acceptable"),
            "`seed` is set twice (by its name or an alias); keep one of the two"
        );
        assert_eq!(
            clean_parser_message("duplicate field `seed` at line 1 column 20"),
            "`seed` is set twice (by its name or an alias); keep one of the two"
        );
    }

    #[test]
    fn an_unclosed_bracket_is_found_where_it_opens() {
        assert_eq!(unclosed_flow_bracket("a: [1, 2]\nb: {x: 1}\nc: '[' # [\n", usize::MAX), None);
        assert_eq!(unclosed_flow_bracket("a: 1\nb: {x: 1,\nc: 2\n", usize::MAX), Some((2, '{')));
        assert_eq!(unclosed_flow_bracket("a: 1\nb: {x: 1,\nc: 2\n", 1), None);
        let hint = unclosed_bracket_hint("a: [1\nb: 2\n", 2).unwrap();
        assert!(hint.contains("line 1 opens a `[`") && hint.contains("`]`"), "{hint}");
    }

    #[test]
    fn keys_and_values_are_found_on_their_lines() {
        let text = "a: 1\n  \"nested_key\": two # why\n";
        assert_eq!(key_position(text, "nested_key"), Some((2, 3)));
        assert_eq!(key_position(text, "nested"), None);
        assert_eq!(key_and_value_at(text, 2, 17), Some(("nested_key", "two")));
        assert_eq!(key_and_value_at(r#"{"seed": 1, "lr": "x"}"#, 1, 22), Some(("lr", "\"x\"")));
        assert_eq!(key_and_value_at(text, 9, 1), None);
        assert_eq!(key_and_value_at("just text\n", 1, 1), None);
    }

    #[test]
    fn misspellings_name_the_closest_key_and_nothing_far() {
        let keys = ["num_processes", "num_machines", "learning_rate"];
        assert_eq!(did_you_mean("num_proceses", &keys), Some("num_processes"));
        assert_eq!(did_you_mean("Learning-Rate", &keys), Some("learning_rate"));
        assert_eq!(did_you_mean("batch", &keys), None);
        assert_eq!(
            unknown_key("x: 1\nnum_proceses: 2\n", "num_proceses", &keys),
            "line 2: unknown key `num_proceses` (did you mean `num_processes`?)"
        );
        assert_eq!(unknown_key("", "zzz", &keys), "unknown key `zzz`");
    }
}
