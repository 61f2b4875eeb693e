//! The worker launcher: environment, rendezvous through the launcher's store, failure propagation, output
//! prefixing and log files, restarts, Ctrl-C forwarding, and configuration errors.
//!
//! Workers are `sh -c` scripts, or this test binary itself re-executed with [`MODE_ENV`] selecting a role (a
//! real Rust worker, or a launcher whose console output and signal handling the test observes from outside).

use ddp_core::launcher::log_path;
use ddp_core::store::Store;
use ddp_core::{launch, DdpError, DistEnv, InitOptions, LaunchConfig, RunToken, TcpStore};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Selects what a re-executed copy of this binary does (see `zz_child_entry`).
const MODE_ENV: &str = "DDP_CORE_LAUNCHER_TEST_MODE";
/// Far below the workers' `sleep 60`, far above what stopping takes even on a loaded machine.
const STOPPED_WELL_BEFORE: Duration = Duration::from_secs(40);

fn sh(n: usize, script: &str) -> LaunchConfig {
    let mut cfg = LaunchConfig::local(n, "sh", vec!["-c".into(), script.into()]);
    cfg.stop_grace = Duration::from_secs(5);
    cfg
}

fn with_out(mut cfg: LaunchConfig, dir: &Path) -> LaunchConfig {
    cfg.env.push(("OUT".into(), dir.display().to_string()));
    cfg
}

fn read(path: impl AsRef<Path>) -> String {
    std::fs::read_to_string(path.as_ref()).unwrap_or_else(|e| panic!("{}: {e}", path.as_ref().display()))
}

fn self_exe_args() -> Vec<String> {
    ["launcher::zz_child_entry", "--exact", "--nocapture", "--test-threads=1", "-q"].map(String::from).to_vec()
}

fn process_gone(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(pid, 0) != 0 }
}

#[test]
fn three_workers_succeed_and_see_torchrun_variables() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = with_out(
        sh(
            3,
            r#"echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $ROLE_RANK $MASTER_ADDR $ACCEL_USE_AGENT_STORE ${#ACCEL_RUN_TOKEN} $ACCEL_RESTART_COUNT $EXTRA $1" > "$OUT/rank$RANK"; echo "$MASTER_PORT" > "$OUT/port$RANK"; echo "${OMP_NUM_THREADS-unset}" > "$OUT/omp$RANK"; echo "${RAYON_NUM_THREADS-unset}" > "$OUT/rayon$RANK"; echo "${CANDLE_NUM_THREADS-unset}" > "$OUT/candle$RANK"; echo "${MIMALLOC_PURGE_DELAY-unset}" > "$OUT/mimalloc$RANK"; echo "${RUST_LIB_BACKTRACE-unset}" > "$OUT/backtrace$RANK""#,
        ),
        dir.path(),
    );
    cfg.args.push("sh".into()); // $0
    cfg.args.push("first-arg".into()); // $1
    cfg.env.push(("EXTRA".into(), "extra-value".into()));
    launch(&cfg).unwrap();
    let omp_preset = std::env::var_os("OMP_NUM_THREADS");
    let mut ports = Vec::new();
    for r in 0..3 {
        assert_eq!(
            read(dir.path().join(format!("rank{r}"))).trim(),
            format!("{r} 3 {r} 3 0 {r} 127.0.0.1 1 32 0 extra-value first-arg")
        );
        ports.push(read(dir.path().join(format!("port{r}"))).trim().parse::<u16>().unwrap());
        let omp = read(dir.path().join(format!("omp{r}")));
        match &omp_preset {
            None => assert_eq!(omp.trim(), "1", "OMP_NUM_THREADS=1 when unset and more than one worker"),
            Some(v) => assert_eq!(omp.trim(), v.to_str().unwrap(), "a user's OMP_NUM_THREADS is kept"),
        }
        let rayon = read(dir.path().join(format!("rayon{r}")));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        match std::env::var_os("RAYON_NUM_THREADS") {
            None => assert_eq!(rayon.trim(), (cores / 3).max(1).to_string(), "each worker gets cores / workers"),
            Some(v) => assert_eq!(rayon.trim(), v.to_str().unwrap(), "a user's RAYON_NUM_THREADS is kept"),
        }
        let candle = read(dir.path().join(format!("candle{r}")));
        match std::env::var_os("CANDLE_NUM_THREADS") {
            None => assert_eq!(candle.trim(), "1", "candle's own elementwise pool off unless the user sets it"),
            Some(v) => assert_eq!(candle.trim(), v.to_str().unwrap(), "a user's CANDLE_NUM_THREADS is kept"),
        }
        let purge = read(dir.path().join(format!("mimalloc{r}")));
        match std::env::var_os("MIMALLOC_PURGE_DELAY") {
            None => assert_eq!(purge.trim(), "-1", "mimalloc keeps freed memory unless the user sets it"),
            Some(v) => assert_eq!(purge.trim(), v.to_str().unwrap(), "a user's MIMALLOC_PURGE_DELAY is kept"),
        }
        let backtrace = read(dir.path().join(format!("backtrace{r}")));
        match std::env::var_os("RUST_LIB_BACKTRACE") {
            None => assert_eq!(backtrace.trim(), "0", "a returned error prints no backtrace unless the user asks"),
            Some(v) => assert_eq!(backtrace.trim(), v.to_str().unwrap(), "a user's RUST_LIB_BACKTRACE is kept"),
        }
    }
    assert!(ports[0] != 0 && ports.iter().all(|p| *p == ports[0]), "{ports:?}");
}

#[test]
fn rust_workers_rendezvous_through_the_launchers_store() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = LaunchConfig::local(3, std::env::current_exe().unwrap(), self_exe_args());
    cfg.env.push((MODE_ENV.into(), "store-worker".into()));
    cfg.env.push(("OUT".into(), dir.path().display().to_string()));
    launch(&cfg).unwrap();
    for r in 0..3 {
        // Each worker saw every rank's key in the launcher's store, with the job's token.
        assert_eq!(read(dir.path().join(format!("store{r}"))), format!("rank {r} of 3, local {r} of 3, saw 0,1,2"));
    }
}

#[test]
fn a_failing_worker_stops_the_others_and_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = with_out(
        sh(3, r#"if [ "$RANK" = 1 ]; then sleep 0.3; exit 3; fi; echo $$ > "$OUT/pid$RANK"; exec sleep 60"#),
        dir.path(),
    );
    let start = Instant::now();
    let err = launch(&cfg).unwrap_err();
    let elapsed = start.elapsed();
    match &err {
        DdpError::WorkerFailed { rank, local_rank, status } => {
            assert_eq!((*rank, *local_rank, status.as_str()), (1, 1, "exit code 3"));
        }
        other => panic!("expected WorkerFailed, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("rank 1") && msg.contains("exit code 3"), "{msg}");
    assert!(elapsed < STOPPED_WELL_BEFORE, "the sleeping workers were not stopped: {elapsed:?}");
    for r in [0, 2] {
        if let Ok(pid) = std::fs::read_to_string(dir.path().join(format!("pid{r}"))) {
            assert!(process_gone(pid.trim().parse().unwrap()), "worker {r} still running");
        }
    }
}

#[test]
fn every_line_of_a_failing_workers_error_reaches_the_user() {
    // Rank 0 fails first; rank 1 fails a moment later and writes its error chain in pieces (as Rust's
    // `Error: {err:?}` does). Stopping it at once used to cut its output to `[rank 1] Error: `.
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = sh(
        2,
        r#"if [ "$RANK" = 0 ]; then exit 3; fi; sleep 0.1; printf 'Error: ' >&2; sleep 0.2;
           printf 'the peer closed the connection\n\nCaused by:\n    0: connection reset by rank 0\n' >&2; exit 1"#,
    );
    cfg.log_dir = Some(dir.path().to_path_buf());
    cfg.tee = true;
    match launch(&cfg) {
        Err(DdpError::WorkerFailed { rank: 0, status, .. }) => assert_eq!(status, "exit code 3"),
        other => panic!("expected WorkerFailed for rank 0, got {other:?}"),
    }
    let log = read(log_path(dir.path(), 1));
    assert!(log.contains("Error: the peer closed the connection\n"), "{log}");
    assert!(log.contains("Caused by:\n    0: connection reset by rank 0\n"), "{log}");
}

#[test]
fn a_worker_killed_by_a_signal_is_reported_with_the_signal_name() {
    let cfg = sh(3, r#"if [ "$RANK" = 2 ]; then kill -9 $$; fi; exec sleep 60"#);
    let start = Instant::now();
    match launch(&cfg) {
        Err(DdpError::WorkerFailed { rank: 2, local_rank: 2, status }) => {
            assert_eq!(status, "killed by signal 9 (SIGKILL)");
        }
        other => panic!("expected WorkerFailed for rank 2, got {other:?}"),
    }
    assert!(start.elapsed() < STOPPED_WELL_BEFORE);
}

#[test]
fn workers_that_ignore_sigterm_are_killed_after_the_grace_period() {
    let mut cfg = sh(2, r#"trap '' TERM; if [ "$RANK" = 0 ]; then exit 7; fi; sleep 60"#);
    cfg.stop_grace = Duration::from_millis(500);
    let start = Instant::now();
    match launch(&cfg) {
        Err(DdpError::WorkerFailed { rank: 0, status, .. }) => assert_eq!(status, "exit code 7"),
        other => panic!("expected WorkerFailed for rank 0, got {other:?}"),
    }
    assert!(start.elapsed() < STOPPED_WELL_BEFORE);
}

#[test]
fn output_is_prefixed_with_the_rank_and_teed_to_log_files() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let out = Command::new(std::env::current_exe().unwrap())
        .args(self_exe_args())
        .env(MODE_ENV, "launcher")
        .env("LAUNCH_N", "2")
        .env(
            "LAUNCH_SCRIPT",
            r#"echo "out-$RANK"; echo "err-$RANK" >&2; echo "two words $RANK"; printf "no-newline-$RANK""#,
        )
        .env("LAUNCH_LOG_DIR", &logs)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("LAUNCH_RESULT ok"), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for r in 0..2 {
        for line in
            [format!("[rank {r}] out-{r}"), format!("[rank {r}] two words {r}"), format!("[rank {r}] no-newline-{r}")]
        {
            assert!(stdout.lines().any(|l| l == line), "missing {line:?} in stdout:\n{stdout}");
        }
        let err_line = format!("[rank {r}] err-{r}");
        assert!(stderr.lines().any(|l| l == err_line), "missing {err_line:?} in stderr:\n{stderr}");
        assert!(!stdout.contains(&format!("err-{r}")), "stderr lines stay on stderr");
        // Log files hold the rank's lines unprefixed; stdout lines keep their order.
        let log = read(log_path(&logs, r));
        let lines: Vec<&str> = log.lines().collect();
        assert!(lines.contains(&format!("err-{r}").as_str()), "{log}");
        let stdout_lines: Vec<&str> = lines.iter().copied().filter(|l| !l.starts_with("err-")).collect();
        assert_eq!(stdout_lines, [format!("out-{r}"), format!("two words {r}"), format!("no-newline-{r}")], "{log}");
    }
}

#[test]
fn a_failed_job_prints_the_first_failing_ranks_error_once() {
    // Rank 1 fails first; rank 0 fails with the same report, rank 2 with another (a consequence, typically).
    // What each worker's `report_error` writes goes to ACCEL_ERROR_FILE, and the launcher prints rank 1's once,
    // names rank 2's in one line, and leaves every report in the rank's log file.
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let script = r#"case $RANK in
        1) printf 'Error: boom\n  caused by: disk full\n' > "$ACCEL_ERROR_FILE"; exit 1 ;;
        0) sleep 0.3; printf 'Error: boom\n  caused by: disk full\n' > "$ACCEL_ERROR_FILE"; exit 1 ;;
        *) sleep 0.3; printf 'Error: peer rank 1 is gone\n' > "$ACCEL_ERROR_FILE"; exit 1 ;;
    esac"#;
    let out = Command::new(std::env::current_exe().unwrap())
        .args(self_exe_args())
        .env(MODE_ENV, "launcher")
        .env("LAUNCH_N", "3")
        .env("LAUNCH_SCRIPT", script)
        .env("LAUNCH_LOG_DIR", &logs)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains("LAUNCH_RESULT err worker rank 1 (local rank 1) failed first: exit code 1"),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.iter().filter(|l| l.contains("boom")).count(), 1, "one copy of the error:\n{stderr}");
    assert!(lines.contains(&"[rank 1] Error: boom") && lines.contains(&"[rank 1]   caused by: disk full"), "{stderr}");
    assert!(lines.contains(&"[rank 2] failed too: peer rank 1 is gone"), "{stderr}");
    assert_eq!(read(log_path(&logs, 0)).trim(), "Error: boom\n  caused by: disk full");
    assert_eq!(read(log_path(&logs, 2)).trim(), "Error: peer rank 1 is gone");
}

#[test]
fn without_tee_output_goes_only_to_the_log_files() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(self_exe_args())
        .env(MODE_ENV, "launcher")
        .env("LAUNCH_N", "2")
        // Rank 1 fails only once rank 0 has written everything (else rank 0 may be stopped before).
        .env(
            "LAUNCH_SCRIPT",
            r#"echo "hello from $RANK"; echo "oops $RANK" >&2; [ "$RANK" = 0 ] && touch "$OUT/done0";
               while [ ! -e "$OUT/done0" ]; do sleep 0.05; done; exit $RANK"#,
        )
        .env("OUT", dir.path())
        .env("LAUNCH_LOG_DIR", dir.path().join("logs"))
        .env("LAUNCH_NO_TEE", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains("LAUNCH_RESULT err worker rank 1 (local rank 1) failed first: exit code 1"),
        "{:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    assert!(!stdout.contains("hello from") && !stderr.contains("oops"), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(out.status.code(), Some(1));
    for r in 0..2 {
        let log = read(log_path(&dir.path().join("logs"), r));
        assert!(log.contains(&format!("hello from {r}\n")) && log.contains(&format!("oops {r}\n")), "{log}");
    }
}

#[test]
fn ctrl_c_to_the_launcher_stops_the_workers() {
    let dir = tempfile::tempdir().unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(self_exe_args())
        .env(MODE_ENV, "launcher")
        .env("LAUNCH_N", "2")
        .env("OUT", dir.path())
        .env("LAUNCH_SCRIPT", r#"echo $$ > "$OUT/pid$RANK.tmp"; mv "$OUT/pid$RANK.tmp" "$OUT/pid$RANK"; exec sleep 60"#)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let pid_files = [dir.path().join("pid0"), dir.path().join("pid1")];
    while !pid_files.iter().all(|p| p.exists()) {
        assert!(Instant::now() < deadline, "workers did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pids: Vec<i32> = pid_files.iter().map(|p| read(p).trim().parse().unwrap()).collect();
    let start = Instant::now();
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(start.elapsed() < STOPPED_WELL_BEFORE);
    assert!(stdout.contains("LAUNCH_RESULT err launcher interrupted by SIGINT"), "{stdout}");
    assert_eq!(out.status.code(), Some(1));
    for pid in pids {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !process_gone(pid) {
            assert!(Instant::now() < deadline, "worker {pid} survived the launcher's Ctrl-C");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn the_group_is_restarted_up_to_max_restarts() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 0 fails on the first run only.
    let script = r#"echo "$MASTER_PORT" > "$OUT/run$ACCEL_RESTART_COUNT.rank$RANK"; if [ "$ACCEL_RESTART_COUNT" = 0 ] && [ "$RANK" = 0 ]; then exit 5; fi; [ "$ACCEL_MAX_RESTARTS" = 2 ]"#;
    let mut cfg = with_out(sh(2, script), dir.path());
    cfg.max_restarts = 2;
    launch(&cfg).unwrap();
    assert!(dir.path().join("run1.rank0").exists() && dir.path().join("run1.rank1").exists());
    assert!(!dir.path().join("run2.rank0").exists(), "no restart after success");

    let dir = tempfile::tempdir().unwrap();
    let mut cfg = with_out(sh(2, r#"echo x > "$OUT/run$ACCEL_RESTART_COUNT.rank$RANK"; exit 4"#), dir.path());
    cfg.max_restarts = 1;
    match launch(&cfg) {
        Err(DdpError::WorkerFailed { status, .. }) => assert_eq!(status, "exit code 4"),
        other => panic!("expected WorkerFailed, got {other:?}"),
    }
    assert!(dir.path().join("run1.rank0").exists() || dir.path().join("run1.rank1").exists());
    assert!(!dir.path().join("run2.rank0").exists() && !dir.path().join("run2.rank1").exists());
}

/// A port that was free a moment ago, for jobs on several "machines" (which need a fixed port).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Machine `node_rank` of a loopback job of `nnodes` "machines" with `n` workers each.
fn machine(n: usize, nnodes: usize, node_rank: usize, port: u16, token: RunToken, script: &str) -> LaunchConfig {
    let mut cfg = sh(n, script);
    cfg.nnodes = nnodes;
    cfg.node_rank = node_rank;
    cfg.master_port = port;
    cfg.env.push(("ACCEL_RUN_TOKEN".into(), token.to_hex()));
    cfg.rdzv_timeout = Duration::from_secs(30);
    cfg
}

/// Runs `cfg` on a thread (a second "machine" of the test's job).
fn launch_on_thread(cfg: LaunchConfig) -> std::thread::JoinHandle<Result<(), DdpError>> {
    std::thread::spawn(move || launch(&cfg))
}

#[test]
fn a_non_zero_node_rank_gets_global_ranks_and_hosts_no_store() {
    let dir = tempfile::tempdir().unwrap();
    let token = RunToken::generate().unwrap();
    let port = free_port();
    let script = r#"echo "$RANK $LOCAL_RANK $WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $ACCEL_RUN_TOKEN" > "$OUT/rank$RANK""#;
    let node0 = launch_on_thread(with_out(machine(2, 2, 0, port, token, script), dir.path()));
    // Machine 1 binds nothing: it joins machine 0's store (and would fail with "port in use" otherwise).
    launch(&with_out(machine(2, 2, 1, port, token, script), dir.path())).unwrap();
    node0.join().unwrap().unwrap();
    for (r, local, group) in [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)] {
        assert_eq!(
            read(dir.path().join(format!("rank{r}"))).trim(),
            format!("{r} {local} 4 {group} 2 127.0.0.1 {port} {}", token.to_hex())
        );
    }
}

#[test]
fn machines_launched_with_different_num_processes_both_fail_at_once_naming_both_values() {
    let dir = tempfile::tempdir().unwrap();
    let token = RunToken::generate().unwrap();
    let port = free_port();
    let script = r#"touch "$OUT/ran$RANK""#;
    let started = Instant::now();
    // `-n 4` on machine 0 (2 workers each), `-n 2` on machine 1 (1 worker each).
    let node0 = launch_on_thread(with_out(machine(2, 2, 0, port, token, script), dir.path()));
    let err1 = launch(&with_out(machine(1, 2, 1, port, token, script), dir.path())).unwrap_err();
    let err0 = node0.join().unwrap().unwrap_err();
    let expected = "rendezvous: machine 1 launched with num_processes 2 but machine 0 with 4; pass the same \
                    -n/--num-processes on every machine (the TOTAL over all machines)";
    assert_eq!(err0.to_string(), expected);
    assert_eq!(err1.to_string(), expected);
    assert!(matches!(err0, DdpError::Rendezvous(_)) && matches!(err1, DdpError::Rendezvous(_)));
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "no worker may start on an inconsistent job");
}

#[test]
fn a_machine_rank_launched_twice_fails_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let token = RunToken::generate().unwrap();
    let port = free_port();
    let script = r#"touch "$OUT/started$RANK"; sleep 3"#;
    let node0 = launch_on_thread(with_out(machine(1, 2, 0, port, token, script), dir.path()));
    let node1 = launch_on_thread(with_out(machine(1, 2, 1, port, token, script), dir.path()));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !dir.path().join("started1").exists() {
        assert!(Instant::now() < deadline, "machine 1's worker did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let started = Instant::now();
    let err = launch(&machine(1, 2, 1, port, token, "true")).unwrap_err();
    let mut host = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes.
    assert_eq!(unsafe { libc::gethostname(host.as_mut_ptr().cast(), host.len()) }, 0);
    let host = String::from_utf8_lossy(&host[..host.iter().position(|b| *b == 0).unwrap()]).into_owned();
    assert_eq!(
        err.to_string(),
        format!(
            "rendezvous: machine rank 1 is already taken by {host} (pid {}); give every machine its own \
             --machine-rank (0..2)",
            std::process::id()
        )
    );
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    // The first two machines are not disturbed.
    node0.join().unwrap().unwrap();
    node1.join().unwrap().unwrap();
}

#[test]
fn machine_0_fails_at_once_when_a_machine_with_another_run_token_is_refused() {
    let port = free_port();
    let started = Instant::now();
    let node0 = launch_on_thread(machine(1, 2, 0, port, RunToken::generate().unwrap(), "true"));
    let err1 = launch(&machine(1, 2, 1, port, RunToken::generate().unwrap(), "true")).unwrap_err();
    let err0 = node0.join().unwrap().unwrap_err();
    assert!(matches!(err1, DdpError::TokenRejected { .. }), "{err1}");
    let msg = err0.to_string();
    assert!(
        msg.starts_with(&format!("rendezvous: the store at 127.0.0.1:{port} refused the peer 127.0.0.1:"))
            && msg.contains("(run token mismatch); export the same ACCEL_RUN_TOKEN"),
        "{msg}"
    );
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
}

/// `machine(...)` without the run token: what a machine started without `export ACCEL_RUN_TOKEN=…` runs.
fn without_token(mut cfg: LaunchConfig) -> LaunchConfig {
    assert!(std::env::var_os("ACCEL_RUN_TOKEN").is_none(), "the test process itself must have no run token");
    cfg.env.retain(|(k, _)| k != "ACCEL_RUN_TOKEN");
    cfg
}

#[test]
fn a_machine_without_the_run_token_fails_the_other_machine_at_once() {
    // Machine 1 has no token: it fails naming the variable, and machine 0 (rdzv_timeout 30 s, 30 min by default)
    // fails within seconds instead of waiting for it.
    let port = free_port();
    let started = Instant::now();
    let node0 = launch_on_thread(machine(1, 2, 0, port, RunToken::generate().unwrap(), "true"));
    let err1 = launch(&without_token(machine(1, 2, 1, port, RunToken::generate().unwrap(), "true"))).unwrap_err();
    let err0 = node0.join().unwrap().unwrap_err();
    assert!(
        err1.to_string().starts_with("environment variable ACCEL_RUN_TOKEN: not set, but a job on 2 machines"),
        "{err1}"
    );
    let msg = err0.to_string();
    assert!(msg.contains("(run token mismatch); export the same ACCEL_RUN_TOKEN"), "{msg}");
    assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());

    // Machine 0 has none: machine 1, started after it, is refused at once.
    let port = free_port();
    let started = Instant::now();
    let node0 = launch_on_thread(without_token(machine(1, 2, 0, port, RunToken::generate().unwrap(), "true")));
    std::thread::sleep(Duration::from_millis(300));
    let err1 = launch(&machine(1, 2, 1, port, RunToken::generate().unwrap(), "true")).unwrap_err();
    let err0 = node0.join().unwrap().unwrap_err();
    assert!(err0.to_string().contains("ACCEL_RUN_TOKEN: not set"), "{err0}");
    assert!(matches!(err1, DdpError::TokenRejected { .. }), "{err1}");
    assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());

    // Machine 1 without the token starts 11 s before machine 0 (machines start minutes apart on a real cluster):
    // it waits to tell machine 0, which fails as soon as it is up.
    let port = free_port();
    let node1 = launch_on_thread(without_token(machine(1, 2, 1, port, RunToken::generate().unwrap(), "true")));
    std::thread::sleep(Duration::from_secs(11));
    let started = Instant::now();
    let err0 = launch(&machine(1, 2, 0, port, RunToken::generate().unwrap(), "true")).unwrap_err();
    assert!(err0.to_string().contains("(run token mismatch)"), "{err0}");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert!(node1.join().unwrap().unwrap_err().to_string().contains("ACCEL_RUN_TOKEN: not set"));
}

#[test]
fn a_launcher_waiting_for_a_machine_says_which_one_until_it_times_out() {
    let port = free_port();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(self_exe_args())
        .env(MODE_ENV, "launcher")
        .env("LAUNCH_N", "2")
        .env("LAUNCH_SCRIPT", "true")
        .env("LAUNCH_MACHINE", format!("0 of 3 port {port} timeout-ms 1500 progress-ms 200"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let progress = format!("[launcher] machine 0: waiting for machine(s) 1, 2 (1/3 joined) at 127.0.0.1:{port}");
    let lines = stderr.lines().filter(|l| *l == progress).count();
    assert!((3..=8).contains(&lines), "{lines} progress lines in {stderr:?}");
    assert!(
        stdout.contains(&format!(
            "LAUNCH_RESULT err rendezvous: timed out after 1.5 s waiting for machine(s) 1, 2 (1/3 joined) at \
             127.0.0.1:{port}; start `accel launch` on every machine"
        )),
        "{stdout}"
    );
}

#[test]
fn rank_0_says_which_ranks_it_is_waiting_for() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = LaunchConfig::local(2, std::env::current_exe().unwrap(), self_exe_args());
    cfg.env.push((MODE_ENV.into(), "pg-worker".into()));
    cfg.env.push(("ACCEL_BACKEND".into(), "cpu".into()));
    cfg.env.push(("ACCEL_TIMEOUT".into(), "2".into()));
    cfg.env.push(("ACCEL_PROGRESS_INTERVAL".into(), "0.3".into()));
    cfg.log_dir = Some(dir.path().to_path_buf());
    cfg.tee = false;
    cfg.stop_grace = Duration::from_secs(1);
    match launch(&cfg) {
        Err(DdpError::WorkerFailed { rank: 0, status, .. }) => assert_eq!(status, "exit code 1"),
        other => panic!("expected rank 0 to fail, got {other:?}"),
    }
    let log = read(log_path(dir.path(), 0));
    let lines = log.lines().filter(|l| l.contains("rank 0: waiting for ranks 1 (1/2 connected) at 127.0.0.1:")).count();
    assert!((3..=8).contains(&lines), "{lines} progress lines in {log:?}");
    assert!(log.contains("init failed:") && log.contains("ranks [1] did not connect"), "{log:?}");
}

#[test]
fn bad_configurations_are_refused_with_a_reason() {
    let check = |cfg: &LaunchConfig, words: &[&str]| {
        let msg = launch(cfg).unwrap_err().to_string();
        for w in words {
            assert!(msg.contains(w), "{msg:?} should contain {w:?}");
        }
    };
    check(&sh(0, "true"), &["nproc_per_node"]);
    let mut cfg = sh(1, "true");
    cfg.nnodes = 2;
    cfg.node_rank = 2;
    check(&cfg, &["node_rank 2"]);
    cfg.node_rank = 0;
    cfg.master_port = 0;
    check(&cfg, &["master_port"]);
    if std::env::var_os("ACCEL_RUN_TOKEN").is_none() {
        cfg.master_port = free_port();
        // Without the token machine 0 waits up to rdzv_timeout to refuse the other machines (so that they fail
        // too), then fails itself.
        cfg.rdzv_timeout = Duration::from_millis(300);
        check(&cfg, &["ACCEL_RUN_TOKEN", "openssl rand -hex 16"]);
    }
    let mut cfg = sh(1, "true");
    cfg.env.push(("ACCEL_RUN_TOKEN".into(), "short".into()));
    check(&cfg, &["ACCEL_RUN_TOKEN", "32 hex digits"]);

    check(&LaunchConfig::local(2, "/nonexistent/worker-binary", vec![]), &["rank 0", "/nonexistent/worker-binary"]);

    // The port is taken: the error names host:port.
    let token = RunToken::generate().unwrap();
    let server = ddp_core::TcpStoreServer::bind("127.0.0.1:0", token).unwrap();
    let mut cfg = sh(1, "true");
    cfg.master_port = server.port();
    check(&cfg, &[&format!("127.0.0.1:{}", server.port())]);
}

/// Entry point of the re-executed copies of this binary; does nothing in a normal test run.
#[test]
fn zz_child_entry() {
    let Ok(mode) = std::env::var(MODE_ENV) else { return };
    let code = match mode.as_str() {
        "store-worker" => store_worker(),
        "launcher" => launcher_child(),
        "pg-worker" => pg_worker(),
        "elastic-worker" => elastic_worker(),
        other => panic!("unknown {MODE_ENV} {other}"),
    };
    std::process::exit(code);
}

/// A Rust worker: reads its layout like a real program, connects to the launcher's store with the job's token,
/// publishes its rank and waits for everyone else's.
fn store_worker() -> i32 {
    let env = DistEnv::from_env().unwrap();
    let opts = InitOptions::from_env().unwrap();
    assert!(env.agent_store && !opts.host_store, "the launcher hosts the store");
    let addr = format!("{}:{}", opts.master_addr, opts.master_port);
    let store =
        TcpStore::connect(&addr, opts.token.expect("launcher sets the token"), Duration::from_secs(60)).unwrap();
    store.set(&format!("rank/{}", env.rank), env.rank.to_string().as_bytes()).unwrap();
    let keys: Vec<String> = (0..env.world_size).map(|r| format!("rank/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.wait(&refs, Duration::from_secs(60)).unwrap();
    let seen: Vec<String> = refs.iter().map(|k| String::from_utf8(store.get(k).unwrap()).unwrap()).collect();
    let out = std::env::var("OUT").unwrap();
    let text = format!(
        "rank {} of {}, local {} of {}, saw {}",
        env.rank,
        env.world_size,
        env.local_rank,
        env.local_world_size,
        seen.join(",")
    );
    std::fs::write(Path::new(&out).join(format!("store{}", env.rank)), text).unwrap();
    0
}

/// Rank 0 forms a real process group; the other ranks never join (they sleep), so rank 0 waits and says so.
fn pg_worker() -> i32 {
    if ddp_core::env::DistEnv::from_env().unwrap().rank != 0 {
        std::thread::sleep(Duration::from_secs(10));
        return 0;
    }
    match ddp_core::ProcessGroup::init_from_env() {
        Ok(_) => 0,
        Err(e) => {
            eprintln!("init failed: {e}");
            1
        }
    }
}

/// A worker of an elastic job: records its round, place and pid, then all-reduces every 100 ms until every rank
/// of its round sees `$OUT/finish` (exit 0), a collective fails (a peer is gone) or `$OUT` is gone (exit 1).
fn elastic_worker() -> i32 {
    let out = std::path::PathBuf::from(std::env::var("OUT").unwrap());
    let env = DistEnv::from_env().unwrap();
    let round = std::env::var("ACCEL_RESTART_COUNT").unwrap();
    let line = format!(
        "world {} group_rank {} machine {} elastic {}",
        env.world_size,
        env.node_rank,
        std::env::var("MACHINE").unwrap(),
        std::env::var("ACCEL_ELASTIC_NNODES").unwrap()
    );
    std::fs::write(out.join(format!("pid{round}.rank{}", env.rank)), std::process::id().to_string()).unwrap();
    std::fs::write(out.join(format!("round{round}.rank{}", env.rank)), line).unwrap();
    let pg = match ddp_core::ProcessGroup::init_from_env() {
        Ok(pg) => pg,
        Err(e) => {
            eprintln!("init failed: {e}");
            return 1;
        }
    };
    loop {
        if !out.exists() {
            return 1; // the test ended (its temporary directory is gone): do not outlive it
        }
        let mut done = [f32::from(u8::from(out.join("finish").exists()))];
        if let Err(e) = pg.all_reduce(&mut done, ddp_core::ReduceOp::Sum) {
            eprintln!("collective failed: {e}");
            return 1;
        }
        if done[0] as usize == env.world_size {
            return 0;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A launcher run from outside, so that the test can read its console and send it signals.
fn launcher_child() -> i32 {
    let n: usize = std::env::var("LAUNCH_N").unwrap().parse().unwrap();
    let mut cfg = sh(n, &std::env::var("LAUNCH_SCRIPT").unwrap());
    cfg.log_dir = std::env::var_os("LAUNCH_LOG_DIR").map(Into::into);
    cfg.tee = std::env::var_os("LAUNCH_NO_TEE").is_none();
    if let Ok(m) = std::env::var("LAUNCH_MACHINE") {
        // "<node_rank> of <nnodes> port <port> timeout-ms <ms> progress-ms <ms>"
        let w: Vec<&str> = m.split(' ').collect();
        cfg.node_rank = w[0].parse().unwrap();
        cfg.nnodes = w[2].parse().unwrap();
        cfg.master_port = w[4].parse().unwrap();
        cfg.rdzv_timeout = Duration::from_millis(w[6].parse().unwrap());
        cfg.progress_interval = Duration::from_millis(w[8].parse().unwrap());
        let token = std::env::var("LAUNCH_TOKEN").unwrap_or_else(|_| RunToken::generate().unwrap().to_hex());
        cfg.env.push(("ACCEL_RUN_TOKEN".into(), token));
    }
    if let Some(e) = std::env::var("LAUNCH_ELASTIC").ok().filter(|e| e != "static") {
        // "<min> max-restarts <n> last-call-ms <ms>": an elastic job of real process-group workers (this binary).
        let w: Vec<&str> = e.split(' ').collect();
        cfg.min_nnodes = Some(w[0].parse().unwrap());
        cfg.max_restarts = w[2].parse().unwrap();
        cfg.last_call = Duration::from_millis(w[4].parse().unwrap());
        cfg.program = std::env::current_exe().unwrap();
        cfg.args = self_exe_args();
        cfg.env.push((MODE_ENV.into(), "elastic-worker".into()));
        cfg.env.push(("MACHINE".into(), cfg.node_rank.to_string()));
        let timeout = std::env::var("LAUNCH_COLLECTIVE_TIMEOUT").unwrap_or_else(|_| "20".into());
        cfg.env.push(("ACCEL_TIMEOUT".into(), timeout));
    }
    let result = launch(&cfg);
    // One write, after the workers' output threads are done.
    match result {
        Ok(()) => {
            println!("LAUNCH_RESULT ok");
            0
        }
        Err(e) => {
            println!("LAUNCH_RESULT err {e}");
            1
        }
    }
}

/// A worker killed by a signal is named as the failure, even when a peer's error exit (its collective broke)
/// reaches the launcher first: the kill is the cause.
#[test]
fn a_killed_worker_is_named_before_a_peer_that_exited_with_an_error() {
    let script = r#"if [ "$RANK" = 1 ]; then exit 1; fi; sleep 0.3; kill -9 $$"#;
    match launch(&sh(2, script)) {
        Err(DdpError::WorkerFailed { rank: 0, status, .. }) => assert_eq!(status, "killed by signal 9 (SIGKILL)"),
        other => panic!("expected rank 0 killed by SIGKILL, got {other:?}"),
    }
}

/// Machine `rank` of an elastic loopback job (`1:2` machines, one worker each) as a launcher process of its own.
fn elastic_machine(rank: usize, port: u16, token: &RunToken, out: &Path, max_restarts: usize) -> std::process::Child {
    elastic_machine_with(rank, port, token, out, max_restarts, &[])
}

fn elastic_machine_with(
    rank: usize,
    port: u16,
    token: &RunToken,
    out: &Path,
    max_restarts: usize,
    env: &[(&str, &str)],
) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(self_exe_args())
        .env(MODE_ENV, "launcher")
        .env("LAUNCH_N", "1")
        .env("LAUNCH_SCRIPT", "unused")
        .env("LAUNCH_MACHINE", format!("{rank} of 2 port {port} timeout-ms 60000 progress-ms 60000"))
        .env("LAUNCH_TOKEN", token.to_hex())
        .env("LAUNCH_ELASTIC", format!("1 max-restarts {max_restarts} last-call-ms 1500"))
        .env("OUT", out)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits (up to 60 s) until `path` exists.
fn wait_for_file(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !path.exists() {
        assert!(Instant::now() < deadline, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// torchrun's `--nnodes 1:2`: machine 1 is lost (its launcher and workers killed), machine 0 goes on alone in a
/// new round, machine 1 comes back and joins the round after; each change is said on every machine.
#[test]
fn an_elastic_job_goes_on_without_a_lost_machine_and_takes_it_back() {
    let dir = tempfile::tempdir().unwrap();
    let (port, token) = (free_port(), RunToken::generate().unwrap());
    let m0 = elastic_machine(0, port, &token, dir.path(), 3);
    let mut m1 = elastic_machine(1, port, &token, dir.path(), 3);
    wait_for_file(&dir.path().join("round0.rank1"));
    // Lose machine 1: its launcher dies at once, its worker with it (PR_SET_PDEATHSIG).
    m1.kill().unwrap();
    let _ = m1.wait();
    wait_for_file(&dir.path().join("round1.rank0"));
    let m1 = elastic_machine(1, port, &token, dir.path(), 3);
    wait_for_file(&dir.path().join("round2.rank1"));
    std::fs::write(dir.path().join("finish"), "").unwrap();
    let (o0, o1) = (m0.wait_with_output().unwrap(), m1.wait_with_output().unwrap());
    let (out0, err0) = (String::from_utf8_lossy(&o0.stdout), String::from_utf8_lossy(&o0.stderr));
    let err1 = String::from_utf8_lossy(&o1.stderr);
    assert!(out0.contains("LAUNCH_RESULT ok"), "machine 0:\n{out0}\n{err0}");
    assert!(String::from_utf8_lossy(&o1.stdout).contains("LAUNCH_RESULT ok"), "machine 1:\n{err1}");
    let round = |name: &str| read(dir.path().join(name));
    assert_eq!(round("round0.rank0"), "world 2 group_rank 0 machine 0 elastic 1:2");
    assert_eq!(round("round0.rank1"), "world 2 group_rank 1 machine 1 elastic 1:2");
    assert_eq!(round("round1.rank0"), "world 1 group_rank 0 machine 0 elastic 1:2");
    assert!(!dir.path().join("round1.rank1").exists(), "round 1 is machine 0 alone");
    assert_eq!(round("round2.rank0"), "world 2 group_rank 0 machine 0 elastic 1:2");
    assert_eq!(round("round2.rank1"), "world 2 group_rank 1 machine 1 elastic 1:2");
    assert!(err0.contains("machine 0: round 0: started with machines 0, 1; 2 machines, 2 processes"), "{err0}");
    assert!(
        err0.contains("machine 0: round 1: machine 1 left (the round before ended: machine 0: worker rank 0 failed"),
        "{err0}"
    );
    assert!(err0.contains("machine 0: round 2: machine 1 joined (the round before ended: machine 1 asks to join)"));
    assert!(err1.contains("machine 1: round 2: machine 1 joined"), "{err1}");
}

/// Failures past `max_restarts` end every machine of an elastic job with the same words.
#[test]
fn an_elastic_job_past_max_restarts_fails_every_machine_naming_why() {
    let dir = tempfile::tempdir().unwrap();
    let (port, token) = (free_port(), RunToken::generate().unwrap());
    let m0 = elastic_machine(0, port, &token, dir.path(), 0);
    let mut m1 = elastic_machine(1, port, &token, dir.path(), 0);
    wait_for_file(&dir.path().join("round0.rank1"));
    m1.kill().unwrap();
    let _ = m1.wait();
    let o0 = m0.wait_with_output().unwrap();
    let out0 = String::from_utf8_lossy(&o0.stdout);
    assert!(
        out0.contains("LAUNCH_RESULT err rendezvous") || out0.contains("LAUNCH_RESULT err"),
        "{out0}\n{}",
        String::from_utf8_lossy(&o0.stderr)
    );
    assert!(out0.contains("round 0 ended: machine 0: worker rank 0 failed"), "{out0}");
    assert!(out0.contains("no restarts left (max_restarts = 0"), "{out0}");
    assert!(!dir.path().join("round1.rank0").exists(), "no round after the last restart");
}

/// A stalled worker (SIGSTOP, past the collective timeout) on machine 1: machine 0's worker times out and the round
/// ends for every machine; machine 1's launcher kills its stopped worker (SIGTERM cannot reach it: SIGKILL after the
/// 5 s grace), which takes longer than the last call, so machine 0 trains alone for a round and machine 1 joins the
/// one after. Nothing hangs.
#[test]
fn a_stalled_worker_ends_the_round_and_its_machine_joins_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let (port, token) = (free_port(), RunToken::generate().unwrap());
    let fast = [("LAUNCH_COLLECTIVE_TIMEOUT", "2")];
    let m0 = elastic_machine_with(0, port, &token, dir.path(), 3, &fast);
    let m1 = elastic_machine_with(1, port, &token, dir.path(), 3, &fast);
    wait_for_file(&dir.path().join("round0.rank1"));
    let pid: i32 = read(dir.path().join("pid0.rank1")).trim().parse().unwrap();
    // SAFETY: plain syscall on the worker this test's launcher started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let stalled = Instant::now();
    wait_for_file(&dir.path().join("round2.rank1"));
    let recovered = stalled.elapsed();
    std::fs::write(dir.path().join("finish"), "").unwrap();
    let (o0, o1) = (m0.wait_with_output().unwrap(), m1.wait_with_output().unwrap());
    let (out0, err0) = (String::from_utf8_lossy(&o0.stdout), String::from_utf8_lossy(&o0.stderr));
    assert!(out0.contains("LAUNCH_RESULT ok"), "machine 0:\n{out0}\n{err0}");
    assert!(String::from_utf8_lossy(&o1.stdout).contains("LAUNCH_RESULT ok"));
    assert!(process_gone(pid), "the stalled worker was killed");
    assert_eq!(read(dir.path().join("round1.rank0")), "world 1 group_rank 0 machine 0 elastic 1:2");
    assert_eq!(read(dir.path().join("round2.rank1")), "world 2 group_rank 1 machine 1 elastic 1:2");
    assert!(
        err0.contains("machine 0: round 1: machine 1 left (the round before ended: machine 0: worker rank 0 failed"),
        "{err0}"
    );
    assert!(err0.contains("machine 0: round 2: machine 1 joined"), "{err0}");
    // The 2 s collective timeout (×1.5 at most, the store's grace), the last call, the 5 s SIGTERM grace, start-up.
    assert!(recovered < Duration::from_secs(30), "{recovered:?}");
}

/// Launchers that may not join a running elastic job are turned away without disturbing it: one with another view
/// of the job (processes per machine), one with the rank of a running machine; and a static launcher on an elastic
/// job's store fails at once, naming both kinds.
#[test]
fn a_running_elastic_job_turns_wrong_launchers_away_and_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (port, token) = (free_port(), RunToken::generate().unwrap());
    let m0 = elastic_machine(0, port, &token, dir.path(), 3);
    wait_for_file(&dir.path().join("round0.rank0")); // machine 0 alone after the last call
    let output = |c: std::process::Child| {
        let o = c.wait_with_output().unwrap();
        format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
    };
    let wrong = output(elastic_machine_with(1, port, &token, dir.path(), 3, &[("LAUNCH_N", "2")]));
    assert!(
        wrong.contains("LAUNCH_RESULT err")
            && wrong.contains("machine 1 launched with nproc_per_node 2 but machine 0 with 1"),
        "{wrong}"
    );
    let twin = output(elastic_machine_with(0, port, &token, dir.path(), 3, &[]));
    assert!(twin.contains("LAUNCH_RESULT err"), "{twin}");
    let stat = output(elastic_machine_with(1, port, &token, dir.path(), 3, &[("LAUNCH_ELASTIC", "static")]));
    assert!(stat.contains("(a static job) but machine 0 with 1:2 (an elastic job)"), "{stat}");
    // A second machine 1 that may join does, and the job ends well.
    let m1 = elastic_machine(1, port, &token, dir.path(), 3);
    wait_for_file(&dir.path().join("round1.rank1"));
    std::fs::write(dir.path().join("finish"), "").unwrap();
    let (o0, o1) = (output(m0), output(m1));
    assert!(o0.contains("LAUNCH_RESULT ok") && o1.contains("LAUNCH_RESULT ok"), "{o0}\n{o1}");
    assert!(o0.contains("machine 0: round 1: machine 1 joined"), "{o0}");
    assert!(!dir.path().join("round2.rank0").exists(), "the turned-away launchers did not restart the job");
}

/// A second launcher with the rank of a running machine is turned away; the running one is not disturbed.
#[test]
fn a_second_launcher_with_a_running_machines_rank_is_turned_away() {
    let dir = tempfile::tempdir().unwrap();
    let (port, token) = (free_port(), RunToken::generate().unwrap());
    let m0 = elastic_machine(0, port, &token, dir.path(), 3);
    let m1 = elastic_machine(1, port, &token, dir.path(), 3);
    wait_for_file(&dir.path().join("round0.rank1"));
    let o = elastic_machine(1, port, &token, dir.path(), 3).wait_with_output().unwrap();
    let twin = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(twin.contains("machine rank 1 is already running in round 0 of this job"), "{twin}");
    std::fs::write(dir.path().join("finish"), "").unwrap();
    for m in [m0, m1] {
        let o = m.wait_with_output().unwrap();
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("LAUNCH_RESULT ok"),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    assert!(!dir.path().join("round1.rank0").exists(), "the running round was not restarted");
}

/// Machine 0 stopped (SIGSTOP: its store still accepts connections but answers nothing): machine 1's launcher stops
/// its workers and ends naming machine 0, within the store's 10 s answer grace, not the collective timeout.
#[test]
fn a_stopped_machine_0_ends_the_other_machines_within_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let (port, token) = (free_port(), RunToken::generate().unwrap());
    let mut m0 = elastic_machine(0, port, &token, dir.path(), 3);
    let m1 = elastic_machine(1, port, &token, dir.path(), 3);
    wait_for_file(&dir.path().join("round0.rank1"));
    let worker: i32 = read(dir.path().join("pid0.rank0")).trim().parse().unwrap();
    // SAFETY: plain syscalls on processes this test started.
    unsafe {
        libc::kill(m0.id() as i32, libc::SIGSTOP);
        libc::kill(worker, libc::SIGSTOP);
    }
    let stopped = Instant::now();
    let o1 = m1.wait_with_output().unwrap();
    let waited = stopped.elapsed();
    let _ = m0.kill();
    // SAFETY: as above.
    unsafe { libc::kill(worker, libc::SIGKILL) };
    let _ = m0.wait();
    let out1 = format!("{}{}", String::from_utf8_lossy(&o1.stdout), String::from_utf8_lossy(&o1.stderr));
    assert!(out1.contains("LAUNCH_RESULT err rendezvous: lost machine 0's store"), "{out1}");
    assert!(waited < Duration::from_secs(30), "{waited:?} (the collective timeout is 20 s, the answer grace 10 s)");
}
