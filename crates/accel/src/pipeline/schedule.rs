//! Pipeline schedules as data: for each pp rank, the ordered list of [`Action`]s one optimizer step runs — the
//! forwards and backwards of its stages' micro-batches and the sends and receives between stages — so that a
//! schedule can be printed, read back, checked ([`super::simulate::simulate`]) and drawn before anything runs.
//!
//! Stages: the model is cut into `pp · v` stages (`v` = virtual stages per rank, 1 except for interleaved 1F1B);
//! stage `s` lives on pp rank `s mod pp` (Megatron's looped placement: rank `r` holds stages `r, r + pp, …`).
//! Stage `s` receives its input from stage `s − 1` and sends its output to stage `s + 1`; the last stage computes
//! the loss, and its backward starts from it.
//!
//! Schedules (per rank `r` of `pp`, `m` micro-batches):
//! - **GPipe** (Huang et al. 2019): the `m` forwards, then the `m` backwards, in micro-batch order. Holds the
//!   activations of all `m` micro-batches.
//! - **1F1B** (PipeDream-Flush; Narayanan et al. 2021, §2.2; Megatron-LM `forward_backward_pipelining_without_
//!   interleaving`): `min(pp − r − 1, m)` warm-up forwards, then one forward and one backward in turn, then the
//!   remaining backwards. The same bubble as GPipe, `(pp − 1) / (m + pp − 1)` of the step, but at most `pp − r`
//!   micro-batches' activations in flight.
//! - **Interleaved 1F1B** (Narayanan et al. 2021, §2.2; Megatron-LM `forward_backward_pipelining_with_
//!   interleaving`): `v` stages per rank, micro-batches taken in groups of `pp` per stage; `(pp − r − 1) · 2 +
//!   (v − 1) · pp` warm-up forwards (at most `m · v`). The bubble shrinks to `(pp − 1) / (v · m + pp − 1)`.
//!
//! Sends are asynchronous (posted, completed later, as torch's `batch_isend_irecv` and Megatron's p2p ops do);
//! receives block until their message arrives. Messages between two ranks arrive in the order they were sent (the
//! backends' point-to-point channels have no tags), so every rank must receive in its peer's sending order:
//! [`super::simulate::simulate`] checks that, and that no rank waits forever.
//!
//! The text form is torch.distributed.pipelining's: an action prints as `{stage}{kind}{micro-batch}` — `0F3`,
//! `1B0`, `0SEND_F3`, `1RECV_F3`, `1SEND_B0`, `0RECV_B0` — and a schedule as one comma-separated line per rank
//! ([`PipelineSchedule::to_csv`], [`PipelineSchedule::from_csv`]), as torch's `_dump_csv` / `_load_csv`.

use crate::{AccelError, Result};
use std::fmt;
use std::str::FromStr;

/// Which schedule (`pipeline_parallel_schedule` in the config: `GPipe`, `1F1B`, `Interleaved1F1B`, as torchtitan
/// spells them). Default: 1F1B (torchtitan's default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    GPipe,
    /// One forward, one backward (PipeDream-Flush).
    #[default]
    OneFOneB,
    /// 1F1B over `v` virtual stages per rank.
    Interleaved1F1B,
}

impl ScheduleKind {
    /// The config spellings.
    pub const CHOICES: &'static str = "GPipe, 1F1B, Interleaved1F1B";

    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "GPipe",
            ScheduleKind::OneFOneB => "1F1B",
            ScheduleKind::Interleaved1F1B => "Interleaved1F1B",
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ScheduleKind {
    type Err = AccelError;
    /// Case-insensitive; `-` and `_` ignored (`gpipe`, `1f1b`, `interleaved_1f1b`).
    fn from_str(s: &str) -> Result<Self> {
        let key: String = s.chars().filter(|c| *c != '_' && *c != '-').collect::<String>().to_ascii_lowercase();
        match key.as_str() {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "interleaved1f1b" => Ok(ScheduleKind::Interleaved1F1B),
            _ => Err(AccelError::Config {
                key: "pipeline_parallel_schedule".into(),
                value: s.to_string(),
                reason: format!("expected one of {}", Self::CHOICES),
            }),
        }
    }
}

impl serde::Serialize for ScheduleKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for ScheduleKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(|e: AccelError| serde::de::Error::custom(e.to_string()))
    }
}

/// What a rank does next. `stage` is the global stage index `0..pp · v`; `microbatch` is `0..m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// The stage's forward of the micro-batch (on the last stage, also its loss).
    Forward { stage: usize, microbatch: usize },
    /// The stage's backward of the micro-batch, from the gradient of its output (the loss on the last stage).
    Backward { stage: usize, microbatch: usize },
    /// Post the stage's output activation to stage + 1's rank.
    SendActivation { stage: usize, microbatch: usize },
    /// Wait for the stage's input activation from stage − 1's rank.
    RecvActivation { stage: usize, microbatch: usize },
    /// Post the gradient of the stage's input to stage − 1's rank.
    SendGradient { stage: usize, microbatch: usize },
    /// Wait for the gradient of the stage's output from stage + 1's rank.
    RecvGradient { stage: usize, microbatch: usize },
}

impl Action {
    /// `(stage, microbatch)`.
    pub fn at(self) -> (usize, usize) {
        match self {
            Action::Forward { stage, microbatch }
            | Action::Backward { stage, microbatch }
            | Action::SendActivation { stage, microbatch }
            | Action::RecvActivation { stage, microbatch }
            | Action::SendGradient { stage, microbatch }
            | Action::RecvGradient { stage, microbatch } => (stage, microbatch),
        }
    }

    /// The kind as torch prints it: `F`, `B`, `SEND_F`, `RECV_F`, `SEND_B`, `RECV_B`.
    pub fn kind(self) -> &'static str {
        match self {
            Action::Forward { .. } => "F",
            Action::Backward { .. } => "B",
            Action::SendActivation { .. } => "SEND_F",
            Action::RecvActivation { .. } => "RECV_F",
            Action::SendGradient { .. } => "SEND_B",
            Action::RecvGradient { .. } => "RECV_B",
        }
    }

    /// Whether this is a forward or backward (compute, not communication).
    pub fn is_compute(self) -> bool {
        matches!(self, Action::Forward { .. } | Action::Backward { .. })
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (stage, mb) = self.at();
        write!(f, "{stage}{}{mb}", self.kind())
    }
}

impl FromStr for Action {
    type Err = AccelError;
    /// Reads `{stage}{kind}{micro-batch}` (`0F3`, `1RECV_B0`).
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            AccelError::InvalidArgument(format!(
            "pipeline action {s:?}: expected {{stage}}{{kind}}{{micro-batch}} with kind F, B, SEND_F, RECV_F, SEND_B \
             or RECV_B (e.g. 0F3, 1RECV_B0)"
        ))
        };
        let s = s.trim();
        let digits = s.bytes().take_while(u8::is_ascii_digit).count();
        let tail = s.bytes().rev().take_while(u8::is_ascii_digit).count();
        if digits == 0 || tail == 0 || digits + tail >= s.len() {
            return Err(bad());
        }
        let stage: usize = s[..digits].parse().map_err(|_| bad())?;
        let microbatch: usize = s[s.len() - tail..].parse().map_err(|_| bad())?;
        Ok(match &s[digits..s.len() - tail] {
            "F" => Action::Forward { stage, microbatch },
            "B" => Action::Backward { stage, microbatch },
            "SEND_F" => Action::SendActivation { stage, microbatch },
            "RECV_F" => Action::RecvActivation { stage, microbatch },
            "SEND_B" => Action::SendGradient { stage, microbatch },
            "RECV_B" => Action::RecvGradient { stage, microbatch },
            _ => return Err(bad()),
        })
    }
}

/// The action lists of every pp rank for one optimizer step's micro-batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineSchedule {
    /// Pipeline ranks.
    pub pp: usize,
    /// Stages per rank (`v`).
    pub virtual_stages: usize,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// `ranks[r]`: rank r's actions, in order.
    pub ranks: Vec<Vec<Action>>,
}

impl PipelineSchedule {
    /// The schedule `kind` for `pp` ranks, `m` micro-batches and `v` stages per rank (`v` must be 1 except for
    /// interleaved 1F1B, which needs `v ≥ 2`).
    ///
    /// Errors ([`AccelError::Config`] naming the key and what would fit): `pp`, `m` or `v` of 0; fewer
    /// micro-batches than pp ranks (every rank would idle most of the step; torch refuses it too); interleaved with
    /// `m` not a multiple of `pp` (Megatron's interleaving takes micro-batches in groups of `pp`); `v ≠ 1` for a
    /// single-stage schedule, `v < 2` for interleaved.
    pub fn new(kind: ScheduleKind, pp: usize, m: usize, v: usize) -> Result<Self> {
        check_shape(kind, pp, m, v)?;
        let ranks = (0..pp)
            .map(|r| {
                let compute = match kind {
                    ScheduleKind::GPipe => gpipe_order(r, m),
                    ScheduleKind::OneFOneB => one_f_one_b_order(r, pp, m),
                    ScheduleKind::Interleaved1F1B => interleaved_order(r, pp, m, v),
                };
                with_communication(&compute, pp * v)
            })
            .collect();
        Ok(PipelineSchedule { pp, virtual_stages: v, microbatches: m, ranks })
    }

    /// One forward of a single micro-batch through every stage, in stage order, with no backward (evaluation):
    /// rank `r` receives, runs and sends on each of its stages `r, r + pp, …`.
    pub fn forward_only(pp: usize, v: usize) -> Self {
        let stages = pp * v;
        let ranks = (0..pp)
            .map(|r| {
                let mut actions = Vec::new();
                for stage in (r..stages).step_by(pp) {
                    if stage > 0 {
                        actions.push(Action::RecvActivation { stage, microbatch: 0 });
                    }
                    actions.push(Action::Forward { stage, microbatch: 0 });
                    if stage + 1 < stages {
                        actions.push(Action::SendActivation { stage, microbatch: 0 });
                    }
                }
                actions
            })
            .collect();
        PipelineSchedule { pp, virtual_stages: v, microbatches: 1, ranks }
    }

    /// Number of stages, `pp · v`.
    pub fn num_stages(&self) -> usize {
        self.pp * self.virtual_stages
    }

    /// The pp rank that holds `stage`.
    pub fn rank_of(&self, stage: usize) -> usize {
        stage % self.pp
    }

    /// One line per rank, actions separated by commas (torch's `_dump_csv` layout).
    pub fn to_csv(&self) -> String {
        self.ranks
            .iter()
            .map(|actions| actions.iter().map(ToString::to_string).collect::<Vec<_>>().join(","))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Reads [`Self::to_csv`]'s text: rank r's actions on line r. The shape (pp, v, m) is taken from the text:
    /// pp = lines, stages = the largest stage + 1, m = the largest micro-batch + 1. Check it with
    /// [`super::simulate::simulate`] before running it.
    ///
    /// Errors: an action that does not parse ([`AccelError::InvalidArgument`] naming it), an empty text, stages
    /// that are not a multiple of the lines.
    pub fn from_csv(text: &str) -> Result<Self> {
        let ranks: Vec<Vec<Action>> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.split(',').filter(|a| !a.trim().is_empty()).map(str::parse).collect::<Result<Vec<_>>>())
            .collect::<Result<_>>()?;
        let pp = ranks.len();
        let all = || ranks.iter().flatten().map(|a| a.at());
        let stages = all().map(|(s, _)| s + 1).max().unwrap_or(0);
        let microbatches = all().map(|(_, mb)| mb + 1).max().unwrap_or(0);
        if pp == 0 || stages == 0 || !stages.is_multiple_of(pp) {
            return Err(AccelError::InvalidArgument(format!(
                "pipeline schedule text: {pp} rank line(s) and {stages} stage(s); expected one line per rank and a \
                 multiple of the rank count of stages"
            )));
        }
        Ok(PipelineSchedule { pp, virtual_stages: stages / pp, microbatches, ranks })
    }
}

fn check_shape(kind: ScheduleKind, pp: usize, m: usize, v: usize) -> Result<()> {
    let config = |key: &str, value: usize, reason: String| {
        Err(AccelError::Config { key: key.into(), value: value.to_string(), reason })
    };
    if pp == 0 {
        return config("parallelism_config_pp_size", pp, "at least 1 pipeline rank".into());
    }
    if m == 0 {
        return config("pipeline_parallel_microbatches", m, "at least 1 micro-batch per step".into());
    }
    match kind {
        ScheduleKind::Interleaved1F1B if v < 2 => config(
            "pipeline_parallel_virtual_stages",
            v,
            "interleaved 1F1B needs at least 2 stages per rank; with 1 use the 1F1B schedule".into(),
        ),
        ScheduleKind::GPipe | ScheduleKind::OneFOneB if v != 1 => config(
            "pipeline_parallel_virtual_stages",
            v,
            format!("{kind} runs 1 stage per rank; set it to 1, or use Interleaved1F1B for {v} stages per rank"),
        ),
        _ if m < pp => config(
            "pipeline_parallel_microbatches",
            m,
            format!(
                "{m} micro-batch(es) cannot fill {pp} pipeline ranks (each would idle most of the step); use at least \
                 {pp}, e.g. {} for a bubble of {:.0} %",
                4 * pp,
                100.0 * (pp - 1) as f64 / (4 * pp + pp - 1) as f64
            ),
        ),
        ScheduleKind::Interleaved1F1B if !m.is_multiple_of(pp) => config(
            "pipeline_parallel_microbatches",
            m,
            format!(
                "interleaved 1F1B takes micro-batches in groups of pp = {pp}; use a multiple of {pp} ({} or {})",
                m / pp * pp,
                m.div_ceil(pp) * pp
            ),
        ),
        _ => Ok(()),
    }
}

/// GPipe's compute order on any rank: every forward, then every backward.
fn gpipe_order(rank: usize, m: usize) -> Vec<Action> {
    let f = (0..m).map(|mb| Action::Forward { stage: rank, microbatch: mb });
    let b = (0..m).map(|mb| Action::Backward { stage: rank, microbatch: mb });
    f.chain(b).collect()
}

/// 1F1B's compute order on `rank`: warm-up forwards, one forward and one backward in turn, cool-down backwards.
fn one_f_one_b_order(rank: usize, pp: usize, m: usize) -> Vec<Action> {
    let warmup = (pp - rank - 1).min(m);
    let mut order: Vec<Action> = (0..warmup).map(|mb| Action::Forward { stage: rank, microbatch: mb }).collect();
    for k in 0..m - warmup {
        order.push(Action::Forward { stage: rank, microbatch: warmup + k });
        order.push(Action::Backward { stage: rank, microbatch: k });
    }
    order.extend((m - warmup..m).map(|mb| Action::Backward { stage: rank, microbatch: mb }));
    order
}

/// Interleaved 1F1B's compute order on `rank` (Megatron-LM's `get_model_chunk_id` / micro-batch numbering): the
/// k-th forward runs chunk `(k / pp) mod v` on micro-batch `(k / (pp·v))·pp + k mod pp`; the k-th backward the
/// same micro-batch numbering with the chunks in reverse.
fn interleaved_order(rank: usize, pp: usize, m: usize, v: usize) -> Vec<Action> {
    let total = m * v;
    let unit = |k: usize, backward: bool| {
        let chunk = (k / pp) % v;
        let chunk = if backward { v - 1 - chunk } else { chunk };
        (chunk * pp + rank, (k / (pp * v)) * pp + k % pp)
    };
    let warmup = ((pp - rank - 1) * 2 + (v - 1) * pp).min(total);
    let mut order = Vec::with_capacity(2 * total);
    let forward = |k| {
        let (stage, microbatch) = unit(k, false);
        Action::Forward { stage, microbatch }
    };
    let backward = |k| {
        let (stage, microbatch) = unit(k, true);
        Action::Backward { stage, microbatch }
    };
    order.extend((0..warmup).map(forward));
    for k in 0..total - warmup {
        order.push(forward(warmup + k));
        order.push(backward(k));
    }
    order.extend((total - warmup..total).map(backward));
    order
}

/// The compute order with its communication: a forward is preceded by the receive of its input (not on stage
/// 0) and followed by the send of its output (not on the last stage); a backward is preceded by the receive of
/// its output's gradient (not on the last stage) and followed by the send of its input's gradient (not on stage
/// 0). A send to a stage on the same rank (interleaved with pp = 1) is kept: the executor hands it over locally.
fn with_communication(compute: &[Action], stages: usize) -> Vec<Action> {
    let mut out = Vec::with_capacity(compute.len() * 3);
    for &a in compute {
        let (stage, microbatch) = a.at();
        match a {
            Action::Forward { .. } => {
                if stage > 0 {
                    out.push(Action::RecvActivation { stage, microbatch });
                }
                out.push(a);
                if stage + 1 < stages {
                    out.push(Action::SendActivation { stage, microbatch });
                }
            }
            Action::Backward { .. } => {
                if stage + 1 < stages {
                    out.push(Action::RecvGradient { stage, microbatch });
                }
                out.push(a);
                if stage > 0 {
                    out.push(Action::SendGradient { stage, microbatch });
                }
            }
            _ => out.push(a),
        }
    }
    out
}
