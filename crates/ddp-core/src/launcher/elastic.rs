//! Elastic membership: torchrun's `--nnodes MIN:MAX`. The job trains on every machine that is there, at least
//! `MIN` and at most `MAX` of them, and re-forms when one is lost or one arrives.
//!
//! The job runs in **rounds**. Each round has a fixed membership (the machines whose launchers joined it) and
//! one generation of workers on each member, ranked densely in machine-rank order. Machine 0's launcher hosts
//! the store for the whole launch and closes every round; it is the one machine the job cannot lose (as the
//! host of torchrun's c10d rendezvous endpoint). In the store, under `accel/elastic/`:
//!
//! - `round{r}/join/{m}`: machine `m` asks to train in round `r` (its launcher, then its view of the job, which
//!   every machine must share: processes per machine, `MIN:MAX`, `max_restarts`, backend, program, accel-rs
//!   version). Claimed with `compare_set`, so two launchers with one machine rank are refused naming the holder.
//! - `round{r}/refused/{m}`: machine 0 turned the launcher that asked for `round{r}/join/{m}` away (its view
//!   disagrees, or its rank is a running machine's), and freed the place; the running round goes on.
//! - `round{r}/members`: written by machine 0 when it closes round `r`: the members, then one line saying what
//!   changed. It closes a round when every machine has joined (`MAX`), or at least `MIN` have and either every
//!   member of the previous round is back (a restart or an arrival: nobody to wait for) or `last_call` has passed
//!   since it began waiting (torchrun's `last_call_timeout`: a lost machine is not waited for longer).
//! - `round{r}/stop`: the first reason to end round `r` (`compare_set`: later ones are its consequences): a
//!   worker failed on some machine, a launcher was interrupted, or a machine asked to join round `r + 1` while
//!   `r` runs (machine 0 sees it). Every launcher watches it and stops its workers at once, so all of them
//!   meet at round `r + 1` within a second or two instead of each waiting for a collective to time out.
//! - `latest`: the newest closed round; a launcher that starts late joins the round after it.
//! - `min_max` (machine 0, at start): a static launcher that reaches this store fails naming both kinds of job.
//!
//! A machine whose store requests to machine 0 go unanswered for [`ANSWER_GRACE`] counts machine 0 as lost: it
//! stops its workers and ends, saying so.
//!
//! A round ended by a failure counts against `max_restarts` (machine 0 counts; past it, it fails every
//! machine with the reason); one ended by an arrival does not, as in torchrun. The workers of each round get
//! the round's number as ACCEL_RESTART_COUNT (their process groups' keys are namespaced by it), the round's
//! world size and ranks, and ACCEL_ELASTIC_NNODES=`MIN:MAX`; they resume from the newest checkpoint themselves
//! (the Trainer does with `resume_from_checkpoint: latest`, keeping the global batch).

use super::rendezvous::{
    self, elastic_join_key as join_key, list, JobView, ABORT_KEY, ELASTIC_MARK, ELASTIC_PREFIX as PREFIX,
};
use super::signals::SignalGuard;
use super::LaunchConfig;
use crate::store::{Store, TcpStore};
use crate::token::RunToken;
use crate::{DdpError, Result};
use std::time::{Duration, Instant};

/// How often a waiting launcher looks at the store.
const POLL: Duration = Duration::from_millis(100);
/// How long a store request may go unanswered before machine 0 counts as lost (a cut link, a dead machine): a
/// launcher cut off from the job then ends within a few of these, saying so, instead of the store's default 60 s.
const ANSWER_GRACE: Duration = Duration::from_secs(10);

/// Why a round ended, as the first launcher to see it wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StopKind {
    /// A worker failed (counts against `max_restarts`).
    Failure,
    /// A launcher other than machine 0's left (interrupted): the others go on without it.
    Left,
    /// A machine asked to join.
    Arrival,
}

impl StopKind {
    fn tag(self) -> &'static str {
        match self {
            StopKind::Failure => "failure",
            StopKind::Left => "left",
            StopKind::Arrival => "arrival",
        }
    }

    fn parse(tag: &str) -> StopKind {
        match tag {
            "left" => StopKind::Left,
            "arrival" => StopKind::Arrival,
            _ => StopKind::Failure,
        }
    }
}

/// One closed round: its number, its members (machine ranks, ascending) and what changed from the round before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Round {
    pub(crate) number: u64,
    pub(crate) machines: Vec<usize>,
    pub(crate) change: String,
}

impl Round {
    /// This machine's rank within the round (its GROUP_RANK), when it is a member.
    pub(crate) fn node_rank(&self, machine: usize) -> Option<usize> {
        self.machines.iter().position(|m| *m == machine)
    }

    fn encode(&self) -> Vec<u8> {
        format!("{}\n{}", list(&self.machines), self.change).into_bytes()
    }

    fn decode(number: u64, bytes: &[u8]) -> Round {
        let text = String::from_utf8_lossy(bytes);
        let (machines, change) = text.split_once('\n').unwrap_or((&text, ""));
        let machines = machines.split(", ").filter_map(|m| m.trim().parse().ok()).collect();
        Round { number, machines, change: change.to_string() }
    }
}

/// One machine's launcher in an elastic job: its connection to machine 0's store and what it tells the others.
pub(crate) struct Elastic<'a> {
    cfg: &'a LaunchConfig,
    min: usize,
    store: TcpStore,
    addr: String,
    view: JobView,
    holder: String,
    /// Rounds ended by a failure so far (machine 0 counts them against `max_restarts`).
    failures: usize,
    /// Set once a request to machine 0's store failed: machine 0 counts as lost from then on, so the launcher
    /// neither waits on the store again (each try would take [`ANSWER_GRACE`] or a connect timeout) nor joins.
    unreachable: std::cell::Cell<bool>,
}

impl<'a> Elastic<'a> {
    /// Connects to machine 0's store at `addr` (machine 0 to its own), waiting up to `rdzv_timeout` for it.
    pub(crate) fn connect(
        cfg: &'a LaunchConfig,
        min: usize,
        addr: &str,
        token: RunToken,
        signals: &SignalGuard,
        launch_id: u64,
    ) -> Result<Self> {
        let store = rendezvous::connect(cfg, addr, token, signals, Instant::now())?.with_answer_grace(ANSWER_GRACE);
        let holder = format!("{} (pid {}, launch {launch_id})", rendezvous::hostname(), std::process::id());
        if cfg.node_rank == 0 {
            store.set(ELASTIC_MARK, format!("{min}:{}", cfg.nnodes).as_bytes())?;
        }
        Ok(Elastic {
            cfg,
            min,
            store,
            addr: addr.to_string(),
            view: JobView::of(cfg),
            holder,
            failures: 0,
            unreachable: std::cell::Cell::new(false),
        })
    }

    /// The round a launcher starting now joins: the one after the newest closed round (0 at the job's start).
    pub(crate) fn first_round(&self) -> Result<u64> {
        let key = format!("{PREFIX}latest");
        if !self.lost_machine_0(self.store.check(&[&key]))? {
            return Ok(0);
        }
        Ok(parse_number(&self.lost_machine_0(self.store.get(&key))?) + 1)
    }

    /// Joins round `number` and returns it once machine 0 has closed it. A round that closed without this
    /// machine (it arrived as the round started) is followed by the next, which its arrival brings about.
    pub(crate) fn join(&mut self, mut number: u64, previous: Option<&Round>, signals: &SignalGuard) -> Result<Round> {
        let me = self.cfg.node_rank;
        // Known lost: say so now (a request would first wait for a connection that cannot come).
        self.lost_machine_0(Ok(()))?;
        loop {
            self.claim(number)?;
            let round = if me == 0 { self.close(number, previous, signals)? } else { self.wait(number, signals)? };
            if round.node_rank(me).is_some() {
                return Ok(round);
            }
            rendezvous::progress(
                me,
                &format!(
                    "round {number} started without this machine (machines {}); joining round {} (the running \
                     machines restart their workers for it)",
                    list(&round.machines),
                    number + 1
                ),
            );
            number += 1;
        }
    }

    /// Ends round `round` for every machine, for `reason` (the first reason given wins; later ones are its
    /// consequences).
    pub(crate) fn request_stop(&self, round: u64, kind: StopKind, reason: &str) {
        if self.unreachable.get() {
            return;
        }
        let value = format!("{}\n{reason}", kind.tag());
        // A failure here (machine 0 gone) is remembered: the next join says so at once instead of waiting again.
        let _ = self.reachable(self.store.compare_set(&format!("{PREFIX}round{round}/stop"), b"", value.as_bytes()));
    }

    /// Ends the whole job on every machine with `message` (machine 0 leaving, or no restarts left).
    fn abort(&self, message: &str) {
        let _ = self.store.compare_set(ABORT_KEY, b"", message.as_bytes());
    }

    /// Machine 0: [`Elastic::abort`], then keeps its store up until the (at most `machines` − 1) others have
    /// read why, or [`rendezvous::ABORT_LINGER`] has passed, so that they fail with the same words.
    pub(crate) fn abort_and_linger(&self, message: &str, machines: usize) {
        self.abort(message);
        let deadline = Instant::now() + rendezvous::ABORT_LINGER;
        while Instant::now() < deadline
            && self.store.add(rendezvous::ABORT_SEEN_KEY, 0).is_ok_and(|seen| seen + 1 < machines as i64)
        {
            std::thread::sleep(POLL / 4);
        }
    }

    /// Whether round `round` must end now, and why (the launch's watch while the workers run): another machine
    /// stopped it, the job was aborted, or — on machine 0 — a machine asks to join the next round. `None` when
    /// the store cannot be reached: the workers go on, and their own collectives say whether the job is intact.
    pub(crate) fn should_stop(&self, round: &Round) -> Option<String> {
        if self.unreachable.get() {
            return None; // said already; the workers are being stopped
        }
        let stop_key = format!("{PREFIX}round{}/stop", round.number);
        let Some(stopped) = self.reachable(self.store.check(&[&stop_key])) else {
            // Machine 0 does not answer (gone, stopped, or cut off): the job cannot re-form without it.
            return Some(format!("machine 0's store at {} does not answer", self.addr));
        };
        if stopped {
            let value = self.reachable(self.store.get(&stop_key))?;
            return Some(String::from_utf8_lossy(&value).split_once('\n').map_or("", |(_, r)| r).to_string());
        }
        if self.reachable(self.store.check(&[ABORT_KEY]))? {
            return Some(String::from_utf8_lossy(&self.reachable(self.store.get(ABORT_KEY))?).into_owned());
        }
        if self.cfg.node_rank == 0 {
            let next = round.number + 1;
            for m in 0..self.cfg.nnodes {
                let key = join_key(next, m);
                if !self.store.check(&[&key]).unwrap_or(false) {
                    continue;
                }
                // A machine that may not join is turned away without disturbing the running round.
                if let Some(refusal) = self.refusal(round, m, &key) {
                    self.refuse(next, m, &key, &refusal);
                    continue;
                }
                let reason = format!("machine {m} asks to join");
                self.request_stop(round.number, StopKind::Arrival, &reason);
                return Some(reason);
            }
        }
        None
    }

    /// Why machine `m`, asking (under `key`) to join the round after `round`, may not: it has the rank of a machine
    /// that is running (`round`'s member), or it disagrees about the job. `None` when it may.
    fn refusal(&self, round: &Round, m: usize, key: &str) -> Option<String> {
        let value = self.store.get(key).ok()?;
        let text = String::from_utf8_lossy(&value);
        let (holder, view) = text.split_once('\n').unwrap_or((&text, ""));
        let stopping = self.store.check(&[&format!("{PREFIX}round{}/stop", round.number)]).unwrap_or(false);
        if round.machines.contains(&m) && !stopping {
            // (A member whose round just ended asks for the next one after saying so: not a second machine.)
            return Some(format!(
                "machine rank {m} is already running in round {} of this job; {holder} was turned away: give every \
                 machine its own --machine-rank (0..{})",
                round.number, self.cfg.nnodes
            ));
        }
        self.view.disagreement(0, m, &JobView::decode(view.as_bytes()))
    }

    /// Turns the launcher that asked under `key` away from round `number` with `why`, and frees the place it
    /// claimed (the rank's rightful machine claims it later).
    fn refuse(&self, number: u64, m: usize, key: &str, why: &str) {
        let holder =
            self.store.get(key).ok().map(|v| String::from_utf8_lossy(&v).lines().next().unwrap_or("").to_string());
        let value = format!("{}\n{why}", holder.unwrap_or_default());
        let _ = self.store.set(&format!("{PREFIX}round{number}/refused/{m}"), value.as_bytes());
        let _ = self.store.delete_key(key);
    }

    /// The value of a store request made while the workers run; `None` (and machine 0 counted as lost) when it
    /// failed or machine 0 already counts as lost.
    fn reachable<T>(&self, r: Result<T>) -> Option<T> {
        if self.unreachable.get() {
            return None;
        }
        r.inspect_err(|_| self.unreachable.set(true)).ok()
    }

    /// Claims this machine's place in round `number`, with its view of the job.
    fn claim(&self, number: u64) -> Result<()> {
        let me = self.cfg.node_rank;
        let value = format!("{}\n{}", self.holder, String::from_utf8_lossy(&self.view.encode()));
        let key = join_key(number, me);
        let claimed = self.lost_machine_0(self.store.compare_set(&key, b"", value.as_bytes()))?;
        if claimed != value.as_bytes() {
            let claimed = String::from_utf8_lossy(&claimed);
            return Err(DdpError::Rendezvous(format!(
                "machine rank {me} is already taken by {}; give every machine its own --machine-rank (0..{})",
                claimed.lines().next().unwrap_or("another launcher"),
                self.cfg.nnodes
            )));
        }
        Ok(())
    }

    /// Machine 0: waits for the machines of round `number`, checks they agree on the job, and closes the round.
    fn close(&mut self, number: u64, previous: Option<&Round>, signals: &SignalGuard) -> Result<Round> {
        let (min, max) = (self.min, self.cfg.nnodes);
        let before: &[usize] = previous.map_or(&[], |p| &p.machines);
        let ended_by = match previous {
            Some(p) => self.stop_reason(p.number)?,
            None => None,
        };
        if let Some((StopKind::Failure, reason)) = &ended_by {
            self.failures += 1;
            if self.failures > self.cfg.max_restarts {
                let message = format!(
                    "round {} ended: {reason}; no restarts left (max_restarts = {}; an arrival does not count, a \
                     failure does)",
                    number - 1,
                    self.cfg.max_restarts
                );
                self.abort_and_linger(&message, before.len());
                return Err(DdpError::Rendezvous(message));
            }
        }
        let start = Instant::now();
        let mut last_progress = Instant::now();
        loop {
            let mut joined = Vec::new();
            for m in 0..max {
                let key = join_key(number, m);
                if !self.store.check(&[&key])? {
                    continue;
                }
                let value = self.store.get(&key)?;
                let text = String::from_utf8_lossy(&value);
                let theirs = JobView::decode(text.split_once('\n').map_or("", |(_, v)| v).as_bytes());
                if let Some(message) = self.view.disagreement(0, m, &theirs) {
                    if number > 0 && !before.contains(&m) {
                        // A machine arriving with another job in mind: turned away, the others go on.
                        self.refuse(number, m, &key, &message);
                        continue;
                    }
                    self.abort_and_linger(&message, max);
                    return Err(DdpError::Rendezvous(message));
                }
                joined.push(m);
            }
            let everyone_back = number > 0 && before.iter().all(|m| joined.contains(m));
            let last_call = start.elapsed() >= self.cfg.last_call;
            if joined.len() == max || (joined.len() >= min && (everyone_back || last_call)) {
                let round = Round {
                    number,
                    change: describe_change(before, &joined, ended_by.as_ref().map(|(_, r)| r.as_str())),
                    machines: joined,
                };
                self.store.set(&format!("{PREFIX}round{number}/members"), &round.encode())?;
                self.store.set(&format!("{PREFIX}latest"), number.to_string().as_bytes())?;
                return Ok(round);
            }
            let waiting = format!(
                "round {number}: {} of {min}..{max} machines here (machines {}); waiting {} at {}",
                joined.len(),
                list(&joined),
                if joined.len() >= min {
                    format!("up to {:.0} s (last call) for the others", self.cfg.last_call.as_secs_f64())
                } else {
                    format!("for at least {}", min - joined.len())
                },
                self.addr
            );
            if start.elapsed() >= self.cfg.rdzv_timeout {
                let message = format!(
                    "timed out after {:.1} s in {waiting}; start `accel launch` on the missing machines with their \
                     own --machine-rank, the same --main-process-ip/--main-process-port and ACCEL_RUN_TOKEN",
                    start.elapsed().as_secs_f64()
                );
                self.abort(&message);
                return Err(DdpError::Rendezvous(message));
            }
            if let Some(e) = rendezvous::interrupted(signals, &waiting) {
                return Err(e);
            }
            if last_progress.elapsed() >= self.cfg.progress_interval {
                last_progress = Instant::now();
                rendezvous::progress(0, &waiting);
            }
            std::thread::sleep(POLL);
        }
    }

    /// Machines other than 0: waits until machine 0 closes round `number`.
    fn wait(&self, number: u64, signals: &SignalGuard) -> Result<Round> {
        let me = self.cfg.node_rank;
        let key = format!("{PREFIX}round{number}/members");
        let start = Instant::now();
        let mut last_progress = Instant::now();
        loop {
            if self.lost_machine_0(self.store.check(&[ABORT_KEY]))? {
                let message = String::from_utf8_lossy(&self.lost_machine_0(self.store.get(ABORT_KEY))?).into_owned();
                let _ = self.store.add(rendezvous::ABORT_SEEN_KEY, 1);
                return Err(DdpError::Rendezvous(message));
            }
            let refused = format!("{PREFIX}round{number}/refused/{me}");
            if self.lost_machine_0(self.store.check(&[&refused]))? {
                let value = self.lost_machine_0(self.store.get(&refused))?;
                let text = String::from_utf8_lossy(&value);
                if let Some((holder, why)) = text.split_once('\n') {
                    if holder == self.holder {
                        return Err(DdpError::Rendezvous(why.to_string()));
                    }
                }
            }
            if self.lost_machine_0(self.store.check(&[&key]))? {
                return Ok(Round::decode(number, &self.lost_machine_0(self.store.get(&key))?));
            }
            if self.lost_machine_0(self.store.check(&[&rendezvous::view_key(0)]))? {
                return Err(DdpError::Rendezvous(format!(
                    "machine 0 launched with num_machines {} (a static job) but machine {me} with {}:{} (an \
                     elastic job); pass the same --nnodes on every machine",
                    self.cfg.nnodes, self.min, self.cfg.nnodes
                )));
            }
            let waiting = format!("waiting for machine 0 to start round {number} at {}", self.addr);
            if start.elapsed() >= self.cfg.rdzv_timeout {
                return Err(DdpError::Rendezvous(format!(
                    "timed out after {:.1} s {waiting}",
                    start.elapsed().as_secs_f64()
                )));
            }
            if let Some(e) = rendezvous::interrupted(signals, &waiting) {
                return Err(e);
            }
            if last_progress.elapsed() >= self.cfg.progress_interval {
                last_progress = Instant::now();
                rendezvous::progress(me, &waiting);
            }
            std::thread::sleep(POLL);
        }
    }

    /// Why round `number` ended, as recorded (`None` when nothing was: the job's first round).
    fn stop_reason(&self, number: u64) -> Result<Option<(StopKind, String)>> {
        let key = format!("{PREFIX}round{number}/stop");
        if !self.store.check(&[&key])? {
            return Ok(None);
        }
        let value = self.store.get(&key)?;
        let text = String::from_utf8_lossy(&value);
        let (tag, reason) = text.split_once('\n').unwrap_or((&text, ""));
        Ok(Some((StopKind::parse(tag), reason.to_string())))
    }

    /// A store error on a machine other than 0 means machine 0 (and with it the job's rendezvous) is gone: say so.
    fn lost_machine_0<T>(&self, r: Result<T>) -> Result<T> {
        if self.unreachable.get() {
            return Err(DdpError::Rendezvous(format!(
                "lost machine 0's store at {} (a request to it failed, or went unanswered for {:.0} s); machine 0 \
                 hosts the rendezvous of an elastic job, which survives the loss of any other machine but not of \
                 machine 0: restart this machine's launcher once machine 0 is reachable",
                self.addr,
                ANSWER_GRACE.as_secs_f64()
            )));
        }
        r.inspect_err(|_| self.unreachable.set(true)).map_err(|e| match e {
            DdpError::Connect { .. } | DdpError::Io { .. } | DdpError::StoreTimeout { .. } => {
                DdpError::Rendezvous(format!(
                "lost machine 0's store at {} ({e}); machine 0 hosts the rendezvous of an elastic job, which survives \
                 the loss of any other machine but not of machine 0: restart this machine's launcher once machine 0 \
                 is reachable",
                self.addr
            ))
            }
            other => other,
        })
    }
}

/// What changed between two rounds' members, and why the earlier round ended.
fn describe_change(before: &[usize], after: &[usize], ended_by: Option<&str>) -> String {
    let machines = |ms: &[usize]| format!("machine{} {}", if ms.len() == 1 { "" } else { "s" }, list(ms));
    if before.is_empty() {
        return format!("started with {}", machines(after));
    }
    let left: Vec<usize> = before.iter().copied().filter(|m| !after.contains(m)).collect();
    let arrived: Vec<usize> = after.iter().copied().filter(|m| !before.contains(m)).collect();
    let mut parts = Vec::new();
    if !left.is_empty() {
        parts.push(format!("{} left", machines(&left)));
    }
    if !arrived.is_empty() {
        parts.push(format!("{} joined", machines(&arrived)));
    }
    if parts.is_empty() {
        parts.push("restarted with the same machines".into());
    }
    let why = ended_by.map(|r| format!(" (the round before ended: {r})")).unwrap_or_default();
    format!("{}{why}", parts.join(", "))
}

fn parse_number(bytes: &[u8]) -> u64 {
    String::from_utf8_lossy(bytes).trim().parse().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_survives_the_store_and_says_what_changed() {
        let round = Round { number: 3, machines: vec![0, 2], change: describe_change(&[0, 1], &[0, 2], Some("x")) };
        assert_eq!(Round::decode(3, &round.encode()), round);
        assert_eq!(round.change, "machine 1 left, machine 2 joined (the round before ended: x)");
        assert_eq!((round.node_rank(2), round.node_rank(1)), (Some(1), None));
        assert_eq!(describe_change(&[], &[0, 1], None), "started with machines 0, 1");
        assert_eq!(describe_change(&[0], &[0], None), "restarted with the same machines");
    }
}
