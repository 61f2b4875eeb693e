//! Where the library's warnings go when the program says nothing: accel and the Trainer report through `tracing`
//! (a checkpoint loaded at another layout, an old checkpoint removed by `total_limit`, …), and a program written
//! from the guide installs no subscriber, which would drop them. Python's `logging` prints warnings to stderr when
//! nothing is configured ("last resort"); [`init_default`] does the same: when no subscriber is set yet, one that
//! prints warnings and errors to stderr (`RUST_LOG` sets another level, `RUST_LOG=off` none). A program that sets
//! its own before the Accelerator keeps it. Without the default feature `logging`, nothing is installed.

/// Installs the default subscriber unless one is set (see the module documentation). Called by
/// `Accelerator::new` and `Accelerator::with_process_group`; the examples and the `accel` CLI call it first thing.
pub fn init_default() {
    #[cfg(feature = "logging")]
    {
        if tracing::dispatcher::has_been_set() {
            return;
        }
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        // Another thread may install one at the same moment: the first wins, the other call changes nothing.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .without_time()
            .with_target(false)
            .try_init();
    }
}
