//! Extractive question answering data: SQuAD JSON (v1.1 and v2.0 nested format) and the
//! features transformers' run_qa.py builds from it — question + context, truncation of the
//! context only, sliding windows of `max_seq_len` tokens overlapping by `doc_stride`, character
//! offsets of the context tokens, and start/end token labels (the CLS position where the answer
//! is not inside a window, or the question has none).

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use tokenizers::Tokenizer;

use super::tokenizer::{load_tokenizer, Truncation};

/// One question about one context.
#[derive(Debug, Clone, PartialEq)]
pub struct QaExample {
    pub id: String,
    pub title: String,
    pub question: String,
    pub context: String,
    /// (text, character offset in the context); empty for an unanswerable (v2.0) question.
    pub answers: Vec<(String, usize)>,
}

#[derive(Deserialize)]
struct SquadFile {
    data: Vec<SquadArticle>,
}

#[derive(Deserialize)]
struct SquadArticle {
    #[serde(default)]
    title: String,
    paragraphs: Vec<SquadParagraph>,
}

#[derive(Deserialize)]
struct SquadParagraph {
    context: String,
    qas: Vec<SquadQa>,
}

#[derive(Deserialize)]
struct SquadQa {
    id: Option<String>,
    question: String,
    #[serde(default)]
    answers: Vec<SquadAnswer>,
    #[serde(default)]
    is_impossible: bool,
}

#[derive(Deserialize)]
struct SquadAnswer {
    text: String,
    answer_start: usize,
}

/// Reads the official SQuAD JSON. A question without an id or a duplicate id is an error.
pub fn load_squad_json(path: &Path) -> Result<Vec<QaExample>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file: SquadFile = serde_json::from_str(&text)
        .map_err(|e| anyhow!("{}: not SQuAD JSON: {e}", path.display()))?;
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for article in file.data {
        for para in article.paragraphs {
            for qa in para.qas {
                let id = qa.id.with_context(|| {
                    format!(
                        "{}: a question has no id: {:?}",
                        path.display(),
                        qa.question
                    )
                })?;
                if !seen.insert(id.clone()) {
                    bail!("{}: duplicate question id {id}", path.display());
                }
                let answers = if qa.is_impossible {
                    Vec::new()
                } else {
                    qa.answers
                        .into_iter()
                        .map(|a| (a.text, a.answer_start))
                        .collect()
                };
                out.push(QaExample {
                    id,
                    title: article.title.clone(),
                    question: qa.question,
                    context: para.context.clone(),
                    answers,
                });
            }
        }
    }
    if out.is_empty() {
        bail!("{} holds no questions", path.display());
    }
    Ok(out)
}

/// One window of one example.
#[derive(Debug, Clone, PartialEq)]
pub struct QaFeature {
    /// Index of the example in the input slice.
    pub example: usize,
    pub input_ids: Vec<i64>,
    pub type_ids: Vec<i64>,
    /// Character span in the context of each context token; `None` for question and special tokens.
    pub offsets: Vec<Option<(usize, usize)>>,
    pub start_position: i64,
    pub end_position: i64,
}

/// A tokenizer set up as run_qa.py sets it: context-only truncation with overflowing windows.
pub fn qa_tokenizer(path: &Path, max_seq_len: usize, doc_stride: usize) -> Result<Tokenizer> {
    load_tokenizer(path, max_seq_len, Truncation::OnlySecond, doc_stride)
}

/// Builds every window of every example, with run_qa.py's labels.
pub fn qa_features(tok: &Tokenizer, examples: &[QaExample]) -> Result<Vec<QaFeature>> {
    let inputs: Vec<tokenizers::EncodeInput> = examples
        .iter()
        .map(|e| (e.question.trim_start(), e.context.as_str()).into())
        .collect();
    let encodings = tok
        .encode_batch_char_offsets(inputs, true)
        .map_err(|e| anyhow!("tokenization failed: {e}"))?;
    let mut out = Vec::new();
    for (index, (enc, ex)) in encodings.into_iter().zip(examples).enumerate() {
        let mut windows = vec![enc.clone()];
        windows.extend(enc.get_overflowing().iter().cloned());
        for w in windows {
            let seq = w.get_sequence_ids();
            let offsets: Vec<Option<(usize, usize)>> = w
                .get_offsets()
                .iter()
                .zip(&seq)
                .map(|(o, s)| (*s == Some(1)).then_some(*o))
                .collect();
            let (start_position, end_position) = label(&offsets, ex);
            out.push(QaFeature {
                example: index,
                input_ids: w.get_ids().iter().map(|&i| i as i64).collect(),
                type_ids: w.get_type_ids().iter().map(|&i| i as i64).collect(),
                offsets,
                start_position,
                end_position,
            });
        }
    }
    Ok(out)
}

/// run_qa.py's labels: the tokens spanning the first answer when the window holds all of
/// it, else the CLS position (0).
fn label(offsets: &[Option<(usize, usize)>], ex: &QaExample) -> (i64, i64) {
    let Some((text, start_char)) = ex.answers.first() else {
        return (0, 0);
    };
    let end_char = start_char + text.chars().count();
    let (Some(first), Some(last)) = (
        offsets.iter().position(Option::is_some),
        offsets.iter().rposition(Option::is_some),
    ) else {
        return (0, 0);
    };
    let (Some((window_start, _)), Some((_, window_end))) = (offsets[first], offsets[last]) else {
        return (0, 0);
    };
    if !(window_start <= *start_char && window_end >= end_char) {
        return (0, 0);
    }
    let mut s = first;
    while s <= last && offsets[s].is_some_and(|(a, _)| a <= *start_char) {
        s += 1;
    }
    let mut e = last;
    while offsets[e].is_some_and(|(_, b)| b >= end_char) {
        e -= 1;
    }
    ((s - 1) as i64, (e + 1) as i64)
}
