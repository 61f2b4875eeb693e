//! Resuming a checkpoint: its compatibility with this run's layout checked, everything restored, what differs from the
//! original run said once, and where in the data to go on.

use super::*;

impl<M, D> Trainer<M, D>
where
    M: ModuleT + 'static,
    D: Dataset + 'static,
{
    /// Verifies and loads the checkpoint `spec` names (every rank agreeing), restores the trainer's state from it,
    /// and says where training goes on; a run that had already ended trains no further.
    ///
    /// The checkpoint may come from another layout (number of processes, per-device batch, accumulation, tp/pp
    /// sizes) with the same global batch and steps per epoch ([`checkpoint::check_compatible`]): its global step is
    /// then the same place in the data, the weights and optimizer state are whole tensors, the loss tallies are
    /// shared out over this run's ranks ([`restored_tally`]), and the Accelerator derives each rank's RNG.
    pub(super) fn resume(&mut self, rt: &mut Runtime<M, D>, plan: &StepPlan, spec: &str) -> Result<StartPoint> {
        let dir = checkpoint::resolve_resume(spec, &self.args.output_dir)?;
        let saved = TrainerState::load_from_json(&dir.join(TRAINER_STATE_NAME))?;
        // Every rank decides alike (the same state, the same layout), unless the ranks' epochs differ
        // (even_batches off): then all stop together.
        agree(&rt.acc, checkpoint::check_compatible(&dir, &saved, &plan.layout()), "checking the checkpoint")?;
        agree(&rt.acc, checkpoint::verify_checksums(&dir), "verifying the checkpoint")?;
        let mut epochs_trained = saved.global_step / plan.upe;
        let skip_micro = ((saved.global_step % plan.upe) as usize) * plan.ga;
        // At another micro-batch (the global batch checked above) the loader takes its position in samples.
        let loaded = rt.acc.load_state(Some(&dir)).map(drop).map_err(TrainerError::from);
        agree(&rt.acc, loaded, "loading the checkpoint")?;
        self.restore_state(rt, &dir, &saved)?;
        let since_log = restored_tally(&saved, &rt.acc).map(|t| LossTally::restored(&t)).unwrap_or_default();
        // From here the state describes this run's layout: its tallies are this layout's (one all-reduce).
        self.state.loss_tally = since_log.gather(&rt.acc)?;
        self.state.model_parallel_size = Some(rt.acc.mesh().model_parallel().world_size() as u64);
        if let Some(why) = already_ended(&saved, plan.max_steps) {
            // Training on would only move past where the original run stopped (and rotate its checkpoints).
            rt.acc.print(format!(
                "Training already ended at global step {} of {} ({why}); not training further, running the \
                 final steps only (no checkpoint is written or deleted)",
                saved.global_step,
                dir.display()
            ));
            epochs_trained = plan.num_epochs;
        } else {
            self.note_layout_change(rt, plan, &saved);
            rt.acc.print(format!(
                "Resuming from {} at global step {}: {epochs_trained} epoch(s) done, skipping the first \
                 {skip_micro} micro-batch(es) of epoch {}",
                dir.display(),
                saved.global_step,
                epochs_trained + 1
            ));
        }
        Ok(StartPoint { epochs_trained, skip_micro, since_log })
    }

    /// Says (once) that the checkpoint was written at another layout, and what of the run is not the same then.
    pub(super) fn note_layout_change(&self, rt: &Runtime<M, D>, plan: &StepPlan, saved: &TrainerState) {
        let here = (plan.world as u64, plan.dp as u64, plan.ga as u64);
        let there = (
            saved.world_size.unwrap_or(here.0),
            saved.data_parallel_size.unwrap_or(here.1),
            saved.gradient_accumulation_steps.unwrap_or(here.2),
        );
        if here == there {
            return;
        }
        let processes = |n: u64| if n == 1 { "1 process".to_string() } else { format!("{n} processes") };
        let mut note = format!(
            "The checkpoint was written by {} ({} data parallel, gradient_accumulation_steps {}), this run has {} ({} \
             data parallel, gradient_accumulation_steps {}); the global batch is the same ({} samples per optimizer \
             step), so its global step is the same place in the data",
            processes(there.0),
            there.1,
            there.2,
            processes(here.0),
            here.1,
            here.2,
            plan.layout().global_batch()
        );
        if there.2 != here.2 {
            // Another micro-batch of all processes (the global batch ÷ GA): the Accelerator addresses dropout masks
            // by micro-step and row in it.
            note.push_str(
                ". The micro-batches are cut differently: a model with dropout draws other masks than the original run",
            );
        }
        // even_batches pads each epoch's last micro-batch on several processes (Accelerate's rule; one process is
        // not padded): the epoch's last step repeats other samples when the padding differs.
        let global = plan.layout().global_batch();
        let n = self.train_dataset.len() as u64;
        let pads = rt.acc.config().even_batches && !self.args.dataloader_drop_last;
        let padding = |dp: u64, ga: u64| {
            let micro = global / ga.max(1);
            if pads && dp > 1 && micro > 0 {
                n.div_ceil(micro) * micro - n
            } else {
                0
            }
        };
        let (padding_there, padding_here) = (padding(there.1, there.2), padding(here.1, here.2));
        if padding_there != padding_here {
            note.push_str(&format!(
                ". The last step of each epoch trains on {padding_here} repeated sample(s) here, {padding_there} in the \
                 original run (even_batches pads the epoch's last micro-batch on several processes; the data set is \
                 not a multiple of it)"
            ));
        }
        if !self.args.average_tokens_across_devices && there.1 != here.1 && !self.loss.items_fixed_per_row() {
            note.push_str(
                ". average_tokens_across_devices is false: each process normalises the loss by its own item count, so \
                 the updates depend on how many processes share the batch",
            );
        }
        rt.acc.print(note);
    }

    /// Takes over a checkpoint's trainer state (step, history, best model, callbacks' states) and counts it and
    /// its recorded best as this run's own checkpoints.
    pub(super) fn restore_state(&mut self, rt: &mut Runtime<M, D>, dir: &Path, saved: &TrainerState) -> Result<()> {
        self.own_checkpoints.insert(dir.to_path_buf());
        if let Some(best) = &saved.best_model_checkpoint {
            self.own_checkpoints.insert(PathBuf::from(best));
        }
        self.state.stateful_callbacks = saved.stateful_callbacks.clone();
        self.state.global_step = saved.global_step;
        self.state.epoch = saved.epoch;
        self.state.log_history = saved.log_history.clone();
        self.state.best_metric = saved.best_metric;
        self.state.best_global_step = saved.best_global_step;
        self.state.best_model_checkpoint = saved.best_model_checkpoint.clone();
        self.state.num_input_tokens_seen = saved.num_input_tokens_seen;
        rt.callbacks.load_states(&saved.stateful_callbacks)?;
        Ok(())
    }
}

/// Where training starts: epochs already done, micro-batches of the next epoch to skip, the restored loss tally
/// (all zero for a fresh run).
#[derive(Default)]
pub(super) struct StartPoint {
    pub(super) epochs_trained: u64,
    pub(super) skip_micro: usize,
    pub(super) since_log: LossTally,
}

/// This rank's training-loss tally from a checkpoint's: its own, by rank, when the saving run had this layout
/// (the sums continue bit for bit); otherwise the saved run's totals shared out for this layout — each replica's
/// sums counted once (÷ the saved pp × tp), then spread so that this run's ranks add up to them × its pp × tp, the
/// weight its own steps' tallies carry (the train loss is Σ sums ÷ Σ items over all ranks).
pub(super) fn restored_tally(saved: &TrainerState, acc: &Accelerator) -> Option<LossTallyState> {
    let (world, here) = (acc.world_size(), acc.mesh().model_parallel().world_size() as f64);
    let same_layout = saved.loss_tally.len() == world
        && saved.model_parallel_size.is_none_or(|r| r as f64 == here)
        && saved.world_size.is_none_or(|w| w as usize == world);
    if same_layout {
        return saved.loss_tally.get(acc.rank()).copied();
    }
    let there = saved.model_parallel_size.unwrap_or(1).max(1) as f64;
    let share = here / (there * world as f64);
    let total = |f: fn(&LossTallyState) -> f64| saved.loss_tally.iter().map(f).sum::<f64>() * share;
    Some(LossTallyState {
        sum: total(|t| t.sum),
        items: total(|t| t.items),
        steps: saved.loss_tally.first()?.steps,
        run_sum: total(|t| t.run_sum),
        run_items: total(|t| t.run_items),
    })
}

/// Why a checkpoint's run had already finished (`None` when it can go on): all `max_steps` done, or a callback
/// (early stopping) stopped it.
pub(super) fn already_ended(saved: &TrainerState, max_steps: u64) -> Option<String> {
    if saved.global_step >= max_steps {
        return Some(format!("all {max_steps} optimizer steps were done"));
    }
    let control = saved.stateful_callbacks.get("TrainerControl").map(TrainerControl::from_state)?;
    if !control.should_training_stop {
        return None;
    }
    let early = saved.stateful_callbacks.get("EarlyStoppingCallback").and_then(|st| {
        let counter = st.attributes.get("early_stopping_patience_counter")?.as_u64()?;
        let patience = st.args.get("early_stopping_patience")?.as_u64()?;
        (counter >= patience).then(|| {
            format!(
                "early stopping: the best-model metric did not improve for {counter} evaluation(s) \
                 (early_stopping_patience {patience}); best {} at step {}",
                saved.best_metric.map(|m| format!("{m:.6}")).unwrap_or_else(|| "-".into()),
                saved.best_global_step.map(|s| s.to_string()).unwrap_or_else(|| "-".into())
            )
        })
    });
    Some(early.unwrap_or_else(|| "a callback set should_training_stop".into()))
}
