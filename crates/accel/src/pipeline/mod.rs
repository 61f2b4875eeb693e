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
//! The Accelerator and the Trainer driving micro-batches through a schedule build on these; until they do, the
//! Accelerator refuses pp > 1 ([`crate::ParallelismConfig::check_accelerator_support`]).

pub mod executor;
pub mod links;
pub mod schedule;
pub mod simulate;
pub mod stages;

pub use executor::{run_schedule, PipelineModel, PipelineStep};
pub use links::PipelineLinks;
pub use schedule::{Action, PipelineSchedule, ScheduleKind};
pub use simulate::{simulate, Costs, SimReport, Span};
pub use stages::split_layers;

#[cfg(test)]
mod tests;
