//! `sprtrain predict`: run a model over a JSON Lines file and write every example's logits, so a
//! model can be checked black-box against transformers.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tch::{Kind, Tensor};

use crate::config::TaskName;
use crate::data::batching::{collate, Feature, Target};
use crate::data::tokenizer::{TextTokenizer, Truncation};
use crate::io::atomic_file::write_atomic_with;
use crate::io::hf_files::TOKENIZER_FILE;
use crate::io::hub;
use crate::models::{self, ProblemType};

/// Longest answer, in tokens, considered for a question (transformers' `max_answer_length`).
const MAX_ANSWER_TOKENS: usize = 30;

/// `sprtrain predict` options.
#[derive(Debug, Clone, clap::Args)]
pub struct PredictArgs {
    /// Model directory or Hugging Face Hub id.
    #[arg(long)]
    pub model: String,
    /// Hub revision (branch, tag or commit).
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// The head to run: seq-cls (fields `text`, optional `text_pair`), token-cls (`text`, split
    /// into words at whitespace, or a `tokens` list of words) or qa (`question`, `context`).
    #[arg(long, value_enum)]
    pub task: TaskName,
    /// Input JSON Lines file.
    #[arg(long)]
    pub input: PathBuf,
    /// Output JSON Lines file (written whole or not at all).
    #[arg(long)]
    pub output: PathBuf,
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Tokens per example including special tokens [default: the model's maximum].
    #[arg(long)]
    pub max_seq_len: Option<usize>,
    /// Labels of a new classification head [default: config.json's].
    #[arg(long)]
    pub num_labels: Option<usize>,
    /// Seed of a newly initialised head.
    #[arg(long, default_value_t = 42)]
    pub seed: i64,
}

/// One input line.
struct Example {
    id: Option<Value>,
    first: String,
    second: Option<String>,
    /// Token classification: the words with their character spans in `first`.
    words: Vec<Word>,
}

impl Example {
    /// Bytes of text: how long its tokens will be, roughly.
    fn text_len(&self) -> usize {
        self.first.len() + self.second.as_ref().map_or(0, String::len)
    }
}

/// A word of a token-classification input and where it sits in the text (characters).
struct Word {
    text: String,
    start: usize,
    end: usize,
}

/// The words of `text` between whitespace, with their character spans.
fn split_words(text: &str) -> Vec<Word> {
    let mut words = Vec::new();
    let mut current: Option<Word> = None;
    for (i, c) in text.chars().enumerate() {
        match (&mut current, c.is_whitespace()) {
            (Some(w), false) => {
                w.text.push(c);
                w.end = i + 1;
            }
            (None, false) => {
                current = Some(Word {
                    text: c.to_string(),
                    start: i,
                    end: i + 1,
                })
            }
            (Some(_), true) => words.extend(current.take()),
            (None, true) => {}
        }
    }
    words.extend(current);
    words
}

fn field(obj: &serde_json::Map<String, Value>, key: &str, at: &str) -> Result<Option<String>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => bail!("{at}: field {key:?} must be a string, got {other}"),
    }
}

fn read_examples(path: &Path, task: TaskName) -> Result<Vec<Example>> {
    let file = std::fs::File::open(path)
        .with_context(|| format!("cannot open input {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let at = format!("{}:{}", path.display(), i + 1);
        let line = line.with_context(|| format!("{at}: cannot read line"))?;
        if line.trim().is_empty() {
            continue;
        }
        let value: Value =
            serde_json::from_str(&line).with_context(|| format!("{at}: invalid JSON"))?;
        let obj = value
            .as_object()
            .with_context(|| format!("{at}: expected a JSON object"))?;
        let (first_key, second_key, second_required) = match task {
            TaskName::Qa => ("question", "context", true),
            _ => ("text", "text_pair", false),
        };
        let given_words = match obj.get("tokens") {
            Some(Value::Array(list)) if task == TaskName::TokenCls => Some(
                list.iter()
                    .map(|w| w.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .with_context(|| format!("{at}: field \"tokens\" must hold strings"))?,
            ),
            _ => None,
        };
        let first = match (field(obj, first_key, &at)?, &given_words) {
            (Some(text), _) => text,
            // Given words stand for the text they make joined by spaces.
            (None, Some(words)) => words.join(" "),
            (None, None) if task == TaskName::TokenCls => {
                bail!("{at}: missing field \"text\" (or a \"tokens\" list)")
            }
            (None, None) => bail!("{at}: missing field {first_key:?}"),
        };
        let words = match (task, given_words) {
            (TaskName::TokenCls, Some(given)) => {
                let mut start = 0;
                given
                    .into_iter()
                    .map(|text| {
                        let end = start + text.chars().count();
                        let w = Word { text, start, end };
                        start = end + 1;
                        w
                    })
                    .collect()
            }
            (TaskName::TokenCls, None) => split_words(&first),
            _ => Vec::new(),
        };
        if task == TaskName::TokenCls && words.is_empty() {
            bail!("{at}: no words to tag");
        }
        let second = field(obj, second_key, &at)?;
        if second_required && second.is_none() {
            bail!("{at}: missing field {second_key:?}");
        }
        out.push(Example {
            id: obj.get("id").cloned(),
            first,
            second,
            words,
        });
    }
    if out.is_empty() {
        bail!("input {} holds no examples", path.display());
    }
    Ok(out)
}

fn to_vec(t: &Tensor) -> Result<Vec<f32>> {
    Ok(Vec::<f32>::try_from(
        t.to_kind(Kind::Float).contiguous().view([-1]),
    )?)
}

fn classification_record(logits: Vec<f32>, config: &models::HfConfig) -> Value {
    let mut rec = json!({ "logits": logits });
    match config.resolved_problem_type() {
        ProblemType::SingleLabel => {
            let best = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i)
                .unwrap_or(0);
            rec["label_id"] = json!(best);
            rec["label"] = json!(config.id2label.get(&best));
        }
        ProblemType::MultiLabel => {
            // sigmoid(x) > 0.5 exactly when x > 0.
            let names: Vec<&String> = logits
                .iter()
                .enumerate()
                .filter(|(_, x)| **x > 0.0)
                .filter_map(|(i, _)| config.id2label.get(&i))
                .collect();
            rec["labels"] = json!(names);
        }
        ProblemType::Regression => {}
    }
    rec
}

/// Best span inside the context (second sequence), scored start + end logit.
fn best_span(
    start: &[f32],
    end: &[f32],
    enc: &tokenizers::Encoding,
) -> Option<(usize, usize, f32)> {
    let in_context: Vec<bool> = enc
        .get_sequence_ids()
        .iter()
        .map(|s| *s == Some(1))
        .collect();
    let mut best: Option<(usize, usize, f32)> = None;
    for s in (0..start.len()).filter(|&s| in_context[s]) {
        for e in (s..start.len().min(s + MAX_ANSWER_TOKENS)).filter(|&e| in_context[e]) {
            let score = start[s] + end[e];
            if best.is_none_or(|(_, _, b)| score > b) {
                best = Some((s, e, score));
            }
        }
    }
    best
}

fn qa_record(start: Vec<f32>, end: Vec<f32>, enc: &tokenizers::Encoding, context: &str) -> Value {
    let mut rec = json!({});
    if let Some((s, e, score)) = best_span(&start, &end, enc) {
        let (from, to) = (enc.get_offsets()[s].0, enc.get_offsets()[e].1);
        let answer: String = context
            .chars()
            .skip(from)
            .take(to.saturating_sub(from))
            .collect();
        rec["answer"] = json!(answer);
        rec["answer_start"] = json!(from);
        rec["score"] = json!(score);
    }
    rec["start_logits"] = json!(start);
    rec["end_logits"] = json!(end);
    rec
}

/// Token classification: each word's tag (that of its first token; null for words cut off by
/// truncation) and the entities they make, with character spans and the mean probability of
/// their words' tags.
fn tagging_record(
    probs: &Tensor,
    enc: &tokenizers::Encoding,
    ex: &Example,
    config: &models::HfConfig,
) -> Result<Value> {
    let (best_p, best) = probs.max_dim(-1, false);
    let best = Vec::<i64>::try_from(best)?;
    let best_p = Vec::<f32>::try_from(best_p)?;
    let mut tags: Vec<Option<(String, f32)>> = vec![None; ex.words.len()];
    let mut previous = None;
    for (t, w) in enc.get_word_ids().iter().enumerate() {
        if let Some(w) = *w {
            if previous != Some(w) {
                let name = config
                    .id2label
                    .get(&(best[t] as usize))
                    .cloned()
                    .unwrap_or_else(|| format!("LABEL_{}", best[t]));
                tags[w as usize] = Some((name, best_p[t]));
            }
        }
        previous = *w;
    }
    let names: Vec<&str> = tags
        .iter()
        .map(|t| t.as_ref().map_or("O", |(n, _)| n.as_str()))
        .collect();
    let entities: Vec<Value> = crate::metrics::seqeval::entities(&names)
        .into_iter()
        .map(|(kind, first, last)| {
            let (start, end) = (ex.words[first].start, ex.words[last].end);
            let score = tags[first..=last]
                .iter()
                .map(|t| t.as_ref().map_or(0.0, |(_, p)| *p))
                .sum::<f32>()
                / (last + 1 - first) as f32;
            json!({
                "type": kind,
                "text": ex.first.chars().skip(start).take(end - start).collect::<String>(),
                "start": start,
                "end": end,
                "score": score,
            })
        })
        .collect();
    Ok(json!({
        "words": ex.words.iter().map(|w| w.text.as_str()).collect::<Vec<_>>(),
        "tags": tags.iter().map(|t| t.as_ref().map(|(n, _)| n)).collect::<Vec<_>>(),
        "entities": entities,
    }))
}

/// Runs `args`; returns how many examples it predicted and the seconds the predictions took
/// (tokenization, forward passes and writing, not loading).
pub fn run(args: &PredictArgs) -> Result<(usize, f64)> {
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    let task = args.task;
    match task {
        TaskName::Mlm => bail!("--task mlm: predict runs seq-cls, token-cls or qa heads"),
        TaskName::CausalLm => {
            bail!("--task causal-lm: use `sprtrain generate` for language models")
        }
        _ => {}
    }
    let examples = read_examples(&args.input, task)?;
    crate::config::Fp32Gemm::Auto.select()?;
    let dir = hub::resolve_model_dir(&args.model, &args.revision)?;
    let pretrained = models::from_pretrained(
        &dir,
        task.head(),
        |c| args.num_labels.map_or(Ok(()), |n| c.set_num_labels(n)),
        args.seed,
    )?;
    let model = &pretrained.model;
    for line in pretrained.report.summary_lines(&model.class_name(), &dir) {
        tracing::warn!("{line}");
    }
    let usable = model.config.max_input_tokens();
    let max_len = args.max_seq_len.unwrap_or(usable);
    if max_len > usable {
        bail!(
            "--max-seq-len {max_len} exceeds the {usable} tokens the model's {} position embeddings allow",
            model.config.max_position_embeddings
        );
    }
    let truncation = match task {
        TaskName::Qa => Truncation::OnlySecond,
        _ => Truncation::LongestFirst,
    };
    let tokenizer = TextTokenizer::from_file(
        &dir.join(TOKENIZER_FILE),
        model.config.pad_token_id,
        max_len,
        truncation,
    )?;

    let started = std::time::Instant::now();
    write_atomic_with(&args.output, |tmp| {
        let file = std::fs::File::create(tmp)
            .with_context(|| format!("cannot create {}", tmp.display()))?;
        let mut out = std::io::BufWriter::new(file);
        // Texts of like length pad little: within each window of 64 batches, examples are
        // batched longest first and written back in input order.
        for window in examples.chunks(args.batch_size * 64) {
            let mut order: Vec<usize> = (0..window.len()).collect();
            order.sort_by_key(|&i| std::cmp::Reverse(window[i].text_len()));
            let mut records: Vec<Option<Value>> = vec![None; window.len()];
            for batch in order.chunks(args.batch_size) {
                let chunk: Vec<&Example> = batch.iter().map(|&i| &window[i]).collect();
                for (&i, rec) in batch
                    .iter()
                    .zip(predict_batch(model, &tokenizer, task, &chunk)?)
                {
                    records[i] = Some(rec);
                }
            }
            for rec in records.into_iter().flatten() {
                writeln!(out, "{rec}")
                    .with_context(|| format!("cannot write {}", tmp.display()))?;
            }
        }
        out.flush()
            .with_context(|| format!("cannot write {}", tmp.display()))
    })?;
    Ok((examples.len(), started.elapsed().as_secs_f64()))
}

/// The output records of one batch of examples.
fn predict_batch(
    model: &models::TaskModel,
    tokenizer: &TextTokenizer,
    task: TaskName,
    chunk: &[&Example],
) -> Result<Vec<Value>> {
    let texts: Vec<(String, Option<String>)> = chunk
        .iter()
        .map(|e| (e.first.clone(), e.second.clone()))
        .collect();
    let encodings = if task == TaskName::TokenCls {
        let words: Vec<Vec<String>> = chunk
            .iter()
            .map(|e| e.words.iter().map(|w| w.text.clone()).collect())
            .collect();
        tokenizer.encode_words_batch(&words)?
    } else {
        tokenizer.encode_batch(&texts)?
    };
    let features: Vec<Feature> = encodings
        .iter()
        .map(|e| Feature::from_encoding(e, Target::Class(0)))
        .collect();
    let (inputs, _) = collate(
        &features.iter().collect::<Vec<_>>(),
        tokenizer.pad_id(),
        None,
    );
    let output = tch::no_grad(|| model.forward(&inputs, false));
    let mut records = Vec::with_capacity(chunk.len());
    for (row, (ex, enc)) in chunk.iter().zip(&encodings).enumerate() {
        let real = enc.len() as i64;
        let mut rec = match task {
            TaskName::Qa => {
                let (s, e) = output.span_logits();
                let start = to_vec(&s.get(row as i64).narrow(0, 0, real))?;
                let end = to_vec(&e.get(row as i64).narrow(0, 0, real))?;
                qa_record(start, end, enc, ex.second.as_deref().unwrap_or_default())
            }
            TaskName::TokenCls => {
                let probs = output.logits.get(row as i64).softmax(-1, Kind::Float); // (T, L)
                tagging_record(&probs, enc, ex, &model.config)?
            }
            _ => classification_record(to_vec(&output.logits.get(row as i64))?, &model.config),
        };
        if let Some(id) = &ex.id {
            rec["id"] = id.clone();
        }
        records.push(rec);
    }
    Ok(records)
}
