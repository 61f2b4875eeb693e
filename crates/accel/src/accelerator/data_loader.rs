//! `prepare_data_loader` and `prepare`: hand a data loader to the Accelerator so it yields this rank's shard on
//! the Accelerator's device and reports the end of each epoch and its padding rows to the [`GradientState`](super::GradientState).

use super::{Accelerator, PreparedModel};
use crate::data::{DataLoader, Dataset, LoaderStateHandle};
use crate::optim::{AcceleratedOptimizer, Optimizer};
use crate::Result;
use candle_nn::VarMap;

/// The position handles of the prepared loaders, in order (kept in the Accelerator's extension slots).
#[derive(Default)]
struct PreparedLoaders(Vec<LoaderStateHandle>);

impl Accelerator {
    /// Prepares a data loader for this process: shards it for `rank` of `world_size` (Accelerate's rules, with
    /// the Accelerator's `split_batches` and `even_batches`), moves its batches to the Accelerator's device, and
    /// makes it report each yielded batch to the [`GradientState`](super::GradientState) (last batch of the epoch → gradients sync;
    /// padding rows → trimmed by `gather_for_metrics`). Its position is saved by `save_state`.
    ///
    /// Errors: batch size 0, or with `split_batches` a batch size not divisible by the world size.
    pub fn prepare_data_loader<D: Dataset>(&self, loader: DataLoader<D>) -> Result<DataLoader<D>> {
        let loader = loader.shard_for(self)?;
        let handle = loader.state_handle();
        self.with_extension(|l: &mut PreparedLoaders| l.0.push(handle));
        Ok(loader)
    }

    /// Position handles of the loaders prepared so far, in order (what `save_state` writes as
    /// `data_loader_{i}.json`).
    pub fn prepared_data_loaders(&self) -> Vec<LoaderStateHandle> {
        self.with_extension(|l: &mut PreparedLoaders| l.0.clone())
    }

    /// `prepare_model`, `prepare_optimizer` and `prepare_data_loader` in one call — the usual first lines of an
    /// Accelerate program.
    pub fn prepare<O: Optimizer, D: Dataset>(
        &self,
        varmap: &VarMap,
        opt: O,
        loader: DataLoader<D>,
    ) -> Result<(PreparedModel, AcceleratedOptimizer<O>, DataLoader<D>)> {
        let model = self.prepare_model(varmap)?;
        let opt = self.prepare_optimizer(&model, opt)?;
        let loader = self.prepare_data_loader(loader)?;
        Ok((model, opt, loader))
    }
}
