//! Extractive question answering, as transformers' run_qa.py: SQuAD-style questions, contexts
//! cut into overlapping windows, answers extracted from start/end logits (`qa_answers`) and
//! scored with the official SQuAD v1.1 / v2.0 exact match and F1.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use tch::Kind;

use super::qa_answers::{self, PostProcess};
use super::{DataFiles, EvalSet, Shards, TaskData, TokenizeOptions, Tokenized};
use crate::config::Config;
use crate::data::batching::Feature;
use crate::data::squad::{self, QaExample, QaFeature, QaReadOptions};
use crate::models::{HfConfig, ModelOutput};

/// Questions with their contexts and answers; held-out questions are whole articles.
pub struct QaData {
    train: Vec<QaExample>,
    eval: Vec<QaExample>,
    doc_stride: usize,
    post: PostProcess,
}

/// Reads one question file, warning (with `report`) about what it found.
/// Context for a tokenizer's encoding error.
fn tokenizing(tokenizer_json: &Path) -> String {
    format!("tokenizing with {}", tokenizer_json.display())
}

fn read_file(path: &Path, options: QaReadOptions, report: bool) -> Result<Vec<QaExample>> {
    let (examples, found) = squad::load_squad(path, options)?;
    if report && found.mismatched_answers > 0 {
        tracing::warn!(
            "{}: {} answers do not start where answer_start says (first: {}); their labels follow answer_start, as run_qa.py's do (qa.strict_answers = true makes this an error)",
            path.display(),
            found.mismatched_answers,
            found.first_mismatch.unwrap_or_default()
        );
    }
    if report && found.skipped > 0 {
        tracing::warn!(
            "{}: skipped {} questions with an empty question or context (data.skip_bad_rows)",
            path.display(),
            found.skipped
        );
    }
    Ok(examples)
}

impl QaData {
    pub fn read(config: &Config, files: &DataFiles, report: bool) -> Result<Self> {
        let options = QaReadOptions {
            strict_answers: config.qa.strict_answers,
            skip_bad_rows: config.data.skip_bad_rows,
        };
        let train = read_file(&files.train, options, report)?;
        let (train, eval) = match &files.eval {
            Some(path) => (train, read_file(path, options, report)?),
            None if files.eval_split > 0.0 => {
                squad::split_by_article(train, files.eval_split, config.runtime.seed)
            }
            None => (train, Vec::new()),
        };
        Ok(QaData {
            train,
            eval,
            doc_stride: config.qa.doc_stride,
            post: PostProcess::from_config(&config.qa),
        })
    }
}

impl TaskData for QaData {
    /// The span head needs nothing from the data.
    fn adapt(&self, _config: &mut HfConfig) -> Result<()> {
        Ok(())
    }

    fn has_eval(&self) -> bool {
        !self.eval.is_empty()
    }

    /// Every process builds all windows (tokenizers runs them in parallel): cheap next to
    /// training, and it keeps each window's text offsets local.
    fn tokenize(
        self: Box<Self>,
        options: &TokenizeOptions,
        _shards: &dyn Shards,
        eval_only: bool,
    ) -> Result<Tokenized> {
        let max_len = options.max_seq_len;
        if self.doc_stride >= max_len {
            bail!(
                "qa.doc_stride: {} must be below model.max_seq_len ({max_len})",
                self.doc_stride
            );
        }
        let tok = squad::qa_tokenizer(options.tokenizer_json, max_len, self.doc_stride)?;
        let train = if eval_only {
            Vec::new()
        } else {
            squad::qa_features(&tok, &self.train)
                .with_context(|| tokenizing(options.tokenizer_json))?
                .into_iter()
                .map(|w| w.input)
                .collect()
        };
        let eval: Option<Box<dyn EvalSet>> = if self.eval.is_empty() {
            None
        } else {
            let windows = squad::qa_features(&tok, &self.eval)
                .with_context(|| tokenizing(options.tokenizer_json))?;
            Some(Box::new(QaEval {
                examples: self.eval,
                windows,
                post: self.post,
            }))
        };
        Ok(Tokenized {
            train,
            eval,
            masking: None,
        })
    }
}

/// Held-out questions and their windows, scored as the SQuAD scripts score answers.
struct QaEval {
    examples: Vec<QaExample>,
    windows: Vec<QaFeature>,
    post: PostProcess,
}

impl EvalSet for QaEval {
    fn features(&self) -> Vec<&Feature> {
        self.windows.iter().map(|w| &w.input).collect()
    }

    /// Each window's start then end logits over its real tokens.
    fn batch_outputs(&self, output: &ModelOutput, batch: &[&Feature]) -> Result<Vec<f32>> {
        let (start, end) = output.span_logits();
        let (start, end) = (start.to_kind(Kind::Float), end.to_kind(Kind::Float));
        let mut out = Vec::new();
        for (row, f) in batch.iter().enumerate() {
            let n = f.input_ids.len() as i64;
            for logits in [&start, &end] {
                out.extend(Vec::<f32>::try_from(
                    logits.get(row as i64).narrow(0, 0, n),
                )?);
            }
        }
        Ok(out)
    }

    /// Answers from the windows' logits (run_qa.py's post-processing), written as
    /// predictions.json and nbest_predictions.json, and their exact match and F1.
    fn metrics(
        &self,
        outputs: &[f32],
        predictions_dir: Option<&Path>,
    ) -> Result<BTreeMap<String, f64>> {
        let (mut starts, mut ends, mut at) = (Vec::new(), Vec::new(), 0);
        for w in &self.windows {
            let n = w.input.input_ids.len();
            if outputs.len() < at + 2 * n {
                bail!("evaluation outputs end before window {}", starts.len());
            }
            starts.push(outputs[at..at + n].to_vec());
            ends.push(outputs[at + n..at + 2 * n].to_vec());
            at += 2 * n;
        }
        let v2 = self.post.version_2_with_negative;
        let predictions =
            qa_answers::postprocess(&self.examples, &self.windows, &starts, &ends, &self.post)?;
        if let Some(dir) = predictions_dir {
            qa_answers::write_predictions(dir, &predictions, v2)?;
        }
        Ok(qa_answers::score(&self.examples, &predictions, v2))
    }
}
