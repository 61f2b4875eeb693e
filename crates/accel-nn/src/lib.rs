//! # accel-nn — the computation under every level of accel-rs
//!
//! What `torch.nn.functional` + `torch.optim` + `torch.save` give a PyTorch user, for candle, with no
//! communication at all (that is `ddp-core`'s):
//!
//! - [`ops`]: fused training ops with their own backward pass (linear + ReLU, causal self-attention, softmax,
//!   layer norm, GELU, cross entropy): candle custom ops on CPU f32, candle's composed ops elsewhere.
//! - [`optim`]: [`AdamW`] and [`Sgd`] (as `torch.optim`'s) with state that [`StateDict`] saves and restores
//!   exactly; the same optimizers every level steps (a level-1 loop after `DistributedDataParallel`, the
//!   Accelerator through its `AcceleratedOptimizer`, the Trainer through the Accelerator).
//! - [`state`]: [`StateDict`] (named tensors + JSON metadata), safetensors files and atomic writes — the unit of
//!   accel's checkpoints.
//!
//! Invariant: accel-nn depends on candle and small libraries only; it knows nothing of processes, ranks or any
//! other accel-rs crate.
//!
//! ```
//! use accel_nn::{AdamW, AdamWConfig, Optimizer};
//! use candle_core::{Device, Tensor, Var};
//! let w = Var::from_tensor(&Tensor::ones(4, candle_core::DType::F32, &Device::Cpu)?)?;
//! let loss = accel_nn::ops::cross_entropy::cross_entropy(
//!     &w.as_tensor().unsqueeze(0)?,
//!     &Tensor::new(&[2u32], &Device::Cpu)?,
//! )?;
//! let grads = loss.backward()?;
//! let mut opt = AdamW::new(AdamWConfig::new(1e-2))?;
//! opt.step(&[w.clone()], &accel_nn::optim::grads_for(&[w], &grads))?;
//! # Ok::<(), accel_nn::NnError>(())
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod error;
pub mod ops;
pub mod optim;
pub mod state;

pub use error::{NnError, Result};
pub use optim::{AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
pub use state::StateDict;

// Optimizers move into threads with the models they step (checked at compile time, tokio-style).
#[allow(dead_code)]
const _: () = {
    fn assert_send_sync<T: Send + Sync>() {}
    fn check() {
        assert_send_sync::<NnError>();
        assert_send_sync::<AdamW>();
        assert_send_sync::<Sgd>();
        assert_send_sync::<StateDict>();
    }
};
