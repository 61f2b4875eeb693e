//! `accel launch`: resolves flags, config file and defaults into a [`LaunchPlan`], then runs it with
//! [`ddp_core::launch`] (one call per machine, as torchrun).
//!
//! Precedence, per setting: command-line flag, then the config file, then the default. `num_processes` is the
//! TOTAL over all machines (Accelerate's meaning); each machine runs `num_processes / num_machines` workers.
//! Workers get torchrun's variables from the launcher (RANK, LOCAL_RANK, WORLD_SIZE, ...) plus Accelerate's
//! (`ACCELERATE_MIXED_PRECISION`, `ACCELERATE_USE_CPU`, `ACCELERATE_GRADIENT_ACCUMULATION_STEPS`, ...), which
//! [`accel::AcceleratorConfig::from_env`] reads.
//!
//! Sharded data parallelism: `distributed_type: FSDP` makes the data-parallel processes dp_shard
//! (`num_processes / (tp × pp)`) unless the `parallelism_config` block (or a flag) sets dp_shard or dp_replicate
//! itself; what they shard is `--fsdp-sharding-strategy`, else the file's `fsdp_config`
//! ([`AccelerateConfig::sharding_strategy`]), and reaches the workers as `FSDP_SHARDING_STRATEGY` when dp_shard > 1.

use crate::args::LaunchArgs;
use crate::config_file::{AccelerateConfig, DistributedType, ParallelismConfig};
use crate::error::{CliError, CliResult};
use accel::config::{MixedPrecision, GRADIENT_ACCUMULATION_STEPS_ENV, MIXED_PRECISION_ENV, USE_CPU_ENV};
use ddp_core::env::{DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT};
use ddp_core::LaunchConfig;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Environment variable: `true` turns on Accelerate's debug mode in the workers.
pub const DEBUG_MODE_ENV: &str = "ACCELERATE_DEBUG_MODE";
/// Environment variable: `1` asks workers to pin themselves to their CPU cores.
pub const CPU_AFFINITY_ENV: &str = "ACCELERATE_CPU_AFFINITY";
/// Environment variable: `true` when a parallelism layout is given (with `PARALLELISM_CONFIG_*_SIZE`).
pub const USE_PARALLELISM_CONFIG_ENV: &str = "ACCELERATE_USE_PARALLELISM_CONFIG";

/// A fully resolved launch of this machine's workers.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchPlan {
    /// Processes over all machines.
    pub num_processes: usize,
    /// Machines in the job; in an elastic job, the most it trains on.
    pub num_machines: usize,
    /// An elastic job's fewest machines (`--num-machines MIN:MAX`); `None` for a fixed count.
    pub min_machines: Option<usize>,
    /// torchrun's `--rdzv-conf`: an elastic round's `last_call_timeout`, when given.
    pub last_call: Option<Duration>,
    /// torchrun's `--rdzv-conf`: how long machines wait for each other (`join_timeout`), when given.
    pub join_timeout: Option<Duration>,
    /// This machine's rank.
    pub machine_rank: usize,
    /// Address of machine 0 (the rendezvous store).
    pub main_process_ip: String,
    /// Store port (0 = a free one, single machine only).
    pub main_process_port: u16,
    /// Compute precision for the workers.
    pub mixed_precision: MixedPrecision,
    /// Micro-batches per optimizer step, when set by a flag or the file (else the program's own choice).
    pub gradient_accumulation_steps: Option<usize>,
    /// Workers run on the CPU.
    pub use_cpu: bool,
    /// Accelerate debug mode.
    pub debug: bool,
    /// Workers print the parallel plan as applied (`--print-plan`).
    pub print_plan: bool,
    /// CUDA_VISIBLE_DEVICES for the workers (`None` or `all`: unchanged).
    pub gpu_ids: Option<String>,
    /// Pin workers to their cores.
    pub enable_cpu_affinity: bool,
    /// OMP_NUM_THREADS / RAYON_NUM_THREADS of the workers (`--num-cpu-threads-per-process`).
    pub num_cpu_threads_per_process: Option<usize>,
    /// Things the launch accepted but will not honour as asked (printed before it starts).
    pub warnings: Vec<String>,
    /// Parallelism layout from the config file's `parallelism_config` block (dp_shard over the data-parallel
    /// processes for `distributed_type: FSDP`), the `--parallelism-config-*` and `--pipeline-parallel-*` flags and
    /// the sharding strategy (`--fsdp-sharding-strategy`, else the file's) (`None` when none gives one: data
    /// parallelism over all processes). Validated against `num_processes` with the library's rules
    /// ([`ParallelismConfig::resolve`]); passed to the workers as `PARALLELISM_CONFIG_*_SIZE`, when set
    /// `PARALLELISM_CONFIG_PP_{SCHEDULE,MICROBATCHES,VIRTUAL_STAGES}`, and with dp_shard > 1
    /// `FSDP_SHARDING_STRATEGY` ([`ParallelismConfig::env_vars`]).
    pub parallelism: Option<ParallelismConfig>,
    /// Group restarts after a failure.
    pub max_restarts: usize,
    /// Per-rank log files.
    pub log_dir: Option<PathBuf>,
    /// Print worker output on the console too (always true without `log_dir`).
    pub tee: bool,
    /// Backend for the workers (ACCEL_BACKEND); `Mpi` hands the job to `mpirun`. `None`: the program's default.
    pub backend: Option<ddp_core::BackendKind>,
    /// The config file read, as the banner names it ([`describe_config`]); [`ddp_core::launcher::NO_CONFIG`] when
    /// none was.
    pub config_source: String,
    /// The program and its arguments.
    pub program: PathBuf,
    /// Arguments of the program.
    pub args: Vec<String>,
}

impl LaunchPlan {
    /// Combines `flags` (highest precedence), `file` and the defaults, and checks the result: counts ≥ 1,
    /// `num_processes` divisible by `num_machines`, `machine_rank < num_machines`, an address and a fixed port for
    /// several machines, parallel sizes whose product is `num_processes` (or all 1), cp = 1, pipeline settings that
    /// fit pp ([`ParallelismConfig::validate_pipeline`]), and no `fsdp_offload_params: true` (refused here, once,
    /// rather than by every rank). Pipeline
    /// settings given with pp 1, and a sharding strategy given with dp_shard 1, get a warning (nothing reads them).
    pub fn resolve(flags: &LaunchArgs, file: Option<&AccelerateConfig>) -> CliResult<Self> {
        check_distributed_type(file)?;
        check_fsdp_offload(file)?;
        let Counts { num_processes, num_machines, machine_rank } = resolve_counts(flags, file)?;
        let min_machines = flags.num_machines.and_then(|c| c.min);

        let (last_call, join_timeout) = resolve_rdzv_conf(flags.rdzv_conf.as_deref())?;
        let (main_process_ip, main_process_port) = resolve_rendezvous(flags, file, num_machines)?;
        let mixed_precision = resolve_mixed_precision(flags, file)?;
        let gradient_accumulation_steps = resolve_accumulation(flags, file)?;
        let use_cpu = resolve_use_cpu(flags, file, num_processes)?;
        let gpu_ids = resolve_gpu_ids(flags, file, use_cpu, num_processes / num_machines)?;
        let mut warnings: Vec<String> = rdzv_warning(flags, file).into_iter().collect();
        let parallelism = resolve_parallelism(flags, file, num_processes)?;
        if let Some(p) = &parallelism {
            check_parallelism(p, num_processes)?;
            if p.is_auto() {
                warnings.extend(chosen_under_auto_warning(p, flags, file));
            } else {
                warnings.extend(unused_pipeline_warning(p));
                warnings.extend(unused_sharding_warning(p, flags, file, num_processes));
            }
        }
        Ok(LaunchPlan {
            num_processes,
            num_machines,
            min_machines,
            last_call,
            join_timeout,
            machine_rank,
            main_process_ip,
            main_process_port,
            mixed_precision,
            gradient_accumulation_steps,
            use_cpu,
            debug: flags.debug || file.is_some_and(|f| f.debug),
            print_plan: flags.print_plan,
            gpu_ids,
            enable_cpu_affinity: flags.enable_cpu_affinity || file.is_some_and(|f| f.enable_cpu_affinity),
            num_cpu_threads_per_process: flags.num_cpu_threads_per_process.map(|n| n as usize),
            warnings,
            parallelism,
            max_restarts: flags.max_restarts.unwrap_or(0),
            log_dir: flags.log_dir.clone(),
            tee: resolve_tee(flags),
            backend: flags.backend.as_deref().map(str::parse).transpose().map_err(CliError::Ddp)?,
            config_source: ddp_core::launcher::NO_CONFIG.to_string(),
            program: flags.program.clone(),
            args: flags.args.clone(),
        })
    }

    /// Workers on this machine.
    pub fn nproc_per_node(&self) -> usize {
        self.num_processes / self.num_machines
    }

    /// The variables every worker gets on top of the launcher's torchrun set, named as Python Accelerate's
    /// launcher names them.
    pub fn worker_env(&self) -> Vec<(String, String)> {
        let mut env = vec![
            (MIXED_PRECISION_ENV.to_string(), self.mixed_precision.as_str().to_string()),
            (USE_CPU_ENV.to_string(), self.use_cpu.to_string()),
        ];
        if let Some(k) = self.gradient_accumulation_steps {
            env.push((GRADIENT_ACCUMULATION_STEPS_ENV.to_string(), k.to_string()));
        }
        if self.debug {
            env.push((DEBUG_MODE_ENV.to_string(), "true".to_string()));
        }
        if let Some(b) = self.backend {
            let name = match b {
                ddp_core::BackendKind::Cpu => "cpu",
                ddp_core::BackendKind::Nccl => "nccl",
                ddp_core::BackendKind::Mpi => "mpi",
                ddp_core::BackendKind::Auto => "auto",
            };
            env.push((ddp_core::env::BACKEND_ENV.to_string(), name.to_string()));
        }
        if self.enable_cpu_affinity {
            env.push((CPU_AFFINITY_ENV.to_string(), "1".to_string()));
        }
        if self.print_plan {
            env.push((accel::plan::PRINT_PLAN_ENV.to_string(), "1".to_string()));
        }
        if let Some(n) = self.num_cpu_threads_per_process {
            env.push(("OMP_NUM_THREADS".to_string(), n.to_string()));
            env.push(("RAYON_NUM_THREADS".to_string(), n.to_string()));
        }
        if let Some(ids) = self.gpu_ids.as_deref().filter(|ids| !ids.eq_ignore_ascii_case("all") && !self.use_cpu) {
            env.push(("CUDA_VISIBLE_DEVICES".to_string(), ids.to_string()));
        }
        if let Some(p) = &self.parallelism {
            env.push((USE_PARALLELISM_CONFIG_ENV.to_string(), "true".to_string()));
            env.extend(p.env_vars());
        }
        // What the banner said, so that the workers do not say it again (unless their program changed it).
        env.push((ddp_core::launcher::LAUNCH_BANNER_ENV.to_string(), self.banner().settings()));
        env.push((ddp_core::launcher::CONFIG_SOURCE_ENV.to_string(), self.config_source.clone()));
        env
    }

    /// The ddp-core launcher configuration of this machine.
    pub fn to_launch_config(&self) -> LaunchConfig {
        let mut cfg = LaunchConfig::local(self.nproc_per_node(), self.program.clone(), self.args.clone());
        cfg.nnodes = self.num_machines;
        cfg.min_nnodes = self.min_machines;
        if let Some(t) = self.last_call {
            cfg.last_call = t;
        }
        if let Some(t) = self.join_timeout {
            cfg.rdzv_timeout = t;
        }
        cfg.node_rank = self.machine_rank;
        cfg.master_addr = self.main_process_ip.clone();
        cfg.master_port = self.main_process_port;
        cfg.env = self.worker_env();
        cfg.log_dir = self.log_dir.clone();
        cfg.tee = self.tee;
        cfg.max_restarts = self.max_restarts;
        cfg.stop_grace = Duration::from_secs(5);
        cfg
    }

    /// What the workers will run, printed once before they start ([`ddp_core::launcher::RunBanner`]). The backend
    /// is the one the workers' `auto` resolves to when `--backend` is not given: NCCL when they run on GPUs that
    /// this build can use, else the CPU backend.
    pub fn banner(&self) -> ddp_core::launcher::RunBanner {
        let on_gpus = !self.use_cpu && crate::hardware::CUDA_COMPILED && crate::hardware::usable_gpu_count() > 0;
        let backend = match self.backend {
            Some(ddp_core::BackendKind::Cpu) => "cpu",
            Some(ddp_core::BackendKind::Nccl) => "nccl",
            Some(ddp_core::BackendKind::Mpi) => "mpi",
            Some(ddp_core::BackendKind::Auto) | None if on_gpus => "nccl",
            Some(ddp_core::BackendKind::Auto) | None => "cpu",
        };
        accel::banner::run_banner(
            self.config_source.clone(),
            self.num_processes,
            self.num_machines,
            &self.parallelism.clone().unwrap_or_default(),
            self.mixed_precision,
            self.gradient_accumulation_steps.unwrap_or(1),
            backend,
        )
    }

    /// The banner, the machine and the program: printed once before the workers start.
    pub fn summary(&self) -> String {
        let machine = if let Some(min) = self.min_machines {
            format!(
                "\naccel launch: machine {} of an elastic job on {min}..{} machines runs {} processes (main {}:{}); \
                 the processes above are those of {} machines",
                self.machine_rank,
                self.num_machines,
                self.nproc_per_node(),
                self.main_process_ip,
                self.main_process_port,
                self.num_machines
            )
        } else if self.num_machines > 1 {
            format!(
                "\naccel launch: machine {}/{} runs {} of the processes (main {}:{})",
                self.machine_rank,
                self.num_machines,
                self.nproc_per_node(),
                self.main_process_ip,
                self.main_process_port
            )
        } else {
            String::new()
        };
        format!("accel launch: {}{machine}\naccel launch: {}", self.banner(), self.program.display())
    }
}

/// How the banner names the config file at `path`: the path, whether it is the default one (where `accel config`
/// writes, and what every later launch reads), and which of the run's settings it changed — those it sets to
/// something other than the built-in default — and which of those a flag overrode.
pub fn describe_config(path: &Path, default_location: bool, file: &AccelerateConfig, flags: &LaunchArgs) -> String {
    let (mut set, mut overridden) = (Vec::new(), Vec::new());
    let mut note = |what: Option<String>, flag_given: bool| {
        if let Some(what) = what {
            if flag_given {
                // "flags overrode its layout …", not "its the layout …".
                overridden.push(what.strip_prefix("the ").map(str::to_string).unwrap_or(what))
            } else {
                set.push(what)
            }
        }
    };
    note(
        file.num_processes.filter(|n| *n > 1).map(|n| format!("{n} processes")),
        flags.num_processes.is_some() || flags.nproc_per_node.is_some(),
    );
    note((file.num_machines > 1).then(|| format!("{} machines", file.num_machines)), flags.num_machines.is_some());
    note(
        (file.mixed_precision != MixedPrecision::No).then(|| format!("mixed precision {}", file.mixed_precision)),
        flags.mixed_precision.is_some(),
    );
    note(
        file.gradient_accumulation_steps.filter(|k| *k > 1).map(|k| format!("gradient accumulation {k}")),
        flags.gradient_accumulation_steps.is_some(),
    );
    note((file.distributed_type == DistributedType::Fsdp).then(|| "distributed_type FSDP".to_string()), false);
    let strategy = file.sharding_strategy().unwrap_or_default();
    note(
        file.parallelism_config
            .as_ref()
            .filter(|p| !p.is_default_layout())
            .map(|p| format!("the layout {}", p.clone().with_sharding_strategy(strategy).layout_with_pipeline())),
        parallelism_flags_given(flags),
    );
    let mut parts = Vec::new();
    if default_location {
        parts.push("the default config file, where `accel config` writes".to_string());
    }
    match (set.is_empty(), overridden.is_empty()) {
        (true, true) => parts.push("it changes no default".into()),
        (false, _) => parts.push(format!("it set {}", set.join(", "))),
        _ => {}
    }
    if !overridden.is_empty() {
        parts.push(format!("flags overrode its {}", overridden.join(", ")));
    }
    format!("{} ({})", path.display(), parts.join("; "))
}

/// Refuses a config file whose `distributed_type` asks for something accel does not run (`DEEPSPEED`,
/// `MEGATRON_LM`, `XLA`, other accelerators): running it as plain data parallelism would train something other
/// than what the file says. (`FSDP` runs: sharded data parallelism, [`resolve_parallelism`].)
fn check_distributed_type(file: Option<&AccelerateConfig>) -> CliResult<()> {
    let Some(DistributedType::Other(t)) = file.map(|f| &f.distributed_type) else { return Ok(()) };
    let (why, block) = match t.as_str() {
        "DEEPSPEED" => ("accel has no DeepSpeed engine", " (and remove deepspeed_config)"),
        "MEGATRON_LM" => (
            "accel has no Megatron-LM plugin (its tensor parallelism is parallelism_config_tp_size)",
            " (and remove megatron_lm_config)",
        ),
        _ => ("accel runs on CPUs and CUDA GPUs only", ""),
    };
    Err(CliError::invalid(
        "distributed_type",
        t.clone(),
        format!(
            "{why}; for data parallelism set distributed_type to MULTI_CPU or MULTI_GPU{block}, or run `accel \
             config` again"
        ),
    ))
}

/// Refuses `fsdp_offload_params: true`: accel keeps every shard on the device it trains on (CPU offload of the
/// parameters is not implemented; on the CPU it would be the same memory).
fn check_fsdp_offload(file: Option<&AccelerateConfig>) -> CliResult<()> {
    if !file.is_some_and(AccelerateConfig::fsdp_offload_params) {
        return Ok(());
    }
    Err(CliError::invalid(
        "fsdp_offload_params",
        "true",
        "CPU offload of the parameters is not implemented (each rank keeps its shards on the device it trains on; \
         on the CPU it would be the same memory); set fsdp_offload_params to false in fsdp_config, or run `accel \
         config` again",
    ))
}

/// The job's size and this machine's place in it.
struct Counts {
    num_processes: usize,
    num_machines: usize,
    machine_rank: usize,
}

/// Machines, processes (the total: `--num-processes`, else `--nproc-per-node` × machines, else the file) and
/// this machine's rank, checked: at least one of each, the processes divisible among the machines, the rank
/// below the machine count.
fn resolve_counts(flags: &LaunchArgs, file: Option<&AccelerateConfig>) -> CliResult<Counts> {
    let num_machines = flags.num_machines.map(|c| c.max).or(file.map(|f| f.num_machines)).unwrap_or(1);
    if num_machines == 0 {
        return Err(CliError::invalid("num_machines", "0", "at least 1 machine"));
    }
    let num_processes = match (flags.num_processes, flags.nproc_per_node) {
        (Some(n), _) => n,
        (None, Some(per_node)) => per_node * num_machines,
        (None, None) => file.and_then(|f| f.num_processes).unwrap_or(num_machines),
    };
    if num_processes == 0 {
        return Err(CliError::invalid("num_processes", "0", "at least 1 process"));
    }
    if num_processes % num_machines != 0 {
        return Err(CliError::Launch(format!(
            "num_processes ({num_processes}) is not divisible by num_machines ({num_machines}): num_processes is \
             the TOTAL over all machines and each machine runs num_processes / num_machines workers; give a \
             multiple of {num_machines}"
        )));
    }
    let machine_rank = flags.machine_rank.or(file.map(|f| f.machine_rank)).unwrap_or(0);
    if machine_rank >= num_machines {
        return Err(CliError::invalid(
            "machine_rank",
            machine_rank.to_string(),
            format!("must be below num_machines ({num_machines}): 0..{}", num_machines - 1),
        ));
    }
    Ok(Counts { num_processes, num_machines, machine_rank })
}

/// torchrun's `--rdzv-conf key=value,...`: `last_call_timeout` and `join_timeout`, in seconds.
fn resolve_rdzv_conf(conf: Option<&str>) -> CliResult<(Option<Duration>, Option<Duration>)> {
    let (mut last_call, mut join) = (None, None);
    for item in conf.unwrap_or_default().split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (key, value) = item.split_once('=').unwrap_or((item, ""));
        let seconds = value
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| CliError::invalid("rdzv_conf", item, "a number of seconds, e.g. last_call_timeout=10"))?;
        match key.trim() {
            "last_call_timeout" => last_call = Some(seconds),
            "join_timeout" => join = Some(seconds),
            other => {
                return Err(CliError::invalid(
                    "rdzv_conf",
                    other,
                    "one of last_call_timeout, join_timeout (seconds), e.g. --rdzv-conf last_call_timeout=10",
                ))
            }
        }
    }
    Ok((last_call, join))
}

/// torchrun's `--rdzv-endpoint`: `HOST:PORT` (`[v6]:PORT` for an IPv6 literal).
fn parse_endpoint(text: &str) -> CliResult<(String, u16)> {
    let bad = || CliError::invalid("rdzv_endpoint", text, "HOST:PORT, e.g. 10.0.0.1:29500");
    let (host, port) = text.trim().rsplit_once(':').ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port.parse::<u16>().map_err(|_| bad())?;
    if host.is_empty() {
        return Err(bad());
    }
    Ok((host.to_string(), port))
}

/// The store's address and port: several machines need machine 0's address and a fixed port every machine is
/// told; one machine defaults to the local address and a free port (so concurrent jobs never collide).
fn resolve_rendezvous(
    flags: &LaunchArgs,
    file: Option<&AccelerateConfig>,
    num_machines: usize,
) -> CliResult<(String, u16)> {
    let endpoint = flags.rdzv_endpoint.as_deref().map(parse_endpoint).transpose()?;
    let ip = endpoint
        .as_ref()
        .map(|(h, _)| h.clone())
        .or_else(|| flags.main_process_ip.clone())
        .or_else(|| file.and_then(|f| f.main_process_ip.clone()));
    let port = endpoint.map(|(_, p)| p).or(flags.main_process_port).or(file.and_then(|f| f.main_process_port));
    // An elastic job (even of one machine at most) needs a port that machines joining later can be told.
    let elastic = flags.num_machines.is_some_and(|c| c.min.is_some());
    if num_machines == 1 {
        let default_port = if elastic { DEFAULT_MASTER_PORT } else { 0 };
        return Ok((ip.unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_string()), port.unwrap_or(default_port)));
    }
    let ip = ip.ok_or_else(|| {
        CliError::Launch(format!(
            "a job on {num_machines} machines needs the address of machine 0: pass --main-process-ip (or set \
             main_process_ip in the config file)"
        ))
    })?;
    let port = port.unwrap_or(DEFAULT_MASTER_PORT);
    if port == 0 {
        return Err(CliError::invalid(
            "main_process_port",
            "0",
            "a job on several machines needs a fixed port that every machine is told (e.g. 29500)",
        ));
    }
    Ok((ip, port))
}

/// `--mixed-precision` (checked against the choices), else the file's, else none.
fn resolve_mixed_precision(flags: &LaunchArgs, file: Option<&AccelerateConfig>) -> CliResult<MixedPrecision> {
    Ok(match &flags.mixed_precision {
        Some(s) => s.parse::<MixedPrecision>().map_err(|_| {
            CliError::invalid("--mixed-precision", s.clone(), format!("choose one of {}", MixedPrecision::CHOICES))
        })?,
        None => file.map(|f| f.mixed_precision).unwrap_or_default(),
    })
}

/// Gradient accumulation from the flag or the file (at least 1; `None` leaves it to the program).
fn resolve_accumulation(flags: &LaunchArgs, file: Option<&AccelerateConfig>) -> CliResult<Option<usize>> {
    let steps = match flags.gradient_accumulation_steps {
        Some(k) => Some(k as usize),
        None => file.and_then(|f| f.gradient_accumulation_steps),
    };
    if steps == Some(0) {
        return Err(CliError::invalid("gradient_accumulation_steps", "0", "at least 1"));
    }
    Ok(steps)
}

/// Whether the workers run on the CPU (`--cpu` or a CPU config file, unless `--multi_gpu`); `--multi_gpu` needs
/// at least 2 processes.
fn resolve_use_cpu(flags: &LaunchArgs, file: Option<&AccelerateConfig>, num_processes: usize) -> CliResult<bool> {
    let use_cpu = !flags.multi_gpu
        && (flags.cpu || file.is_some_and(|f| f.use_cpu || f.distributed_type == DistributedType::MultiCpu));
    if flags.multi_gpu && num_processes < 2 {
        return Err(CliError::Launch(
            "--multi_gpu needs at least 2 processes: pass --num-processes N (one per GPU), or drop --multi_gpu for \
             a single process"
                .into(),
        ));
    }
    Ok(use_cpu)
}

/// The workers' GPU ids from the flag or the file; several GPU processes per machine need at least one id each
/// (`accelerate launch` refuses fewer too).
fn resolve_gpu_ids(
    flags: &LaunchArgs,
    file: Option<&AccelerateConfig>,
    use_cpu: bool,
    per_node: usize,
) -> CliResult<Option<String>> {
    let gpu_ids = flags.gpu_ids.clone().or_else(|| file.and_then(|f| f.gpu_ids.clone()));
    if let Some(ids) = gpu_ids.as_deref().filter(|ids| !use_cpu && !ids.trim().eq_ignore_ascii_case("all")) {
        let n = ids.split(',').filter(|id| !id.trim().is_empty()).count();
        if per_node > 1 && n < per_node {
            return Err(CliError::Launch(format!(
                "{per_node} GPU processes per machine but gpu_ids {ids:?} names {n} GPU(s): list at least one GPU \
                 per process (--gpu-ids, or gpu_ids in the config file), use `all`, or pass --cpu"
            )));
        }
    }
    Ok(gpu_ids)
}

/// A warning for an `rdzv_backend` other than `static`, which accel accepts but does not use.
fn rdzv_warning(flags: &LaunchArgs, file: Option<&AccelerateConfig>) -> Option<String> {
    let rdzv = flags.rdzv_backend.as_deref().or(file.and_then(|f| f.rdzv_backend.as_deref()));
    rdzv.filter(|b| !b.trim().eq_ignore_ascii_case("static")).map(|backend| {
        format!(
            "rdzv_backend {backend:?} is not used: accel always rendezvouses through its own TCP store on \
             main_process_ip:main_process_port with fixed machine ranks (like `static`)"
        )
    })
}

/// Refuses, before any worker starts, a layout that does not fit `num_processes`, pipeline settings that do not
/// fit pp, and under `auto` a memory size (`ACCEL_AUTO_LAYOUT_MEMORY`) the workers could not read: one message
/// saying what would run, instead of every rank failing with it.
fn check_parallelism(p: &ParallelismConfig, num_processes: usize) -> CliResult<()> {
    if p.is_auto() {
        // The workers choose the open sizes; the fixed ones must leave a whole number of processes to them.
        p.validate_sizes()?;
        let fixed: usize = p.fixed_sizes().iter().flatten().product();
        if !num_processes.is_multiple_of(fixed) {
            return Err(accel::AccelError::Config {
                key: "parallelism_config".into(),
                value: p.to_string(),
                reason: format!(
                    "the fixed sizes multiply to {fixed}, which does not divide the {num_processes} processes; \
                     leave more sizes to auto or launch a multiple of {fixed} processes"
                ),
            }
            .into());
        }
        // The memory the workers' chooser is told, read once here rather than refused by every worker.
        accel::auto_layout::memory_from_env()?;
        return Ok(());
    }
    p.resolve(num_processes)?;
    Ok(())
}

/// Whether worker output also goes to the console: always without `--log-dir`; with it, only when `--tee` is
/// given and not `0`.
fn resolve_tee(flags: &LaunchArgs) -> bool {
    match (&flags.log_dir, &flags.tee) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(_), Some(v)) => v.trim() != "0",
    }
}

/// Whether any `--parallelism-config-*`, `--pipeline-parallel-*` or `--fsdp-sharding-strategy` flag was given.
fn parallelism_flags_given(flags: &LaunchArgs) -> bool {
    [
        flags.parallelism_config_dp_replicate_size,
        flags.parallelism_config_dp_shard_size,
        flags.parallelism_config_tp_size,
        flags.parallelism_config_pp_size,
        flags.parallelism_config_cp_size,
        flags.pipeline_parallel_microbatches,
        flags.pipeline_parallel_virtual_stages,
    ]
    .iter()
    .any(Option::is_some)
        || flags.parallelism.is_some()
        || flags.pipeline_parallel_schedule.is_some()
        || flags.fsdp_sharding_strategy.is_some()
}

/// Under `auto` sizes the workers' chooser picks the sharding strategy and the pipeline's schedule, micro-batches
/// and stages per rank too: a warning naming those the flags or the file gave, which are not used.
fn chosen_under_auto_warning(
    p: &ParallelismConfig,
    flags: &LaunchArgs,
    file: Option<&AccelerateConfig>,
) -> Option<String> {
    let mut given = Vec::new();
    if flags.fsdp_sharding_strategy.is_some() || file.is_some_and(AccelerateConfig::sets_sharding_strategy) {
        given.push(format!("fsdp_sharding_strategy {}", p.sharding_strategy));
    }
    given.extend(pipeline_settings_given(p));
    (!given.is_empty()).then(|| {
        format!(
            "{}: not used — with `auto` sizes the workers choose the sharding strategy and the pipeline's schedule, \
             micro-batches and stages per rank as well (fix the sizes to run these settings)",
            given.join(", ")
        )
    })
}

/// The pipeline settings `p` sets to other than their defaults, as `key value` (a schedule other than 1F1B, the
/// micro-batches, the virtual stages).
fn pipeline_settings_given(p: &ParallelismConfig) -> Vec<String> {
    let mut set = Vec::new();
    if p.pp_schedule != ParallelismConfig::default().pp_schedule {
        set.push(format!("pipeline_parallel_schedule {}", p.pp_schedule));
    }
    if let Some(m) = p.pp_microbatches {
        set.push(format!("pipeline_parallel_microbatches {m}"));
    }
    if let Some(v) = p.pp_virtual_stages {
        set.push(format!("pipeline_parallel_virtual_stages {v}"));
    }
    set
}

/// A warning for pipeline settings (schedule other than 1F1B, micro-batches, virtual stages) in a layout with pp 1,
/// which nothing reads.
fn unused_pipeline_warning(p: &ParallelismConfig) -> Option<String> {
    if p.pp_size > 1 {
        return None;
    }
    let set = pipeline_settings_given(p);
    (!set.is_empty()).then(|| {
        format!(
            "{} only {} to pipeline parallelism and pp_size is 1: ignored (set --parallelism-config-pp-size or \
             parallelism_config_pp_size above 1 to use a pipeline)",
            set.join(", "),
            if set.len() == 1 { "applies" } else { "apply" }
        )
    })
}

/// A warning for a sharding strategy that nothing reads: given (by `--fsdp-sharding-strategy` or the file's
/// `fsdp_config`) while the layout has dp_shard 1, or `distributed_type: FSDP` whose block's dp_replicate leaves
/// dp_shard at 1 on several processes.
fn unused_sharding_warning(
    p: &ParallelismConfig,
    flags: &LaunchArgs,
    file: Option<&AccelerateConfig>,
    num_processes: usize,
) -> Option<String> {
    if p.dp_shard_size > 1 {
        return None;
    }
    if flags.fsdp_sharding_strategy.is_some() || file.is_some_and(AccelerateConfig::sets_sharding_strategy) {
        return Some(format!(
            "fsdp_sharding_strategy {} only applies to sharded data parallelism and dp_shard_size is 1: ignored (set \
             --parallelism-config-dp-shard-size or parallelism_config_dp_shard_size above 1, or distributed_type \
             FSDP, to shard)",
            p.sharding_strategy
        ));
    }
    let fsdp = file.is_some_and(|f| f.distributed_type == DistributedType::Fsdp);
    (fsdp && num_processes > 1 && p.dp_replicate_size > 1).then(|| {
        format!(
            "distributed_type FSDP with dp_replicate_size {} and dp_shard_size 1 shards nothing: the {} processes \
             run plain data parallelism (leave dp_replicate_size and dp_shard_size 1 to shard over every \
             data-parallel process, or set dp_shard_size)",
            p.dp_replicate_size, num_processes
        )
    })
}

/// The config file's `parallelism_config` block with each `--parallelism-config-*` flag given overriding its
/// size and each `--pipeline-parallel-*` flag its pipeline setting; under `distributed_type: FSDP`, when neither
/// sets dp_shard nor dp_replicate above 1, the data-parallel processes (`num_processes / (tp × pp)`, when that
/// divides) are dp_shard. The sharding strategy: `--fsdp-sharding-strategy`, else the file's
/// ([`AccelerateConfig::sharding_strategy`]). `None` when neither the file nor a flag names a layout or a strategy
/// and the file is not FSDP.
fn resolve_parallelism(
    flags: &LaunchArgs,
    file: Option<&AccelerateConfig>,
    num_processes: usize,
) -> CliResult<Option<ParallelismConfig>> {
    let fsdp = file.is_some_and(|f| f.distributed_type == DistributedType::Fsdp);
    let block = file.and_then(|f| f.parallelism_config.as_ref());
    let file_strategy = file.is_some_and(AccelerateConfig::sets_sharding_strategy);
    if block.is_none() && !parallelism_flags_given(flags) && !fsdp && !file_strategy {
        return Ok(None);
    }
    let mut p = layout_from_flags(flags, block);
    if fsdp && p.dp_shard_size == 1 && p.dp_replicate_size == 1 {
        let model = p.tp_size * p.pp_size * p.cp_size;
        if model > 0 && num_processes.is_multiple_of(model) {
            p.dp_shard_size = num_processes / model;
        }
    }
    p.sharding_strategy = match (flags.fsdp_sharding_strategy, file) {
        (Some(s), _) => s,
        (None, Some(f)) => f.sharding_strategy()?,
        (None, None) => p.sharding_strategy,
    };
    Ok(Some(p))
}

/// The file's `parallelism_config` block (else the defaults) with each `--parallelism-config-*` and
/// `--pipeline-parallel-*` flag given overriding its setting.
fn layout_from_flags(flags: &LaunchArgs, file: Option<&ParallelismConfig>) -> ParallelismConfig {
    let given = [
        flags.parallelism_config_dp_replicate_size,
        flags.parallelism_config_dp_shard_size,
        flags.parallelism_config_tp_size,
        flags.parallelism_config_pp_size,
        flags.parallelism_config_cp_size,
    ];
    let mut p = file.cloned().unwrap_or_default();
    if flags.parallelism.is_some() {
        // `--parallelism auto`: every size the flags below do not fix is chosen by the workers.
        let auto = ParallelismConfig::auto();
        (p.dp_replicate_size, p.dp_shard_size, p.tp_size, p.pp_size) =
            (auto.dp_replicate_size, auto.dp_shard_size, auto.tp_size, auto.pp_size);
    }
    for (flag, slot) in given.into_iter().zip([
        &mut p.dp_replicate_size,
        &mut p.dp_shard_size,
        &mut p.tp_size,
        &mut p.pp_size,
        &mut p.cp_size,
    ]) {
        if let Some(n) = flag {
            *slot = n as usize;
        }
    }
    if let Some(kind) = flags.pipeline_parallel_schedule {
        p.pp_schedule = kind;
    }
    if let Some(m) = flags.pipeline_parallel_microbatches {
        p.pp_microbatches = Some(m as usize);
    }
    if let Some(v) = flags.pipeline_parallel_virtual_stages {
        p.pp_virtual_stages = Some(v as usize);
    }
    p
}

/// Checks that `program` can be started: a path must name an existing file, a bare name must be on PATH.
pub fn check_program(program: &Path) -> CliResult<()> {
    let has_dir = program.components().count() > 1 || program.is_absolute();
    if has_dir {
        if program.is_file() {
            return Ok(());
        }
        return Err(CliError::Launch(format!(
            "program {} not found: no such file (build it first, or check the path)",
            program.display()
        )));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|dir| dir.join(program).is_file()) {
        return Ok(());
    }
    Err(CliError::Launch(format!(
        "program `{}` not found: not on PATH (give a path such as ./{} or target/release/{})",
        program.display(),
        program.display(),
        program.display()
    )))
}

/// On the machine that hosts the store, fails early with [`CliError::PortInUse`] when the port is taken
/// (a plain bind attempt; other bind errors, e.g. an address of another machine, are left to the launcher).
pub fn check_port(plan: &LaunchPlan) -> CliResult<()> {
    if plan.machine_rank != 0 || plan.main_process_port == 0 {
        return Ok(());
    }
    match std::net::TcpListener::bind((plan.main_process_ip.as_str(), plan.main_process_port)) {
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            Err(CliError::PortInUse { addr: plan.main_process_ip.clone(), port: plan.main_process_port })
        }
        _ => Ok(()),
    }
}

/// Runs the workers of `plan` to completion; errors name the first failing rank and its exit status.
pub fn run_plan(plan: &LaunchPlan) -> CliResult<()> {
    check_program(&plan.program)?;
    if plan.backend == Some(ddp_core::BackendKind::Mpi) {
        return run_with_mpirun(plan);
    }
    check_port(plan)?;
    ddp_core::launch(&plan.to_launch_config()).map_err(|e| match e {
        ddp_core::DdpError::Bind { source, .. } if source.kind() == std::io::ErrorKind::AddrInUse => {
            CliError::PortInUse { addr: plan.main_process_ip.clone(), port: plan.main_process_port }
        }
        e => CliError::Ddp(e),
    })
}

/// `--backend mpi`: `mpirun -np <num_processes>` places every rank (on this machine, or on the hosts of the
/// scheduler's allocation / MPI's hostfile), so it is run once, not once per machine; ranks and sizes come from MPI.
fn run_with_mpirun(plan: &LaunchPlan) -> CliResult<()> {
    if plan.machine_rank != 0 {
        return Err(CliError::Launch(
            "--backend mpi: run `accel launch` once, on the first machine; mpirun starts the ranks on every host \
             (drop --machine-rank)"
                .into(),
        ));
    }
    let mut job = ddp_core::mpirun::MpiLaunch::new(plan.num_processes, plan.program.clone(), plan.args.clone());
    job.flavor = ddp_core::mpirun::MpiFlavor::detect()?;
    job.env = plan.worker_env();
    let mut cmd = ddp_core::mpirun::mpirun_command(&job);
    let status = cmd.status().map_err(|e| CliError::io("cannot start mpirun", e))?;
    if status.success() {
        Ok(())
    } else {
        Err(CliError::Launch(format!("mpirun exited with {status}; the rank that failed is named in its output above")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(program: &str) -> LaunchArgs {
        LaunchArgs { program: program.into(), ..LaunchArgs::default() }
    }

    #[test]
    fn backend_flag_reaches_the_workers() {
        let mut f = flags("prog");
        f.backend = Some("mpi".into());
        let p = LaunchPlan::resolve(&f, None).unwrap();
        assert_eq!(p.backend, Some(ddp_core::BackendKind::Mpi));
        assert!(p.worker_env().contains(&("ACCEL_BACKEND".to_string(), "mpi".to_string())));
        let p = LaunchPlan::resolve(&flags("prog"), None).unwrap();
        assert!(p.worker_env().iter().all(|(k, _)| k != "ACCEL_BACKEND"), "no flag: the program's default");
    }

    #[test]
    fn defaults_without_file() {
        let p = LaunchPlan::resolve(&flags("prog"), None).unwrap();
        assert_eq!((p.num_processes, p.num_machines, p.machine_rank), (1, 1, 0));
        assert_eq!((p.main_process_ip.as_str(), p.main_process_port), ("127.0.0.1", 0));
        assert_eq!(p.mixed_precision, MixedPrecision::No);
        assert_eq!(p.gradient_accumulation_steps, None);
        assert!(p.tee);
    }

    #[test]
    fn flags_override_file_which_overrides_defaults() {
        let file = AccelerateConfig {
            num_processes: Some(4),
            num_machines: 2,
            machine_rank: 1,
            main_process_ip: Some("10.0.0.1".into()),
            main_process_port: Some(7000),
            mixed_precision: MixedPrecision::Bf16,
            gradient_accumulation_steps: Some(3),
            ..AccelerateConfig::default()
        };
        let p = LaunchPlan::resolve(&flags("prog"), Some(&file)).unwrap();
        assert_eq!((p.num_processes, p.num_machines, p.machine_rank, p.nproc_per_node()), (4, 2, 1, 2));
        assert_eq!((p.main_process_ip.as_str(), p.main_process_port), ("10.0.0.1", 7000));
        assert_eq!((p.mixed_precision, p.gradient_accumulation_steps), (MixedPrecision::Bf16, Some(3)));

        let f = LaunchArgs {
            num_processes: Some(6),
            machine_rank: Some(0),
            main_process_port: Some(7100),
            mixed_precision: Some("fp16".into()),
            gradient_accumulation_steps: Some(2),
            ..flags("prog")
        };
        let p = LaunchPlan::resolve(&f, Some(&file)).unwrap();
        assert_eq!((p.num_processes, p.nproc_per_node(), p.machine_rank, p.main_process_port), (6, 3, 0, 7100));
        assert_eq!((p.mixed_precision, p.gradient_accumulation_steps), (MixedPrecision::Fp16, Some(2)));
        let cfg = p.to_launch_config();
        assert_eq!((cfg.nproc_per_node, cfg.nnodes, cfg.node_rank, cfg.master_port), (3, 2, 0, 7100));
    }

    #[test]
    fn parallelism_auto_leaves_the_open_sizes_to_the_workers() {
        let auto = LaunchArgs { num_processes: Some(4), parallelism: Some("auto".into()), ..flags("p") };
        let p = LaunchPlan::resolve(&auto, None).unwrap();
        let env = p.worker_env();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        for var in [
            "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
            "PARALLELISM_CONFIG_DP_SHARD_SIZE",
            "PARALLELISM_CONFIG_TP_SIZE",
            "PARALLELISM_CONFIG_PP_SIZE",
        ] {
            assert_eq!(get(var), Some("auto"), "{var}");
        }
        let back = accel::AcceleratorConfig::from_lookup(|k| get(k).map(str::to_string)).unwrap();
        assert_eq!(back.parallelism, accel::ParallelismConfig::auto());
        // A size given by its flag stays fixed; one that cannot divide the processes is refused before launch.
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        let tp2 = LaunchArgs { parallelism_config_tp_size: Some(2), ..auto.clone() };
        let plan = LaunchPlan::resolve(&tp2, None).unwrap();
        // The banner says what is fixed and that the rest is chosen, not a layout the workers will not run.
        assert!(
            plan.banner()
                .settings()
                .contains("| dp_replicate auto × dp_shard auto × tp 2 × pp auto (chosen at start-up) |"),
            "{}",
            plan.banner().settings()
        );
        let p = plan.parallelism.unwrap();
        assert_eq!(p.fixed_sizes(), [None, None, Some(2), None]);
        // A strategy or schedule next to auto is chosen anyway: said once, not "dp_shard_size is 1".
        let strategy = LaunchArgs { fsdp_sharding_strategy: Some(accel::ShardingStrategy::FullShard), ..auto.clone() };
        let w = LaunchPlan::resolve(&strategy, None).unwrap().warnings;
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("fsdp_sharding_strategy FULL_SHARD: not used — with `auto` sizes"), "{w:?}");
        let tp3 = LaunchArgs { parallelism_config_tp_size: Some(3), ..auto };
        let e = LaunchPlan::resolve(&tp3, None).unwrap_err().to_string();
        assert!(e.contains("the fixed sizes multiply to 3, which does not divide the 4 processes"), "{e}");
    }

    #[test]
    fn torchrun_per_node_count_multiplies() {
        let f = LaunchArgs {
            nproc_per_node: Some(2),
            num_machines: Some(crate::args::MachineCount::fixed(3)),
            main_process_ip: Some("h".into()),
            ..flags("p")
        };
        let p = LaunchPlan::resolve(&f, None).unwrap();
        assert_eq!((p.num_processes, p.nproc_per_node(), p.main_process_port), (6, 2, 29500));
    }

    #[test]
    fn inconsistent_layouts_are_refused() {
        let e = LaunchPlan::resolve(
            &LaunchArgs {
                num_processes: Some(3),
                num_machines: Some(crate::args::MachineCount::fixed(2)),
                ..flags("p")
            },
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("not divisible by num_machines (2)"), "{e}");
        let e = LaunchPlan::resolve(
            &LaunchArgs { num_machines: Some(crate::args::MachineCount::fixed(2)), ..flags("p") },
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("--main-process-ip"), "{e}");
        let e = LaunchPlan::resolve(&LaunchArgs { machine_rank: Some(1), ..flags("p") }, None).unwrap_err().to_string();
        assert!(e.contains("machine_rank"), "{e}");
        let e =
            LaunchPlan::resolve(&LaunchArgs { num_processes: Some(0), ..flags("p") }, None).unwrap_err().to_string();
        assert!(e.contains("at least 1"), "{e}");
        let e = LaunchPlan::resolve(&LaunchArgs { mixed_precision: Some("fp8".into()), ..flags("p") }, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("fp8") && e.contains("bf16"), "{e}");
    }

    #[test]
    fn parallelism_flags_override_the_file_and_reach_the_workers() {
        let tp2 = LaunchArgs { num_processes: Some(4), parallelism_config_tp_size: Some(2), ..flags("p") };
        // tp 2 alone on 4 processes: the product is 2, and the message says what fits.
        let e = LaunchPlan::resolve(&tp2, None).unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid configuration parallelism_config = \"dp_replicate 1 × dp_shard 1 × tp 2 × pp 1 × cp 1\": the \
             sizes multiply to 2 but the job has 4 processes; with tp 2 and 4 processes set dp_replicate_size 2"
        );
        let f = LaunchArgs { parallelism_config_dp_replicate_size: Some(2), ..tp2.clone() };
        let p = LaunchPlan::resolve(&f, None).unwrap();
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        let env = p.worker_env();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("ACCELERATE_USE_PARALLELISM_CONFIG"), Some("true"));
        assert_eq!(get("PARALLELISM_CONFIG_TP_SIZE"), Some("2"));
        assert_eq!(get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE"), Some("2"));
        assert_eq!(get("PARALLELISM_CONFIG_PP_SIZE"), Some("1"));
        // What the workers read back is the launch's layout.
        let back = accel::AcceleratorConfig::from_lookup(|k| get(k).map(str::to_string)).unwrap();
        assert_eq!(back.parallelism, ParallelismConfig::data_parallel(2).with_tp_size(2));
        // The file's block, with a flag overriding one size.
        let file = AccelerateConfig {
            num_processes: Some(8),
            parallelism_config: Some(ParallelismConfig::data_parallel(4).with_tp_size(2)),
            ..AccelerateConfig::default()
        };
        let f = LaunchArgs {
            parallelism_config_tp_size: Some(4),
            parallelism_config_dp_replicate_size: Some(2),
            ..flags("p")
        };
        let p = LaunchPlan::resolve(&f, Some(&file)).unwrap();
        assert_eq!(p.parallelism, Some(ParallelismConfig::data_parallel(2).with_tp_size(4)));
        let p = LaunchPlan::resolve(&flags("p"), Some(&file)).unwrap();
        assert_eq!(p.parallelism, Some(ParallelismConfig::data_parallel(4).with_tp_size(2)));
        // No block and no flag: nothing passed, the workers run data parallel over all processes.
        let p = LaunchPlan::resolve(&LaunchArgs { num_processes: Some(4), ..flags("p") }, None).unwrap();
        assert_eq!(p.parallelism, None);
        assert!(p.worker_env().iter().all(|(k, _)| !k.starts_with("PARALLELISM_CONFIG_")));
        // cp is refused before launch.
        let e = LaunchPlan::resolve(&LaunchArgs { parallelism_config_cp_size: Some(2), ..tp2.clone() }, None)
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("context parallelism is not implemented yet; set cp_size to 1"), "{e}");
        // dp_shard 2 × tp 2 (sharded data parallelism with tp) reaches the workers.
        let p = LaunchPlan::resolve(&LaunchArgs { parallelism_config_dp_shard_size: Some(2), ..tp2.clone() }, None)
            .unwrap();
        assert_eq!(p.parallelism, Some(ParallelismConfig::default().with_tp_size(2).with_dp_shard_size(2)));
        // pp 2 × tp 2 on 4 processes is launched: the layout reaches the workers, the default schedule as absence.
        let p = LaunchPlan::resolve(&LaunchArgs { parallelism_config_pp_size: Some(2), ..tp2 }, None).unwrap();
        assert_eq!(p.parallelism, Some(ParallelismConfig::default().with_tp_size(2).with_pp_size(2)));
        let env = p.worker_env();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!((get("PARALLELISM_CONFIG_PP_SIZE"), get("PARALLELISM_CONFIG_TP_SIZE")), (Some("2"), Some("2")));
        assert_eq!(get("PARALLELISM_CONFIG_PP_SCHEDULE"), None);
        assert_eq!(get("PARALLELISM_CONFIG_PP_MICROBATCHES"), None);
        let back = accel::AcceleratorConfig::from_lookup(|k| get(k).map(str::to_string)).unwrap();
        assert_eq!(back.parallelism.pp_microbatches_per_step(), 2, "one micro-batch per stage by default");
    }

    #[test]
    fn pipeline_flags_override_the_file_and_reach_the_workers() {
        use accel::pipeline::ScheduleKind;
        let file = AccelerateConfig {
            num_processes: Some(4),
            parallelism_config: Some(
                ParallelismConfig::data_parallel(2).with_pp_size(2).with_pp_schedule(ScheduleKind::GPipe),
            ),
            ..AccelerateConfig::default()
        };
        let p = LaunchPlan::resolve(&flags("p"), Some(&file)).unwrap();
        assert_eq!(p.parallelism.as_ref().unwrap().pp_schedule, ScheduleKind::GPipe);
        assert!(p.worker_env().contains(&("PARALLELISM_CONFIG_PP_SCHEDULE".to_string(), "GPipe".to_string())));
        // Flags override the file's schedule and add micro-batches and virtual stages.
        let f = LaunchArgs {
            pipeline_parallel_schedule: Some(ScheduleKind::Interleaved1F1B),
            pipeline_parallel_microbatches: Some(8),
            pipeline_parallel_virtual_stages: Some(3),
            ..flags("p")
        };
        let p = LaunchPlan::resolve(&f, Some(&file)).unwrap();
        let want = ParallelismConfig::data_parallel(2)
            .with_pp_size(2)
            .with_pp_schedule(ScheduleKind::Interleaved1F1B)
            .with_pp_microbatches(8)
            .with_pp_virtual_stages(3);
        assert_eq!(p.parallelism.as_ref(), Some(&want));
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        let env = p.worker_env();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("PARALLELISM_CONFIG_PP_SCHEDULE"), Some("Interleaved1F1B"));
        assert_eq!(get("PARALLELISM_CONFIG_PP_MICROBATCHES"), Some("8"));
        assert_eq!(get("PARALLELISM_CONFIG_PP_VIRTUAL_STAGES"), Some("3"));
        let back = accel::AcceleratorConfig::from_lookup(|k| get(k).map(str::to_string)).unwrap();
        assert_eq!(back.parallelism, want);
        // Pipeline settings that do not fit pp are refused before launch, with the key and what fits.
        let f = LaunchArgs {
            pipeline_parallel_schedule: Some(ScheduleKind::Interleaved1F1B),
            pipeline_parallel_microbatches: Some(5),
            ..flags("p")
        };
        let e = LaunchPlan::resolve(&f, Some(&file)).unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid configuration pipeline_parallel_microbatches = \"5\": Interleaved1F1B takes micro-batches in \
             groups of pp = 2; use a multiple of 2: 4 or 6"
        );
        let f = LaunchArgs { pipeline_parallel_microbatches: Some(1), ..flags("p") };
        let e = LaunchPlan::resolve(&f, Some(&file)).unwrap_err().to_string();
        assert!(
            e.ends_with(
                "1 micro-batch cannot fill the 2 pipeline stages (pp 2 × 1 per rank): each stage would \
                             idle most of the step; use at least 2"
            ),
            "{e}"
        );
        // Without pp they are passed along but warned about: nothing reads them.
        let f = LaunchArgs {
            num_processes: Some(2),
            pipeline_parallel_schedule: Some(ScheduleKind::GPipe),
            pipeline_parallel_microbatches: Some(4),
            ..flags("p")
        };
        let p = LaunchPlan::resolve(&f, None).unwrap();
        assert_eq!(
            p.warnings,
            ["pipeline_parallel_schedule GPipe, pipeline_parallel_microbatches 4 only apply to pipeline parallelism \
              and pp_size is 1: ignored (set --parallelism-config-pp-size or parallelism_config_pp_size above 1 to \
              use a pipeline)"]
        );
        let f = LaunchArgs { pipeline_parallel_virtual_stages: Some(1), ..flags("p") };
        let p = LaunchPlan::resolve(&f, None).unwrap();
        assert!(p.warnings[0].starts_with("pipeline_parallel_virtual_stages 1 only applies to"), "{:?}", p.warnings);
    }

    #[test]
    fn the_config_description_names_the_pipeline() {
        use accel::pipeline::ScheduleKind;
        let file = AccelerateConfig {
            num_processes: Some(4),
            parallelism_config: Some(
                ParallelismConfig::data_parallel(2).with_pp_size(2).with_pp_schedule(ScheduleKind::GPipe),
            ),
            ..AccelerateConfig::default()
        };
        let d = describe_config(Path::new("c.yaml"), false, &file, &flags("p"));
        assert_eq!(
            d,
            "c.yaml (it set 4 processes, the layout dp_replicate 2 × dp_shard 1 × tp 1 × pp 2 (GPipe, 2 \
             micro-batches))"
        );
        let f = LaunchArgs { pipeline_parallel_microbatches: Some(4), ..flags("p") };
        let d = describe_config(Path::new("c.yaml"), false, &file, &f);
        assert_eq!(
            d,
            "c.yaml (it set 4 processes; flags overrode its layout dp_replicate 2 × dp_shard 1 × tp 1 × pp 2 (GPipe, 2 \
             micro-batches))"
        );
    }

    /// An FSDP file of `n` processes on the CPU, its `fsdp_config` holding `strategy` when given.
    fn fsdp_file(n: usize, strategy: Option<&str>) -> AccelerateConfig {
        let mut f = AccelerateConfig {
            distributed_type: DistributedType::Fsdp,
            num_processes: Some(n),
            use_cpu: true,
            ..AccelerateConfig::default()
        };
        if let Some(s) = strategy {
            f.fsdp_config = Some([("fsdp_sharding_strategy".to_string(), serde_json::json!(s))].into());
        }
        f
    }

    #[test]
    fn an_fsdp_file_shards_the_data_parallel_processes_with_its_strategy() {
        use accel::ShardingStrategy::*;
        // No block: the 4 processes are dp_shard, with the file's strategy, and the workers read back the same.
        let p = LaunchPlan::resolve(&flags("p"), Some(&fsdp_file(4, Some("SHARD_GRAD_OP")))).unwrap();
        assert_eq!(p.parallelism, Some(ParallelismConfig::default().with_dp_shard_size(4)));
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        let env = p.worker_env();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("FSDP_SHARDING_STRATEGY"), Some("SHARD_GRAD_OP"));
        assert_eq!(
            (get("PARALLELISM_CONFIG_DP_SHARD_SIZE"), get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE")),
            (Some("4"), Some("1"))
        );
        let back = accel::AcceleratorConfig::from_lookup(|k| get(k).map(str::to_string)).unwrap();
        assert_eq!(Some(back.parallelism), p.parallelism);
        // tp 2 from a flag: the 2 data-parallel processes shard.
        let f = LaunchArgs { parallelism_config_tp_size: Some(2), ..flags("p") };
        let p = LaunchPlan::resolve(&f, Some(&fsdp_file(4, Some("shard_optim")))).unwrap();
        let want =
            ParallelismConfig::default().with_tp_size(2).with_dp_shard_size(2).with_sharding_strategy(ShardOptim);
        assert_eq!(p.parallelism, Some(want));
        // A block that splits the data-parallel processes itself (HSDP) is kept.
        let file = AccelerateConfig {
            parallelism_config: Some(ParallelismConfig::data_parallel(2).with_dp_shard_size(2)),
            ..fsdp_file(4, Some("NO_SHARD"))
        };
        let p = LaunchPlan::resolve(&flags("p"), Some(&file)).unwrap();
        let want = ParallelismConfig::data_parallel(2).with_dp_shard_size(2).with_sharding_strategy(NoShard);
        assert_eq!(p.parallelism, Some(want));
        // No strategy: FULL_SHARD, as Accelerate, passed to the workers (who read back the same); the flag picks
        // another.
        let p = LaunchPlan::resolve(&flags("p"), Some(&fsdp_file(4, None))).unwrap();
        assert_eq!(
            p.parallelism,
            Some(ParallelismConfig::default().with_dp_shard_size(4).with_sharding_strategy(FullShard))
        );
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        let env = p.worker_env();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("FSDP_SHARDING_STRATEGY"), Some("FULL_SHARD"));
        assert_eq!(
            (get("PARALLELISM_CONFIG_DP_SHARD_SIZE"), get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE")),
            (Some("4"), Some("1"))
        );
        let back = accel::AcceleratorConfig::from_lookup(|k| get(k).map(str::to_string)).unwrap();
        assert_eq!(back.parallelism.sharding_strategy, FullShard);
        assert_eq!(Some(back.parallelism), p.parallelism);
        let f = LaunchArgs { fsdp_sharding_strategy: Some(ShardGradOp), ..flags("p") };
        let p = LaunchPlan::resolve(&f, Some(&fsdp_file(4, None))).unwrap();
        assert_eq!(p.parallelism.as_ref().map(|p| (p.dp_shard_size, p.sharding_strategy)), Some((4, ShardGradOp)));
        // The flag overrides the file's strategy.
        let f = LaunchArgs { fsdp_sharding_strategy: Some(ShardOptim), ..flags("p") };
        let p = LaunchPlan::resolve(&f, Some(&fsdp_file(4, Some("SHARD_GRAD_OP")))).unwrap();
        assert!(p.worker_env().contains(&("FSDP_SHARDING_STRATEGY".to_string(), "SHARD_OPTIM".to_string())));
        // One process: nothing to shard, nothing refused, no strategy passed.
        let p = LaunchPlan::resolve(&flags("p"), Some(&fsdp_file(1, None))).unwrap();
        assert_eq!(p.parallelism.as_ref().map(|p| p.dp_shard_size), Some(1));
        assert!(p.worker_env().iter().all(|(k, _)| k != "FSDP_SHARDING_STRATEGY"));
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    }

    #[test]
    fn a_data_parallel_layout_with_dp_shard_runs_zero_2_unless_told_otherwise() {
        let file = AccelerateConfig {
            distributed_type: DistributedType::MultiCpu,
            num_processes: Some(4),
            parallelism_config: Some(ParallelismConfig::data_parallel(2).with_dp_shard_size(2)),
            ..AccelerateConfig::default()
        };
        let p = LaunchPlan::resolve(&flags("p"), Some(&file)).unwrap();
        assert!(p.worker_env().contains(&("FSDP_SHARDING_STRATEGY".to_string(), "SHARD_GRAD_OP".to_string())));
        let f = LaunchArgs { fsdp_sharding_strategy: Some(accel::ShardingStrategy::NoShard), ..flags("p") };
        let p = LaunchPlan::resolve(&f, Some(&file)).unwrap();
        assert!(p.worker_env().contains(&("FSDP_SHARDING_STRATEGY".to_string(), "NO_SHARD".to_string())));
        // The flag with dp_shard 1: a warning, and nothing passed.
        let f = LaunchArgs {
            num_processes: Some(2),
            fsdp_sharding_strategy: Some(accel::ShardingStrategy::ShardOptim),
            ..flags("p")
        };
        let p = LaunchPlan::resolve(&f, None).unwrap();
        assert_eq!(
            p.warnings,
            ["fsdp_sharding_strategy SHARD_OPTIM only applies to sharded data parallelism and dp_shard_size is 1: \
              ignored (set --parallelism-config-dp-shard-size or parallelism_config_dp_shard_size above 1, or \
              distributed_type FSDP, to shard)"]
        );
        assert!(p.worker_env().iter().all(|(k, _)| k != "FSDP_SHARDING_STRATEGY"));
        // The same from the file's fsdp_config, without a layout block.
        let mut file = AccelerateConfig { num_processes: Some(2), ..AccelerateConfig::default() };
        file.set_sharding_strategy(accel::ShardingStrategy::NoShard);
        let p = LaunchPlan::resolve(&flags("p"), Some(&file)).unwrap();
        assert!(p.warnings[0].starts_with("fsdp_sharding_strategy NO_SHARD only applies to"), "{:?}", p.warnings);
    }

    #[test]
    fn cpu_offload_is_refused_and_fsdp_replicas_that_shard_nothing_are_warned_about() {
        let mut file = fsdp_file(4, Some("SHARD_GRAD_OP"));
        file.fsdp_config.as_mut().unwrap().insert("fsdp_offload_params".into(), serde_json::json!(true));
        let e = LaunchPlan::resolve(&flags("p"), Some(&file)).unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid fsdp_offload_params \"true\": CPU offload of the parameters is not implemented (each rank keeps \
             its shards on the device it trains on; on the CPU it would be the same memory); set \
             fsdp_offload_params to false in fsdp_config, or run `accel config` again"
        );
        file.fsdp_config.as_mut().unwrap().insert("fsdp_offload_params".into(), serde_json::json!(false));
        LaunchPlan::resolve(&flags("p"), Some(&file)).unwrap();
        // FSDP whose block replicates every data-parallel process: nothing shards, said once.
        let file =
            AccelerateConfig { parallelism_config: Some(ParallelismConfig::data_parallel(4)), ..fsdp_file(4, None) };
        let p = LaunchPlan::resolve(&flags("p"), Some(&file)).unwrap();
        assert_eq!(
            p.warnings,
            ["distributed_type FSDP with dp_replicate_size 4 and dp_shard_size 1 shards nothing: the 4 processes run \
              plain data parallelism (leave dp_replicate_size and dp_shard_size 1 to shard over every data-parallel \
              process, or set dp_shard_size)"]
        );
    }

    #[test]
    fn the_config_description_names_fsdp_and_the_sharding_strategy() {
        let mut file = AccelerateConfig {
            parallelism_config: Some(ParallelismConfig::data_parallel(2).with_dp_shard_size(2)),
            ..fsdp_file(4, None)
        };
        file.fsdp_config = Some([("fsdp_reshard_after_forward".to_string(), serde_json::json!(false))].into());
        assert_eq!(
            describe_config(Path::new("c.yaml"), false, &file, &flags("p")),
            "c.yaml (it set 4 processes, distributed_type FSDP, the layout dp_replicate 2 × dp_shard 2 \
             (SHARD_GRAD_OP) × tp 1 × pp 1)"
        );
        let f = LaunchArgs { fsdp_sharding_strategy: Some(accel::ShardingStrategy::ShardOptim), ..flags("p") };
        assert_eq!(
            describe_config(Path::new("c.yaml"), false, &file, &f),
            "c.yaml (it set 4 processes, distributed_type FSDP; flags overrode its layout dp_replicate 2 × dp_shard 2 \
             (SHARD_GRAD_OP) × tp 1 × pp 1)"
        );
    }

    #[test]
    fn worker_env_uses_accelerate_names() {
        let file = AccelerateConfig {
            debug: true,
            gpu_ids: Some("0,1".into()),
            use_cpu: false,
            parallelism_config: Some(ParallelismConfig::data_parallel(2)),
            ..AccelerateConfig::default()
        };
        let f = LaunchArgs {
            num_processes: Some(2),
            mixed_precision: Some("bf16".into()),
            gradient_accumulation_steps: Some(4),
            ..flags("p")
        };
        let p = LaunchPlan::resolve(&f, Some(&file)).unwrap();
        let env = p.worker_env();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("ACCELERATE_MIXED_PRECISION"), Some("bf16"));
        assert_eq!(get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"), Some("4"));
        assert_eq!(get("ACCELERATE_DEBUG_MODE"), Some("true"));
        assert_eq!(get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE"), Some("2"));
        assert_eq!(get("PARALLELISM_CONFIG_TP_SIZE"), Some("1"));
        assert_eq!(get("ACCELERATE_USE_CPU"), Some("false"));
        assert_eq!(get("CUDA_VISIBLE_DEVICES"), Some("0,1"));
        // The values parse back into the Accelerator's config.
        let acc = accel::AcceleratorConfig::from_lookup(|k| get(k).map(str::to_string)).unwrap();
        assert_eq!((acc.mixed_precision, acc.gradient_accumulation_steps), (MixedPrecision::Bf16, 4));
    }

    #[test]
    fn log_dir_without_tee_writes_files_only() {
        let p = LaunchPlan::resolve(&LaunchArgs { log_dir: Some("logs".into()), ..flags("p") }, None).unwrap();
        assert!(!p.tee);
        let p = LaunchPlan::resolve(
            &LaunchArgs { log_dir: Some("logs".into()), tee: Some("3".into()), ..flags("p") },
            None,
        )
        .unwrap();
        assert!(p.tee);
    }

    #[test]
    fn missing_programs_are_reported() {
        let e = check_program(Path::new("./definitely/not/here")).unwrap_err().to_string();
        assert!(e.contains("not found"), "{e}");
        let e = check_program(Path::new("accel-no-such-program-xyz")).unwrap_err().to_string();
        assert!(e.contains("not on PATH"), "{e}");
        check_program(Path::new("sh")).unwrap();
    }

    #[test]
    fn busy_port_is_detected() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let p = LaunchPlan::resolve(&LaunchArgs { main_process_port: Some(port), ..flags("p") }, None).unwrap();
        let e = check_port(&p).unwrap_err();
        assert!(matches!(e, CliError::PortInUse { port: q, .. } if q == port), "{e}");
    }

    #[test]
    fn accelerate_launch_flags_have_accelerate_meanings() {
        // --multi_gpu overrides a CPU config file; --num_cpu_threads_per_process sets the thread variables.
        let file = AccelerateConfig {
            use_cpu: true,
            distributed_type: DistributedType::MultiCpu,
            rdzv_backend: Some("static".into()),
            ..AccelerateConfig::default()
        };
        let f = LaunchArgs {
            multi_gpu: true,
            num_processes: Some(2),
            num_cpu_threads_per_process: Some(3),
            enable_cpu_affinity: true,
            print_plan: true,
            ..flags("p")
        };
        let p = LaunchPlan::resolve(&f, Some(&file)).unwrap();
        assert!(!p.use_cpu && p.warnings.is_empty(), "{:?}", p.warnings);
        let env = p.worker_env();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!((get("ACCELERATE_USE_CPU"), get("OMP_NUM_THREADS")), (Some("false"), Some("3")));
        assert_eq!((get("RAYON_NUM_THREADS"), get("ACCELERATE_CPU_AFFINITY")), (Some("3"), Some("1")));
        assert_eq!(get(accel::plan::PRINT_PLAN_ENV), Some("1"), "--print-plan reaches the workers");
        let quiet = LaunchPlan::resolve(&LaunchArgs { num_processes: Some(2), ..flags("p") }, Some(&file)).unwrap();
        assert!(!quiet.worker_env().iter().any(|(k, _)| k == accel::plan::PRINT_PLAN_ENV));

        let e = LaunchPlan::resolve(&LaunchArgs { multi_gpu: true, ..flags("p") }, None).unwrap_err().to_string();
        assert!(e.contains("--multi_gpu needs at least 2 processes"), "{e}");
        let f = LaunchArgs { rdzv_backend: Some("c10d".into()), ..flags("p") };
        let p = LaunchPlan::resolve(&f, None).unwrap();
        assert_eq!(p.warnings.len(), 1);
        assert!(p.warnings[0].starts_with("rdzv_backend \"c10d\" is not used"), "{:?}", p.warnings);
    }

    #[test]
    fn fewer_gpu_ids_than_gpu_processes_is_refused() {
        let f = LaunchArgs { num_processes: Some(2), gpu_ids: Some("0".into()), ..flags("p") };
        let e = LaunchPlan::resolve(&f, None).unwrap_err().to_string();
        assert!(e.starts_with("2 GPU processes per machine but gpu_ids \"0\" names 1 GPU(s)"), "{e}");
        // On the CPU the ids do not matter; `all` and enough ids are fine.
        LaunchPlan::resolve(&LaunchArgs { cpu: true, ..f.clone() }, None).unwrap();
        LaunchPlan::resolve(&LaunchArgs { gpu_ids: Some("all".into()), ..f.clone() }, None).unwrap();
        LaunchPlan::resolve(&LaunchArgs { gpu_ids: Some("2,3".into()), ..f }, None).unwrap();
    }
}

#[cfg(test)]
mod elastic_tests {
    use super::*;
    use crate::args::MachineCount;

    #[test]
    fn an_elastic_range_and_the_rendezvous_settings_reach_the_launcher() {
        let mut f = LaunchArgs { program: "train".into(), ..LaunchArgs::default() };
        f.num_machines = Some(MachineCount::parse("1:2").unwrap());
        f.nproc_per_node = Some(2);
        f.main_process_ip = Some("10.0.0.1".into());
        f.rdzv_conf = Some("last_call_timeout=5, join_timeout=60".into());
        let plan = LaunchPlan::resolve(&f, None).unwrap();
        assert_eq!((plan.num_machines, plan.min_machines, plan.nproc_per_node()), (2, Some(1), 2));
        let cfg = plan.to_launch_config();
        assert_eq!((cfg.nnodes, cfg.min_nnodes, cfg.master_port), (2, Some(1), DEFAULT_MASTER_PORT));
        assert_eq!((cfg.last_call, cfg.rdzv_timeout), (Duration::from_secs(5), Duration::from_secs(60)));
        assert!(plan.summary().contains("machine 0 of an elastic job on 1..2 machines runs 2 processes"));

        f.rdzv_conf = Some("read_timeout=5".into());
        let e = LaunchPlan::resolve(&f, None).unwrap_err().to_string();
        assert!(e.contains("read_timeout") && e.contains("last_call_timeout, join_timeout"), "{e}");
        assert_eq!(MachineCount::parse("3"), Ok(MachineCount { min: None, max: 3 }));
        for bad in ["2:1", "0:2", "a:2", "x"] {
            assert!(MachineCount::parse(bad).is_err(), "{bad}");
        }
        assert!(MachineCount::parse("2:1").unwrap_err().contains("1 <= MIN <= MAX"));
        // torchrun's spelling of machine 0's address and port.
        f.rdzv_conf = None;
        f.main_process_ip = None;
        f.rdzv_endpoint = Some("10.0.0.7:29611".into());
        let plan = LaunchPlan::resolve(&f, None).unwrap();
        assert_eq!((plan.main_process_ip.as_str(), plan.main_process_port), ("10.0.0.7", 29611));
        f.rdzv_endpoint = Some("10.0.0.7".into());
        let e = LaunchPlan::resolve(&f, None).unwrap_err().to_string();
        assert!(e.contains("rdzv_endpoint") && e.contains("HOST:PORT"), "{e}");
    }
}
