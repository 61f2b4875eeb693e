//! Runs every rank's action list of a [`PipelineSchedule`] against the others, without a model, to check that the
//! schedule is runnable and to measure what it costs on paper:
//!
//! - every stage forwards and backwards every micro-batch exactly once, a backward after its forward, a compute
//!   after the receive it needs, a send after the compute that made its tensor;
//! - receives match their peer's sends in order (point-to-point channels carry no tags), and no rank waits for
//!   a message that never comes (a deadlock names each rank's blocked action);
//! - with a forward costing `forward` and a backward `backward` time units, sends free and receives waiting for
//!   their message: each action's start and end (the timeline), each rank's idle (bubble) fraction, and the most
//!   micro-batches whose activations a rank holds at once.
//!
//! For GPipe and 1F1B the bubble comes out as `(pp − 1) / (m + pp − 1)` on every rank and for interleaved 1F1B as
//! `(pp − 1) / (v · m + pp − 1)` (Narayanan et al. 2021, §2.2), which the tests check.

use super::schedule::{Action, PipelineSchedule};
use crate::{AccelError, Result};
use std::collections::{HashSet, VecDeque};

/// Time units of one stage's forward and backward of one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Costs {
    /// Forward of one micro-batch on one stage.
    pub forward: f64,
    /// Backward of one micro-batch on one stage.
    pub backward: f64,
}

impl Default for Costs {
    /// The usual rule of thumb: a backward costs two forwards.
    fn default() -> Self {
        Costs { forward: 1.0, backward: 2.0 }
    }
}

/// One compute action on the timeline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// The forward or backward.
    pub action: Action,
    /// Start time.
    pub start: f64,
    /// End time.
    pub end: f64,
}

/// What running a schedule on paper gave.
#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    /// Per rank, its forwards and backwards in order with their times.
    pub timeline: Vec<Vec<Span>>,
    /// When the last rank finishes.
    pub makespan: f64,
    /// Per rank, the idle fraction of the makespan.
    pub bubble: Vec<f64>,
    /// Per rank, the most micro-batches forwarded but not yet backwarded at once (activations held), over its
    /// stages.
    pub peak_in_flight: Vec<usize>,
}

impl SimReport {
    /// The timeline as text, one row per rank, one column per `unit` of time: a forward of micro-batch k as the
    /// digit k, its backward as the letter `a` + k (`+` / `*` past 10 and 26), idle time (the bubble) as `.`:
    ///
    /// ```text
    /// rank 0 |01..aa.bb|      1F1B, pp 2, 2 micro-batches, a backward costing two forwards
    /// rank 1 |.0aa1bb..|
    /// ```
    pub fn draw(&self, unit: f64) -> String {
        let cols = (self.makespan / unit).round() as usize;
        let rows: Vec<String> = self
            .timeline
            .iter()
            .enumerate()
            .map(|(r, spans)| {
                let mut line = vec!['.'; cols];
                for span in spans {
                    let (start, end) = ((span.start / unit).round() as usize, (span.end / unit).round() as usize);
                    let mb = span.action.at().1 as u32;
                    let mark = match span.action.kind() {
                        "F" => char::from_digit(mb, 10).unwrap_or('+'),
                        _ => char::from_u32('a' as u32 + mb).filter(|_| mb < 26).unwrap_or('*'),
                    };
                    line.iter_mut().take(end.min(cols)).skip(start).for_each(|c| *c = mark);
                }
                format!("rank {r} |{}|", line.into_iter().collect::<String>())
            })
            .collect();
        rows.join("\n")
    }
}

/// A rank's progress.
#[derive(Default)]
struct RankState {
    pc: usize,
    clock: f64,
    busy: f64,
    forwarded: HashSet<(usize, usize)>,
    backwarded: HashSet<(usize, usize)>,
    received: HashSet<Action>,
    in_flight: usize,
    peak: usize,
    spans: Vec<Span>,
}

/// Runs `schedule` on paper with `costs` (see the module documentation).
///
/// Errors ([`AccelError::InvalidArgument`] naming the rank and the action): an action out of the schedule's
/// shape, a compute before what it needs, a receive that does not match the next message from its peer, a
/// deadlock, a stage and micro-batch not forwarded and backwarded exactly once.
pub fn simulate(schedule: &PipelineSchedule, costs: Costs) -> Result<SimReport> {
    let (pp, stages, m) = (schedule.pp, schedule.num_stages(), schedule.microbatches);
    if schedule.ranks.len() != pp {
        return Err(bad(format!("{} action lists for pp = {pp}", schedule.ranks.len())));
    }
    for (r, actions) in schedule.ranks.iter().enumerate() {
        if let Some(a) = actions.iter().find(|a| a.at().0 >= stages || a.at().1 >= m || schedule.rank_of(a.at().0) != r)
        {
            return Err(bad(format!("rank {r}: {a} is not one of its actions ({stages} stages, {m} micro-batches)")));
        }
    }
    // channels[src][dst]: messages posted and not yet received, with the time they were posted.
    let mut channels: Vec<Vec<VecDeque<(Action, f64)>>> = vec![vec![VecDeque::new(); pp]; pp];
    let mut ranks: Vec<RankState> = (0..pp).map(|_| RankState::default()).collect();
    loop {
        let mut progressed = false;
        for (r, st) in ranks.iter_mut().enumerate() {
            while let Some(&action) = schedule.ranks[r].get(st.pc) {
                if !step(schedule, r, action, st, &mut channels, costs)? {
                    break;
                }
                st.pc += 1;
                progressed = true;
            }
        }
        if ranks.iter().enumerate().all(|(r, st)| st.pc == schedule.ranks[r].len()) {
            break;
        }
        if !progressed {
            let blocked: Vec<String> = ranks
                .iter()
                .enumerate()
                .filter_map(|(r, st)| schedule.ranks[r].get(st.pc).map(|a| format!("rank {r} waits at {a}")))
                .collect();
            return Err(bad(format!("deadlock: {}", blocked.join("; "))));
        }
    }
    for (r, st) in ranks.iter().enumerate() {
        for stage in (r..stages).step_by(pp) {
            for mb in 0..m {
                if !st.forwarded.contains(&(stage, mb)) || !st.backwarded.contains(&(stage, mb)) {
                    return Err(bad(format!(
                        "rank {r}: stage {stage} micro-batch {mb} is not forwarded and backwarded"
                    )));
                }
            }
        }
        if let Some((src, q)) = channels.iter().enumerate().find_map(|(src, c)| c[r].front().map(|q| (src, q))) {
            return Err(bad(format!("rank {r} never receives {} from rank {src}", q.0)));
        }
    }
    let makespan = ranks.iter().map(|st| st.clock).fold(0.0, f64::max);
    Ok(SimReport {
        bubble: ranks.iter().map(|st| if makespan > 0.0 { 1.0 - st.busy / makespan } else { 0.0 }).collect(),
        peak_in_flight: ranks.iter().map(|st| st.peak).collect(),
        timeline: ranks.into_iter().map(|st| st.spans).collect(),
        makespan,
    })
}

/// Runs `action` on rank `r` if it can run now; `Ok(false)` when it waits for a message.
fn step(
    schedule: &PipelineSchedule,
    r: usize,
    action: Action,
    st: &mut RankState,
    channels: &mut [Vec<VecDeque<(Action, f64)>>],
    costs: Costs,
) -> Result<bool> {
    let last = schedule.num_stages() - 1;
    let (stage, mb) = action.at();
    let need = |st: &RankState, what: Action| -> Result<()> {
        if st.received.contains(&what) {
            Ok(())
        } else {
            Err(bad(format!("rank {r} runs {action} before {what}")))
        }
    };
    match action {
        Action::Forward { .. } => {
            if stage > 0 {
                need(st, Action::RecvActivation { stage, microbatch: mb })?;
            }
            if !st.forwarded.insert((stage, mb)) {
                return Err(bad(format!("rank {r} runs {action} twice")));
            }
            st.in_flight += 1;
            st.peak = st.peak.max(st.in_flight);
            compute(st, action, costs.forward);
        }
        Action::Backward { .. } => {
            if !st.forwarded.contains(&(stage, mb)) {
                return Err(bad(format!("rank {r} runs {action} before its forward")));
            }
            if stage < last {
                need(st, Action::RecvGradient { stage, microbatch: mb })?;
            }
            if !st.backwarded.insert((stage, mb)) {
                return Err(bad(format!("rank {r} runs {action} twice")));
            }
            st.in_flight -= 1;
            compute(st, action, costs.backward);
        }
        Action::SendActivation { .. } | Action::SendGradient { .. } => {
            let (made, to) = match action {
                Action::SendActivation { .. } if stage < last => (st.forwarded.contains(&(stage, mb)), stage + 1),
                Action::SendGradient { .. } if stage > 0 => (st.backwarded.contains(&(stage, mb)), stage - 1),
                _ => return Err(bad(format!("rank {r}: {action} has no stage to go to"))),
            };
            if !made {
                return Err(bad(format!("rank {r} runs {action} before computing what it sends")));
            }
            channels[r][schedule.rank_of(to)].push_back((action, st.clock));
        }
        Action::RecvActivation { .. } | Action::RecvGradient { .. } => {
            let (expected, from) = match action {
                Action::RecvActivation { .. } if stage > 0 => {
                    (Action::SendActivation { stage: stage - 1, microbatch: mb }, stage - 1)
                }
                Action::RecvGradient { .. } if stage < last => {
                    (Action::SendGradient { stage: stage + 1, microbatch: mb }, stage + 1)
                }
                _ => return Err(bad(format!("rank {r}: {action} has no stage to come from"))),
            };
            let src = schedule.rank_of(from);
            match channels[src][r].front() {
                None => return Ok(false),
                Some(&(sent, _)) if sent != expected => {
                    return Err(bad(format!(
                        "rank {r} expects {expected} from rank {src} at {action}, but the next message from rank \
                         {src} is {sent} (messages between two ranks arrive in the order they were sent)"
                    )))
                }
                Some(&(_, posted)) => {
                    st.clock = st.clock.max(posted);
                    channels[src][r].pop_front();
                    st.received.insert(action);
                }
            }
        }
    }
    Ok(true)
}

fn compute(st: &mut RankState, action: Action, cost: f64) {
    let start = st.clock;
    st.clock += cost;
    st.busy += cost;
    st.spans.push(Span { action, start, end: st.clock });
}

fn bad(msg: String) -> AccelError {
    AccelError::InvalidArgument(format!("pipeline schedule: {msg}"))
}
