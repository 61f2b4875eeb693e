//! [`AutoLayoutRequest`]: what a program tells the Accelerator so that it can choose the layout at start-up
//! (`AcceleratorConfig::auto_layout`) — the model's shape and how it trains — and [`AutoLayoutDecision`], what the
//! Accelerator chose and measured (`Accelerator::auto_layout`).

use super::assumptions::Assumptions;
use super::choose::Choice;
use super::layout::Layout;
use super::measure::ClusterProbe;
use super::model::ModelSpec;
use super::train::TrainSpec;

/// The program's side of the automatic layout: its model and its training (see [`super::choose`]).
///
/// The Accelerator fills in what it knows better: the sizes the config fixes ([`TrainSpec::fixed`]), the precision
/// and the bytes per state ([`super::StateBytes::accel`] of its mixed precision and device), and activation
/// checkpointing when its config turns it on. The rest — the global batch, the micro-batch sizes, whether
/// accumulation, tp, pp, each sharding strategy and schedule are allowed, the optimizer — is the program's.
#[derive(Debug, Clone)]
pub struct AutoLayoutRequest {
    /// The model's shape.
    pub model: ModelSpec,
    /// How it trains, and which layouts the program can run.
    pub train: TrainSpec,
    /// The cost model's knobs. `runtime_overhead_bytes` is replaced by the probe's measurement unless
    /// [`Self::fixed_overhead`] is set.
    pub assumptions: Assumptions,
    /// Keep `assumptions.runtime_overhead_bytes` as given instead of measuring it.
    pub fixed_overhead: bool,
    /// Memory per process to plan for, bytes, instead of the detected one (also `ACCEL_AUTO_LAYOUT_MEMORY`, which
    /// this takes precedence over).
    pub memory_per_process: Option<u64>,
}

impl AutoLayoutRequest {
    /// A request for `model` trained as `train`, with the default assumptions and the detected memory.
    pub fn new(model: ModelSpec, train: TrainSpec) -> Self {
        AutoLayoutRequest {
            model,
            train,
            assumptions: Assumptions::default(),
            fixed_overhead: false,
            memory_per_process: None,
        }
    }

    /// Builder: plan for `bytes` of memory per process instead of the detected memory.
    pub fn with_memory_per_process(mut self, bytes: u64) -> Self {
        self.memory_per_process = Some(bytes);
        self
    }

    /// Builder: the cost model's assumptions (the runtime overhead given here is kept: not measured).
    pub fn with_assumptions(mut self, assumptions: Assumptions) -> Self {
        self.assumptions = assumptions;
        self.fixed_overhead = true;
        self
    }
}

/// What the Accelerator chose at start-up and why: the measured cluster and the chooser's [`Choice`] (its
/// `Display` is the printed explanation).
#[derive(Debug, Clone)]
pub struct AutoLayoutDecision {
    /// The start-up probe's measurements.
    pub probe: ClusterProbe,
    /// The chosen layout, its prediction and the runners-up.
    pub choice: Choice,
}

impl AutoLayoutDecision {
    /// The chosen layout: its micro-batch size ([`Layout::micro_batch_size`]), the rows a rank reads per training
    /// step ([`Layout::per_process_batch`]), the layers per stage. The Accelerator already runs its sizes, sharding,
    /// schedule, accumulation steps and checkpointing.
    pub fn layout(&self) -> &Layout {
        &self.choice.best.layout
    }
}

impl std::fmt::Display for AutoLayoutDecision {
    /// The probe's line, then the choice's explanation.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "auto layout probe {}", self.probe)?;
        write!(f, "{}", self.choice)
    }
}
