//! One bucket's gradients as a [`PiecewiseBuffer`]: the all_reduce reads each gradient tensor's storage where it
//! lies and writes the averages straight into the new gradient tensors, so the bucket is never packed into a
//! flat buffer nor unpacked from one. On the CPU backend's shared-memory path that halves the bucket's memory
//! traffic (docs/benchmarks.md, "Where the MLP's 2-process step goes"); other paths pack into the process
//! group's scratch buffer ([`crate::Backend::all_reduce_piecewise`]'s default).

use super::flat;
use crate::backend::PiecewiseBuffer;
use crate::dtype::with_element_type;
use crate::{DType, DdpError, Element, Result};
use candle_core::{Device, Shape, Tensor, WithDType};
use std::mem::MaybeUninit;
use std::ops::Range;

/// The bucket's gradients, read in place, and the averages' new storage.
pub(crate) struct BucketPieces {
    dtype: DType,
    len: usize,
    /// Per parameter, in bucket order: its bytes in the bucket, and its gradient (a contiguous CPU tensor of the
    /// bucket's dtype) or `None` where this rank has none (read as zeros).
    inputs: Vec<(Range<usize>, Option<Tensor>)>,
    /// Per parameter: where its average goes, `None` for a parameter no rank used (its bytes are dropped).
    outputs: Vec<Option<Box<dyn Output + Send>>>,
    /// Zeros for the parameters without a gradient on this rank (as long as the largest of them).
    zeros: Vec<u8>,
}

impl BucketPieces {
    /// `params[i] = (bytes in the bucket, gradient on this rank, whether some rank used it)`, in bucket order.
    /// Gradients of another dtype than `dtype`, strided ones and device ones are converted to contiguous CPU
    /// tensors of `dtype` first (one copy, as packing them did).
    pub fn new(dtype: DType, params: Vec<(Range<usize>, Option<&Tensor>, bool)>) -> Result<Self> {
        let len = params.last().map_or(0, |(r, _, _)| r.end);
        let (mut inputs, mut outputs, mut zeros_len) = (Vec::new(), Vec::new(), 0);
        for (range, grad, used) in params {
            let input = match grad {
                Some(g) => Some(flat::readable(g, dtype)?),
                None => {
                    zeros_len = zeros_len.max(range.len());
                    None
                }
            };
            let elems = range.len() / dtype.size_in_bytes();
            outputs.push(
                used.then(
                    || with_element_type!(dtype, T => Box::new(Typed::<T>::new(elems)) as Box<dyn Output + Send>),
                ),
            );
            inputs.push((range, input));
        }
        Ok(Self { dtype, len, inputs, outputs, zeros: vec![0; zeros_len] })
    }

    /// The averaged gradient of the bucket's `i`-th parameter (`None` for one no rank used), once the all_reduce
    /// wrote every byte; an error if it did not (a backend that broke [`PiecewiseBuffer`]'s contract).
    pub fn take(&mut self, i: usize, shape: &Shape, device: &Device) -> Result<Option<Tensor>> {
        let Some(out) = self.outputs[i].take() else { return Ok(None) };
        let t = out.into_tensor(shape)?;
        Ok(Some(if device.is_cpu() { t } else { t.to_device(device)? }))
    }
}

/// The parameters (indices into `inputs`, whose byte ranges follow each other) that overlap `range`, with the
/// overlap; parameters of no bytes overlap nothing.
fn overlapping(
    inputs: &[(Range<usize>, Option<Tensor>)],
    range: Range<usize>,
) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
    let first = inputs.partition_point(|(r, _)| r.end <= range.start);
    inputs[first..]
        .iter()
        .enumerate()
        .take_while(move |(_, (r, _))| r.start < range.end)
        .map(move |(k, (r, _))| (first + k, r.start.max(range.start)..r.end.min(range.end)))
        .filter(|(_, overlap)| !overlap.is_empty())
}

impl PiecewiseBuffer for BucketPieces {
    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, range: Range<usize>, f: &mut dyn FnMut(usize, &[u8])) {
        for (i, overlap) in overlapping(&self.inputs, range) {
            let (param, grad) = &self.inputs[i];
            let local = overlap.start - param.start..overlap.end - param.start;
            match grad {
                Some(g) => flat::with_bytes(g, self.dtype, |bytes| f(overlap.start, &bytes[local])),
                None => f(overlap.start, &self.zeros[..local.len()]),
            }
        }
    }

    fn write(&mut self, offset: usize, src: &[u8]) {
        let Self { inputs, outputs, .. } = self;
        for (i, overlap) in overlapping(inputs, offset..offset + src.len()) {
            if let Some(out) = &mut outputs[i] {
                let at = overlap.start - inputs[i].0.start;
                out.write(at, &src[overlap.start - offset..overlap.end - offset]);
            }
        }
    }
}

/// Where one parameter's average is written, in order, before it becomes a tensor.
trait Output {
    /// Bytes `at..at + src.len()` of the parameter; `at` must be where the previous write ended.
    fn write(&mut self, at: usize, src: &[u8]);
    /// The tensor, once every byte is written.
    fn into_tensor(self: Box<Self>, shape: &Shape) -> Result<Tensor>;
}

/// A `Vec<T>` filled front to back without being zeroed first (the all_reduce writes every byte, in order).
struct Typed<T> {
    /// Empty, with room for `n` elements.
    elems: Vec<T>,
    n: usize,
    /// Bytes written so far, from the start.
    filled: usize,
}

impl<T: Element + WithDType> Typed<T> {
    fn new(n: usize) -> Self {
        Self { elems: Vec::with_capacity(n), n, filled: 0 }
    }
}

impl<T: Element + WithDType> Output for Typed<T> {
    fn write(&mut self, at: usize, src: &[u8]) {
        assert_eq!(at, self.filled, "all_reduce_piecewise wrote a parameter's bytes out of order");
        let spare: &mut [MaybeUninit<T>] = &mut self.elems.spare_capacity_mut()[..self.n];
        let total = std::mem::size_of_val(spare);
        assert!(at + src.len() <= total, "all_reduce_piecewise wrote past a parameter's end");
        // SAFETY: `spare` is the first `n` elements of the vector's allocation (its length is 0 until
        // `into_tensor`), `total` bytes; the copy stays within it (asserted) and the source is another allocation.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), (spare.as_mut_ptr() as *mut u8).add(at), src.len()) };
        self.filled += src.len();
    }

    fn into_tensor(mut self: Box<Self>, shape: &Shape) -> Result<Tensor> {
        let n = self.n;
        if self.filled != n * std::mem::size_of::<T>() {
            return Err(DdpError::InvalidArgument(format!(
                "all_reduce_piecewise: the backend wrote {} of a gradient's {} bytes (a backend bug)",
                self.filled,
                n * std::mem::size_of::<T>()
            )));
        }
        // SAFETY: all `n` elements were written (bytes `0..filled` in order, `filled` = n · size_of::<T>()), and
        // every bit pattern is a valid `T` (a `Pod` element type).
        unsafe { self.elems.set_len(n) };
        Ok(Tensor::from_vec(std::mem::take(&mut self.elems), shape, &Device::Cpu)?)
    }
}
