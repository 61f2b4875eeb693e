//! Flat buffers: several tensors of one dtype copied into one contiguous, 8-byte aligned byte buffer (a bucket)
//! and back: what the parameter broadcast at construction sends (gradients go as pieces: `pieces`). The buffer is
//! `Vec<u64>` underneath so it can be viewed as any element type collectives carry.

use crate::dtype::with_element_type;
use crate::{DType, DdpError, Result};
use candle_core::{Device, Shape, Storage, Tensor};

/// An 8-byte aligned byte buffer of `len` bytes, reused across steps.
#[derive(Debug, Default)]
pub(crate) struct FlatBuffer {
    words: Vec<u64>,
    len: usize,
}

impl FlatBuffer {
    /// Resizes to `len` bytes (contents unspecified; callers overwrite every byte they use).
    pub fn resize(&mut self, len: usize) {
        let words = len.div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        self.len = len;
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(self.words.as_mut_slice())[..self.len]
    }

    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(self.words.as_slice())[..self.len]
    }
}

/// Copies `t` (any layout, any device; `elem_count` elements of `dtype`) into `dst`, which holds exactly
/// `t.elem_count()` elements' bytes. Contiguous CPU tensors are copied straight from their storage.
pub(crate) fn copy_in(t: &Tensor, dtype: DType, dst: &mut [u8]) -> Result<()> {
    with_bytes(&readable(t, dtype)?, dtype, |bytes| dst.copy_from_slice(bytes));
    Ok(())
}

/// `g` as a contiguous CPU tensor of `dtype`: itself when it is one already (no copy), else converted (another
/// dtype, strided, or on a device: one copy each).
pub(crate) fn readable(g: &Tensor, dtype: DType) -> Result<Tensor> {
    let g = if DType::from_candle(g.dtype()) == Some(dtype) {
        g.clone()
    } else {
        let want = dtype.to_candle().ok_or_else(|| {
            DdpError::InvalidArgument(format!(
                "DDP: a tensor of dtype {:?} in a bucket of {dtype:?}, which candle has no dtype for",
                g.dtype()
            ))
        })?;
        g.to_dtype(want)?
    };
    let ready = {
        let (storage, layout) = g.storage_and_layout();
        matches!(&*storage, Storage::Cpu(_)) && layout.contiguous_offsets().is_some()
    };
    if ready {
        return Ok(g);
    }
    Ok(g.flatten_all()?.to_device(&Device::Cpu)?.contiguous()?)
}

/// Calls `f` with the bytes of `g` in its storage; `g` is a tensor [`readable`] returned for `dtype`.
pub(crate) fn with_bytes(g: &Tensor, dtype: DType, f: impl FnOnce(&[u8])) {
    let (storage, layout) = g.storage_and_layout();
    let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) else {
        unreachable!("`readable` returns contiguous CPU tensors only");
    };
    with_element_type!(dtype, T => {
        let elems = cpu.as_slice::<T>().expect("`readable` converted the tensor to the bucket's dtype");
        f(bytemuck::cast_slice(&elems[start..end]))
    })
}

/// A new tensor of `shape` on `device` holding `src`'s `dtype` elements.
pub(crate) fn tensor_from(src: &[u8], dtype: DType, shape: &Shape, device: &Device) -> Result<Tensor> {
    with_element_type!(dtype, T => Ok(Tensor::from_slice(bytemuck::cast_slice::<u8, T>(src), shape, device)?))
}

/// The ddp-core dtype of a parameter, or an error naming it when collectives cannot carry that dtype.
pub(crate) fn dtype_of(name: &str, t: &Tensor) -> Result<DType> {
    DType::from_candle(t.dtype()).ok_or_else(|| {
        DdpError::InvalidArgument(format!(
            "DDP: parameter `{name}` has dtype {:?}, which collectives do not support (use f32, f64, f16, bf16, \
             i32, i64 or u8)",
            t.dtype()
        ))
    })
}
