//! Entity-level precision, recall and F1 as seqeval's default mode computes them (conlleval's
//! chunking: IOB1, IOB2 and IOBES tags, a chunk also ending where the type changes), plus
//! token accuracy: the metrics transformers' run_ner.py reports.

use std::collections::{BTreeMap, BTreeSet};

/// An entity: its type and first and last token positions (inclusive).
pub type Entity = (String, usize, usize);

/// Splits a tag into its chunk tag (first character: B, I, E, S, O, ...) and its type ("_"
/// when it has none), as seqeval does for prefix tags.
fn split_tag(tag: &str) -> (char, &str) {
    let mut chars = tag.chars();
    let first = chars.next().unwrap_or('O');
    let rest = chars.as_str();
    // The type is what follows the first '-' after the chunk tag ("B-PER" -> "PER").
    let kind = match rest.split_once('-') {
        Some((_, t)) => t,
        None => rest,
    };
    (first, if kind.is_empty() { "_" } else { kind })
}

fn end_of_chunk(prev_tag: char, tag: char, prev_type: &str, kind: &str) -> bool {
    matches!(prev_tag, 'E' | 'S')
        || (matches!(prev_tag, 'B' | 'I') && matches!(tag, 'B' | 'S' | 'O'))
        || (prev_tag != 'O' && prev_tag != '.' && prev_type != kind)
}

fn start_of_chunk(prev_tag: char, tag: char, prev_type: &str, kind: &str) -> bool {
    matches!(tag, 'B' | 'S')
        || (matches!(prev_tag, 'E' | 'S' | 'O') && matches!(tag, 'E' | 'I'))
        || (tag != 'O' && tag != '.' && prev_type != kind)
}

/// The entities of one tag sequence (seqeval's `get_entities`).
pub fn entities<S: AsRef<str>>(tags: &[S]) -> Vec<Entity> {
    let mut chunks = Vec::new();
    let (mut prev_tag, mut prev_type) = ('O', "");
    let mut begin = 0;
    for (i, tag) in tags.iter().map(AsRef::as_ref).chain(["O"]).enumerate() {
        let (t, kind) = split_tag(tag);
        if end_of_chunk(prev_tag, t, prev_type, kind) {
            chunks.push((prev_type.to_string(), begin, i - 1));
        }
        if start_of_chunk(prev_tag, t, prev_type, kind) {
            begin = i;
        }
        (prev_tag, prev_type) = (t, kind);
    }
    chunks
}

/// Entity-level scores of predicted against gold tag sequences (one per sentence): micro
/// `precision`, `recall`, `f1`, token `accuracy`, and per entity type `TYPE_precision`,
/// `TYPE_recall`, `TYPE_f1`, `TYPE_number` (gold count). Divisions by zero give 0, as
/// seqeval's default `zero_division` does.
pub fn scores<S: AsRef<str>>(gold: &[Vec<S>], predicted: &[Vec<S>]) -> BTreeMap<String, f64> {
    // seqeval scores nested lists as one sequence with an "O" after each sentence.
    let flatten = |seqs: &[Vec<S>]| -> Vec<String> {
        seqs.iter()
            .flat_map(|s| s.iter().map(|t| t.as_ref().to_string()).chain(["O".into()]))
            .collect()
    };
    let (gold_flat, pred_flat) = (flatten(gold), flatten(predicted));
    let by_type = |flat: &[String]| {
        let mut m: BTreeMap<String, BTreeSet<(usize, usize)>> = BTreeMap::new();
        for (kind, s, e) in entities(flat) {
            m.entry(kind).or_default().insert((s, e));
        }
        m
    };
    let (gold_entities, pred_entities) = (by_type(&gold_flat), by_type(&pred_flat));
    let empty = BTreeSet::new();
    let types: BTreeSet<&String> = gold_entities.keys().chain(pred_entities.keys()).collect();
    let ratio = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    let f1 = |p: f64, r: f64| {
        if p + r == 0.0 {
            0.0
        } else {
            2.0 * p * r / (p + r)
        }
    };
    let mut out = BTreeMap::new();
    let (mut tp_all, mut pred_all, mut gold_all) = (0, 0, 0);
    for kind in types {
        let g = gold_entities.get(kind).unwrap_or(&empty);
        let p = pred_entities.get(kind).unwrap_or(&empty);
        let tp = g.intersection(p).count();
        let (precision, recall) = (ratio(tp, p.len()), ratio(tp, g.len()));
        out.insert(format!("{kind}_precision"), precision);
        out.insert(format!("{kind}_recall"), recall);
        out.insert(format!("{kind}_f1"), f1(precision, recall));
        out.insert(format!("{kind}_number"), g.len() as f64);
        (tp_all, pred_all, gold_all) = (tp_all + tp, pred_all + p.len(), gold_all + g.len());
    }
    let (precision, recall) = (ratio(tp_all, pred_all), ratio(tp_all, gold_all));
    out.insert("precision".into(), precision);
    out.insert("recall".into(), recall);
    out.insert("f1".into(), f1(precision, recall));
    // Token accuracy over the sentences' own tags (the separators excluded, which agree).
    let tokens: usize = gold.iter().map(Vec::len).sum();
    let correct = gold
        .iter()
        .zip(predicted)
        .flat_map(|(g, p)| g.iter().zip(p))
        .filter(|(g, p)| g.as_ref() == p.as_ref())
        .count();
    out.insert("accuracy".into(), ratio(correct, tokens));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_follow_conlleval() {
        let e = |tags: &[&str]| entities(tags);
        assert_eq!(
            e(&["B-PER", "I-PER", "O", "B-LOC"]),
            [("PER".into(), 0, 1), ("LOC".into(), 3, 3)]
        );
        // An I- without a B- starts a chunk (IOB1); a type change ends one.
        assert_eq!(
            e(&["I-PER", "I-LOC", "I-LOC"]),
            [("PER".into(), 0, 0), ("LOC".into(), 1, 2)]
        );
        // IOBES: S- is a chunk of its own, E- ends one.
        assert_eq!(
            e(&["S-ORG", "B-MISC", "E-MISC", "E-MISC"]),
            [
                ("ORG".into(), 0, 0),
                ("MISC".into(), 1, 2),
                ("MISC".into(), 3, 3)
            ]
        );
        // Types with hyphens keep them.
        assert_eq!(
            e(&["B-creative-work", "I-creative-work"]),
            [("creative-work".into(), 0, 1)]
        );
    }

    #[test]
    fn micro_scores_count_exact_matches() {
        let gold = vec![vec!["B-PER", "I-PER", "O"], vec!["B-LOC", "O"]];
        let pred = vec![vec!["B-PER", "I-PER", "O"], vec!["B-LOC", "I-LOC"]];
        let s = scores(&gold, &pred);
        assert_eq!(s["precision"], 0.5);
        assert_eq!(s["recall"], 0.5);
        assert_eq!(s["f1"], 0.5);
        assert_eq!(s["accuracy"], 0.8);
        assert_eq!(s["PER_f1"], 1.0);
        assert_eq!(s["LOC_f1"], 0.0);
        assert_eq!(s["LOC_number"], 1.0);
    }
}
