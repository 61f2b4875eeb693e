//! [`Accelerator`]: the level-2 entry point (like Hugging Face Accelerate's `Accelerator`).
//!
//! One object that knows the process group, the device, the compute precision and the gradient-accumulation
//! window, so a single-process candle loop becomes distributed by changing a handful of lines:
//! `var_builder` (device + dtype), `prepare_model` / `prepare_optimizer` / `prepare_data_loader`, `backward`
//! instead of `loss.backward()`, and `AcceleratedOptimizer::step` (a no-op between gradient syncs).
//!
//! Its whole public API is in this file, grouped by purpose: setup, prepare, the training step, collectives,
//! process control, state (checkpoints), tracking. The work behind the step lives in [`crate::step`] (the one
//! owner of a step), behind collectives in `collectives.rs`, behind checkpoints in `checkpointing.rs` (over [`crate::state`]'s files), behind
//! tracking in [`crate::tracking`].
//!
//! Cheap to clone (one `Arc`); every clone is the same Accelerator.

pub(crate) mod checkpointing;
mod collectives;

pub use collectives::ReduceKind;

use crate::data::{BatchInfo, DataLoader, Dataset, LoaderStateHandle};
use crate::mixed_precision::{GradScaler, GradScalerConfig};
use crate::model::PreparedModel;
use crate::optim::{AcceleratedOptimizer, Optimizer};
use crate::pipeline::runtime::{Combine, PipelineRuntime};
use crate::pipeline::{Stage, StagedModel};
use crate::state::SharedStateful;
use crate::step::{StepController, StepCounters};
use crate::tensor_parallel::{with_dropout_context, DropoutContext, ParamBuilder, TensorParallel};
use crate::tracking::{TrackerKind, Trackers};
use crate::{lock, AccelError, AcceleratorConfig, MixedPrecision, ParallelismConfig, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use ddp_core::{DeviceMesh, ProcessGroup};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// The Accelerator: process group, device, precision, the training step, prepared objects, trackers.
#[derive(Clone)]
pub struct Accelerator {
    inner: Arc<Inner>,
}

/// Everything behind an [`Accelerator`]; one owner per piece of state.
struct Inner {
    /// The checkpoint being written in the background, if any (first: the Accelerator's end waits for it).
    saves: checkpointing::BackgroundSaves,
    /// The config as run: with the automatic layout's settings when it chose them.
    config: AcceleratorConfig,
    /// What the automatic layout measured and chose, when a size was `auto`.
    auto_layout: Option<crate::auto_layout::AutoLayoutDecision>,
    pg: ProcessGroup,
    /// `config.parallelism` resolved for this job's world size (every size 1 → dp_replicate = world size).
    parallelism: ParallelismConfig,
    /// The ranks laid out as `[pp, dp_replicate, dp_shard, tp]`, with a group per dimension.
    mesh: DeviceMesh,
    /// Tensor parallelism over the mesh's tp group (and the layouts of the parameters built through it).
    tp: TensorParallel,
    /// Pipeline parallelism (pp > 1): the links between stages, the schedule, the agreed activation shapes.
    pipeline: Option<PipelineRuntime>,
    device: Device,
    /// The accumulation window, sync decision, gradient buffers, fp16 scaler and step counters (shared with the
    /// prepared optimizers, which take their gradients from it).
    step: Arc<StepController>,
    /// What `prepare_*` and `register_*` were given, in order (what checkpoints save and restore).
    prepared: Mutex<Prepared>,
    /// The trackers of `init_trackers` (main process only).
    trackers: Mutex<Trackers>,
    /// The Accelerator's RNG (seeded by `set_seed`); its state is checkpointed per rank.
    rng: Mutex<ChaCha8Rng>,
    /// Which builder made each parameter not yet prepared (`var_builder`, `builder`): what `prepare_model` checks
    /// the plan and the layout against.
    provenance: Arc<crate::nn::Provenance>,
    /// On the CPU: bf16 autocast set on the creating thread (on under bf16, off otherwise), put back as it was when
    /// the Accelerator goes (see [`Accelerator::compute_dtype`]).
    _autocast: Option<accel_nn::ops::autocast::Bf16Guard>,
}

/// The objects an Accelerator prepared or was asked to checkpoint, in registration order.
#[derive(Default)]
pub(crate) struct Prepared {
    pub(crate) models: Vec<PreparedModel>,
    /// Each optimizer with the model whose parameters it steps (its state is laid out like that model's).
    pub(crate) optimizers: Vec<(Arc<Mutex<dyn Optimizer>>, PreparedModel)>,
    pub(crate) data_loaders: Vec<LoaderStateHandle>,
    pub(crate) schedulers: Vec<SharedStateful>,
    pub(crate) custom: Vec<SharedStateful>,
}

impl Prepared {
    /// A snapshot of the registry (the handles are shared, the lists are copied).
    pub(crate) fn snapshot(&self) -> Prepared {
        Prepared {
            models: self.models.clone(),
            optimizers: self.optimizers.clone(),
            data_loaders: self.data_loaders.clone(),
            schedulers: self.schedulers.clone(),
            custom: self.custom.clone(),
        }
    }
}

impl std::fmt::Debug for Accelerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accelerator")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("device", &self.device())
            .field("mixed_precision", &self.mixed_precision())
            .field("gradient_accumulation_steps", &self.inner.config.gradient_accumulation_steps)
            .field("mesh", &self.inner.mesh.shape())
            .finish()
    }
}

// ==== Setup ===========================================================================================================
impl Accelerator {
    /// Builds an Accelerator for this process: joins the job described by the environment (torchrun / `accel
    /// launch` names, a Slurm step, Open MPI or PMI — as [`ddp_core::DistEnv::detect`] decides) when it has more
    /// than one process, or runs as a single process (no launcher variables, a bare `salloc` shell, a one-process
    /// job). Picks the device (CUDA device `local_rank` with the `cuda` feature unless `cfg.cpu`, else the CPU)
    /// and applies `cfg.seed`. The library's warnings go to stderr unless the program set a tracing subscriber of
    /// its own ([`crate::logging`]). Errors: an inconsistent job layout (naming the variable), rendezvous failures.
    pub fn new(cfg: AcceleratorConfig) -> Result<Self> {
        crate::logging::init_default();
        cfg.validate()?;
        let pg = if joins_a_job(ddp_core::DistEnv::detect_from_env()?.as_ref()) {
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
    ///
    /// Lays `pg`'s ranks out as the [`DeviceMesh`] of `cfg.parallelism` (collective over `pg`: one group per
    /// mesh dimension). Errors: the config's ([`AcceleratorConfig::validate`]), sizes whose product is not the
    /// world size ([`ParallelismConfig::resolve`]), the device, backend failures building the mesh.
    pub fn with_process_group(cfg: AcceleratorConfig, pg: ProcessGroup) -> Result<Self> {
        crate::logging::init_default();
        cfg.validate()?;
        let device = pick_device(&cfg, pg.local_rank())?;
        let (cfg, auto_layout) = choose_auto_layout(cfg, &pg, &device)?;
        // Every rank has the same config, so these errors are raised by all ranks before any collective.
        let parallelism = cfg.parallelism.resolve(pg.world_size())?;
        let shape = parallelism.mesh_shape(pg.world_size())?;
        let mesh = DeviceMesh::new(&pg, shape)?;
        let tp = TensorParallel::new(mesh.tp().clone());
        let pipeline = match mesh.pp().world_size() {
            1 => None,
            _ => Some(PipelineRuntime::new(
                &mesh,
                parallelism.pp_schedule,
                parallelism.pp_microbatches_per_step(),
                parallelism.pp_stages_per_rank(),
            )?),
        };
        let scaler = match cfg.mixed_precision {
            MixedPrecision::Fp16 => Some(GradScaler::new(GradScalerConfig::default())?),
            _ => None,
        };
        let seed = cfg.seed;
        // bf16 on the CPU is autocast over f32 tensors (compute_dtype's docs); elsewhere bf16 tensors.
        let autocast = device
            .is_cpu()
            .then(|| accel_nn::ops::autocast::Bf16Guard::new(cfg.mixed_precision == MixedPrecision::Bf16));
        let acc = Accelerator {
            inner: Arc::new(Inner {
                saves: Default::default(),
                _autocast: autocast,
                step: Arc::new(StepController::new(cfg.gradient_accumulation_steps, scaler)),
                config: cfg,
                auto_layout,
                pg,
                parallelism,
                mesh,
                tp,
                pipeline,
                device,
                prepared: Mutex::new(Prepared::default()),
                trackers: Mutex::new(Trackers::default()),
                rng: Mutex::new(ChaCha8Rng::seed_from_u64(0)),
                provenance: Arc::default(),
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

    /// [`Accelerator::rank`] under Accelerate's name (`accelerator.process_index`).
    pub fn process_index(&self) -> usize {
        self.rank()
    }

    /// [`Accelerator::local_rank`] under Accelerate's name (`accelerator.local_process_index`).
    pub fn local_process_index(&self) -> usize {
        self.local_rank()
    }

    /// [`Accelerator::world_size`] under Accelerate's name (`accelerator.num_processes`).
    pub fn num_processes(&self) -> usize {
        self.world_size()
    }

    /// Whether this is rank 0 of the job (the one that prints, logs and writes shared files).
    pub fn is_main_process(&self) -> bool {
        self.rank() == 0
    }

    /// Whether this is local rank 0 on its machine.
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank() == 0
    }

    /// The process group of the whole job, all `world_size` ranks (for level-1 collectives when the user needs
    /// them; the mesh's groups are in [`Accelerator::mesh`]).
    pub fn process_group(&self) -> &ProcessGroup {
        &self.inner.pg
    }

    /// The device mesh: the job's ranks laid out as `[pp, dp_replicate, dp_shard, tp]` (tp innermost) from
    /// [`AcceleratorConfig::parallelism`], with this rank's coordinates and a process group per dimension
    /// (`mesh().tp()`, `mesh().dp()`, ...). Under pure data parallelism: `[1, world_size, 1, 1]`.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.inner.mesh
    }

    /// The parallel sizes this Accelerator runs with: the config's, resolved for the world size (every size 1
    /// becomes dp_replicate = world size, as Accelerate).
    pub fn parallelism_config(&self) -> &ParallelismConfig {
        &self.inner.parallelism
    }

    /// Tensor parallelism over the mesh's tp group (a one-rank group when tp_size is 1): build tensor-parallel
    /// layers with it, or through [`Accelerator::param_builder`].
    pub fn tensor_parallel(&self) -> &TensorParallel {
        &self.inner.tp
    }

    /// This rank's index among the data-parallel ranks (`mesh().dp()`): what data loaders shard by.
    pub fn data_parallel_rank(&self) -> usize {
        self.inner.mesh.dp().rank()
    }

    /// The number of data-parallel ranks (dp_replicate × dp_shard): `world_size / (tp × pp)`.
    pub fn data_parallel_size(&self) -> usize {
        self.inner.mesh.dp().world_size()
    }

    /// What the automatic layout measured and chose (`Display`: the printed explanation), when a size of the
    /// config was `auto`; `None` otherwise. The program reads its batch from it: [`crate::auto_layout::Layout::
    /// per_process_batch`] rows per training step (micro-batches of [`crate::auto_layout::Layout::
    /// micro_batch_size`]); the sizes, sharding, schedule, accumulation and checkpointing are already the config's.
    pub fn auto_layout(&self) -> Option<&crate::auto_layout::AutoLayoutDecision> {
        self.inner.auto_layout.as_ref()
    }

    /// `request` completed with this Accelerator's settings (the sizes its config fixes, its precision and
    /// device, checkpointing when on): what its automatic layout chose for, and what [`Self::predict_layout`]
    /// costs.
    pub fn completed_auto_layout_request(
        &self,
        request: &crate::auto_layout::AutoLayoutRequest,
    ) -> crate::auto_layout::AutoLayoutRequest {
        completed_auto_layout_request(&self.inner.config, &self.inner.device, request)
    }

    /// The cost model's prediction (memory per rank, time per optimizer step) for the layout this Accelerator runs,
    /// with micro-batches of `micro_batch_size` sequences, on the machines as a start-up probe measures them now.
    /// Collective over the job (the probe). `accel_gpt --predict` prints it beside what it measures.
    pub fn predict_layout(
        &self,
        request: &crate::auto_layout::AutoLayoutRequest,
        micro_batch_size: usize,
    ) -> Result<(crate::auto_layout::ClusterProbe, crate::auto_layout::Candidate)> {
        let cfg = &self.inner.config;
        let layout = crate::auto_layout::Layout::of_config(
            &self.inner.parallelism,
            cfg.gradient_accumulation_steps,
            micro_batch_size,
            cfg.activation_checkpointing,
        );
        crate::auto_layout::predict(
            &self.inner.pg,
            &self.inner.device,
            &self.completed_auto_layout_request(request),
            &layout,
        )
    }

    /// The configuration this Accelerator runs with (the automatic layout's settings in it when it chose them).
    pub fn config(&self) -> &AcceleratorConfig {
        &self.inner.config
    }

    /// The compute precision.
    pub fn mixed_precision(&self) -> MixedPrecision {
        self.inner.config.mixed_precision
    }

    /// The dtype model `Var`s and activations use: F32, F16 or BF16 — except bf16 on the CPU, which is F32.
    ///
    /// bf16 on the CPU runs as PyTorch's `torch.autocast("cpu", dtype=torch.bfloat16)` (and Accelerate's
    /// `mixed_precision="bf16"` on a CPU, which uses it): parameters, activations and gradients are f32 tensors,
    /// and the linear layers of [`crate::ops::linear`] multiply bf16-rounded operands into bf16-rounded results
    /// ([`crate::ops::autocast`], switched on for the thread that creates the Accelerator, until it is dropped).
    /// candle's CPU kernels for bf16 tensors cost several times their f32 ones (`docs/benchmarks.md`, "bf16 on
    /// the CPU"); on CUDA, bf16 keeps bf16 tensors with fp32 master weights.
    pub fn compute_dtype(&self) -> DType {
        match self.inner.config.mixed_precision {
            MixedPrecision::Bf16 if self.inner.device.is_cpu() => DType::F32,
            mp => mp.compute_dtype(),
        }
    }

    /// Micro-batches per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.inner.config.gradient_accumulation_steps
    }

    /// A candle `VarBuilder` over `varmap` that creates parameters in the compute dtype on the Accelerator's
    /// device, each drawn from the config's seed (0 without one) per name with the distribution candle asks for
    /// ([`crate::nn::seeded_var_builder`]: candle's own initialisers cannot be seeded), so a model written the
    /// candle way starts from the same weights in every run. Build the model with it, then call
    /// [`Accelerator::prepare_model`]. Such a model trains under DDP, ZeRO-1 and ZeRO-2; for tensor or pipeline
    /// parallelism or FULL_SHARD build it with [`Accelerator::builder`] (the same calls).
    pub fn var_builder(&self, varmap: &VarMap) -> VarBuilder<'static> {
        let seed = self.inner.config.seed.unwrap_or(0);
        let record = self.inner.provenance.clone();
        crate::nn::recorded_var_builder(varmap, seed, self.compute_dtype(), self.device(), record)
    }

    /// An [`crate::nn::VarBuilder`] over `varmap`: candle's builder vocabulary (`pp`, `get`, and `accel::nn`'s
    /// `linear`, `embedding`, `layer_norm`, `rms_norm`, …), every parameter drawn from the config's seed per name
    /// on the full model, each layer split over [`Accelerator::tensor_parallel`] as `plan` says — or as the
    /// config's plan says when it has one (`ParallelismConfig::tp_plan`, a YAML config's
    /// `parallelism_config_tp_plan`), which replaces the model's default. Build the model with it, then call
    /// [`Accelerator::prepare_model`], which checks that every rule of the plan matched a layer and, with
    /// `ACCEL_PRINT_PLAN=1`, prints which parameter got which style (main process).
    pub fn builder(&self, varmap: &VarMap, plan: crate::plan::ParallelPlan) -> crate::nn::VarBuilder {
        let plan = self.inner.config.parallelism.tp_plan.clone().unwrap_or(plan);
        let vb = crate::nn::VarBuilder::from_param_builder(self.param_builder(varmap), plan);
        // The builder asks this Accelerator which pipeline stages a staged model's rank holds (a weak handle: a
        // builder kept alive does not keep the Accelerator).
        let accelerator = Arc::downgrade(&self.inner);
        vb.set_stages(Box::new(move |n_blocks, listed| match accelerator.upgrade() {
            Some(inner) => Accelerator { inner }.pipeline_stages(n_blocks, listed),
            None => Err(AccelError::Usage("the Accelerator that made this builder is gone".into())),
        }));
        self.inner.provenance.add_book(vb.book().clone());
        vb
    }

    /// A [`ParamBuilder`] over `varmap` for tensor-parallel models: parameters drawn on the full model from the
    /// config's seed (0 without one), in the compute dtype on the Accelerator's device, each rank keeping its
    /// slice of [`Accelerator::tensor_parallel`]. Build the model with it, then call
    /// [`Accelerator::prepare_model`].
    pub fn param_builder(&self, varmap: &VarMap) -> ParamBuilder {
        let seed = self.inner.config.seed.unwrap_or(0);
        ParamBuilder::new(varmap, &self.inner.tp, seed, self.compute_dtype(), self.device())
    }

    /// Seeds the Accelerator's RNG ([`Accelerator::rng`]) and the device RNG (CUDA; candle's CPU RNG cannot be
    /// seeded) with `seed`, or `seed + rank` when `device_specific` (different dropout masks per rank).
    pub fn set_seed(&self, seed: u64, device_specific: bool) {
        let seed = if device_specific { seed.wrapping_add(self.rank() as u64) } else { seed };
        *lock(&self.inner.rng) = ChaCha8Rng::seed_from_u64(seed);
        if !self.device().is_cpu() {
            if let Err(e) = self.device().set_seed(seed) {
                tracing::warn!("could not seed the device RNG: {e}");
            }
        }
    }

    /// The Accelerator's RNG (ChaCha8, seeded by [`Accelerator::set_seed`], checkpointed per rank): use it for
    /// anything random in the training loop that must resume exactly (dropout masks, augmentation).
    pub fn rng(&self) -> MutexGuard<'_, ChaCha8Rng> {
        lock(&self.inner.rng)
    }
}

// ==== Prepare =========================================================================================================
impl Accelerator {
    /// Prepares a model's parameters (all `Var`s of `varmap`, sorted by name): wraps them in DDP (names and
    /// shapes checked across ranks, rank 0's values broadcast) and, under bf16/fp16, keeps fp32 master copies
    /// that the optimizer updates. Every rank must call it with the same model. Errors: an empty `VarMap`,
    /// parameters not on the Accelerator's device, a parameter already in a prepared model, mismatches across
    /// ranks, and under tensor parallelism a parameter not built by a [`ParamBuilder`] whose values differ across
    /// the tp ranks (named; build it with `ParamBuilder::replicated` or `sharded`).
    pub fn prepare_model(&self, varmap: &VarMap) -> Result<PreparedModel> {
        self.prepare_model_then(varmap, |_| {})
    }

    /// [`Accelerator::prepare_model`], `adjust` seeing the model before it is registered (tests wrap its
    /// strategies there).
    pub(crate) fn prepare_model_then(
        &self,
        varmap: &VarMap,
        adjust: impl FnOnce(&mut PreparedModel),
    ) -> Result<PreparedModel> {
        let ids: Vec<candle_core::TensorId> = lock(varmap.data()).values().map(|v| v.as_tensor().id()).collect();
        let target = crate::nn::Target {
            tp_size: self.mesh().tp().world_size(),
            pp_size: self.mesh().pp().world_size(),
            full_shard: self.inner.config.parallelism.sharding_strategy == crate::ShardingStrategy::FullShard
                && self.mesh().group(ddp_core::MeshDim::DpShard).world_size() > 1,
        };
        // Which builder made the model first (a candle VarBuilder's model is refused under pp naming the builder to
        // switch to), then whether it was cut into stages.
        let books = self.inner.provenance.check(&ids, &target)?;
        if let Some(p) = &self.inner.pipeline {
            if !p.stages_asked() {
                return Err(AccelError::Usage(format!(
                    "prepare_model: this job has pp_size {} (pipeline parallelism) but the program did not ask \
                     which stages this rank holds: every rank would hold the whole model and the pp ranks would \
                     train copies that never meet. Declare the model's blocks with accel::nn::staged on \
                     accelerator.builder (each rank then builds its stages; examples/src/gpt.rs does), or build \
                     the model per stage from accelerator.pipeline_stages(..) yourself; train with \
                     accelerator.pipeline_backward(..); or set pp_size 1",
                    self.mesh().pp().world_size()
                )));
            }
        }
        crate::nn::Provenance::check_rules(&books, self.mesh().pp())?;
        if let Some(report) = crate::nn::Provenance::report(&books, target.tp_size) {
            // One rank per pipeline stage prints its stages' layers (the first dp and tp rank of each).
            let mesh = self.mesh();
            if mesh.dp().rank() == 0
                && mesh.tp().rank() == 0
                && std::env::var(crate::plan::PRINT_PLAN_ENV).is_ok_and(|v| v != "0" && !v.is_empty())
            {
                let pp = mesh.pp();
                if pp.world_size() > 1 {
                    println!(
                        "pp rank {} of {} — the layers of its pipeline stages (each pp rank prints its own):",
                        pp.rank(),
                        pp.world_size()
                    );
                }
                println!("{}", report.trim_end());
            }
        }
        let num_params = {
            let vars = lock(varmap.data());
            let prepared = lock(&self.inner.prepared);
            for (name, var) in vars.iter() {
                let id = var.as_tensor().id();
                if prepared.models.iter().any(|m| m.parameters().iter().any(|o| o.as_tensor().id() == id)) {
                    return Err(AccelError::Usage(format!(
                        "prepare_model: parameter {name:?} belongs to a model that was already prepared; prepare \
                         each model once and reuse the PreparedModel"
                    )));
                }
            }
            vars.len()
        };
        // The model's gradient slots live with the step owner, under the model's index.
        let index = self.inner.step.register_model(num_params);
        let mut model = PreparedModel::new(
            index,
            self.mesh(),
            self.tensor_parallel(),
            self.device(),
            &self.inner.config.ddp,
            self.inner.config.parallelism.sharding_strategy,
            varmap,
        )?;
        adjust(&mut model);
        // FULL_SHARD took the weights into chunks: the accel::nn layers gather theirs from the prepared model now.
        if model.is_fully_sharded() {
            for book in &books {
                book.gather_from(Arc::new(model.clone()))?;
            }
        }
        lock(&self.inner.prepared).models.push(model.clone());
        Ok(model)
    }

    /// Wraps an optimizer for `model`: it will step on the model's fp32 master weights, only on gradient-sync
    /// steps, with fp16 unscaling and overflow skipping. Its state is saved by `save_state`.
    pub fn prepare_optimizer<O: Optimizer>(&self, model: &PreparedModel, opt: O) -> Result<AcceleratedOptimizer<O>> {
        let opt = Arc::new(Mutex::new(opt));
        lock(&self.inner.prepared).optimizers.push((opt.clone() as Arc<Mutex<dyn Optimizer>>, model.clone()));
        Ok(AcceleratedOptimizer::new(self.inner.step.clone(), model.clone(), opt))
    }

    /// Prepares a data loader for this process: shards it for the data-parallel rank of the data-parallel size
    /// ([`Accelerator::data_parallel_rank`] of [`Accelerator::data_parallel_size`]; the world under pure data
    /// parallelism), so tensor-parallel (and pipeline) peers get the same batches, as they must (accelerate#3092).
    /// Accelerate's rules, with the Accelerator's `split_batches` and `even_batches`. Moves its batches to the
    /// Accelerator's device, and makes it report each batch it yields to the training step (last batch of the
    /// epoch → gradients sync; padding rows → trimmed by `gather_for_metrics`). Its position is saved by
    /// `save_state`.
    ///
    /// Errors: batch size 0, or with `split_batches` a batch size not divisible by the data-parallel size.
    pub fn prepare_data_loader<D: Dataset>(&self, loader: DataLoader<D>) -> Result<DataLoader<D>> {
        let loader = self.shard_loader(loader)?;
        let handle = loader.state_handle().for_accelerator(self.gradient_accumulation_steps(), self.is_main_process());
        lock(&self.inner.prepared).data_loaders.push(handle);
        Ok(loader)
    }

    /// [`Accelerator::prepare_data_loader`] for evaluation: the same sharding, device and batch reports (so
    /// `gather_for_metrics` drops the padding rows), but not saved by `save_state` — an evaluation pass has no
    /// position to resume, and a checkpoint must not depend on how many evaluation loaders a run created.
    pub fn prepare_eval_data_loader<D: Dataset>(&self, loader: DataLoader<D>) -> Result<DataLoader<D>> {
        self.shard_loader(loader)
    }

    /// `prepare_model`, `prepare_optimizer` and `prepare_data_loader` in one call — the usual first lines of an
    /// Accelerate program.
    pub fn prepare<O: Optimizer, D: Dataset>(
        &self,
        varmap: &VarMap,
        opt: O,
        loader: DataLoader<D>,
    ) -> Result<(PreparedModel, AcceleratedOptimizer<O>, DataLoader<D>)> {
        let model = self.prepare_model(varmap)?;
        let opt = self.prepare_optimizer(&model, opt)?;
        let loader = self.prepare_data_loader(loader)?;
        Ok((model, opt, loader))
    }
}

// ==== The training step ===============================================================================================
impl Accelerator {
    /// Backward pass of one micro-batch: divides `loss` by the gradient accumulation steps, multiplies it by the
    /// fp16 loss scale, computes gradients, adds them (as fp32) to every prepared model's gradient slots, and on a
    /// sync step reduces (averages) them across ranks.
    ///
    /// `loss` is a scalar (any float dtype; compute it in F32 under fp16 so scaling cannot overflow the loss
    /// itself). Call it once per micro-batch. Errors: no prepared model, parameters without a gradient (unless
    /// `DdpOptions::find_unused_parameters`), collective failures.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        self.refuse_under_pipeline("backward")?;
        let models = self.require_models("backward")?;
        self.inner.step.backward(&models, loss)
    }

    /// [`Accelerator::backward`] with the gradient all-reduce overlapped with the backward pass: `segments` are
    /// the cuts recorded while computing `loss` — `let (loss, segments) = accel::segments::record(|| ...)?`
    /// around the forward pass, with the model calling [`crate::segments::cut`] between its layers. The backward
    /// pass runs segment by segment and, on a sync step, each bucket is all-reduced as soon as its gradients
    /// are final (ddp-core's `DistributedDataParallel::backward`; the first sync step plans the buckets and
    /// reduces after its backward pass). Gradients, loss scaling, accumulation and clipping are exactly
    /// `backward`'s. Overlap needs one prepared model without `find_unused_parameters`; otherwise the segments
    /// run one after the other and the reduction follows, as in `backward`.
    ///
    /// Errors: those of `backward`; a cut the loss does not depend on; ranks whose cuts differ; a parameter
    /// whose gradient arrives after its bucket went out (the model changed where it uses the parameter).
    pub fn backward_segments(&self, loss: &Tensor, segments: crate::segments::BackwardSegments) -> Result<()> {
        self.refuse_under_pipeline("backward_segments")?;
        let models = self.require_models("backward_segments")?;
        self.inner.step.backward_segments(&models, loss, segments)
    }

    /// The stages of a model of `n_layers` blocks this rank holds: without pipeline parallelism one stage with
    /// every block; with pp > 1 the stages `r, r + pp, …` of the `pp × virtual stages` the schedule runs (one per
    /// rank except for interleaved 1F1B), the blocks spread evenly (the remainder to the middle stages first) or
    /// as `layers_per_stage` lists them (torchtitan's `pipeline_parallel_layers_per_stage`; 0 allowed; `None`
    /// under an automatic layout that split the blocks unevenly: its split). Build
    /// only these stages' parameters, with [`Accelerator::param_builder`] (the single-process names, so every
    /// layout starts from the same weights and saves the same `model.safetensors`).
    ///
    /// Errors ([`AccelError::Config`]): more stages than blocks, a list whose length or sum does not fit.
    pub fn pipeline_stages(&self, n_layers: usize, layers_per_stage: Option<&[usize]>) -> Result<Vec<Stage>> {
        // The automatic layout's split (fewer blocks where memory is smaller) when the program gives none.
        let chosen = self.auto_layout().and_then(|d| d.layout().layers_per_stage.clone());
        let layers_per_stage = layers_per_stage.or(chosen.as_deref());
        match &self.inner.pipeline {
            Some(p) => p.stages(n_layers, layers_per_stage),
            None => {
                let ranges = crate::pipeline::split_layers(n_layers, 1, layers_per_stage)?;
                Ok(vec![Stage { index: 0, num_stages: 1, layers: ranges[0].clone() }])
            }
        }
    }

    /// Forward and backward of one batch through the model's stages — the training step's `model.forward`,
    /// loss and [`Accelerator::backward`] in one call, at any pp size, so the same loop trains every layout.
    ///
    /// - `inputs`, `targets`: the batch (every rank of a pp group reads the same one: the data loader shards by
    ///   the data-parallel rank). `loss_fn(output of the last stage, targets)` returns the *mean* loss of its
    ///   rows, a scalar (compute it in f32 under fp16).
    /// - Without pipeline parallelism: the forward of the one stage, the loss, and
    ///   [`Accelerator::backward_segments`] (the dp all-reduce overlapped with the backward at the model's cuts).
    /// - With pp > 1: the batch is split along dim 0 into `pipeline_parallel_microbatches` micro-batches and run
    ///   through the configured schedule (GPipe, 1F1B or interleaved 1F1B; see [`crate::pipeline`]); each
    ///   micro-batch's loss is divided by the micro-batch count, the accumulation steps and multiplied by the fp16
    ///   scale before its backward, so the step's gradients are those of the batch's mean loss, never rescaled
    ///   after; they join the accumulation window like `backward`'s, and DDP's all-reduce over dp runs once, on the
    ///   sync step, after the last micro-batch's backward.
    ///
    /// Returns the batch's mean loss (a scalar f32 on the Accelerator's device, the same on every rank of a pp
    /// group). One pipeline step counts as one micro-step of the accumulation window.
    ///
    /// Errors: no prepared model or more than one under pp; a batch whose rows do not split into the
    /// micro-batches (naming both counts); a loss that is not a scalar; a stage that died or stalls (naming the
    /// stage, the micro-batch, the op and the peer's pp rank, within the collective timeout); `backward`'s.
    pub fn pipeline_backward(
        &self,
        model: &dyn StagedModel,
        inputs: &Tensor,
        targets: &Tensor,
        loss_fn: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.pipeline_step(model, inputs, targets, &loss_fn, Combine::Mean)
    }

    /// [`Accelerator::pipeline_backward`] for a loss normalised by its caller (the Trainer's sum over the items
    /// divided by the global item count): `loss_fn` returns each micro-batch's *share* of the batch's loss, the
    /// shares are summed (not averaged) for the backward, and the call returns their sum. Everything else is
    /// `pipeline_backward`'s.
    pub fn pipeline_backward_sum(
        &self,
        model: &dyn StagedModel,
        inputs: &Tensor,
        targets: &Tensor,
        loss_fn: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.pipeline_step(model, inputs, targets, &loss_fn, Combine::Sum)
    }

    /// The forward of one batch through the model's stages and `loss_fn` of the last stage's output, with no
    /// backward (evaluation): returns `loss_fn`'s value, the same on every rank of a pp group. The batch runs as
    /// one micro-batch, so any batch size works. Without pipeline parallelism: the forward and the loss.
    ///
    /// Errors: a stage that died or stalls (named as in `pipeline_backward`); `loss_fn`'s.
    pub fn pipeline_forward(
        &self,
        model: &dyn StagedModel,
        inputs: &Tensor,
        targets: &Tensor,
        loss_fn: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let value = match &self.inner.pipeline {
            None => return Ok(loss_fn(&model.stage_forward(0, inputs)?, targets)?.detach()),
            Some(p) => p.forward(model, inputs, targets, &loss_fn)?,
        };
        Ok(Tensor::new(value as f32, self.device())?)
    }

    fn pipeline_step(
        &self,
        model: &dyn StagedModel,
        inputs: &Tensor,
        targets: &Tensor,
        loss_fn: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
        combine: Combine,
    ) -> Result<Tensor> {
        let dropout = self.dropout_context(inputs.dims().first().copied().unwrap_or(0));
        let Some(pipeline) = &self.inner.pipeline else {
            let checkpointing = self.inner.config.activation_checkpointing;
            let (loss, cuts) = crate::segments::record(|| -> Result<Tensor> {
                let output = crate::activation_checkpoint::with_activation_checkpointing(checkpointing, || {
                    with_dropout_context(dropout, || model.stage_forward(0, inputs))
                })?;
                loss_fn(&output, targets)
            })?;
            let models = self.require_models("pipeline_backward")?;
            self.inner.step.backward_segments(&models, &loss, cuts)?;
            return Ok(loss.to_dtype(DType::F32)?.detach());
        };
        let model_handle = match &self.require_models("pipeline_backward")?[..] {
            [m] => m.clone(),
            many => {
                return Err(AccelError::Usage(format!(
                    "pipeline_backward: {} prepared models; a pipeline runs one model cut into stages: prepare one",
                    many.len()
                )))
            }
        };
        let (sync, factor) = self.inner.step.begin_pipeline_step();
        // The stages' forwards are recorded (their checkpointed blocks recomputed in the backward) under activation
        // checkpointing, and under FULL_SHARD, whose units must not keep their gathered weights.
        let checkpointing = self.inner.config.activation_checkpointing || model_handle.is_fully_sharded();
        let (grads, value) = crate::activation_checkpoint::with_activation_checkpointing(checkpointing, || {
            pipeline.step(model, model_handle.parameters().to_vec(), inputs, targets, loss_fn, factor, combine, dropout)
        })?;
        self.inner.step.add_pipeline_gradients(&model_handle, grads, sync)?;
        Ok(Tensor::new(value as f32, self.device())?)
    }

    /// Where the next micro-step's forward sits in the single-process run, for
    /// [`crate::tensor_parallel::dropout`]: the run's seed, the micro-step (backward calls so far, restored on
    /// resume) and this data-parallel replica's first row in the micro-step's global batch (`dp rank × rows`, with
    /// `rows` the replica's batch rows: replicas hold consecutive shares of the global batch). `pipeline_backward`
    /// and the Trainer set it around their forward passes; a loop calling `backward` itself wraps its training
    /// forward in `accel::tensor_parallel::with_dropout_context(accelerator.dropout_context(rows), || …)`, or its
    /// dropout stays off.
    pub fn dropout_context(&self, rows: usize) -> DropoutContext {
        DropoutContext {
            seed: self.inner.config.seed.unwrap_or(0),
            step: self.inner.step.counters().total_micro_steps,
            row_offset: (self.data_parallel_rank() * rows) as u64,
        }
    }

    /// The pipeline schedule this job runs (`None` without pipeline parallelism): each pp rank's actions, to
    /// print ([`crate::pipeline::PipelineSchedule::to_csv`]) or simulate.
    pub fn pipeline_schedule(&self) -> Option<&crate::pipeline::PipelineSchedule> {
        self.inner.pipeline.as_ref().map(PipelineRuntime::schedule)
    }

    /// This rank's measured time in the pipeline's training steps so far (`None` without pipeline
    /// parallelism): [`crate::pipeline::PipelineTiming::bubble`] is the measured bubble, to set beside the
    /// schedule's `(p − 1)/(m + p − 1)`.
    pub fn pipeline_timing(&self) -> Option<crate::pipeline::PipelineTiming> {
        self.inner.pipeline.as_ref().map(PipelineRuntime::timing)
    }

    /// Runs one micro-step (forward + `backward`) in `f`, Accelerate's `with accelerator.accumulate(model)`:
    /// advances the accumulation window on entry, so [`Accelerator::sync_gradients`] tells inside `f` whether this
    /// micro-step will sync. `backward` advances the window itself when called outside `accumulate`, so using it
    /// is optional. `f`'s error type is yours (anything an [`AccelError`] converts into). Errors: nested calls.
    pub fn accumulate<R, E: From<AccelError>>(
        &self,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        self.inner.step.accumulate(f)
    }

    /// Runs a whole accumulation window of `micro_batches` micro-steps whose end the caller decides — for loops
    /// that cut windows themselves (the Trainer collects a window's batches first to count its loss items, as
    /// HF's Trainer does; a pipeline schedule drives its micro-batches). `f(i)` runs micro-step `i` (forward +
    /// `backward`); gradients sync after the last one, whatever the counting rule or the loader's end-of-data
    /// would say. `micro_batches` may be smaller than `gradient_accumulation_steps` (the end of an epoch).
    /// Errors: `micro_batches == 0`, nesting inside `accumulate`, and `f`'s errors (any type an [`AccelError`]
    /// converts into).
    pub fn accumulate_window<E: From<AccelError>>(
        &self,
        micro_batches: usize,
        f: impl FnMut(usize) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        self.inner.step.accumulate_window(micro_batches, f)
    }

    /// Runs `f` with gradient sync turned off (like DDP's `no_sync()`): gradients of `backward` calls inside are
    /// accumulated locally; the first syncing `backward` after it all-reduces the accumulated sum. The optimizer
    /// does not step on gradients that were not synced.
    pub fn no_sync<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        self.inner.step.no_sync(f)
    }

    /// Whether the current micro-step syncs gradients (and the optimizer will step): true on the last micro-step
    /// of an accumulation window and on the last batch of a prepared data loader, false inside `no_sync`.
    /// Inside [`Accelerator::accumulate`] it is known before `backward`; outside, it is updated by `backward`.
    pub fn sync_gradients(&self) -> bool {
        self.inner.step.sync_gradients()
    }

    /// Clips the synced gradients of all prepared models so their global L2 norm is at most `max_norm`
    /// (`torch.nn.utils.clip_grad_norm_`: coefficient `max_norm / (norm + 1e-6)` when below 1). Under fp16 the
    /// gradients are unscaled first (once per optimizer step). Returns the total norm before clipping (inf or
    /// NaN when an fp16 step overflowed — that step will be skipped and nothing is clipped). Under tensor
    /// parallelism every parameter counts once: the squares of tp shards are summed over the tp group
    /// (collective), replicated parameters are not counted once per tp rank (Megatron-LM's
    /// `param_is_not_tensor_parallel_duplicate`); the norm is the single-process model's.
    ///
    /// Outside a sync step (inside an accumulation window, or in `no_sync`) it does nothing and returns `None`:
    /// call it after the `backward` that syncs, as Accelerate's examples do under `if accelerator.sync_gradients`.
    /// Errors: no prepared model.
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<Option<f64>> {
        let models = self.require_models("clip_grad_norm")?;
        if max_norm.is_nan() || max_norm < 0.0 {
            return Err(AccelError::InvalidArgument(format!("clip_grad_norm: max_norm must be ≥ 0, got {max_norm}")));
        }
        self.inner.step.clip_grad_norm(&models, max_norm)
    }

    /// Clamps every synced gradient element into `[-clip_value, clip_value]` (`torch.nn.utils.clip_grad_value_`),
    /// after unscaling under fp16. Returns whether it clipped: `false` outside a sync step, where it does nothing
    /// (see [`Accelerator::clip_grad_norm`]). Errors: a negative or NaN `clip_value`, no prepared model.
    pub fn clip_grad_value(&self, clip_value: f64) -> Result<bool> {
        if clip_value.is_nan() || clip_value < 0.0 {
            return Err(AccelError::InvalidArgument(format!(
                "clip_grad_value: clip_value must be ≥ 0, got {clip_value}"
            )));
        }
        let models = self.require_models("clip_grad_value")?;
        self.inner.step.clip_grad_value(&models, clip_value)
    }

    /// `model`'s current fp32 gradients (one slot per parameter, [`PreparedModel::names`] order; `None` where no
    /// micro-batch produced one yet) and whether they have been reduced across ranks (the optimizer step will
    /// apply them). Under fp16 they stay loss-scaled until clipping or the optimizer step unscales them. Under
    /// sharded data parallelism (`dp_shard_size > 1`) the reduced ones are this rank's 1-D chunks of each
    /// parameter's flattened gradient (ZeRO-1: what its optimizer steps), not whole gradients.
    pub fn gradients(&self, model: &PreparedModel) -> (Vec<Option<Tensor>>, bool) {
        self.inner.step.gradients(model)
    }

    /// Reports a batch handed to the training loop: whether it is the last of its epoch (gradients sync there)
    /// and how many of its rows are `even_batches` padding (`gather_for_metrics` drops them). Prepared data
    /// loaders call it for every batch they yield; call it yourself only for a loader you did not prepare.
    pub fn note_batch(&self, info: &BatchInfo) {
        self.inner.step.note_batch(info)
    }

    /// Trailing rows of this rank's current batch that `even_batches` duplicated from the epoch's start (0 but in
    /// the last batch of an epoch), as the prepared loader reported; losses and metrics over an evaluation set
    /// skip them (`gather_for_metrics` does so itself).
    pub fn padding_in_batch(&self) -> usize {
        self.inner.step.padding_in_batch()
    }

    /// Real optimizer steps taken so far (fp16 steps skipped for overflow are not counted); Accelerate's `step`.
    pub fn optimizer_step_count(&self) -> u64 {
        self.inner.step.counters().optimizer_steps
    }

    /// Step counters (what checkpoints save).
    pub fn step_counters(&self) -> StepCounters {
        self.inner.step.counters()
    }

    /// The current fp16 loss scale (PyTorch's `GradScaler.get_scale()`), `None` unless mixed precision is fp16.
    pub fn loss_scale(&self) -> Option<f64> {
        self.inner.step.scaler().map(|s| lock(s).scale())
    }

    /// The fp16 loss scaler itself (Accelerate's `accelerator.scaler`), `None` unless mixed precision is fp16:
    /// to replace it with another configuration or to inspect its state. Read the scale with
    /// [`Accelerator::loss_scale`].
    pub fn grad_scaler(&self) -> Option<Arc<Mutex<GradScaler>>> {
        self.inner.step.scaler().cloned()
    }
}

// ==== Collectives =====================================================================================================
// `gather`, `gather_for_metrics`, `reduce` and `pad_across_processes` work over the data-parallel group
// (`mesh().dp()`): the ranks that saw different data. Tensor-parallel (and pipeline) peers saw the same batch and
// hold the same per-sample results, so gathering over the world would repeat every row tp × pp times. Under pure
// data parallelism the dp group is the world and nothing changes. Every rank still calls them (each dp group runs
// its own collective). `broadcast` stays over the world (its root is a global rank).
impl Accelerator {
    /// Concatenates every data-parallel rank's `t` along dim 0, in dp-rank order (`[n_r, ..] → [Σ n_r, ..]`; a
    /// scalar counts as `[1]`). Ranks may hold different numbers of rows; the other dims and the dtype must agree.
    /// Collective over the dp group (`mesh().dp()`, the world under pure data parallelism): tp peers, which saw
    /// the same batch, are not repeated.
    pub fn gather(&self, t: &Tensor) -> Result<Tensor> {
        collectives::gather(self.inner.mesh.dp(), t, 0)
    }

    /// Like [`Accelerator::gather`] for evaluation: drops the rows that `even_batches` duplicated to fill the last
    /// batch (as reported by the prepared data loader), so over an epoch exactly `len(dataset)` rows come back.
    /// Over the dp group, like `gather`.
    pub fn gather_for_metrics(&self, t: &Tensor) -> Result<Tensor> {
        collectives::gather(self.inner.mesh.dp(), t, self.inner.step.padding_in_batch())
    }

    /// Reduces `t` element-wise over the data-parallel ranks (`mesh().dp()`, the world under pure data
    /// parallelism); every rank gets the result (same shape and dtype). Collective.
    pub fn reduce(&self, t: &Tensor, op: ReduceKind) -> Result<Tensor> {
        collectives::reduce(self.inner.mesh.dp(), t, op)
    }

    /// Pads `t` along `dim` with `pad_value` to the largest size any data-parallel rank has there (at the end,
    /// or at the start with `pad_first`), so tensors of different lengths can be gathered. Every rank must pass
    /// the same rank of tensor. Collective over the dp group, like `gather`.
    pub fn pad_across_processes(&self, t: &Tensor, dim: usize, pad_value: f64, pad_first: bool) -> Result<Tensor> {
        collectives::pad_across_processes(self.inner.mesh.dp(), t, dim, pad_value, pad_first)
    }

    /// Every rank of the job gets `root`'s `t` (all ranks pass tensors of the same shape and dtype; `root` is a
    /// global rank). Collective over the world.
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        collectives::broadcast(&self.inner.pg, t, root)
    }
}

// ==== Process control =================================================================================================
impl Accelerator {
    /// Prints `msg` (and a newline) on the main process only.
    pub fn print(&self, msg: impl std::fmt::Display) {
        if self.is_main_process() {
            println!("{msg}");
        }
    }

    /// What this run is — config file, processes × machines, layout, mixed precision, gradient accumulation,
    /// backend — as [`Self::print_banner`] prints it. The config file is the one `accel launch` read (none when
    /// the program was started on its own: its settings come from defaults, its flags and `ACCELERATE_*`
    /// variables).
    pub fn run_banner(&self) -> ddp_core::launcher::RunBanner {
        let machines = ddp_core::env::DistEnv::detect_from_env()
            .ok()
            .flatten()
            .map_or(1, |e| e.world_size / e.local_world_size.max(1));
        let shape = self.mesh().shape();
        let resolved = crate::ParallelismConfig {
            dp_replicate_size: shape.dp_replicate,
            dp_shard_size: shape.dp_shard,
            tp_size: shape.tp,
            pp_size: shape.pp,
            ..self.inner.parallelism.clone()
        };
        crate::banner::run_banner(
            ddp_core::launcher::RunBanner::config_from_env(),
            self.world_size(),
            machines,
            &resolved,
            self.mixed_precision(),
            self.gradient_accumulation_steps(),
            self.inner.pg.backend_name(),
        )
    }

    /// Prints the [run banner](Self::run_banner) once, on the main process, as `{program}: config … | …`: before
    /// the first step, so a run says what it is. Under `accel launch`, which printed its own banner, only when
    /// the program changed a setting the launcher announced (its flags or code override the launch's).
    pub fn print_banner(&self, program: &str) {
        if let Some(line) = self.run_banner().worker_line(program) {
            self.print(line);
        }
    }

    /// Returns when every process has reached this point (a barrier).
    pub fn wait_for_everyone(&self) -> Result<()> {
        if self.world_size() > 1 {
            self.inner.pg.barrier()?;
        }
        Ok(())
    }

    /// Runs `f` on the main process first, then on the others (e.g. download or preprocess a data set once). The
    /// main process releases the others even when its `f` fails, and returns its error.
    pub fn main_process_first<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        if self.is_main_process() {
            let r = f();
            self.wait_for_everyone()?;
            r
        } else {
            self.wait_for_everyone()?;
            f()
        }
    }

    /// This rank's contiguous share of `items` (Accelerate's `split_between_processes`): sizes differ by at most
    /// one, the first `len % world_size` ranks get one more; concatenating the shares in rank order gives `items`.
    pub fn split_between_processes<T: Clone>(&self, items: &[T]) -> Vec<T> {
        let (start, end) = collectives::split_range(items.len(), self.rank(), self.world_size());
        items[start..end].to_vec()
    }
}

// ==== State (checkpoints) =============================================================================================
impl Accelerator {
    /// Adds `obj` to what [`Accelerator::save_state`] saves (as `custom_checkpoint_{i}.json` /
    /// `.safetensors`, `i` = registration order) and [`Accelerator::load_state`] restores. Register the same
    /// objects in the same order before loading.
    pub fn register_for_checkpointing(&self, obj: SharedStateful) {
        lock(&self.inner.prepared).custom.push(obj);
    }

    /// Adds a learning-rate scheduler to the checkpoint (`scheduler.json`, then `scheduler_1.json`, …), like a
    /// scheduler passed to Accelerate's `prepare`. A `Box<dyn LrScheduler>` works: wrap it as
    /// `Arc::new(Mutex::new(sched))` and pass a clone.
    pub fn register_scheduler(&self, sched: SharedStateful) {
        lock(&self.inner.prepared).schedulers.push(sched);
    }

    /// Saves the training state into `dir`, or with `None` into `project_dir/checkpoints/checkpoint_{i}` (needs
    /// `automatic_checkpoint_naming` and `project_dir`; the oldest automatic checkpoints beyond `total_limit` are
    /// then deleted). Collective: every rank must call it. Returns the checkpoint directory.
    ///
    /// Written: fp32 master weights (`model.safetensors`, names = `VarMap` names, readable by Python's
    /// `safetensors`), optimizer state, fp16 scaler, schedulers, data-loader positions, registered objects,
    /// step counters (`accelerator.json`, all by rank 0), each rank's RNG state (`random_states_{rank}.json`) and,
    /// when saved inside an accumulation window, each rank's partial gradients (`gradients_{rank}.json` /
    /// `.safetensors`), so the resumed window ends exactly as the uninterrupted one. The directory appears under its final name only when complete (written as `.{name}.partial`, then
    /// renamed); an existing directory of that name is replaced.
    ///
    /// Differs from Accelerate on purpose: an explicit `dir` is honoured even with automatic naming on.
    ///
    /// Errors: I/O, a registered object failing to produce its state, another rank failing (the temporary
    /// directory is removed and any previous checkpoint is left intact).
    ///
    /// Under `AcceleratorConfig::async_checkpointing` (torchtitan's asynchronous checkpointing) it returns once
    /// everything the checkpoint holds is copied in memory — the models' fp32 weights and the optimizers' state on
    /// rank 0 (about 12 bytes per parameter with AdamW, on top of the training state), each rank's RNG and partial
    /// gradients — and a writer thread writes, agrees and renames while training goes on; the returned path is the
    /// one the checkpoint will have. The next save, [`Accelerator::load_state`],
    /// [`Accelerator::wait_for_checkpoint`] and the Accelerator's end wait for it; its error is returned by the
    /// first of them. A crash while it writes leaves the previous checkpoint the newest complete one.
    pub fn save_state(&self, dir: Option<&Path>) -> Result<PathBuf> {
        checkpointing::save_state(self, dir, None)
    }

    /// [`Accelerator::save_state`], then `on_committed(dir)` on the main process once the checkpoint is committed
    /// (on the writer thread under async checkpointing): for files that must join the checkpoint only when it is
    /// complete — the Trainer's checksums and its state file, written last.
    pub fn save_state_then(
        &self,
        dir: Option<&Path>,
        on_committed: impl FnOnce(&Path) -> Result<()> + Send + 'static,
    ) -> Result<PathBuf> {
        checkpointing::save_state(self, dir, Some(Box::new(on_committed)))
    }

    /// Waits for a checkpoint being written in the background (`async_checkpointing`) and returns its directory,
    /// `None` when none is in flight. Errors: the save's, naming the checkpoint (not committed). Collective in
    /// effect: every rank's writer agrees with the others before it ends.
    pub fn wait_for_checkpoint(&self) -> Result<Option<PathBuf>> {
        checkpointing::wait_for_save(self)
    }

    /// Restores the state saved by [`Accelerator::save_state`] from `dir`, or with `None` from the newest
    /// `project_dir/checkpoints/checkpoint_{i}`. Prepare the same models, optimizers and data loaders and register
    /// the same objects, in the same order, before calling it. Returns the directory loaded.
    ///
    /// Afterwards the step counters, the RNG and the data-loader positions continue where the checkpoint was
    /// taken: the next iteration of a prepared loader skips the batches already consumed in that epoch.
    ///
    /// Errors (all naming the checkpoint and the fix): no checkpoint found, missing files, a tensor missing or of
    /// another shape (named), a different world size, different numbers of prepared objects.
    pub fn load_state(&self, dir: Option<&Path>) -> Result<PathBuf> {
        let (dir, counters, gradients) = checkpointing::load_state(self, dir)?;
        self.inner.step.restore(counters);
        if let Some(sd) = gradients {
            let models = lock(&self.inner.prepared).models.clone();
            self.inner.step.load_gradients_state_dict(&models, &sd).map_err(|e| AccelError::Checkpoint {
                path: dir.join(format!("gradients_{}.safetensors", self.rank())),
                reason: format!("restoring the partial gradients: {e}"),
            })?;
        }
        tracing::info!("loaded checkpoint {} (optimizer step {})", dir.display(), counters.optimizer_steps);
        Ok(dir)
    }
}

// ==== Tracking ========================================================================================================
impl Accelerator {
    /// Starts the trackers of `kinds`, writing into `logging_dir/project/` (created when missing).
    ///
    /// Only the main process creates files; on other ranks this records nothing and [`Accelerator::log`] is a
    /// no-op, so training code calls it unconditionally. Calling it again finishes the previous trackers first.
    /// Errors: `project` empty or containing a path separator, directory or file creation failures (naming the
    /// path).
    pub fn init_trackers(&self, project: &str, kinds: &[TrackerKind], logging_dir: &Path) -> Result<()> {
        lock(&self.inner.trackers).init(self.is_main_process(), project, kinds, logging_dir)
    }

    /// Logs scalar `values` at `step` to every tracker (main process only; elsewhere, and before
    /// `init_trackers`, a no-op). `step` is usually [`Accelerator::optimizer_step_count`] or the trainer's global
    /// step. Errors name the file that could not be written.
    pub fn log(&self, values: &[(&str, f64)], step: u64) -> Result<()> {
        lock(&self.inner.trackers).log(values, step)
    }

    /// Flushes and closes every tracker (Accelerate's `end_training`). Safe to call more than once.
    pub fn end_training(&self) -> Result<()> {
        lock(&self.inner.trackers).finish()
    }

    /// The directory the trackers write into (`logging_dir/project`), when `init_trackers` ran on this process.
    pub fn tracker_dir(&self) -> Option<PathBuf> {
        lock(&self.inner.trackers).dir().map(Path::to_path_buf)
    }
}

// ==== Crate-internal ==================================================================================================
impl Accelerator {
    /// A snapshot of the prepared and registered objects (what checkpoints save and restore).
    pub(crate) fn prepared(&self) -> Prepared {
        lock(&self.inner.prepared).snapshot()
    }

    /// This rank's gradients between optimizer steps, for a checkpoint (see `StepController`).
    pub(crate) fn gradients_state_dict(&self) -> Option<crate::state::StateDict> {
        let models = lock(&self.inner.prepared).models.clone();
        self.inner.step.gradients_state_dict(&models)
    }

    /// `project_dir/checkpoints`, where automatically named checkpoints go; `None` without a `project_dir`.
    pub(crate) fn checkpoints_dir(&self) -> Option<PathBuf> {
        self.config().project_dir.as_ref().map(|p| p.join(crate::state::CHECKPOINTS_SUBDIR))
    }

    /// `loader` sharded for this rank with the config's batch rules, on this device, reporting its batches here.
    fn shard_loader<D: Dataset>(&self, loader: DataLoader<D>) -> Result<DataLoader<D>> {
        let acc = Arc::downgrade(&self.inner);
        let cfg = self.config();
        loader
            .with_split_batches(cfg.split_batches)
            .with_even_batches(cfg.even_batches)
            .with_device(self.device().clone())
            .with_batch_observer(Arc::new(move |b: &BatchInfo| {
                // A loader outliving its Accelerator reports to no one.
                if let Some(inner) = acc.upgrade() {
                    inner.step.note_batch(b);
                }
            }))
            .with_sharding(self.data_parallel_rank(), self.data_parallel_size())
    }

    /// The prepared models; errors unless `prepare_model` was called (backward, clipping).
    /// `backward` and `backward_segments` take a whole model's loss, which no rank has under pp.
    fn refuse_under_pipeline(&self, what: &str) -> Result<()> {
        match &self.inner.pipeline {
            Some(_) => Err(AccelError::Usage(format!(
                "{what}: this job has pp_size {} (pipeline parallelism): each rank holds only its stages, so there is \
                 no whole-model loss to call {what} on; train with accelerator.pipeline_backward(..), which runs \
                 the stages' micro-batches through the schedule (it works at pp_size 1 too), or set pp_size 1",
                self.mesh().pp().world_size()
            ))),
            None => Ok(()),
        }
    }

    fn require_models(&self, what: &str) -> Result<Vec<PreparedModel>> {
        let models = lock(&self.inner.prepared).models.clone();
        if models.is_empty() {
            return Err(AccelError::Usage(format!(
                "{what} needs a prepared model: call accelerator.prepare_model(&varmap) first"
            )));
        }
        Ok(models)
    }
}

/// Whether the detected job layout needs a process group of its own (more than one process).
fn joins_a_job(layout: Option<&ddp_core::DistEnv>) -> bool {
    layout.is_some_and(|env| env.world_size > 1)
}

/// When a parallel size is `auto`: probes the machines, chooses the layout for the program's request, prints the
/// decision on rank 0, and returns the config with the chosen settings (collective over `pg`). Otherwise `cfg`
/// as it is.
fn choose_auto_layout(
    cfg: AcceleratorConfig,
    pg: &ProcessGroup,
    device: &Device,
) -> Result<(AcceleratorConfig, Option<crate::auto_layout::AutoLayoutDecision>)> {
    if !cfg.parallelism.is_auto() {
        return Ok((cfg, None));
    }
    let Some(request) = &cfg.auto_layout else {
        return Err(AccelError::Config {
            key: "parallelism_config".into(),
            value: cfg.parallelism.to_string(),
            reason: "some sizes are `auto`, and the program did not describe its model for the automatic layout: \
                     set AcceleratorConfig::auto_layout (an accel::auto_layout::AutoLayoutRequest: the model's \
                     shape and the global batch), or set every size"
                .into(),
        });
    };
    if cfg.gradient_accumulation_steps != 1 {
        // Silently replacing it would change the global batch the user asked for.
        return Err(AccelError::Config {
            key: "gradient_accumulation_steps".into(),
            value: cfg.gradient_accumulation_steps.to_string(),
            reason: "an automatic layout chooses the accumulation steps itself, from the global batch the program \
                     gives (its AutoLayoutRequest): leave them at 1 (drop --gradient-accumulation-steps or \
                     ACCELERATE_GRADIENT_ACCUMULATION_STEPS) and give the global batch instead, or give the sizes"
                .into(),
        });
    }
    let request = completed_auto_layout_request(&cfg, device, request);
    let decision = crate::auto_layout::decide(pg, device, &request)?;
    if pg.rank() == 0 {
        println!("{decision}");
    }
    // The chosen sizes, sharding, schedule and micro-batches (the config's cp settings kept), accumulation steps
    // and checkpointing.
    let layout = decision.layout();
    let mut out = cfg.clone();
    let mut p = layout.parallelism_config();
    p.cp_size = cfg.parallelism.cp_size;
    p.cp_comm_strategy = cfg.parallelism.cp_comm_strategy.clone();
    out.parallelism = p;
    out.gradient_accumulation_steps = layout.accumulation_steps;
    out.activation_checkpointing = layout.activation_checkpointing;
    Ok((out, Some(decision)))
}

/// `request` completed with what `cfg` fixes on `device` (`auto_layout::completed_request`): the sizes that are
/// not `auto`, the precision of its mixed precision, checkpointing when it turns it on.
fn completed_auto_layout_request(
    cfg: &AcceleratorConfig,
    device: &Device,
    request: &crate::auto_layout::AutoLayoutRequest,
) -> crate::auto_layout::AutoLayoutRequest {
    use crate::auto_layout::Precision;
    let precision = match cfg.mixed_precision {
        MixedPrecision::No => Precision::Fp32,
        MixedPrecision::Fp16 => Precision::Fp16,
        MixedPrecision::Bf16 => Precision::Bf16,
    };
    crate::auto_layout::completed_request(
        request,
        cfg.parallelism.fixed_sizes(),
        precision,
        device,
        cfg.activation_checkpointing,
    )
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
    use ddp_core::{DistEnv, EnvSource};

    /// What `Accelerator::new` decides under each launcher's environment (`None`: a single process).
    fn decide(vars: &[(&str, &str)]) -> Option<(EnvSource, usize, usize)> {
        let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        let layout = DistEnv::detect(get).expect("a consistent layout");
        joins_a_job(layout.as_ref()).then(|| layout.map(|e| (e.source, e.rank, e.world_size)).unwrap())
    }

    #[test]
    fn every_launcher_environment_through_the_accelerator() {
        assert_eq!(decide(&[]), None, "no launcher");
        let torchrun = [("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("MASTER_PORT", "29500")];
        assert_eq!(decide(&torchrun), Some((EnvSource::Torchrun, 1, 4)), "torchrun / accel launch");
        assert_eq!(decide(&[("RANK", "0"), ("WORLD_SIZE", "1")]), None, "a one-process torchrun job");
        let srun =
            [("SLURM_PROCID", "2"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "2"), ("SLURM_NTASKS_PER_NODE", "4")];
        assert_eq!(decide(&srun), Some((EnvSource::Slurm, 2, 4)), "a Slurm batch step (srun)");
        // Inside `salloc` (or an sbatch script before srun): the allocation's variables, but no task of a step.
        let salloc = [("SLURM_NTASKS", "4"), ("SLURM_JOB_ID", "77"), ("SLURM_NNODES", "1")];
        assert_eq!(decide(&salloc), None, "a bare salloc shell is a single process");
        let ompi = [("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "4")];
        assert_eq!(decide(&ompi), Some((EnvSource::OpenMpi, 3, 4)), "Open MPI");
        assert_eq!(decide(&[("PMI_RANK", "0"), ("PMI_SIZE", "2")]), Some((EnvSource::Pmi, 0, 2)), "PMI (MPICH)");
        assert_eq!(decide(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "1")]), None, "mpirun -np 1");
    }

    #[test]
    fn an_inconsistent_layout_is_an_error_not_a_single_process() {
        let e = DistEnv::detect(|k| (k == "RANK").then(|| "1".to_string())).unwrap_err().to_string();
        assert!(e.contains("WORLD_SIZE"), "{e}");
    }
}
