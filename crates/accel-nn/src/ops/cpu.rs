//! What the fused ops' CPU kernels share: reading f32 storage through a layout as a matrix of rows, and the one
//! call into the `gemm` crate (the kernel candle's own CPU matmul uses, so products match candle's within f32
//! rounding). Private to `nn`.

use candle_core::{CpuStorage, Layout, Result, Storage, Tensor};

/// A tensor `[d0, …, d_{r−2}, cols]` seen as a matrix of `rows = d0·…·d_{r−2}` rows: element `(i, j)` sits at
/// `offset + i·rs + j·cs` of the storage. Only exists when the leading dimensions merge into one strided
/// dimension (true of any contiguous tensor, and of a transposed 2-D one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowsView {
    pub rows: usize,
    pub cols: usize,
    pub offset: usize,
    pub rs: usize,
    pub cs: usize,
}

impl RowsView {
    /// The view of `layout`, or `None` when its leading dimensions do not merge (the caller copies the tensor
    /// with `contiguous()` first) or when it has rank 0.
    pub fn of(layout: &Layout) -> Option<RowsView> {
        let dims = layout.dims();
        let stride = layout.stride();
        let r = dims.len();
        if r == 0 {
            return None;
        }
        let cols = dims[r - 1];
        let cs = stride[r - 1];
        let rows: usize = dims[..r - 1].iter().product();
        let rs = if r >= 2 { stride[r - 2] } else { cols * cs };
        // Leading dims merge when each one steps over exactly the one below it (size-1 dims step anywhere).
        for i in 0..r.saturating_sub(2) {
            if dims[i] != 1 && stride[i] != stride[i + 1] * dims[i + 1] {
                return None;
            }
        }
        Some(RowsView { rows, cols, offset: layout.start_offset(), rs, cs })
    }

    /// Whether rows are packed one after the other with unit column stride (element `(i, j)` at `i·cols + j`).
    pub fn is_packed(&self) -> bool {
        (self.cs == 1 || self.cols <= 1) && (self.rs == self.cols || self.rows <= 1)
    }

    /// Element `(i, j)` of `data`.
    #[inline]
    pub fn at<T: Copy>(&self, data: &[T], i: usize, j: usize) -> T {
        data[self.offset + i * self.rs + j * self.cs]
    }
}

/// Whether the tensor's leading dimensions merge into rows (see [`RowsView`]).
pub(crate) fn has_rows_view(t: &Tensor) -> bool {
    RowsView::of(t.layout()).is_some()
}

/// The f32 slice of a CPU storage, or an error naming the op and the dtype it got.
pub(crate) fn f32_slice<'a>(s: &'a CpuStorage, op: &str, what: &str) -> Result<&'a [f32]> {
    match s {
        CpuStorage::F32(v) => Ok(v),
        other => candle_core::bail!(
            "{op}: {what} must be f32 on this path, got {:?}",
            candle_core::backend::BackendStorage::dtype(other)
        ),
    }
}

/// Runs `f` on the f32 CPU storage of `t` and its layout (the storage stays read-locked meanwhile).
pub(crate) fn with_f32<R>(t: &Tensor, op: &str, what: &str, f: impl FnOnce(&[f32], &Layout) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(f32_slice(s, op, what)?, layout),
        _ => candle_core::bail!("{op}: {what} must be on the CPU on this path"),
    }
}

/// A strided matrix operand of [`gemm_new`] and [`gemm_into`]: `ptr[offset + i·rs + j·cs]` is element `(i, j)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MatRef<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// The matrix of `view` over `data`.
    pub fn rows(data: &'a [f32], view: &RowsView) -> Self {
        MatRef { data, offset: view.offset, rs: view.rs, cs: view.cs }
    }

    /// The transpose (swapped strides, no copy: `gemm` packs its operands whatever their strides).
    pub fn t(self) -> Self {
        MatRef { rs: self.cs, cs: self.rs, ..self }
    }

    /// Index of the last element `(m−1, n−1)` + 1 relative to the slice, to check bounds before handing raw
    /// pointers to `gemm`.
    fn end(&self, m: usize, n: usize) -> usize {
        if m == 0 || n == 0 {
            self.offset
        } else {
            self.offset + (m - 1) * self.rs + (n - 1) * self.cs + 1
        }
    }
}

/// The destination of [`gemm_into`]: element `(i, j)` at `data[offset + i·rs + j]` (rows of unit column stride,
/// `rs` apart — a column block of a wider row-major matrix, such as one attention head's columns).
#[derive(Debug)]
pub(crate) struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub offset: usize,
    pub rs: usize,
}

/// `a[m×k] · b[k×n]` into a new packed row-major `m×n` buffer, on candle's thread count (`RAYON_NUM_THREADS`), as
/// candle's own matmul. The buffer is not zero-filled first: the product writes every element (a memset of the
/// output was 3–5 % of a small GPT's training step).
///
/// Panics (a bug in the caller, not bad user input) if an operand's strides reach past its slice.
pub(crate) fn gemm_new(a: MatRef<'_>, b: MatRef<'_>, m: usize, n: usize, k: usize) -> Vec<f32> {
    let len = m * n;
    if len == 0 || k == 0 {
        return vec![0f32; len];
    }
    assert!(a.end(m, k) <= a.data.len() && b.end(k, n) <= b.data.len(), "gemm: operand strides out of bounds");
    let mut out: Vec<f32> = Vec::with_capacity(len);
    // SAFETY: the operands' bounds were checked above; `out` has capacity for the m×n packed elements the product
    // writes without reading them (read_dst false), so every element is initialised before `set_len`.
    unsafe {
        gemm_raw(out.as_mut_ptr(), n, a, b, m, n, k, false, candle_core::utils::get_num_threads());
        out.set_len(len);
    }
    out
}

/// `dst[m×n] = a[m×k] · b[k×n]` (`accumulate = false`) or `dst += a · b` (`accumulate = true`) into a strided
/// destination, on the calling thread only (for products inside a task that is already one of several in
/// parallel, such as one attention head). Without `accumulate` the destination is only written, never read (it may
/// hold anything before).
///
/// Panics (a bug in the caller) if an operand's or the destination's strides reach past its slice.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_into(dst: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, m: usize, n: usize, k: usize, accumulate: bool) {
    let dst_end = if m == 0 || n == 0 { dst.offset } else { dst.offset + (m - 1) * dst.rs + n };
    assert!(dst_end <= dst.data.len() && (m <= 1 || dst.rs >= n), "gemm: destination strides out of bounds");
    assert!(a.end(m, k) <= a.data.len() && b.end(k, n) <= b.data.len(), "gemm: operand strides out of bounds");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                dst.data[dst.offset + i * dst.rs..][..n].fill(0.0);
            }
        }
        return;
    }
    // SAFETY: the bounds of every element the product reads (a: m×k, b: k×n) and writes (dst: m rows of n, rs
    // apart, rs ≥ n so rows do not overlap) were checked above; the slices outlive the call and dst does not alias
    // a or b (it is a &mut).
    unsafe { gemm_raw(dst.data.as_mut_ptr().add(dst.offset), dst.rs, a, b, m, n, k, accumulate, 1) }
}

/// The one call into `gemm`: `dst[m×n]` (rows `rs` apart, unit column stride) `= a · b`, or `+=` with `accumulate`.
///
/// # Safety
/// `dst` must be valid for writes (and, with `accumulate`, reads) of `m` rows of `n` elements `rs ≥ n` apart, not
/// aliasing `a` or `b`; the operands' strides must stay inside their slices; `k ≥ 1`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_raw(
    dst: *mut f32,
    rs: usize,
    a: MatRef<'_>,
    b: MatRef<'_>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    threads: usize,
) {
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the caller's contract above.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            rs as isize,
            accumulate,
            a.data.as_ptr().add(a.offset),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().add(b.offset),
            b.cs as isize,
            b.rs as isize,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}
