//! The search space: one [`Distribution`] per parameter name, and the mapping between a parameter's value (a
//! JSON number or choice, as stored in the study file and applied to [`TrainingArguments`]) and the continuous
//! coordinate the samplers work in (the value, its logarithm, or a choice's index).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::args::TrainingArguments;
use crate::error::{Result, TrainerError};

/// Parameter values of one trial, by name (a name is a [`TrainingArguments`] field or a user parameter).
pub type Params = BTreeMap<String, Value>;

/// How one parameter is drawn. In YAML: `{type: float, low: 1e-4, high: 1e-2, log: true}`,
/// `{type: int, low: 32, high: 512, log: true}`, `{type: categorical, choices: [adamw, sgd]}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum Distribution {
    /// A real number in `[low, high]`, uniform in the value or (with `log`) in its logarithm (`low > 0`).
    Float {
        /// Smallest value.
        low: f64,
        /// Largest value.
        high: f64,
        /// Sample uniformly in `ln(value)`.
        #[serde(default)]
        log: bool,
        /// Points per axis for the grid sampler (default 5, ends included).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        grid_points: Option<usize>,
    },
    /// An integer in `[low, high]` (both included), uniform or log-uniform (`low ≥ 1`).
    Int {
        /// Smallest value.
        low: i64,
        /// Largest value.
        high: i64,
        /// Sample uniformly in `ln(value)`.
        #[serde(default)]
        log: bool,
        /// Points for the grid sampler (default: every integer up to 5 of them, else 5 spread points).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        grid_points: Option<usize>,
    },
    /// One of a list of values (strings, numbers or booleans).
    Categorical {
        /// The values.
        choices: Vec<Value>,
    },
}

/// Default number of grid points per numeric axis.
const GRID_POINTS: usize = 5;

impl Distribution {
    /// A uniform float in `[low, high]`.
    pub fn float(low: f64, high: f64) -> Self {
        Distribution::Float { low, high, log: false, grid_points: None }
    }

    /// A log-uniform float in `[low, high]` (`low > 0`).
    pub fn log_float(low: f64, high: f64) -> Self {
        Distribution::Float { low, high, log: true, grid_points: None }
    }

    /// A uniform integer in `[low, high]`.
    pub fn int(low: i64, high: i64) -> Self {
        Distribution::Int { low, high, log: false, grid_points: None }
    }

    /// A log-uniform integer in `[low, high]` (`low ≥ 1`).
    pub fn log_int(low: i64, high: i64) -> Self {
        Distribution::Int { low, high, log: true, grid_points: None }
    }

    /// One of `choices`.
    pub fn categorical<V: Into<Value>>(choices: impl IntoIterator<Item = V>) -> Self {
        Distribution::Categorical { choices: choices.into_iter().map(Into::into).collect() }
    }

    /// Checks the bounds; the error names the parameter.
    pub fn validate(&self, name: &str) -> Result<()> {
        let bad = |reason: String| Err(TrainerError::Usage(format!("search space parameter `{name}`: {reason}")));
        match *self {
            Distribution::Float { low, high, log, .. } => {
                if !(low.is_finite() && high.is_finite() && low < high) {
                    return bad(format!("needs finite low < high, got low = {low}, high = {high}"));
                }
                if log && low <= 0.0 {
                    return bad(format!("log: true needs low > 0, got {low}"));
                }
            }
            Distribution::Int { low, high, log, .. } => {
                if low > high {
                    return bad(format!("needs low ≤ high, got low = {low}, high = {high}"));
                }
                if log && low < 1 {
                    return bad(format!("log: true needs low ≥ 1, got {low}"));
                }
            }
            Distribution::Categorical { ref choices } => {
                if choices.is_empty() {
                    return bad("has no choices".into());
                }
            }
        }
        Ok(())
    }

    /// The sampler's coordinate range `[start, end)` (a little wider than the values' image so that `high`
    /// itself fits: the TPE crate's ranges are half-open).
    pub(crate) fn internal_range(&self) -> (f64, f64) {
        match *self {
            Distribution::Float { low, high, log, .. } => {
                let (a, b) = if log { (low.ln(), high.ln()) } else { (low, high) };
                (a, b + (b - a).abs() * 1e-9 + 1e-12)
            }
            Distribution::Int { low, high, log, .. } => {
                let (a, b) = (low as f64 - 0.5, high as f64 + 0.5);
                if log {
                    (a.ln(), b.ln())
                } else {
                    (a, b)
                }
            }
            Distribution::Categorical { ref choices } => (0.0, choices.len() as f64),
        }
    }

    /// Whether the coordinate is a choice index (the TPE uses a histogram instead of a Parzen estimator).
    pub(crate) fn is_categorical(&self) -> bool {
        matches!(self, Distribution::Categorical { .. })
    }

    /// The value at coordinate `u` (clamped into the bounds; integers rounded).
    pub(crate) fn value_at(&self, u: f64) -> Value {
        match *self {
            Distribution::Float { low, high, log, .. } => {
                let v = if log { u.exp() } else { u };
                Value::from(v.clamp(low, high))
            }
            Distribution::Int { low, high, log, .. } => {
                let v = if log { u.exp() } else { u };
                Value::from((v.round() as i64).clamp(low, high))
            }
            Distribution::Categorical { ref choices } => {
                let i = (u.max(0.0).floor() as usize).min(choices.len() - 1);
                choices[i].clone()
            }
        }
    }

    /// The coordinate of `value`, or `None` when it is not a value of this distribution.
    pub(crate) fn coordinate_of(&self, value: &Value) -> Option<f64> {
        match *self {
            Distribution::Float { low, high, log, .. } => {
                let v = value.as_f64().filter(|v| (low..=high).contains(v))?;
                Some(if log { v.ln() } else { v })
            }
            Distribution::Int { low, high, log, .. } => {
                let v = value.as_i64().filter(|v| (low..=high).contains(v))? as f64;
                Some(if log { v.ln() } else { v })
            }
            Distribution::Categorical { ref choices } => choices.iter().position(|c| c == value).map(|i| i as f64),
        }
    }

    /// The values the grid sampler visits, in increasing order.
    pub(crate) fn grid(&self) -> Vec<Value> {
        match *self {
            Distribution::Float { low, high, log, grid_points } => {
                let n = grid_points.unwrap_or(GRID_POINTS).max(2);
                let (a, b) = if log { (low.ln(), high.ln()) } else { (low, high) };
                (0..n)
                    .map(|i| {
                        let u = a + (b - a) * i as f64 / (n - 1) as f64;
                        Value::from(if log { u.exp() } else { u }.clamp(low, high))
                    })
                    .collect()
            }
            Distribution::Int { low, high, log, grid_points } => {
                let count = (high - low + 1) as usize;
                let n = grid_points.unwrap_or(GRID_POINTS).max(1);
                if count <= n {
                    return (low..=high).map(Value::from).collect();
                }
                let (a, b) = if log { ((low as f64).ln(), (high as f64).ln()) } else { (low as f64, high as f64) };
                let mut out: Vec<i64> = (0..n)
                    .map(|i| {
                        let u = a + (b - a) * i as f64 / (n.max(2) - 1) as f64;
                        (if log { u.exp() } else { u }.round() as i64).clamp(low, high)
                    })
                    .collect();
                out.dedup();
                out.into_iter().map(Value::from).collect()
            }
            Distribution::Categorical { ref choices } => choices.clone(),
        }
    }
}

/// The search space: distributions by parameter name (visited in name order, which fixes how samplers consume
/// their random streams).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SearchSpace(pub BTreeMap<String, Distribution>);

impl SearchSpace {
    /// An empty space.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) parameter `name`.
    pub fn add(mut self, name: impl Into<String>, d: Distribution) -> Self {
        self.0.insert(name.into(), d);
        self
    }

    /// Checks every distribution.
    pub fn validate(&self) -> Result<()> {
        if self.0.is_empty() {
            return Err(TrainerError::Usage("the search space has no parameters".into()));
        }
        self.0.iter().try_for_each(|(k, d)| d.validate(k))
    }

    /// Parameter names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }
}

/// The names of all [`TrainingArguments`] fields (the keys of its serde representation).
pub fn training_argument_names() -> Vec<String> {
    match serde_json::to_value(TrainingArguments::default()) {
        Ok(Value::Object(m)) => m.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// `args` with every parameter that names a [`TrainingArguments`] field set to its value (through the serde
/// representation, so `learning_rate: 3e-4`, `optim: "sgd"` or `per_device_train_batch_size: 32` all work);
/// parameters with other names are left to the caller (user parameters such as a hidden width).
///
/// Errors: [`TrainerError::InvalidArgument`] naming the field when a value does not fit its type (e.g. a float
/// for `per_device_train_batch_size`).
pub fn apply_params(args: &TrainingArguments, params: &Params) -> Result<TrainingArguments> {
    let mut json = serde_json::to_value(args).map_err(|e| TrainerError::json("encoding training arguments", e))?;
    for (name, value) in params {
        let Some(obj) = json.as_object_mut() else { break };
        if !obj.contains_key(name) {
            continue;
        }
        obj.insert(name.clone(), value.clone());
        if let Err(e) = serde_json::from_value::<TrainingArguments>(json.clone()) {
            return Err(TrainerError::invalid(name, format!("the search space gave {value}, which does not fit: {e}")));
        }
    }
    serde_json::from_value(json).map_err(|e| TrainerError::json("decoding training arguments", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_round_trip_and_grid() {
        let f = Distribution::log_float(1e-4, 1e-2);
        let u = f.coordinate_of(&Value::from(1e-3)).unwrap();
        assert!((f.value_at(u).as_f64().unwrap() - 1e-3).abs() < 1e-15);
        let (a, b) = f.internal_range();
        assert!(a <= f.coordinate_of(&Value::from(1e-2)).unwrap() && f.coordinate_of(&Value::from(1e-2)).unwrap() < b);
        let grid: Vec<f64> = f.grid().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(grid.len(), 5);
        assert!((grid[2] - 1e-3).abs() < 1e-12 && (grid[0] - 1e-4).abs() < 1e-15 && grid[4] == 1e-2);
        let i = Distribution::log_int(32, 512);
        assert_eq!(i.value_at(i.internal_range().0), Value::from(32));
        assert_eq!(i.grid(), [32, 64, 128, 256, 512].map(Value::from).to_vec());
        assert_eq!(Distribution::int(1, 3).grid(), [1, 2, 3].map(Value::from).to_vec());
        let c = Distribution::categorical(["adamw", "sgd"]);
        assert_eq!(c.value_at(1.7), Value::from("sgd"));
        assert_eq!(c.coordinate_of(&Value::from("adamw")), Some(0.0));
        assert!(Distribution::log_float(0.0, 1.0).validate("lr").unwrap_err().to_string().contains("`lr`"));
    }

    #[test]
    fn params_apply_to_training_arguments_by_name() {
        let params: Params = [
            ("learning_rate".to_string(), Value::from(3e-4)),
            ("optim".into(), Value::from("sgd")),
            ("per_device_train_batch_size".into(), Value::from(32)),
            ("hidden".into(), Value::from(128)),
        ]
        .into();
        let a = apply_params(&TrainingArguments::default(), &params).unwrap();
        assert_eq!(a.learning_rate, 3e-4);
        assert_eq!(a.optim, crate::args::OptimizerKind::Sgd);
        assert_eq!(a.per_device_train_batch_size, 32);
        let bad: Params = [("per_device_train_batch_size".to_string(), Value::from(0.5))].into();
        let e = apply_params(&TrainingArguments::default(), &bad).unwrap_err();
        assert!(e.to_string().contains("per_device_train_batch_size"), "{e}");
        assert!(training_argument_names().iter().any(|n| n == "weight_decay"));
    }
}
