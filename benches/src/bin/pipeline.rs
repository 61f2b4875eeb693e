//! Pipeline schedules on the char-GPT, measured: 2 processes (one pp stage each, pp 2), for each schedule and
//! micro-batch count, the step time, tokens/s and each rank's **measured** idle (bubble) fraction beside the model
//! `(pp − 1) / (v·m + pp − 1)`, the measured timeline of one step drawn as text (forwards as the micro-batch's
//! digit, backwards as its letter, idle as `.`), and each rank's peak resident memory over the run (one schedule
//! and micro-batch count per run to compare the activations they hold).
//!
//! ```text
//! cargo run -p accel-benches --bin pipeline                               # GPipe, 1F1B, interleaved; m 2, 4, 8
//! cargo run -p accel-benches --bin pipeline -- --microbatches 4 --steps 20
//! ```
//!
//! What a step is here: one `accel::pipeline::run_schedule` over the global batch (forwards, backwards, sends and
//! receives; no optimizer step), each rank starting after a barrier. The bubble of a rank is `1 − (its forward and
//! backward time) / (the step's wall time)`; the median over the timed steps is printed. The stages are
//! `CharGpt::new_stage` parts of `GptConfig::small` (4 layers: 2 per rank, or 1 per stage and 2 stages per rank
//! interleaved), the data the shipped Shakespeare text.

use accel::data::CharVocab;
use accel::pipeline::{run_schedule, simulate, split_layers, Costs, PipelineLinks, PipelineModel, PipelineSchedule};
use accel::pipeline::{ScheduleKind, SimReport, Span};
use accel::tensor_parallel::{ParamBuilder, TensorParallel};
use accel_examples::gpt::{CharGpt, GptConfig, StagePart};
use anyhow::Context;
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::VarMap;
use clap::Parser;
use ddp_core::{ProcessGroup, ReduceOp};
use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Pipeline schedules on the char-GPT at pp 2: step time and measured bubble per rank.
#[derive(Parser, Debug)]
struct Cli {
    /// Schedules, comma-separated (GPipe, 1F1B, Interleaved1F1B; interleaved runs 2 stages per rank).
    #[arg(long, value_delimiter = ',', default_value = "GPipe,1F1B,Interleaved1F1B")]
    schedules: Vec<String>,
    /// Micro-batch counts, comma-separated (each divides --batch-size).
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
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
}

const PP: usize = 2;

fn main() -> std::process::ExitCode {
    accel_examples::run_main(run)
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if ddp_core::launcher::launch_self(PP)? {
        return Ok(());
    }
    let pg = ProcessGroup::init_from_env().context("joining the pp group")?;
    anyhow::ensure!(pg.world_size() == PP, "the benchmark runs on {PP} processes, got {}", pg.world_size());
    let links = PipelineLinks::new(&pg)?;
    let text = std::fs::read_to_string(accel_examples::default_text_path())?;
    let vocab = CharVocab::from_text(&text);
    let cfg = GptConfig::small(vocab.len());
    let ids = vocab.encode(&text.chars().take(200_000).collect::<String>())?;
    let (x, y) = batch(&ids, cli.batch_size, cfg.block_size)?;
    if pg.rank() == 0 {
        println!(
            "pipeline bench: char-GPT {} parameters (d_model {}, {} layers, context {}), batch {} sequences = {} tokens \
             per step, pp {PP}, {} timed steps after {} warm-up",
            cfg.num_parameters(),
            cfg.d_model,
            cfg.n_layer,
            cfg.block_size,
            cli.batch_size,
            cli.batch_size * cfg.block_size,
            cli.steps,
            cli.warmup
        );
        println!("| schedule | m | step ms | tokens/s | bubble rank 0 | bubble rank 1 | model (p−1)/(v·m+p−1) |");
        println!("|---|---:|---:|---:|---:|---:|---:|");
    }
    for name in &cli.schedules {
        let kind: ScheduleKind = name.parse()?;
        let v = if kind == ScheduleKind::Interleaved1F1B { 2 } else { 1 };
        for &m in &cli.microbatches {
            anyhow::ensure!(
                cli.batch_size % m == 0,
                "--batch-size {} is not divisible by {m} micro-batches",
                cli.batch_size
            );
            let schedule = PipelineSchedule::new(kind, PP, m, v)?;
            let mut model = Stages::new(&pg, cfg, &schedule, m, x.clone(), y.clone())?;
            let (mut walls, mut bubbles, mut last) = (Vec::new(), Vec::new(), Vec::new());
            for step in 0..cli.warmup + cli.steps {
                pg.barrier()?;
                let start = Instant::now();
                let out = run_schedule(&schedule, &links, &mut model)?;
                let wall = start.elapsed().as_secs_f64();
                if step >= cli.warmup {
                    let busy: f64 = out.timeline.iter().map(|(_, a, b)| b - a).sum();
                    walls.push(wall);
                    bubbles.push(1.0 - busy / wall);
                    last = out.timeline;
                }
            }
            let (wall, bubble) = (median(&mut walls), median(&mut bubbles));
            // Rank 1's figures to rank 0: [wall, bubble].
            let mut both = [0f64; 2 * PP];
            pg.all_gather(&[wall, bubble], &mut both)?;
            let model_bubble = (PP as f64 - 1.0) / ((v * m) as f64 + PP as f64 - 1.0);
            if pg.rank() == 0 {
                let step = both[0].max(both[2]);
                println!(
                    "| {kind} | {m} | {:.1} | {:.0} | {:.3} | {:.3} | {model_bubble:.3} |",
                    step * 1e3,
                    (cli.batch_size * cfg.block_size) as f64 / step,
                    both[1],
                    both[3]
                );
            }
            print_timeline(&pg, &last, kind, m)?;
        }
    }
    // The process's peak resident memory: run one schedule and micro-batch count per invocation to compare the
    // activations each holds (GPipe all m micro-batches', 1F1B at most pp − rank).
    let mut rss = [0f64; PP];
    pg.all_gather(&[accel_examples::peak_rss_mib()], &mut rss)?;
    if pg.rank() == 0 {
        println!("peak RSS (MiB, VmHWM, the whole run): rank 0 {:.0}, rank 1 {:.0}", rss[0], rss[1]);
    }
    Ok(())
}

/// This rank's row of the last timed step's timeline (forwards and backwards against the step's own clock),
/// drawn at 1/60 of the step per column; each rank prints its own row.
fn print_timeline(
    pg: &ProcessGroup,
    timeline: &[(accel::pipeline::Action, f64, f64)],
    kind: ScheduleKind,
    m: usize,
) -> anyhow::Result<()> {
    let mut end = [timeline.last().map_or(0.0, |t| t.2)];
    pg.all_reduce(&mut end, ReduceOp::Max)?;
    let unit = end[0] / 60.0;
    let spans: Vec<Span> = timeline.iter().map(|&(action, start, end)| Span { action, start, end }).collect();
    let mut rows = vec![Vec::new(); PP];
    rows[pg.rank()] = spans;
    let drawn =
        SimReport { timeline: rows, makespan: end[0], bubble: vec![0.0; PP], peak_in_flight: vec![0; PP] }.draw(unit);
    let mine = drawn.lines().nth(pg.rank()).unwrap_or_default();
    println!("timeline {kind} m {m}: {mine}");
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
    parts: Vec<(usize, CharGpt)>,
    varmap: VarMap,
    m: usize,
    x: Tensor,
    y: Tensor,
    d_model: usize,
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
        let pb = ParamBuilder::new(&varmap, &tp, 0, DType::F32, &Device::Cpu);
        let parts = (pg.rank()..stages)
            .step_by(PP)
            .map(|s| {
                let part = StagePart { layers: layers[s].clone(), first: s == 0, last: s == stages - 1 };
                Ok((s, CharGpt::new_stage(cfg, &pb, part)?))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let tokens = x.elem_count();
        // The simulator's view of the same schedule must run (a check, not a measurement).
        simulate(schedule, Costs::default())?;
        Ok(Stages { parts, varmap, m, x, y, d_model: cfg.d_model, tokens })
    }

    fn part(&self, stage: usize) -> &CharGpt {
        &self.parts.iter().find(|(s, _)| *s == stage).expect("a stage of this rank").1
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
        self.part(stage).stage_forward(&input)
    }
    fn loss(&mut self, mb: usize, output: &Tensor) -> accel::Result<Tensor> {
        let last = self.parts.last().expect("a stage").0;
        let targets = self.rows(&self.y, mb)?;
        let sum = self.part(last).token_losses_of(output, &targets)?.sum_all()?;
        Ok((sum / self.tokens as f64)?)
    }
    fn input_shape(&self, _stage: usize) -> (Shape, DType) {
        let (n, s) = (self.x.dim(0).unwrap_or(0) / self.m, self.x.dim(1).unwrap_or(0));
        (Shape::from((n, s, self.d_model)), DType::F32)
    }
    fn parameters(&self) -> Vec<Var> {
        self.varmap.all_vars()
    }
}
