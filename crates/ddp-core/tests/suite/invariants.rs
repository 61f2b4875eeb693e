//! Invariants of the workspace's sources, checked at the grep level.
//!
//! Only `ddp_core::env` (crates/ddp-core/src/env.rs) reads the job-layout variables (RANK, WORLD_SIZE,
//! LOCAL_RANK, MASTER_ADDR, SLURM_*, OMPI_*, PMI_*, ...): one place decides what a launcher's variables mean, so
//! every level agrees on it. Everything else asks that module (`DistEnv`, `is_launched_worker`, ...). Setting the
//! variables for a child process (the launcher does) is no read and is allowed.

use std::path::{Path, PathBuf};

/// Job-layout variables, by exact name.
const LAYOUT_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
];
/// Job-layout variables, by the prefix of their launcher family.
const LAYOUT_PREFIXES: &[&str] = &["SLURM_", "OMPI_", "PMI_", "PMIX_"];
/// The calls that read the process environment.
const READS: &[&str] = &["env::var(", "env::var_os(", "env::vars(", "env::vars_os(", " var_os(", " var("];

/// The one file allowed to read them.
const ALLOWED: &str = "crates/ddp-core/src/env.rs";

/// Whether `literal` (the text between two quotes) names a job-layout variable.
fn is_layout_var(literal: &str) -> bool {
    LAYOUT_VARS.contains(&literal) || LAYOUT_PREFIXES.iter().any(|p| literal.starts_with(p))
}

/// The string literals of `code` (plain `"..."`; escapes are kept as written).
fn literals(code: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(start) = rest.find('"') {
        let after = &rest[start + 1..];
        let mut end = None;
        let mut escaped = false;
        for (i, c) in after.char_indices() {
            match c {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => {
                    end = Some(i);
                    break;
                }
                _ => escaped = false,
            }
        }
        let Some(end) = end else { break };
        out.push(&after[..end]);
        rest = &after[end + 1..];
    }
    out
}

/// The statements of `source` that read the environment and name a job-layout variable: the code (comment lines
/// dropped) is cut at `;`, `{` and `}`, so a read and the names it is handed in one expression (a call, or an
/// array of names it iterates) stay together. Returns (line of the statement's end, the statement).
fn layout_reads(source: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut statement = String::new();
    for (n, line) in source.lines().enumerate() {
        if line.trim_start().starts_with("//") {
            continue;
        }
        for c in line.chars() {
            if matches!(c, ';' | '{' | '}') {
                check_statement(&statement, n + 1, &mut found);
                statement.clear();
            } else {
                statement.push(c);
            }
        }
        statement.push(' ');
    }
    check_statement(&statement, source.lines().count(), &mut found);
    found
}

fn check_statement(statement: &str, line: usize, found: &mut Vec<(usize, String)>) {
    if READS.iter().any(|r| statement.contains(r)) && literals(statement).into_iter().any(is_layout_var) {
        found.push((line, statement.split_whitespace().collect::<Vec<_>>().join(" ")));
    }
}

/// Every `.rs` file below `dir`, except build output and hidden directories.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the workspace root")
}

#[test]
fn only_ddp_core_env_reads_job_layout_variables() {
    let root = workspace_root();
    let this_file = Path::new(file!()).file_name().expect("file name");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(files.len() > 50, "found only {} .rs files under {}", files.len(), root.display());
    let mut violations = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&root).unwrap_or(&file);
        if rel == Path::new(ALLOWED) || (rel.ends_with(this_file) && rel.starts_with("crates/ddp-core/tests")) {
            continue;
        }
        let Ok(source) = std::fs::read_to_string(&file) else { continue };
        for (line, statement) in layout_reads(&source) {
            violations.push(format!("{}:{line}: {statement}", rel.display()));
        }
    }
    assert!(
        violations.is_empty(),
        "job-layout variables are read outside {ALLOWED}; ask ddp_core::env instead (DistEnv::detect_from_env, \
         is_launched_worker, ...), or add what is missing there:\n{}",
        violations.join("\n")
    );
}

#[test]
fn the_check_sees_reads_and_ignores_writes() {
    let reads = [
        r#"let r = std::env::var("RANK").unwrap();"#,
        r#"if std::env::var_os("SLURM_PROCID").is_none() { }"#,
        r#"let mpi = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"].iter().any(|v| std::env::var_os(v).is_some());"#,
        "let port = env::var(\n    \"MASTER_PORT\",\n);",
    ];
    for code in reads {
        assert_eq!(layout_reads(code).len(), 1, "not seen: {code}");
    }
    let fine = [
        r#"cmd.env("RANK", rank.to_string());"#,
        r#"let t = std::env::var("OMP_NUM_THREADS"); set("MASTER_PORT", port);"#,
        r#"// std::env::var("RANK") in a comment"#,
        r#"let s = std::env::var(TOKEN_ENV).unwrap_or_else(|_| "RANKING".into());"#,
    ];
    for code in fine {
        assert!(layout_reads(code).is_empty(), "flagged: {code}");
    }
}
