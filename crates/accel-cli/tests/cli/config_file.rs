//! Accelerate's YAML config: reading files Python Accelerate wrote, writing files it can read, errors with
//! locations, atomic writes.

use accel::{MixedPrecision, ShardingStrategy};
use accel_cli::{AccelerateConfig, CliError, DistributedType, LaunchArgs, LaunchPlan, ParallelismConfig};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

#[test]
fn reads_the_file_accelerate_config_writes() {
    let loaded = AccelerateConfig::load(&fixture("accelerate_multi_gpu.yaml")).unwrap();
    let c = &loaded.config;
    assert_eq!(c.compute_environment, "LOCAL_MACHINE");
    assert_eq!(c.distributed_type, DistributedType::MultiGpu);
    assert_eq!(c.mixed_precision, MixedPrecision::Bf16);
    assert_eq!((c.num_processes, c.num_machines, c.machine_rank), (Some(2), 1, 0));
    assert_eq!(c.gpu_ids.as_deref(), Some("all"));
    assert_eq!(c.downcast_bf16, "no");
    assert_eq!(c.rdzv_backend.as_deref(), Some("static"));
    assert!(c.same_network && !c.use_cpu && !c.debug);
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
}

/// Files written by Python Accelerate 1.15.0 itself (not reconstructed): `ClusterConfig.to_yaml_file` for a
/// 2-process MULTI_CPU job, and `accelerate config default --mixed_precision bf16`, which writes JSON.
#[test]
fn reads_files_written_by_accelerate_1_15() {
    let loaded = AccelerateConfig::load(&fixture("accelerate_1_15_multi_cpu.yaml")).unwrap();
    let c = &loaded.config;
    assert_eq!(c.distributed_type, DistributedType::MultiCpu);
    assert_eq!(c.mixed_precision, MixedPrecision::No, "the quoted 'no' Accelerate writes");
    assert_eq!((c.num_processes, c.num_machines, c.machine_rank), (Some(2), 1, 0));
    assert!(c.use_cpu && c.same_network);
    let plan = LaunchPlan::resolve(&LaunchArgs { program: "prog".into(), ..LaunchArgs::default() }, Some(c)).unwrap();
    assert_eq!((plan.num_processes, plan.num_machines), (2, 1));

    let loaded = AccelerateConfig::load(&fixture("accelerate_1_15_config_default.yaml")).unwrap();
    let c = &loaded.config;
    assert_eq!(c.distributed_type, DistributedType::No);
    assert_eq!(c.mixed_precision, MixedPrecision::Bf16);
    assert_eq!((c.num_processes, c.num_machines), (Some(1), 1));
}

#[test]
fn reads_a_two_machine_fsdp_file_and_warns_about_what_accel_ignores() {
    let path = fixture("accelerate_fsdp_two_machines.yaml");
    let loaded = AccelerateConfig::load(&path).unwrap();
    let c = &loaded.config;
    assert_eq!(c.distributed_type, DistributedType::Fsdp);
    assert_eq!(c.mixed_precision, MixedPrecision::No);
    assert_eq!((c.num_processes, c.num_machines, c.machine_rank), (Some(4), 2, 1));
    assert_eq!(c.main_process_ip.as_deref(), Some("192.168.1.1"));
    assert_eq!(c.main_process_port, Some(7878));
    assert_eq!(
        c.parallelism_config,
        Some(ParallelismConfig {
            cp_comm_strategy: None,
            cp_size: 1,
            dp_replicate_size: 2,
            dp_shard_size: 2,
            pp_size: 1,
            tp_size: 1,
            pp_microbatches: None,
            pp_schedule: Default::default(),
            pp_virtual_stages: None,
            sharding_strategy: ShardingStrategy::ShardGradOp,
            tp_plan: None,
        })
    );
    // FSDP2's `fsdp_reshard_after_forward: true` is FULL_SHARD; the FSDP keys accel has no use for are named once.
    assert_eq!(c.sharding_strategy().unwrap(), ShardingStrategy::FullShard);
    assert_eq!(
        loaded.warnings,
        [format!(
            "{}: fsdp_config: `fsdp_auto_wrap_policy`, `fsdp_cpu_ram_efficient_loading`, `fsdp_state_dict_type`, \
             `fsdp_version` ask for FSDP features accel does not implement (it reads only `fsdp_offload_params`, \
             `fsdp_reshard_after_forward` and `fsdp_sharding_strategy`, and has no wrapping policy to set: the \
             model's own blocks are the units); ignored",
            path.display()
        )]
    );
    // Its dp_replicate 2 × dp_shard 2 layout (HSDP) is launched with FULL_SHARD (ZeRO-3), every worker told the
    // strategy.
    let flags = LaunchArgs { program: "prog".into(), ..LaunchArgs::default() };
    let plan = LaunchPlan::resolve(&flags, Some(c)).unwrap();
    assert_eq!(
        plan.parallelism,
        Some(
            ParallelismConfig::data_parallel(2)
                .with_dp_shard_size(2)
                .with_sharding_strategy(ShardingStrategy::FullShard)
        )
    );
    let env = plan.worker_env();
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    assert_eq!(get("FSDP_SHARDING_STRATEGY"), Some("FULL_SHARD"));
    assert_eq!(
        (get("PARALLELISM_CONFIG_DP_SHARD_SIZE"), get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE")),
        (Some("2"), Some("2"))
    );
    assert!(plan.banner().layout.contains("dp_shard 2 (FULL_SHARD)"), "{}", plan.banner().layout);
    // With --fsdp-sharding-strategy SHARD_GRAD_OP the same layout is launched with ZeRO-2.
    let zero2 = LaunchArgs { fsdp_sharding_strategy: Some(ShardingStrategy::ShardGradOp), ..flags.clone() };
    let plan = LaunchPlan::resolve(&zero2, Some(c)).unwrap();
    assert_eq!(plan.parallelism, Some(ParallelismConfig::data_parallel(2).with_dp_shard_size(2)));
    let env = plan.worker_env();
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    assert_eq!(get("FSDP_SHARDING_STRATEGY"), Some("SHARD_GRAD_OP"));
    assert_eq!(get("PARALLELISM_CONFIG_DP_SHARD_SIZE"), Some("2"));
    assert_eq!(
        plan.warnings,
        ["rdzv_backend \"c10d\" is not used: accel always rendezvouses through its own TCP store on \
          main_process_ip:main_process_port with fixed machine ranks (like `static`)"]
    );
    // The same when the file says it (FSDP1's key, replacing FSDP2's).
    let mut zero2_file = c.clone();
    zero2_file.set_sharding_strategy(ShardingStrategy::ShardGradOp);
    assert_eq!(LaunchPlan::resolve(&flags, Some(&zero2_file)).unwrap().parallelism, plan.parallelism);
    // With tp 2 from a flag: 2 × 2 × 2 = 8 sizes for 4 processes, refused naming what fits.
    let tp2 = LaunchArgs { parallelism_config_tp_size: Some(2), ..flags.clone() };
    let e = LaunchPlan::resolve(&tp2, Some(&zero2_file)).unwrap_err().to_string();
    assert!(e.contains("the sizes multiply to 8 but the job has 4 processes"), "{e}");
    // A layout the Accelerator runs whose product is not the process count is refused, naming what fits.
    let flags = LaunchArgs {
        program: "prog".into(),
        parallelism_config_tp_size: Some(4),
        parallelism_config_dp_shard_size: Some(1),
        ..LaunchArgs::default()
    };
    let e = LaunchPlan::resolve(&flags, Some(&zero2_file)).unwrap_err().to_string();
    assert!(
        e.ends_with(
            "the sizes multiply to 8 but the job has 4 processes; with tp 4 and 4 processes set dp_replicate_size 1"
        ),
        "{e}"
    );
}

#[test]
fn a_written_fsdp_block_round_trips_with_the_keys_python_accelerate_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fsdp.yaml");
    let mut cfg = AccelerateConfig::load(&fixture("accelerate_fsdp_two_machines.yaml")).unwrap().config;
    cfg.set_sharding_strategy(ShardingStrategy::ShardOptim);
    cfg.save(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        text.contains(
            "fsdp_config:\n  fsdp_activation_checkpointing: false\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
             fsdp_cpu_ram_efficient_loading: true\n  fsdp_offload_params: false\n  fsdp_sharding_strategy: \
             SHARD_OPTIM\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n  fsdp_version: 2\n"
        ),
        "{text}"
    );
    let back = AccelerateConfig::load(&path).unwrap().config;
    assert_eq!(back, cfg);
    assert_eq!(back.sharding_strategy().unwrap(), ShardingStrategy::ShardOptim);
}

#[test]
fn unknown_keys_are_errors_naming_the_file_the_line_and_the_closest_key() {
    // Accelerate refuses unknown keys; a misspelled `num_processes` must not silently run 1 process.
    let text = std::fs::read_to_string(fixture("accelerate_multi_gpu.yaml")).unwrap()
        + "num_proceses: 4
";
    let e = AccelerateConfig::parse(&text, Path::new("cfg.yaml")).unwrap_err();
    assert!(matches!(e, CliError::ConfigValue { .. }), "{e}");
    let line = text.lines().count();
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!(
            "config file cfg.yaml: line {line}: unknown key `num_proceses` (did you mean `num_processes`?)"
        )),
        "{msg}"
    );
}

#[test]
fn written_files_round_trip_and_quote_no() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nested/dir/default_config.yaml");
    let cfg = AccelerateConfig {
        distributed_type: DistributedType::MultiCpu,
        num_processes: Some(4),
        num_machines: 2,
        machine_rank: 1,
        main_process_ip: Some("10.0.0.7".into()),
        main_process_port: Some(29555),
        use_cpu: true,
        parallelism_config: Some(ParallelismConfig::data_parallel(4)),
        ..AccelerateConfig::default()
    };
    cfg.save(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    // YAML 1.1 readers (PyYAML) turn a bare `no` into false: it must be quoted.
    assert!(text.contains("mixed_precision: \"no\"") || text.contains("mixed_precision: 'no'"), "{text}");
    assert!(!text.contains("null"), "unset keys are omitted like Python's to_dict: {text}");
    // Keys come out sorted, like yaml.safe_dump.
    let keys: Vec<&str> = text.lines().filter(|l| !l.starts_with(' ')).filter_map(|l| l.split(':').next()).collect();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(keys, sorted);
    let back = AccelerateConfig::load(&path).unwrap();
    assert_eq!(back.config, cfg);
    assert!(back.warnings.is_empty(), "{:?}", back.warnings);
}

#[test]
fn a_bare_no_and_other_yaml_1_1_spellings_are_read() {
    let text = "distributed_type: NO\nmixed_precision: no\ndowncast_bf16: no\nuse_cpu: yes\nnum_processes: 1\n";
    let c = AccelerateConfig::parse(text, Path::new("x.yaml")).unwrap().config;
    assert_eq!(c.mixed_precision, MixedPrecision::No);
    assert_eq!(c.distributed_type, DistributedType::No);
    assert_eq!(c.downcast_bf16, "no");
    assert!(c.use_cpu);
}

#[test]
fn json_configs_are_read_too() {
    let text = r#"{"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "mixed_precision": "fp16",
                   "num_processes": 3, "use_cpu": true}"#;
    let c = AccelerateConfig::parse(text, Path::new("default_config.json")).unwrap().config;
    assert_eq!(
        (c.distributed_type, c.mixed_precision, c.num_processes),
        (DistributedType::MultiCpu, MixedPrecision::Fp16, Some(3))
    );
}

#[test]
fn malformed_yaml_reports_the_file_and_the_position_once() {
    let text = "compute_environment: LOCAL_MACHINE\nnum_processes: 2\nmixed_precision: [bf16\nuse_cpu: false\n";
    let e = AccelerateConfig::parse(text, Path::new("bad.yaml")).unwrap_err();
    let CliError::ConfigSyntax { line, column, .. } = &e else { panic!("expected a syntax error, got {e}") };
    assert!(*line >= 3, "{e}");
    assert!(*column >= 1, "{e}");
    let msg = e.to_string();
    assert!(msg.starts_with(&format!("config file bad.yaml: line {line}, column {column}: ")), "{msg}");
    // The position once; the only other "line" is the hint naming where the unclosed `[` opens.
    assert_eq!(msg.matches("column").count(), 1, "{msg}");
    assert!(msg.contains("(line 3 opens a `[` that is never closed"), "{msg}");
    assert!(!msg.contains("<input>") && !msg.contains("invalid type: sequence"), "{msg}");

    let e = AccelerateConfig::parse("num_machines: 1\nnum_processes: two\n", Path::new("t.yaml")).unwrap_err();
    assert!(matches!(e, CliError::ConfigSyntax { line: 2, .. }), "{e}");
    assert!(e
        .to_string()
        .ends_with("num_processes: expected a whole number ≥ 1 (or -1: decided at launch), got `two`"));
    let e = AccelerateConfig::parse("   \n", Path::new("empty.yaml")).unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
}

#[test]
fn a_failed_save_leaves_no_partial_file() {
    let dir = tempfile::tempdir().unwrap();
    // The parent "directory" is a file: creating the temporary file fails before anything is written.
    let blocker = dir.path().join("not_a_dir");
    std::fs::write(&blocker, "x").unwrap();
    let target = blocker.join("default_config.yaml");
    assert!(AccelerateConfig::default().save(&target).is_err());
    assert!(!target.exists());
    // Renaming onto a directory fails after the temporary file was written: it is removed again.
    let target = dir.path().join("occupied");
    std::fs::create_dir(&target).unwrap();
    std::fs::write(target.join("keep"), "x").unwrap();
    assert!(AccelerateConfig::default().save(&target).is_err());
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 2, "only the blocker file and the directory remain: {left:?}");
}
