//! Worker launcher (library): spawns the local workers of a job with torchrun's environment, hosts the store,
//! prefixes their output with the rank, and stops everything when one fails. `accel launch` is a thin CLI on it.
//!
//! Like torchrun's local elastic agent (static rendezvous), per machine:
//! 1. node 0 hosts the job's [`TcpStoreServer`] on `master_addr:master_port` (port 0: a free port, single
//!    machine only), checked with the job's run token (fresh per launch on one machine; on several machines
//!    the same ACCEL_RUN_TOKEN must be exported on each);
//! 2. on several machines, every machine's launcher first joins a rendezvous in that store: it claims its machine
//!    rank, publishes its view of the job (world size, machine count, backend, program, accel-rs version) and
//!    waits for the other machines, printing which ones are missing every `progress_interval`; a disagreement,
//!    a machine rank claimed twice or a peer refused by the store fails every machine at once with
//!    [`DdpError::Rendezvous`] naming the values and machines (no worker has started yet);
//! 3. it starts `nproc_per_node` workers, each in its own process group, with the environment of
//!    [`LaunchConfig::worker_env`];
//! 4. every line a worker prints goes to the console prefixed `[rank r] ` and/or to `log_dir/rank{r}.log`;
//! 5. when a worker exits non-zero or is killed, the others get SIGTERM, then SIGKILL after `stop_grace`, and
//!    [`launch`] returns [`DdpError::WorkerFailed`] naming the first failing rank (after up to `max_restarts`
//!    restarts of the whole group, each with a fresh store);
//! 6. SIGINT/SIGTERM to the launcher is forwarded to the workers, which are stopped the same way.
//!
//! Workers get no stdin (they run in background process groups, where reading a terminal would stop them).
//! Anything a worker leaves running in its process group is killed when the group ends.

mod banner;
mod elastic;
mod error_report;
mod group;
mod output;
mod rendezvous;
mod signals;
mod status;

pub use banner::{RunBanner, CONFIG_SOURCE_ENV, LAUNCH_BANNER_ENV, NO_CONFIG};
pub use error_report::{error_report, exit_code, report_error, report_text, ERROR_FILE_ENV};
pub use output::log_path;
pub use status::{signal_name, WorkerExit};

use crate::env::{AGENT_STORE_ENV, DEFAULT_MASTER_PORT};
use crate::store::TcpStoreServer;
use crate::token::{RunToken, RUN_TOKEN_ENV};
use crate::{DdpError, Result};
use group::{GroupOutcome, GroupSpec};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

pub use crate::env::{ELASTIC_NNODES_ENV, MAX_RESTARTS_ENV, RESTART_COUNT_ENV};
/// Default of [`LaunchConfig::last_call`] (torchrun's `last_call_timeout`).
pub const DEFAULT_LAST_CALL: Duration = Duration::from_secs(30);
/// Default of [`LaunchConfig::progress_interval`].
pub const DEFAULT_PROGRESS_INTERVAL: Duration = Duration::from_secs(15);

/// What to launch and how.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Workers on this machine.
    pub nproc_per_node: usize,
    /// Machines in the job; in an elastic job (`min_nnodes` set), the most it trains on.
    pub nnodes: usize,
    /// Elastic membership (torchrun's `--nnodes MIN:MAX`): the fewest machines the job trains on. A lost machine
    /// (other than machine 0, which hosts the rendezvous) or an arriving one re-forms the job at the new size,
    /// its workers restarted to resume from their newest checkpoint. `None`: exactly `nnodes` machines.
    pub min_nnodes: Option<usize>,
    /// This machine's rank (0 hosts the store).
    pub node_rank: usize,
    /// Store address (workers connect here; node 0 binds it).
    pub master_addr: String,
    /// Store port; 0 picks a free one (single-node only).
    pub master_port: u16,
    /// Program to run.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Extra environment for every worker (e.g. ACCELERATE_MIXED_PRECISION).
    pub env: Vec<(String, String)>,
    /// Write each rank's output to `log_dir/rank{r}.log` (as well as the console when `tee`).
    pub log_dir: Option<PathBuf>,
    /// Also print worker output (prefixed by `[rank r]`) when logging to files. Default true.
    pub tee: bool,
    /// Restart the whole worker group up to this many times after a failure (default 0).
    pub max_restarts: usize,
    /// How long to wait after SIGTERM before SIGKILL when stopping workers.
    pub stop_grace: Duration,
    /// Multi-machine jobs: how long the launchers wait for every machine to join before any worker starts
    /// (default 30 min, the collective timeout).
    pub rdzv_timeout: Duration,
    /// Multi-machine jobs: how often a launcher still waiting for machines prints which ones (default 15 s).
    pub progress_interval: Duration,
    /// Elastic jobs: once `min_nnodes` machines are there, how much longer a round waits for the others before
    /// it starts without them ([`DEFAULT_LAST_CALL`], torchrun's `last_call_timeout`). A round that every
    /// machine of the round before has rejoined starts at once.
    pub last_call: Duration,
}

impl LaunchConfig {
    /// One machine, `n` workers, free port, output teed, no restarts.
    pub fn local(n: usize, program: impl Into<PathBuf>, args: Vec<String>) -> Self {
        LaunchConfig {
            nproc_per_node: n,
            nnodes: 1,
            min_nnodes: None,
            node_rank: 0,
            master_addr: crate::env::DEFAULT_MASTER_ADDR.into(),
            master_port: 0,
            program: program.into(),
            args,
            env: Vec::new(),
            log_dir: None,
            tee: true,
            max_restarts: 0,
            stop_grace: Duration::from_secs(5),
            rdzv_timeout: crate::env::DEFAULT_COLLECTIVE_TIMEOUT,
            progress_interval: DEFAULT_PROGRESS_INTERVAL,
            last_call: DEFAULT_LAST_CALL,
        }
    }
}

impl LaunchConfig {
    /// Total number of workers in the job (`nnodes · nproc_per_node`).
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// Checks the configuration; errors say which field is wrong and how to fix it.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(DdpError::InvalidArgument(m));
        if self.nproc_per_node == 0 {
            return bad("launch: nproc_per_node must be at least 1".into());
        }
        if self.nnodes == 0 {
            return bad("launch: nnodes must be at least 1".into());
        }
        if self.node_rank >= self.nnodes {
            return bad(format!(
                "launch: node_rank {} is out of range for {} machine(s) (use 0..{})",
                self.node_rank, self.nnodes, self.nnodes
            ));
        }
        if let Some(min) = self.min_nnodes {
            if min == 0 || min > self.nnodes {
                return bad(format!(
                    "launch: an elastic job's machines MIN:MAX = {min}:{} need 1 <= MIN <= MAX",
                    self.nnodes
                ));
            }
            if self.master_port == 0 {
                return bad(format!(
                    "launch: an elastic job ({min}:{} machines) needs a fixed master_port, which machines that                      join later can know; use e.g. {DEFAULT_MASTER_PORT}",
                    self.nnodes
                ));
            }
        }
        if self.nnodes > 1 && self.master_port == 0 {
            return bad(format!(
                "launch: a job on {} machines needs a fixed master_port (0 picks a free port, which the other \
                 machines could not know); use e.g. {DEFAULT_MASTER_PORT}",
                self.nnodes
            ));
        }
        if self.master_addr.trim().is_empty() {
            return bad("launch: master_addr is empty".into());
        }
        Ok(())
    }

    /// The run token of the job: an ACCEL_RUN_TOKEN in [`LaunchConfig::env`] wins; otherwise a single-machine
    /// job draws a fresh one and a multi-machine job reads ACCEL_RUN_TOKEN from the launcher's environment
    /// ([`DdpError::Env`] when it is missing: every machine must use the same token).
    pub fn run_token(&self) -> Result<RunToken> {
        if let Some((_, v)) = self.env.iter().rev().find(|(k, _)| k == RUN_TOKEN_ENV) {
            return RunToken::from_hex(v);
        }
        if self.nnodes == 1 {
            return RunToken::generate();
        }
        RunToken::from_env()?.ok_or_else(|| DdpError::Env {
            var: RUN_TOKEN_ENV.into(),
            reason: format!(
                "not set, but a job on {} machines needs the same run token on every machine: run \
                 `export {RUN_TOKEN_ENV}=$(openssl rand -hex 16)` once, and export that value on each machine \
                 before launching",
                self.nnodes
            ),
        })
    }

    /// The environment of worker `local_rank`, on top of the launcher's own: [`LaunchConfig::env`], then
    /// RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (this machine's rank), GROUP_WORLD_SIZE,
    /// ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (`master_port`: the store's actual port),
    /// ACCEL_RUN_TOKEN, ACCEL_USE_AGENT_STORE=1 (node 0's launcher hosts the store, so no worker starts one),
    /// ACCEL_RESTART_COUNT, ACCEL_MAX_RESTARTS, and, when more than one worker shares the machine and neither the
    /// launcher's environment nor `env` sets them, OMP_NUM_THREADS=1 (as torchrun) and RAYON_NUM_THREADS =
    /// cores / workers (the rayon pool candle's matrix products and accel-nn's fused ops run on), so that N
    /// workers do not each start one thread per core; and, whatever the number of workers, unless the launcher's
    /// environment or `env` sets it, CANDLE_NUM_THREADS=1: candle's second pool, for its elementwise ops, spins
    /// after every op and took the cores from rayon's (char-GPT step 73 → 53 ms with rayon at 2 threads on 2
    /// cores). With one worker per machine this leaves candle's elementwise ops on one thread while rayon has
    /// every core: measured only on 2 cores, so a many-core machine may want CANDLE_NUM_THREADS set by hand. And,
    /// again unless set, MIMALLOC_PURGE_DELAY=-1: a worker whose global allocator is mimalloc keeps the memory a
    /// step frees for the next step instead of returning it to the kernel and faulting it in again (char-GPT:
    /// 105–216 page faults per step → 0); resident memory then stays at its peak. Ignored by any other allocator.
    /// And, unless set, RUST_LIB_BACKTRACE=0: an error a worker returns from `main` prints its chain without a
    /// backtrace on every rank, even under RUST_BACKTRACE=1 (which still gives a panic its backtrace).
    pub fn worker_env(
        &self,
        local_rank: usize,
        master_port: u16,
        token: &RunToken,
        restart_count: usize,
    ) -> Vec<(String, String)> {
        let rank = self.node_rank * self.nproc_per_node + local_rank;
        let mut env = self.env.clone();
        let mut set = |k: &str, v: String| env.push((k.to_string(), v));
        set("RANK", rank.to_string());
        set("LOCAL_RANK", local_rank.to_string());
        set("WORLD_SIZE", self.world_size().to_string());
        set("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string());
        set("GROUP_RANK", self.node_rank.to_string());
        set("GROUP_WORLD_SIZE", self.nnodes.to_string());
        set("ROLE_RANK", rank.to_string());
        set("ROLE_WORLD_SIZE", self.world_size().to_string());
        set("MASTER_ADDR", self.master_addr.clone());
        set("MASTER_PORT", master_port.to_string());
        set(RUN_TOKEN_ENV, token.to_hex());
        set(AGENT_STORE_ENV, "1".into());
        set(RESTART_COUNT_ENV, restart_count.to_string());
        set(MAX_RESTARTS_ENV, self.max_restarts.to_string());
        let user_set = |name: &str| std::env::var_os(name).is_some() || self.env.iter().any(|(k, _)| k == name);
        if self.nproc_per_node > 1 {
            if !user_set("OMP_NUM_THREADS") {
                set("OMP_NUM_THREADS", "1".into());
            }
            // candle's CPU kernels run on rayon, whose pool starts one thread per core in every process: N workers
            // on one machine would oversubscribe it N times (3-5x slower measured on 2 cores). Give each worker its
            // share of the cores unless the user chose.
            if !user_set("RAYON_NUM_THREADS") {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                set("RAYON_NUM_THREADS", (cores / self.nproc_per_node).max(1).to_string());
            }
        }
        // candle 0.11's own elementwise pool (CANDLE_NUM_THREADS − 1 spinning workers) beside rayon's: see the doc
        // comment; measured in docs/benchmarks.md, "One training step vs PyTorch". At one rayon thread it has no
        // workers anyway.
        if !user_set("CANDLE_NUM_THREADS") {
            set("CANDLE_NUM_THREADS", "1".into());
        }
        // mimalloc's purge of idle pages: see the doc comment; measured in docs/benchmarks.md, "Allocator".
        if !user_set("MIMALLOC_PURGE_DELAY") {
            set("MIMALLOC_PURGE_DELAY", "-1".into());
        }
        // An error a worker returns from `main` is printed as its chain, not with a backtrace per rank (anyhow and
        // std's `Backtrace::capture` read this before RUST_BACKTRACE, which still gives panics theirs).
        if !user_set("RUST_LIB_BACKTRACE") {
            set("RUST_LIB_BACKTRACE", "0".into());
        }
        env
    }
}

/// `host:port`, bracketing IPv6 literals.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Whether this process is already a worker of a launched job: a launcher's layout variable is set (RANK from
/// torchrun / `accel launch`, SLURM_PROCID, OMPI_COMM_WORLD_RANK or PMI_RANK).
pub fn is_worker() -> bool {
    crate::env::is_launched_worker()
}

/// Self-launch, like `torch.multiprocessing.spawn`: when this process is not already a worker ([`is_worker`]) and
/// `nproc > 1`, runs `nproc` copies of the current executable with the same arguments as the workers of a local job
/// ([`LaunchConfig::local`]) and returns `Ok(true)` once they all succeeded — the caller then just exits. Returns
/// `Ok(false)` when the caller should do the work itself (it is a worker, or a single process is asked for).
///
/// Errors: those of [`launch`] (the first failing worker's rank and status), or [`DdpError::Io`] when the current
/// executable cannot be located.
///
/// ```no_run
/// if ddp_core::launcher::launch_self(2)? {
///     return Ok(()); // the workers ran
/// }
/// let pg = ddp_core::ProcessGroup::init_from_env()?;
/// # Ok::<(), ddp_core::DdpError>(())
/// ```
pub fn launch_self(nproc: usize) -> Result<bool> {
    if nproc == 0 {
        // Silently training as one process would hide a typo in a launch script.
        return Err(DdpError::InvalidArgument(
            "nproc is 0: give the number of worker processes to launch (1 trains in this process)".into(),
        ));
    }
    if is_worker() || nproc <= 1 {
        return Ok(false);
    }
    let exe = std::env::current_exe().map_err(|e| DdpError::io("locating this executable to launch its workers", e))?;
    launch(&LaunchConfig::local(nproc, exe, std::env::args().skip(1).collect()))?;
    Ok(true)
}

/// The error-report files of one worker generation ([`ERROR_FILE_ENV`]), in a fresh directory removed on drop.
struct ErrorFiles {
    dir: PathBuf,
}

impl ErrorFiles {
    fn create(launch_id: u64, restart: usize) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("accel-errors-{}-{launch_id}-{restart}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir); // a leftover of a killed launcher that had our pid
        std::fs::create_dir(&dir).map_err(|e| DdpError::io(format!("creating {}", dir.display()), e))?;
        Ok(ErrorFiles { dir })
    }

    fn path(&self, local_rank: usize) -> PathBuf {
        self.dir.join(format!("rank{local_rank}.txt"))
    }

    /// Prints the report of the first failing worker once, on the console and in its log file, each line
    /// prefixed with its rank as its output was; another rank's report that says something else is named in one
    /// line (its whole report goes to its log file). A worker that wrote no report (killed, a panic, a program
    /// that does not use [`report_error`]) printed what it had to say on its stderr: then the first report another
    /// rank left is the one printed in full.
    fn print(&self, first: usize, sinks: &output::Sinks) {
        let order = std::iter::once(first).chain((0..sinks.len()).filter(|r| *r != first));
        let reports: Vec<(usize, String)> =
            order.filter_map(|r| error_report::read_report(&self.path(r)).map(|text| (r, text))).collect();
        let Some((shown_rank, shown)) = reports.first() else { return };
        sinks.rank(*shown_rank).write_report(shown, true, true);
        let mut differing = Vec::new();
        for (rank, other) in &reports[1..] {
            let sink = sinks.rank(*rank);
            sink.write_report(other, false, true);
            if other != shown {
                differing.push(*rank);
                if differing.len() == 1 {
                    let first_line = other.lines().next().unwrap_or_default();
                    let line = format!("failed too: {}", first_line.trim_start_matches("Error: "));
                    sink.write_report(&line, true, false);
                }
            }
        }
        // Usually the same chain reaction (a collective broken by the first failure): named once, not repeated.
        if differing.len() > 1 {
            let more: Vec<String> = differing[1..].iter().map(|r| sinks.rank(*r).rank().to_string()).collect();
            eprintln!(
                "[launcher] rank(s) {} failed too (their reports are in their log files with --log-dir)",
                more.join(", ")
            );
        }
    }
}

impl Drop for ErrorFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A machine without the run token cannot join, but its peers would wait for it until `rdzv_timeout` (30 min by
/// default): it makes them fail as soon as they are up instead, through the store's own refusal of a wrong token.
/// Machine 1, 2, … connects to machine 0's store with a throw-away token (machine 0 sees the refused peer and
/// fails); machine 0 listens with one (every machine that connects is refused and fails). It says so at once
/// (`error`, on stderr) and waits for the other machines as long as a rendezvous would (`rdzv_timeout`; Ctrl-C
/// ends the wait), since they may start minutes later. No token is ever sent, and nothing a peer learns from a
/// throw-away token's proof is of use.
fn fail_the_other_machines(cfg: &LaunchConfig, error: &DdpError) {
    if cfg.nnodes <= 1 || cfg.master_port == 0 {
        return;
    }
    let Ok(throw_away) = RunToken::generate() else { return };
    let addr = host_port(&cfg.master_addr, cfg.master_port);
    eprintln!(
        "[launcher] machine {}: {error}\n[launcher] machine {}: waiting up to {:.0} s to tell the other machines, so \
         that they fail too (Ctrl-C to stop)",
        cfg.node_rank,
        cfg.node_rank,
        cfg.rdzv_timeout.as_secs_f64()
    );
    if cfg.node_rank > 0 {
        let _ = crate::store::TcpStore::connect(&addr, throw_away, cfg.rdzv_timeout);
        return;
    }
    let Ok(server) = TcpStoreServer::bind(&addr, throw_away) else { return };
    let until = std::time::Instant::now() + cfg.rdzv_timeout;
    // Every peer that has not been refused yet may still come: wait for all of them, or the timeout.
    while server.refused_peers().len() < cfg.nnodes - 1 && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs the workers to completion. `Ok(())` when all exit 0; otherwise [`crate::DdpError::WorkerFailed`] naming
/// the first failing rank and its status, after stopping the others.
///
/// Other errors: [`DdpError::InvalidArgument`] for a bad configuration, [`DdpError::Env`] for a missing run
/// token on several machines, [`DdpError::Bind`] when node 0 cannot listen on `master_addr:master_port`,
/// [`DdpError::Rendezvous`] on several machines when they disagree about the job, claim the same machine
/// rank, a peer is refused by machine 0's store, or a machine does not join within `rdzv_timeout`
/// ([`DdpError::Connect`] / [`DdpError::TokenRejected`] when this machine cannot reach machine 0's store),
/// [`DdpError::Interrupted`] when SIGINT/SIGTERM interrupted the launch (after the workers were stopped; the
/// message names the signal), [`DdpError::Io`] when a worker cannot be started (naming the program).
///
/// ```no_run
/// use ddp_core::{launch, LaunchConfig};
/// let cfg = LaunchConfig::local(2, "target/release/train", vec!["--epochs".into(), "3".into()]);
/// launch(&cfg)?;   // prints "[rank 0] ..." / "[rank 1] ..." lines
/// # Ok::<(), ddp_core::DdpError>(())
/// ```
pub fn launch(cfg: &LaunchConfig) -> Result<()> {
    cfg.validate()?;
    let token = cfg.run_token().inspect_err(|e| fail_the_other_machines(cfg, e))?;
    let signals =
        signals::SignalGuard::install().map_err(|e| DdpError::io("installing the launcher's signal handlers", e))?;
    static LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let launch_id = LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if let Some(min) = cfg.min_nnodes {
        return launch_elastic(cfg, min, token, &signals, launch_id);
    }
    let first_rank = cfg.node_rank * cfg.nproc_per_node;
    let sinks = output::Sinks::open(first_rank, cfg.nproc_per_node, cfg.log_dir.as_deref(), cfg.tee, false)?;
    let mut restart = 0;
    loop {
        // A fresh store per attempt: keys of a failed generation must not leak into the next.
        let server = if cfg.node_rank == 0 {
            Some(TcpStoreServer::bind(&host_port(&cfg.master_addr, cfg.master_port), token)?)
        } else {
            None
        };
        let port = server.as_ref().map_or(cfg.master_port, |s| s.port());
        if cfg.nnodes > 1 {
            rendezvous::rendezvous(
                cfg,
                &host_port(&cfg.master_addr, port),
                token,
                server.as_ref(),
                launch_id,
                &signals,
            )?;
        }
        tracing::info!(
            "launcher: starting {} worker(s) (ranks {}..{} of {}), store at {}{}",
            cfg.nproc_per_node,
            first_rank,
            first_rank + cfg.nproc_per_node,
            cfg.world_size(),
            host_port(&cfg.master_addr, port),
            if restart > 0 { format!(", restart {restart} of {}", cfg.max_restarts) } else { String::new() }
        );
        let outcome = run_workers(cfg, port, &token, restart, launch_id, &sinks, &signals, &mut || None)?;
        drop(server);
        match outcome {
            GroupOutcome::Success => return Ok(()),
            GroupOutcome::Interrupted { signal } => return Err(interrupted(signal, cfg.nproc_per_node)),
            GroupOutcome::Stopped { reason } => return Err(DdpError::Rendezvous(reason)), // a static launch has no watch
            GroupOutcome::Failed { local_rank, status } => {
                let err =
                    DdpError::WorkerFailed { rank: first_rank + local_rank, local_rank, status: status.to_string() };
                if restart >= cfg.max_restarts {
                    if cfg.max_restarts > 0 {
                        eprintln!("[launcher] {err}; no restarts left (max_restarts = {})", cfg.max_restarts);
                    }
                    return Err(err);
                }
                restart += 1;
                // The user's console is where the workers' output goes, so say it there too (tracing may be off).
                eprintln!("[launcher] {err}; restarting the worker group ({restart} of {})", cfg.max_restarts);
                tracing::warn!("launcher: {err}; restarting the worker group ({restart} of {})", cfg.max_restarts);
                sinks.note(&format!("{err}; restart {restart} of {}", cfg.max_restarts));
            }
        }
    }
}

/// An elastic launch ([`LaunchConfig::min_nnodes`]): machine 0 hosts one store for the whole launch; every
/// launcher joins round after round ([`elastic`]), running one generation of workers per round with the
/// round's world size and ranks, until its workers succeed or the job fails.
fn launch_elastic(
    cfg: &LaunchConfig,
    min: usize,
    token: RunToken,
    signals: &signals::SignalGuard,
    launch_id: u64,
) -> Result<()> {
    let server = match cfg.node_rank {
        0 => Some(TcpStoreServer::bind(&host_port(&cfg.master_addr, cfg.master_port), token)?),
        _ => None,
    };
    let addr = host_port(&cfg.master_addr, cfg.master_port);
    let mut agent = elastic::Elastic::connect(cfg, min, &addr, token, signals, launch_id)?;
    let mut number = agent.first_round()?;
    let mut previous: Option<elastic::Round> = None;
    loop {
        let round = agent.join(number, previous.as_ref(), signals)?;
        let node_rank = round.node_rank(cfg.node_rank).expect("join returns a round this machine is in");
        let mut here = cfg.clone();
        here.nnodes = round.machines.len();
        here.node_rank = node_rank;
        here.min_nnodes = None;
        here.env.push((ELASTIC_NNODES_ENV.into(), format!("{min}:{}", cfg.nnodes)));
        let first_rank = node_rank * cfg.nproc_per_node;
        // Said once on every machine: what changed, and where this machine's workers now stand.
        let count = |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        let ranks = match cfg.nproc_per_node {
            1 => format!("rank {first_rank}"),
            n => format!("ranks {first_rank}-{}", first_rank + n - 1),
        };
        eprintln!(
            "[launcher] machine {}: round {}: {}; {}, {} (this machine: {ranks})",
            cfg.node_rank,
            round.number,
            round.change,
            count(here.nnodes, "machine", "machines"),
            count(here.world_size(), "process", "processes"),
        );
        if here.nnodes != cfg.nnodes {
            // The launcher's banner described the job at its most machines: this round's workers say their own.
            here.env.retain(|(k, _)| k != LAUNCH_BANNER_ENV);
        }
        let sinks =
            output::Sinks::open(first_rank, cfg.nproc_per_node, cfg.log_dir.as_deref(), cfg.tee, previous.is_some())?;
        sinks.note(&format!("round {}: {}", round.number, round.change));
        let attempt = round.number as usize;
        let outcome = run_workers(&here, cfg.master_port, &token, attempt, launch_id, &sinks, signals, &mut || {
            agent.should_stop(&round)
        })?;
        match outcome {
            GroupOutcome::Success => {
                drop(server);
                return Ok(());
            }
            GroupOutcome::Interrupted { signal } => {
                let name = signal_name(signal).unwrap_or("a signal");
                if cfg.node_rank == 0 {
                    agent.abort_and_linger(
                        &format!(
                            "machine 0's launcher was interrupted by {name}; the elastic job ends with it \
                             (machine 0 hosts its rendezvous)"
                        ),
                        round.machines.len(),
                    );
                } else {
                    let reason = format!("machine {}'s launcher was interrupted by {name}", cfg.node_rank);
                    agent.request_stop(round.number, elastic::StopKind::Left, &reason);
                }
                return Err(interrupted(signal, cfg.nproc_per_node));
            }
            GroupOutcome::Failed { local_rank, status } => {
                let reason =
                    format!("machine {}: worker rank {} failed ({status})", cfg.node_rank, first_rank + local_rank);
                agent.request_stop(round.number, elastic::StopKind::Failure, &reason);
            }
            GroupOutcome::Stopped { .. } => {}
        }
        number = round.number + 1;
        previous = Some(round);
    }
}

/// The error of a launch a signal interrupted.
fn interrupted(signal: i32, workers: usize) -> DdpError {
    DdpError::Interrupted {
        signal,
        context: format!(
            "launcher interrupted by {}; its {workers} worker(s) were stopped",
            signal_name(signal).unwrap_or("a signal")
        ),
    }
}

/// Runs one generation of this machine's workers for `cfg`'s layout, their store at `port`, until they end
/// or `watch` asks them to stop; prints the first failing worker's error report.
#[allow(clippy::too_many_arguments)]
fn run_workers(
    cfg: &LaunchConfig,
    port: u16,
    token: &RunToken,
    attempt: usize,
    launch_id: u64,
    sinks: &output::Sinks,
    signals: &signals::SignalGuard,
    watch: &mut dyn FnMut() -> Option<String>,
) -> Result<GroupOutcome> {
    let reports = ErrorFiles::create(launch_id, attempt)?;
    let commands = (0..cfg.nproc_per_node)
        .map(|local_rank| {
            let mut cmd = Command::new(&cfg.program);
            cmd.args(&cfg.args).envs(cfg.worker_env(local_rank, port, token, attempt));
            cmd.env(ERROR_FILE_ENV, reports.path(local_rank));
            cmd
        })
        .collect();
    let spec = GroupSpec { commands, first_rank: cfg.node_rank * cfg.nproc_per_node, stop_grace: cfg.stop_grace };
    let outcome = group::run_group(spec, sinks, signals, watch)?;
    if let GroupOutcome::Failed { local_rank, .. } = outcome {
        reports.print(local_rank, sinks);
    }
    Ok(outcome)
}
