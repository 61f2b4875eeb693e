//! One integration-test binary for the crate (each test binary links candle: one link instead of one per file).

mod accumulation;
mod auto_layout;
mod checkpoint;
mod data_loader;
mod describe;
mod equivalence;
mod gather;
mod llama;
mod logging;
mod mixed_precision;
mod optim;
mod overlap;
mod parallelism;
mod pipeline;
mod plan;
mod ranks;
mod resume;
mod sharded;
mod tensor_parallel;
mod tensorboard;
mod trackers;
