//! [`EarlyStoppingCallback`]: stop training when `metric_for_best_model` stops improving, with the semantics of
//! HF's `EarlyStoppingCallback(early_stopping_patience, early_stopping_threshold)`.

use super::{CallbackContext, TrainerCallback, TrainerControl};
use crate::error::{Result, TrainerError};
use crate::metrics::Metrics;
use crate::state::CallbackState;

/// Counts evaluations that do not improve on the best metric so far; asks the trainer to stop when the count
/// reaches `patience`.
///
/// On each evaluation — before the trainer updates `state.best_metric` — a value better than the best by
/// *more than* `threshold` (strictly greater/less per `greater_is_better`, and `|value − best| > threshold`)
/// resets the counter; anything else (equal, worse, or better by ≤ threshold) increments it. The first
/// evaluation (no best yet) resets it. Needs `metric_for_best_model` and an evaluation strategy (checked by
/// [`crate::TrainingArguments::validate`] when set through the arguments, and at `on_train_begin` here).
/// The counter is saved in checkpoints (`stateful_callbacks.EarlyStoppingCallback`), so a resumed run stops at the
/// same evaluation as an uninterrupted one.
#[derive(Debug, Clone, PartialEq)]
pub struct EarlyStoppingCallback {
    patience: usize,
    threshold: f64,
    counter: usize,
}

impl EarlyStoppingCallback {
    /// `patience` evaluations without an improvement larger than `threshold` stop training.
    pub fn new(patience: usize, threshold: f64) -> Self {
        EarlyStoppingCallback { patience, threshold, counter: 0 }
    }

    /// Evaluations in a row without sufficient improvement.
    pub fn counter(&self) -> usize {
        self.counter
    }

    /// HF's `check_metric_value`: updates the counter for `value` against `best` (None: no evaluation yet).
    pub fn check_metric_value(&mut self, value: f64, best: Option<f64>, greater_is_better: bool) {
        let improved = match best {
            None => true,
            Some(best) => {
                let better = if greater_is_better { value > best } else { value < best };
                better && (value - best).abs() > self.threshold
            }
        };
        if improved {
            self.counter = 0;
        } else {
            self.counter += 1;
        }
    }
}

impl TrainerCallback for EarlyStoppingCallback {
    fn name(&self) -> String {
        "EarlyStoppingCallback".into()
    }

    fn on_train_begin(&mut self, ctx: &CallbackContext, _control: &mut TrainerControl) -> Result<()> {
        if ctx.args.metric_for_best_model.is_none() {
            return Err(TrainerError::invalid(
                "metric_for_best_model",
                "EarlyStoppingCallback needs a metric to watch; set metric_for_best_model (e.g. \"loss\")",
            ));
        }
        if ctx.args.eval_strategy == crate::args::IntervalStrategy::No {
            return Err(TrainerError::invalid(
                "eval_strategy",
                "EarlyStoppingCallback needs evaluations; set eval_strategy to \"steps\" or \"epoch\"",
            ));
        }
        if self.patience == 0 {
            return Err(TrainerError::invalid("early_stopping_patience", "is 0; use ≥ 1"));
        }
        Ok(())
    }

    fn on_evaluate(&mut self, ctx: &CallbackContext, control: &mut TrainerControl, metrics: &Metrics) -> Result<()> {
        let Some(key) = ctx.args.best_metric_key() else { return Ok(()) };
        // Early stopping watches the validation set: an evaluation under another prefix (the final `test_` pass
        // of `evaluate_dataset`) is not its business.
        let prefix = key.split_once('_').map_or("", |(p, _)| p);
        if !prefix.is_empty() && !metrics.keys().any(|k| k.starts_with(&format!("{prefix}_"))) {
            return Ok(());
        }
        let Some(&value) = metrics.get(&key) else {
            tracing::warn!(
                "early stopping is watching {key:?}, which this evaluation did not produce (it has {:?}); \
                 early stopping is skipped for this evaluation",
                metrics.keys().collect::<Vec<_>>()
            );
            return Ok(());
        };
        self.check_metric_value(value, ctx.state.best_metric, ctx.args.greater_is_better_resolved());
        if self.counter >= self.patience {
            control.should_training_stop = true;
        }
        Ok(())
    }

    fn state(&self) -> Option<CallbackState> {
        let mut st = CallbackState::default();
        st.args.insert("early_stopping_patience".into(), self.patience.into());
        st.args.insert("early_stopping_threshold".into(), self.threshold.into());
        st.attributes.insert("early_stopping_patience_counter".into(), self.counter.into());
        Some(st)
    }

    fn load_state(&mut self, state: &CallbackState) -> Result<()> {
        if let Some(c) = state.attributes.get("early_stopping_patience_counter").and_then(|v| v.as_u64()) {
            self.counter = c as usize;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the HF protocol over `values`: callback first (sees the previous best), then the best update.
    /// Returns the 1-based evaluation at which training stops.
    fn stops_at(values: &[f64], patience: usize, threshold: f64, greater: bool) -> Option<usize> {
        let mut cb = EarlyStoppingCallback::new(patience, threshold);
        let mut best: Option<f64> = None;
        for (i, &v) in values.iter().enumerate() {
            cb.check_metric_value(v, best, greater);
            if cb.counter() >= patience {
                return Some(i + 1);
            }
            let better = best.is_none_or(|b| if greater { v > b } else { v < b });
            if better {
                best = Some(v);
            }
        }
        None
    }

    #[test]
    fn patience_counts_consecutive_non_improvements() {
        assert_eq!(stops_at(&[1.0, 0.9, 0.95, 0.91, 0.92], 3, 0.0, false), Some(5));
        assert_eq!(stops_at(&[1.0, 0.9, 0.95, 0.8, 0.85, 0.86], 3, 0.0, false), None); // reset at 0.8
        assert_eq!(stops_at(&[1.0, 1.0], 1, 0.0, false), Some(2)); // equal is not better
    }

    #[test]
    fn threshold_is_strict() {
        // Improvement of exactly the threshold does not count (|Δ| > threshold is required).
        assert_eq!(stops_at(&[0.5, 0.6, 0.7], 2, 0.1, true), Some(3));
        // Improvement just above the threshold resets.
        assert_eq!(stops_at(&[0.5, 0.6000001, 0.7000002], 2, 0.1, true), None);
        // Small improvements (≤ threshold) count as no improvement even though best_metric moves.
        assert_eq!(stops_at(&[0.90, 0.91, 0.92, 0.93], 3, 0.05, true), Some(4));
    }

    #[test]
    fn state_round_trip() {
        let mut cb = EarlyStoppingCallback::new(4, 0.01);
        cb.check_metric_value(1.0, Some(0.5), false);
        let st = cb.state().unwrap();
        assert_eq!(st.attributes["early_stopping_patience_counter"], 1);
        let mut fresh = EarlyStoppingCallback::new(4, 0.01);
        fresh.load_state(&st).unwrap();
        assert_eq!(fresh, cb);
    }
}
