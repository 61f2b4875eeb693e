//! Pipeline parallelism against one process: a 6-8-8-8-3 tanh MLP cut into 2 and 4 stages (and 4 stages on 2
//! ranks, interleaved), every schedule and micro-batch count, ranks as threads. The gradients summed over the
//! micro-batches are one process's gradient accumulation over the same micro-batches bit for bit (the same ops
//! on the same values, summed in the same order), and the full batch's gradient to f32 rounding; the
//! micro-batch losses sum to the full batch's loss.

use accel::pipeline::{run_schedule, PipelineLinks, PipelineModel, PipelineSchedule, ScheduleKind, ShapeBook};
use candle_core::{DType, Device, Tensor, Var};
use ddp_core::store::MemoryStore;
use ddp_core::{GroupOptions, ProcessGroup, Store};
use std::sync::Arc;
use std::time::Duration;

const WIDTHS: [usize; 5] = [6, 8, 8, 8, 3];
const ROWS: usize = 16;

/// Deterministic values in [-scale, scale].
fn wave(seed: f32, shape: &[usize], scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| scale * ((i as f32 * 0.37 + seed * 1.3).sin())).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Layer `i`'s weight and bias (the same on every rank, as seeded initialisation gives).
fn layer_params(i: usize) -> (Var, Var) {
    let w = Var::from_tensor(&wave(i as f32, &[WIDTHS[i + 1], WIDTHS[i]], 0.6)).unwrap();
    let b = Var::from_tensor(&wave(i as f32 + 0.5, &[WIDTHS[i + 1]], 0.2)).unwrap();
    (w, b)
}

fn apply(layer: &(Var, Var), x: &Tensor, last: bool) -> Tensor {
    let y = x.matmul(&layer.0.as_tensor().t().unwrap()).unwrap().broadcast_add(layer.1.as_tensor()).unwrap();
    if last {
        y
    } else {
        y.tanh().unwrap()
    }
}

fn rows(t: &Tensor, mb: usize, m: usize) -> Tensor {
    t.narrow(0, mb * ROWS / m, ROWS / m).unwrap()
}

/// The loss of some rows, normalised by the whole step's item count (every row and output of the batch).
fn loss(out: &Tensor, target: &Tensor) -> Tensor {
    ((out - target).unwrap().sqr().unwrap().sum_all().unwrap() / (ROWS * WIDTHS[4]) as f64).unwrap()
}

/// This rank's stages of the MLP: `layers_per_stage` layers each.
struct MlpStages {
    layers: Vec<(Var, Var)>,
    layers_per_stage: usize,
    m: usize,
    x: Tensor,
    target: Tensor,
}

impl PipelineModel for MlpStages {
    fn forward(&mut self, stage: usize, mb: usize, input: Option<&Tensor>) -> accel::Result<Tensor> {
        let mut h = input.cloned().unwrap_or_else(|| rows(&self.x, mb, self.m));
        for i in stage * self.layers_per_stage..(stage + 1) * self.layers_per_stage {
            h = apply(&self.layers[i], &h, i == WIDTHS.len() - 2);
        }
        Ok(h)
    }
    fn loss(&mut self, mb: usize, output: &Tensor) -> accel::Result<Tensor> {
        Ok(loss(output, &rows(&self.target, mb, self.m)))
    }
    fn parameters(&self) -> Vec<Var> {
        self.layers.iter().flat_map(|(w, b)| [w.clone(), b.clone()]).collect()
    }
}

/// `(name, gradient values)` of every parameter this rank's stages hold, and its losses.
type RankGrads = (Vec<(String, Vec<u32>)>, Vec<f64>);

fn names() -> Vec<String> {
    (0..WIDTHS.len() - 1).flat_map(|i| [format!("fc{i}.weight"), format!("fc{i}.bias")]).collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| if *x == 0.0 { 0 } else { x.to_bits() }).collect()
}

/// Runs `f(rank, links)` on `pp` ranks (threads over one in-memory store, loopback links), results by rank.
fn on_pp_ranks<R: Send + 'static>(pp: usize, f: impl Fn(usize, PipelineLinks) -> R + Send + Sync + 'static) -> Vec<R> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let f = Arc::new(f);
    let handles: Vec<_> = (0..pp)
        .map(|rank| {
            let (store, f) = (store.clone(), f.clone());
            std::thread::spawn(move || {
                let opts = GroupOptions { timeout: Duration::from_secs(60), ..Default::default() };
                let pg = ProcessGroup::from_store(store, rank, pp, opts).unwrap();
                f(rank, PipelineLinks::new(&pg).unwrap())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
}

/// Runs `kind` on `pp` ranks with `v` stages each and `m` micro-batches; every rank's gradients by name.
fn pipelined(kind: ScheduleKind, pp: usize, v: usize, m: usize) -> Vec<RankGrads> {
    let schedule = PipelineSchedule::new(kind, pp, m, v).unwrap();
    on_pp_ranks(pp, move |rank, links| -> RankGrads {
        let stages = pp * v;
        let layers_per_stage = (WIDTHS.len() - 1) / stages;
        let mine: Vec<usize> =
            (rank..stages).step_by(pp).flat_map(|s| s * layers_per_stage..(s + 1) * layers_per_stage).collect();
        let mut model = mlp_stages(layers_per_stage, m);
        let step = run_schedule(&schedule, &links, &mut model, &mut ShapeBook::default()).unwrap();
        let names = names();
        let grads = mine
            .iter()
            .flat_map(|&i| [2 * i, 2 * i + 1])
            .map(|k| (names[k].clone(), bits(step.gradients[k].as_ref().expect("a gradient"))))
            .collect();
        (grads, step.losses)
    })
}

/// Every layer of the MLP (a rank uses its stages' only), `layers_per_stage` per stage, `m` micro-batches.
fn mlp_stages(layers_per_stage: usize, m: usize) -> MlpStages {
    MlpStages {
        layers: (0..WIDTHS.len() - 1).map(layer_params).collect(),
        layers_per_stage,
        m,
        x: wave(0.1, &[ROWS, WIDTHS[0]], 1.0),
        target: wave(3.0, &[ROWS, WIDTHS[4]], 0.5),
    }
}

/// One process: gradient accumulation over the same `m` micro-batches, summed in order; and the losses.
fn one_process(m: usize) -> (Vec<(String, Vec<u32>)>, Vec<f64>) {
    let layers: Vec<(Var, Var)> = (0..WIDTHS.len() - 1).map(layer_params).collect();
    let params: Vec<Var> = layers.iter().flat_map(|(w, b)| [w.clone(), b.clone()]).collect();
    let (x, target) = (wave(0.1, &[ROWS, WIDTHS[0]], 1.0), wave(3.0, &[ROWS, WIDTHS[4]], 0.5));
    let mut sums: Vec<Option<Tensor>> = vec![None; params.len()];
    let mut losses = Vec::new();
    for mb in 0..m {
        let mut h = rows(&x, mb, m);
        for (i, l) in layers.iter().enumerate() {
            h = apply(l, &h, i == layers.len() - 1);
        }
        let l = loss(&h, &rows(&target, mb, m));
        losses.push(l.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap());
        let store = l.backward().unwrap();
        for (s, p) in sums.iter_mut().zip(&params) {
            let g = store.get(p.as_tensor()).unwrap().clone();
            *s = Some(match s.take() {
                Some(a) => (a + g).unwrap(),
                None => g,
            });
        }
    }
    (names().into_iter().zip(sums.iter().map(|g| bits(g.as_ref().unwrap()))).collect(), losses)
}

fn merged(ranks: Vec<RankGrads>) -> (Vec<(String, Vec<u32>)>, Vec<f64>) {
    let mut grads: Vec<(String, Vec<u32>)> = ranks.iter().flat_map(|(g, _)| g.clone()).collect();
    let order = names();
    grads.sort_by_key(|(n, _)| order.iter().position(|o| o == n).unwrap());
    let losses = ranks.into_iter().flat_map(|(_, l)| l).collect();
    (grads, losses)
}

#[test]
fn every_schedule_gives_one_process_gradients_over_the_same_micro_batches() {
    for (kind, pp, v, ms) in [
        (ScheduleKind::GPipe, 2, 1, &[2, 4][..]),
        (ScheduleKind::OneFOneB, 2, 1, &[2, 4]),
        (ScheduleKind::GPipe, 4, 1, &[4]),
        (ScheduleKind::OneFOneB, 4, 1, &[4, 8]),
        (ScheduleKind::Interleaved1F1B, 2, 2, &[2, 4]),
    ] {
        for &m in ms {
            let (grads, losses) = merged(pipelined(kind, pp, v, m));
            let (want, want_losses) = one_process(m);
            assert_eq!(grads, want, "{kind} pp {pp} v {v} m {m}: gradients");
            assert_eq!(losses, want_losses, "{kind} pp {pp} v {v} m {m}: losses");
        }
    }
}

#[test]
fn micro_batches_sum_to_the_full_batch() {
    // The loss is normalised once, by the whole batch, before backward: the micro-batches' gradients add up to
    // the full batch's (to f32 rounding: the batch's sums are split differently), and nothing is rescaled after.
    let (grads, losses) = merged(pipelined(ScheduleKind::OneFOneB, 2, 1, 4));
    let (full, full_loss) = one_process(1);
    assert!((losses.iter().sum::<f64>() - full_loss[0]).abs() < 1e-6, "{losses:?} vs {full_loss:?}");
    for ((name, got), (_, want)) in grads.iter().zip(&full) {
        for (g, w) in got.iter().zip(want) {
            let (g, w) = (f32::from_bits(*g), f32::from_bits(*w));
            assert!((g - w).abs() <= 1e-6 + 1e-5 * w.abs(), "{name}: {g} vs {w}");
        }
    }
}

/// Stage s multiplies its input by a vector `w_s` of `D` elements: activations of 4 MiB, larger than any socket or
/// ring buffer, so a send waits for its receive — the case where a schedule with synchronous sends on one group
/// per rank would deadlock (rank 0 sending micro-batch 1 forward while rank 1 sends micro-batch 0's gradient).
struct ScaleStages {
    w: Vec<Var>,
    m: usize,
}

const D: usize = 1 << 20;

impl PipelineModel for ScaleStages {
    fn forward(&mut self, stage: usize, mb: usize, input: Option<&Tensor>) -> accel::Result<Tensor> {
        let x = match input {
            Some(t) => t.clone(),
            None => wave(mb as f32, &[1, D], 1.0),
        };
        Ok(x.broadcast_mul(self.w[stage].as_tensor())?)
    }
    fn loss(&mut self, _mb: usize, output: &Tensor) -> accel::Result<Tensor> {
        Ok((output.sqr()?.sum_all()? / (self.m * D) as f64)?)
    }
    fn parameters(&self) -> Vec<Var> {
        self.w.clone()
    }
}

#[test]
fn large_activations_do_not_deadlock_any_schedule() {
    for (kind, v) in [(ScheduleKind::GPipe, 1), (ScheduleKind::OneFOneB, 1), (ScheduleKind::Interleaved1F1B, 2)] {
        let (pp, m) = (2, 4);
        let schedule = PipelineSchedule::new(kind, pp, m, v).unwrap();
        let per_rank = on_pp_ranks(pp, move |rank, links| {
            let w = (0..pp * v).map(|s| Var::from_tensor(&wave(10.0 + s as f32, &[D], 1.0)).unwrap()).collect();
            let mut model = ScaleStages { w, m };
            let step = run_schedule(&schedule, &links, &mut model, &mut ShapeBook::default()).unwrap();
            let stages: Vec<usize> = (rank..pp * v).step_by(pp).collect();
            let sum = |s: usize| step.gradients[s].as_ref().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            stages.iter().map(|&s| (s, sum(s))).collect::<Vec<_>>()
        });
        let mut got: Vec<(usize, f32)> = per_rank.into_iter().flatten().collect();
        got.sort_by_key(|(s, _)| *s);
        // One process: the same product chain, gradients accumulated over the micro-batches.
        let w: Vec<Var> = (0..pp * v).map(|s| Var::from_tensor(&wave(10.0 + s as f32, &[D], 1.0)).unwrap()).collect();
        let mut sums = vec![0f32; w.len()];
        for mb in 0..m {
            let mut h = wave(mb as f32, &[1, D], 1.0);
            for wi in &w {
                h = h.broadcast_mul(wi.as_tensor()).unwrap();
            }
            let l = (h.sqr().unwrap().sum_all().unwrap() / (m * D) as f64).unwrap();
            let store = l.backward().unwrap();
            for (s, wi) in sums.iter_mut().zip(&w) {
                *s += store.get(wi.as_tensor()).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            }
        }
        for (s, g) in got {
            assert!((g - sums[s]).abs() <= 1e-4 * sums[s].abs().max(1.0), "{kind} stage {s}: {g} vs {}", sums[s]);
        }
    }
}

/// A stage that dies: the rank waiting for it fails at once (not at the timeout), naming the stage, the
/// micro-batch, the action and both pp ranks, with the backend's error naming the dead rank.
#[test]
fn a_dead_stage_fails_the_waiting_rank_naming_stage_micro_batch_and_peer() {
    let schedule = PipelineSchedule::new(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    let started = std::time::Instant::now();
    let errs = on_pp_ranks(2, move |rank, links| -> Option<String> {
        if rank == 1 {
            return None; // dies: its groups and connections go away
        }
        let mut model = mlp_stages(2, 2);
        Some(ddp_core::launcher::error_report(
            &run_schedule(&schedule, &links, &mut model, &mut ShapeBook::default()).err()?,
        ))
    });
    let e = errs[0].as_ref().expect("rank 0 fails");
    assert!(
        e.starts_with(
            "Error: pipeline stage 0, micro-batch 0 (0RECV_B0) on pp rank 0 (rank 0): receiving the output gradient \
             from pp rank 1 (rank 1): "
        ),
        "{e}"
    );
    assert!(e.contains("rank 1"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
}
