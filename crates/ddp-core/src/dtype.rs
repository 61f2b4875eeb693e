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
    ($t:ty, $tag:expr, $to:expr, $from:expr, $compute:ty) => {
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
                if n.is_power_of_two() {
                    // x / 2^k and x · 2^-k are the same real number, each rounded once: the same bits as the
                    // division below (tested; 2^-k ≥ 2^-63 is exact in f32 and f64). The multiply vectorises; the
                    // division through f64 took 3× the time of the add before it in the 2-rank all_reduce (perf).
                    let inv = 1.0 / n as f64;
                    acc.iter_mut().for_each(|a| *a = from(to(*a) * inv as $compute));
                    return;
                }
                let n = n as f64;
                acc.iter_mut().for_each(|a| *a = from((to(*a) as f64 / n) as _));
            }
        }
    };
}

float_element!(f32, DType::F32, |v: f32| v, |v: f32| v, f32);
float_element!(f64, DType::F64, |v: f64| v, |v: f64| v, f64);
// Half types reduce in f32 and round once per combine, like Gloo/NCCL do per hop.
float_element!(f16, DType::F16, |v: f16| v.to_f32(), f16::from_f32, f32);
float_element!(bf16, DType::BF16, |v: bf16| v.to_f32(), bf16::from_f32, f32);

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

/// `out = op(a, b)`, then divided by `divide_by` when given (the last combine of [`ReduceOp::Avg`]): the same
/// bits as copying `a` into `out`, [`reduce_into`] and [`divide_in_place`], in one pass over memory (the three
/// run chunk by chunk on data in L1). All three buffers hold whole `dtype` elements and have one length.
pub fn combine_into(dtype: DType, op: ReduceOp, out: &mut [u8], a: &[u8], b: &[u8], divide_by: Option<usize>) {
    assert!(out.len() == a.len() && a.len() == b.len(), "combine_into: buffer lengths differ");
    // 4 KiB: a whole number of elements of every dtype, and three chunks fit in L1 together.
    const CHUNK: usize = 4096;
    for ((o, a), b) in out.chunks_mut(CHUNK).zip(a.chunks(CHUNK)).zip(b.chunks(CHUNK)) {
        o.copy_from_slice(a);
        reduce_into(dtype, op, o, b);
        if let Some(n) = divide_by {
            divide_in_place(dtype, o, n);
        }
    }
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

    #[test]
    fn combine_into_has_the_bits_of_copy_reduce_divide() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        // Lengths around the 4 KiB chunk, in bytes of every dtype; random bytes cover every bit pattern kind
        // (NaNs, infinities, subnormals) for the float types.
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8] {
            let es = dtype.size_in_bytes();
            for elems in [1usize, 3, 4096 / es - 1, 4096 / es, 4096 / es + 1, 3 * 4096 / es + 5] {
                let n = elems * es;
                let a: Vec<u8> = (0..n).map(|_| rng.random()).collect();
                let b: Vec<u8> = (0..n).map(|_| rng.random()).collect();
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product] {
                    for divide_by in [None, Some(2), Some(3)] {
                        let mut want = a.clone();
                        reduce_into(dtype, op, &mut want, &b);
                        if let Some(d) = divide_by {
                            divide_in_place(dtype, &mut want, d);
                        }
                        let mut got = vec![0u8; n];
                        combine_into(dtype, op, &mut got, &a, &b, divide_by);
                        assert_eq!(got, want, "{dtype:?} {op:?} {elems} elements, divide by {divide_by:?}");
                    }
                }
            }
        }
    }

    /// The power-of-two shortcut of `divide` (a multiply) has the bits of the division through f64 it replaces,
    /// on random bit patterns of every float type (NaNs, infinities, subnormals, and halves around their
    /// underflow) and on every f32 exponent.
    #[test]
    fn divide_by_a_power_of_two_has_the_bits_of_the_division() {
        use rand::{Rng, SeedableRng};
        // Bits equal; for NaNs only NaN-ness (Rust does not promise NaN payloads across operations).
        fn same<T: Copy>(got: &[T], want: &[T], bits: impl Fn(T) -> u64, nan: impl Fn(T) -> bool) -> bool {
            got.iter().zip(want).all(|(&g, &w)| if nan(g) || nan(w) { nan(g) && nan(w) } else { bits(g) == bits(w) })
        }
        fn by_division<T: Copy>(v: &[T], n: usize, to: impl Fn(T) -> f64, from: impl Fn(f64) -> T) -> Vec<T> {
            v.iter().map(|&a| from(to(a) / n as f64)).collect()
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let mut f32s: Vec<f32> = (0..1 << 20).map(|_| f32::from_bits(rng.random())).collect();
        // Every exponent, with random mantissas and signs (the subnormal range included).
        f32s.extend(
            (0u32..256).flat_map(|e| (0..64u32).map(move |m| f32::from_bits((e << 23) | (m * 131_071 % (1 << 23))))),
        );
        f32s.extend([0.0, -0.0, f32::MIN_POSITIVE, f32::from_bits(1), f32::MAX, f32::INFINITY, f32::NAN]);
        let f64s: Vec<f64> = (0..1 << 18).map(|_| f64::from_bits(rng.random())).collect();
        let f16s: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let bf16s: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        for n in [1usize, 2, 4, 8, 64, 1024] {
            // f32 divides through f64 and rounds once: `(a as f64 / n) as f32`.
            let want = by_division(&f32s, n, |a| a as f64, |q| q as f32);
            let mut got = f32s.clone();
            f32::divide(&mut got, n);
            assert!(same(&got, &want, |x| x.to_bits() as u64, f32::is_nan), "f32 / {n}");
            let mut got = f64s.clone();
            f64::divide(&mut got, n);
            let want: Vec<f64> = f64s.iter().map(|a| a / n as f64).collect();
            assert!(same(&got, &want, f64::to_bits, f64::is_nan), "f64 / {n}");
            let want = by_division(&f16s, n, |a| a.to_f32() as f64, |q| f16::from_f32(q as f32));
            let mut got = f16s.clone();
            f16::divide(&mut got, n);
            assert!(same(&got, &want, |x| x.to_bits() as u64, f16::is_nan), "f16 / {n}");
            let want = by_division(&bf16s, n, |a| a.to_f32() as f64, |q| bf16::from_f32(q as f32));
            let mut got = bf16s.clone();
            bf16::divide(&mut got, n);
            assert!(same(&got, &want, |x| x.to_bits() as u64, bf16::is_nan), "bf16 / {n}");
        }
    }
}
