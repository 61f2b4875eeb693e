//! Shared plumbing of the fused CPU kernels: when the fast path applies, the f32 slice behind a candle storage,
//! row-parallel loops over rayon, and a vectorisable sum.
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
const GRAIN: usize = 32 * 1024;

/// Rows per task for rows of `row_len` elements (at least one row).
fn rows_per_task(row_len: usize) -> usize {
    (GRAIN / row_len.max(1)).max(1)
}

/// Whether `len` elements are worth splitting over rayon's threads.
fn parallel(len: usize) -> bool {
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
#[inline]
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
#[inline]
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
