//! Point-to-point send/recv through the shared segment's per-pair rings (`cpu/shm_p2p.rs`): real values at
//! every size class, streams in both directions, interleaving with collectives, mismatches and ordering
//! violations failing on both ranks, deadlocks beyond the rings' capacity reported instead of hanging, and proof
//! that the rings (not TCP) carry the bytes.

use crate::common::*;
use ddp_core::cpu::{CpuBackend, CpuTuning};
use ddp_core::{ProcessGroup, ReduceOp};
use std::time::{Duration, Instant};

/// Default ring geometry (`CpuTuning::default()`): 8 chunks of 64 KiB per ordered pair.
const CHUNK: usize = 64 << 10;
const CHUNKS: usize = 8;

/// Small rings (4 chunks of 256 bytes) so short tests wrap them many times and cross the capacity cheaply.
fn small_rings() -> CpuTuning {
    CpuTuning { shm_p2p_chunk_bytes: 256, shm_p2p_chunks: 4, ..CpuTuning::default() }
}

fn cpu(pg: &ProcessGroup) -> &CpuBackend {
    pg.backend().as_any().and_then(|a| a.downcast_ref::<CpuBackend>()).expect("a CPU backend")
}

/// Chunks (sent to, received from) `peer` through the rings; panics when p2p is not on shared memory.
fn chunks(pg: &ProcessGroup, peer: usize) -> (u64, u64) {
    cpu(pg).shm_p2p_chunks(peer).expect("send/recv through the shared-memory rings")
}

/// Chunks a message of `n` bytes takes with `chunk`-byte chunks.
fn chunks_of(n: usize, chunk: usize) -> u64 {
    n.div_ceil(chunk).max(1) as u64
}

/// The bytes rank `from` sends to rank `to` in message `tag`: distinct per sender, receiver, message and offset,
/// so a byte from the wrong message, rank or place cannot pass.
fn payload(from: usize, to: usize, tag: usize, n: usize) -> Vec<u8> {
    let seed = (from as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (to as u64).wrapping_mul(0xC2B2_AE3D)
        ^ (tag as u64).wrapping_mul(0x1656_67B1);
    (0..n as u64).map(|i| ((seed ^ i.wrapping_mul(0x27D4_EB2F)).wrapping_mul(0x9E37_79B9) >> 24) as u8).collect()
}

#[test]
fn values_of_every_size_class_arrive_exactly_on_2_and_3_ranks() {
    // 0, 1, 7 bytes; one chunk plus one byte; several MiB (ten times the ring).
    let sizes = [0usize, 1, 7, CHUNK + 1, 5 * (1 << 20) + 3];
    for world in [2usize, 3] {
        run_ranks(world, None, move |pg| {
            let (p, r) = (pg.world_size(), pg.rank());
            for (tag, &n) in sizes.iter().enumerate() {
                // A ring: even ranks send first, odd ranks receive first (so messages beyond the ring's capacity
                // cannot deadlock), all ranks at once.
                let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
                let before = (chunks(&pg, next).0, chunks(&pg, prev).1);
                let mut got = vec![0xAAu8; n];
                if r % 2 == 0 {
                    pg.send(&payload(r, next, tag, n), next).unwrap();
                    pg.recv(&mut got, prev).unwrap();
                } else {
                    pg.recv(&mut got, prev).unwrap();
                    pg.send(&payload(r, next, tag, n), next).unwrap();
                }
                assert!(got == payload(prev, r, tag, n), "world {world}, rank {r}: {n} bytes from rank {prev}");
                let after = (chunks(&pg, next).0, chunks(&pg, prev).1);
                let want = chunks_of(n, CHUNK);
                assert_eq!((after.0 - before.0, after.1 - before.1), (want, want), "{n} bytes took the rings");
            }
            // Every ordered pair in turn (on 3 ranks also the pairs the ring skipped).
            for (tag, (s, d)) in (0..p).flat_map(|s| (0..p).map(move |d| (s, d))).filter(|(s, d)| s != d).enumerate() {
                let n = 1 + tag * 997;
                if r == s {
                    pg.send(&payload(s, d, 100 + tag, n), d).unwrap();
                } else if r == d {
                    let mut got = vec![0u8; n];
                    pg.recv(&mut got, s).unwrap();
                    assert!(got == payload(s, d, 100 + tag, n), "{s} -> {d}, {n} bytes");
                }
            }
        });
    }
}

#[test]
fn typed_elements_keep_their_bits() {
    run_ranks(2, None, |pg| {
        let r = pg.rank();
        let mine = input::<f32>(r, 30_001);
        let mut got = vec![0.0f32; 30_001];
        if r == 0 {
            pg.send(&mine, 1).unwrap();
            pg.recv(&mut got, 1).unwrap();
        } else {
            pg.recv(&mut got, 0).unwrap();
            pg.send(&mine, 0).unwrap();
        }
        assert_eq!(bits(&got), bits(&input::<f32>(1 - r, 30_001)));
    });
}

#[test]
fn both_directions_at_once_within_the_ring_capacity_do_not_deadlock() {
    // Both ranks send first, then receive: fine while each direction's unreceived messages fit in the ring.
    // Default rings: 8 one-chunk messages per direction (sizes 0 … 64 KiB), 40 rounds; then many messages in a
    // row through small rings (4 chunks of 256 B) whose messages span 1–4 chunks.
    run_ranks(2, None, |pg| {
        let (r, peer) = (pg.rank(), 1 - pg.rank());
        for round in 0..40 {
            let sizes: Vec<usize> = (0..CHUNKS).map(|i| (round * 7919 + i * 104_729) % (CHUNK + 1)).collect();
            for (i, &n) in sizes.iter().enumerate() {
                pg.send(&payload(r, peer, round * 100 + i, n), peer).unwrap();
            }
            for (i, &n) in sizes.iter().enumerate() {
                let mut got = vec![0u8; n];
                pg.recv(&mut got, peer).unwrap();
                assert!(got == payload(peer, r, round * 100 + i, n), "round {round}, message {i}, {n} bytes");
            }
        }
    });
    run_ranks(2, Some(small_rings()), |pg| {
        let (r, peer) = (pg.rank(), 1 - pg.rank());
        for round in 0..300 {
            // 1 to 4 messages whose chunks add up to at most 4.
            let sizes: Vec<usize> = match round % 4 {
                0 => vec![1024],
                1 => vec![0, 1, 255, 256],
                2 => vec![511, 300],
                _ => vec![(round * 31) % 768],
            };
            for (i, &n) in sizes.iter().enumerate() {
                pg.send(&payload(r, peer, round * 10 + i, n), peer).unwrap();
            }
            for (i, &n) in sizes.iter().enumerate() {
                let mut got = vec![0u8; n];
                pg.recv(&mut got, peer).unwrap();
                assert!(got == payload(peer, r, round * 10 + i, n), "round {round}, message {i}, {n} bytes");
            }
        }
    });
}

#[test]
fn a_pairwise_exchange_beyond_the_ring_capacity_is_reported_as_a_deadlock_on_both_ranks() {
    // Small rings hold 4 × 256 = 1024 bytes: 1024 bytes each way works (previous test), 1025 cannot.
    let started = Instant::now();
    let errs = run_ranks(2, Some(small_rings()), |pg| {
        let peer = 1 - pg.rank();
        let err = pg.send(&vec![1u8; 1025], peer).unwrap_err().to_string();
        let later = pg.recv(&mut [0u8; 1025], peer).unwrap_err().to_string();
        (err, later)
    });
    for (rank, (err, later)) in errs.iter().enumerate() {
        assert!(err.contains("send/recv") && err.contains("sequence number 1"), "rank {rank}: {err}");
        assert!(err.contains("deadlock") && err.contains("blocked in send"), "rank {rank}: {err}");
        assert!(err.contains("1024 bytes"), "rank {rank} names the capacity: {err}");
        assert!(!err.contains("timed out"), "rank {rank}: {err}");
        assert!(later.contains("aborted"), "rank {rank}: {later}");
    }
    // Both receiving first is a deadlock at any size.
    let errs = run_ranks(2, None, |pg| pg.recv(&mut [0u8; 8], 1 - pg.rank()).unwrap_err().to_string());
    for (rank, err) in errs.iter().enumerate() {
        assert!(err.contains("deadlock") && err.contains("blocked in recv"), "rank {rank}: {err}");
    }
    assert!(started.elapsed() < Duration::from_secs(20), "detected, not timed out: {:?}", started.elapsed());
}

#[test]
fn point_to_point_interleaves_with_collectives() {
    for world in [2usize, 3] {
        run_ranks(world, None, |pg| {
            let (p, r) = (pg.world_size(), pg.rank());
            let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
            let ring = |tag: usize, n: usize| {
                let mut got = vec![0u8; n];
                if r % 2 == 0 {
                    pg.send(&payload(r, next, tag, n), next).unwrap();
                    pg.recv(&mut got, prev).unwrap();
                } else {
                    pg.recv(&mut got, prev).unwrap();
                    pg.send(&payload(r, next, tag, n), next).unwrap();
                }
                assert!(got == payload(prev, r, tag, n), "tag {tag}, {n} bytes");
            };
            for it in 0..20usize {
                ring(it * 10, 1 + it * 4099);
                // Slot path, TCP ring (after an exchange round) and pipelined shared-memory all_reduce.
                for n in [3usize, 40_000, 300_000] {
                    let mut v = input::<i64>(r + it, n);
                    pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                    let inputs: Vec<Vec<i64>> = (0..p).map(|q| input::<i64>(q + it, n)).collect();
                    let want: Vec<i64> = (0..n).map(|i| inputs.iter().map(|x| x[i]).sum()).collect();
                    assert!(v == want, "it {it}: all_reduce of {n}");
                }
                ring(it * 10 + 1, 700_000);
                let mut b = input::<f32>(r + it, 5000);
                pg.broadcast(&mut b, it % p).unwrap();
                assert_eq!(bits(&b), bits(&input::<f32>(it % p + it, 5000)));
                ring(it * 10 + 2, 0);
                pg.barrier().unwrap();
            }
        });
    }
}

#[test]
fn a_size_mismatch_fails_on_both_ranks_naming_both_sizes() {
    // Small message: the send completes before the receiver looks (eager); the sender's next call fails.
    let errs = run_ranks(2, None, |pg| {
        if pg.rank() == 0 {
            pg.send(&[1.0f32; 10], 1).unwrap();
            pg.barrier().unwrap_err().to_string()
        } else {
            pg.recv(&mut [0.0f32; 12], 0).unwrap_err().to_string()
        }
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(e.contains("40 bytes") && e.contains("48 bytes"), "rank {rank}: {e}");
    }
    assert!(errs[1].contains("send/recv") && errs[1].contains("sequence number 1"), "{}", errs[1]);
    assert!(errs[1].contains("[peer rank 0]"), "{}", errs[1]);
    // Larger than the ring: the sender is blocked in its send when the receiver finds the mismatch, and that
    // send fails.
    let errs = run_ranks(2, None, |pg| {
        if pg.rank() == 0 {
            pg.send(&vec![7u8; 3 << 20], 1).unwrap_err().to_string()
        } else {
            pg.recv(&mut vec![0u8; 2 << 20], 0).unwrap_err().to_string()
        }
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(e.contains("send/recv") && e.contains("sequence number 1"), "rank {rank}: {e}");
        assert!(e.contains(&(3usize << 20).to_string()) && e.contains(&(2usize << 20).to_string()), "rank {rank}: {e}");
    }
}

#[test]
fn messages_crossing_a_collective_fail_on_both_ranks() {
    let ordering = |e: &str| e.contains("collective");
    // 1. Sent before a barrier, received after it (small: the send completes at once).
    let errs = run_ranks(2, None, |pg| {
        let res = if pg.rank() == 0 {
            pg.send(&[1u8; 16], 1).and_then(|_| pg.barrier()).and_then(|_| pg.barrier())
        } else {
            pg.barrier().and_then(|_| pg.recv(&mut [0u8; 16], 0)).and_then(|_| pg.barrier())
        };
        res.unwrap_err().to_string()
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(ordering(e), "rank {rank}: {e}");
    }
    // 2. The same with a message larger than the ring: the sender is stuck in send, the receiver in the
    //    all_reduce; over one TCP connection the all_reduce would have read the message and failed.
    let started = Instant::now();
    let errs = run_ranks(2, None, |pg| {
        let mut v = [1.0f32; 4];
        if pg.rank() == 0 {
            pg.send(&vec![1u8; 2 << 20], 1).unwrap_err().to_string()
        } else {
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err().to_string()
        }
    });
    // Either rank may see it first: rank 1 the message its all_reduce left behind, rank 0 that rank 1 entered a
    // collective while its send waits.
    assert!(errs[0].contains("send/recv"), "{}", errs[0]);
    assert!(errs[1].contains("all_reduce"), "{}", errs[1]);
    assert!(errs.iter().all(|e| ordering(e) && !e.contains("timed out")), "{errs:?}");
    // 3. The receiver waits for a message its peer sends only after a collective.
    let errs = run_ranks(2, None, |pg| {
        let mut v = [1.0f32; 4];
        if pg.rank() == 0 {
            pg.all_reduce(&mut v, ReduceOp::Sum).and_then(|_| pg.send(&[1u8; 4], 1)).unwrap_err().to_string()
        } else {
            pg.recv(&mut [0u8; 4], 0).unwrap_err().to_string()
        }
    });
    assert!(errs[0].contains("all_reduce"), "{}", errs[0]);
    assert!(errs[1].contains("send/recv") && errs[1].contains("already entered collective 1"), "{}", errs[1]);
    assert!(started.elapsed() < Duration::from_secs(20), "detected, not timed out: {:?}", started.elapsed());
}

#[test]
fn the_ordering_rule_holds_over_tcp_too() {
    // Shared memory off. A broadcast rooted at the receiver never reads the sender's connection, so before the
    // collective count travelled with every message this crossed silently over TCP; now both paths refuse it.
    let tcp_only = CpuTuning { shared_memory: false, ..CpuTuning::default() };
    let errs = run_ranks(2, Some(tcp_only), |pg| {
        let mut b = [pg.rank() as u8; 8];
        let res = if pg.rank() == 0 {
            pg.send(&[1u8; 16], 1).and_then(|_| pg.broadcast(&mut b, 1)).and_then(|_| pg.barrier())
        } else {
            pg.broadcast(&mut b, 1).and_then(|_| pg.recv(&mut [0u8; 16], 0)).and_then(|_| pg.barrier())
        };
        res.unwrap_err().to_string()
    });
    assert!(errs[1].contains("send/recv") && errs[1].contains("after 0 collectives"), "{}", errs[1]);
    assert!(errs[1].contains("after 1 collectives"), "{}", errs[1]);
    assert!(errs[0].contains("barrier"), "{}", errs[0]);
}

#[test]
fn the_rings_carry_the_bytes_and_tuning_selects_tcp() {
    // Shared memory on: chunks move through the rings (counted in the segment itself) …
    let moved = run_ranks(2, None, |pg| {
        let peer = 1 - pg.rank();
        let before = chunks(&pg, peer);
        let mut got = vec![0u8; 1 << 20];
        if pg.rank() == 0 {
            pg.send(&payload(0, 1, 0, 1 << 20), 1).unwrap();
        } else {
            pg.recv(&mut got, 0).unwrap();
            assert!(got == payload(0, 1, 0, 1 << 20));
        }
        let after = chunks(&pg, peer);
        (after.0 - before.0, after.1 - before.1)
    });
    assert_eq!(moved, vec![((1 << 20) / CHUNK as u64, 0), (0, (1 << 20) / CHUNK as u64)]);
    // … and are not there when send/recv go over TCP: no shared memory at all, or rings switched off. Same values.
    let tcp_only = CpuTuning { shared_memory: false, ..CpuTuning::default() };
    let no_rings = CpuTuning { shm_p2p_chunks: 0, ..CpuTuning::default() };
    for (tuning, shm) in [(tcp_only, false), (no_rings, true)] {
        run_ranks(2, Some(tuning), move |pg| {
            assert_eq!(cpu(&pg).uses_shared_memory(), shm);
            assert_eq!(cpu(&pg).shm_p2p_chunks(1 - pg.rank()), None);
            let mut got = vec![0u8; 100_003];
            if pg.rank() == 0 {
                pg.send(&payload(0, 1, 5, 100_003), 1).unwrap();
                pg.recv(&mut got, 1).unwrap();
                assert!(got == payload(1, 0, 6, 100_003));
            } else {
                pg.recv(&mut got, 0).unwrap();
                assert!(got == payload(0, 1, 5, 100_003));
                pg.send(&payload(1, 0, 6, 100_003), 0).unwrap();
            }
        });
    }
}

#[test]
fn conformance_suite_runs_on_small_shared_memory_rings_and_on_tcp() {
    // The conformance suite (its p2p ring included) with rings small enough that its large message wraps them
    // hundreds of times, and with shared memory off (send/recv over TCP).
    let small = CpuTuning { shm_p2p_chunk_bytes: 4096, shm_p2p_chunks: 2, ..CpuTuning::default() };
    let tcp_only = CpuTuning { shared_memory: false, ..CpuTuning::default() };
    for (world, tuning, rings) in [(2usize, small, true), (3, small, true), (2, tcp_only, false), (3, tcp_only, false)]
    {
        let outcomes = run_ranks(world, Some(tuning), move |pg| {
            let opts = crate::conformance::SuiteOptions { large: 3 * (1 << 20) / 4 + 3, ..Default::default() };
            let out = crate::conformance::run(&pg, &opts);
            let peer = (pg.rank() + 1) % pg.world_size();
            match cpu(&pg).shm_p2p_chunks(peer) {
                // 786 435 f32 in 4 KiB chunks: 769 chunks for the large message alone.
                Some((sent, _)) => assert!(rings && sent > 769, "the large message went through the rings: {sent}"),
                None => assert!(!rings, "send/recv should use the rings"),
            }
            out
        });
        for (rank, out) in outcomes.iter().enumerate() {
            assert!(out.failed.is_empty(), "world {world}, rank {rank}: {}\n{}", out.summary(), out.failed.join("\n"));
            assert!(out.passed > 100, "world {world}: only {} cases ran", out.passed);
        }
    }
}
