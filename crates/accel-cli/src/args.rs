//! The `accel` command line, as clap definitions (parsed by the binary, executed by [`crate::run`]).
//!
//! Flag names follow `accelerate launch` with dashes; the underscore spellings of Accelerate
//! (`--num_processes`) and torchrun's names (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`,
//! `--nproc-per-node`) are accepted as aliases so existing launch scripts migrate by changing the program name.

use accel::pipeline::ScheduleKind;
use accel::ShardingStrategy;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// `--pipeline-parallel-schedule`: [`ScheduleKind`]'s spellings, case-insensitive.
fn parse_schedule(s: &str) -> Result<ScheduleKind, String> {
    s.parse().map_err(|_| format!("expected one of {}", ScheduleKind::CHOICES))
}

/// `--fsdp-sharding-strategy`: [`ShardingStrategy`]'s spellings (FSDP's names, `SHARD_OPTIM`, torch's numbers).
fn parse_sharding_strategy(s: &str) -> Result<ShardingStrategy, String> {
    s.parse().map_err(|_| format!("expected one of {}", ShardingStrategy::NAMES))
}

/// `accel`: configure, launch and check distributed candle training (like `accelerate` / `torchrun`).
#[derive(Debug, Parser)]
#[command(name = "accel", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once per process; boxing would only add noise to every match
pub enum Command {
    /// Write an Accelerate config file by answering questions on stdin (or `accel config default`).
    Config(ConfigArgs),
    /// Run a program on N processes (on one or several machines) with torchrun's environment.
    Launch(LaunchArgs),
    /// Run the built-in distributed self-check (collectives and a tiny training run) and print PASS/FAIL.
    Test(TestArgs),
    /// Print versions, hardware and the active config: the text to paste into a bug report.
    Env(EnvArgs),
    /// Internal: one rank of `accel test` (started by `accel test` itself).
    #[command(name = "self-test-worker", hide = true)]
    SelfTestWorker,
}

/// `accel config [--config-file F]` and `accel config default ...`.
#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// Where to write the config (default: $HF_HOME/accelerate/default_config.yaml).
    #[arg(long, alias = "config_file", value_name = "FILE")]
    pub config_file: Option<PathBuf>,
    /// Write a default config without questions.
    #[command(subcommand)]
    pub action: Option<ConfigAction>,
}

/// Subcommands of `accel config`.
#[derive(Debug, Subcommand)]
pub enum ConfigAction {
    /// Write a config for this machine without asking (one process; GPUs when built with CUDA and present).
    Default(ConfigDefaultArgs),
}

/// `accel config default`.
#[derive(Debug, Args)]
pub struct ConfigDefaultArgs {
    /// Compute precision to record.
    #[arg(long, alias = "mixed_precision", value_name = "MODE", default_value = "no",
          value_parser = ["no", "fp16", "bf16"])]
    pub mixed_precision: String,
    /// Where to write the config (default: $HF_HOME/accelerate/default_config.yaml).
    #[arg(long, alias = "config_file", value_name = "FILE")]
    pub config_file: Option<PathBuf>,
    /// Replace an existing file (by default an existing config is kept, as `accelerate config default` does).
    #[arg(long)]
    pub force: bool,
}

/// `accel launch [flags] <program> [args...]`. Every flag overrides the config file, which overrides the defaults.
#[derive(Debug, Args, Default, Clone)]
pub struct LaunchArgs {
    /// Config file (default: $HF_HOME/accelerate/default_config.yaml when it exists).
    #[arg(long, alias = "config_file", value_name = "FILE")]
    pub config_file: Option<PathBuf>,
    /// Total number of processes over all machines (default 1).
    #[arg(short = 'n', long, alias = "num_processes", value_name = "N", conflicts_with = "nproc_per_node")]
    pub num_processes: Option<usize>,
    /// torchrun spelling: processes PER MACHINE (the total is this × --num-machines).
    #[arg(long, alias = "nproc_per_node", value_name = "N")]
    pub nproc_per_node: Option<usize>,
    /// Number of machines (default 1), or torchrun's elastic `MIN:MAX`: the job trains on whichever machines are
    /// there (at least MIN), and re-forms when one is lost or arrives. Run `accel launch` once on each.
    #[arg(long, visible_alias = "nnodes", alias = "num_machines", value_name = "N|MIN:MAX",
          value_parser = MachineCount::parse)]
    pub num_machines: Option<MachineCount>,
    /// Rank of this machine, 0..num_machines (default 0; machine 0 hosts the rendezvous store).
    #[arg(long, visible_alias = "node-rank", aliases = ["machine_rank", "node_rank"], value_name = "R")]
    pub machine_rank: Option<usize>,
    /// Address of the machine of rank 0 (default 127.0.0.1; required with several machines).
    #[arg(long, visible_alias = "master-addr", aliases = ["main_process_ip", "master_addr"], value_name = "ADDR")]
    pub main_process_ip: Option<String>,
    /// Rendezvous port on machine 0 (single machine default: a free port; several machines: 29500).
    #[arg(long, visible_alias = "master-port", aliases = ["main_process_port", "master_port"], value_name = "PORT")]
    pub main_process_port: Option<u16>,
    /// torchrun's `--rdzv-endpoint HOST:PORT`: machine 0's address and port in one flag (the same as
    /// `--main-process-ip HOST --main-process-port PORT`).
    #[arg(long, alias = "rdzv_endpoint", value_name = "HOST:PORT", conflicts_with_all = ["main_process_ip", "main_process_port"])]
    pub rdzv_endpoint: Option<String>,
    /// Compute precision passed to the workers (ACCELERATE_MIXED_PRECISION).
    #[arg(long, alias = "mixed_precision", value_name = "MODE", value_parser = ["no", "fp16", "bf16"])]
    pub mixed_precision: Option<String>,
    /// Micro-batches per optimizer step (ACCELERATE_GRADIENT_ACCUMULATION_STEPS).
    #[arg(long, alias = "gradient_accumulation_steps", value_name = "K",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub gradient_accumulation_steps: Option<u64>,
    /// Run on the CPU even where GPUs exist (ACCELERATE_USE_CPU=true).
    #[arg(long, alias = "use_cpu", conflicts_with = "multi_gpu")]
    pub cpu: bool,
    /// Accelerate's `--multi_gpu`: one process per GPU (ACCELERATE_USE_CPU=false, overriding `use_cpu` /
    /// MULTI_CPU of the config file); needs at least 2 processes.
    #[arg(long, alias = "multi_gpu")]
    pub multi_gpu: bool,
    /// Threads each worker's CPU kernels use (OMP_NUM_THREADS and RAYON_NUM_THREADS, which candle reads).
    #[arg(long, alias = "num_cpu_threads_per_process", value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub num_cpu_threads_per_process: Option<u64>,
    /// Pin each worker to its share of the CPU cores (ACCELERATE_CPU_AFFINITY=1).
    #[arg(long, alias = "enable_cpu_affinity")]
    pub enable_cpu_affinity: bool,
    /// Accelerate's flag for multi-machine jobs on one local network; accepted for compatibility (accel's
    /// rendezvous only needs every machine to reach --main-process-ip:--main-process-port).
    #[arg(long, alias = "same_network")]
    pub same_network: bool,
    /// torchrun's rendezvous backend (`static`, `c10d`, ...). accel always rendezvouses through its own TCP store
    /// on machine 0 with fixed machine ranks, as `static`; another value gets a warning.
    #[arg(long, alias = "rdzv_backend", value_name = "BACKEND")]
    pub rdzv_backend: Option<String>,
    /// GPUs the workers may use (`all` or `0,1`): CUDA_VISIBLE_DEVICES.
    #[arg(long, alias = "gpu_ids", value_name = "IDS")]
    pub gpu_ids: Option<String>,
    /// torchrun's rendezvous settings, `key=value` separated by commas: `last_call_timeout` (seconds an elastic
    /// round waits for more machines once MIN are there, default 30) and `join_timeout` (seconds the machines
    /// wait for each other, default 1800).
    #[arg(long, alias = "rdzv_conf", value_name = "KEY=VALUE,...")]
    pub rdzv_conf: Option<String>,
    /// Restart all workers up to this many times after a failure (default 0).
    #[arg(long, alias = "max_restarts", value_name = "N")]
    pub max_restarts: Option<usize>,
    /// Write each rank's output to DIR/ (with --log-dir, output goes to the files only unless --tee).
    #[arg(long, aliases = ["log_dir", "logs-dir"], value_name = "DIR")]
    pub log_dir: Option<PathBuf>,
    /// With --log-dir, also print worker output on the console. torchrun's `--tee=0..3` is accepted (0 = off).
    #[arg(long, value_name = "STREAMS", num_args = 0..=1, require_equals = true, default_missing_value = "3")]
    pub tee: Option<String>,
    /// Accelerate's debug mode for the workers (ACCELERATE_DEBUG_MODE=true: collective checks).
    #[arg(long)]
    pub debug: bool,
    /// Print which parameter the parallel plan gives which style (and its shape per rank), once, when the program
    /// prepares a model built with accel::nn's builder (ACCEL_PRINT_PLAN=1).
    #[arg(long, alias = "print_plan")]
    pub print_plan: bool,
    /// `auto`: the workers' Accelerator chooses every parallel size the other flags and the config file leave open
    /// — dp_replicate × dp_shard × tp × pp, the sharding strategy, the pipeline schedule and micro-batches — at
    /// start-up, from the program's model description, each process's memory (or ACCEL_AUTO_LAYOUT_MEMORY) and
    /// the links it measures (PARALLELISM_CONFIG_*_SIZE=auto; accel::auto_layout). Sizes given by
    /// --parallelism-config-* stay fixed.
    #[arg(long, value_name = "auto", value_parser = ["auto"], ignore_case = true)]
    pub parallelism: Option<String>,
    /// Data-parallel replicas (PARALLELISM_CONFIG_DP_REPLICATE_SIZE; overrides the config file's
    /// `parallelism_config` block). With every size 1 (the default) the job is data parallel over all processes.
    #[arg(long, alias = "parallelism_config_dp_replicate_size", value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub parallelism_config_dp_replicate_size: Option<u64>,
    /// Sharded data-parallel size (PARALLELISM_CONFIG_DP_SHARD_SIZE): the training state split over this many
    /// ranks as --fsdp-sharding-strategy says, alone, with dp_replicate (HSDP), tp or pp.
    #[arg(long, alias = "parallelism_config_dp_shard_size", value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub parallelism_config_dp_shard_size: Option<u64>,
    /// What the dp_shard ranks shard (FSDP_SHARDING_STRATEGY; overrides the config file's
    /// `fsdp_config.fsdp_sharding_strategy`): SHARD_GRAD_OP (ZeRO-2: gradients and optimizer state; the default),
    /// FULL_SHARD (ZeRO-3: the parameters too; the program builds its model from the prepared model's
    /// param_builder, as accel_gpt does), SHARD_OPTIM (ZeRO-1: optimizer state), NO_SHARD (plain DDP). Only read
    /// with dp_shard above 1.
    #[arg(long, alias = "fsdp_sharding_strategy", value_name = "STRATEGY", value_parser = parse_sharding_strategy)]
    pub fsdp_sharding_strategy: Option<ShardingStrategy>,
    /// Tensor-parallel size (PARALLELISM_CONFIG_TP_SIZE). The sizes must multiply to the number of processes.
    #[arg(long, alias = "parallelism_config_tp_size", value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub parallelism_config_tp_size: Option<u64>,
    /// Pipeline-parallel size (PARALLELISM_CONFIG_PP_SIZE; accel's own): pipeline ranks, each running its stages
    /// of the model. The program must split its model into stages (as accel_gpt does); see
    /// --pipeline-parallel-schedule and --pipeline-parallel-microbatches.
    #[arg(long, alias = "parallelism_config_pp_size", value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub parallelism_config_pp_size: Option<u64>,
    /// Pipeline schedule with pp > 1 (PARALLELISM_CONFIG_PP_SCHEDULE; torchtitan's `pipeline_parallel_schedule`):
    /// GPipe, 1F1B (default) or Interleaved1F1B, any case.
    #[arg(long, alias = "pipeline_parallel_schedule", value_name = "SCHEDULE", value_parser = parse_schedule)]
    pub pipeline_parallel_schedule: Option<ScheduleKind>,
    /// Micro-batches per optimizer step with pp > 1 (PARALLELISM_CONFIG_PP_MICROBATCHES; default one per stage, pp
    /// × virtual stages): at least the number of stages, a multiple of pp for Interleaved1F1B.
    #[arg(long, alias = "pipeline_parallel_microbatches", value_name = "M",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub pipeline_parallel_microbatches: Option<u64>,
    /// Model stages per pipeline rank with pp > 1 (PARALLELISM_CONFIG_PP_VIRTUAL_STAGES; Megatron's virtual
    /// pipeline size): 2 or more for Interleaved1F1B (its default 2), 1 for GPipe and 1F1B.
    #[arg(long, alias = "pipeline_parallel_virtual_stages", value_name = "V",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub pipeline_parallel_virtual_stages: Option<u64>,
    /// Context-parallel size (PARALLELISM_CONFIG_CP_SIZE): only 1, context parallelism is not implemented.
    #[arg(long, alias = "parallelism_config_cp_size", value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub parallelism_config_cp_size: Option<u64>,
    /// Communication backend of the workers (ACCEL_BACKEND): cpu, nccl or auto run under accel's own launcher;
    /// mpi hands the job to `mpirun` (the program must be built with the `mpi` feature).
    #[arg(long, value_name = "BACKEND", value_parser = ["cpu", "nccl", "mpi", "auto"])]
    pub backend: Option<String>,
    /// The program to run on every process (a path, or a name looked up on PATH).
    #[arg(value_name = "PROGRAM", required = true)]
    pub program: PathBuf,
    /// Arguments passed to the program.
    #[arg(value_name = "ARGS", trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

/// `accel test`.
#[derive(Debug, Args)]
pub struct TestArgs {
    /// Number of processes to check with (at least 1).
    #[arg(short = 'n', long, aliases = ["num_processes"], value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(1..=64))]
    pub num_processes: u64,
}

/// `accel env`.
#[derive(Debug, Args)]
pub struct EnvArgs {
    /// Config file to report (default: $HF_HOME/accelerate/default_config.yaml).
    #[arg(long, alias = "config_file", value_name = "FILE")]
    pub config_file: Option<PathBuf>,
}

/// `--num-machines`: a fixed count `N`, or an elastic range `MIN:MAX` (torchrun's `--nnodes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MachineCount {
    /// The fewest machines an elastic job trains on; `None` for a fixed count.
    pub min: Option<usize>,
    /// The machines of a fixed job, the most of an elastic one.
    pub max: usize,
}

impl MachineCount {
    /// Exactly `n` machines.
    pub fn fixed(n: usize) -> Self {
        MachineCount { min: None, max: n }
    }

    /// Parses `N` or `MIN:MAX` (`1 <= MIN <= MAX`).
    pub fn parse(text: &str) -> Result<MachineCount, String> {
        let number = |t: &str| {
            t.trim().parse::<usize>().map_err(|_| format!("{t:?} is not a number of machines; give N or MIN:MAX"))
        };
        match text.split_once(':') {
            None => Ok(MachineCount { min: None, max: number(text)? }),
            Some((min, max)) => {
                let (min, max) = (number(min)?, number(max)?);
                if min == 0 || min > max {
                    return Err(format!("{text}: an elastic range MIN:MAX needs 1 <= MIN <= MAX (e.g. 1:2)"));
                }
                Ok(MachineCount { min: Some(min), max })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn launch_keeps_program_arguments_verbatim() {
        let cli =
            Cli::parse_from(["accel", "launch", "-n", "2", "--mixed-precision", "bf16", "prog", "--lr", "0.1", "-x"]);
        let Command::Launch(a) = cli.command else { panic!("not launch") };
        assert_eq!(a.num_processes, Some(2));
        assert_eq!(a.mixed_precision.as_deref(), Some("bf16"));
        assert_eq!(a.program, PathBuf::from("prog"));
        assert_eq!(a.args, ["--lr", "0.1", "-x"]);
    }

    #[test]
    fn torchrun_and_underscore_spellings_are_accepted() {
        let cli = Cli::parse_from([
            "accel",
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "10.0.0.1",
            "--master_port",
            "1234",
            "--nproc-per-node",
            "4",
            "--tee",
            "prog",
        ]);
        let Command::Launch(a) = cli.command else { panic!("not launch") };
        assert_eq!(
            (a.num_machines, a.machine_rank, a.nproc_per_node),
            (Some(MachineCount { min: None, max: 2 }), Some(1), Some(4))
        );
        assert_eq!(a.main_process_ip.as_deref(), Some("10.0.0.1"));
        assert_eq!(a.main_process_port, Some(1234));
        assert_eq!(a.tee.as_deref(), Some("3"));
        assert_eq!(a.program, PathBuf::from("prog"));
    }

    #[test]
    fn accelerate_launch_flags_are_accepted_in_both_spellings() {
        for (multi, threads, affinity, same, rdzv) in [
            (
                "--multi_gpu",
                "--num_cpu_threads_per_process",
                "--enable_cpu_affinity",
                "--same_network",
                "--rdzv_backend",
            ),
            (
                "--multi-gpu",
                "--num-cpu-threads-per-process",
                "--enable-cpu-affinity",
                "--same-network",
                "--rdzv-backend",
            ),
        ] {
            let cli = Cli::parse_from(["accel", "launch", multi, threads, "4", affinity, same, rdzv, "c10d", "prog"]);
            let Command::Launch(a) = cli.command else { panic!("not launch") };
            assert!(a.multi_gpu && a.enable_cpu_affinity && a.same_network, "{multi}");
            assert_eq!((a.num_cpu_threads_per_process, a.rdzv_backend.as_deref()), (Some(4), Some("c10d")));
        }
        let e = Cli::try_parse_from(["accel", "launch", "--multi_gpu", "--cpu", "prog"]).unwrap_err().to_string();
        assert!(e.contains("--cpu") && e.contains("cannot be used with"), "{e}");
        let e = Cli::try_parse_from(["accel", "launch", "--num_cpu_threads_per_process", "0", "prog"]).unwrap_err();
        assert!(e.to_string().contains("0 is not in 1.."), "{e}");
    }

    #[test]
    fn parallelism_flags_are_accepted_in_both_spellings() {
        for spelling in ["--parallelism_config_", "--parallelism-config-"] {
            let flag = |name: &str| {
                format!("{spelling}{}", if spelling.ends_with('_') { name.to_string() } else { name.replace('_', "-") })
            };
            let cli = Cli::parse_from([
                "accel".to_string(),
                "launch".to_string(),
                flag("dp_replicate_size"),
                "2".to_string(),
                flag("dp_shard_size"),
                "1".to_string(),
                flag("tp_size"),
                "4".to_string(),
                flag("pp_size"),
                "3".to_string(),
                flag("cp_size"),
                "1".to_string(),
                "prog".to_string(),
            ]);
            let Command::Launch(a) = cli.command else { panic!("not launch") };
            assert_eq!(
                (
                    a.parallelism_config_dp_replicate_size,
                    a.parallelism_config_dp_shard_size,
                    a.parallelism_config_tp_size,
                    a.parallelism_config_pp_size,
                    a.parallelism_config_cp_size
                ),
                (Some(2), Some(1), Some(4), Some(3), Some(1)),
                "{spelling}"
            );
        }
        let e = Cli::try_parse_from(["accel", "launch", "--parallelism-config-tp-size", "0", "prog"]).unwrap_err();
        assert!(e.to_string().contains("0 is not in 1.."), "{e}");
    }

    #[test]
    fn the_sharding_strategy_flag_is_accepted_in_both_spellings_and_checked() {
        for (flag, value, want) in [
            ("--fsdp_sharding_strategy", "SHARD_OPTIM", ShardingStrategy::ShardOptim),
            ("--fsdp-sharding-strategy", "shard-grad-op", ShardingStrategy::ShardGradOp),
            ("--fsdp-sharding-strategy", "3", ShardingStrategy::NoShard),
            ("--fsdp_sharding_strategy", "FULL_SHARD", ShardingStrategy::FullShard),
        ] {
            let cli = Cli::parse_from(["accel", "launch", flag, value, "prog"]);
            let Command::Launch(a) = cli.command else { panic!("not launch") };
            assert_eq!(a.fsdp_sharding_strategy, Some(want), "{flag} {value}");
        }
        let cli = Cli::parse_from(["accel", "launch", "prog"]);
        let Command::Launch(a) = cli.command else { panic!("not launch") };
        assert_eq!(a.fsdp_sharding_strategy, None);
        let e = Cli::try_parse_from(["accel", "launch", "--fsdp-sharding-strategy", "zero2", "prog"]).unwrap_err();
        assert!(
            e.to_string().contains(
                "invalid value 'zero2' for '--fsdp-sharding-strategy <STRATEGY>': expected one of NO_SHARD, \
                 SHARD_OPTIM (ZeRO-1), SHARD_GRAD_OP (ZeRO-2), FULL_SHARD (ZeRO-3), HYBRID_SHARD, \
                 _HYBRID_SHARD_ZERO2, or torch's numbers 1-5"
            ),
            "{e}"
        );
    }

    #[test]
    fn pipeline_flags_are_accepted_in_both_spellings() {
        for (schedule, microbatches, stages, value) in [
            (
                "--pipeline-parallel-schedule",
                "--pipeline-parallel-microbatches",
                "--pipeline-parallel-virtual-stages",
                "interleaved1f1b",
            ),
            (
                "--pipeline_parallel_schedule",
                "--pipeline_parallel_microbatches",
                "--pipeline_parallel_virtual_stages",
                "Interleaved1F1B",
            ),
        ] {
            let cli = Cli::parse_from(["accel", "launch", schedule, value, microbatches, "8", stages, "2", "prog"]);
            let Command::Launch(a) = cli.command else { panic!("not launch") };
            assert_eq!(
                (a.pipeline_parallel_schedule, a.pipeline_parallel_microbatches, a.pipeline_parallel_virtual_stages),
                (Some(ScheduleKind::Interleaved1F1B), Some(8), Some(2)),
                "{schedule}"
            );
        }
        let cli = Cli::parse_from(["accel", "launch", "--pipeline-parallel-schedule", "gpipe", "prog"]);
        let Command::Launch(a) = cli.command else { panic!("not launch") };
        assert_eq!(a.pipeline_parallel_schedule, Some(ScheduleKind::GPipe));
        let e = Cli::try_parse_from(["accel", "launch", "--pipeline-parallel-schedule", "zigzag", "prog"]).unwrap_err();
        assert!(
            e.to_string().contains(
                "invalid value 'zigzag' for '--pipeline-parallel-schedule <SCHEDULE>': expected one of GPipe, 1F1B, \
                 Interleaved1F1B"
            ),
            "{e}"
        );
        for flag in ["--pipeline-parallel-microbatches", "--pipeline-parallel-virtual-stages"] {
            let e = Cli::try_parse_from(["accel", "launch", flag, "0", "prog"]).unwrap_err();
            assert!(e.to_string().contains("0 is not in 1.."), "{flag}: {e}");
        }
    }
}
