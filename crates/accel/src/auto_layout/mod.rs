//! The automatic layout's cost model and chooser: for a world of processes on given
//! machines, which `dp_replicate × dp_shard × tp × pp`, which sharding stage, which pipeline schedule, how many
//! micro-batches of which size — predicted memory per rank and time per optimizer step for every candidate, the
//! fastest that fits chosen, and why.
//!
//! Its core is pure and deterministic: numbers in, a [`Choice`] (or an [`AutoLayoutError`] saying what would fit)
//! out ([`choose`], [`evaluate`]). Around it, [`probe_cluster`] measures the machines on the real backend and
//! [`decide`] runs probe → choose for the Accelerator, which does so when a size of its config is `auto`
//! ([`crate::ParallelismConfig::AUTO`]) and the program described its model ([`AutoLayoutRequest`]); the guide
//! (docs/guide/04-nd-parallel-auto-layout.md, "The automatic layout") writes the cost model down.
//!
//! ```
//! use accel::auto_layout::{choose, Assumptions, ClusterSpec, Link, ModelSpec, Precision, TrainSpec};
//!
//! // The examples' char-GPT (820 992 parameters) on 2 machines × 2 processes, 1 GiB each.
//! let model = ModelSpec::gpt(4, 128, 4, 512, 76, 64);
//! let fast = Link::new(5e-6, 10e9); // α 5 µs, β 10 GB/s within a machine
//! let slow = Link::new(50e-6, 1e9); // across machines
//! let cluster = ClusterSpec::uniform(2, 2, 1 << 30, 50e9, fast, slow);
//! let train = TrainSpec::new(32, &[4, 8], Precision::Fp32);
//! let choice = choose(&model, &cluster, &train, &Assumptions::default())?;
//! println!("{choice}"); // the layout, its predicted memory and step time, the runners-up, the links
//! let config = choice.best.layout.parallelism_config(); // what `AcceleratorConfig::parallelism` takes
//! assert_eq!(config.total_size(), 4);
//! # Ok::<(), accel::auto_layout::AutoLayoutError>(())
//! ```
//!
//! ## Units
//!
//! Bytes (`u64`), seconds (`f64`), FLOP/s (`f64`), bytes per second for link bandwidth β, seconds for link
//! latency α. Sizes of the model are elements (parameters) or sequences (batches); a token is one position of one
//! sequence.
//!
//! ## Files, one concept each
//!
//! - `model.rs` — [`ModelSpec`]: the transformer's shape, its parameters per rank under tp and pp, its FLOPs, the
//!   activation bytes a block keeps ([`ActivationSpec`], Korthikanti et al. 2022).
//! - `train.rs` — [`TrainSpec`]: global batch, micro-batch sizes, accumulation, [`Precision`], optimizer
//!   ([`OptimizerKind`]), bytes per element of each training state ([`StateBytes`]), what the program allows.
//! - `cluster.rs` — [`ClusterSpec`]: machines (processes, memory and FLOP/s per process, the link inside) and the
//!   link between machines, α–β each ([`Link`]).
//! - `assumptions.rs` — [`Assumptions`]: the model's own knobs (memory margin, runtime overhead, runners-up).
//! - `layout.rs` — [`Layout`]: one candidate, and the [`crate::ParallelismConfig`] it becomes.
//! - `placement.rs` — which machine each rank lands on (the mesh's `[pp, dp_replicate, dp_shard, tp]` order, tp
//!   innermost) and which link each group spans ([`GroupLink`]).
//! - `memory.rs` — [`MemoryBreakdown`]: bytes per rank, term by term, with the sources.
//! - `time.rs` — [`TimeBreakdown`]: seconds per optimizer step (compute, tp, pp, dp/ZeRO, bubble), α–β collectives.
//! - `split.rs` — uneven pipeline splits: fewer layers on the stages of smaller (or slower) machines.
//! - `enumerate.rs` — every layout the world size, the model and the batch allow, and why others are not.
//! - `choose.rs` — [`choose`]: evaluate, drop what does not fit, rank, explain ([`Choice`]'s `Display`).
//! - `error.rs` — [`AutoLayoutError`]: invalid input, no layout at all, or nothing fits (with what would).
//! - `units.rs` — how bytes, seconds and bandwidths print.
//! - `measure.rs` — [`probe_cluster`]: the start-up probe (collective), the only part that measures.
//! - `request.rs` — [`AutoLayoutRequest`] (what the program describes) and [`AutoLayoutDecision`] (what was chosen).
//! - `decide.rs` — [`completed_request`] (the request with what the run fixes), [`decide`] (probe, then choose),
//!   [`predict`] (the cost model's figures for a given layout on the measured cluster).
//!
//! ## Sources
//!
//! - Memory of the training state: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
//!   Parameter Models" (§3.1: mixed-precision Adam keeps 2Ψ + 2Ψ + KΨ with K = 12; §5: stage 1 divides the
//!   optimizer state by N, stage 2 also the gradients, stage 3 also the parameters; §7: communication 2Ψ for
//!   stages 1 and 2, 3Ψ for stage 3), and DeepSpeed's autotuner (`get_instantiation_memory_required_per_gpu`: the
//!   same division, then by the model-parallel size; it counts 16Ψ of optimizer state in fp16 where ZeRO counts 12).
//! - Tensor parallelism: Shoeybi et al. 2019, "Megatron-LM" (two all-reduces forward and two backward per block).
//! - Pipelines and FLOPs: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
//!   Using Megatron-LM" (bubble `(p − 1)/(m + p − 1)`, divided by `v` when interleaved; 1F1B holds at most `p`
//!   micro-batches; FLOPs `72·B·s·L·h²·(1 + s/6h + V/12Lh)` = 6 per parameter per token plus attention).
//! - Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
//!   (`s·b·h·(34 + 5·a·s/h)` bytes per block in 16-bit, `s·b·h·(10 + 24/t + 5·a·s/(h·t))` under tp; only the block
//!   inputs with full recomputation).
//! - The search itself: DeepSpeed's autotuner and NeMo's auto-configurator enumerate candidates and keep those
//!   that fit; Galvatron and Alpa cost them with profiled α–β links. Here every candidate is costed by formulas,
//!   none is run (timing the best few for a few steps, as NeMo and DeepSpeed do, is not done).
//!
//! ## What the model assumes (conservatively)
//!
//! No overlap: communication adds to computation (DDP's bucketed overlap and FSDP's prefetch are not counted);
//! peak memory adds the resting state, the transient buffers and the activations in flight (their peaks need not
//! coincide); links inside a machine serve every group at full β, the link between machines is one per machine,
//! shared by every group crossing it at once; a ring collective over `n` ranks takes `n − 1` (all-gather,
//! reduce-scatter) or `2(n − 1)` (all-reduce) α steps and moves `(n − 1)/n` or `2(n − 1)/n` of the buffer over its
//! slowest link.

mod assumptions;
mod candidate;
mod choose;
mod cluster;
mod decide;
mod enumerate;
mod error;
mod invalid;
mod layout;
mod measure;
mod memory;
mod model;
mod placement;
mod request;
mod split;
mod time;
mod train;
mod units;

#[cfg(test)]
mod tests;

pub use crate::nn::ActivationSpec;
pub use assumptions::Assumptions;
pub use choose::{choose, evaluate, Candidate, Choice, GroupUse, RankPrediction, SplitComparison};
pub use cluster::{ClusterSpec, Link, Machine};
pub use decide::{completed_request, decide, predict};
pub use enumerate::{enumerate, Rejections};
pub use error::AutoLayoutError;
pub use invalid::InvalidSpec;
pub use layout::Layout;
pub use measure::{memory_from_env, parse_memory, probe_cluster, ClusterProbe, FLOPS_PROBE_SECONDS, MEMORY_ENV};
pub use memory::{in_flight_chunks, MemoryBreakdown};
pub use model::ModelSpec;
pub use placement::{GroupKind, GroupLink, LinkClass, Placement};
pub use request::{AutoLayoutDecision, AutoLayoutRequest};
pub use time::{all_gather_time, all_reduce_time, bubble_fraction, reduce_scatter_time, send_time, TimeBreakdown};
pub use train::{Checkpointing, OptimizerKind, Precision, StateBytes, TrainSpec};
