//! `accel config`: the questions of `accelerate config`, answered line by line on any reader (stdin, or a pipe in
//! tests), producing an [`AccelerateConfig`].
//!
//! Every answer is validated where it is given: an invalid one prints why and asks again (at most
//! [`MAX_ATTEMPTS`] times); input ending early is an error. An empty answer takes the default shown in brackets.
//! Nothing is written here: the caller saves the result atomically, so an aborted questionnaire leaves no file.

use crate::config_file::{AccelerateConfig, DistributedType, ParallelismConfig};
use crate::error::{CliError, CliResult};
use accel::config::MixedPrecision;
use accel::pipeline::ScheduleKind;
use accel::ShardingStrategy;
use std::io::{BufRead, Write};

/// How many invalid answers to one question are tolerated before giving up.
pub const MAX_ATTEMPTS: usize = 5;

/// What the questionnaire knows about the machine: defaults, and the warnings given when an answer asks for more.
#[derive(Debug, Clone, Copy, Default)]
pub struct MachineDefaults {
    /// GPUs this build can use (0 without the `cuda` feature or without GPUs).
    pub gpus: usize,
    /// This build has the `cuda` feature (so `gpus == 0` means no GPU is visible, not that none could be seen).
    pub cuda_compiled: bool,
}

/// Asks the questions on `input`, writing prompts and complaints to `out`, and returns the config.
///
/// Order: CPU or GPU; number of machines; for several machines this machine's rank, the main machine's address
/// and port and whether all share a network; total number of processes; for more than one process the
/// tensor-parallel and pipeline-parallel sizes (the data-parallel size is what remains: processes / (tp × pp)),
/// the data-parallel processes that shard (dp_shard) and, above 1, what they shard (default SHARD_GRAD_OP,
/// written as `fsdp_config: {fsdp_sharding_strategy: ...}`), with pp above 1 the pipeline schedule
/// (default 1F1B) and micro-batches per step (default one per stage); GPU ids; mixed precision. A
/// `parallelism_config` block is written only when tp, pp or dp_shard is above 1; `distributed_type` stays
/// `MULTI_CPU` / `MULTI_GPU` (the block and `fsdp_config` say what is sharded).
///
/// Errors: [`CliError::Questionnaire`] when the input ends or a question got [`MAX_ATTEMPTS`] invalid answers.
pub fn ask(input: &mut dyn BufRead, out: &mut dyn Write, machine: MachineDefaults) -> CliResult<AccelerateConfig> {
    let mut q = Asker { input, out };
    let default_device = if machine.gpus > 0 { "gpu" } else { "cpu" };
    let use_cpu = q.ask("Compute on the CPU or on GPUs? [cpu/gpu]", Some(default_device), |s| {
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(true),
            "gpu" | "cuda" => Ok(false),
            _ => Err("answer `cpu` or `gpu`".to_string()),
        }
    })?;
    if !use_cpu && machine.gpus == 0 {
        // Accelerate writes GPU configs on machines without GPUs too (a login node configuring a cluster job), so
        // this is a warning; the reason says whether this machine or this build cannot see them.
        let why = if machine.cuda_compiled {
            "no GPU is visible on this machine (nvidia-smi lists none)"
        } else {
            "this accel build has no CUDA support (built without `--features cuda`), so it cannot see GPUs"
        };
        q.say(&format!(
            "  warning: {why}; the config is written for GPUs anyway: the programs you launch with it must be built \
             with CUDA and run where GPUs are\n"
        ))?;
    }
    let num_machines = q.ask("How many machines (nodes) will run the job?", Some("1"), |s| positive("machines", s))?;

    let mut cfg = AccelerateConfig { num_machines, use_cpu, ..AccelerateConfig::default() };
    if num_machines > 1 {
        let last = num_machines - 1;
        cfg.machine_rank = q.ask(&format!("What is the rank of this machine (0..{last})?"), Some("0"), |s| {
            let r: usize = s.parse().map_err(|_| format!("{s:?} is not a whole number"))?;
            if r > last {
                return Err(format!("the rank must be between 0 and {last}"));
            }
            Ok(r)
        })?;
        cfg.main_process_ip =
            Some(q.ask("What is the IP address (or host name) of the machine of rank 0?", None, |s| {
                if s.contains(char::is_whitespace) || s.contains('/') {
                    return Err(format!("{s:?} is not an address"));
                }
                Ok(s.to_string())
            })?);
        cfg.main_process_port = Some(q.ask(
            "Which port should the machine of rank 0 listen on?",
            Some("29500"),
            |s| match s.parse::<u16>() {
                Ok(0) => {
                    Err("a multi-machine job needs a fixed port (0 would pick a different one per run)".to_string())
                }
                Ok(p) => Ok(p),
                Err(_) => Err(format!("{s:?} is not a port number (1..65535)")),
            },
        )?);
        cfg.same_network = q.ask("Are all the machines on the same local network? [yes/no]", Some("yes"), yes_no)?;
    }

    let per_machine_default = if use_cpu { 1 } else { machine.gpus.max(1) };
    let default_total = (per_machine_default * num_machines).to_string();
    let num_processes = q.ask("How many processes in total, over all machines?", Some(&default_total), |s| {
        let n = positive("processes", s)?;
        if n % num_machines != 0 {
            return Err(format!(
                "{n} processes cannot be spread evenly over {num_machines} machines; give a multiple of {num_machines}"
            ));
        }
        Ok(n)
    })?;
    cfg.num_processes = Some(num_processes);
    cfg.distributed_type = DistributedType::for_job(num_processes, use_cpu);
    let per_machine = num_processes / num_machines;
    if !use_cpu && machine.gpus > 0 && per_machine > machine.gpus {
        q.say(&format!(
            "  warning: {per_machine} processes per machine, but {} GPU(s) are visible here: processes will share GPUs\n",
            machine.gpus
        ))?;
    }
    if num_processes > 1 {
        cfg.parallelism_config = ask_parallelism(&mut q, num_processes, per_machine)?;
        if let Some(p) = cfg.parallelism_config.as_mut().filter(|p| p.dp_shard_size > 1) {
            // The strategy lives in `fsdp_config` (Accelerate's place for it); the block keeps its serialised keys.
            let s = std::mem::take(&mut p.sharding_strategy);
            cfg.set_sharding_strategy(s);
        }
    }

    if !use_cpu {
        let ids = q.ask("Which GPUs should be used (comma-separated indices, or `all`)?", Some("all"), |s| {
            if s.eq_ignore_ascii_case("all") {
                return Ok("all".to_string());
            }
            let ids: Result<Vec<usize>, _> = s.split(',').map(|p| p.trim().parse::<usize>()).collect();
            match ids {
                // As `accelerate launch`: several GPU processes need at least as many GPU ids.
                Ok(ids) if !ids.is_empty() && ids.len() < per_machine => Err(format!(
                    "{per_machine} GPU processes per machine need {per_machine} GPU ids, but {s:?} names {}; list \
                     one per process (e.g. `{}`) or answer `all`",
                    ids.len(),
                    (0..per_machine).map(|i| i.to_string()).collect::<Vec<_>>().join(",")
                )),
                Ok(ids) if !ids.is_empty() => Ok(ids.iter().map(usize::to_string).collect::<Vec<_>>().join(",")),
                _ => Err(format!("{s:?} is not `all` or a list like `0,1`")),
            }
        })?;
        cfg.gpu_ids = Some(ids);
    }

    if use_cpu {
        q.say(CPU_PRECISION_COSTS)?;
    }
    cfg.mixed_precision =
        q.ask("Mixed precision? [no/fp16/bf16]", Some("no"), |s| match s.to_ascii_lowercase().as_str() {
            "no" | "fp16" | "bf16" => s.parse::<MixedPrecision>().map_err(|e| e.to_string()),
            _ => Err(format!("choose one of {}", MixedPrecision::CHOICES)),
        })?;

    Ok(cfg)
}

/// What each precision costs on a CPU, printed before the question there (measured: docs/benchmarks.md, "bf16 on
/// the CPU"): bf16 is autocast over f32 tensors (accel's `Accelerator::compute_dtype`), fp16 keeps f16 tensors.
const CPU_PRECISION_COSTS: &str =
    "  on the CPU: bf16 runs as autocast (f32 tensors, bf16 products in the linear layers) and \
     costs about what no does (1.05x its step time, docs/benchmarks.md); fp16 keeps f16 tensors, which candle \
     computes about 7x slower than f32 on a CPU\n";

/// The tensor-parallel and pipeline-parallel sizes (each must divide what is left of the processes), without pp the
/// data-parallel processes that shard (dp_shard) and, above 1, what they shard ([`ShardingStrategy`], in the
/// returned config's `sharding_strategy`: SHARD_GRAD_OP, FULL_SHARD, SHARD_OPTIM or NO_SHARD; FULL_SHARD said to
/// need a model built from the prepared model's `param_builder`) and, with pp > 1, the pipeline schedule and
/// micro-batches (checked with the library's rules, [`ParallelismConfig::validate_pipeline`]); `None` when tp, pp
/// and dp_shard are 1 (data parallelism over all processes needs no block). The micro-batches are written only
/// when they are not the default (one per stage).
fn ask_parallelism(
    q: &mut Asker<'_>,
    num_processes: usize,
    per_machine: usize,
) -> CliResult<Option<ParallelismConfig>> {
    let tp = q.ask(
        "Tensor-parallel size (tp: processes that split each layer; 1 = off; auto = choose for me: every size, the \
         sharding and the schedule at start-up, from the model and the measured machines)?",
        Some("1"),
        |s| match s.trim().eq_ignore_ascii_case("auto") {
            true => Ok(None),
            false => dividing("tp", s, num_processes).map(Some),
        },
    )?;
    let Some(tp) = tp else {
        q.say(
            "  auto: the program describes its model (AcceleratorConfig::auto_layout, as accel_gpt does); set \
             ACCEL_AUTO_LAYOUT_MEMORY to plan for less memory than each process has\n",
        )?;
        return Ok(Some(ParallelismConfig::auto()));
    };
    if tp > per_machine {
        q.say(&format!(
            "  warning: tp {tp} is more than the {per_machine} processes of a machine: every layer will talk across \
             machines (keep tp within a machine when you can)\n"
        ))?;
    }
    let pp = q.ask("Pipeline-parallel size (pp: pipeline stages; 1 = off)?", Some("1"), |s| {
        dividing("pp", s, num_processes / tp)
    })?;
    let mut p = ParallelismConfig::data_parallel(num_processes / (tp * pp)).with_tp_size(tp).with_pp_size(pp);
    let dp = num_processes / (tp * pp);
    if dp > 1 {
        // Sharded data parallelism over some of the data-parallel processes; the rest replicate (HSDP).
        let shard = q.ask(
            &format!(
                "Shard the training state over how many of the {dp} data-parallel processes (dp_shard, ZeRO / FSDP: \
                 each holds 1/dp_shard of what is sharded; 1 = off)?"
            ),
            Some("1"),
            |s| dividing("dp_shard", s, dp),
        )?;
        p = p.with_dp_replicate_size(dp / shard).with_dp_shard_size(shard);
        if shard > 1 {
            let choices = SHARDING_CHOICES.map(|s| s.name()).join("/");
            p.sharding_strategy = q.ask(
                &format!(
                    "What do the dp_shard processes shard? [{choices}] (SHARD_GRAD_OP, ZeRO-2: gradients and optimizer \
                     state; FULL_SHARD, ZeRO-3: the parameters too; SHARD_OPTIM, ZeRO-1: optimizer state; NO_SHARD: \
                     nothing, plain DDP)"
                ),
                Some(ShardingStrategy::default().name()),
                |s| {
                    s.parse::<ShardingStrategy>()
                        .map_err(|_| format!("choose one of {}", SHARDING_CHOICES.map(|s| s.name()).join(", ")))
                },
            )?;
            if p.sharding_strategy == ShardingStrategy::FullShard {
                q.say(
                    "  with FULL_SHARD the program must build its model from the prepared model's param_builder() \
                     after prepare_model (as accel_gpt does); a candle VarBuilder model is refused\n",
                )?;
            }
        }
    }
    if pp > 1 {
        q.say("  with pp above 1 the program must split its model into pipeline stages (as accel_gpt does)\n")?;
        p.pp_schedule = q.ask(
            &format!("Pipeline schedule? [{}]", ScheduleKind::CHOICES.replace(", ", "/")),
            Some(ScheduleKind::default().as_str()),
            |s| s.parse::<ScheduleKind>().map_err(|_| format!("choose one of {}", ScheduleKind::CHOICES)),
        )?;
        let stages = p.pp_size * p.pp_stages_per_rank();
        let rule = match p.pp_schedule {
            ScheduleKind::Interleaved1F1B => format!("at least the {stages} stages, a multiple of pp {pp}"),
            _ => format!("at least the {stages} stages"),
        };
        let m =
            q.ask(&format!("Pipeline micro-batches per optimizer step ({rule})?"), Some(&stages.to_string()), |s| {
                let m = positive("micro-batches", s)?;
                p.clone().with_pp_microbatches(m).validate_pipeline().map_err(|e| e.to_string())?;
                Ok(m)
            })?;
        p.pp_microbatches = (m != stages).then_some(m);
    }
    Ok((tp > 1 || pp > 1 || p.dp_shard_size > 1).then_some(p))
}

/// The sharding strategies `accel config` offers, the default first, then from the most sharded down.
const SHARDING_CHOICES: [ShardingStrategy; 4] = [
    ShardingStrategy::ShardGradOp,
    ShardingStrategy::FullShard,
    ShardingStrategy::ShardOptim,
    ShardingStrategy::NoShard,
];

/// A size ≥ 1 that divides `processes` (what is left of the job for this dimension and the ones after it).
fn dividing(what: &str, s: &str, processes: usize) -> Result<usize, String> {
    let n = positive(&format!("{what} ranks"), s)?;
    if !processes.is_multiple_of(n) {
        let divisors: Vec<String> =
            (1..=processes).filter(|d| processes.is_multiple_of(*d)).map(|d| d.to_string()).collect();
        return Err(format!(
            "{what} {n} does not divide the {processes} processes left for it; choose one of {}",
            divisors.join(", ")
        ));
    }
    Ok(n)
}

struct Asker<'a> {
    input: &'a mut dyn BufRead,
    out: &'a mut dyn Write,
}

impl Asker<'_> {
    /// Prints `question [default]: `, reads one line, validates it; re-asks on an invalid answer.
    fn ask<T>(
        &mut self,
        question: &str,
        default: Option<&str>,
        mut parse: impl FnMut(&str) -> Result<T, String>,
    ) -> CliResult<T> {
        for _ in 0..MAX_ATTEMPTS {
            let prompt = match default {
                Some(d) => format!("{question} (default: {d}): "),
                None => format!("{question}: "),
            };
            self.say(&prompt)?;
            let mut line = String::new();
            let n =
                self.input.read_line(&mut line).map_err(|e| CliError::io("cannot read the answer from stdin", e))?;
            if n == 0 {
                self.say("\n")?;
                return Err(CliError::Questionnaire(format!(
                    "the input ended before the question {question:?} was answered"
                )));
            }
            let answer = line.trim();
            let answer = match (answer.is_empty(), default) {
                (true, Some(d)) => d,
                (true, None) => {
                    self.say("  this question has no default; please answer it\n")?;
                    continue;
                }
                (false, _) => answer,
            };
            match parse(answer) {
                Ok(v) => return Ok(v),
                Err(why) => self.say(&format!("  invalid answer {answer:?}: {why}\n"))?,
            }
        }
        Err(CliError::Questionnaire(format!("{MAX_ATTEMPTS} invalid answers to the question {question:?}")))
    }

    fn say(&mut self, text: &str) -> CliResult<()> {
        self.out
            .write_all(text.as_bytes())
            .and_then(|_| self.out.flush())
            .map_err(|e| CliError::io("cannot write the question to stdout", e))
    }
}

fn positive(what: &str, s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err(format!("the number of {what} must be at least 1")),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a whole number")),
    }
}

fn yes_no(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "y" => Ok(true),
        "n" => Ok(false),
        _ => accel::config::parse_bool("answer", s).map_err(|_| "answer yes or no".to_string()),
    }
}

/// The config `accel config default` writes: Accelerate's `write_basic_config` (one process on the CPU, or one per
/// GPU when CUDA is compiled in and GPUs are present) with the given precision.
pub fn basic_config(mixed_precision: MixedPrecision, machine: MachineDefaults) -> AccelerateConfig {
    let use_cpu = machine.gpus == 0;
    let num_processes = machine.gpus.max(1);
    AccelerateConfig {
        distributed_type: DistributedType::for_job(num_processes, use_cpu),
        gpu_ids: (!use_cpu).then(|| "all".to_string()),
        mixed_precision,
        num_processes: Some(num_processes),
        use_cpu,
        ..AccelerateConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(answers: &str, gpus: usize) -> (CliResult<AccelerateConfig>, String) {
        let mut input = answers.as_bytes();
        let mut out = Vec::new();
        let r = ask(&mut input, &mut out, MachineDefaults { gpus, cuda_compiled: gpus > 0 });
        (r, String::from_utf8(out).unwrap())
    }

    #[test]
    fn defaults_give_one_cpu_process() {
        let (cfg, _) = run("\n\n\n\n", 0);
        let cfg = cfg.unwrap();
        assert!(cfg.use_cpu);
        assert_eq!((cfg.num_machines, cfg.num_processes), (1, Some(1)));
        assert_eq!(cfg.distributed_type, DistributedType::No);
        assert_eq!(cfg.mixed_precision, MixedPrecision::No);
    }

    #[test]
    fn multi_machine_answers_are_recorded() {
        // gpu; 2 machines; rank 1; address; port; not the same network; 8 processes; tp 2; pp 1; dp_shard 1; ids;
        // bf16.
        let (cfg, _) = run("gpu\n2\n1\n10.1.2.3\n6000\nno\n8\n2\n\n\n0,1,2,3\nbf16\n", 0);
        let cfg = cfg.unwrap();
        assert!(!cfg.use_cpu);
        assert_eq!((cfg.num_machines, cfg.machine_rank, cfg.num_processes), (2, 1, Some(8)));
        assert_eq!(cfg.main_process_ip.as_deref(), Some("10.1.2.3"));
        assert_eq!(cfg.main_process_port, Some(6000));
        assert!(!cfg.same_network);
        assert_eq!(cfg.gpu_ids.as_deref(), Some("0,1,2,3"));
        assert_eq!(cfg.mixed_precision, MixedPrecision::Bf16);
        assert_eq!(cfg.distributed_type, DistributedType::MultiGpu);
        assert_eq!(cfg.parallelism_config, Some(ParallelismConfig::data_parallel(4).with_tp_size(2)));
    }

    #[test]
    fn invalid_answers_are_asked_again() {
        let (cfg, out) = run("cpu\n2\n0\n127.0.0.1\n0\n29501\nyes\n3\n4\n\n\n\nfp8\nfp16\n", 0);
        let cfg = cfg.unwrap();
        assert_eq!(cfg.num_processes, Some(4));
        assert_eq!(cfg.main_process_port, Some(29501));
        assert_eq!(cfg.mixed_precision, MixedPrecision::Fp16);
        assert_eq!(cfg.parallelism_config, None, "tp 1 and pp 1: no block");
        assert!(out.contains("cannot be spread evenly over 2 machines"), "{out}");
        assert!(out.contains("invalid answer \"fp8\""), "{out}");
        assert!(out.contains("fixed port"), "{out}");
    }

    #[test]
    fn the_cpu_precision_question_says_what_each_costs() {
        let (cfg, out) = run("cpu\n\n\nbf16\n", 0);
        assert_eq!(cfg.unwrap().mixed_precision, MixedPrecision::Bf16);
        assert!(out.contains("on the CPU: bf16 runs as autocast") && out.contains("1.05x its step time"), "{out}");
        assert!(out.contains("fp16 keeps f16 tensors"), "{out}");
        let (cfg, out) = run("gpu\n1\n8\n\n\n\nall\nbf16\n", 8);
        assert_eq!(cfg.unwrap().mixed_precision, MixedPrecision::Bf16, "{out}");
        assert!(!out.contains("on the CPU:"), "GPU configs are not told CPU costs: {out}");
    }

    #[test]
    fn early_end_of_input_is_an_error() {
        let (r, _) = run("cpu\n", 0);
        let e = r.unwrap_err().to_string();
        assert!(e.contains("input ended") && e.contains("no config file was written"), "{e}");
    }

    #[test]
    fn too_many_invalid_answers_is_an_error() {
        let (r, _) = run("x\nx\nx\nx\nx\nx\n", 0);
        assert!(r.unwrap_err().to_string().contains("5 invalid answers"));
    }

    #[test]
    fn auto_at_the_tp_question_chooses_every_size_at_start_up() {
        // cpu; 1 machine; 4 processes; auto (no further layout question); no mixed precision.
        let (cfg, out) = run("cpu\n1\n4\nauto\nno\n", 0);
        let cfg = cfg.unwrap();
        assert_eq!(cfg.parallelism_config, Some(ParallelismConfig::auto()), "{out}");
        assert!(out.contains("auto = choose for me") && out.contains("ACCEL_AUTO_LAYOUT_MEMORY"), "{out}");
        assert!(cfg.to_yaml().unwrap().contains("parallelism_config_tp_size: auto"));
    }

    #[test]
    fn tp_and_pp_sizes_are_asked_after_the_processes_and_must_divide_them() {
        // cpu; 1 machine; 4 processes; tp 3 (refused) then 2; pp 4 (refused: 2 processes are left) then 1;
        // dp_shard 1; no.
        let (cfg, out) = run("cpu\n1\n4\n3\n2\n4\n\n\nno\n", 0);
        assert_eq!(cfg.unwrap().parallelism_config, Some(ParallelismConfig::data_parallel(2).with_tp_size(2)));
        assert!(
            out.contains(
                "invalid answer \"3\": tp 3 does not divide the 4 processes left for it; choose one of 1, 2, 4"
            ),
            "{out}"
        );
        assert!(out.contains("invalid answer \"4\": pp 4 does not divide the 2 processes left for it"), "{out}");
        // pp 2 is accepted; the schedule and the micro-batches default to 1F1B and one per stage (not written).
        let (cfg, out) = run("cpu\n1\n4\n2\n2\n\n\nno\n", 0);
        let p = cfg.unwrap().parallelism_config.unwrap();
        assert_eq!(p, ParallelismConfig::data_parallel(1).with_tp_size(2).with_pp_size(2));
        assert_eq!((p.pp_schedule, p.pp_microbatches_per_step()), (ScheduleKind::OneFOneB, 2));
        assert!(!out.contains("invalid answer"), "{out}");
        assert!(out.contains("the program must split its model into pipeline stages"), "{out}");
        assert!(
            out.contains(
                "Pipeline schedule? [GPipe/1F1B/Interleaved1F1B] (default: 1F1B): Pipeline micro-batches per optimizer \
                 step (at least the 2 stages)? (default: 2): "
            ),
            "{out}"
        );
        // tp wider than a machine: a warning.
        let (cfg, out) = run("cpu\n2\n0\n10.0.0.1\n\nyes\n4\n4\n\nno\n", 0);
        assert_eq!(cfg.unwrap().parallelism_config, Some(ParallelismConfig::data_parallel(1).with_tp_size(4)));
        assert!(out.contains("warning: tp 4 is more than the 2 processes of a machine"), "{out}");
    }

    #[test]
    fn without_pp_the_sharded_data_parallel_processes_and_their_strategy_are_asked_and_checked() {
        // cpu; 1 machine; 4 processes; tp 1; pp 1; dp_shard 3 (refused: 4 data-parallel processes) then 2; the
        // default strategy; no.
        let (cfg, out) = run("cpu\n1\n4\n\n\n3\n2\n\nno\n", 0);
        let cfg = cfg.unwrap();
        assert_eq!(cfg.parallelism_config, Some(ParallelismConfig::data_parallel(2).with_dp_shard_size(2)));
        assert_eq!(cfg.sharding_strategy().unwrap(), ShardingStrategy::ShardGradOp);
        assert_eq!(cfg.distributed_type, DistributedType::MultiCpu, "the type stays; fsdp_config says what shards");
        let block = cfg.fsdp_config.as_ref().unwrap();
        assert_eq!(serde_json::to_string(block).unwrap(), r#"{"fsdp_sharding_strategy":"SHARD_GRAD_OP"}"#);
        assert!(
            out.contains(
                "Shard the training state over how many of the 4 data-parallel processes (dp_shard, ZeRO / FSDP: \
                 each holds 1/dp_shard of what is sharded; 1 = off)? (default: 1): "
            ),
            "{out}"
        );
        assert!(out.contains("invalid answer \"3\": dp_shard 3 does not divide the 4 processes left for it"), "{out}");
        assert!(
            out.contains(
                "What do the dp_shard processes shard? [SHARD_GRAD_OP/FULL_SHARD/SHARD_OPTIM/NO_SHARD] \
                 (SHARD_GRAD_OP, ZeRO-2: gradients and optimizer state; FULL_SHARD, ZeRO-3: the parameters too; \
                 SHARD_OPTIM, ZeRO-1: optimizer state; NO_SHARD: nothing, plain DDP) (default: SHARD_GRAD_OP): "
            ),
            "{out}"
        );
        assert!(!out.contains("with FULL_SHARD"), "{out}");
        // With tp 2: 2 data-parallel processes left, both sharding; a typo is re-asked, saying why; FULL_SHARD is
        // taken, with what it needs of the program.
        let (cfg, out) = run("cpu\n1\n4\n2\n\n2\nzero\nFULL_SHARD\nno\n", 0);
        let cfg = cfg.unwrap();
        // The block keeps the sizes; the strategy goes to `fsdp_config`, where Accelerate keeps it.
        let want = ParallelismConfig::data_parallel(1).with_tp_size(2).with_dp_shard_size(2);
        assert_eq!(cfg.parallelism_config, Some(want));
        assert_eq!(cfg.sharding_strategy().unwrap(), ShardingStrategy::FullShard);
        assert_eq!(
            serde_json::to_string(cfg.fsdp_config.as_ref().unwrap()).unwrap(),
            r#"{"fsdp_sharding_strategy":"FULL_SHARD"}"#
        );
        assert!(
            out.contains("invalid answer \"zero\": choose one of SHARD_GRAD_OP, FULL_SHARD, SHARD_OPTIM, NO_SHARD\n"),
            "{out}"
        );
        assert!(
            out.contains(
                "  with FULL_SHARD the program must build its model from the prepared model's param_builder() after \
                 prepare_model (as accel_gpt does); a candle VarBuilder model is refused\n"
            ),
            "{out}"
        );
        // Another spelling of a strategy is read as it (HYBRID_SHARD: FULL_SHARD over dp_shard).
        let (cfg, _) = run("cpu\n1\n4\n\n\n2\nhybrid_shard\nno\n", 0);
        assert_eq!(cfg.unwrap().sharding_strategy().unwrap(), ShardingStrategy::FullShard);
        let (cfg, _) = run("cpu\n1\n4\n\n\n2\nshard_optim\nno\n", 0);
        assert_eq!(cfg.unwrap().sharding_strategy().unwrap(), ShardingStrategy::ShardOptim);
        // dp_shard 1: no strategy question, no fsdp_config.
        let (cfg, out) = run("cpu\n1\n4\n\n\n\nno\n", 0);
        let cfg = cfg.unwrap();
        assert_eq!((cfg.parallelism_config, cfg.fsdp_config), (None, None));
        assert!(!out.contains("What do the dp_shard processes shard?"), "{out}");
    }

    #[test]
    fn a_sharded_config_round_trips_through_its_file() {
        // cpu; 1 machine; 4 processes; tp 1; pp 1; dp_shard 4; NO_SHARD; no.
        let (cfg, _) = run("cpu\n1\n4\n\n\n4\nno_shard\nno\n", 0);
        let cfg = cfg.unwrap();
        let yaml = cfg.to_yaml().unwrap();
        assert!(yaml.contains("distributed_type: MULTI_CPU\n"), "{yaml}");
        assert!(yaml.contains("fsdp_config:\n  fsdp_sharding_strategy: NO_SHARD\n"), "{yaml}");
        assert!(yaml.contains("  parallelism_config_dp_shard_size: 4\n"), "{yaml}");
        let back = AccelerateConfig::parse(&yaml, std::path::Path::new("c.yaml")).unwrap();
        assert_eq!(back.config, cfg);
        assert!(back.warnings.is_empty(), "{:?}", back.warnings);
        assert_eq!(back.config.sharding_strategy().unwrap(), ShardingStrategy::NoShard);
    }

    #[test]
    fn with_pp_the_schedule_and_micro_batches_are_asked_and_checked() {
        // cpu; 1 machine; 4 processes; tp 1; pp 4; `zigzag` (refused) then interleaved; 4 micro-batches (refused:
        // 8 stages), 10 (refused: not a multiple of 4), 12; no.
        let (cfg, out) = run("cpu\n1\n4\n1\n4\nzigzag\ninterleaved1f1b\n4\n10\n12\nno\n", 0);
        let want = ParallelismConfig::data_parallel(1)
            .with_pp_size(4)
            .with_pp_schedule(ScheduleKind::Interleaved1F1B)
            .with_pp_microbatches(12);
        assert_eq!(cfg.unwrap().parallelism_config, Some(want));
        assert!(out.contains("invalid answer \"zigzag\": choose one of GPipe, 1F1B, Interleaved1F1B"), "{out}");
        assert!(
            out.contains(
                "Pipeline micro-batches per optimizer step (at least the 8 stages, a multiple of pp 4)? \
                          (default: 8): "
            ),
            "{out}"
        );
        assert!(
            out.contains(
                "invalid answer \"4\": invalid configuration pipeline_parallel_microbatches = \"4\": 4 micro-batches \
                 cannot fill the 8 pipeline stages (pp 4 × 2 per rank): each stage would idle most of the step; use \
                 at least 8"
            ),
            "{out}"
        );
        assert!(
            out.contains(
                "invalid answer \"10\": invalid configuration pipeline_parallel_microbatches = \"10\": \
                 Interleaved1F1B takes micro-batches in groups of pp = 4; use a multiple of 4: 8 or 12"
            ),
            "{out}"
        );
        // GPipe with the default count: the default is not written.
        let (cfg, _) = run("cpu\n1\n2\n1\n2\nGPipe\n\nno\n", 0);
        let p = cfg.unwrap().parallelism_config.unwrap();
        assert_eq!((p.pp_schedule, p.pp_microbatches), (ScheduleKind::GPipe, None));
        // Five invalid counts end the questionnaire, as for every question.
        let (r, _) = run("cpu\n1\n2\n1\n2\n\n1\n1\n0\nx\n1\n", 0);
        assert!(r.unwrap_err().to_string().contains("5 invalid answers"));
    }

    #[test]
    fn basic_config_matches_accelerate_write_basic_config() {
        let c = basic_config(MixedPrecision::Bf16, MachineDefaults { gpus: 0, cuda_compiled: false });
        assert!(c.use_cpu);
        assert_eq!((c.num_processes, c.distributed_type.clone()), (Some(1), DistributedType::No));
        let c = basic_config(MixedPrecision::No, MachineDefaults { gpus: 4, cuda_compiled: true });
        assert_eq!((c.num_processes, c.distributed_type), (Some(4), DistributedType::MultiGpu));
    }

    #[test]
    fn gpus_this_machine_cannot_see_are_warned_about_and_too_few_gpu_ids_refused() {
        // gpu; 1 machine; 2 processes; tp 1; pp 1; dp_shard 1; `0` (refused: 2 processes need 2 ids) then `0,1`;
        // no.
        let (cfg, out) = run("gpu\n1\n2\n\n\n\n0\n0,1\nno\n", 0);
        let cfg = cfg.unwrap();
        assert_eq!((cfg.gpu_ids.as_deref(), cfg.distributed_type), (Some("0,1"), DistributedType::MultiGpu));
        assert!(
            out.contains("warning: this accel build has no CUDA support (built without `--features cuda`)"),
            "{out}"
        );
        assert!(
            out.contains("invalid answer \"0\": 2 GPU processes per machine need 2 GPU ids, but \"0\" names 1"),
            "{out}"
        );
        let mut input = "gpu\n1\n4\n\n\n\nall\nno\n".as_bytes();
        let mut out = Vec::new();
        ask(&mut input, &mut out, MachineDefaults { gpus: 0, cuda_compiled: true }).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(out.contains("warning: no GPU is visible on this machine"), "{out}");
        let (_, out) = run("gpu\n1\n4\n\n\n\nall\nno\n", 2);
        assert!(out.contains("warning: 4 processes per machine, but 2 GPU(s) are visible here"), "{out}");
        assert!(!out.contains("no GPU is visible"), "{out}");
    }
}
