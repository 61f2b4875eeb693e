//! [`PrinterCallback`]: prints every log entry as one line on rank 0 (HF's `PrinterCallback` / the log lines of
//! its progress callback).

use super::{CallbackContext, ConsoleWriter, TrainerCallback, TrainerControl};
use crate::error::Result;
use crate::state::LogEntry;

/// Prints `step 120/470 | epoch 1.28 | loss 0.3112 | learning_rate 7.4e-4 | grad_norm 1.23` for every log entry,
/// on rank 0 only, above the progress bar when one is shown.
#[derive(Debug, Clone, Default)]
pub struct PrinterCallback {
    console: ConsoleWriter,
}

impl PrinterCallback {
    /// A printer writing through `console`.
    pub fn new(console: ConsoleWriter) -> Self {
        PrinterCallback { console }
    }

    /// The line printed for `logs` in a run of `max_steps` steps.
    pub fn format(logs: &LogEntry, max_steps: u64) -> String {
        let mut line = format!("step {}/{} | epoch {:.2}", logs.step, max_steps, logs.epoch);
        // Losses and metrics first, then rates and timings, each group in name order.
        let mut keys: Vec<&String> = logs.values.keys().collect();
        keys.sort_by_key(|k| (rank_of(k), k.as_str()));
        for k in keys {
            line.push_str(&format!(" | {k} {}", format_value(k, logs.values[k])));
        }
        line
    }
}

fn rank_of(key: &str) -> u8 {
    if key.ends_with("loss") {
        0
    } else if key.contains("runtime") || key.contains("per_second") || key == "learning_rate" || key == "grad_norm" {
        2
    } else {
        1
    }
}

fn format_value(key: &str, v: f64) -> String {
    if key == "learning_rate" {
        format!("{v:.3e}")
    } else if key.contains("per_second") {
        format!("{v:.1}")
    } else if key.contains("runtime") {
        format!("{v:.2}s")
    } else if v != 0.0 && v.abs() < 1e-3 {
        format!("{v:.3e}")
    } else {
        format!("{v:.4}")
    }
}

impl TrainerCallback for PrinterCallback {
    fn on_log(&mut self, ctx: &CallbackContext, _control: &mut TrainerControl, logs: &LogEntry) -> Result<()> {
        if ctx.is_world_process_zero() {
            self.console.println(&Self::format(logs, ctx.state.max_steps));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_losses_first_then_metrics_then_rates() {
        let logs = LogEntry {
            epoch: 1.28,
            step: 120,
            values: [
                ("learning_rate".to_string(), 7.4e-4),
                ("loss".to_string(), 0.31119),
                ("grad_norm".to_string(), 1.23),
                ("eval_accuracy".to_string(), 0.97),
            ]
            .into_iter()
            .collect(),
        };
        assert_eq!(
            PrinterCallback::format(&logs, 470),
            "step 120/470 | epoch 1.28 | loss 0.3112 | eval_accuracy 0.9700 | grad_norm 1.2300 | learning_rate 7.400e-4"
        );
    }
}
