//! Evaluation metrics: what `compute_metrics` receives ([`EvalPrediction`]) and the built-in metrics —
//! accuracy, macro precision / recall / F1 (scikit-learn's `precision_recall_fscore_support(average="macro")`
//! with `zero_division=0`) and perplexity (`exp` of the mean token loss).
//!
//! Labels equal to [`IGNORE_INDEX`] (-100, PyTorch's `CrossEntropyLoss` default and what the trainer pads
//! token-level labels with) are skipped everywhere.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};

use crate::error::{Result, TrainerError};

/// Named metric values, e.g. `{"accuracy": 0.97, "f1": 0.96}`. The trainer adds the `eval_` prefix.
pub type Metrics = BTreeMap<String, f64>;

/// Label value that marks "no target here" (padding of variable-length targets).
pub const IGNORE_INDEX: i64 = -100;

/// Everything predicted on an evaluation set, gathered from all processes: exactly one row per sample, in the
/// data set's order when the loader does not shuffle (duplicates added to even out the last batch are removed).
#[derive(Debug, Clone)]
pub struct EvalPrediction {
    /// Model outputs, e.g. logits `[N, classes]` (or `[N, T, classes]` for token-level tasks, padded along `T`).
    pub predictions: Tensor,
    /// Targets, `[N]` or `[N, T]`, as i64 with [`IGNORE_INDEX`] where padded.
    pub label_ids: Tensor,
}

impl EvalPrediction {
    /// Arg-max class of every prediction (`[N]` or `[N, T]`), flattened, paired with the flattened labels, with
    /// [`IGNORE_INDEX`] positions removed.
    pub fn class_pairs(&self) -> Result<(Vec<i64>, Vec<i64>)> {
        let last = self.predictions.rank().checked_sub(1).ok_or_else(|| {
            TrainerError::Usage("predictions must have a class dimension (logits [N, classes])".into())
        })?;
        let predicted = self.predictions.argmax(last)?.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
        let labels = self.label_ids.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
        if predicted.len() != labels.len() {
            return Err(TrainerError::Usage(format!(
                "predictions {:?} and labels {:?} do not line up: {} predicted classes for {} labels",
                self.predictions.dims(),
                self.label_ids.dims(),
                predicted.len(),
                labels.len()
            )));
        }
        Ok(predicted.into_iter().zip(labels).filter(|(_, l)| *l != IGNORE_INDEX).unzip())
    }
}

/// Fraction of `predicted[i] == labels[i]` (0 for empty input).
pub fn accuracy(predicted: &[i64], labels: &[i64]) -> f64 {
    if labels.is_empty() {
        return 0.0;
    }
    predicted.iter().zip(labels).filter(|(p, l)| p == l).count() as f64 / labels.len() as f64
}

/// Macro-averaged (precision, recall, F1) over the classes present in `labels` or `predicted`, as scikit-learn's
/// `precision_recall_fscore_support(average="macro", zero_division=0)`: per class
/// `precision = tp / (tp + fp)`, `recall = tp / (tp + fn)`, `F1 = 2·tp / (2·tp + fp + fn)`, 0 where undefined,
/// then the unweighted mean.
pub fn precision_recall_f1_macro(predicted: &[i64], labels: &[i64]) -> (f64, f64, f64) {
    // class -> (tp, predicted count, true count)
    let mut counts: BTreeMap<i64, (u64, u64, u64)> = BTreeMap::new();
    for (&p, &l) in predicted.iter().zip(labels) {
        counts.entry(p).or_default().1 += 1;
        let e = counts.entry(l).or_default();
        e.2 += 1;
        if p == l {
            e.0 += 1;
        }
    }
    if counts.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    let ratio = |num: u64, den: u64| if den == 0 { 0.0 } else { num as f64 / den as f64 };
    let (mut p, mut r, mut f) = (0.0, 0.0, 0.0);
    for &(tp, pp, ap) in counts.values() {
        p += ratio(tp, pp);
        r += ratio(tp, ap);
        f += ratio(2 * tp, pp + ap);
    }
    let k = counts.len() as f64;
    (p / k, r / k, f / k)
}

/// Perplexity `exp(mean_loss)` of a mean per-token cross-entropy (natural log).
pub fn perplexity(mean_loss: f64) -> f64 {
    mean_loss.exp()
}

/// The built-in classification metrics: `accuracy`, `precision`, `recall`, `f1` (macro). Use as
/// `trainer.compute_metrics(metrics::classification)`.
pub fn classification(pred: &EvalPrediction) -> Result<Metrics> {
    let (p, l) = pred.class_pairs()?;
    let (precision, recall, f1) = precision_recall_f1_macro(&p, &l);
    Ok(Metrics::from([
        ("accuracy".to_string(), accuracy(&p, &l)),
        ("precision".to_string(), precision),
        ("recall".to_string(), recall),
        ("f1".to_string(), f1),
    ]))
}

/// Accuracy alone (`{"accuracy": ...}`).
pub fn accuracy_metric(pred: &EvalPrediction) -> Result<Metrics> {
    let (p, l) = pred.class_pairs()?;
    Ok(Metrics::from([("accuracy".to_string(), accuracy(&p, &l))]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn macro_scores_match_sklearn() {
        // sklearn: precision_recall_fscore_support([0,1,2,0,1,2], [0,2,1,0,0,1], average="macro", zero_division=0)
        // -> (0.2222222, 0.3333333, 0.2666667)
        let y_true = [0, 1, 2, 0, 1, 2];
        let y_pred = [0, 2, 1, 0, 0, 1];
        let (p, r, f) = precision_recall_f1_macro(&y_pred, &y_true);
        assert!((p - 2.0 / 9.0).abs() < 1e-12, "{p}");
        assert!((r - 1.0 / 3.0).abs() < 1e-12, "{r}");
        assert!((f - 0.8 / 3.0).abs() < 1e-12, "{f}");
        assert!((accuracy(&y_pred, &y_true) - 2.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn a_class_only_predicted_counts_with_zero_recall_and_precision() {
        // Class 3 never occurs in labels but is predicted once: it enters the macro mean with p = r = f = 0.
        let (p, r, f) = precision_recall_f1_macro(&[0, 3], &[0, 0]);
        assert_eq!((p, r), ((1.0 + 0.0) / 2.0, (0.5 + 0.0) / 2.0));
        assert!((f - (2.0 / 3.0) / 2.0).abs() < 1e-12);
        assert_eq!(precision_recall_f1_macro(&[], &[]), (0.0, 0.0, 0.0));
    }

    #[test]
    fn token_level_predictions_skip_ignore_index() {
        let dev = Device::Cpu;
        // [N=1, T=3, C=2]: argmax 1, 0, 1; label at t=2 is padding.
        let logits = Tensor::new(&[[[0.0f32, 1.0], [2.0, 0.0], [0.0, 5.0]]], &dev).unwrap();
        let labels = Tensor::new(&[[1i64, 1, IGNORE_INDEX]], &dev).unwrap();
        let m = classification(&EvalPrediction { predictions: logits, label_ids: labels }).unwrap();
        assert_eq!(m["accuracy"], 0.5);
        assert!((perplexity(2f64.ln()) - 2.0).abs() < 1e-12);
    }
}
