//! Plain text for character-level language modelling (as Karpathy's char-rnn / nanoGPT "shakespeare_char"):
//! a [`CharVocab`] of the distinct characters, and [`TextDataset`], fixed-length windows of token ids whose
//! targets are the next characters.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use super::dataset::{Batch, Dataset};
use super::tokens::TokenDataset;
use crate::error::{AccelError, Result};

/// The distinct characters of a text, sorted by code point; token id = position in that order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CharVocab {
    chars: Vec<char>,
    ids: HashMap<char, u32>,
}

impl CharVocab {
    /// The vocabulary of `text`.
    pub fn from_text(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        Self::from_chars(chars)
    }

    /// A vocabulary of exactly these characters (deduplicated, sorted).
    pub fn from_chars(mut chars: Vec<char>) -> Self {
        chars.sort_unstable();
        chars.dedup();
        let ids = chars.iter().enumerate().map(|(i, &c)| (c, i as u32)).collect();
        CharVocab { chars, ids }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// Whether the vocabulary is empty.
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The characters, by token id.
    pub fn chars(&self) -> &[char] {
        &self.chars
    }

    /// Token ids of `text`. Errors name the first character not in the vocabulary and its position.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        text.chars()
            .enumerate()
            .map(|(pos, c)| {
                self.ids.get(&c).copied().ok_or_else(|| {
                    AccelError::Data(format!("character {c:?} at position {pos} is not in the vocabulary"))
                })
            })
            .collect()
    }

    /// The text of token ids; ids outside the vocabulary become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|&i| self.chars.get(i as usize).copied().unwrap_or('\u{FFFD}')).collect()
    }
}

/// Windows of `seq_len` token ids of a text. Sample `i` starts at token `i · stride`:
/// inputs `[seq_len]` u32 = tokens `[i·stride, i·stride + seq_len)`, targets `[seq_len]` u32 = the same window
/// shifted by one (the next character at every position). A text of `T` tokens gives
/// `⌊(T − seq_len − 1) / stride⌋ + 1` samples (0 when `T ≤ seq_len`).
#[derive(Debug, Clone)]
pub struct TextDataset {
    windows: TokenDataset,
    vocab: CharVocab,
}

impl TextDataset {
    /// Non-overlapping windows (`stride = seq_len`) of `text`, with the vocabulary of `text`.
    pub fn from_text(text: &str, seq_len: usize) -> Result<Self> {
        Self::with_vocab(text, CharVocab::from_text(text), seq_len, seq_len)
    }

    /// Windows of `text` every `stride` tokens, with a given vocabulary (e.g. the training set's, for a
    /// validation text).
    ///
    /// Errors: `seq_len` or `stride` 0; a character outside `vocab`.
    pub fn with_vocab(text: &str, vocab: CharVocab, seq_len: usize, stride: usize) -> Result<Self> {
        if seq_len == 0 || stride == 0 {
            return Err(AccelError::Data(format!(
                "TextDataset: seq_len ({seq_len}) and stride ({stride}) must be at least 1"
            )));
        }
        let windows = TokenDataset::new(vocab.encode(text)?, seq_len, stride)?;
        Ok(TextDataset { windows, vocab })
    }

    /// [`TextDataset::from_text`] of a UTF-8 file (`.gz` decompressed). Errors name the file.
    pub fn from_file(path: &Path, seq_len: usize) -> Result<Self> {
        let file = std::fs::File::open(path)
            .map_err(|e| AccelError::io(format!("opening text file {}", path.display()), e))?;
        let mut text = String::new();
        if path.extension().is_some_and(|e| e == "gz") {
            flate2::read::GzDecoder::new(file).read_to_string(&mut text)
        } else {
            std::io::BufReader::new(file).read_to_string(&mut text)
        }
        .map_err(|e| AccelError::io(format!("reading text file {} (must be UTF-8)", path.display()), e))?;
        Self::from_text(&text, seq_len)
    }

    /// The vocabulary.
    pub fn vocab(&self) -> &CharVocab {
        &self.vocab
    }

    /// All token ids of the text.
    pub fn tokens(&self) -> &[u32] {
        self.windows.tokens()
    }

    /// Tokens per window.
    pub fn seq_len(&self) -> usize {
        self.windows.seq_len()
    }
}

/// The windows' batches ([`TokenDataset`]'s).
impl Dataset for TextDataset {
    fn len(&self) -> usize {
        self.windows.len()
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Batch> {
        self.windows.get_batch(indices)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocab_round_trip_and_unknown_character() {
        let v = CharVocab::from_text("hello world");
        assert_eq!(v.chars(), &[' ', 'd', 'e', 'h', 'l', 'o', 'r', 'w']);
        assert_eq!(v.decode(&v.encode("world").unwrap()), "world");
        let err = v.encode("help").unwrap_err().to_string();
        assert!(err.contains("'p'") && err.contains("position 3"), "{err}");
    }

    #[test]
    fn windows_and_next_character_targets() {
        let ds = TextDataset::from_text("abcdefg", 3).unwrap();
        // 7 tokens, windows at 0 and 3 (the one at 6 would need tokens 6..10).
        assert_eq!(ds.len(), 2);
        let b = ds.get_batch(&[1, 0]).unwrap();
        let v = ds.vocab();
        let rows = b.inputs.to_vec2::<u32>().unwrap();
        let next = b.targets.to_vec2::<u32>().unwrap();
        assert_eq!((v.decode(&rows[0]), v.decode(&next[0])), ("def".to_string(), "efg".to_string()));
        assert_eq!((v.decode(&rows[1]), v.decode(&next[1])), ("abc".to_string(), "bcd".to_string()));
        let overlapping = TextDataset::with_vocab("abcdefg", v.clone(), 3, 1).unwrap();
        assert_eq!(overlapping.len(), 4);
        assert_eq!(TextDataset::from_text("abc", 3).unwrap().len(), 0);
    }
}
