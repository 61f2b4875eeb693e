//! Optimizers whose state can be saved and restored exactly, and [`AcceleratedOptimizer`], the wrapper
//! `prepare_optimizer` returns: it steps only on gradient-sync steps, unscales and skips fp16 overflow steps, and
//! copies updated fp32 master weights back into the model's compute-dtype `Var`s.
//!
//! The optimizers themselves live in ddp-core ([`ddp_core::optim`]) so that a level-1 loop uses the same ones; they
//! are re-exported here under their old paths:
//!
//! - [`Sgd`]: `torch.optim.SGD` (momentum, dampening, Nesterov momentum after Sutskever et al., "On the importance
//!   of initialization and momentum in deep learning", ICML 2013, weight decay as L2 added to the gradient).
//! - [`AdamW`]: `torch.optim.AdamW` (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019, on
//!   Adam by Kingma & Ba 2015, with bias correction).
//!
//! Their methods return [`ddp_core::DdpError`]; `?` in a function returning [`crate::Result`] turns it into
//! [`crate::AccelError`] (configuration, checkpoint and JSON errors keep their `AccelError` variant).

mod accelerated;

pub use accelerated::AcceleratedOptimizer;
pub(crate) use ddp_core::optim::map_param_tensors;
pub use ddp_core::optim::{grads_for, AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
