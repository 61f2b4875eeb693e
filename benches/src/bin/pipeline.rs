//! Pipeline schedules on the char-GPT, measured: for each pp size (`--pp`, default 2 and 4), schedule and
//! micro-batch count, `pp` processes (one pp rank each) run the schedule; the bench prints the step time, tokens/s,
//! each rank's **measured** idle (bubble) fraction beside the model `(pp − 1) / (v·m + pp − 1)`, each rank's peak
//! resident memory, and the measured timeline of one step drawn as text (forwards as the micro-batch's digit,
//! backwards as its letter, idle as `.`). A second pass runs each schedule with a large batch (`--memory-batch-size`)
//! so that activations dominate the resident memory, beside a small-batch baseline: the peak activation memory of
//! GPipe, 1F1B and interleaved 1F1B on the first and the last stage.
//!
//! ```text
//! cargo run -p accel-benches --bin pipeline                   # pp 2 and 4; GPipe, 1F1B, interleaved; m 1, 2, 4, 8
//! cargo run -p accel-benches --bin pipeline -- --pp 2 --microbatches 4 --steps 20 --memory-batch-size 0
//! ```
//!
//! Each configuration runs in fresh processes (launched by this one), so each rank's peak resident memory
//! (`VmHWM`) is that configuration's alone. Configurations the library refuses (`PipelineSchedule::new`: fewer
//! micro-batches than pp ranks; interleaved with m not a multiple of pp) or that do not fit the model
//! (`split_layers`: more stages than layers) are skipped with the library's message.
//!
//! What a step is here: one `accel::pipeline::run_schedule` over the global batch (forwards, backwards, sends and
//! receives; no optimizer step), each rank starting after a barrier. The bubble of a rank is `1 − (its forward and
//! backward time) / (its step's wall time)`; the median over the timed steps is printed. The model is
//! `GptConfig::small` with `--layers-per-rank` × pp layers (default 2 per rank: 4 layers at pp 2, which is
//! `GptConfig::small` itself, 8 at pp 4), its stages given to the builder (`VarBuilder::with_stages`; GPipe and 1F1B: one stage per
//! rank; interleaved 1F1B: 2 stages per rank); the data the shipped Shakespeare text. With more ranks than cores the
//! processes share cores: the measured bubble is then not the schedule's alone (a rank also waits for a core).

use accel::data::CharVocab;
use accel::nn::VarBuilder;
use accel::pipeline::{run_schedule, simulate, split_layers, Action, Costs, PipelineLinks, PipelineModel};
use accel::pipeline::{PipelineSchedule, ScheduleKind, ShapeBook, SimReport, Span};
use accel::pipeline::{Stage, StagedModel};
use accel::tensor_parallel::TensorParallel;
use accel_examples::gpt::{CharGpt, GptConfig};
use anyhow::Context;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use clap::Parser;
use ddp_core::launcher::{launch, LaunchConfig};
use ddp_core::ProcessGroup;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Pipeline schedules on the char-GPT at pp 2 and 4: step time, measured bubble, peak memory per rank, timelines.
#[derive(Parser, Debug)]
struct Cli {
    /// Pipeline sizes, comma-separated (each runs that many processes on this machine).
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    pp: Vec<usize>,
    /// Schedules, comma-separated (GPipe, 1F1B, Interleaved1F1B; interleaved runs 2 stages per rank).
    #[arg(long, value_delimiter = ',', default_value = "GPipe,1F1B,Interleaved1F1B")]
    schedules: Vec<String>,
    /// Micro-batch counts, comma-separated (each divides --batch-size); those a schedule refuses are skipped.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    microbatches: Vec<usize>,
    /// Sequences per step (the global batch).
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Timed steps per configuration.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Transformer blocks per pp rank: the model has this × pp layers (2: `GptConfig::small`'s 4 at pp 2, 8 at
    /// pp 4, 1 per stage interleaved).
    #[arg(long, default_value_t = 2)]
    layers_per_rank: usize,
    /// The memory pass: sequences per step (0 skips the pass); its baseline runs GPipe with one sequence per
    /// micro-batch.
    #[arg(long, default_value_t = 128)]
    memory_batch_size: usize,
    /// The memory pass: micro-batches per step.
    #[arg(long, default_value_t = 8)]
    memory_microbatches: usize,
    /// The memory pass: timed steps (1 untimed first).
    #[arg(long, default_value_t = 3)]
    memory_steps: usize,
    /// Internal: run one configuration as a worker (the first --pp, --schedules and --microbatches) and write
    /// this rank's figures to this directory.
    #[arg(long, hide = true)]
    worker_out: Option<PathBuf>,
}

fn main() -> std::process::ExitCode {
    accel_examples::run_main(run)
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match &cli.worker_out {
        Some(dir) => worker(&cli, dir),
        None => driver(&cli),
    }
}

/// One configuration to launch.
#[derive(Clone, Debug)]
struct Config {
    pp: usize,
    kind: ScheduleKind,
    m: usize,
    batch: usize,
    steps: usize,
    warmup: usize,
}

impl Config {
    fn v(&self) -> usize {
        if self.kind == ScheduleKind::Interleaved1F1B {
            2
        } else {
            1
        }
    }
}

/// What the ranks of one configuration measured.
struct Measured {
    /// The step: the largest of the ranks' median wall times, seconds.
    step: f64,
    bubble: Vec<f64>,
    rss_mib: Vec<f64>,
    timeline: Vec<Vec<Span>>,
}

fn gpt_config(vocab: usize, layers_per_rank: usize, pp: usize) -> GptConfig {
    GptConfig { n_layer: layers_per_rank * pp, ..GptConfig::small(vocab) }
}

fn load_avg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// The launching process: checks every configuration against the library, launches the ones that run, prints
/// the tables and timelines.
fn driver(cli: &Cli) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(accel_examples::default_text_path())?;
    let vocab = CharVocab::from_text(&text).len();
    let kinds = cli.schedules.iter().map(|s| s.parse::<ScheduleKind>()).collect::<Result<Vec<_>, _>>()?;
    for &m in &cli.microbatches {
        anyhow::ensure!(
            m > 0 && cli.batch_size.is_multiple_of(m),
            "--batch-size {} is not divisible by {m} micro-batches",
            cli.batch_size
        );
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (d_model, block) = (GptConfig::small(vocab).d_model, GptConfig::small(vocab).block_size);
    println!(
        "pipeline bench: char-GPT d_model {d_model}, {} layers per rank, context {block}; batch {} sequences = {} \
         tokens per step; {} timed steps after {} warm-up; {cores} cores; load average {} (1, 5, 15 min)",
        cli.layers_per_rank,
        cli.batch_size,
        cli.batch_size * block,
        cli.steps,
        cli.warmup,
        load_avg()
    );
    let started = Instant::now();
    let tmp = std::env::temp_dir().join(format!("accel-pipeline-bench-{}", std::process::id()));
    let mut timelines = Vec::new();
    for &pp in &cli.pp {
        let cfg = gpt_config(vocab, cli.layers_per_rank, pp);
        println!();
        println!(
            "pp {pp}: {} layers ({} parameters), {pp} processes on {cores} cores{}",
            cfg.n_layer,
            cfg.num_parameters(),
            if pp > cores {
                format!(
                    " — OVERSUBSCRIBED: {pp} ranks share {cores} cores, so step times are slower than on {pp} cores \
                     and the measured bubble of a rank also holds the time it waited for a core"
                )
            } else {
                String::new()
            }
        );
        let mut rows = Vec::new();
        let mut skipped = Vec::new();
        for &kind in &kinds {
            for &m in &cli.microbatches {
                let c = Config { pp, kind, m, batch: cli.batch_size, steps: cli.steps, warmup: cli.warmup };
                if let Err(why) = runnable(&c, &cfg) {
                    skipped.push(format!("{kind} m {m}: {why}"));
                    continue;
                }
                let got = run_config(cli, &c, &tmp)?;
                let label = format!("pp {pp} {kind} m {m}");
                timelines.push((label, got.timeline.clone()));
                rows.push((c, got));
            }
        }
        let ranks = (0..pp).map(|r| r.to_string()).collect::<Vec<_>>().join(" / ");
        println!(
            "| schedule | m | step ms | tokens/s | bubble, rank {ranks} | model (p−1)/(v·m+p−1) | \
             peak RSS MiB, rank {ranks} |"
        );
        println!("|---|---:|---:|---:|---|---:|---|");
        for (c, got) in &rows {
            let model = (pp as f64 - 1.0) / ((c.v() * c.m) as f64 + pp as f64 - 1.0);
            println!(
                "| {} | {} | {:.1} | {:.0} | {} | {model:.3} | {} |",
                name(c),
                c.m,
                got.step * 1e3,
                (c.batch * block) as f64 / got.step,
                join(&got.bubble, 3),
                join(&got.rss_mib, 0)
            );
        }
        for s in &skipped {
            println!("skipped at pp {pp}: {s}");
        }
        if cli.memory_batch_size > 0 {
            memory_pass(cli, pp, &cfg, &kinds, &tmp)?;
        }
    }
    println!();
    println!(
        "timelines of the last timed step (one column = 1/60 of the step; forward = micro-batch digit, backward = \
         its letter, idle = .):"
    );
    for (label, rows) in &timelines {
        let makespan = rows.iter().flatten().map(|s| s.end).fold(0.0, f64::max);
        let n = rows.len();
        let drawn = SimReport { timeline: rows.clone(), makespan, bubble: vec![0.0; n], peak_in_flight: vec![0; n] }
            .draw(makespan / 60.0);
        for (r, line) in drawn.lines().enumerate() {
            let head = if r == 0 { label.as_str() } else { "" };
            println!("{head:<28} {line}");
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    println!();
    println!("done in {:.0} s; load average {} (1, 5, 15 min)", started.elapsed().as_secs_f64(), load_avg());
    Ok(())
}

/// Peak activation memory: each schedule at `--memory-batch-size` sequences and `--memory-microbatches`, beside a
/// GPipe baseline with one sequence per micro-batch (code, model, runtime).
fn memory_pass(cli: &Cli, pp: usize, cfg: &GptConfig, kinds: &[ScheduleKind], tmp: &Path) -> anyhow::Result<()> {
    let m = cli.memory_microbatches;
    let (steps, warmup) = (cli.memory_steps, 1);
    let base = Config { pp, kind: ScheduleKind::GPipe, m, batch: m, steps, warmup };
    if let Err(why) = runnable(&base, cfg) {
        println!("memory pass at pp {pp} skipped: {why}");
        return Ok(());
    }
    let baseline = run_config(cli, &base, tmp)?;
    println!();
    println!(
        "peak memory at pp {pp}, m {m}, {} sequences per step ({steps} timed steps after {warmup}); first stage on \
         rank 0, last on rank {}:",
        cli.memory_batch_size,
        pp - 1
    );
    println!(
        "| schedule | first stage MiB | last stage MiB | above the baseline (first / last) | micro-batches held at \
         most (simulator, first / last) | all ranks MiB | step ms |"
    );
    println!("|---|---:|---:|---:|---|---|---:|");
    let last = pp - 1;
    println!(
        "| baseline (GPipe, {m} sequences) | {:.0} | {:.0} | — | — | {} | — |",
        baseline.rss_mib[0],
        baseline.rss_mib[last],
        join(&baseline.rss_mib, 0)
    );
    for &kind in kinds {
        let c = Config { pp, kind, m, batch: cli.memory_batch_size, steps, warmup };
        if let Err(why) = runnable(&c, cfg) {
            println!("skipped: {kind} m {m}: {why}");
            continue;
        }
        anyhow::ensure!(
            c.batch.is_multiple_of(m),
            "--memory-batch-size {} is not divisible by {m} micro-batches",
            c.batch
        );
        let got = run_config(cli, &c, tmp)?;
        let held = simulate(&PipelineSchedule::new(kind, pp, m, c.v())?, Costs::default())?.peak_in_flight;
        println!(
            "| {} | {:.0} | {:.0} | {:.0} / {:.0} | {} / {} | {} | {:.0} |",
            name(&c),
            got.rss_mib[0],
            got.rss_mib[last],
            got.rss_mib[0] - baseline.rss_mib[0],
            got.rss_mib[last] - baseline.rss_mib[last],
            held[0],
            held[last],
            join(&got.rss_mib, 0),
            got.step * 1e3
        );
    }
    Ok(())
}

fn name(c: &Config) -> String {
    if c.v() > 1 {
        format!("{} (v {})", c.kind, c.v())
    } else {
        c.kind.to_string()
    }
}

fn join(v: &[f64], decimals: usize) -> String {
    v.iter().map(|x| format!("{x:.decimals$}")).collect::<Vec<_>>().join(" / ")
}

/// Whether the library takes the configuration: the schedule (`PipelineSchedule::new`) and the split of the model
/// into its stages (`split_layers`); the error is the library's message.
fn runnable(c: &Config, cfg: &GptConfig) -> anyhow::Result<()> {
    let schedule = PipelineSchedule::new(c.kind, c.pp, c.m, c.v())?;
    split_layers(cfg.n_layer, schedule.num_stages(), None)?;
    Ok(())
}

/// Launches `c.pp` workers for one configuration and reads back what each rank wrote.
fn run_config(cli: &Cli, c: &Config, tmp: &Path) -> anyhow::Result<Measured> {
    let dir = tmp.join(format!("pp{}-{}-m{}-b{}", c.pp, c.kind, c.m, c.batch));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let args: Vec<String> = [
        ("--pp", c.pp.to_string()),
        ("--schedules", c.kind.to_string()),
        ("--microbatches", c.m.to_string()),
        ("--batch-size", c.batch.to_string()),
        ("--steps", c.steps.to_string()),
        ("--warmup", c.warmup.to_string()),
        ("--layers-per-rank", cli.layers_per_rank.to_string()),
        ("--worker-out", dir.display().to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect();
    let exe = std::env::current_exe().context("locating this executable to launch its workers")?;
    launch(&LaunchConfig::local(c.pp, exe, args)).with_context(|| format!("pp {} {} m {}", c.pp, c.kind, c.m))?;
    let mut got = Measured { step: 0.0, bubble: Vec::new(), rss_mib: Vec::new(), timeline: Vec::new() };
    for r in 0..c.pp {
        let path = dir.join(format!("rank{r}.json"));
        let v: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).with_context(|| path.display().to_string())?)?;
        let num = |k: &str| v[k].as_f64().with_context(|| format!("{k} in {}", path.display()));
        got.step = got.step.max(num("wall")?);
        got.bubble.push(num("bubble")?);
        got.rss_mib.push(num("rss_mib")?);
        let spans = v["timeline"]
            .as_array()
            .context("timeline")?
            .iter()
            .map(|s| {
                let action: Action = s[0].as_str().context("action")?.parse()?;
                Ok(Span { action, start: s[1].as_f64().context("start")?, end: s[2].as_f64().context("end")? })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        got.timeline.push(spans);
    }
    Ok(got)
}

/// One rank of one configuration: runs the steps and writes its figures to `out/rank{r}.json`.
fn worker(cli: &Cli, out: &Path) -> anyhow::Result<()> {
    let (pp, m) = (cli.pp[0], cli.microbatches[0]);
    let kind: ScheduleKind = cli.schedules[0].parse()?;
    let pg = ProcessGroup::init_from_env().context("joining the pp group")?;
    anyhow::ensure!(pg.world_size() == pp, "pp {pp} on {} processes", pg.world_size());
    let links = PipelineLinks::new(&pg)?;
    let text = std::fs::read_to_string(accel_examples::default_text_path())?;
    let vocab = CharVocab::from_text(&text);
    let cfg = gpt_config(vocab.len(), cli.layers_per_rank, pp);
    let ids = vocab.encode(&text.chars().take(200_000).collect::<String>())?;
    let (x, y) = batch(&ids, cli.batch_size, cfg.block_size)?;
    let v = if kind == ScheduleKind::Interleaved1F1B { 2 } else { 1 };
    let schedule = PipelineSchedule::new(kind, pp, m, v)?;
    let mut model = Stages::new(&pg, cfg, &schedule, m, x, y)?;
    let (mut walls, mut bubbles, mut last) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..cli.warmup + cli.steps {
        pg.barrier()?;
        let start = Instant::now();
        let out = run_schedule(&schedule, &links, &mut model, &mut ShapeBook::default())?;
        let wall = start.elapsed().as_secs_f64();
        if step >= cli.warmup {
            let busy: f64 = out.timeline.iter().map(|(_, a, b)| b - a).sum();
            walls.push(wall);
            bubbles.push(1.0 - busy / wall);
            last = out.timeline;
        }
    }
    pg.barrier()?;
    let timeline: Vec<Value> = last.iter().map(|(a, s, e)| json!([a.to_string(), s, e])).collect();
    let figures = json!({
        "wall": median(&mut walls),
        "bubble": median(&mut bubbles),
        "rss_mib": accel_examples::peak_rss_mib(),
        "timeline": timeline,
    });
    let path = out.join(format!("rank{}.json", pg.rank()));
    std::fs::write(&path, figures.to_string()).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// `n` windows of `len` + 1 characters spread over `ids`: inputs and next-character targets `[n, len]`.
fn batch(ids: &[u32], n: usize, len: usize) -> anyhow::Result<(Tensor, Tensor)> {
    let stride = (ids.len() - len - 1) / n;
    let rows = |off: usize| -> Vec<u32> {
        (0..n).flat_map(|i| ids[i * stride + off..i * stride + off + len].to_vec()).collect()
    };
    Ok((Tensor::from_vec(rows(0), (n, len), &Device::Cpu)?, Tensor::from_vec(rows(1), (n, len), &Device::Cpu)?))
}

/// This rank's stages of the char-GPT.
struct Stages {
    model: CharGpt,
    varmap: VarMap,
    m: usize,
    x: Tensor,
    y: Tensor,
    tokens: usize,
}

impl Stages {
    fn new(
        pg: &ProcessGroup,
        cfg: GptConfig,
        schedule: &PipelineSchedule,
        m: usize,
        x: Tensor,
        y: Tensor,
    ) -> anyhow::Result<Self> {
        let stages = schedule.num_stages();
        let layers = split_layers(cfg.n_layer, stages, None)?;
        let varmap = VarMap::new();
        let tp = TensorParallel::new(ProcessGroup::single_process()?);
        // This rank's stages, given to the builder outright (this bench runs its own schedule, not the
        // Accelerator's).
        let mine: Vec<Stage> = (pg.rank()..stages)
            .step_by(schedule.pp)
            .map(|s| Stage { index: s, num_stages: stages, layers: layers[s].clone() })
            .collect();
        let vb = VarBuilder::new(&varmap, &tp, 0, DType::F32, &Device::Cpu, CharGpt::plan(&cfg)).with_stages(mine);
        let model = CharGpt::new(cfg, &vb)?;
        let tokens = x.elem_count();
        // The simulator's view of the same schedule must run (a check, not a measurement).
        simulate(schedule, Costs::default())?;
        Ok(Stages { model, varmap, m, x, y, tokens })
    }

    fn rows(&self, t: &Tensor, mb: usize) -> candle_core::Result<Tensor> {
        let n = t.dim(0)? / self.m;
        t.narrow(0, mb * n, n)
    }
}

impl PipelineModel for Stages {
    fn forward(&mut self, stage: usize, mb: usize, input: Option<&Tensor>) -> accel::Result<Tensor> {
        let input = match input {
            Some(t) => t.clone(),
            None => self.rows(&self.x, mb)?,
        };
        self.model.stage_forward(stage, &input)
    }
    fn loss(&mut self, mb: usize, output: &Tensor) -> accel::Result<Tensor> {
        let targets = self.rows(&self.y, mb)?;
        let sum = self.model.token_losses_of(output, &targets)?.sum_all()?;
        Ok((sum / self.tokens as f64)?)
    }
    fn parameters(&self) -> Vec<Var> {
        self.varmap.all_vars()
    }
}
