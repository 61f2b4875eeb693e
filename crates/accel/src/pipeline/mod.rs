//! Pipeline parallelism (pp): the model cut into stages across the mesh's pp ranks, each step's micro-batches
//! flowing through them in a schedule.
//!
//! - [`schedule`] — the schedules (GPipe, 1F1B, interleaved 1F1B) as data: each rank's list of forwards,
//!   backwards, sends and receives, printable and readable in torch.distributed.pipelining's text form.
//! - [`mod@simulate`] — runs the lists against each other on paper: no deadlock, receives in their peers' sending
//!   order, each rank's bubble and the activations it holds.
//! - [`stages`] — which blocks each stage holds (even, or as listed).
//! - [`links`] — the point-to-point groups between neighbouring pp ranks, one per direction.
//! - [`executor`] — runs one rank's list on its stages of a model ([`PipelineModel`]): activations forward,
//!   gradients backward, a stage's backward from the gradient of its output, gradients summed over micro-batches.
//!
//! - `runtime` — what the Accelerator keeps for pipeline steps; [`Stage`] and [`StagedModel`], what a program
//!   sees: [`crate::Accelerator::pipeline_stages`] tells a rank which stages (blocks) to build, and
//!   [`crate::Accelerator::pipeline_backward`] runs one step's micro-batches through the schedule.

pub mod executor;
pub mod links;
pub(crate) mod runtime;
pub mod schedule;
pub mod simulate;
pub mod stages;

pub use executor::{run_schedule, PipelineModel, PipelineStep, ShapeBook};
pub use links::PipelineLinks;
pub use runtime::{PipelineTiming, Stage, StagedModel};
pub use schedule::{Action, PipelineSchedule, ScheduleKind};
pub use simulate::{simulate, Costs, SimReport, Span};
pub use stages::split_layers;

#[cfg(test)]
mod tests;
