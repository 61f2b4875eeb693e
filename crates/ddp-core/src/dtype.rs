//! Element types that collectives move and reduce, and the reduction operators.
//!
//! Collectives work on plain slices of [`Element`] types. Backends move bytes; [`reduce_into`] is the one
//! place that turns bytes back into typed values and combines them, so every backend reduces the same way.

use half::{bf16, f16};

/// Reduction operator of `all_reduce` / `reduce_scatter`, as in `torch.distributed.ReduceOp`.
///
/// `Avg` divides the sum by the group size after the reduction (integer types: truncating division).
/// Example, two ranks holding `[1, 2]` and `[3, 4]`: `Sum` → `[4, 6]`, `Avg` → `[2, 3]`, `Max` → `[3, 4]`,
/// `Min` → `[1, 2]`, `Product` → `[3, 8]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the group (sum, then divide by world size).
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
    /// Element-wise product.
    Product,
}

impl ReduceOp {
    /// The operator to combine two partial values with (`Avg` combines as `Sum`).
    pub fn combining(self) -> ReduceOp {
        match self {
            ReduceOp::Avg => ReduceOp::Sum,
            op => op,
        }
    }

    /// Stable wire code.
    pub fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Product => 4,
        }
    }
}

/// Data type tag carried next to byte buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// 8-bit unsigned integer.
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Stable wire code.
    pub fn code(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::F64 => 1,
            DType::F16 => 2,
            DType::BF16 => 3,
            DType::I32 => 4,
            DType::I64 => 5,
            DType::U8 => 6,
        }
    }

    /// The matching candle dtype, where candle has one (`i32` has none in candle 0.11's CPU tensors it does; see docs).
    pub fn to_candle(self) -> Option<candle_core::DType> {
        use candle_core::DType as C;
        Some(match self {
            DType::F32 => C::F32,
            DType::F64 => C::F64,
            DType::F16 => C::F16,
            DType::BF16 => C::BF16,
            DType::I64 => C::I64,
            DType::U8 => C::U8,
            DType::I32 => C::I32,
        })
    }

    /// The ddp-core dtype for a candle dtype; `None` for types collectives do not support.
    pub fn from_candle(d: candle_core::DType) -> Option<DType> {
        use candle_core::DType as C;
        Some(match d {
            C::F32 => DType::F32,
            C::F64 => DType::F64,
            C::F16 => DType::F16,
            C::BF16 => DType::BF16,
            C::I64 => DType::I64,
            C::U8 => DType::U8,
            C::I32 => DType::I32,
            _ => return None,
        })
    }
}

/// A type collectives can carry: plain old data with a reduction.
pub trait Element: bytemuck::Pod + Send + Sync + std::fmt::Debug + 'static {
    /// Its dtype tag.
    const DTYPE: DType;
    /// `acc = op(acc, x)` element-wise (`op` is never `Avg` here: see [`ReduceOp::combining`]).
    fn combine(acc: &mut [Self], x: &[Self], op: ReduceOp);
    /// Divides every element by `n` (the last step of `Avg`).
    fn divide(acc: &mut [Self], n: usize);
}

macro_rules! float_element {
    ($t:ty, $tag:expr, $to:expr, $from:expr) => {
        impl Element for $t {
            const DTYPE: DType = $tag;
            fn combine(acc: &mut [Self], x: &[Self], op: ReduceOp) {
                debug_assert_eq!(acc.len(), x.len());
                let to = $to;
                let from = $from;
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => {
                        acc.iter_mut().zip(x).for_each(|(a, b)| *a = from(to(*a) + to(*b)))
                    }
                    ReduceOp::Product => acc.iter_mut().zip(x).for_each(|(a, b)| *a = from(to(*a) * to(*b))),
                    ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, b)| *a = from(to(*a).max(to(*b)))),
                    ReduceOp::Min => acc.iter_mut().zip(x).for_each(|(a, b)| *a = from(to(*a).min(to(*b)))),
                }
            }
            fn divide(acc: &mut [Self], n: usize) {
                let to = $to;
                let from = $from;
                let n = n as f64;
                acc.iter_mut().for_each(|a| *a = from((to(*a) as f64 / n) as _));
            }
        }
    };
}

float_element!(f32, DType::F32, |v: f32| v, |v: f32| v);
float_element!(f64, DType::F64, |v: f64| v, |v: f64| v);
// Half types reduce in f32 and round once per combine, like Gloo/NCCL do per hop.
float_element!(f16, DType::F16, |v: f16| v.to_f32(), f16::from_f32);
float_element!(bf16, DType::BF16, |v: bf16| v.to_f32(), bf16::from_f32);

macro_rules! int_element {
    ($t:ty, $tag:expr) => {
        impl Element for $t {
            const DTYPE: DType = $tag;
            fn combine(acc: &mut [Self], x: &[Self], op: ReduceOp) {
                debug_assert_eq!(acc.len(), x.len());
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.wrapping_add(*b)),
                    ReduceOp::Product => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.wrapping_mul(*b)),
                    ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, b)| *a = (*a).max(*b)),
                    ReduceOp::Min => acc.iter_mut().zip(x).for_each(|(a, b)| *a = (*a).min(*b)),
                }
            }
            fn divide(acc: &mut [Self], n: usize) {
                acc.iter_mut().for_each(|a| *a /= n as $t);
            }
        }
    };
}

int_element!(i32, DType::I32);
int_element!(i64, DType::I64);
int_element!(u8, DType::U8);

/// Calls `$body` with `$T` bound to the Rust element type of a ddp-core [`DType`] (`$dtype`). Every such type is
/// an [`Element`] and a candle `WithDType`. The one dtype dispatch of the crate (buffers, DDP flat buckets, tensor
/// collectives): a new [`DType`] variant is added here once.
macro_rules! with_element_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::F16 => {
                type $T = ::half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = ::half::bf16;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
        }
    };
}
pub(crate) use with_element_type;

/// `acc = op(acc, x)` on byte buffers holding `dtype` elements. Both buffers must hold whole elements.
/// Unaligned buffers are handled (copied through an aligned scratch), aligned ones are reduced in place.
pub fn reduce_into(dtype: DType, op: ReduceOp, acc: &mut [u8], x: &[u8]) {
    assert_eq!(acc.len(), x.len(), "reduce_into: buffer lengths differ");
    with_element_type!(dtype, T => {
        match (bytemuck::try_cast_slice_mut::<u8, T>(acc), bytemuck::try_cast_slice::<u8, T>(x)) {
            (Ok(a), Ok(b)) => T::combine(a, b, op.combining()),
            (Ok(a), Err(_)) => {
                let b: Vec<T> = bytemuck::pod_collect_to_vec(x);
                T::combine(a, &b, op.combining())
            }
            (Err(_), _) => {
                let mut a: Vec<T> = bytemuck::pod_collect_to_vec(acc);
                let b: Vec<T> = bytemuck::pod_collect_to_vec(x);
                T::combine(&mut a, &b, op.combining());
                acc.copy_from_slice(bytemuck::cast_slice(&a));
            }
        }
    })
}

/// Divides every `dtype` element of `buf` by `n` (the final step of [`ReduceOp::Avg`]).
pub fn divide_in_place(dtype: DType, buf: &mut [u8], n: usize) {
    with_element_type!(dtype, T => {
        match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
            Ok(a) => T::divide(a, n),
            Err(_) => {
                let mut a: Vec<T> = bytemuck::pod_collect_to_vec(buf);
                T::divide(&mut a, n);
                buf.copy_from_slice(bytemuck::cast_slice(&a));
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_rank_example_from_the_docs() {
        for (op, want) in [
            (ReduceOp::Sum, [4.0f32, 6.0]),
            (ReduceOp::Max, [3.0, 4.0]),
            (ReduceOp::Min, [1.0, 2.0]),
            (ReduceOp::Product, [3.0, 8.0]),
        ] {
            let mut a = [1.0f32, 2.0];
            f32::combine(&mut a, &[3.0, 4.0], op);
            assert_eq!(a, want, "{op:?}");
        }
        let mut a = [4.0f32, 6.0];
        f32::divide(&mut a, 2);
        assert_eq!(a, [2.0, 3.0]);
    }

    #[test]
    fn unaligned_bytes_reduce_like_typed() {
        let a = [1.5f32, -2.0, 3.25];
        let b = [0.5f32, 4.0, -1.0];
        let mut buf = [0u8; 13];
        buf[1..].copy_from_slice(bytemuck::cast_slice(&a));
        let bb: Vec<u8> = bytemuck::cast_slice(&b).to_vec();
        reduce_into(DType::F32, ReduceOp::Sum, &mut buf[1..], &bb);
        let got: Vec<f32> = bytemuck::pod_collect_to_vec(&buf[1..]);
        assert_eq!(got, vec![2.0, 2.0, 2.25]);
    }
}
