//! [`Trainer`]: the training loop of HF's `Trainer.train()` on top of the Accelerator — epochs and global steps
//! with HF's arithmetic, gradient accumulation with token-exact loss normalisation, clipping, LR schedules stepped
//! only on real optimizer steps, logging, evaluation, checkpoints with rotation, exact resume, callbacks,
//! early stopping, best-model reloading and plots.
//!
//! Step arithmetic (HF): with `L` micro-batches per epoch on each process and accumulation `GA`, an epoch has
//! `upe = max(ceil(L / GA), 1)` optimizer steps; `max_steps` (if > 0) wins, else `max_steps =
//! ceil(num_train_epochs · upe)`. An optimizer step consumes a *window* of `GA` micro-batches (fewer at the end
//! of an epoch). Resuming at global step `g` skips `g / upe` epochs and `(g % upe) · GA` micro-batches — at any
//! number of processes, per-device batch and accumulation whose optimizer step covers the same global batch and
//! whose epochs have the same `upe` ([`checkpoint::check_compatible`]): the loader cuts every epoch's order into
//! the same global steps, so the same samples follow.
//!
//! Loss normalisation: the loss returns (sum of per-item losses, item count) per micro-batch. For each window
//! the trainer needs `N`, the window's item count summed over all ranks, and back-propagates
//! `loss_sum · GA · W / N` per micro-batch, which the Accelerator divides by `GA` and DDP averages over the `W`
//! ranks: the applied gradient is exactly `∇(Σ loss) / N` over the whole window and all ranks, so `GA = k` with
//! batch `b` equals `GA = 1` with batch `k·b` for any mix of sequence lengths. `N` comes from one all-reduce of
//! (loss sum, count) per optimizer step — except when the loss has a fixed item count per row
//! ([`crate::losses::Loss::items_fixed_per_row`], e.g. [`crate::losses::CrossEntropy`]) and every rank holds the
//! same number of rows (`even_batches` or `dataloader_drop_last`): then `N = W ×` the local count, with no
//! communication. With `average_tokens_across_devices = false` each rank normalises by its own count (DDP then
//! averages per-rank means, HF's behaviour with that flag).
//!
//! Tensor parallelism ([`Trainer::with_plan`]): the `tp` ranks of a data-parallel replica see the same batch and
//! return the same loss ([`crate::losses::Loss::compute_parallel`]), so summing counts over all `W = dp · tp`
//! ranks counts each replica's items `tp` times: `GA · W / N = GA · dp / N_dp`, which the Accelerator's
//! averaging over the `dp` ranks turns into the same `∇(Σ loss) / N_dp`; the logged means are unchanged too.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use accel::auto_layout::{AutoLayoutRequest, Checkpointing, ModelSpec, Precision, TrainSpec};
use accel::data::{Batch, DataLoader, DataLoaderConfig, Dataset};
use accel::dist::ProcessGroup;
use accel::nn::SharedStagedModel;
use accel::optim::AcceleratedOptimizer;
use accel::scheduler::{warmup_steps_from, LrScheduler, Scheduler};
use accel::segments::{self, BackwardSegments};
use accel::state::Stateful;
use accel::tensor_parallel::TensorParallel;
use accel::{Accelerator, AcceleratorConfig, MixedPrecision, PreparedModel};
use candle_core::{DType, ModuleT, Tensor};
use candle_nn::{VarBuilder, VarMap};

use crate::args::{SaveStrategy, TrainingArguments};
use crate::callbacks::{
    CallbackContext, CallbackHandler, ConsoleWriter, DefaultFlowCallback, EarlyStoppingCallback, PrinterCallback,
    TrackersCallback, TrainerCallback, TrainerControl,
};
use crate::checkpoint;
use crate::error::{Result, TrainerError};
use crate::losses::Loss;
use crate::metrics::{EvalPrediction, Metrics};
use crate::optimizer::TrainerOptimizer;
use crate::output_dir;
use crate::restarts;
use crate::state::{LogEntry, LossTallyState, TrainerState, TRAINER_STATE_NAME};

/// Builds the model from a `VarBuilder` (device, dtype and seeded initialisation chosen by the trainer).
pub type ModelInit<M> = Box<dyn Fn(VarBuilder<'static>) -> candle_core::Result<M> + Send>;
/// What the Trainer's one model builder is handed at setup: the Accelerator and the VarMap the parameters go into
/// (each constructor's wrapper makes the builder its closure wants from them).
struct Builders<'a> {
    acc: &'a Accelerator,
    varmap: &'a VarMap,
}
/// The one model builder the Trainer keeps: the model, and the stages `accel::nn::staged` built for it, if any.
type InitFn<M> = Box<dyn Fn(&Builders) -> candle_core::Result<(M, Option<SharedStagedModel>)> + Send>;
/// The model's shape for the automatic layout (a model on `accel::nn`'s builder, described without allocating):
/// from the plan in effect (the config's, else the Trainer's) and the tokens per sample.
type DescribeFn = Box<dyn Fn(Option<accel::plan::ParallelPlan>, usize) -> accel::Result<ModelSpec> + Send>;
/// Computes metrics from everything predicted on the evaluation set (gathered from all processes).
pub type ComputeMetrics = Box<dyn Fn(&EvalPrediction) -> Result<Metrics> + Send>;

/// What [`Trainer::train`] returns (HF's `TrainOutput`).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOutput {
    /// Optimizer steps taken in total (including those before a resume).
    pub global_step: u64,
    /// Mean training loss over the steps of this run.
    pub training_loss: f64,
    /// `train_runtime` (s), `train_samples_per_second`, `train_steps_per_second`, `train_loss`, `epoch`.
    pub metrics: Metrics,
}

/// The model and everything the Accelerator prepared for it; created on first use.
pub(crate) struct Runtime<M, D> {
    pub(crate) acc: Accelerator,
    /// The tensor-parallel group the model is split over (one rank without tensor parallelism).
    pub(crate) tp: TensorParallel,
    pub(crate) varmap: VarMap,
    pub(crate) model: M,
    /// Under pp, the stages the model declared with `accel::nn::staged` ([`Trainer::with_plan`]): training and
    /// evaluation then go through the Accelerator's pipeline calls.
    pub(crate) staged: Option<SharedStagedModel>,
    pub(crate) prepared: PreparedModel,
    pub(crate) optimizer: AcceleratedOptimizer<TrainerOptimizer>,
    pub(crate) train_loader: DataLoader<D>,
    pub(crate) scheduler: Option<Arc<Mutex<Scheduler>>>,
    pub(crate) callbacks: CallbackHandler,
}

/// An HF-style trainer. See the module documentation for the loop's semantics.
///
/// ```no_run
/// use trainer::{Trainer, TrainingArguments, losses, metrics};
/// # fn data() -> accel::data::TensorDataset { unimplemented!() }
/// # fn main() -> trainer::Result<()> {
/// let args = TrainingArguments { num_train_epochs: 3.0, learning_rate: 1e-3, ..Default::default() };
/// let mut t = Trainer::new(args, |vb| candle_nn::linear(784, 10, vb.pp("fc")), data(), Some(data()),
///                          losses::cross_entropy)
///     .compute_metrics(metrics::classification);
/// let out = t.train()?;
/// println!("{} steps, loss {:.4}", out.global_step, out.training_loss);
/// # Ok(()) }
/// ```
pub struct Trainer<M, D> {
    pub(crate) args: TrainingArguments,
    model_init: InitFn<M>,
    /// `Some` for a model on `accel::nn`'s builder (`with_plan`): what the automatic layout reads its shape from.
    describe_model: Option<DescribeFn>,
    train_dataset: Arc<D>,
    pub(crate) eval_dataset: Option<Arc<D>>,
    pub(crate) loss: Arc<dyn Loss>,
    pub(crate) compute_metrics: Option<ComputeMetrics>,
    user_callbacks: Vec<Box<dyn TrainerCallback>>,
    process_group: Option<ProcessGroup>,
    parallelism: Option<accel::ParallelismConfig>,
    pub(crate) rt: Option<Runtime<M, D>>,
    pub(crate) state: TrainerState,
    pub(crate) control: TrainerControl,
    trained: bool,
    /// Whether `train` prints the run banner (a hyperparameter search's trials do not: the study says it once).
    banner: bool,
    /// Checkpoints of this run's lineage: written by it, or the resumed checkpoint and its recorded best. Only
    /// these are ever loaded as the best model.
    own_checkpoints: std::collections::HashSet<PathBuf>,
    /// Global step of this run's last checkpoint (an epoch end that coincides with a step save saves once).
    last_saved_step: Option<u64>,
}

/// A callback event (to dispatch with split borrows of the trainer).
pub(crate) enum Event<'a> {
    TrainBegin,
    TrainEnd,
    EpochBegin,
    EpochEnd,
    StepBegin,
    StepEnd,
    Save,
    Evaluate(&'a Metrics),
    Log(&'a LogEntry),
}

pub(crate) fn fire(
    callbacks: &mut CallbackHandler,
    args: &TrainingArguments,
    state: &TrainerState,
    acc: &Accelerator,
    control: &mut TrainerControl,
    event: Event,
) -> Result<()> {
    let ctx = CallbackContext { args, state, rank: acc.rank(), world_size: acc.world_size() };
    match event {
        Event::TrainBegin => callbacks.on_train_begin(&ctx, control),
        Event::TrainEnd => callbacks.on_train_end(&ctx, control),
        Event::EpochBegin => callbacks.on_epoch_begin(&ctx, control),
        Event::EpochEnd => callbacks.on_epoch_end(&ctx, control),
        Event::StepBegin => callbacks.on_step_begin(&ctx, control),
        Event::StepEnd => callbacks.on_step_end(&ctx, control),
        Event::Save => callbacks.on_save(&ctx, control),
        Event::Evaluate(m) => callbacks.on_evaluate(&ctx, control, m),
        Event::Log(l) => callbacks.on_log(&ctx, control, l),
    }
}

/// The error for a model laid out over pipeline stages that it does not declare.
fn not_staged(acc: &Accelerator) -> TrainerError {
    TrainerError::Usage(format!(
        "the processes are laid out with pp_size {} (pipeline parallelism) but this trainer's model is not cut into \
         stages: build it with Trainer::with_plan on accel::nn's builder and declare its blocks with \
         accel::nn::staged (each rank then builds its stages only), or set pp_size 1",
        acc.mesh().pp().world_size()
    ))
}

/// A Trainer error met inside an Accelerator callback, carried as an Accelerator error (its message kept).
pub(crate) fn accel_error(e: TrainerError) -> accel::AccelError {
    match e {
        TrainerError::Accel(e) => e,
        e => accel::AccelError::InvalidArgument(e.to_string()),
    }
}

/// Casts floating-point inputs to the compute dtype (integer inputs such as token ids are left alone).
pub(crate) fn cast_input(x: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(if x.dtype().is_float() && x.dtype() != dtype { x.to_dtype(dtype)? } else { x.clone() })
}

/// Model outputs in F32 for the loss (autocast-style upcast of bf16/fp16 logits).
pub(crate) fn outputs_f32(y: Tensor) -> Result<Tensor> {
    Ok(if y.dtype() != DType::F32 && y.dtype().is_float() { y.to_dtype(DType::F32)? } else { y })
}

impl<M, D> Trainer<M, D>
where
    M: ModuleT + 'static,
    D: Dataset + 'static,
{
    /// A trainer for the model `model_init` builds, trained on `train_dataset`, evaluated on `eval_dataset`,
    /// with `loss` (a closure or one of [`crate::losses`]). Nothing runs until [`Self::train`], [`Self::evaluate`] or
    /// [`Self::predict`]; those set up the Accelerator (from the environment — `accel launch` / torchrun
    /// variables — or [`Self::process_group`]), build the model with seeded initialisation and prepare it.
    ///
    /// `model_init` builds the model from candle's own `VarBuilder`: it trains under DDP, ZeRO-1 and ZeRO-2. For
    /// every layout — tensor and pipeline parallelism, FULL_SHARD — build it from `accel::nn`'s builder (the same
    /// calls) with [`Trainer::with_plan`].
    pub fn new<F>(
        args: TrainingArguments,
        model_init: F,
        train_dataset: D,
        eval_dataset: Option<D>,
        loss: impl Loss + 'static,
    ) -> Self
    where
        F: Fn(VarBuilder<'static>) -> candle_core::Result<M> + Send + 'static,
    {
        let init: InitFn<M> = Box::new(move |b: &Builders| Ok((model_init(b.acc.var_builder(b.varmap))?, None)));
        Self::with_init(args, init, None, train_dataset, eval_dataset, loss)
    }

    /// Like [`Trainer::new`], for a model written on [`accel::nn`]'s builder — candle's calls (`pp`, `linear`,
    /// `embedding`, `layer_norm`, `rms_norm`, `get`) on `accel::nn::VarBuilder` — laid out by `plan` (or by the
    /// config's `parallelism_config_tp_plan`, which replaces it): every parameter drawn from `args.seed` per name
    /// on the full model, each linear and embedding split over the tp group as the plan says, and under FULL_SHARD
    /// (`fsdp: "full_shard"`, an Accelerate FSDP config) each weight gathered when the forward uses it — the model
    /// is built once and its code is the same at every layout. Under pipeline parallelism the model declares its
    /// blocks with [`accel::nn::staged`] and the Trainer drives the stages the builder made (the loss must count
    /// its items from the targets, [`Loss::count_items`]; evaluation then reports the loss only: the outputs live on the
    /// last stage, so `compute_metrics` and `predict` are refused). With an empty plan
    /// (`ParallelPlan::default()`) every layer is replicated: DDP, ZeRO-1/2, FULL_SHARD and HSDP; a linear at
    /// tp > 1 then needs a rule, and setup says which.
    ///
    /// ```no_run
    /// use accel::nn::{linear, Activation, Module, VarBuilder};
    /// use accel::plan::{ParallelPlan, ParallelStyle};
    /// use trainer::{losses, Trainer, TrainingArguments};
    /// # fn data() -> accel::data::TensorDataset { unimplemented!() }
    /// # fn main() -> trainer::Result<()> {
    /// let plan = ParallelPlan::default().with("fc1", ParallelStyle::Colwise).with("fc2", ParallelStyle::Rowwise);
    /// let mlp = |vb: VarBuilder| -> candle_core::Result<_> {
    ///     let fc1 = linear(784, 256, vb.pp("fc1"))?.with_activation(Activation::Relu);
    ///     let fc2 = linear(256, 10, vb.pp("fc2"))?;
    ///     Ok(candle_nn::seq().add(fc1).add(fc2))
    /// };
    /// let mut t = Trainer::with_plan(TrainingArguments::default(), plan, mlp, data(), None, losses::CrossEntropy);
    /// t.train()?;
    /// # Ok(()) }
    /// ```
    pub fn with_plan<F>(
        args: TrainingArguments,
        plan: accel::plan::ParallelPlan,
        model_init: F,
        train_dataset: D,
        eval_dataset: Option<D>,
        loss: impl Loss + 'static,
    ) -> Self
    where
        F: Fn(accel::nn::VarBuilder) -> candle_core::Result<M> + Send + 'static,
    {
        // Shared by the build and the description (a Mutex: the closure need only be Send).
        let model_init = Arc::new(Mutex::new(model_init));
        let (described, default_plan) = (model_init.clone(), plan.clone());
        let describe: DescribeFn = Box::new(move |plan, seq_len| {
            let build = described.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            ModelSpec::of_model(plan.unwrap_or_else(|| default_plan.clone()), seq_len, |vb| (*build)(vb))
        });
        let init: InitFn<M> = Box::new(move |b: &Builders| {
            let vb = b.acc.builder(b.varmap, plan.clone());
            let model = (*model_init.lock().unwrap_or_else(std::sync::PoisonError::into_inner))(vb.clone())?;
            Ok((model, vb.staged_model()))
        });
        Self::with_init(args, init, Some(describe), train_dataset, eval_dataset, loss)
    }

    fn with_init(
        args: TrainingArguments,
        model_init: InitFn<M>,
        describe_model: Option<DescribeFn>,
        train_dataset: D,
        eval_dataset: Option<D>,
        loss: impl Loss + 'static,
    ) -> Self {
        Trainer {
            args,
            model_init,
            describe_model,
            train_dataset: Arc::new(train_dataset),
            eval_dataset: eval_dataset.map(Arc::new),
            loss: Arc::new(loss),
            compute_metrics: None,
            user_callbacks: Vec::new(),
            process_group: None,
            parallelism: None,
            rt: None,
            state: TrainerState::default(),
            control: TrainerControl::default(),
            trained: false,
            banner: true,
            own_checkpoints: Default::default(),
            last_saved_step: None,
        }
    }

    /// Sets the metrics computed at each evaluation from the gathered predictions (e.g.
    /// [`crate::metrics::classification`]); their names get the `eval_` prefix.
    pub fn compute_metrics(mut self, f: impl Fn(&EvalPrediction) -> Result<Metrics> + Send + 'static) -> Self {
        self.compute_metrics = Some(Box::new(f));
        self
    }

    /// Adds a callback (after the built-in ones).
    pub fn callback(mut self, cb: impl TrainerCallback + 'static) -> Self {
        self.user_callbacks.push(Box::new(cb));
        self
    }

    /// Does not print the run banner when training (a hyperparameter search's trials).
    pub(crate) fn without_banner(mut self) -> Self {
        self.banner = false;
        self
    }

    /// Runs on this process group instead of the one described by the environment (tests run ranks as threads).
    pub fn process_group(mut self, pg: ProcessGroup) -> Self {
        self.process_group = Some(pg);
        self
    }

    /// Lays the processes out with these parallel sizes (e.g. `ParallelismConfig::default().with_tp_size(2)
    /// .with_dp_replicate_size(2)` on 4 ranks) instead of the environment's `PARALLELISM_CONFIG_*` (HF's
    /// `TrainingArguments.parallelism_config`). Errors at setup: the sizes do not multiply to the world size.
    pub fn parallelism_config(mut self, parallelism: accel::ParallelismConfig) -> Self {
        self.parallelism = Some(parallelism);
        self
    }

    /// The arguments (finalized once the trainer has been set up).
    pub fn args(&self) -> &TrainingArguments {
        &self.args
    }

    /// The training state (global step, log history, best metric...).
    pub fn state(&self) -> &TrainerState {
        &self.state
    }

    /// The model (after setup: built on the first `train` / `evaluate` / `predict`).
    pub fn model(&self) -> Option<&M> {
        self.rt.as_ref().map(|r| &r.model)
    }

    /// The model's variables (compute dtype), after setup.
    pub fn varmap(&self) -> Option<&VarMap> {
        self.rt.as_ref().map(|r| &r.varmap)
    }

    /// The prepared model (fp32 master weights, gradients), after setup.
    pub fn prepared_model(&self) -> Option<&PreparedModel> {
        self.rt.as_ref().map(|r| &r.prepared)
    }

    /// The Accelerator, after setup.
    pub fn accelerator(&self) -> Option<&Accelerator> {
        self.rt.as_ref().map(|r| &r.acc)
    }

    /// Sets up the Accelerator, model, optimizer, train loader and callbacks (idempotent).
    pub fn setup(&mut self) -> Result<()> {
        if self.rt.is_some() {
            return Ok(());
        }
        let acc = self.build_accelerator()?;
        self.args.finalize()?;
        let varmap = VarMap::new();
        // The model's tensor-parallel group (one rank without tensor parallelism), for the loss.
        let tp = acc.tensor_parallel().clone();
        let (model, built_stages) = (self.model_init)(&Builders { acc: &acc, varmap: &varmap })?;
        let staged = match (acc.pipeline_schedule().is_some(), built_stages) {
            (true, Some(stages)) => Some(stages),
            (true, None) => return Err(not_staged(&acc)),
            (false, _) => None,
        };
        // Under FULL_SHARD the VarMap keeps this rank's chunks from here on; a model on accel::nn's builder fetches
        // its weights at each use, one built from a candle VarBuilder keeps them and is refused here, saying so.
        let prepared = acc.prepare_model(&varmap)?;
        let optimizer = acc.prepare_optimizer(&prepared, TrainerOptimizer::from_args(&self.args)?)?;
        let cfg = DataLoaderConfig {
            batch_size: self.args.per_device_train_batch_size,
            shuffle: true,
            seed: self.args.data_seed_resolved(),
            drop_last: self.args.dataloader_drop_last,
            split_batches: acc.config().split_batches,
            even_batches: acc.config().even_batches,
            prefetch: true,
        };
        let train_loader = acc.prepare_data_loader(DataLoader::from_arc(self.train_dataset.clone(), cfg))?;
        let callbacks = self.build_callbacks(&acc);
        if acc.is_main_process() {
            std::fs::create_dir_all(&self.args.output_dir)
                .map_err(|e| TrainerError::io(format!("creating output_dir {}", self.args.output_dir.display()), e))?;
        }
        self.rt = Some(Runtime {
            acc,
            tp,
            varmap,
            model,
            staged,
            prepared,
            optimizer,
            train_loader,
            scheduler: None,
            callbacks,
        });
        Ok(())
    }

    /// The Accelerator: the environment's configuration (`accel launch` flags) unless the arguments set mixed
    /// precision / accumulation explicitly; the arguments are then updated to what is in effect. `fsdp`, when set,
    /// sets the sharding strategy and makes the data-parallel processes dp_shard ([`crate::args::FsdpPlan::apply`]
    /// on this job's world size).
    fn build_accelerator(&mut self) -> Result<Accelerator> {
        let mut cfg = AcceleratorConfig::from_env()?;
        if self.args.mixed_precision != MixedPrecision::No {
            cfg.mixed_precision = self.args.mixed_precision;
        }
        if self.args.gradient_accumulation_steps != 1 {
            cfg.gradient_accumulation_steps = self.args.gradient_accumulation_steps;
        }
        cfg.activation_checkpointing |= self.args.gradient_checkpointing;
        cfg.async_checkpointing |= self.args.async_checkpointing;
        cfg.seed = Some(self.args.seed);
        if let Some(p) = &self.parallelism {
            cfg.parallelism = p.clone();
        }
        let world_size = match &self.process_group {
            Some(pg) => pg.world_size(),
            // The job Accelerator::new joins: more than one process when a launcher describes one.
            None => accel::dist::env::DistEnv::detect_from_env()?.map_or(1, |env| env.world_size.max(1)),
        };
        if cfg.parallelism.is_auto() {
            if self.args.fsdp.is_some() {
                return Err(TrainerError::invalid(
                    "fsdp",
                    "an automatic layout (a parallelism size `auto`) chooses the sharding itself; drop fsdp, or give \
                     the sizes",
                ));
            }
            // The accumulation asked for (the arguments' or the environment's) is part of the global batch the
            // layout keeps; the layout chooses its own.
            self.args.gradient_accumulation_steps = cfg.gradient_accumulation_steps;
            if cfg.auto_layout.is_none() {
                cfg.auto_layout = Some(self.auto_layout_request(&cfg, world_size)?);
            }
            cfg.gradient_accumulation_steps = 1;
        } else {
            if let Some(plan) = self.args.fsdp_plan()? {
                let fsdp = self.args.fsdp.clone().unwrap_or_default();
                cfg.parallelism = plan.apply(&cfg.parallelism, world_size, &fsdp)?;
            }
            self.keep_the_global_batch(&mut cfg, world_size)?;
        }
        self.args.mixed_precision = cfg.mixed_precision;
        self.args.gradient_accumulation_steps = cfg.gradient_accumulation_steps;
        let acc = match self.process_group.take() {
            Some(pg) => Accelerator::with_process_group(cfg, pg)?,
            None => Accelerator::new(cfg)?,
        };
        if let Some(decision) = acc.auto_layout() {
            // The chosen micro-batch and accumulation replace the arguments' (the global batch is kept).
            self.args.per_device_train_batch_size = decision.layout().per_process_batch();
            self.args.gradient_accumulation_steps = acc.gradient_accumulation_steps();
        }
        Ok(acc)
    }

    /// What the automatic layout needs (a size of the config is `auto`): the model's shape, read from its build
    /// on `accel::nn`'s builder (described, nothing allocated) for samples of the training set's length — the
    /// tokens of a sample of integer ids, 1 for a sample of features — and the global batch the arguments give
    /// (`per_device_train_batch_size` × the processes × `gradient_accumulation_steps`, what data parallelism over
    /// all of them would train), split into any micro-batch size that divides it; activation checkpointing
    /// chosen where it saves memory, or always with `gradient_checkpointing`.
    fn auto_layout_request(&self, cfg: &AcceleratorConfig, world_size: usize) -> Result<AutoLayoutRequest> {
        let describe = self.describe_model.as_ref().ok_or_else(|| {
            TrainerError::Usage(
                "an automatic layout (a parallelism size `auto`) reads the model's shape from its build on \
                 accel::nn's builder: construct the Trainer with Trainer::with_plan (the same layer calls on \
                 accel::nn::VarBuilder), or give the sizes"
                    .into(),
            )
        })?;
        if self.train_dataset.is_empty() {
            return Err(TrainerError::Usage("the training dataset is empty: no layout to choose for it".into()));
        }
        let sample = self.train_dataset.get_batch(&[0])?.inputs;
        let seq_len = match sample.dtype() {
            DType::U8 | DType::U32 | DType::I64 => sample.elem_count().max(1),
            _ => 1,
        };
        let model = describe(cfg.parallelism.tp_plan.clone(), seq_len)?;
        let args = &self.args;
        // An elastic job re-chooses its layout at each size, for the global batch it started with.
        let global = match self.elastic_global_batch()? {
            Some((saved, _)) => saved as usize,
            None => args.per_device_train_batch_size * world_size * args.gradient_accumulation_steps.max(1),
        };
        if global > self.train_dataset.len() {
            return Err(TrainerError::invalid(
                "per_device_train_batch_size",
                format!(
                    "the global batch of an automatic layout, {} per device × {world_size} processes × {} \
                     accumulation steps = {global} samples, is more than the {} samples of the training set; lower \
                     it",
                    args.per_device_train_batch_size,
                    args.gradient_accumulation_steps.max(1),
                    self.train_dataset.len()
                ),
            ));
        }
        let checkpointing = if args.gradient_checkpointing { Checkpointing::On } else { Checkpointing::Auto };
        let train = TrainSpec::any_micro_batch(global, Precision::Fp32).with_checkpointing(checkpointing);
        Ok(AutoLayoutRequest::new(model, train))
    }

    fn build_callbacks(&mut self, acc: &Accelerator) -> CallbackHandler {
        let mut handler = CallbackHandler::new();
        handler.push(Box::new(DefaultFlowCallback));
        if let Some(patience) = self.args.early_stopping_patience {
            handler.push(Box::new(EarlyStoppingCallback::new(patience, self.args.early_stopping_threshold)));
        }
        let console = ConsoleWriter::new();
        #[cfg(feature = "progress")]
        handler.push(Box::new(crate::callbacks::ProgressCallback::new(console.clone())));
        handler.push(Box::new(PrinterCallback::new(console)));
        let mut kinds = Vec::new();
        if self.args.report_to.contains("jsonl") {
            kinds.push(accel::tracking::TrackerKind::Jsonl);
        }
        if self.args.report_to.contains("tensorboard") {
            kinds.push(accel::tracking::TrackerKind::TensorBoard);
        }
        if !kinds.is_empty() && !self.args.report_to.0.iter().any(|r| r == "none") {
            // The trackers write into logging_dir/project/ = self.args.tracker_dir().
            let logging_dir = self.args.logging_dir.clone().unwrap_or_else(|| self.args.output_dir.join("runs"));
            let project = self.args.run_name_resolved();
            handler.push(Box::new(TrackersCallback::new(acc.clone(), project, kinds, logging_dir)));
        }
        for cb in self.user_callbacks.drain(..) {
            handler.push(cb);
        }
        handler
    }

    /// Trains: see the module documentation. Resumes when `resume_from_checkpoint` is set. Call once per
    /// Trainer.
    ///
    /// The output directory is this run's alone ([`crate::output_dir`]): the main process holds
    /// `output_dir/.trainer.lock` while `train` runs (another job in the same directory fails at once), and a new run
    /// in a directory holding another run's files (checkpoints, `trainer_state.json`, `training_args.yaml`,
    /// `training_curves.*`, the trackers' `logging_dir/run_name`) is refused with
    /// [`TrainerError::InvalidArgument`] (`output_dir`) unless it resumes or sets `overwrite_output_dir`, which
    /// deletes them first.
    ///
    /// Signals: while the lock is held, SIGINT and SIGTERM whose action is the default (terminate) first delete
    /// the lock, then end the process by the same signal (a shell shows exit status 130 / 143). For that the main
    /// process installs a handler for the two signals while `train` runs and restores the previous action after;
    /// a program that ignores or handles them itself keeps its own behaviour (details: [`crate::output_dir::signals`]).
    pub fn train(&mut self) -> Result<TrainOutput> {
        if self.trained {
            return Err(TrainerError::Usage(
                "train() was already called on this Trainer; build a new Trainer to train again".into(),
            ));
        }
        self.setup()?;
        self.trained = true;
        let mut rt = self.rt.take().expect("setup created the runtime");
        if self.banner {
            rt.acc.print_banner(&program_name());
        }
        let result = match self.claim_output_dir(&rt.acc) {
            // The lock is held until training ends (successfully or not) and removed when `_lock` drops.
            Ok(_lock) => self.train_loop(&mut rt),
            Err(e) => Err(e),
        };
        self.rt = Some(rt);
        result
    }

    /// Makes `output_dir` this run's (main process; every rank agrees on the outcome): takes its lock (refusing
    /// a directory another job is training in; released on SIGINT/SIGTERM too), then refuses another run's files
    /// (checkpoints, final state, curves, the trackers' folder of this run name) unless this run resumes or
    /// `overwrite_output_dir` deletes them.
    fn claim_output_dir(&self, acc: &Accelerator) -> Result<Option<output_dir::OutputDirLock>> {
        let local = if acc.is_main_process() {
            output_dir::lock_output_dir(&self.args.output_dir).and_then(|lock| {
                // A restarted launch's earlier attempt may have left files before its first checkpoint: its own.
                let restarts = restarts::restarts_possible();
                let resuming = self.resumes()? || (restarts && restarts::written_by_this_launch(&self.args.output_dir));
                let removed = output_dir::check_output_dir(
                    &self.args.output_dir,
                    &self.args.tracker_dir(),
                    resuming,
                    self.args.overwrite_output_dir,
                )?;
                for path in removed {
                    acc.print(format!("overwrite_output_dir: deleted {} of the previous run", path.display()));
                }
                if restarts {
                    restarts::mark_output_dir(&self.args.output_dir)?;
                    if self.args.save_strategy == SaveStrategy::No || self.args.resume_from_checkpoint.is_none() {
                        acc.print(
                            "the launcher restarts this job's workers after a failure (max_restarts, or an elastic \
                             job), but this run does not both save checkpoints and resume the newest \
                             (--save-strategy steps --resume-from-checkpoint latest): a restart starts over",
                        );
                    }
                }
                Ok(Some(lock))
            })
        } else {
            Ok(None)
        };
        agree(acc, local, "checking output_dir")
    }

    /// The whole run: plan the steps, resume if asked, train the epochs, then summarise (see the module
    /// documentation).
    fn train_loop(&mut self, rt: &mut Runtime<M, D>) -> Result<TrainOutput> {
        self.check_eval_dataset()?;
        let start = Instant::now();
        let plan = self.plan_steps(rt)?;
        self.state = self.initial_state(rt, &plan);
        let scheduler = self.install_scheduler(rt, &plan);
        self.own_checkpoints.clear();
        self.last_saved_step = None;

        // Resume: validate and restore everything, then skip what was already trained (HF's arithmetic). Nothing
        // is written before the checkpoint has been verified and loaded: a failed resume changes no file.
        let from = match self.args.resume_from_checkpoint.clone() {
            Some(spec) if self.resumes()? => self.resume(rt, &plan, &spec)?,
            Some(_) => {
                rt.acc.print(format!(
                    "resume_from_checkpoint is \"latest\" and {} holds no checkpoint yet: training from the start \
                     (the launcher restarts this job's workers, which then resume from the newest one)",
                    self.args.output_dir.display()
                ));
                StartPoint::default()
            }
            None => StartPoint::default(),
        };
        self.write_training_args(rt)?;
        {
            let lr = crate::lock(&scheduler).lr();
            rt.optimizer.set_learning_rate(lr);
        }
        self.control = TrainerControl::default();
        fire(&mut rt.callbacks, &self.args, &self.state, &rt.acc, &mut self.control, Event::TrainBegin)?;

        let start_step = self.state.global_step;
        let mut progress = Progress { since_log: from.since_log, last_grad_norm: None };
        self.run_epochs(rt, &plan, from.epochs_trained, from.skip_micro, &mut progress)?;
        self.finish_training(rt, &plan, start, start_step, progress.since_log)
    }

    /// Whether this run resumes a checkpoint: it asks to, and — when it asks for the newest under a launcher that
    /// restarts its workers (whose first attempt has none yet) — there is one.
    fn resumes(&self) -> Result<bool> {
        Ok(match &self.args.resume_from_checkpoint {
            None => false,
            Some(_) if self.args.resume_latest() && restarts::restarts_possible() => {
                checkpoint::latest_checkpoint(&self.args.output_dir)?.is_some()
            }
            Some(_) => true,
        })
    }

    /// Under an elastic launch, the global batch of the checkpoint this run resumes (what every size keeps), and
    /// the checkpoint; `None` outside one, when nothing is resumed, or for a checkpoint that did not record it.
    fn elastic_global_batch(&self) -> Result<Option<(u64, PathBuf)>> {
        if restarts::elastic_nnodes().is_none() || !self.resumes()? {
            return Ok(None);
        }
        let Some(dir) = checkpoint::latest_checkpoint(&self.args.output_dir)? else { return Ok(None) };
        let saved = TrainerState::load_from_json(&dir.join(TRAINER_STATE_NAME))?;
        Ok(saved.global_batch_size.map(|g| (g, dir)))
    }

    /// An elastic job restarted at another size keeps the global batch of the checkpoint it resumes: the
    /// gradient accumulation (else the per-device batch) of `cfg` and the arguments are set to what keeps it at
    /// this job's data-parallel size, said once; refused naming the sizes that would keep it.
    fn keep_the_global_batch(&mut self, cfg: &mut AcceleratorConfig, world_size: usize) -> Result<()> {
        if cfg.split_batches {
            return Ok(());
        }
        let Some((global, dir)) = self.elastic_global_batch()? else { return Ok(()) };
        let machines = restarts::elastic_nnodes().unwrap_or_default();
        let resolved = cfg.parallelism.resolve(world_size)?;
        let dp = resolved.dp_replicate_size * resolved.dp_shard_size;
        let (per_device, accumulation) = (self.args.per_device_train_batch_size, cfg.gradient_accumulation_steps);
        let max_machines = machines.split(':').nth(1).and_then(|m| m.trim().parse::<usize>().ok()).unwrap_or(1);
        // At MAX machines the data-parallel size is at most this many times today's (at least one machine now).
        let max_dp = dp * max_machines;
        let (per_device_kept, accumulation_kept) =
            restarts::keep_global_batch(global, dp, per_device, accumulation, max_dp).map_err(|e| {
                TrainerError::checkpoint(&dir, format!("elastic restart at {world_size} processes: {e}"))
            })?;
        if (per_device_kept, accumulation_kept) != (per_device, accumulation) {
            if accel::dist::env::DistEnv::detect_from_env()?.is_none_or(|env| env.rank == 0) {
                eprintln!(
                    "elastic ({machines} machines): keeping the checkpoint's global batch of {global} samples at \
                     {dp} data-parallel process(es): per-device batch {per_device_kept}, gradient_accumulation_steps \
                     {accumulation_kept} (the arguments say {per_device} and {accumulation})"
                );
            }
            self.args.per_device_train_batch_size = per_device_kept;
            cfg.gradient_accumulation_steps = accumulation_kept;
        }
        Ok(())
    }

    /// Refuses an evaluation strategy without an eval dataset (before anything else runs).
    fn check_eval_dataset(&self) -> Result<()> {
        if self.args.eval_strategy != crate::args::IntervalStrategy::No && self.eval_dataset.is_none() {
            return Err(TrainerError::invalid(
                "eval_strategy",
                format!(
                    "is \"{}\" but the Trainer has no eval dataset; pass one to Trainer::new or set eval_strategy \
                     to \"no\"",
                    self.args.eval_strategy
                ),
            ));
        }
        Ok(())
    }

    /// HF's step arithmetic for this run (optimizer steps per epoch, `max_steps`, epochs); refuses an empty
    /// loader and an evaluation tensor parallelism cannot do.
    fn plan_steps(&self, rt: &Runtime<M, D>) -> Result<StepPlan> {
        let ga = self.args.gradient_accumulation_steps;
        let world = rt.acc.world_size();
        // Tensor- and pipeline-parallel peers train on the same batches: the samples per step count the
        // data-parallel ranks.
        let dp = rt.acc.data_parallel_size();
        let evaluates = self.args.eval_strategy != crate::args::IntervalStrategy::No;
        self.check_tp_evaluation(rt, evaluates && self.compute_metrics.is_some())?;
        let loader_len = rt.train_loader.len();
        if loader_len == 0 {
            return Err(TrainerError::Usage(format!(
                "the training data loader is empty on rank {} ({} samples, per_device_train_batch_size {}, {} \
                 processes, dataloader_drop_last {}); use a smaller batch or more data",
                rt.acc.rank(),
                self.train_dataset.len(),
                self.args.per_device_train_batch_size,
                world,
                self.args.dataloader_drop_last
            )));
        }
        let upe = loader_len.div_ceil(ga).max(1) as u64;
        let (max_steps, num_epochs) = if self.args.max_steps > 0 {
            let m = self.args.max_steps as u64;
            (m, m.div_ceil(upe))
        } else {
            ((self.args.num_train_epochs * upe as f64).ceil() as u64, self.args.num_train_epochs.ceil() as u64)
        };
        Ok(StepPlan {
            ga,
            world,
            dp,
            micro_global: rt.train_loader.total_batch_size(),
            split_batches: rt.train_loader.config().split_batches,
            loader_len,
            upe,
            max_steps,
            num_epochs,
        })
    }

    /// A fresh run's state: the plan's intervals and sizes, step 0.
    fn initial_state(&self, rt: &Runtime<M, D>, plan: &StepPlan) -> TrainerState {
        TrainerState {
            max_steps: plan.max_steps,
            logging_steps: self.args.logging_interval(plan.max_steps),
            eval_steps: self.args.eval_interval(plan.max_steps),
            save_steps: self.args.save_interval(plan.max_steps),
            train_batch_size: (self.args.per_device_train_batch_size * plan.dp) as u64,
            num_train_epochs: plan.num_epochs,
            world_size: Some(plan.world as u64),
            gradient_accumulation_steps: Some(plan.ga as u64),
            global_batch_size: Some(plan.layout().global_batch()),
            data_parallel_size: Some(plan.dp as u64),
            steps_per_epoch: Some(plan.upe),
            model_parallel_size: Some(rt.acc.mesh().model_parallel().world_size() as u64),
            is_local_process_zero: rt.acc.is_local_main_process(),
            is_world_process_zero: rt.acc.is_main_process(),
            ..TrainerState::default()
        }
    }

    /// Builds the LR schedule over `max_steps` and registers it with the Accelerator (so checkpoints carry it).
    fn install_scheduler(&self, rt: &mut Runtime<M, D>, plan: &StepPlan) -> Arc<Mutex<Scheduler>> {
        let warmup = warmup_steps_from(self.args.warmup_steps, self.args.warmup_ratio, plan.max_steps);
        let scheduler = Arc::new(Mutex::new(Scheduler::new(
            self.args.lr_scheduler_type,
            self.args.learning_rate,
            warmup,
            plan.max_steps,
        )));
        rt.acc.register_scheduler(scheduler.clone() as Arc<Mutex<dyn Stateful + Send>>);
        rt.scheduler = Some(scheduler.clone());
        scheduler
    }

    /// Verifies and loads the checkpoint `spec` names (every rank agreeing), restores the trainer's state from it,
    /// and says where training goes on; a run that had already ended trains no further.
    ///
    /// The checkpoint may come from another layout (number of processes, per-device batch, accumulation, tp/pp
    /// sizes) with the same global batch and steps per epoch ([`checkpoint::check_compatible`]): its global step is
    /// then the same place in the data, the weights and optimizer state are whole tensors, the loss tallies are
    /// shared out over this run's ranks ([`restored_tally`]), and the Accelerator derives each rank's RNG.
    fn resume(&mut self, rt: &mut Runtime<M, D>, plan: &StepPlan, spec: &str) -> Result<StartPoint> {
        let dir = checkpoint::resolve_resume(spec, &self.args.output_dir)?;
        let saved = TrainerState::load_from_json(&dir.join(TRAINER_STATE_NAME))?;
        // Every rank decides alike (the same state, the same layout), unless the ranks' epochs differ
        // (even_batches off): then all stop together.
        agree(&rt.acc, checkpoint::check_compatible(&dir, &saved, &plan.layout()), "checking the checkpoint")?;
        agree(&rt.acc, checkpoint::verify_checksums(&dir), "verifying the checkpoint")?;
        let mut epochs_trained = saved.global_step / plan.upe;
        let skip_micro = ((saved.global_step % plan.upe) as usize) * plan.ga;
        // At another micro-batch (the global batch checked above) the loader takes its position in samples.
        let loaded = rt.acc.load_state(Some(&dir)).map(drop).map_err(TrainerError::from);
        agree(&rt.acc, loaded, "loading the checkpoint")?;
        self.restore_state(rt, &dir, &saved)?;
        let since_log = restored_tally(&saved, &rt.acc).map(|t| LossTally::restored(&t)).unwrap_or_default();
        // From here the state describes this run's layout: its tallies are this layout's (one all-reduce).
        self.state.loss_tally = since_log.gather(&rt.acc)?;
        self.state.model_parallel_size = Some(rt.acc.mesh().model_parallel().world_size() as u64);
        if let Some(why) = already_ended(&saved, plan.max_steps) {
            // Training on would only move past where the original run stopped (and rotate its checkpoints).
            rt.acc.print(format!(
                "Training already ended at global step {} of {} ({why}); not training further, running the \
                 final steps only (no checkpoint is written or deleted)",
                saved.global_step,
                dir.display()
            ));
            epochs_trained = plan.num_epochs;
        } else {
            self.note_layout_change(rt, plan, &saved);
            rt.acc.print(format!(
                "Resuming from {} at global step {}: {epochs_trained} epoch(s) done, skipping the first \
                 {skip_micro} micro-batch(es) of epoch {}",
                dir.display(),
                saved.global_step,
                epochs_trained + 1
            ));
        }
        Ok(StartPoint { epochs_trained, skip_micro, since_log })
    }

    /// Says (once) that the checkpoint was written at another layout, and what of the run is not the same then.
    fn note_layout_change(&self, rt: &Runtime<M, D>, plan: &StepPlan, saved: &TrainerState) {
        let here = (plan.world as u64, plan.dp as u64, plan.ga as u64);
        let there = (
            saved.world_size.unwrap_or(here.0),
            saved.data_parallel_size.unwrap_or(here.1),
            saved.gradient_accumulation_steps.unwrap_or(here.2),
        );
        if here == there {
            return;
        }
        let processes = |n: u64| if n == 1 { "1 process".to_string() } else { format!("{n} processes") };
        let mut note = format!(
            "The checkpoint was written by {} ({} data parallel, gradient_accumulation_steps {}), this run has {} ({} \
             data parallel, gradient_accumulation_steps {}); the global batch is the same ({} samples per optimizer \
             step), so its global step is the same place in the data",
            processes(there.0),
            there.1,
            there.2,
            processes(here.0),
            here.1,
            here.2,
            plan.layout().global_batch()
        );
        if there.2 != here.2 {
            // Another micro-batch of all processes (the global batch ÷ GA): the Accelerator addresses dropout masks
            // by micro-step and row in it.
            note.push_str(
                ". The micro-batches are cut differently: a model with dropout draws other masks than the original run",
            );
        }
        // even_batches pads each epoch's last micro-batch on several processes (Accelerate's rule; one process is
        // not padded): the epoch's last step repeats other samples when the padding differs.
        let global = plan.layout().global_batch();
        let n = self.train_dataset.len() as u64;
        let pads = rt.acc.config().even_batches && !self.args.dataloader_drop_last;
        let padding = |dp: u64, ga: u64| {
            let micro = global / ga.max(1);
            if pads && dp > 1 && micro > 0 {
                n.div_ceil(micro) * micro - n
            } else {
                0
            }
        };
        let (padding_there, padding_here) = (padding(there.1, there.2), padding(here.1, here.2));
        if padding_there != padding_here {
            note.push_str(&format!(
                ". The last step of each epoch trains on {padding_here} repeated sample(s) here, {padding_there} in the \
                 original run (even_batches pads the epoch's last micro-batch on several processes; the data set is \
                 not a multiple of it)"
            ));
        }
        if !self.args.average_tokens_across_devices && there.1 != here.1 && !self.loss.items_fixed_per_row() {
            note.push_str(
                ". average_tokens_across_devices is false: each process normalises the loss by its own item count, so \
                 the updates depend on how many processes share the batch",
            );
        }
        rt.acc.print(note);
    }

    /// Takes over a checkpoint's trainer state (step, history, best model, callbacks' states) and counts it and
    /// its recorded best as this run's own checkpoints.
    fn restore_state(&mut self, rt: &mut Runtime<M, D>, dir: &Path, saved: &TrainerState) -> Result<()> {
        self.own_checkpoints.insert(dir.to_path_buf());
        if let Some(best) = &saved.best_model_checkpoint {
            self.own_checkpoints.insert(PathBuf::from(best));
        }
        self.state.stateful_callbacks = saved.stateful_callbacks.clone();
        self.state.global_step = saved.global_step;
        self.state.epoch = saved.epoch;
        self.state.log_history = saved.log_history.clone();
        self.state.best_metric = saved.best_metric;
        self.state.best_global_step = saved.best_global_step;
        self.state.best_model_checkpoint = saved.best_model_checkpoint.clone();
        self.state.num_input_tokens_seen = saved.num_input_tokens_seen;
        rt.callbacks.load_states(&saved.stateful_callbacks)?;
        Ok(())
    }

    /// Writes the arguments to `output_dir/training_args.yaml` (main process), after any resume has succeeded.
    fn write_training_args(&self, rt: &Runtime<M, D>) -> Result<()> {
        if rt.acc.is_main_process() {
            let yaml = self.args.to_yaml()?;
            let path = self.args.output_dir.join("training_args.yaml");
            std::fs::write(&path, yaml).map_err(|e| TrainerError::io(format!("writing {}", path.display()), e))?;
        }
        Ok(())
    }

    /// Trains the remaining epochs, from `epochs_trained` (skipping `skip_micro` micro-batches of the first),
    /// until `max_steps` or a callback stops training.
    fn run_epochs(
        &mut self,
        rt: &mut Runtime<M, D>,
        plan: &StepPlan,
        epochs_trained: u64,
        skip_micro: usize,
        progress: &mut Progress,
    ) -> Result<()> {
        for epoch in epochs_trained..plan.num_epochs {
            if self.state.global_step >= plan.max_steps {
                break;
            }
            let first_epoch_skip = if epoch == epochs_trained { skip_micro } else { 0 };
            self.run_epoch(rt, plan, epoch, first_epoch_skip, progress)?;
            if self.control.should_training_stop {
                break;
            }
        }
        Ok(())
    }

    /// One epoch: positions the loader, takes one optimizer step per window of micro-batches until the epoch
    /// ends or a callback stops it, then the epoch end's callbacks, log, evaluation and save.
    fn run_epoch(
        &mut self,
        rt: &mut Runtime<M, D>,
        plan: &StepPlan,
        epoch: u64,
        skip: usize,
        progress: &mut Progress,
    ) -> Result<()> {
        rt.train_loader.set_epoch(epoch);
        rt.train_loader.skip_first_batches(skip);
        self.control.new_epoch();
        fire(&mut rt.callbacks, &self.args, &self.state, &rt.acc, &mut self.control, Event::EpochBegin)?;
        let mut consumed = skip;
        let mut iter = rt.train_loader.iter();
        while let Some(window) = next_window(&mut iter, plan.ga)? {
            consumed += window.len();
            let epoch_progress = epoch as f64 + consumed as f64 / plan.loader_len as f64;
            self.run_step(rt, window, epoch_progress, progress)?;
            if self.control.should_epoch_stop || self.control.should_training_stop {
                break;
            }
        }
        drop(iter);
        fire(&mut rt.callbacks, &self.args, &self.state, &rt.acc, &mut self.control, Event::EpochEnd)?;
        self.maybe_log_save_evaluate(rt, &mut progress.since_log, progress.last_grad_norm)
    }

    /// One global step: the optimizer step over `window` between its callbacks, the loss tallied and the step
    /// counted, then whatever logging, evaluation and saving the control flags ask for.
    fn run_step(
        &mut self,
        rt: &mut Runtime<M, D>,
        window: Vec<Batch>,
        epoch_progress: f64,
        progress: &mut Progress,
    ) -> Result<()> {
        fire(&mut rt.callbacks, &self.args, &self.state, &rt.acc, &mut self.control, Event::StepBegin)?;
        let step = self.training_step(rt, &window)?;
        drop(window);
        progress.since_log.add(step.loss_sum, step.items)?;
        if step.grad_norm.is_some() {
            progress.last_grad_norm = step.grad_norm;
        }
        self.state.global_step += 1;
        self.state.epoch = epoch_progress;
        fire(&mut rt.callbacks, &self.args, &self.state, &rt.acc, &mut self.control, Event::StepEnd)?;
        self.maybe_log_save_evaluate(rt, &mut progress.since_log, progress.last_grad_norm)
    }

    /// The end of training: the run's loss and throughput logged, the best model reloaded if asked,
    /// `on_train_end`, the final state written; returns HF's `TrainOutput`.
    fn finish_training(
        &mut self,
        rt: &mut Runtime<M, D>,
        plan: &StepPlan,
        start: Instant,
        start_step: u64,
        mut since_log: LossTally,
    ) -> Result<TrainOutput> {
        // A checkpoint still being written (async_checkpointing) is part of the run: committed before it ends.
        rt.acc.wait_for_checkpoint()?;
        let runtime = start.elapsed().as_secs_f64();
        let steps_this_run = self.state.global_step - start_step;
        since_log.flush()?;
        let training_loss = since_log.run_mean(&rt.acc)?.unwrap_or(0.0);
        let samples = steps_this_run as f64 * (self.args.per_device_train_batch_size * plan.ga * plan.dp) as f64;
        let metrics = Metrics::from([
            ("train_runtime".to_string(), runtime),
            ("train_samples_per_second".to_string(), samples / runtime.max(1e-9)),
            ("train_steps_per_second".to_string(), steps_this_run as f64 / runtime.max(1e-9)),
            ("train_loss".to_string(), training_loss),
        ]);
        self.log(rt, metrics.clone())?;
        if self.args.load_best_model_at_end {
            self.load_best_model(rt)?;
        }
        fire(&mut rt.callbacks, &self.args, &self.state, &rt.acc, &mut self.control, Event::TrainEnd)?;
        self.write_final_state(rt)?;
        rt.acc.wait_for_everyone()?;
        let mut metrics = metrics;
        metrics.insert("epoch".into(), self.state.epoch);
        Ok(TrainOutput { global_step: self.state.global_step, training_loss, metrics })
    }

    /// Writes the final `trainer_state.json` (and, with the feature `plots`, the training curves) on the main
    /// process.
    fn write_final_state(&self, rt: &Runtime<M, D>) -> Result<()> {
        if rt.acc.is_main_process() {
            self.state.save_to_json(&self.args.output_dir.join(TRAINER_STATE_NAME))?;
            // Without the feature `plots`, validation refused save_plots: true.
            #[cfg(feature = "plots")]
            if self.args.save_plots {
                match crate::plot::plot_training_curves(&self.state, &self.args.output_dir) {
                    Ok(_) => {}
                    // A missing plot must not fail a finished training run.
                    Err(e) => tracing::warn!("could not write the training curves: {e}"),
                }
            }
        }
        Ok(())
    }

    /// One optimizer step over a window of micro-batches. See the module documentation for the normalisation.
    ///
    /// When the loss can count a micro-batch's items from its targets ([`Loss::count_items`], as HF counts
    /// `num_items_in_batch` from the labels), the window's count is known before any forward pass and each
    /// micro-batch runs forward and backward before the next one starts: memory does not grow with
    /// `gradient_accumulation_steps`. Otherwise every micro-batch's graph is kept until the count is known.
    fn training_step(&mut self, rt: &mut Runtime<M, D>, window: &[Batch]) -> Result<StepOutcome> {
        let (local_sum, local_items) = self.accumulate_gradients(rt, window)?;
        let acc = &rt.acc;
        let grad_norm = if self.args.max_grad_norm > 0.0 { acc.clip_grad_norm(self.args.max_grad_norm)? } else { None };
        if self.args.on_nonfinite_loss == crate::args::NonFiniteLoss::SkipStep
            && self.skip_nonfinite_step(rt, local_sum.as_ref(), grad_norm)?
        {
            let zero = Tensor::zeros((), DType::F32, rt.acc.device())?;
            return Ok(StepOutcome { loss_sum: zero, items: 0.0, grad_norm: None });
        }
        optimizer_step(rt)?;
        let loss_sum = local_sum.expect("a window has at least one micro-batch");
        Ok(StepOutcome { loss_sum, items: local_items as f64, grad_norm })
    }

    /// Forward and backward over the window's micro-batches, the gradients accumulated (and synced with the
    /// last); returns this rank's loss sum (detached) and item count.
    fn accumulate_gradients(&self, rt: &Runtime<M, D>, window: &[Batch]) -> Result<(Option<Tensor>, usize)> {
        let counts = window
            .iter()
            .map(|b| self.loss.count_items(&b.targets))
            .collect::<candle_core::Result<Option<Vec<usize>>>>()?;
        let mut local_sum: Option<Tensor> = None;
        // The trainer cuts windows itself (it needs the window's item count first): the window's last micro-batch
        // syncs, whatever the loader's end-of-data flag says about the batch fetched last.
        let local_items = match counts {
            Some(counts) => self.accumulate_counted(rt, window, &counts, &mut local_sum)?,
            None => self.accumulate_uncounted(rt, window, &mut local_sum)?,
        };
        Ok((local_sum, local_items))
    }

    /// A window whose item counts the loss gave up front (`counts`): each micro-batch runs forward and backward
    /// before the next one starts.
    fn accumulate_counted(
        &self,
        rt: &Runtime<M, D>,
        window: &[Batch],
        counts: &[usize],
        local_sum: &mut Option<Tensor>,
    ) -> Result<usize> {
        let acc = &rt.acc;
        let rows: usize = window.iter().map(Batch::len).sum();
        let local_items: usize = counts.iter().sum();
        let scale = self.loss_scale(acc, local_items, rows)?;
        if let Some(staged) = &rt.staged {
            // Each pipeline micro-batch's loss sum × the window's scale, summed; the call returns that sum (the
            // same on every pp rank), so this rank's share of the window's loss sum is it ÷ scale.
            let (dtype, tp) = (acc.compute_dtype(), &rt.tp);
            acc.accumulate_window(window.len(), |i| {
                let b = &window[i];
                let scaled =
                    acc.pipeline_backward_sum(staged.as_ref(), &cast_input(&b.inputs, dtype)?, &b.targets, |y, t| {
                        let out = self.loss.compute_parallel(&outputs_f32(y.clone()).map_err(accel_error)?, t, tp)?;
                        Ok(out.loss_sum.affine(scale, 0.0)?)
                    })?;
                let sum = if scale > 0.0 { scaled.affine(1.0 / scale, 0.0)? } else { scaled.zeros_like()? };
                add_detached(local_sum, &sum)
            })?;
            return Ok(local_items);
        }
        acc.accumulate_window(window.len(), |i| {
            let (out, cuts) = self.forward(rt, &window[i], 0)?;
            if out.num_items != counts[i] {
                return Err(TrainerError::Usage(format!(
                    "the loss counted {} items from the targets (count_items) but computed {} (compute); make \
                     the two agree",
                    counts[i], out.num_items
                )));
            }
            add_detached(local_sum, &out.loss_sum)?;
            Ok(acc.backward_segments(&out.loss_sum.affine(scale, 0.0)?, cuts)?)
        })?;
        Ok(local_items)
    }

    /// A window whose item count is known only after every forward pass: each micro-batch's graph is kept until
    /// then, and the backward passes follow.
    fn accumulate_uncounted(
        &self,
        rt: &Runtime<M, D>,
        window: &[Batch],
        local_sum: &mut Option<Tensor>,
    ) -> Result<usize> {
        let acc = &rt.acc;
        if rt.staged.is_some() {
            return Err(TrainerError::Usage(
                "a pipelined model needs a loss that counts its items from the targets \
                 (Loss::count_items): each micro-batch's backward runs before the pipeline's last stage could count \
                 the window; use one of trainer::losses or implement count_items"
                    .into(),
            ));
        }
        let rows: usize = window.iter().map(Batch::len).sum();
        let mut sums = Vec::with_capacity(window.len());
        let mut local_items = 0usize;
        for (ahead, batch) in window.iter().enumerate() {
            // The backward passes come after every forward: the micro-step of this one is `ahead` further on.
            let (out, cuts) = self.forward(rt, batch, ahead as u64)?;
            add_detached(local_sum, &out.loss_sum)?;
            local_items += out.num_items;
            sums.push((out.loss_sum, Some(cuts)));
        }
        let scale = self.loss_scale(acc, local_items, rows)?;
        acc.accumulate_window(sums.len(), |i| {
            let cuts = sums[i].1.take().unwrap_or_default();
            Ok::<_, TrainerError>(acc.backward_segments(&sums[i].0.affine(scale, 0.0)?, cuts)?)
        })?;
        Ok(local_items)
    }

    /// One micro-batch's forward pass and loss (`ahead`: see the dropout context below). The pass is recorded: where the model marks backward-segment cuts
    /// (`accel::segments::cut`), the gradient all-reduce starts during the backward pass
    /// (Accelerator::backward_segments).
    fn forward(
        &self,
        rt: &Runtime<M, D>,
        batch: &Batch,
        ahead: u64,
    ) -> Result<(crate::losses::LossOutput, BackwardSegments)> {
        let dtype = rt.acc.compute_dtype();
        // Dropout (accel::tensor_parallel::dropout) is on in the training forward only, its masks those of the
        // micro-step whose backward this forward feeds (`ahead` micro-steps after the next one).
        let mut dropout = rt.acc.dropout_context(batch.len());
        dropout.step += ahead;
        segments::record(|| {
            let x = cast_input(&batch.inputs, dtype)?;
            let checkpointing = rt.acc.config().activation_checkpointing;
            let y = accel::activation_checkpoint::with_activation_checkpointing(checkpointing, || {
                accel::tensor_parallel::with_dropout_context(dropout, || rt.model.forward_t(&x, true))
            })?;
            let y = outputs_f32(y)?;
            Ok(self.loss.compute_parallel(&y, &batch.targets, &rt.tp)?)
        })
    }

    /// `on_nonfinite_loss = skip_step`: whether any rank's loss or the gradient norm is not finite (every rank
    /// agrees). Then every rank skips the same step: the synced gradients are dropped, weights and schedule stay.
    fn skip_nonfinite_step(
        &self,
        rt: &mut Runtime<M, D>,
        local_sum: Option<&Tensor>,
        grad_norm: Option<f64>,
    ) -> Result<bool> {
        let acc = &rt.acc;
        let local = local_sum.map_or(Ok(0.0), |t| t.to_dtype(DType::F64)?.to_scalar::<f64>())?;
        let mut bad = [f64::from(u8::from(!local.is_finite() || grad_norm.is_some_and(|g| !g.is_finite())))];
        if acc.world_size() > 1 {
            acc.process_group().all_reduce(&mut bad, accel::dist::ReduceOp::Max)?;
        }
        if bad[0] == 0.0 {
            return Ok(false);
        }
        rt.optimizer.zero_grad();
        tracing::warn!(
            "global step {}: non-finite loss or gradient norm on some rank; step skipped (on_nonfinite_loss = \
             skip_step)",
            self.state.global_step + 1
        );
        Ok(true)
    }

    /// The factor each micro-batch's loss sum is multiplied by before `backward`: `GA · W / N` with `N` the
    /// window's item count over all ranks (see the module documentation); `backward` divides by GA and DDP
    /// averages over the `W` ranks, so the applied gradient is `∇(Σ loss) / N`. Collective for token-level losses.
    fn loss_scale(&self, acc: &Accelerator, local_items: usize, rows: usize) -> Result<f64> {
        let world = acc.world_size();
        let (items, global) = match self.normalisation(acc) {
            Normalisation::Local => (local_items as f64, false),
            Normalisation::FixedPerRow => {
                if !local_items.is_multiple_of(rows.max(1)) {
                    return Err(TrainerError::Usage(format!(
                        "the loss declares items_fixed_per_row() but returned {local_items} items for {rows} rows; \
                         return false from items_fixed_per_row for losses with varying item counts"
                    )));
                }
                // Same rows on every rank at every step: the global count is known without communication.
                ((local_items * world) as f64, true)
            }
            Normalisation::Reduced => {
                let mut buf = [local_items as f64];
                acc.process_group().all_reduce(&mut buf, accel::dist::ReduceOp::Sum)?;
                (buf[0], true)
            }
        };
        let ga = acc.gradient_accumulation_steps() as f64;
        Ok(if items > 0.0 { ga * if global { world as f64 } else { 1.0 } / items } else { 0.0 })
    }

    /// How this run normalises token-level losses (see [`Normalisation`]).
    fn normalisation(&self, acc: &Accelerator) -> Normalisation {
        let equal_rows = acc.config().even_batches || self.args.dataloader_drop_last;
        if acc.world_size() == 1 || !self.args.average_tokens_across_devices {
            Normalisation::Local
        } else if self.loss.items_fixed_per_row() && equal_rows {
            Normalisation::FixedPerRow
        } else {
            Normalisation::Reduced
        }
    }

    /// HF's `_maybe_log_save_evaluate`: log the running loss, evaluate (and track the best metric), checkpoint,
    /// as the control flags ask.
    fn maybe_log_save_evaluate(
        &mut self,
        rt: &mut Runtime<M, D>,
        since_log: &mut LossTally,
        grad_norm: Option<f64>,
    ) -> Result<()> {
        self.check_finite(rt, since_log, grad_norm)?;
        if self.control.should_log && since_log.steps > 0 {
            // Every rank logs at the same steps, so this collective is matched on all of them.
            let loss = since_log.log_mean(&rt.acc)?.unwrap_or(0.0);
            let mut values = Metrics::from([
                ("loss".to_string(), loss),
                ("learning_rate".to_string(), rt.optimizer.learning_rate()),
            ]);
            if let Some(g) = grad_norm {
                values.insert("grad_norm".into(), g);
            }
            self.log(rt, values)?;
        }
        if self.control.should_evaluate && self.eval_dataset.is_some() {
            let metrics = self.evaluate_in(rt, None, "eval")?;
            let new_best = self.determine_best_metric(&metrics)?;
            if self.args.save_strategy == SaveStrategy::Best {
                self.control.should_save = new_best;
            }
        }
        if self.control.should_save {
            self.save_checkpoint(rt, since_log)?;
            fire(&mut rt.callbacks, &self.args, &self.state, &rt.acc, &mut self.control, Event::Save)?;
        }
        self.control.new_step();
        Ok(())
    }

    /// Appends a log entry at the current step and dispatches `on_log`.
    pub(crate) fn log(&mut self, rt: &mut Runtime<M, D>, values: Metrics) -> Result<()> {
        let entry = LogEntry { epoch: self.state.epoch, step: self.state.global_step, values };
        self.state.log_history.push(entry.clone());
        fire(&mut rt.callbacks, &self.args, &self.state, &rt.acc, &mut self.control, Event::Log(&entry))
    }

    /// HF's `_determine_best_metric`: updates `best_metric` / `best_global_step`; true when this evaluation is a
    /// new best.
    fn determine_best_metric(&mut self, metrics: &Metrics) -> Result<bool> {
        let Some(key) = self.args.best_metric_key() else { return Ok(false) };
        let value = *metrics.get(&key).ok_or_else(|| TrainerError::MissingMetric {
            name: key.clone(),
            available: metrics.keys().cloned().collect(),
        })?;
        let greater = self.args.greater_is_better_resolved();
        let better = match self.state.best_metric {
            None => true,
            Some(best) => {
                if greater {
                    value > best
                } else {
                    value < best
                }
            }
        };
        if better {
            self.state.best_metric = Some(value);
            if self.args.save_strategy != SaveStrategy::No {
                self.state.best_global_step = Some(self.state.global_step);
            }
        }
        Ok(better)
    }

    /// Stops training when the step just taken had a non-finite loss (on any rank) or gradient norm, before
    /// anything of it is logged or saved. One host read of the step's loss per optimizer step, plus one tiny
    /// all-reduce when distributed so every rank stops at the same step.
    fn check_finite(
        &mut self,
        rt: &mut Runtime<M, D>,
        since_log: &mut LossTally,
        grad_norm: Option<f64>,
    ) -> Result<()> {
        let Some((loss, items)) = since_log.pending.take() else { return Ok(()) };
        let local = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let acc = &rt.acc;
        let (rank, world) = (acc.rank(), acc.world_size());
        let mut flags = vec![0.0; world];
        flags[rank] = if local.is_finite() { 0.0 } else { 1.0 };
        if world > 1 {
            acc.process_group().all_reduce(&mut flags, accel::dist::ReduceOp::Sum)?;
        }
        let bad: Vec<usize> = (0..world).filter(|&r| flags[r] > 0.0).collect();
        // Under fp16 an overflowing gradient is routine: the loss scaler skips that step and lowers the scale.
        let fp16 = acc.config().mixed_precision == MixedPrecision::Fp16;
        let grad_bad = grad_norm.filter(|g| !g.is_finite() && !fp16);
        let step = self.state.global_step;
        if bad.is_empty() && grad_bad.is_none() {
            since_log.last_finite = Some((step, if items > 0.0 { local / items } else { local }));
            return Ok(());
        }
        let last = match since_log.last_finite {
            Some((s, l)) => format!("last finite loss {l:.6} at global step {s} on rank {rank}"),
            None => "no finite loss before it in this run".to_string(),
        };
        let what = if !bad.is_empty() {
            let ranks = bad.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ");
            let own = if flags[rank] > 0.0 { format!(" (here: {})", local / items.max(1.0)) } else { String::new() };
            format!("the training loss is not finite at global step {step} on rank {ranks}{own}")
        } else {
            format!("the gradient norm is {} at global step {step} (rank {rank})", grad_bad.unwrap_or(f64::NAN))
        };
        let saved = self.last_saved_step.map(|s| {
            format!(
                "; the newest checkpoint, {}, is from before",
                checkpoint::checkpoint_dir(&self.args.output_dir, s).display()
            )
        });
        Err(TrainerError::NonFinite(format!(
            "training diverged: {what}; {last}. Nothing from this step on is saved{}. Lower learning_rate (now {}), \
             keep gradient clipping on (max_grad_norm), or check the data",
            saved.unwrap_or_default(),
            self.args.learning_rate
        )))
    }

    /// Writes `output_dir/checkpoint-{global_step}`: the Accelerator's state (all ranks), then `checksums.json`
    /// and `trainer_state.json` (main process, atomically, last), then rotation. A directory of that name that this
    /// run did not write (a leftover of the run it resumed) is replaced. Refuses non-finite weights, so a diverged
    /// step never replaces a good checkpoint.
    fn save_checkpoint(&mut self, rt: &mut Runtime<M, D>, since_log: &LossTally) -> Result<()> {
        let dir = checkpoint::checkpoint_dir(&self.args.output_dir, self.state.global_step);
        if self.last_saved_step == Some(self.state.global_step) {
            // Already written at this step by this run (e.g. an epoch end that coincides with a step save).
            return Ok(());
        }
        // Every rank holds the same weights, so every rank reaches the same verdict without communication.
        for (name, t) in rt.prepared.state_dict()? {
            let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            if let Some(v) = values.iter().find(|v| !v.is_finite()) {
                return Err(TrainerError::NonFinite(format!(
                    "training diverged: parameter {name} holds {v} at global step {}; not saving {} so that no \
                     checkpoint with non-finite weights replaces a good one. Lower learning_rate (now {}) or keep \
                     gradient clipping on (max_grad_norm)",
                    self.state.global_step,
                    dir.display(),
                    self.args.learning_rate
                )));
            }
        }
        self.state.loss_tally = since_log.gather(&rt.acc)?;
        self.state.model_parallel_size = Some(rt.acc.mesh().model_parallel().world_size() as u64);
        let mut callbacks: std::collections::BTreeMap<_, _> = rt.callbacks.states().into_iter().collect();
        callbacks.insert("TrainerControl".to_string(), self.control.to_state());
        self.state.stateful_callbacks = callbacks;
        // The previous save first, if it is still being written: its directory may be the best one.
        rt.acc.wait_for_checkpoint()?;
        if let Some(best_step) = self.state.best_global_step {
            let best_dir = checkpoint::checkpoint_dir(&self.args.output_dir, best_step);
            // The best is this save, or a checkpoint already complete on disk.
            if best_step == self.state.global_step || checkpoint::is_complete(&best_dir) {
                self.state.best_model_checkpoint = Some(best_dir.to_string_lossy().into_owned());
            }
        }
        // The Trainer's files join the checkpoint once the Accelerator's are committed (on the writer thread
        // under async_checkpointing): the checksums, then the state file, whose presence marks it complete.
        let text = self.state.to_json_string()?;
        let best = self.state.best_model_checkpoint.as_ref().map(PathBuf::from);
        let (output_dir, limit) = (self.args.output_dir.clone(), self.args.save_total_limit);
        rt.acc.save_state_then(Some(&dir), move |dir| {
            let finish = || -> Result<()> {
                checkpoint::write_checksums(dir, &[(TRAINER_STATE_NAME, text.as_bytes())])?;
                accel::state::write_atomic(&dir.join(TRAINER_STATE_NAME), text)?;
                checkpoint::rotate_checkpoints(&output_dir, limit, best.as_deref())?;
                Ok(())
            };
            finish().map_err(|e| accel::AccelError::Checkpoint { path: dir.to_path_buf(), reason: e.to_string() })
        })?;
        self.own_checkpoints.insert(dir);
        self.last_saved_step = Some(self.state.global_step);
        if !self.args.async_checkpointing {
            rt.acc.wait_for_everyone()?;
        }
        Ok(())
    }

    /// Loads the weights of `best_model_checkpoint` into the model (every rank).
    fn load_best_model(&mut self, rt: &mut Runtime<M, D>) -> Result<()> {
        let Some(best) = self.state.best_model_checkpoint.clone() else {
            rt.acc.print("load_best_model_at_end: no best checkpoint was saved; keeping the final weights");
            return Ok(());
        };
        if !self.own_checkpoints.contains(Path::new(&best)) {
            rt.acc.print(format!(
                "load_best_model_at_end: {best} was not written by this run (nor the run it resumed); keeping the \
                 final weights"
            ));
            return Ok(());
        }
        agree(&rt.acc, checkpoint::verify_checksums(Path::new(&best)), "verifying the best checkpoint")?;
        let path = Path::new(&best).join("model.safetensors");
        let weights = accel::state::load_safetensors(&path, rt.acc.device())?;
        rt.prepared.load_state_dict(&weights)?;
        rt.acc.print(format!(
            "Loading best model from {best} (score: {})",
            self.state.best_metric.map(|m| format!("{m:.6}")).unwrap_or_default()
        ));
        Ok(())
    }

    /// Writes the fp32 weights (`model.safetensors`, names = `VarMap` names) and `training_args.yaml` to `dir`
    /// (default `output_dir`), from the main process; returns the weights file.
    pub fn save_model(&mut self, dir: Option<&Path>) -> Result<PathBuf> {
        self.setup()?;
        let rt = self.rt.as_ref().expect("setup created the runtime");
        let dir = dir.map(Path::to_path_buf).unwrap_or_else(|| self.args.output_dir.clone());
        let path = dir.join("model.safetensors");
        // Every rank takes part: under tensor parallelism the full weights are gathered over the tp group.
        let weights = rt.prepared.state_dict()?;
        if rt.acc.is_main_process() {
            std::fs::create_dir_all(&dir).map_err(|e| TrainerError::io(format!("creating {}", dir.display()), e))?;
            // Atomic: save_safetensors goes through accel::state::write_atomic.
            accel::state::save_safetensors(&weights, &path)?;
            let args_path = dir.join("training_args.yaml");
            std::fs::write(&args_path, self.args.to_yaml()?)
                .map_err(|e| TrainerError::io(format!("writing {}", args_path.display()), e))?;
        }
        rt.acc.wait_for_everyone()?;
        Ok(path)
    }
}

/// How the per-window item count `N` of the loss normalisation is obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Normalisation {
    /// This rank's count (one process, or `average_tokens_across_devices` off: DDP then averages per-rank means).
    Local,
    /// `world_size ×` this rank's count: the loss has a fixed item count per row and every rank holds as many rows.
    FixedPerRow,
    /// Summed over ranks with one all-reduce per optimizer step (token-level losses).
    Reduced,
}

/// Result of one optimizer step.
struct StepOutcome {
    /// This rank's summed per-item loss over the window (scalar on the device, detached).
    loss_sum: Tensor,
    /// This rank's item count over the window.
    items: f64,
    /// Total gradient norm before clipping, when clipping is on.
    grad_norm: Option<f64>,
}

/// Adds a micro-batch's loss sum, detached from its graph, to this window's running sum.
fn add_detached(sum: &mut Option<Tensor>, loss_sum: &Tensor) -> Result<()> {
    let detached = loss_sum.detach();
    *sum = Some(match sum.take() {
        None => detached,
        Some(acc_sum) => (acc_sum + detached)?,
    });
    Ok(())
}

/// The optimizer step; a real one (not skipped by the fp16 scaler) moves the schedule and the learning rate.
fn optimizer_step<M, D>(rt: &mut Runtime<M, D>) -> Result<()> {
    let stepped = rt.optimizer.step()?;
    if stepped {
        // Only real optimizer steps move the schedule (not fp16-skipped ones).
        if let Some(s) = &rt.scheduler {
            let mut s = crate::lock(s);
            s.step();
            rt.optimizer.set_learning_rate(s.lr());
        }
    }
    Ok(())
}

/// The step arithmetic of one `train()` call (HF's; see the module documentation).
struct StepPlan {
    /// Micro-batches per optimizer step (`gradient_accumulation_steps`).
    ga: usize,
    /// Processes in the job.
    world: usize,
    /// Data-parallel ranks (tensor- and pipeline-parallel peers train on the same batches).
    dp: usize,
    /// Samples of one micro-batch over all data-parallel ranks (the loader's global batch).
    micro_global: usize,
    /// The loader's `split_batches`.
    split_batches: bool,
    /// Micro-batches per epoch on this process.
    loader_len: usize,
    /// Optimizer steps per epoch.
    upe: u64,
    max_steps: u64,
    num_epochs: u64,
}

impl StepPlan {
    /// This run's layout, as a checkpoint is checked against it.
    fn layout(&self) -> checkpoint::RunLayout {
        checkpoint::RunLayout {
            world_size: self.world,
            data_parallel_size: self.dp,
            per_device_batch: self.micro_global / self.dp.max(1),
            gradient_accumulation_steps: self.ga,
            steps_per_epoch: self.upe,
            split_batches: self.split_batches,
        }
    }
}

/// Where training starts: epochs already done, micro-batches of the next epoch to skip, the restored loss tally
/// (all zero for a fresh run).
#[derive(Default)]
struct StartPoint {
    epochs_trained: u64,
    skip_micro: usize,
    since_log: LossTally,
}

/// What the loop carries from step to step: the loss sums, which stay on the device until a log needs them (as
/// HF's `tr_loss`; restored on resume), and the newest gradient norm.
struct Progress {
    since_log: LossTally,
    last_grad_norm: Option<f64>,
}

/// The next optimizer step's window: up to `ga` micro-batches, fewer at the end of the epoch, `None` once the
/// epoch has ended.
fn next_window(iter: &mut impl Iterator<Item = accel::Result<Batch>>, ga: usize) -> Result<Option<Vec<Batch>>> {
    let mut window: Vec<Batch> = Vec::with_capacity(ga);
    for _ in 0..ga {
        match iter.next() {
            Some(b) => window.push(b?),
            None => break,
        }
    }
    Ok((!window.is_empty()).then_some(window))
}

/// This rank's training-loss tally from a checkpoint's: its own, by rank, when the saving run had this layout
/// (the sums continue bit for bit); otherwise the saved run's totals shared out for this layout — each replica's
/// sums counted once (÷ the saved pp × tp), then spread so that this run's ranks add up to them × its pp × tp, the
/// weight its own steps' tallies carry (the train loss is Σ sums ÷ Σ items over all ranks).
fn restored_tally(saved: &TrainerState, acc: &Accelerator) -> Option<LossTallyState> {
    let (world, here) = (acc.world_size(), acc.mesh().model_parallel().world_size() as f64);
    let same_layout = saved.loss_tally.len() == world
        && saved.model_parallel_size.is_none_or(|r| r as f64 == here)
        && saved.world_size.is_none_or(|w| w as usize == world);
    if same_layout {
        return saved.loss_tally.get(acc.rank()).copied();
    }
    let there = saved.model_parallel_size.unwrap_or(1).max(1) as f64;
    let share = here / (there * world as f64);
    let total = |f: fn(&LossTallyState) -> f64| saved.loss_tally.iter().map(f).sum::<f64>() * share;
    Some(LossTallyState {
        sum: total(|t| t.sum),
        items: total(|t| t.items),
        steps: saved.loss_tally.first()?.steps,
        run_sum: total(|t| t.run_sum),
        run_items: total(|t| t.run_items),
    })
}

/// Training-loss sums: on the device between logs (one small add per step, no host sync), on the host for the
/// whole run.
#[derive(Default)]
struct LossTally {
    /// This rank's loss sum since the last log (loss dtype, on the device).
    sum: Option<Tensor>,
    /// This rank's item count since the last log.
    items: f64,
    /// Optimizer steps since the last log.
    steps: u64,
    /// This rank's loss sum and item count of the whole run, up to the last log.
    run_sum: f64,
    run_items: f64,
    /// The since-log sum restored from a checkpoint, until the first step after the resume puts it on the device
    /// (in the loss's dtype, where it came from, so the sums continue bit for bit).
    restored_sum: Option<f64>,
    /// The newest step's loss sum and item count, not yet checked for finiteness.
    pending: Option<(Tensor, f64)>,
    /// (global step, this rank's mean loss) of the newest step with a finite loss.
    last_finite: Option<(u64, f64)>,
}

impl LossTally {
    /// A tally continuing from a checkpoint's.
    fn restored(t: &LossTallyState) -> Self {
        LossTally {
            items: t.items,
            steps: t.steps,
            run_sum: t.run_sum,
            run_items: t.run_items,
            restored_sum: (t.steps > 0).then_some(t.sum),
            ..Default::default()
        }
    }

    fn add(&mut self, loss_sum: Tensor, items: f64) -> Result<()> {
        self.pending = Some((loss_sum.clone(), items));
        self.sum = Some(match (self.sum.take(), self.restored_sum.take()) {
            (Some(s), _) => (s + loss_sum)?,
            (None, Some(r)) => {
                (Tensor::new(r, loss_sum.device())?.to_dtype(loss_sum.dtype())?.reshape(loss_sum.shape())? + loss_sum)?
            }
            (None, None) => loss_sum,
        });
        self.items += items;
        self.steps += 1;
        Ok(())
    }

    /// This rank's since-log loss sum as a host value (reads the device once).
    fn current_sum(&self) -> Result<f64> {
        Ok(match &self.sum {
            Some(s) => s.to_dtype(DType::F64)?.to_scalar::<f64>()?,
            None => self.restored_sum.unwrap_or(0.0),
        })
    }

    /// Every rank's tally, indexed by rank (for the checkpoint). Collective when distributed: each rank fills its
    /// own slot of a zero vector, so the all-reduce sum carries the values exactly.
    fn gather(&self, acc: &Accelerator) -> Result<Vec<LossTallyState>> {
        const N: usize = 5;
        let (rank, world) = (acc.rank(), acc.world_size());
        let mut buf = vec![0.0; N * world];
        buf[rank * N..(rank + 1) * N].copy_from_slice(&[
            self.current_sum()?,
            self.items,
            self.steps as f64,
            self.run_sum,
            self.run_items,
        ]);
        if world > 1 {
            acc.process_group().all_reduce(&mut buf, accel::dist::ReduceOp::Sum)?;
        }
        Ok(buf
            .chunks(N)
            .map(|c| LossTallyState { sum: c[0], items: c[1], steps: c[2] as u64, run_sum: c[3], run_items: c[4] })
            .collect())
    }

    /// Moves the since-log sums into the run totals; returns them (this rank's sum, items).
    fn flush(&mut self) -> Result<(f64, f64)> {
        let sum = self.current_sum()?;
        self.sum = None;
        self.restored_sum = None;
        let items = std::mem::take(&mut self.items);
        self.steps = 0;
        self.run_sum += sum;
        self.run_items += items;
        Ok((sum, items))
    }

    /// The item-weighted mean loss over all ranks since the last log, and resets it. Collective (one all-reduce
    /// of (sum, count) when distributed): every rank calls it at the same steps.
    fn log_mean(&mut self, acc: &Accelerator) -> Result<Option<f64>> {
        let (sum, items) = self.flush()?;
        global_mean(acc, sum, items)
    }

    /// The item-weighted mean loss over all ranks and the whole run (call [`Self::flush`] first). Collective.
    fn run_mean(&self, acc: &Accelerator) -> Result<Option<f64>> {
        global_mean(acc, self.run_sum, self.run_items)
    }
}

/// `Σ sum / Σ items` over ranks (`None` when there are no items anywhere).
fn global_mean(acc: &Accelerator, sum: f64, items: f64) -> Result<Option<f64>> {
    let mut buf = [sum, items];
    if acc.world_size() > 1 {
        acc.process_group().all_reduce(&mut buf, accel::dist::ReduceOp::Sum)?;
    }
    Ok((buf[1] > 0.0).then(|| buf[0] / buf[1]))
}

/// Turns one rank's outcome into every rank's: when any rank failed, the others fail too (instead of waiting
/// in the next collective until the timeout). One all-reduce of a flag when distributed.
fn agree<T>(acc: &Accelerator, local: Result<T>, what: &str) -> Result<T> {
    if acc.world_size() == 1 {
        return local;
    }
    let mut flag = [if local.is_err() { 1.0 } else { 0.0 }];
    acc.process_group().all_reduce(&mut flag, accel::dist::ReduceOp::Sum)?;
    match local {
        Ok(_) if flag[0] > 0.0 => Err(TrainerError::Usage(format!(
            "{what} failed on another process (its error says why); rank {} stops too",
            acc.rank()
        ))),
        other => other,
    }
}

/// Why a checkpoint's run had already finished (`None` when it can go on): all `max_steps` done, or a callback
/// (early stopping) stopped it.
fn already_ended(saved: &TrainerState, max_steps: u64) -> Option<String> {
    if saved.global_step >= max_steps {
        return Some(format!("all {max_steps} optimizer steps were done"));
    }
    let control = saved.stateful_callbacks.get("TrainerControl").map(TrainerControl::from_state)?;
    if !control.should_training_stop {
        return None;
    }
    let early = saved.stateful_callbacks.get("EarlyStoppingCallback").and_then(|st| {
        let counter = st.attributes.get("early_stopping_patience_counter")?.as_u64()?;
        let patience = st.args.get("early_stopping_patience")?.as_u64()?;
        (counter >= patience).then(|| {
            format!(
                "early stopping: the best-model metric did not improve for {counter} evaluation(s) \
                 (early_stopping_patience {patience}); best {} at step {}",
                saved.best_metric.map(|m| format!("{m:.6}")).unwrap_or_else(|| "-".into()),
                saved.best_global_step.map(|s| s.to_string()).unwrap_or_else(|| "-".into())
            )
        })
    });
    Some(early.unwrap_or_else(|| "a callback set should_training_stop".into()))
}

/// The running program's name, for the run banner (`train_gpt: config …`).
fn program_name() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "trainer".into())
}
