//! The automatic layout end to end: `accel_gpt --predict` prints the cost model's peak
//! memory per rank for the layout it runs, within ±25 % of the peak RSS the ranks measure, at the char-GPT's
//! layouts (1 process, dp2, tp2, pp2 1F1B, dp_shard 2 FULL_SHARD; the run-to-run spread of a peak RSS is a few
//! percent); `--parallelism auto` probes, chooses, prints
//! why, and trains the choice; a memory no layout fits fails before training with what would.

use super::gpt_tp::run_example;

/// The default char-GPT (820 992 parameters) at a global batch of 32 sequences, 3 steps: its training state and
/// activations are most of a rank's memory (the runtime's ~50 MiB is the rest).
const MODEL: [&str; 8] = ["--steps", "3", "--log-every", "3", "--sample-len", "0", "--seed", "3"];

/// `(predicted MiB, the largest measured peak RSS of a rank in MiB)` from an accel_gpt run's output.
pub(crate) fn predicted_and_measured(out: &str) -> (f64, f64) {
    let predicted = out
        .lines()
        .find_map(|l| l.split("auto_layout predicted: peak ").nth(1))
        .and_then(|rest| rest.split(" MiB").next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no prediction in:\n{out}"));
    let measured = out
        .lines()
        .filter_map(|l| l.split("peak RSS ").nth(1))
        .filter_map(|rest| rest.split(" MiB").next()?.parse::<f64>().ok())
        .fold(0.0, f64::max);
    assert!(measured > 0.0, "no peak RSS in:\n{out}");
    (predicted, measured)
}

#[test]
fn the_predicted_peak_memory_is_within_a_quarter_of_the_measured_one() {
    let bin = env!("CARGO_BIN_EXE_accel_gpt");
    let layouts: [(&str, &[&str]); 5] = [
        ("1 process", &["--nproc", "1", "--batch-size", "32"]),
        ("dp2", &["--nproc", "2", "--batch-size", "16"]),
        ("tp2", &["--nproc", "2", "--tp-size", "2", "--batch-size", "32"]),
        // One micro-batch per stage (the default). With 4 micro-batches rank 0's peak measures 0.74× the predicted
        // one (114.5 against 84.3 MiB: as if all 4 were in flight where 1F1B holds 2), not explained
        // yet; with 2 and 8 the prediction is within 10 %.
        ("pp2 1F1B", &["--nproc", "2", "--pp-size", "2", "--batch-size", "32"]),
        (
            "dp_shard 2 FULL_SHARD",
            &["--nproc", "2", "--dp-shard-size", "2", "--sharding-strategy", "FULL_SHARD", "--batch-size", "16"],
        ),
    ];
    let mut table = Vec::new();
    for (name, flags) in layouts {
        let out = run_example(bin, &[flags, &MODEL[..], &["--predict"]].concat());
        let (predicted, measured) = predicted_and_measured(&out);
        table.push((name, predicted, measured, predicted / measured));
    }
    let rows: Vec<String> =
        table.iter().map(|(n, p, m, r)| format!("{n}: predicted {p:.1} MiB, measured {m:.1} MiB ({r:.2}×)")).collect();
    for (name, _, _, ratio) in &table {
        assert!((0.75..=1.25).contains(ratio), "{name} is off by more than 25 %:\n{}", rows.join("\n"));
    }
}

#[test]
fn parallelism_auto_chooses_explains_and_trains() {
    let bin = env!("CARGO_BIN_EXE_accel_gpt");
    let out = run_example(
        bin,
        &[
            "--nproc",
            "2",
            "--parallelism",
            "auto",
            "--global-batch-size",
            "16",
            "--steps",
            "2",
            "--log-every",
            "1",
            "--sample-len",
            "0",
        ],
    );
    for expected in [
        "[rank 0] auto layout probe measured in",
        "[rank 0] auto layout for 2 processes (1 machine × 2 processes): model n_layer 4, d_model 128",
        "[rank 0] chosen: ",
        "[rank 0] runners-up (the fastest fitting layout of each other shape):",
        "[rank 0] auto_layout flags: --tp-size ",
        "[rank 0] auto_layout predicted: peak ",
        "global batch 16 sequences",
        "[rank 0] accel_gpt done: 2 steps",
    ] {
        assert!(out.contains(expected), "missing {expected:?} in:\n{out}");
    }
    // The flags it prints run the same layout without auto.
    let flags = out.lines().find_map(|l| l.split("auto_layout flags: ").nth(1)).unwrap();
    let args: Vec<&str> = flags.split_whitespace().collect();
    let pinned = run_example(
        bin,
        &[&["--nproc", "2", "--steps", "2", "--log-every", "1", "--sample-len", "0"], &args[..]].concat(),
    );
    let banner = |text: &str| {
        text.lines()
            .find(|l| l.contains("accel_gpt: config"))
            .map(|l| l.split(" | ").nth(2).map(str::to_string))
            .unwrap()
    };
    assert_eq!(banner(&pinned), banner(&out), "auto:\n{out}\npinned:\n{pinned}");
    assert_eq!(super::gpt_tp::logged_losses(&pinned), super::gpt_tp::logged_losses(&out));

    // Layout flags next to auto are refused, naming them.
    let refused = std::process::Command::new(bin)
        .args(["--nproc", "2", "--parallelism", "auto", "--tp-size", "2"])
        .env_remove("RANK")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && text.contains("--parallelism auto chooses the layout, and --tp-size 2"),
        "{text}"
    );

    // Under `accel launch --parallelism auto` the program does not see the flag, only the `auto` sizes the
    // launcher hands its workers: --global-batch-size is taken then too (it used to be refused).
    let mut launched = std::process::Command::new(bin);
    launched.args(["--global-batch-size", "8", "--steps", "1", "--log-every", "1", "--sample-len", "0"]);
    launched.env_remove("RANK").env("RUST_BACKTRACE", "0");
    for (key, value) in accel::ParallelismConfig::auto().env_vars() {
        launched.env(key, value);
    }
    let out = launched.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("global batch 8 sequences"), "{text}");
}

#[test]
fn a_memory_nothing_fits_fails_before_training_with_what_would() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_accel_gpt"))
        .args(["--nproc", "2", "--parallelism", "auto", "--steps", "1", "--sample-len", "0"])
        .env_remove("RANK")
        .env("ACCEL_AUTO_LAYOUT_MEMORY", "40MiB")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("The smallest memory per process that would fit is"), "{text}");
    assert!(!text.contains("step 1/1"), "nothing trained:\n{text}");
}

/// The automatic layout reads the char-GPT's shape from the model (`ModelSpec::of_model`: its build described,
/// nothing allocated) and gets what the GPT formulas filled in by hand give, number for number — untied and tied,
/// with dropout and without — so its predictions and choices are the same.
#[test]
fn the_char_gpt_described_from_its_build_is_the_gpt_formula() {
    use accel::auto_layout::{choose, ActivationSpec, ClusterSpec, Link, ModelSpec, Precision, TrainSpec};
    use accel_examples::gpt::{CharGpt, GptConfig};
    for (tie_embeddings, dropout) in [(false, 0.0), (true, 0.1)] {
        let cfg = GptConfig { tie_embeddings, dropout, ..GptConfig::small(76) };
        let described = ModelSpec::of_model(CharGpt::plan(&cfg), cfg.block_size, |vb| CharGpt::new(cfg, &vb)).unwrap();
        let formula = ModelSpec::gpt(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_ff, cfg.vocab_size, cfg.block_size)
            .with_tied_embeddings(tie_embeddings)
            .with_activations(ActivationSpec::accel(dropout > 0.0, 4));
        let case = format!("tied {tie_embeddings}, dropout {dropout}");
        let sizes = |m: &ModelSpec| (m.n_layer, m.d_model, m.n_head, m.d_ff, m.vocab, m.seq_len, m.tied_embeddings);
        assert_eq!(sizes(&described), sizes(&formula), "{case}");
        assert_eq!(described.total_params(), formula.total_params(), "{case}");
        for tp in 1..=8 {
            assert_eq!(described.tp_fits(tp), formula.tp_fits(tp), "{case}: tp {tp}");
            if !formula.tp_fits(tp) {
                continue;
            }
            for pp in [1, 2, 4] {
                for r in 0..pp {
                    let layers = cfg.n_layer / pp;
                    let (d, f) =
                        (described.params_on_rank(tp, pp, r, layers), formula.params_on_rank(tp, pp, r, layers));
                    assert_eq!(d, f, "{case}: tp {tp}, pp {pp}, rank {r}");
                }
            }
            assert_eq!(described.block_forward_flops_per_token(tp), formula.block_forward_flops_per_token(tp));
            assert_eq!(described.head_forward_flops_per_token(tp), formula.head_forward_flops_per_token(tp));
            assert_eq!(described.block_activation_bytes(8, tp, 4), formula.block_activation_bytes(8, tp, 4));
            assert_eq!(described.tp_all_reduces_per_block(true), formula.tp_all_reduces_per_block(true));
        }
        let (fast, slow) = (Link::new(5e-6, 10e9), Link::new(50e-6, 1e9));
        let cluster = ClusterSpec::uniform(2, 2, 1 << 30, 50e9, fast, slow);
        let train = TrainSpec::new(32, &[4, 8], Precision::Fp32);
        let chosen = |m: &ModelSpec| choose(m, &cluster, &train, &Default::default()).unwrap().to_string();
        assert_eq!(chosen(&described), chosen(&formula), "{case}");
    }
}

/// An automatic layout's global batch larger than the training data is refused before training, naming the
/// largest that fits.
#[test]
fn a_global_batch_larger_than_the_data_is_refused() {
    let bin = env!("CARGO_BIN_EXE_accel_gpt");
    let out = std::process::Command::new(bin)
        .args(["--parallelism", "auto", "--global-batch-size", "1000003", "--steps", "1"])
        .env_remove("RANK")
        .output()
        .expect("running accel_gpt");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "accepted:\n{text}");
    assert!(text.contains("the global batch of 1000003 sequences is more than the"), "{text}");
    assert!(text.contains("windows of 64 characters of the training data: give --global-batch-size"), "{text}");
    assert!(!text.contains("step 1"), "{text}");
}
