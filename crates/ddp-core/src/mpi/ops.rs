//! ddp-core dtypes and reduction operators as MPI datatypes and `MPI_Op`s.
//!
//! MPI has no 16-bit float types, so f16/bf16 travel as `MPI_UINT16_T` and reduce with user-defined operators
//! (`MPI_Op_create`) that call ddp-core's own kernels ([`crate::dtype::reduce_into`]: f32 accumulation, one
//! rounding per combine, as the CPU backend). `Avg` is `MPI_SUM` followed by a division by the group size on each
//! rank (integer types: truncating), as the CPU backend does.

use crate::dtype::reduce_into;
use crate::{DType, ReduceOp};
use mpi::ffi;
use std::ffi::{c_int, c_void};

/// The MPI datatype that carries `dtype` (16-bit floats as `MPI_UINT16_T`).
pub(crate) fn datatype(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading link-time constants exported by mpi-sys's C shim.
    unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::U8 => ffi::RSMPI_UINT8_T,
        }
    }
}

/// The byte datatype (broadcast, all_gather, send/recv move bytes).
pub(crate) fn byte_type() -> ffi::MPI_Datatype {
    // SAFETY: as above.
    unsafe { ffi::RSMPI_UINT8_T }
}

/// An `MPI_Op` for one reduction; user-defined ones are freed on drop.
pub(crate) struct MpiOp {
    raw: ffi::MPI_Op,
    user_defined: bool,
}

impl MpiOp {
    /// The operator combining partial values of `op` on `dtype` (`Avg` combines as `Sum`).
    pub(crate) fn new(op: ReduceOp, dtype: DType) -> Result<Self, i32> {
        let op = op.combining();
        if matches!(dtype, DType::F16 | DType::BF16) {
            let f: unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_int, *mut ffi::MPI_Datatype) =
                match (dtype, op) {
                    (DType::F16, ReduceOp::Sum) => half_op::<0, 0>,
                    (DType::F16, ReduceOp::Max) => half_op::<0, 2>,
                    (DType::F16, ReduceOp::Min) => half_op::<0, 3>,
                    (DType::F16, _) => half_op::<0, 4>,
                    (_, ReduceOp::Sum) => half_op::<1, 0>,
                    (_, ReduceOp::Max) => half_op::<1, 2>,
                    (_, ReduceOp::Min) => half_op::<1, 3>,
                    (_, _) => half_op::<1, 4>,
                };
            let mut raw = std::mem::MaybeUninit::<ffi::MPI_Op>::uninit();
            // SAFETY: `f` has MPI_User_function's signature and never unwinds; `raw` is a valid out-pointer.
            let rc = unsafe { ffi::MPI_Op_create(Some(f), 1, raw.as_mut_ptr()) };
            if rc != 0 {
                return Err(rc);
            }
            // SAFETY: initialised by the successful MPI_Op_create.
            return Ok(MpiOp { raw: unsafe { raw.assume_init() }, user_defined: true });
        }
        // SAFETY: reading link-time constants.
        let raw = unsafe {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => ffi::RSMPI_SUM,
                ReduceOp::Product => ffi::RSMPI_PROD,
                ReduceOp::Max => ffi::RSMPI_MAX,
                ReduceOp::Min => ffi::RSMPI_MIN,
            }
        };
        Ok(MpiOp { raw, user_defined: false })
    }

    pub(crate) fn raw(&self) -> ffi::MPI_Op {
        self.raw
    }
}

impl Drop for MpiOp {
    fn drop(&mut self) {
        if self.user_defined {
            // SAFETY: created by MPI_Op_create and no longer used by any pending operation (calls are blocking).
            unsafe { ffi::MPI_Op_free(&mut self.raw) };
        }
    }
}

/// MPI user function for 16-bit floats: `inout = in ∘ inout` element-wise. `H` 0 = f16, 1 = bf16; `OP` is
/// [`ReduceOp::code`] (0 sum, 2 max, 3 min, 4 product).
unsafe extern "C" fn half_op<const H: u8, const OP: u8>(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    _datatype: *mut ffi::MPI_Datatype,
) {
    let n = (*len).max(0) as usize * 2;
    // SAFETY: MPI passes two buffers of `len` elements of the 2-byte datatype; they do not overlap.
    let x = std::slice::from_raw_parts(invec as *const u8, n);
    let acc = std::slice::from_raw_parts_mut(inoutvec as *mut u8, n);
    let dtype = if H == 0 { DType::F16 } else { DType::BF16 };
    let op = match OP {
        0 => ReduceOp::Sum,
        2 => ReduceOp::Max,
        3 => ReduceOp::Min,
        _ => ReduceOp::Product,
    };
    // reduce_into handles unaligned buffers and cannot panic for equal lengths; never unwind into C anyway.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| reduce_into(dtype, op, acc, x)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn half_user_function_combines_like_the_cpu_kernels() {
        let a: Vec<bf16> = [1.0f32, 2.5, -3.0].iter().map(|&v| bf16::from_f32(v)).collect();
        let mut b: Vec<bf16> = [0.5f32, 4.0, 7.0].iter().map(|&v| bf16::from_f32(v)).collect();
        let mut len: c_int = 3;
        // SAFETY: two buffers of 3 bf16 values, as MPI would pass them.
        unsafe {
            half_op::<1, 2>(a.as_ptr() as *mut c_void, b.as_mut_ptr() as *mut c_void, &mut len, std::ptr::null_mut())
        };
        let got: Vec<f32> = b.iter().map(|v| v.to_f32()).collect();
        assert_eq!(got, vec![1.0, 4.0, 7.0]);
    }
}
