//! Differentiable collectives over a tensor-parallel group (Megatron-LM, Shoeybi et al. 2019, §3; picotron's
//! `tp_communications.py`): candle custom ops whose backward is the conjugate collective, so a model written
//! with them trains under `Tensor::backward` like any other.
//!
//! | function | forward | backward |
//! |---|---|---|
//! | [`copy_to_group`] (Megatron's *f*) | identity | all-reduce (sum) |
//! | [`reduce_from_group`] (*g*) | all-reduce (sum) | identity |
//! | [`gather_from_group`] | all-gather along `dim` | keep this rank's chunk |
//! | [`split_to_group`] | keep this rank's chunk along `dim` | all-gather along `dim` |
//! | [`gather_shards`] (FSDP's unshard) | all-gather of 1-D chunks | reduce-scatter (sum) |
//!
//! Each backward runs its collective once: an all-reduce whose backward also all-reduced would multiply the
//! gradient by the group size (pytorch#58005). Every rank of the group must call the same functions in the
//! same order with tensors of the same shape and dtype; a one-rank group makes every function the identity.
//!
//! How: the forward collective runs at tensor level on a detached input (the [`ProcessGroup`] tensor helpers,
//! so CPU tensors over the CPU backend and CUDA tensors over NCCL alike); a custom op then only attaches the
//! backward — [`CustomOp2`] "take the second argument's values, send the gradient to the first" for *g*, gather
//! and split, [`CustomOp1`] identity for *f*. The ops' forward is a plain strided copy written against candle's
//! `BackendStorage` / `BackendDevice` traits, so it is device-generic. Tensors on a device without a copy here
//! (Metal) are refused by candle with "no metal implementation for ...".
//!
//! Errors: those of the collectives (unsupported dtype or device, a peer failing), and for gather / split a
//! `dim` out of range or (split) a size the group size does not divide.

use crate::{CommHook, DdpError, ProcessGroup, ReduceOp, Result};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

/// A strided copy of `s` (viewed through `l`) into a fresh contiguous storage on the same device.
fn copy_storage<S: BackendStorage<Device: BackendDevice<Storage = S>>>(
    s: &S,
    l: &Layout,
) -> candle_core::Result<(S, Shape)> {
    // SAFETY: `copy_strided_src` writes every element of the `l.shape()`-sized buffer before it is read.
    let mut dst = unsafe { s.device().alloc_uninit(l.shape(), s.dtype())? };
    s.copy_strided_src(&mut dst, 0, l)?;
    Ok((dst, l.shape().clone()))
}

/// A ddp-core error raised inside a backward pass, carried through candle's error type.
fn wrap(e: DdpError) -> candle_core::Error {
    // No `Error::wrap`: it captures a backtrace under RUST_BACKTRACE=1, which every rank would then print.
    candle_core::Error::Wrapped(Box::new(e))
}

/// *f*'s op: identity forward, all-reduce (sum) backward.
struct CopyToGroup {
    pg: ProcessGroup,
}

impl CustomOp1 for CopyToGroup {
    fn name(&self) -> &'static str {
        "copy-to-group"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        copy_storage(s, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        copy_storage(s, l)
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(self.pg.all_reduce_tensor(grad, ReduceOp::Sum).map_err(wrap)?))
    }
}

/// What the gradient of [`TakeSecond`]'s first argument is, given the gradient of its result.
enum Backward {
    /// The gradient unchanged (*g*).
    Identity,
    /// This rank's chunk of the gradient along `dim` (gather).
    Chunk { dim: usize, rank: usize, len: usize },
    /// The gradient all-gathered along `dim` (split).
    AllGather { dim: usize, pg: ProcessGroup },
    /// The gradient reduce-scattered (summed) over the group, this rank's chunk kept (gather_shards), as `how`
    /// says.
    ReduceScatter { pg: ProcessGroup, how: ShardGradient },
}

/// `TakeSecond(x, v)`: forward returns `v`'s values (computed from `x` by a collective outside the graph); the
/// backward gives `x` the gradient [`Backward`] says and `v` none.
struct TakeSecond {
    backward: Backward,
}

impl CustomOp2 for TakeSecond {
    fn name(&self) -> &'static str {
        match self.backward {
            Backward::Identity => "reduce-from-group",
            Backward::Chunk { .. } => "gather-from-group",
            Backward::AllGather { .. } => "split-to-group",
            Backward::ReduceScatter { .. } => "gather-shards",
        }
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        copy_storage(s2, l2)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        copy_storage(s2, l2)
    }

    fn bwd(
        &self,
        _arg1: &Tensor,
        _arg2: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = match &self.backward {
            Backward::Identity => grad.clone(),
            Backward::Chunk { dim, rank, len } => grad.narrow(*dim, rank * len, *len)?,
            Backward::AllGather { dim, pg } => all_gather_dim(pg, grad, *dim).map_err(wrap)?,
            Backward::ReduceScatter { pg, how } => how.reduce_scatter(pg, grad)?,
        };
        Ok((Some(g), None))
    }
}

/// A fully sharded parameter made whole for one use (FSDP's unshard; ZeRO stage 3, Rajbhandari et al. 2020 §5.3):
/// forward all-gathers every rank's 1-D `chunk` (`[c]`, the same length on every rank) into `[world · c]` in
/// group-rank order; backward reduce-scatters the gradient of the whole (summed over the group, not averaged) and
/// gives each rank the gradient of its own chunk. The whole tensor lives as long as the graph that uses it: a
/// caller that must not keep it recomputes the use at the backward pass (activation checkpointing, as FSDP units
/// are). A one-rank group returns `chunk` itself.
///
/// Errors: `chunk` not 1-D; the collectives'.
pub fn gather_shards(chunk: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    gather_shards_with(chunk, pg, ShardGradient::default())
}

/// A check run by a backward pass before it reduce-scatters a gathered parameter's gradient: `Err(reason)` fails
/// the backward with the reason (e.g. the whole parameter was gathered before an optimizer step and used after
/// it: a stale copy).
pub type BackwardGuard = std::sync::Arc<dyn Fn() -> std::result::Result<(), String> + Send + Sync>;

/// How the backward pass of [`gather_shards_with`] reduce-scatters the gradient of the whole parameter.
#[derive(Clone, Default)]
pub struct ShardGradient {
    /// Run first; its `Err` fails the backward ([`BackwardGuard`]).
    pub guard: Option<BackwardGuard>,
    /// Compression of the reduce-scatter, as PyTorch's compress hooks: `Bf16` sums in bf16; `Fp16` divides by
    /// `fp16_divisor` first (fp16's range: the hook averages before it sums) and sums in fp16. The result is cast
    /// back to the gradient's dtype.
    pub hook: CommHook,
    /// What `Fp16` divides by (the data-parallel ranks the gradient is averaged over); unused otherwise.
    pub fp16_divisor: f64,
}

impl ShardGradient {
    fn reduce_scatter(&self, pg: &ProcessGroup, grad: &Tensor) -> candle_core::Result<Tensor> {
        use candle_core::DType;
        if let Some(guard) = &self.guard {
            guard().map_err(candle_core::Error::Msg)?;
        }
        let grad = grad.contiguous()?;
        let wire = match self.hook {
            CommHook::None => grad.clone(),
            CommHook::Bf16 => grad.to_dtype(DType::BF16)?,
            CommHook::Fp16 => grad.affine(1.0 / self.fp16_divisor, 0.0)?.to_dtype(DType::F16)?,
        };
        pg.reduce_scatter_tensor(&wire, ReduceOp::Sum).map_err(wrap)?.to_dtype(grad.dtype())
    }
}

/// [`gather_shards`] whose backward reduces as `how` says (a guard, compression).
///
/// Errors: as [`gather_shards`].
pub fn gather_shards_with(chunk: &Tensor, pg: &ProcessGroup, how: ShardGradient) -> Result<Tensor> {
    if chunk.rank() != 1 {
        return Err(DdpError::InvalidArgument(format!(
            "gather_shards: a shard is a 1-D chunk, got shape {:?} (flatten the parameter and cut it into equal \
             chunks first)",
            chunk.dims()
        )));
    }
    if pg.world_size() == 1 {
        return Ok(chunk.clone());
    }
    let whole = pg.all_gather_tensor(&chunk.detach())?;
    attach(chunk, whole, Backward::ReduceScatter { pg: pg.clone(), how })
}

/// [`gather_shards_with`] for a `whole` gathered beforehand (a prefetch: the all-gather of `chunk`'s values over
/// `pg`'s ranks, `[world · c]`, done elsewhere — e.g. on a communication thread over a second communicator of the
/// same ranks): attaches the backward (reduce-scatter over `pg`, as `how` says) to it.
///
/// Errors: `chunk` not 1-D, or `whole` not `world` times its length.
pub fn attach_gathered_shards(chunk: &Tensor, whole: Tensor, pg: &ProcessGroup, how: ShardGradient) -> Result<Tensor> {
    if chunk.rank() != 1 || whole.dims() != [chunk.dim(0)? * pg.world_size()] {
        return Err(DdpError::InvalidArgument(format!(
            "attach_gathered_shards: a gathered {:?} for a chunk of {:?} over {} ranks; pass the all-gather of \
             that chunk",
            whole.dims(),
            chunk.dims(),
            pg.world_size()
        )));
    }
    attach(chunk, whole, Backward::ReduceScatter { pg: pg.clone(), how })
}

/// All-gather of `x` along `dim` (chunks in group-rank order), outside the autograd graph.
fn all_gather_dim(pg: &ProcessGroup, x: &Tensor, dim: usize) -> Result<Tensor> {
    if dim == 0 {
        return pg.all_gather_tensor(&x.detach());
    }
    // [world, ..x] gathered along a new leading dim, then its slices laid side by side along `dim`.
    let stacked = pg.all_gather_tensor(&x.detach().unsqueeze(0)?)?;
    let pieces = (0..pg.world_size()).map(|r| stacked.get(r)).collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&pieces, dim)?)
}

/// `value` (computed from `x` outside the graph) with `backward` attached towards `x`; `value` itself when `x`
/// carries no gradient.
fn attach(x: &Tensor, value: Tensor, backward: Backward) -> Result<Tensor> {
    if !x.track_op() {
        return Ok(value);
    }
    Ok(x.apply_op2(&value, TakeSecond { backward })?)
}

fn check_dim(x: &Tensor, dim: usize, what: &str) -> Result<()> {
    if dim >= x.rank() {
        return Err(DdpError::InvalidArgument(format!(
            "{what}: dim {dim} is out of range for a tensor of shape {:?} (rank {}; dims 0..{} fit)",
            x.dims(),
            x.rank(),
            x.rank()
        )));
    }
    Ok(())
}

/// *f*: identity forward, all-reduce (sum) of the gradient over `pg` backward. Put it before a column-parallel
/// matmul whose input is replicated. Shape and dtype unchanged.
pub fn copy_to_group(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    // Without a gradient to all-reduce, *f* is the identity (no copy).
    if pg.world_size() == 1 || !x.track_op() {
        return Ok(x.clone());
    }
    Ok(x.apply_op1(CopyToGroup { pg: pg.clone() })?)
}

/// *g*: all-reduce (sum) over `pg` forward, identity backward. Put it after a row-parallel matmul whose output
/// is a partial sum. Shape and dtype unchanged.
pub fn reduce_from_group(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    if pg.world_size() == 1 {
        return Ok(x.clone());
    }
    let reduced = pg.all_reduce_tensor(&x.detach(), ReduceOp::Sum)?;
    attach(x, reduced, Backward::Identity)
}

/// All-gather along `dim` forward (`[.., n, ..] → [.., n·world, ..]`, chunks in group-rank order); backward keeps
/// this rank's chunk of the gradient.
pub fn gather_from_group(x: &Tensor, pg: &ProcessGroup, dim: usize) -> Result<Tensor> {
    check_dim(x, dim, "gather_from_group")?;
    if pg.world_size() == 1 {
        return Ok(x.clone());
    }
    let gathered = all_gather_dim(pg, x, dim)?;
    let backward = Backward::Chunk { dim, rank: pg.rank(), len: x.dim(dim)? };
    attach(x, gathered, backward)
}

/// This rank's chunk along `dim` forward (`[.., n·world, ..] → [.., n, ..]`; `n·world` must divide evenly);
/// backward all-gathers the gradient along `dim`.
pub fn split_to_group(x: &Tensor, pg: &ProcessGroup, dim: usize) -> Result<Tensor> {
    check_dim(x, dim, "split_to_group")?;
    let (size, world) = (x.dim(dim)?, pg.world_size());
    if !size.is_multiple_of(world) {
        return Err(DdpError::InvalidArgument(format!(
            "split_to_group: dim {dim} of shape {:?} ({size}) is not divisible by the group size {world}",
            x.dims()
        )));
    }
    if world == 1 {
        return Ok(x.clone());
    }
    let len = size / world;
    let chunk = x.detach().narrow(dim, pg.rank() * len, len)?;
    let backward = Backward::AllGather { dim, pg: pg.clone() };
    attach(x, chunk, backward)
}
