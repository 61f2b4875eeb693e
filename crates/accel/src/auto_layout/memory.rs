//! Memory per rank, term by term ([`MemoryBreakdown`]).
//!
//! A rank of pp rank `r` holds Ψ_r parameters ([`ModelSpec::params_on_rank`]: its blocks, split over tp, plus the
//! embeddings on the first stage and the head on the last) — tp and pp divide the model first, as in DeepSpeed's
//! autotuner. With `S` = dp_shard and the per-parameter bytes of [`StateBytes`]:
//!
//! | term          | NO_SHARD (0)  | SHARD_OPTIM (1) | SHARD_GRAD_OP (2) | FULL_SHARD (3)                 |
//! |---------------|---------------|-----------------|-------------------|--------------------------------|
//! | `params`      | Ψ_r·param     | Ψ_r·param       | Ψ_r·param         | ⌈Ψ_r/S⌉·param (0 in accel¹)    |
//! | `grads`       | Ψ_r·grad      | Ψ_r·grad        | ⌈Ψ_r/S⌉·grad      | ⌈Ψ_r/S⌉·grad                   |
//! | `optimizer`   | Ψ_r·opt       | ⌈Ψ_r/S⌉·opt     | ⌈Ψ_r/S⌉·opt       | ⌈Ψ_r/S⌉·opt                    |
//!
//! (Rajbhandari et al. 2020, §5, Fig. 1: stage 1 divides the optimizer state by N, stage 2 also the gradients,
//! stage 3 also the parameters; with mixed-precision AdamW 2 + 2 + 12 bytes, so 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and
//! 16Ψ/N. ¹ accel's FULL_SHARD parameters rest as the fp32 masters' chunks: [`StateBytes::full_shard_params_are_masters`].
//! Chunk padding is counted once for the rank's parameters together, not per parameter.)
//!
//! Transient terms, at their largest during a step:
//! - `gathered` (FULL_SHARD): one unit (block) gathered whole, plus what lies outside the units and is gathered
//!   per forward (the embeddings, the head), plus that unit's whole gradient before its reduce-scatter — FSDP's
//!   "one unit at a time" (Zhao et al. 2023); the same on a pipeline stage, whose forward accel records too.
//! - `grad_buffer`: the backward pass's gradients of a micro-batch in the compute dtype before they join the
//!   rank's gradient slots (candle returns a backward's gradients together): Ψ_r·param when the slots cannot be
//!   those very tensors — more than one micro-batch per step (they are added), ZeRO-2 (they are reduce-scattered
//!   into chunks), or slots of another width (fp32 slots of 16-bit gradients). Conservative: a segmented backward
//!   frees it segment by segment. Under ZeRO-1 and -2 also the flat rank-major buffer the gradients are packed
//!   into for the reduce-scatter, Ψ_r·grad (accel's `FlatShards`: a copy).
//! - `gathered` under FULL_SHARD is also at least the stage's whole fp32 parameters, Ψ_r·4: accel draws a stage
//!   whole before it shards it (measured: the large char-GPT's FULL_SHARD ranks peaked 60–130 MiB above the
//!   training terms without this).
//! - `activations`: per micro-batch, the rank's blocks × [`ModelSpec::block_activation_bytes`] plus the
//!   embedding's (first stage) and the head's and loss's (last stage) — or, with recomputation, each block's input
//!   ([`ModelSpec::checkpointed_block_bytes`]) plus the full activations of the blocks alive while they are
//!   recomputed ([`super::ActivationSpec::recomputed_blocks_live`]: 1 ideally, 2 in accel) — times the
//!   micro-batches in flight ([`in_flight_chunks`]; a chunk is one of the rank's `v` stages).
//! - `overhead`: [`Assumptions::runtime_overhead_bytes`].
//!
//! The peak adds them all (their maxima need not coincide: conservative).

use super::assumptions::Assumptions;
use super::layout::Layout;
use super::model::ModelSpec;
use super::train::{StateBytes, TrainSpec};
use super::units;
use crate::pipeline::ScheduleKind;

/// One rank's predicted memory, bytes, term by term (module documentation). `params`, `grads` and `optimizer`
/// are what rests between steps — what the Accelerator can be asked to report and compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryBreakdown {
    /// Parameters in the compute dtype (this rank's share).
    pub params: u64,
    /// Gradient slots kept between the backward and the optimizer step.
    pub grads: u64,
    /// Optimizer state (fp32 masters under mixed precision, moments).
    pub optimizer: u64,
    /// FULL_SHARD's gathered weights and unit gradient.
    pub gathered: u64,
    /// A micro-batch's gradients before they join the slots.
    pub grad_buffer: u64,
    /// Activations kept for the backward, over the micro-batches in flight.
    pub activations: u64,
    /// The runtime's own.
    pub overhead: u64,
}

impl MemoryBreakdown {
    /// `params + grads + optimizer`: what rests between steps.
    pub fn resting(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }

    /// The predicted peak: every term.
    pub fn total(&self) -> u64 {
        self.resting() + self.gathered + self.grad_buffer + self.activations + self.overhead
    }
}

impl std::fmt::Display for MemoryBreakdown {
    /// `1.20 GiB (params 100.00 MiB, grads …, optimizer …, activations …, overhead …)`, zero terms left out.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let terms = [
            ("params", self.params),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("gathered", self.gathered),
            ("grad buffer", self.grad_buffer),
            ("activations", self.activations),
            ("overhead", self.overhead),
        ];
        let shown: Vec<String> =
            terms.iter().filter(|(_, n)| *n > 0).map(|(name, n)| format!("{name} {}", units::bytes(*n))).collect();
        write!(f, "{} ({})", units::bytes(self.total()), shown.join(", "))
    }
}

/// Micro-batches whose activations pp rank `pp_rank` holds at once, counted in chunks (one of its `v` stages ×
/// one micro-batch), for `m` micro-batches:
///
/// - no pipeline (`pp` 1, or `schedule` `None`): 1 — accumulation runs one micro-batch's graph at a time;
/// - GPipe: `m` (every forward before any backward);
/// - 1F1B: `min(pp − r, m)` (`pp − r − 1` warm-up forwards and the steady state's one; Narayanan et al. 2021);
/// - interleaved 1F1B: `min(m·v, 2(pp − r − 1) + (v − 1)·pp + 1)` (Megatron's warm-up forwards, then one).
///
/// The simulator of [`crate::pipeline::simulate()`] agrees on every rank (tested).
pub fn in_flight_chunks(schedule: Option<ScheduleKind>, pp: usize, pp_rank: usize, m: usize, v: usize) -> usize {
    match schedule {
        _ if pp <= 1 => 1,
        None => 1,
        Some(ScheduleKind::GPipe) => m,
        Some(ScheduleKind::OneFOneB) => (pp - pp_rank).min(m),
        Some(ScheduleKind::Interleaved1F1B) => (2 * (pp - pp_rank - 1) + (v - 1) * pp + 1).min(m * v),
    }
}

/// The memory of pp rank `pp_rank` of `layout` holding `layers` blocks (module documentation).
pub(crate) fn rank_memory(
    model: &ModelSpec,
    train: &TrainSpec,
    assumptions: &Assumptions,
    layout: &Layout,
    pp_rank: usize,
    layers: usize,
) -> MemoryBreakdown {
    let (t, p, v) = (layout.tp, layout.pp, layout.virtual_stages as u64);
    let StateBytes { param, grad, optimizer, activation: e, full_shard_params_are_masters } = train.bytes;
    let psi = model.params_on_rank(t, p, pp_rank, layers);
    let z = layout.zero_stage();
    let shard = |n: u64, sharded: bool| if sharded { n.div_ceil(layout.dp_shard as u64) } else { n };
    let (first, last) = (pp_rank == 0, pp_rank + 1 == p);
    let in_flight = in_flight_chunks(layout.schedule, p, pp_rank, layout.microbatches, layout.virtual_stages) as u64;
    let block = if layers > 0 { model.block_params_per_rank(t) } else { 0 };

    let gathered = if z < 3 {
        0
    } else {
        let outside = if first { model.embedding_params_per_rank(t) } else { 0 }
            + if last { model.head_params_per_rank(t, p) } else { 0 };
        // accel draws the stage whole (fp32) before it shards it: the larger of that and one unit at a time.
        ((block + outside) * param + block * param).max(psi * 4)
    };
    let backward =
        if z < 3 && (layout.microbatches_per_step() > 1 || z == 2 || grad != param) { psi * param } else { 0 };
    // ZeRO-1 and -2 pack the gradients into one rank-major flat buffer for the reduce-scatter (a copy).
    let packed = if z == 1 || z == 2 { psi * grad } else { 0 };
    let grad_buffer = backward + packed;

    let b = layout.micro_batch_size;
    let extras = if first { model.embedding_activation_bytes(b, e) } else { 0 }
        + if last { model.head_activation_bytes(b, t, e) } else { 0 };
    let block_act = model.block_activation_bytes(b, t, e);
    let activations = if layout.recomputes() {
        let per_mb = layers as u64 * model.checkpointed_block_bytes(b, e) + extras;
        let live = (layers as u64).min(model.activations.recomputed_blocks_live);
        (in_flight * per_mb).div_ceil(v) + live * block_act
    } else {
        (in_flight * (layers as u64 * block_act + extras)).div_ceil(v)
    };

    MemoryBreakdown {
        params: if z == 3 && full_shard_params_are_masters { 0 } else { shard(psi, z >= 3) * param },
        grads: shard(psi, z >= 2) * grad,
        optimizer: shard(psi, z >= 1) * optimizer,
        gathered,
        grad_buffer,
        activations,
        overhead: assumptions.runtime_overhead_bytes,
    }
}
