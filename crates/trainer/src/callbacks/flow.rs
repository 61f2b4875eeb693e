//! [`DefaultFlowCallback`]: turns the arguments' logging / evaluation / save strategies into per-step decisions,
//! exactly as HF's `DefaultFlowCallback`.

use super::{CallbackContext, TrainerCallback, TrainerControl};
use crate::args::{IntervalStrategy, SaveStrategy};
use crate::error::Result;

/// Sets `should_log` / `should_evaluate` / `should_save` every `logging_steps` / `eval_steps` / `save_steps`
/// optimizer steps (strategy "steps") or at each epoch end (strategy "epoch"), logs the first step when
/// `logging_first_step`, and stops training at `max_steps` (saving there under the "steps" save strategy).
/// Always the first callback of a trainer.
#[derive(Debug, Default, Clone)]
pub struct DefaultFlowCallback;

impl TrainerCallback for DefaultFlowCallback {
    fn on_step_end(&mut self, ctx: &CallbackContext, control: &mut TrainerControl) -> Result<()> {
        let (args, state) = (ctx.args, ctx.state);
        let step = state.global_step;
        if step == 1 && args.logging_first_step {
            control.should_log = true;
        }
        if args.logging_strategy == IntervalStrategy::Steps
            && state.logging_steps > 0
            && step % state.logging_steps == 0
        {
            control.should_log = true;
        }
        if args.eval_strategy == IntervalStrategy::Steps && state.eval_steps > 0 && step % state.eval_steps == 0 {
            control.should_evaluate = true;
        }
        if args.save_strategy == SaveStrategy::Steps && state.save_steps > 0 && step % state.save_steps == 0 {
            control.should_save = true;
        }
        if step >= state.max_steps {
            control.should_training_stop = true;
            if args.save_strategy == SaveStrategy::Steps {
                control.should_save = true;
            }
        }
        Ok(())
    }

    fn on_epoch_end(&mut self, ctx: &CallbackContext, control: &mut TrainerControl) -> Result<()> {
        let args = ctx.args;
        if args.logging_strategy == IntervalStrategy::Epoch {
            control.should_log = true;
        }
        if args.eval_strategy == IntervalStrategy::Epoch {
            control.should_evaluate = true;
        }
        if args.save_strategy == SaveStrategy::Epoch {
            control.should_save = true;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::TrainingArguments;
    use crate::state::TrainerState;

    #[test]
    fn steps_strategies_fire_on_multiples_and_at_max_steps() {
        let args = TrainingArguments {
            eval_strategy: IntervalStrategy::Steps,
            logging_first_step: true,
            ..Default::default()
        };
        let mut state =
            TrainerState { max_steps: 10, logging_steps: 2, eval_steps: 3, save_steps: 4, ..Default::default() };
        let mut fired = Vec::new();
        for step in 1..=10 {
            state.global_step = step;
            let mut c = TrainerControl::default();
            let ctx = CallbackContext { args: &args, state: &state, rank: 0, world_size: 1 };
            DefaultFlowCallback.on_step_end(&ctx, &mut c).unwrap();
            fired.push((c.should_log, c.should_evaluate, c.should_save, c.should_training_stop));
        }
        let logs: Vec<u64> = (1..=10).filter(|s| fired[*s as usize - 1].0).collect();
        let evals: Vec<u64> = (1..=10).filter(|s| fired[*s as usize - 1].1).collect();
        let saves: Vec<u64> = (1..=10).filter(|s| fired[*s as usize - 1].2).collect();
        assert_eq!(logs, vec![1, 2, 4, 6, 8, 10]);
        assert_eq!(evals, vec![3, 6, 9]);
        assert_eq!(saves, vec![4, 8, 10]);
        assert!(fired[9].3 && !fired[8].3);
    }
}
