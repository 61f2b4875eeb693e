//! The flags the Llama examples share (`accel_llama`, `train_llama`: `#[path]`-included by each, so that only
//! binaries know clap): where the model, the text and the tokenizer come from, and the model's shape when it is
//! trained from scratch — each checked before any worker starts.

use accel::models::llama::LlamaConfig;
use std::path::PathBuf;

/// The model and its data.
#[derive(clap::Args, Debug, Clone)]
pub struct LlamaArgs {
    /// Fine-tune the model of this Hugging Face directory (config.json, model.safetensors or shards, and its
    /// tokenizer.json) instead of training one from scratch (the shape flags are then refused).
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

/// What a run trains: the config, the tokenizer and the file it came from.
pub struct LlamaSetup {
    pub config: LlamaConfig,
    pub tokenizer: tokenizers::Tokenizer,
    pub tokenizer_path: PathBuf,
}

impl LlamaArgs {
    /// The text to train on.
    pub fn text_path(&self) -> PathBuf {
        match &self.data_dir {
            Some(dir) => dir.join("shakespeare8.txt"),
            None => accel_examples::default_text_path(),
        }
    }

    /// The model's config and tokenizer — the directory's, or the shape flags' with the data directory's tokenizer
    /// — checked against each other and against `--seq-len` and `tp` (every rank calls it; the launcher first,
    /// so a bad command line fails once). Errors: shape flags beside `--model-dir`; a model directory without a
    /// tokenizer.json; a tokenizer with more ids than the model's vocabulary; a `--seq-len` past
    /// `max_position_embeddings`; a tp size the model's heads or MLP do not split into; no text.
    pub fn setup(&self, tp: usize) -> anyhow::Result<LlamaSetup> {
        if let (Some(_), Some(flag)) = (&self.model_dir, self.shape.given()) {
            anyhow::bail!(
                "--model-dir takes the model's shape from its config.json: drop {flag} (and any other shape flag)"
            );
        }
        let tokenizer_path = match &self.model_dir {
            Some(dir) => {
                anyhow::ensure!(dir.is_dir(), "--model-dir {} is not a directory", dir.display());
                let path = dir.join("tokenizer.json");
                anyhow::ensure!(
                    path.is_file(),
                    "{} has no tokenizer.json: a model is fine-tuned with the tokenizer it was trained with; copy \
                     that tokenizer.json into the directory",
                    dir.display()
                );
                path
            }
            None => match &self.data_dir {
                Some(dir) => dir.join("tokenizer.json"),
                None => accel_examples::llama::default_tokenizer_path(),
            },
        };
        let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path)
            .map_err(|e| anyhow::anyhow!("reading the tokenizer {}: {e}", tokenizer_path.display()))?;
        let ids = tokenizer.get_vocab_size(true);
        let config = match &self.model_dir {
            Some(dir) => LlamaConfig::from_pretrained(dir)?,
            None => self.shape.config(ids, self.seq_len.max(2048))?,
        };
        anyhow::ensure!(
            ids <= config.vocab_size,
            "the tokenizer {} has {ids} ids but the model's vocab_size is {}: they do not belong together",
            tokenizer_path.display(),
            config.vocab_size
        );
        anyhow::ensure!(
            self.seq_len <= config.max_position_embeddings,
            "--seq-len {} is longer than the model's max_position_embeddings ({}): use --seq-len {} or less",
            self.seq_len,
            config.max_position_embeddings,
            config.max_position_embeddings
        );
        config.check_tp_size(tp)?;
        let text = self.text_path();
        anyhow::ensure!(text.is_file(), "--data-dir: no text at {}", text.display());
        Ok(LlamaSetup { config, tokenizer, tokenizer_path })
    }
}

/// The model's shape when training from scratch (the examples' flags; the defaults apply when a flag is not
/// given, and any given flag is refused beside `--model-dir`).
#[derive(clap::Args, Debug, Clone)]
pub struct LlamaShape {
    /// Width of the residual stream [default: 384].
    #[arg(long)]
    pub hidden_size: Option<usize>,
    /// Hidden width of the SwiGLU MLP [default: 1024].
    #[arg(long)]
    pub intermediate_size: Option<usize>,
    /// Decoder layers (the pipeline's blocks) [default: 6].
    #[arg(long)]
    pub num_hidden_layers: Option<usize>,
    /// Query heads (split over the tp ranks) [default: 6].
    #[arg(long)]
    pub num_attention_heads: Option<usize>,
    /// Key/value heads (grouped-query attention; tp must divide it) [default: 2].
    #[arg(long)]
    pub num_key_value_heads: Option<usize>,
    /// Tie the head's weight to the token embedding (no `lm_head.weight`).
    #[arg(long)]
    pub tie_word_embeddings: bool,
    /// Dropout on the attention probabilities in training [default: 0].
    #[arg(long)]
    pub attention_dropout: Option<f64>,
    /// Dropout on each residual branch in training [default: 0].
    #[arg(long)]
    pub hidden_dropout: Option<f64>,
}

impl LlamaShape {
    /// The config these flags give for a vocabulary of `vocab_size` ids and sequences up to `max_positions`,
    /// checked; bos 0 and eos 1 (the shipped tokenizer's `<s>` and `</s>`).
    pub fn config(&self, vocab_size: usize, max_positions: usize) -> anyhow::Result<LlamaConfig> {
        let mut c = LlamaConfig::new(
            vocab_size,
            self.hidden_size.unwrap_or(384),
            self.intermediate_size.unwrap_or(1024),
            self.num_hidden_layers.unwrap_or(6),
            self.num_attention_heads.unwrap_or(6),
            self.num_key_value_heads.unwrap_or(2),
        );
        c.tie_word_embeddings = self.tie_word_embeddings;
        c.attention_dropout = self.attention_dropout.unwrap_or(0.0);
        c.hidden_dropout = self.hidden_dropout.unwrap_or(0.0);
        c.max_position_embeddings = max_positions;
        c.other.insert("bos_token_id".into(), 0.into());
        c.other.insert("eos_token_id".into(), 1.into());
        c.check()?;
        Ok(c)
    }

    /// The first shape flag given, if any (a `--model-dir` run takes the shape from the directory).
    pub fn given(&self) -> Option<&'static str> {
        let given = [
            ("--hidden-size", self.hidden_size.is_some()),
            ("--intermediate-size", self.intermediate_size.is_some()),
            ("--num-hidden-layers", self.num_hidden_layers.is_some()),
            ("--num-attention-heads", self.num_attention_heads.is_some()),
            ("--num-key-value-heads", self.num_key_value_heads.is_some()),
            ("--tie-word-embeddings", self.tie_word_embeddings),
            ("--attention-dropout", self.attention_dropout.is_some()),
            ("--hidden-dropout", self.hidden_dropout.is_some()),
        ];
        given.into_iter().find(|(_, g)| *g).map(|(flag, _)| flag)
    }
}
