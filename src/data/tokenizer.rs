//! A Hugging Face `tokenizer.json` (tokenizers crate) and the collation of its encodings into
//! padded model inputs, matching what transformers' fast tokenizers produce with
//! `padding=True, truncation=True`.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use tch::Tensor;
use tokenizers::{Encoding, Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

use crate::models::EncoderInputs;

/// What to truncate when a pair is too long: both, longest first (classification), or only
/// the second text (the context in question answering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncation {
    LongestFirst,
    OnlySecond,
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
                stride: 0,
            }))
            .map_err(|e| {
                anyhow!(
                    "{}: cannot truncate to {max_len} tokens: {e}",
                    path.display()
                )
            })?;
        Ok(TextTokenizer { inner, pad_id })
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

/// Pads encodings to the longest in the batch (right padding) and builds (B, T) tensors.
pub fn collate(encodings: &[Encoding], pad_id: i64) -> Result<EncoderInputs> {
    let b = encodings.len();
    let t = encodings
        .iter()
        .map(Encoding::len)
        .max()
        .context("empty batch")?;
    let mut ids = vec![pad_id; b * t];
    let mut mask = vec![0i64; b * t];
    let mut types = vec![0i64; b * t];
    for (row, enc) in encodings.iter().enumerate() {
        let base = row * t;
        for (j, ((&id, &ty), &m)) in enc
            .get_ids()
            .iter()
            .zip(enc.get_type_ids())
            .zip(enc.get_attention_mask())
            .enumerate()
        {
            ids[base + j] = id as i64;
            types[base + j] = ty as i64;
            mask[base + j] = m as i64;
        }
    }
    let shape = [b as i64, t as i64];
    Ok(EncoderInputs {
        input_ids: Tensor::from_slice(&ids).view(shape),
        attention_mask: Tensor::from_slice(&mask).view(shape),
        token_type_ids: Some(Tensor::from_slice(&types).view(shape)),
    })
}
