//! Evaluation and prediction (HF's `evaluate` / `predict` / `evaluation_loop`): the data set is sharded across
//! processes (no shuffle, `per_device_eval_batch_size`), the model runs in inference mode, losses are summed per
//! item and reduced across ranks, and predictions and labels are gathered with `gather_for_metrics`, which drops
//! the duplicates `even_batches` adds, so exactly one row per sample comes back, in data-set order.
//!
//! Metrics: `{prefix}_loss` (item-weighted mean), whatever `compute_metrics` returns (prefixed), plus
//! `{prefix}_runtime` (s), `{prefix}_samples_per_second` and `{prefix}_steps_per_second`.

use std::sync::Arc;
use std::time::Instant;

use accel::data::{DataLoader, DataLoaderConfig, Dataset};
use accel::Accelerator;
use candle_core::{DType, ModuleT, Tensor};

use crate::error::{Result, TrainerError};
use crate::metrics::{EvalPrediction, Metrics, IGNORE_INDEX};
use crate::trainer::{accel_error, cast_input, fire, outputs_f32, Event, Runtime, Trainer};

/// What [`Trainer::predict`] returns (HF's `PredictionOutput`).
#[derive(Debug, Clone)]
pub struct PredictionOutput {
    /// Model outputs for every sample, in data-set order (`[N, ...]`, F32; token dimensions padded with 0).
    pub predictions: Tensor,
    /// Targets (`[N, ...]`, I64; token dimensions padded with [`IGNORE_INDEX`]).
    pub label_ids: Tensor,
    /// `test_loss`, `compute_metrics`' values with the `test_` prefix, `test_runtime`, ...
    pub metrics: Metrics,
}

/// A sharded, unshuffled loader for evaluation, prepared by the Accelerator for evaluation (reports each batch's
/// `even_batches` padding; not saved in checkpoints).
fn eval_loader<D: Dataset + 'static>(acc: &Accelerator, ds: Arc<D>, batch_size: usize) -> Result<DataLoader<D>> {
    let cfg = DataLoaderConfig {
        batch_size,
        shuffle: false,
        seed: 0,
        drop_last: false,
        split_batches: acc.config().split_batches,
        even_batches: acc.config().even_batches,
        prefetch: true,
    };
    Ok(acc.prepare_eval_data_loader(DataLoader::from_arc(ds, cfg))?)
}

/// Concatenates tensors along dim 0, padding dimension 1 (token positions) to the longest with `pad`.
fn cat_padded(parts: &[Tensor], pad: f64) -> Result<Tensor> {
    if parts.len() == 1 {
        return Ok(parts[0].clone());
    }
    let width = parts.iter().map(|t| if t.rank() >= 2 { t.dim(1).unwrap_or(0) } else { 0 }).max().unwrap_or(0);
    let padded = parts
        .iter()
        .map(|t| {
            if t.rank() < 2 || t.dim(1)? == width {
                return Ok(t.clone());
            }
            let mut shape = t.dims().to_vec();
            shape[1] = width - t.dim(1)?;
            let fill = Tensor::ones(shape, DType::F64, t.device())?.affine(pad, 0.0)?.to_dtype(t.dtype())?;
            Ok(Tensor::cat(&[t, &fill], 1)?)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&padded, 0)?)
}

/// What one pass over an evaluation set produced.
struct LoopOutput {
    loss_sum: f64,
    items: f64,
    predictions: Option<Tensor>,
    labels: Option<Tensor>,
    samples: usize,
    steps: usize,
}

impl<M, D> Trainer<M, D>
where
    M: ModuleT + 'static,
    D: Dataset + 'static,
{
    /// Evaluates on the eval data set: returns `eval_loss`, the `compute_metrics` values (prefixed `eval_`),
    /// `eval_runtime`, `eval_samples_per_second`, `eval_steps_per_second`; logs them and calls `on_evaluate`.
    /// Errors: no eval data set.
    pub fn evaluate(&mut self) -> Result<Metrics> {
        self.setup()?;
        let mut rt = self.rt.take().expect("setup created the runtime");
        let r = self.evaluate_in(&mut rt, None, "eval");
        self.rt = Some(rt);
        r
    }

    /// Evaluates on `dataset` instead of the eval data set, with `prefix` (e.g. `"test"`) on metric names.
    pub fn evaluate_dataset(&mut self, dataset: D, prefix: &str) -> Result<Metrics> {
        self.setup()?;
        let mut rt = self.rt.take().expect("setup created the runtime");
        let r = self.evaluate_in(&mut rt, Some(Arc::new(dataset)), prefix);
        self.rt = Some(rt);
        r
    }

    /// Predicts on `dataset`: outputs and labels for every sample in order, plus `test_`-prefixed metrics (no
    /// logging, no callbacks; as HF's `predict`).
    pub fn predict(&mut self, dataset: D) -> Result<PredictionOutput> {
        self.setup()?;
        let mut rt = self.rt.take().expect("setup created the runtime");
        let r = (|| {
            let start = Instant::now();
            let out = self.evaluation_loop(&mut rt, Arc::new(dataset), true)?;
            let metrics = self.finish_metrics(&out, "test", start.elapsed().as_secs_f64())?;
            let (Some(predictions), Some(label_ids)) = (out.predictions, out.labels) else {
                return Err(TrainerError::Usage("predict: the data set is empty".into()));
            };
            Ok(PredictionOutput { predictions, label_ids, metrics })
        })();
        self.rt = Some(rt);
        r
    }

    /// Evaluation with the runtime taken out of `self` (used by the training loop).
    pub(crate) fn evaluate_in(
        &mut self,
        rt: &mut Runtime<M, D>,
        dataset: Option<Arc<D>>,
        prefix: &str,
    ) -> Result<Metrics> {
        let ds = match dataset.or_else(|| self.eval_dataset.clone()) {
            Some(ds) => ds,
            None => {
                return Err(TrainerError::Usage(
                    "evaluate: no eval dataset; pass one to Trainer::new (or call evaluate_dataset)".into(),
                ))
            }
        };
        let start = Instant::now();
        let out = self.evaluation_loop(rt, ds, self.compute_metrics.is_some())?;
        let metrics = self.finish_metrics(&out, prefix, start.elapsed().as_secs_f64())?;
        self.log(rt, metrics.clone())?;
        fire(&mut rt.callbacks, &self.args, &self.state, &rt.acc, &mut self.control, Event::Evaluate(&metrics))?;
        Ok(metrics)
    }

    fn finish_metrics(&self, out: &LoopOutput, prefix: &str, runtime: f64) -> Result<Metrics> {
        let mut metrics = Metrics::new();
        if out.items > 0.0 {
            metrics.insert(format!("{prefix}_loss"), out.loss_sum / out.items);
        }
        if let (Some(f), Some(p), Some(l)) = (&self.compute_metrics, &out.predictions, &out.labels) {
            let user = f(&EvalPrediction { predictions: p.clone(), label_ids: l.clone() })?;
            for (k, v) in user {
                let key = if k.starts_with(&format!("{prefix}_")) { k } else { format!("{prefix}_{k}") };
                metrics.insert(key, v);
            }
        }
        metrics.insert(format!("{prefix}_runtime"), runtime);
        metrics.insert(format!("{prefix}_samples_per_second"), out.samples as f64 / runtime.max(1e-9));
        metrics.insert(format!("{prefix}_steps_per_second"), out.steps as f64 / runtime.max(1e-9));
        Ok(metrics)
    }

    /// Refuses what evaluation cannot do for a model split over tp > 1 ranks: gathering its outputs (they are
    /// shards, e.g. of the vocabulary) for `compute_metrics` or [`Trainer::predict`].
    pub(crate) fn check_tp_evaluation(&self, rt: &Runtime<M, D>, keep_predictions: bool) -> Result<()> {
        if keep_predictions && rt.acc.pipeline_schedule().is_some() {
            return Err(TrainerError::Usage(format!(
                "the model is cut into {} pipeline stages: evaluation reports the loss only, its outputs exist on \
                 the last stage alone, which compute_metrics / predict cannot use; drop compute_metrics (eval_loss \
                 is still reported), or evaluate with pp_size 1",
                rt.acc.mesh().pp().world_size()
            )));
        }
        if keep_predictions && rt.tp.size() > 1 {
            return Err(TrainerError::Usage(format!(
                "the model is split over {} tensor-parallel ranks: evaluation reports the loss only, its outputs \
                 are shards that compute_metrics / predict cannot use; drop compute_metrics (eval_loss is still \
                 reported), or evaluate with tp_size 1",
                rt.tp.size()
            )));
        }
        Ok(())
    }

    fn evaluation_loop(&mut self, rt: &mut Runtime<M, D>, ds: Arc<D>, keep_predictions: bool) -> Result<LoopOutput> {
        self.check_tp_evaluation(rt, keep_predictions)?;
        let acc = rt.acc.clone();
        let n = ds.len();
        let loader = eval_loader(&acc, ds, self.args.per_device_eval_batch_size)?;
        let dtype = acc.compute_dtype();
        let (mut loss_sum, mut items, mut steps) = (0.0f64, 0usize, 0usize);
        let (mut preds, mut labels) = (Vec::new(), Vec::new());
        for batch in loader.iter() {
            let batch = batch?;
            steps += 1;
            if let Some(staged) = &rt.staged {
                // Through the stages (forward only); the loss is the last stage's, the same on every pp rank.
                let rows = batch.len();
                let keep = rows - acc.padding_in_batch().min(rows);
                if keep > 0 {
                    let (x, t) = (batch.inputs.narrow(0, 0, keep)?, batch.targets.narrow(0, 0, keep)?);
                    let n = self.loss.count_items(&t)?.ok_or_else(|| {
                        TrainerError::Usage(
                            "a pipelined model is evaluated with a loss that counts its items from the targets \
                             (Loss::count_items)"
                                .into(),
                        )
                    })?;
                    let tp = &rt.tp;
                    let sum = acc.pipeline_forward(staged.as_ref(), &cast_input(&x, dtype)?, &t, |y, t| {
                        Ok(self.loss.compute_parallel(&outputs_f32(y.clone()).map_err(accel_error)?, t, tp)?.loss_sum)
                    })?;
                    loss_sum += f64::from(sum.to_scalar::<f32>()?);
                    items += n;
                }
                continue;
            }
            let y = outputs_f32(rt.model.forward_t(&cast_input(&batch.inputs, dtype)?, false)?.detach())?;
            let rows = batch.len();
            let keep = rows - acc.padding_in_batch().min(rows);
            if keep > 0 {
                let (y, t) = (y.narrow(0, 0, keep)?, batch.targets.narrow(0, 0, keep)?);
                let out = self.loss.compute_parallel(&y, &t, &rt.tp)?;
                loss_sum += out.loss_sum.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                items += out.num_items;
            }
            if keep_predictions {
                let mut p = y;
                let mut l = batch.targets.to_dtype(DType::I64)?;
                if l.rank() >= 2 && acc.world_size() > 1 {
                    // Token-level outputs: equal lengths across ranks before gathering.
                    l = acc.pad_across_processes(&l, 1, IGNORE_INDEX as f64, false)?;
                    if p.rank() >= 2 {
                        p = acc.pad_across_processes(&p, 1, 0.0, false)?;
                    }
                }
                preds.push(acc.gather_for_metrics(&p)?);
                labels.push(acc.gather_for_metrics(&l)?);
            }
        }
        let (loss_sum, items) = if acc.world_size() > 1 {
            let mut buf = [loss_sum, items as f64];
            acc.process_group().all_reduce(&mut buf, accel::dist::ReduceOp::Sum)?;
            (buf[0], buf[1])
        } else {
            (loss_sum, items as f64)
        };
        let (predictions, labels) = if preds.is_empty() {
            (None, None)
        } else {
            (Some(cat_padded(&preds, 0.0)?), Some(cat_padded(&labels, IGNORE_INDEX as f64)?))
        };
        if let Some(l) = &labels {
            if l.dim(0)? != n {
                return Err(TrainerError::Usage(format!(
                    "evaluation gathered {} rows for a data set of {n} samples; the data loader's even_batches \
                     padding and gather_for_metrics disagree",
                    l.dim(0)?
                )));
            }
        }
        Ok(LoopOutput { loss_sum, items, predictions, labels, samples: n, steps })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn cat_padded_pads_token_dimension() {
        let a = Tensor::new(&[[1i64, 2, 3]], &Device::Cpu).unwrap();
        let b = Tensor::new(&[[4i64], [5]], &Device::Cpu).unwrap();
        let c = cat_padded(&[a, b], IGNORE_INDEX as f64).unwrap();
        assert_eq!(c.to_vec2::<i64>().unwrap(), vec![vec![1, 2, 3], vec![4, -100, -100], vec![5, -100, -100]]);
    }
}
