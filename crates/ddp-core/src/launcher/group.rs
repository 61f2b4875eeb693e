//! One generation of worker processes: spawn, watch, stop, reap.
//!
//! Each worker runs in its own process group, so stopping it also stops whatever it started (a `sh -c`
//! wrapper's child, a data-loading helper). A watcher thread per worker waits for its exit with
//! `waitid(WNOWAIT)`, which reports the exit *without* reaping: the worker's pid, and so its process-group id,
//! stay reserved until the launcher reaps it, so signalling the group can never hit an unrelated process that
//! reused the number. On Linux each worker also gets `PR_SET_PDEATHSIG = SIGKILL`, so a launcher killed with
//! SIGKILL (which it cannot catch) does not leave orphans behind.

use super::output::{Pumps, Sinks, Stream};
use super::signals::SignalGuard;
use super::status::WorkerExit;
use crate::{DdpError, Result};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// How often the wait loop looks at the signal counter.
const POLL: Duration = Duration::from_millis(50);
/// How long to wait for workers to die after SIGKILL before giving up on them.
const KILL_WAIT: Duration = Duration::from_secs(10);
/// How long to wait for output streams to drain after the workers are gone.
const DRAIN_WAIT: Duration = Duration::from_secs(5);
/// After the first failure, how long the other workers may take to exit on their own before SIGTERM. They
/// usually fail too (their collective broke) and are printing their error chain in several writes: a SIGTERM
/// in between would cut it to `[rank 1] Error: `.
const SETTLE: Duration = Duration::from_secs(1);

/// How a group ended.
pub(crate) enum GroupOutcome {
    /// Every worker exited 0.
    Success,
    /// A worker failed first (local rank, status); the others were stopped.
    Failed { local_rank: usize, status: WorkerExit },
    /// The launcher got SIGINT/SIGTERM; the workers were stopped.
    Interrupted { signal: i32 },
    /// The launch's watch asked for a stop (an elastic job's membership changed, or another machine failed);
    /// the workers were stopped.
    Stopped { reason: String },
}

/// What to start: `commands[local_rank]`, fully configured except for stdio.
pub(crate) struct GroupSpec {
    pub(crate) commands: Vec<Command>,
    pub(crate) first_rank: usize,
    pub(crate) stop_grace: Duration,
}

struct Worker {
    child: Child,
    pid: libc::pid_t,
    exited: Option<WorkerExit>,
}

/// How often the wait loop asks the launch's watch whether to stop (it may ask a store over the network).
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// Spawns the group and waits until it succeeds, a worker fails, a signal arrives or `watch` returns a reason to
/// stop (asked every [`WATCH_EVERY`]; a static launch's never does). Always returns with every worker reaped.
pub(crate) fn run_group(
    spec: GroupSpec,
    sinks: &Sinks,
    signals: &SignalGuard,
    watch: &mut dyn FnMut() -> Option<String>,
) -> Result<GroupOutcome> {
    let (tx, rx) = std::sync::mpsc::channel::<(usize, WorkerExit)>();
    let mut workers: Vec<Worker> = Vec::with_capacity(spec.commands.len());
    let mut pumps = Pumps::new();
    if let Err(e) = spawn_workers(spec.commands, spec.first_rank, sinks, &tx, &mut workers, &mut pumps) {
        stop(&mut workers, &rx, libc::SIGTERM, spec.stop_grace, signals);
        reap(&mut workers);
        pumps.finish(DRAIN_WAIT);
        return Err(e);
    }
    drop(tx);

    let mut last_watch = Instant::now();
    let outcome = loop {
        if let Some(signal) = signals.received() {
            // Info: the launch's error says it once ("launcher interrupted by SIGINT; its N worker(s) were stopped").
            tracing::info!("launcher: got signal {signal}; stopping {} worker(s)", workers.len());
            stop(&mut workers, &rx, signal, spec.stop_grace, signals);
            break GroupOutcome::Interrupted { signal };
        }
        match rx.recv_timeout(POLL) {
            Ok((local_rank, status)) => {
                workers[local_rank].exited = Some(status);
                if !status.success() {
                    // Info, not error: the summary reaches the user once, as the error `launch` returns.
                    tracing::info!(
                        "launcher: worker rank {} failed first ({status}); stopping the others",
                        spec.first_rank + local_rank
                    );
                    settle(&mut workers, &rx, SETTLE, signals);
                    // A worker killed by a signal (OOM killer, kill -9) is usually the cause, and its peers then
                    // fail with a collective error — whose exit the watchers may report first. Name the killed one.
                    let (local_rank, status) = match status {
                        WorkerExit::Code(_) => workers
                            .iter()
                            .enumerate()
                            .find_map(|(i, w)| match w.exited {
                                Some(s @ WorkerExit::Signal { .. }) => Some((i, s)),
                                _ => None,
                            })
                            .unwrap_or((local_rank, status)),
                        WorkerExit::Signal { .. } => (local_rank, status),
                    };
                    stop(&mut workers, &rx, libc::SIGTERM, spec.stop_grace, signals);
                    break GroupOutcome::Failed { local_rank, status };
                }
                if workers.iter().all(|w| w.exited.is_some()) {
                    break GroupOutcome::Success;
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                if last_watch.elapsed() >= WATCH_EVERY {
                    last_watch = Instant::now();
                    if let Some(reason) = watch() {
                        tracing::info!("launcher: stopping {} worker(s): {reason}", workers.len());
                        stop(&mut workers, &rx, libc::SIGTERM, spec.stop_grace, signals);
                        break GroupOutcome::Stopped { reason };
                    }
                }
            }
            Err(RecvTimeoutError::Disconnected) => break GroupOutcome::Success, // no workers at all
        }
    };
    // Whatever the worker left running in its process group goes with it.
    for w in &workers {
        signal_group(w.pid, libc::SIGKILL);
    }
    reap(&mut workers);
    pumps.finish(DRAIN_WAIT);
    Ok(outcome)
}

/// Starts each command as a worker in its own process group (killed with the launcher: `PR_SET_PDEATHSIG`), its
/// output pumped into its rank's sink, and a watcher thread that reports its exit on `tx` without reaping it. On an
/// error the workers started so far are in `workers`, for the caller to stop.
fn spawn_workers(
    commands: Vec<Command>,
    first_rank: usize,
    sinks: &Sinks,
    tx: &std::sync::mpsc::Sender<(usize, WorkerExit)>,
    workers: &mut Vec<Worker>,
    pumps: &mut Pumps,
) -> Result<()> {
    let parent = std::process::id() as libc::pid_t;
    for (local_rank, mut cmd) in commands.into_iter().enumerate() {
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
        // SAFETY: the closure runs between fork and exec and only makes async-signal-safe calls.
        unsafe {
            cmd.pre_exec(move || {
                #[cfg(target_os = "linux")]
                {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // The launcher may have died between fork and prctl: then nobody would reap us.
                    if libc::getppid() != parent {
                        libc::_exit(1);
                    }
                }
                #[cfg(not(target_os = "linux"))]
                let _ = parent;
                Ok(())
            });
        }
        let rank = first_rank + local_rank;
        let mut child = cmd.spawn().map_err(|e| {
            DdpError::io(
                format!(
                    "starting worker rank {rank}: {:?} (is the path right and the program built? a bare name is \
                     looked up on PATH)",
                    cmd.get_program()
                ),
                e,
            )
        })?;
        let pid = child.id() as libc::pid_t;
        let sink = sinks.rank(local_rank);
        if let Some(out) = child.stdout.take() {
            pumps.start(out, sink.clone(), Stream::Stdout)?;
        }
        if let Some(err) = child.stderr.take() {
            pumps.start(err, sink.clone(), Stream::Stderr)?;
        }
        let tx = tx.clone();
        std::thread::Builder::new()
            .name(format!("launcher-wait-{rank}"))
            .spawn(move || {
                let _ = tx.send((local_rank, wait_without_reaping(pid)));
            })
            .map_err(|e| DdpError::io("starting a worker watcher thread", e))?;
        workers.push(Worker { child, pid, exited: None });
    }
    Ok(())
}

/// Waits up to `limit` for the running workers to exit by themselves (no signal sent); stops early on a new
/// SIGINT/SIGTERM to the launcher.
fn settle(workers: &mut [Worker], rx: &Receiver<(usize, WorkerExit)>, limit: Duration, signals: &SignalGuard) {
    let signals_before = signals.count();
    let deadline = Instant::now() + limit;
    while workers.iter().any(|w| w.exited.is_none()) && signals.count() == signals_before {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        if let Ok((i, status)) = rx.recv_timeout(POLL.min(left)) {
            workers[i].exited = Some(status);
        }
    }
}

/// Sends `first_signal` to every running worker's group, waits up to `grace`, then SIGKILLs the rest (at once
/// when another SIGINT/SIGTERM reaches the launcher meanwhile), and waits for them to exit.
fn stop(
    workers: &mut [Worker],
    rx: &Receiver<(usize, WorkerExit)>,
    first_signal: i32,
    grace: Duration,
    signals: &SignalGuard,
) {
    for w in workers.iter().filter(|w| w.exited.is_none()) {
        signal_group(w.pid, first_signal);
    }
    let signals_before = signals.count();
    let deadline = Instant::now() + grace;
    while workers.iter().any(|w| w.exited.is_none()) && Instant::now() < deadline {
        if signals.count() != signals_before {
            break; // a second Ctrl-C: no more patience
        }
        if let Ok((i, status)) = rx.recv_timeout(POLL.min(deadline.saturating_duration_since(Instant::now()))) {
            workers[i].exited = Some(status);
        }
    }
    for w in workers.iter().filter(|w| w.exited.is_none()) {
        signal_group(w.pid, libc::SIGKILL);
    }
    let deadline = Instant::now() + KILL_WAIT;
    while workers.iter().any(|w| w.exited.is_none()) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((i, status)) => workers[i].exited = Some(status),
            Err(_) => {
                tracing::error!("launcher: some workers did not exit after SIGKILL (stuck in the kernel?)");
                return;
            }
        }
    }
}

/// Reaps every worker that has exited (their zombies kept the pids reserved until now).
fn reap(workers: &mut [Worker]) {
    for w in workers.iter_mut() {
        if w.exited.is_some() {
            let _ = w.child.wait();
        } else {
            let _ = w.child.try_wait();
        }
    }
}

fn signal_group(pid: libc::pid_t, signal: i32) {
    // SAFETY: plain syscall. The group id is the worker's pid, still reserved because it is not reaped yet.
    unsafe {
        libc::kill(-pid, signal);
    }
}

/// Blocks until `pid` exits and returns how, leaving it a zombie (WNOWAIT) for the launcher to reap.
fn wait_without_reaping(pid: libc::pid_t) -> WorkerExit {
    loop {
        // SAFETY: `info` is a plain C struct that waitid fills in.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOWAIT) };
        if rc == 0 {
            return WorkerExit::from_siginfo(&info);
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            // ECHILD: someone else reaped it; we cannot know how it ended.
            tracing::error!("launcher: waitid({pid}) failed: {err}");
            return WorkerExit::Code(-1);
        }
    }
}
