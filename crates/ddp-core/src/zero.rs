//! ZeRO: sharded optimizer state over a process group (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
//! Training Trillion Parameter Models", §5.1–5.2 and §7; DeepSpeed's `runtime/zero/stage_1_and_2.py`; PyTorch's
//! `torch.distributed.optim.ZeroRedundancyOptimizer`).
//!
//! Two layers:
//!
//! - **The primitives** every ZeRO stage of accel-rs is built from: [`FlatChunk`] (how one parameter's flattened
//!   elements are cut into one equal, zero-padded chunk per rank) and [`FlatShards`] (a list of parameters cut over
//!   a group: the rank-major buffer, its reduce-scatter — averaged, or summed for a caller that accumulates
//!   micro-batches — with the optional [`CommHook`] compression and a replicate group (HSDP), and the all-gather of
//!   updated chunks back into whole parameters). A [`FlatShards::subset`] reduce-scatters some parameters only (a
//!   bucket: the parameters one backward segment produced, ZeRO-2).
//! - **[`ZeroRedundancyOptimizer`]**, the level-1 optimizer wrapper: each rank's optimizer owns chunk `rank` of
//!   every parameter, so its state (AdamW's two moments) is `1/N` of the model's.
//!
//! # The layout
//!
//! A parameter of `numel` elements on a group of `N` ranks is flattened (row-major, as `flatten_all`) and cut into
//! `N` chunks of `chunk = max(1, ceil(numel / N))` elements; rank `r` owns elements `r·chunk .. (r+1)·chunk`, the
//! part beyond `numel` being zeros. Uneven and tiny parameters work alike: a bias of 1 element on 4 ranks is 4
//! chunks of 1, rank 0's holding the value and ranks 1–3 a zero. A list of parameters travels as one **rank-major**
//! buffer of `N · per_rank` elements (`per_rank = Σ chunk`): rank 0's chunks of every parameter in list order,
//! then rank 1's, …: exactly what a reduce-scatter hands out (block `r` to rank `r`) and an all-gather collects.
//!
//! # Dtypes on the wire
//!
//! Gradients and parameters travel as fp32 whatever their dtype (converted on the way in, and back into each
//! parameter's dtype on the way out), unless a [`CommHook`] compresses the reduce-scatter to 16 bits with the
//! semantics of PyTorch's `fp16_compress_hook` (divided by the data-parallel ranks *before* the cast: fp16's range)
//! and `bf16_compress_hook` (cast, summed, divided after). Reductions add in rank order (the CPU backend's fixed
//! order on the CPU backend), so every rank gets the same bits.
//!
//! # Communication
//!
//! A reduce-scatter and an all-gather of the model per step: each moves `(N−1)/N · Ψ` elements per rank, together
//! the `2Ψ` of DDP's ring all-reduce (ZeRO paper §7: stage 1 and 2 cost what data parallelism costs).

use crate::ddp::{fingerprint, flat};
use crate::{CommHook, DdpError, ProcessGroup, ReduceOp, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;

/// How one parameter's flattened elements are cut into a group's chunks (see the [module](self) docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlatChunk {
    /// Elements of the parameter.
    pub numel: usize,
    /// Elements per chunk: `max(1, ceil(numel / ranks))`; the chunks together hold `chunk · ranks ≥ numel`
    /// elements, the rest zero padding.
    pub chunk: usize,
}

impl FlatChunk {
    /// The cut of a parameter of `numel` elements over `ranks` ranks (0 counts as 1).
    pub fn of(numel: usize, ranks: usize) -> Self {
        FlatChunk { numel, chunk: numel.div_ceil(ranks.max(1)).max(1) }
    }

    /// The parameter's elements (flat indices) in chunk `rank`: `chunk` of them, fewer in the last chunk holding
    /// any, none beyond it (the rest of the chunk is padding).
    pub fn range(&self, rank: usize) -> std::ops::Range<usize> {
        (rank * self.chunk).min(self.numel)..((rank + 1) * self.chunk).min(self.numel)
    }

    /// Chunk `rank` of `t` (any shape, `numel` elements, any dtype): fp32, 1-D `[chunk]`, zero padded. Never `t`
    /// itself (a view of `t`'s storage at most, not a variable: `Var::from_tensor` of it copies).
    ///
    /// Errors: [`DdpError::InvalidArgument`] when `t` does not have `numel` elements.
    pub fn slice(&self, t: &Tensor, rank: usize) -> Result<Tensor> {
        if t.elem_count() != self.numel {
            return Err(DdpError::InvalidArgument(format!(
                "FlatChunk::slice: a tensor of shape {:?} ({} elements) cut as a parameter of {} elements",
                t.dims(),
                t.elem_count(),
                self.numel
            )));
        }
        let flat = t.flatten_all()?.to_dtype(DType::F32)?;
        let range = self.range(rank);
        let mine = flat.narrow(0, range.start, range.len())?;
        Ok(match range.len() {
            // The whole of a 1-D f32 variable (one rank, or one element): a copy, so that `Var::from_tensor` of
            // the chunk makes a new variable rather than returning the parameter itself.
            n if n == self.chunk && mine.is_variable() => mine.copy()?,
            n if n == self.chunk => mine,
            n => Tensor::cat(&[mine, Tensor::zeros(self.chunk - n, DType::F32, t.device())?], 0)?,
        })
    }

    /// The whole tensor of shape `dims` from every rank's chunk in rank order (`all`: 1-D `[ranks · chunk]`, or at
    /// least its first `numel` elements), padding dropped; `all`'s dtype.
    pub fn unslice(&self, all: &Tensor, dims: &[usize]) -> Result<Tensor> {
        Ok(all.narrow(0, 0, self.numel)?.reshape(dims)?)
    }
}

/// A list of parameters cut over the `ranks` ranks of a group: one [`FlatChunk`] per parameter, and the
/// collectives over them (see the [module](self) docs for the layout).
///
/// Methods that communicate take the groups as arguments (the layout holds none): `shard`, whose size must be
/// [`FlatShards::ranks`], is the group the chunks are cut over; `replicate` (HSDP: shard inside a group,
/// replicate across groups; `None` or a group of 1 for plain ZeRO) is the group of the ranks holding the same
/// chunk. Averages are over `shard × replicate` ranks. Gradients are given as one slot per parameter in list order,
/// `None` counting as zeros, of any shape with the parameter's element count and any float dtype; chunks come back
/// as fp32 1-D `[chunk]` tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatShards {
    chunks: Vec<FlatChunk>,
    ranks: usize,
}

impl FlatShards {
    /// Parameters of `numels` elements cut over `ranks` ranks (0 counts as 1).
    pub fn new(numels: &[usize], ranks: usize) -> Self {
        let ranks = ranks.max(1);
        FlatShards { chunks: numels.iter().map(|&n| FlatChunk::of(n, ranks)).collect(), ranks }
    }

    /// The ranks the parameters are cut over.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// One cut per parameter, in list order.
    pub fn chunks(&self) -> &[FlatChunk] {
        &self.chunks
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Whether the list has no parameter.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Elements of one rank's chunks of every parameter (`Σ chunk`): one rank's block of the rank-major buffer,
    /// what each rank's optimizer steps (ZeRO-1: its state is this size, `≈ Ψ / ranks`).
    pub fn per_rank(&self) -> usize {
        self.chunks.iter().map(|c| c.chunk).sum()
    }

    /// The parameters `params` (indices into this list, in the order given) as a list of their own, cut alike:
    /// a bucket of ZeRO-2, reduce-scattered when the backward segment producing its gradients is done. A
    /// parameter's chunk is the same in the subset as in the whole list, so per element a bucket's reduce-scatter
    /// adds the same numbers as the whole list's.
    ///
    /// Errors: [`DdpError::InvalidArgument`] for an index beyond the list.
    pub fn subset(&self, params: &[usize]) -> Result<FlatShards> {
        let chunks = params
            .iter()
            .map(|&i| {
                self.chunks.get(i).copied().ok_or_else(|| {
                    DdpError::InvalidArgument(format!(
                        "FlatShards::subset: parameter index {i} in a list of {} parameters",
                        self.chunks.len()
                    ))
                })
            })
            .collect::<Result<_>>()?;
        Ok(FlatShards { chunks, ranks: self.ranks })
    }

    /// The rank-major fp32 buffer of `grads` (one slot per parameter, `None` = zeros): `ranks · per_rank`
    /// elements, rank `r`'s block holding chunk `r` of every parameter in list order, zero padded. Local, no
    /// communication.
    ///
    /// Errors: [`DdpError::InvalidArgument`] for a slot count other than [`FlatShards::len`] or a gradient whose
    /// element count is not its parameter's.
    pub fn pack_rank_major<G: AsRef<Tensor>>(&self, grads: &[Option<G>]) -> Result<Vec<f32>> {
        self.check_slots("gradient", grads.len())?;
        let per_rank = self.per_rank();
        let mut buf = vec![0f32; self.ranks * per_rank];
        let mut offset = 0;
        for (i, (g, c)) in grads.iter().zip(&self.chunks).enumerate() {
            if let Some(g) = g {
                let g = g.as_ref();
                self.check_numel("gradient", i, g, c)?;
                let f = g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                for r in 0..self.ranks {
                    let range = c.range(r);
                    let at = r * per_rank + offset;
                    buf[at..at + range.len()].copy_from_slice(&f[range]);
                }
            }
            offset += c.chunk;
        }
        Ok(buf)
    }

    /// This rank's chunks of the gradients averaged over `shard × replicate` ranks: one reduce-scatter over
    /// `shard` of the rank-major buffer (summed in rank order), an all-reduce of the result over `replicate` when
    /// it has more than one rank, then `· (1 / ranks)` in fp32. With [`CommHook::Fp16`] every value is divided by
    /// the ranks before its cast to fp16 (and not after); with [`CommHook::Bf16`] cast to bf16, summed in bf16,
    /// divided after the cast back. Collective over `shard` (and `replicate`): every rank calls it with the same
    /// list. Returns one fp32 `[chunk]` tensor per parameter on `device`.
    ///
    /// Equals [`FlatShards::finish_mean`] of [`FlatShards::reduce_scatter_sum`], bit for bit.
    ///
    /// Errors: those of [`FlatShards::pack_rank_major`]; `shard`'s size other than [`FlatShards::ranks`];
    /// collective errors.
    pub fn reduce_scatter_mean<G: AsRef<Tensor>>(
        &self,
        shard: &ProcessGroup,
        replicate: Option<&ProcessGroup>,
        hook: CommHook,
        grads: &[Option<G>],
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        let mine = self.scatter(shard, replicate, hook, grads)?;
        self.finish(mine, replicate, hook, device)
    }

    /// This rank's chunks of the gradients summed over `shard` (one reduce-scatter), not averaged and not reduced
    /// over `replicate`: for a caller that accumulates micro-batches as chunks (ZeRO-2: each micro-batch, or each
    /// bucket of one, reduce-scattered as soon as it exists) and finishes the window's sums once with
    /// [`FlatShards::finish_mean`]. With [`CommHook::Fp16`] each value is already divided by the `shard × replicate`
    /// ranks before its cast (fp16's range), so the "sum" is the shard group's part of the mean; `finish_mean`
    /// does not divide it again. `replicate` is only counted here. Collective over `shard`; one fp32 `[chunk]`
    /// tensor per parameter on `device`.
    ///
    /// Errors: as [`FlatShards::reduce_scatter_mean`].
    pub fn reduce_scatter_sum<G: AsRef<Tensor>>(
        &self,
        shard: &ProcessGroup,
        replicate: Option<&ProcessGroup>,
        hook: CommHook,
        grads: &[Option<G>],
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        let mine = self.scatter(shard, replicate, hook, grads)?;
        self.split(&mine, None, device)
    }

    /// The averages of chunk sums ([`FlatShards::reduce_scatter_sum`]'s results, possibly added over
    /// micro-batches; `None` = zeros): all-reduced over `replicate` when it has more than one rank — in the hook's
    /// precision, the chunks cast to it and back — then `· (1 / ranks)` over `shard × replicate` ranks unless the
    /// fp16 hook divided first. Collective over `replicate` only. One fp32 `[chunk]` tensor per parameter on
    /// `device`.
    ///
    /// Errors: [`DdpError::InvalidArgument`] for a slot count other than [`FlatShards::len`] or a sum that is
    /// not its parameter's `[chunk]`; collective errors.
    pub fn finish_mean<G: AsRef<Tensor>>(
        &self,
        replicate: Option<&ProcessGroup>,
        hook: CommHook,
        sums: &[Option<G>],
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        self.check_slots("chunk sum", sums.len())?;
        let mut mine = Vec::with_capacity(self.per_rank());
        for (i, (s, c)) in sums.iter().zip(&self.chunks).enumerate() {
            match s {
                Some(s) => {
                    let s = s.as_ref();
                    if s.elem_count() != c.chunk {
                        return Err(DdpError::InvalidArgument(format!(
                            "FlatShards::finish_mean: chunk sum {i} has {} elements, its chunk {}",
                            s.elem_count(),
                            c.chunk
                        )));
                    }
                    mine.extend(s.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
                }
                None => mine.resize(mine.len() + c.chunk, 0.0),
            }
        }
        self.finish(mine, replicate, hook, device)
    }

    /// Every rank's chunks (`mine[i]`: this rank's chunk of parameter `i`, `[chunk]` elements, any dtype)
    /// all-gathered over `shard` into whole flat fp32 tensors, `[numel]` each, on `mine[i]`'s device: e.g. an
    /// optimizer buffer of the chunks consolidated for a checkpoint. Collective over `shard`.
    ///
    /// Errors: [`DdpError::InvalidArgument`] for a count or a chunk size that does not match; `shard`'s size other
    /// than [`FlatShards::ranks`]; collective errors.
    pub fn all_gather<G: AsRef<Tensor>>(&self, shard: &ProcessGroup, mine: &[G]) -> Result<Vec<Tensor>> {
        let mine: Vec<&Tensor> = mine.iter().map(AsRef::as_ref).collect();
        let all = self.gather(shard, &mine)?;
        self.chunks
            .iter()
            .enumerate()
            .map(|(i, c)| c.unslice(&self.whole(&all, i, mine[i].device())?, &[c.numel]))
            .collect()
    }

    /// The updated chunks (`mine[i]`: this rank's chunk of parameter `i`, e.g. the variables an optimizer
    /// stepped) all-gathered over `shard` into the whole parameters `full` (each set to its shape, dtype and
    /// device; padding dropped). Collective over `shard`. The values are copied, never added: every rank's
    /// parameters end bit-identical.
    ///
    /// Errors: as [`FlatShards::all_gather`]; a `full` parameter whose element count is not its chunk's `numel`.
    pub fn all_gather_into(&self, shard: &ProcessGroup, mine: &[Var], full: &[Var]) -> Result<()> {
        self.check_slots("whole parameter", full.len())?;
        for (i, (v, c)) in full.iter().zip(&self.chunks).enumerate() {
            self.check_numel("whole parameter", i, v.as_tensor(), c)?;
        }
        let mine: Vec<&Tensor> = mine.iter().map(Var::as_tensor).collect();
        let all = self.gather(shard, &mine)?;
        for (i, (master, c)) in full.iter().zip(&self.chunks).enumerate() {
            let t = self.whole(&all, i, master.device())?;
            master.set(&c.unslice(&t, master.dims())?.to_dtype(master.dtype())?)?;
        }
        Ok(())
    }

    /// The reduce-scatter of [`Self::reduce_scatter_sum`] as one flat vector (this rank's block, in list order).
    fn scatter<G: AsRef<Tensor>>(
        &self,
        shard: &ProcessGroup,
        replicate: Option<&ProcessGroup>,
        hook: CommHook,
        grads: &[Option<G>],
    ) -> Result<Vec<f32>> {
        self.check_group(shard)?;
        let input = self.pack_rank_major(grads)?;
        let per_rank = self.per_rank();
        let ranks = self.data_parallel_ranks(replicate);
        Ok(match hook {
            CommHook::None => {
                let mut mine = vec![0f32; per_rank];
                shard.reduce_scatter(&input, &mut mine, ReduceOp::Sum)?;
                mine
            }
            // fp16 divides first (its range); bf16 after, as PyTorch's compress hooks.
            CommHook::Fp16 => {
                let half: Vec<half::f16> = input.iter().map(|v| half::f16::from_f32(v / ranks)).collect();
                drop(input);
                let mut mine = vec![half::f16::ZERO; per_rank];
                shard.reduce_scatter(&half, &mut mine, ReduceOp::Sum)?;
                mine.iter().map(|v| v.to_f32()).collect()
            }
            CommHook::Bf16 => {
                let half: Vec<half::bf16> = input.iter().map(|v| half::bf16::from_f32(*v)).collect();
                drop(input);
                let mut mine = vec![half::bf16::ZERO; per_rank];
                shard.reduce_scatter(&half, &mut mine, ReduceOp::Sum)?;
                mine.iter().map(|v| v.to_f32()).collect()
            }
        })
    }

    /// This rank's block of sums → averaged chunks (see [`Self::finish_mean`]).
    fn finish(
        &self,
        mut mine: Vec<f32>,
        replicate: Option<&ProcessGroup>,
        hook: CommHook,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        if let Some(rep) = replicate.filter(|g| g.world_size() > 1) {
            match hook {
                CommHook::None => rep.all_reduce(&mut mine, ReduceOp::Sum)?,
                CommHook::Fp16 => {
                    let mut h: Vec<half::f16> = mine.iter().map(|v| half::f16::from_f32(*v)).collect();
                    rep.all_reduce(&mut h, ReduceOp::Sum)?;
                    mine = h.iter().map(|v| v.to_f32()).collect();
                }
                CommHook::Bf16 => {
                    let mut h: Vec<half::bf16> = mine.iter().map(|v| half::bf16::from_f32(*v)).collect();
                    rep.all_reduce(&mut h, ReduceOp::Sum)?;
                    mine = h.iter().map(|v| v.to_f32()).collect();
                }
            }
        }
        let scale = match hook {
            CommHook::Fp16 => 1.0,
            CommHook::None | CommHook::Bf16 => 1.0 / self.data_parallel_ranks(replicate),
        };
        self.split(&mine, Some(scale), device)
    }

    /// This rank's block cut into one `[chunk]` tensor per parameter, each value multiplied by `scale` if given.
    fn split(&self, mine: &[f32], scale: Option<f32>, device: &Device) -> Result<Vec<Tensor>> {
        let mut at = 0;
        let mut out = Vec::with_capacity(self.chunks.len());
        for c in &self.chunks {
            let part = &mine[at..at + c.chunk];
            let values = match scale {
                Some(s) => part.iter().map(|v| v * s).collect(),
                None => part.to_vec(),
            };
            out.push(Tensor::from_vec(values, c.chunk, device)?);
            at += c.chunk;
        }
        Ok(out)
    }

    /// All-gathers this rank's chunks (checked) over `shard`: the rank-major buffer of every rank's chunks.
    fn gather(&self, shard: &ProcessGroup, mine: &[&Tensor]) -> Result<Vec<f32>> {
        self.check_group(shard)?;
        self.check_slots("chunk", mine.len())?;
        let per_rank = self.per_rank();
        let mut block = Vec::with_capacity(per_rank);
        for (i, (t, c)) in mine.iter().zip(&self.chunks).enumerate() {
            if t.elem_count() != c.chunk {
                return Err(DdpError::InvalidArgument(format!(
                    "FlatShards: chunk {i} has {} elements, expected {} (FlatChunk::chunk)",
                    t.elem_count(),
                    c.chunk
                )));
            }
            block.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
        }
        let mut all = vec![0f32; self.ranks * per_rank];
        shard.all_gather(&block, &mut all)?;
        Ok(all)
    }

    /// Parameter `i`'s chunks from every rank, in rank order, out of the rank-major `all`: 1-D `[ranks · chunk]`.
    fn whole(&self, all: &[f32], i: usize, device: &Device) -> Result<Tensor> {
        let per_rank = self.per_rank();
        let offset: usize = self.chunks[..i].iter().map(|c| c.chunk).sum();
        let c = self.chunks[i].chunk;
        let mut flat = Vec::with_capacity(self.ranks * c);
        for r in 0..self.ranks {
            flat.extend_from_slice(&all[r * per_rank + offset..r * per_rank + offset + c]);
        }
        Ok(Tensor::from_vec(flat, self.ranks * c, device)?)
    }

    /// `shard × replicate` as the divisor of an average.
    fn data_parallel_ranks(&self, replicate: Option<&ProcessGroup>) -> f32 {
        (self.ranks * replicate.map_or(1, ProcessGroup::world_size)) as f32
    }

    fn check_group(&self, shard: &ProcessGroup) -> Result<()> {
        if shard.world_size() != self.ranks {
            return Err(DdpError::InvalidArgument(format!(
                "FlatShards: parameters cut over {} ranks used over a group of {}; build the FlatShards with the \
                 shard group's world_size",
                self.ranks,
                shard.world_size()
            )));
        }
        Ok(())
    }

    fn check_slots(&self, what: &str, n: usize) -> Result<()> {
        if n != self.chunks.len() {
            return Err(DdpError::InvalidArgument(format!(
                "FlatShards: {n} {what} slots for {} parameters; pass one per parameter, in list order",
                self.chunks.len()
            )));
        }
        Ok(())
    }

    fn check_numel(&self, what: &str, i: usize, t: &Tensor, c: &FlatChunk) -> Result<()> {
        if t.elem_count() != c.numel {
            return Err(DdpError::InvalidArgument(format!(
                "FlatShards: {what} {i} has shape {:?} ({} elements), its parameter {} elements",
                t.dims(),
                t.elem_count(),
                c.numel
            )));
        }
        Ok(())
    }
}

/// PyTorch's `ZeroRedundancyOptimizer` for candle: an optimizer whose state is sharded over a process group — each
/// rank's inner optimizer owns chunk `rank` of every parameter ([`FlatChunk`]), so its state (AdamW's two moments)
/// takes `per_rank` elements per buffer ([`FlatShards::per_rank`], `≈ 1/N` of the model) instead of the whole
/// model's (ZeRO stage 1, Rajbhandari et al. 2020 §5.1).
///
/// ```no_run
/// # fn main() -> anyhow::Result<()> {
/// use candle_nn::{AdamW, Optimizer, ParamsAdamW};
/// use ddp_core::{ProcessGroup, ZeroRedundancyOptimizer};
/// # let (loss, varmap): (candle_core::Tensor, candle_nn::VarMap) = todo!();
/// let pg = ProcessGroup::init_from_env()?;
/// // Checks the parameters across ranks and broadcasts rank 0's, as DDP does; the inner optimizer gets this
/// // rank's chunks.
/// let mut zero = ZeroRedundancyOptimizer::new(&pg, &varmap, |chunks| AdamW::new(chunks, ParamsAdamW::default()))?;
/// let grads = loss.backward()?; // this rank's gradients; no DDP sync: step reduce-scatters them
/// zero.step(&grads)?; // reduce-scatter (mean) → the inner AdamW steps the chunks → all-gather into the Vars
/// # Ok(()) }
/// ```
///
/// One step ([`ZeroRedundancyOptimizer::step`]) is three phases: the gradients are reduce-scattered over the group
/// (each rank receives the mean over the ranks of its chunks only), the inner optimizer steps this rank's chunks,
/// and the updated chunks are all-gathered into the model's `Var`s, which every rank then holds whole and
/// identical. Communication per step is one reduce-scatter and one all-gather of the model, `2Ψ` like DDP's
/// all-reduce; do not also sync the gradients with [`crate::DistributedDataParallel`] (the mean is taken here).
/// PyTorch's class leaves the gradient all-reduce to DDP and broadcasts each rank's updated shard; this one does
/// the paper's reduce-scatter + all-gather, which moves the same bytes without the extra all-reduce.
///
/// - **Parameters are the model's `Var`s.** Every step first copies this rank's chunks out of them into the shard
///   variables ([`Self::shard_vars`], 1-D, in each parameter's dtype), so weights loaded or changed between steps
///   are what the next step updates — like PyTorch, where the optimizer steps the parameters themselves. With
///   f32 parameters a step is the step of the inner optimizer on the whole parameters with the averaged
///   gradients, element for element (tested against DDP + AdamW).
/// - **Construction** checks names, shapes and dtypes across ranks and broadcasts rank 0's values (what
///   [`crate::DistributedDataParallel`] does), so ranks may build their models from different seeds.
/// - **The inner optimizer** is built by a closure from the shard variables (`candle_nn::AdamW::new(chunks, p)`)
///   and any `candle_nn::Optimizer` is stepped by [`Self::step`]. An optimizer with another interface (accel-nn's,
///   which take the parameters and one gradient slot each at every step) goes through [`Self::step_with`].
/// - **State access:** [`Self::inner`] / [`Self::inner_mut`]. `candle_nn::AdamW` keeps its moments private, so
///   there is no `consolidate_state_dict` for it; an optimizer that exposes per-parameter buffers (shaped like the
///   shard variables) gets them as whole tensors with [`Self::consolidate`] (PyTorch's `consolidate_state_dict`,
///   on every rank).
/// - **Padding:** chunk elements beyond a parameter's end are zeros with a zero gradient (refilled from the
///   parameters at every step) and are dropped by the all-gather.
/// - **Memory per rank:** the whole parameters and gradients (as with DDP), the shard variables (`per_rank`
///   elements in the parameters' dtypes: candle variables cannot be views of another's storage) and the inner
///   optimizer's state for them (AdamW: `2 · per_rank` elements instead of `2Ψ`).
/// - **Dtypes:** f32, f16 and bf16 parameters (chunks travel as fp32, see the [module](self) docs); f64 is refused
///   (it would be rounded to fp32 on the wire).
#[derive(Debug)]
pub struct ZeroRedundancyOptimizer<O> {
    pg: ProcessGroup,
    vars: Vec<(String, Var)>,
    /// `vars`' variables alone (what the all-gather writes).
    params: Vec<Var>,
    layout: FlatShards,
    shard_vars: Vec<Var>,
    device: Device,
    hook: CommHook,
    inner: O,
}

impl<O> ZeroRedundancyOptimizer<O> {
    /// Shards the variables of a `VarMap` (sorted by name, so every rank sees the same order) over `pg`; `make`
    /// builds the inner optimizer from this rank's shard variables (one 1-D `Var` of `chunk` elements per
    /// parameter, in that order).
    ///
    /// Errors: see [`Self::from_named_vars`].
    pub fn new<E>(
        pg: &ProcessGroup,
        varmap: &VarMap,
        make: impl FnOnce(Vec<Var>) -> std::result::Result<O, E>,
    ) -> Result<Self>
    where
        DdpError: From<E>,
    {
        let mut vars: Vec<(String, Var)> = {
            let data = crate::sync::lock(varmap.data());
            data.iter().map(|(name, var)| (name.clone(), var.clone())).collect()
        };
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        Self::from_named_vars(pg, vars, make)
    }

    /// Shards named variables, in the given order (the same on every rank). Collective over `pg`: checks the
    /// names, shapes and dtypes across ranks and broadcasts rank 0's values into every `Var` (as
    /// [`crate::DistributedDataParallel`] does), then builds the inner optimizer with `make`.
    ///
    /// Errors, before any communication: [`DdpError::InvalidArgument`] for an empty list, variables on different
    /// devices, or a variable that is not f32, f16 or bf16 (each named). Then [`DdpError::ParameterMismatch`] on
    /// every rank when the ranks' parameters differ; collective errors; `make`'s.
    pub fn from_named_vars<E>(
        pg: &ProcessGroup,
        vars: Vec<(String, Var)>,
        make: impl FnOnce(Vec<Var>) -> std::result::Result<O, E>,
    ) -> Result<Self>
    where
        DdpError: From<E>,
    {
        let Some((first, v0)) = vars.first() else {
            return Err(DdpError::InvalidArgument(
                "ZeroRedundancyOptimizer: no parameters to shard; build the model (its VarBuilder creates the \
                 variables) before the optimizer"
                    .into(),
            ));
        };
        let device = v0.device().clone();
        for (name, var) in &vars {
            if !var.device().same_device(&device) {
                return Err(DdpError::InvalidArgument(format!(
                    "ZeroRedundancyOptimizer: parameter `{name}` is on {:?} but `{first}` on {device:?}; every \
                     parameter must be on one device (move the model with its VarBuilder's device)",
                    var.device()
                )));
            }
            if !matches!(var.dtype(), DType::F32 | DType::F16 | DType::BF16) {
                return Err(DdpError::InvalidArgument(format!(
                    "ZeroRedundancyOptimizer: parameter `{name}` has dtype {:?}; ZeRO shards f32, f16 and bf16 \
                     parameters (chunks travel as fp32): convert it, or keep it out of the optimizer",
                    var.dtype()
                )));
            }
        }
        let sigs: Vec<fingerprint::ParamSig> = vars
            .iter()
            .map(|(name, v)| fingerprint::ParamSig {
                name: name.clone(),
                dims: v.dims().to_vec(),
                dtype: v.dtype().as_str().to_string(),
            })
            .collect();
        fingerprint::check_across_ranks(pg, &sigs)?;
        if pg.world_size() > 1 {
            broadcast_from_rank0(pg, &vars)?;
        }
        let numels: Vec<usize> = vars.iter().map(|(_, v)| v.elem_count()).collect();
        let layout = FlatShards::new(&numels, pg.world_size());
        let shard_vars = vars
            .iter()
            .zip(layout.chunks())
            .map(|((_, v), c)| Ok(Var::from_tensor(&c.slice(v.as_tensor(), pg.rank())?.to_dtype(v.dtype())?)?))
            .collect::<Result<Vec<_>>>()?;
        let inner = make(shard_vars.clone())?;
        let params = vars.iter().map(|(_, v)| v.clone()).collect();
        Ok(ZeroRedundancyOptimizer {
            pg: pg.clone(),
            vars,
            params,
            layout,
            shard_vars,
            device,
            hook: CommHook::None,
            inner,
        })
    }

    /// Compresses the gradients' reduce-scatter to 16 bits (PyTorch's `fp16_compress_hook` /
    /// `bf16_compress_hook` semantics, as [`crate::DdpOptions::comm_hook`]); the all-gather stays fp32.
    pub fn with_comm_hook(mut self, hook: CommHook) -> Self {
        self.hook = hook;
        self
    }

    /// The gradient compression in use.
    pub fn comm_hook(&self) -> CommHook {
        self.hook
    }

    /// The group the optimizer state is sharded over.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// The model's parameters, in shard order.
    pub fn named_vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// This rank's chunks: one 1-D `Var` of [`FlatChunk::chunk`] elements per parameter (in [`Self::named_vars`]
    /// order, each in its parameter's dtype) — what the inner optimizer steps and keeps state for.
    pub fn shard_vars(&self) -> &[Var] {
        &self.shard_vars
    }

    /// How the parameters are cut ([`FlatShards::per_rank`]: this rank's elements).
    pub fn layout(&self) -> &FlatShards {
        &self.layout
    }

    /// The inner optimizer (over [`Self::shard_vars`]).
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The inner optimizer, mutably (learning rate, hyper-parameters).
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// One step with any optimizer: reduce-scatters `grads` (mean over the group), copies this rank's chunks of
    /// the parameters into the shard variables, calls `update(inner, shard_vars, chunk_grads)` — one gradient
    /// slot per shard variable, all `Some`, in its dtype — and all-gathers the updated chunks into the
    /// parameters. Collective over the group. For accel-nn's optimizers:
    /// `zero.step_with(&grads, |opt, vars, grads| -> anyhow::Result<()> { Ok(opt.step(vars, grads)?) })?`.
    ///
    /// Errors (raised before any communication, on the rank at fault): [`DdpError::InvalidArgument`] naming the
    /// parameters `grads` has no gradient for (every parameter must take part in the loss) or a gradient whose
    /// shape is not its parameter's. Then collective errors, and `update`'s.
    pub fn step_with<E>(
        &mut self,
        grads: &GradStore,
        update: impl FnOnce(&mut O, &[Var], &[Option<Tensor>]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E>
    where
        E: From<DdpError>,
    {
        let chunk_grads = self.reduce_scatter(grads)?;
        update(&mut self.inner, &self.shard_vars, &chunk_grads)?;
        self.layout.all_gather_into(&self.pg, &self.shard_vars, &self.params)?;
        Ok(())
    }

    /// Per-parameter buffers of the inner optimizer (`chunks[i]` shaped like `shard_vars()[i]`, e.g. a moment)
    /// gathered into whole tensors of each parameter's shape, fp32, on every rank: PyTorch's
    /// `consolidate_state_dict`, for an optimizer that exposes its state. Collective over the group.
    ///
    /// Errors: [`DdpError::InvalidArgument`] for a count or a size that does not match the shard variables;
    /// collective errors.
    pub fn consolidate<G: AsRef<Tensor>>(&self, chunks: &[G]) -> Result<Vec<Tensor>> {
        self.layout
            .all_gather(&self.pg, chunks)?
            .into_iter()
            .zip(&self.vars)
            .map(|(t, (_, v))| Ok(t.reshape(v.dims())?))
            .collect()
    }

    /// Checks `grads`, reduce-scatters them, and refreshes the shard variables from the parameters: the chunk
    /// gradients, one per shard variable, in its dtype.
    fn reduce_scatter(&self, grads: &GradStore) -> Result<Vec<Option<Tensor>>> {
        let slots: Vec<Option<Tensor>> = self.vars.iter().map(|(_, v)| grads.get(v.as_tensor()).cloned()).collect();
        let missing: Vec<&str> =
            slots.iter().zip(&self.vars).filter(|(g, _)| g.is_none()).map(|(_, (n, _))| n.as_str()).collect();
        if !missing.is_empty() {
            return Err(DdpError::InvalidArgument(format!(
                "ZeroRedundancyOptimizer::step: no gradient for {missing:?}; every parameter given to the optimizer \
                 must take part in the loss (leave parameters that do not out of the VarMap or the list it was \
                 built from)"
            )));
        }
        for ((name, v), g) in self.vars.iter().zip(&slots) {
            if let Some(g) = g.as_ref().filter(|g| g.dims() != v.dims()) {
                return Err(DdpError::InvalidArgument(format!(
                    "ZeroRedundancyOptimizer::step: gradient of `{name}` has shape {:?}, its parameter {:?}",
                    g.dims(),
                    v.dims()
                )));
            }
        }
        let means = self.layout.reduce_scatter_mean(&self.pg, None, self.hook, &slots, &self.device)?;
        drop(slots);
        let rank = self.pg.rank();
        self.shard_vars
            .iter()
            .zip(&self.vars)
            .zip(self.layout.chunks())
            .zip(means)
            .map(|(((sv, (_, v)), c), g)| {
                sv.set(&c.slice(v.as_tensor(), rank)?.to_dtype(sv.dtype())?)?;
                Ok(Some(g.to_dtype(sv.dtype())?))
            })
            .collect()
    }
}

impl<O: candle_nn::Optimizer> ZeroRedundancyOptimizer<O> {
    /// One optimizer step of the whole model from this rank's gradients (as `loss.backward()` returned them):
    /// reduce-scatter (the mean over the group), the inner optimizer's step on this rank's chunks, all-gather into
    /// the parameters. Collective over the group.
    ///
    /// Errors: see [`Self::step_with`]; the inner optimizer's.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step_with(grads, |inner, vars, chunk_grads| -> Result<()> {
            let mut store = GradStore::default();
            for (v, g) in vars.iter().zip(chunk_grads) {
                if let Some(g) = g {
                    store.insert(v.as_tensor(), g.clone());
                }
            }
            Ok(inner.step(&store)?)
        })
    }

    /// `loss.backward()` then [`Self::step`].
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        let grads = loss.backward()?;
        self.step(&grads)
    }

    /// The inner optimizer's learning rate.
    pub fn learning_rate(&self) -> f64 {
        self.inner.learning_rate()
    }

    /// Sets the inner optimizer's learning rate (a scheduler's step).
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.inner.set_learning_rate(lr)
    }
}

/// Copies rank 0's values into every rank's variables: one broadcast per parameter, in its own dtype.
fn broadcast_from_rank0(pg: &ProcessGroup, vars: &[(String, Var)]) -> Result<()> {
    let mut buf = flat::FlatBuffer::default();
    for (name, var) in vars {
        let t = var.as_tensor();
        let dtype = flat::dtype_of(name, t)?;
        buf.resize(t.elem_count() * dtype.size_in_bytes());
        flat::copy_in(t, dtype, buf.bytes_mut())?;
        pg.broadcast(buf.bytes_mut(), 0)?;
        if pg.rank() != 0 {
            var.set(&flat::tensor_from(buf.bytes(), dtype, t.shape(), t.device())?)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32], dims: &[usize]) -> Tensor {
        Tensor::from_vec(v.to_vec(), dims, &Device::Cpu).unwrap()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap()
    }

    fn range(n: usize, from: f32) -> Vec<f32> {
        (0..n).map(|i| from + i as f32).collect()
    }

    #[test]
    fn flat_chunk_pads_uneven_and_tiny_parameters() {
        assert_eq!(FlatChunk::of(10, 4), FlatChunk { numel: 10, chunk: 3 });
        assert_eq!(FlatChunk::of(8, 4), FlatChunk { numel: 8, chunk: 2 });
        assert_eq!(FlatChunk::of(1, 4), FlatChunk { numel: 1, chunk: 1 });
        assert_eq!(FlatChunk::of(0, 4), FlatChunk { numel: 0, chunk: 1 });
        assert_eq!(FlatChunk::of(5, 0), FlatChunk { numel: 5, chunk: 5 });
        let c = FlatChunk::of(10, 4);
        let ranges: Vec<_> = (0..5).map(|r| c.range(r)).collect();
        assert_eq!(ranges, vec![0..3, 3..6, 6..9, 9..10, 10..10]);
        // A bias of 1 on 4 ranks: rank 0 holds it, ranks 1-3 hold padding only.
        let b = FlatChunk::of(1, 4);
        assert_eq!((0..4).map(|r| b.range(r)).collect::<Vec<_>>(), vec![0..1, 1..1, 1..1, 1..1]);
    }

    #[test]
    fn flat_chunk_slices_are_zero_padded_fp32_and_unslice_inverts_them() {
        let w = t(&range(10, 1.0), &[2, 5]);
        let c = FlatChunk::of(10, 4);
        let slices: Vec<Tensor> = (0..4).map(|r| c.slice(&w, r).unwrap()).collect();
        let got: Vec<Vec<f32>> = slices.iter().map(values).collect();
        assert_eq!(got, vec![vec![1., 2., 3.], vec![4., 5., 6.], vec![7., 8., 9.], vec![10., 0., 0.]]);
        assert!(slices.iter().all(|s| s.dims() == [3] && s.dtype() == DType::F32));
        let whole = c.unslice(&Tensor::cat(&slices, 0).unwrap(), &[2, 5]).unwrap();
        assert_eq!(whole.dims(), [2, 5]);
        assert_eq!(values(&whole), range(10, 1.0));
        // Another dtype comes out as fp32; the tiny parameter's padding ranks get a zero.
        let b = t(&[-2.5], &[1]).to_dtype(DType::BF16).unwrap();
        let cb = FlatChunk::of(1, 3);
        let got: Vec<Vec<f32>> = (0..3).map(|r| values(&cb.slice(&b, r).unwrap())).collect();
        assert_eq!(got, vec![vec![-2.5], vec![0.0], vec![0.0]]);
        assert_eq!(cb.slice(&b, 1).unwrap().dtype(), DType::F32);
        let err = c.slice(&t(&range(9, 0.0), &[9]), 0).unwrap_err().to_string();
        assert!(err.contains("9 elements") && err.contains("10 elements"), "{err}");
    }

    /// Three parameters of 5, 1 and 7 elements on 2 ranks: chunks 3, 1, 4 (per rank 8).
    fn three() -> FlatShards {
        FlatShards::new(&[5, 1, 7], 2)
    }

    #[test]
    fn pack_rank_major_puts_each_ranks_chunks_together_padded() {
        let s = three();
        assert_eq!(s.chunks().iter().map(|c| c.chunk).collect::<Vec<_>>(), vec![3, 1, 4]);
        assert_eq!((s.len(), s.ranks(), s.per_rank()), (3, 2, 8));
        let grads = [Some(t(&range(5, 1.0), &[5])), None, Some(t(&range(7, 10.0), &[7, 1]))];
        let buf = s.pack_rank_major(&grads).unwrap();
        #[rustfmt::skip]
        let want = vec![
            1., 2., 3.,  0.,  10., 11., 12., 13.,  // rank 0: chunk 0 of each parameter
            4., 5., 0.,  0.,  14., 15., 16., 0.,   // rank 1: chunk 1, padded
        ];
        assert_eq!(buf, want);
    }

    #[test]
    fn a_subset_keeps_each_parameters_chunk() {
        let s = three();
        let sub = s.subset(&[2, 0]).unwrap();
        assert_eq!(sub.chunks(), &[s.chunks()[2], s.chunks()[0]]);
        assert_eq!((sub.len(), sub.ranks(), sub.per_rank()), (2, 2, 7));
        let buf = sub.pack_rank_major(&[Some(t(&range(7, 10.0), &[7])), Some(t(&range(5, 1.0), &[5]))]).unwrap();
        assert_eq!(buf, vec![10., 11., 12., 13., 1., 2., 3., 14., 15., 16., 0., 4., 5., 0.]);
        let err = s.subset(&[0, 3]).unwrap_err().to_string();
        assert!(err.contains("index 3") && err.contains("3 parameters"), "{err}");
        assert!(s.subset(&[]).unwrap().is_empty());
    }

    #[test]
    fn pack_rejects_wrong_slot_counts_and_sizes() {
        let s = three();
        let err = s.pack_rank_major::<Tensor>(&[None, None]).unwrap_err().to_string();
        assert!(err.contains("2 gradient slots for 3 parameters"), "{err}");
        let err = s.pack_rank_major(&[None, Some(t(&[1., 2.], &[2])), None]).unwrap_err().to_string();
        assert!(err.contains("gradient 1") && err.contains("its parameter 1 elements"), "{err}");
    }

    #[test]
    fn on_one_rank_the_collectives_are_identities() {
        let pg = ProcessGroup::single_process().unwrap();
        let s = FlatShards::new(&[6, 1], 1);
        let grads = [Some(t(&range(6, 1.0), &[2, 3])), Some(t(&[7.0], &[1]))];
        for hook in [CommHook::None, CommHook::Bf16] {
            let mean = s.reduce_scatter_mean(&pg, None, hook, &grads, &Device::Cpu).unwrap();
            assert_eq!(mean.iter().map(values).collect::<Vec<_>>(), vec![range(6, 1.0), vec![7.0]]);
        }
        let full =
            [Var::zeros((2, 3), DType::F32, &Device::Cpu).unwrap(), Var::zeros(1, DType::F16, &Device::Cpu).unwrap()];
        let mine = [Var::new(range(6, 1.0), &Device::Cpu).unwrap(), Var::new(&[7f32], &Device::Cpu).unwrap()];
        s.all_gather_into(&pg, &mine, &full).unwrap();
        assert_eq!(values(full[0].as_tensor()), range(6, 1.0));
        assert_eq!((full[1].dtype(), values(full[1].as_tensor())), (DType::F16, vec![7.0]));
        let err = FlatShards::new(&[6], 2).reduce_scatter_mean(&pg, None, CommHook::None, &grads[..1], &Device::Cpu);
        let err = err.unwrap_err().to_string();
        assert!(err.contains("cut over 2 ranks used over a group of 1"), "{err}");
    }
}
