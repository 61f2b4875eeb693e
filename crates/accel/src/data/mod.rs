//! Data sets and loaders.
//!
//! - [`Dataset`], [`Batch`], [`TensorDataset`]: random-access data, batched; in-memory tensors.
//! - Readers for the formats users have: [`idx`] (MNIST, gzip too) with [`load_mnist`], [`csv`] (numeric
//!   columns), [`text`] (character-level language modelling).
//! - [`DataLoader`]: batching, seeded shuffle per epoch, per-rank sharding ([`sharding`]: Accelerate's rules for
//!   `split_batches`, `even_batches`, `drop_last`), prefetch on a worker thread, `skip_first_batches` and a
//!   [`Stateful`](crate::state::Stateful) position for mid-epoch resume.

pub mod csv;
mod dataset;
pub mod idx;
mod loader;
mod mnist;
pub mod sharding;
pub mod text;
mod tokens;

pub use csv::{read_csv, CsvOptions, LabelColumn, LabelKind};
pub use dataset::{Batch, Dataset, TensorDataset};
pub use loader::{
    epoch_order, BatchInfo, BatchObserver, DataLoader, DataLoaderConfig, DataLoaderIter, LoaderPosition,
    LoaderStateHandle,
};
pub use mnist::{load_mnist, MNIST_CLASSES, MNIST_PIXELS};
pub use sharding::{ShardBatch, ShardSpec};
pub use text::{CharVocab, TextDataset};
pub use tokens::TokenDataset;
