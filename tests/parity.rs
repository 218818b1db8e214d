//! Forward, loss and gradient parity with Hugging Face transformers 5.23.0 on tiny random
//! models of every architecture and head (fixtures from scripts/make_fixtures.py): the
//! encoders (BERT, DistilBERT, RoBERTa, XLM-RoBERTa, ELECTRA with embeddings narrower than its
//! hidden size, DeBERTa-v3's layout with bucketed relative positions and DeBERTa-v2's with its
//! own position projections, ModernBERT with global and sliding-window layers; bare, sequence
//! and token classification, question answering, masked LM), and the decoders (GPT-2, Llama with GQA and llama3 rope scaling, tied Llama,
//! Mistral with a sliding window, Qwen2 with q/k/v biases, Qwen3 with q/k norms) on a right-padded
//! batch.
//!
//! Tolerances: fp32 forward (hidden states, logits, loss) 1e-5 absolute — libtorch and PyTorch
//! run the same kernels, so differences come only from op order (seen: ~1e-7); gradients 1e-4.

mod common;

use common::{fixtures, max_abs_diff, reference};
use sprtrain::models::{from_pretrained, EncoderInputs, Head, Labels};
use tch::Tensor;

const FORWARD_TOL: f64 = 1e-5;
const GRAD_TOL: f64 = 1e-4;

fn check_case(name: &str) {
    let dir = fixtures().join("parity").join(name);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let head = meta["head"].as_str().unwrap();
    let task = match head {
        "base" => Head::Base,
        "qa" => Head::QuestionAnswering,
        "causal-lm" => Head::CausalLm,
        "token-cls" => Head::TokenClassification,
        h if h.starts_with("mlm") => Head::MaskedLm,
        _ => Head::SequenceClassification,
    };
    let r = reference(&dir.join("reference.safetensors"));
    let p = from_pretrained(&dir, task, |_| Ok(()), 0).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    assert!(
        p.report.newly_initialised.is_empty(),
        "{name}: new {:?}",
        p.report.newly_initialised
    );
    assert!(
        p.report.unused.is_empty(),
        "{name}: unused {:?}",
        p.report.unused
    );

    let inputs = EncoderInputs {
        input_ids: r["input_ids"].shallow_clone(),
        attention_mask: r["attention_mask"].shallow_clone(),
        token_type_ids: Some(r["token_type_ids"].shallow_clone()),
    };
    let out = p.model.forward(&inputs, false);
    // The classification heads of BERT-like encoders and DistilBERT read the first position
    // alone, and their last layer computes only that one (`TaskModel::positions_read`).
    let first_only = task == Head::SequenceClassification
        && ["bert", "roberta", "xlm-roberta", "electra", "distilbert"]
            .iter()
            .any(|family| {
                name.strip_prefix(family)
                    .is_some_and(|r| r.starts_with("-seq"))
            });
    let reference_hidden = if first_only {
        r["hidden"].narrow(1, 0, 1)
    } else {
        r["hidden"].shallow_clone()
    };
    assert_eq!(
        out.hidden.size(),
        reference_hidden.size(),
        "{name}: hidden state's shape"
    );
    let d_hidden = max_abs_diff(&out.hidden, &reference_hidden);
    eprintln!("{name}: hidden max abs diff {d_hidden:e}");
    assert!(
        d_hidden <= FORWARD_TOL,
        "{name}: hidden differs by {d_hidden:e}"
    );

    let loss = match task {
        Head::Base => out.hidden.pow_tensor_scalar(3).mean(None),
        Head::QuestionAnswering => {
            let (s, e) = out.span_logits();
            for (got, key) in [(&s, "start_logits"), (&e, "end_logits")] {
                let d = max_abs_diff(got, &r[key]);
                assert!(d <= FORWARD_TOL, "{name}: {key} differ by {d:e}");
            }
            let spans = Labels::Spans {
                start: r["start_positions"].shallow_clone(),
                end: r["end_positions"].shallow_clone(),
            };
            p.model.loss(&out, &spans).unwrap()
        }
        _ => {
            // (DeBERTa returns a one-label regression's logits flattened to (B).)
            let d = max_abs_diff(&out.logits.reshape(r["logits"].size()), &r["logits"]);
            assert!(d <= FORWARD_TOL, "{name}: logits differ by {d:e}");
            let y = r["labels"].shallow_clone();
            let labels = match head {
                "seq-cls-single" | "seq-cls" => Labels::Classes(y),
                "seq-cls-multi" => Labels::MultiHot(y),
                "seq-cls-regression" => Labels::Values(y),
                _ => Labels::Tokens(y),
            };
            p.model.loss(&out, &labels).unwrap()
        }
    };
    let d_loss = max_abs_diff(&loss.view([1]), &r["loss"]);
    assert!(
        d_loss <= FORWARD_TOL,
        "{name}: loss {} vs {}, differs by {d_loss:e}",
        loss.double_value(&[]),
        r["loss"].double_value(&[0])
    );

    loss.backward();
    let vars = p.vs.variables();
    let grads = meta["grad_params"].as_array().unwrap();
    assert!(grads.len() >= 3, "{name}: fixture checks too few gradients");
    for g in grads {
        let g = g.as_str().unwrap();
        let var = vars
            .get(g)
            .unwrap_or_else(|| panic!("{name}: no variable {g}"));
        let d = max_abs_diff(&var.grad(), &r[&format!("grad.{g}")]);
        let scale = r[&format!("grad.{g}")].abs().max().double_value(&[]);
        assert!(
            scale > 0.0,
            "{name}: reference gradient of {g} is zero, the check would be vacuous"
        );
        eprintln!("{name}: grad {g} max abs diff {d:e} (scale {scale:e})");
        assert!(d <= GRAD_TOL, "{name}: gradient of {g} differs by {d:e}");
    }
}

macro_rules! parity_tests {
    ($($test:ident => $case:literal),* $(,)?) => {
        $(#[test] fn $test() { check_case($case); })*
    };
}

parity_tests! {
    bert_base => "bert-base",
    bert_seq_cls_single_sharded => "bert-seq-cls-single",
    bert_seq_cls_multi => "bert-seq-cls-multi",
    bert_seq_cls_regression => "bert-seq-cls-regression",
    bert_qa_legacy_gamma_beta => "bert-qa",
    bert_mlm => "bert-mlm",
    bert_mlm_untied => "bert-mlm-untied",
    bert_token_cls => "bert-token-cls",
    distilbert_token_cls => "distilbert-token-cls",
    roberta_token_cls => "roberta-token-cls",
    xlm_roberta_base => "xlm-roberta-base",
    xlm_roberta_seq_cls_single => "xlm-roberta-seq-cls-single",
    xlm_roberta_seq_cls_multi => "xlm-roberta-seq-cls-multi",
    xlm_roberta_seq_cls_regression => "xlm-roberta-seq-cls-regression",
    xlm_roberta_qa => "xlm-roberta-qa",
    xlm_roberta_mlm => "xlm-roberta-mlm",
    xlm_roberta_token_cls => "xlm-roberta-token-cls",
    electra_base => "electra-base",
    electra_seq_cls_single => "electra-seq-cls-single",
    electra_seq_cls_multi => "electra-seq-cls-multi",
    electra_seq_cls_regression => "electra-seq-cls-regression",
    electra_qa => "electra-qa",
    electra_mlm_generator => "electra-mlm",
    electra_token_cls => "electra-token-cls",
    deberta_v3_base => "deberta-v2-base",
    deberta_v3_seq_cls_single => "deberta-v2-seq-cls-single",
    deberta_v3_seq_cls_multi => "deberta-v2-seq-cls-multi",
    deberta_v3_seq_cls_regression => "deberta-v2-seq-cls-regression",
    deberta_v3_qa => "deberta-v2-qa",
    deberta_v3_mlm_legacy_head => "deberta-v2-mlm",
    deberta_v3_token_cls => "deberta-v2-token-cls",
    deberta_v2_own_position_projections_base => "deberta-v2-own-base",
    deberta_v2_own_position_projections_seq_cls => "deberta-v2-own-seq-cls-single",
    modernbert_base_global_and_local_layers => "modernbert-base",
    modernbert_seq_cls_single => "modernbert-seq-cls-single",
    modernbert_seq_cls_multi => "modernbert-seq-cls-multi",
    modernbert_seq_cls_regression => "modernbert-seq-cls-regression",
    modernbert_seq_cls_mean_pooling => "modernbert-mean-seq-cls-single",
    modernbert_qa => "modernbert-qa",
    modernbert_mlm => "modernbert-mlm",
    modernbert_token_cls => "modernbert-token-cls",
    distilbert_base => "distilbert-base",
    distilbert_seq_cls_single => "distilbert-seq-cls-single",
    distilbert_seq_cls_multi => "distilbert-seq-cls-multi",
    distilbert_seq_cls_regression => "distilbert-seq-cls-regression",
    distilbert_qa => "distilbert-qa",
    distilbert_mlm => "distilbert-mlm",
    roberta_base => "roberta-base",
    roberta_seq_cls_single => "roberta-seq-cls-single",
    roberta_seq_cls_multi => "roberta-seq-cls-multi",
    roberta_seq_cls_regression => "roberta-seq-cls-regression",
    roberta_qa => "roberta-qa",
    roberta_mlm => "roberta-mlm",
    gpt2_causal_lm => "gpt2-causal-lm",
    gpt2_seq_cls_last_token => "gpt2-seq-cls",
    llama_causal_lm_gqa_llama3_rope => "llama-causal-lm",
    llama_causal_lm_tied => "llama-tied-causal-lm",
    llama_seq_cls_last_token => "llama-seq-cls",
    mistral_causal_lm_sliding_window => "mistral-causal-lm",
    qwen2_causal_lm_qkv_bias => "qwen2-causal-lm",
    qwen3_causal_lm_qk_norm => "qwen3-causal-lm",
}

/// A task checkpoint loads as the bare model (prefix stripped, head reported unused) and gives
/// the same hidden state; padding never changes real tokens' outputs.
#[test]
fn task_checkpoint_loads_as_base_model_and_padding_is_inert() {
    let dir = fixtures().join("parity").join("roberta-seq-cls-single");
    let r = reference(&dir.join("reference.safetensors"));
    let p = from_pretrained(&dir, Head::Base, |_| Ok(()), 0).unwrap();
    assert_eq!(
        p.report.unused,
        [
            "classifier.dense.bias",
            "classifier.dense.weight",
            "classifier.out_proj.bias",
            "classifier.out_proj.weight"
        ]
    );
    // RoBERTa has no pooler in task checkpoints: the bare model's pooler is new.
    assert_eq!(
        p.report.newly_initialised,
        ["pooler.dense.bias", "pooler.dense.weight"]
    );
    let inputs = EncoderInputs {
        input_ids: r["input_ids"].shallow_clone(),
        attention_mask: r["attention_mask"].shallow_clone(),
        token_type_ids: None,
    };
    let hidden = p.model.forward(&inputs, false).hidden;
    assert!(max_abs_diff(&hidden, &r["hidden"]) <= FORWARD_TOL);

    // Row 0 alone, without the batch's padding, against the same row padded to T + 7.
    let real = r["attention_mask"].get(0).sum(None).int64_value(&[]);
    let ids = r["input_ids"].get(0).narrow(0, 0, real).unsqueeze(0);
    let alone = p
        .model
        .forward(
            &EncoderInputs {
                attention_mask: ids.ones_like(),
                input_ids: ids.shallow_clone(),
                token_type_ids: None,
            },
            false,
        )
        .hidden;
    let padded_ids = Tensor::cat(
        &[
            ids.shallow_clone(),
            Tensor::full([1, 7], 1, (tch::Kind::Int64, tch::Device::Cpu)),
        ],
        1,
    );
    let padded_mask = Tensor::cat(
        &[
            ids.ones_like(),
            Tensor::zeros([1, 7], (tch::Kind::Int64, tch::Device::Cpu)),
        ],
        1,
    );
    let padded = p
        .model
        .forward(
            &EncoderInputs {
                input_ids: padded_ids,
                attention_mask: padded_mask,
                token_type_ids: None,
            },
            false,
        )
        .hidden;
    let d = max_abs_diff(&padded.narrow(1, 0, real), &alone);
    assert!(d <= FORWARD_TOL, "padding changed real tokens by {d:e}");
}
