//! The library's warnings reach a program that configured no logging (`accel::logging`).

use accel::{Accelerator, AcceleratorConfig};
use ddp_core::ProcessGroup;

/// A program that installs no tracing subscriber still sees the library's warnings: the Accelerator installs one
/// printing warnings to stderr (`accel::logging`) when none is set, as Python's logging does.
#[test]
fn the_accelerator_makes_its_warnings_reach_stderr() {
    let _acc = Accelerator::with_process_group(AcceleratorConfig::default(), ProcessGroup::single_process().unwrap());
    assert!(tracing::dispatcher::has_been_set(), "no subscriber after Accelerator::with_process_group");
    assert!(tracing::enabled!(tracing::Level::WARN), "warnings are enabled by default");
}
