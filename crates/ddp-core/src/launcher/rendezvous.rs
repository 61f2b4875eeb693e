//! The launchers' own rendezvous on a multi-machine job, before any worker starts (like torchrun's agent-level
//! rendezvous): each machine's launcher connects to the job's store (machine 0's launcher to its own server),
//! claims its machine rank, publishes its view of the job and waits for every other machine's. It fails fast,
//! on every machine at once, and says why:
//!
//! - two machines that disagree on the job (world size, machine count, backend, program, accel-rs version): the
//!   first launcher to see it stores one message under [`ABORT_KEY`] naming both values and which machine has
//!   which; every other launcher reads it at its next poll and fails with the same words;
//! - two machines with the same machine rank: the rank is claimed with `compare_set`, so the second fails naming
//!   the holder (host and pid);
//! - a peer refused by the store (another run token, another protocol version): machine 0's launcher sees it in
//!   [`TcpStoreServer::refused_peers`] and fails too, instead of waiting for a machine that will never get in.
//!
//! While machines are missing, every `progress_interval` the launcher prints which ones and how many have joined.

use super::signals::SignalGuard;
use super::LaunchConfig;
use crate::store::{Store, TcpStore, TcpStoreServer};
use crate::token::RunToken;
use crate::{DdpError, Result};
use std::time::{Duration, Instant};

/// Key prefix of the launchers' rendezvous (apart from the workers' `ddp/` keys).
const PREFIX: &str = "accel/launch/";
/// Key prefix of an elastic job's rounds ([`super::elastic`]); a static and an elastic launcher on one store read
/// each other's front door (this module is the one both use) to say at once that the machines disagree.
pub(super) const ELASTIC_PREFIX: &str = "accel/elastic/";
/// Set by machine 0's launcher of an elastic job (its `MIN:MAX`).
pub(super) const ELASTIC_MARK: &str = "accel/elastic/min_max";
/// Key holding the message of the first launcher that found the job inconsistent.
pub(crate) const ABORT_KEY: &str = "accel/launch/abort";
/// Counter of the launchers that have seen every machine's view agree with theirs.
const READY_KEY: &str = "accel/launch/ready";
/// Counter of the launchers that have read [`ABORT_KEY`].
pub(super) const ABORT_SEEN_KEY: &str = "accel/launch/abort_seen";
/// How long machine 0's launcher keeps its store up after an abort, for the other launchers to read why.
pub(super) const ABORT_LINGER: Duration = Duration::from_secs(3);
/// How often a waiting launcher looks at the store.
const POLL: Duration = Duration::from_millis(100);

/// One machine's view of the job: what every machine must agree on. Field order is the order of the checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JobView {
    fields: Vec<(&'static str, String)>,
}

impl JobView {
    pub(crate) fn of(cfg: &LaunchConfig) -> Self {
        let backend = cfg
            .env
            .iter()
            .rev()
            .find(|(k, _)| k == crate::env::BACKEND_ENV)
            .map_or_else(|| "default".to_string(), |(_, v)| v.trim().to_ascii_lowercase());
        // An elastic job's size changes from round to round: its machines agree on the processes per machine and
        // the range instead.
        let (processes, machines) = match cfg.min_nnodes {
            Some(min) => (("nproc_per_node", cfg.nproc_per_node), format!("{min}:{}", cfg.nnodes)),
            None => (("num_processes", cfg.world_size()), cfg.nnodes.to_string()),
        };
        JobView {
            fields: vec![
                (processes.0, processes.1.to_string()),
                ("num_machines", machines),
                ("backend", backend),
                ("max_restarts", cfg.max_restarts.to_string()),
                ("program", cfg.program.display().to_string()),
                ("accel-rs version", env!("CARGO_PKG_VERSION").to_string()),
            ],
        }
    }

    pub(super) fn encode(&self) -> Vec<u8> {
        self.fields.iter().map(|(k, v)| format!("{k}={v}\n")).collect::<String>().into_bytes()
    }

    pub(super) fn decode(bytes: &[u8]) -> Vec<(String, String)> {
        String::from_utf8_lossy(bytes)
            .lines()
            .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
            .collect()
    }

    /// The message for the first field where machine `theirs_rank` (with `theirs`) differs from machine
    /// `ours_rank` (with this view); `None` when they agree. The higher machine rank is named first, so that
    /// every launcher words the same disagreement the same way.
    pub(super) fn disagreement(
        &self,
        ours_rank: usize,
        theirs_rank: usize,
        theirs: &[(String, String)],
    ) -> Option<String> {
        for (name, ours) in &self.fields {
            let other = theirs.iter().find(|(k, _)| k == name).map_or("(not given)", |(_, v)| v.as_str());
            if other == ours {
                continue;
            }
            let ((hi, hi_v), (lo, lo_v)) = if theirs_rank > ours_rank {
                ((theirs_rank, other), (ours_rank, ours.as_str()))
            } else {
                ((ours_rank, ours.as_str()), (theirs_rank, other))
            };
            let fix = match *name {
                "num_processes" => "pass the same -n/--num-processes on every machine (the TOTAL over all machines)",
                "nproc_per_node" => "pass the same --nproc-per-node on every machine",
                "num_machines" => "pass the same --num-machines on every machine",
                "backend" => "pass the same --backend (ACCEL_BACKEND) on every machine",
                "max_restarts" => "pass the same --max-restarts on every machine",
                "program" => "launch the same program on every machine",
                _ => "install the same accel-rs build on every machine",
            };
            return Some(format!("machine {hi} launched with {name} {hi_v} but machine {lo} with {lo_v}; {fix}"));
        }
        None
    }
}

/// The key under which machine `m` asks to join round `number` of an elastic job.
pub(super) fn elastic_join_key(number: u64, m: usize) -> String {
    format!("{ELASTIC_PREFIX}round{number}/join/{m}")
}

/// The key under which machine `m`'s launcher publishes its view of a static job.
pub(super) fn view_key(m: usize) -> String {
    format!("{PREFIX}machine{m}/view")
}

/// Runs the launchers' rendezvous of `cfg` (nnodes > 1) against the store at `addr`; `server` is machine 0's
/// own store server; `launch_id` is the same for every attempt of one [`super::launch`] call and
/// unique in the process. Returns once every machine has joined with the same view of the job.
///
/// Errors: [`DdpError::Rendezvous`] for a disagreement, a taken machine rank, a refused peer or a machine that
/// did not join within `cfg.rdzv_timeout`; the store's own errors ([`DdpError::Connect`],
/// [`DdpError::TokenRejected`]) when this launcher cannot reach machine 0's store.
pub(crate) fn rendezvous(
    cfg: &LaunchConfig,
    addr: &str,
    token: RunToken,
    server: Option<&TcpStoreServer>,
    launch_id: u64,
    signals: &SignalGuard,
) -> Result<()> {
    let start = Instant::now();
    let me = cfg.node_rank;
    let store = connect(cfg, addr, token, signals, start)?;

    // Claim the machine rank. The same launch (after a restart of its worker group) may claim it again; the
    // launch id tells apart two launches in one process (tests), which share host and pid.
    let holder = format!("{} (pid {})\n{launch_id}", hostname(), std::process::id());
    let claimed = store.compare_set(&format!("{PREFIX}machine{me}/owner"), b"", holder.as_bytes())?;
    if claimed != holder.as_bytes() {
        let claimed = String::from_utf8_lossy(&claimed);
        let other = claimed.lines().next().unwrap_or("another launcher");
        return Err(DdpError::Rendezvous(format!(
            "machine rank {me} is already taken by {other}; give every machine its own --machine-rank \
             (0..{})",
            cfg.nnodes
        )));
    }

    // Machine 0 runs an elastic job: say so before publishing a view it will never read.
    if store.check(&[ELASTIC_MARK])? {
        let min_max = String::from_utf8_lossy(&store.get(ELASTIC_MARK)?).into_owned();
        return Err(DdpError::Rendezvous(format!(
            "machine {me} launched with num_machines {} (a static job) but machine 0 with {min_max} (an elastic \
             job); pass the same --nnodes on every machine",
            cfg.nnodes
        )));
    }
    let view = JobView::of(cfg);
    store.set(&view_key(me), &view.encode())?;
    let mut joined = vec![false; cfg.nnodes];
    joined[me] = true;
    let mut last_progress = Instant::now();
    loop {
        let abort = |store: &TcpStore, msg: String| -> DdpError {
            let _ = store.compare_set(ABORT_KEY, b"", msg.as_bytes());
            if server.is_some() {
                linger(store, cfg.nnodes);
            }
            DdpError::Rendezvous(msg)
        };
        if store.check(&[ABORT_KEY])? {
            let msg = String::from_utf8_lossy(&store.get(ABORT_KEY)?).into_owned();
            let _ = store.add(ABORT_SEEN_KEY, 1);
            return Err(DdpError::Rendezvous(msg));
        }
        if let Some(refused) = server.and_then(|s| s.refused_peers().into_iter().next()) {
            return Err(abort(
                &store,
                format!(
                    "the store at {addr} refused the peer {} ({}); export the same ACCEL_RUN_TOKEN and run the \
                     same accel-rs build on every machine",
                    refused.peer, refused.reason
                ),
            ));
        }
        if let Some(m) = (1..cfg.nnodes).find(|m| store.check(&[&elastic_join_key(0, *m)]).unwrap_or(false)) {
            return Err(abort(
                &store,
                format!(
                    "machine {m} launched an elastic job (--nnodes MIN:MAX) but machine {me} a static one of {} \
                     machines; pass the same --nnodes on every machine",
                    cfg.nnodes
                ),
            ));
        }
        for (m, joined) in joined.iter_mut().enumerate().filter(|(_, j)| !**j) {
            let key = view_key(m);
            if !store.check(&[&key])? {
                continue;
            }
            let theirs = JobView::decode(&store.get(&key)?);
            if let Some(msg) = view.disagreement(me, m, &theirs) {
                return Err(abort(&store, msg));
            }
            *joined = true;
        }
        let missing: Vec<usize> = (0..cfg.nnodes).filter(|m| !joined[*m]).collect();
        if missing.is_empty() {
            // Machine 0's store goes away with its launcher, which may be done before a slow peer has read every
            // view (a short job): it leaves only once every launcher has.
            store.add(READY_KEY, 1)?;
            while server.is_some() && store.add(READY_KEY, 0)? < cfg.nnodes as i64 {
                if start.elapsed() >= cfg.rdzv_timeout {
                    break; // a launcher vanished after its checks passed: its workers will not find the store
                }
                std::thread::sleep(POLL / 4);
            }
            tracing::info!("launcher: all {} machines joined at {addr}", cfg.nnodes);
            return Ok(());
        }
        let waiting = format!(
            "waiting for machine(s) {} ({}/{} joined) at {addr}",
            list(&missing),
            cfg.nnodes - missing.len(),
            cfg.nnodes
        );
        if start.elapsed() >= cfg.rdzv_timeout {
            return Err(DdpError::Rendezvous(format!(
                "timed out after {:.1} s {waiting}; start `accel launch` on every machine with its own \
                 --machine-rank, the same --main-process-ip/--main-process-port and the same ACCEL_RUN_TOKEN",
                start.elapsed().as_secs_f64()
            )));
        }
        if let Some(e) = interrupted(signals, &waiting) {
            return Err(e);
        }
        if last_progress.elapsed() >= cfg.progress_interval {
            last_progress = Instant::now();
            progress(me, &waiting);
        }
        std::thread::sleep(POLL);
    }
}

/// How long one connection attempt to machine 0's store may take before the launcher looks at signals again.
const CONNECT_SLICE: Duration = Duration::from_secs(1);

/// Connects to machine 0's store, waiting for it up to `cfg.rdzv_timeout` from `start`: in slices, so that a
/// signal (Ctrl-C) ends the wait at once and the user sees every `progress_interval` what is being waited for.
pub(super) fn connect(
    cfg: &LaunchConfig,
    addr: &str,
    token: RunToken,
    signals: &SignalGuard,
    start: Instant,
) -> Result<TcpStore> {
    // The first failed attempt is reported at once (machine 0 usually is just not up yet: say what we wait for).
    let mut last_progress: Option<Instant> = None;
    loop {
        let left = cfg.rdzv_timeout.saturating_sub(start.elapsed());
        match TcpStore::connect(addr, token, left.clamp(Duration::from_millis(1), CONNECT_SLICE)) {
            Ok(store) => return Ok(store.with_timeout(cfg.rdzv_timeout)),
            Err(DdpError::Connect { reason, .. }) => {
                let waiting = format!("waiting for machine 0's store at {addr} ({reason})");
                if start.elapsed() >= cfg.rdzv_timeout {
                    return Err(DdpError::Rendezvous(format!(
                        "timed out after {:.1} s {waiting}; start `accel launch` with --machine-rank 0 on the \
                         machine at --main-process-ip, with the same --main-process-port and ACCEL_RUN_TOKEN",
                        start.elapsed().as_secs_f64()
                    )));
                }
                if let Some(e) = interrupted(signals, &waiting) {
                    return Err(e);
                }
                if last_progress.is_none_or(|t| t.elapsed() >= cfg.progress_interval) {
                    last_progress = Some(Instant::now());
                    progress(cfg.node_rank, &waiting);
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// The error of a rendezvous a signal ended, if one arrived.
pub(super) fn interrupted(signals: &SignalGuard, waiting: &str) -> Option<DdpError> {
    signals.received().map(|sig| {
        DdpError::Rendezvous(format!(
            "interrupted by {} while {waiting}; no worker was started",
            super::status::signal_name(sig).unwrap_or("a signal")
        ))
    })
}

/// A progress line on the user's console (where the launcher's other messages go; tracing may be off).
pub(super) fn progress(me: usize, waiting: &str) {
    eprintln!("[launcher] machine {me}: {waiting}");
}

/// Machine 0 hosts the store, which goes away with its launcher: before that, wait (at most [`ABORT_LINGER`])
/// until every other launcher that has claimed its machine rank has read the abort message, so that they fail
/// with the same words rather than with "the store server closed the connection".
fn linger(store: &TcpStore, nnodes: usize) {
    let deadline = Instant::now() + ABORT_LINGER;
    while Instant::now() < deadline {
        let claimed = (1..nnodes)
            .filter(|m| store.check(&[&format!("{PREFIX}machine{m}/owner")]).unwrap_or(false))
            .count() as i64;
        if store.add(ABORT_SEEN_KEY, 0).map_or(true, |seen| seen >= claimed) {
            return;
        }
        std::thread::sleep(POLL / 4);
    }
}

/// `1, 2, 3`.
pub(super) fn list(items: &[usize]) -> String {
    items.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
}

/// This machine's host name ("unknown host" when it cannot be read).
pub(super) fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into `buf`.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown host".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(n: usize, nnodes: usize) -> JobView {
        let mut cfg = LaunchConfig::local(n, "train", vec![]);
        cfg.nnodes = nnodes;
        JobView::of(&cfg)
    }

    #[test]
    fn a_disagreement_names_both_values_and_machines_the_same_way_on_both_sides() {
        let (m0, m1) = (view(2, 2), view(1, 2));
        let from_0 = m0.disagreement(0, 1, &JobView::decode(&m1.encode())).unwrap();
        let from_1 = m1.disagreement(1, 0, &JobView::decode(&m0.encode())).unwrap();
        assert_eq!(from_0, from_1);
        assert_eq!(
            from_0,
            "machine 1 launched with num_processes 2 but machine 0 with 4; pass the same -n/--num-processes on \
             every machine (the TOTAL over all machines)"
        );
        assert_eq!(m0.disagreement(0, 1, &JobView::decode(&m0.encode())), None);
    }
}
