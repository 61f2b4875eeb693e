//! Optimizers whose state can be saved and restored exactly, and [`AcceleratedOptimizer`], the wrapper
//! `prepare_optimizer` returns: it steps only on gradient-sync steps, unscales and skips fp16 overflow steps, and
//! copies updated fp32 master weights back into the model's compute-dtype `Var`s.
//!
//! The optimizers themselves live in accel-nn ([`accel_nn::optim`]) so that a level-1 loop uses the same ones;
//! they are re-exported here:
//!
//! - [`Sgd`]: `torch.optim.SGD` (momentum, dampening, Nesterov momentum after Sutskever et al., "On the importance
//!   of initialization and momentum in deep learning", ICML 2013, weight decay as L2 added to the gradient).
//! - [`AdamW`]: `torch.optim.AdamW` (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019, on
//!   Adam by Kingma & Ba 2015, with bias correction).
//!
//! Their methods return [`accel_nn::NnError`]; `?` in a function returning [`crate::Result`] turns it into the
//! [`crate::AccelError`] variant of the same name.

mod accelerated;

pub use accel_nn::optim::{grads_for, AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
/// The error the optimizers' methods return (what an [`Optimizer`] implemented outside accel-rs returns too).
pub use accel_nn::NnError;
pub use accelerated::AcceleratedOptimizer;
