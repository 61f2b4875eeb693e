//! [`AutoLayoutError`]: what the chooser says when it cannot choose — an input that cannot be costed, a world size
//! with no layout at all for the model and batch (and why, and which global batch would have one), or layouts that
//! all need more memory than the processes have (and how much would do, or how many more processes).

use super::candidate::Candidate;
use super::units;

/// Why no layout was chosen (see the module documentation).
#[derive(Debug, Clone)]
pub enum AutoLayoutError {
    /// The model, cluster, training or assumptions cannot be costed (a size of 0, a link without bandwidth, …).
    InvalidSpec(String),
    /// No layout of this world size satisfies the constraints.
    NoLayout {
        /// Processes.
        world: usize,
        /// The rules that ruled layouts out, each with an example ([`super::Rejections::lines`]).
        reasons: Vec<String>,
        /// The nearest global batches (below, above) for which layouts exist, when any is found.
        nearest_batches: (Option<usize>, Option<usize>),
    },
    /// Layouts exist, none fits the memory.
    NothingFits {
        /// Layouts considered.
        considered: usize,
        /// The layout that needs the least memory per process.
        least_memory: Box<Candidate>,
        /// The memory per process that layout needs (its peak over the usable fraction).
        needed_per_process: u64,
        /// The fastest layout, and the memory per process it would need.
        fastest: Box<Candidate>,
        /// What it would need.
        fastest_needs: u64,
        /// The most memory a process has now.
        largest_memory: u64,
        /// More machines like the one with the most memory that would let a layout fit: (machines added, world
        /// size then), when found within the search's bound.
        more_machines: Option<(usize, usize)>,
        /// The largest world size the search for more machines tried.
        searched_up_to: usize,
    },
}

impl std::fmt::Display for AutoLayoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AutoLayoutError::InvalidSpec(what) => write!(f, "auto layout: {what}"),
            AutoLayoutError::NoLayout { world, reasons, nearest_batches } => {
                write!(
                    f,
                    "auto layout: no layout of {} fits the constraints",
                    units::plural(*world, "process", "processes")
                )?;
                if !reasons.is_empty() {
                    write!(f, " — {}", reasons.join("; "))?;
                }
                match nearest_batches {
                    (Some(lo), Some(hi)) => write!(f, "; a global batch of {lo} or {hi} sequences would have layouts"),
                    (Some(n), None) | (None, Some(n)) => {
                        write!(f, "; a global batch of {n} sequences would have layouts")
                    }
                    (None, None) => Ok(()),
                }
            }
            AutoLayoutError::NothingFits {
                considered,
                least_memory,
                needed_per_process,
                fastest,
                fastest_needs,
                largest_memory,
                more_machines,
                searched_up_to,
            } => {
                let tight = least_memory.tightest();
                write!(
                    f,
                    "auto layout: none of the {considered} layouts fits in memory. The smallest memory per process that \
                     would fit is {} ({} bytes; the processes have at most {}): {} peaks at {} on pp rank {} ({})",
                    units::bytes(*needed_per_process),
                    needed_per_process,
                    units::bytes(*largest_memory),
                    least_memory.layout,
                    units::bytes(tight.memory.total()),
                    tight.pp_rank,
                    tight.memory,
                )?;
                if fastest.layout != least_memory.layout {
                    write!(
                        f,
                        ". The fastest layout, {} ({} per step), would need {} per process",
                        fastest.layout,
                        units::seconds(fastest.time.total),
                        units::bytes(*fastest_needs)
                    )?;
                }
                match more_machines {
                    Some((added, world)) => write!(
                        f,
                        ". Or add {} like the largest ({} processes in all)",
                        units::plural(*added, "machine", "machines"),
                        world
                    ),
                    None => write!(f, ". No world size up to {searched_up_to} processes fits with these machines"),
                }
            }
        }
    }
}

impl std::error::Error for AutoLayoutError {}

/// The Accelerator's error: [`crate::AccelError::Config`] on the `parallelism_config` key with the value `auto`.
impl From<AutoLayoutError> for crate::AccelError {
    fn from(e: AutoLayoutError) -> Self {
        crate::AccelError::Config { key: "parallelism_config".into(), value: "auto".into(), reason: e.to_string() }
    }
}
