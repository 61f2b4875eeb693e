//! One optimizer step: the window's micro-batches forward and backward with the loss normalised over the window and all
//! ranks, a non-finite step skipped or stopped, and the optimizer stepped.

use super::*;

impl<M, D> Trainer<M, D>
where
    M: ModuleT + 'static,
    D: Dataset + 'static,
{
    /// One optimizer step over a window of micro-batches. See the module documentation for the normalisation.
    ///
    /// When the loss can count a micro-batch's items from its targets ([`Loss::count_items`], as HF counts
    /// `num_items_in_batch` from the labels), the window's count is known before any forward pass and each
    /// micro-batch runs forward and backward before the next one starts: memory does not grow with
    /// `gradient_accumulation_steps`. Otherwise every micro-batch's graph is kept until the count is known.
    pub(super) fn training_step(&mut self, rt: &mut Runtime<M, D>, window: &[Batch]) -> Result<StepOutcome> {
        let (local_sum, local_items) = self.accumulate_gradients(rt, window)?;
        let acc = &rt.acc;
        let grad_norm = if self.args.max_grad_norm > 0.0 { acc.clip_grad_norm(self.args.max_grad_norm)? } else { None };
        if self.args.on_nonfinite_loss == crate::args::NonFiniteLoss::SkipStep
            && self.skip_nonfinite_step(rt, local_sum.as_ref(), grad_norm)?
        {
            let zero = Tensor::zeros((), DType::F32, rt.acc.device())?;
            return Ok(StepOutcome { loss_sum: zero, items: 0.0, grad_norm: None });
        }
        optimizer_step(rt)?;
        let loss_sum = local_sum.expect("a window has at least one micro-batch");
        Ok(StepOutcome { loss_sum, items: local_items as f64, grad_norm })
    }

    /// Forward and backward over the window's micro-batches, the gradients accumulated (and synced with the
    /// last); returns this rank's loss sum (detached) and item count.
    pub(super) fn accumulate_gradients(&self, rt: &Runtime<M, D>, window: &[Batch]) -> Result<(Option<Tensor>, usize)> {
        let counts = window
            .iter()
            .map(|b| self.loss.count_items(&b.targets))
            .collect::<candle_core::Result<Option<Vec<usize>>>>()?;
        let mut local_sum: Option<Tensor> = None;
        // The trainer cuts windows itself (it needs the window's item count first): the window's last micro-batch
        // syncs, whatever the loader's end-of-data flag says about the batch fetched last.
        let local_items = match counts {
            Some(counts) => self.accumulate_counted(rt, window, &counts, &mut local_sum)?,
            None => self.accumulate_uncounted(rt, window, &mut local_sum)?,
        };
        Ok((local_sum, local_items))
    }

    /// A window whose item counts the loss gave up front (`counts`): each micro-batch runs forward and backward
    /// before the next one starts.
    pub(super) fn accumulate_counted(
        &self,
        rt: &Runtime<M, D>,
        window: &[Batch],
        counts: &[usize],
        local_sum: &mut Option<Tensor>,
    ) -> Result<usize> {
        let acc = &rt.acc;
        let rows: usize = window.iter().map(Batch::len).sum();
        let local_items: usize = counts.iter().sum();
        let scale = self.loss_scale(acc, local_items, rows)?;
        if let Some(staged) = &rt.staged {
            // Each pipeline micro-batch's loss sum × the window's scale, summed; the call returns that sum (the
            // same on every pp rank), so this rank's share of the window's loss sum is it ÷ scale.
            let (dtype, tp) = (acc.compute_dtype(), &rt.tp);
            acc.accumulate_window(window.len(), |i| {
                let b = &window[i];
                let scaled =
                    acc.pipeline_backward_sum(staged.as_ref(), &cast_input(&b.inputs, dtype)?, &b.targets, |y, t| {
                        let out = self.loss.compute_parallel(&outputs_f32(y.clone()).map_err(accel_error)?, t, tp)?;
                        Ok(out.loss_sum.affine(scale, 0.0)?)
                    })?;
                let sum = if scale > 0.0 { scaled.affine(1.0 / scale, 0.0)? } else { scaled.zeros_like()? };
                add_detached(local_sum, &sum)
            })?;
            return Ok(local_items);
        }
        acc.accumulate_window(window.len(), |i| {
            let (out, cuts) = self.forward(rt, &window[i], 0)?;
            if out.num_items != counts[i] {
                return Err(TrainerError::Usage(format!(
                    "the loss counted {} items from the targets (count_items) but computed {} (compute); make \
                     the two agree",
                    counts[i], out.num_items
                )));
            }
            add_detached(local_sum, &out.loss_sum)?;
            Ok(acc.backward_segments(&out.loss_sum.affine(scale, 0.0)?, cuts)?)
        })?;
        Ok(local_items)
    }

    /// A window whose item count is known only after every forward pass: each micro-batch's graph is kept until
    /// then, and the backward passes follow.
    pub(super) fn accumulate_uncounted(
        &self,
        rt: &Runtime<M, D>,
        window: &[Batch],
        local_sum: &mut Option<Tensor>,
    ) -> Result<usize> {
        let acc = &rt.acc;
        if rt.staged.is_some() {
            return Err(TrainerError::Usage(
                "a pipelined model needs a loss that counts its items from the targets \
                 (Loss::count_items): each micro-batch's backward runs before the pipeline's last stage could count \
                 the window; use one of trainer::losses or implement count_items"
                    .into(),
            ));
        }
        let rows: usize = window.iter().map(Batch::len).sum();
        let mut sums = Vec::with_capacity(window.len());
        let mut local_items = 0usize;
        for (ahead, batch) in window.iter().enumerate() {
            // The backward passes come after every forward: the micro-step of this one is `ahead` further on.
            let (out, cuts) = self.forward(rt, batch, ahead as u64)?;
            add_detached(local_sum, &out.loss_sum)?;
            local_items += out.num_items;
            sums.push((out.loss_sum, Some(cuts)));
        }
        let scale = self.loss_scale(acc, local_items, rows)?;
        acc.accumulate_window(sums.len(), |i| {
            let cuts = sums[i].1.take().unwrap_or_default();
            Ok::<_, TrainerError>(acc.backward_segments(&sums[i].0.affine(scale, 0.0)?, cuts)?)
        })?;
        Ok(local_items)
    }

    /// One micro-batch's forward pass and loss (`ahead`: see the dropout context below). The pass is recorded: where the model marks backward-segment cuts
    /// (`accel::segments::cut`), the gradient all-reduce starts during the backward pass
    /// (Accelerator::backward_segments).
    pub(super) fn forward(
        &self,
        rt: &Runtime<M, D>,
        batch: &Batch,
        ahead: u64,
    ) -> Result<(crate::losses::LossOutput, BackwardSegments)> {
        let dtype = rt.acc.compute_dtype();
        // Dropout (accel::tensor_parallel::dropout) is on in the training forward only, its masks those of the
        // micro-step whose backward this forward feeds (`ahead` micro-steps after the next one).
        let mut dropout = rt.acc.dropout_context(batch.len());
        dropout.step += ahead;
        segments::record(|| {
            let x = cast_input(&batch.inputs, dtype)?;
            let checkpointing = rt.acc.config().activation_checkpointing;
            let y = accel::activation_checkpoint::with_activation_checkpointing(checkpointing, || {
                accel::tensor_parallel::with_dropout_context(dropout, || rt.model.forward_t(&x, true))
            })?;
            let y = outputs_f32(y)?;
            Ok(self.loss.compute_parallel(&y, &batch.targets, &rt.tp)?)
        })
    }

    /// `on_nonfinite_loss = skip_step`: whether any rank's loss or the gradient norm is not finite (every rank
    /// agrees). Then every rank skips the same step: the synced gradients are dropped, weights and schedule stay.
    pub(super) fn skip_nonfinite_step(
        &self,
        rt: &mut Runtime<M, D>,
        local_sum: Option<&Tensor>,
        grad_norm: Option<f64>,
    ) -> Result<bool> {
        let acc = &rt.acc;
        let local = local_sum.map_or(Ok(0.0), |t| t.to_dtype(DType::F64)?.to_scalar::<f64>())?;
        let mut bad = [f64::from(u8::from(!local.is_finite() || grad_norm.is_some_and(|g| !g.is_finite())))];
        if acc.world_size() > 1 {
            acc.process_group().all_reduce(&mut bad, accel::dist::ReduceOp::Max)?;
        }
        if bad[0] == 0.0 {
            return Ok(false);
        }
        rt.optimizer.zero_grad();
        tracing::warn!(
            "global step {}: non-finite loss or gradient norm on some rank; step skipped (on_nonfinite_loss = \
             skip_step)",
            self.state.global_step + 1
        );
        Ok(true)
    }

    /// The factor each micro-batch's loss sum is multiplied by before `backward`: `GA · W / N` with `N` the
    /// window's item count over all ranks (see the module documentation); `backward` divides by GA and DDP
    /// averages over the `W` ranks, so the applied gradient is `∇(Σ loss) / N`. Collective for token-level losses.
    pub(super) fn loss_scale(&self, acc: &Accelerator, local_items: usize, rows: usize) -> Result<f64> {
        let world = acc.world_size();
        let (items, global) = match self.normalisation(acc) {
            Normalisation::Local => (local_items as f64, false),
            Normalisation::FixedPerRow => {
                if !local_items.is_multiple_of(rows.max(1)) {
                    return Err(TrainerError::Usage(format!(
                        "the loss declares items_fixed_per_row() but returned {local_items} items for {rows} rows; \
                         return false from items_fixed_per_row for losses with varying item counts"
                    )));
                }
                // Same rows on every rank at every step: the global count is known without communication.
                ((local_items * world) as f64, true)
            }
            Normalisation::Reduced => {
                let mut buf = [local_items as f64];
                acc.process_group().all_reduce(&mut buf, accel::dist::ReduceOp::Sum)?;
                (buf[0], true)
            }
        };
        let ga = acc.gradient_accumulation_steps() as f64;
        Ok(if items > 0.0 { ga * if global { world as f64 } else { 1.0 } / items } else { 0.0 })
    }

    /// How this run normalises token-level losses (see [`Normalisation`]).
    pub(super) fn normalisation(&self, acc: &Accelerator) -> Normalisation {
        let equal_rows = acc.config().even_batches || self.args.dataloader_drop_last;
        if acc.world_size() == 1 || !self.args.average_tokens_across_devices {
            Normalisation::Local
        } else if self.loss.items_fixed_per_row() && equal_rows {
            Normalisation::FixedPerRow
        } else {
            Normalisation::Reduced
        }
    }
}

/// How the per-window item count `N` of the loss normalisation is obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Normalisation {
    /// This rank's count (one process, or `average_tokens_across_devices` off: DDP then averages per-rank means).
    Local,
    /// `world_size ×` this rank's count: the loss has a fixed item count per row and every rank holds as many rows.
    FixedPerRow,
    /// Summed over ranks with one all-reduce per optimizer step (token-level losses).
    Reduced,
}

/// Result of one optimizer step.
pub(super) struct StepOutcome {
    /// This rank's summed per-item loss over the window (scalar on the device, detached).
    pub(super) loss_sum: Tensor,
    /// This rank's item count over the window.
    pub(super) items: f64,
    /// Total gradient norm before clipping, when clipping is on.
    pub(super) grad_norm: Option<f64>,
}

/// Adds a micro-batch's loss sum, detached from its graph, to this window's running sum.
pub(super) fn add_detached(sum: &mut Option<Tensor>, loss_sum: &Tensor) -> Result<()> {
    let detached = loss_sum.detach();
    *sum = Some(match sum.take() {
        None => detached,
        Some(acc_sum) => (acc_sum + detached)?,
    });
    Ok(())
}

/// The optimizer step; a real one (not skipped by the fp16 scaler) moves the schedule and the learning rate.
pub(super) fn optimizer_step<M, D>(rt: &mut Runtime<M, D>) -> Result<()> {
    let stepped = rt.optimizer.step()?;
    if stepped {
        // Only real optimizer steps move the schedule (not fp16-skipped ones).
        if let Some(s) = &rt.scheduler {
            let mut s = crate::lock(s);
            s.step();
            rt.optimizer.set_learning_rate(s.lr());
        }
    }
    Ok(())
}

/// The next optimizer step's window: up to `ga` micro-batches, fewer at the end of the epoch, `None` once the
/// epoch has ended.
pub(super) fn next_window(
    iter: &mut impl Iterator<Item = accel::Result<Batch>>,
    ga: usize,
) -> Result<Option<Vec<Batch>>> {
    let mut window: Vec<Batch> = Vec::with_capacity(ga);
    for _ in 0..ga {
        match iter.next() {
            Some(b) => window.push(b?),
            None => break,
        }
    }
    Ok((!window.is_empty()).then_some(window))
}
