//! The char-GPT cut into pipeline stages (the executor level): at pp 2 and pp 4, and 4
//! stages on 2 ranks interleaved, with GPipe, 1F1B and interleaved 1F1B, every parameter's gradient summed over
//! the micro-batches is one process's gradient accumulation over the same micro-batches, bit for bit (the same
//! ops on the same values: each stage builds only its own parameters, from the same per-name streams), and the
//! micro-batch losses are one process's. f32, no dropout; ranks are threads over loopback.

use accel::nn::VarBuilder;
use accel::pipeline::{
    run_schedule, split_layers, PipelineLinks, PipelineModel, PipelineSchedule, ScheduleKind, ShapeBook,
};
use accel::pipeline::{Stage, StagedModel};
use accel::tensor_parallel::TensorParallel;
use accel_examples::gpt::{CharGpt, GptConfig};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use ddp_core::store::MemoryStore;
use ddp_core::{GroupOptions, ProcessGroup, Store};
use std::sync::Arc;
use std::time::Duration;

const SEED: u64 = 77;
const BATCH: usize = 8;
const SEQ: usize = 16;

fn cfg() -> GptConfig {
    GptConfig {
        vocab_size: 13,
        block_size: SEQ,
        n_layer: 4,
        n_head: 2,
        d_model: 16,
        d_ff: 32,
        tie_embeddings: false,
        dropout: 0.0,
    }
}

/// The step's batch: ids and next-id targets, deterministic.
fn batch() -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..BATCH * (SEQ + 1)).map(|i| ((i * 7 + i / 5) % 13) as u32).collect();
    let rows = |off: usize| -> Vec<u32> {
        (0..BATCH).flat_map(|b| ids[b * (SEQ + 1) + off..b * (SEQ + 1) + off + SEQ].to_vec()).collect()
    };
    let x = Tensor::from_vec(rows(0), (BATCH, SEQ), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(rows(1), (BATCH, SEQ), &Device::Cpu).unwrap();
    (x, y)
}

fn builder(varmap: &VarMap) -> VarBuilder {
    let tp = TensorParallel::new(ProcessGroup::single_process().unwrap());
    VarBuilder::new(varmap, &tp, SEED, DType::F32, &Device::Cpu, CharGpt::plan(&cfg()))
}

/// A micro-batch's loss, normalised by every token of the step (once, before backward).
fn loss(model: &CharGpt, logits: &Tensor, targets: &Tensor) -> Tensor {
    (model.token_losses_of(logits, targets).unwrap().sum_all().unwrap() / (BATCH * SEQ) as f64).unwrap()
}

struct GptStages {
    /// This rank's stages of the model.
    model: CharGpt,
    varmap: VarMap,
    m: usize,
    x: Tensor,
    y: Tensor,
}

impl GptStages {
    fn rows(&self, t: &Tensor, mb: usize) -> Tensor {
        t.narrow(0, mb * BATCH / self.m, BATCH / self.m).unwrap()
    }
}

impl PipelineModel for GptStages {
    fn forward(&mut self, stage: usize, mb: usize, input: Option<&Tensor>) -> accel::Result<Tensor> {
        let input = input.cloned().unwrap_or_else(|| self.rows(&self.x, mb));
        self.model.stage_forward(stage, &input)
    }
    fn loss(&mut self, mb: usize, output: &Tensor) -> accel::Result<Tensor> {
        Ok(loss(&self.model, output, &self.rows(&self.y, mb)))
    }
    fn parameters(&self) -> Vec<Var> {
        sorted_vars(&self.varmap).into_iter().map(|(_, v)| v).collect()
    }
}

fn sorted_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let mut v: Vec<(String, Var)> = varmap.data().lock().unwrap().iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| if *x == 0.0 { 0 } else { x.to_bits() }).collect()
}

type Grads = Vec<(String, Vec<u32>)>;

fn pipelined(kind: ScheduleKind, pp: usize, v: usize, m: usize) -> (Grads, Vec<f64>) {
    let schedule = Arc::new(PipelineSchedule::new(kind, pp, m, v).unwrap());
    let parts = split_layers(cfg().n_layer, pp * v, None).unwrap();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let handles: Vec<_> = (0..pp)
        .map(|rank| {
            let (store, schedule, parts) = (store.clone(), schedule.clone(), parts.clone());
            std::thread::spawn(move || {
                let opts = GroupOptions { timeout: Duration::from_secs(60), ..Default::default() };
                let pg = ProcessGroup::from_store(store, rank, pp, opts).unwrap();
                let links = PipelineLinks::new(&pg).unwrap();
                let varmap = VarMap::new();
                // This rank's stages, given to the builder outright (the schedule runs without an Accelerator).
                let stages: Vec<Stage> = (rank..pp * v)
                    .step_by(pp)
                    .map(|s| Stage { index: s, num_stages: pp * v, layers: parts[s].clone() })
                    .collect();
                let model = CharGpt::new(cfg(), &builder(&varmap).with_stages(stages)).unwrap();
                let (x, y) = batch();
                let mut model = GptStages { model, varmap: varmap.clone(), m, x, y };
                let step = run_schedule(&schedule, &links, &mut model, &mut ShapeBook::default()).unwrap();
                let grads: Grads = sorted_vars(&varmap)
                    .into_iter()
                    .zip(&step.gradients)
                    .map(|((n, _), g)| (n, bits(g.as_ref().expect("every parameter gets a gradient"))))
                    .collect();
                (grads, step.losses)
            })
        })
        .collect();
    let mut grads = Vec::new();
    let mut losses = Vec::new();
    for h in handles {
        let (g, l) = h.join().expect("a rank panicked");
        grads.extend(g);
        losses.extend(l);
    }
    grads.sort_by(|a, b| a.0.cmp(&b.0));
    (grads, losses)
}

fn one_process(m: usize) -> (Grads, Vec<f64>) {
    let varmap = VarMap::new();
    let model = CharGpt::new(cfg(), &builder(&varmap)).unwrap();
    let (x, y) = batch();
    let vars = sorted_vars(&varmap);
    let mut sums: Vec<Option<Tensor>> = vec![None; vars.len()];
    let mut losses = Vec::new();
    for mb in 0..m {
        let rows = |t: &Tensor| t.narrow(0, mb * BATCH / m, BATCH / m).unwrap();
        let l = loss(&model, &model.logits(&rows(&x)).unwrap(), &rows(&y));
        losses.push(l.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap());
        let store = l.backward().unwrap();
        for (s, (_, v)) in sums.iter_mut().zip(&vars) {
            let g = store.get(v.as_tensor()).unwrap().clone();
            *s = Some(match s.take() {
                Some(a) => (a + g).unwrap(),
                None => g,
            });
        }
    }
    (vars.into_iter().zip(sums).map(|((n, _), g)| (n, bits(&g.unwrap()))).collect(), losses)
}

#[test]
fn char_gpt_stages_give_one_process_gradients_and_losses() {
    for (kind, pp, v, m) in [
        (ScheduleKind::GPipe, 2, 1, 2),
        (ScheduleKind::OneFOneB, 2, 1, 4),
        (ScheduleKind::OneFOneB, 4, 1, 4),
        (ScheduleKind::Interleaved1F1B, 2, 2, 2),
    ] {
        let (grads, losses) = pipelined(kind, pp, v, m);
        let (want, want_losses) = one_process(m);
        assert_eq!(grads.len(), want.len(), "{kind} pp {pp}: every parameter once over the ranks");
        for ((n, g), (wn, w)) in grads.iter().zip(&want) {
            assert_eq!(n, wn);
            assert!(g == w, "{kind} pp {pp} v {v} m {m}: gradient of {n} differs");
        }
        assert_eq!(losses, want_losses, "{kind} pp {pp} v {v} m {m}");
    }
}

#[test]
fn a_stage_holds_only_its_own_parameters() {
    let varmap = VarMap::new();
    let middle = Stage { index: 1, num_stages: 3, layers: 1..3 };
    CharGpt::new(cfg(), &builder(&varmap).with_stages(vec![middle])).unwrap();
    let names: Vec<String> = sorted_vars(&varmap).into_iter().map(|(n, _)| n).collect();
    assert!(names.iter().all(|n| n.starts_with("h.1.") || n.starts_with("h.2.")), "{names:?}");
    assert_eq!(names.len(), 2 * 16, "16 tensors per block (2 layer norms, q, k, v, c_proj, c_fc, c_proj)");
}
