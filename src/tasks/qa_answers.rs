//! From start/end logits to answers, as transformers' `postprocess_qa_predictions`
//! (examples/pytorch/question-answering/utils_qa.py) does it, and the files it writes:
//! `predictions.json`, `nbest_predictions.json` and, for SQuAD v2.0, `null_odds.json`.
//!
//! Per example, over all its windows: the `n_best_size` highest start and end logits of each
//! window are paired; pairs outside the context, reversed or longer than `max_answer_length`
//! tokens are skipped; the best-scoring spans (start + end logit) are kept, with a softmax over
//! their scores. With v2.0, the null answer (the CLS position, the lowest over the windows)
//! wins when its score beats the best span's by more than `null_score_diff_threshold`.
//! Logits are those of the window's real tokens (padding never competes for the n-best).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Result};
use serde::ser::{Serialize, SerializeMap, Serializer};

use crate::data::squad::{QaExample, QaFeature};
use crate::io::atomic_file::write_json;

/// Post-processing settings (run_qa.py's flags of the same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PostProcess {
    pub n_best_size: usize,
    pub max_answer_length: usize,
    pub version_2_with_negative: bool,
    pub null_score_diff_threshold: f64,
}

impl PostProcess {
    pub fn from_config(c: &crate::config::QaConfig) -> Self {
        PostProcess {
            n_best_size: c.n_best_size,
            max_answer_length: c.max_answer_length,
            version_2_with_negative: c.version_2_with_negative,
            null_score_diff_threshold: c.null_score_diff_threshold,
        }
    }
}

impl Default for PostProcess {
    fn default() -> Self {
        PostProcess {
            n_best_size: 20,
            max_answer_length: 30,
            version_2_with_negative: false,
            null_score_diff_threshold: 0.0,
        }
    }
}

/// One candidate answer.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Candidate {
    pub start_logit: f32,
    pub end_logit: f32,
    pub text: String,
    pub probability: f32,
}

/// Answers for every example, in example order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Predictions {
    /// (question id, answer text; "" for "no answer").
    pub answers: Vec<(String, String)>,
    /// (question id, candidates best first).
    pub nbest: Vec<(String, Vec<Candidate>)>,
    /// v2.0: (question id, null score minus the best span's score).
    pub null_odds: Vec<(String, f32)>,
}

impl Predictions {
    pub fn answer_map(&self) -> std::collections::HashMap<String, String> {
        self.answers.iter().cloned().collect()
    }
}

/// Positions of the `n` largest values, largest first (ties: the later position first, as
/// numpy's reversed argsort gives them).
fn top_positions(logits: &[f32], n: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[a].total_cmp(&logits[b]));
    idx.into_iter().rev().take(n).collect()
}

/// Characters `start..end` of `text` (Python's `text[start:end]`).
fn char_slice(text: &str, start: usize, end: usize) -> String {
    text.chars()
        .skip(start)
        .take(end.saturating_sub(start))
        .collect()
}

struct Scored {
    offsets: (usize, usize),
    score: f32,
    start_logit: f32,
    end_logit: f32,
}

/// Answers from each feature's (start, end) logits over its tokens.
pub fn postprocess(
    examples: &[QaExample],
    features: &[QaFeature],
    start_logits: &[Vec<f32>],
    end_logits: &[Vec<f32>],
    cfg: &PostProcess,
) -> Result<Predictions> {
    if start_logits.len() != features.len() || end_logits.len() != features.len() {
        bail!(
            "{} start and {} end logit rows for {} features",
            start_logits.len(),
            end_logits.len(),
            features.len()
        );
    }
    let by_example = features_by_example(examples, features)?;
    let v2 = cfg.version_2_with_negative;
    let mut out = Predictions::default();
    for (example, feature_ids) in examples.iter().zip(&by_example) {
        let (null, spans) = scored_spans(feature_ids, features, start_logits, end_logits, cfg);
        let nbest = n_best(example, spans, null.as_ref(), cfg);
        let answer = if !v2 {
            nbest[0].text.clone()
        } else {
            let best = nbest
                .iter()
                .find(|c| !c.text.is_empty())
                .unwrap_or(&nbest[0]);
            let null_score = null.as_ref().map_or(0.0, |n| n.score);
            let diff = null_score - best.start_logit - best.end_logit;
            out.null_odds.push((example.id.clone(), diff));
            if f64::from(diff) > cfg.null_score_diff_threshold {
                String::new()
            } else {
                best.text.clone()
            }
        };
        out.answers.push((example.id.clone(), answer));
        out.nbest.push((example.id.clone(), nbest));
    }
    Ok(out)
}

/// The indices of each example's features.
fn features_by_example(examples: &[QaExample], features: &[QaFeature]) -> Result<Vec<Vec<usize>>> {
    let mut by_example: Vec<Vec<usize>> = vec![Vec::new(); examples.len()];
    for (i, f) in features.iter().enumerate() {
        match by_example.get_mut(f.example) {
            Some(v) => v.push(i),
            None => bail!(
                "feature {i} names example {} of {}",
                f.example,
                examples.len()
            ),
        }
    }
    Ok(by_example)
}

/// Over one example's features: the lowest-scoring null answer (the first token's start and
/// end logits), and every span of the `n_best_size` best starts and ends that lies in the
/// context and is at most `max_answer_length` tokens long.
fn scored_spans(
    feature_ids: &[usize],
    features: &[QaFeature],
    start_logits: &[Vec<f32>],
    end_logits: &[Vec<f32>],
    cfg: &PostProcess,
) -> (Option<Scored>, Vec<Scored>) {
    let mut null: Option<Scored> = None;
    let mut spans: Vec<Scored> = Vec::new();
    for &fi in feature_ids {
        let (starts, ends) = (&start_logits[fi], &end_logits[fi]);
        let offsets = &features[fi].offsets;
        let (Some(&s0), Some(&e0)) = (starts.first(), ends.first()) else {
            continue;
        };
        if null.as_ref().is_none_or(|n| n.score > s0 + e0) {
            null = Some(Scored {
                offsets: (0, 0),
                score: s0 + e0,
                start_logit: s0,
                end_logit: e0,
            });
        }
        let best_ends = top_positions(ends, cfg.n_best_size);
        for &s in &top_positions(starts, cfg.n_best_size) {
            for &e in &best_ends {
                let (Some(Some(so)), Some(Some(eo))) = (offsets.get(s), offsets.get(e)) else {
                    continue;
                };
                if e < s || e - s + 1 > cfg.max_answer_length {
                    continue;
                }
                spans.push(Scored {
                    offsets: (so.0, eo.1),
                    score: starts[s] + ends[e],
                    start_logit: starts[s],
                    end_logit: ends[e],
                });
            }
        }
    }
    (null, spans)
}

/// The `n_best_size` best answers (with SQuAD v2, the null answer among them), their texts
/// and softmax probabilities; never empty.
fn n_best(
    example: &QaExample,
    mut prelim: Vec<Scored>,
    null: Option<&Scored>,
    cfg: &PostProcess,
) -> Vec<Candidate> {
    let v2 = cfg.version_2_with_negative;
    if let (true, Some(n)) = (v2, null) {
        prelim.push(Scored { ..*n });
    }
    // Stable: equal scores keep their order, as Python's sorted(reverse=True).
    prelim.sort_by(|a, b| b.score.total_cmp(&a.score));
    prelim.truncate(cfg.n_best_size);
    if v2 && !prelim.iter().any(|p| p.offsets == (0, 0)) {
        if let Some(n) = null {
            prelim.push(Scored { ..*n });
        }
    }
    // (text, score, start logit, end logit)
    let mut cands: Vec<(String, f32, f32, f32)> = prelim
        .iter()
        .map(|p| {
            let text = char_slice(&example.context, p.offsets.0, p.offsets.1);
            (text, p.score, p.start_logit, p.end_logit)
        })
        .collect();
    if cands.is_empty() || (cands.len() == 1 && cands[0].0.is_empty()) {
        cands.insert(0, ("empty".to_string(), 0.0, 0.0, 0.0));
    }
    let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = cands.iter().map(|c| (c.1 - max).exp()).collect();
    let total: f32 = exps.iter().sum();
    cands
        .iter()
        .zip(&exps)
        .map(|(c, e)| Candidate {
            start_logit: c.2,
            end_logit: c.3,
            text: c.0.clone(),
            probability: e / total,
        })
        .collect()
}

/// A JSON object with its keys in the given order.
struct Ordered<'a, V>(&'a [(String, V)]);

impl<V: Serialize> Serialize for Ordered<'_, V> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// Writes `predictions.json`, `nbest_predictions.json` and (v2.0) `null_odds.json` into `dir`,
/// keyed by question id in example order, as run_qa.py does.
pub fn write_predictions(dir: &Path, p: &Predictions, v2: bool) -> Result<()> {
    write_json(&dir.join("predictions.json"), &Ordered(&p.answers))?;
    write_json(&dir.join("nbest_predictions.json"), &Ordered(&p.nbest))?;
    if v2 {
        write_json(&dir.join("null_odds.json"), &Ordered(&p.null_odds))?;
    }
    Ok(())
}

/// The SQuAD scores of these answers: v1.1's `exact_match`/`f1`, or v2.0's breakdown.
pub fn score(examples: &[QaExample], p: &Predictions, v2: bool) -> BTreeMap<String, f64> {
    use crate::metrics::squad::{squad_v1, squad_v2, Gold};
    let gold: Vec<Gold> = examples
        .iter()
        .map(|e| Gold {
            id: &e.id,
            answers: e.answers.iter().map(|(t, _)| t.as_str()).collect(),
        })
        .collect();
    let answers = p.answer_map();
    if v2 {
        squad_v2(&gold, &answers)
    } else {
        squad_v1(&gold, &answers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(context: &str) -> QaExample {
        QaExample {
            id: "q".into(),
            title: String::new(),
            question: "?".into(),
            context: context.into(),
            answers: vec![],
        }
    }

    fn feature(offsets: Vec<Option<(usize, usize)>>) -> QaFeature {
        QaFeature {
            example: 0,
            input: crate::data::batching::Feature {
                input_ids: vec![0; offsets.len()],
                type_ids: vec![0; offsets.len()],
                target: crate::data::batching::Target::Span(0, 0),
            },
            offsets,
        }
    }

    #[test]
    fn best_span_inside_the_context() {
        // [CLS] q [SEP] Paris is big [SEP]
        let ex = example("Paris is big");
        let f = feature(vec![
            None,
            None,
            None,
            Some((0, 5)),
            Some((6, 8)),
            Some((9, 12)),
            None,
        ]);
        // The question token (1) has the highest logits but is not context.
        let s = vec![vec![0.0, 9.0, 0.0, 5.0, 1.0, 0.5, 0.0]];
        let e = vec![vec![0.0, 9.0, 0.0, 4.0, 1.0, 2.0, 0.0]];
        let p = postprocess(
            &[ex],
            std::slice::from_ref(&f),
            &s,
            &e,
            &PostProcess::default(),
        )
        .unwrap();
        assert_eq!(p.answers, vec![("q".to_string(), "Paris".to_string())]);
        let probs: f32 = p.nbest[0].1.iter().map(|c| c.probability).sum();
        assert!((probs - 1.0).abs() < 1e-6);
        // An answer longer than max_answer_length tokens is never chosen.
        let cfg = PostProcess {
            max_answer_length: 1,
            ..PostProcess::default()
        };
        let e2 = vec![vec![0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 0.0]];
        let p = postprocess(&[example("Paris is big")], &[f], &s, &e2, &cfg).unwrap();
        assert_ne!(p.answers[0].1, "Paris is big");
    }

    #[test]
    fn null_answer_under_v2() {
        let f = feature(vec![None, Some((0, 5)), None]);
        let s = vec![vec![6.0, 1.0, 0.0]];
        let e = vec![vec![6.0, 1.0, 0.0]];
        let cfg = PostProcess {
            version_2_with_negative: true,
            ..PostProcess::default()
        };
        let p = postprocess(&[example("Paris")], std::slice::from_ref(&f), &s, &e, &cfg).unwrap();
        assert_eq!(p.answers[0].1, "");
        assert_eq!(p.null_odds[0].1, 10.0);
        let lenient = PostProcess {
            null_score_diff_threshold: 10.5,
            ..cfg
        };
        let p = postprocess(&[example("Paris")], &[f], &s, &e, &lenient).unwrap();
        assert_eq!(p.answers[0].1, "Paris");
    }
}
