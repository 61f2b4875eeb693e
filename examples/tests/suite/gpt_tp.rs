//! The char-GPT (`accel_examples::gpt`) split over tp = 2 and 4 ranks (threads over loopback) computes what the
//! single process computes: the gathered logits, the loss, and the gradient of every parameter (each rank's shard
//! of a sharded one, the whole of a replicated one) equal the tp = 1 model's, f32, within 2e-5 relative to the
//! largest magnitude of the reference tensor (summation order differs: the row-parallel sums and the
//! all-reduces add partial products in another order). The vocabulary of 11 is padded to 12 columns at tp 2 / 4.

use accel::nn::VarBuilder;
use accel::tensor_parallel::{ParamLayout, TensorParallel};
use accel_examples::gpt::{CharGpt, GptConfig};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use ddp_core::store::MemoryStore;
use ddp_core::{GroupOptions, ProcessGroup, Store};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

const TOL: f32 = 2e-5;

fn cfg() -> GptConfig {
    GptConfig {
        vocab_size: 11,
        block_size: 8,
        n_layer: 2,
        n_head: 4,
        d_model: 16,
        d_ff: 32,
        tie_embeddings: false,
        dropout: 0.0,
    }
}

/// What one rank computed: full logits `[b, s, vocab]`, the loss, and per parameter (gradient, layout).
struct RankResult {
    logits: Vec<f32>,
    loss: f32,
    grads: BTreeMap<String, (Tensor, ParamLayout)>,
}

fn batch() -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..2 * 7).map(|i| (i * 5 + 3) % 11).collect();
    let targets: Vec<u32> = (0..2 * 7).map(|i| (i * 7 + 1) % 11).collect();
    (Tensor::from_vec(ids, (2, 7), &Device::Cpu).unwrap(), Tensor::from_vec(targets, (2, 7), &Device::Cpu).unwrap())
}

fn run_rank(pg: ProcessGroup) -> RankResult {
    let tp = TensorParallel::new(pg);
    let varmap = VarMap::new();
    let vb = VarBuilder::new(&varmap, &tp, 7, DType::F32, &Device::Cpu, CharGpt::plan(&cfg()));
    let model = CharGpt::new(cfg(), &vb).unwrap();
    let (ids, targets) = batch();
    let local = model.logits(&ids).unwrap();
    assert_eq!(local.dims(), &[2, 7, model.padded_vocab() / tp.size()]);
    let full = ddp_core::functional::gather_from_group(&local, tp.group(), 2).unwrap();
    let logits = full.narrow(2, 0, 11).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let loss = model.loss(&ids, &targets).unwrap();
    let grads_store = loss.backward().unwrap();
    let grads = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(name, var)| {
            let g = grads_store.get(var.as_tensor()).unwrap_or_else(|| panic!("{name} has no gradient")).clone();
            (name.clone(), (g, tp.layout(var)))
        })
        .collect();
    RankResult { logits, loss: loss.to_scalar::<f32>().unwrap(), grads }
}

fn run_tp(tp: usize) -> Vec<RankResult> {
    if tp == 1 {
        return vec![run_rank(ProcessGroup::single_process().unwrap())];
    }
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let handles: Vec<_> = (0..tp)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let opts = GroupOptions { timeout: Duration::from_secs(60), ..GroupOptions::default() };
                run_rank(ProcessGroup::from_store(store, rank, tp, opts).unwrap())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
}

fn assert_close(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}: lengths");
    let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst <= TOL * scale, "{name}: max |diff| {worst:e} > {TOL:e} × {scale:e}");
}

fn check_layout(tp: usize) {
    let reference = run_tp(1).pop().unwrap();
    let ranks = run_tp(tp);
    for (r, res) in ranks.iter().enumerate() {
        assert_close(&format!("tp{tp} rank {r} logits"), &res.logits, &reference.logits);
        assert!(
            (res.loss - reference.loss).abs() <= TOL * reference.loss,
            "tp{tp} rank {r}: loss {} vs {}",
            res.loss,
            reference.loss
        );
    }
    let mut sharded = 0;
    for (name, (want, _)) in &reference.grads {
        let want_v = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        match ranks[0].grads[name].1 {
            ParamLayout::Replicated => {
                for (r, res) in ranks.iter().enumerate() {
                    let got = res.grads[name].0.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    assert_close(&format!("tp{tp} rank {r} grad {name}"), &got, &want_v);
                }
            }
            ParamLayout::Sharded { dim, full, .. } => {
                sharded += 1;
                let parts: Vec<Tensor> = ranks.iter().map(|res| res.grads[name].0.clone()).collect();
                let cat = Tensor::cat(&parts, dim).unwrap().narrow(dim, 0, full).unwrap();
                assert_eq!(cat.dims(), want.dims(), "{name}");
                let got = cat.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_close(&format!("tp{tp} grad {name} (gathered)"), &got, &want_v);
            }
        }
    }
    // wte, 2 × (q, k, v weight + bias, attn c_proj weight, c_fc weight + bias, mlp c_proj weight), lm_head.
    assert_eq!(sharded, 1 + 2 * 10 + 1, "sharded parameters at tp{tp}");
}

#[test]
fn tp2_matches_the_single_process_model() {
    check_layout(2);
}

#[test]
fn tp4_matches_the_single_process_model() {
    check_layout(4);
}

/// Every tp rank samples the same characters from a seeded rng (the gathered logits are identical), and the
/// same as the single process.
#[test]
fn generation_agrees_across_tp_ranks() {
    use rand::SeedableRng;
    let generate = |pg: ProcessGroup| {
        let tp = TensorParallel::new(pg);
        let varmap = VarMap::new();
        let vb = VarBuilder::new(&varmap, &tp, 7, DType::F32, &Device::Cpu, CharGpt::plan(&cfg()));
        let model = CharGpt::new(cfg(), &vb).unwrap();
        model.generate(&[1, 2, 3], 10, 0.8, &mut rand_chacha::ChaCha8Rng::seed_from_u64(42)).unwrap()
    };
    let single = generate(ProcessGroup::single_process().unwrap());
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let opts = GroupOptions { timeout: Duration::from_secs(60), ..GroupOptions::default() };
                generate(ProcessGroup::from_store(store, rank, 2, opts).unwrap())
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), single);
    }
}

/// A small, quick `accel_gpt` run: 4 steps logged every 2, batch 4 × 16 characters, d_model 32, `n_layer` blocks,
/// d_ff 64, a 20-character sample.
pub(super) fn small_accel_gpt_args(n_layer: &'static str) -> [&'static str; 18] {
    [
        "--steps",
        "4",
        "--log-every",
        "2",
        "--batch-size",
        "4",
        "--block-size",
        "16",
        "--d-model",
        "32",
        "--n-layer",
        n_layer,
        "--d-ff",
        "64",
        "--sample-len",
        "20",
        "--lr",
        "1e-2",
    ]
}

/// Runs an example binary (a fresh launch: RANK unset); returns stdout + stderr after asserting success.
pub(super) fn run_example(bin: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(bin)
        .args(args)
        .env_remove("RANK")
        .env_remove("PARALLELISM_CONFIG_TP_SIZE")
        .env_remove("PARALLELISM_CONFIG_PP_SIZE")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("running the example");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{bin} {args:?} failed ({}):\n{text}", out.status);
    text
}

/// The `step N/M: loss X` values rank 0 printed, in order.
pub(super) fn logged_losses(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| !l.starts_with("[rank 1]") && !l.starts_with("[rank 2]") && !l.starts_with("[rank 3]"))
        .filter_map(|l| l.split(": loss ").nth(1))
        .map(|rest| rest.split(',').next().unwrap().to_string())
        .collect()
}

/// A small accel_gpt run: the same command at 1 process and at tp2 prints the same losses (4 decimals) and a
/// sample; tp2 reports both ranks' peak RSS.
#[test]
fn accel_gpt_tp2_prints_the_single_process_losses() {
    let small = small_accel_gpt_args("1");
    let bin = env!("CARGO_BIN_EXE_accel_gpt");
    let single = run_example(bin, &[&["--nproc", "1"], &small[..]].concat());
    let tp2 = run_example(bin, &[&["--nproc", "2", "--tp-size", "2"], &small[..]].concat());
    let (a, b) = (logged_losses(&single), logged_losses(&tp2));
    assert_eq!(a.len(), 2, "two logged steps:\n{single}");
    assert_eq!(a, b, "1 process:\n{single}\ntp2:\n{tp2}");
    assert!(tp2.contains("dp 1 × tp 2"), "{tp2}");
    assert!(
        tp2.contains(
            "[rank 0] accel_gpt: config none: defaults | 2 processes × 1 machine | dp_replicate 1 × dp_shard 1 × tp 2 \
             × pp 1 | mixed precision no | gradient accumulation 1 | backend cpu\n"
        ),
        "{tp2}"
    );
    for r in 0..2 {
        assert!(tp2.contains(&format!("rank {r} (pp 0 dp 0 tp {r}): peak RSS")), "rank {r}'s RSS:\n{tp2}");
    }
    assert!(single.contains("sample (temperature 0.8):\nHAMLET:\n"), "{single}");
    // The tp traffic counter counts the steps it names: the 2 after warm-up here, and the whole run when the run
    // ends with its first logged interval (it reported 0 calls there).
    assert!(tp_all_reduce_calls(&tp2, "the 2 steps after warm-up") > 0, "{tp2}");
    let steps: Vec<&str> = small.iter().map(|a| if *a == "4" { "2" } else { *a }).collect();
    let short = run_example(bin, &[&["--nproc", "2", "--tp-size", "2"], &steps[..]].concat());
    assert!(tp_all_reduce_calls(&short, "all 2 steps, warm-up included") > 0, "{short}");
}

/// The all-reduce calls per step of the `tp traffic` line, which must name `window`.
fn tp_all_reduce_calls(out: &str, window: &str) -> u64 {
    let line = out.lines().find(|l| l.contains("tp traffic per optimizer step")).expect("a tp traffic line");
    assert!(line.contains(&format!("over {window})")), "{line}");
    let calls = line.split(" calls").next().unwrap().rsplit(' ').next().unwrap();
    calls.parse().unwrap_or_else(|_| panic!("calls in {line}"))
}

/// Layouts the model or the process count cannot take are refused before any worker starts, naming what fits.
#[test]
fn gpt_examples_refuse_tp_sizes_that_do_not_fit() {
    for bin in [env!("CARGO_BIN_EXE_accel_gpt"), env!("CARGO_BIN_EXE_train_gpt")] {
        let out = std::process::Command::new(bin)
            .args(["--nproc", "4", "--tp-size", "3"])
            .env_remove("RANK")
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success() && text.contains("--tp-size 3 must divide --nproc 4"), "{bin}:\n{text}");
        let out = std::process::Command::new(bin)
            .args(["--nproc", "3", "--tp-size", "3"])
            .env_remove("RANK")
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "{bin}:\n{text}");
        assert!(text.contains("3 does not divide n_head = 4") && text.contains("[1, 2, 4]"), "{bin}:\n{text}");
    }
    // A --layers-per-stage list that does not add up to the model's layers is refused before any worker starts,
    // once, naming the sum.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_accel_gpt"))
        .args(["--nproc", "2", "--pp-size", "2", "--layers-per-stage", "1,2"])
        .env_remove("RANK")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("--layers-per-stage") && text.contains("add up to 3 but the model has 4 layers"), "{text}");
    assert!(!text.contains("[rank"), "refused before any worker started:\n{text}");
}

/// The Trainer-level example at tp2: trains, evaluates the loss (no metrics over sharded outputs) and samples.
#[test]
fn train_gpt_runs_at_tp2() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("run");
    let text = run_example(
        env!("CARGO_BIN_EXE_train_gpt"),
        &[
            "--nproc",
            "2",
            "--tp-size",
            "2",
            "--block-size",
            "16",
            "--max-steps",
            "4",
            "--logging-steps",
            "2",
            "--eval-steps",
            "4",
            "--per-device-train-batch-size",
            "4",
            "--per-device-eval-batch-size",
            "256",
            "--sample-len",
            "10",
            "--report-to",
            "none",
            "--save-plots",
            "false",
            "--disable-tqdm",
            "true",
            "--output-dir",
            out_dir.to_str().unwrap(),
        ],
    );
    assert!(text.contains("validation loss"), "{text}");
    assert!(text.contains("sample (temperature 0.8)"), "{text}");
    // The banner once, from rank 0, before the first step; the summary names the layout.
    let banner = "[rank 0] train_gpt: config none: defaults | 2 processes × 1 machine | dp_replicate 1 × dp_shard 1 × \
                  tp 2 × pp 1 | mixed precision no | gradient accumulation 1 | backend cpu";
    assert_eq!(text.lines().filter(|l| l.contains("config none")).collect::<Vec<_>>(), [banner], "{text}");
    assert!(text.contains(" parameters, 2 process(es) = pp 1 × dp 1 × tp 2; 4 optimizer steps"), "{text}");
}
