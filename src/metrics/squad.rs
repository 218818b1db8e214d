//! Exact match and F1 exactly as the official SQuAD evaluation scripts compute them
//! (evaluate-v1.1.py and evaluate-v2.0.py from the SQuAD explorer): answers are lower-cased,
//! stripped of ASCII punctuation, of the articles a/an/the and of extra whitespace; a question
//! scores the best over its gold answers; totals are percentages.

use std::collections::{BTreeMap, HashMap};
use std::sync::OnceLock;

/// One question's gold answers (empty for an unanswerable v2.0 question).
pub struct Gold<'a> {
    pub id: &'a str,
    pub answers: Vec<&'a str>,
}

/// Python's `str.isspace`, which `str.split()` splits on: Unicode White_Space plus the
/// information separators U+001C..U+001F.
fn python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// The scripts' `normalize_answer`: lower case, drop ASCII punctuation, replace the words
/// a/an/the by a space, collapse whitespace.
pub fn normalize_answer(s: &str) -> String {
    static ARTICLES: OnceLock<regex::Regex> = OnceLock::new();
    let articles = ARTICLES.get_or_init(|| regex::Regex::new(r"\b(a|an|the)\b").expect("valid"));
    let lower = s.to_lowercase();
    let no_punct: String = lower
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    let no_articles = articles.replace_all(&no_punct, " ");
    tokens(&no_articles).join(" ")
}

fn tokens(s: &str) -> Vec<&str> {
    s.split(python_space).filter(|t| !t.is_empty()).collect()
}

/// Tokens shared by the two lists, counted with multiplicity (`Counter & Counter`).
fn overlap(a: &[&str], b: &[&str]) -> usize {
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for t in a {
        *counts.entry(t).or_default() += 1;
    }
    b.iter()
        .filter(|t| match counts.get_mut(*t) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        })
        .count()
}

fn harmonic(same: usize, pred: usize, gold: usize) -> f64 {
    let precision = same as f64 / pred as f64;
    let recall = same as f64 / gold as f64;
    (2.0 * precision * recall) / (precision + recall)
}

/// v1.1's `f1_score`: 0 when no token is shared (also when both are empty).
pub fn f1_v1(prediction: &str, gold: &str) -> f64 {
    let (p, g) = (normalize_answer(prediction), normalize_answer(gold));
    let (p, g) = (tokens(&p), tokens(&g));
    let same = overlap(&p, &g);
    if same == 0 {
        return 0.0;
    }
    harmonic(same, p.len(), g.len())
}

/// v2.0's `compute_f1`: when either side is empty, 1 if both are, else 0.
pub fn f1_v2(gold: &str, prediction: &str) -> f64 {
    let (g, p) = (normalize_answer(gold), normalize_answer(prediction));
    let (g, p) = (tokens(&g), tokens(&p));
    if g.is_empty() || p.is_empty() {
        return f64::from(u8::from(g == p));
    }
    let same = overlap(&g, &p);
    if same == 0 {
        return 0.0;
    }
    harmonic(same, p.len(), g.len())
}

fn exact(a: &str, b: &str) -> f64 {
    f64::from(u8::from(normalize_answer(a) == normalize_answer(b)))
}

/// evaluate-v1.1.py: `exact_match` and `f1` in percent over all questions; a question without
/// a prediction scores 0.
pub fn squad_v1(gold: &[Gold], predictions: &HashMap<String, String>) -> BTreeMap<String, f64> {
    let (mut em, mut f1) = (0.0, 0.0);
    for q in gold {
        let Some(pred) = predictions.get(q.id) else {
            continue;
        };
        em += q.answers.iter().map(|g| exact(pred, g)).fold(0.0, f64::max);
        f1 += q.answers.iter().map(|g| f1_v1(pred, g)).fold(0.0, f64::max);
    }
    let total = gold.len().max(1) as f64;
    BTreeMap::from([
        ("exact_match".to_string(), 100.0 * em / total),
        ("f1".to_string(), 100.0 * f1 / total),
    ])
}

/// evaluate-v2.0.py without a no-answer probability file: `exact`, `f1` and `total`, and the
/// same for the answerable (`HasAns_`) and unanswerable (`NoAns_`) questions. Gold answers
/// that normalise to nothing are dropped; a question left with none expects "".
/// Questions without a prediction are left out, as the script does.
pub fn squad_v2(gold: &[Gold], predictions: &HashMap<String, String>) -> BTreeMap<String, f64> {
    // (exact, f1, has an answer) per scored question, in file order.
    let mut scored: Vec<(f64, f64, bool)> = Vec::new();
    for q in gold {
        let Some(pred) = predictions.get(q.id) else {
            continue;
        };
        let mut answers: Vec<&str> = q
            .answers
            .iter()
            .copied()
            .filter(|a| !normalize_answer(a).is_empty())
            .collect();
        if answers.is_empty() {
            answers.push("");
        }
        let em = answers.iter().map(|g| exact(g, pred)).fold(0.0, f64::max);
        let f1 = answers.iter().map(|g| f1_v2(g, pred)).fold(0.0, f64::max);
        scored.push((em, f1, !q.answers.is_empty()));
    }
    let mut out = BTreeMap::new();
    let mut add = |prefix: &str, rows: Vec<&(f64, f64, bool)>| {
        let total = rows.len() as f64;
        let (em, f1) = rows.iter().fold((0.0, 0.0), |(e, f), r| (e + r.0, f + r.1));
        out.insert(format!("{prefix}exact"), 100.0 * em / total.max(1.0));
        out.insert(format!("{prefix}f1"), 100.0 * f1 / total.max(1.0));
        out.insert(format!("{prefix}total"), total);
    };
    add("", scored.iter().collect());
    let has: Vec<_> = scored.iter().filter(|r| r.2).collect();
    let no: Vec<_> = scored.iter().filter(|r| !r.2).collect();
    if !has.is_empty() {
        add("HasAns_", has);
    }
    if !no.is_empty() {
        add("NoAns_", no);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_as_the_scripts() {
        assert_eq!(normalize_answer("The  Eiffel Tower!"), "eiffel tower");
        assert_eq!(normalize_answer("an apple, a pear"), "apple pear");
        assert_eq!(normalize_answer("theatre"), "theatre");
        assert_eq!(normalize_answer("Ünïcode\u{a0}Text"), "ünïcode text");
        assert_eq!(normalize_answer("«the» end"), "« » end");
    }

    #[test]
    fn f1_edge_cases_differ_between_versions() {
        assert_eq!(f1_v1("", ""), 0.0);
        assert_eq!(f1_v2("", ""), 1.0);
        assert!((f1_v1("the cat sat", "a cat sat down") - 0.8).abs() < 1e-12);
    }
}
