//! Token classification (named-entity recognition), as transformers' run_ner.py: sentences
//! split into words with one tag each; a word's first sub-token carries its label and the
//! others -100 (or, with `data.label_all_tokens`, the word's label with B- turned into I-);
//! entity-level precision, recall and F1 as seqeval computes them, and token accuracy, over
//! the labelled (first) sub-tokens.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use tch::Kind;

use super::{DataFiles, EvalSet, Shards, TaskData, TokenizeOptions, Tokenized};
use crate::config::{Config, DataConfig};
use crate::data::batching::{split_off_held_out, Feature, Target};
use crate::data::conll::{label_list, read_tagged, tag_ids, TagReadOptions, TaggedSentence};
use crate::data::tokenizer::{TextTokenizer, Truncation};
use crate::metrics::seqeval;
use crate::models::{HfConfig, ModelOutput};

/// The tagged-file reader's options from the `[data]` settings.
pub fn read_options(data: &DataConfig) -> TagReadOptions {
    TagReadOptions {
        format: data.format,
        tokens_column: data.tokens_column.clone(),
        tags_column: data.tags_column.clone(),
        label_names: data.label_names.clone(),
        skip_bad_rows: data.skip_bad_rows,
    }
}

/// A sentence with its tags as label ids.
type Sentence = (TaggedSentence, Vec<usize>);

/// Tagged sentences; the training file's tags fix the head (or `data.label_names` does).
pub struct TokenClsData {
    train: Vec<Sentence>,
    eval: Vec<Sentence>,
    labels: Vec<String>,
    label_all_tokens: bool,
}

impl TokenClsData {
    pub fn read(config: &Config, files: &DataFiles, _report: bool) -> Result<Self> {
        let options = read_options(&config.data);
        let read = |path: &PathBuf, labels: &[String]| -> Result<Vec<Sentence>> {
            tag_ids(
                read_tagged(path, &options)?,
                labels,
                path,
                options.skip_bad_rows,
            )
        };
        let raw_train = read_tagged(&files.train, &options)?;
        let labels = label_list(&raw_train, &options.label_names);
        let mut train = tag_ids(raw_train, &labels, &files.train, options.skip_bad_rows)?;
        let eval = if let Some(path) = &files.eval {
            read(path, &labels)?
        } else if files.eval_split > 0.0 {
            split_off_held_out(&mut train, files.eval_split, config.runtime.seed)
        } else {
            Vec::new()
        };
        let num_labels = config.model.num_labels;
        if num_labels > 0 && num_labels != labels.len() {
            bail!(
                "model.num_labels is {num_labels} but the training data has {} tags ({})",
                labels.len(),
                labels.join(", ")
            );
        }
        Ok(TokenClsData {
            train,
            eval,
            labels,
            label_all_tokens: config.data.label_all_tokens,
        })
    }
}

/// run_ner.py's label alignment for one tokenized sentence: special tokens -100, a word's
/// first token its label, later tokens -100 or (`label_all_tokens`) the label with B- made I-
/// (`b_to_i`).
pub fn align_labels(
    word_ids: &[Option<u32>],
    word_labels: &[usize],
    b_to_i: &[usize],
    label_all_tokens: bool,
) -> Vec<i64> {
    let mut previous = None;
    word_ids
        .iter()
        .map(|&w| {
            let label = match w {
                None => -100,
                Some(w) if Some(w) != previous => word_labels[w as usize] as i64,
                Some(w) if label_all_tokens => b_to_i[word_labels[w as usize]] as i64,
                Some(_) => -100,
            };
            previous = w;
            label
        })
        .collect()
}

/// For each label id, the id of its I- form when it is a B- tag with an I- tag in the set,
/// else itself.
pub fn b_to_i_labels(labels: &[String]) -> Vec<usize> {
    labels
        .iter()
        .enumerate()
        .map(|(i, l)| {
            l.strip_prefix("B-")
                .and_then(|kind| labels.iter().position(|m| *m == format!("I-{kind}")))
                .unwrap_or(i)
        })
        .collect()
}

impl TaskData for TokenClsData {
    fn adapt(&self, c: &mut HfConfig) -> Result<()> {
        if c.arch.is_decoder() {
            bail!(
                "model.task \"token-cls\" needs an encoder ({}); the model is {}",
                crate::models::hf_config::ENCODER_MODEL_TYPES,
                c.arch.class_stem()
            );
        }
        c.id2label = self.labels.iter().cloned().enumerate().collect();
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
        let b_to_i = b_to_i_labels(&self.labels);
        let features = |what: &str, sentences: &[Sentence]| {
            shards.tokenize_shared(what, sentences.len(), &|share| {
                let part = &sentences[share];
                let words: Vec<Vec<String>> = part.iter().map(|(s, _)| s.words.clone()).collect();
                let encodings = tok.encode_words_batch(&words)?;
                Ok(encodings
                    .iter()
                    .zip(part)
                    .map(|(enc, (_, ids))| {
                        let labels =
                            align_labels(enc.get_word_ids(), ids, &b_to_i, self.label_all_tokens);
                        Feature::from_encoding(enc, Target::Tokens(labels))
                    })
                    .collect())
            })
        };
        let train = if eval_only {
            Vec::new()
        } else {
            features("training", &self.train)?
        };
        let eval = features("evaluation", &self.eval)?;
        let eval: Option<Box<dyn EvalSet>> = (!eval.is_empty()).then(|| {
            Box::new(TokenClsEval {
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

/// The labelled positions of a feature's tokens (a word's first token, unless all are).
fn labelled(feature: &Feature) -> Vec<(usize, i64)> {
    match &feature.target {
        Target::Tokens(labels) => labels
            .iter()
            .enumerate()
            .filter(|(_, &l)| l != -100)
            .map(|(i, &l)| (i, l))
            .collect(),
        _ => Vec::new(),
    }
}

/// Held-out sentences, scored by seqeval over the labelled tokens.
struct TokenClsEval {
    features: Vec<Feature>,
    labels: Vec<String>,
}

impl EvalSet for TokenClsEval {
    fn features(&self) -> Vec<&Feature> {
        self.features.iter().collect()
    }

    /// The predicted label id of each labelled token, row after row.
    fn batch_outputs(&self, output: &ModelOutput, batch: &[&Feature]) -> Result<Vec<f32>> {
        let predicted = output.logits.argmax(-1, false); // (B, T)
        let mut out = Vec::new();
        for (row, f) in batch.iter().enumerate() {
            let row_ids = Vec::<i64>::try_from(predicted.get(row as i64).to_kind(Kind::Int64))?;
            out.extend(labelled(f).iter().map(|&(i, _)| row_ids[i] as f32));
        }
        Ok(out)
    }

    fn metrics(
        &self,
        outputs: &[f32],
        _predictions_dir: Option<&Path>,
    ) -> Result<BTreeMap<String, f64>> {
        let name = |id: usize| self.labels.get(id).cloned().unwrap_or_else(|| "O".into());
        let (mut gold, mut predicted) = (Vec::new(), Vec::new());
        let mut at = 0;
        for f in &self.features {
            let positions = labelled(f);
            let Some(preds) = outputs.get(at..at + positions.len()) else {
                bail!("evaluation produced fewer outputs than labelled tokens");
            };
            at += positions.len();
            gold.push(positions.iter().map(|&(_, l)| name(l as usize)).collect());
            predicted.push(preds.iter().map(|&p| name(p as usize)).collect());
        }
        Ok(seqeval::scores::<String>(&gold, &predicted))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_follow_run_ner_alignment() {
        let labels: Vec<String> = ["B-PER", "I-PER", "O", "B-LOC"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let b_to_i = b_to_i_labels(&labels);
        // B-PER -> I-PER; B-LOC has no I-LOC in the set and stays.
        assert_eq!(b_to_i, [1, 1, 2, 3]);
        // [CLS] Jo ##hn went to Ro ##me [SEP]; words John(B-PER) went(O) to(O) Rome(B-LOC).
        let word_ids = [
            None,
            Some(0),
            Some(0),
            Some(1),
            Some(2),
            Some(3),
            Some(3),
            None,
        ];
        let word_labels = [0, 2, 2, 3];
        assert_eq!(
            align_labels(&word_ids, &word_labels, &b_to_i, false),
            [-100, 0, -100, 2, 2, 3, -100, -100]
        );
        assert_eq!(
            align_labels(&word_ids, &word_labels, &b_to_i, true),
            [-100, 0, 1, 2, 2, 3, 3, -100]
        );
    }
}
