//! Pruners: decide, after each report of a running trial, whether to stop it. They read the study (every
//! trial's reports so far), so a decision needs no state of its own and is the same in whichever process makes
//! it.
//!
//! - [`PrunerConfig::Median`] (Optuna's `MedianPruner`): after `n_startup_trials` complete trials and
//!   `n_warmup_steps`, a trial is pruned when its best value so far is worse than the median of the complete
//!   trials' values reported at the same step.
//! - [`PrunerConfig::SuccessiveHalving`] (asynchronous successive halving, ASHA — Li et al. 2018, "A System for
//!   Massively Parallel Hyperparameter Tuning"; Optuna's `SuccessiveHalvingPruner`): rung `k` sits at step
//!   `min_resource · η^(min_early_stopping_rate + k)`; a trial reaching a rung is promoted when its value there is
//!   among the best `1/η` of the values every trial (running ones included) has reported at that rung, else it
//!   is pruned. A rung is judged once, when the trial's reports first pass it, so a promotion is never undone.

use serde::{Deserialize, Serialize};

use super::study::{StudyView, TrialRecord, TrialState};
use super::Direction;

/// When a running trial is stopped. In YAML: `{type: median, n_startup_trials: 5}`,
/// `{type: successive_halving, reduction_factor: 3}`, `{type: none}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum PrunerConfig {
    /// Never prune.
    None,
    /// Median stopping rule.
    Median {
        /// Complete trials needed before anything is pruned.
        #[serde(default = "default_startup")]
        n_startup_trials: usize,
        /// Reports at steps below this never prune (Optuna: `step < n_warmup_steps`).
        #[serde(default)]
        n_warmup_steps: u64,
    },
    /// Asynchronous successive halving (ASHA).
    SuccessiveHalving {
        /// Step of the first rung; `null` = the smallest step any trial has reported (the first evaluation).
        #[serde(default)]
        min_resource: Option<u64>,
        /// η: each rung keeps the best 1/η.
        #[serde(default = "default_eta")]
        reduction_factor: u64,
        /// s: the first rung is at `min_resource · η^s`.
        #[serde(default)]
        min_early_stopping_rate: u32,
    },
}

fn default_startup() -> usize {
    5
}
fn default_eta() -> u64 {
    3
}

impl Default for PrunerConfig {
    fn default() -> Self {
        PrunerConfig::Median { n_startup_trials: default_startup(), n_warmup_steps: 0 }
    }
}

/// `a` is strictly better than `b`.
fn better(direction: Direction, a: f64, b: f64) -> bool {
    match direction {
        Direction::Maximize => a > b,
        Direction::Minimize => a < b,
    }
}

/// The value a trial reported at its first report at or after `step`.
fn value_at_rung(t: &TrialRecord, step: u64) -> Option<f64> {
    t.reports.iter().find(|r| r.0 >= step).and_then(|r| r.1)
}

impl PrunerConfig {
    /// Whether trial `trial` should stop after its latest report (in `study`). A non-finite report always prunes.
    pub fn should_prune(&self, study: &StudyView, trial: u64, direction: Direction) -> bool {
        let Some(t) = study.trials.get(&trial) else { return false };
        let Some(&(step, last)) = t.reports.last() else { return false };
        let Some(_) = last else { return true };
        match *self {
            PrunerConfig::None => false,
            PrunerConfig::Median { n_startup_trials, n_warmup_steps } => {
                if step < n_warmup_steps {
                    return false;
                }
                let complete: Vec<&TrialRecord> =
                    study.in_state(TrialState::Complete).filter(|o| o.number != trial).collect();
                if complete.len() < n_startup_trials {
                    return false;
                }
                let mut at_step: Vec<f64> =
                    complete.iter().filter_map(|o| o.reports.iter().find(|r| r.0 == step).and_then(|r| r.1)).collect();
                if at_step.is_empty() {
                    return false;
                }
                at_step.sort_by(f64::total_cmp);
                let n = at_step.len();
                let median = if n % 2 == 1 { at_step[n / 2] } else { 0.5 * (at_step[n / 2 - 1] + at_step[n / 2]) };
                let best = t
                    .reports
                    .iter()
                    .filter_map(|r| r.1)
                    .reduce(|a, b| if better(direction, b, a) { b } else { a })
                    .expect("the last report is finite");
                better(direction, median, best)
            }
            PrunerConfig::SuccessiveHalving { min_resource, reduction_factor, min_early_stopping_rate } => {
                let eta = reduction_factor.max(2);
                let r = min_resource.unwrap_or_else(|| {
                    study.trials.values().filter_map(|o| o.reports.first().map(|r| r.0)).min().unwrap_or(step).max(1)
                });
                let previous = t.reports.len().checked_sub(2).map(|i| t.reports[i].0);
                let mut rung_step = r.saturating_mul(eta.saturating_pow(min_early_stopping_rate));
                while rung_step <= step {
                    // Judge only the rungs this report passed for the first time.
                    if previous.is_none_or(|p| p < rung_step) {
                        let Some(own) = value_at_rung(t, rung_step) else { return true };
                        let mut competing: Vec<f64> = study
                            .trials
                            .values()
                            .filter(|o| o.number != trial && o.state != TrialState::Failed)
                            .filter_map(|o| value_at_rung(o, rung_step))
                            .collect();
                        competing.push(own);
                        competing.sort_by(|a, b| {
                            if better(direction, *a, *b) {
                                std::cmp::Ordering::Less
                            } else if better(direction, *b, *a) {
                                std::cmp::Ordering::Greater
                            } else {
                                std::cmp::Ordering::Equal
                            }
                        });
                        let keep = (competing.len() / eta as usize).max(1);
                        if better(direction, competing[keep - 1], own) {
                            return true;
                        }
                    }
                    rung_step = rung_step.saturating_mul(eta);
                }
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hpsearch::study::Record;

    fn study(trials: &[(&[(u64, f64)], TrialState)]) -> StudyView {
        let mut records = Vec::new();
        for (i, (reports, state)) in trials.iter().enumerate() {
            let trial = i as u64;
            records.push(Record::TrialStart { trial, params: Default::default(), output_dir: "x".into() });
            for &(step, value) in reports.iter() {
                records.push(Record::Report { trial, step, value: Some(value) });
            }
            if *state != TrialState::Running {
                records.push(Record::TrialEnd {
                    trial,
                    state: *state,
                    value: reports.last().map(|r| r.1),
                    error: None,
                    checkpoint: None,
                    master_port: None,
                    world_size: 1,
                    wall_s: 0.0,
                });
            }
        }
        StudyView::from_records(records)
    }

    #[test]
    fn median_pruner_stops_a_trial_below_the_median_at_the_right_step() {
        use TrialState::*;
        let done: &[(u64, f64)] = &[(10, 0.50), (20, 0.70), (30, 0.80)];
        let done2: &[(u64, f64)] = &[(10, 0.60), (20, 0.75), (30, 0.85)];
        let done3: &[(u64, f64)] = &[(10, 0.40), (20, 0.72), (30, 0.90)];
        let pruner = PrunerConfig::Median { n_startup_trials: 3, n_warmup_steps: 15 };
        // The new trial's reports, one at a time: median at step 10 is 0.50, at 20 it is 0.72.
        let new: [(u64, f64); 3] = [(10, 0.45), (20, 0.71), (30, 0.95)];
        let decisions: Vec<bool> = (1..=3)
            .map(|k| {
                let s = study(&[(done, Complete), (done2, Complete), (done3, Complete), (&new[..k], Running)]);
                pruner.should_prune(&s, 3, Direction::Maximize)
            })
            .collect();
        // Step 10 is below n_warmup_steps (not judged although 0.45 < 0.50); at step 20 its best (0.71) < median 0.72.
        assert_eq!(decisions, vec![false, true, false]);
        // Fewer complete trials than n_startup_trials: never prunes.
        let s = study(&[(done, Complete), (done2, Complete), (done3, Running), (&new[..2], Running)]);
        assert!(!pruner.should_prune(&s, 3, Direction::Maximize));
        // Minimising: a loss of 0.9 at step 20 is worse than the median 0.72.
        let s = study(&[(done, Complete), (done2, Complete), (done3, Complete), (&[(20, 0.9)], Running)]);
        assert!(pruner.should_prune(&s, 3, Direction::Minimize));
        assert!(!pruner.should_prune(&s, 3, Direction::Maximize));
    }

    #[test]
    fn successive_halving_keeps_the_top_fraction_per_rung() {
        use TrialState::*;
        let asha =
            PrunerConfig::SuccessiveHalving { min_resource: Some(1), reduction_factor: 2, min_early_stopping_rate: 0 };
        // Rungs at steps 1, 2, 4. Three trials already passed rung 1 with 0.3, 0.5, 0.7.
        let a: &[(u64, f64)] = &[(1, 0.3), (2, 0.35)];
        let b: &[(u64, f64)] = &[(1, 0.5), (2, 0.55)];
        let c: &[(u64, f64)] = &[(1, 0.7), (2, 0.8)];
        // A fourth trial at rung 1 (step 1): 4 values, keep the best 2 (0.7, 0.5): 0.6 is promoted, 0.4 pruned.
        let s = study(&[(a, Pruned), (b, Complete), (c, Running), (&[(1, 0.6)], Running)]);
        assert!(!asha.should_prune(&s, 3, Direction::Maximize));
        let s = study(&[(a, Pruned), (b, Complete), (c, Running), (&[(1, 0.4)], Running)]);
        assert!(asha.should_prune(&s, 3, Direction::Maximize));
        // The first trial at a rung is always promoted.
        assert!(!asha.should_prune(&study(&[(&[(1, 0.1)], Running)]), 0, Direction::Maximize));
        // A rung already judged is not judged again: the report at step 3 passes no new rung.
        let s = study(&[(a, Pruned), (b, Complete), (c, Running), (&[(1, 0.6), (2, 0.1), (3, 0.1)], Running)]);
        assert!(!asha.should_prune(&s, 3, Direction::Maximize));
    }
}
