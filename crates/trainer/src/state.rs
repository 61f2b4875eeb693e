//! [`TrainerState`]: the progress of a run, saved as `trainer_state.json` in every checkpoint with the field
//! names and layout of Hugging Face's `TrainerState` (so HF tooling that reads `log_history` or
//! `best_model_checkpoint` works on our checkpoints).
//!
//! Fields we add (HF readers ignore unknown keys): `global_batch_size` (samples of one optimizer step over all
//! processes) and `steps_per_epoch` — a resume checks them, because the same `global_step` is the same place in
//! the data exactly when both are the same, whatever the number of processes, the per-device batch and the
//! accumulation that make up the global batch; `world_size`, `data_parallel_size` and
//! `gradient_accumulation_steps` (informational, and what a checkpoint written before `global_batch_size` existed is
//! checked by); the loss tallies (`loss_tally`, `model_parallel_size`).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainerError};

/// Name of the state file inside a checkpoint directory.
pub const TRAINER_STATE_NAME: &str = "trainer_state.json";

/// One entry of `log_history`: the optimizer step, the epoch (fractional) and named values, flattened into one
/// JSON object like HF's (`{"loss": 0.31, "learning_rate": 1e-3, "grad_norm": 0.8, "epoch": 1.5, "step": 120}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogEntry {
    /// Fractional epoch at the time of the log (HF's `state.epoch`).
    #[serde(default)]
    pub epoch: f64,
    /// Optimizer step (HF's `state.global_step`).
    pub step: u64,
    /// The logged values (e.g. `loss`, `eval_accuracy`, `train_runtime`).
    #[serde(flatten)]
    pub values: BTreeMap<String, f64>,
}

impl LogEntry {
    /// The value `key`, if logged.
    pub fn get(&self, key: &str) -> Option<f64> {
        self.values.get(key).copied()
    }
}

/// Saved state of one callback in `stateful_callbacks` (HF's `ExportableState.state()`): constructor arguments
/// and mutable attributes.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CallbackState {
    /// Constructor arguments (e.g. `early_stopping_patience`).
    #[serde(default)]
    pub args: serde_json::Map<String, serde_json::Value>,
    /// Mutable attributes (e.g. `early_stopping_patience_counter`).
    #[serde(default)]
    pub attributes: serde_json::Map<String, serde_json::Value>,
}

/// The progress of training, HF's `TrainerState`. Only the main process's copy is written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Fractional epoch (e.g. 2.5 = halfway through the third epoch).
    #[serde(default)]
    pub epoch: f64,
    /// Optimizer steps taken so far.
    pub global_step: u64,
    /// Total optimizer steps of the run.
    pub max_steps: u64,
    /// Logging interval in optimizer steps.
    #[serde(default)]
    pub logging_steps: u64,
    /// Evaluation interval in optimizer steps.
    #[serde(default)]
    pub eval_steps: u64,
    /// Checkpoint interval in optimizer steps.
    #[serde(default)]
    pub save_steps: u64,
    /// Global batch of one optimizer step divided by accumulation: per-device batch × world size (HF's
    /// `train_batch_size` is the per-device batch × number of GPUs in DataParallel).
    #[serde(default)]
    pub train_batch_size: u64,
    /// Epochs of the run (rounded up).
    #[serde(default)]
    pub num_train_epochs: u64,
    /// Tokens seen (HF's field; 0 unless the run counts them).
    #[serde(default)]
    pub num_input_tokens_seen: u64,
    /// Floating-point operations (HF's field; 0 here: candle does not count them).
    #[serde(default)]
    pub total_flos: f64,
    /// Every log and evaluation, in order.
    #[serde(default)]
    pub log_history: Vec<LogEntry>,
    /// Best value of `metric_for_best_model` seen so far.
    #[serde(default)]
    pub best_metric: Option<f64>,
    /// Global step of that best evaluation.
    #[serde(default)]
    pub best_global_step: Option<u64>,
    /// Checkpoint directory holding the best model (when one was saved at `best_global_step`).
    #[serde(default)]
    pub best_model_checkpoint: Option<String>,
    /// Whether this process is the local main process (HF's field).
    #[serde(default = "yes")]
    pub is_local_process_zero: bool,
    /// Whether this process is the global main process (HF's field).
    #[serde(default = "yes")]
    pub is_world_process_zero: bool,
    /// HF's hyper-parameter-search field (always false here).
    #[serde(default)]
    pub is_hyper_param_search: bool,
    /// HF's trial name (always null here).
    #[serde(default)]
    pub trial_name: Option<String>,
    /// HF's trial parameters (always null here).
    #[serde(default)]
    pub trial_params: Option<serde_json::Value>,
    /// State of stateful callbacks by name (`TrainerControl`, `EarlyStoppingCallback`, ...).
    #[serde(default)]
    pub stateful_callbacks: BTreeMap<String, CallbackState>,
    /// Processes of the run that wrote this state (ours; informational — checked on resume only for a checkpoint
    /// without `global_batch_size`, which then resumes at the same world size alone).
    #[serde(default)]
    pub world_size: Option<u64>,
    /// Gradient accumulation of that run (ours; informational, or checked like `world_size`).
    #[serde(default)]
    pub gradient_accumulation_steps: Option<u64>,
    /// Samples of one optimizer step over all processes in that run (ours): the per-device batch × the
    /// data-parallel size × `gradient_accumulation_steps` (tensor- and pipeline-parallel peers read the same
    /// batch, so they do not count). A resume requires the same global batch, at any number of processes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_batch_size: Option<u64>,
    /// Data-parallel processes of that run (ours; informational: the resume messages name the per-device batch
    /// with it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel_size: Option<u64>,
    /// Optimizer steps per epoch of that run (ours; checked on resume with `global_batch_size`: the resume
    /// arithmetic — `global_step / steps_per_epoch` epochs done, then `global_step % steps_per_epoch` steps — must
    /// find the same place in the data).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps_per_epoch: Option<u64>,
    /// Each rank's training-loss tally at the save, indexed by rank (ours): the loss since the last log and the
    /// run totals, so a resumed run logs and reports `train_loss` exactly as the uninterrupted one. Only their sums
    /// over all ranks matter (a logged loss is Σ sums ÷ Σ items): a resume at another number of processes shares
    /// those totals out over its own ranks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loss_tally: Vec<LossTallyState>,
    /// Ranks holding pieces of one model replica (pp × tp) in the run that saved `loss_tally` (ours): their
    /// tallies are copies of one another, so a resume at another layout rescales the tallies rather than reading
    /// them by rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_parallel_size: Option<u64>,
}

/// One rank's training-loss tally (see [`TrainerState::loss_tally`]). Sums are this rank's per-item loss sums,
/// items its item counts.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct LossTallyState {
    /// Loss sum since the last log (the value of the on-device accumulator, exactly).
    pub sum: f64,
    /// Item count since the last log.
    pub items: f64,
    /// Optimizer steps since the last log.
    pub steps: u64,
    /// Loss sum of the whole run up to the last log.
    pub run_sum: f64,
    /// Item count of the whole run up to the last log.
    pub run_items: f64,
}

fn yes() -> bool {
    true
}

impl Default for TrainerState {
    fn default() -> Self {
        TrainerState {
            epoch: 0.0,
            global_step: 0,
            max_steps: 0,
            logging_steps: 500,
            eval_steps: 500,
            save_steps: 500,
            train_batch_size: 0,
            num_train_epochs: 0,
            num_input_tokens_seen: 0,
            total_flos: 0.0,
            log_history: Vec::new(),
            best_metric: None,
            best_global_step: None,
            best_model_checkpoint: None,
            is_local_process_zero: true,
            is_world_process_zero: true,
            is_hyper_param_search: false,
            trial_name: None,
            trial_params: None,
            stateful_callbacks: BTreeMap::new(),
            world_size: None,
            gradient_accumulation_steps: None,
            global_batch_size: None,
            data_parallel_size: None,
            steps_per_epoch: None,
            loss_tally: Vec::new(),
            model_parallel_size: None,
        }
    }
}

impl TrainerState {
    /// Pretty JSON with HF's two-space indentation and sorted keys.
    pub fn to_json_string(&self) -> Result<String> {
        // Through a Value so keys come out sorted, like HF's `json.dumps(..., indent=2, sort_keys=True)`.
        let v = serde_json::to_value(self).map_err(|e| TrainerError::json("encoding trainer state", e))?;
        let text = serde_json::to_string_pretty(&v).map_err(|e| TrainerError::json("encoding trainer state", e))?;
        Ok(text + "\n")
    }

    /// Writes `path` atomically ([`accel::state::write_atomic`]: a crash leaves either the old file or the new one).
    pub fn save_to_json(&self, path: &Path) -> Result<()> {
        Ok(accel::state::write_atomic(path, self.to_json_string()?)?)
    }

    /// Reads a `trainer_state.json` (ours or HF's).
    pub fn load_from_json(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| TrainerError::io(format!("reading {}", path.display()), e))?;
        serde_json::from_str(&text).map_err(|e| TrainerError::json(format!("parsing {}", path.display()), e))
    }

    /// The logged values of `key` as (step, value) pairs, in order (for plots).
    pub fn series(&self, key: &str) -> Vec<(u64, f64)> {
        self.log_history.iter().filter_map(|e| e.get(key).map(|v| (e.step, v))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> TrainerState {
        let mut s =
            TrainerState { epoch: 1.5, global_step: 120, max_steps: 240, world_size: Some(2), ..Default::default() };
        s.log_history.push(LogEntry {
            epoch: 0.5,
            step: 40,
            values: [("loss".to_string(), 0.75), ("learning_rate".to_string(), 1e-3), ("grad_norm".into(), 1.25)]
                .into_iter()
                .collect(),
        });
        s.log_history.push(LogEntry {
            epoch: 1.0,
            step: 80,
            values: [("eval_loss".to_string(), 0.5), ("eval_accuracy".to_string(), 0.875)].into_iter().collect(),
        });
        s.best_metric = Some(0.5);
        s.best_global_step = Some(80);
        s.best_model_checkpoint = Some("out/checkpoint-80".into());
        let mut es = CallbackState::default();
        es.args.insert("early_stopping_patience".into(), 3.into());
        es.attributes.insert("early_stopping_patience_counter".into(), 1.into());
        s.stateful_callbacks.insert("EarlyStoppingCallback".into(), es);
        s
    }

    #[test]
    fn round_trip_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(TRAINER_STATE_NAME);
        let s = sample();
        s.save_to_json(&path).unwrap();
        assert_eq!(TrainerState::load_from_json(&path).unwrap(), s);
        assert!(!path.with_extension("json.tmp").exists());
        assert_eq!(s.series("loss"), vec![(40, 0.75)]);
    }

    #[test]
    fn floats_round_trip_bit_exactly() {
        // Without serde_json's float_roundtrip about one value in nine came back one ulp off (e.g.
        // 0.10494035463009499 → 0.104940354630095), so a resumed log_history differed from the original.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut s = TrainerState::default();
        for step in 0..2000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = (x >> 11) as f64 / (1u64 << 53) as f64 * 3.0;
            let f32_sum = (v as f32) as f64 * 37.0;
            s.log_history.push(LogEntry {
                epoch: v,
                step,
                values: [("loss".to_string(), v), ("grad_norm".to_string(), f32_sum)].into_iter().collect(),
            });
            s.loss_tally.push(LossTallyState { sum: f32_sum, items: 8.0, steps: 1, run_sum: v * 1e3, run_items: 9.0 });
        }
        let back: TrainerState = serde_json::from_str(&s.to_json_string().unwrap()).unwrap();
        for (a, b) in s.log_history.iter().zip(&back.log_history) {
            assert_eq!(a.epoch.to_bits(), b.epoch.to_bits(), "epoch {}", a.epoch);
            assert_eq!(
                a.get("loss").unwrap().to_bits(),
                b.get("loss").unwrap().to_bits(),
                "{}",
                a.get("loss").unwrap()
            );
        }
        assert_eq!(back, s);
    }

    #[test]
    fn hf_layout_flat_log_entries_and_sorted_keys() {
        let v: serde_json::Value = serde_json::from_str(&sample().to_json_string().unwrap()).unwrap();
        let entry = &v["log_history"][0];
        assert_eq!(entry["step"], 40);
        assert_eq!(entry["loss"], 0.75);
        assert_eq!(entry["epoch"], 0.5);
        assert_eq!(v["best_model_checkpoint"], "out/checkpoint-80");
        assert_eq!(
            v["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"]["early_stopping_patience_counter"],
            1
        );
        for key in ["epoch", "global_step", "max_steps", "log_history", "best_metric", "best_global_step"] {
            assert!(v.get(key).is_some(), "missing {key}");
        }
        let text = sample().to_json_string().unwrap();
        assert!(text.find("\"best_global_step\"").unwrap() < text.find("\"epoch\"").unwrap(), "keys sorted");
    }

    #[test]
    fn reads_an_hf_written_state() {
        // Abridged from a trainer_state.json written by transformers 4.5x.
        let hf = r#"{
          "best_global_step": null, "best_metric": null, "best_model_checkpoint": null,
          "epoch": 3.0, "eval_steps": 500, "global_step": 12, "is_hyper_param_search": false,
          "is_local_process_zero": true, "is_world_process_zero": true,
          "log_history": [{"epoch": 3.0, "step": 12, "total_flos": 79.0, "train_loss": 0.69,
                           "train_runtime": 1.2, "train_samples_per_second": 80.0, "train_steps_per_second": 10.0}],
          "logging_steps": 500, "max_steps": 12, "num_input_tokens_seen": 0, "num_train_epochs": 3,
          "save_steps": 500,
          "stateful_callbacks": {"TrainerControl": {"args": {"should_epoch_stop": false, "should_evaluate": false,
              "should_log": false, "should_save": true, "should_training_stop": true}, "attributes": {}}},
          "total_flos": 79, "train_batch_size": 8, "trial_name": null, "trial_params": null
        }"#;
        let s: TrainerState = serde_json::from_str(hf).unwrap();
        assert_eq!(s.global_step, 12);
        assert_eq!(s.log_history[0].get("train_loss"), Some(0.69));
        assert_eq!(s.stateful_callbacks["TrainerControl"].args["should_save"], true);
        assert_eq!(s.world_size, None);
    }
}
