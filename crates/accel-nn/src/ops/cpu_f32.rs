//! Shared plumbing of the fused CPU kernels: when the fast path applies, the f32 slice behind a candle storage,
//! row-parallel loops over rayon, a vectorisable sum, and an `exp` that the compiler can inline and vectorise.
//!
//! The kernels read their inputs as contiguous row-major f32 slices: the public functions make their inputs
//! contiguous before applying a custom op (a no-op when they already are; candle's copy carries the gradient
//! otherwise), and the backward passes do the same with the incoming gradient.

use candle_core::{CpuStorage, DType, Layout, Storage, Tensor};
use rayon::prelude::*;

/// Whether the fused fast path applies: the switch is on ([`super::fused_ops_enabled`]) and every tensor is an f32
/// tensor on the CPU. Everything else (CUDA, Metal, bf16/f16/f64) takes candle's composed ops.
pub(crate) fn fast_path(tensors: &[&Tensor]) -> bool {
    super::fused_ops_enabled() && tensors.iter().all(|t| t.device().is_cpu() && t.dtype() == DType::F32)
}

/// The elements of a contiguous f32 CPU storage viewed through `l`.
///
/// Errors: another dtype, or a strided layout (the callers make their inputs contiguous first, so this names a
/// bug in the caller rather than bad user input).
pub(crate) fn storage_f32<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    let data = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("{op}: the fused kernel expects a contiguous input, got strides {:?}", l.stride()),
    }
}

/// [`storage_f32`] for a whole storage as [`Tensor::storage_and_layout`] hands it out (CPU only).
pub(crate) fn tensor_f32<'a>(s: &'a Storage, l: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    match s {
        Storage::Cpu(s) => storage_f32(s, l, op),
        _ => candle_core::bail!("{op}: the fused kernel runs on the CPU only"),
    }
}

/// Elements per rayon task: below this a task's work is too small to pay for the hand-off.
pub(crate) const GRAIN: usize = 32 * 1024;

/// Rows per task for rows of `row_len` elements (at least one row).
fn rows_per_task(row_len: usize) -> usize {
    (GRAIN / row_len.max(1)).max(1)
}

/// Whether `len` elements are worth splitting over rayon's threads.
pub(crate) fn parallel(len: usize) -> bool {
    len >= 2 * GRAIN && rayon::current_num_threads() > 1
}

/// Calls `f(first_row, rows)` on consecutive blocks of whole rows of `out` (rows of `row_len` elements), in
/// parallel on rayon's pool when `out` is large enough. `first_row` indexes the block's first row in `out`.
pub(crate) fn for_row_blocks(out: &mut [f32], row_len: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if row_len == 0 || out.is_empty() {
        return;
    }
    let rows = rows_per_task(row_len);
    if parallel(out.len()) {
        out.par_chunks_mut(rows * row_len).enumerate().for_each(|(t, block)| f(t * rows, block));
    } else {
        f(0, out);
    }
}

/// Like [`for_row_blocks`], and each block also returns a value; the values come back in block order (for
/// per-block partial sums that the caller then adds up).
pub(crate) fn map_row_blocks<R: Send>(
    out: &mut [f32],
    row_len: usize,
    f: impl Fn(usize, &mut [f32]) -> R + Sync + Send,
) -> Vec<R> {
    if row_len == 0 || out.is_empty() {
        return Vec::new();
    }
    let rows = rows_per_task(row_len);
    if parallel(out.len()) {
        out.par_chunks_mut(rows * row_len).enumerate().map(|(t, block)| f(t * rows, block)).collect()
    } else {
        vec![f(0, out)]
    }
}

/// `Σ a[i]·b[i]` with eight independent accumulators, so that the compiler vectorises it (and the rounding error
/// grows like that of a pairwise sum rather than a sequential one).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ar.iter().zip(br) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `Σ a[i]` with eight independent accumulators (see [`dot`]).
#[inline(always)]
pub(crate) fn sum(a: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.chunks_exact(8);
    let rest = chunks.remainder();
    for x in chunks {
        for k in 0..8 {
            acc[k] += x[k];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + rest.iter().sum::<f32>()
}

/// Defines `fn $name(args)` that runs `$body` compiled for AVX2 when the CPU has it (checked at run time, cached by
/// std), and for the build's baseline (SSE2 on x86-64) otherwise. The body's loops vectorise 8 lanes wide instead
/// of 4; what they compute is the same (no FMA contraction: Rust never fuses `a * b + c` on its own), so results
/// do not depend on the CPU. The body may call only `#[inline(always)]` helpers (such as [`exp`]) for them to be
/// compiled for AVX2 too.
macro_rules! simd_fn {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) {
                    body($($arg),*)
                }
                if $crate::ops::cpu_f32::use_avx2() {
                    // SAFETY: the CPU has AVX2 (use_avx2 checked it).
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use simd_fn;

#[cfg(test)]
thread_local! {
    /// Tests only: this thread runs every [`simd_fn!`] kernel in its baseline build (see [`baseline_only`]).
    static BASELINE_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Tests only: `f()` with every [`simd_fn!`] kernel called on this thread in its baseline build, to compare it with
/// the AVX2 one. Per thread, so tests running at the same time keep their own builds; the kernels must run on
/// the calling thread (inputs below the rayon thresholds), or they take the AVX2 build there.
#[cfg(test)]
pub(crate) fn baseline_only<R>(f: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            BASELINE_ONLY.with(|b| b.set(false));
        }
    }
    BASELINE_ONLY.with(|b| b.set(true));
    let _reset = Reset;
    f()
}

/// Whether [`simd_fn!`] kernels take their AVX2 build: the CPU has AVX2 (std caches the check).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn use_avx2() -> bool {
    #[cfg(test)]
    if BASELINE_ONLY.with(|b| b.get()) {
        return false;
    }
    std::arch::is_x86_feature_detected!("avx2")
}

/// `e^x` in f32 without a call: Cody–Waite range reduction `x = n·ln 2 + r` (`|r| ≤ ln 2 / 2`, `ln 2` split in two
/// parts so that `n·ln 2` is exact), Cephes' degree-6 polynomial for `e^r` (`expf.c`, S. L. Moshier), then `2^n`
/// built in the exponent bits. Branch-free selects only, so that a loop over a slice vectorises (glibc's `expf` is
/// a call per element: it was 7.5 % of the char-GPT step's CPU samples). Error ≤ 1 ulp of f32 against the
/// exactly rounded value over the normal range (tested).
///
/// Special values as `f32::exp`: `exp(0) = 1` exactly, `exp(−∞) = 0`, `+∞` above the overflow threshold
/// `ln(f32::MAX) ≈ 88.72284` and for `+∞`, NaN for NaN. One difference: results below `f32::MIN_POSITIVE`
/// (`x < −87.33654`) flush to 0 instead of being subnormal.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // The largest x with a finite e^x (just below ln(f32::MAX)) and the smallest with a normal one (just above
    // ln(f32::MIN_POSITIVE)); beyond them the result is +∞ or (flushed) 0.
    const OVERFLOW: f32 = 88.722_83;
    const UNDERFLOW: f32 = -87.336_54;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // 0.693359375 has 9 significant bits, so n·LN2_HI is exact for |n| ≤ 2^15; LN2_LO is the rest of ln 2.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5·2^23: adding it rounds to an integer (to nearest, ties to even) held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    // f32::clamp keeps NaN a NaN (f32::max/min would not).
    let xc = x.clamp(UNDERFLOW, OVERFLOW);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes' 5.0000001201e-1, which rounds to 0.5 in f32
    let er = p * (r * r) + r + 1.0;
    // n ∈ [−126, 128] from t's low bits; 2^n as two normal factors 2^⌊n/2⌋ · 2^(n − ⌊n/2⌋) (2^128 is not a
    // normal f32, but e^r·2^128 is when r < 0).
    // Wrapping integer ops: they cannot overflow here, and the overflow checks of a debug build would keep the
    // loop from vectorising.
    let n_int = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let half = n_int >> 1;
    let pow2 = |k: i32| f32::from_bits((k.wrapping_add(127) as u32) << 23);
    let y = er * pow2(half) * pow2(n_int.wrapping_sub(half));
    // (NaN went through every step as NaN.)
    if x > OVERFLOW {
        f32::INFINITY
    } else if x < UNDERFLOW {
        0.0
    } else {
        y
    }
}

#[cfg(test)]
mod tests {
    use super::exp;

    /// Distance in units in the last place between two finite f32 of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_one_ulp_over_the_normal_range() {
        let (lo, hi) = (-87.336_54f32, 88.722_83f32);
        let mut worst = (0u32, 0f32);
        // Every 97th f32 bit pattern in [lo, hi] (both signs), about 23 million points; plus the ends.
        let negative = (0u32..=lo.to_bits() & 0x7fff_ffff).step_by(97).map(|b| -f32::from_bits(b));
        let positive = (0u32..=hi.to_bits()).step_by(97).map(f32::from_bits);
        for x in negative.chain(positive).chain([lo, hi, 0.0, -0.0, 1.0, -1.0]) {
            let exact = (x as f64).exp() as f32;
            let got = exp(x);
            assert!(got.is_finite(), "exp({x}) = {got}, exact {exact}");
            let e = ulps(got, exact);
            if e > worst.0 {
                worst = (e, x);
            }
        }
        assert!(worst.0 <= 1, "worst error {} ulps at x = {}", worst.0, worst.1);
    }

    /// GELU (forward and backward) and softmax give the same bits from the AVX2 and the baseline builds of their
    /// kernels (on a CPU without AVX2 both runs take the baseline, and the test still passes).
    #[test]
    fn avx2_and_baseline_kernels_agree_bit_for_bit() {
        use candle_core::{Device, Tensor, Var};
        // Values across GELU's and exp's whole range, including the saturated ends, in rows of odd length (so the
        // vector loops have remainders).
        let xs: Vec<f32> = (0..37 * 301).map(|i| ((i as f32 * 0.7317).sin() * 12.0) + (i % 7) as f32 - 3.0).collect();
        let run = || {
            let x = Var::from_tensor(&Tensor::from_vec(xs.clone(), (37, 301), &Device::Cpu).unwrap()).unwrap();
            let y = crate::ops::activation::gelu(x.as_tensor()).unwrap();
            let s = crate::ops::softmax::softmax_last_dim(x.as_tensor()).unwrap();
            let loss = (y.sum_all().unwrap() + (s.sqr().unwrap().sum_all().unwrap())).unwrap();
            let grads = loss.backward().unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
            };
            (bits(&y), bits(&s), bits(grads.get(x.as_tensor()).unwrap()))
        };
        let native = run();
        let baseline = super::baseline_only(run);
        assert!(native.0 == baseline.0, "GELU forward differs between the AVX2 and the baseline kernels");
        assert!(native.1 == baseline.1, "softmax differs between the AVX2 and the baseline kernels");
        assert!(native.2 == baseline.2, "GELU + softmax backward differs between the AVX2 and the baseline kernels");
    }

    #[test]
    fn exp_special_values() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::MAX), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-88.0), 0.0, "subnormal results flush to 0");
        assert_eq!(exp(f32::MIN), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-f32::NAN).is_nan());
        // Monotone across the reduction's interval boundaries (x ≈ (k + ½)·ln 2, where n changes): every pair of
        // neighbouring f32 in a window of 64 around each (the f32 product lands a few ulps from the exact point).
        let up = |x: f32| f32::from_bits(if x >= 0.0 { x.to_bits() + 1 } else { x.to_bits() - 1 });
        let down = |x: f32| f32::from_bits(if x > 0.0 { x.to_bits() - 1 } else { x.to_bits() + 1 });
        for k in -120..120 {
            let mut x = (k as f32 + 0.5) * std::f32::consts::LN_2;
            for _ in 0..32 {
                x = down(x);
            }
            for _ in 0..64 {
                let next = up(x);
                assert!(exp(x) <= exp(next), "exp not monotone at {x}: {} > {}", exp(x), exp(next));
                x = next;
            }
        }
    }
}
