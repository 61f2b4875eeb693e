//! [`DistributedDataParallel`]: gradient averaging across ranks for candle parameters (like
//! `torch.nn.parallel.DistributedDataParallel`, reference: Li et al., "PyTorch Distributed: Experiences on
//! Accelerating Data Parallel Training", VLDB 2020).
//!
//! At construction parameter names, shapes and dtypes are checked across ranks and rank 0's values are broadcast.
//! After `loss.backward()`, [`DistributedDataParallel::sync_gradients`] packs gradients into buckets (the first of
//! 1 MiB, then `bucket_cap_mb`, built in reverse parameter order, one dtype per bucket), all-reduces them in bucket
//! order with [`ReduceOp::Avg`] and writes the averages back into the `GradStore`. A communication thread reduces
//! bucket k while the calling thread packs bucket k+1 and unpacks the buckets already reduced.
//!
//! Differences from PyTorch, on purpose: candle has no autograd hooks, so the reduction starts after the whole
//! backward pass (not while it runs); and gradient accumulation is explicit: candle's `backward()` returns a
//! fresh `GradStore`, so with sync off the user sums micro-batch gradients (see
//! [`DistributedDataParallel::accumulate_gradients`]) and the next synced call averages the sum.

mod bucket;
mod fingerprint;
mod flat;

pub use bucket::compute_bucket_layout;

use crate::{DType, DdpError, ProcessGroup, ReduceOp, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::VarMap;
use fingerprint::ParamSig;
use flat::FlatBuffer;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Mutex};

/// Bytes in a MiB (caps are given in MiB, as PyTorch's `bucket_cap_mb`).
const MIB: f64 = (1u64 << 20) as f64;

/// Options of [`DistributedDataParallel`].
#[derive(Debug, Clone, PartialEq)]
pub struct DdpOptions {
    /// Cap of every bucket after the first, in MiB (default 25, as PyTorch).
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket, in MiB (default 1, as PyTorch).
    pub first_bucket_cap_mb: f64,
    /// Allow parameters without a gradient instead of failing (default false). When on, a parameter with no
    /// gradient on this rank is reduced as zeros (so every rank issues the same collectives), one extra
    /// all_reduce of a usage bitmap tells which parameters some rank used: those get the average (the sum of
    /// the ranks that used it divided by world size, as PyTorch), and a parameter no rank used gets no gradient
    /// (the optimizer skips it, like PyTorch leaving `.grad` as `None`).
    pub find_unused_parameters: bool,
    /// Broadcast rank 0's parameter values at construction (default true).
    pub broadcast_parameters: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_mb: 25.0,
            first_bucket_cap_mb: 1.0,
            find_unused_parameters: false,
            broadcast_parameters: true,
        }
    }
}

/// A bucket as planned at construction.
#[derive(Debug)]
struct BucketPlan {
    dtype: DType,
    /// Parameter indices in packing order.
    params: Vec<usize>,
    /// Byte offset of each parameter of `params` in the flat buffer.
    offsets: Vec<usize>,
    /// Total bytes.
    bytes: usize,
}

/// Keeps a model's gradients in sync across the ranks of a process group.
///
/// ```no_run
/// # fn main() -> anyhow::Result<()> {
/// use ddp_core::{DdpOptions, DistributedDataParallel, ProcessGroup};
/// # let (loss, varmap): (candle_core::Tensor, candle_nn::VarMap) = todo!();
/// let pg = ProcessGroup::init_from_env()?;
/// let ddp = DistributedDataParallel::new(&pg, &varmap, DdpOptions::default())?; // check + broadcast
/// let mut grads = loss.backward()?;
/// ddp.sync_gradients(&mut grads)?; // every rank now holds the average gradient
/// # Ok(()) }
/// ```
pub struct DistributedDataParallel {
    pg: ProcessGroup,
    vars: Vec<(String, Var)>,
    /// Size of each parameter in bytes.
    sizes: Vec<usize>,
    buckets: Vec<BucketPlan>,
    opts: DdpOptions,
    require_sync: AtomicBool,
    /// One flat buffer per bucket, kept between steps so big buckets are not re-allocated (and page-faulted)
    /// every step.
    buffers: Mutex<Vec<FlatBuffer>>,
}

impl std::fmt::Debug for DistributedDataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedDataParallel")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("parameters", &self.vars.len())
            .field("buckets", &self.bucket_layout())
            .field("opts", &self.opts)
            .finish()
    }
}

impl DistributedDataParallel {
    /// Wraps the variables of a `VarMap` (sorted by name, so every rank sees the same order).
    ///
    /// Errors: see [`Self::from_named_vars`].
    pub fn new(pg: &ProcessGroup, varmap: &VarMap, opts: DdpOptions) -> Result<Self> {
        let mut vars: Vec<(String, Var)> = {
            let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
            data.iter().map(|(name, var)| (name.clone(), var.clone())).collect()
        };
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        Self::from_named_vars(pg, vars, opts)
    }

    /// Wraps named variables in the given order (must be the same order on every rank).
    ///
    /// Collective: every rank of `pg` must call it. All-gathers a fingerprint of (name, shape, dtype) of every
    /// parameter, then (with `broadcast_parameters`) broadcasts rank 0's values into every `Var`.
    ///
    /// Errors: [`DdpError::ParameterMismatch`] on every rank when any rank's parameters differ from rank 0's,
    /// naming the first differing parameter and what each rank has; [`DdpError::InvalidArgument`] for a negative
    /// or non-finite cap or a dtype collectives cannot carry (checked before any communication); collective
    /// errors from the process group.
    pub fn from_named_vars(pg: &ProcessGroup, vars: Vec<(String, Var)>, opts: DdpOptions) -> Result<Self> {
        let cap = |mb: f64, what: &str| -> Result<usize> {
            if mb.is_finite() && mb >= 0.0 {
                Ok((mb * MIB) as usize)
            } else {
                Err(DdpError::InvalidArgument(format!(
                    "DdpOptions::{what} must be a finite number ≥ 0 (MiB), got {mb}"
                )))
            }
        };
        let first_cap = cap(opts.first_bucket_cap_mb, "first_bucket_cap_mb")?;
        let later_cap = cap(opts.bucket_cap_mb, "bucket_cap_mb")?;
        let dtypes =
            vars.iter().map(|(name, var)| flat::dtype_of(name, var.as_tensor())).collect::<Result<Vec<_>>>()?;
        let sizes: Vec<usize> =
            vars.iter().zip(&dtypes).map(|((_, v), d)| v.as_tensor().elem_count() * d.size_in_bytes()).collect();
        let sigs: Vec<ParamSig> = vars
            .iter()
            .map(|(name, v)| ParamSig {
                name: name.clone(),
                dims: v.as_tensor().dims().to_vec(),
                dtype: v.as_tensor().dtype().as_str().to_string(),
            })
            .collect();
        fingerprint::check_across_ranks(pg, &sigs)?;

        let layout = bucket::assign(
            &sizes.iter().copied().zip(dtypes.iter().copied()).collect::<Vec<_>>(),
            first_cap,
            later_cap,
        );
        let buckets = layout
            .into_iter()
            .map(|b| {
                let offsets = b
                    .params
                    .iter()
                    .scan(0usize, |off, &p| {
                        let here = *off;
                        *off += sizes[p];
                        Some(here)
                    })
                    .collect();
                BucketPlan { dtype: dtypes[b.params[0]], params: b.params, offsets, bytes: b.bytes }
            })
            .collect::<Vec<_>>();
        let buffers = Mutex::new((0..buckets.len()).map(|_| FlatBuffer::default()).collect());
        let ddp = DistributedDataParallel {
            pg: pg.clone(),
            vars,
            sizes,
            buckets,
            opts,
            require_sync: AtomicBool::new(true),
            buffers,
        };
        if ddp.opts.broadcast_parameters && pg.world_size() > 1 {
            ddp.broadcast_parameters()?;
        }
        Ok(ddp)
    }

    /// The wrapped parameters, in registration order.
    pub fn named_vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// The process group gradients are reduced over.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// The options this wrapper was built with.
    pub fn options(&self) -> &DdpOptions {
        &self.opts
    }

    /// Whether [`Self::sync_gradients`] communicates (false inside [`Self::no_sync`]).
    pub fn require_sync(&self) -> bool {
        self.require_sync.load(Ordering::SeqCst)
    }

    /// Averages every parameter's gradient in `grads` across ranks (no-op while [`Self::set_require_sync`] is
    /// false). Collective: every rank must call it for the same step.
    ///
    /// Each gradient is replaced by a new tensor (same shape, dtype and device as its parameter) holding
    /// `(1 / world_size) · Σ_ranks grad`. Gradients of tensors that are not wrapped parameters are left alone.
    /// The level-1 entry point over candle's `GradStore`; [`Self::reduce_gradients`] is the same reduction over
    /// gradient slots (what the Accelerator uses).
    ///
    /// Errors (raised before any communication, so on the rank at fault): [`DdpError::UnusedParameters`] naming
    /// the parameters with no gradient unless `find_unused_parameters`; [`DdpError::InvalidArgument`] for a
    /// gradient whose shape differs from its parameter's. Then collective errors from the process group (a dead
    /// peer, a timeout), after which the gradients are unspecified.
    pub fn sync_gradients(&self, grads: &mut GradStore) -> Result<()> {
        if !self.require_sync() {
            return Ok(());
        }
        let mut slots: Vec<Option<Tensor>> = self.vars.iter().map(|(_, v)| grads.get(v.as_tensor()).cloned()).collect();
        let unused: Vec<String> =
            slots.iter().zip(&self.vars).filter(|(g, _)| g.is_none()).map(|(_, (name, _))| name.clone()).collect();
        if !unused.is_empty() && !self.opts.find_unused_parameters {
            return Err(DdpError::UnusedParameters { names: unused });
        }
        self.reduce_gradients(&mut slots)?;
        for ((_, var), slot) in self.vars.iter().zip(slots) {
            match slot {
                Some(g) => {
                    grads.insert(var.as_tensor(), g);
                }
                None => {
                    grads.remove(var.as_tensor());
                }
            }
        }
        Ok(())
    }

    /// Averages gradient slots across ranks in place: `grads[i]` is the gradient of the `i`-th wrapped parameter
    /// ([`Self::named_vars`] order), `None` where this rank produced none. Collective: every rank must call it for
    /// the same step. Ignores [`Self::set_require_sync`] (the caller decides when to sync).
    ///
    /// Afterwards `grads[i]` is `Some((1 / world_size) · Σ_ranks grad)` (a rank without a gradient contributes
    /// zeros) for every parameter some rank used, and `None` for a parameter no rank used. The used-parameter
    /// bitmap costs one extra small all-reduce, only with `find_unused_parameters`; without it every slot must be
    /// `Some` (the caller checked, see [`DdpError::UnusedParameters`]).
    ///
    /// Cost: one pack into the bucket buffers and one unpack into new tensors per parameter, nothing else.
    ///
    /// Errors: [`DdpError::InvalidArgument`] for a slot count or a gradient shape that does not match the wrapped
    /// parameters, or a `None` slot without `find_unused_parameters` (before any communication); collective
    /// errors from the process group.
    pub fn reduce_gradients(&self, grads: &mut [Option<Tensor>]) -> Result<()> {
        if grads.len() != self.vars.len() {
            return Err(DdpError::InvalidArgument(format!(
                "DDP: {} gradient slots for {} wrapped parameters; pass one slot per parameter, in named_vars order",
                grads.len(),
                self.vars.len()
            )));
        }
        for ((name, var), g) in self.vars.iter().zip(grads.iter()) {
            match g {
                Some(g) if g.dims() != var.as_tensor().dims() => {
                    return Err(DdpError::InvalidArgument(format!(
                        "DDP: gradient of `{name}` has shape {:?}, its parameter {:?}",
                        g.dims(),
                        var.as_tensor().dims()
                    )))
                }
                None if !self.opts.find_unused_parameters => {
                    return Err(DdpError::UnusedParameters { names: vec![name.clone()] })
                }
                _ => {}
            }
        }
        if self.pg.world_size() == 1 {
            // The average over one rank is the gradient itself.
            return Ok(());
        }
        let globally_used = if self.opts.find_unused_parameters {
            let mut used: Vec<u8> = grads.iter().map(|g| u8::from(g.is_some())).collect();
            self.pg.all_reduce(&mut used, ReduceOp::Max)?;
            used.into_iter().map(|u| u != 0).collect()
        } else {
            vec![true; grads.len()]
        };

        let mut buffers = std::mem::take(&mut *self.buffers.lock().unwrap_or_else(|e| e.into_inner()));
        buffers.resize_with(self.buckets.len(), FlatBuffer::default);
        let result = self.reduce_buckets(grads, &globally_used, &mut buffers);
        *self.buffers.lock().unwrap_or_else(|e| e.into_inner()) = buffers;
        result
    }

    /// The pipeline: this thread packs bucket k+1 while a communication thread all-reduces bucket k, then
    /// unpacks reduced buckets in order. Collectives are issued strictly in bucket order by the one comm thread.
    fn reduce_buckets(&self, grads: &mut [Option<Tensor>], used: &[bool], buffers: &mut [FlatBuffer]) -> Result<()> {
        if let [only] = buffers {
            self.pack_gradients(0, grads, only)?;
            self.pg.all_reduce_bytes(only.bytes_mut(), self.buckets[0].dtype, ReduceOp::Avg)?;
            return self.unpack_gradients(0, only, used, grads);
        }
        std::thread::scope(|scope| {
            let (to_comm, comm_inbox) = mpsc::channel::<(usize, FlatBuffer)>();
            let (to_main, main_inbox) = mpsc::channel::<Result<(usize, FlatBuffer)>>();
            let (pg, buckets) = (&self.pg, &self.buckets);
            scope.spawn(move || {
                for (k, mut buf) in comm_inbox {
                    let r = pg.all_reduce_bytes(buf.bytes_mut(), buckets[k].dtype, ReduceOp::Avg);
                    let failed = r.is_err();
                    if to_main.send(r.map(|()| (k, buf))).is_err() || failed {
                        break;
                    }
                }
            });
            let mut first_err: Option<DdpError> = None;
            for (k, slot) in buffers.iter_mut().enumerate() {
                let mut buf = std::mem::take(slot);
                if let Err(e) = self.pack_gradients(k, grads, &mut buf) {
                    first_err = Some(e);
                    break;
                }
                if to_comm.send((k, buf)).is_err() {
                    break; // the comm thread stopped on an error, which it has sent us
                }
            }
            drop(to_comm);
            for msg in main_inbox {
                match msg {
                    Ok((k, buf)) => {
                        if first_err.is_none() {
                            if let Err(e) = self.unpack_gradients(k, &buf, used, grads) {
                                first_err = Some(e);
                            }
                        }
                        buffers[k] = buf;
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            first_err.map_or(Ok(()), Err)
        })
    }

    /// Copies the gradients of bucket `k` into `buf` (zeros for parameters without one).
    fn pack_gradients(&self, k: usize, local: &[Option<Tensor>], buf: &mut FlatBuffer) -> Result<()> {
        let plan = &self.buckets[k];
        buf.resize(plan.bytes);
        let bytes = buf.bytes_mut();
        for (&p, &off) in plan.params.iter().zip(&plan.offsets) {
            let dst = &mut bytes[off..off + self.sizes[p]];
            match &local[p] {
                Some(g) => {
                    let param_dtype = self.vars[p].1.as_tensor().dtype();
                    if g.dtype() == param_dtype {
                        flat::copy_in(g, plan.dtype, dst)?;
                    } else {
                        flat::copy_in(&g.to_dtype(param_dtype)?, plan.dtype, dst)?;
                    }
                }
                None => dst.fill(0),
            }
        }
        Ok(())
    }

    /// Writes the reduced gradients of bucket `k` back into their slots (`None` for parameters no rank used).
    fn unpack_gradients(&self, k: usize, buf: &FlatBuffer, used: &[bool], grads: &mut [Option<Tensor>]) -> Result<()> {
        let plan = &self.buckets[k];
        let bytes = buf.bytes();
        for (&p, &off) in plan.params.iter().zip(&plan.offsets) {
            if !used[p] {
                grads[p] = None;
                continue;
            }
            let var = self.vars[p].1.as_tensor();
            grads[p] =
                Some(flat::tensor_from(&bytes[off..off + self.sizes[p]], plan.dtype, var.shape(), var.device())?);
        }
        Ok(())
    }

    /// Copies rank 0's parameter values into every rank's `Var`s, one broadcast per bucket.
    fn broadcast_parameters(&self) -> Result<()> {
        let mut buf = FlatBuffer::default();
        for plan in &self.buckets {
            buf.resize(plan.bytes);
            for (&p, &off) in plan.params.iter().zip(&plan.offsets) {
                flat::copy_in(self.vars[p].1.as_tensor(), plan.dtype, &mut buf.bytes_mut()[off..off + self.sizes[p]])?;
            }
            self.pg.broadcast(buf.bytes_mut(), 0)?;
            if self.pg.rank() != 0 {
                for (&p, &off) in plan.params.iter().zip(&plan.offsets) {
                    let var = &self.vars[p].1;
                    let t = var.as_tensor();
                    var.set(&flat::tensor_from(
                        &buf.bytes()[off..off + self.sizes[p]],
                        plan.dtype,
                        t.shape(),
                        t.device(),
                    )?)?;
                }
            }
        }
        Ok(())
    }

    /// Turns gradient sync on or off (gradient accumulation: off for all but the last micro-batch).
    pub fn set_require_sync(&self, on: bool) {
        self.require_sync.store(on, Ordering::SeqCst);
    }

    /// Runs `f` with sync turned off, like PyTorch's `no_sync()` context manager.
    pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        self.set_require_sync(false);
        let r = f();
        self.set_require_sync(true);
        r
    }

    /// Gradient accumulation helper: adds the wrapped parameters' gradients of `micro` into `acc` (a parameter
    /// missing from `acc` takes `micro`'s gradient). Local only, no communication: call it for the micro-batches
    /// of an accumulation window, then [`Self::sync_gradients`] on `acc` once.
    pub fn accumulate_gradients(&self, acc: &mut GradStore, micro: &GradStore) -> Result<()> {
        for (_, var) in &self.vars {
            let t = var.as_tensor();
            if let Some(g) = micro.get(t) {
                let sum = match acc.get(t) {
                    Some(a) => (a + g)?,
                    None => g.clone(),
                };
                acc.insert(t, sum);
            }
        }
        Ok(())
    }

    /// Bucket layout: the parameter indices (registration order) in each bucket, in communication order;
    /// within a bucket, reverse registration order.
    pub fn bucket_layout(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.params.clone()).collect()
    }

    /// Size of each bucket in bytes, in communication order.
    pub fn bucket_bytes(&self) -> Vec<usize> {
        self.buckets.iter().map(|b| b.bytes).collect()
    }
}
