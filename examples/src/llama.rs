//! What the Llama examples (`accel_llama`, `train_llama`) share: the tokenized Shakespeare text, the model's
//! shape from flags or from a Hugging Face directory, the tokenizer, and the output directory a user loads in
//! transformers.

use std::path::{Path, PathBuf};

use accel::data::TokenDataset;
use accel::models::llama::LlamaConfig;
use anyhow::Context;

/// The shipped tokenizer: a byte-level BPE of 2048 ids trained on the text (`scripts/train-tokenizer.py`).
pub fn default_tokenizer_path() -> PathBuf {
    crate::default_text_path().with_file_name("tokenizer.json")
}

/// The tokenizer of a run: the model directory's `tokenizer.json` when fine-tuning from one that has it, else
/// `fallback` (the shipped one). Errors name the file that cannot be read.
pub fn load_tokenizer(model_dir: Option<&Path>, fallback: &Path) -> anyhow::Result<(tokenizers::Tokenizer, PathBuf)> {
    let path = match model_dir.map(|d| d.join("tokenizer.json")) {
        Some(p) if p.is_file() => p,
        _ => fallback.to_path_buf(),
    };
    let tokenizer = tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| anyhow::anyhow!("reading the tokenizer {}: {e}", path.display()))?;
    Ok((tokenizer, path))
}

/// The text at `path` tokenized, as non-overlapping windows of `seq_len` tokens: the first 95 % of the tokens for
/// training, the last 5 % for validation.
pub fn token_datasets(
    path: &Path,
    tokenizer: &tokenizers::Tokenizer,
    seq_len: usize,
) -> anyhow::Result<(TokenDataset, TokenDataset)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let ids = tokenizer
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("tokenizing {}: {e}", path.display()))?
        .get_ids()
        .to_vec();
    let cut = ids.len() * 95 / 100;
    let validation = ids[cut..].to_vec();
    let mut train = ids;
    train.truncate(cut);
    Ok((TokenDataset::new(train, seq_len, seq_len)?, TokenDataset::new(validation, seq_len, seq_len)?))
}

/// Refuses a `--tp-size` that does not divide the key/value heads, once, before any worker starts (each worker
/// would refuse it in `Llama::new`).
pub fn check_tp(config: &LlamaConfig, tp: usize) -> anyhow::Result<()> {
    let kv = config.num_key_value_heads();
    if !kv.is_multiple_of(tp) {
        let fit: Vec<String> = (1..=kv).filter(|d| kv.is_multiple_of(*d)).map(|d| d.to_string()).collect();
        anyhow::bail!(
            "--tp-size {tp} does not divide the {kv} key/value heads (each rank computes whole heads and the query \
             heads they serve); tp sizes that fit: {}",
            fit.join(", ")
        );
    }
    Ok(())
}

/// The number of parameters of a Llama of `config` (each weight once; a tied head is the embedding).
pub fn num_parameters(config: &LlamaConfig) -> usize {
    accel::models::llama::weight_shapes(config).values().map(|s| s.iter().product::<usize>()).sum()
}

/// Copies the tokenizer into a saved model directory (each file written atomically), with the
/// `tokenizer_config.json` that makes `AutoTokenizer.from_pretrained(dir)` read it as a fast tokenizer (the
/// directory's own when fine-tuning from one that has it), so the directory is what transformers' `Auto*` classes
/// load.
pub fn copy_tokenizer(tokenizer: &Path, out: &Path) -> anyhow::Result<()> {
    let bytes = std::fs::read(tokenizer).with_context(|| format!("reading {}", tokenizer.display()))?;
    accel::state::write_atomic(&out.join("tokenizer.json"), bytes)?;
    let config = match std::fs::read(tokenizer.with_file_name("tokenizer_config.json")) {
        Ok(own) => own,
        Err(_) => serde_json::to_vec_pretty(&serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
        }))?,
    };
    accel::state::write_atomic(&out.join("tokenizer_config.json"), config)?;
    Ok(())
}
