//! [`DataLoader`]: batches of a [`Dataset`] for this rank, epoch by epoch — seeded shuffle, per-rank sharding
//! (Accelerate's rules, see [`super::sharding`]), prefetch on a worker thread, mid-epoch resume.
//!
//! - Shuffle: the epoch order is a Fisher–Yates permutation drawn from `ChaCha8Rng::seed_from_u64(seed + epoch)`,
//!   the same on every rank (as ddp-core's `DistributedSampler`; PyTorch's *rule*, not its exact sequence).
//! - Position: the loader remembers `(epoch, batches consumed)`. Finishing an epoch moves to `(epoch + 1, 0)`, so
//!   a plain `for epoch { for batch in &loader {..} }` reshuffles every epoch even without [`DataLoader::set_epoch`].
//!   The position is [`Stateful`] (via [`DataLoader::state_handle`]); restoring it makes the next iteration skip
//!   the batches already consumed, so a checkpoint taken mid-epoch resumes with exactly the batches that follow.
//! - Prefetch: while the caller works on batch `k`, a worker thread builds batch `k + 1` (gathers rows, moves them
//!   to the device); exactly one batch ahead, so the order and the data are the same as without prefetch.
//! - End of loader: an observer (set by the Accelerator) learns about each yielded batch ([`BatchInfo`]): whether
//!   it is the last of the epoch (gradients sync there) and how many of its rows are `even_batches` padding
//!   (`gather_for_metrics` trims them).

use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use candle_core::Device;
use serde::{Deserialize, Serialize};

use super::dataset::{Batch, Dataset};
use super::sharding::{ShardBatch, ShardSpec};
use crate::error::{AccelError, Result};
use crate::lock;
use crate::state::{StateDict, Stateful};

/// How a [`DataLoader`] batches, orders and shards its data set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataLoaderConfig {
    /// Rows per batch on each rank; with `split_batches`, rows per *global* batch. Default 1 (PyTorch's).
    pub batch_size: usize,
    /// Reshuffle every epoch (default false).
    pub shuffle: bool,
    /// Shuffle seed; the order of epoch `e` depends only on `seed + e` (default 0).
    pub seed: u64,
    /// Drop the incomplete last global batch (default false).
    pub drop_last: bool,
    /// `batch_size` is the global batch, split across ranks (default false). `Accelerator::prepare_data_loader`
    /// sets it from the Accelerator's configuration.
    pub split_batches: bool,
    /// Pad the tail with samples from the epoch start so every rank yields as many full batches (default true;
    /// no effect on a single process).
    /// `Accelerator::prepare_data_loader` sets it from the Accelerator's configuration.
    pub even_batches: bool,
    /// Build the next batch on a worker thread while the current one is used (default true).
    pub prefetch: bool,
}

impl Default for DataLoaderConfig {
    fn default() -> Self {
        DataLoaderConfig {
            batch_size: 1,
            shuffle: false,
            seed: 0,
            drop_last: false,
            split_batches: false,
            even_batches: true,
            prefetch: true,
        }
    }
}

impl DataLoaderConfig {
    /// The defaults with `batch_size` rows per batch.
    pub fn with_batch_size(batch_size: usize) -> Self {
        DataLoaderConfig { batch_size, ..Self::default() }
    }
}

/// Where a loader is in its data: the epoch and how many of its batches have been handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LoaderPosition {
    /// The epoch the next iteration yields.
    pub epoch: u64,
    /// Batches of that epoch already yielded (0 at an epoch boundary).
    pub batches_consumed: usize,
}

/// What the loader reports about each batch it yields (to the Accelerator's training step, see
/// `Accelerator::note_batch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchInfo {
    /// Epoch of the batch.
    pub epoch: u64,
    /// Index of the batch in this rank's epoch (0-based).
    pub step: usize,
    /// Batches this rank yields per epoch.
    pub num_batches: usize,
    /// Whether this is the last batch of the epoch on this rank (end of loader: gradients sync here).
    pub is_last: bool,
    /// Rows of this rank's batch.
    pub rows: usize,
    /// Trailing rows of this rank's batch that are `even_batches` duplicates.
    pub padding: usize,
    /// Trailing rows of the whole global step (all ranks concatenated in rank order) that are duplicates: what
    /// `gather_for_metrics` trims so exactly `len(dataset)` rows come back over the epoch.
    pub global_padding: usize,
}

/// A callback told about every yielded batch, on the thread that iterates.
pub type BatchObserver = Arc<dyn Fn(&BatchInfo) + Send + Sync>;

#[derive(Debug, Default)]
struct PositionState {
    position: LoaderPosition,
    /// Batches the next iteration skips (set by `skip_first_batches` or by loading a checkpoint).
    pending_skip: Option<usize>,
}

/// Batches of a data set for this rank. See the module documentation.
pub struct DataLoader<D> {
    dataset: Arc<D>,
    cfg: DataLoaderConfig,
    rank: usize,
    world_size: usize,
    device: Device,
    state: Arc<Mutex<PositionState>>,
    observer: Option<BatchObserver>,
}

impl<D> std::fmt::Debug for DataLoader<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("config", &self.cfg)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device)
            .field("position", &lock(&self.state).position)
            .finish()
    }
}

impl<D: Dataset> DataLoader<D> {
    /// A loader over `dataset` for a single process (rank 0 of 1) on the CPU.
    /// `Accelerator::prepare_data_loader` shards it and moves its batches to the Accelerator's device.
    pub fn new(dataset: D, cfg: DataLoaderConfig) -> Self {
        Self::from_arc(Arc::new(dataset), cfg)
    }

    /// Like [`DataLoader::new`] for a data set shared with other loaders.
    pub fn from_arc(dataset: Arc<D>, cfg: DataLoaderConfig) -> Self {
        DataLoader {
            dataset,
            cfg,
            rank: 0,
            world_size: 1,
            device: Device::Cpu,
            state: Arc::new(Mutex::new(PositionState::default())),
            observer: None,
        }
    }

    /// Shards the loader for `rank` of `world_size`.
    ///
    /// Errors: batch size 0, rank out of range, or (with `split_batches`) a batch size not divisible by
    /// `world_size`.
    pub fn with_sharding(mut self, rank: usize, world_size: usize) -> Result<Self> {
        self.rank = rank;
        self.world_size = world_size;
        self.spec().validate()?;
        Ok(self)
    }

    /// Sets `split_batches` (validated by the next [`DataLoader::with_sharding`] or at iteration).
    pub fn with_split_batches(mut self, split_batches: bool) -> Self {
        self.cfg.split_batches = split_batches;
        self
    }

    /// Sets `even_batches`.
    pub fn with_even_batches(mut self, even_batches: bool) -> Self {
        self.cfg.even_batches = even_batches;
        self
    }

    /// Batches are moved to `device` (on the prefetch thread when prefetching).
    pub fn with_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Calls `observer` for every yielded batch (replaces any previous one). The Accelerator uses it to learn
    /// about the end of the loader and the padding rows.
    pub fn with_batch_observer(mut self, observer: BatchObserver) -> Self {
        self.observer = Some(observer);
        self
    }

    /// The data set.
    pub fn dataset(&self) -> &Arc<D> {
        &self.dataset
    }

    /// The configuration.
    pub fn config(&self) -> &DataLoaderConfig {
        &self.cfg
    }

    /// This loader's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks the data is sharded over.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The device batches are delivered on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The sharding layout of this rank.
    pub fn spec(&self) -> ShardSpec {
        ShardSpec {
            dataset_len: self.dataset.len(),
            batch_size: self.cfg.batch_size,
            world_size: self.world_size,
            rank: self.rank,
            split_batches: self.cfg.split_batches,
            even_batches: self.cfg.even_batches,
            drop_last: self.cfg.drop_last,
        }
    }

    /// Batches this rank yields per full epoch.
    pub fn len(&self) -> usize {
        self.spec().num_batches()
    }

    /// Whether an epoch yields no batch on this rank.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows per global step over all ranks (`batch_size × world_size`, or `batch_size` with `split_batches`).
    pub fn total_batch_size(&self) -> usize {
        self.spec().global_batch_size()
    }

    /// Samples in the data set.
    pub fn dataset_len(&self) -> usize {
        self.dataset.len()
    }

    /// The epoch the next iteration yields.
    pub fn epoch(&self) -> u64 {
        lock(&self.state).position.epoch
    }

    /// Sets the epoch of the next iteration (its shuffle order). Setting a different epoch than the current one
    /// cancels a pending [`DataLoader::skip_first_batches`]; setting the same one keeps it, so a resumed loop
    /// `for e in loader.epoch()..epochs { loader.set_epoch(e); .. }` skips what the checkpoint had consumed.
    pub fn set_epoch(&mut self, epoch: u64) {
        let mut st = lock(&self.state);
        if st.position.epoch != epoch {
            st.pending_skip = None;
            st.position = LoaderPosition { epoch, batches_consumed: 0 };
        }
    }

    /// The next iteration starts at batch `n` of its epoch (replacing any earlier request): mid-epoch resume.
    /// Skipped batches are not loaded. Skipping past the end yields an empty epoch.
    pub fn skip_first_batches(&mut self, n: usize) {
        lock(&self.state).pending_skip = Some(n);
    }

    /// Current position (epoch, batches consumed).
    pub fn position(&self) -> LoaderPosition {
        lock(&self.state).position
    }

    /// A handle to the position that implements [`Stateful`], shared with this loader (and its clones made by
    /// `Accelerator::prepare_data_loader`): what `save_state` writes to `data_loader_{i}.json`.
    pub fn state_handle(&self) -> LoaderStateHandle {
        LoaderStateHandle { state: Arc::clone(&self.state), layout: LoaderLayout::of(self), announce: true }
    }

    /// The sample order of `epoch` over the whole data set (before sharding): `0..N`, or the seeded shuffle.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        epoch_order(self.dataset.len(), self.cfg.shuffle, self.cfg.seed, epoch)
    }
}

impl<D: Dataset + 'static> DataLoader<D> {
    /// Iterates the batches of the current epoch on this rank, starting after any pending skip.
    ///
    /// Each item is a [`Batch`] on the loader's device, or the error of building it (after which the iteration
    /// ends). Finishing the epoch advances the loader to the next one.
    pub fn iter(&self) -> DataLoaderIter<D> {
        let spec = self.spec();
        let (epoch, skip) = {
            let mut st = lock(&self.state);
            let skip = st.pending_skip.take().unwrap_or(0);
            st.position.batches_consumed = skip.min(spec.num_batches());
            (st.position.epoch, skip)
        };
        let mut it = DataLoaderIter {
            epoch,
            next_step: skip,
            num_batches: spec.num_batches(),
            finished: false,
            source: Source::Failed(None),
            state: Arc::clone(&self.state),
            observer: self.observer.clone(),
        };
        if let Err(e) = spec.validate() {
            it.source = Source::Failed(Some(e));
            return it;
        }
        let order = Arc::new(self.epoch_order(epoch));
        let producer = Producer { dataset: Arc::clone(&self.dataset), spec, order, device: self.device.clone() };
        it.source = if self.cfg.prefetch && skip < it.num_batches {
            let (tx, rx) = sync_channel(0);
            let worker = std::thread::Builder::new().name(format!("accel-prefetch-r{}", self.rank)).spawn(move || {
                for step in skip..producer.spec.num_batches() {
                    let item = producer.produce(step);
                    let failed = item.1.is_err();
                    if tx.send(item).is_err() || failed {
                        break;
                    }
                }
            });
            match worker {
                Ok(handle) => Source::Prefetch { rx: Some(rx), worker: Some(handle) },
                Err(e) => Source::Failed(Some(AccelError::io("spawning the data-loader prefetch thread", e))),
            }
        } else {
            Source::Inline(producer)
        };
        it
    }
}

impl<D: Dataset + 'static> IntoIterator for &DataLoader<D> {
    type Item = Result<Batch>;
    type IntoIter = DataLoaderIter<D>;
    fn into_iter(self) -> DataLoaderIter<D> {
        self.iter()
    }
}

/// `0..n`, or its Fisher–Yates shuffle with `ChaCha8Rng::seed_from_u64(seed + epoch)`: ddp-core's
/// [`ddp_core::sampler::epoch_permutation`], the same order as its `DistributedSampler`.
pub fn epoch_order(n: usize, shuffle: bool, seed: u64, epoch: u64) -> Vec<usize> {
    if shuffle {
        ddp_core::sampler::epoch_permutation(n, seed, epoch)
    } else {
        (0..n).collect()
    }
}

/// Builds batch `step` of an epoch (on whichever thread runs it).
struct Producer<D> {
    dataset: Arc<D>,
    spec: ShardSpec,
    order: Arc<Vec<usize>>,
    device: Device,
}

impl<D: Dataset> Producer<D> {
    fn produce(&self, step: usize) -> (Option<ShardBatch>, Result<Batch>) {
        let Some(sb) = self.spec.batch(&self.order, step) else {
            return (None, Err(AccelError::Data(format!("data loader: batch {step} is past the end of the epoch"))));
        };
        let batch = self.dataset.get_batch(&sb.indices).and_then(|b| b.to_device(&self.device));
        (Some(sb), batch)
    }
}

enum Source<D> {
    Inline(Producer<D>),
    Prefetch {
        rx: Option<Receiver<(Option<ShardBatch>, Result<Batch>)>>,
        worker: Option<JoinHandle<()>>,
    },
    /// Nothing to produce; the error (if any) is yielded once.
    Failed(Option<AccelError>),
}

/// The iterator of [`DataLoader::iter`].
pub struct DataLoaderIter<D> {
    epoch: u64,
    next_step: usize,
    num_batches: usize,
    finished: bool,
    source: Source<D>,
    state: Arc<Mutex<PositionState>>,
    observer: Option<BatchObserver>,
}

impl<D: Dataset> Iterator for DataLoaderIter<D> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if self.finished {
            return None;
        }
        if let Source::Failed(err) = &mut self.source {
            self.finished = true;
            return err.take().map(Err);
        }
        if self.next_step >= self.num_batches {
            self.finished = true;
            self.stop_worker();
            return None;
        }
        let step = self.next_step;
        let (sb, batch) = match &mut self.source {
            Source::Inline(p) => p.produce(step),
            Source::Prefetch { rx, .. } => match rx.as_ref().map(|rx| rx.recv()) {
                Some(Ok(item)) => item,
                _ => (None, Err(AccelError::Data("data loader: the prefetch thread stopped unexpectedly".into()))),
            },
            Source::Failed(_) => unreachable!("handled above"),
        };
        let (sb, batch) = match (sb, batch) {
            (Some(sb), Ok(batch)) => (sb, batch),
            (_, Err(e)) => {
                self.finished = true;
                self.stop_worker();
                return Some(Err(e));
            }
            (None, Ok(_)) => unreachable!("a batch is only produced for a step inside the epoch"),
        };
        self.next_step += 1;
        {
            let mut st = lock(&self.state);
            st.position = if sb.is_last {
                LoaderPosition { epoch: self.epoch + 1, batches_consumed: 0 }
            } else {
                LoaderPosition { epoch: self.epoch, batches_consumed: step + 1 }
            };
        }
        if let Some(obs) = &self.observer {
            obs(&BatchInfo {
                epoch: self.epoch,
                step,
                num_batches: self.num_batches,
                is_last: sb.is_last,
                rows: sb.indices.len(),
                padding: sb.padding,
                global_padding: sb.global_padding,
            });
        }
        Some(Ok(batch))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = if self.finished { 0 } else { self.num_batches.saturating_sub(self.next_step) };
        (0, Some(left))
    }
}

impl<D> DataLoaderIter<D> {
    /// Hangs up on the prefetch thread and waits for it (it finishes at most the batch it is building).
    fn stop_worker(&mut self) {
        if let Source::Prefetch { rx, worker } = &mut self.source {
            drop(rx.take());
            if let Some(handle) = worker.take() {
                let _ = handle.join();
            }
        }
    }
}

impl<D> Drop for DataLoaderIter<D> {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

/// The layout a saved position is only valid for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct LoaderLayout {
    dataset_len: usize,
    total_batch_size: usize,
    num_batches: usize,
    shuffle: bool,
    seed: u64,
    /// Micro-batches per optimizer step of the Accelerator that prepared the loader (1 for a loader of its own,
    /// and in checkpoints written before it was recorded): with `total_batch_size`, the global batch.
    #[serde(default = "one")]
    accumulation: usize,
}

fn one() -> usize {
    1
}

impl LoaderLayout {
    fn of<D: Dataset>(l: &DataLoader<D>) -> Self {
        LoaderLayout {
            dataset_len: l.dataset_len(),
            total_batch_size: l.total_batch_size(),
            num_batches: l.len(),
            shuffle: l.cfg.shuffle,
            seed: l.cfg.seed,
            accumulation: 1,
        }
    }

    /// Samples of one optimizer step over all processes.
    fn global_batch(&self) -> usize {
        self.total_batch_size * self.accumulation
    }
}

/// The [`Stateful`] position of a [`DataLoader`] (shared with it): epoch and batches consumed, plus the layout
/// they are valid for. Loading it makes the loader's next iteration resume after the consumed batches.
#[derive(Debug, Clone)]
pub struct LoaderStateHandle {
    state: Arc<Mutex<PositionState>>,
    layout: LoaderLayout,
    /// Whether this process says what a resume changes (the main process; every rank loads the same position).
    announce: bool,
}

impl LoaderStateHandle {
    /// The handle of a loader prepared by an Accelerator that accumulates `accumulation` micro-batches per
    /// optimizer step; `announce` on its main process only.
    pub(crate) fn for_accelerator(mut self, accumulation: usize, announce: bool) -> Self {
        self.layout.accumulation = accumulation;
        self.announce = announce;
        self
    }

    /// The loader's current position.
    pub fn position(&self) -> LoaderPosition {
        lock(&self.state).position
    }
}

impl Stateful for LoaderStateHandle {
    fn state_dict(&self) -> Result<StateDict> {
        let pos = self.position();
        Ok(StateDict::from_meta(serde_json::json!({
            "epoch": pos.epoch,
            "batches_consumed": pos.batches_consumed,
            "layout": self.layout,
        })))
    }

    fn load_state_dict(&mut self, sd: &StateDict) -> Result<()> {
        let epoch: u64 = sd.meta_field("epoch")?;
        let batches_consumed: usize = sd.meta_field("batches_consumed")?;
        let layout: LoaderLayout = sd.meta_field("layout")?;
        let (saved, here) = (&layout, &self.layout);
        let same_data = (saved.dataset_len, saved.shuffle, saved.seed) == (here.dataset_len, here.shuffle, here.seed);
        if same_data && saved.total_batch_size != here.total_batch_size {
            // Another global batch (another per-process batch or data-parallel size): the position is a number of
            // samples of the epoch's order, which is the same; it continues here if it is a whole number of this
            // run's batches.
            let samples = batches_consumed * saved.total_batch_size;
            if samples.is_multiple_of(here.total_batch_size) && samples / here.total_batch_size <= here.num_batches {
                let batches = samples / here.total_batch_size;
                // The data goes on where it stopped. With the global batch kept (another accumulation), so do the
                // optimizer steps, which the Accelerator says; with another, they do not repeat the original's.
                if self.announce && saved.global_batch() != here.global_batch() {
                    tracing::warn!(
                        "the checkpoint's optimizer steps read {} samples over all processes, this run's read {}: \
                         the data continues at sample {samples} of epoch {epoch}, but each optimizer step now sees \
                         another global batch, so the run does not continue the original's updates (keep the \
                         global batch to continue them exactly)",
                        saved.global_batch(),
                        here.global_batch()
                    );
                }
                let mut st = lock(&self.state);
                st.position = LoaderPosition { epoch, batches_consumed: batches };
                st.pending_skip = Some(batches);
                return Ok(());
            }
            return Err(AccelError::Data(format!(
                "the saved data-loader position cannot continue here: it is {samples} samples into epoch {epoch} \
                 ({batches_consumed} batches of {} samples), which is not a whole number of this run's batches of \
                 {} samples (the per-process batch × the data-parallel size); use a global batch that divides \
                 {samples}, e.g. the saved one",
                saved.total_batch_size, here.total_batch_size
            )));
        }
        // The accumulation alone does not move the position (the micro-batches are the same).
        if (LoaderLayout { accumulation: 1, ..layout.clone() }) != (LoaderLayout { accumulation: 1, ..here.clone() }) {
            // Name what differs; the global batch first (a change of data-parallel size changes it).
            let what = if saved.dataset_len != here.dataset_len {
                format!(
                    "the data set had {} samples, this one has {}: resume with the same data set",
                    saved.dataset_len, here.dataset_len
                )
            } else if (saved.shuffle, saved.seed) != (here.shuffle, here.seed) {
                format!(
                    "the data order differs (shuffle {} seed {} then, shuffle {} seed {} now): resume with the same \
                     shuffle and seed",
                    saved.shuffle, saved.seed, here.shuffle, here.seed
                )
            } else {
                format!(
                    "the epoch had {} batches, this run's has {} (drop_last or the number of processes changed)",
                    saved.num_batches, here.num_batches
                )
            };
            return Err(AccelError::Data(format!(
                "the saved data-loader position cannot continue here, resuming would yield other batches: {what}"
            )));
        }
        let mut st = lock(&self.state);
        st.position = LoaderPosition { epoch, batches_consumed };
        st.pending_skip = Some(batches_consumed);
        Ok(())
    }
}
