//! A Hugging Face `tokenizer.json` (tokenizers crate), set up as transformers' fast tokenizers
//! are with `truncation=True` (padding happens per batch, in `batching::collate`).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use tokenizers::{Encoding, Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

/// What to truncate when a pair is too long: both, longest first (classification), or only
/// the second text (the context in question answering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncation {
    LongestFirst,
    OnlySecond,
}

/// Parses tokenizer.json. The JSON is checked first: the tokenizers crate panics on some
/// malformed JSON (inside its own deserialisers) instead of returning an error; what
/// still panics becomes an error.
fn read_tokenizer(path: &Path) -> Result<Tokenizer> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let json: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| anyhow!("{} is not a valid tokenizer.json: {e}", path.display()))?;
    if let Some(processor) = json.get("post_processor") {
        check_templates(processor)
            .with_context(|| format!("{} is not a valid tokenizer.json", path.display()))?;
    }
    if let Some(model) = json.get("model") {
        check_unknown_token(model)
            .with_context(|| format!("{} is not a valid tokenizer.json", path.display()))?;
    }
    crate::runtime::panic_guard::catch(path, "the tokenizers crate", || {
        Tokenizer::from_bytes(&bytes)
            .map_err(|e| anyhow!("{} is not a valid tokenizer.json: {e}", path.display()))
    })
}

/// A template post-processor must define every special token its templates use (the
/// tokenizers crate would panic on the first encoding otherwise).
fn check_templates(processor: &serde_json::Value) -> Result<()> {
    match processor.get("type").and_then(|t| t.as_str()) {
        Some("Sequence") => processor
            .get("processors")
            .and_then(|p| p.as_array())
            .into_iter()
            .flatten()
            .try_for_each(check_templates),
        Some("TemplateProcessing") => {
            let defined = processor.get("special_tokens");
            for template in ["single", "pair"] {
                let pieces = processor.get(template).and_then(|t| t.as_array());
                for piece in pieces.into_iter().flatten() {
                    let Some(id) = piece.pointer("/SpecialToken/id").and_then(|i| i.as_str())
                    else {
                        continue;
                    };
                    if defined.and_then(|d| d.get(id)).is_none() {
                        bail!("post_processor: the {template} template uses special token {id:?}, which its special_tokens do not define");
                    }
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// A WordPiece, WordLevel or BPE model maps what it does not know to its `unk_token`, so that
/// token must be in its vocabulary (otherwise the first unknown word fails to encode, deep in
/// a run). A BPE model without one (GPT-2's byte-level BPE) has nothing to check.
fn check_unknown_token(model: &serde_json::Value) -> Result<()> {
    let Some(kind @ ("WordPiece" | "WordLevel" | "BPE")) =
        model.get("type").and_then(|t| t.as_str())
    else {
        return Ok(());
    };
    let Some(unk) = model.get("unk_token").and_then(|u| u.as_str()) else {
        return Ok(()); // the tokenizers crate reports a missing or mistyped field itself
    };
    if model.get("vocab").and_then(|v| v.get(unk)).is_none() {
        bail!("the {kind} model's unk_token {unk:?} is not in its vocab");
    }
    Ok(())
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
    let mut inner = read_tokenizer(path)?;
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

/// Loads `tokenizer.json` without padding or truncation: language-model texts are cut into
/// blocks after tokenization.
pub fn load_untruncated(path: &Path) -> Result<Tokenizer> {
    if !path.is_file() {
        bail!("tokenizer file {} does not exist", path.display());
    }
    let mut inner = read_tokenizer(path)?;
    inner.with_padding(None);
    inner
        .with_truncation(None)
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    Ok(inner)
}

pub struct TextTokenizer {
    inner: Tokenizer,
    pad_id: i64,
    /// Named in encoding errors.
    path: PathBuf,
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
            path: path.to_path_buf(),
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
            .map_err(|e| anyhow!("tokenization with {} failed: {e}", self.path.display()))
    }

    /// Encodes sentences already split into words (as `is_split_into_words=True`), in
    /// parallel; `Encoding::get_word_ids` maps each token back to its word.
    pub fn encode_words_batch(&self, sentences: &[Vec<String>]) -> Result<Vec<Encoding>> {
        let inputs: Vec<tokenizers::EncodeInput> = sentences
            .iter()
            .map(|words| {
                let words: Vec<&str> = words.iter().map(String::as_str).collect();
                tokenizers::InputSequence::from(words).into()
            })
            .collect();
        self.inner
            .encode_batch_char_offsets(inputs, true)
            .map_err(|e| anyhow!("tokenization with {} failed: {e}", self.path.display()))
    }

    pub fn pad_id(&self) -> i64 {
        self.pad_id
    }
}

/// Writes a character-level tokenizer.json for `text_file`: token i is the i-th distinct
/// character in code-point order (nanoGPT's `sorted(set(data))`), encoding maps each
/// character to its token and decoding joins them back. Returns the vocabulary size.
pub fn write_char_tokenizer(text_file: &Path, output: &Path) -> Result<usize> {
    use std::collections::BTreeSet;
    use tokenizers::decoders::fuse::Fuse;
    use tokenizers::models::bpe::BPE;

    let text = std::fs::read_to_string(text_file)
        .map_err(|e| anyhow!("cannot read {} as UTF-8 text: {e}", text_file.display()))?;
    let chars: BTreeSet<char> = text.chars().collect();
    if chars.is_empty() {
        bail!(
            "{} is empty: no characters for a vocabulary",
            text_file.display()
        );
    }
    let vocab: ahash::AHashMap<String, u32> = chars
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    // BPE without merges over one "word" per text: every character is its own token.
    let model = BPE::builder()
        .vocab_and_merges(vocab, Vec::new())
        .build()
        .map_err(|e| anyhow!("cannot build the character vocabulary: {e}"))?;
    let mut tokenizer = Tokenizer::new(model);
    tokenizer.with_decoder(Some(Fuse::new()));
    let json = tokenizer
        .to_string(true)
        .map_err(|e| anyhow!("cannot serialise the tokenizer: {e}"))?;
    crate::io::atomic_file::write_atomic(output, json.as_bytes())?;
    Ok(chars.len())
}
