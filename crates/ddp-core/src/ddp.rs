//! [`DistributedDataParallel`]: gradient averaging across ranks for candle parameters (like
//! `torch.nn.parallel.DistributedDataParallel`, reference: Li et al., "PyTorch Distributed: Experiences on
//! Accelerating Data Parallel Training", VLDB 2020).
//!
//! At construction parameter names, shapes and dtypes are checked across ranks and rank 0's values are broadcast.
//! After `loss.backward()`, [`DistributedDataParallel::sync_gradients`] groups gradients into buckets (the first
//! of 1 MiB, then `bucket_cap_mb`, built in reverse parameter order, one dtype per bucket), all-reduces them in
//! bucket order with [`ReduceOp::Avg`] and writes the averages back into the `GradStore`. A bucket goes to the
//! process group as pieces ([`ProcessGroup::all_reduce_piecewise`]): on one machine the shared-memory all_reduce
//! reads the gradient tensors where they lie and writes the averages into new tensors, with no packed copy of the
//! bucket; other paths pack it into a reused buffer. Where a spare core exists ([`Overlap`]), a communication
//! thread reduces bucket k while the calling thread launches bucket k+1.
//!
//! Overlap with the backward pass: candle has no autograd hooks, so `sync_gradients` starts after the whole
//! backward pass. [`DistributedDataParallel::backward`] instead runs the backward pass of a forward recorded with
//! [`crate::segments::record`] one segment at a time (the model marks the cuts with [`crate::segments::cut`]) and
//! all-reduces each bucket on the communication thread as soon as the segments that produce its gradients are
//! done, while the next segment computes — PyTorch's overlap (Li et al. §3.2.3), with cuts instead of hooks. The
//! first such call learns after which segment each gradient is final (agreed across ranks: the latest on any
//! rank) and rebuilds the buckets in that order, never spanning a cut, as PyTorch rebuilds its buckets after the
//! first iteration; it reduces after its backward pass. Later calls overlap — where overlap pays: see
//! [`Overlap`] (by default not on a CPU whose cores are all busy with the backward pass).
//!
//! Difference from PyTorch, on purpose: gradient accumulation is explicit: candle's `backward()` returns a
//! fresh `GradStore`, so with sync off the user sums micro-batch gradients (see
//! [`DistributedDataParallel::accumulate_gradients`]) and the next synced call averages the sum.

mod bucket;
pub(crate) mod fingerprint;
pub(crate) mod flat;
mod overlap;
mod pieces;

use crate::segments::BackwardSegments;
use crate::{DType, DdpError, ProcessGroup, ReduceOp, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::VarMap;
use fingerprint::ParamSig;
use flat::FlatBuffer;
use overlap::OverlapPlan;
use pieces::BucketPieces;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

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
    /// Whether [`DistributedDataParallel::backward`] all-reduces buckets while the backward pass goes on
    /// (default [`Overlap::Auto`]).
    pub overlap: Overlap,
    /// Gradient compression for the all-reduce (default [`CommHook::None`]; PyTorch's `register_comm_hook` with
    /// `fp16_compress_hook` / `bf16_compress_hook`, Accelerate's `DistributedDataParallelKwargs(comm_hook=…)`).
    pub comm_hook: CommHook,
}

/// Gradient compression of DDP's all-reduce (PyTorch's `torch.distributed.algorithms.ddp_comm_hooks.default_hooks`):
/// the gradients are cast to a 16-bit type, averaged in it, and cast back — half the bytes on the wire for a
/// rounding of each gradient to 8 (bf16) or 11 (fp16) significant bits. With a hook the reduction runs after the
/// backward pass over one flat buffer (no overlap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommHook {
    /// Gradients reduced in their own dtype.
    #[default]
    None,
    /// `fp16_compress_hook`: divided by the world size in fp32, then cast to fp16 (so the sum cannot overflow
    /// fp16's range), summed, cast back.
    Fp16,
    /// `bf16_compress_hook`: cast to bf16, averaged, cast back (bf16 has fp32's range).
    Bf16,
}

impl CommHook {
    /// The accepted spellings, for messages.
    pub const CHOICES: &'static str = "no, fp16, bf16";
}

impl std::str::FromStr for CommHook {
    type Err = DdpError;
    /// `no` / `none`, `fp16`, `bf16` (case-insensitive; Accelerate's `DDPCommunicationHookType` values).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "no" | "none" => Ok(CommHook::None),
            "fp16" => Ok(CommHook::Fp16),
            "bf16" => Ok(CommHook::Bf16),
            other => Err(DdpError::InvalidArgument(format!(
                "comm hook {other:?}: expected one of {} (power_sgd is not implemented)",
                Self::CHOICES
            ))),
        }
    }
}

/// When [`DistributedDataParallel::backward`] overlaps the gradient all-reduce with the backward pass.
///
/// Overlap pays when communication runs on resources the backward pass does not use: NCCL (the GPU's copy and
/// communication engines) or spare CPU cores. The CPU backend's collectives are memory copies and reductions done
/// by the ranks' own threads, and they proceed only while both ranks' communication threads run at once: when every
/// core is busy with the backward pass, an overlapped all-reduce only time-slices against it (measured on 2 ranks ×
/// 2 cores: no gain beyond the noise; docs/benchmarks.md, "Communication overlapped with the backward pass").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overlap {
    /// Overlap on NCCL, and on the CPU and MPI backends when this machine has a spare core for every local rank's
    /// communication thread (`available_parallelism ≥ local_world_size × (compute threads + 1)`); otherwise
    /// [`Overlap::Off`].
    #[default]
    Auto,
    /// Always overlap.
    On,
    /// Run the backward pass segment by segment, then reduce bucket by bucket on the calling thread (the same
    /// buckets and order as `sync_gradients`).
    Off,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_mb: 25.0,
            first_bucket_cap_mb: 1.0,
            find_unused_parameters: false,
            broadcast_parameters: true,
            overlap: Overlap::Auto,
            comm_hook: CommHook::None,
        }
    }
}

/// A bucket as planned at construction.
#[derive(Debug)]
struct BucketPlan {
    dtype: DType,
    /// Parameter indices in bucket order (where each one's bytes sit in the bucket).
    params: Vec<usize>,
    /// Byte offset of each parameter of `params` in the bucket.
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
    /// Element type each parameter's gradient travels as.
    dtypes: Vec<DType>,
    /// Caps in bytes: the first bucket's, the later ones'.
    caps: (usize, usize),
    opts: DdpOptions,
    require_sync: AtomicBool,
    /// The bucket layout: reverse registration order at construction, rebuilt once by the first overlapped
    /// backward (then with the plan that says when each bucket is ready).
    layout: Mutex<Arc<BucketLayout>>,
}

/// The buckets in communication order, and the overlap plan they were built for (if any).
#[derive(Debug)]
struct BucketLayout {
    buckets: Vec<BucketPlan>,
    overlap: Option<OverlapPlan>,
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

        let buckets = plan_buckets(
            bucket::assign(
                &sizes.iter().copied().zip(dtypes.iter().copied()).collect::<Vec<_>>(),
                first_cap,
                later_cap,
            ),
            &sizes,
            &dtypes,
        );
        let ddp = DistributedDataParallel {
            pg: pg.clone(),
            vars,
            sizes,
            dtypes,
            caps: (first_cap, later_cap),
            opts,
            require_sync: AtomicBool::new(true),
            layout: Mutex::new(Arc::new(BucketLayout { buckets, overlap: None })),
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

    /// Whether communication runs on its own thread here — overlapping the all-reduce with the backward pass in
    /// [`Self::backward`], and bucket k's all-reduce with launching bucket k+1 in [`Self::sync_gradients`]:
    /// [`DdpOptions::overlap`], with [`Overlap::Auto`] decided from the backend and this machine's cores (see
    /// [`Overlap`]).
    pub fn overlaps(&self) -> bool {
        if self.opts.comm_hook != CommHook::None {
            return false; // a compressed reduction runs after the backward pass, over one flat buffer
        }
        match self.opts.overlap {
            Overlap::On => true,
            Overlap::Off => false,
            Overlap::Auto => {
                let cores = std::thread::available_parallelism().map_or(1, usize::from);
                let needed = self.pg.local_world_size().max(1) * (rayon::current_num_threads() + 1);
                self.pg.backend_name() == "nccl" || cores >= needed
            }
        }
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

    /// `loss.backward()` followed by [`Self::sync_gradients`], with the bucket all-reduces overlapped with the
    /// backward pass: `segments` are the cuts recorded while computing `loss` ([`crate::segments::record`]); see
    /// the module docs for how the first call plans the buckets. Collective, like `sync_gradients` (every rank
    /// calls it for the same step, with the same cuts). Without cuts, or with sync off ([`Self::no_sync`]), or
    /// on one rank, it is exactly `loss.backward()` then `sync_gradients`.
    ///
    /// Returns every gradient of the backward pass: the wrapped parameters' averaged across ranks (when sync is
    /// on), other variables' as computed. Gradients equal `loss.backward()`'s, bit for bit (up to the sign of
    /// an exact zero at a cut).
    ///
    /// Errors: those of `sync_gradients`; a rank whose number of segments differs from the others' (on the
    /// first call, on every rank); a parameter that gets a gradient from a segment after its bucket went out
    /// (the model used it across different cuts than when the plan was made); candle's.
    pub fn backward(&self, loss: &Tensor, segments: BackwardSegments) -> Result<GradStore> {
        self.backward_accumulated(loss, segments, GradStore::default())
    }

    /// [`Self::backward`] for the last micro-batch of a gradient-accumulation window: `acc` holds the sums of the
    /// window's earlier micro-batches ([`Self::accumulate_gradients`] inside [`Self::no_sync`]); this
    /// micro-batch's gradients are added to them and the sums are averaged across ranks, overlapped with the
    /// backward pass.
    pub fn backward_accumulated(
        &self,
        loss: &Tensor,
        segments: BackwardSegments,
        mut acc: GradStore,
    ) -> Result<GradStore> {
        let mut slots: Vec<Option<Tensor>> = self.vars.iter().map(|(_, v)| acc.remove(v.as_tensor())).collect();
        self.backward_segments_into(loss, segments, &mut slots, self.require_sync(), |mut store, slots| {
            let mut got = Vec::new();
            for (i, (_, var)) in self.vars.iter().enumerate() {
                if let Some(g) = store.remove(var.as_tensor()) {
                    slots[i] = Some(match slots[i].take() {
                        Some(sum) => (sum + g)?,
                        None => g,
                    });
                    got.push(i);
                }
            }
            acc.extend(store)?; // other variables' gradients, summed over the segments
            Ok(got)
        })?;
        for ((_, var), slot) in self.vars.iter().zip(slots) {
            match slot {
                Some(g) => acc.insert(var.as_tensor(), g),
                None => acc.remove(var.as_tensor()),
            };
        }
        Ok(acc)
    }

    /// The segmented, overlapped backward over caller-owned gradient slots (what the Accelerator uses; the
    /// slots are those of [`Self::reduce_gradients`]): runs `segments`' backward pass of `loss`; after each
    /// segment `add(store, slots)` moves that segment's gradients of the wrapped parameters into `slots`
    /// (summing with what is there, in whatever dtype the caller keeps) and returns the slot indices it gave a
    /// gradient. With `sync`, the slots are averaged across ranks, each bucket as soon as its gradients are
    /// final; without, nothing is communicated.
    ///
    /// Errors: as [`Self::backward`]; [`DdpError::InvalidArgument`] for a slot count that is not the number of
    /// wrapped parameters; `add`'s.
    pub fn backward_segments_into(
        &self,
        loss: &Tensor,
        segments: BackwardSegments,
        slots: &mut [Option<Tensor>],
        sync: bool,
        add: impl FnMut(GradStore, &mut [Option<Tensor>]) -> Result<Vec<usize>>,
    ) -> Result<()> {
        self.run_segments_into(loss, segments, slots, sync, add)
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
    /// Cost: one new tensor per parameter. Between processes of one machine the all_reduce reads the gradients
    /// in place and writes the new tensors itself; elsewhere each bucket is also packed into a reused buffer once.
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

        if self.opts.comm_hook != CommHook::None {
            return self.reduce_compressed(grads, &globally_used);
        }
        let layout = self.layout();
        if layout.buckets.len() == 1 || !self.overlaps() {
            // One bucket, or no spare core for a communication thread (see `Overlap`): bucket by bucket on this
            // thread — a thread that can only time-slice against this one would add its start and its scheduling
            // to every step and hide nothing.
            for plan in &layout.buckets {
                let mut pieces = self.bucket_pieces(plan, grads, &globally_used)?;
                self.pg.all_reduce_piecewise(&mut pieces, plan.dtype, ReduceOp::Avg)?;
                self.take_averages(plan, pieces, grads)?;
            }
            return Ok(());
        }
        self.pipelined(&layout, &globally_used, |pipe| {
            for k in 0..layout.buckets.len() {
                pipe.launch(k, grads)?;
            }
            Ok(())
        })?
        .put_back_into(grads)
    }

    /// [`Self::reduce_gradients`] with a [`CommHook`]: every gradient cast to the hook's 16-bit type into one flat
    /// buffer (zeros for a parameter this rank did not use), one all-reduce of it, cast back into new tensors of
    /// each gradient's dtype. `used`: per parameter, whether some rank has a gradient.
    fn reduce_compressed(&self, grads: &mut [Option<Tensor>], used: &[bool]) -> Result<()> {
        let world = self.pg.world_size() as f64;
        let half = match self.opts.comm_hook {
            CommHook::Fp16 => candle_core::DType::F16,
            _ => candle_core::DType::BF16,
        };
        let mut parts = Vec::with_capacity(grads.len());
        for ((_, var), g) in self.vars.iter().zip(grads.iter()) {
            let g = match g {
                Some(g) => g.clone(),
                None => var.as_tensor().zeros_like()?,
            };
            // fp16 divides first (PyTorch's fp16_compress_hook), so the sum of world_size values stays in range.
            let g = if self.opts.comm_hook == CommHook::Fp16 { g.affine(1.0 / world, 0.0)? } else { g };
            parts.push(g.flatten_all()?.to_dtype(half)?);
        }
        let flat = Tensor::cat(&parts, 0)?;
        let (op, dtype) = match self.opts.comm_hook {
            CommHook::Fp16 => (ReduceOp::Sum, DType::F16),
            _ => (ReduceOp::Avg, DType::BF16),
        };
        let reduced = match half {
            candle_core::DType::F16 => {
                let mut v = flat.to_vec1::<half::f16>()?;
                self.pg.all_reduce_bytes(bytemuck::cast_slice_mut(&mut v), dtype, op)?;
                Tensor::from_vec(v, flat.dims(), flat.device())?
            }
            _ => {
                let mut v = flat.to_vec1::<half::bf16>()?;
                self.pg.all_reduce_bytes(bytemuck::cast_slice_mut(&mut v), dtype, op)?;
                Tensor::from_vec(v, flat.dims(), flat.device())?
            }
        };
        let mut at = 0;
        for ((slot, (_, var)), used) in grads.iter_mut().zip(&self.vars).zip(used) {
            let n = var.as_tensor().elem_count();
            let g = reduced.narrow(0, at, n)?.reshape(var.as_tensor().dims())?.to_dtype(var.as_tensor().dtype())?;
            *slot = used.then_some(g);
            at += n;
        }
        Ok(())
    }

    /// Bucket `plan`'s gradients as the all_reduce's input and output (`pieces`): the all_reduce reads them from
    /// the tensors in `local` where they lie (zeros where a slot is `None`) and writes the averages into new
    /// tensors, which [`Self::take_averages`] puts back — no packed copy of the bucket where the backend reads and
    /// writes pieces itself (the CPU backend's shared memory; other paths pack into the process group's scratch).
    fn bucket_pieces(&self, plan: &BucketPlan, local: &[Option<Tensor>], used: &[bool]) -> Result<BucketPieces> {
        let params = plan.params.iter().zip(&plan.offsets);
        BucketPieces::new(
            plan.dtype,
            params.map(|(&p, &off)| (off..off + self.sizes[p], local[p].as_ref(), used[p])).collect(),
        )
    }

    /// Writes the averages of a reduced bucket into their slots (`None` for parameters no rank used).
    fn take_averages(&self, plan: &BucketPlan, mut pieces: BucketPieces, grads: &mut [Option<Tensor>]) -> Result<()> {
        for (k, &p) in plan.params.iter().enumerate() {
            let var = self.vars[p].1.as_tensor();
            grads[p] = pieces.take(k, var.shape(), var.device())?;
        }
        Ok(())
    }

    /// The current bucket layout.
    fn layout(&self) -> Arc<BucketLayout> {
        crate::sync::lock(&self.layout).clone()
    }

    /// The pipeline: `produce` launches buckets (their gradients handed over as [`BucketPieces`], no copy) while a
    /// communication thread all-reduces the ones launched before, strictly in launch order — which must be bucket
    /// order, the same on every rank. `used`: per parameter, whether some rank has a gradient for it. Returns the
    /// reduced buckets once `produce` is done and every launched bucket came back.
    fn pipelined<'b>(
        &self,
        layout: &'b BucketLayout,
        used: &'b [bool],
        produce: impl FnOnce(&mut Pipeline<'_, 'b>) -> Result<()>,
    ) -> Result<Reduced<'_, 'b>> {
        std::thread::scope(|scope| {
            let (to_comm, comm_inbox) = mpsc::channel::<(usize, BucketPieces)>();
            let (to_main, main_inbox) = mpsc::channel::<Result<(usize, BucketPieces)>>();
            let (pg, buckets) = (&self.pg, &layout.buckets);
            scope.spawn(move || {
                for (k, mut pieces) in comm_inbox {
                    let r = pg.all_reduce_piecewise(&mut pieces, buckets[k].dtype, ReduceOp::Avg);
                    let failed = r.is_err();
                    if to_main.send(r.map(|()| (k, pieces))).is_err() || failed {
                        break;
                    }
                }
            });
            let mut pipe = Pipeline { ddp: self, layout, used, to_comm: Some(to_comm), launched: 0 };
            let produced = produce(&mut pipe);
            let launched = pipe.launched;
            drop(pipe.to_comm.take()); // the comm thread ends once it has reduced what it was sent
            let mut first_err = produced.err();
            let mut reduced: Vec<Option<BucketPieces>> = (0..layout.buckets.len()).map(|_| None).collect();
            for msg in main_inbox {
                match msg {
                    Ok((k, pieces)) => {
                        reduced[k] = Some(pieces);
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            if let Some(e) = first_err {
                return Err(e);
            }
            debug_assert_eq!(reduced.iter().filter(|r| r.is_some()).count(), launched);
            Ok(Reduced { ddp: self, layout, reduced })
        })
    }

    /// Copies rank 0's parameter values into every rank's `Var`s, one broadcast per bucket.
    fn broadcast_parameters(&self) -> Result<()> {
        let mut buf = FlatBuffer::default();
        for plan in &self.layout().buckets {
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
    /// within a bucket, reverse registration order — until the first overlapped [`Self::backward`] rebuilds the
    /// buckets in the order gradients become final (see the module docs).
    pub fn bucket_layout(&self) -> Vec<Vec<usize>> {
        self.layout().buckets.iter().map(|b| b.params.clone()).collect()
    }

    /// Size of each bucket in bytes, in communication order.
    pub fn bucket_bytes(&self) -> Vec<usize> {
        self.layout().buckets.iter().map(|b| b.bytes).collect()
    }
}

/// Byte offsets within each bucket, from an assignment of parameters to buckets.
fn plan_buckets(assigned: Vec<bucket::Bucket>, sizes: &[usize], dtypes: &[DType]) -> Vec<BucketPlan> {
    assigned
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
        .collect()
}

/// The launching side of [`DistributedDataParallel::pipelined`]: hands buckets to the communication thread.
struct Pipeline<'d, 'b> {
    ddp: &'d DistributedDataParallel,
    layout: &'b BucketLayout,
    used: &'b [bool],
    to_comm: Option<mpsc::Sender<(usize, BucketPieces)>>,
    /// Buckets sent so far (always the first `launched`, in order).
    launched: usize,
}

impl Pipeline<'_, '_> {
    /// Sends bucket `k` of `grads` to be all-reduced. Buckets must be launched in order.
    fn launch(&mut self, k: usize, grads: &[Option<Tensor>]) -> Result<()> {
        debug_assert_eq!(k, self.launched, "buckets go out in bucket order");
        let pieces = self.ddp.bucket_pieces(&self.layout.buckets[k], grads, self.used)?;
        self.launched += 1;
        // A closed channel means the comm thread stopped on an error, which `pipelined` reports.
        if let Some(tx) = &self.to_comm {
            let _ = tx.send((k, pieces));
        }
        Ok(())
    }

    /// Buckets launched so far.
    fn launched(&self) -> usize {
        self.launched
    }
}

/// Reduced buckets, ready to be put back.
struct Reduced<'d, 'b> {
    ddp: &'d DistributedDataParallel,
    layout: &'b BucketLayout,
    /// Per bucket, its averages (`None` for a bucket that was not launched).
    reduced: Vec<Option<BucketPieces>>,
}

impl Reduced<'_, '_> {
    /// Writes the averages into `grads` (`None` for parameters no rank had a gradient for).
    fn put_back_into(self, grads: &mut [Option<Tensor>]) -> Result<()> {
        for (plan, pieces) in self.layout.buckets.iter().zip(self.reduced) {
            if let Some(pieces) = pieces {
                self.ddp.take_averages(plan, pieces, grads)?;
            }
        }
        Ok(())
    }
}
