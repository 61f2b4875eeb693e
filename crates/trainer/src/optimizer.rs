//! [`TrainerOptimizer`]: the optimizer chosen by `TrainingArguments.optim`, as one concrete type the Accelerator
//! can wrap.

use accel::optim::{AdamW, AdamWConfig, NnError, Optimizer, Sgd, SgdConfig};
use accel::state::StateDict;
use candle_core::{Tensor, Var};

use crate::args::{OptimizerKind, TrainingArguments};
use crate::error::Result;

/// AdamW or SGD, configured from the training arguments (`learning_rate`, `weight_decay`, `adam_beta1/2`,
/// `adam_epsilon`, `sgd_momentum`).
#[derive(Debug)]
pub enum TrainerOptimizer {
    /// `torch.optim.AdamW` (Loshchilov & Hutter 2019).
    AdamW(AdamW),
    /// `torch.optim.SGD`.
    Sgd(Sgd),
}

impl TrainerOptimizer {
    /// The optimizer `args.optim` names, with the arguments' hyper-parameters.
    pub fn from_args(args: &TrainingArguments) -> Result<Self> {
        Ok(match args.optim {
            OptimizerKind::AdamW => TrainerOptimizer::AdamW(AdamW::new(AdamWConfig {
                lr: args.learning_rate,
                beta1: args.adam_beta1,
                beta2: args.adam_beta2,
                eps: args.adam_epsilon,
                weight_decay: args.weight_decay,
            })?),
            OptimizerKind::Sgd => TrainerOptimizer::Sgd(Sgd::new(SgdConfig {
                lr: args.learning_rate,
                momentum: args.sgd_momentum,
                dampening: 0.0,
                weight_decay: args.weight_decay,
                nesterov: false,
            })?),
        })
    }

    fn inner(&self) -> &dyn Optimizer {
        match self {
            TrainerOptimizer::AdamW(o) => o,
            TrainerOptimizer::Sgd(o) => o,
        }
    }

    fn inner_mut(&mut self) -> &mut dyn Optimizer {
        match self {
            TrainerOptimizer::AdamW(o) => o,
            TrainerOptimizer::Sgd(o) => o,
        }
    }
}

impl Optimizer for TrainerOptimizer {
    fn step(&mut self, params: &[Var], grads: &[Option<Tensor>]) -> std::result::Result<(), NnError> {
        self.inner_mut().step(params, grads)
    }
    fn learning_rate(&self) -> f64 {
        self.inner().learning_rate()
    }
    fn set_learning_rate(&mut self, lr: f64) {
        self.inner_mut().set_learning_rate(lr)
    }
    fn state_dict(&self) -> std::result::Result<StateDict, NnError> {
        self.inner().state_dict()
    }
    fn load_state_dict(&mut self, sd: &StateDict) -> std::result::Result<(), NnError> {
        self.inner_mut().load_state_dict(sd)
    }
}
