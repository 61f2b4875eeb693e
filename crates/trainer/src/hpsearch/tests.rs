//! Study-level tests: resume after a kill, failing trials, pruning through reports, launched trials (own
//! directories and ports), and a real Trainer search.

use std::sync::atomic::AtomicUsize;
use std::sync::Mutex;

use super::*;

fn space() -> SearchSpace {
    SearchSpace::new().add("x", Distribution::float(-2.0, 2.0)).add("k", Distribution::categorical(["a", "b"]))
}

/// A quiet in-process search over `space()` minimising `eval_loss` in `dir`.
fn search(dir: &Path) -> HyperparameterSearch {
    HyperparameterSearch::new(space(), "loss")
        .study_dir(dir)
        .in_process()
        .verbose(false)
        .plots(false)
        .pruner(PrunerConfig::None)
        .sampler(SamplerConfig::Tpe { seed: 7, n_startup_trials: 2, n_ei_candidates: 24, gamma: 0.25 })
}

fn value(p: &Params) -> f64 {
    let x = p["x"].as_f64().unwrap();
    (x - 0.5).powi(2) + if p["k"] == "b" { 0.0 } else { 0.3 }
}

#[test]
fn killed_study_resumes_without_rerunning_finished_trials() {
    let reference = tempfile::tempdir().unwrap();
    let full = search(reference.path()).n_trials(6).run(|t| Ok(value(t.params()))).unwrap().unwrap();
    assert_eq!(full.count(TrialState::Complete), 6);

    let dir = tempfile::tempdir().unwrap();
    search(dir.path()).n_trials(3).run(|t| Ok(value(t.params()))).unwrap().unwrap();
    // Simulate a kill while trial 2's end was being written: cut the file in the middle of its last line.
    let file = dir.path().join(STUDY_FILE);
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.trim_end().lines().last().unwrap().contains("\"trial_end\""));
    let cut = text.trim_end().rfind('\n').unwrap() + 20;
    std::fs::write(&file, &text[..cut]).unwrap();
    let torn = Journal::new(&file).load().unwrap();
    assert!(torn.torn_tail);
    assert_eq!(torn.trials[&2].state, TrialState::Running);
    assert_eq!(torn.in_state(TrialState::Complete).count(), 2);

    // n_trials counts this run's trials (Optuna's optimize(n_trials=N)): the interrupted trial 2 and 3 new ones.
    let calls: Mutex<Vec<u64>> = Mutex::new(Vec::new());
    let view = Journal::new(&file).load().unwrap();
    let queue = TrialQueue::new(&view, 4, None);
    assert_eq!(
        plan_line(&file, &view, &queue, 4, None),
        format!(
            "[hp] resuming {}: 2 finished trial(s) kept, 1 interrupted; running 4 more (n_trials counts this run's \
             trials, as Optuna's optimize(n_trials=N)): 2 again, then 3 new: 3–5",
            file.display()
        )
    );
    let resumed = search(dir.path())
        .n_trials(4)
        .run(|t| {
            calls.lock().unwrap().push(t.number());
            Ok(value(t.params()))
        })
        .unwrap()
        .unwrap();
    // Trials 0 and 1 are kept, 2 (no end record) is re-run with its parameters, 3..5 are new.
    assert_eq!(*calls.lock().unwrap(), vec![2, 3, 4, 5]);
    assert_eq!(resumed.count(TrialState::Complete), 6);
    assert_eq!(resumed.run_now, 4);
    assert!(!Journal::new(&file).load().unwrap().torn_tail);
    // Same seed, replayed history: the resumed study drew exactly the uninterrupted study's parameters.
    let params = |s: &StudySummary| s.trials.iter().map(|t| t.params.clone()).collect::<Vec<_>>();
    assert_eq!(params(&resumed), params(&full));
    assert_eq!(resumed.best.as_ref().unwrap().number, full.best.as_ref().unwrap().number);

    // Another configuration in the same study directory is refused.
    let e = search(dir.path()).direction(Direction::Maximize).run(|_| Ok(0.0)).unwrap_err();
    assert!(e.to_string().contains("another configuration"), "{e}");
}

/// Runs `search` counting the objective's calls; returns (the trial numbers it ran, the summary).
fn run_counted(search: HyperparameterSearch) -> (Vec<u64>, StudySummary) {
    let calls: Mutex<Vec<u64>> = Mutex::new(Vec::new());
    let s = search
        .run(|t| {
            calls.lock().unwrap().push(t.number());
            Ok(value(t.params()))
        })
        .unwrap()
        .unwrap();
    let mut calls = calls.into_inner().unwrap();
    calls.sort();
    (calls, s)
}

#[test]
fn a_resumed_study_runs_n_trials_more_as_optuna_does() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(STUDY_FILE);
    let (calls, first) = run_counted(search(dir.path()).n_trials(3));
    assert_eq!(calls, vec![0, 1, 2]);
    assert_eq!((first.trials.len(), first.run_now), (3, 3));

    // What the driver prints first, for the next run of the same study with n_trials 2.
    let view = Journal::new(&file).load().unwrap();
    assert_eq!(
        plan_line(&file, &view, &TrialQueue::new(&view, 2, None), 2, None),
        format!(
            "[hp] resuming {}: 3 finished trial(s) kept; running 2 more (n_trials counts this run's trials, as \
             Optuna's optimize(n_trials=N)): 2 new: 3–4",
            file.display()
        )
    );
    let (calls, resumed) = run_counted(search(dir.path()).n_trials(2));
    assert_eq!(calls, vec![3, 4], "2 more trials, after the 3 finished ones");
    assert_eq!((resumed.trials.len(), resumed.run_now), (5, 2));
    assert_eq!(resumed.count(TrialState::Complete), 5);
    let table = resumed.table();
    assert!(
        table.contains("hyperparameter search: 5 trials (5 complete, 0 pruned, 0 failed), 2 of them run now"),
        "{table}"
    );

    // n_trials 0: nothing runs, and the first line says so.
    let view = Journal::new(&file).load().unwrap();
    assert!(plan_line(&file, &view, &TrialQueue::new(&view, 0, None), 0, None)
        .ends_with("5 finished trial(s) kept; nothing left to run: n_trials is 0"));
    let (calls, same) = run_counted(search(dir.path()).n_trials(0));
    assert!(calls.is_empty());
    assert_eq!((same.trials.len(), same.run_now), (5, 0));
}

#[test]
fn a_grid_study_stops_at_its_last_point_and_says_so() {
    // 3 × 2 = 6 points.
    let grid = |dir: &Path| {
        HyperparameterSearch::new(
            SearchSpace::new().add("x", Distribution::int(0, 2)).add("k", Distribution::categorical(["a", "b"])),
            "loss",
        )
        .study_dir(dir)
        .in_process()
        .verbose(false)
        .plots(false)
        .pruner(PrunerConfig::None)
        .sampler(SamplerConfig::Grid { seed: 0 })
    };
    let value = |p: &Params| p["x"].as_i64().unwrap() as f64;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(STUDY_FILE);
    let empty = StudyView::default();
    assert_eq!(
        plan_line(&file, &empty, &TrialQueue::new(&empty, 4, Some(6)), 4, Some(GridSize { points: 6, enqueued: 0 })),
        format!("[hp] new study {}: running 4 trial(s) (0–3)", file.display())
    );
    let first = grid(dir.path()).n_trials(4).run(|t| Ok(value(t.params()))).unwrap().unwrap();
    assert_eq!((first.trials.len(), first.run_now), (4, 4));

    // 5 more asked, 2 points left: both run, and the line says why not 5.
    let view = Journal::new(&file).load().unwrap();
    assert!(plan_line(&file, &view, &TrialQueue::new(&view, 5, Some(6)), 5, Some(GridSize { points: 6, enqueued: 0 }))
        .ends_with(
            "running 2 more (n_trials counts this run's trials, as Optuna's optimize(n_trials=N)): 2 new: 4–5 \
                    (the grid has 6 points; n_trials was 5)"
        ));
    let second = grid(dir.path()).n_trials(5).run(|t| Ok(value(t.params()))).unwrap().unwrap();
    assert_eq!((second.trials.len(), second.run_now), (6, 2));
    let mut points: Vec<String> = second.trials.iter().map(|t| format!("{:?}", t.params)).collect();
    points.sort();
    points.dedup();
    assert_eq!(points.len(), 6, "every grid point once");

    // Nothing left: no trial runs, the first line says so, the summary is the study as it stands.
    let view = Journal::new(&file).load().unwrap();
    assert_eq!(
        plan_line(&file, &view, &TrialQueue::new(&view, 3, Some(6)), 3, Some(GridSize { points: 6, enqueued: 0 })),
        format!(
            "[hp] resuming {}: 6 finished trial(s) kept; nothing left to run: the grid's 6 points have all been tried",
            file.display()
        )
    );
    let third = grid(dir.path()).n_trials(3).run(|_| panic!("no trial may run")).unwrap().unwrap();
    assert_eq!((third.trials.len(), third.run_now), (6, 0));
    assert_eq!(third.best.as_ref().unwrap().value, Some(0.0));
}

#[test]
fn an_enqueued_baseline_does_not_hide_a_grid_point() {
    // 2 × 2 = 4 points plus the enqueued defaults: 5 trials, every point once (trial 0 used to take point 0's place).
    let dir = tempfile::tempdir().unwrap();
    let mut baseline = Params::new();
    baseline.insert("x".into(), serde_json::json!(7));
    baseline.insert("k".into(), serde_json::json!("z"));
    let search = HyperparameterSearch::new(
        SearchSpace::new().add("x", Distribution::int(0, 1)).add("k", Distribution::categorical(["a", "b"])),
        "loss",
    )
    .study_dir(dir.path())
    .in_process()
    .verbose(false)
    .plots(false)
    .pruner(PrunerConfig::None)
    .sampler(SamplerConfig::Grid { seed: 0 })
    .enqueue_trial(baseline)
    .n_trials(10);
    let file = dir.path().join(STUDY_FILE);
    let empty = StudyView::default();
    assert_eq!(
        plan_line(&file, &empty, &TrialQueue::new(&empty, 10, Some(5)), 10, Some(GridSize { points: 4, enqueued: 1 })),
        format!(
            "[hp] new study {}: running 5 trial(s) (0–4) (the grid has 4 points and 1 enqueued trial(s); n_trials \
             was 10)",
            file.display()
        )
    );
    let s = search.run(|t| Ok(t.params()["x"].as_i64().unwrap() as f64)).unwrap().unwrap();
    let mut seen: Vec<String> = s.trials.iter().map(|t| format!("{}{}", t.params["x"], t.params["k"])).collect();
    seen.sort();
    assert_eq!(seen, ["0\"a\"", "0\"b\"", "1\"a\"", "1\"b\"", "7\"z\""]);
}

#[test]
fn failing_trials_are_recorded_and_the_study_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let s = search(dir.path())
        .n_trials(5)
        .processes(2)
        .run(|t| match t.number() {
            1 => Err(TrainerError::Usage("out of memory (simulated)".into())),
            3 => panic!("simulated panic"),
            _ => Ok(value(t.params())),
        })
        .unwrap()
        .unwrap();
    assert_eq!((s.count(TrialState::Complete), s.count(TrialState::Failed)), (3, 2));
    assert!(s.trial(1).unwrap().error.as_deref().unwrap().contains("out of memory"));
    assert!(s.trial(3).unwrap().error.as_deref().unwrap().contains("simulated panic"));
    assert!([0, 2, 4].contains(&s.best.as_ref().unwrap().number));
    let table = s.table();
    assert!(table.contains("3 complete, 0 pruned, 2 failed") && table.contains("best trial"), "{table}");
}

#[test]
fn median_pruning_from_reports_keeps_partial_results() {
    let dir = tempfile::tempdir().unwrap();
    // Trials 0-2 (enqueued) set the medians; trial 3 is worse from its second report on and must stop there.
    let enqueue = |x: f64| Params::from([("x".to_string(), Value::from(x)), ("k".into(), Value::from("a"))]);
    let searched = search(dir.path())
        .pruner(PrunerConfig::Median { n_startup_trials: 3, n_warmup_steps: 0 })
        .enqueue_trial(enqueue(0.0))
        .enqueue_trial(enqueue(0.2))
        .enqueue_trial(enqueue(0.4))
        .enqueue_trial(enqueue(1.9))
        .n_trials(4);
    let s = searched
        .run(|t| {
            let x = t.get_f64("x")?;
            let mut last = 0.0;
            for step in [10u64, 20, 30] {
                // Losses fall with the step. Trial 3 beats the median (0.098) at step 10, then falls behind:
                // its best so far, 0.05, is worse than the median 0.049 at step 20.
                let scale = match (t.number(), step) {
                    (3, 10) => 0.97,
                    (3, _) => 1.0,
                    _ => 1.0 - x * 0.1,
                };
                last = scale / step as f64;
                if t.report(step, last)? {
                    break;
                }
            }
            Ok(last)
        })
        .unwrap()
        .unwrap();
    let t3 = s.trial(3).unwrap();
    assert_eq!(t3.state, TrialState::Pruned);
    assert_eq!(t3.reports, vec![(10, Some(0.097)), (20, Some(0.05))], "stopped at its second report");
    assert_eq!(t3.value, Some(0.05), "a pruned trial keeps its last report");
    assert_eq!(s.count(TrialState::Complete), 3);
    assert_eq!(s.trial(0).unwrap().reports.len(), 3);
}

/// The name of this test for the trial processes the launcher starts (the test binary re-run on one test).
const SUBPROCESS_TEST: &str = "hpsearch::tests::launched_trials_get_own_directories_and_ports";

#[test]
fn launched_trials_get_own_directories_and_ports() {
    let exe = std::env::current_exe().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = HyperparameterSearch::new(space(), "loss")
        .study_dir(dir.path())
        .verbose(false)
        .sampler(SamplerConfig::Random { seed: 1 })
        .pruner(PrunerConfig::None)
        .processes(4)
        .processes_per_trial(2)
        .n_trials(4)
        .trial_command(exe, vec!["--exact".into(), SUBPROCESS_TEST.into(), "--nocapture".into()])
        .run(|t| {
            // In a trial process (both ranks): every rank sees the same trial; reports are collective.
            assert_eq!(t.world_size(), 2);
            std::thread::sleep(Duration::from_millis(300));
            let v = value(t.params());
            let pruned = t.report(1, v)?;
            assert!(!pruned);
            if t.number() == 3 {
                return Err(TrainerError::Usage("trial 3 fails on purpose".into()));
            }
            Ok(v)
        })
        .unwrap();
    let Some(s) = s else { return }; // a trial process: done
    assert_eq!((s.count(TrialState::Complete), s.count(TrialState::Failed)), (3, 1), "{}", s.table());
    assert!(s.trial(3).unwrap().error.as_deref().unwrap().contains("fails on purpose"));
    let dirs: std::collections::BTreeSet<_> = s.trials.iter().map(|t| t.output_dir.clone()).collect();
    assert_eq!(dirs.len(), 4, "one output directory per trial");
    for t in &s.trials {
        assert_eq!(t.world_size, 2);
        assert!(t.output_dir.join("logs").join("rank1.log").is_file());
        assert_eq!(t.reports.len(), 1, "rank 0 alone records the report");
    }
    // With a budget of 4 processes and 2 per trial, trials 0 and 1 run together, then 2 and 3.
    let port = |n: u64| s.trial(n).unwrap().master_port.expect("launched trials record MASTER_PORT");
    assert_ne!(port(0), port(1));
    assert_ne!(port(2), port(3));
}

#[test]
fn trainer_search_prunes_and_keeps_the_best_checkpoint() {
    use accel::data::TensorDataset;
    use candle_core::{Device, Tensor};
    let data = |n: usize, offset: usize| {
        let xs: Vec<f32> = (0..n * 2).map(|i| (((i + offset) as f32) * 0.61).sin()).collect();
        let ys: Vec<f32> = xs.chunks(2).map(|r| 2.0 * r[0] - r[1] + 0.5).collect();
        TensorDataset::new(
            Tensor::from_vec(xs, (n, 2), &Device::Cpu).unwrap(),
            Tensor::from_vec(ys, (n, 1), &Device::Cpu).unwrap(),
        )
        .unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let space = SearchSpace::new().add("learning_rate", Distribution::log_float(1e-4, 0.3));
    let lr = |v: f64| Params::from([("learning_rate".to_string(), Value::from(v))]);
    let base = TrainingArguments {
        num_train_epochs: 3.0,
        per_device_train_batch_size: 8,
        per_device_eval_batch_size: 32,
        eval_strategy: crate::IntervalStrategy::Epoch,
        save_strategy: crate::SaveStrategy::Epoch,
        load_best_model_at_end: true,
        logging_steps: 4.0,
        report_to: crate::ReportTo(vec!["none".into()]),
        disable_tqdm: true,
        save_plots: false,
        ..Default::default()
    };
    let built = AtomicUsize::new(0);
    let s = HyperparameterSearch::new(space, "eval_loss")
        .study_dir(dir.path())
        .in_process()
        .verbose(false)
        .pruner(PrunerConfig::Median { n_startup_trials: 2, n_warmup_steps: 0 })
        .enqueue_trial(lr(0.1))
        .enqueue_trial(lr(0.05))
        .enqueue_trial(lr(1e-4))
        .n_trials(3)
        .run_trainer(|trial| {
            built.fetch_add(1, Ordering::SeqCst);
            let args = trial.training_args(&base)?;
            assert_eq!(args.output_dir, trial.output_dir());
            Ok(Trainer::new(
                args,
                |vb| candle_nn::linear(2, 1, vb.pp("fc")),
                data(64, 0),
                Some(data(32, 999)),
                crate::losses::Mse,
            ))
        })
        .unwrap()
        .unwrap();
    assert_eq!(built.load(Ordering::SeqCst), 3, "a fresh Trainer per trial");
    // The tiny learning rate barely moves: worse than the median of the two others at its first evaluation.
    let slow = s.trial(2).unwrap();
    assert_eq!(slow.state, TrialState::Pruned, "{}", s.table());
    assert_eq!(slow.reports.len(), 1);
    let best = s.best.as_ref().unwrap();
    assert!(best.number < 2 && best.value.unwrap() < slow.value.unwrap());
    let ckpt = best.checkpoint.as_ref().unwrap();
    assert!(ckpt.join("model.safetensors").is_file(), "{}", ckpt.display());
    // Only the best trial keeps checkpoints.
    let other = s.trial(1 - best.number).unwrap();
    let leftovers = std::fs::read_dir(&other.output_dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("checkpoint-"))
        .count();
    assert_eq!(leftovers, 0);
    // The study plot needs the feature `plots` (on in a workspace build: the examples turn it on).
    let plotted = dir.path().join("hp_search.png").is_file() && dir.path().join("hp_search.svg").is_file();
    assert_eq!(plotted, cfg!(feature = "plots"));
}
