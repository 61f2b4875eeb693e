//! Pipeline parallelism (pp): the model cut into stages across the mesh's pp ranks, each step's micro-batches
//! flowing through them in a schedule.
//!
//! - [`schedule`] — the schedules (GPipe, 1F1B, interleaved 1F1B) as data: each rank's list of forwards,
//!   backwards, sends and receives, printable and readable in torch.distributed.pipelining's text form.
//! - [`simulate`] — runs the lists against each other on paper: no deadlock, receives in their peers' sending
//!   order, each rank's bubble and the activations it holds.
//!
//! Running a schedule on a model (stages, activations over the pp group, the Accelerator and the Trainer driving
//! micro-batches) builds on these; until it lands the Accelerator refuses pp > 1
//! ([`crate::ParallelismConfig::check_accelerator_support`]).

pub mod schedule;
pub mod simulate;

pub use schedule::{Action, PipelineSchedule, ScheduleKind};
pub use simulate::{simulate, Costs, SimReport, Span};

#[cfg(test)]
mod tests;
