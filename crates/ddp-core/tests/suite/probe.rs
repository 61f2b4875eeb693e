//! Link probes (`ddp_core::probe`) on the CPU backend, ranks as threads on loopback: ping-pong and all-reduce
//! estimates are finite with α ≥ 0 and β > 0, the same on every rank that measured, `None` on the ranks a
//! ping-pong leaves out; bad arguments fail with messages naming the fix. No assertion on absolute speed.

use crate::common::run_ranks;
use ddp_core::probe::{all_reduce_probe, ping_pong, LinkEstimate, DEFAULT_REPEATS, DEFAULT_SIZES};
use ddp_core::ReduceOp;
use std::time::Instant;

/// Small sizes and few repeats: the tests check the plumbing, not the speed.
const SIZES: [usize; 3] = [8, 4096, 65536];
const REPEATS: usize = 3;

fn assert_sane(est: &LinkEstimate, sizes: &[usize]) {
    assert!(est.alpha.is_finite() && est.alpha >= 0.0, "alpha {est:?}");
    assert!(est.beta.is_finite() && est.beta > 0.0, "beta {est:?}");
    assert_eq!(est.samples.len(), sizes.len());
    for (&(n, t), &asked) in est.samples.iter().zip(sizes) {
        assert!(n >= asked && n < asked + 4, "sample size {n} for {asked}");
        assert!(t.is_finite() && t >= 0.0, "sample time {t}");
    }
}

#[test]
fn ping_pong_on_2_and_3_ranks_gives_both_ends_the_same_estimate() {
    for world in [2usize, 3] {
        let (a, b) = (world - 1, 0);
        let out = run_ranks(world, None, move |pg| {
            let est = ping_pong(&pg, a, b, &SIZES, REPEATS).unwrap();
            // The group still works afterwards (collective sequence untouched by the left-out ranks).
            let mut v = [1i32];
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert_eq!(v[0] as usize, world);
            est
        });
        for (r, est) in out.iter().enumerate() {
            assert_eq!(est.is_some(), r == a || r == b, "rank {r} of {world}");
        }
        let (ea, eb) = (out[a].as_ref().unwrap(), out[b].as_ref().unwrap());
        assert_sane(ea, &SIZES);
        assert_eq!(ea, eb, "both ends fit the same timings");
    }
}

#[test]
fn all_reduce_probe_on_2_and_3_ranks_gives_every_rank_the_same_estimate() {
    for world in [2usize, 3] {
        // 5 bytes rounds up to 2 f32 (8 bytes).
        let sizes = [5usize, 4096, 65536];
        let out = run_ranks(world, None, move |pg| all_reduce_probe(&pg, &sizes, REPEATS).unwrap());
        assert_sane(&out[0], &sizes);
        assert_eq!(out[0].samples[0].0, 8);
        for est in &out[1..] {
            assert_eq!(est, &out[0]);
        }
    }
}

#[test]
fn argument_errors_name_the_fix_on_every_rank() {
    let out = run_ranks(3, None, |pg| {
        let pp = |a, b, sizes: &[usize], repeats| ping_pong(&pg, a, b, sizes, repeats).unwrap_err().to_string();
        let ar = |sizes: &[usize], repeats| all_reduce_probe(&pg, sizes, repeats).unwrap_err().to_string();
        vec![
            pp(0, 1, &[], 3),
            pp(0, 1, &[8, 0], 3),
            pp(0, 1, &[8, 8], 3),
            pp(0, 1, &SIZES, 0),
            pp(0, 3, &SIZES, 3),
            pp(5, 1, &SIZES, 3),
            pp(2, 2, &SIZES, 3),
            ar(&[], 3),
            ar(&[0, 8], 3),
            ar(&SIZES, 0),
        ]
    });
    let expected = [
        "ping_pong: no sizes; pass at least two message sizes",
        "ping_pong: sizes[1] is 0 bytes; every size must be at least 1 byte",
        "ping_pong: every size is 8 bytes; the α–β fit needs at least two different sizes",
        "ping_pong: repeats is 0; time each size at least once",
        "ping_pong: rank b = 3 is out of range for a group of 3 ranks; pass group ranks in 0..3",
        "ping_pong: rank a = 5 is out of range for a group of 3 ranks",
        "ping_pong: a and b are both rank 2; pass two different ranks of the group",
        "all_reduce_probe: no sizes",
        "all_reduce_probe: sizes[0] is 0 bytes",
        "all_reduce_probe: repeats is 0",
    ];
    for msgs in &out {
        for (m, e) in msgs.iter().zip(expected) {
            assert!(m.contains(e), "{m:?} should contain {e:?}");
        }
    }
}

#[test]
fn all_reduce_probe_needs_two_ranks() {
    let out = run_ranks(1, None, |pg| all_reduce_probe(&pg, &SIZES, 1).unwrap_err().to_string());
    assert!(out[0].contains("no link to measure; probe a group of at least 2 ranks"), "{}", out[0]);
}

#[test]
fn default_probes_on_2_ranks_are_short() {
    // Informational timing (printed with --nocapture); the only assertion is on the estimates' sanity.
    let out = run_ranks(2, None, |pg| {
        let start = Instant::now();
        let pp = ping_pong(&pg, 0, 1, &DEFAULT_SIZES, DEFAULT_REPEATS).unwrap().unwrap();
        let t_pp = start.elapsed();
        let start = Instant::now();
        let ar = all_reduce_probe(&pg, &DEFAULT_SIZES, DEFAULT_REPEATS).unwrap();
        (pp, t_pp, ar, start.elapsed())
    });
    let (pp, t_pp, ar, t_ar) = &out[0];
    assert_sane(pp, &DEFAULT_SIZES);
    assert_sane(ar, &DEFAULT_SIZES);
    eprintln!(
        "default probes, 2 ranks: ping_pong {:.1} ms (α {:.2e} s, β {:.3e} B/s), all_reduce_probe {:.1} ms \
         (α {:.2e} s, β {:.3e} B/s)",
        t_pp.as_secs_f64() * 1e3,
        pp.alpha,
        pp.beta,
        t_ar.as_secs_f64() * 1e3,
        ar.alpha,
        ar.beta
    );
}
