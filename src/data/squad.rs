//! Extractive question answering data: SQuAD JSON (v1.1 and v2.0 nested format) and the
//! features transformers' run_qa.py builds from it — question + context, truncation of the
//! context only, sliding windows of `max_seq_len` tokens overlapping by `doc_stride`, character
//! offsets of the context tokens, and start/end token labels (the CLS position where the answer
//! is not inside a window, or the question has none).

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use tokenizers::{Encoding, Tokenizer};

use super::batching::{Feature, Target};
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

/// How question files are checked as they are read.
#[derive(Debug, Clone, Copy, Default)]
pub struct QaReadOptions {
    /// An `answer_start` that does not point at its answer text is an error (else counted and
    /// warned about once; the label follows `answer_start`, as run_qa.py's does).
    pub strict_answers: bool,
    /// Skip questions with an empty question or context (counted) instead of failing.
    pub skip_bad_rows: bool,
}

/// What reading a question file found besides its examples.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QaReadReport {
    /// Answers whose `answer_start` does not point at their text.
    pub mismatched_answers: usize,
    /// The first such answer, described.
    pub first_mismatch: Option<String>,
    /// Questions skipped for an empty question or context (`skip_bad_rows`).
    pub skipped: usize,
}

// The official nested format: data[].paragraphs[].qas[].
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
    id: Option<serde_json::Value>,
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

// The Hugging Face datasets format (JSON, JSON Lines, Parquet): one record per question.
#[derive(Deserialize)]
struct FlatRecord {
    id: Option<serde_json::Value>,
    #[serde(default)]
    title: Option<String>,
    context: String,
    question: String,
    #[serde(default)]
    answers: Option<FlatAnswers>,
}

#[derive(Deserialize)]
struct FlatAnswers {
    text: Vec<String>,
    answer_start: Vec<usize>,
}

/// Builds examples, checking ids, answers and empty texts as it goes.
struct Collector<'a> {
    path: &'a Path,
    options: QaReadOptions,
    seen: std::collections::HashSet<String>,
    examples: Vec<QaExample>,
    report: QaReadReport,
}

impl Collector<'_> {
    fn push(
        &mut self,
        at: &str,
        id: Option<serde_json::Value>,
        title: &str,
        question: String,
        context: &str,
        answers: Vec<(String, usize)>,
    ) -> Result<()> {
        let path = self.path.display();
        let id = match id {
            Some(serde_json::Value::String(s)) => s,
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => bail!("{path}: {at}: the question has no id: {question:?}"),
        };
        if !self.seen.insert(id.clone()) {
            bail!("{path}: {at}: duplicate question id {id}");
        }
        for (what, text) in [("question", question.as_str()), ("context", context)] {
            if text.trim().is_empty() {
                if self.options.skip_bad_rows {
                    self.report.skipped += 1;
                    return Ok(());
                }
                bail!("{path}: question {id} has an empty {what}");
            }
        }
        for (text, start) in &answers {
            let found: String = context
                .chars()
                .skip(*start)
                .take(text.chars().count())
                .collect();
            if &found != text {
                let what = format!(
                    "question {id}: answer {text:?} does not start at character {start} of its context (found {found:?})"
                );
                if self.options.strict_answers {
                    bail!("{path}: {what} (qa.strict_answers is set)");
                }
                self.report.mismatched_answers += 1;
                self.report.first_mismatch.get_or_insert(what);
            }
        }
        self.examples.push(QaExample {
            id,
            title: title.to_string(),
            question,
            context: context.to_string(),
            answers,
        });
        Ok(())
    }

    fn nested(&mut self, articles: Vec<SquadArticle>) -> Result<()> {
        for (a, article) in articles.into_iter().enumerate() {
            for (p, para) in article.paragraphs.into_iter().enumerate() {
                for (q, qa) in para.qas.into_iter().enumerate() {
                    let answers = if qa.is_impossible {
                        Vec::new()
                    } else {
                        qa.answers
                            .into_iter()
                            .map(|x| (x.text, x.answer_start))
                            .collect()
                    };
                    let at = format!("data[{a}].paragraphs[{p}].qas[{q}]");
                    self.push(
                        &at,
                        qa.id,
                        &article.title,
                        qa.question,
                        &para.context,
                        answers,
                    )?;
                }
            }
        }
        Ok(())
    }

    fn flat(&mut self, at: &str, value: serde_json::Value) -> Result<()> {
        let r: FlatRecord = serde_json::from_value(value)
            .map_err(|e| anyhow!("{}: {at}: not a question record: {e}", self.path.display()))?;
        let answers = match r.answers {
            Some(a) if a.text.len() != a.answer_start.len() => bail!(
                "{}: {at}: answers has {} texts but {} starts",
                self.path.display(),
                a.text.len(),
                a.answer_start.len()
            ),
            Some(a) => a.text.into_iter().zip(a.answer_start).collect(),
            None => Vec::new(),
        };
        let title = r.title.unwrap_or_default();
        self.push(at, r.id, &title, r.question, &r.context, answers)
    }
}

/// Reads questions: the official SQuAD JSON (v1.1, v2.0's `is_impossible`), or the Hugging
/// Face flat records (`id, title, context, question, answers{text, answer_start}`) as a JSON
/// array, a JSON object with a `data` array, JSON Lines (`.jsonl`) or Parquet (`.parquet`, as
/// the Hub's rajpurkar/squad files). A question without an id, or a duplicate id, is an error.
pub fn load_squad(path: &Path, options: QaReadOptions) -> Result<(Vec<QaExample>, QaReadReport)> {
    if !path.is_file() {
        bail!("data file {} does not exist", path.display());
    }
    let mut c = Collector {
        path,
        options,
        seen: std::collections::HashSet::new(),
        examples: Vec::new(),
        report: QaReadReport::default(),
    };
    let name = path.to_string_lossy().to_ascii_lowercase();
    if name.ends_with(".parquet") {
        crate::runtime::panic_guard::catch(path, "the parquet reader", || {
            read_parquet_records(path, &mut c)
        })?;
    } else if name.ends_with(".jsonl") {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let at = format!("line {}", i + 1);
            let value = serde_json::from_str(line)
                .map_err(|e| anyhow!("{}: {at}: invalid JSON: {e}", path.display()))?;
            c.flat(&at, value)?;
        }
    } else {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| anyhow!("{}: invalid JSON: {e}", path.display()))?;
        let records = match value {
            serde_json::Value::Object(mut o) => match o.remove("data") {
                Some(serde_json::Value::Array(a)) => a,
                _ => bail!("{}: not SQuAD JSON: no \"data\" array", path.display()),
            },
            serde_json::Value::Array(a) => a,
            _ => bail!(
                "{}: not SQuAD JSON: expected an object or an array",
                path.display()
            ),
        };
        let nested = records
            .first()
            .is_some_and(|r| r.get("paragraphs").is_some());
        if nested {
            let articles: Vec<SquadArticle> =
                serde_json::from_value(serde_json::Value::Array(records))
                    .map_err(|e| anyhow!("{}: not SQuAD JSON: {e}", path.display()))?;
            c.nested(articles)?;
        } else {
            for (i, r) in records.into_iter().enumerate() {
                c.flat(&format!("record {}", i + 1), r)?;
            }
        }
    }
    if c.examples.is_empty() {
        bail!("{} holds no questions", path.display());
    }
    Ok((c.examples, c.report))
}

/// Reads the official SQuAD JSON strictly (every check an error).
pub fn load_squad_json(path: &Path) -> Result<Vec<QaExample>> {
    Ok(load_squad(
        path,
        QaReadOptions {
            strict_answers: true,
            skip_bad_rows: false,
        },
    )?
    .0)
}

fn read_parquet_records(path: &Path, c: &mut Collector) -> Result<()> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let reader = SerializedFileReader::new(file)
        .with_context(|| format!("{} is not a valid Parquet file", path.display()))?;
    let rows = reader
        .get_row_iter(None)
        .with_context(|| format!("{}: cannot read rows", path.display()))?;
    for (i, row) in rows.enumerate() {
        let at = format!("row {}", i + 1);
        let row = row.with_context(|| format!("{}: {at}: cannot decode", path.display()))?;
        c.flat(&at, row.to_json_value())?;
    }
    Ok(())
}

/// Splits examples by article (title) into (train, held out), holding out about `fraction`
/// of the articles, seeded: no context is seen on both sides.
pub fn split_by_article(
    examples: Vec<QaExample>,
    fraction: f64,
    seed: u64,
) -> (Vec<QaExample>, Vec<QaExample>) {
    let mut titles: Vec<&str> = Vec::new();
    for e in &examples {
        if !titles.contains(&e.title.as_str()) {
            titles.push(&e.title);
        }
    }
    let (_, held) = super::batching::holdout_split(titles.len(), fraction, seed);
    let held: std::collections::HashSet<String> =
        held.iter().map(|&i| titles[i].to_string()).collect();
    examples.into_iter().partition(|e| !held.contains(&e.title))
}

/// One window of one example.
#[derive(Debug, Clone, PartialEq)]
pub struct QaFeature {
    /// Index of the example in the input slice.
    pub example: usize,
    /// Character span in the context of each context token; `None` for question and special tokens.
    pub offsets: Vec<Option<(usize, usize)>>,
    /// The model input: token ids, token types, and the answer's (start, end) token span.
    pub input: Feature,
}

impl QaFeature {
    /// The labelled answer span, (start, end) token positions; (0, 0) (CLS) when the window
    /// does not hold the answer.
    pub fn span(&self) -> (i64, i64) {
        match self.input.target {
            Target::Span(s, e) => (s, e),
            _ => (0, 0),
        }
    }
}

/// A tokenizer set up as run_qa.py sets it: context-only truncation with overflowing windows.
pub fn qa_tokenizer(path: &Path, max_seq_len: usize, doc_stride: usize) -> Result<Tokenizer> {
    load_tokenizer(path, max_seq_len, Truncation::OnlySecond, doc_stride)
}

/// Builds every window of every example, with run_qa.py's labels.
pub fn qa_features(tok: &Tokenizer, examples: &[QaExample]) -> Result<Vec<QaFeature>> {
    let encodings = encode_pairs(tok, examples)?;
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
            let (start, end) = label(&offsets, ex);
            out.push(QaFeature {
                example: index,
                input: Feature {
                    input_ids: w.get_ids().iter().map(|&i| i as i64).collect(),
                    type_ids: w.get_type_ids().iter().map(|&i| i as i64).collect(),
                    target: Target::Span(start, end),
                },
                offsets,
            });
        }
    }
    Ok(out)
}

/// Every example's (question, context) pair encoded as `tok.encode_char_offsets((question,
/// context), true)` encodes it (truncation with its overflowing windows included), but each
/// distinct context tokenized once: SQuAD asks about five questions of every paragraph, and the
/// context is most of each pair's tokens. A pair's encoding is its two sequences encoded
/// alone, then truncated and given special tokens by `post_process`, which is what this
/// repeats with the context's encoding shared.
pub fn encode_pairs(tok: &Tokenizer, examples: &[QaExample]) -> Result<Vec<Encoding>> {
    use rayon::prelude::*;
    let failed = |e| anyhow!("tokenization failed: {e}");
    // One sequence, as the pair encoding encodes each: no truncation, padding or special tokens.
    let mut alone = tok.clone();
    alone
        .with_truncation(None)
        .map_err(failed)?
        .with_padding(None)
        .with_post_processor(None::<tokenizers::PostProcessorWrapper>);
    let mut context_index = std::collections::HashMap::new();
    let mut contexts = Vec::new();
    let which: Vec<usize> = examples
        .iter()
        .map(|e| {
            *context_index.entry(e.context.as_str()).or_insert_with(|| {
                contexts.push(e.context.as_str());
                contexts.len() - 1
            })
        })
        .collect();
    let questions: Vec<&str> = examples.iter().map(|e| e.question.trim_start()).collect();
    let questions = alone
        .encode_batch_char_offsets(questions, false)
        .map_err(failed)?;
    let mut contexts = alone
        .encode_batch_char_offsets(contexts, false)
        .map_err(failed)?;
    // The second sequence of a pair has token type 1.
    for c in &mut contexts {
        c.set_type_ids(vec![1; c.len()]);
    }
    questions
        .into_par_iter()
        .zip(which.into_par_iter())
        .map(|(q, c)| {
            tok.post_process(q, Some(contexts[c].clone()), true)
                .map_err(failed)
        })
        .collect()
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
