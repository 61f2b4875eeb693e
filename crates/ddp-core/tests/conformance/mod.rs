//! The collective conformance suite shared by every backend: a function of a [`ProcessGroup`], so the same
//! checks run on the CPU backend (threads over a MemoryStore, `tests/conformance_cpu.rs`), on MPI under
//! `mpirun -np 2/3/4` (`tests/conformance_mpi.rs`), and on NCCL on a GPU machine (the `gpu_check` binary of
//! accel-examples includes this file with `#[path]`).
//!
//! Every rank of the group calls [`run`] with the same options. Inputs are small integers, exact in every
//! dtype, so results must match the single-process reference bit for bit whatever order a backend reduces in;
//! the one exception is `Avg` on floating types, where NCCL pre-multiplies by 1/P (`ncclAvg`) and the result is
//! compared with a relative tolerance (1e-6 f32/f64, 1e-2 f16/bf16). Failures are collected, not panicked, so a
//! caller can print a table (the GPU check) or assert (tests).
#![allow(dead_code)]

use ddp_core::{DType, Element, ProcessGroup, ReduceOp};
use half::{bf16, f16};

/// Every reduction operator.
pub const OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product];

/// What to run.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    /// Buffer sizes in elements for every dtype × op (0, 1, odd, non-divisible by the world size...).
    pub sizes: Vec<usize>,
    /// A larger size (elements) run for f32 and bf16 `Sum`/`Avg` all_reduce only; 0 to skip.
    pub large: usize,
    /// Point-to-point send/recv (a ring); needs world size ≥ 2.
    pub p2p: bool,
    /// Sub-groups (`new_group` of the even ranks, `split` by rank parity); needs world size ≥ 2.
    pub subgroups: bool,
}

impl Default for SuiteOptions {
    fn default() -> Self {
        SuiteOptions { sizes: vec![0, 1, 7, 1001], large: 3 * (1 << 20) / 4 + 3, p2p: true, subgroups: true }
    }
}

/// What happened: how many cases passed and a line per failed case.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    /// Cases that matched the reference.
    pub passed: usize,
    /// `case: what differed` for every failed case (errors included).
    pub failed: Vec<String>,
}

impl Outcome {
    fn record(&mut self, case: String, result: Result<(), String>) {
        match result {
            Ok(()) => self.passed += 1,
            Err(e) => self.failed.push(format!("{case}: {e}")),
        }
    }

    /// `N passed, M failed` (the plain closing line test runners read).
    pub fn summary(&self) -> String {
        format!("{} passed, {} failed", self.passed, self.failed.len())
    }

    /// Adds another outcome's counts.
    pub fn merge(&mut self, other: Outcome) {
        self.passed += other.passed;
        self.failed.extend(other.failed);
    }
}

/// Small integers as any element type.
pub trait Small: Element + PartialEq {
    /// `v` in this type (`v` is a small integer, exact everywhere it is used).
    fn small(v: i64) -> Self;
    /// As f64, for tolerant comparisons.
    fn to_f64(self) -> f64;
}

macro_rules! small_int {
    ($t:ty) => {
        impl Small for $t {
            fn small(v: i64) -> Self {
                v as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}
small_int!(i32);
small_int!(i64);
small_int!(u8);
impl Small for f32 {
    fn small(v: i64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}
impl Small for f64 {
    fn small(v: i64) -> Self {
        v as f64
    }
    fn to_f64(self) -> f64 {
        self
    }
}
impl Small for f16 {
    fn small(v: i64) -> Self {
        f16::from_f64(v as f64)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
}
impl Small for bf16 {
    fn small(v: i64) -> Self {
        bf16::from_f64(v as f64)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
}

/// Rank `rank`'s input for `op`: values whose reduction over ≤ 8 ranks is exact in every dtype
/// (sums ≤ 8·9, products of 1s and 2s ≤ 2^8, signed values only for signed types).
pub fn input<T: Small>(rank: usize, n: usize, op: ReduceOp, salt: usize) -> Vec<T> {
    let signed = !matches!(T::DTYPE, DType::U8);
    (0..n)
        .map(|i| {
            let k = (i * 7 + rank * 3 + salt * 5) as i64;
            let v = match op {
                ReduceOp::Product => 1 + (k % 2),
                ReduceOp::Max | ReduceOp::Min if signed => k % 11 - 5,
                _ => k % 9,
            };
            T::small(v)
        })
        .collect()
}

/// The single-process reference: rank 0's input combined with ranks 1.. in order, then the `Avg` division.
pub fn reference<T: Small>(world: usize, n: usize, op: ReduceOp, salt: usize) -> Vec<T> {
    let mut acc = input::<T>(0, n, op, salt);
    for r in 1..world {
        T::combine(&mut acc, &input::<T>(r, n, op, salt), op.combining());
    }
    if op == ReduceOp::Avg {
        T::divide(&mut acc, world);
    }
    acc
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 | DType::BF16 => 1e-2,
        _ => 1e-6,
    }
}

/// Exact comparison (bitwise via PartialEq on exact values), or tolerant for float `Avg`.
pub fn compare<T: Small>(got: &[T], want: &[T], op: ReduceOp) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("length {} != {}", got.len(), want.len()));
    }
    let float = matches!(T::DTYPE, DType::F32 | DType::F64 | DType::F16 | DType::BF16);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if float && op == ReduceOp::Avg {
            let (g, w) = (g.to_f64(), w.to_f64());
            (g - w).abs() <= tolerance(T::DTYPE) * w.abs().max(1.0)
        } else {
            g == w
        };
        if !ok {
            return Err(format!("element {i}: got {g:?}, expected {w:?}"));
        }
    }
    Ok(())
}

fn check_reductions<T: Small>(pg: &ProcessGroup, opts: &SuiteOptions, out: &mut Outcome) {
    let (rank, world) = (pg.rank(), pg.world_size());
    for op in OPS {
        for &n in &opts.sizes {
            let case = format!("all_reduce/{:?}/{op:?}/n={n}", T::DTYPE);
            let mut v = input::<T>(rank, n, op, 0);
            let r = pg.all_reduce(&mut v, op).map_err(|e| e.to_string());
            out.record(case, r.and_then(|_| compare(&v, &reference::<T>(world, n, op, 0), op)));

            // reduce_scatter: input of world·n elements, block r of the reduction lands on rank r.
            let case = format!("reduce_scatter/{:?}/{op:?}/n={n}", T::DTYPE);
            let input_all = input::<T>(rank, world * n, op, 1);
            let mut got = vec![T::small(0); n];
            let r = pg.reduce_scatter(&input_all, &mut got, op).map_err(|e| e.to_string());
            let want = reference::<T>(world, world * n, op, 1);
            out.record(case, r.and_then(|_| compare(&got, &want[rank * n..(rank + 1) * n], op)));
        }
    }
}

fn check_movement<T: Small>(pg: &ProcessGroup, opts: &SuiteOptions, out: &mut Outcome) {
    let (rank, world) = (pg.rank(), pg.world_size());
    for &n in &opts.sizes {
        for root in 0..world {
            let case = format!("broadcast/{:?}/root={root}/n={n}", T::DTYPE);
            let mut v = input::<T>(rank, n, ReduceOp::Sum, 2);
            let r = pg.broadcast(&mut v, root).map_err(|e| e.to_string());
            out.record(case, r.and_then(|_| compare(&v, &input::<T>(root, n, ReduceOp::Sum, 2), ReduceOp::Sum)));
        }
        let case = format!("all_gather/{:?}/n={n}", T::DTYPE);
        let mine = input::<T>(rank, n, ReduceOp::Sum, 3);
        let mut all = vec![T::small(0); world * n];
        let r = pg.all_gather(&mine, &mut all).map_err(|e| e.to_string());
        let want: Vec<T> = (0..world).flat_map(|r| input::<T>(r, n, ReduceOp::Sum, 3)).collect();
        out.record(case, r.and_then(|_| compare(&all, &want, ReduceOp::Sum)));
    }
}

/// Ring send/recv: even ranks send first, odd ranks receive first (no deadlock with rendezvous sends).
fn check_p2p<T: Small>(pg: &ProcessGroup, n: usize, out: &mut Outcome) {
    let (rank, world) = (pg.rank(), pg.world_size());
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let case = format!("send_recv_ring/{:?}/n={n}", T::DTYPE);
    let mine = input::<T>(rank, n, ReduceOp::Sum, 4);
    let mut got = vec![T::small(0); n];
    let r = if rank % 2 == 0 {
        pg.send(&mine, next).and_then(|_| pg.recv(&mut got, prev))
    } else {
        pg.recv(&mut got, prev).and_then(|_| pg.send(&mine, next))
    };
    let r = r.map_err(|e| e.to_string());
    out.record(case, r.and_then(|_| compare(&got, &input::<T>(prev, n, ReduceOp::Sum, 4), ReduceOp::Sum)));
}

fn check_subgroups(pg: &ProcessGroup, out: &mut Outcome) {
    let (rank, world) = (pg.rank(), pg.world_size());
    // new_group of the even ranks: members all_reduce their global ranks.
    let evens: Vec<usize> = (0..world).step_by(2).collect();
    match pg.new_group(&evens) {
        Ok(Some(sub)) => {
            let mut v = [rank as i64, 1];
            let r = sub.all_reduce(&mut v, ReduceOp::Sum).map_err(|e| e.to_string());
            let want = [evens.iter().sum::<usize>() as i64, evens.len() as i64];
            let ok = r.and_then(|_| {
                if sub.rank() != rank / 2 || sub.world_size() != evens.len() {
                    Err(format!("sub-group rank {} of {}", sub.rank(), sub.world_size()))
                } else {
                    compare(&v, &want, ReduceOp::Sum)
                }
            });
            out.record("new_group(evens)/all_reduce".into(), ok);
        }
        Ok(None) if rank % 2 == 1 => out.record("new_group(evens)/non-member".into(), Ok(())),
        Ok(None) => out.record("new_group(evens)".into(), Err("a member got no group".into())),
        Err(e) => out.record("new_group(evens)".into(), Err(e.to_string())),
    }
    // split by parity, keyed by descending rank: sub-group ranks run backwards.
    match pg.split(Some((rank % 2) as u32), world - rank) {
        Ok(Some(sub)) => {
            let same: Vec<usize> = (0..world).filter(|r| r % 2 == rank % 2).collect();
            let mut v = [rank as f32];
            let r = sub.all_reduce(&mut v, ReduceOp::Max).map_err(|e| e.to_string());
            let want_rank = same.iter().rev().position(|&r| r == rank).unwrap();
            let ok = r.and_then(|_| {
                if sub.rank() != want_rank {
                    Err(format!("split rank {} expected {want_rank}", sub.rank()))
                } else {
                    compare(&v, &[*same.last().unwrap() as f32], ReduceOp::Max)
                }
            });
            out.record("split(parity)/all_reduce".into(), ok);
            let mut b = [rank as i32 * 10];
            let r = sub.broadcast(&mut b, 0).map_err(|e| e.to_string());
            let ok = r.and_then(|_| compare(&b, &[*same.last().unwrap() as i32 * 10], ReduceOp::Sum));
            out.record("split(parity)/broadcast".into(), ok);
        }
        Ok(None) => out.record("split(parity)".into(), Err("no group for a coloured rank".into())),
        Err(e) => out.record("split(parity)".into(), Err(e.to_string())),
    }
}

/// Runs the whole suite on `pg`. Every rank calls it with the same options.
pub fn run(pg: &ProcessGroup, opts: &SuiteOptions) -> Outcome {
    let mut out = Outcome::default();
    check_reductions::<f32>(pg, opts, &mut out);
    check_reductions::<f64>(pg, opts, &mut out);
    check_reductions::<f16>(pg, opts, &mut out);
    check_reductions::<bf16>(pg, opts, &mut out);
    check_reductions::<i32>(pg, opts, &mut out);
    check_reductions::<i64>(pg, opts, &mut out);
    check_reductions::<u8>(pg, opts, &mut out);
    check_movement::<f32>(pg, opts, &mut out);
    check_movement::<bf16>(pg, opts, &mut out);
    check_movement::<i64>(pg, opts, &mut out);
    check_movement::<u8>(pg, opts, &mut out);
    if opts.large > 0 {
        let n = opts.large;
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let mut v = input::<f32>(pg.rank(), n, op, 0);
            let r = pg.all_reduce(&mut v, op).map_err(|e| e.to_string());
            let want = reference::<f32>(pg.world_size(), n, op, 0);
            out.record(format!("all_reduce/F32/{op:?}/n={n}"), r.and_then(|_| compare(&v, &want, op)));
            let mut v = input::<bf16>(pg.rank(), n, op, 0);
            let r = pg.all_reduce(&mut v, op).map_err(|e| e.to_string());
            let want = reference::<bf16>(pg.world_size(), n, op, 0);
            out.record(format!("all_reduce/BF16/{op:?}/n={n}"), r.and_then(|_| compare(&v, &want, op)));
        }
    }
    if pg.world_size() >= 2 && opts.p2p {
        for &n in &opts.sizes {
            check_p2p::<f32>(pg, n, &mut out);
            check_p2p::<u8>(pg, n, &mut out);
        }
        if opts.large > 0 {
            check_p2p::<f32>(pg, opts.large, &mut out);
        }
    }
    for i in 0..3 {
        out.record(format!("barrier/{i}"), pg.barrier().map_err(|e| e.to_string()));
    }
    if pg.world_size() >= 2 && opts.subgroups {
        check_subgroups(pg, &mut out);
    }
    out
}
