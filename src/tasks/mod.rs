//! Tasks: what differs between fine-tuning a classifier and a question answerer, behind one
//! interface, so that the training loop, evaluation, checkpoints and MPI code never ask which
//! task they run.
//!
//! A task turns the run's files into examples ([`read`], before the model is built: the data
//! can size the head), adapts the model's config.json to them, tokenizes them into
//! [`Feature`]s whose targets make the batch labels, and turns the evaluation outputs into
//! metrics and prediction files ([`EvalSet`]). The head and its loss live with the model
//! (`crate::models`), as in transformers.
//!
//! Adding a task: a module here implementing [`TaskData`] and [`EvalSet`], a `TaskName`
//! variant with its head (config.rs), and one line in [`read`].

pub mod language_modeling;
pub mod qa_answers;
pub mod question_answering;
pub mod sequence_classification;
pub mod token_classification;

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::config::{Config, TaskName};
use crate::data::batching::Feature;
use crate::data::masking::Masking;
use crate::models::{HfConfig, ModelOutput};

/// The run's data files, resolved to local paths.
#[derive(Debug, Clone, PartialEq)]
pub struct DataFiles {
    pub train: PathBuf,
    pub eval: Option<PathBuf>,
    /// Fraction of the training file held out for evaluation when there is no `eval` file.
    pub eval_split: f64,
}

/// How texts become token ids.
#[derive(Debug, Clone, Copy)]
pub struct TokenizeOptions<'a> {
    pub tokenizer_json: &'a Path,
    pub pad_id: i64,
    /// Tokens per feature, special tokens included.
    pub max_seq_len: usize,
    /// The model's end-of-sequence token, which ends an instruction's completion.
    pub eos_id: Option<i64>,
}

/// Tokenization spread over the processes of a run: `tokenize` is called on a share of the
/// `n` examples and every process gets all features back, in example order. Tasks use it
/// without knowing how the work is spread (the training code implements it over MPI).
pub trait Shards {
    fn tokenize_shared(
        &self,
        what: &str,
        n: usize,
        tokenize: &dyn Fn(Range<usize>) -> Result<Vec<Feature>>,
    ) -> Result<Vec<Feature>>;
}

/// A task's examples, read from the run's files.
pub trait TaskData {
    /// Changes the model's config.json for these data before the model is built (class
    /// labels, problem type).
    fn adapt(&self, config: &mut HfConfig) -> Result<()>;
    /// Whether there are evaluation examples.
    fn has_eval(&self) -> bool;
    /// Tokenizes the training examples (none with `eval_only`) and the evaluation examples.
    fn tokenize(
        self: Box<Self>,
        options: &TokenizeOptions,
        shards: &dyn Shards,
        eval_only: bool,
    ) -> Result<Tokenized>;
}

/// A task's features, ready for batching.
pub struct Tokenized {
    pub train: Vec<Feature>,
    pub eval: Option<Box<dyn EvalSet>>,
    /// Masked LM: how training features are masked as they are batched (fresh masks every
    /// step, as transformers' collator draws them).
    pub masking: Option<Masking>,
}

/// Evaluation data and how the task scores it. Evaluation runs the model over
/// [`EvalSet::features`] in shards, keeps [`EvalSet::batch_outputs`] of each batch, gathers
/// them in feature order and hands them to [`EvalSet::metrics`].
pub trait EvalSet {
    /// The model inputs, one per example (or per window of one).
    fn features(&self) -> Vec<&Feature>;
    /// What evaluation keeps of one batch's output, row after row, as f32.
    fn batch_outputs(&self, output: &ModelOutput, batch: &[&Feature]) -> Result<Vec<f32>>;
    /// The task's metrics (keys without the `eval_` prefix) from every feature's outputs;
    /// writes the task's prediction files into `predictions_dir` when given.
    fn metrics(
        &self,
        outputs: &[f32],
        predictions_dir: Option<&Path>,
    ) -> Result<BTreeMap<String, f64>>;
}

/// Reads the training and evaluation examples of `config.model.task`; with `report`, warns
/// about what reading found (skipped rows, mismatched answers).
pub fn read(config: &Config, files: &DataFiles, report: bool) -> Result<Box<dyn TaskData>> {
    Ok(match config.model.task {
        TaskName::SeqCls => Box::new(sequence_classification::SeqClsData::read(
            config, files, report,
        )?),
        TaskName::TokenCls => Box::new(token_classification::TokenClsData::read(
            config, files, report,
        )?),
        TaskName::Qa => Box::new(question_answering::QaData::read(config, files, report)?),
        TaskName::Mlm | TaskName::CausalLm => {
            Box::new(language_modeling::LmData::read(config, files, report)?)
        }
    })
}
