//! Fused training ops for candle with their own backward pass — what `torch.nn.functional` gives a PyTorch user:
//! one kernel forward and one kernel backward where candle composes several ops (each of which allocates its
//! output, and each of whose gradients candle accumulates into a zero-filled buffer).
//!
//! - [`linear`]: `y = act(x · wᵀ + b)` with ReLU/none fused; skips the input gradient when `x` needs none.
//! - [`cross_entropy`]: mean negative log-likelihood of `log_softmax(logits)` in one pass; backward `softmax − onehot`.
//! - [`layer_norm`]: LayerNorm over the last dimension with its analytic backward.
//! - [`softmax`]: softmax over the last dimension (optionally scaled and causally masked) with its backward.
//! - [`activation`]: GELU (tanh approximation, as candle's `gelu`) with a one-pass backward.
//! - [`attention`]: causal self-attention over heads laid side by side, `softmax(q kᵀ · scale + mask) v`, in one op.
//! - [`autocast`]: bf16 autocast on the CPU (f32 tensors, [`linear`]'s products on bf16-rounded operands), per thread.
//!
//! Every op has a *fast path* (CPU, f32, contiguous where it matters) implemented as candle custom ops, and falls
//! back to candle's own composed ops elsewhere (CUDA, bf16/f16, f64), so the results are the same op for op within
//! f32 rounding. The fast path can be switched off process-wide with [`set_fused_ops`] or the environment variable
//! `ACCEL_FUSED_OPS=0` (to compare, or to rule the fused kernels out when debugging).
//!
//! Invariant: only this module knows which kernels are fused; callers (the examples' models, the tensor-parallel
//! layers, the Trainer's losses) call these functions and never branch on the device or the switch themselves.

use std::sync::atomic::{AtomicU8, Ordering};

pub mod activation;
pub mod attention;
pub mod autocast;
mod cpu;
/// f32 CPU kernel helpers; `optim`'s AdamW pass uses `simd_fn!` too.
pub(crate) mod cpu_f32;
pub mod cross_entropy;
pub mod layer_norm;
pub mod linear;
pub mod softmax;

/// 0: not decided yet (read `ACCEL_FUSED_OPS` on first use), 1: on, 2: off.
static FUSED_OPS: AtomicU8 = AtomicU8::new(0);

/// Environment variable that turns the fused fast paths off when set to `0`, `false` or `off`.
pub const FUSED_OPS_ENV: &str = "ACCEL_FUSED_OPS";

/// Whether the fused fast paths are in use (default: yes, unless `ACCEL_FUSED_OPS` is `0`, `false` or `off`).
pub fn fused_ops_enabled() -> bool {
    match FUSED_OPS.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            let off = std::env::var(FUSED_OPS_ENV)
                .map(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "false" | "off"))
                .unwrap_or(false);
            // A concurrent set_fused_ops wins: only replace the undecided state.
            let _ = FUSED_OPS.compare_exchange(0, if off { 2 } else { 1 }, Ordering::Relaxed, Ordering::Relaxed);
            FUSED_OPS.load(Ordering::Relaxed) == 1
        }
    }
}

/// Turns the fused fast paths on or off for the whole process (overrides `ACCEL_FUSED_OPS`). Meant for
/// benchmarks and tests that compare both paths in one run; a training run should not flip it mid-step.
pub fn set_fused_ops(enabled: bool) {
    FUSED_OPS.store(if enabled { 1 } else { 2 }, Ordering::Relaxed);
}
