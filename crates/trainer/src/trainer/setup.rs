//! Setting the run up: the Accelerator from the environment, the arguments and the plan (an automatic layout, an
//! elastic job's kept global batch), the model, its optimizer and data, the callbacks.

use super::*;

impl<M, D> Trainer<M, D>
where
    M: ModuleT + 'static,
    D: Dataset + 'static,
{
    /// Sets up the Accelerator, model, optimizer, train loader and callbacks (idempotent).
    pub fn setup(&mut self) -> Result<()> {
        if self.rt.is_some() {
            return Ok(());
        }
        let acc = self.build_accelerator()?;
        self.args.finalize()?;
        let varmap = VarMap::new();
        // The model's tensor-parallel group (one rank without tensor parallelism), for the loss.
        let tp = acc.tensor_parallel().clone();
        let (model, built_stages) = (self.model_init)(&Builders { acc: &acc, varmap: &varmap })?;
        let staged = match (acc.pipeline_schedule().is_some(), built_stages) {
            (true, Some(stages)) => Some(stages),
            (true, None) => return Err(not_staged(&acc)),
            (false, _) => None,
        };
        // Under FULL_SHARD the VarMap keeps this rank's chunks from here on; a model on accel::nn's builder fetches
        // its weights at each use, one built from a candle VarBuilder keeps them and is refused here, saying so.
        let prepared = acc.prepare_model(&varmap)?;
        let optimizer = acc.prepare_optimizer(&prepared, TrainerOptimizer::from_args(&self.args)?)?;
        let cfg = DataLoaderConfig {
            batch_size: self.args.per_device_train_batch_size,
            shuffle: true,
            seed: self.args.data_seed_resolved(),
            drop_last: self.args.dataloader_drop_last,
            split_batches: acc.config().split_batches,
            even_batches: acc.config().even_batches,
            prefetch: true,
        };
        let train_loader = acc.prepare_data_loader(DataLoader::from_arc(self.train_dataset.clone(), cfg))?;
        let callbacks = self.build_callbacks(&acc);
        if acc.is_main_process() {
            std::fs::create_dir_all(&self.args.output_dir)
                .map_err(|e| TrainerError::io(format!("creating output_dir {}", self.args.output_dir.display()), e))?;
        }
        self.rt = Some(Runtime {
            acc,
            tp,
            varmap,
            model,
            staged,
            prepared,
            optimizer,
            train_loader,
            scheduler: None,
            callbacks,
        });
        Ok(())
    }

    /// The Accelerator: the environment's configuration (`accel launch` flags) unless the arguments set mixed
    /// precision / accumulation explicitly; the arguments are then updated to what is in effect. `fsdp`, when set,
    /// sets the sharding strategy and makes the data-parallel processes dp_shard ([`crate::args::FsdpPlan::apply`]
    /// on this job's world size).
    pub(super) fn build_accelerator(&mut self) -> Result<Accelerator> {
        let mut cfg = AcceleratorConfig::from_env()?;
        if self.args.mixed_precision != MixedPrecision::No {
            cfg.mixed_precision = self.args.mixed_precision;
        }
        if self.args.gradient_accumulation_steps != 1 {
            cfg.gradient_accumulation_steps = self.args.gradient_accumulation_steps;
        }
        cfg.activation_checkpointing |= self.args.gradient_checkpointing;
        cfg.async_checkpointing |= self.args.async_checkpointing;
        cfg.seed = Some(self.args.seed);
        if let Some(p) = &self.parallelism {
            cfg.parallelism = p.clone();
        }
        let world_size = match &self.process_group {
            Some(pg) => pg.world_size(),
            // The job Accelerator::new joins: more than one process when a launcher describes one.
            None => accel::dist::env::DistEnv::detect_from_env()?.map_or(1, |env| env.world_size.max(1)),
        };
        if cfg.parallelism.is_auto() {
            if self.args.fsdp.is_some() {
                return Err(TrainerError::invalid(
                    "fsdp",
                    "an automatic layout (a parallelism size `auto`) chooses the sharding itself; drop fsdp, or give \
                     the sizes",
                ));
            }
            // The accumulation asked for (the arguments' or the environment's) is part of the global batch the
            // layout keeps; the layout chooses its own.
            self.args.gradient_accumulation_steps = cfg.gradient_accumulation_steps;
            if cfg.auto_layout.is_none() {
                cfg.auto_layout = Some(self.auto_layout_request(&cfg, world_size)?);
            }
            cfg.gradient_accumulation_steps = 1;
        } else {
            if let Some(plan) = self.args.fsdp_plan()? {
                let fsdp = self.args.fsdp.clone().unwrap_or_default();
                cfg.parallelism = plan.apply(&cfg.parallelism, world_size, &fsdp)?;
            }
            self.keep_the_global_batch(&mut cfg, world_size)?;
        }
        self.args.mixed_precision = cfg.mixed_precision;
        self.args.gradient_accumulation_steps = cfg.gradient_accumulation_steps;
        let acc = match self.process_group.take() {
            Some(pg) => Accelerator::with_process_group(cfg, pg)?,
            None => Accelerator::new(cfg)?,
        };
        if let Some(decision) = acc.auto_layout() {
            // The chosen micro-batch and accumulation replace the arguments' (the global batch is kept).
            self.args.per_device_train_batch_size = decision.layout().per_process_batch();
            self.args.gradient_accumulation_steps = acc.gradient_accumulation_steps();
        }
        Ok(acc)
    }

    /// What the automatic layout needs (a size of the config is `auto`): the model's shape, read from its build
    /// on `accel::nn`'s builder (described, nothing allocated) for samples of the training set's length — the
    /// tokens of a sample of integer ids, 1 for a sample of features — and the global batch the arguments give
    /// (`per_device_train_batch_size` × the processes × `gradient_accumulation_steps`, what data parallelism over
    /// all of them would train), split into any micro-batch size that divides it; activation checkpointing
    /// chosen where it saves memory, or always with `gradient_checkpointing`.
    pub(super) fn auto_layout_request(&self, cfg: &AcceleratorConfig, world_size: usize) -> Result<AutoLayoutRequest> {
        let describe = self.describe_model.as_ref().ok_or_else(|| {
            TrainerError::Usage(
                "an automatic layout (a parallelism size `auto`) reads the model's shape from its build on \
                 accel::nn's builder: construct the Trainer with Trainer::with_plan (the same layer calls on \
                 accel::nn::VarBuilder), or give the sizes"
                    .into(),
            )
        })?;
        if self.train_dataset.is_empty() {
            return Err(TrainerError::Usage("the training dataset is empty: no layout to choose for it".into()));
        }
        let sample = self.train_dataset.get_batch(&[0])?.inputs;
        let seq_len = match sample.dtype() {
            DType::U8 | DType::U32 | DType::I64 => sample.elem_count().max(1),
            _ => 1,
        };
        let model = describe(cfg.parallelism.tp_plan.clone(), seq_len)?;
        let args = &self.args;
        // An elastic job re-chooses its layout at each size, for the global batch it started with.
        let global = match self.elastic_global_batch()? {
            Some((saved, _)) => saved as usize,
            None => args.per_device_train_batch_size * world_size * args.gradient_accumulation_steps.max(1),
        };
        if global > self.train_dataset.len() {
            return Err(TrainerError::invalid(
                "per_device_train_batch_size",
                format!(
                    "the global batch of an automatic layout, {} per device × {world_size} processes × {} \
                     accumulation steps = {global} samples, is more than the {} samples of the training set; lower \
                     it",
                    args.per_device_train_batch_size,
                    args.gradient_accumulation_steps.max(1),
                    self.train_dataset.len()
                ),
            ));
        }
        let checkpointing = if args.gradient_checkpointing { Checkpointing::On } else { Checkpointing::Auto };
        let train = TrainSpec::any_micro_batch(global, Precision::Fp32).with_checkpointing(checkpointing);
        Ok(AutoLayoutRequest::new(model, train))
    }

    pub(super) fn build_callbacks(&mut self, acc: &Accelerator) -> CallbackHandler {
        let mut handler = CallbackHandler::new();
        handler.push(Box::new(DefaultFlowCallback));
        if let Some(patience) = self.args.early_stopping_patience {
            handler.push(Box::new(EarlyStoppingCallback::new(patience, self.args.early_stopping_threshold)));
        }
        let console = ConsoleWriter::new();
        #[cfg(feature = "progress")]
        handler.push(Box::new(crate::callbacks::ProgressCallback::new(console.clone())));
        handler.push(Box::new(PrinterCallback::new(console)));
        let mut kinds = Vec::new();
        if self.args.report_to.contains("jsonl") {
            kinds.push(accel::tracking::TrackerKind::Jsonl);
        }
        if self.args.report_to.contains("tensorboard") {
            kinds.push(accel::tracking::TrackerKind::TensorBoard);
        }
        if !kinds.is_empty() && !self.args.report_to.0.iter().any(|r| r == "none") {
            // The trackers write into logging_dir/project/ = self.args.tracker_dir().
            let logging_dir = self.args.logging_dir.clone().unwrap_or_else(|| self.args.output_dir.join("runs"));
            let project = self.args.run_name_resolved();
            handler.push(Box::new(TrackersCallback::new(acc.clone(), project, kinds, logging_dir)));
        }
        for cb in self.user_callbacks.drain(..) {
            handler.push(cb);
        }
        handler
    }

    /// Whether this run resumes a checkpoint: it asks to, and — when it asks for the newest under a launcher that
    /// restarts its workers (whose first attempt has none yet) — there is one.
    pub(super) fn resumes(&self) -> Result<bool> {
        Ok(match &self.args.resume_from_checkpoint {
            None => false,
            Some(_) if self.args.resume_latest() && restarts::restarts_possible() => {
                checkpoint::latest_checkpoint(&self.args.output_dir)?.is_some()
            }
            Some(_) => true,
        })
    }

    /// Under an elastic launch, the global batch of the checkpoint this run resumes (what every size keeps), and
    /// the checkpoint; `None` outside one, when nothing is resumed, or for a checkpoint that did not record it.
    pub(super) fn elastic_global_batch(&self) -> Result<Option<(u64, PathBuf)>> {
        if restarts::elastic_nnodes().is_none() || !self.resumes()? {
            return Ok(None);
        }
        let Some(dir) = checkpoint::latest_checkpoint(&self.args.output_dir)? else { return Ok(None) };
        let saved = TrainerState::load_from_json(&dir.join(TRAINER_STATE_NAME))?;
        Ok(saved.global_batch_size.map(|g| (g, dir)))
    }

    /// An elastic job restarted at another size keeps the global batch of the checkpoint it resumes: the
    /// gradient accumulation (else the per-device batch) of `cfg` and the arguments are set to what keeps it at
    /// this job's data-parallel size, said once; refused naming the sizes that would keep it.
    pub(super) fn keep_the_global_batch(&mut self, cfg: &mut AcceleratorConfig, world_size: usize) -> Result<()> {
        if cfg.split_batches {
            return Ok(());
        }
        let Some((global, dir)) = self.elastic_global_batch()? else { return Ok(()) };
        let machines = restarts::elastic_nnodes().unwrap_or_default();
        let resolved = cfg.parallelism.resolve(world_size)?;
        let dp = resolved.dp_replicate_size * resolved.dp_shard_size;
        let (per_device, accumulation) = (self.args.per_device_train_batch_size, cfg.gradient_accumulation_steps);
        let max_machines = machines.split(':').nth(1).and_then(|m| m.trim().parse::<usize>().ok()).unwrap_or(1);
        // At MAX machines the data-parallel size is at most this many times today's (at least one machine now).
        let max_dp = dp * max_machines;
        let (per_device_kept, accumulation_kept) =
            restarts::keep_global_batch(global, dp, per_device, accumulation, max_dp).map_err(|e| {
                TrainerError::checkpoint(&dir, format!("elastic restart at {world_size} processes: {e}"))
            })?;
        if (per_device_kept, accumulation_kept) != (per_device, accumulation) {
            if accel::dist::env::DistEnv::detect_from_env()?.is_none_or(|env| env.rank == 0) {
                eprintln!(
                    "elastic ({machines} machines): keeping the checkpoint's global batch of {global} samples at \
                     {dp} data-parallel process(es): per-device batch {per_device_kept}, gradient_accumulation_steps \
                     {accumulation_kept} (the arguments say {per_device} and {accumulation})"
                );
            }
            self.args.per_device_train_batch_size = per_device_kept;
            cfg.gradient_accumulation_steps = accumulation_kept;
        }
        Ok(())
    }
}

/// The error for a model laid out over pipeline stages that it does not declare.
pub(super) fn not_staged(acc: &Accelerator) -> TrainerError {
    TrainerError::Usage(format!(
        "the processes are laid out with pp_size {} (pipeline parallelism) but this trainer's model is not cut into \
         stages: build it with Trainer::with_plan on accel::nn's builder and declare its blocks with \
         accel::nn::staged (each rank then builds its stages only), or set pp_size 1",
        acc.mesh().pp().world_size()
    ))
}
