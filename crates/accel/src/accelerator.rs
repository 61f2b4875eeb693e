//! [`Accelerator`]: the level-2 entry point (like Hugging Face Accelerate's `Accelerator`).
//!
//! One object that knows the process group, the device, the compute precision and the gradient-accumulation
//! window, so a single-process candle loop becomes distributed by changing a handful of lines:
//! `var_builder` (device + dtype), `prepare_model` / `prepare_optimizer` / `prepare_data_loader`, `backward`
//! instead of `loss.backward()`, and `AcceleratedOptimizer::step` (a no-op between gradient syncs).
//!
//! Cheap to clone (one `Arc`); every clone is the same Accelerator.

mod collectives;
mod data_loader;
mod gradient_state;
pub(crate) mod gradients;
mod prepared_model;
mod process_control;

pub use collectives::ReduceKind;
pub use gradient_state::GradientState;
pub use prepared_model::PreparedModel;

use crate::mixed_precision::{GradScaler, GradScalerConfig};
use crate::optim::{AcceleratedOptimizer, Optimizer};
use crate::{AccelError, AcceleratorConfig, MixedPrecision, Result};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use ddp_core::ProcessGroup;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// The Accelerator: process group, device, precision, accumulation window, prepared objects.
#[derive(Clone)]
pub struct Accelerator {
    pub(crate) inner: Arc<AcceleratorInner>,
}

/// Shared state behind an [`Accelerator`]. `pub(crate)` so the state (save/load) and tracking modules can reach it.
pub(crate) struct AcceleratorInner {
    pub(crate) config: AcceleratorConfig,
    pub(crate) pg: ProcessGroup,
    pub(crate) device: Device,
    pub(crate) gradient_state: GradientState,
    /// Dynamic loss scaler; `Some` only under fp16.
    pub(crate) scaler: Option<Arc<Mutex<GradScaler>>>,
    /// Models given to `prepare_model`, in order.
    pub(crate) models: Mutex<Vec<PreparedModel>>,
    /// Optimizers given to `prepare_optimizer`, in order (for `save_state` / `load_state`).
    pub(crate) optimizers: Mutex<Vec<Arc<Mutex<dyn Optimizer>>>>,
    pub(crate) steps: Mutex<StepState>,
    /// The Accelerator's RNG (seeded by `set_seed`); its state is checkpointed per rank.
    pub(crate) rng: Mutex<ChaCha8Rng>,
    /// Per-type slots other modules (state registry, trackers) keep their data in, see [`Accelerator::with_extension`].
    pub(crate) extensions: Mutex<HashMap<TypeId, Box<dyn Any + Send>>>,
}

/// Step bookkeeping (Accelerate's `AcceleratorState.step` + `GradientState.sync_gradients`).
#[derive(Debug, Clone, Default)]
pub(crate) struct StepState {
    /// Micro-steps since the last end-of-loader reset; the window syncs when it is a multiple of GA.
    pub(crate) micro_step: u64,
    /// Whether the current micro-step syncs gradients (true before the first one).
    pub(crate) sync_gradients: bool,
    /// Inside `accumulate`: the window was advanced on entry, `backward` must not advance it again.
    pub(crate) in_accumulate: bool,
    /// Nesting depth of `no_sync`.
    pub(crate) no_sync_depth: usize,
    /// Micro-steps (backward calls) since construction.
    pub(crate) total_micro_steps: u64,
    /// Optimizer steps actually taken (fp16-skipped steps excluded).
    pub(crate) optimizer_steps: u64,
    /// Optimizer steps skipped because of fp16 overflow.
    pub(crate) skipped_steps: u64,
}

/// Step counters saved in checkpoints (`accelerator.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct StepCounters {
    /// Position in the accumulation window (micro-steps since the last end-of-loader reset).
    pub micro_step: u64,
    /// Backward calls since the start of training.
    pub total_micro_steps: u64,
    /// Optimizer steps taken.
    pub optimizer_steps: u64,
    /// Optimizer steps skipped for fp16 overflow.
    pub skipped_steps: u64,
}

/// Locks a mutex, ignoring poisoning: a panicking rank is about to take the job down anyway, and every critical
/// section here leaves the data consistent.
pub(crate) fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl std::fmt::Debug for Accelerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accelerator")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("device", &self.device())
            .field("mixed_precision", &self.mixed_precision())
            .field("gradient_accumulation_steps", &self.inner.config.gradient_accumulation_steps)
            .finish()
    }
}

impl Accelerator {
    /// Builds an Accelerator for this process: joins the job described by the environment (torchrun / `accel
    /// launch` names, Slurm, Open MPI or PMI with more than one task) or runs as a single process when none is set.
    /// Picks the device (CUDA device `local_rank` with the `cuda` feature unless `cfg.cpu`, else the CPU) and
    /// applies `cfg.seed`.
    pub fn new(cfg: AcceleratorConfig) -> Result<Self> {
        cfg.validate()?;
        let pg = if distributed_env_present(|k| std::env::var(k).ok()) {
            ProcessGroup::init_from_env()?
        } else {
            ProcessGroup::single_process()?
        };
        Self::with_process_group(cfg, pg)
    }

    /// `Accelerator::new(AcceleratorConfig::from_env()?)`: what a program started by `accel launch` calls.
    pub fn from_env() -> Result<Self> {
        Self::new(AcceleratorConfig::from_env()?)
    }

    /// An Accelerator over an existing process group (tests run ranks as threads this way).
    pub fn with_process_group(cfg: AcceleratorConfig, pg: ProcessGroup) -> Result<Self> {
        cfg.validate()?;
        let device = pick_device(&cfg, pg.local_rank())?;
        let scaler = match cfg.mixed_precision {
            MixedPrecision::Fp16 => Some(Arc::new(Mutex::new(GradScaler::new(GradScalerConfig::default())?))),
            _ => None,
        };
        let seed = cfg.seed;
        let acc = Accelerator {
            inner: Arc::new(AcceleratorInner {
                config: cfg,
                pg,
                device,
                gradient_state: GradientState::new(),
                scaler,
                models: Mutex::new(Vec::new()),
                optimizers: Mutex::new(Vec::new()),
                steps: Mutex::new(StepState { sync_gradients: true, ..Default::default() }),
                rng: Mutex::new(ChaCha8Rng::seed_from_u64(0)),
                extensions: Mutex::new(HashMap::new()),
            }),
        };
        if let Some(seed) = seed {
            acc.set_seed(seed, false);
        }
        Ok(acc)
    }

    /// The device models and batches live on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }
    /// Global rank of this process, `0..world_size`.
    pub fn rank(&self) -> usize {
        self.inner.pg.rank()
    }
    /// Rank on this machine.
    pub fn local_rank(&self) -> usize {
        self.inner.pg.local_rank()
    }
    /// Number of processes in the job.
    pub fn world_size(&self) -> usize {
        self.inner.pg.world_size()
    }
    /// Whether this is rank 0 of the job (the one that prints, logs and writes shared files).
    pub fn is_main_process(&self) -> bool {
        self.rank() == 0
    }
    /// Whether this is local rank 0 on its machine.
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank() == 0
    }
    /// The process group (for level-1 collectives when the user needs them).
    pub fn process_group(&self) -> &ProcessGroup {
        &self.inner.pg
    }
    /// The configuration this Accelerator was built with.
    pub fn config(&self) -> &AcceleratorConfig {
        &self.inner.config
    }
    /// The compute precision.
    pub fn mixed_precision(&self) -> MixedPrecision {
        self.inner.config.mixed_precision
    }
    /// The dtype model `Var`s and activations use: F32, F16 or BF16.
    pub fn compute_dtype(&self) -> DType {
        self.inner.config.mixed_precision.compute_dtype()
    }
    /// Micro-batches per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.inner.config.gradient_accumulation_steps
    }
    /// The state shared with prepared data loaders (end of loader, padding rows).
    pub fn gradient_state(&self) -> &GradientState {
        &self.inner.gradient_state
    }

    /// A `VarBuilder` over `varmap` that creates parameters in the compute dtype on the Accelerator's device:
    /// build the model with it, then call [`Accelerator::prepare_model`].
    pub fn var_builder(&self, varmap: &VarMap) -> VarBuilder<'static> {
        VarBuilder::from_varmap(varmap, self.compute_dtype(), self.device())
    }

    /// Prepares a model's parameters (all `Var`s of `varmap`, sorted by name): wraps them in DDP (names and
    /// shapes checked across ranks, rank 0's values broadcast) and, under bf16/fp16, keeps fp32 master copies
    /// that the optimizer updates. Every rank must call it with the same model. Errors: an empty `VarMap`,
    /// parameters not on the Accelerator's device, mismatches across ranks.
    pub fn prepare_model(&self, varmap: &VarMap) -> Result<PreparedModel> {
        let model = PreparedModel::new(self, varmap)?;
        let mut models = lock(&self.inner.models);
        for other in models.iter() {
            if let Some(shared) = model
                .names()
                .iter()
                .zip(model.parameters())
                .find(|(_, v)| other.parameters().iter().any(|o| o.as_tensor().id() == v.as_tensor().id()))
            {
                return Err(AccelError::Usage(format!(
                    "prepare_model: parameter {:?} belongs to a model that was already prepared; prepare each model \
                     once and reuse the PreparedModel",
                    shared.0
                )));
            }
        }
        models.push(model.clone());
        Ok(model)
    }

    /// Wraps an optimizer for `model`: it will step on the model's fp32 master weights, only on gradient-sync
    /// steps, with fp16 unscaling and overflow skipping. Its state is saved by `save_state`.
    pub fn prepare_optimizer<O: Optimizer>(&self, model: &PreparedModel, opt: O) -> Result<AcceleratedOptimizer<O>> {
        let opt = Arc::new(Mutex::new(opt));
        lock(&self.inner.optimizers).push(opt.clone() as Arc<Mutex<dyn Optimizer>>);
        Ok(AcceleratedOptimizer::new(self.clone(), model.clone(), opt))
    }

    /// Real optimizer steps taken so far (fp16 steps skipped for overflow are not counted).
    pub fn optimizer_step_count(&self) -> u64 {
        lock(&self.inner.steps).optimizer_steps
    }

    /// Step counters (for checkpoints).
    pub fn step_counters(&self) -> StepCounters {
        let s = lock(&self.inner.steps);
        StepCounters {
            micro_step: s.micro_step,
            total_micro_steps: s.total_micro_steps,
            optimizer_steps: s.optimizer_steps,
            skipped_steps: s.skipped_steps,
        }
    }

    /// Restores step counters saved by [`Accelerator::step_counters`] (used by `load_state`).
    pub fn set_step_counters(&self, c: StepCounters) {
        let mut s = lock(&self.inner.steps);
        s.micro_step = c.micro_step;
        s.total_micro_steps = c.total_micro_steps;
        s.optimizer_steps = c.optimizer_steps;
        s.skipped_steps = c.skipped_steps;
        s.sync_gradients = c.micro_step % self.inner.config.gradient_accumulation_steps as u64 == 0;
    }

    /// The fp16 loss scaler, `None` unless mixed precision is fp16.
    pub fn grad_scaler(&self) -> Option<Arc<Mutex<GradScaler>>> {
        self.inner.scaler.clone()
    }

    /// The models prepared so far, in order.
    pub fn prepared_models(&self) -> Vec<PreparedModel> {
        lock(&self.inner.models).clone()
    }

    /// The optimizers prepared so far, in order (shared with their [`AcceleratedOptimizer`]s).
    pub fn prepared_optimizers(&self) -> Vec<Arc<Mutex<dyn Optimizer>>> {
        lock(&self.inner.optimizers).clone()
    }

    /// The Accelerator's RNG (ChaCha8, seeded by [`Accelerator::set_seed`], checkpointed per rank): use it for
    /// anything random in the training loop that must resume exactly (dropout masks, augmentation).
    pub fn rng(&self) -> MutexGuard<'_, ChaCha8Rng> {
        lock(&self.inner.rng)
    }

    /// Runs `f` on this Accelerator's slot of type `T` (created with `T::default()` on first use). Lets other
    /// modules (checkpoint registry, trackers) keep state in the Accelerator without a field of their own here.
    pub(crate) fn with_extension<T: Default + Send + 'static, R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let mut map = lock(&self.inner.extensions);
        let slot = map.entry(TypeId::of::<T>()).or_insert_with(|| Box::new(T::default()));
        f(slot.downcast_mut::<T>().expect("extension slot holds its TypeId's type"))
    }

    /// Errors unless `prepare_model` was called (used by backward, clipping, optimizer steps).
    pub(crate) fn require_models(&self, what: &str) -> Result<Vec<PreparedModel>> {
        let models = self.prepared_models();
        if models.is_empty() {
            return Err(AccelError::Usage(format!(
                "{what} needs a prepared model: call accelerator.prepare_model(&varmap) first"
            )));
        }
        Ok(models)
    }
}

/// Whether the environment describes a multi-process job (torchrun names, or Slurm / Open MPI / PMI with more than
/// one task).
pub(crate) fn distributed_env_present(get: impl Fn(&str) -> Option<String>) -> bool {
    if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
        return true;
    }
    ["SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .any(|k| get(k).and_then(|v| v.trim().parse::<usize>().ok()).is_some_and(|n| n > 1))
}

/// The CPU when asked for (or when CUDA is not built in), else CUDA device `local_rank`.
fn pick_device(cfg: &AcceleratorConfig, local_rank: usize) -> Result<Device> {
    if cfg.cpu {
        return Ok(Device::Cpu);
    }
    // Without the `cuda` feature candle reports CUDA as unavailable and this is the CPU.
    Device::cuda_if_available(local_rank).map_err(|e| AccelError::Config {
        key: "device".into(),
        value: format!("cuda:{local_rank}"),
        reason: format!(
            "cannot open CUDA device {local_rank} (local rank {local_rank}): {e}; run one process per GPU, or force \
             the CPU with AcceleratorConfig::cpu / ACCELERATE_USE_CPU=1 / accel launch --cpu"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_detection() {
        let none = |_: &str| None::<String>;
        assert!(!distributed_env_present(none));
        assert!(distributed_env_present(|k: &str| (k == "RANK").then(|| "0".to_string())));
        assert!(!distributed_env_present(|k: &str| (k == "SLURM_NTASKS").then(|| "1".to_string())));
        assert!(distributed_env_present(|k: &str| (k == "OMPI_COMM_WORLD_SIZE").then(|| "4".to_string())));
    }
}
