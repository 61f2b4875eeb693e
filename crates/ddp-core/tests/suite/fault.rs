//! Faults: a killed worker, a stuck worker and a wrong run token each end in a prompt error on every surviving
//! rank that names the op, its sequence number and the responsible rank — never a hang.

use crate::common::procs;
use ddp_core::store::MemoryStore;
use ddp_core::{DdpError, GroupOptions, ProcessGroup, ReduceOp, RunToken, Store};
use std::io::{BufRead, BufReader};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Worker: all_reduce in a loop (a small buffer on the direct / slot path and a 1 MiB one on the ring / pipelined
/// shared-memory path; only the small one with `ACCEL_TEST_SMALL_ONLY`) until an error, which it prints before
/// exiting with code 3.
#[test]
fn worker() {
    let Some(scenario) = procs::scenario() else { return };
    assert_eq!(scenario, "loop");
    let pg = ProcessGroup::init_from_env().unwrap();
    let mut small = vec![1.0f32; 256];
    let mut large = vec![1.0f32; 1 << 18];
    let small_only = std::env::var_os("ACCEL_TEST_SMALL_ONLY").is_some();
    for iter in 0u64.. {
        let res = pg.all_reduce(&mut small, ReduceOp::Sum).and_then(|_| {
            if small_only {
                Ok(())
            } else {
                pg.all_reduce(&mut large, ReduceOp::Avg)
            }
        });
        if let Err(e) = res {
            eprintln!("worker error: {e}");
            std::process::exit(3);
        }
        println!("iter {iter}");
    }
}

/// Worker: a three-stage pipeline over point-to-point (rank 0 → 1 → 2, 2 MiB messages, four times the
/// shared-memory ring). Rank 1 sleeps 20 ms per message, so rank 0 spends its time blocked in send and rank 2
/// blocked in recv. Prints `iter N` per message and, on error, which call failed, then exits with code 3.
#[test]
fn pipeline_worker() {
    let Some(scenario) = procs::scenario() else { return };
    assert_eq!(scenario, "pipeline");
    let pg = ProcessGroup::init_from_env().unwrap();
    let mut buf = vec![0u8; 2 << 20];
    for iter in 0u64.. {
        let res = match pg.rank() {
            0 => pg.send(&buf, 1).map_err(|e| ("send", e)),
            1 => pg.recv(&mut buf, 0).map_err(|e| ("recv", e)).and_then(|_| {
                std::thread::sleep(Duration::from_millis(20));
                pg.send(&buf, 2).map_err(|e| ("send", e))
            }),
            _ => pg.recv(&mut buf, 1).map_err(|e| ("recv", e)),
        };
        if let Err((call, e)) = res {
            eprintln!("worker error: in {call}: {e}");
            std::process::exit(3);
        }
        println!("iter {iter}");
    }
}

#[test]
fn killing_a_pipeline_stage_fails_the_ranks_blocked_in_shared_memory_send_and_recv() {
    // Rank 1 is killed while rank 0 waits for room in its ring (blocked in send) and rank 2 waits for data
    // (blocked in recv); both must fail within seconds, naming the call, its sequence number and rank 1.
    let lines =
        kill_and_collect(Kill { test: "fault::pipeline_worker", scenario: "pipeline", victim: 1, ..Kill::default() });
    for (rank, line) in &lines {
        assert!(line.contains("send/recv") && line.contains("sequence number"), "rank {rank}: {line}");
        let want = if *rank == 0 { "in send:" } else { "in recv:" };
        assert!(line.contains(want), "rank {rank} was blocked in the other call: {line}");
    }
}

#[test]
fn stuck_peer_times_out_a_blocked_send_and_a_blocked_recv() {
    // Shared-memory rings (default tuning): rank 0 waits in recv from rank 1, rank 2 in a send to rank 1 larger
    // than the ring, and rank 1 does nothing for 4 s.
    let errs = run_ranks_with_timeout(3, Duration::from_millis(1500), |pg| match pg.rank() {
        0 => pg.recv(&mut [0u8; 8], 1).unwrap_err(),
        1 => {
            std::thread::sleep(Duration::from_secs(4));
            pg.recv(&mut vec![0u8; 2 << 20], 2).unwrap_err()
        }
        _ => pg.send(&vec![1u8; 2 << 20], 1).unwrap_err(),
    });
    for (rank, e) in errs.iter().enumerate() {
        let DdpError::Collective { op, peer, seq, .. } = e else { panic!("rank {rank}: {e}") };
        assert_eq!((*op, *peer, *seq), ("send/recv", Some(1), 1), "rank {rank}: {e}");
        assert!(e.to_string().contains("timed out") && e.to_string().contains("rank 1"), "rank {rank}: {e}");
    }
}

#[test]
fn killed_worker_fails_every_other_rank_within_seconds() {
    // Default tuning: the 1 MiB all_reduce goes through shared memory.
    kill_and_check_survivors(1, &[], false);
}

#[test]
fn killed_worker_fails_every_other_rank_on_the_tcp_path_too() {
    kill_and_check_survivors(1, &[("ACCEL_CPU_SHM", "0".to_string())], false);
}

#[test]
fn killed_worker_fails_every_other_rank_on_the_shared_memory_slot_path() {
    // Only 1 KiB all_reduces: every call is one round of the slot exchange, so the kill lands mid-round.
    kill_and_check_survivors(2, &[("ACCEL_TEST_SMALL_ONLY", "1".to_string())], false);
}

#[test]
fn killing_the_rank_that_hosts_the_store_still_fails_the_others_quickly() {
    // No launcher: rank 0 hosts the store, so the abort record cannot be published; sockets carry the news.
    kill_and_check_survivors(0, &[], true);
}

fn kill_and_check_survivors(victim: usize, extra_env: &[(&str, String)], rank0_hosts_store: bool) {
    let lines = kill_and_collect(Kill { victim, extra_env, rank0_hosts_store, ..Kill::default() });
    for (rank, line) in lines {
        assert!(line.contains("all_reduce") && line.contains("sequence number"), "rank {rank}: {line}");
    }
}

/// A job of three workers running `test` / `scenario`; `victim` is SIGKILLed once every worker printed 20 `iter`
/// lines.
struct Kill<'a> {
    test: &'a str,
    scenario: &'a str,
    victim: usize,
    extra_env: &'a [(&'a str, String)],
    rank0_hosts_store: bool,
}

impl Default for Kill<'_> {
    fn default() -> Self {
        Kill { test: "fault::worker", scenario: "loop", victim: 1, extra_env: &[], rank0_hosts_store: false }
    }
}

/// Runs `kill`'s job and checks every survivor failed within seconds with exit code 3 and an error naming the
/// victim; returns each survivor's `worker error:` line.
fn kill_and_collect(kill: Kill<'_>) -> Vec<(usize, String)> {
    let Kill { test, scenario, victim, extra_env, rank0_hosts_store } = kill;
    // The collective timeout is 10 minutes: only fault propagation can end the survivors' calls quickly.
    let mut env = vec![("ACCEL_TIMEOUT", "600".to_string())];
    env.extend_from_slice(extra_env);
    let mut job = procs::spawn_with(test, scenario, 3, &env, rank0_hosts_store);
    let progress: Vec<Arc<Mutex<u64>>> = (0..3).map(|_| Arc::new(Mutex::new(0))).collect();
    for (c, p) in job.children.iter_mut().zip(&progress) {
        let out = c.stdout.take().unwrap();
        let p = p.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(n) = line.strip_prefix("iter ").and_then(|n| n.parse().ok()) {
                    *p.lock().unwrap() = n;
                }
            }
        });
    }
    let start = Instant::now();
    while progress.iter().any(|p| *p.lock().unwrap() < 20) {
        assert!(start.elapsed() < Duration::from_secs(120), "workers did not make progress");
        std::thread::sleep(Duration::from_millis(10));
    }
    job.children[victim].kill().unwrap(); // SIGKILL, mid-all_reduce: the survivors are looping on it
    let killed_at = Instant::now();
    let mut survivors = Vec::new();
    for (rank, mut c) in job.children.into_iter().enumerate() {
        if rank == victim {
            let _ = c.wait();
            continue;
        }
        while c.try_wait().unwrap().is_none() {
            if killed_at.elapsed() > Duration::from_secs(60) {
                let _ = c.kill();
                panic!("rank {rank} still running 60 s after rank {victim} was killed: a hang");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let elapsed = killed_at.elapsed();
        let out = c.wait_with_output().unwrap();
        survivors.push((rank, out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned(), elapsed));
    }
    let mut lines = Vec::new();
    for (rank, code, stderr, elapsed) in survivors {
        assert_eq!(code, Some(3), "rank {rank}: {stderr}");
        let line = stderr.lines().find(|l| l.starts_with("worker error:")).unwrap_or_else(|| panic!("{stderr}"));
        let (tag, gone) = (format!("[peer rank {victim}]"), format!("rank {victim} is gone"));
        assert!(line.contains(&tag) && line.contains(&gone), "rank {rank}: {line}");
        eprintln!("rank {rank} after {elapsed:?}: {line}");
        // "Within a few seconds": generous for a loaded 2-core machine, far below the 600 s timeout.
        assert!(elapsed < Duration::from_secs(20), "rank {rank} took {elapsed:?}");
        lines.push((rank, line.to_string()));
    }
    lines
}

#[test]
fn stuck_worker_times_out_on_every_rank_naming_it() {
    let errs = run_ranks_with_timeout(3, Duration::from_millis(1500), |pg| {
        let mut v = [1.0f64; 8];
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_secs(4));
            // The others' inputs may all have arrived before they gave up, so this call can complete; the
            // group is aborted all the same and the next call must say so.
            if pg.all_reduce(&mut v, ReduceOp::Sum).is_ok() {
                return pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
            }
        }
        pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err()
    });
    for (rank, e) in errs.iter().enumerate() {
        let DdpError::Collective { op, peer, .. } = e else { panic!("rank {rank}: {e}") };
        assert_eq!((*op, *peer), ("all_reduce", Some(1)), "rank {rank}: {e}");
        assert!(e.to_string().contains("timed out") && e.to_string().contains("rank 1"), "rank {rank}: {e}");
    }
    for e in [&errs[0], &errs[2]] {
        assert!(e.to_string().contains("sequence number 1"), "{e}");
    }
}

#[test]
fn wrong_run_token_is_refused() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(30)));
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let opts = GroupOptions {
                    token: Some(RunToken::generate().unwrap()), // a different token on each rank
                    timeout: Duration::from_secs(2),
                    ..GroupOptions::default()
                };
                ProcessGroup::from_store(store, rank, 2, opts).unwrap_err()
            })
        })
        .collect();
    let errs: Vec<DdpError> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(matches!(errs[1], DdpError::TokenRejected { .. }), "{}", errs[1]);
    assert!(errs[1].to_string().contains("rank 0"), "{}", errs[1]);
    // Rank 0 never got a trustworthy rank 1.
    assert!(errs[0].to_string().contains("did not connect"), "{}", errs[0]);
}

fn run_ranks_with_timeout<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(30)));
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, f) = (store.clone(), f.clone());
            std::thread::spawn(move || {
                let opts = GroupOptions { timeout, ..GroupOptions::default() };
                f(ProcessGroup::from_store(store, rank, world, opts).unwrap())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// The CPU backend's peer handshake proves the run token without sending it: a listener on a peer's published
/// address (here a fake "rank 0") records everything rank 1 sends, and neither the token's bytes nor its hex are
/// in it. Rank 1 then fails instead of trusting the fake peer.
#[test]
fn mesh_handshake_never_sends_the_run_token() {
    use std::io::Read;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(30)));
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = fake.local_addr().unwrap().to_string();
    // Where a world-2 group formed on this store publishes rank 0's backend address.
    store.set("ddp/attempt0/world0/backend/addr/0", addr.as_bytes()).unwrap();
    let token = RunToken::generate().unwrap();
    let rank1 = std::thread::spawn(move || {
        let opts = GroupOptions { token: Some(token), timeout: Duration::from_secs(3), ..GroupOptions::default() };
        ProcessGroup::from_store(store, 1, 2, opts).unwrap_err()
    });
    let (mut conn, _) = fake.accept().unwrap();
    conn.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while let Ok(n) = conn.read(&mut buf) {
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
    }
    drop(conn);
    let err = rank1.join().unwrap();
    assert!(seen.len() >= 30, "the fake peer got a hello ({} bytes)", seen.len());
    assert!(!seen.windows(16).any(|w| w == token.as_bytes()), "the token's bytes went on the wire");
    let hex = token.to_hex();
    assert!(!String::from_utf8_lossy(&seen).to_lowercase().contains(&hex), "the token's hex went on the wire");
    assert!(!err.to_string().is_empty());
}
