//! The matrix products of one MLP training step (784-512-512-10, batch 128) through candle's CPU matmul (the
//! `gemm` crate), timed one by one — what remains candle's own cost in the single-process step comparison
//! (docs/benchmarks.md, "One training step vs PyTorch"); `scripts/torch_ref/matmul.py` times the same products in
//! PyTorch.
//!
//! ```text
//! RAYON_NUM_THREADS=1 cargo run -p accel-benches --bin matmul_time -- --json
//! ```
//!
//! Products (f32, contiguous operands, `m×k · k×n`): the forward `x·Wᵀ` of the first and second layer
//! (`128×784 · 784×512`, `128×512 · 512×512`), and the first layer's weight gradient `gᵀ·x` (`512×128 · 128×784`).
//! `--product MxKxN` (repeated) times other shapes. Reported per product: the median over `--reps` calls after `--warmup`, in µs, and GFLOP/s (`2·m·k·n`).

use std::time::Instant;

use candle_core::{Device, Tensor};
use clap::Parser;

/// Global allocator, as every binary of the workspace (docs/benchmarks.md, "Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The MLP step's matrix products through candle's matmul.
#[derive(Parser, Debug)]
struct Cli {
    /// Timed calls per product.
    #[arg(long, default_value_t = 200)]
    reps: usize,
    /// Untimed calls first.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// One JSON object per product instead of the table.
    #[arg(long)]
    json: bool,
    /// Time these products instead of the MLP's three, each `MxKxN` (`m×k · k×n`; repeat the flag), e.g. the
    /// large char-GPT's `--product 512x512x2048` (8 × 64 tokens through `c_fc`).
    #[arg(long = "product", value_parser = parse_product)]
    products: Vec<(usize, usize, usize)>,
}

/// `MxKxN` → `(m, k, n)`, each at least 1.
fn parse_product(s: &str) -> Result<(usize, usize, usize), String> {
    let dims: Vec<usize> = s
        .split(['x', 'X', '×'])
        .map(|d| d.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("`{s}`: {e}; a product is written MxKxN, e.g. 512x512x2048"))?;
    match dims[..] {
        [m, k, n] if m > 0 && k > 0 && n > 0 => Ok((m, k, n)),
        _ => Err(format!("`{s}`: a product is written MxKxN with three sizes of at least 1, e.g. 512x512x2048")),
    }
}

/// `(name, m, k, n)` of each product.
const PRODUCTS: [(&str, usize, usize, usize); 3] =
    [("fc1 forward", 128, 784, 512), ("fc2 forward", 128, 512, 512), ("fc1 weight gradient", 512, 128, 784)];

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let products: Vec<(String, usize, usize, usize)> = match cli.products.is_empty() {
        true => PRODUCTS.iter().map(|(name, m, k, n)| (name.to_string(), *m, *k, *n)).collect(),
        false => cli.products.iter().map(|&(m, k, n)| (format!("{m}x{k}x{n}"), m, k, n)).collect(),
    };
    for (name, m, k, n) in products {
        let a = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
        let b = Tensor::randn(0f32, 1.0, (k, n), &Device::Cpu)?;
        let mut times = Vec::with_capacity(cli.reps);
        for i in 0..cli.warmup + cli.reps {
            let t0 = Instant::now();
            let c = a.matmul(&b)?;
            let dt = t0.elapsed().as_secs_f64();
            drop(c);
            if i >= cli.warmup {
                times.push(dt);
            }
        }
        times.sort_by(f64::total_cmp);
        let us = times[times.len() / 2] * 1e6;
        let gflops = 2.0 * (m * k * n) as f64 / (us * 1e-6) / 1e9;
        let threads = candle_core::utils::get_num_threads();
        if cli.json {
            println!(
                "{}",
                serde_json::json!({"impl": "candle", "product": name, "m": m, "k": k, "n": n, "threads": threads,
                    "us": us, "gflops": gflops})
            );
        } else {
            println!("candle {name:20} {m}×{k}·{k}×{n}, {threads} thread(s): {us:8.1} µs, {gflops:6.1} GFLOP/s");
        }
    }
    Ok(())
}
