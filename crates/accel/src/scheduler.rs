//! Learning-rate schedules with warmup, with the formulas of Hugging Face transformers' `optimization.py`
//! (`get_constant_schedule`, `get_constant_schedule_with_warmup`, `get_linear_schedule_with_warmup`,
//! `get_cosine_schedule_with_warmup`), i.e. a PyTorch `LambdaLR` whose multiplier of the base learning rate at
//! scheduler step `t` (the number of optimizer steps already taken) is:
//!
//! | kind                   | `t < W`         | `t ≥ W`                                                          |
//! |------------------------|-----------------|------------------------------------------------------------------|
//! | `constant`             | 1               | 1                                                                |
//! | `constant_with_warmup` | `t / max(1, W)` | 1                                                                |
//! | `linear`               | `t / max(1, W)` | `max(0, (T − t) / max(1, T − W))`                                |
//! | `cosine`               | `t / max(1, W)` | `max(0, ½ (1 + cos(π · (t − W) / max(1, T − W))))` (half a cycle) |
//!
//! with `W` warmup steps and `T` total training steps. As in PyTorch, the schedule starts at `t = 0` (so the very
//! first optimizer step of a warmup schedule uses learning rate 0) and [`LrScheduler::step`] is called once after
//! every *real* optimizer step — not after a step skipped for an fp16 overflow.
//!
//! Warmup given as a ratio follows `TrainingArguments.get_warmup_steps`: `W = ceil(T · ratio)` unless explicit
//! warmup steps are > 0 ([`warmup_steps_from`]).

use std::f64::consts::PI;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::state::{StateDict, Stateful};

/// A learning-rate schedule stepped once per real optimizer step. Saved and restored with the checkpoint
/// (register it with `Accelerator::register_for_checkpointing`).
pub trait LrScheduler: Stateful + Send {
    /// Advances the schedule by one optimizer step (PyTorch's `scheduler.step()`).
    fn step(&mut self);
    /// Learning rate for the next optimizer step.
    fn lr(&self) -> f64;
    /// Number of times [`LrScheduler::step`] was called (PyTorch's `last_epoch`, starting at 0).
    fn last_step(&self) -> u64;
}

/// The shape of a schedule (HF's `lr_scheduler_type`). Parses from / serialises to HF's names: `"constant"`,
/// `"constant_with_warmup"`, `"linear"`, `"cosine"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SchedulerKind {
    /// Base learning rate throughout (warmup ignored, as HF's `get_constant_schedule`).
    Constant,
    /// Linear warmup from 0, then constant.
    ConstantWithWarmup,
    /// Linear warmup from 0, then linear decay to 0 at the last training step (HF's default).
    #[default]
    Linear,
    /// Linear warmup from 0, then half a cosine cycle down to 0 at the last training step.
    Cosine,
}

impl SchedulerKind {
    /// All kinds with their HF names, for error messages and CLI help.
    pub const ALL: [(SchedulerKind, &'static str); 4] = [
        (SchedulerKind::Constant, "constant"),
        (SchedulerKind::ConstantWithWarmup, "constant_with_warmup"),
        (SchedulerKind::Linear, "linear"),
        (SchedulerKind::Cosine, "cosine"),
    ];

    /// HF's name of the kind.
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(k, _)| *k == self).map(|(_, n)| *n).unwrap_or("linear")
    }
}

impl fmt::Display for SchedulerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SchedulerKind {
    type Err = crate::AccelError;

    /// HF's names (case-insensitive, `-` for `_` accepted). Errors: [`crate::AccelError::Config`] with key
    /// `lr_scheduler_type`, naming the value and the accepted names.
    fn from_str(s: &str) -> crate::Result<Self> {
        let norm = s.trim().to_ascii_lowercase().replace('-', "_");
        Self::ALL.iter().find(|(_, n)| *n == norm).map(|(k, _)| *k).ok_or_else(|| crate::AccelError::Config {
            key: "lr_scheduler_type".into(),
            value: s.to_string(),
            reason: "unknown scheduler; expected one of constant, constant_with_warmup, linear, cosine".into(),
        })
    }
}

/// Warmup steps as HF's `TrainingArguments.get_warmup_steps`: `warmup_steps` when > 0, else
/// `ceil(num_training_steps · warmup_ratio)`.
pub fn warmup_steps_from(warmup_steps: u64, warmup_ratio: f64, num_training_steps: u64) -> u64 {
    if warmup_steps > 0 {
        warmup_steps
    } else {
        (num_training_steps as f64 * warmup_ratio.max(0.0)).ceil() as u64
    }
}

/// Multiplier of the base learning rate at scheduler step `step` (the `lr_lambda` of HF's schedules; see the
/// module table). `warmup` and `total` are optimizer steps.
pub fn lr_multiplier(kind: SchedulerKind, step: u64, warmup: u64, total: u64) -> f64 {
    let t = step as f64;
    let w = warmup as f64;
    if kind == SchedulerKind::Constant {
        return 1.0;
    }
    if step < warmup {
        return t / w.max(1.0);
    }
    match kind {
        SchedulerKind::Constant | SchedulerKind::ConstantWithWarmup => 1.0,
        SchedulerKind::Linear => {
            let remaining = total as f64 - t;
            (remaining / (total as f64 - w).max(1.0)).max(0.0)
        }
        SchedulerKind::Cosine => {
            let progress = (t - w) / (total as f64 - w).max(1.0);
            // num_cycles = 0.5 (HF's default): half a cosine from 1 down to 0.
            (0.5 * (1.0 + (PI * 2.0 * 0.5 * progress).cos())).max(0.0)
        }
    }
}

/// The schedules of this module as one concrete type (a `LambdaLR` with one of HF's lambdas). Use it directly
/// when you need to share it (e.g. `Arc<Mutex<Scheduler>>` registered for checkpointing), or through
/// [`get_scheduler`] as a `Box<dyn LrScheduler>`.
#[derive(Debug, Clone, PartialEq)]
pub struct Scheduler {
    kind: SchedulerKind,
    base_lr: f64,
    num_warmup_steps: u64,
    num_training_steps: u64,
    last_step: u64,
}

impl Scheduler {
    /// A schedule at step 0. `base_lr` is the optimizer's configured learning rate; `num_training_steps` the total
    /// number of optimizer steps of the run (HF's `max_steps`).
    pub fn new(kind: SchedulerKind, base_lr: f64, num_warmup_steps: u64, num_training_steps: u64) -> Self {
        Scheduler { kind, base_lr, num_warmup_steps, num_training_steps, last_step: 0 }
    }

    /// The kind of schedule.
    pub fn kind(&self) -> SchedulerKind {
        self.kind
    }
    /// The base learning rate.
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }
    /// Warmup steps `W`.
    pub fn num_warmup_steps(&self) -> u64 {
        self.num_warmup_steps
    }
    /// Total training steps `T`.
    pub fn num_training_steps(&self) -> u64 {
        self.num_training_steps
    }
    /// Learning rate at an arbitrary scheduler step (does not move the schedule).
    pub fn lr_at(&self, step: u64) -> f64 {
        self.base_lr * lr_multiplier(self.kind, step, self.num_warmup_steps, self.num_training_steps)
    }
}

impl LrScheduler for Scheduler {
    fn step(&mut self) {
        self.last_step += 1;
    }
    fn lr(&self) -> f64 {
        self.lr_at(self.last_step)
    }
    fn last_step(&self) -> u64 {
        self.last_step
    }
}

impl Stateful for Scheduler {
    /// No tensors; `meta` = `{"kind", "base_lr", "num_warmup_steps", "num_training_steps", "last_step"}` (what
    /// `scheduler.json` holds in a checkpoint).
    fn state_dict(&self) -> crate::Result<StateDict> {
        Ok(StateDict {
            tensors: Default::default(),
            meta: serde_json::json!({
                "kind": self.kind.name(),
                "base_lr": self.base_lr,
                "num_warmup_steps": self.num_warmup_steps,
                "num_training_steps": self.num_training_steps,
                "last_step": self.last_step,
            }),
        })
    }

    /// Restores every field. Errors when a field is missing or has the wrong type, naming it.
    fn load_state_dict(&mut self, sd: &StateDict) -> crate::Result<()> {
        let meta = &sd.meta;
        let field_u64 = |name: &str| {
            meta.get(name).and_then(|v| v.as_u64()).ok_or_else(|| bad_state(name, "a non-negative integer"))
        };
        let kind_name = meta.get("kind").and_then(|v| v.as_str()).ok_or_else(|| bad_state("kind", "a string"))?;
        self.kind = kind_name.parse().map_err(|e: crate::AccelError| bad_state("kind", &e.to_string()))?;
        self.base_lr = meta.get("base_lr").and_then(|v| v.as_f64()).ok_or_else(|| bad_state("base_lr", "a number"))?;
        self.num_warmup_steps = field_u64("num_warmup_steps")?;
        self.num_training_steps = field_u64("num_training_steps")?;
        self.last_step = field_u64("last_step")?;
        Ok(())
    }
}

fn bad_state(field: &str, expected: &str) -> crate::AccelError {
    crate::AccelError::InvalidArgument(format!(
        "scheduler state: field `{field}` is missing or invalid (expected {expected}); was scheduler.json written by \
         accel's Scheduler?"
    ))
}

/// A boxed schedule (HF's `get_scheduler(name, optimizer, num_warmup_steps, num_training_steps)`).
pub fn get_scheduler(
    kind: SchedulerKind,
    base_lr: f64,
    num_warmup_steps: u64,
    num_training_steps: u64,
) -> Box<dyn LrScheduler> {
    Box::new(Scheduler::new(kind, base_lr, num_warmup_steps, num_training_steps))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn linear_matches_hand_computed_values() {
        // W = 2, T = 10, base 1e-3: 0, 0.5, then (10 - t) / 8.
        let mut s = Scheduler::new(SchedulerKind::Linear, 1e-3, 2, 10);
        let expected = [0.0, 0.5e-3, 1e-3, 0.875e-3, 0.75e-3, 0.625e-3, 0.5e-3, 0.375e-3, 0.25e-3, 0.125e-3, 0.0, 0.0];
        for (t, e) in expected.iter().enumerate() {
            assert!(close(s.lr(), *e), "step {t}: {} vs {e}", s.lr());
            assert_eq!(s.last_step(), t as u64);
            s.step();
        }
    }

    #[test]
    fn cosine_matches_hand_computed_values() {
        // W = 1, T = 5: progress at t = 1..5 is 0, .25, .5, .75, 1 → ½(1 + cos(π p)).
        let s = Scheduler::new(SchedulerKind::Cosine, 2.0, 1, 5);
        let half_root2 = std::f64::consts::FRAC_1_SQRT_2;
        let expected = [0.0, 2.0, 1.0 + half_root2, 1.0, 1.0 - half_root2, 0.0];
        for (t, e) in expected.iter().enumerate() {
            assert!(close(s.lr_at(t as u64), *e), "step {t}: {} vs {e}", s.lr_at(t as u64));
        }
    }

    #[test]
    fn constant_kinds() {
        let c = Scheduler::new(SchedulerKind::Constant, 0.1, 5, 10);
        assert_eq!((0..12).map(|t| c.lr_at(t)).collect::<Vec<_>>(), vec![0.1; 12]);
        let w = Scheduler::new(SchedulerKind::ConstantWithWarmup, 0.1, 4, 10);
        let got: Vec<f64> = (0..6).map(|t| w.lr_at(t)).collect();
        let want = [0.0, 0.025, 0.05, 0.075, 0.1, 0.1];
        assert!(got.iter().zip(want).all(|(g, w)| close(*g, w)), "{got:?}");
    }

    #[test]
    fn no_warmup_starts_at_base_lr_and_total_equal_warmup_does_not_divide_by_zero() {
        let s = Scheduler::new(SchedulerKind::Linear, 1.0, 0, 4);
        assert_eq!(s.lr_at(0), 1.0);
        assert_eq!(s.lr_at(1), 0.75);
        let degenerate = Scheduler::new(SchedulerKind::Cosine, 1.0, 3, 3);
        assert!(close(degenerate.lr_at(2), 2.0 / 3.0));
        assert_eq!(degenerate.lr_at(3), 1.0); // progress 0 / max(1, 0)
        assert_eq!(degenerate.lr_at(4), 0.0);
    }

    #[test]
    fn warmup_ratio_rounds_up() {
        assert_eq!(warmup_steps_from(0, 0.1, 95), 10);
        assert_eq!(warmup_steps_from(0, 0.0, 95), 0);
        assert_eq!(warmup_steps_from(7, 0.5, 95), 7);
    }

    #[test]
    fn kind_names_round_trip_and_errors_list_choices() {
        for (k, n) in SchedulerKind::ALL {
            assert_eq!(n.parse::<SchedulerKind>().unwrap(), k);
            assert_eq!(k.to_string(), n);
        }
        assert_eq!("Constant-With-Warmup".parse::<SchedulerKind>().unwrap(), SchedulerKind::ConstantWithWarmup);
        let err = "exp".parse::<SchedulerKind>().unwrap_err().to_string();
        assert!(err.contains("\"exp\"") && err.contains("cosine"), "{err}");
    }

    #[test]
    fn state_round_trip() {
        let mut s = Scheduler::new(SchedulerKind::Cosine, 3e-4, 10, 100);
        for _ in 0..37 {
            s.step();
        }
        let sd = s.state_dict().unwrap();
        let mut fresh = Scheduler::new(SchedulerKind::Constant, 1.0, 0, 1);
        fresh.load_state_dict(&sd).unwrap();
        assert_eq!(fresh, s);
        let broken = StateDict { tensors: Default::default(), meta: serde_json::json!({"kind": "linear"}) };
        let err = fresh.load_state_dict(&broken).unwrap_err().to_string();
        assert!(err.contains("base_lr"), "{err}");
    }
}
