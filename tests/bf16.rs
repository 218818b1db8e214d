//! BF16 mixed precision on tiny shapes: matmuls in bf16, parameters, gradients, LayerNorm
//! outputs and the loss in fp32, results close to fp32. bf16 keeps 8 mantissa bits
//! (relative error ~4e-3 per rounding), so logits agree to ~1e-2 and gradient directions to
//! a cosine above 0.99 on this 2-layer model.

mod common;

use common::{fixtures, reference};
use sprtrain::models::layers::autocast;
use sprtrain::models::{from_pretrained, EncoderInputs, Head, Labels};
use tch::{Kind, Tensor};

fn cosine(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (
        a.to_kind(Kind::Double).view([-1]),
        b.to_kind(Kind::Double).view([-1]),
    );
    (a.dot(&b) / (a.norm() * b.norm())).double_value(&[])
}

#[test]
fn bf16_compute_keeps_fp32_master_state_and_tracks_fp32() {
    let dir = fixtures().join("parity").join("bert-seq-cls-single");
    let r = reference(&dir.join("reference.safetensors"));
    let p = from_pretrained(&dir, Head::SequenceClassification, |_| Ok(()), 0).unwrap();
    let inputs = EncoderInputs {
        input_ids: r["input_ids"].shallow_clone(),
        attention_mask: r["attention_mask"].shallow_clone(),
        token_type_ids: Some(r["token_type_ids"].shallow_clone()),
    };
    let labels = Labels::Classes(r["labels"].shallow_clone());
    let grad_name = "bert.encoder.layer.0.attention.self.query.weight";
    let var = p.vs.variables()[grad_name].shallow_clone();

    let fp32 = p.model.forward(&inputs, false);
    p.model.loss(&fp32, &labels).unwrap().backward();
    let fp32_grad = var.grad().copy();
    let mut var_mut = var.shallow_clone();
    var_mut.zero_grad();

    let (out, loss) = {
        let _bf16 = autocast(Some(Kind::BFloat16));
        let out = p.model.forward(&inputs, false);
        let loss = p.model.loss(&out, &labels).unwrap();
        (out, loss)
    };
    assert_eq!(
        out.logits.kind(),
        Kind::BFloat16,
        "linear layers compute in bf16"
    );
    assert_eq!(
        out.hidden.kind(),
        Kind::Float,
        "LayerNorm output stays fp32"
    );
    assert_eq!(loss.kind(), Kind::Float, "the loss is fp32");
    loss.backward();
    assert_eq!(
        (var.kind(), var.grad().kind()),
        (Kind::Float, Kind::Float),
        "master weights and gradients are fp32"
    );

    let d = (out.logits.to_kind(Kind::Float) - &fp32.logits)
        .abs()
        .max()
        .double_value(&[]);
    eprintln!(
        "bf16 vs fp32: logits max abs diff {d:e}, gradient cosine {}",
        cosine(&var.grad(), &fp32_grad)
    );
    assert!(d < 2e-2, "bf16 logits drift {d}");
    assert!(cosine(&var.grad(), &fp32_grad) > 0.99);
    // The guard restores fp32.
    assert_eq!(p.model.forward(&inputs, false).logits.kind(), Kind::Float);
}

/// Decoders under bf16: every family's logits track fp32 (rotary tables, RMSNorm and the loss
/// stay fp32; Qwen3's fp32 q/k norms meet bf16 values in attention), gradients point the same
/// way.
#[test]
fn bf16_decoders_track_fp32() {
    for case in [
        "gpt2-causal-lm",
        "llama-causal-lm",
        "mistral-causal-lm",
        "qwen2-causal-lm",
        "qwen3-causal-lm",
    ] {
        let dir = fixtures().join("parity").join(case);
        let r = reference(&dir.join("reference.safetensors"));
        let p = from_pretrained(&dir, Head::CausalLm, |_| Ok(()), 0).unwrap();
        let inputs = EncoderInputs {
            input_ids: r["input_ids"].shallow_clone(),
            attention_mask: r["attention_mask"].shallow_clone(),
            token_type_ids: None,
        };
        let labels = Labels::Tokens(r["labels"].shallow_clone());
        let (name, var) =
            p.vs.variables()
                .into_iter()
                .find(|(n, _)| n.contains("layers.0.") || n.contains("h.0.attn.c_attn.weight"))
                .unwrap();
        let fp32 = p.model.forward(&inputs, false);
        p.model.loss(&fp32, &labels).unwrap().backward();
        let fp32_grad = var.grad().copy();
        p.vs.variables().values_mut().for_each(|v| v.zero_grad());
        let out = {
            let _bf16 = autocast(Some(Kind::BFloat16));
            let out = p.model.forward(&inputs, false);
            p.model.loss(&out, &labels).unwrap().backward();
            out
        };
        let d = (out.logits.to_kind(Kind::Float) - &fp32.logits)
            .abs()
            .max()
            .double_value(&[]);
        let c = cosine(&var.grad(), &fp32_grad);
        eprintln!("{case}: bf16 logits max abs diff {d:e}, gradient cosine of {name} {c}");
        assert!(d < 2e-2, "{case}: bf16 logits drift {d}");
        assert!(c > 0.99, "{case}: {c}");
    }
}
