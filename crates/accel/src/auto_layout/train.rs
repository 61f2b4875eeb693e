//! [`TrainSpec`]: how the model is trained — the global batch, the micro-batch sizes the program can take, whether
//! it accumulates gradients, the precision and optimizer (and so the bytes of each training state per parameter,
//! [`StateBytes`]), activation checkpointing, and which parallel forms the program supports.

use super::invalid::InvalidSpec;
use crate::pipeline::ScheduleKind;
use crate::sharding::ShardingStrategy;

/// The compute precision (accel's `MixedPrecision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    /// fp32 throughout.
    Fp32,
    /// bf16 compute, fp32 master weights.
    Bf16,
    /// fp16 compute with loss scaling, fp32 master weights.
    Fp16,
}

impl Precision {
    /// Bytes of one element of the compute dtype: 4 or 2.
    pub fn compute_bytes(self) -> u64 {
        match self {
            Precision::Fp32 => 4,
            Precision::Bf16 | Precision::Fp16 => 2,
        }
    }

    /// Whether compute is 16-bit over fp32 masters.
    pub fn is_mixed(self) -> bool {
        self != Precision::Fp32
    }

    /// `fp32`, `bf16`, `fp16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}

/// The optimizer, for the state it keeps per parameter (fp32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OptimizerKind {
    /// Adam / AdamW: two fp32 moments, 8 bytes per parameter.
    AdamW,
    /// SGD with momentum: one fp32 buffer, 4 bytes.
    SgdMomentum,
    /// Plain SGD: nothing.
    Sgd,
}

impl OptimizerKind {
    /// fp32 state bytes per parameter (masters not included).
    pub fn state_bytes(self) -> u64 {
        match self {
            OptimizerKind::AdamW => 8,
            OptimizerKind::SgdMomentum => 4,
            OptimizerKind::Sgd => 0,
        }
    }

    /// `AdamW`, `SGD (momentum)`, `SGD`.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "AdamW",
            OptimizerKind::SgdMomentum => "SGD (momentum)",
            OptimizerKind::Sgd => "SGD",
        }
    }
}

/// Bytes per parameter of each training state, and per activation element. The ZeRO paper's accounting
/// ([`StateBytes::zero_paper`]) or accel's ([`StateBytes::accel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StateBytes {
    /// The parameters the model computes with.
    pub param: u64,
    /// The gradient a rank keeps between the backward pass and the optimizer step.
    pub grad: u64,
    /// The optimizer's state: fp32 masters under mixed precision plus the moments.
    pub optimizer: u64,
    /// One activation element.
    pub activation: u64,
    /// Under FULL_SHARD the parameters rest as the fp32 masters' chunks (counted in `optimizer`), not as a second
    /// copy in the compute dtype (accel; DeepSpeed's stage 3 keeps both).
    pub full_shard_params_are_masters: bool,
}

impl StateBytes {
    /// Rajbhandari et al. 2020 (§3.1) and DeepSpeed's autotuner: mixed precision keeps 2 bytes of parameters,
    /// 2 of gradients and 12 of optimizer state (4 of fp32 masters + AdamW's 8) per parameter — 16Ψ; fp32 keeps 4,
    /// 4 and 8 — 16Ψ. Activations in the compute dtype.
    pub fn zero_paper(precision: Precision, optimizer: OptimizerKind) -> Self {
        let masters = if precision.is_mixed() { 4 } else { 0 };
        StateBytes {
            param: precision.compute_bytes(),
            grad: precision.compute_bytes(),
            optimizer: masters + optimizer.state_bytes(),
            activation: precision.compute_bytes(),
            full_shard_params_are_masters: false,
        }
    }

    /// What accel holds: gradients always in fp32 slots (the step owner's, 4 bytes), fp32 masters only where the
    /// compute dtype is 16-bit, FULL_SHARD's parameters resting as the masters' chunks. On the CPU (`cpu`), bf16 is
    /// autocast over f32 parameters and activations: 4 bytes each and no separate masters.
    pub fn accel(precision: Precision, optimizer: OptimizerKind, cpu: bool) -> Self {
        let compute = if cpu && precision == Precision::Bf16 { 4 } else { precision.compute_bytes() };
        let masters = if compute == 2 { 4 } else { 0 };
        StateBytes {
            param: compute,
            grad: 4,
            optimizer: masters + optimizer.state_bytes(),
            activation: compute,
            full_shard_params_are_masters: true,
        }
    }
}

/// Activation checkpointing (`AcceleratorConfig::activation_checkpointing`): whether the chooser may, must or must
/// not recompute blocks in the backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Checkpointing {
    /// Never (the program's blocks are not wrapped in `activation_checkpoint::block`).
    #[default]
    Off,
    /// Always (FULL_SHARD recomputes its units anyway).
    On,
    /// Either: the chooser weighs the memory saved against a third more compute.
    Auto,
}

/// How the model is trained, and which layouts the program supports.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSpec {
    /// Sequences per optimizer step, over all data-parallel ranks (B).
    pub global_batch: usize,
    /// The micro-batch sizes (sequences per forward on one rank) the chooser may pick from.
    pub micro_batch_sizes: Vec<usize>,
    /// Whether the program may accumulate gradients over several micro-batches at pp 1 (pipeline micro-batches
    /// are always allowed: the pipeline splits the batch itself).
    pub gradient_accumulation: bool,
    /// Compute precision.
    pub precision: Precision,
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// Bytes per parameter of each state: by default [`StateBytes::zero_paper`] of the precision and optimizer;
    /// the wiring passes [`StateBytes::accel`].
    pub bytes: StateBytes,
    /// Activation checkpointing.
    pub checkpointing: Checkpointing,
    /// The program builds its model with tensor-parallel layers (`ParamBuilder`): tp > 1 is allowed.
    pub tensor_parallel: bool,
    /// The program builds its model as pipeline stages (`pipeline_stages` + `pipeline_backward`): pp > 1 is allowed.
    pub pipeline: bool,
    /// The sharding strategies the program allows when dp_shard > 1 (FULL_SHARD needs the model built from the
    /// prepared builder).
    pub strategies: Vec<ShardingStrategy>,
    /// The pipeline schedules allowed when pp > 1.
    pub schedules: Vec<ScheduleKind>,
    /// Sizes the user fixed, `[dp_replicate, dp_shard, tp, pp]` (`None`: chosen), e.g. `tp_size: auto` with the
    /// others set ([`crate::ParallelismConfig::fixed_sizes`]).
    pub fixed: [Option<usize>; 4],
}

impl TrainSpec {
    /// A global batch of `global_batch` sequences in micro-batches of any of `micro_batch_sizes`, with AdamW in
    /// `precision` (the ZeRO paper's bytes), accumulation allowed, checkpointing off, every parallel form, every
    /// sharding strategy and schedule allowed.
    pub fn new(global_batch: usize, micro_batch_sizes: &[usize], precision: Precision) -> Self {
        TrainSpec {
            global_batch,
            micro_batch_sizes: micro_batch_sizes.to_vec(),
            gradient_accumulation: true,
            precision,
            optimizer: OptimizerKind::AdamW,
            bytes: StateBytes::zero_paper(precision, OptimizerKind::AdamW),
            checkpointing: Checkpointing::Off,
            tensor_parallel: true,
            pipeline: true,
            strategies: vec![
                ShardingStrategy::NoShard,
                ShardingStrategy::ShardOptim,
                ShardingStrategy::ShardGradOp,
                ShardingStrategy::FullShard,
            ],
            schedules: vec![ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved1F1B],
            fixed: [None; 4],
        }
    }

    /// [`TrainSpec::new`] with every micro-batch size that divides `global_batch` allowed.
    pub fn any_micro_batch(global_batch: usize, precision: Precision) -> Self {
        let sizes: Vec<usize> = (1..=global_batch).filter(|b| global_batch.is_multiple_of(*b)).collect();
        TrainSpec::new(global_batch, &sizes, precision)
    }

    /// Builder: the sizes the user fixed, `[dp_replicate, dp_shard, tp, pp]` (`None`: chosen).
    pub fn with_fixed_sizes(mut self, fixed: [Option<usize>; 4]) -> Self {
        self.fixed = fixed;
        self
    }

    /// Builder: the optimizer (the bytes follow it, in the same accounting as before: ZeRO's unless
    /// [`Self::with_bytes`] set others, which are kept).
    pub fn with_optimizer(mut self, optimizer: OptimizerKind) -> Self {
        if self.bytes == StateBytes::zero_paper(self.precision, self.optimizer) {
            self.bytes = StateBytes::zero_paper(self.precision, optimizer);
        }
        self.optimizer = optimizer;
        self
    }

    /// Builder: bytes per state (e.g. [`StateBytes::accel`]).
    pub fn with_bytes(mut self, bytes: StateBytes) -> Self {
        self.bytes = bytes;
        self
    }

    /// Builder: activation checkpointing.
    pub fn with_checkpointing(mut self, checkpointing: Checkpointing) -> Self {
        self.checkpointing = checkpointing;
        self
    }

    /// Builder: whether gradient accumulation is allowed.
    pub fn with_gradient_accumulation(mut self, allowed: bool) -> Self {
        self.gradient_accumulation = allowed;
        self
    }

    /// Builder: whether tp > 1 and pp > 1 are allowed.
    pub fn with_parallel_forms(mut self, tensor_parallel: bool, pipeline: bool) -> Self {
        self.tensor_parallel = tensor_parallel;
        self.pipeline = pipeline;
        self
    }

    /// Builder: the allowed sharding strategies.
    pub fn with_strategies(mut self, strategies: &[ShardingStrategy]) -> Self {
        self.strategies = strategies.to_vec();
        self
    }

    /// Builder: the allowed pipeline schedules.
    pub fn with_schedules(mut self, schedules: &[ScheduleKind]) -> Self {
        self.schedules = schedules.to_vec();
        self
    }

    /// Checks: a global batch ≥ 1, at least one micro-batch size, none 0.
    pub fn validate(&self) -> Result<(), InvalidSpec> {
        if self.global_batch == 0 {
            return Err(InvalidSpec("the global batch is 0 sequences; it is at least 1".into()));
        }
        if self.micro_batch_sizes.is_empty() || self.micro_batch_sizes.contains(&0) {
            return Err(InvalidSpec(format!(
                "micro-batch sizes {:?}: give at least one, each at least 1 sequence",
                self.micro_batch_sizes
            )));
        }
        if self.fixed.contains(&Some(0)) {
            return Err(InvalidSpec(format!(
                "fixed sizes {:?} (dp_replicate, dp_shard, tp, pp): a fixed size is at least 1",
                self.fixed
            )));
        }
        Ok(())
    }
}
