//! Evaluation metrics for sequence classification, defined as scikit-learn and SciPy define
//! them (the `evaluate` GLUE metrics): accuracy, F1 (binary on class 1, and macro),
//! Matthews correlation, Pearson and Spearman correlation; SQuAD's exact match and F1 in
//! [`squad`].

use std::collections::BTreeMap;

pub mod seqeval;
pub mod squad;

/// Fraction of predictions equal to the labels.
pub fn accuracy(pred: &[usize], gold: &[usize]) -> f64 {
    if gold.is_empty() {
        return 0.0;
    }
    pred.iter().zip(gold).filter(|(p, g)| p == g).count() as f64 / gold.len() as f64
}

/// F1 of one class treated as positive; 0 when it is never predicted nor present.
pub fn f1_for(pred: &[usize], gold: &[usize], class: usize) -> f64 {
    let tp = pred
        .iter()
        .zip(gold)
        .filter(|(p, g)| **p == class && **g == class)
        .count() as f64;
    let fp = pred
        .iter()
        .zip(gold)
        .filter(|(p, g)| **p == class && **g != class)
        .count() as f64;
    let fn_ = pred
        .iter()
        .zip(gold)
        .filter(|(p, g)| **p != class && **g == class)
        .count() as f64;
    if tp == 0.0 {
        0.0
    } else {
        2.0 * tp / (2.0 * tp + fp + fn_)
    }
}

/// Unweighted mean of per-class F1 over `num_classes` classes.
pub fn macro_f1(pred: &[usize], gold: &[usize], num_classes: usize) -> f64 {
    (0..num_classes).map(|c| f1_for(pred, gold, c)).sum::<f64>() / num_classes.max(1) as f64
}

/// Multiclass Matthews correlation coefficient (scikit-learn's formula); 0 when undefined.
pub fn matthews(pred: &[usize], gold: &[usize], num_classes: usize) -> f64 {
    let n = gold.len() as f64;
    let mut t = vec![0f64; num_classes]; // true counts per class
    let mut p = vec![0f64; num_classes]; // predicted counts per class
    let mut correct = 0f64;
    for (&pi, &gi) in pred.iter().zip(gold) {
        if pi < num_classes {
            p[pi] += 1.0;
        }
        if gi < num_classes {
            t[gi] += 1.0;
        }
        if pi == gi {
            correct += 1.0;
        }
    }
    let tp: f64 = t.iter().zip(&p).map(|(a, b)| a * b).sum();
    let cov_ytyp = correct * n - tp;
    let cov_ypyp = n * n - p.iter().map(|x| x * x).sum::<f64>();
    let cov_ytyt = n * n - t.iter().map(|x| x * x).sum::<f64>();
    if cov_ypyp * cov_ytyt == 0.0 {
        0.0
    } else {
        cov_ytyp / (cov_ytyt * cov_ypyp).sqrt()
    }
}

/// Pearson correlation; 0 when either side is constant.
pub fn pearson(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len() as f64;
    if n == 0.0 {
        return 0.0;
    }
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let cov: f64 = x.iter().zip(y).map(|(a, b)| (a - mx) * (b - my)).sum();
    let vx: f64 = x.iter().map(|a| (a - mx).powi(2)).sum();
    let vy: f64 = y.iter().map(|b| (b - my).powi(2)).sum();
    if vx == 0.0 || vy == 0.0 {
        0.0
    } else {
        cov / (vx * vy).sqrt()
    }
}

/// Ranks with ties given their average rank (SciPy's `rankdata`, method "average").
fn ranks(x: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[a].total_cmp(&x[b]));
    let mut r = vec![0.0; x.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && x[idx[j + 1]] == x[idx[i]] {
            j += 1;
        }
        let avg = (i + j) as f64 / 2.0 + 1.0;
        for k in i..=j {
            r[idx[k]] = avg;
        }
        i = j + 1;
    }
    r
}

/// Spearman rank correlation (Pearson over average ranks).
pub fn spearman(x: &[f64], y: &[f64]) -> f64 {
    pearson(&ranks(x), &ranks(y))
}

/// The metrics reported for a classification evaluation.
pub fn classification_report(
    pred: &[usize],
    gold: &[usize],
    num_classes: usize,
) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    m.insert("accuracy".into(), accuracy(pred, gold));
    if num_classes == 2 {
        m.insert("f1".into(), f1_for(pred, gold, 1));
    }
    m.insert("f1_macro".into(), macro_f1(pred, gold, num_classes));
    m.insert(
        "matthews_correlation".into(),
        matthews(pred, gold, num_classes),
    );
    m
}

/// The metrics reported for a regression evaluation.
pub fn regression_report(pred: &[f64], gold: &[f64]) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    m.insert("pearson".into(), pearson(pred, gold));
    m.insert("spearmanr".into(), spearman(pred, gold));
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    // Reference values from scikit-learn 1.x and SciPy on the same inputs.
    #[test]
    fn classification_metrics_match_sklearn() {
        let gold = [0, 1, 1, 0, 1, 1, 0, 0, 1, 1];
        let pred = [0, 1, 0, 0, 1, 1, 1, 0, 1, 0];
        assert!((accuracy(&pred, &gold) - 0.7).abs() < 1e-12);
        // f1_score(gold, pred) = 2*4/(2*4+1+2)
        assert!((f1_for(&pred, &gold, 1) - 8.0 / 11.0).abs() < 1e-12);
        // f1_score(average="macro") = (8/11 + 6/9) / 2
        assert!((macro_f1(&pred, &gold, 2) - (8.0 / 11.0 + 6.0 / 9.0) / 2.0).abs() < 1e-12);
        // matthews_corrcoef = (4*3 - 1*2) / sqrt(5*5*6*4)
        assert!((matthews(&pred, &gold, 2) - 10.0 / (600f64).sqrt()).abs() < 1e-12);
        assert_eq!(matthews(&[1, 1, 1], &[0, 1, 0], 2), 0.0);
        // multiclass: matthews_corrcoef([0,1,2,2,1,0], [0,2,2,1,1,0]) = 0.5 (gold first)
        assert!((matthews(&[0, 2, 2, 1, 1, 0], &[0, 1, 2, 2, 1, 0], 3) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn correlations_match_scipy() {
        let x = [1.0, 2.0, 3.0, 4.0, 5.0];
        let y = [2.0, 1.0, 4.0, 3.0, 7.0];
        // scipy.stats.pearsonr -> 0.824163383692134, spearmanr -> 0.8
        assert!((pearson(&x, &y) - 0.824163383692134).abs() < 1e-12);
        assert!((spearman(&x, &y) - 0.8).abs() < 1e-12);
        // ties: spearmanr([1,2,2,3],[1,3,2,4]) = 0.9486832980505138
        assert!(
            (spearman(&[1.0, 2.0, 2.0, 3.0], &[1.0, 3.0, 2.0, 4.0]) - 0.9486832980505138).abs()
                < 1e-12
        );
    }
}
