//! Every collective of the CPU backend × dtype × op against a single-process reference, world sizes 1–4,
//! sizes 0, 1, odd, non-divisible by the world size, and larger than several segments; ranks are threads over a
//! MemoryStore (the multi-process TCP variant is in `multiprocess.rs`).
//!
//! Inputs are small integers, exact in every dtype, so the reference must match bit for bit whatever order the
//! backend reduces in; `random_floats_are_bit_identical_across_ranks` covers inexact data.

use crate::common::*;
use ddp_core::{DType, DdpError, ProcessGroup, ReduceOp};

/// Sizes in elements: empty, one, odd, not divisible by 2/3/4, and (with 256-byte segments) many segments.
const SIZES: [usize; 5] = [0, 1, 7, 1001, 3 * 1024 + 5];

fn check_all_reduce<T: FromSmall>(pg: &ProcessGroup) {
    let world = pg.world_size();
    for op in OPS {
        for n in SIZES {
            let mut v = input::<T>(pg.rank(), n);
            pg.all_reduce(&mut v, op).unwrap();
            assert_eq!(
                bits(&v),
                bits(&reference::<T>(world, n, op)),
                "all_reduce {:?} {op:?} n={n} world={world} rank={}",
                T::DTYPE,
                pg.rank()
            );
        }
    }
}

fn all_dtypes_all_reduce(pg: &ProcessGroup) {
    check_all_reduce::<f32>(pg);
    check_all_reduce::<f64>(pg);
    check_all_reduce::<half::f16>(pg);
    check_all_reduce::<half::bf16>(pg);
    check_all_reduce::<i32>(pg);
    check_all_reduce::<i64>(pg);
    check_all_reduce::<u8>(pg);
}

#[test]
fn all_reduce_every_dtype_op_size_and_world_size() {
    for world in 1..=4 {
        // Tiny segments: every TCP path (direct exchange, ring with one and many segments) at small sizes.
        run_ranks(world, Some(tiny_segments()), |pg| all_dtypes_all_reduce(&pg));
        // Shared memory in 4 KiB blocks: one and many blocks, both halves of the double buffer.
        run_ranks(world, Some(tiny_shm_blocks()), |pg| all_dtypes_all_reduce(&pg));
        // Shared-memory slots of 64 bytes: the slot path, its fall-back to the TCP paths and the pipelined path.
        run_ranks(world, Some(tiny_shm_slots()), |pg| all_dtypes_all_reduce(&pg));
        // Default tuning: sizes up to 12 KiB take the shared-memory slot path (P > 1).
        run_ranks(world, None, |pg| check_all_reduce::<f32>(&pg));
    }
}

fn uses_shared_memory(pg: &ProcessGroup) -> bool {
    let any = pg.backend().as_any().expect("the CPU backend exposes itself");
    any.downcast_ref::<ddp_core::cpu::CpuBackend>().expect("a CPU backend").uses_shared_memory()
}

#[test]
fn shared_memory_is_used_on_one_machine_and_can_be_disabled() {
    assert_eq!(run_ranks(3, Some(tiny_shm_blocks()), |pg| uses_shared_memory(&pg)), vec![true; 3]);
    assert_eq!(run_ranks(2, Some(tiny_segments()), |pg| uses_shared_memory(&pg)), vec![false; 2]);
    assert_eq!(run_ranks(4, None, |pg| uses_shared_memory(&pg)), vec![true; 4]);
}

#[test]
fn mismatched_sizes_on_the_shared_memory_path_fail_on_every_rank() {
    let errs = run_ranks(2, Some(tiny_shm_blocks()), |pg| {
        let mut v = vec![1.0f64; if pg.rank() == 0 { 1000 } else { 1500 }];
        pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err().to_string()
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(e.contains("all_reduce") && e.contains("sequence number 1"), "rank {rank}: {e}");
        assert!(e.contains("8000 bytes") && e.contains("12000 bytes"), "rank {rank}: {e}");
    }
}

#[test]
fn all_reduce_larger_than_several_default_segments() {
    // 3 MiB of f32 and of bf16 with the default 1 MiB segments: ring with several segments per chunk.
    for world in [2, 3] {
        run_ranks(world, None, |pg| {
            let n = 3 * (1 << 20) / 4 + 3;
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let mut v = input::<f32>(pg.rank(), n);
                pg.all_reduce(&mut v, op).unwrap();
                assert!(bits(&v) == bits(&reference::<f32>(pg.world_size(), n, op)), "f32 {op:?}");
            }
            let n = 3 * (1 << 20) / 2 + 1;
            let mut v = input::<half::bf16>(pg.rank(), n);
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert!(bits(&v) == bits(&reference::<half::bf16>(pg.world_size(), n, ReduceOp::Sum)), "bf16");
        });
    }
}

#[test]
fn two_rank_example_from_the_docs() {
    let out = run_ranks(2, None, |pg| {
        let mine = if pg.rank() == 0 { [1.0f32, 2.0] } else { [3.0, 4.0] };
        OPS.map(|op| {
            let mut v = mine;
            pg.all_reduce(&mut v, op).unwrap();
            v
        })
    });
    for r in out {
        assert_eq!(r, [[4.0, 6.0], [2.0, 3.0], [3.0, 4.0], [1.0, 2.0], [3.0, 8.0]]);
    }
}

#[test]
fn random_floats_are_bit_identical_across_ranks() {
    use rand::{Rng, SeedableRng};
    // Default tuning: 5 and 3000 elements take the shared-memory slot path, 300 001 the pipelined one.
    let cases = [(2, None), (3, Some(tiny_segments())), (3, Some(tiny_shm_slots())), (4, None)];
    for (world, tuning) in cases {
        let out = run_ranks(world, tuning, |pg| {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(pg.rank() as u64);
            let mut results = Vec::new();
            for n in [5usize, 3000, 300_001] {
                let v0: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
                let mut v = v0.clone();
                pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                results.push((v0, v));
            }
            results
        });
        for (i, (_, result0)) in out[0].iter().enumerate() {
            // Close to the sum in f64 …
            for (j, got) in result0.iter().enumerate() {
                let want: f64 = out.iter().map(|r| r[i].0[j] as f64).sum();
                assert!((*got as f64 - want).abs() < 1e-5, "world {world} n#{i} [{j}]: {got} vs {want}");
            }
            // … and the same bits on every rank.
            for r in &out[1..] {
                assert!(bits(&r[i].1) == bits(result0), "world {world}: ranks disagree on n#{i}");
            }
        }
    }
}

fn check_reduce_scatter<T: FromSmall>(pg: &ProcessGroup) {
    let (world, rank) = (pg.world_size(), pg.rank());
    for op in OPS {
        for n in [0usize, 1, 7, 300] {
            let inp = input::<T>(rank, n * world);
            let mut out = vec![T::zeroed(); n];
            pg.reduce_scatter(&inp, &mut out, op).unwrap();
            let full = reference::<T>(world, n * world, op);
            assert_eq!(bits(&out), bits(&full[rank * n..(rank + 1) * n]), "reduce_scatter {:?} {op:?} n={n}", T::DTYPE);
        }
    }
}

#[test]
fn reduce_scatter_every_dtype_and_op() {
    // TCP ring; shared-memory slot exchange in many rounds (64-byte slots) and in one round (default tuning).
    for (world, tuning) in (1..=4).flat_map(|w| [(w, Some(tiny_segments())), (w, Some(tiny_shm_slots())), (w, None)]) {
        run_ranks(world, tuning, |pg| {
            check_reduce_scatter::<f32>(&pg);
            check_reduce_scatter::<f64>(&pg);
            check_reduce_scatter::<half::f16>(&pg);
            check_reduce_scatter::<half::bf16>(&pg);
            check_reduce_scatter::<i32>(&pg);
            check_reduce_scatter::<i64>(&pg);
            check_reduce_scatter::<u8>(&pg);
        });
    }
}

fn check_all_gather<T: FromSmall>(pg: &ProcessGroup) {
    let world = pg.world_size();
    for n in [0usize, 1, 7, 1001] {
        let mut out = vec![T::zeroed(); n * world];
        pg.all_gather(&input::<T>(pg.rank(), n), &mut out).unwrap();
        let want: Vec<T> = (0..world).flat_map(|r| input::<T>(r, n)).collect();
        assert_eq!(bits(&out), bits(&want), "all_gather {:?} n={n}", T::DTYPE);
    }
}

fn check_broadcast<T: FromSmall>(pg: &ProcessGroup) {
    for root in 0..pg.world_size() {
        for n in [0usize, 1, 7, 1001] {
            let mut v = input::<T>(pg.rank(), n);
            pg.broadcast(&mut v, root).unwrap();
            assert_eq!(bits(&v), bits(&input::<T>(root, n)), "broadcast {:?} root={root} n={n}", T::DTYPE);
        }
    }
}

#[test]
fn all_gather_and_broadcast_every_dtype() {
    for world in 1..=4 {
        for tuning in [Some(tiny_segments()), Some(tiny_shm_slots()), None] {
            run_ranks(world, tuning, |pg| {
                check_all_gather::<f32>(&pg);
                check_all_gather::<f64>(&pg);
                check_all_gather::<half::f16>(&pg);
                check_all_gather::<half::bf16>(&pg);
                check_all_gather::<i32>(&pg);
                check_all_gather::<i64>(&pg);
                check_all_gather::<u8>(&pg);
                check_broadcast::<f32>(&pg);
                check_broadcast::<f64>(&pg);
                check_broadcast::<half::f16>(&pg);
                check_broadcast::<half::bf16>(&pg);
                check_broadcast::<i32>(&pg);
                check_broadcast::<i64>(&pg);
                check_broadcast::<u8>(&pg);
            });
        }
    }
}

#[test]
fn send_recv_ring_and_barrier() {
    for (world, tuning) in (2..=4).flat_map(|w| [(w, Some(tiny_segments())), (w, None)]) {
        run_ranks(world, tuning, |pg| {
            let (p, r) = (pg.world_size(), pg.rank());
            for n in [0usize, 1, 1001] {
                // Even ranks send first, odd ranks receive first: no two ranks block on each other's send.
                let mine = input::<i64>(r, n);
                let mut got = vec![0i64; n];
                let (right, left) = ((r + 1) % p, (r + p - 1) % p);
                if r % 2 == 0 {
                    pg.send(&mine, right).unwrap();
                    pg.recv(&mut got, left).unwrap();
                } else {
                    pg.recv(&mut got, left).unwrap();
                    pg.send(&mine, right).unwrap();
                }
                assert_eq!(got, input::<i64>(left, n));
                pg.barrier().unwrap();
            }
        });
    }
}

#[test]
fn self_send_and_bad_lengths_are_invalid_arguments() {
    run_ranks(2, None, |pg| {
        let err = pg.send(&[1.0f32], pg.rank()).unwrap_err();
        assert!(matches!(err, DdpError::InvalidArgument(_)), "{err}");
        let mut out = vec![0.0f32; 3];
        let err = pg.all_gather(&[1.0f32, 2.0], &mut out).unwrap_err();
        assert!(err.to_string().contains("expected world_size (2)"), "{err}");
        let err = pg.broadcast(&mut out, 5).unwrap_err();
        assert!(err.to_string().contains("root 5"), "{err}");
        // Byte-level all_reduce with a partial element.
        let err = pg.all_reduce_bytes(&mut [0u8; 6], DType::F32, ReduceOp::Sum).unwrap_err();
        assert!(err.to_string().contains("not a whole number"), "{err}");
    });
}

#[test]
fn mismatched_sizes_fail_on_every_rank_naming_both_calls() {
    let errs = run_ranks(2, None, |pg| {
        let mut v = vec![1.0f32; if pg.rank() == 0 { 10 } else { 12 }];
        let first = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err().to_string();
        // The group is aborted: later calls fail at once with the same cause.
        let later = pg.barrier().unwrap_err().to_string();
        (first, later)
    });
    for (rank, (first, later)) in errs.iter().enumerate() {
        assert!(first.contains("all_reduce") && first.contains("sequence number 1"), "rank {rank}: {first}");
        assert!(first.contains("40 bytes") && first.contains("48 bytes"), "rank {rank}: {first}");
        assert!(later.contains("barrier") && later.contains("aborted"), "rank {rank}: {later}");
    }
}

#[test]
fn mismatched_collectives_fail_naming_both_ops() {
    let errs = run_ranks(3, None, |pg| {
        let mut v = vec![1i64; 4];
        if pg.rank() == 1 {
            pg.broadcast(&mut v, 0).unwrap_err().to_string()
        } else {
            pg.all_reduce(&mut v, ReduceOp::Max).unwrap_err().to_string()
        }
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(e.contains("failed on rank"), "rank {rank}: {e}");
    }
    // The rank that saw the other's frame names both collectives.
    assert!(errs.iter().any(|e| e.contains("broadcast") && e.contains("all_reduce")), "{errs:?}");
}

#[test]
fn sequence_numbers_count_collectives() {
    let errs = run_ranks(2, None, |pg| {
        pg.barrier().unwrap();
        let mut v = [0u8; 3];
        pg.broadcast(&mut v, 0).unwrap();
        // Third collective: rank 0 barrier, rank 1 all_reduce.
        if pg.rank() == 0 {
            pg.barrier().unwrap_err().to_string()
        } else {
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err().to_string()
        }
    });
    for e in &errs {
        assert!(e.contains("sequence number 3"), "{e}");
    }
}

#[test]
fn tensor_collectives() {
    use candle_core::{DType as C, Device, Tensor};
    run_ranks(3, None, |pg| {
        let (p, r) = (pg.world_size(), pg.rank() as f64);
        for dt in [C::F32, C::F64, C::F16, C::BF16, C::I64, C::U8, C::I32] {
            let t = (Tensor::ones((2, 3), dt, &Device::Cpu).unwrap() * (r + 1.0)).unwrap();
            let sum = pg.all_reduce_tensor(&t, ReduceOp::Sum).unwrap();
            assert_eq!(sum.dims(), &[2, 3]);
            assert_eq!(sum.dtype(), dt);
            let v: Vec<f64> = sum.to_dtype(C::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(v, vec![6.0; 6], "{dt:?}");

            let b = pg.broadcast_tensor(&t, 2).unwrap();
            let v: Vec<f64> = b.to_dtype(C::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(v, vec![3.0; 6], "{dt:?}");

            let g = pg.all_gather_tensor(&t).unwrap();
            assert_eq!(g.dims(), &[2 * p, 3]);
            let v: Vec<f64> = g.to_dtype(C::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let want: Vec<f64> = (0..p).flat_map(|q| vec![q as f64 + 1.0; 6]).collect();
            assert_eq!(v, want, "{dt:?}");

            let big = Tensor::arange(0u8, (3 * p) as u8, &Device::Cpu).unwrap().to_dtype(dt).unwrap();
            let big = big.reshape((3 * p, 1)).unwrap();
            let rs = pg.reduce_scatter_tensor(&big, ReduceOp::Max).unwrap();
            assert_eq!(rs.dims(), &[3, 1]);
            let v: Vec<f64> = rs.to_dtype(C::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let base = 3.0 * pg.rank() as f64;
            assert_eq!(v, vec![base, base + 1.0, base + 2.0], "{dt:?}");
        }
        // Scalars gather into a vector; non-divisible dim 0 and unsupported dtypes are clear errors.
        let s = Tensor::new(r as f32, &Device::Cpu).unwrap();
        assert_eq!(pg.all_gather_tensor(&s).unwrap().to_vec1::<f32>().unwrap(), vec![0.0, 1.0, 2.0]);
        let odd = Tensor::zeros((4, 2), C::F32, &Device::Cpu).unwrap();
        let e = pg.reduce_scatter_tensor(&odd, ReduceOp::Sum).unwrap_err().to_string();
        assert!(e.contains("not divisible by the world size 3"), "{e}");
        let nc = Tensor::zeros((2, 3), C::F32, &Device::Cpu).unwrap().t().unwrap();
        let out = pg.all_reduce_tensor(&nc, ReduceOp::Sum).unwrap();
        assert_eq!(out.dims(), &[3, 2]);
        pg.barrier().unwrap();
    });
}

#[test]
fn single_process_group_is_the_identity() {
    let pg = ProcessGroup::single_process().unwrap();
    assert_eq!((pg.rank(), pg.world_size(), pg.backend_name()), (0, 1, "cpu"));
    let mut v = [1.5f32, -2.0];
    for op in OPS {
        pg.all_reduce(&mut v, op).unwrap();
    }
    assert_eq!(v, [1.5, -2.0]);
    let mut out = [0.0f32; 2];
    pg.reduce_scatter(&v, &mut out, ReduceOp::Avg).unwrap();
    assert_eq!(out, v);
    pg.barrier().unwrap();
}

#[test]
fn multi_process_init_with_port_zero_is_a_clear_error() {
    let opts = ddp_core::InitOptions { world_size: 2, master_port: 0, ..ddp_core::InitOptions::single_process() };
    let err = ProcessGroup::init(opts).unwrap_err();
    assert!(matches!(&err, DdpError::Env { var, .. } if var == "MASTER_PORT"), "{err}");
}

#[cfg(not(feature = "nccl"))]
#[test]
fn backend_not_compiled_in_is_unavailable() {
    use ddp_core::{store::MemoryStore, BackendKind, GroupOptions, Store};
    let store: std::sync::Arc<dyn Store> = std::sync::Arc::new(MemoryStore::default());
    let opts = GroupOptions { backend: BackendKind::Nccl, ..GroupOptions::default() };
    let err = ProcessGroup::from_store(store, 0, 1, opts).unwrap_err();
    assert!(matches!(err, DdpError::BackendUnavailable { backend: "nccl", .. }), "{err}");
}

#[test]
fn traffic_counts_calls_and_payload_bytes_per_operation() {
    let stats = run_ranks(2, None, |pg| {
        let before = pg.traffic();
        let mut v = vec![1.0f32; 10];
        pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        let mut out = vec![0i64; 6];
        pg.all_gather(&[1i64, 2, 3], &mut out).unwrap();
        let mut b = [0u8; 5];
        pg.broadcast(&mut b, 0).unwrap();
        pg.traffic() - before
    });
    for s in stats {
        assert_eq!((s.all_reduce.calls, s.all_reduce.bytes), (2, 80));
        assert_eq!((s.all_gather.calls, s.all_gather.bytes), (1, 24));
        assert_eq!((s.broadcast.calls, s.broadcast.bytes), (1, 5));
        assert_eq!((s.send.calls, s.recv.calls, s.reduce_scatter.calls), (0, 0, 0));
        assert_eq!((s.total_calls(), s.total_bytes()), (4, 109));
    }
}

#[test]
fn mismatched_sizes_on_the_shared_memory_slot_path_fail_on_every_rank() {
    // Default tuning: both sizes take the slot exchange, which compares every rank's call identity.
    let errs = run_ranks(3, None, |pg| {
        let mut v = vec![1.0f32; if pg.rank() == 2 { 12 } else { 10 }];
        let first = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err().to_string();
        let later = pg.all_gather(&[1u8], &mut [0u8; 3]).unwrap_err().to_string();
        (first, later)
    });
    for (rank, (first, later)) in errs.iter().enumerate() {
        assert!(first.contains("all_reduce") && first.contains("sequence number 1"), "rank {rank}: {first}");
        assert!(later.contains("all_gather") && later.contains("aborted"), "rank {rank}: {later}");
    }
    assert!(errs.iter().any(|(e, _)| e.contains("40 bytes") && e.contains("48 bytes")), "{errs:?}");
}

#[test]
fn slot_path_and_tcp_path_sizes_mismatch_fails_instead_of_hanging() {
    // Rank 0's 64 bytes take the slot path, rank 1's 512 bytes the TCP ring: the empty exchange round before
    // the ring catches it on both ranks.
    let errs = run_ranks(2, Some(tiny_shm_slots()), |pg| {
        let mut v = vec![1u8; if pg.rank() == 0 { 64 } else { 512 }];
        pg.all_reduce(&mut v, ReduceOp::Max).unwrap_err().to_string()
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(e.contains("all_reduce") && e.contains("sequence number 1"), "rank {rank}: {e}");
    }
}

#[test]
fn mixed_collectives_on_shared_memory_reuse_slots_in_order() {
    // Many rounds back to back of every kind (both slot parities, rounds split across calls) at world 2–4.
    for world in 2..=4 {
        run_ranks(world, Some(tiny_shm_slots()), |pg| {
            let (p, r) = (pg.world_size(), pg.rank());
            for it in 0..50usize {
                let n = 1 + (it * 7) % 40;
                let mut v = input::<i64>(r + it, n);
                pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                let want: Vec<i64> = (0..n).map(|i| (0..p).map(|q| input::<i64>(q + it, n)[i]).sum()).collect();
                assert_eq!(v, want, "it {it}");
                let mut b = input::<f32>(r + it, n);
                pg.broadcast(&mut b, it % p).unwrap();
                assert_eq!(bits(&b), bits(&input::<f32>(it % p + it, n)));
                let mut g = vec![0u8; n * p];
                pg.all_gather(&input::<u8>(r, n), &mut g).unwrap();
                assert_eq!(g, (0..p).flat_map(|q| input::<u8>(q, n)).collect::<Vec<_>>());
                pg.barrier().unwrap();
            }
        });
    }
}

/// A buffer held in pieces of irregular lengths (1, 2, 3, … elements, cycling), as DDP's buckets are: records
/// every write so the test can check the backend's contract (each byte written once, in order).
struct Pieces {
    pieces: Vec<Vec<u8>>,
    writes: Vec<(usize, usize)>,
}

impl Pieces {
    fn new(bytes: &[u8], elem: usize) -> Self {
        let (mut pieces, mut at, mut k) = (Vec::new(), 0, 0);
        while at < bytes.len() {
            let n = ((k % 7 + 1) * elem).min(bytes.len() - at);
            pieces.push(bytes[at..at + n].to_vec());
            (at, k) = (at + n, k + 1);
        }
        Self { pieces, writes: Vec::new() }
    }
    fn starts(&self) -> Vec<usize> {
        self.pieces.iter().scan(0, |at, p| Some(std::mem::replace(at, *at + p.len()))).collect()
    }
    fn concat(&self) -> Vec<u8> {
        self.pieces.concat()
    }
}

impl ddp_core::PiecewiseBuffer for Pieces {
    fn len(&self) -> usize {
        self.pieces.iter().map(Vec::len).sum()
    }
    fn read(&self, range: std::ops::Range<usize>, f: &mut dyn FnMut(usize, &[u8])) {
        for (start, p) in self.starts().into_iter().zip(&self.pieces) {
            let (a, b) = (start.max(range.start), (start + p.len()).min(range.end));
            if a < b {
                f(a, &p[a - start..b - start]);
            }
        }
    }
    fn write(&mut self, offset: usize, src: &[u8]) {
        self.writes.push((offset, src.len()));
        for (start, p) in self.starts().into_iter().zip(self.pieces.iter_mut()) {
            let (a, b) = (start.max(offset), (start + p.len()).min(offset + src.len()));
            if a < b {
                p[a - start..b - start].copy_from_slice(&src[a - offset..b - offset]);
            }
        }
    }
}

/// all_reduce_piecewise gives the bits of all_reduce on the concatenated pieces, on every path (pipelined
/// shared memory in one block and in many, the slot exchange, TCP), world sizes 2–4, f32 and bf16 floats that
/// round, an empty buffer, and writes each byte exactly once, in order. One rank of each group uses the contiguous
/// call, the others the piecewise one: they are the same collective.
#[test]
fn all_reduce_piecewise_has_the_bits_of_all_reduce_on_every_path() {
    use ddp_core::PiecewiseBuffer;
    use half::bf16;
    use rand::{Rng, SeedableRng};
    let tunings = [None, Some(tiny_shm_blocks()), Some(tiny_shm_slots()), Some(tiny_segments())];
    for (world, tuning) in [2usize, 3, 4].into_iter().flat_map(|w| tunings.map(|t| (w, t))) {
        let out = run_ranks(world, tuning, |pg| {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(pg.rank() as u64 + 10);
            let mut results = Vec::new();
            // Bytes of f32 (4) or bf16 (2) elements. 300 001 f32: the default tuning's pipelined path (above
            // 64 KiB); 1001: below it; bf16 100 003: pipelined too.
            let cases = [
                (DType::F32, 1001usize, ReduceOp::Avg),
                (DType::F32, 300_001, ReduceOp::Avg),
                (DType::F32, 5000, ReduceOp::Sum),
                (DType::F32, 777, ReduceOp::Max),
                (DType::F32, 0, ReduceOp::Avg),
                (DType::BF16, 100_003, ReduceOp::Avg),
                (DType::BF16, 4099, ReduceOp::Sum),
            ];
            for (dtype, n, op) in cases {
                let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
                let bytes: Vec<u8> = match dtype {
                    DType::F32 => bytemuck::cast_slice(&v).to_vec(),
                    _ => bytemuck::cast_slice(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()).to_vec(),
                };
                let mut contiguous: Vec<u64> = vec![0; bytes.len().div_ceil(8)];
                let contiguous = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut contiguous)[..bytes.len()];
                contiguous.copy_from_slice(&bytes);
                pg.all_reduce_bytes(contiguous, dtype, op).unwrap();
                let mut pieces = Pieces::new(&bytes, dtype.size_in_bytes());
                if pg.rank() == 0 {
                    let mut packed: Vec<u64> = vec![0; bytes.len().div_ceil(8)];
                    let packed = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut packed)[..bytes.len()];
                    packed.copy_from_slice(&pieces.concat());
                    pg.all_reduce_bytes(packed, dtype, op).unwrap();
                    pieces.write(0, packed);
                } else {
                    pg.all_reduce_piecewise(&mut pieces, dtype, op).unwrap();
                }
                results.push((contiguous.to_vec(), pieces.concat(), pieces.writes.clone()));
            }
            results
        });
        for (rank, results) in out.iter().enumerate() {
            for (k, (contiguous, piecewise, writes)) in results.iter().enumerate() {
                assert!(contiguous == piecewise, "world {world} {tuning:?} rank {rank} case {k}: bits differ");
                assert!(contiguous == &out[0][k].0, "world {world} rank {rank} case {k}: ranks disagree");
                // In order, no gaps, no overlaps, every byte.
                let mut next = 0;
                for &(offset, len) in writes {
                    assert_eq!(offset, next, "world {world} {tuning:?} rank {rank} case {k}: writes {writes:?}");
                    next += len;
                }
                assert_eq!(next, piecewise.len(), "world {world} rank {rank} case {k}: every byte written");
            }
        }
    }
}

/// A pipeline stage's activation and gradient between two ranks: contiguous, strided and every dtype arrive
/// with their values; a size the receiver does not expect is an error naming both sizes, not a wrong tensor.
#[test]
fn tensors_go_point_to_point_in_order() {
    use candle_core::{DType as C, Device, Tensor};
    let errs = run_ranks(2, None, |pg| {
        let base = Tensor::arange(0f32, 12.0, &Device::Cpu).unwrap().reshape((3, 4)).unwrap();
        if pg.rank() == 0 {
            for dt in [C::F32, C::BF16, C::F16, C::I64] {
                pg.send_tensor(&base.to_dtype(dt).unwrap(), 1).unwrap();
            }
            pg.send_tensor(&base.t().unwrap(), 1).unwrap(); // strided: sent from a contiguous copy
            pg.send_tensor(&base, 1).unwrap(); // 12 elements where 1 expects 6
            String::new()
        } else {
            for dt in [C::F32, C::BF16, C::F16, C::I64] {
                let t = pg.recv_tensor((3, 4), dt, 0).unwrap();
                assert_eq!((t.dims(), t.dtype()), (&[3usize, 4][..], dt));
                let v: Vec<f32> = t.to_dtype(C::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                assert_eq!(v, (0..12).map(|i| i as f32).collect::<Vec<_>>(), "{dt:?}");
            }
            let t = pg.recv_tensor((4, 3), C::F32, 0).unwrap();
            assert_eq!(t.to_vec2::<f32>().unwrap(), base.t().unwrap().to_vec2::<f32>().unwrap());
            pg.recv_tensor((2, 3), C::F32, 0).unwrap_err().to_string()
        }
    });
    assert!(errs[1].contains("24 bytes") && errs[1].contains("48 bytes"), "{}", errs[1]);
    let e = run_ranks(1, None, |pg| {
        pg.send_tensor(&candle_core::Tensor::zeros(2, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap(), 0)
            .unwrap_err()
            .to_string()
    });
    assert!(e[0].contains("is this rank itself"), "{}", e[0]);
}
