//! save_state / load_state: what a checkpoint holds and restores, its file format, automatic naming with a total
//! limit, atomicity under a failing or crashing save, and the errors a user gets for a wrong checkpoint.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::ranks::*;
use accel::data::{DataLoader, DataLoaderConfig, TensorDataset};
use accel::state::{StateDict, Stateful};
use accel::{
    AcceleratedOptimizer, Accelerator, AcceleratorConfig, AdamW, AdamWConfig, MixedPrecision, Optimizer, PreparedModel,
};
use candle_core::{Device, Tensor};
use ddp_core::ProcessGroup;
use rand::RngCore;

struct Setup {
    acc: Accelerator,
    model: TinyMlp,
    prepared: PreparedModel,
    opt: AcceleratedOptimizer<AdamW>,
    loader: DataLoader<TensorDataset>,
}

fn setup(acc: Accelerator, init_seed: u64) -> anyhow::Result<Setup> {
    setup_with_batch(acc, init_seed, 4)
}

fn setup_with_batch(acc: Accelerator, init_seed: u64, batch_size: usize) -> anyhow::Result<Setup> {
    let (model, varmap) = tiny_model(&acc, init_seed)?;
    let prepared = acc.prepare_model(&varmap)?;
    let opt = acc.prepare_optimizer(&prepared, AdamW::new(AdamWConfig::new(1e-2))?)?;
    let (x, y) = dataset(37, 5);
    let cfg = DataLoaderConfig { batch_size, shuffle: true, seed: 11, ..DataLoaderConfig::default() };
    let loader = acc.prepare_data_loader(DataLoader::new(TensorDataset::new(x, y)?, cfg))?;
    Ok(Setup { acc, model, prepared, opt, loader })
}

/// Trains `micro_batches` micro-steps (crossing epochs as needed).
fn train(s: &mut Setup, micro_batches: usize) -> anyhow::Result<()> {
    let mut left = micro_batches;
    while left > 0 {
        for batch in s.loader.iter() {
            let b = batch?;
            let l = loss(&s.acc, &s.model, &b.inputs, &b.targets)?;
            s.acc.backward(&l)?;
            s.opt.step()?;
            left -= 1;
            if left == 0 {
                break;
            }
        }
    }
    Ok(())
}

fn single(cfg: AcceleratorConfig) -> Accelerator {
    Accelerator::with_process_group(cfg, ProcessGroup::single_process().unwrap()).unwrap()
}

fn bits(prepared: &PreparedModel) -> Vec<Vec<u32>> {
    prepared.master_weights().iter().map(|v| var_values(v).iter().map(|x| x.to_bits()).collect()).collect()
}

/// A registered object with a tensor and a counter.
#[derive(Default)]
struct Counter {
    count: u64,
    history: Vec<f32>,
    fail: bool,
    panic: bool,
}

impl Stateful for Counter {
    fn state_dict(&self) -> accel::Result<StateDict> {
        if self.panic {
            panic!("simulated crash in the middle of save_state");
        }
        if self.fail {
            return Err(accel::AccelError::InvalidArgument("simulated failure while saving".into()));
        }
        let t = Tensor::new(self.history.as_slice(), &Device::Cpu)?;
        Ok(StateDict::from_meta(serde_json::json!({ "count": self.count })).with_tensor("history", t))
    }
    fn load_state_dict(&mut self, sd: &StateDict) -> accel::Result<()> {
        self.count = sd.meta_field("count")?;
        self.history = sd.tensor("history")?.to_vec1()?;
        Ok(())
    }
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn round_trip_restores_every_part_of_the_state() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let cfg = AcceleratorConfig { gradient_accumulation_steps: 2, seed: Some(7), ..Default::default() };
    let mut a = setup(single(cfg.clone()), 1)?;
    let counter = Arc::new(Mutex::new(Counter { count: 41, history: vec![0.5, -1.25], ..Default::default() }));
    let sched = Arc::new(Mutex::new(Counter { count: 3, history: vec![2.0], ..Default::default() }));
    a.acc.register_for_checkpointing(counter.clone());
    a.acc.register_scheduler(sched.clone());
    train(&mut a, 6)?; // 3 optimizer steps, 6 of the 10 batches of epoch 0
    a.acc.rng().next_u64();
    let dir = a.acc.save_state(Some(&tmp.path().join("ckpt")))?;
    assert_eq!(
        files(&dir),
        [
            "accelerator.json",
            "custom_checkpoint_0.json",
            "custom_checkpoint_0.safetensors",
            "data_loader.json",
            "model.safetensors",
            "optimizer.json",
            "optimizer.safetensors",
            "random_states_0.json",
            "scheduler.json",
            "scheduler.safetensors",
        ]
    );
    assert!(!tmp.path().join(".ckpt.partial").exists());

    let b = setup(single(cfg), 99)?;
    let counter_b = Arc::new(Mutex::new(Counter::default()));
    let sched_b = Arc::new(Mutex::new(Counter::default()));
    b.acc.register_for_checkpointing(counter_b.clone());
    b.acc.register_scheduler(sched_b.clone());
    assert_ne!(bits(&a.prepared), bits(&b.prepared));
    assert_eq!(b.acc.load_state(Some(&dir))?, dir);

    assert_eq!(bits(&a.prepared), bits(&b.prepared), "master weights");
    let (sa, sb) = (a.opt.optimizer().state_dict()?, b.opt.optimizer().state_dict()?);
    assert_eq!(sa.meta, sb.meta, "optimizer metadata");
    assert_eq!(sa.tensors.keys().collect::<Vec<_>>(), sb.tensors.keys().collect::<Vec<_>>());
    for (k, t) in &sa.tensors {
        assert_eq!(
            to_f32_map(&BTreeMap::from([(k.clone(), t.clone())])),
            to_f32_map(&BTreeMap::from([(k.clone(), sb.tensors[k].clone())]))
        );
    }
    assert_eq!(a.acc.step_counters(), b.acc.step_counters());
    assert_eq!(b.acc.optimizer_step_count(), 3);
    assert_eq!(a.acc.rng().next_u64(), b.acc.rng().next_u64(), "RNG continues the same stream");
    assert_eq!(b.loader.position(), a.loader.position());
    let restored = counter_b.lock().unwrap();
    assert_eq!((restored.count, restored.history.clone()), (41, vec![0.5, -1.25]));
    assert_eq!(sched_b.lock().unwrap().count, 3);
    Ok(())
}

#[test]
fn model_file_is_standard_safetensors_with_varmap_names_in_fp32() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let cfg = AcceleratorConfig { mixed_precision: MixedPrecision::Bf16, ..Default::default() };
    let mut s = setup(single(cfg), 2)?;
    train(&mut s, 2)?;
    let dir = s.acc.save_state(Some(tmp.path()))?;
    // Parse with the reference implementation of the format (the Rust core Python's `safetensors` also uses).
    let bytes = std::fs::read(dir.join("model.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    assert_eq!(names, ["l1.bias", "l1.weight", "l2.bias", "l2.weight"]);
    for (name, master) in s.prepared.names().iter().zip(s.prepared.master_weights()) {
        let view = st.tensor(name)?;
        assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}: masters are saved in fp32 under bf16");
        assert_eq!(view.shape(), master.dims());
        let saved: Vec<f32> = view.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(saved, var_values(master), "{name}");
    }
    Ok(())
}

#[test]
fn fp16_loss_scale_is_saved_and_restored() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let cfg = AcceleratorConfig { mixed_precision: MixedPrecision::Fp16, ..Default::default() };
    let mut a = setup(single(cfg.clone()), 3)?;
    train(&mut a, 2)?;
    a.acc.grad_scaler().unwrap().lock().unwrap().update(true); // an overflow: 65536 → 32768
    let dir = a.acc.save_state(Some(tmp.path()))?;
    assert!(dir.join("scaler.json").is_file());
    let b = setup(single(cfg), 3)?;
    assert_eq!(b.acc.grad_scaler().unwrap().lock().unwrap().scale(), 65536.0);
    b.acc.load_state(Some(&dir))?;
    let (sa, sb) = (a.acc.grad_scaler().unwrap(), b.acc.grad_scaler().unwrap());
    assert_eq!(sb.lock().unwrap().scale(), 32768.0);
    assert_eq!(sa.lock().unwrap().growth_tracker(), sb.lock().unwrap().growth_tracker());
    Ok(())
}

#[test]
fn automatic_naming_keeps_the_newest_total_limit_and_loads_the_newest() -> anyhow::Result<()> {
    let project = tempfile::tempdir()?;
    let cfg = AcceleratorConfig {
        project_dir: Some(project.path().to_path_buf()),
        automatic_checkpoint_naming: true,
        total_limit: Some(2),
        ..Default::default()
    };
    let mut a = setup(single(cfg.clone()), 4)?;
    let mut saved = Vec::new();
    for _ in 0..4 {
        train(&mut a, 1)?;
        saved.push(a.acc.save_state(None)?);
    }
    let root = project.path().join("checkpoints");
    assert_eq!(saved, (0..4).map(|i| root.join(format!("checkpoint_{i}"))).collect::<Vec<PathBuf>>());
    assert_eq!(files(&root), ["checkpoint_2", "checkpoint_3"]);

    let b = setup(single(cfg), 5)?;
    assert_eq!(b.acc.load_state(None)?, root.join("checkpoint_3"));
    assert_eq!(b.acc.optimizer_step_count(), 4);
    assert_eq!(bits(&a.prepared), bits(&b.prepared));
    // A restarted job continues the numbering.
    assert_eq!(b.acc.save_state(None)?, root.join("checkpoint_4"));
    assert_eq!(files(&root), ["checkpoint_3", "checkpoint_4"]);
    Ok(())
}

#[test]
fn automatic_naming_errors_name_the_missing_configuration() -> anyhow::Result<()> {
    let s = setup(single(AcceleratorConfig::default()), 1)?;
    let err = s.acc.save_state(None).unwrap_err().to_string();
    assert!(err.contains("project_dir") && err.contains("automatic_checkpoint_naming"), "{err}");
    let err = s.acc.load_state(None).unwrap_err().to_string();
    assert!(err.contains("project_dir"), "{err}");
    let project = tempfile::tempdir()?;
    let cfg = AcceleratorConfig { project_dir: Some(project.path().into()), ..Default::default() };
    let err = setup(single(cfg), 1)?.acc.load_state(None).unwrap_err().to_string();
    assert!(err.contains("no checkpoint_{i} directory found"), "{err}");
    Ok(())
}

#[test]
fn a_failing_save_leaves_the_previous_checkpoint_intact() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let target = tmp.path().join("ckpt");
    let mut s = setup(single(AcceleratorConfig::default()), 6)?;
    let counter = Arc::new(Mutex::new(Counter::default()));
    s.acc.register_for_checkpointing(counter.clone());
    train(&mut s, 2)?;
    s.acc.save_state(Some(&target))?;
    let before = std::fs::read(target.join("model.safetensors"))?;
    let meta_before = std::fs::read_to_string(target.join("accelerator.json"))?;

    train(&mut s, 3)?;
    counter.lock().unwrap().fail = true;
    let err = s.acc.save_state(Some(&target)).unwrap_err().to_string();
    assert!(err.contains("simulated failure"), "{err}");
    assert_eq!(std::fs::read(target.join("model.safetensors"))?, before, "previous weights untouched");
    assert_eq!(std::fs::read_to_string(target.join("accelerator.json"))?, meta_before);
    assert_eq!(files(tmp.path()), ["ckpt"], "the temporary directory is cleaned up");

    // A crash (here: a panic) mid-save leaves at most a hidden partial directory, never the final name.
    let fresh = tmp.path().join("new");
    counter.lock().unwrap().fail = false;
    counter.lock().unwrap().panic = true;
    let acc = s.acc.clone();
    let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| acc.save_state(Some(&fresh))));
    assert!(crashed.is_err());
    assert!(!fresh.exists(), "no checkpoint under the final name");
    assert!(tmp.path().join(".new.partial").is_dir(), "the partial save is set aside under a hidden name");
    // The next save removes the stale partial directory and completes.
    counter.lock().unwrap_or_else(|p| p.into_inner()).panic = false;
    s.acc.save_state(Some(&fresh))?;
    assert_eq!(files(tmp.path()), ["ckpt", "new"]);
    let b = setup(single(AcceleratorConfig::default()), 7)?;
    b.acc.register_for_checkpointing(Arc::new(Mutex::new(Counter::default())));
    b.acc.load_state(Some(&fresh))?;
    assert_eq!(bits(&b.prepared), bits(&s.prepared));
    Ok(())
}

/// Saves a small checkpoint and returns its directory.
fn saved_checkpoint(tmp: &Path) -> anyhow::Result<PathBuf> {
    let mut s = setup(single(AcceleratorConfig::default()), 8)?;
    train(&mut s, 2)?;
    Ok(s.acc.save_state(Some(&tmp.join("ckpt")))?)
}

fn load_err(dir: &Path) -> String {
    let b = setup(single(AcceleratorConfig::default()), 9).unwrap();
    b.acc.load_state(Some(dir)).unwrap_err().to_string()
}

#[test]
fn load_errors_name_the_problem_and_the_fix() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = saved_checkpoint(tmp.path())?;

    let err = load_err(&tmp.path().join("nowhere"));
    assert!(err.contains("nowhere") && err.contains("does not exist"), "{err}");
    std::fs::create_dir(tmp.path().join("empty"))?;
    let err = load_err(&tmp.path().join("empty"));
    assert!(err.contains("no accelerator.json"), "{err}");

    // A missing file is named.
    std::fs::rename(dir.join("optimizer.json"), tmp.path().join("optimizer.json.bak"))?;
    let err = load_err(&dir);
    assert!(err.contains("optimizer.json"), "{err}");
    std::fs::rename(tmp.path().join("optimizer.json.bak"), dir.join("optimizer.json"))?;
    std::fs::remove_file(dir.join("random_states_0.json"))?;
    assert!(load_err(&dir).contains("random_states_0.json"));

    // A model with other parameter names or shapes: the tensor is named.
    let dir = saved_checkpoint(&tmp.path().join("2"))?;
    let other = single(AcceleratorConfig::default());
    let varmap = candle_nn::VarMap::new();
    let _m = TinyMlp::new(other.var_builder(&varmap), IN, HIDDEN + 1, OUT)?;
    let prepared = other.prepare_model(&varmap)?;
    let _opt = other.prepare_optimizer(&prepared, AdamW::new(AdamWConfig::new(1e-2))?)?;
    let (x, y) = dataset(37, 5);
    let cfg = DataLoaderConfig { batch_size: 4, shuffle: true, seed: 11, ..DataLoaderConfig::default() };
    other.prepare_data_loader(DataLoader::new(TensorDataset::new(x, y)?, cfg))?;
    let err = other.load_state(Some(&dir)).unwrap_err().to_string();
    assert!(err.contains("model.safetensors") && err.contains("l1.bias") && err.contains("shape"), "{err}");

    // Different numbers of prepared objects.
    let bare = single(AcceleratorConfig::default());
    let (_m, varmap) = tiny_model(&bare, 1)?;
    bare.prepare_model(&varmap)?;
    let err = bare.load_state(Some(&dir)).unwrap_err().to_string();
    assert!(err.contains("holds 1 optimizers but this Accelerator has 0"), "{err}");

    // A checkpoint of another world size taken inside an accumulation window (per-rank partial gradients).
    let meta_path = dir.join("accelerator.json");
    let mut meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&meta_path)?)?;
    meta["world_size"] = 4.into();
    std::fs::write(&meta_path, serde_json::to_string(&meta)?)?;
    std::fs::write(dir.join("gradients_0.json"), "{}")?;
    let err = load_err(&dir);
    assert!(
        err.contains(
            "written by 4 processes inside an accumulation window (each rank's partial gradients), but this job has 1"
        ),
        "{err}"
    );
    Ok(())
}

#[test]
fn two_ranks_write_shared_files_once_and_one_rng_file_each() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let d = dir.clone();
    let draws = run_ranks(2, AcceleratorConfig::default(), move |acc| {
        acc.set_seed(100, true); // a different stream per rank
        let mut s = setup(acc, 1)?;
        train(&mut s, 3)?;
        s.acc.save_state(Some(&d))?;
        let next = s.acc.rng().next_u64();
        Ok((next, bits(&s.prepared)))
    });
    assert_ne!(draws[0].0, draws[1].0);
    assert_eq!(draws[0].1, draws[1].1, "DDP keeps the ranks' weights equal");
    assert!(dir.join("random_states_0.json").is_file() && dir.join("random_states_1.json").is_file());
    assert!(!tmp.path().join(".ckpt.partial").exists());

    let d = dir.clone();
    let restored = run_ranks(2, AcceleratorConfig::default(), move |acc| {
        let s = setup(acc, 2)?;
        s.acc.load_state(Some(&d))?;
        let next = s.acc.rng().next_u64();
        Ok((next, bits(&s.prepared)))
    });
    assert_eq!(restored, draws, "each rank gets its own RNG stream back, and the weights");

    // One process resumes the two-process checkpoint (taken at an optimizer step): the same weights, the loader 24
    // samples into the epoch (3 batches of 2 × 4 rows: 3 of 8 here, or 6 of 4), and an RNG derived from (seed,
    // rank, optimizer step); a batch that does not divide the samples consumed is refused.
    let err = setup_with_batch(single(AcceleratorConfig::default()), 9, 5)?.acc.load_state(Some(&dir)).unwrap_err();
    assert!(err.to_string().contains("it is 24 samples into epoch 0"), "{err}");
    let four = setup_with_batch(single(AcceleratorConfig::default()), 2, 4)?;
    four.acc.load_state(Some(&dir))?;
    assert_eq!(four.loader.state_handle().position().batches_consumed, 6);
    let one = setup_with_batch(single(AcceleratorConfig::default()), 2, 8)?;
    one.acc.load_state(Some(&dir))?;
    assert_eq!(one.loader.state_handle().position().batches_consumed, 3);
    assert_eq!(bits(&one.prepared), draws[0].1);
    let mut derived = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(0);
    derived.set_stream(one.acc.step_counters().optimizer_steps << 20);
    assert_eq!(one.acc.rng().next_u64(), derived.next_u64());
    Ok(())
}

/// A layer of 1 M parameters (4 MiB, 12 MiB with AdamW's moments): its checkpoint takes longer to write than an
/// optimizer step takes to overwrite its weights in place.
fn wide_layer(acc: &Accelerator) -> anyhow::Result<(candle_nn::Linear, PreparedModel, AcceleratedOptimizer<AdamW>)> {
    let varmap = candle_nn::VarMap::new();
    let layer = candle_nn::linear(1024, 1024, acc.var_builder(&varmap).pp("wide"))?;
    let prepared = acc.prepare_model(&varmap)?;
    let opt = acc.prepare_optimizer(&prepared, AdamW::new(AdamWConfig::new(1e-2))?)?;
    Ok((layer, prepared, opt))
}

fn wide_step(
    acc: &Accelerator,
    layer: &candle_nn::Linear,
    opt: &mut AcceleratedOptimizer<AdamW>,
) -> anyhow::Result<()> {
    let x = Tensor::ones((4, 1024), candle_core::DType::F32, acc.device())?;
    let loss = candle_core::Module::forward(layer, &x)?.sqr()?.mean_all()?;
    acc.backward(&loss)?;
    opt.step()?;
    Ok(())
}

/// In the background (`async_checkpointing`) `save_state` returns before the files are written and training goes
/// on: the optimizer step right after it overwrites the weights and moments in place (while the writer writes, or
/// after it: the copy itself is pinned by the unit test `a_detached_snapshot_keeps_the_state_at_the_save`), yet the
/// checkpoint holds the state at the save — the same bytes a synchronous save of that state writes — on every rank
/// of a two-rank job. The wait returns its directory; loading it restores that state.
#[test]
fn a_checkpoint_written_in_the_background_holds_the_state_at_the_save() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let (sync_dir, async_dir) = (tmp.path().join("sync"), tmp.path().join("async"));
    let run = |dir: PathBuf, background: bool| {
        let cfg = AcceleratorConfig { async_checkpointing: background, seed: Some(3), ..Default::default() };
        run_ranks(2, cfg, move |acc| {
            let (layer, prepared, mut opt) = wide_layer(&acc)?;
            wide_step(&acc, &layer, &mut opt)?;
            let at_save = bits(&prepared);
            let returned = acc.save_state(Some(&dir))?;
            wide_step(&acc, &layer, &mut opt)?; // while the writer writes, in the background case
            let waited = acc.wait_for_checkpoint()?;
            assert_eq!(waited, background.then(|| dir.clone()), "the wait returns the background save's directory");
            assert_eq!(returned, dir);
            assert_ne!(bits(&prepared), at_save, "the step after the save changed the weights");
            Ok(at_save)
        })
    };
    let at_save = run(sync_dir.clone(), false);
    assert_eq!(run(async_dir.clone(), true), at_save, "the same training in both runs");
    for file in ["model.safetensors", "optimizer.safetensors", "optimizer.json", "accelerator.json"] {
        let (a, b) = (std::fs::read(sync_dir.join(file))?, std::fs::read(async_dir.join(file))?);
        assert!(a == b, "{file}: the background save wrote other bytes than the synchronous one");
    }
    assert_eq!(files(&async_dir), files(&sync_dir));
    assert!(!tmp.path().join(".async.partial").exists());
    let restored = run_ranks(1, AcceleratorConfig::default(), move |acc| {
        let (_, prepared, _) = wide_layer(&acc)?;
        acc.load_state(Some(&async_dir))?;
        Ok(bits(&prepared))
    });
    assert_eq!(restored[0], at_save[0]);
    Ok(())
}

/// Background saves one after another: each waits for the previous (total_limit applies as they commit), a load
/// waits for the one in flight and finds it, and a writer's error reaches the caller at the next wait, naming the
/// checkpoint.
#[test]
fn background_saves_wait_for_each_other_and_report_their_errors() -> anyhow::Result<()> {
    let project = tempfile::tempdir()?;
    let cfg = AcceleratorConfig {
        project_dir: Some(project.path().to_path_buf()),
        automatic_checkpoint_naming: true,
        total_limit: Some(2),
        async_checkpointing: true,
        ..Default::default()
    };
    let mut a = setup(single(cfg.clone()), 4)?;
    for _ in 0..4 {
        train(&mut a, 1)?;
        a.acc.save_state(None)?;
    }
    // No wait: the load waits for checkpoint_3, then loads it.
    let b = setup(single(cfg.clone()), 5)?;
    let root = project.path().join("checkpoints");
    assert_eq!(a.acc.load_state(None)?, root.join("checkpoint_3"));
    assert_eq!(files(&root), ["checkpoint_2", "checkpoint_3"]);
    assert_eq!(b.acc.load_state(None)?, root.join("checkpoint_3"));
    assert_eq!(bits(&a.prepared), bits(&b.prepared));

    // A writer's failure (here: what runs once the checkpoint is committed) is the next wait's error.
    let dir = a.acc.save_state_then(None, |dir| {
        Err(accel::AccelError::Checkpoint { path: dir.into(), reason: "simulated failure after the commit".into() })
    })?;
    assert_eq!(dir, root.join("checkpoint_4"));
    let err = a.acc.wait_for_checkpoint().unwrap_err().to_string();
    assert!(err.contains("checkpoint_4") && err.contains("simulated failure after the commit"), "{err}");
    assert_eq!(a.acc.wait_for_checkpoint()?, None, "reported once");
    Ok(())
}
