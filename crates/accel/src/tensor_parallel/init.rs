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
use std::ops::Range;
use std::sync::Arc;

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
    /// Every element `value`.
    Constant(f64),
    /// Normal(mean, std²).
    Gaussian {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
    /// Uniform(lo, up).
    Range {
        /// Lower bound.
        lo: f64,
        /// Upper bound (> lo).
        up: f64,
    },
}

impl ParamInit {
    /// candle-nn's initialiser `init` for a parameter whose *full* (single-process) shape is `full_shape`: the same
    /// distribution candle would draw from (Kaiming's fan and gain from the full shape, He et al. 2015, as
    /// `candle_nn::Init::Kaiming` computes them), drawn from the builder's seeded per-name stream instead of
    /// candle's unseedable RNG.
    pub fn from_candle(init: candle_nn::Init, full_shape: &Shape) -> Self {
        use candle_nn::init::NormalOrUniform;
        match init {
            candle_nn::Init::Const(0.0) => ParamInit::Zeros,
            candle_nn::Init::Const(1.0) => ParamInit::Ones,
            candle_nn::Init::Const(c) => ParamInit::Constant(c),
            candle_nn::Init::Randn { mean: 0.0, stdev } => ParamInit::Normal { std: stdev },
            candle_nn::Init::Randn { mean, stdev } => ParamInit::Gaussian { mean, std: stdev },
            candle_nn::Init::Uniform { lo, up } if lo == -up => ParamInit::Uniform { bound: up },
            candle_nn::Init::Uniform { lo, up } => ParamInit::Range { lo, up },
            candle_nn::Init::Kaiming { dist, fan, non_linearity } => {
                let std = non_linearity.gain() / (fan.for_shape(full_shape).max(1) as f64).sqrt();
                match dist {
                    NormalOrUniform::Normal => ParamInit::Normal { std },
                    NormalOrUniform::Uniform => ParamInit::Uniform { bound: 3f64.sqrt() * std },
                }
            }
        }
    }
}

/// Creates parameters in a `VarMap` (see the module documentation) — or, built by
/// [`crate::PreparedModel::param_builder`], hands out a prepared model's parameters by name. Cheap to clone.
///
/// Every parameter `name` (with the builder's `pp` prefix, `a.b.weight`) is drawn from its own ChaCha8 stream
/// seeded by `(seed, name)`, on the full shape, so the values do not depend on the tp size, on the rank or on
/// the order in which parameters are created.
///
/// A builder from `PreparedModel::param_builder` creates nothing: each call returns the prepared parameter of
/// that name (this rank's tp piece, in the compute dtype), checked against the shape the call asks for — under
/// FULL_SHARD gathered from the dp_shard ranks' chunks at that moment (so build the layers inside the forward
/// pass that uses them: a gathered tensor is a copy, stale after the next optimizer step).
#[derive(Clone)]
pub struct ParamBuilder {
    varmap: VarMap,
    path: Vec<String>,
    seed: u64,
    dtype: DType,
    device: Device,
    tp: TensorParallel,
    /// `Some`: hand out a prepared model's parameters instead of creating them.
    lookup: Option<Arc<dyn ParamSource>>,
    /// `Some`: create each parameter from this source's tensor of its name instead of drawing it.
    weights: Option<Arc<dyn InitialWeights>>,
    /// `Some`: describe the model instead of building it — record each parameter's name, shape and split, and
    /// hand out a value-less stand-in ([`ShapeRecord`]).
    describing: Option<Arc<ShapeRecord>>,
}

/// What a describing builder saw (`accel::nn::describe`): every parameter the model asked for, in order, the head
/// counts its attention asked the builder to split, and whether it drops out. Nothing is allocated: the tensors handed out are a zero
/// scalar broadcast to the parameter's shape.
#[derive(Default)]
pub(crate) struct ShapeRecord {
    pub(crate) params: std::sync::Mutex<Vec<RecordedParam>>,
    /// `(module path, heads)` of each `VarBuilder::local_heads` call.
    pub(crate) heads: std::sync::Mutex<Vec<(String, usize)>>,
    /// Whether a dropout layer with a probability above 0 was made.
    pub(crate) dropout: std::sync::atomic::AtomicBool,
}

/// One parameter a describing builder was asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RecordedParam {
    pub(crate) name: String,
    /// The full (single-process) shape.
    pub(crate) shape: Vec<usize>,
    /// The dim tensor parallelism splits, and whether a size tp does not divide is padded (else it must divide).
    pub(crate) split: Option<(usize, bool)>,
}

/// Initial values of a model's parameters by name — a checkpoint's — for a builder to create them from instead of
/// drawing them from the seed ([`crate::nn::VarBuilder::with_weights`]; candle's
/// `VarBuilder::from_mmaped_safetensors`). The builder keeps this rank's slice of each.
pub trait InitialWeights: Send + Sync {
    /// The full single-process tensor of parameter `name` (any float dtype, any device). Errors: a name the
    /// source does not hold — a builder with weights creates every parameter from them, never from the seed, so
    /// a model that asks for a name the checkpoint lacks fails naming it instead of starting that parameter at
    /// random.
    fn full_tensor(&self, name: &str) -> Result<Tensor>;

    /// Rows `range` along `dim` of parameter `name`, whose full shape is `full_shape` (a tensor-parallel shard,
    /// `range` within the real rows), when the source can read them without the rest — a memory-mapped file
    /// reads only those bytes. `None` (the default): the builder reads [`InitialWeights::full_tensor`] and keeps
    /// its slice. Errors: the name missing, or held with another shape.
    fn rows(&self, name: &str, full_shape: &[usize], dim: usize, range: Range<usize>) -> Result<Option<Tensor>> {
        let _ = (name, full_shape, dim, range);
        Ok(None)
    }
}

/// Where a [`ParamBuilder`] made by a prepared model takes its parameters from.
pub(crate) trait ParamSource: Send + Sync {
    /// Parameter `full_name` as this rank uses it (its tp piece, compute dtype; under FULL_SHARD gathered now).
    fn get(&self, full_name: &str) -> Result<Tensor>;
    /// Whether [`ParamSource::get`] gathers (FULL_SHARD): a model then builds its units inside their forward.
    fn gathers(&self) -> bool;
    /// Starts gathering the parameters under `prefix` ahead of their use (FULL_SHARD's prefetch).
    fn prefetch(&self, prefix: &str) -> Result<()>;
}

impl ParamBuilder {
    /// A builder creating parameters in `varmap`, in `dtype` on `device`, laid out over `tp`.
    pub fn new(varmap: &VarMap, tp: &TensorParallel, seed: u64, dtype: DType, device: &Device) -> Self {
        ParamBuilder {
            varmap: varmap.clone(),
            path: Vec::new(),
            seed,
            dtype,
            device: device.clone(),
            tp: tp.clone(),
            lookup: None,
            weights: None,
            describing: None,
        }
    }

    /// The same builder describing the model instead of building it: each parameter is recorded in `record` and
    /// handed out as a zero scalar broadcast to its shape (no memory, no draw, no weights read, nothing in the
    /// `VarMap`); a name asked for twice — a tied embedding's copy on a last pipeline stage — is recorded twice.
    pub(crate) fn describing(mut self, record: Arc<ShapeRecord>) -> Self {
        self.describing = Some(record);
        self
    }

    /// The record of a describing builder.
    pub(crate) fn shape_record(&self) -> Option<&Arc<ShapeRecord>> {
        self.describing.as_ref()
    }

    /// A describing builder's stand-in for parameter `full_name` of full shape `shape` (split along `split`):
    /// recorded, and this rank's shape of zeros without storage.
    fn described(&self, full_name: String, shape: &Shape, split: Option<(usize, bool)>) -> Result<Option<Tensor>> {
        let Some(record) = &self.describing else { return Ok(None) };
        let mut local = shape.dims().to_vec();
        if let Some((dim, _)) = split {
            local[dim] = local[dim].div_ceil(self.tp.size());
        }
        lock(&record.params).push(RecordedParam { name: full_name, shape: shape.dims().to_vec(), split });
        Ok(Some(Tensor::zeros((), self.dtype, &Device::Cpu)?.broadcast_as(local)?))
    }

    /// A builder handing out `source`'s parameters (`PreparedModel::param_builder`).
    pub(crate) fn lookup(source: Arc<dyn ParamSource>, tp: &TensorParallel, dtype: DType, device: &Device) -> Self {
        ParamBuilder { lookup: Some(source), ..ParamBuilder::new(&VarMap::new(), tp, 0, dtype, device) }
    }

    /// The same builder creating every parameter from `weights` (its full tensor of the parameter's name, this
    /// rank's slice kept) instead of drawing it from the seed.
    pub fn with_weights(mut self, weights: Arc<dyn InitialWeights>) -> Self {
        self.weights = Some(weights);
        self
    }

    /// The full initial tensor of `full_name`: from the weights when the builder has them (checked against the
    /// shape the layer asks for), else drawn from the seed.
    fn initial(&self, full_name: &str, shape: &Shape, init: ParamInit) -> Result<Tensor> {
        let Some(weights) = &self.weights else { return draw_full(self.seed, full_name, shape, init) };
        let t = weights.full_tensor(full_name)?;
        if t.dims() != shape.dims() {
            return Err(AccelError::InvalidArgument(format!(
                "the initial weights hold `{full_name}` with shape {:?}, but the model builds it with shape {:?}: \
                 the weights belong to another configuration of the model",
                t.dims(),
                shape.dims()
            )));
        }
        Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?)
    }

    /// This rank's piece of a sharded parameter read from the weights alone (its real rows, then the layout's
    /// zero padding), when the weights can read rows without the whole tensor; `None` otherwise.
    fn initial_rows(&self, full_name: &str, shape: &Shape, layout: ParamLayout) -> Result<Option<Tensor>> {
        let (Some(weights), ParamLayout::Sharded { dim, full, .. }) = (&self.weights, layout) else { return Ok(None) };
        let range = layout.shard_range(self.tp.rank(), self.tp.size()).expect("sharded");
        let real = range.start.min(full)..range.end.min(full);
        let Some(rows) = weights.rows(full_name, shape.dims(), dim, real.clone())? else { return Ok(None) };
        let mut want = shape.dims().to_vec();
        want[dim] = real.len();
        if rows.dims() != want.as_slice() {
            return Err(AccelError::InvalidArgument(format!(
                "the initial weights gave rows {real:?} of `{full_name}` with shape {:?}, expected {want:?}",
                rows.dims()
            )));
        }
        let rows = rows.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        if real.len() == range.len() {
            return Ok(Some(rows));
        }
        let mut pad = want;
        pad[dim] = range.len() - real.len();
        Ok(Some(Tensor::cat(&[&rows, &Tensor::zeros(pad, DType::F32, &Device::Cpu)?], dim)?))
    }

    /// Whether this builder gathers fully sharded parameters when asked for them (a prepared FULL_SHARD model's):
    /// a model then builds each unit (a transformer block) inside the unit's forward, with
    /// [`crate::activation_checkpoint::unit`], so the gathered weights are dropped after it and gathered again for
    /// its backward.
    pub fn gathers(&self) -> bool {
        self.lookup.as_ref().is_some_and(|l| l.gathers())
    }

    /// FULL_SHARD's prefetch: starts gathering every parameter under this builder's prefix (a unit the model runs
    /// next) on a communication thread, so that building the unit finds them gathered. Nothing for any other
    /// builder. Every rank must prefetch the same units in the same order (the same model code does).
    ///
    /// Errors: a copy of the chunks failing.
    pub fn prefetch(&self) -> Result<()> {
        match &self.lookup {
            Some(source) if source.gathers() => source.prefetch(&self.path.join(".")),
            _ => Ok(()),
        }
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
        let vb = match &self.lookup {
            Some(source) => {
                VarBuilder::from_backend(Box::new(SourceBackend(source.clone())), self.dtype, self.device.clone())
            }
            None => VarBuilder::from_varmap(&self.varmap, self.dtype, &self.device),
        };
        self.path.iter().fold(vb, |vb, p| vb.pp(p))
    }

    /// The builder's prefix, the dotted path its `pp` calls made (`layers.3.self_attn`; empty at the root).
    pub fn prefix(&self) -> String {
        self.path.join(".")
    }

    /// Parameter `name` under this prefix if it already exists (created by this builder or another over the same
    /// `VarMap`), or — for a builder handing out a prepared model's parameters — if the prepared model has it.
    pub(crate) fn existing(&self, name: &str) -> Option<Tensor> {
        let full_name = self.full_name(name);
        if let Some(record) = &self.describing {
            let params = lock(&record.params);
            let p = params.iter().find(|p| p.name == full_name)?;
            return Tensor::zeros((), self.dtype, &Device::Cpu).and_then(|z| z.broadcast_as(p.shape.clone())).ok();
        }
        match &self.lookup {
            Some(source) => source.get(&full_name).ok(),
            None => lock(self.varmap.data()).get(&full_name).map(|v| v.as_tensor().clone()),
        }
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
        let shape = shape.into();
        if let Some(source) = &self.lookup {
            return looked_up(source.as_ref(), &full_name, shape.dims());
        }
        if let Some(stand_in) = self.described(full_name.clone(), &shape, None)? {
            return Ok(stand_in);
        }
        self.check_free(&full_name)?;
        let full = self.initial(&full_name, &shape, init)?;
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
        if let Some(source) = &self.lookup {
            let mut local = dims.to_vec();
            local[dim] = size.div_ceil(tp);
            return looked_up(source.as_ref(), &full_name, &local);
        }
        if let Some(stand_in) = self.described(full_name.clone(), &shape, Some((dim, pad)))? {
            return Ok(stand_in);
        }
        self.check_free(&full_name)?;
        // Past the model's size the layout pads with zero rows: they take part in no real output (the
        // vocab-parallel loss masks them out) and are dropped from checkpoints.
        let layout = ParamLayout::Sharded { dim, full: size, padded: size.div_ceil(tp) * tp };
        if let Some(local) = self.initial_rows(&full_name, &shape, layout)? {
            return self.insert(full_name, local, layout);
        }
        let full = self.initial(&full_name, &shape, init)?;
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

/// `source`'s parameter `full_name`, which the model asks for with this rank's shape `want`.
fn looked_up(source: &dyn ParamSource, full_name: &str, want: &[usize]) -> Result<Tensor> {
    let t = source.get(full_name)?;
    if t.dims() != want {
        return Err(AccelError::InvalidArgument(format!(
            "param_builder: parameter `{full_name}` was prepared with shape {:?} but the model asks for {want:?}; \
             build the model with the configuration it was prepared with",
            t.dims()
        )));
    }
    Ok(t)
}

/// A candle `VarBuilder` backend over a prepared model's parameters (`ParamBuilder::var_builder` of a
/// [`ParamBuilder::lookup`] builder).
struct SourceBackend(Arc<dyn ParamSource>);

impl SourceBackend {
    /// A candle layer keeps the weights it is built with: from a gathering (FULL_SHARD) source they would go stale.
    fn refuse_gathering(&self, name: &str) -> candle_core::Result<()> {
        if self.0.gathers() {
            return Err(candle_core::Error::Msg(format!(
                "param_builder: `{name}` requested through a candle VarBuilder from a FULL_SHARD model: a candle layer \
                 keeps the weights it is built with, which would go stale after the first optimizer step; build \
                 the model with accelerator.builder(&varmap, plan) (accel::nn, whose layers fetch their weights at \
                 each forward), or use SHARD_GRAD_OP (the Trainer's fsdp \"shard_grad_op\")"
            )));
        }
        Ok(())
    }
}

impl candle_nn::var_builder::SimpleBackend for SourceBackend {
    fn get(&self, s: Shape, name: &str, _: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.refuse_gathering(name)?;
        let t = looked_up(self.0.as_ref(), name, s.dims()).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        t.to_dtype(dtype)?.to_device(dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.refuse_gathering(name)?;
        self.0.get(name).map_err(|e| candle_core::Error::Msg(e.to_string()))?.to_dtype(dtype)?.to_device(dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.get(name).is_ok()
    }
}

/// The tp sizes that divide `size`, as a readable list.
pub(crate) fn divisors(size: usize) -> String {
    let d: Vec<String> = (1..=size).filter(|d| size.is_multiple_of(*d)).map(|d| d.to_string()).collect();
    if d.is_empty() {
        "none".into()
    } else {
        d.join(", ")
    }
}

/// The full f32 tensor of parameter `full_name` (on the CPU), drawn from its own stream.
pub(crate) fn draw_full(seed: u64, full_name: &str, shape: &Shape, init: ParamInit) -> Result<Tensor> {
    let n = shape.elem_count();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // The stream number: FNV-1a of the name (stable across runs, platforms and Rust versions, unlike std's hasher).
    rng.set_stream(ddp_core::fingerprint::fnv1a(full_name.as_bytes()));
    let bad = |what: &str, v: f64| {
        AccelError::InvalidArgument(format!(
            "tensor parallel: parameter `{full_name}`: {what} {v} must be finite and non-negative"
        ))
    };
    let values: Vec<f32> = match init {
        ParamInit::Zeros => vec![0.0; n],
        ParamInit::Ones => vec![1.0; n],
        ParamInit::Constant(c) => vec![c as f32; n],
        ParamInit::Gaussian { mean, std } => {
            if !(std.is_finite() && std >= 0.0 && mean.is_finite()) {
                return Err(bad("std", std));
            }
            let normal = Normal::new(mean as f32, std as f32).map_err(|_| bad("std", std))?;
            (0..n).map(|_| normal.sample(&mut rng)).collect()
        }
        ParamInit::Range { lo, up } => {
            if !(lo.is_finite() && up.is_finite() && lo < up) {
                return Err(AccelError::InvalidArgument(format!(
                    "tensor parallel: parameter `{full_name}`: a uniform range [{lo}, {up}) needs finite bounds with \
                     lo < up"
                )));
            }
            let uniform = Uniform::new(lo as f32, up as f32).map_err(|_| bad("bound", up))?;
            (0..n).map(|_| rng.sample(uniform)).collect()
        }
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
