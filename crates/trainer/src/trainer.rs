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

mod loss_tally;
mod resume;
mod setup;
mod step;

use loss_tally::*;
use resume::*;
use step::*;

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
                let then = match self.args.save_strategy {
                    SaveStrategy::No => "",
                    _ => " (the launcher restarts this job's workers, which then resume from the newest one)",
                };
                rt.acc.print(format!(
                    "resume_from_checkpoint is \"latest\" and {} holds no checkpoint yet: training from the \
                     start{then}",
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

/// What the loop carries from step to step: the loss sums, which stay on the device until a log needs them (as
/// HF's `tr_loss`; restored on resume), and the newest gradient norm.
struct Progress {
    since_log: LossTally,
    last_grad_norm: Option<f64>,
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

/// The running program's name, for the run banner (`train_gpt: config …`).
fn program_name() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "trainer".into())
}
