//! Helpers shared by the collective tests: ranks as threads over a MemoryStore, deterministic inputs, and
//! single-process references built from the same element kernels (`Element::combine` / `divide`).
#![allow(dead_code)]

use ddp_core::cpu::CpuTuning;
use ddp_core::store::MemoryStore;
use ddp_core::{Element, GroupOptions, ProcessGroup, ReduceOp, Store};
use std::sync::Arc;
use std::time::Duration;

/// Tuning that makes small buffers take the TCP segmented ring with many segments: 256-byte segments, direct
/// exchange only up to 64 bytes, chain broadcast from 512 bytes, no shared memory.
pub fn tiny_segments() -> CpuTuning {
    CpuTuning {
        segment_bytes: 256,
        small_all_reduce_bytes: 64,
        chain_broadcast_bytes: 512,
        socket_buffer_bytes: None,
        shared_memory: false,
        ..CpuTuning::default()
    }
}

/// Tuning that sends every all_reduce above 64 bytes through shared memory in 4 KiB blocks (many blocks,
/// both halves of the double buffer).
pub fn tiny_shm_blocks() -> CpuTuning {
    CpuTuning {
        small_all_reduce_bytes: 64,
        shared_memory: true,
        shm_min_bytes: 64,
        shm_block_bytes: 4096,
        ..CpuTuning::default()
    }
}

/// Tuning for the shared-memory slot exchange with 64-byte slots: all_reduce up to 64 bytes takes the slot path,
/// up to 256 bytes the TCP direct exchange, up to 1 KiB the TCP ring and above it the pipelined shared-memory
/// all_reduce (each after an empty exchange round); broadcast / all_gather / reduce_scatter run in many rounds
/// (both slots of the double buffer).
pub fn tiny_shm_slots() -> CpuTuning {
    CpuTuning {
        segment_bytes: 256,
        small_all_reduce_bytes: 256,
        shared_memory: true,
        shm_min_bytes: 1024,
        shm_block_bytes: 4096,
        shm_slot_bytes: 64,
        ..CpuTuning::default()
    }
}

/// Runs `f(pg)` on `world` threads, each a rank of a group over one MemoryStore; returns results by rank.
pub fn run_ranks<T: Send + 'static>(
    world: usize,
    tuning: Option<CpuTuning>,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let store = store.clone();
            let f = f.clone();
            std::thread::Builder::new()
                .name(format!("rank{rank}"))
                .spawn(move || {
                    let opts = GroupOptions {
                        timeout: Duration::from_secs(60),
                        cpu_tuning: tuning,
                        ..GroupOptions::default()
                    };
                    let pg = ProcessGroup::from_store(store, rank, world, opts).expect("group formation");
                    f(pg)
                })
                .expect("spawn rank thread")
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
}

/// A value exactly representable in every dtype (including bf16's 8-bit mantissa) for which sums over ≤ 4
/// ranks and products stay exact: integers in -3..=3 (0..=3 for u8).
pub fn small_int(rank: usize, i: usize, unsigned: bool) -> i64 {
    let h = (rank as u64 * 0x9E37_79B9 + i as u64 * 0x85EB_CA6B).wrapping_mul(0xC2B2_AE35) >> 13;
    if unsigned {
        (h % 4) as i64
    } else {
        (h % 7) as i64 - 3
    }
}

/// Converts an exact small integer into an element type.
pub trait FromSmall: Element {
    fn from_small(v: i64) -> Self;
    const UNSIGNED: bool = false;
}
impl FromSmall for f32 {
    fn from_small(v: i64) -> Self {
        v as f32
    }
}
impl FromSmall for f64 {
    fn from_small(v: i64) -> Self {
        v as f64
    }
}
impl FromSmall for half::f16 {
    fn from_small(v: i64) -> Self {
        half::f16::from_f32(v as f32)
    }
}
impl FromSmall for half::bf16 {
    fn from_small(v: i64) -> Self {
        half::bf16::from_f32(v as f32)
    }
}
impl FromSmall for i32 {
    fn from_small(v: i64) -> Self {
        v as i32
    }
}
impl FromSmall for i64 {
    fn from_small(v: i64) -> Self {
        v
    }
}
impl FromSmall for u8 {
    fn from_small(v: i64) -> Self {
        v as u8
    }
    const UNSIGNED: bool = true;
}

/// Rank `rank`'s input of `n` elements.
pub fn input<T: FromSmall>(rank: usize, n: usize) -> Vec<T> {
    (0..n).map(|i| T::from_small(small_int(rank, i, T::UNSIGNED))).collect()
}

/// Single-process reference of all_reduce over `world` ranks' inputs.
pub fn reference<T: FromSmall>(world: usize, n: usize, op: ReduceOp) -> Vec<T> {
    let mut acc = input::<T>(0, n);
    for r in 1..world {
        T::combine(&mut acc, &input::<T>(r, n), op.combining());
    }
    if op == ReduceOp::Avg {
        T::divide(&mut acc, world);
    }
    acc
}

/// Bitwise view for exact comparisons (NaN-safe, distinguishes -0.0).
pub fn bits<T: Element>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

pub const OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product];

/// Real worker processes: the test binary re-executes itself running one `#[test]` in worker mode.
pub mod procs {
    use ddp_core::{RunToken, TcpStoreServer, RUN_TOKEN_ENV};
    use std::process::{Child, Command, Stdio};

    /// Environment variable selecting the worker scenario of a re-executed test binary.
    pub const SCENARIO_ENV: &str = "DDP_TEST_SCENARIO";

    /// The scenario this process should run as a worker, if it is one.
    pub fn scenario() -> Option<String> {
        std::env::var(SCENARIO_ENV).ok()
    }

    /// A job: the store hosted here (as the launcher does) and `world` workers running `test_name` with
    /// torchrun's variables set.
    pub struct Job {
        pub server: TcpStoreServer,
        pub children: Vec<Child>,
    }

    pub fn spawn(test_name: &str, scenario: &str, world: usize, extra_env: &[(&str, String)]) -> Job {
        spawn_with(test_name, scenario, world, extra_env, false)
    }

    /// Like [`spawn`]; with `rank0_hosts_store` no store is hosted here and rank 0 binds MASTER_PORT itself (as
    /// without a launcher). The returned job's `server` is then an unused placeholder.
    pub fn spawn_with(
        test_name: &str,
        scenario: &str,
        world: usize,
        extra_env: &[(&str, String)],
        rank0_hosts_store: bool,
    ) -> Job {
        let token = RunToken::generate().unwrap();
        let server = TcpStoreServer::bind("127.0.0.1:0", token).unwrap();
        let port = if rank0_hosts_store {
            // A free port for rank 0 to bind (taken from the OS, then released).
            std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
        } else {
            server.port()
        };
        let exe = std::env::current_exe().unwrap();
        let children = (0..world)
            .map(|rank| {
                let mut cmd = Command::new(&exe);
                cmd.args(["--exact", test_name, "--nocapture", "--test-threads=1"])
                    .env(SCENARIO_ENV, scenario)
                    .env("RANK", rank.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("WORLD_SIZE", world.to_string())
                    .env("LOCAL_WORLD_SIZE", world.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .env("ACCEL_USE_AGENT_STORE", if rank0_hosts_store { "0" } else { "1" })
                    .env(RUN_TOKEN_ENV, token.to_hex())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                for (k, v) in extra_env {
                    cmd.env(k, v);
                }
                cmd.spawn().unwrap()
            })
            .collect();
        Job { server, children }
    }

    /// Waits for every worker; returns (exit code, stdout, stderr) by rank. Panics after `limit`.
    pub fn wait_all(job: Job, limit: std::time::Duration) -> Vec<(Option<i32>, String, String)> {
        let start = std::time::Instant::now();
        let mut out = Vec::new();
        for (rank, mut c) in job.children.into_iter().enumerate() {
            loop {
                if c.try_wait().unwrap().is_some() {
                    break;
                }
                if start.elapsed() > limit {
                    let _ = c.kill();
                    panic!("worker rank {rank} still running after {limit:?}");
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let o = c.wait_with_output().unwrap();
            out.push((
                o.status.code(),
                String::from_utf8_lossy(&o.stdout).into_owned(),
                String::from_utf8_lossy(&o.stderr).into_owned(),
            ));
        }
        drop(job.server);
        out
    }
}

/// A deterministic f32 CPU tensor: `scale · sin(seed + 0.37·i)` in `shape`.
pub fn wave(seed: f32, shape: &[usize], scale: f32) -> candle_core::Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| scale * (seed + 0.37 * i as f32).sin()).collect();
    candle_core::Tensor::from_vec(v, shape, &candle_core::Device::Cpu).unwrap()
}
