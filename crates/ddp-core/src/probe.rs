//! Link probes: measure a group's link on the real backend and fit it to the α–β model.
//!
//! A message of `n` bytes takes `t(n) = α + n/β` seconds: `α` seconds of latency per message, `β` bytes per
//! second of bandwidth (Hockney 1994, "The communication challenge for MPP: Intel Paragon and Meiko CS-2"; the
//! model Alpa's and Colossal-AI's profilers fit, and the `Link { alpha, beta }` that `accel::auto_layout` takes).
//! Two probes give a [`LinkEstimate`]:
//!
//! - [`ping_pong`]: two ranks bounce messages of each size; one-way time = round trip / 2, median over the
//!   repeats, least-squares fit of `α + n/β`. The link between those two ranks.
//! - [`all_reduce_probe`]: every rank times `all_reduce` of each size; the slowest rank's median per size is fit to
//!   the ring model `t(n) = 2(p−1)·α + 2(p−1)/p · n/β` (Thakur, Rabenseifner & Gropp 2005), which recovers the
//!   α and β of one ring link as the collectives see it (shared memory or TCP, whatever the backend picks).
//!
//! Start-up probes, short by design ([`DEFAULT_SIZES`], [`DEFAULT_REPEATS`]): numbers to feed a cost model, not a
//! benchmark. Timings are wall-clock ([`std::time::Instant`]) on this rank.

use crate::error::{DdpError, Result};
use crate::{ProcessGroup, ReduceOp};
use std::time::Instant;

/// Suggested probe sizes in bytes: 8 B (latency), 64 KiB, 1 MiB (bandwidth).
pub const DEFAULT_SIZES: [usize; 3] = [8, 64 << 10, 1 << 20];

/// Suggested timed repetitions per size (the median is kept).
pub const DEFAULT_REPEATS: usize = 5;

/// Shortest time a sample may report, seconds: keeps the fit finite when a timer reads 0.
const MIN_SECONDS: f64 = 1e-9;

/// A measured α–β link: a message of `n` bytes takes `alpha + n / beta` seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkEstimate {
    /// Latency: seconds per message (≥ 0).
    pub alpha: f64,
    /// Bandwidth: bytes per second (> 0, finite).
    pub beta: f64,
    /// The measurements the fit was made from: `(bytes, seconds)` per size, in the order of the sizes asked
    /// for. [`ping_pong`]: the median one-way time; [`all_reduce_probe`]: the slowest rank's median time of
    /// the whole all_reduce.
    pub samples: Vec<(usize, f64)>,
}

impl LinkEstimate {
    /// Seconds one message of `bytes` takes on this link: `α + bytes/β`.
    pub fn message_time(&self, bytes: f64) -> f64 {
        self.alpha + bytes / self.beta
    }

    /// Least-squares fit of `t(n) = α + n/β` to `samples` (`(bytes, seconds)`), which it keeps.
    ///
    /// An ordinary least-squares line `t = c + s·n`, then `α = c`, `β = 1/s`. If the intercept comes out
    /// negative, `α` is clamped to 0 and the slope refit through the origin (`s = Σ n·t / Σ n²`). If the samples
    /// show no per-byte cost (slope ≤ 0: timings that do not grow with size, noise), `α` is their mean time and
    /// `β = n_max / α`, the bandwidth at which the largest message would cost one more latency — a lower bound
    /// the samples support. Needs at least two distinct sizes, all > 0, and finite times ≥ 0.
    pub fn fit(samples: Vec<(usize, f64)>) -> Result<LinkEstimate> {
        if samples.is_empty() {
            return Err(DdpError::InvalidArgument(
                "probe fit: no samples; give at least two (bytes, seconds) samples of different sizes".into(),
            ));
        }
        if let Some(&(n, t)) = samples.iter().find(|&&(n, t)| n == 0 || !t.is_finite() || t < 0.0) {
            return Err(DdpError::InvalidArgument(format!(
                "probe fit: sample ({n} bytes, {t} s) is unusable; sizes must be > 0 and times finite and ≥ 0"
            )));
        }
        let first = samples[0].0;
        if samples.iter().all(|&(n, _)| n == first) {
            return Err(DdpError::InvalidArgument(format!(
                "probe fit: every sample is {first} bytes; the α–β fit needs at least two different sizes \
                 (e.g. ddp_core::probe::DEFAULT_SIZES)"
            )));
        }
        let pts: Vec<(f64, f64)> = samples.iter().map(|&(n, t)| (n as f64, t.max(MIN_SECONDS))).collect();
        let k = pts.len() as f64;
        let mean_n = pts.iter().map(|p| p.0).sum::<f64>() / k;
        let mean_t = pts.iter().map(|p| p.1).sum::<f64>() / k;
        let sxx: f64 = pts.iter().map(|p| (p.0 - mean_n) * (p.0 - mean_n)).sum();
        let sxy: f64 = pts.iter().map(|p| (p.0 - mean_n) * (p.1 - mean_t)).sum();
        let mut slope = sxy / sxx;
        let mut intercept = mean_t - slope * mean_n;
        if intercept < 0.0 {
            intercept = 0.0;
            slope = pts.iter().map(|p| p.0 * p.1).sum::<f64>() / pts.iter().map(|p| p.0 * p.0).sum::<f64>();
        }
        let (alpha, beta) = if slope > 0.0 && slope.is_finite() && (1.0 / slope).is_finite() {
            (intercept, 1.0 / slope)
        } else {
            let n_max = pts.iter().map(|p| p.0).fold(0.0, f64::max);
            (mean_t, n_max / mean_t)
        };
        Ok(LinkEstimate { alpha, beta, samples })
    }
}

/// Checks the arguments shared by both probes.
fn check_sizes(probe: &str, sizes: &[usize], repeats: usize) -> Result<()> {
    if sizes.is_empty() {
        return Err(DdpError::InvalidArgument(format!(
            "{probe}: no sizes; pass at least two message sizes in bytes (e.g. ddp_core::probe::DEFAULT_SIZES)"
        )));
    }
    if let Some(i) = sizes.iter().position(|&n| n == 0) {
        return Err(DdpError::InvalidArgument(format!(
            "{probe}: sizes[{i}] is 0 bytes; every size must be at least 1 byte (e.g. ddp_core::probe::DEFAULT_SIZES)"
        )));
    }
    if sizes.iter().all(|&n| n == sizes[0]) {
        return Err(DdpError::InvalidArgument(format!(
            "{probe}: every size is {} bytes; the α–β fit needs at least two different sizes \
             (e.g. ddp_core::probe::DEFAULT_SIZES)",
            sizes[0]
        )));
    }
    if repeats == 0 {
        return Err(DdpError::InvalidArgument(format!(
            "{probe}: repeats is 0; time each size at least once (e.g. ddp_core::probe::DEFAULT_REPEATS)"
        )));
    }
    Ok(())
}

/// The median of `v` (mean of the middle two for an even count). `v` is non-empty.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Ping-pong between group ranks `a` and `b`: the α–β estimate of the link between them.
///
/// For each size, one untimed round trip (warm-up), then `repeats` timed ones: `a` sends `n` bytes to `b`, `b`
/// sends them back; one-way time = round trip / 2, timed on `a`, median over the repeats. `a` then sends its
/// medians to `b`, and both fit them ([`LinkEstimate::fit`]), so `a` and `b` return the same estimate.
///
/// Not a collective: only `a` and `b` communicate (with the group's send/recv, which needs nothing from the other
/// ranks); every other rank checks the arguments and returns `Ok(None)` at once. As with any send/recv, `a` and
/// `b` must call it at matching points of their collective sequence (between the same two collectives).
///
/// Errors (on every rank, before anything is sent): `sizes` empty, holding a 0, or of one distinct size;
/// `repeats` 0; `a` or `b` out of range, or equal.
pub fn ping_pong(
    pg: &ProcessGroup,
    a: usize,
    b: usize,
    sizes: &[usize],
    repeats: usize,
) -> Result<Option<LinkEstimate>> {
    check_sizes("ping_pong", sizes, repeats)?;
    let p = pg.world_size();
    for (name, r) in [("a", a), ("b", b)] {
        if r >= p {
            return Err(DdpError::InvalidArgument(format!(
                "ping_pong: rank {name} = {r} is out of range for a group of {p} ranks; pass group ranks in 0..{p}"
            )));
        }
    }
    if a == b {
        return Err(DdpError::InvalidArgument(format!(
            "ping_pong: a and b are both rank {a}; pass two different ranks of the group"
        )));
    }
    let me = pg.rank();
    if me != a && me != b {
        return Ok(None);
    }
    let max = sizes.iter().copied().max().unwrap_or(0);
    let mut buf = vec![0u8; max];
    let mut medians = vec![0f64; sizes.len()];
    for (slot, &n) in medians.iter_mut().zip(sizes) {
        let msg = &mut buf[..n];
        let mut one_way = Vec::with_capacity(repeats);
        for i in 0..=repeats {
            if me == a {
                let start = Instant::now();
                pg.send(msg, b)?;
                pg.recv(msg, b)?;
                if i > 0 {
                    one_way.push(start.elapsed().as_secs_f64() / 2.0);
                }
            } else {
                pg.recv(msg, a)?;
                pg.send(msg, a)?;
            }
        }
        if me == a {
            *slot = median(&mut one_way);
        }
    }
    if me == a {
        pg.send(&medians, b)?;
    } else {
        pg.recv(&mut medians, a)?;
    }
    let samples = sizes.iter().copied().zip(medians).collect();
    LinkEstimate::fit(samples).map(Some)
}

/// All-reduce probe over the whole group: the α–β estimate of one link of the ring the collectives run on.
///
/// For each size `n` (rounded up to whole f32 elements; the samples hold the bytes actually reduced), one untimed
/// all_reduce (warm-up), then `repeats` times: a barrier (so the ranks start together), then a timed
/// `all_reduce(Sum)` of an f32 buffer. Each rank takes its median per size; an `all_reduce(Max)` of the medians
/// gives every rank the slowest rank's, the samples. They are fit as `t(n) = A + n·S` ([`LinkEstimate::fit`]) and
/// read with the ring all-reduce model over `p` ranks,
///
/// `t(n) = 2(p−1)·α + 2(p−1)/p · n/β`
///
/// (a reduce-scatter then an all-gather: `2(p−1)` steps, each one message of `n/p` bytes): `α = A / 2(p−1)`,
/// `β = 2(p−1) / (p·S)`. The returned `samples` are the whole-all_reduce times, not per-link ones. The backend may
/// use other algorithms (a direct exchange for small buffers, shared memory on one machine): the estimate is then
/// the ring-equivalent link, what a ring cost model should use.
///
/// A collective: every rank of the group calls it with the same arguments and gets the same estimate.
///
/// Errors: `sizes` empty, holding a 0, or of one distinct size; `repeats` 0; a group of one rank (no link).
pub fn all_reduce_probe(pg: &ProcessGroup, sizes: &[usize], repeats: usize) -> Result<LinkEstimate> {
    check_sizes("all_reduce_probe", sizes, repeats)?;
    let p = pg.world_size();
    if p < 2 {
        return Err(DdpError::InvalidArgument(
            "all_reduce_probe: the group has 1 rank, so there is no link to measure; probe a group of at least 2 ranks"
                .into(),
        ));
    }
    let elems: Vec<usize> = sizes.iter().map(|&n| n.div_ceil(4)).collect();
    let mut buf = vec![0f32; elems.iter().copied().max().unwrap_or(0)];
    let mut medians = vec![0f64; sizes.len()];
    for (slot, &k) in medians.iter_mut().zip(&elems) {
        let v = &mut buf[..k];
        let mut times = Vec::with_capacity(repeats);
        for i in 0..=repeats {
            pg.barrier()?;
            let start = Instant::now();
            pg.all_reduce(v, ReduceOp::Sum)?;
            if i > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        *slot = median(&mut times);
    }
    pg.all_reduce(&mut medians, ReduceOp::Max)?;
    let samples: Vec<(usize, f64)> = elems.iter().map(|&k| k * 4).zip(medians).collect();
    let whole = LinkEstimate::fit(samples)?;
    let steps = 2.0 * (p as f64 - 1.0);
    let alpha = whole.alpha / steps;
    // whole.beta = 1/S, so β = 2(p−1)/(p·S) = 2(p−1)·whole.beta / p.
    let beta = steps * whole.beta / p as f64;
    Ok(LinkEstimate { alpha, beta, samples: whole.samples })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_a_known_alpha_and_beta_exactly() {
        let (alpha, beta) = (1e-5, 1e9);
        let samples: Vec<(usize, f64)> =
            [8usize, 64 << 10, 1 << 20, 3 << 20].iter().map(|&n| (n, alpha + n as f64 / beta)).collect();
        let est = LinkEstimate::fit(samples.clone()).unwrap();
        assert!((est.alpha - alpha).abs() <= 1e-12 * alpha.max(1.0), "alpha {}", est.alpha);
        assert!((est.beta - beta).abs() <= 1e-9 * beta, "beta {}", est.beta);
        assert_eq!(est.samples, samples);
        assert!((est.message_time(1e6) - (alpha + 1e6 / beta)).abs() < 1e-15);
    }

    #[test]
    fn fit_clamps_a_negative_intercept_and_refits_through_the_origin() {
        // Exactly t = n / 1e9 minus a constant: OLS intercept < 0.
        let samples: Vec<(usize, f64)> = [1000usize, 2000, 4000].iter().map(|&n| (n, n as f64 / 1e9 - 5e-7)).collect();
        let est = LinkEstimate::fit(samples).unwrap();
        assert_eq!(est.alpha, 0.0);
        assert!(est.beta > 0.0 && est.beta.is_finite());
    }

    #[test]
    fn fit_without_a_per_byte_cost_keeps_a_finite_positive_beta() {
        let est = LinkEstimate::fit(vec![(8, 2e-6), (1024, 2e-6), (4096, 1e-6)]).unwrap();
        assert!(est.alpha > 0.0 && est.beta > 0.0 && est.beta.is_finite(), "{est:?}");
    }

    #[test]
    fn fit_rejects_unusable_samples() {
        let msg = |s: Vec<(usize, f64)>| LinkEstimate::fit(s).unwrap_err().to_string();
        assert!(msg(vec![]).contains("no samples"));
        assert!(msg(vec![(8, 1e-6), (8, 2e-6)]).contains("at least two different sizes"));
        assert!(msg(vec![(0, 1e-6), (8, 2e-6)]).contains("sizes must be > 0"));
        assert!(msg(vec![(4, f64::NAN), (8, 2e-6)]).contains("times finite"));
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
