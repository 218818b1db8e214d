//! Question-answering features equal transformers' run_qa.py preprocessing (fixture from
//! scripts/make_fixtures.py with all-MiniLM-L6-v2's tokenizer): the same windows of every
//! example — long contexts overflow into many — with the same token ids, token types, context
//! offsets (in characters, non-ASCII text included) and start/end labels. Exact equality.

mod common;

use common::{fixtures, require_minilm};
use serde_json::Value;
use sprtrain::data::squad::{encode_pairs, load_squad_json, qa_features, qa_tokenizer};

#[test]
fn windows_offsets_and_labels_match_run_qa() {
    let Some(model) = require_minilm() else {
        return;
    };
    let dir = fixtures().join("qa");
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("features_reference.json")).unwrap(),
    )
    .unwrap();
    let max_len = reference["max_seq_len"].as_u64().unwrap() as usize;
    let stride = reference["doc_stride"].as_u64().unwrap() as usize;
    let examples = load_squad_json(&dir.join("squad_v1.json")).unwrap();
    assert_eq!(examples.len(), 6);
    let tok = qa_tokenizer(&model.join("tokenizer.json"), max_len, stride).unwrap();
    let ours = qa_features(&tok, &examples).unwrap();
    let theirs = reference["features"].as_array().unwrap();
    assert_eq!(ours.len(), theirs.len(), "number of windows");
    for (i, (f, r)) in ours.iter().zip(theirs).enumerate() {
        let ex = &examples[f.example];
        assert_eq!(
            ex.id,
            r["example"].as_str().unwrap(),
            "feature {i}: example"
        );
        let ids: Vec<i64> = serde_json::from_value(r["input_ids"].clone()).unwrap();
        assert_eq!(f.input.input_ids, ids, "feature {i} ({}): input ids", ex.id);
        let types: Vec<i64> = serde_json::from_value(r["token_type_ids"].clone()).unwrap();
        assert_eq!(f.input.type_ids, types, "feature {i}: token types");
        let offsets: Vec<Option<(usize, usize)>> =
            serde_json::from_value(r["offsets"].clone()).unwrap();
        assert_eq!(f.offsets, offsets, "feature {i}: offsets");
        assert_eq!(
            f.span(),
            (
                r["start_position"].as_i64().unwrap(),
                r["end_position"].as_i64().unwrap()
            ),
            "feature {i} ({}): labels",
            ex.id
        );
    }
    // Each answer is labelled inside exactly one window, and the label spans its text.
    for (e, ex) in examples.iter().enumerate() {
        let labelled: Vec<_> = ours
            .iter()
            .filter(|f| f.example == e && f.span().0 > 0)
            .collect();
        assert_eq!(labelled.len(), 1, "{}", ex.id);
        let f = labelled[0];
        let (start, end) = f.span();
        let (a, _) = f.offsets[start as usize].unwrap();
        let (_, b) = f.offsets[end as usize].unwrap();
        let span: String = ex.context.chars().skip(a).take(b - a).collect();
        assert_eq!(span, ex.answers[0].0, "{}", ex.id);
    }
}

#[test]
fn squad_json_errors_are_clear() {
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = tmp.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let p = write("bad.json", "{\"data\": [");
    let e = load_squad_json(&p).unwrap_err().to_string();
    assert!(
        e.contains("invalid JSON") && e.contains("line 1 column 10"),
        "{e}"
    );
    let q = |id: &str| format!("{{{id}\"question\": \"q\", \"answers\": []}}");
    let p = write(
        "noid.json",
        &format!(
            "{{\"data\": [{{\"paragraphs\": [{{\"context\": \"c\", \"qas\": [{}]}}]}}]}}",
            q("")
        ),
    );
    assert!(load_squad_json(&p)
        .unwrap_err()
        .to_string()
        .contains("has no id"));
    let two = format!("{}, {}", q("\"id\": \"x\", "), q("\"id\": \"x\", "));
    let p = write(
        "dup.json",
        &format!("{{\"data\": [{{\"paragraphs\": [{{\"context\": \"c\", \"qas\": [{two}]}}]}}]}}"),
    );
    assert!(load_squad_json(&p)
        .unwrap_err()
        .to_string()
        .contains("duplicate question id x"));
}

/// Every field of two encodings, their overflowing windows included, is the same.
fn assert_same_encoding(a: &tokenizers::Encoding, b: &tokenizers::Encoding, what: &str) {
    assert_eq!(a.get_ids(), b.get_ids(), "{what}: ids");
    assert_eq!(a.get_type_ids(), b.get_type_ids(), "{what}: token types");
    assert_eq!(a.get_tokens(), b.get_tokens(), "{what}: tokens");
    assert_eq!(a.get_offsets(), b.get_offsets(), "{what}: offsets");
    assert_eq!(a.get_word_ids(), b.get_word_ids(), "{what}: words");
    assert_eq!(
        a.get_sequence_ids(),
        b.get_sequence_ids(),
        "{what}: sequences"
    );
    assert_eq!(
        a.get_special_tokens_mask(),
        b.get_special_tokens_mask(),
        "{what}: special"
    );
    assert_eq!(
        a.get_attention_mask(),
        b.get_attention_mask(),
        "{what}: attention"
    );
    assert_eq!(
        a.get_overflowing().len(),
        b.get_overflowing().len(),
        "{what}: windows"
    );
    for (i, (x, y)) in a
        .get_overflowing()
        .iter()
        .zip(b.get_overflowing())
        .enumerate()
    {
        assert_same_encoding(x, y, &format!("{what}, window {}", i + 1));
    }
}

/// Pairs encoded with each context tokenized once equal pairs encoded whole, as tokenizers
/// encodes them, on every XQuAD question (240 paragraphs, 1,190 questions, some in several
/// windows), at run_qa.py's 384/128 and at 64/16 where nearly every pair overflows.
#[test]
fn shared_context_encoding_equals_whole_pair_encoding() {
    let xquad =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/squad/xquad.en.json");
    let Some(xquad) = common::require(
        xquad.is_file().then_some(xquad),
        "../shared/data/squad is absent",
    ) else {
        return;
    };
    let examples = load_squad_json(&xquad).unwrap();
    assert_eq!(examples.len(), 1190);
    let tokenizer = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("configs/models/distilbert-base-uncased/tokenizer.json");
    for (max_len, stride) in [(384, 128), (64, 16)] {
        let tok = qa_tokenizer(&tokenizer, max_len, stride).unwrap();
        let shared = encode_pairs(&tok, &examples).unwrap();
        let pairs: Vec<tokenizers::EncodeInput> = examples
            .iter()
            .map(|e| (e.question.trim_start(), e.context.as_str()).into())
            .collect();
        let whole = tok.encode_batch_char_offsets(pairs, true).unwrap();
        assert_eq!(shared.len(), whole.len());
        let windows: usize = whole.iter().map(|e| 1 + e.get_overflowing().len()).sum();
        assert!(windows > examples.len(), "{max_len}: some pairs overflow");
        for (i, (a, b)) in shared.iter().zip(&whole).enumerate() {
            assert_same_encoding(a, b, &format!("{max_len}/{stride}, example {i}"));
        }
    }
}
