//! Question answering after the model: answers from logits equal transformers'
//! `postprocess_qa_predictions`, EM/F1 equal the official SQuAD v1.1 and v2.0 scripts, and the
//! Hugging Face flat layouts read as the nested SQuAD JSON does (fixtures from
//! scripts/make_fixtures.py). Bad question files fail with one clear line.

mod common;

use std::collections::HashMap;

use common::fixtures;
use serde_json::Value;
use sprtrain::data::batching::{Feature, Target};
use sprtrain::data::squad::{load_squad, load_squad_json, QaFeature, QaReadOptions};
use sprtrain::metrics::squad::{squad_v1, squad_v2, Gold};
use sprtrain::tasks::qa_answers::{postprocess, PostProcess};

fn read_json(name: &str) -> Value {
    let p = fixtures().join("qa").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<Vec<f32>> {
    serde_json::from_value(v.clone()).unwrap()
}

#[test]
fn answers_match_postprocess_qa_predictions() {
    let examples = load_squad_json(&fixtures().join("qa/squad_v1.json")).unwrap();
    let windows_ref = read_json("features_reference.json");
    let index: HashMap<&str, usize> = examples
        .iter()
        .enumerate()
        .map(|(i, e)| (e.id.as_str(), i))
        .collect();
    let windows: Vec<QaFeature> = windows_ref["features"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| QaFeature {
            example: index[f["example"].as_str().unwrap()],
            offsets: serde_json::from_value(f["offsets"].clone()).unwrap(),
            input: Feature {
                input_ids: serde_json::from_value(f["input_ids"].clone()).unwrap(),
                type_ids: serde_json::from_value(f["token_type_ids"].clone()).unwrap(),
                target: Target::Span(0, 0),
            },
        })
        .collect();
    let reference = read_json("postprocess_reference.json");
    let starts = floats(&reference["start_logits"]);
    let ends = floats(&reference["end_logits"]);
    let cases = reference["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 4);
    for case in cases {
        let s = &case["settings"];
        let cfg = PostProcess {
            n_best_size: s["n_best_size"].as_u64().unwrap_or(20) as usize,
            max_answer_length: s["max_answer_length"].as_u64().unwrap_or(30) as usize,
            version_2_with_negative: s["version_2_with_negative"].as_bool().unwrap_or(false),
            null_score_diff_threshold: s["null_score_diff_threshold"].as_f64().unwrap_or(0.0),
        };
        let ours = postprocess(&examples, &windows, &starts, &ends, &cfg).unwrap();
        let want = case["predictions"].as_object().unwrap();
        assert_eq!(ours.answers.len(), want.len());
        for ((id, text), (wid, wtext)) in ours.answers.iter().zip(want) {
            assert_eq!((id, text.as_str()), (wid, wtext.as_str().unwrap()), "{s}");
        }
        let mut candidates = 0;
        for (id, list) in &ours.nbest {
            let theirs = case["nbest"][id].as_array().unwrap();
            assert_eq!(list.len(), theirs.len(), "{s} {id}: n-best size");
            for (c, t) in list.iter().zip(theirs) {
                assert_eq!(c.text, t["text"].as_str().unwrap(), "{s} {id}");
                // The same f32 logits (compared as f32: JSON holds their f64 decimal form).
                assert_eq!(c.start_logit, t["start_logit"].as_f64().unwrap() as f32);
                assert_eq!(c.end_logit, t["end_logit"].as_f64().unwrap() as f32);
                // numpy sums the softmax pairwise, we in order: a few f32 ulps apart.
                let p = t["probability"].as_f64().unwrap();
                assert!((c.probability as f64 - p).abs() < 1e-6, "{s} {id}: {p}");
                candidates += 1;
            }
        }
        assert!(candidates > 2 * examples.len(), "{s}: only {candidates}");
        if cfg.version_2_with_negative {
            for (id, diff) in &ours.null_odds {
                let want = case["null_odds"][id].as_f64().unwrap();
                assert!(
                    (*diff as f64 - want).abs() < 1e-5,
                    "{s} {id}: {diff} vs {want}"
                );
            }
        }
    }
    // The settings matter: v2.0 with a low threshold answers "" somewhere, v1.1 never does.
    let answers = |c: &Value| -> Vec<String> {
        c["predictions"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    };
    assert!(answers(&cases[0]).iter().all(|a| !a.is_empty()));
    assert!(answers(&cases[3]).iter().any(String::is_empty));
}

fn gold_of(dataset: &Value) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    for a in dataset["data"].as_array().unwrap() {
        for p in a["paragraphs"].as_array().unwrap() {
            for q in p["qas"].as_array().unwrap() {
                let answers = q["answers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x["text"].as_str().unwrap().to_string())
                    .collect();
                out.push((q["id"].as_str().unwrap().to_string(), answers));
            }
        }
    }
    out
}

#[test]
fn exact_match_and_f1_equal_the_official_scripts() {
    let reference = read_json("squad_eval_reference.json");
    for version in ["v1", "v2"] {
        let case = &reference[version];
        let gold = gold_of(&case["dataset"]);
        let gold: Vec<Gold> = gold
            .iter()
            .map(|(id, a)| Gold {
                id,
                answers: a.iter().map(String::as_str).collect(),
            })
            .collect();
        let preds: HashMap<String, String> =
            serde_json::from_value(case["predictions"].clone()).unwrap();
        let ours = if version == "v1" {
            squad_v1(&gold, &preds)
        } else {
            squad_v2(&gold, &preds)
        };
        let theirs = case["result"].as_object().unwrap();
        assert_eq!(
            ours.len(),
            theirs.len(),
            "{version}: {ours:?} vs {theirs:?}"
        );
        for (k, v) in theirs {
            let want = v.as_f64().unwrap();
            let got = ours[k];
            assert!((got - want).abs() < 1e-9, "{version} {k}: {got} vs {want}");
        }
        // Not vacuous: partial credit and misses both occur.
        let f1 = ours["f1"];
        assert!(f1 > 10.0 && f1 < 90.0, "{version}: f1 {f1}");
    }
}

#[test]
fn flat_json_jsonl_and_parquet_read_as_the_nested_json() {
    let dir = fixtures().join("qa");
    let nested = load_squad_json(&dir.join("squad_v1.json")).unwrap();
    assert_eq!(nested.len(), 6);
    for name in ["squad_flat.json", "squad_flat.jsonl", "squad_flat.parquet"] {
        let (flat, report) = load_squad(&dir.join(name), QaReadOptions::default()).unwrap();
        assert_eq!(flat, nested, "{name}");
        assert_eq!(report, Default::default(), "{name}");
    }
}

#[test]
fn bad_question_files_fail_with_one_clear_line() {
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = tmp.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let lenient = QaReadOptions::default();
    let err =
        |p: &std::path::Path, o: QaReadOptions| format!("{:#}", load_squad(p, o).unwrap_err());
    let record = |id: &str, q: &str, c: &str, text: &str, start: usize| {
        format!(
            r#"{{"id": "{id}", "question": "{q}", "context": "{c}", "answers": {{"text": ["{text}"], "answer_start": [{start}]}}}}"#
        )
    };
    let p = write(
        "bad.jsonl",
        &format!("{}\n{{\"id\": 3,", record("a", "q", "c", "c", 0)),
    );
    let e = err(&p, lenient);
    assert!(
        e.contains("line 2: invalid JSON") && e.contains("column"),
        "{e}"
    );

    // answer_start off by one: counted and warned about by default, an error when strict.
    let p = write(
        "shifted.jsonl",
        &record("a", "Where?", "In Paris, France.", "Paris", 4),
    );
    let (examples, report) = load_squad(&p, lenient).unwrap();
    assert_eq!((examples.len(), report.mismatched_answers), (1, 1));
    assert!(report.first_mismatch.unwrap().contains("found \"aris,\""));
    let strict = QaReadOptions {
        strict_answers: true,
        ..lenient
    };
    let e = err(&p, strict);
    assert!(
        e.contains("question a: answer \"Paris\" does not start at character 4")
            && e.contains("qa.strict_answers"),
        "{e}"
    );

    // Empty question or context: an error, or skipped and counted with skip_bad_rows.
    let p = write(
        "empty.jsonl",
        &[
            record("a", " ", "ctx", "ctx", 0),
            record("b", "q", "ctx", "ctx", 0),
        ]
        .join("\n"),
    );
    assert!(err(&p, lenient).contains("question a has an empty question"));
    let skip = QaReadOptions {
        skip_bad_rows: true,
        ..lenient
    };
    let (examples, report) = load_squad(&p, skip).unwrap();
    assert_eq!((examples.len(), report.skipped), (1, 1));
    let p = write("nocontext.jsonl", &record("a", "q", "", "", 0));
    assert!(err(&p, lenient).contains("question a has an empty context"));

    // Duplicate ids across records, mismatched answer lists, not SQuAD at all.
    let p = write(
        "dup.json",
        &format!(
            "[{}, {}]",
            record("x", "q", "c", "c", 0),
            record("x", "q2", "c", "c", 0)
        ),
    );
    assert!(err(&p, lenient).contains("record 2: duplicate question id x"));
    let p = write(
        "lists.jsonl",
        r#"{"id": "a", "question": "q", "context": "c", "answers": {"text": ["c", "d"], "answer_start": [0]}}"#,
    );
    assert!(err(&p, lenient).contains("answers has 2 texts but 1 starts"));
    let p = write("other.json", r#"{"rows": []}"#);
    assert!(err(&p, lenient).contains("no \"data\" array"));
    let p = write("empty.json", r#"{"data": []}"#);
    assert!(err(&p, lenient).contains("holds no questions"));
    for e in [
        err(&p, lenient),
        err(&tmp.path().join("missing.json"), lenient),
    ] {
        assert_eq!(e.lines().count(), 1, "{e}");
    }
}
