//! Token classification (NER) end to end: seqeval's entity-level metrics against seqeval
//! itself on tricky tag sequences, training on CoNLL files (tags from the file become the
//! head's labels, seqeval F1 in the evaluation), `sprtrain predict --task token-cls` (tags per
//! word, entities with character spans), and bad tag files refused with one line.

mod common;

use common::{eval_results, fixtures, losses, ok, sprtrain, write_conll, RunConfig};
use serde_json::Value;
use sprtrain::metrics::seqeval;

/// seqeval 1.2.2's default mode on 21 cases (hand-written IOB1/IOB2/IOBES edge cases, types
/// with hyphens, bare B/I tags, and random mixes): the same entities, and every score equal
/// to 1e-12 (both sides divide the same integer counts).
#[test]
fn seqeval_scores_match_seqeval() {
    let text = std::fs::read_to_string(fixtures().join("seqeval").join("cases.json")).unwrap();
    let cases: Vec<Value> = serde_json::from_str(&text).unwrap();
    assert!(cases.len() > 20);
    let tags = |v: &Value| -> Vec<Vec<String>> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| {
                s.as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_str().unwrap().to_string())
                    .collect()
            })
            .collect()
    };
    for (i, case) in cases.iter().enumerate() {
        let (gold, predicted) = (tags(&case["gold"]), tags(&case["predicted"]));
        for (sentence, want) in gold.iter().zip(case["gold_entities"].as_array().unwrap()) {
            let want: Vec<(String, usize, usize)> = want
                .as_array()
                .unwrap()
                .iter()
                .map(|e| {
                    (
                        e[0].as_str().unwrap().to_string(),
                        e[1].as_u64().unwrap() as usize,
                        e[2].as_u64().unwrap() as usize,
                    )
                })
                .collect();
            assert_eq!(seqeval::entities(sentence), want, "case {i}: {sentence:?}");
        }
        let got = seqeval::scores(&gold, &predicted);
        for (key, want) in case["scores"].as_object().unwrap() {
            let want = want.as_f64().unwrap();
            let have = got
                .get(key)
                .unwrap_or_else(|| panic!("case {i}: no {key} in {got:?}"));
            assert!(
                (have - want).abs() <= 1e-12,
                "case {i}: {key} {have} vs {want}"
            );
        }
        assert_eq!(
            got.len(),
            case["scores"].as_object().unwrap().len(),
            "case {i}: {got:?}"
        );
    }
}

#[test]
fn token_classification_trains_evaluates_and_predicts() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, eval) = (tmp.path().join("train.conll"), tmp.path().join("dev.conll"));
    write_conll(&train, 160, 1);
    write_conll(&eval, 40, 2);
    let out = tmp.path().join("run");
    let config = RunConfig::new(&fixtures().join("train_parity_mlm"), &train, &out)
        .set("model.task", "token-cls")
        .set_path("data.eval_file", &eval)
        .set("train.epochs", 4)
        .set("train.batch_size", 8)
        .set("train.learning_rate", 5e-3)
        .set("train.warmup_ratio", 0.1)
        .write(&tmp.path().join("ner.toml"));
    ok(sprtrain().arg("--config").arg(&config).output().unwrap());
    let l = losses(&out);
    assert!(
        l[0] > 1.0 && *l.last().unwrap() < 0.2,
        "the loss must fall: {l:?}"
    );
    let r = eval_results(&out);
    eprintln!("token-cls eval: {r}");
    // The rule is learnable exactly: entity F1 and token accuracy reach 1 on held-out data.
    assert!(r["eval_f1"].as_f64().unwrap() >= 0.95, "{r}");
    assert!(r["eval_accuracy"].as_f64().unwrap() >= 0.98, "{r}");
    assert!(r["eval_LOC_number"].as_f64().unwrap() > 5.0, "{r}");
    // The training file's sorted tags are the head's labels.
    let saved: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(saved["id2label"]["0"], "B-LOC");
    assert_eq!(saved["id2label"]["3"], "O");
    assert_eq!(saved["architectures"][0], "BertForTokenClassification");

    // predict: tags per word and entities with character spans, from text or given words.
    let input = tmp.path().join("in.jsonl");
    std::fs::write(
        &input,
        "{\"id\": 1, \"text\": \"it rained in  paris, the most populous city\"}\n\
         {\"tokens\": [\"normandy\", \"was\", \"a\", \"delight\"]}\n",
    )
    .unwrap();
    let output = tmp.path().join("out.jsonl");
    ok(sprtrain()
        .args(["predict", "--task", "token-cls", "--model"])
        .arg(&out)
        .arg("--input")
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .output()
        .unwrap());
    let records: Vec<Value> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records[0]["id"], 1);
    assert_eq!(
        records[0]["words"],
        serde_json::json!(["it", "rained", "in", "paris,", "the", "most", "populous", "city"])
    );
    assert_eq!(records[0]["tags"][3], "B-LOC", "{}", records[0]);
    assert_eq!(records[0]["tags"][5], "B-MISC", "{}", records[0]);
    assert_eq!(records[0]["tags"][6], "I-MISC", "{}", records[0]);
    let entities = records[0]["entities"].as_array().unwrap();
    let text = "it rained in  paris, the most populous city";
    let span = |e: &Value| {
        let (s, t) = (
            e["start"].as_u64().unwrap() as usize,
            e["end"].as_u64().unwrap() as usize,
        );
        text[s..t].to_string()
    };
    assert_eq!(entities.len(), 2, "{entities:?}");
    assert_eq!(
        (entities[0]["type"].as_str(), span(&entities[0]).as_str()),
        (Some("LOC"), "paris,")
    );
    assert_eq!(entities[0]["text"], "paris,");
    assert_eq!(
        (entities[1]["type"].as_str(), span(&entities[1]).as_str()),
        (Some("MISC"), "most populous")
    );
    assert!(entities[1]["score"].as_f64().unwrap() > 0.5);
    assert_eq!(records[1]["tags"][0], "B-LOC");
    assert_eq!(records[1]["entities"][0]["text"], "normandy");
    assert_eq!(records[1]["entities"][0]["end"], 8);
}

/// A tag the training file does not have, in the evaluation file: one line naming the file
/// and line, a non-zero exit, and no output written.
#[test]
fn an_unknown_tag_is_refused_with_its_line() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, eval) = (tmp.path().join("train.conll"), tmp.path().join("dev.conll"));
    write_conll(&train, 20, 1);
    std::fs::write(&eval, "paris\tB-LOC\nrained\tB-WEATHER\n").unwrap();
    let out = tmp.path().join("run");
    let config = RunConfig::new(&fixtures().join("train_parity_mlm"), &train, &out)
        .set("model.task", "token-cls")
        .set_path("data.eval_file", &eval)
        .write(&tmp.path().join("bad.toml"));
    let run = sprtrain().arg("--config").arg(&config).output().unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains(
            "dev.conll:2: tag \"B-WEATHER\" is not in the label set (B-LOC, B-MISC, I-MISC, O)"
        ),
        "{stderr}"
    );
    assert!(!out.join("config.json").exists());
}
