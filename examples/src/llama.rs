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

/// The number of parameters of a Llama of `config` (each weight once; a tied head is the embedding).
pub fn num_parameters(config: &LlamaConfig) -> usize {
    accel::models::llama::weight_shapes(config).values().map(|s| s.iter().product::<usize>()).sum()
}

/// The tokenizer files a saved model directory gets (for `SaveOptions::files`, written in the same commit as the
/// model): `tokenizer.json`, and the `tokenizer_config.json` beside it — or, when there is none, one that makes
/// `AutoTokenizer.from_pretrained(dir)` read it as a fast tokenizer with the shipped special tokens. Read once, at
/// start-up: fine-tuning a directory in place replaces the files it was read from.
pub fn tokenizer_files(tokenizer: &Path) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let bytes = std::fs::read(tokenizer).with_context(|| format!("reading {}", tokenizer.display()))?;
    let config = match std::fs::read(tokenizer.with_file_name("tokenizer_config.json")) {
        Ok(own) => own,
        Err(_) => serde_json::to_vec_pretty(&serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
        }))?,
    };
    Ok(vec![("tokenizer.json".into(), bytes), ("tokenizer_config.json".into(), config)])
}

/// The dtype a run saves in: the flag's, else the fine-tuned directory's (`dtype` or `torch_dtype` in its
/// config.json), else f32.
pub fn save_dtype(flag: Option<&str>, config: &LlamaConfig) -> candle_core::DType {
    let from_config = || {
        ["dtype", "torch_dtype"].iter().find_map(|k| config.other.get(*k).and_then(|v| v.as_str()).map(String::from))
    };
    match flag.map(String::from).or_else(from_config).as_deref() {
        Some("bf16" | "bfloat16") => candle_core::DType::BF16,
        Some("f16" | "float16") => candle_core::DType::F16,
        _ => candle_core::DType::F32,
    }
}
