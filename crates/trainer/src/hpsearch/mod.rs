//! Hyperparameter search (HF's `Trainer.hyperparameter_search` with Optuna's vocabulary): a [`SearchSpace`] of
//! float (linear / log), int and categorical parameters, a sampler ([`SamplerConfig`]: random, grid, TPE), a
//! pruner fed by the Trainer's evaluations ([`PrunerConfig`]: median, asynchronous successive halving), trials
//! run several at a time under a process budget (each trial one process or a data-parallel group started by
//! ddp-core's launcher), and a resumable study file.
//!
//! ```no_run
//! use trainer::hpsearch::{Distribution, HyperparameterSearch, SearchSpace};
//! use trainer::{losses, metrics, Trainer, TrainingArguments};
//! # fn data() -> accel::data::TensorDataset { unimplemented!() }
//! # fn main() -> trainer::Result<()> {
//! let space = SearchSpace::new()
//!     .add("learning_rate", Distribution::log_float(1e-4, 1e-2))  // a TrainingArguments field
//!     .add("hidden", Distribution::log_int(32, 512));              // a user parameter
//! let search = HyperparameterSearch::new(space, "eval_accuracy").n_trials(20).processes(4);
//! // model_init style: every trial builds a fresh Trainer (fresh weights) from its parameters. In the driver
//! // this returns the study's summary; in a trial's own process (the study re-runs this program) it runs that
//! // one trial and returns None.
//! let summary = search.run_trainer(|trial| {
//!     let args = trial.training_args(&TrainingArguments::default())?;  // output_dir = the trial's own
//!     let hidden = trial.get_usize("hidden")?;
//!     Ok(Trainer::new(args, move |vb| candle_nn::linear(784, hidden, vb.pp("fc")), data(), Some(data()),
//!                     losses::cross_entropy).compute_metrics(metrics::classification))
//! })?;
//! if let Some(s) = summary { println!("{}", s.table()); }
//! # Ok(()) }
//! ```
//!
//! **Trials and processes.** The process that calls [`HyperparameterSearch::run`] is the *driver*: it samples
//! each trial's parameters, appends them to the study file and, by default, starts the trial as
//! `processes_per_trial` copies of the current program through [`accel::dist::launch`] (port 0: every trial's
//! store gets its own free port; the trial's output goes to `trial-N/logs/rank{r}.log`). The copies find the
//! trial in their environment (`ACCEL_HP_STUDY`, `ACCEL_HP_TRIAL`), run the same `run` call, which executes that
//! one trial and returns `None`. At most `processes / processes_per_trial` trials run at once, and every trial
//! process gets `RAYON_NUM_THREADS = OMP_NUM_THREADS = max(1, cores / processes)` (unless the environment sets
//! them), so the budget never oversubscribes the machine. [`HyperparameterSearch::in_process`] runs trials as
//! threads of the driver instead (one process per trial, sharing the driver's thread pool; what the tests use).
//!
//! **Results.** A trial that fails (error, panic, non-zero exit) is recorded as failed with its error and the
//! study goes on. Every trial has its own `study_dir/trial-NNNN` output directory. At the end the driver prints
//! a table, writes `study_dir/hp_search.{png,svg}` (objective per trial with the running best; each trial's
//! reported metric against the step, pruned ones marked), keeps only the best trial's checkpoints and prints its
//! path.
//!
//! **Resuming.** The study file (`study_dir/study.jsonl`, see [`study`]) is appended as things happen; running
//! the same search again with the same `study_dir` keeps the finished trials, re-runs the interrupted ones with
//! their recorded parameters and samples new ones from the recorded history (same seed → same draws for a
//! sequential study). As with Optuna's `study.optimize(n_trials=N)`, `n_trials` counts the trials *this run*
//! starts: a resumed study runs N more (its interrupted trials first, counted among them); a grid stops at its
//! last point. The driver's first line says which: `[hp] new study …: running 20 trial(s) (0–19)`, `[hp] resuming
//! …: 20 finished trial(s) kept; running 20 more …: 20 new: 20–39`, or `… nothing left to run: …`.
//!
//! The TPE sampler is the [`tpe`] crate; random and grid sampling, the pruners, the study file and the
//! scheduling are ours (the Rust crates with TPE have none of them). See [`sampler`] for what we add to `tpe`.

#[cfg(feature = "plots")]
#[cfg_attr(docsrs, doc(cfg(feature = "plots")))]
pub mod plot;
pub mod pruner;
pub mod sampler;
pub mod space;
pub mod study;

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use accel::data::Dataset;
use candle_core::ModuleT;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use pruner::PrunerConfig;
pub use sampler::SamplerConfig;
pub use space::{apply_params, Distribution, Params, SearchSpace};
pub use study::{Journal, Record, StudyView, TrialRecord, TrialState};

use crate::args::TrainingArguments;
use crate::callbacks::{CallbackContext, TrainerCallback, TrainerControl};
use crate::error::{Result, TrainerError};
use crate::metrics::Metrics;
use crate::trainer::Trainer;

/// Environment variable naming the study file, set for a trial's processes.
pub const STUDY_ENV: &str = "ACCEL_HP_STUDY";
/// Environment variable with the trial number, set for a trial's processes.
pub const TRIAL_ENV: &str = "ACCEL_HP_TRIAL";
/// Name of the study file in `study_dir`.
pub const STUDY_FILE: &str = "study.jsonl";

/// Whether the objective is minimised or maximised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Lower is better (losses).
    Minimize,
    /// Higher is better (accuracy).
    Maximize,
}

impl Direction {
    /// HF's rule: minimise names ending in "loss", maximise the others.
    pub fn for_metric(metric: &str) -> Self {
        if metric.ends_with("loss") {
            Direction::Minimize
        } else {
            Direction::Maximize
        }
    }

    /// Whether `a` is strictly better than `b`.
    pub fn better(self, a: f64, b: f64) -> bool {
        match self {
            Direction::Maximize => a > b,
            Direction::Minimize => a < b,
        }
    }

    /// The value as a loss (the samplers minimise).
    fn as_loss(self, v: f64) -> f64 {
        match self {
            Direction::Maximize => -v,
            Direction::Minimize => v,
        }
    }
}

/// What a study searches and how; written as the study file's first line and checked on resume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StudyConfig {
    /// The objective's metric, with the `eval_` prefix for Trainer metrics (e.g. `eval_accuracy`).
    pub metric: String,
    /// Minimise or maximise it.
    pub direction: Direction,
    /// The parameters.
    pub space: SearchSpace,
    /// How new trials are drawn.
    pub sampler: SamplerConfig,
    /// When running trials stop.
    pub pruner: PrunerConfig,
}

/// A search file (`hp.yaml`):
///
/// ```yaml
/// metric: eval_accuracy        # "eval_" optional; direction defaults from the name (…loss: minimize)
/// direction: maximize
/// n_trials: 20
/// processes: 4                 # process budget: trials running at once × processes per trial
/// processes_per_trial: 1
/// study_dir: runs/hp_mnist
/// sampler: {type: tpe, seed: 0, n_startup_trials: 8}
/// pruner: {type: median, n_startup_trials: 4}
/// params:
///   learning_rate: {type: float, low: 1.0e-4, high: 3.0e-2, log: true}
///   weight_decay: {type: float, low: 0.0, high: 0.1}
///   hidden: {type: int, low: 32, high: 512, log: true}
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchFile {
    /// Objective metric (default `eval_loss`).
    #[serde(default)]
    pub metric: Option<String>,
    /// Direction (default from the metric's name).
    #[serde(default)]
    pub direction: Option<Direction>,
    /// Trials each run of the search starts (default 10): a resumed study runs this many more (Optuna's
    /// `optimize(n_trials=N)`).
    #[serde(default)]
    pub n_trials: Option<usize>,
    /// Process budget (default 1).
    #[serde(default)]
    pub processes: Option<usize>,
    /// Processes per trial (default 1).
    #[serde(default)]
    pub processes_per_trial: Option<usize>,
    /// Study directory (default `hp_search`).
    #[serde(default)]
    pub study_dir: Option<PathBuf>,
    /// Sampler (default TPE, seed 0).
    #[serde(default)]
    pub sampler: SamplerConfig,
    /// Pruner (default median).
    #[serde(default)]
    pub pruner: PrunerConfig,
    /// The search space.
    pub params: SearchSpace,
}

/// How trials are run.
#[derive(Debug, Clone, PartialEq)]
enum Launch {
    /// Threads of the driver, one process each.
    InProcess,
    /// Copies of `program` started by ddp-core's launcher (`None`: the current executable and arguments).
    Subprocess { program: Option<PathBuf>, args: Option<Vec<String>> },
}

/// A hyperparameter search (builder). See the module documentation.
#[derive(Debug, Clone)]
pub struct HyperparameterSearch {
    config: StudyConfig,
    n_trials: usize,
    study_dir: PathBuf,
    processes: usize,
    processes_per_trial: usize,
    launch: Launch,
    enqueued: Vec<Params>,
    keep_only_best_checkpoint: bool,
    plots: bool,
    verbose: bool,
}

/// `eval_` + the name unless it already has the prefix.
fn eval_key(metric: &str) -> String {
    if metric.starts_with("eval_") {
        metric.to_string()
    } else {
        format!("eval_{metric}")
    }
}

impl HyperparameterSearch {
    /// A search over `space` optimising `metric` (`"eval_accuracy"` or `"accuracy"`: the Trainer's evaluation
    /// metric; the direction follows HF's rule, see [`Direction::for_metric`]). Defaults: 10 trials, TPE with
    /// seed 0, median pruner, one process, `study_dir = "hp_search"`, trials in their own processes.
    pub fn new(space: SearchSpace, metric: &str) -> Self {
        let metric = eval_key(metric);
        HyperparameterSearch {
            config: StudyConfig {
                direction: Direction::for_metric(&metric),
                metric,
                space,
                sampler: SamplerConfig::default(),
                pruner: PrunerConfig::default(),
            },
            n_trials: 10,
            study_dir: PathBuf::from("hp_search"),
            processes: 1,
            processes_per_trial: 1,
            launch: Launch::Subprocess { program: None, args: None },
            enqueued: Vec::new(),
            keep_only_best_checkpoint: true,
            plots: cfg!(feature = "plots"),
            verbose: true,
        }
    }

    /// Reads a search file (see [`SearchFile`]); errors name the file and the key.
    pub fn from_yaml_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| TrainerError::ConfigFile { path: path.to_path_buf(), reason: e.to_string() })?;
        let (f, _): (SearchFile, _) = crate::config_file::parse(path, &text, &|_| None)?;
        Ok(Self::from_search_file(f))
    }

    /// The search a [`SearchFile`] describes.
    pub fn from_search_file(f: SearchFile) -> Self {
        let mut s = Self::new(f.params, f.metric.as_deref().unwrap_or("eval_loss"));
        if let Some(d) = f.direction {
            s.config.direction = d;
        }
        s.config.sampler = f.sampler;
        s.config.pruner = f.pruner;
        s.n_trials = f.n_trials.unwrap_or(s.n_trials);
        s.processes = f.processes.unwrap_or(s.processes);
        s.processes_per_trial = f.processes_per_trial.unwrap_or(s.processes_per_trial);
        if let Some(d) = f.study_dir {
            s.study_dir = d;
        }
        s
    }

    /// Minimise or maximise.
    pub fn direction(mut self, d: Direction) -> Self {
        self.config.direction = d;
        self
    }

    /// Trials this run of the study starts, as Optuna's `study.optimize(n_trials=N)`: `n` for a new study, `n`
    /// more for a resumed one (its interrupted trials re-run first and count among them). A grid sampler runs at
    /// most its points not yet tried; 0 runs nothing (the summary then shows the study as it stands). Default 10.
    pub fn n_trials(mut self, n: usize) -> Self {
        self.n_trials = n;
        self
    }

    /// The sampler.
    pub fn sampler(mut self, s: SamplerConfig) -> Self {
        self.config.sampler = s;
        self
    }

    /// The pruner.
    pub fn pruner(mut self, p: PrunerConfig) -> Self {
        self.config.pruner = p;
        self
    }

    /// Where the study file and the trials' output directories go.
    pub fn study_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.study_dir = dir.into();
        self
    }

    /// The process budget: at most this many trial processes at once (default 1).
    pub fn processes(mut self, n: usize) -> Self {
        self.processes = n.max(1);
        self
    }

    /// Processes of each trial (data parallel through ddp-core's launcher; default 1).
    pub fn processes_per_trial(mut self, n: usize) -> Self {
        self.processes_per_trial = n.max(1);
        self
    }

    /// Runs trials as threads of this process (one process each) instead of launched processes.
    pub fn in_process(mut self) -> Self {
        self.launch = Launch::InProcess;
        self
    }

    /// Starts trial processes as `program args…` instead of the current executable with its arguments (the
    /// program must reach the same `run` call).
    pub fn trial_command(mut self, program: impl Into<PathBuf>, args: Vec<String>) -> Self {
        self.launch = Launch::Subprocess { program: Some(program.into()), args: Some(args) };
        self
    }

    /// Fixes the parameters of the next trial not yet enqueued (Optuna's `enqueue_trial`): trial `k` takes the
    /// `k`-th enqueued set; parameters it lacks are sampled. E.g. the current defaults, as a baseline.
    pub fn enqueue_trial(mut self, params: Params) -> Self {
        self.enqueued.push(params);
        self
    }

    /// Whether the checkpoints of all but the best trial are deleted at the end (default true).
    pub fn keep_only_best_checkpoint(mut self, yes: bool) -> Self {
        self.keep_only_best_checkpoint = yes;
        self
    }

    /// Whether `hp_search.{png,svg}` is written (default: when the crate is built with its feature `plots`; asking
    /// for plots in a build without it is an error when the search starts).
    pub fn plots(mut self, yes: bool) -> Self {
        self.plots = yes;
        self
    }

    /// Whether the driver prints a line per trial and the final table (default true).
    pub fn verbose(mut self, yes: bool) -> Self {
        self.verbose = yes;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &StudyConfig {
        &self.config
    }

    /// The study file.
    pub fn study_file(&self) -> PathBuf {
        self.study_dir.join(STUDY_FILE)
    }

    /// Runs the study with a Trainer per trial: `build` makes a fresh Trainer from the trial's parameters (use
    /// [`Trial::training_args`] for the arguments), the search adds a callback reporting every evaluation's
    /// metric to the pruner, trains, and takes the objective from the best (with `metric_for_best_model` = the
    /// study's metric) or last evaluation. The best checkpoint (or the final weights) is the trial's checkpoint.
    ///
    /// Returns the summary in the driver, `None` in a trial's own process. Errors: a bad search space or study
    /// file (a resumed study with another configuration); a trial's failure is recorded, not returned (except in
    /// the trial's own process, which then exits non-zero).
    pub fn run_trainer<M, D, B>(&self, build: B) -> Result<Option<StudySummary>>
    where
        M: ModuleT + 'static,
        D: Dataset + 'static,
        B: Fn(&Trial) -> Result<Trainer<M, D>> + Sync,
    {
        self.run(|trial| {
            let trainer = build(trial)?;
            train_trial(trial, trainer)
        })
    }

    /// Runs the study with any objective: it gets the [`Trial`] (parameters, [`Trial::report`] for pruning) and
    /// returns the value to optimise. See [`Self::run_trainer`] for the return value.
    pub fn run<F>(&self, objective: F) -> Result<Option<StudySummary>>
    where
        F: Fn(&mut Trial) -> Result<f64> + Sync,
    {
        if let Some((study, number)) = worker_env() {
            self.run_worker(&study, number, &objective)?;
            return Ok(None);
        }
        self.drive(&objective).map(Some)
    }

    /// In a trial's process: runs that trial from the study file.
    fn run_worker<F>(&self, study: &Path, number: u64, objective: &F) -> Result<()>
    where
        F: Fn(&mut Trial) -> Result<f64> + Sync,
    {
        let journal = Journal::new(study);
        let view = journal.load()?;
        let config = view.config.clone().ok_or_else(|| {
            TrainerError::Usage(format!("{STUDY_ENV}={}: the study file has no configuration line", study.display()))
        })?;
        let rec = view.trials.get(&number).ok_or_else(|| {
            TrainerError::Usage(format!("{TRIAL_ENV}={number}: no such trial in {}", study.display()))
        })?;
        // The launcher gave this process its place in the trial's job (a lone process: rank 0 of 1).
        let (rank, world_size, master_port) = match accel::dist::env::DistEnv::detect_from_env() {
            Ok(Some(env)) => (env.rank, env.world_size, Some(env.master_port)),
            _ => (0, 1, None),
        };
        let trial = Trial::new(
            journal.clone(),
            Arc::new(config),
            number,
            rec.params.clone(),
            rec.output_dir.clone(),
            rank,
            world_size,
            master_port,
        );
        run_trial(trial, objective)
    }

    /// The driver: samples, schedules and records trials; prints and plots the results.
    fn drive<F>(&self, objective: &F) -> Result<StudySummary>
    where
        F: Fn(&mut Trial) -> Result<f64> + Sync,
    {
        let started = Instant::now();
        self.config.space.validate()?;
        if self.plots && !cfg!(feature = "plots") {
            return Err(TrainerError::invalid(
                "plots",
                "built without feature `plots` of crate trainer: enable it in Cargo.toml, or set plots(false)",
            ));
        }
        let study_dir = self.create_study_dir()?;
        let journal = Journal::new(study_dir.join(STUDY_FILE));
        let view = self.open_journal(&journal)?;
        // Enqueued trials (a baseline) come before a grid's points and do not use one up.
        let grid = self
            .config
            .sampler
            .capacity(&self.config.space)
            .map(|points| GridSize { points, enqueued: self.enqueued.len() });
        let mut queue = TrialQueue::new(&view, self.n_trials, grid.map(|g| g.points + g.enqueued));
        self.say(plan_line(journal.path(), &view, &queue, self.n_trials, grid));
        let planned = queue.left;
        let (slots, threads) = self.parallelism();
        let interrupted = AtomicBool::new(false);
        let pool = TrialPool {
            journal: &journal,
            study_dir: &study_dir,
            config: Arc::new(self.config.clone()),
            threads,
            interrupted: &interrupted,
        };
        self.run_trials(objective, &pool, &mut queue, slots)?;
        let run_now = planned - queue.left;
        if interrupted.load(Ordering::SeqCst) {
            return Err(TrainerError::Usage(format!(
                "the study was interrupted; run the same search again to resume it from {}",
                journal.path().display()
            )));
        }
        self.summarise(&journal, &study_dir, started, run_now)
    }

    /// Creates the study directory and returns its canonical path (the trials' directories are made from it).
    fn create_study_dir(&self) -> Result<PathBuf> {
        std::fs::create_dir_all(&self.study_dir)
            .map_err(|e| TrainerError::io(format!("creating the study directory {}", self.study_dir.display()), e))?;
        std::fs::canonicalize(&self.study_dir)
            .map_err(|e| TrainerError::io(format!("resolving {}", self.study_dir.display()), e))
    }

    /// Opens the study file: cuts a torn last line, then starts a new study (its configuration line) or checks
    /// that the existing one was written by this search; returns what the file holds.
    fn open_journal(&self, journal: &Journal) -> Result<StudyView> {
        if journal.repair()? {
            self.say(format!("[hp] {}: cut a torn last line (the study was killed)", journal.path().display()));
        }
        let view = journal.load()?;
        match &view.config {
            None => journal.append(&Record::Study { config: self.config.clone() })?,
            Some(c) if *c != self.config => {
                return Err(TrainerError::Usage(format!(
                    "the study file {} was written by a search with another configuration (space, metric, \
                     direction, sampler or pruner); use another study_dir, or the same search file to resume it.\n\
                     in the file: {}\nthis search: {}",
                    journal.path().display(),
                    serde_json::to_string(c).unwrap_or_default(),
                    serde_json::to_string(&self.config).unwrap_or_default()
                )))
            }
            Some(_) => {}
        }
        Ok(view)
    }

    /// (trials running at once, threads per trial process): the process budget split into trials, and the cores
    /// shared among their processes.
    fn parallelism(&self) -> (usize, usize) {
        let slots = (self.processes / self.processes_per_trial).max(1);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = (cores / (slots * self.processes_per_trial)).max(1);
        (slots, threads)
    }

    /// Runs the queued trials, at most `slots` at once, until all have ended or the study is interrupted.
    fn run_trials<'env, F>(
        &'env self,
        objective: &'env F,
        pool: &TrialPool<'env>,
        queue: &mut TrialQueue,
        slots: usize,
    ) -> Result<()>
    where
        F: Fn(&mut Trial) -> Result<f64> + Sync,
    {
        std::thread::scope(|scope| -> Result<()> {
            let (tx, rx) = std::sync::mpsc::channel::<TrialDone>();
            let mut running = 0usize;
            loop {
                while running < slots && !pool.interrupted.load(Ordering::SeqCst) {
                    let Some((number, params)) = self.next_trial(queue, pool.journal)? else { break };
                    let output_dir = self.start_trial(pool, number, &params)?;
                    running += 1;
                    self.spawn_trial(scope, objective, pool, number, params, output_dir, tx.clone())?;
                }
                if running == 0 {
                    return Ok(());
                }
                let (number, err) = rx.recv().expect("a running trial always reports back");
                running -= 1;
                self.record_trial_end(pool, number, err)?;
            }
        })
    }

    /// The next trial to start: a re-run of an interrupted one, else a new one sampled now; `None` when this run
    /// has started its `n_trials` (or the grid has no point left).
    fn next_trial(&self, queue: &mut TrialQueue, journal: &Journal) -> Result<Option<(u64, Params)>> {
        if queue.left == 0 {
            return Ok(None);
        }
        Ok(if let Some(t) = queue.rerun.pop() {
            queue.left -= 1;
            Some((t.number, t.params))
        } else if queue.end.is_none_or(|end| queue.next < end) {
            let n = queue.next;
            queue.next += 1;
            queue.left -= 1;
            Some((n, self.sample(journal, n)?))
        } else {
            None
        })
    }

    /// Gives trial `number` an empty directory (a re-run starts clean: stale checkpoints would be mistaken for
    /// this attempt's) and records its start in the study file.
    fn start_trial(&self, pool: &TrialPool<'_>, number: u64, params: &Params) -> Result<PathBuf> {
        let output_dir = pool.study_dir.join(format!("trial-{number:04}"));
        if output_dir.exists() {
            std::fs::remove_dir_all(&output_dir)
                .map_err(|e| TrainerError::io(format!("clearing {}", output_dir.display()), e))?;
        }
        std::fs::create_dir_all(&output_dir)
            .map_err(|e| TrainerError::io(format!("creating {}", output_dir.display()), e))?;
        pool.journal.append(&Record::TrialStart {
            trial: number,
            params: params.clone(),
            output_dir: output_dir.clone(),
        })?;
        self.say(format!("[hp] trial {number} started: {}", format_params(params)));
        Ok(output_dir)
    }

    /// Runs trial `number` on a thread of `scope` (in this process, or as its own processes started by
    /// ddp-core's launcher); the thread sends (number, error) on `tx` when the trial has ended.
    #[allow(clippy::too_many_arguments)]
    fn spawn_trial<'scope, 'env, F>(
        &'env self,
        scope: &'scope std::thread::Scope<'scope, 'env>,
        objective: &'env F,
        pool: &TrialPool<'env>,
        number: u64,
        params: Params,
        output_dir: PathBuf,
        tx: std::sync::mpsc::Sender<TrialDone>,
    ) -> Result<()>
    where
        F: Fn(&mut Trial) -> Result<f64> + Sync,
    {
        match &self.launch {
            Launch::InProcess => {
                let trial =
                    Trial::new(pool.journal.clone(), pool.config.clone(), number, params, output_dir, 0, 1, None);
                scope.spawn(move || {
                    let r = run_trial(trial, objective);
                    let _ = tx.send((number, r.err().map(|e| e.to_string())));
                });
            }
            Launch::Subprocess { program, args } => {
                let cfg = self.launch_config(program, args, pool.journal, number, &output_dir, pool.threads)?;
                let interrupted = pool.interrupted;
                scope.spawn(move || {
                    let _ = tx.send((number, launch_trial(&cfg, &output_dir, interrupted)));
                });
            }
        }
        Ok(())
    }

    /// After trial `number`'s thread has reported: records the failure of a trial whose processes died before
    /// writing their end (unless the study was interrupted), and says how the trial ended.
    fn record_trial_end(&self, pool: &TrialPool<'_>, number: u64, err: Option<String>) -> Result<()> {
        let view = pool.journal.load()?;
        let Some(t) = view.trials.get(&number) else { return Ok(()) };
        if !t.is_finished() && !pool.interrupted.load(Ordering::SeqCst) {
            pool.journal.append(&Record::TrialEnd {
                trial: number,
                state: TrialState::Failed,
                value: None,
                error: Some(err.unwrap_or_else(|| "the trial exited without recording a result".into())),
                checkpoint: None,
                master_port: None,
                world_size: self.processes_per_trial,
                wall_s: 0.0,
            })?;
        }
        let view = pool.journal.load()?;
        if let Some(t) = view.trials.get(&number) {
            self.say(format!("[hp] trial {number} {}", describe_end(t, &self.config.metric)));
        }
        Ok(())
    }

    /// The study's summary from its file: checkpoints pruned to the best one if asked, plots written, the table
    /// printed.
    fn summarise(&self, journal: &Journal, study_dir: &Path, started: Instant, run_now: usize) -> Result<StudySummary> {
        let view = journal.load()?;
        #[cfg_attr(not(feature = "plots"), allow(unused_mut))]
        let mut summary = StudySummary::new(&view, &self.config, journal.path().to_path_buf(), started.elapsed());
        summary.run_now = run_now;
        if self.keep_only_best_checkpoint {
            summary.prune_checkpoints();
        }
        #[cfg(feature = "plots")]
        if self.plots {
            match plot::plot_study(&summary, study_dir) {
                Ok(files) => summary.plots = files,
                Err(e) => tracing::warn!("could not plot the study: {e}"),
            }
        }
        #[cfg(not(feature = "plots"))]
        let _ = study_dir;
        if self.verbose {
            println!("{}", summary.table());
        }
        Ok(summary)
    }

    /// The parameters of new trial `number`: the enqueued ones, the rest from the sampler fed with the finished
    /// trials of the study file.
    fn sample(&self, journal: &Journal, number: u64) -> Result<Params> {
        let view = journal.load()?;
        let d = self.config.direction;
        let history: Vec<sampler::Observation> = view
            .trials
            .values()
            .filter_map(|t| {
                match (t.state, t.value) {
                    (TrialState::Complete, Some(v)) => Some(d.as_loss(v)),
                    (TrialState::Pruned, _) => Some(f64::INFINITY),
                    _ => None,
                }
                .map(|value| sampler::Observation { params: t.params.clone(), value })
            })
            .collect();
        // A grid maps a trial to a point by its number: trials after the enqueued ones take points 0, 1, … so that
        // an enqueued baseline does not hide a point.
        let point = match self.config.sampler {
            sampler::SamplerConfig::Grid { .. } => number.saturating_sub(self.enqueued.len() as u64),
            _ => number,
        };
        let mut params = self.config.sampler.sample(&self.config.space, point, &history)?;
        if let Some(fixed) = self.enqueued.get(number as usize) {
            params.extend(fixed.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        Ok(params)
    }

    fn launch_config(
        &self,
        program: &Option<PathBuf>,
        args: &Option<Vec<String>>,
        journal: &Journal,
        number: u64,
        output_dir: &Path,
        threads: usize,
    ) -> Result<accel::dist::LaunchConfig> {
        let program = match program {
            Some(p) => p.clone(),
            None => std::env::current_exe()
                .map_err(|e| TrainerError::io("locating this executable to launch the trials", e))?,
        };
        let args = args.clone().unwrap_or_else(|| std::env::args().skip(1).collect());
        let mut cfg = accel::dist::LaunchConfig::local(self.processes_per_trial, program, args);
        cfg.env.push((STUDY_ENV.into(), journal.path().display().to_string()));
        cfg.env.push((TRIAL_ENV.into(), number.to_string()));
        for var in ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"] {
            if std::env::var_os(var).is_none() {
                cfg.env.push((var.into(), threads.to_string()));
            }
        }
        cfg.log_dir = Some(output_dir.join("logs"));
        cfg.tee = false;
        Ok(cfg)
    }

    fn say(&self, line: String) {
        if self.verbose {
            println!("{line}");
        }
    }
}

/// What a trial's thread reports when the trial has ended: its number and, when it failed outside the
/// objective's own error handling, why.
type TrialDone = (u64, Option<String>);

/// The trials this run still starts: the interrupted ones of a resumed study first (re-run with their parameters,
/// in number order), then new numbers after the study's last one; `left` of them in all (Optuna's
/// `optimize(n_trials=N)`: N trials per run, however many the study already holds).
struct TrialQueue {
    /// Popped from the back.
    rerun: Vec<TrialRecord>,
    /// The next new trial's number.
    next: u64,
    /// Trials this run may still start.
    left: usize,
    /// New trial numbers stay below this: a grid's point count (a grid sampler maps trial `k` to its `k`-th point).
    end: Option<u64>,
}

impl TrialQueue {
    /// The queue of a run of `n_trials` trials over a study whose file holds `view`; `capacity` is the sampler's
    /// number of distinct points, if bounded.
    fn new(view: &StudyView, n_trials: usize, capacity: Option<usize>) -> Self {
        let mut rerun: Vec<TrialRecord> = view.in_state(TrialState::Running).cloned().collect();
        rerun.reverse();
        let next = view.trials.keys().next_back().map_or(0, |k| k + 1);
        let end = capacity.map(|c| c as u64);
        let new_possible = end.map_or(usize::MAX, |e| e.saturating_sub(next) as usize);
        let left = n_trials.min(rerun.len().saturating_add(new_possible));
        TrialQueue { rerun, next, left, end }
    }

    /// (interrupted trials re-run, new trials) this run will start, unless it is interrupted.
    fn planned(&self) -> (usize, usize) {
        let reruns = self.left.min(self.rerun.len());
        (reruns, self.left - reruns)
    }
}

/// The driver's first line: a new or resumed study, and which trials this run starts — or that nothing is left to
/// run, and why.
/// A grid study's size: its points, and the enqueued trials that run before them.
#[derive(Debug, Clone, Copy)]
struct GridSize {
    points: usize,
    enqueued: usize,
}

impl std::fmt::Display for GridSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} points", self.points)?;
        match self.enqueued {
            0 => Ok(()),
            n => write!(f, " and {n} enqueued trial(s)"),
        }
    }
}

fn plan_line(file: &Path, view: &StudyView, queue: &TrialQueue, n_trials: usize, grid: Option<GridSize>) -> String {
    let finished = view.trials.values().filter(|t| t.is_finished()).count();
    let interrupted = queue.rerun.len();
    let (reruns, new) = queue.planned();
    let numbers = |from: u64, count: usize| match count {
        0 => String::new(),
        1 => format!("{from}"),
        _ => format!("{from}–{}", from + count as u64 - 1),
    };
    let grid_note = match grid {
        Some(g) if reruns + new < n_trials => format!(" (the grid has {g}; n_trials was {n_trials})"),
        _ => String::new(),
    };
    if view.trials.is_empty() {
        return match new {
            0 if n_trials == 0 => format!("[hp] new study {}: nothing to run (n_trials is 0)", file.display()),
            0 => format!("[hp] new study {}: nothing to run{grid_note}", file.display()),
            _ => format!("[hp] new study {}: running {new} trial(s) ({}){grid_note}", file.display(), numbers(0, new)),
        };
    }
    let mut kept = format!("[hp] resuming {}: {finished} finished trial(s) kept", file.display());
    if interrupted > 0 {
        kept += &format!(", {interrupted} interrupted");
    }
    if reruns + new == 0 {
        // With n_trials > 0 only a grid can run out.
        let why = match grid {
            Some(g) if n_trials > 0 => format!("the grid's {g} have all been tried"),
            _ => "n_trials is 0".to_string(),
        };
        return format!("{kept}; nothing left to run: {why}");
    }
    let mut which = Vec::new();
    if reruns > 0 {
        let again: Vec<String> = queue.rerun.iter().rev().take(reruns).map(|t| t.number.to_string()).collect();
        which.push(format!("{} again", again.join(", ")));
    }
    if new > 0 {
        which.push(format!("{new} new: {}", numbers(queue.next, new)));
    }
    format!(
        "{kept}; running {} more (n_trials counts this run's trials, as Optuna's optimize(n_trials=N)): {}{grid_note}",
        reruns + new,
        which.join(", then ")
    )
}

/// What the driver shares with the trials it runs.
struct TrialPool<'a> {
    journal: &'a Journal,
    /// Canonical; the trials' directories are made in it.
    study_dir: &'a Path,
    config: Arc<StudyConfig>,
    /// Threads per trial process (`RAYON_NUM_THREADS` / `OMP_NUM_THREADS` unless set).
    threads: usize,
    /// Set when a trial's launcher was interrupted (Ctrl-C): no new trial starts.
    interrupted: &'a AtomicBool,
}

/// Runs one trial as its own processes (ddp-core's launcher) and returns its failure, if any, for the study
/// file; an interrupted launch sets `interrupted` instead.
fn launch_trial(cfg: &accel::dist::LaunchConfig, output_dir: &Path, interrupted: &AtomicBool) -> Option<String> {
    match accel::dist::launch(cfg) {
        Ok(()) => None,
        Err(accel::dist::DdpError::Interrupted { .. }) => {
            interrupted.store(true, Ordering::SeqCst);
            None
        }
        Err(e) => Some(format!(
            "{e} (its output: {})",
            accel::dist::launcher::log_path(&output_dir.join("logs"), 0).display()
        )),
    }
}

/// The trial a process was launched for (from [`STUDY_ENV`] and [`TRIAL_ENV`]).
fn worker_env() -> Option<(PathBuf, u64)> {
    let study = std::env::var_os(STUDY_ENV)?;
    let number = std::env::var(TRIAL_ENV).ok()?.parse().ok()?;
    Some((PathBuf::from(study), number))
}

fn format_value(v: &Value) -> String {
    match v {
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or_default();
            if f != 0.0 && (f.abs() < 1e-2 || f.abs() >= 1e4) {
                format!("{f:.3e}")
            } else {
                format!("{f:.4}")
            }
        }
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn format_params(p: &Params) -> String {
    p.iter().map(|(k, v)| format!("{k}={}", format_value(v))).collect::<Vec<_>>().join(" ")
}

fn describe_end(t: &TrialRecord, metric: &str) -> String {
    let value = t.value.map(|v| format!(" {metric}={v:.4}")).unwrap_or_default();
    let error = t.error.as_ref().map(|e| format!(": {e}")).unwrap_or_default();
    format!("{}{value} after {} report(s), {:.1} s{error}", t.state, t.reports.len(), t.wall_s)
}

/// Runs one trial and records its end (rank 0). Failures (errors, panics) are recorded and returned.
fn run_trial<F>(mut trial: Trial, objective: &F) -> Result<()>
where
    F: Fn(&mut Trial) -> Result<f64> + Sync,
{
    let start = Instant::now();
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| objective(&mut trial)));
    let wall_s = start.elapsed().as_secs_f64();
    let s = &trial.shared;
    let (state, value, error) = match &outcome {
        Ok(Ok(_)) if trial.is_pruned() => (TrialState::Pruned, trial.last_report(), None),
        Ok(Ok(v)) if v.is_finite() => (TrialState::Complete, Some(*v), None),
        Ok(Ok(v)) => (TrialState::Failed, None, Some(format!("the objective returned {v}"))),
        Ok(Err(e)) => (TrialState::Failed, None, Some(e.to_string())),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            (TrialState::Failed, None, Some(format!("the objective panicked: {msg}")))
        }
    };
    if s.rank == 0 {
        s.journal.append(&Record::TrialEnd {
            trial: s.number,
            state,
            value,
            error: error.clone(),
            checkpoint: s.checkpoint.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            master_port: s.master_port,
            world_size: s.world_size,
            wall_s,
        })?;
    }
    match (outcome, error) {
        (Ok(Err(e)), _) => Err(e),
        (_, Some(msg)) => Err(TrainerError::Callback { context: format!("trial {}", s.number), message: msg }),
        _ => Ok(()),
    }
}

/// Trains one trial's Trainer with the pruning callback; returns the objective.
fn train_trial<M, D>(trial: &mut Trial, trainer: Trainer<M, D>) -> Result<f64>
where
    M: ModuleT + 'static,
    D: Dataset + 'static,
{
    let metric = trial.shared.config.metric.clone();
    let mut trainer = trainer.callback(trial.pruning_callback()).without_banner();
    trainer.train()?;
    let state = trainer.state();
    let best =
        if trainer.args().best_metric_key().as_deref() == Some(metric.as_str()) { state.best_metric } else { None };
    let value = best
        .or_else(|| state.log_history.iter().rev().find_map(|e| e.values.get(&metric).copied()))
        .or_else(|| trial.last_report());
    let checkpoint = match state.best_model_checkpoint.clone() {
        Some(c) => PathBuf::from(c),
        None => trainer.save_model(None)?,
    };
    trial.set_checkpoint(checkpoint);
    value.ok_or_else(|| {
        TrainerError::Usage(format!(
            "trial {}: the Trainer never reported `{metric}`: set eval_strategy (and an eval dataset with \
             compute_metrics giving that metric)",
            trial.number()
        ))
    })
}

/// What a trial's objective shares with its pruning callback.
#[derive(Debug)]
struct TrialShared {
    journal: Journal,
    config: Arc<StudyConfig>,
    number: u64,
    params: Params,
    output_dir: PathBuf,
    rank: usize,
    world_size: usize,
    master_port: Option<u16>,
    pruned: AtomicBool,
    reports: AtomicU64,
    last_report: Mutex<Option<f64>>,
    checkpoint: Mutex<Option<PathBuf>>,
}

/// One trial, as its objective sees it: parameters, output directory, reporting.
#[derive(Debug, Clone)]
pub struct Trial {
    shared: Arc<TrialShared>,
}

/// How long ranks other than 0 wait for rank 0's pruning decision.
const DECISION_TIMEOUT: Duration = Duration::from_secs(600);

impl Trial {
    #[allow(clippy::too_many_arguments)]
    fn new(
        journal: Journal,
        config: Arc<StudyConfig>,
        number: u64,
        params: Params,
        output_dir: PathBuf,
        rank: usize,
        world_size: usize,
        master_port: Option<u16>,
    ) -> Self {
        Trial {
            shared: Arc::new(TrialShared {
                journal,
                config,
                number,
                params,
                output_dir,
                rank,
                world_size,
                master_port,
                pruned: AtomicBool::new(false),
                reports: AtomicU64::new(0),
                last_report: Mutex::new(None),
                checkpoint: Mutex::new(None),
            }),
        }
    }

    /// The trial's number (0, 1, ...).
    pub fn number(&self) -> u64 {
        self.shared.number
    }

    /// All parameters.
    pub fn params(&self) -> &Params {
        &self.shared.params
    }

    /// The trial's own output directory (`study_dir/trial-NNNN`).
    pub fn output_dir(&self) -> &Path {
        &self.shared.output_dir
    }

    /// This process's rank in the trial (0 for single-process trials).
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// Processes running the trial.
    pub fn world_size(&self) -> usize {
        self.shared.world_size
    }

    /// MASTER_PORT of the trial's process group, for launched trials.
    pub fn master_port(&self) -> Option<u16> {
        self.shared.master_port
    }

    /// A parameter's value.
    pub fn get(&self, name: &str) -> Result<&Value> {
        self.shared.params.get(name).ok_or_else(|| {
            TrainerError::Usage(format!(
                "trial {}: no parameter `{name}` in the search space (it has: {})",
                self.number(),
                self.shared.params.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        })
    }

    /// A numeric parameter.
    pub fn get_f64(&self, name: &str) -> Result<f64> {
        let v = self.get(name)?;
        v.as_f64().ok_or_else(|| TrainerError::Usage(format!("parameter `{name}` is {v}, not a number")))
    }

    /// An integer parameter.
    pub fn get_i64(&self, name: &str) -> Result<i64> {
        let v = self.get(name)?;
        v.as_i64().ok_or_else(|| TrainerError::Usage(format!("parameter `{name}` is {v}, not an integer")))
    }

    /// A non-negative integer parameter.
    pub fn get_usize(&self, name: &str) -> Result<usize> {
        let v = self.get(name)?;
        v.as_u64()
            .map(|u| u as usize)
            .ok_or_else(|| TrainerError::Usage(format!("parameter `{name}` is {v}, not a non-negative integer")))
    }

    /// A string parameter (categorical choice).
    pub fn get_str(&self, name: &str) -> Result<&str> {
        let v = self.get(name)?;
        v.as_str().ok_or_else(|| TrainerError::Usage(format!("parameter `{name}` is {v}, not a string")))
    }

    /// `base` with the parameters that name [`TrainingArguments`] fields applied ([`apply_params`]),
    /// `output_dir` set to the trial's own directory and `run_name` to `trial-N`.
    pub fn training_args(&self, base: &TrainingArguments) -> Result<TrainingArguments> {
        let mut args = apply_params(base, &self.shared.params)?;
        args.output_dir = self.shared.output_dir.clone();
        args.run_name = Some(format!("trial-{}", self.number()));
        Ok(args)
    }

    /// Reports an intermediate value (e.g. the evaluation metric at optimizer step `step`) and returns whether
    /// the pruner stops the trial. Collective for multi-process trials: every rank calls it at the same steps;
    /// rank 0 records the value and decides, the others read its decision (a file in the trial's directory).
    pub fn report(&self, step: u64, value: f64) -> Result<bool> {
        let s = &self.shared;
        let index = s.reports.fetch_add(1, Ordering::SeqCst);
        *s.last_report.lock().unwrap_or_else(|p| p.into_inner()) = value.is_finite().then_some(value);
        let decision_dir = s.output_dir.join(".hp_decisions");
        let decision_file = decision_dir.join(format!("report-{index}"));
        let prune = if s.rank == 0 {
            let value = value.is_finite().then_some(value);
            s.journal.append(&Record::Report { trial: s.number, step, value })?;
            let view = s.journal.load()?;
            let prune = s.config.pruner.should_prune(&view, s.number, s.config.direction);
            if s.world_size > 1 {
                std::fs::create_dir_all(&decision_dir)
                    .map_err(|e| TrainerError::io(format!("creating {}", decision_dir.display()), e))?;
                let tmp = decision_dir.join(format!("report-{index}.tmp"));
                std::fs::write(&tmp, if prune { "prune" } else { "continue" })
                    .and_then(|_| std::fs::rename(&tmp, &decision_file))
                    .map_err(|e| TrainerError::io(format!("writing {}", decision_file.display()), e))?;
            }
            prune
        } else {
            let start = Instant::now();
            loop {
                if let Ok(text) = std::fs::read_to_string(&decision_file) {
                    break text == "prune";
                }
                if start.elapsed() > DECISION_TIMEOUT {
                    return Err(TrainerError::Usage(format!(
                        "trial {}: rank 0's pruning decision {} did not appear within {:?}",
                        s.number,
                        decision_file.display(),
                        DECISION_TIMEOUT
                    )));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        if prune {
            s.pruned.store(true, Ordering::SeqCst);
        }
        Ok(prune)
    }

    /// Whether the pruner stopped the trial.
    pub fn is_pruned(&self) -> bool {
        self.shared.pruned.load(Ordering::SeqCst)
    }

    /// The last finite value reported.
    pub fn last_report(&self) -> Option<f64> {
        *self.shared.last_report.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the trial's checkpoint (kept if the trial is the best).
    pub fn set_checkpoint(&self, path: impl Into<PathBuf>) {
        *self.shared.checkpoint.lock().unwrap_or_else(|p| p.into_inner()) = Some(path.into());
    }

    /// A Trainer callback that reports the study's metric after every evaluation and stops training when the
    /// pruner says so.
    pub fn pruning_callback(&self) -> PruningCallback {
        PruningCallback { trial: self.clone() }
    }
}

/// Reports each evaluation's study metric to the [`Trial`] and sets `should_training_stop` when it is pruned.
#[derive(Debug, Clone)]
pub struct PruningCallback {
    trial: Trial,
}

impl TrainerCallback for PruningCallback {
    fn on_evaluate(&mut self, ctx: &CallbackContext, control: &mut TrainerControl, metrics: &Metrics) -> Result<()> {
        let key = &self.trial.shared.config.metric;
        let value = *metrics.get(key).ok_or_else(|| TrainerError::MissingMetric {
            name: key.clone(),
            available: metrics.keys().cloned().collect(),
        })?;
        if self.trial.report(ctx.state.global_step, value)? {
            control.should_training_stop = true;
        }
        Ok(())
    }
}

/// The outcome of a study.
#[derive(Debug, Clone)]
pub struct StudySummary {
    /// Every trial, by number.
    pub trials: Vec<TrialRecord>,
    /// The best complete trial.
    pub best: Option<TrialRecord>,
    /// The objective's metric.
    pub metric: String,
    /// Its direction.
    pub direction: Direction,
    /// The study file.
    pub study_file: PathBuf,
    /// The plots written.
    pub plots: Vec<PathBuf>,
    /// Wall time of this run of the driver, seconds.
    pub wall_s: f64,
    /// Trials this run of the driver started (re-runs of interrupted ones included); the others were already in
    /// the study file.
    pub run_now: usize,
}

impl StudySummary {
    fn new(view: &StudyView, config: &StudyConfig, study_file: PathBuf, wall: Duration) -> Self {
        let trials: Vec<TrialRecord> = view.trials.values().cloned().collect();
        let best = trials
            .iter()
            .filter(|t| t.state == TrialState::Complete)
            .filter_map(|t| t.value.map(|v| (t, v)))
            .reduce(|a, b| if config.direction.better(b.1, a.1) { b } else { a })
            .map(|(t, _)| t.clone());
        StudySummary {
            trials,
            best,
            metric: config.metric.clone(),
            direction: config.direction,
            study_file,
            plots: Vec::new(),
            wall_s: wall.as_secs_f64(),
            run_now: 0,
        }
    }

    /// Trial `number`.
    pub fn trial(&self, number: u64) -> Option<&TrialRecord> {
        self.trials.iter().find(|t| t.number == number)
    }

    /// How many trials are in `state`.
    pub fn count(&self, state: TrialState) -> usize {
        self.trials.iter().filter(|t| t.state == state).count()
    }

    /// Deletes the `checkpoint-*` directories of every trial but the best (their reports and logs stay).
    fn prune_checkpoints(&self) {
        let best = self.best.as_ref().map(|b| b.number);
        for t in self.trials.iter().filter(|t| Some(t.number) != best) {
            let Ok(entries) = std::fs::read_dir(&t.output_dir) else { continue };
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with("checkpoint-") && e.path().is_dir() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }

    /// The results table: one row per trial, then the best trial, its parameters and checkpoint.
    pub fn table(&self) -> String {
        let names: Vec<String> = {
            let mut n: Vec<String> = self.trials.iter().flat_map(|t| t.params.keys().cloned()).collect();
            n.sort();
            n.dedup();
            n
        };
        let metric_w = self.metric.len().max(10);
        let widths: Vec<usize> = names.iter().map(|n| n.len().max(10)).collect();
        let mut out = format!(
            "\nhyperparameter search: {} trials ({} complete, {} pruned, {} failed), {} of them run now in {:.1} s; \
             study file {}\n",
            self.trials.len(),
            self.count(TrialState::Complete),
            self.count(TrialState::Pruned),
            self.count(TrialState::Failed),
            self.run_now,
            self.wall_s,
            self.study_file.display()
        );
        out += &format!("{:>5}  {:<8}  {:>metric_w$}", "trial", "state", self.metric);
        for (n, w) in names.iter().zip(&widths) {
            out += &format!("  {n:>w$}");
        }
        out += &format!("  {:>7}  {:>7}\n", "reports", "wall_s");
        for t in &self.trials {
            let mark = if Some(t.number) == self.best.as_ref().map(|b| b.number) { "*" } else { " " };
            let value = t.value.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into());
            out += &format!("{:>4}{mark}  {:<8}  {value:>metric_w$}", t.number, t.state.to_string());
            for (n, w) in names.iter().zip(&widths) {
                let v = t.params.get(n).map(format_value).unwrap_or_else(|| "-".into());
                out += &format!("  {v:>w$}");
            }
            out += &format!("  {:>7}  {:>7.1}\n", t.reports.len(), t.wall_s);
            if let Some(e) = &t.error {
                out += &format!("       error: {}\n", e.lines().next().unwrap_or_default());
            }
        }
        match &self.best {
            Some(b) => {
                out += &format!(
                    "best trial {}: {} = {:.4}  ({})\n",
                    b.number,
                    self.metric,
                    b.value.unwrap_or(f64::NAN),
                    format_params(&b.params)
                );
                if let Some(c) = &b.checkpoint {
                    out += &format!("best checkpoint: {}\n", c.display());
                }
            }
            None => out += "no trial completed\n",
        }
        for p in &self.plots {
            out += &format!("plot: {}\n", p.display());
        }
        out
    }
}

impl<M: ModuleT + 'static, D: Dataset + 'static> Trainer<M, D> {
    /// HF's `Trainer.hyperparameter_search(hp_space, n_trials, direction)`, with `model_init`'s role played by
    /// `build`: every trial gets a fresh Trainer (fresh weights) built from its parameters. Optimises `metric`
    /// (e.g. `"eval_accuracy"`, an evaluation metric the Trainer logs) in `direction` over `n_trials` trials of
    /// `space` (n_trials more on a resumed study, as Optuna's `optimize`), with the default sampler (TPE), pruner
    /// (median) and a one-process budget; use [`HyperparameterSearch`] for everything else (samplers, pruners,
    /// process budget, study directory). Returns the study's summary in the driver and `None` in a trial's own
    /// process. Errors: as [`HyperparameterSearch::run_trainer`].
    pub fn hyperparameter_search<B>(
        space: SearchSpace,
        metric: &str,
        n_trials: usize,
        direction: Direction,
        build: B,
    ) -> Result<Option<StudySummary>>
    where
        B: Fn(&Trial) -> Result<Trainer<M, D>> + Sync,
    {
        HyperparameterSearch::new(space, metric).n_trials(n_trials).direction(direction).run_trainer(build)
    }
}

#[cfg(test)]
mod tests;
