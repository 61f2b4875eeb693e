//! [`ShardedDataParallel`]: sharded optimizer state over the mesh's `dp_shard` group — ZeRO stage 1
//! (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §5.1; DeepSpeed's
//! `stage_1_and_2.py`; PyTorch's `ZeroRedundancyOptimizer`).
//!
//! Every parameter is flattened and cut into `dp_shard` equal chunks (the last padded with zeros: uneven and tiny
//! parameters work alike, [`FlatChunk`]); rank `r` of the dp_shard group owns chunk `r` of every parameter. On a
//! sync step the gradients are reduce-scattered over dp_shard — one collective over a rank-major buffer, each rank
//! receiving the mean of its chunks — and averaged over `dp_replicate` (HSDP: shard inside a group, replicate
//! across groups). The optimizer steps only the owned chunks (fp32 copies of them: the AdamW moments are the size
//! of the chunks, 1/dp_shard of the model's), and after its step the chunks are all-gathered back into the whole
//! parameters. Communication per step: a reduce-scatter and an all-gather of the model, 2Ψ like DDP's all-reduce
//! (ZeRO paper §7).
//!
//! The gradient norm counts every element once: the chunks' squares summed over dp_shard (and the tp shards' over
//! tp); the fp16 overflow verdict is agreed over dp_shard too (ranks hold different chunks). Checkpoints hold the
//! optimizer state as one process would (chunks all-gathered into whole parameters; [`FlatChunk::unslice`]), so a
//! sharded run resumes at another layout and a replicated one resumes sharded.
//!
//! What this stage does not do yet (issue "ND-parallel III"): gradients are whole on every rank until the
//! reduce-scatter (ZeRO-2 frees them bucket by bucket during the backward pass), and parameters rest whole between
//! steps (FULL_SHARD / ZeRO-3).

use super::strategy::GradientStrategy;
use crate::tensor_parallel::ParamLayout;
use crate::Result;
use candle_core::{DType, Device, Tensor, Var};
use ddp_core::{CommHook, ProcessGroup, ReduceOp};

/// How one parameter's flattened elements are cut into the dp_shard group's chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FlatChunk {
    /// Elements of the parameter (this rank's tp piece).
    pub(crate) numel: usize,
    /// Elements per chunk: `ceil(numel / dp_shard)`; the chunks together hold `chunk · dp_shard ≥ numel`, the
    /// rest zero padding.
    pub(crate) chunk: usize,
}

impl FlatChunk {
    pub(crate) fn of(numel: usize, ranks: usize) -> Self {
        FlatChunk { numel, chunk: numel.div_ceil(ranks.max(1)).max(1) }
    }

    /// Chunk `rank` of `t` (any shape with `numel` elements), fp32, 1-D `[chunk]`.
    pub(crate) fn slice(&self, t: &Tensor, rank: usize) -> Result<Tensor> {
        let flat = t.flatten_all()?.to_dtype(DType::F32)?;
        let start = (rank * self.chunk).min(self.numel);
        let end = ((rank + 1) * self.chunk).min(self.numel);
        let mine = flat.narrow(0, start, end - start)?;
        Ok(match end - start {
            n if n == self.chunk => mine,
            n => Tensor::cat(&[mine, Tensor::zeros(self.chunk - n, DType::F32, t.device())?], 0)?,
        })
    }

    /// The whole tensor of shape `dims` from every rank's chunk in rank order (`[ranks · chunk]`), padding dropped.
    pub(crate) fn unslice(&self, all: &Tensor, dims: &[usize]) -> Result<Tensor> {
        Ok(all.narrow(0, 0, self.numel)?.reshape(dims)?)
    }
}

/// Sharded optimizer state over dp_shard, replicated over dp_replicate (see the module documentation).
#[derive(Debug)]
pub(crate) struct ShardedDataParallel {
    shard: ProcessGroup,
    replicate: ProcessGroup,
    /// The mesh's model-parallel group (tp; pp is refused with sharding): norms and overflow.
    model_parallel: ProcessGroup,
    chunks: Vec<FlatChunk>,
    device: Device,
    /// Gradient compression of the reduce-scatter (DDP's hook, the same semantics: half the bytes).
    hook: CommHook,
}

impl ShardedDataParallel {
    pub(crate) fn new(
        shard: ProcessGroup,
        replicate: ProcessGroup,
        model_parallel: ProcessGroup,
        chunks: Vec<FlatChunk>,
        device: Device,
        hook: CommHook,
    ) -> Self {
        ShardedDataParallel { shard, replicate, model_parallel, chunks, device, hook }
    }

    /// Chunks per parameter, in rank-major order of a buffer: rank `r`'s chunks of every parameter, then rank
    /// `r + 1`'s (what a reduce-scatter hands out and an all-gather collects).
    fn per_rank(&self) -> usize {
        self.chunks.iter().map(|c| c.chunk).sum()
    }
}

impl GradientStrategy for ShardedDataParallel {
    /// Whole gradients in, this rank's chunks out (1-D fp32, averaged over dp_shard × dp_replicate). A parameter
    /// no micro-batch reached counts as a zero gradient.
    fn reduce(&self, slots: &mut [Option<Tensor>]) -> Result<()> {
        let n = self.shard.world_size();
        let per_rank = self.per_rank();
        let flats: Vec<Vec<f32>> = slots
            .iter()
            .zip(&self.chunks)
            .map(|(slot, c)| -> Result<Vec<f32>> {
                let mut f = match slot {
                    Some(g) => g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?,
                    None => vec![0.0; c.numel],
                };
                f.resize(c.chunk * n, 0.0);
                Ok(f)
            })
            .collect::<Result<_>>()?;
        let mut input = Vec::with_capacity(n * per_rank);
        for r in 0..n {
            for (f, c) in flats.iter().zip(&self.chunks) {
                input.extend_from_slice(&f[r * c.chunk..(r + 1) * c.chunk]);
            }
        }
        drop(flats);
        let ranks = (n * self.replicate.world_size()) as f32;
        let (mine, scale) = match self.hook {
            CommHook::None => {
                let mut mine = vec![0f32; per_rank];
                self.shard.reduce_scatter(&input, &mut mine, ReduceOp::Sum)?;
                if self.replicate.world_size() > 1 {
                    self.replicate.all_reduce(&mut mine, ReduceOp::Sum)?;
                }
                (mine, 1.0 / ranks)
            }
            // fp16 divides first (its range); bf16 after, as PyTorch's compress hooks.
            CommHook::Fp16 => {
                let input: Vec<half::f16> = input.iter().map(|v| half::f16::from_f32(v / ranks)).collect();
                let mut mine = vec![half::f16::ZERO; per_rank];
                self.shard.reduce_scatter(&input, &mut mine, ReduceOp::Sum)?;
                if self.replicate.world_size() > 1 {
                    self.replicate.all_reduce(&mut mine, ReduceOp::Sum)?;
                }
                (mine.iter().map(|v| v.to_f32()).collect(), 1.0)
            }
            CommHook::Bf16 => {
                let input: Vec<half::bf16> = input.iter().map(|v| half::bf16::from_f32(*v)).collect();
                let mut mine = vec![half::bf16::ZERO; per_rank];
                self.shard.reduce_scatter(&input, &mut mine, ReduceOp::Sum)?;
                if self.replicate.world_size() > 1 {
                    self.replicate.all_reduce(&mut mine, ReduceOp::Sum)?;
                }
                (mine.iter().map(|v| v.to_f32()).collect(), 1.0 / ranks)
            }
        };
        drop(input);
        let mut at = 0;
        for (slot, c) in slots.iter_mut().zip(&self.chunks) {
            let chunk: Vec<f32> = mine[at..at + c.chunk].iter().map(|v| v * scale).collect();
            *slot = Some(Tensor::from_vec(chunk, c.chunk, &self.device)?);
            at += c.chunk;
        }
        Ok(())
    }

    fn norm_group(&self) -> &ProcessGroup {
        &self.model_parallel
    }

    /// The chunks' squares summed over dp_shard (every element once), the tp shards' also over tp.
    fn squared_norm(&self, per_param: &[f64], layouts: &[ParamLayout]) -> Result<f64> {
        let mut sums = [0.0f64; 2]; // [tp-sharded, tp-replicated]
        for (sq, layout) in per_param.iter().zip(layouts) {
            match layout {
                ParamLayout::Sharded { .. } => sums[0] += sq,
                ParamLayout::Replicated => sums[1] += sq,
            }
        }
        self.shard.all_reduce(&mut sums, ReduceOp::Sum)?;
        let mut sharded = [sums[0]];
        if self.model_parallel.world_size() > 1 {
            self.model_parallel.all_reduce(&mut sharded, ReduceOp::Sum)?;
        }
        Ok(sharded[0] + sums[1])
    }

    /// Agreed over dp_shard (the ranks hold different chunks) and the model-parallel group.
    fn any_rank(&self, local: bool, _layouts: &[ParamLayout]) -> Result<bool> {
        let mut flag = [i32::from(local)];
        self.shard.all_reduce(&mut flag, ReduceOp::Max)?;
        if self.model_parallel.world_size() > 1 {
            self.model_parallel.all_reduce(&mut flag, ReduceOp::Max)?;
        }
        Ok(flag[0] != 0)
    }

    /// All-gathers the updated chunks (`optimized`) over dp_shard into the whole fp32 masters (`full`).
    fn after_optimizer_step(&self, optimized: &[Var], full: &[Var]) -> Result<()> {
        let n = self.shard.world_size();
        let per_rank = self.per_rank();
        let mut mine = Vec::with_capacity(per_rank);
        for v in optimized {
            mine.extend(v.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>()?);
        }
        let mut all = vec![0f32; n * per_rank];
        self.shard.all_gather(&mine, &mut all)?;
        let mut offset = 0;
        for (master, c) in full.iter().zip(&self.chunks) {
            let mut flat = Vec::with_capacity(n * c.chunk);
            for r in 0..n {
                flat.extend_from_slice(&all[r * per_rank + offset..r * per_rank + offset + c.chunk]);
            }
            let t = Tensor::from_vec(flat, n * c.chunk, master.device())?;
            master.set(&c.unslice(&t, master.dims())?.to_dtype(master.dtype())?)?;
            offset += c.chunk;
        }
        Ok(())
    }
}
