//! The flags the Llama examples share (`accel_llama`, `train_llama`: `#[path]`-included by each, so that only
//! binaries know clap): where the model, the text and the tokenizer come from, and the model's shape when it is
//! trained from scratch.

use accel::models::llama::LlamaConfig;
use std::path::PathBuf;

/// The model and its data.
#[derive(clap::Args, Debug, Clone)]
pub struct LlamaArgs {
    /// Fine-tune the model of this Hugging Face directory (config.json, model.safetensors or shards, and
    /// tokenizer.json if it has one) instead of training one from scratch (the shape flags are then refused).
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    #[command(flatten)]
    pub shape: LlamaShape,
    /// Directory with shakespeare8.txt and tokenizer.json (default: the repository's data/shakespeare).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
}

impl LlamaArgs {
    /// Refuses shape flags beside `--model-dir` (the directory's config.json gives the shape).
    pub fn check(&self) -> anyhow::Result<()> {
        if self.model_dir.is_some() && !self.shape.is_default() {
            anyhow::bail!(
                "--model-dir takes the model's shape from its config.json: drop the shape flags (--hidden-size, …)"
            );
        }
        Ok(())
    }

    /// The text to train on.
    pub fn text_path(&self) -> PathBuf {
        match &self.data_dir {
            Some(dir) => dir.join("shakespeare8.txt"),
            None => accel_examples::default_text_path(),
        }
    }

    /// The tokenizer (the model directory's, else the data directory's) and its path.
    pub fn tokenizer(&self) -> anyhow::Result<(tokenizers::Tokenizer, PathBuf)> {
        let fallback = match &self.data_dir {
            Some(dir) => dir.join("tokenizer.json"),
            None => accel_examples::llama::default_tokenizer_path(),
        };
        accel_examples::llama::load_tokenizer(self.model_dir.as_deref(), &fallback)
    }

    /// The model's config: the directory's, or the shape flags' for a vocabulary of `vocab_size` ids.
    pub fn config(&self, vocab_size: usize) -> anyhow::Result<LlamaConfig> {
        match &self.model_dir {
            Some(dir) => Ok(LlamaConfig::from_pretrained(dir)?),
            None => self.shape.config(vocab_size, self.seq_len.max(2048)),
        }
    }
}

/// The model's shape when training from scratch (the examples' flags).
#[derive(clap::Args, Debug, Clone)]
pub struct LlamaShape {
    /// Width of the residual stream.
    #[arg(long, default_value_t = 384)]
    pub hidden_size: usize,
    /// Hidden width of the SwiGLU MLP.
    #[arg(long, default_value_t = 1024)]
    pub intermediate_size: usize,
    /// Decoder layers (the pipeline's blocks).
    #[arg(long, default_value_t = 6)]
    pub num_hidden_layers: usize,
    /// Query heads (split over the tp ranks).
    #[arg(long, default_value_t = 6)]
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention; tp must divide it).
    #[arg(long, default_value_t = 2)]
    pub num_key_value_heads: usize,
    /// Tie the head's weight to the token embedding (no `lm_head.weight`).
    #[arg(long)]
    pub tie_word_embeddings: bool,
    /// Dropout on the attention probabilities in training.
    #[arg(long, default_value_t = 0.0)]
    pub attention_dropout: f64,
    /// Dropout on each residual branch in training.
    #[arg(long, default_value_t = 0.0)]
    pub hidden_dropout: f64,
}

impl LlamaShape {
    /// The config these flags give for a vocabulary of `vocab_size` ids and sequences up to `max_positions`,
    /// checked; bos 0 and eos 1 (the shipped tokenizer's `<s>` and `</s>`).
    pub fn config(&self, vocab_size: usize, max_positions: usize) -> anyhow::Result<LlamaConfig> {
        let mut c = LlamaConfig::new(
            vocab_size,
            self.hidden_size,
            self.intermediate_size,
            self.num_hidden_layers,
            self.num_attention_heads,
            self.num_key_value_heads,
        );
        c.tie_word_embeddings = self.tie_word_embeddings;
        c.attention_dropout = self.attention_dropout;
        c.hidden_dropout = self.hidden_dropout;
        c.max_position_embeddings = max_positions;
        c.other.insert("bos_token_id".into(), 0.into());
        c.other.insert("eos_token_id".into(), 1.into());
        c.check()?;
        Ok(c)
    }

    /// Whether every flag is at its default (a `--model-dir` run takes the shape from the directory).
    pub fn is_default(&self) -> bool {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Defaults {
            #[command(flatten)]
            shape: LlamaShape,
        }
        let d = Defaults::parse_from(["defaults"]).shape;
        format!("{d:?}") == format!("{self:?}")
    }
}
