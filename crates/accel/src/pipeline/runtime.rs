//! What the Accelerator keeps to train a model cut into pipeline stages, and the user-facing pieces of it:
//!
//! - [`Stage`] — one stage of the model on this rank (its index, the blocks it holds, first / last);
//! - [`StagedModel`] — the one method a model implements to be pipelined: the forward of one of its stages;
//! - `PipelineRuntime` — this rank's links, the schedule of the config (built once, so a shape that cannot run is
//!   an error when the Accelerator starts), the activation shapes agreed so far, and the step: the batch split
//!   into micro-batches, the schedule run ([`super::run_schedule`]), each micro-batch's loss scaled before its
//!   backward, the gradients handed to the step owner.
//!
//! Loss normalisation (torchtitan #1733, #2972): the user's loss function returns the *mean* loss of one
//! micro-batch; each is multiplied by `1 / m` (the mean over the step's `m` equal micro-batches), `1 / GA` and the
//! fp16 loss scale before its backward — exactly what `Accelerator::backward` does to a whole batch's mean loss —
//! and DDP averages over dp. So the step's gradient is the gradient of the mean over every item of the global
//! batch, as without pp, and gradients are never rescaled after.

use super::executor::{run_schedule, PipelineModel, ShapeBook};
use super::links::PipelineLinks;
use super::schedule::PipelineSchedule;
use super::schedule::ScheduleKind;
use super::stages::split_layers;
use crate::tensor_parallel::{with_dropout_context, DropoutContext};
use crate::{lock, AccelError, Result};
use candle_core::{DType, Tensor, Var};
use ddp_core::DeviceMesh;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// One pipeline stage held by this rank ([`crate::Accelerator::pipeline_stages`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    /// The stage's index, `0..num_stages` (stage `s` lives on pp rank `s mod pp`).
    pub index: usize,
    /// Stages in the whole pipeline (`pp × virtual stages`; 1 without pipeline parallelism).
    pub num_stages: usize,
    /// The model's blocks (layers) this stage holds, as indices of the single-process model.
    pub layers: Range<usize>,
}

impl Stage {
    /// Whether this stage holds the input side of the model (the embedding: it reads the micro-batch itself).
    pub fn is_first(&self) -> bool {
        self.index == 0
    }

    /// Whether this stage holds the output side (final norm and head: its output goes to the loss function).
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.num_stages
    }
}

/// A model cut into stages, as one rank holds it: the parts built for [`crate::Accelerator::pipeline_stages`].
pub trait StagedModel {
    /// The forward of stage `stage` (one of this rank's). `input`: the micro-batch's inputs on the first stage,
    /// the previous stage's output elsewhere (the same shape and dtype for every micro-batch of a step). The last
    /// stage returns what the loss function takes (the logits).
    fn stage_forward(&self, stage: usize, input: &Tensor) -> Result<Tensor>;
}

/// What the Accelerator keeps for pipeline steps (pp > 1 only).
pub(crate) struct PipelineRuntime {
    links: PipelineLinks,
    schedule: PipelineSchedule,
    pp_group: ddp_core::ProcessGroup,
    /// Whether the program asked for its stages (a program that never does builds the whole model on every
    /// rank: refused at `prepare_model`).
    stages_asked: AtomicBool,
    shapes: Mutex<AgreedShapes>,
    /// This rank's busy and elapsed time over the training steps run so far (the measured bubble).
    timing: Mutex<PipelineTiming>,
}

/// This rank's time in the pipeline's training steps so far ([`crate::Accelerator::pipeline_timing`]): the
/// measured bubble is `1 − busy / elapsed`, the part of each step this rank waited for its neighbours. Subtract two
/// readings for a window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PipelineTiming {
    /// Training steps (`pipeline_backward` calls) counted.
    pub steps: u64,
    /// Seconds this rank spent in its stages' forwards and backwards.
    pub busy_seconds: f64,
    /// Seconds from each step's start to its last action's end, summed.
    pub elapsed_seconds: f64,
}

impl PipelineTiming {
    /// The idle fraction of the steps, `1 − busy / elapsed` (0 with no step counted).
    pub fn bubble(&self) -> f64 {
        if self.elapsed_seconds > 0.0 {
            (1.0 - self.busy_seconds / self.elapsed_seconds).max(0.0)
        } else {
            0.0
        }
    }

    /// The steps between `earlier` and this reading.
    pub fn since(&self, earlier: &PipelineTiming) -> PipelineTiming {
        PipelineTiming {
            steps: self.steps - earlier.steps,
            busy_seconds: self.busy_seconds - earlier.busy_seconds,
            elapsed_seconds: self.elapsed_seconds - earlier.elapsed_seconds,
        }
    }
}

/// The activation shapes agreed over the links, for the micro-batch input shape they were agreed for (every rank
/// of the pp group reads the same batches, so all start a new book together when it changes).
#[derive(Default)]
struct AgreedShapes {
    input_dims: Vec<usize>,
    book: ShapeBook,
}

impl PipelineRuntime {
    /// This rank's pipeline timing so far.
    pub(crate) fn timing(&self) -> PipelineTiming {
        *lock(&self.timing)
    }

    /// The links over the mesh's pp group (collective over it) and the schedule `kind` with `microbatches` and
    /// `stages_per_rank`. Errors: a schedule that cannot run (micro-batches fewer than the stages, not a multiple
    /// of pp for interleaved, …), naming the config keys; the backend's, creating the links.
    pub(crate) fn new(
        mesh: &DeviceMesh,
        kind: ScheduleKind,
        microbatches: usize,
        stages_per_rank: usize,
    ) -> Result<Self> {
        let pp_group = mesh.pp().clone();
        let schedule = PipelineSchedule::new(kind, pp_group.world_size(), microbatches, stages_per_rank)?;
        Ok(PipelineRuntime {
            links: PipelineLinks::new(&pp_group)?,
            schedule,
            pp_group,
            stages_asked: AtomicBool::new(false),
            shapes: Mutex::new(AgreedShapes::default()),
            timing: Mutex::new(PipelineTiming::default()),
        })
    }

    pub(crate) fn schedule(&self) -> &PipelineSchedule {
        &self.schedule
    }

    /// This rank's stages of a model of `n_layers` blocks.
    pub(crate) fn stages(&self, n_layers: usize, layers_per_stage: Option<&[usize]>) -> Result<Vec<Stage>> {
        let n = self.schedule.num_stages();
        let ranges = split_layers(n_layers, n, layers_per_stage)?;
        self.stages_asked.store(true, Ordering::Relaxed);
        let me = self.links.rank();
        Ok(ranges
            .into_iter()
            .enumerate()
            .filter(|(s, _)| self.schedule.rank_of(*s) == me)
            .map(|(index, layers)| Stage { index, num_stages: n, layers })
            .collect())
    }

    pub(crate) fn stages_asked(&self) -> bool {
        self.stages_asked.load(Ordering::Relaxed)
    }

    /// One pipeline step on this rank: `inputs` / `targets` (the step's batch, every rank of the pp group the
    /// same) split into the schedule's micro-batches along dim 0, the schedule run on `model`, each micro-batch's
    /// loss (`loss_fn(last stage output, targets)`) multiplied by `factor` — and by `1 / m` under
    /// [`Combine::Mean`] — before its backward. Returns the gradients of `params` summed over the micro-batches
    /// and the micro-batches' losses combined (mean or sum, as `loss_fn` returned them, the same on every pp rank:
    /// broadcast from the last stage's rank).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn step(
        &self,
        model: &dyn StagedModel,
        params: Vec<Var>,
        inputs: &Tensor,
        targets: &Tensor,
        loss_fn: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
        factor: f64,
        combine: Combine,
        dropout: DropoutContext,
    ) -> Result<(Vec<Option<Tensor>>, f64)> {
        self.run(&self.schedule, model, params, inputs, targets, loss_fn, factor, combine, Some(dropout))
    }

    /// The forward of the whole batch through the stages (no backward, no gradients; one micro-batch, so any
    /// batch size runs): `loss_fn` of the last stage's output, the same on every pp rank. For evaluation.
    pub(crate) fn forward(
        &self,
        model: &dyn StagedModel,
        inputs: &Tensor,
        targets: &Tensor,
        loss_fn: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<f64> {
        let forward_only = PipelineSchedule::forward_only(self.schedule.pp, self.schedule.virtual_stages);
        Ok(self.run(&forward_only, model, Vec::new(), inputs, targets, loss_fn, 1.0, Combine::Sum, None)?.1)
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        schedule: &PipelineSchedule,
        model: &dyn StagedModel,
        params: Vec<Var>,
        inputs: &Tensor,
        targets: &Tensor,
        loss_fn: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
        factor: f64,
        combine: Combine,
        dropout: Option<DropoutContext>,
    ) -> Result<(Vec<Option<Tensor>>, f64)> {
        let m = schedule.microbatches;
        let split = |t: &Tensor, what: &str| -> Result<Vec<Tensor>> {
            let rows = t.dims().first().copied().unwrap_or(0);
            if rows == 0 || !rows.is_multiple_of(m) {
                return Err(AccelError::InvalidArgument(format!(
                    "pipeline_backward: the {what} have {rows} rows (dim 0), which do not split into the {m} \
                     micro-batches of pipeline_parallel_microbatches; use a batch size that is a multiple of {m} \
                     (e.g. {}), or set pipeline_parallel_microbatches to a divisor of {rows}",
                    m * rows.div_ceil(m).max(1)
                )));
            }
            (0..m).map(|i| Ok(t.narrow(0, i * rows / m, rows / m)?)).collect()
        };
        let mut adapter = Adapter {
            model,
            params,
            inputs: split(inputs, "inputs")?,
            targets: split(targets, "targets")?,
            loss_fn,
            factor: match combine {
                Combine::Mean => factor / m as f64,
                Combine::Sum => factor,
            },
            losses: Vec::new(),
            dropout,
        };
        let mut shapes = lock(&self.shapes);
        let dims = adapter.inputs[0].dims().to_vec();
        if shapes.input_dims != dims {
            *shapes = AgreedShapes { input_dims: dims, book: ShapeBook::default() };
        }
        let training = !adapter.params.is_empty();
        let step = run_schedule(schedule, &self.links, &mut adapter, &mut shapes.book)?;
        drop(shapes);
        if training {
            let mut timing = lock(&self.timing);
            timing.steps += 1;
            timing.busy_seconds += step.timeline.iter().map(|(_, start, end)| end - start).sum::<f64>();
            timing.elapsed_seconds += step.timeline.iter().map(|&(_, _, end)| end).fold(0.0, f64::max);
        }
        // The last stage's rank holds the losses; every pp rank returns them combined.
        let last_rank = schedule.rank_of(schedule.num_stages() - 1);
        let sum: f64 = adapter.losses.iter().sum();
        let mut combined = [match combine {
            Combine::Mean => sum / adapter.losses.len().max(1) as f64,
            Combine::Sum => sum,
        }];
        self.pp_group.broadcast(&mut combined, last_rank)?;
        Ok((step.gradients, combined[0]))
    }
}

/// How a step combines its micro-batches' losses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Combine {
    /// Each is a micro-batch's mean: scaled by `1 / m` before backward, averaged for the result.
    Mean,
    /// Each is already the micro-batch's share of the batch's loss: summed.
    Sum,
}

/// A [`StagedModel`] and one step's micro-batches, as the executor drives them.
struct Adapter<'a> {
    model: &'a dyn StagedModel,
    params: Vec<Var>,
    inputs: Vec<Tensor>,
    targets: Vec<Tensor>,
    loss_fn: &'a dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
    /// What each micro-batch's loss is multiplied by before its backward.
    factor: f64,
    /// Each micro-batch's loss as the loss function returned it.
    losses: Vec<f64>,
    /// The step's dropout context (its first row's offset; `None`: no dropout, evaluation).
    dropout: Option<DropoutContext>,
}

impl PipelineModel for Adapter<'_> {
    fn forward(&mut self, stage: usize, microbatch: usize, input: Option<&Tensor>) -> Result<Tensor> {
        let input = input.unwrap_or(&self.inputs[microbatch]);
        match self.dropout {
            // Each micro-batch's rows sit after the previous ones' in the step's batch.
            Some(ctx) => {
                let rows = self.inputs[0].dims().first().copied().unwrap_or(0) as u64;
                let ctx = DropoutContext { row_offset: ctx.row_offset + microbatch as u64 * rows, ..ctx };
                with_dropout_context(ctx, || self.model.stage_forward(stage, input))
            }
            None => self.model.stage_forward(stage, input),
        }
    }

    fn loss(&mut self, microbatch: usize, output: &Tensor) -> Result<Tensor> {
        let loss = (self.loss_fn)(output, &self.targets[microbatch])?;
        if loss.elem_count() != 1 {
            return Err(AccelError::InvalidArgument(format!(
                "pipeline_backward: the loss function returned a tensor of shape {:?}; it must return the \
                 micro-batch's mean loss, a scalar",
                loss.dims()
            )));
        }
        let loss = loss.flatten_all()?.squeeze(0)?;
        self.losses.push(loss.to_dtype(DType::F64)?.to_scalar::<f64>()?);
        Ok(loss.to_dtype(DType::F32)?.affine(self.factor, 0.0)?)
    }

    fn parameters(&self) -> Vec<Var> {
        self.params.clone()
    }
}
