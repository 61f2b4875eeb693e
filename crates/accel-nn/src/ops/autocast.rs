//! bf16 autocast on the CPU: the matrix products of [`super::linear`] take bf16 operands and give bf16 results
//! while every tensor stays f32 — what `torch.autocast("cpu", dtype=torch.bfloat16)` does to `F.linear`.
//!
//! Why not bf16 tensors: candle 0.11's CPU kernels for bf16 tensors are far slower than its f32 ones on an x86 CPU
//! with AVX512-BF16 (measured in `docs/benchmarks.md`, "bf16 on the CPU": an elementwise bf16 `add` of 200 k
//! values takes 2–7 ms against 0.02–0.05 ms in f32), and candle's backward pass adds every gradient into a
//! zero-filled buffer of its tensor's dtype, so a bf16 model pays that `add` once per parameter and activation per
//! step. Kept in f32 and rounded to bf16 only where PyTorch's autocast computes in bf16, a model trains with
//! bf16's numerics at f32's speed.
//!
//! What a product computes with autocast on (the fused path and the composed one alike): `y = bf16(bf16(x) ·
//! bf16(w)ᵀ + bf16(b))` with f32 accumulation (a product of two bf16 values is exact in f32, so this is the bf16
//! GEMM with f32 accumulation that bf16 hardware and PyTorch's oneDNN kernels compute, up to the order of the
//! sums); backward, the incoming gradient is rounded to bf16 (the gradient of the output cast), and `dx`, `dw`,
//! `db` are rounded to bf16 (the gradients of the input casts), as PyTorch's autograd does through autocast's
//! casts. `bf16(v)` is round-to-nearest-even to bf16's 8 significant bits (`half::bf16::from_f32`, candle's
//! `to_dtype(BF16)`), NaN kept a NaN.
//!
//! The switch is per thread, as `torch.autocast` is: the Accelerator turns it on for the thread that creates it
//! when it trains on the CPU in bf16 ([`set_bf16`] / [`Bf16Guard`]); an op records the state when it is applied,
//! so its backward pass computes what its forward did, whichever thread runs it.

use std::cell::Cell;

use rayon::prelude::*;

use super::cpu_f32::{parallel, GRAIN};

thread_local! {
    static BF16: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread's products run in bf16 ([module docs](self)). Off unless [`set_bf16`] turned it on.
pub fn bf16_enabled() -> bool {
    BF16.with(|b| b.get())
}

/// Turns bf16 autocast on or off for the calling thread and returns the previous state.
pub fn set_bf16(enabled: bool) -> bool {
    BF16.with(|b| b.replace(enabled))
}

/// Holds bf16 autocast in a given state on the thread that made it and puts the previous state back when
/// dropped on that thread (dropped on another thread it does nothing: the switch it set is not that thread's).
#[derive(Debug)]
pub struct Bf16Guard {
    previous: bool,
    thread: std::thread::ThreadId,
}

impl Bf16Guard {
    /// Sets the calling thread's switch to `enabled` until the guard is dropped.
    pub fn new(enabled: bool) -> Self {
        Bf16Guard { previous: set_bf16(enabled), thread: std::thread::current().id() }
    }
}

impl Drop for Bf16Guard {
    fn drop(&mut self) {
        if std::thread::current().id() == self.thread {
            set_bf16(self.previous);
        }
    }
}

/// `v` rounded to the nearest bf16 value (ties to even), as an f32: the upper 16 bits of the result are the bf16.
/// Infinities stay infinite, values past bf16's largest finite one round to infinity, a NaN stays a NaN (quiet).
/// Branch-free, so that loops over slices vectorise.
#[inline(always)]
pub(crate) fn round_bf16(v: f32) -> f32 {
    let bits = v.to_bits();
    // Adding 0x7fff plus the lowest kept bit carries into the kept bits exactly when the dropped half is above the
    // midpoint, or at it with an odd kept part: round to nearest, ties to even (the carry may reach the exponent,
    // which is the correct next binade or infinity).
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
    // A NaN could lose its payload bits (and become infinity) when truncated: keep it a quiet NaN instead.
    let nan = (bits & 0xffff_0000) | 0x0040_0000;
    f32::from_bits(if v.is_nan() { nan } else { rounded })
}

/// Runs `body` compiled for AVX-512 when the CPU has it (16 lanes: the rounding passes are as long as the
/// activations and weights, and this halves their instructions against AVX2), else through a [`simd_fn!`] kernel
/// (AVX2 or the baseline). The results are the same bits on every build (integer operations and a select).
///
/// [`simd_fn!`]: super::cpu_f32::simd_fn
macro_rules! wide_fn {
    ($(#[$meta:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$meta])*
        fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn wide_body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) {
                    wide_body($($arg),*)
                }
                // use_avx2 first: tests that force the baseline build turn it off (and every AVX-512 CPU has AVX2).
                if super::cpu_f32::use_avx2() && std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F (checked just above).
                    return unsafe { avx512($($arg),*) };
                }
            }
            super::cpu_f32::simd_fn! {
                fn narrow($($arg: $ty),*) {
                    wide_body($($arg),*)
                }
            }
            narrow($($arg),*)
        }
    };
}

wide_fn! {
    /// Rounds every element of `xs` to bf16 in place ([`round_bf16`]).
    fn round_bf16_in_place_impl(xs: &mut [f32]) {
        for v in xs.iter_mut() {
            *v = round_bf16(*v);
        }
    }
}

/// Rounds every element of `xs` to bf16 in place ([`round_bf16`]), in blocks on rayon's pool when `xs` is long
/// enough (the products around it run on every thread: a rounding pass on one would take twice its share).
pub(crate) fn round_bf16_in_place(xs: &mut [f32]) {
    if parallel(xs.len()) {
        xs.par_chunks_mut(GRAIN).for_each(round_bf16_in_place_impl);
    } else {
        round_bf16_in_place_impl(xs)
    }
}

wide_fn! {
    /// `dst[i] = round_bf16(src[i])` ([`round_bf16`]) for the first `min(len)` elements, written without reading
    /// `dst` (it may be uninitialised).
    fn round_bf16_into(src: &[f32], dst: &mut [std::mem::MaybeUninit<f32>]) {
        for (d, s) in dst.iter_mut().zip(src) {
            d.write(round_bf16(*s));
        }
    }
}

/// A bf16-rounded copy of `xs`, written once (no zero-filling first: the copies are as large as the activations),
/// in blocks on rayon's pool when `xs` is long enough (as [`round_bf16_in_place`]).
pub(crate) fn rounded_bf16(xs: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(xs.len());
    let dst = &mut out.spare_capacity_mut()[..xs.len()];
    if parallel(xs.len()) {
        dst.par_chunks_mut(GRAIN).zip(xs.par_chunks(GRAIN)).for_each(|(d, s)| round_bf16_into(s, d));
    } else {
        round_bf16_into(xs, dst);
    }
    // SAFETY: round_bf16_into wrote each of the first xs.len() elements (the capacity is at least that).
    unsafe { out.set_len(xs.len()) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against candle's own conversion (half's round-to-nearest-even) on every upper-16-bit pattern with the
    /// lower halves that matter: exact, a tie, just below and above it, the largest dropped part.
    #[test]
    fn round_bf16_matches_candle_conversion_bit_for_bit() {
        let mut values = Vec::new();
        for hi in 0u32..=0xffff {
            for lo in [0u32, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1234] {
                values.push(f32::from_bits((hi << 16) | lo));
            }
        }
        let t = candle_core::Tensor::from_vec(values.clone(), values.len(), &candle_core::Device::Cpu).unwrap();
        let want: Vec<f32> =
            t.to_dtype(candle_core::DType::BF16).unwrap().to_dtype(candle_core::DType::F32).unwrap().to_vec1().unwrap();
        let mut got = values.clone();
        round_bf16_in_place(&mut got);
        let baseline = super::super::cpu_f32::baseline_only(|| rounded_bf16(&values));
        for ((v, w), (g, b)) in values.iter().zip(&want).zip(got.iter().zip(&baseline)) {
            if w.is_nan() {
                assert!(g.is_nan() && b.is_nan(), "{:#010x}: NaN must stay NaN, got {g} / {b}", v.to_bits());
            } else {
                assert_eq!(g.to_bits(), w.to_bits(), "{:#010x} ({v:e}): {g:e} vs candle {w:e}", v.to_bits());
                assert_eq!(b.to_bits(), w.to_bits(), "{:#010x}: baseline build {b:e} vs candle {w:e}", v.to_bits());
            }
        }
        // The cases by name: a tie rounds to the even neighbour, overflow goes to infinity.
        assert_eq!(round_bf16(1.0 + 2f32.powi(-8)), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        assert_eq!(round_bf16(f32::NEG_INFINITY), f32::NEG_INFINITY);
    }

    #[test]
    fn the_switch_is_per_thread_and_the_guard_restores_it() {
        assert!(!bf16_enabled());
        {
            let _g = Bf16Guard::new(true);
            assert!(bf16_enabled());
            assert!(!std::thread::spawn(bf16_enabled).join().unwrap(), "another thread keeps its own switch");
        }
        assert!(!bf16_enabled());
    }
}
