//! Models written the candle way, laid out by a plan: candle's builder vocabulary (`VarBuilder`, `pp`, `get`,
//! `linear`, `embedding`, `layer_norm`, `rms_norm`) over accel's seeded, tensor-parallel parameters, and layers
//! that are candle `Module`s.
//!
//! Porting a candle model is changing the builder's type, not its calls: import the builder and the layer
//! constructors from `accel::nn` instead of `candle_nn`, and take the builder from
//! [`crate::Accelerator::builder`] with a [`crate::plan::ParallelPlan`]. The model's code is the same at every
//! layout; the plan decides which linear layers are split column-wise or row-wise:
//!
//! ```diff
//! -use candle_nn::{linear_no_bias, rms_norm, Linear, Module, RmsNorm, VarBuilder};
//! +use accel::nn::{linear_no_bias, rms_norm, Linear, Module, RmsNorm, VarBuilder};
//! ```
//!
//! The model below is written once; the test builds it at tp = 1, 2 and 4 ([`crate::plan`] for the styles):
//!
//! ```
//! use accel::nn::{linear_no_bias, rms_norm, Linear, Module, RmsNorm, VarBuilder};
//! use candle_core::{Result, Tensor};
//!
//! /// A bias-free SwiGLU MLP (Shazeer 2020; Llama's): `down(silu(gate(x)) · up(x))` after an RMS norm.
//! struct SwiGlu {
//!     norm: RmsNorm,
//!     gate: Linear,
//!     up: Linear,
//!     down: Linear,
//! }
//!
//! impl SwiGlu {
//!     fn new(d: usize, hidden: usize, vb: VarBuilder) -> Result<Self> {
//!         Ok(SwiGlu {
//!             norm: rms_norm(d, 1e-6, vb.pp("norm"))?,
//!             gate: linear_no_bias(d, hidden, vb.pp("gate_proj"))?,
//!             up: linear_no_bias(d, hidden, vb.pp("up_proj"))?,
//!             down: linear_no_bias(hidden, d, vb.pp("down_proj"))?,
//!         })
//!     }
//! }
//!
//! impl Module for SwiGlu {
//!     fn forward(&self, x: &Tensor) -> Result<Tensor> {
//!         let h = self.norm.forward(x)?;
//!         let h = (candle_nn::ops::silu(&self.gate.forward(&h)?)? * self.up.forward(&h)?)?;
//!         x + self.down.forward(&h)?
//!     }
//! }
//!
//! # fn main() -> anyhow::Result<()> {
//! use accel::plan::{ParallelPlan, ParallelStyle};
//! use accel::{Accelerator, AcceleratorConfig};
//! let plan = ParallelPlan::new()
//!     .with("mlp.gate_proj", ParallelStyle::Colwise)
//!     .with("mlp.up_proj", ParallelStyle::Colwise)
//!     .with("mlp.down_proj", ParallelStyle::Rowwise);
//! let acc = Accelerator::new(AcceleratorConfig::default().with_seed(0))?;
//! let varmap = candle_nn::VarMap::new();
//! let mlp = SwiGlu::new(16, 64, acc.builder(&varmap, plan).pp("mlp"))?;
//! let prepared = acc.prepare_model(&varmap)?;
//! let y = mlp.forward(&Tensor::ones((2, 16), candle_core::DType::F32, acc.device())?)?;
//! assert_eq!(y.dims(), &[2, 16]);
//! assert_eq!(prepared.names().len(), 4);
//! # Ok(())
//! # }
//! ```
//!
//! What each layer draws (on the full shape, from the run's seed per parameter name, so every layout starts from
//! the single-process weights) and how each style splits it is documented on the constructor. A model written
//! with candle's own `VarBuilder` ([`crate::Accelerator::var_builder`]) is seeded the same way and trains under
//! DDP, ZeRO-1 and ZeRO-2; `prepare_model` refuses it at tp > 1, pp > 1 and FULL_SHARD, naming this builder.
//!
//! The layers hold their parameters as handles: under FULL_SHARD `prepare_model` empties them and each forward
//! gathers what it uses from the prepared model; a block built with [`unit`] is gathered and freed as a whole,
//! recomputed under activation checkpointing, and the next one prefetched — the model's code does none of it.
//!
//! A model declared as its blocks ([`staged`]: an input part, `n` blocks, an output part) is cut into pipeline
//! stages by the Accelerator, each rank building only its stages' parts; every schedule runs it unchanged.
//!
//! [`describe`] runs a model's constructor on a builder that records instead of allocating: its parameters'
//! names, shapes, splits and parts, which the automatic layout reads the model's shape from
//! ([`crate::auto_layout::ModelSpec::of_model`]).

mod activations;
mod builder;
mod describe;
mod layers;
mod provenance;
mod staged;
mod unit;

pub use crate::tensor_parallel::{InitialWeights, ShardedDim};
pub use accel_nn::ops::linear::Activation;
pub use activations::ActivationSpec;
pub use builder::{LayerKind, PlannedLayer, SharedStagedModel, VarBuilder};
pub use candle_core::{Module, ModuleT};
pub use candle_nn::{Init, LayerNormConfig};
pub use describe::{describe, ModelPart, ModelShape, ShapedParam};
pub use layers::{
    dropout, embedding, embedding_init, layer_norm, layer_norm_no_bias, linear, linear_b, linear_init, linear_no_bias,
    rms_norm, Dropout, Embedding, LayerNorm, Linear, LinearInit, RmsNorm,
};
pub use provenance::seeded_var_builder;
pub(crate) use provenance::{recorded_var_builder, Provenance, Target};
pub use staged::{staged, Staged};
pub use unit::{unit, Unit};
