//! [`ParamBuilder`]: a model's parameters drawn on the full model from one seed, each rank keeping its slice.
//!
//! Every parameter is drawn whole, in f32, from its own ChaCha8 stream: the key comes from the builder's seed
//! (`ChaCha8Rng::seed_from_u64(seed)`), the 64-bit stream number from the FNV-1a hash of the parameter's full
//! dotted name (`h.0.mlp.fc.weight`). The full tensor is then zero-padded along the split dim (for
//! [`ParamBuilder::sharded_padded`]), this tp rank's chunk kept, cast to the builder's dtype and moved to its
//! device. So a model built at tp = 1, 2 or 4, or with its parameters created in another order, starts from the
//! same full weights, bit for bit (Megatron's `_initialize_affine_weight_cpu` does the same: draw the master
//! weight, keep a slice).

use super::{ParamLayout, TensorParallel};
use crate::{lock, AccelError, Result};
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal, Uniform};

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
    /// form (their parameters are replicated, initialised by candle, not from the seed). At tp > 1,
    /// `prepare_model` accepts such a parameter only if it holds the same values on every tp rank (a constant
    /// initialiser, e.g. a norm's ones and zeros): candle's random initialisers draw different values on each
    /// rank, so build those with [`ParamBuilder::replicated`].
    pub fn var_builder(&self) -> VarBuilder<'static> {
        let vb = VarBuilder::from_varmap(&self.varmap, self.dtype, &self.device);
        self.path.iter().fold(vb, |vb, p| vb.pp(p))
    }

    /// The full dotted name of parameter `name` under this builder's prefix.
    pub fn full_name(&self, name: &str) -> String {
        let mut parts = self.path.clone();
        parts.push(name.to_string());
        parts.join(".")
    }

    /// A parameter every tp rank holds whole. Errors: a name already in the `VarMap`.
    pub fn replicated(&self, name: &str, shape: impl Into<Shape>, init: ParamInit) -> Result<Tensor> {
        let full_name = self.full_name(name);
        self.check_free(&full_name)?;
        let full = draw_full(self.seed, &full_name, &shape.into(), init)?;
        self.insert(full_name, full, ParamLayout::Replicated)
    }

    /// A parameter split along `dim` over the tp group: the full tensor of `full_shape` is drawn, this rank's
    /// `full_shape[dim] / tp` rows kept. Errors: `full_shape[dim]` not divisible by the tp size (naming the
    /// parameter, the sizes and the tp sizes that would divide it), a name already in the `VarMap`.
    pub fn sharded(&self, name: &str, full_shape: impl Into<Shape>, dim: usize, init: ParamInit) -> Result<Tensor> {
        self.split(name, full_shape.into(), dim, init, false)
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
        self.split(name, full_shape.into(), dim, init, true)
    }

    fn split(&self, name: &str, shape: Shape, dim: usize, init: ParamInit, pad: bool) -> Result<Tensor> {
        let full_name = self.full_name(name);
        let dims = shape.dims();
        if dim >= dims.len() {
            return Err(AccelError::InvalidArgument(format!(
                "tensor parallel: parameter `{full_name}` of shape {dims:?} cannot be split along dim {dim} (it has \
                 {} dims)",
                dims.len()
            )));
        }
        let (size, tp) = (dims[dim], self.tp.size());
        if !pad && !size.is_multiple_of(tp) {
            return Err(AccelError::InvalidArgument(format!(
                "tensor parallel: parameter `{full_name}` of shape {dims:?} is split along dim {dim}, of size {size}, \
                 which tp size {tp} does not divide (tp sizes that divide {size}: {})",
                divisors(size)
            )));
        }
        self.check_free(&full_name)?;
        // Past the model's size the layout pads with zero rows: they take part in no real output (the
        // vocab-parallel loss masks them out) and are dropped from checkpoints.
        let layout = ParamLayout::Sharded { dim, full: size, padded: size.div_ceil(tp) * tp };
        let full = draw_full(self.seed, &full_name, &shape, init)?;
        let local = layout.slice(&full, self.tp.rank(), tp)?;
        self.insert(full_name, local, layout)
    }

    fn check_free(&self, full_name: &str) -> Result<()> {
        if lock(self.varmap.data()).contains_key(full_name) {
            return Err(AccelError::InvalidArgument(format!(
                "tensor parallel: parameter `{full_name}` already exists in the VarMap (each parameter is created \
                 once; give the layer another prefix with `pp`)"
            )));
        }
        Ok(())
    }

    /// Casts the f32 host tensor to the builder's dtype and device, makes it a `Var` in the `VarMap` and records
    /// its layout.
    fn insert(&self, full_name: String, value: Tensor, layout: ParamLayout) -> Result<Tensor> {
        let value = value.contiguous()?.to_dtype(self.dtype)?.to_device(&self.device)?;
        let var = Var::from_tensor(&value)?;
        let mut data = lock(self.varmap.data());
        if data.contains_key(&full_name) {
            return Err(AccelError::InvalidArgument(format!(
                "tensor parallel: parameter `{full_name}` already exists in the VarMap"
            )));
        }
        self.tp.register(&var, layout);
        let t = var.as_tensor().clone();
        data.insert(full_name, var);
        Ok(t)
    }
}

/// The tp sizes that divide `size`, as a readable list.
fn divisors(size: usize) -> String {
    let d: Vec<String> = (1..=size).filter(|d| size.is_multiple_of(*d)).map(|d| d.to_string()).collect();
    if d.is_empty() {
        "none".into()
    } else {
        d.join(", ")
    }
}

/// 64-bit FNV-1a: the stream number of a parameter name (stable across runs, platforms and Rust versions,
/// unlike `DefaultHasher`).
fn fnv1a(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The full f32 tensor of parameter `full_name` (on the CPU), drawn from its own stream.
fn draw_full(seed: u64, full_name: &str, shape: &Shape, init: ParamInit) -> Result<Tensor> {
    let n = shape.elem_count();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(fnv1a(full_name));
    let bad = |what: &str, v: f64| {
        AccelError::InvalidArgument(format!(
            "tensor parallel: parameter `{full_name}`: {what} {v} must be finite and non-negative"
        ))
    };
    let values: Vec<f32> = match init {
        ParamInit::Zeros => vec![0.0; n],
        ParamInit::Ones => vec![1.0; n],
        ParamInit::Normal { std } => {
            if !(std.is_finite() && std >= 0.0) {
                return Err(bad("std", std));
            }
            let normal = Normal::new(0.0f32, std as f32).map_err(|_| bad("std", std))?;
            (0..n).map(|_| normal.sample(&mut rng)).collect()
        }
        ParamInit::Uniform { bound } => {
            if !(bound.is_finite() && bound >= 0.0) {
                return Err(bad("bound", bound));
            }
            if bound == 0.0 {
                vec![0.0; n]
            } else {
                let b = bound as f32;
                let uniform = Uniform::new(-b, b).map_err(|_| bad("bound", bound))?;
                (0..n).map(|_| rng.sample(uniform)).collect()
            }
        }
    };
    Ok(Tensor::from_vec(values, shape, &Device::Cpu)?)
}
