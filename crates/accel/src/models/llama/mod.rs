//! The Llama family (`model_type: llama`: Llama 2 and 3, TinyLlama, SmolLM): transformers' `LlamaForCausalLM`
//! written once on [`crate::nn`], its tensor-parallel plan, and Hugging Face model directories read and written
//! at any layout.
//!
//! ```no_run
//! use accel::models::llama::{self, Llama, LlamaConfig};
//! use accel::{Accelerator, AcceleratorConfig};
//! # fn main() -> anyhow::Result<()> {
//! let dir = std::path::Path::new("TinyLlama-1.1B");
//! let acc = Accelerator::new(AcceleratorConfig::from_env()?)?;
//! let config = LlamaConfig::from_pretrained(dir)?;
//! let varmap = candle_nn::VarMap::new();
//! let model = Llama::new(&config, acc.builder(&varmap, Llama::plan(&config)))?;
//! let prepared = acc.prepare_model(&varmap)?;
//! llama::load_pretrained(&prepared, &config, dir)?; // each rank keeps its slice
//! // … train …
//! llama::save_pretrained(&acc, &prepared, &config, "out".as_ref(), &Default::default())?;
//! # Ok(())
//! # }
//! ```
//!
//! Checked against transformers (`scripts/llama-fixture.py` and the fixture it made, under
//! `crates/accel/tests/fixtures/llama`): logits, loss and every gradient at one process and at each layout, and
//! greedy generation token for token.

mod checkpoint;
mod config;
mod model;
mod rope;

pub use checkpoint::{
    check_save_dir, load_pretrained, save_pretrained, weight_shapes, PretrainedWeights, SaveOptions, WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
};
pub use config::{LlamaConfig, Rope, RopeScaling};
pub use model::Llama;
