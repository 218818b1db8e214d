//! A Hugging Face `tokenizer.json` (tokenizers crate), set up as transformers' fast tokenizers
//! are with `truncation=True` (padding happens per batch, in `batching::collate`).

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use tokenizers::{Encoding, Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

/// What to truncate when a pair is too long: both, longest first (classification), or only
/// the second text (the context in question answering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncation {
    LongestFirst,
    OnlySecond,
}

/// Loads `tokenizer.json` without its own padding, truncating to `max_len` tokens including
/// special tokens; a `stride` > 0 keeps the overflow as windows overlapping by that many tokens.
pub fn load_tokenizer(
    path: &Path,
    max_len: usize,
    truncation: Truncation,
    stride: usize,
) -> Result<Tokenizer> {
    if !path.is_file() {
        bail!("tokenizer file {} does not exist", path.display());
    }
    let mut inner = Tokenizer::from_file(path)
        .map_err(|e| anyhow!("{} is not a valid tokenizer.json: {e}", path.display()))?;
    inner.with_padding(None);
    let strategy = match truncation {
        Truncation::LongestFirst => TruncationStrategy::LongestFirst,
        Truncation::OnlySecond => TruncationStrategy::OnlySecond,
    };
    inner
        .with_truncation(Some(TruncationParams {
            direction: TruncationDirection::Right,
            max_length: max_len,
            strategy,
            stride,
        }))
        .map_err(|e| {
            anyhow!(
                "{}: cannot truncate to {max_len} tokens with stride {stride}: {e}",
                path.display()
            )
        })?;
    Ok(inner)
}

pub struct TextTokenizer {
    inner: Tokenizer,
    pad_id: i64,
}

impl TextTokenizer {
    /// Loads `tokenizer.json`, dropping its own padding settings (we pad per batch) and
    /// truncating to `max_len` tokens including special tokens.
    pub fn from_file(
        path: &Path,
        pad_id: i64,
        max_len: usize,
        truncation: Truncation,
    ) -> Result<Self> {
        Ok(TextTokenizer {
            inner: load_tokenizer(path, max_len, truncation, 0)?,
            pad_id,
        })
    }

    /// Encodes single texts or pairs, in parallel; offsets are in characters, as in Python.
    pub fn encode_batch(&self, texts: &[(String, Option<String>)]) -> Result<Vec<Encoding>> {
        let inputs: Vec<tokenizers::EncodeInput> = texts
            .iter()
            .map(|(a, b)| match b {
                Some(b) => (a.as_str(), b.as_str()).into(),
                None => a.as_str().into(),
            })
            .collect();
        self.inner
            .encode_batch_char_offsets(inputs, true)
            .map_err(|e| anyhow!("tokenization failed: {e}"))
    }

    pub fn pad_id(&self) -> i64 {
        self.pad_id
    }
}
