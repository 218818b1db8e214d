//! Sequence classification and regression, as transformers' run_glue.py: one text or a pair
//! per example, a class label (id or name) or a number; accuracy, F1 and Matthews correlation,
//! or Pearson and Spearman correlations and MSE.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Result};
use tch::Kind;

use super::{DataFiles, EvalSet, Shards, TaskData, TokenizeOptions, Tokenized};
use crate::config::{Config, DataConfig, ModelConfig};
use crate::data::batching::{split_off_held_out, Feature, Target};
use crate::data::classification::{self, Example, LabelKind, ReadOptions};
use crate::data::tokenizer::{TextTokenizer, Truncation};
use crate::metrics;
use crate::models::{HfConfig, ModelOutput, ProblemType};

/// The problem type a run's classification head trains for: the one place it is decided.
fn problem_type(model: &ModelConfig) -> Result<ProblemType> {
    match model.problem_type.resolve(model.num_labels) {
        ProblemType::MultiLabel => {
            bail!("model.problem_type: multi-label training data is not supported yet")
        }
        p => Ok(p),
    }
}

/// The classification reader's options from the `[data]` settings.
pub fn read_options(data: &DataConfig) -> ReadOptions {
    ReadOptions {
        format: data.format,
        has_header: data.has_header,
        text_column: data.text_column.clone(),
        text_pair_column: data.text_pair_column.clone(),
        label_column: data.label_column.clone(),
        label_names: data.label_names.clone(),
        skip_bad_rows: data.skip_bad_rows,
    }
}

/// Classification examples; the training file's labels fix the head.
pub struct SeqClsData {
    train: Vec<Example>,
    eval: Vec<Example>,
    labels: LabelKind,
}

impl SeqClsData {
    pub fn read(config: &Config, files: &DataFiles, _report: bool) -> Result<Self> {
        let regression = problem_type(&config.model)? == ProblemType::Regression;
        let options = read_options(&config.data);
        let (mut train, labels) =
            classification::load_examples(&files.train, &options, regression, None)?;
        let eval = if let Some(path) = &files.eval {
            classification::load_examples(path, &options, regression, Some(&labels))?.0
        } else if files.eval_split > 0.0 {
            split_off_held_out(&mut train, files.eval_split, config.runtime.seed)
        } else {
            Vec::new()
        };
        let num_labels = config.model.num_labels;
        if let LabelKind::Classes(names) = &labels {
            if num_labels > 0 && num_labels != names.len() {
                bail!(
                    "model.num_labels is {num_labels} but the training data has {} labels ({})",
                    names.len(),
                    names.join(", ")
                );
            }
        }
        Ok(SeqClsData {
            train,
            eval,
            labels,
        })
    }
}

impl TaskData for SeqClsData {
    fn adapt(&self, c: &mut HfConfig) -> Result<()> {
        c.id2label = classification::id2label(&self.labels);
        c.problem_type = Some(match self.labels {
            LabelKind::Regression => ProblemType::Regression,
            LabelKind::Classes(_) => ProblemType::SingleLabel,
        });
        Ok(())
    }

    fn has_eval(&self) -> bool {
        !self.eval.is_empty()
    }

    fn tokenize(
        self: Box<Self>,
        options: &TokenizeOptions,
        shards: &dyn Shards,
        eval_only: bool,
    ) -> Result<Tokenized> {
        let tok = TextTokenizer::from_file(
            options.tokenizer_json,
            options.pad_id,
            options.max_seq_len,
            Truncation::LongestFirst,
        )?;
        let labels = &self.labels;
        let features = |what: &str, examples: &[Example]| {
            shards.tokenize_shared(what, examples.len(), &|share| {
                classification::tokenize(&tok, &examples[share], labels)
            })
        };
        let train = if eval_only {
            Vec::new()
        } else {
            features("training", &self.train)?
        };
        let eval = features("evaluation", &self.eval)?;
        let eval: Option<Box<dyn EvalSet>> = (!eval.is_empty()).then(|| {
            Box::new(SeqClsEval {
                features: eval,
                labels: self.labels.clone(),
            }) as Box<dyn EvalSet>
        });
        Ok(Tokenized {
            train,
            eval,
            masking: None,
        })
    }
}

/// Held-out examples, scored by predicted class (or value).
struct SeqClsEval {
    features: Vec<Feature>,
    labels: LabelKind,
}

impl EvalSet for SeqClsEval {
    fn features(&self) -> Vec<&Feature> {
        self.features.iter().collect()
    }

    /// The predicted value (regression) or class id (exact in f32) of each row.
    fn batch_outputs(&self, output: &ModelOutput, _batch: &[&Feature]) -> Result<Vec<f32>> {
        let predicted = match self.labels {
            LabelKind::Regression => output.logits.view([-1]).to_kind(Kind::Float),
            LabelKind::Classes(_) => output.logits.argmax(-1, false).to_kind(Kind::Float),
        };
        Ok(Vec::<f32>::try_from(predicted)?)
    }

    fn metrics(
        &self,
        outputs: &[f32],
        _predictions_dir: Option<&Path>,
    ) -> Result<BTreeMap<String, f64>> {
        let gold = self.features.iter().map(|f| match &f.target {
            Target::Class(c) => *c as f64,
            Target::Value(v) => *v,
            _ => f64::NAN,
        });
        Ok(match &self.labels {
            LabelKind::Regression => {
                let pred: Vec<f64> = outputs.iter().map(|&x| x as f64).collect();
                metrics::regression_report(&pred, &gold.collect::<Vec<_>>())
            }
            LabelKind::Classes(names) => {
                let pred: Vec<usize> = outputs.iter().map(|&p| p as usize).collect();
                let gold: Vec<usize> = gold.map(|g| g as usize).collect();
                metrics::classification_report(&pred, &gold, names.len())
            }
        })
    }
}
