//! The CLI path of docs/guide/cli.md ("The path: config, test, launch"), run as the page shows it: every `accel`
//! command in the docs parses; the documented `accel config` answers and `accel config default` write files that
//! `accel launch` then reads; a Python Accelerate file is found where Python Accelerate keeps it; two machines
//! (here: two launchers on one host) form one job; `--backend mpi` runs once, on the first machine.
//!
//! The programs launched are `sh -c 'echo …'` scripts that print the environment the workers get, so no training
//! binary of another crate is needed.

use accel_cli::Cli;
use assert_cmd::Command;
use clap::Parser;
use predicates::prelude::*;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Prints what a worker was told: rank, world size, machine rank, precision, CPU.
const SHOW_ENV: &str = "echo \"rank=$RANK world=$WORLD_SIZE group=$GROUP_RANK mp=$ACCELERATE_MIXED_PRECISION \
                        cpu=$ACCELERATE_USE_CPU\"";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The binary with HF_HOME inside `home`, so the user's own default config never leaks into a test.
fn accel(home: &Path) -> Command {
    let mut c = Command::cargo_bin("accel").unwrap();
    c.env("HF_HOME", home.join("hf")).env_remove("RANK").env_remove("WORLD_SIZE").timeout(Duration::from_secs(300));
    c
}

fn stdout_of(c: &mut Command) -> String {
    let out = c.output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    stdout.into_owned()
}

/// Splits a shell line into words: whitespace separates, '…' and "…" quote (no expansion), a backslash escapes
/// the next character outside single quotes. Good enough for the commands of the docs, which use no globs.
fn shell_words(line: &str) -> Vec<String> {
    let (mut words, mut word, mut in_word) = (Vec::new(), String::new(), false);
    let mut chars = line.chars();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some('\''), '\'') | (Some('"'), '"') => quote = None,
            (Some('\''), c) => word.push(c),
            (Some(_), '\\') | (None, '\\') => {
                if let Some(n) = chars.next() {
                    word.push(n);
                }
                in_word = true;
            }
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, c) => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// The part of a shell line before an unquoted ` #` comment.
fn strip_comment(line: &str) -> &str {
    let mut quote: Option<char> = None;
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (None, '\'' | '"') => quote = Some(c),
            (None, '#') if prev.is_whitespace() => return &line[..i],
            _ => {}
        }
        prev = c;
    }
    line
}

/// Every `accel …` command in the ```sh / ```bash blocks of `text` (continuation lines joined, comments dropped,
/// leading `VAR=value` assignments skipped, pipelines and `&&` / `;` lists split), with its line number.
fn accel_commands(text: &str) -> Vec<(usize, Vec<String>)> {
    let mut found = Vec::new();
    let mut in_shell = false;
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let fence = line.trim_start();
        if fence.starts_with("```") {
            in_shell = !in_shell && matches!(fence.trim_start_matches('`').trim(), "sh" | "bash" | "shell");
            continue;
        }
        if !in_shell {
            continue;
        }
        let (start, mut joined) = pending.take().unwrap_or((i + 1, String::new()));
        let code = strip_comment(line);
        if let Some(head) = code.trim_end().strip_suffix('\\') {
            joined.push_str(head);
            joined.push(' ');
            pending = Some((start, joined));
            continue;
        }
        joined.push_str(code);
        for part in joined.split(['|', ';', '&']) {
            let words = shell_words(part);
            let mut words = words.into_iter().skip_while(|w| {
                w.split_once('=')
                    .is_some_and(|(k, _)| !k.is_empty() && k.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
            });
            let Some(first) = words.next() else { continue };
            if first == "accel" || first.ends_with("/accel") {
                found.push((start, std::iter::once("accel".to_string()).chain(words).collect()));
            }
        }
    }
    found
}

fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            markdown_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
}

/// Every `accel` command line the README and the docs show is one the binary accepts (clap's definitions in
/// src/args.rs), so no page documents a flag that does not exist.
#[test]
fn every_accel_command_in_the_docs_parses() {
    let mut files = vec![root().join("README.md")];
    markdown_files(&root().join("docs"), &mut files);
    let mut checked = 0;
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (line, argv) in accel_commands(&text) {
            if let Err(e) = Cli::try_parse_from(&argv) {
                panic!("{}:{line}: `{}` is refused by the accel command line:\n{e}", file.display(), argv.join(" "));
            }
            checked += 1;
        }
    }
    assert!(checked >= 15, "only {checked} accel commands found in the docs: is the extraction broken?");
}

#[test]
fn shell_lines_are_split_like_a_shell() {
    let text = "```sh\nFOO=1 accel launch -n 2 './my prog' --x \"a b\"   # comment\nprintf 'x\\n' | accel config \\\n  --config-file f.yaml\nexport A=$(x) && accel test -n 2\n```\n```text\naccel nope\n```\n";
    let cmds = accel_commands(text);
    assert_eq!(
        cmds,
        vec![
            (2, vec!["accel", "launch", "-n", "2", "./my prog", "--x", "a b"].into_iter().map(String::from).collect()),
            (3, vec!["accel", "config", "--config-file", "f.yaml"].into_iter().map(String::from).collect()),
            (5, vec!["accel", "test", "-n", "2"].into_iter().map(String::from).collect()),
        ]
    );
}

/// The one-machine block of docs/guide/cli.md, run as written: the piped answers write `job.yaml` (2 CPU processes,
/// bf16), and `accel launch --config-file job.yaml` starts 2 workers told bf16 and the CPU.
#[test]
fn the_documented_config_answers_write_a_file_launch_reads() {
    let page = std::fs::read_to_string(root().join("docs/guide/cli.md")).unwrap();
    let line = page
        .lines()
        .find(|l| l.starts_with("printf '") && l.contains("| accel config --config-file job.yaml"))
        .expect("docs/guide/cli.md shows `printf '…' | accel config --config-file job.yaml`");
    let answers = shell_words(line.split('|').next().unwrap())[1].replace("\\n", "\n");
    let dir = tempfile::tempdir().unwrap();
    accel(dir.path())
        .current_dir(dir.path())
        .args(["config", "--config-file", "job.yaml"])
        .write_stdin(answers)
        .assert()
        .success()
        .stdout(predicate::str::contains("accel config: wrote job.yaml"));
    let out = stdout_of(
        accel(dir.path())
            .current_dir(dir.path())
            .args(["launch", "--config-file", "job.yaml"])
            .args(["sh", "-c", SHOW_ENV]),
    );
    for r in 0..2 {
        assert!(out.contains(&format!("rank={r} world=2 group=0 mp=bf16 cpu=true")), "{out}");
    }
}

/// `accel config default` writes a one-process file; `accel launch --config_file` (Accelerate's spelling) reads
/// its precision, and `-n` overrides its process count.
#[test]
fn config_default_then_launch_with_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("one.yaml");
    accel(dir.path())
        .args(["config", "default", "--config-file"])
        .arg(&file)
        .args(["--mixed-precision", "bf16"])
        .assert()
        .success();
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("num_processes: 1") && text.contains("mixed_precision: bf16"), "{text}");
    let out = stdout_of(
        accel(dir.path()).arg("launch").arg("--config_file").arg(&file).args(["-n", "2", "sh", "-c", SHOW_ENV]),
    );
    assert!(out.contains("rank=0 world=2 group=0 mp=bf16") && out.contains("rank=1 world=2 group=0 mp=bf16"), "{out}");
}

/// A file Python Accelerate 1.15 wrote (2 CPU processes) is picked up from `$HF_HOME/accelerate/`, and without
/// HF_HOME from `$XDG_CACHE_HOME/huggingface/accelerate/`, with no `--config-file`.
#[test]
fn launch_reads_a_python_accelerate_file_where_python_accelerate_keeps_it() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/accelerate_1_15_multi_cpu.yaml");
    let dir = tempfile::tempdir().unwrap();
    let hf_home = dir.path().join("hf/accelerate/default_config.yaml");
    std::fs::create_dir_all(hf_home.parent().unwrap()).unwrap();
    std::fs::copy(&fixture, &hf_home).unwrap();
    let out = stdout_of(accel(dir.path()).args(["launch", "sh", "-c", SHOW_ENV]));
    assert!(out.contains("rank=1 world=2 group=0 mp=no cpu=true"), "{out}");
    accel(dir.path())
        .arg("env")
        .assert()
        .success()
        .stdout(predicate::str::contains(format!("config file: {}", hf_home.display())));

    let xdg = dir.path().join("xdg");
    let in_xdg = xdg.join("huggingface/accelerate/default_config.yaml");
    std::fs::create_dir_all(in_xdg.parent().unwrap()).unwrap();
    std::fs::copy(&fixture, &in_xdg).unwrap();
    let out = stdout_of(
        accel(dir.path()).env_remove("HF_HOME").env("XDG_CACHE_HOME", &xdg).args(["launch", "sh", "-c", SHOW_ENV]),
    );
    assert!(out.contains("rank=1 world=2 group=0 mp=no cpu=true"), "{out}");
}

/// The two-machine commands of the page, with 127.0.0.1 for machine 0's address: two launchers with the same
/// `-n 4`, port and run token, machine ranks 0 and 1, form one job of 4 ranks, 2 per machine.
#[test]
fn two_machines_on_one_host_form_one_job() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let token = "0123456789abcdef0123456789abcdef";
    let dir = tempfile::tempdir().unwrap();
    let launcher = |rank: &str| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_accel"));
        c.env("HF_HOME", dir.path().join("hf"))
            .env("ACCEL_RUN_TOKEN", token)
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .args(["launch", "-n", "4", "--num-machines", "2", "--machine-rank", rank])
            .args(["--main-process-ip", "127.0.0.1", "--main-process-port", &port, "sh", "-c", SHOW_ENV])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        c
    };
    let machine1 = launcher("1").spawn().unwrap();
    let machine0 = launcher("0").spawn().unwrap();
    for (machine, child, ranks) in [(0, machine0, [0, 1]), (1, machine1, [2, 3])] {
        let out = child.wait_with_output().unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "machine {machine}: {stdout}\n{stderr}");
        for r in ranks {
            assert!(
                stdout.contains(&format!("rank={r} world=4 group={machine} mp=no")),
                "machine {machine}:\n{stdout}"
            );
        }
        assert!(
            stderr.contains(&format!(
                "accel launch: machine {machine}/2 runs 2 of the processes (main 127.0.0.1:{port})"
            )),
            "{stderr}"
        );
    }
}

/// `--backend mpi` is run once, on the first machine (mpirun places every rank).
#[test]
fn backend_mpi_is_launched_once_from_the_first_machine() {
    let dir = tempfile::tempdir().unwrap();
    accel(dir.path())
        .args(["launch", "--backend", "mpi", "-n", "2", "--num-machines", "2", "--machine-rank", "1"])
        .args(["--main-process-ip", "127.0.0.1", "sh", "-c", "true"])
        .assert()
        .failure()
        .stderr(predicate::str::contains("--backend mpi: run `accel launch` once, on the first machine"));
}

/// A machine waiting for a machine 0 that never comes says what it waits for, and Ctrl-C (SIGINT) ends the wait
/// at once, before any worker starts.
#[test]
fn a_launcher_waiting_for_machine_0_reports_progress_and_stops_on_sigint() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let dir = tempfile::tempdir().unwrap();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_accel"))
        .env("HF_HOME", dir.path().join("hf"))
        .env("ACCEL_RUN_TOKEN", "0123456789abcdef0123456789abcdef")
        .env("ACCEL_PROGRESS_INTERVAL", "0.5")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .args(["launch", "-n", "4", "--num-machines", "2", "--machine-rank", "1"])
        .args(["--main-process-ip", "127.0.0.1", "--main-process-port", &port, "sh", "-c", "true"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    // SAFETY: kill only sends a signal to the child we spawned.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) }, 0);
    let sent = std::time::Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(sent.elapsed() < Duration::from_secs(5), "the launcher took {:?} to stop after SIGINT", sent.elapsed());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains(&format!("machine 1: waiting for machine 0's store at 127.0.0.1:{port}")), "{stderr}");
    assert!(stderr.contains("interrupted by SIGINT while waiting for machine 0's store"), "{stderr}");
}

/// A malformed ACCEL_RUN_TOKEN on a multi-machine launch is refused before the banner and before machine 0's
/// store starts (the other machine is never refused by a store that then fails itself).
#[test]
fn a_malformed_run_token_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_accel"))
        .env("HF_HOME", dir.path().join("hf"))
        .env("ACCEL_RUN_TOKEN", "not-hex")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .args(["launch", "-n", "2", "--num-machines", "2", "--machine-rank", "0"])
        .args(["--main-process-ip", "127.0.0.1", "--main-process-port", "29671", "sh", "-c", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.starts_with("accel: error: environment variable ACCEL_RUN_TOKEN"), "{stderr}");
    assert!(stderr.contains("32 hex digits") && !stderr.contains("accel launch: config"), "{stderr}");
}
