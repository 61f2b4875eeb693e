//! Time per optimizer step ([`TimeBreakdown`]), from FLOPs and α–β collectives.
//!
//! **Collectives** (ring algorithms, as the CPU backend's and NCCL's large-message paths; Thakur et al. 2005):
//! over `n` ranks, a buffer of `B` bytes, a link of latency α and bandwidth β —
//! all-reduce `2(n − 1)·α + 2(n − 1)/n · B/β`; reduce-scatter and all-gather `(n − 1)·α + (n − 1)/n · B/β`; a send
//! `α + B/β`. One collective per reduction (bucketing adds α per bucket).
//!
//! **Per micro-batch, on pp rank r** with `L_r` blocks, micro-batch `b`, `s` tokens, tp `t`, `e` bytes per
//! activation element, at the slowest process of the rank (its FLOP/s):
//! - compute: `(3 + c) · b·s · (L_r · F_block/t + [last] · 2·h·⌈V/t⌉) / FLOP/s` — a forward, a backward of two
//!   forwards (6 FLOPs per parameter per token, Narayanan et al. 2021), `c` = 1 more forward when recomputing
//!   (8 per parameter per token); `F_block` = 2 per matrix parameter + 4·s·h for attention
//!   ([`super::ModelSpec::block_forward_flops_per_token`]).
//! - tp (Megatron, Shoeybi et al. 2019): per block 2 all-reduces of `b·s·h·e` forward and 2 backward (2 more when
//!   recomputing), one for the vocab-parallel embedding (first stage), one for the head's input gradient and
//!   three small ones of `b·s·4` for the vocab-parallel cross entropy (last stage), over the tp group's link.
//! - pp: for each of the rank's stages, a send of `b·s·h·e` to the next stage and one of the same size back to the
//!   previous, over the link to that pp rank (sends are not overlapped with compute: conservative).
//! - dp per micro-batch: ZeRO-2 reduce-scatters the gradients (`Ψ_r·grad` over dp_shard); FULL_SHARD all-gathers
//!   the parameters for the forward and again for the recomputation and reduce-scatters the gradients; with
//!   dp_replicate > 1 (HSDP) each reduced shard is all-reduced over dp_replicate.
//!
//! - gradient accumulation: with `m` micro-batches per step, each after the first adds the rank's gradients
//!   (its shard under ZeRO-2/3) into the sum: `(m − 1)/m · 3 · Ψ_r·grad / bandwidth` per micro-batch, at the
//!   probe's element-wise memory bandwidth ([`super::Machine::memory_bandwidth`]), counted as compute.
//!
//! **Synchronisation under load**: every blocking collective and every send above also costs the machine's
//! [`super::Machine::sync_latency`] (measured by the probe: the wait for a peer the operating system has not
//! scheduled yet while the machine's processes compute; milliseconds when processes outnumber cores, about 0
//! otherwise) — per tp all-reduce, per send, per sharded collective of a micro-batch (FULL_SHARD: per gathered
//! unit, its blocks and the embeddings/head, HSDP's all-reduce included), per step's reduction and per tied
//! embeddings' all-reduce.
//!
//! **Per step**: DDP all-reduces `Ψ_r·grad` over dp once; ZeRO-1 reduce-scatters once (+ HSDP's all-reduce) and
//! all-gathers the updated parameters; ZeRO-2 all-gathers them; FULL_SHARD nothing more. In volume (ZeRO §7):
//! 2Ψ for DDP, ZeRO-1 and ZeRO-2 at one micro-batch, (k + 1)Ψ for ZeRO-2 over k micro-batches, 3Ψ per micro-batch
//! for FULL_SHARD. Tied embeddings under pp add an all-reduce of the embedding's gradient between the first and
//! the last stage.
//!
//! **The pipeline**: with `T_r` rank r's time per micro-batch and `v` stages per rank, each stage takes `T_r/v`;
//! `m·v` of them flow through, so the step's pipeline part is `(m·v − 1) · max_r T_r/v + Σ_r T_r/v` — for equal
//! ranks `(m·v + p − 1) · T/v`, whose idle part is the bubble `(p − 1)/(v·m + p − 1)` of it (Narayanan et al. 2021,
//! §2.2; [`bubble_fraction`]). At pp 1 it is `k · T`. The step adds the slowest rank's per-step communication.

use super::cluster::Link;
use super::layout::Layout;
use super::model::ModelSpec;
use super::placement::{GroupKind, Placement};
use super::train::TrainSpec;
use super::units;

/// Seconds of a ring all-reduce of `bytes` over `n` ranks.
pub fn all_reduce_time(n: usize, bytes: f64, link: &Link) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n1 = (n - 1) as f64;
    2.0 * n1 * link.alpha + 2.0 * n1 / n as f64 * bytes / link.beta
}

/// Seconds of a ring reduce-scatter of a `bytes` buffer over `n` ranks (each receives `bytes / n`).
pub fn reduce_scatter_time(n: usize, bytes: f64, link: &Link) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n1 = (n - 1) as f64;
    n1 * link.alpha + n1 / n as f64 * bytes / link.beta
}

/// Seconds of a ring all-gather into a `bytes` buffer over `n` ranks (each contributes `bytes / n`).
pub fn all_gather_time(n: usize, bytes: f64, link: &Link) -> f64 {
    reduce_scatter_time(n, bytes, link)
}

/// Seconds of one send of `bytes`.
pub fn send_time(bytes: f64, link: &Link) -> f64 {
    link.message_time(bytes)
}

/// The pipeline's idle fraction with equal stages: `(pp − 1) / (v·m + pp − 1)` (0 at pp 1).
pub fn bubble_fraction(pp: usize, m: usize, v: usize) -> f64 {
    if pp <= 1 {
        return 0.0;
    }
    (pp - 1) as f64 / (v * m + pp - 1) as f64
}

/// A step's predicted time, seconds, split so that the parts add up to `total`: the slowest pp rank's compute,
/// tp and pp communication over its micro-batches, the data-parallel communication (per micro-batch on that rank,
/// plus the slowest rank's per-step reduction), and the pipeline's idle time.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TimeBreakdown {
    /// Forward, backward and recomputation.
    pub compute: f64,
    /// Tensor-parallel all-reduces.
    pub tp_comm: f64,
    /// Pipeline sends.
    pub pp_comm: f64,
    /// Data-parallel / ZeRO collectives.
    pub dp_comm: f64,
    /// The pipeline's idle time on the slowest rank.
    pub bubble: f64,
    /// The step.
    pub total: f64,
    /// The pp rank whose micro-batches take longest (it sets the pipeline's pace).
    pub critical_pp_rank: usize,
}

impl std::fmt::Display for TimeBreakdown {
    /// `12.3 ms (compute 10.0 ms, tp 1.0 ms, dp 1.3 ms)`, zero parts left out.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts = [
            ("compute", self.compute),
            ("tp", self.tp_comm),
            ("pp", self.pp_comm),
            ("dp", self.dp_comm),
            ("bubble", self.bubble),
        ];
        let shown: Vec<String> =
            parts.iter().filter(|(_, s)| *s > 0.0).map(|(name, s)| format!("{name} {}", units::seconds(*s))).collect();
        write!(f, "{} ({})", units::seconds(self.total), shown.join(", "))
    }
}

/// Operator calls in one block's forward (two layer norms, the attention's projections, scores, softmax and
/// mask, the MLP's two products and activation, the residual adds, reshapes): a count of accel's char-GPT's
/// candle ops, rounded; what the fixed cost per call ([`super::Machine::op_latency`]) multiplies.
pub const OPS_PER_BLOCK: f64 = 30.0;

/// Operator calls of the head's forward (final norm, product, loss).
pub const OPS_PER_HEAD: f64 = 8.0;

/// One micro-batch on one pp rank, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct MicroBatchTime {
    pub(crate) compute: f64,
    pub(crate) tp: f64,
    pub(crate) pp: f64,
    pub(crate) dp: f64,
}

impl MicroBatchTime {
    pub(crate) fn total(&self) -> f64 {
        self.compute + self.tp + self.pp + self.dp
    }
}

/// What the time model needs besides the layout.
pub(crate) struct TimeModel<'a> {
    pub(crate) model: &'a ModelSpec,
    pub(crate) train: &'a TrainSpec,
    pub(crate) placement: &'a Placement,
}

impl TimeModel<'_> {
    /// One micro-batch on pp rank `r` holding `layers` blocks (module documentation).
    pub(crate) fn microbatch(&self, layout: &Layout, r: usize, layers: usize) -> MicroBatchTime {
        let (model, bytes) = (self.model, self.train.bytes);
        let (t, p, v) = (layout.tp, layout.pp, layout.virtual_stages);
        let (first, last) = (r == 0, r + 1 == p);
        let b = layout.micro_batch_size as f64;
        let tokens = b * model.seq_len as f64;
        let recompute = layout.recomputes();

        let forward = tokens
            * (layers as f64 * model.block_forward_flops_per_token(t)
                + if last { model.head_forward_flops_per_token(t) } else { 0.0 });
        let passes = if recompute { 4.0 } else { 3.0 };
        // Operator calls of one forward: each block's, the head's; the backward counts as two forwards.
        let ops = OPS_PER_BLOCK * layers as f64 + if last { OPS_PER_HEAD } else { 0.0 };
        let compute = passes * (forward / self.placement.flops_of(r) + ops * self.placement.op_latency_of(r));
        // Accumulating this rank's gradients (its shard under ZeRO-2/3) over the step's micro-batches: every one
        // after the first adds into the sum (2 buffers read, 1 written), spread over the micro-batches here.
        let m = layout.microbatches_per_step() as f64;
        let psi = model.params_on_rank(t, p, r, layers) as f64;
        let held = psi / if layout.zero_stage() >= 2 { layout.dp_shard } else { 1 } as f64;
        let accumulate = (m - 1.0) / m * 3.0 * held * bytes.grad as f64 / self.placement.memory_bandwidth_of(r);
        let compute = compute + accumulate;

        let bsh = tokens * model.d_model as f64 * bytes.activation as f64;
        let sync = self.placement.sync_latency_of(r);
        let tp = if t > 1 {
            let link = self.placement.link(GroupKind::Tp, r).link;
            let n = layers as f64 * model.tp_all_reduces_per_block(recompute)
                + f64::from(u8::from(first))
                + f64::from(u8::from(last));
            let small = if last { 3.0 } else { 0.0 };
            n * all_reduce_time(t, bsh, &link) + small * all_reduce_time(t, tokens * 4.0, &link) + (n + small) * sync
        } else {
            0.0
        };

        let mut pp = 0.0;
        if p > 1 {
            let next = self.placement.link(GroupKind::PpNext, r).link;
            let prev = self.placement.link(GroupKind::PpNext, (r + p - 1) % p).link;
            for j in 0..v {
                let stage = r + j * p;
                if stage + 1 < p * v {
                    pp += send_time(bsh, &next) + sync;
                }
                if stage > 0 {
                    pp += send_time(bsh, &prev) + sync;
                }
            }
        }

        let (s, rep) = (layout.dp_shard, layout.dp_replicate);
        let shard_link = self.placement.link(GroupKind::DpShard, r).link;
        let rep_link = self.placement.link(GroupKind::DpReplicate, r).link;
        let grads = psi * bytes.grad as f64;
        let reduce = reduce_scatter_time(s, grads, &shard_link) + all_reduce_time(rep, grads / s as f64, &rep_link);
        let reduce_syncs = if rep > 1 { 2.0 } else { 1.0 };
        // FULL_SHARD gathers unit by unit (each block, and the embeddings or the head on the first and last stage).
        let units = layers as f64 + f64::from(u8::from(first)) + f64::from(u8::from(last));
        let dp = match layout.zero_stage() {
            2 => reduce + reduce_syncs * sync,
            3 => {
                2.0 * all_gather_time(s, psi * bytes.param as f64, &shard_link)
                    + reduce
                    + (2.0 + reduce_syncs) * units * sync
            }
            _ => 0.0,
        };
        MicroBatchTime { compute, tp, pp, dp }
    }

    /// The per-step (once per optimizer step) communication of pp rank `r` holding `layers` blocks.
    pub(crate) fn per_step(&self, layout: &Layout, r: usize, layers: usize) -> f64 {
        let (model, bytes) = (self.model, self.train.bytes);
        let (t, p) = (layout.tp, layout.pp);
        let psi = model.params_on_rank(t, p, r, layers) as f64;
        let (s, rep) = (layout.dp_shard, layout.dp_replicate);
        let link = |kind| self.placement.link(kind, r).link;
        let grads = psi * bytes.grad as f64;
        let gather = all_gather_time(s, psi * bytes.param as f64, &link(GroupKind::DpShard));
        let sync = if layout.dp() > 1 { self.placement.sync_latency_of(r) } else { 0.0 };
        let reduction = match layout.zero_stage() {
            0 => all_reduce_time(layout.dp(), grads, &link(GroupKind::Dp)) + sync,
            1 => {
                reduce_scatter_time(s, grads, &link(GroupKind::DpShard))
                    + all_reduce_time(rep, grads / s as f64, &link(GroupKind::DpReplicate))
                    + gather
                    + if rep > 1 { 3.0 } else { 2.0 } * sync
            }
            2 => gather + sync,
            _ => 0.0,
        };
        let tied = if model.tied_embeddings && p > 1 && (r == 0 || r + 1 == p) {
            let embedding = (model.vocab_per_rank(t) * model.d_model as u64 * bytes.grad) as f64;
            all_reduce_time(2, embedding, &link(GroupKind::Tied)) + self.placement.sync_latency_of(r)
        } else {
            0.0
        };
        reduction + tied
    }

    /// The step of `layout` with `rank_layers[r]` blocks on pp rank r (module documentation).
    pub(crate) fn step(&self, layout: &Layout, rank_layers: &[usize]) -> TimeBreakdown {
        let per_mb: Vec<MicroBatchTime> =
            rank_layers.iter().enumerate().map(|(r, &n)| self.microbatch(layout, r, n)).collect();
        let per_step = rank_layers.iter().enumerate().map(|(r, &n)| self.per_step(layout, r, n)).fold(0.0, f64::max);
        let v = layout.virtual_stages as f64;
        let m = layout.microbatches_per_step() as f64;
        let chunks: Vec<f64> = per_mb.iter().map(|t| t.total() / v).collect();
        let slowest = chunks.iter().copied().fold(0.0, f64::max);
        let pipeline = (m * v - 1.0) * slowest + chunks.iter().sum::<f64>();
        let critical = chunks.iter().position(|&c| c == slowest).unwrap_or(0);
        let c = per_mb[critical];
        TimeBreakdown {
            compute: m * c.compute,
            tp_comm: m * c.tp,
            pp_comm: m * c.pp,
            dp_comm: m * c.dp + per_step,
            bubble: (pipeline - m * c.total()).max(0.0),
            total: pipeline + per_step,
            critical_pp_rank: critical,
        }
    }
}
