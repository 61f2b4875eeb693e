//! The `accel` binary end to end (assert_cmd): config (interactive and default), launch, bad inputs, env, test.

use accel::MixedPrecision;
use accel_cli::{AccelerateConfig, DistributedType};
use assert_cmd::Command;
use predicates::prelude::*;
use std::path::Path;
use std::time::Duration;

/// The binary with a clean environment for config lookups: HF_HOME points into `home` so the user's own
/// default config never leaks into a test.
fn accel(home: &Path) -> Command {
    let mut c = Command::cargo_bin("accel").unwrap();
    c.env("HF_HOME", home.join("hf")).env_remove("RANK").env_remove("WORLD_SIZE").timeout(Duration::from_secs(300));
    c
}

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

#[test]
fn interactive_config_with_piped_answers_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cfg.yaml");
    // cpu; 2 machines; rank 1; main 10.0.0.5; port 0 (refused) then 29600; same network; 3 processes (refused:
    // not divisible) then 4; tp 2; pp 1; dp_shard 1; fp8 (refused) then bf16.
    let answers = "cpu\n2\n1\n10.0.0.5\n0\n29600\nyes\n3\n4\n2\n\n\nfp8\nbf16\n";
    accel(dir.path())
        .args(["config", "--config-file"])
        .arg(&path)
        .write_stdin(answers)
        .assert()
        .success()
        .stdout(predicate::str::contains("invalid answer \"3\""))
        .stdout(predicate::str::contains("invalid answer \"fp8\""))
        .stdout(predicate::str::contains("wrote"));
    let c = AccelerateConfig::load(&path).unwrap().config;
    assert_eq!((c.num_machines, c.machine_rank, c.num_processes), (2, 1, Some(4)));
    assert_eq!((c.main_process_ip.as_deref(), c.main_process_port), (Some("10.0.0.5"), Some(29600)));
    assert_eq!(
        (c.mixed_precision, c.distributed_type, c.use_cpu),
        (MixedPrecision::Bf16, DistributedType::MultiCpu, true)
    );
    assert_eq!(c.parallelism_config, Some(accel_cli::ParallelismConfig::data_parallel(2).with_tp_size(2)));
}

#[test]
fn interactive_config_with_a_pipeline_writes_a_file_launch_runs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cfg.yaml");
    // cpu; 1 machine; 4 processes; tp 1; pp 2; dp_shard 1 (of the 2 data-parallel processes); Interleaved1F1B; 3
    // micro-batches (refused: 4 stages) then 6; no.
    accel(dir.path())
        .args(["config", "--config-file"])
        .arg(&path)
        .write_stdin("cpu\n1\n4\n1\n2\n\nInterleaved1F1B\n3\n6\nno\n")
        .assert()
        .success()
        .stdout(predicate::str::contains(
            "invalid answer \"3\": invalid configuration pipeline_parallel_microbatches = \"3\": 3 micro-batches \
             cannot fill the 4 pipeline stages (pp 2 × 2 per rank)",
        ));
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        text.contains(
            "  parallelism_config_pp_size: 2\n  parallelism_config_tp_size: 1\n  pipeline_parallel_microbatches: 6\n  \
             pipeline_parallel_schedule: Interleaved1F1B\n"
        ),
        "{text}"
    );
    let p = AccelerateConfig::load(&path).unwrap().config.parallelism_config.unwrap();
    assert_eq!((p.dp_replicate_size, p.pp_size, p.pp_microbatches_per_step(), p.pp_stages_per_rank()), (2, 2, 6, 2));
    // `accel launch` runs it: the workers get the pipeline settings.
    let out = accel(dir.path())
        .args(["launch", "--config-file"])
        .arg(&path)
        .args(["sh", "-c", "echo \"rank=$RANK $PARALLELISM_CONFIG_PP_SCHEDULE $PARALLELISM_CONFIG_PP_MICROBATCHES\""])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("rank=3 Interleaved1F1B 6"));
}

#[test]
fn interactive_config_that_ends_early_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out/cfg.yaml");
    accel(dir.path())
        .args(["config", "--config-file"])
        .arg(&path)
        .write_stdin("cpu\n1\n")
        .assert()
        .failure()
        .code(1)
        .stderr(predicate::str::contains("input ended").and(predicate::str::contains("no config file was written")));
    assert!(!path.exists());
}

#[test]
fn config_default_writes_to_hf_home_and_keeps_an_existing_file() {
    let dir = tempfile::tempdir().unwrap();
    accel(dir.path()).args(["config", "default", "--mixed-precision", "bf16"]).assert().success();
    let path = dir.path().join("hf/accelerate/default_config.yaml");
    let c = AccelerateConfig::load(&path).unwrap().config;
    assert_eq!((c.mixed_precision, c.num_processes), (MixedPrecision::Bf16, Some(1)));
    // Refuses to overwrite, as `accelerate config default` does; --force replaces it.
    accel(dir.path())
        .args(["config", "default"])
        .assert()
        .failure()
        .stderr(predicate::str::contains("already exists").and(predicate::str::contains("--force")));
    accel(dir.path()).args(["config", "default", "--force"]).assert().success();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("mixed_precision: \"no\"") || text.contains("mixed_precision: 'no'"), "{text}");
}

#[test]
fn launch_runs_two_ranks_with_the_torchrun_and_accelerate_environment() {
    let dir = tempfile::tempdir().unwrap();
    let script = "echo \"rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE mp=$ACCELERATE_MIXED_PRECISION \
                  ga=$ACCELERATE_GRADIENT_ACCUMULATION_STEPS cpu=$ACCELERATE_USE_CPU arg=$1\"";
    let out = accel(dir.path())
        .args(["launch", "--num-processes", "2", "--mixed-precision", "bf16", "--gradient-accumulation-steps", "4"])
        .args(["--cpu", "sh", "-c", script, "sh", "--flag-for-program"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let out = String::from_utf8(out).unwrap();
    for r in 0..2 {
        let want = format!("rank={r} local={r} world=2 mp=bf16 ga=4 cpu=true arg=--flag-for-program");
        assert!(out.contains(&want), "missing {want:?} in:\n{out}");
    }
}

#[test]
fn launch_takes_settings_from_the_config_file_and_flags_override_them() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("cfg.yaml");
    std::fs::write(&cfg, "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: fp16\nuse_cpu: true\n")
        .unwrap();
    let script = "echo \"rank=$RANK world=$WORLD_SIZE mp=$ACCELERATE_MIXED_PRECISION\"";
    let out =
        accel(dir.path()).args(["launch", "--config-file"]).arg(&cfg).args(["sh", "-c", script]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("rank=1 world=2 mp=fp16"), "{stdout}");
    let out = accel(dir.path())
        .args(["launch", "--config-file"])
        .arg(&cfg)
        .args(["--num-processes", "1", "--mixed-precision", "no", "sh", "-c", script])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("rank=0 world=1 mp=no") && !stdout.contains("rank=1"), "{stdout}");
}

#[test]
fn launch_prints_one_banner_naming_the_default_config_that_changed_the_run() {
    // `accel config default --mixed-precision bf16` once; a later plain launch is bf16, and its banner says why.
    let dir = tempfile::tempdir().unwrap();
    accel(dir.path()).args(["config", "default", "--mixed-precision", "bf16"]).assert().success();
    let default = dir.path().join("hf/accelerate/default_config.yaml");
    let out = accel(dir.path())
        .args(["launch", "-n", "2", "sh", "-c", "echo \"rank=$RANK banner=$ACCEL_LAUNCH_BANNER\""])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    let settings = "2 processes × 1 machine | dp_replicate 2 × dp_shard 1 × tp 1 × pp 1 | mixed precision bf16 | \
                    gradient accumulation 1 | backend cpu";
    let banner = format!(
        "accel launch: config {} (the default config file, where `accel config` writes; it set mixed precision \
         bf16) | {settings}",
        default.display()
    );
    assert_eq!(stderr.lines().filter(|l| l.starts_with("accel launch: config")).collect::<Vec<_>>(), [banner]);
    // The workers get the settings it printed, so that an Accelerator program does not print them again.
    assert!(stdout.contains(&format!("[rank 1] rank=1 banner={settings}")), "{stdout}");

    // No config file: "none: defaults"; flags appear in the banner.
    std::fs::remove_file(&default).unwrap();
    let out = accel(dir.path())
        .args(["launch", "-n", "4", "--gradient-accumulation-steps", "2", "--parallelism-config-tp-size", "2"])
        .args(["--parallelism-config-dp-replicate-size", "2", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.lines().any(|l| l
            == "accel launch: config none: defaults | 4 processes × 1 machine | dp_replicate 2 × dp_shard 1 × tp 2 × \
                pp 1 | mixed precision no | gradient accumulation 2 | backend cpu"),
        "{stderr}"
    );
}

#[test]
fn a_pipeline_layout_is_launched_with_its_schedule_and_with_dp_shard() {
    // pp 2 × tp 2 on 4 processes with a schedule and micro-batches: every worker gets them.
    let dir = tempfile::tempdir().unwrap();
    let script = "echo \"started pp=$PARALLELISM_CONFIG_PP_SIZE tp=$PARALLELISM_CONFIG_TP_SIZE \
                  schedule=$PARALLELISM_CONFIG_PP_SCHEDULE m=$PARALLELISM_CONFIG_PP_MICROBATCHES\"";
    let out = accel(dir.path())
        .args(["launch", "-n", "4", "--parallelism-config-pp-size", "2", "--parallelism-config-tp-size", "2"])
        .args(["--pipeline-parallel-schedule", "gpipe", "--pipeline_parallel_microbatches", "4"])
        .args(["sh", "-c", script])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    for r in 0..4 {
        let want = format!("[rank {r}] started pp=2 tp=2 schedule=GPipe m=4");
        assert!(stdout.contains(&want), "missing {want:?} in:\n{stdout}");
    }
    // The banner names the schedule after the layout.
    assert!(
        stderr.lines().any(|l| l
            == "accel launch: config none: defaults | 4 processes × 1 machine | dp_replicate 1 × dp_shard 1 × tp 2 × \
                pp 2 (GPipe, 4 micro-batches) | mixed precision no | gradient accumulation 1 | backend cpu"),
        "{stderr}"
    );
    // The default schedule and count travel as absence (the workers' defaults: 1F1B, one per stage).
    let out = accel(dir.path())
        .args(["launch", "-n", "2", "--parallelism-config-pp-size", "2", "sh", "-c", script])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("[rank 1] started pp=2 tp=1 schedule= m="));

    // dp_shard 2 × pp 2 on 4 processes: every worker gets both (each stage sharded over its dp_shard ranks).
    let out = accel(dir.path())
        .args(["launch", "-n", "4", "--parallelism-config-dp-shard-size", "2", "--parallelism-config-pp-size", "2"])
        .args(["sh", "-c", "echo \"started pp=$PARALLELISM_CONFIG_PP_SIZE shard=$PARALLELISM_CONFIG_DP_SHARD_SIZE\""])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("[rank 3] started pp=2 shard=2"));
    // Pipeline settings that do not fit: refused before any worker starts, naming the key and what fits.
    let out = accel(dir.path())
        .args(["launch", "-n", "2", "--parallelism-config-pp-size", "2", "--pipeline-parallel-microbatches", "1"])
        .args(["sh", "-c", "echo started"])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1));
    assert!(!stdout.contains("started"), "{stdout}");
    assert_eq!(
        stderr.trim(),
        "accel: error: invalid configuration pipeline_parallel_microbatches = \"1\": 1 micro-batch cannot fill the 2 \
         pipeline stages (pp 2 × 1 per rank): each stage would idle most of the step; use at least 2"
    );
    // A schedule clap does not know is a usage error (status 2) listing the choices.
    accel(dir.path())
        .args(["launch", "--pipeline-parallel-schedule", "zigzag", "true"])
        .assert()
        .failure()
        .code(2)
        .stderr(predicate::str::contains("expected one of GPipe, 1F1B, Interleaved1F1B"));
    // Accelerate's FSDP2 file asks for FULL_SHARD (ZeRO-3): launched (here on one machine, its 4 processes), every
    // worker told the strategy, the banner naming it after dp_shard.
    let out = accel(dir.path())
        .args(["launch", "--config-file"])
        .arg(fixture("accelerate_fsdp_two_machines.yaml"))
        .args(["--num-machines", "1", "--machine-rank", "0", "--main-process-ip", "127.0.0.1"])
        .args(["--main-process-port", "0", "--cpu", "sh", "-c"])
        .arg("echo \"started rank=$RANK shard=$PARALLELISM_CONFIG_DP_SHARD_SIZE strategy=$FSDP_SHARDING_STRATEGY\"")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    for r in 0..4 {
        let want = format!("[rank {r}] started rank={r} shard=2 strategy=FULL_SHARD");
        assert!(stdout.contains(&want), "missing {want:?} in:\n{stdout}");
    }
    assert!(
        stderr.lines().any(|l| l.starts_with("accel launch: config ")
            && l.ends_with(
                "| 4 processes × 1 machine | dp_replicate 2 × dp_shard 2 (FULL_SHARD) × tp 1 × pp 1 | mixed precision \
                 no | gradient accumulation 1 | backend cpu"
            )),
        "{stderr}"
    );
    // A strategy clap does not know is a usage error (status 2) listing the names.
    accel(dir.path())
        .args(["launch", "--fsdp_sharding_strategy", "zero2", "true"])
        .assert()
        .failure()
        .code(2)
        .stderr(predicate::str::contains("expected one of NO_SHARD, SHARD_OPTIM (ZeRO-1), SHARD_GRAD_OP (ZeRO-2)"));
}

#[test]
fn an_fsdp_file_and_a_sharded_accel_config_launch_with_their_strategy() {
    let dir = tempfile::tempdir().unwrap();
    let script = "echo \"rank=$RANK shard=$PARALLELISM_CONFIG_DP_SHARD_SIZE strategy=$FSDP_SHARDING_STRATEGY\"";
    // Accelerate's FSDP file with FSDP2's `fsdp_reshard_after_forward: false` (SHARD_GRAD_OP): both processes shard.
    let cfg = dir.path().join("fsdp.yaml");
    std::fs::write(
        &cfg,
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: false\n  fsdp_version: 2\n\
         num_processes: 2\nuse_cpu: true\n",
    )
    .unwrap();
    let out =
        accel(dir.path()).args(["launch", "--config-file"]).arg(&cfg).args(["sh", "-c", script]).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("[rank 1] rank=1 shard=2 strategy=SHARD_GRAD_OP"), "{stdout}");
    assert_eq!(
        stderr.lines().filter(|l| l.starts_with("accel: warning:")).collect::<Vec<_>>(),
        [format!(
            "accel: warning: {}: fsdp_config: `fsdp_version` asks for FSDP features accel does not implement (it \
             reads only `fsdp_offload_params`, `fsdp_reshard_after_forward` and `fsdp_sharding_strategy`, and has no \
             wrapping policy to set: the model's own blocks are the units); ignored",
            cfg.display()
        )]
    );
    assert!(
        stderr.lines().any(|l| l
            == format!(
                "accel launch: config {} (it set 2 processes, distributed_type FSDP) | 2 processes × 1 machine | \
                 dp_replicate 1 × dp_shard 2 (SHARD_GRAD_OP) × tp 1 × pp 1 | mixed precision no | gradient \
                 accumulation 1 | backend cpu",
                cfg.display()
            )),
        "{stderr}"
    );
    // The flag overrides the file.
    let out = accel(dir.path())
        .args(["launch", "--config-file"])
        .arg(&cfg)
        .args(["--fsdp-sharding-strategy", "no_shard", "sh", "-c", script])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("[rank 0] rank=0 shard=2 strategy=NO_SHARD"));

    // `accel config` with dp_shard 2 and FULL_SHARD writes a MULTI_CPU file with `fsdp_config`, which launches.
    let path = dir.path().join("cfg.yaml");
    // cpu; 1 machine; 2 processes; tp 1; pp 1; dp_shard 2; `zero3` (re-asked) then FULL_SHARD; no.
    accel(dir.path())
        .args(["config", "--config-file"])
        .arg(&path)
        .write_stdin("cpu\n1\n2\n\n\n2\nzero3\nFULL_SHARD\nno\n")
        .assert()
        .success()
        .stdout(predicate::str::contains(
            "invalid answer \"zero3\": choose one of SHARD_GRAD_OP, FULL_SHARD, SHARD_OPTIM, NO_SHARD",
        ));
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("distributed_type: MULTI_CPU\n"), "{text}");
    assert!(text.contains("fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"), "{text}");
    let out =
        accel(dir.path()).args(["launch", "--config-file"]).arg(&path).args(["sh", "-c", script]).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("[rank 1] rank=1 shard=2 strategy=FULL_SHARD"), "{stdout}");
    assert!(!stderr.contains("warning"), "{stderr}");
    assert!(
        stderr.lines().any(|l| l
            == format!(
                "accel launch: config {} (it set 2 processes, the layout dp_replicate 1 × dp_shard 2 (FULL_SHARD) × \
                 tp 1 × pp 1) | 2 processes × 1 machine | dp_replicate 1 × dp_shard 2 (FULL_SHARD) × tp 1 × pp 1 | \
                 mixed precision no | gradient accumulation 1 | backend cpu",
                path.display()
            )),
        "{stderr}"
    );
}

#[test]
fn launch_reports_the_first_failing_rank_and_its_status() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 1 fails at once; rank 0 would sleep for a long time and must be stopped by the launcher.
    accel(dir.path())
        .args(["launch", "-n", "2", "sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 120"])
        .assert()
        .failure()
        .code(1)
        .stderr(predicate::str::contains("rank 1").and(predicate::str::contains("exit code 3")));
}

#[test]
fn launch_refuses_bad_inputs_with_clear_messages() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path();
    accel(home)
        .args(["launch", "--mixed-precision", "fp8", "sh", "-c", "true"])
        .assert()
        .failure()
        .code(2)
        .stderr(predicate::str::contains("fp8").and(predicate::str::contains("bf16")));
    accel(home)
        .args(["launch", "-n", "3", "--num-machines", "2", "--main-process-ip", "127.0.0.1", "sh", "-c", "true"])
        .assert()
        .failure()
        .code(1)
        .stderr(predicate::str::contains("not divisible by num_machines (2)"));
    accel(home).args(["launch", "-n", "2"]).assert().failure().code(2).stderr(predicate::str::contains("<PROGRAM>"));
    accel(home)
        .args(["launch", "./no/such/program"])
        .assert()
        .failure()
        .code(1)
        .stderr(predicate::str::contains("not found"));
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    accel(home)
        .args(["launch", "--main-process-port", &port, "sh", "-c", "true"])
        .assert()
        .failure()
        .code(1)
        .stderr(predicate::str::contains(format!("port {port}")).and(predicate::str::contains("already in use")));
    accel(home)
        .args(["launch", "--config-file"])
        .arg(home.join("missing.yaml"))
        .args(["sh", "-c", "true"])
        .assert()
        .failure()
        .stderr(predicate::str::contains("does not exist"));
}

#[test]
fn launch_with_malformed_yaml_shows_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.yaml");
    std::fs::write(&cfg, "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: {bf16\n").unwrap();
    accel(dir.path())
        .args(["launch", "--config-file"])
        .arg(&cfg)
        .args(["sh", "-c", "true"])
        .assert()
        .failure()
        .code(1)
        .stderr(predicate::str::contains("bad.yaml").and(predicate::str::is_match(r"line 3, column \d+").unwrap()));
}

#[test]
fn launch_with_a_misspelled_key_is_refused_with_a_suggestion() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("accelerate.yaml");
    let text = std::fs::read_to_string(fixture("accelerate_1_15_multi_cpu.yaml")).unwrap() + "num_proceses: 3\n";
    std::fs::write(&cfg, text).unwrap();
    accel(dir.path())
        .args(["launch", "--config-file"])
        .arg(&cfg)
        .args(["sh", "-c", "echo ran"])
        .assert()
        .failure()
        .code(1)
        .stdout(predicate::str::contains("ran").not())
        .stderr(
            predicate::str::contains(format!("accel: error: config file {}: line", cfg.display()))
                .and(predicate::str::contains("unknown key `num_proceses` (did you mean `num_processes`?)")),
        );
}

#[test]
fn launch_with_a_real_accelerate_file_and_multi_gpu_flag_spellings_runs() {
    let dir = tempfile::tempdir().unwrap();
    accel(dir.path())
        .args(["launch", "--cpu", "--config_file"])
        .arg(fixture("accelerate_multi_gpu.yaml"))
        .args(["--num_cpu_threads_per_process", "1", "--rdzv_backend", "c10d"])
        .args(["sh", "-c", "echo \"rank=$RANK mp=$ACCELERATE_MIXED_PRECISION omp=$OMP_NUM_THREADS\""])
        .assert()
        .success()
        .stderr(predicate::str::contains("warning: rdzv_backend \"c10d\" is not used"))
        .stdout(predicate::str::contains("rank=1 mp=bf16 omp=1"));
}

#[test]
fn env_reports_versions_hardware_and_the_active_config() {
    let dir = tempfile::tempdir().unwrap();
    accel(dir.path())
        .arg("env")
        .assert()
        .success()
        .stdout(predicate::str::contains(format!("accel version: {}", env!("CARGO_PKG_VERSION"))))
        .stdout(predicate::str::contains("candle version:"))
        .stdout(predicate::str::contains("rustc"))
        .stdout(predicate::str::contains("CPU cores available:"))
        .stdout(predicate::str::contains("GPUs:"))
        .stdout(predicate::str::contains("config file: none"));
    if !cfg!(feature = "cuda") {
        accel(dir.path()).arg("env").assert().stdout(predicate::str::contains("CUDA support: not compiled in"));
    }
    let cfg = dir.path().join("hf/accelerate/default_config.yaml");
    std::fs::create_dir_all(cfg.parent().unwrap()).unwrap();
    std::fs::copy(fixture("accelerate_multi_gpu.yaml"), &cfg).unwrap();
    accel(dir.path())
        .arg("env")
        .assert()
        .success()
        .stdout(predicate::str::contains(format!("config file: {}", cfg.display())))
        .stdout(predicate::str::contains("    distributed_type: MULTI_GPU"));
}

#[test]
fn self_test_passes_on_two_processes() {
    let dir = tempfile::tempdir().unwrap();
    accel(dir.path())
        .args(["test", "--num-processes", "2"])
        .assert()
        .success()
        .stdout(predicate::str::contains("PASS"))
        .stdout(predicate::str::contains("FAIL").not())
        .stdout(predicate::str::contains("DDP 2×4 = 1×8 (fp32)"))
        .stdout(predicate::str::contains("DDP 2×4 = 1×8 (bf16)"))
        .stdout(predicate::str::contains("Accelerator 2×4 = 1×8 (fp32)"))
        .stdout(predicate::str::contains("Accelerator 2×4 = 1×8 (bf16)"))
        .stdout(predicate::str::contains("all 11 checks PASSED"));
}

#[test]
fn self_test_reports_a_wrong_collective_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let out = accel(dir.path()).args(["test", "-n", "2"]).env("ACCEL_SELF_TEST_FAULT_RANK", "1").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let sum_line = stdout.lines().find(|l| l.starts_with("all_reduce sum (f32)")).expect("the table has the sum row");
    assert!(
        sum_line.contains("FAIL") && sum_line.contains("expected [3.0, -3.0, 1.0], got [4.0, -3.0, 1.0]"),
        "{sum_line}"
    );
    assert_eq!(stdout.matches("FAIL").count(), 1, "only the faulty check fails:\n{stdout}");
    assert!(stderr.contains("1 of 11 checks FAILED"), "{stderr}");
}

#[test]
fn launch_log_dir_writes_per_rank_files_and_tee_also_prints() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let out = accel(dir.path())
        .args(["launch", "-n", "2", "--log-dir"])
        .arg(&logs)
        .args(["sh", "-c", "echo quiet-line-$RANK"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("quiet-line"), "without --tee output goes to files only");
    let all_logs: String = std::fs::read_dir(&logs)
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(all_logs.contains("quiet-line-0") && all_logs.contains("quiet-line-1"), "{all_logs}");

    accel(dir.path())
        .args(["launch", "-n", "2", "--tee", "--log-dir"])
        .arg(dir.path().join("logs2"))
        .args(["sh", "-c", "echo teed-line-$RANK"])
        .assert()
        .success()
        .stdout(predicate::str::contains("teed-line-0").and(predicate::str::contains("teed-line-1")));
}

#[test]
fn launch_max_restarts_reruns_a_failed_group() {
    let dir = tempfile::tempdir().unwrap();
    // Fails the first time (leaving a marker), succeeds when restarted.
    let marker = dir.path().join("attempted");
    let script = format!("if [ -f '{0}' ]; then echo second-attempt; else touch '{0}'; exit 7; fi", marker.display());
    accel(dir.path())
        .args(["launch", "-n", "1", "sh", "-c", &script])
        .assert()
        .failure()
        .stderr(predicate::str::contains("exit code 7"));
    std::fs::remove_file(&marker).unwrap();
    accel(dir.path())
        .args(["launch", "-n", "1", "--max-restarts", "1", "sh", "-c", &script])
        .assert()
        .success()
        .stdout(predicate::str::contains("second-attempt"));
}

#[test]
fn launch_under_auto_reads_the_memory_it_passes_on_once_before_any_worker_starts() {
    let dir = tempfile::tempdir().unwrap();
    // A size the workers' chooser could not read: refused by the launcher, naming the variable; nothing runs.
    accel(dir.path())
        .env("ACCEL_AUTO_LAYOUT_MEMORY", "lots")
        .args(["launch", "-n", "2", "--parallelism", "auto", "sh", "-c", "echo worker-ran"])
        .assert()
        .failure()
        .stdout(predicate::str::contains("worker-ran").not())
        .stderr(predicate::str::contains("ACCEL_AUTO_LAYOUT_MEMORY").and(predicate::str::contains("350MiB")));
    // A readable one reaches the workers unchanged.
    accel(dir.path())
        .env("ACCEL_AUTO_LAYOUT_MEMORY", "350MiB")
        .args([
            "launch",
            "-n",
            "2",
            "--parallelism",
            "auto",
            "sh",
            "-c",
            "echo worker-memory=$ACCEL_AUTO_LAYOUT_MEMORY",
        ])
        .assert()
        .success()
        .stdout(predicate::str::contains("worker-memory=350MiB"));
}
