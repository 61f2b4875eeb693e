//! [`ParamBuilder`]: a model's parameters drawn on the full model from one seed, each rank keeping its slice.
//!
//! TODO(helper tp-layers): implement.

use super::{ParamLayout, TensorParallel};
use crate::Result;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::{VarBuilder, VarMap};

/// How a parameter's full tensor is initialised (drawn in f32, then cast to the compute dtype).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ParamInit {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Normal(0, std²).
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// Uniform(−bound, bound).
    Uniform {
        /// Half-width.
        bound: f64,
    },
}

/// Creates parameters in a `VarMap` (see the module documentation). Cheap to clone.
///
/// Every parameter `name` (with the builder's `pp` prefix, `a.b.weight`) is drawn from its own ChaCha8 stream
/// seeded by `(seed, name)`, on the full shape, so the values do not depend on the tp size, on the rank or on
/// the order in which parameters are created.
#[derive(Clone)]
pub struct ParamBuilder {
    varmap: VarMap,
    path: Vec<String>,
    seed: u64,
    dtype: DType,
    device: Device,
    tp: TensorParallel,
}

impl ParamBuilder {
    /// A builder creating parameters in `varmap`, in `dtype` on `device`, laid out over `tp`.
    pub fn new(varmap: &VarMap, tp: &TensorParallel, seed: u64, dtype: DType, device: &Device) -> Self {
        ParamBuilder { varmap: varmap.clone(), path: Vec::new(), seed, dtype, device: device.clone(), tp: tp.clone() }
    }

    /// A builder whose parameter names get `name.` in front (like `VarBuilder::pp`).
    pub fn pp(&self, name: impl ToString) -> Self {
        let mut b = self.clone();
        b.path.push(name.to_string());
        b
    }

    /// The tensor-parallel group and layout registry.
    pub fn tp(&self) -> &TensorParallel {
        &self.tp
    }

    /// The parameters' dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The parameters' device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A candle `VarBuilder` over the same `VarMap`, dtype, device and prefix, for layers that have no parallel
    /// form (their parameters are replicated, initialised by candle, not from the seed).
    pub fn var_builder(&self) -> VarBuilder<'static> {
        todo!()
    }

    /// A parameter every tp rank holds whole. Errors: a name already in the `VarMap`.
    pub fn replicated(&self, name: &str, shape: impl Into<Shape>, init: ParamInit) -> Result<Tensor> {
        let _ = (name, shape.into(), init, ParamLayout::Replicated);
        todo!()
    }

    /// A parameter split along `dim` over the tp group: the full tensor of `full_shape` is drawn, this rank's
    /// `full_shape[dim] / tp` rows kept. Errors: `full_shape[dim]` not divisible by the tp size (naming the
    /// parameter, the sizes and the tp sizes that would divide it), a name already in the `VarMap`.
    pub fn sharded(&self, name: &str, full_shape: impl Into<Shape>, dim: usize, init: ParamInit) -> Result<Tensor> {
        let _ = (name, full_shape.into(), dim, init);
        todo!()
    }

    /// Like [`ParamBuilder::sharded`], but a size tp does not divide is padded with zero rows up to the next
    /// multiple of tp (a vocabulary of 65 characters at tp = 2 becomes 66 rows; the padding is registered in the
    /// [`ParamLayout`] and dropped from checkpoints).
    pub fn sharded_padded(
        &self,
        name: &str,
        full_shape: impl Into<Shape>,
        dim: usize,
        init: ParamInit,
    ) -> Result<Tensor> {
        let _ = (name, full_shape.into(), dim, init);
        todo!()
    }
}
