//! The loss tally: each rank's sum of per-item losses and their count since the last log and over the run, combined
//! over the ranks when logged and saved in checkpoints.

use super::*;

/// Training-loss sums: on the device between logs (one small add per step, no host sync), on the host for the
/// whole run.
#[derive(Default)]
pub(super) struct LossTally {
    /// This rank's loss sum since the last log (loss dtype, on the device).
    pub(super) sum: Option<Tensor>,
    /// This rank's item count since the last log.
    pub(super) items: f64,
    /// Optimizer steps since the last log.
    pub(super) steps: u64,
    /// This rank's loss sum and item count of the whole run, up to the last log.
    pub(super) run_sum: f64,
    pub(super) run_items: f64,
    /// The since-log sum restored from a checkpoint, until the first step after the resume puts it on the device
    /// (in the loss's dtype, where it came from, so the sums continue bit for bit).
    pub(super) restored_sum: Option<f64>,
    /// The newest step's loss sum and item count, not yet checked for finiteness.
    pub(super) pending: Option<(Tensor, f64)>,
    /// (global step, this rank's mean loss) of the newest step with a finite loss.
    pub(super) last_finite: Option<(u64, f64)>,
}

impl LossTally {
    /// A tally continuing from a checkpoint's.
    pub(super) fn restored(t: &LossTallyState) -> Self {
        LossTally {
            items: t.items,
            steps: t.steps,
            run_sum: t.run_sum,
            run_items: t.run_items,
            restored_sum: (t.steps > 0).then_some(t.sum),
            ..Default::default()
        }
    }

    pub(super) fn add(&mut self, loss_sum: Tensor, items: f64) -> Result<()> {
        self.pending = Some((loss_sum.clone(), items));
        self.sum = Some(match (self.sum.take(), self.restored_sum.take()) {
            (Some(s), _) => (s + loss_sum)?,
            (None, Some(r)) => {
                (Tensor::new(r, loss_sum.device())?.to_dtype(loss_sum.dtype())?.reshape(loss_sum.shape())? + loss_sum)?
            }
            (None, None) => loss_sum,
        });
        self.items += items;
        self.steps += 1;
        Ok(())
    }

    /// This rank's since-log loss sum as a host value (reads the device once).
    pub(super) fn current_sum(&self) -> Result<f64> {
        Ok(match &self.sum {
            Some(s) => s.to_dtype(DType::F64)?.to_scalar::<f64>()?,
            None => self.restored_sum.unwrap_or(0.0),
        })
    }

    /// Every rank's tally, indexed by rank (for the checkpoint). Collective when distributed: each rank fills its
    /// own slot of a zero vector, so the all-reduce sum carries the values exactly.
    pub(super) fn gather(&self, acc: &Accelerator) -> Result<Vec<LossTallyState>> {
        const N: usize = 5;
        let (rank, world) = (acc.rank(), acc.world_size());
        let mut buf = vec![0.0; N * world];
        buf[rank * N..(rank + 1) * N].copy_from_slice(&[
            self.current_sum()?,
            self.items,
            self.steps as f64,
            self.run_sum,
            self.run_items,
        ]);
        if world > 1 {
            acc.process_group().all_reduce(&mut buf, accel::dist::ReduceOp::Sum)?;
        }
        Ok(buf
            .chunks(N)
            .map(|c| LossTallyState { sum: c[0], items: c[1], steps: c[2] as u64, run_sum: c[3], run_items: c[4] })
            .collect())
    }

    /// Moves the since-log sums into the run totals; returns them (this rank's sum, items).
    pub(super) fn flush(&mut self) -> Result<(f64, f64)> {
        let sum = self.current_sum()?;
        self.sum = None;
        self.restored_sum = None;
        let items = std::mem::take(&mut self.items);
        self.steps = 0;
        self.run_sum += sum;
        self.run_items += items;
        Ok((sum, items))
    }

    /// The item-weighted mean loss over all ranks since the last log, and resets it. Collective (one all-reduce
    /// of (sum, count) when distributed): every rank calls it at the same steps.
    pub(super) fn log_mean(&mut self, acc: &Accelerator) -> Result<Option<f64>> {
        let (sum, items) = self.flush()?;
        global_mean(acc, sum, items)
    }

    /// The item-weighted mean loss over all ranks and the whole run (call [`Self::flush`] first). Collective.
    pub(super) fn run_mean(&self, acc: &Accelerator) -> Result<Option<f64>> {
        global_mean(acc, self.run_sum, self.run_items)
    }
}

/// `Σ sum / Σ items` over ranks (`None` when there are no items anywhere).
pub(super) fn global_mean(acc: &Accelerator, sum: f64, items: f64) -> Result<Option<f64>> {
    let mut buf = [sum, items];
    if acc.world_size() > 1 {
        acc.process_group().all_reduce(&mut buf, accel::dist::ReduceOp::Sum)?;
    }
    Ok((buf[1] > 0.0).then(|| buf[0] / buf[1]))
}
