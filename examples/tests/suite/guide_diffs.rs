//! The diffs of docs/guide/00-levels.md are the real diffs between the MNIST programs of the three levels.
//!
//! Each program (`examples/src/bin/{ddp,accel,train}_mnist.rs`) marks the regions the chapter compares with
//! `// guide:begin NAME` … `// guide:end NAME` (the marker lines themselves are not part of the region). The
//! chapter puts each diff in a ```diff block right after a line `<!-- guide:diff OLD.rs NEW.rs NAME -->`. This test
//! recomputes every block — the unified diff of region NAME from OLD.rs to NEW.rs, [`CONTEXT`] lines of context,
//! line numbers counted from the region's first line, computed with the `similar` crate — and fails when one
//! differs from the chapter, naming the block and how to regenerate it. With `ACCEL_BLESS_GUIDE=1` it rewrites
//! the stale blocks instead (like insta's bless); review the chapter's explanations of the hunks afterwards.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The chapter, relative to the workspace root.
const CHAPTER: &str = "docs/guide/00-levels.md";
/// Set to `1` to rewrite the chapter's stale diff blocks instead of failing.
const BLESS_ENV: &str = "ACCEL_BLESS_GUIDE";
/// The programs, in level order; the chapter compares each with the next.
const PROGRAMS: [&str; 3] = ["ddp_mnist.rs", "accel_mnist.rs", "train_mnist.rs"];
/// The regions every program marks.
const REGIONS: [&str; 6] = ["args", "job", "data", "model", "loop", "eval"];
/// Lines of context around each change.
const CONTEXT: usize = 3;
/// What regenerates the blocks (printed in the failure message and in the programs' headers).
const BLESS_COMMAND: &str = "ACCEL_BLESS_GUIDE=1 cargo test -p accel-examples --test suite guide_diffs";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("examples/ sits in the workspace root").to_path_buf()
}

fn program_text(name: &str) -> String {
    let path = root().join("examples/src/bin").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The marked regions of one source file: name → the lines between its markers, each ending in `\n`.
/// Errors: an `end` without its `begin` (or for another name), a region opened twice or inside another, a
/// region left open, a marker without a name.
fn regions(file: &str, text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut found = BTreeMap::new();
    let mut open: Option<(String, usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let marker = line.trim();
        if let Some(name) = marker.strip_prefix("// guide:begin") {
            let name = name.trim();
            if name.is_empty() {
                return Err(format!("{file}:{n}: `// guide:begin` needs a region name"));
            }
            if let Some((other, at, _)) = &open {
                return Err(format!("{file}:{n}: region `{name}` begins inside region `{other}` (line {at})"));
            }
            if found.contains_key(name) {
                return Err(format!("{file}:{n}: region `{name}` is marked twice"));
            }
            open = Some((name.to_string(), n, String::new()));
        } else if let Some(name) = marker.strip_prefix("// guide:end") {
            let name = name.trim();
            match open.take() {
                Some((begun, _, body)) if begun == name => {
                    // Blank lines that end a region (kept apart from a trailing comment for rustfmt) are not code.
                    let body = body.trim_end();
                    found.insert(begun, if body.is_empty() { String::new() } else { format!("{body}\n") });
                }
                Some((begun, at, _)) => {
                    return Err(format!("{file}:{n}: `// guide:end {name}` closes region `{begun}` (line {at})"))
                }
                None => return Err(format!("{file}:{n}: `// guide:end {name}` without a `// guide:begin {name}`")),
            }
        } else if let Some((_, _, body)) = &mut open {
            body.push_str(line);
            body.push('\n');
        }
    }
    match open {
        Some((name, at, _)) => Err(format!("{file}:{at}: region `{name}` has no `// guide:end {name}`")),
        None => Ok(found),
    }
}

/// The unified diff of region `region` from `old_file` to `new_file`, as the chapter shows it.
fn region_diff(old_file: &str, old: &str, new_file: &str, new: &str, region: &str) -> String {
    similar::TextDiff::configure()
        .algorithm(similar::Algorithm::Patience)
        .diff_lines(old, new)
        .unified_diff()
        .context_radius(CONTEXT)
        .header(&format!("{old_file} ({region})"), &format!("{new_file} ({region})"))
        .to_string()
}

/// One ```diff block of the chapter and what it claims to show.
#[derive(Debug)]
struct Block {
    old: String,
    new: String,
    region: String,
    /// Byte range of the block's content (after the opening fence's line, up to the closing fence).
    body: Range<usize>,
}

/// Every `<!-- guide:diff OLD NEW REGION -->` marker of `chapter` with the ```diff block that follows it.
fn diff_blocks(chapter: &str) -> Result<Vec<Block>, String> {
    const MARK: &str = "<!-- guide:diff ";
    let mut blocks = Vec::new();
    let mut offset = 0;
    let mut lines = chapter.split_inclusive('\n').peekable();
    let mut n = 0;
    while let Some(line) = lines.next() {
        n += 1;
        let start = offset;
        offset += line.len();
        let Some(rest) = line.trim().strip_prefix(MARK) else { continue };
        let words: Vec<&str> = rest.trim_end_matches("-->").split_whitespace().collect();
        let [old, new, region] = words[..] else {
            return Err(format!(
                "{CHAPTER}:{n}: expected `{MARK}OLD.rs NEW.rs REGION -->`, got {:?}",
                &chapter[start..offset]
            ));
        };
        match lines.next() {
            Some(fence) if fence.trim_end() == "```diff" => offset += fence.len(),
            _ => return Err(format!("{CHAPTER}:{n}: the marker must be followed by a ```diff line")),
        }
        n += 1;
        let body_start = offset;
        loop {
            let Some(line) = lines.next() else {
                return Err(format!("{CHAPTER}:{n}: the ```diff block after the marker is never closed"));
            };
            n += 1;
            if line.trim_end() == "```" {
                blocks.push(Block {
                    old: old.to_string(),
                    new: new.to_string(),
                    region: region.to_string(),
                    body: body_start..offset,
                });
                offset += line.len();
                break;
            }
            offset += line.len();
        }
    }
    Ok(blocks)
}

#[test]
fn guide_diffs_match_the_marked_regions_of_the_examples() {
    let sources: BTreeMap<&str, BTreeMap<String, String>> =
        PROGRAMS.iter().map(|&p| (p, regions(p, &program_text(p)).unwrap_or_else(|e| panic!("{e}")))).collect();
    for (program, found) in &sources {
        let names: Vec<&str> = found.keys().map(String::as_str).collect();
        let mut want = REGIONS.to_vec();
        want.sort();
        assert_eq!(names, want, "examples/src/bin/{program}: the regions the guide compares");
    }

    let path = root().join(CHAPTER);
    let chapter = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let blocks = diff_blocks(&chapter).unwrap_or_else(|e| panic!("{e}"));
    // Every step up (level 1 → 2, 2 → 3) is shown for every region, once.
    let mut shown: Vec<(&str, &str, &str)> =
        blocks.iter().map(|b| (b.old.as_str(), b.new.as_str(), b.region.as_str())).collect();
    shown.sort();
    let mut expected: Vec<(&str, &str, &str)> =
        PROGRAMS.windows(2).flat_map(|w| REGIONS.iter().map(move |&r| (w[0], w[1], r))).collect();
    expected.sort();
    assert_eq!(shown, expected, "{CHAPTER}: one diff block per step up and region");

    let bless = std::env::var(BLESS_ENV).is_ok_and(|v| v.trim() == "1");
    let mut text = chapter.clone();
    let mut stale = Vec::new();
    // From the last block to the first, so the byte ranges of the earlier ones stay valid while rewriting.
    for b in blocks.iter().rev() {
        let (old, new) = (&sources[b.old.as_str()][&b.region], &sources[b.new.as_str()][&b.region]);
        let want = region_diff(&b.old, old, &b.new, new, &b.region);
        let have = &chapter[b.body.clone()];
        if have != want {
            let what_changed = similar::TextDiff::from_lines(have, want.as_str())
                .unified_diff()
                .context_radius(1)
                .header("the chapter's block", "the examples now")
                .to_string();
            stale.push(format!("`{}` from {} to {}:\n{what_changed}", b.region, b.old, b.new));
            text.replace_range(b.body.clone(), &want);
        }
    }
    if stale.is_empty() {
        return;
    }
    stale.reverse();
    if bless {
        let tmp = path.with_extension("md.bless");
        std::fs::write(&tmp, &text).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        eprintln!(
            "{BLESS_ENV}=1: rewrote {} diff block(s) of {CHAPTER}; check the explanations under them",
            stale.len()
        );
        return;
    }
    panic!(
        "{CHAPTER}: {} diff block(s) no longer match the examples' marked regions (`// guide:begin NAME` … \
         `// guide:end NAME` in examples/src/bin/*_mnist.rs). Regenerate them with\n\n    {BLESS_COMMAND}\n\nthen \
         check that the text under each diff still describes its hunks, and commit the chapter.\n\n{}",
        stale.len(),
        stale.join("\n")
    );
}

#[test]
fn region_markers_are_checked() {
    let ok = "a\n// guide:begin x\nb\n  // guide:end x\n// guide:begin y\n// guide:end y\n";
    let r = regions("f.rs", ok).unwrap();
    assert_eq!((r["x"].as_str(), r["y"].as_str()), ("b\n", ""));
    for (text, message) in [
        ("// guide:begin x\n", "f.rs:1: region `x` has no `// guide:end x`"),
        ("// guide:end x\n", "f.rs:1: `// guide:end x` without a `// guide:begin x`"),
        ("// guide:begin x\n// guide:begin y\n", "f.rs:2: region `y` begins inside region `x` (line 1)"),
        ("// guide:begin x\n// guide:end y\n", "f.rs:2: `// guide:end y` closes region `x` (line 1)"),
        ("// guide:begin x\n// guide:end x\n// guide:begin x\n", "f.rs:3: region `x` is marked twice"),
        ("// guide:begin\n", "f.rs:1: `// guide:begin` needs a region name"),
    ] {
        assert_eq!(regions("f.rs", text).unwrap_err(), message, "{text:?}");
    }
}

#[test]
fn diff_blocks_are_found_after_their_markers() {
    let chapter = "text\n<!-- guide:diff a.rs b.rs loop -->\n```diff\n-x\n+y\n```\nmore\n";
    let blocks = diff_blocks(chapter).unwrap();
    assert_eq!(blocks.len(), 1);
    assert_eq!((blocks[0].old.as_str(), blocks[0].new.as_str(), blocks[0].region.as_str()), ("a.rs", "b.rs", "loop"));
    assert_eq!(&chapter[blocks[0].body.clone()], "-x\n+y\n");
    let err = diff_blocks("<!-- guide:diff a.rs b.rs loop -->\ntext\n").unwrap_err();
    assert!(err.ends_with("the marker must be followed by a ```diff line"), "{err}");
    let err = diff_blocks("<!-- guide:diff a.rs loop -->\n```diff\n```\n").unwrap_err();
    assert!(err.contains("expected `<!-- guide:diff OLD.rs NEW.rs REGION -->`"), "{err}");
    let diff = region_diff("a.rs", "x\ny\n", "b.rs", "x\nz\n", "r");
    assert_eq!(diff, "--- a.rs (r)\n+++ b.rs (r)\n@@ -1,2 +1,2 @@\n x\n-y\n+z\n");
}
