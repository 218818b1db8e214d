//! Training parity with transformers: the same tiny model, the same 20 batches, AdamW with
//! weight decay off biases and normalisation weights, warmup then decay, clipping at 1.0.
//! Per-step losses must agree within 1e-4 relative (fp32; the two sides differ only in op
//! order, seen ~1e-6), learning rates exactly, final weights within 1e-4. Two recipes: a BERT
//! classifier with a linear schedule, and a Llama causal LM (GQA, untied head) with a cosine
//! schedule and beta2 0.95.

mod common;

use common::{fixtures, max_abs_diff, reference};
use sprtrain::config::TrainConfig;
use sprtrain::models::{from_pretrained, EncoderInputs, Head, Labels};
use sprtrain::optim::{FlatParams, ScheduleKind};
use sprtrain::train::optimizer;
use tch::Tensor;

fn check_training(fixture: &str, head: Head, labels: fn(Tensor) -> Labels, finals: &[&str]) {
    let dir = fixtures().join(fixture);
    let r = reference(&dir.join("reference.safetensors"));
    let hp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let steps = hp["steps"].as_i64().unwrap();
    let p = from_pretrained(&dir, head, |_| Ok(()), 0).unwrap();
    // transformers' recipe as a config: the engine builds its optimizer (clip -> lr -> AdamW
    // -> zero) from it exactly as a training run does.
    let tc = TrainConfig {
        learning_rate: hp["lr"].as_f64().unwrap(),
        weight_decay: hp["weight_decay"].as_f64().unwrap(),
        warmup_steps: hp["warmup_steps"].as_u64().unwrap() as usize,
        max_grad_norm: hp["max_grad_norm"].as_f64().unwrap(),
        adam_beta2: hp["adam_beta2"].as_f64().unwrap_or(0.999),
        lr_scheduler: match hp["lr_scheduler"].as_str().unwrap_or("linear") {
            "cosine" => ScheduleKind::Cosine,
            _ => ScheduleKind::Linear,
        },
        ..TrainConfig::default()
    };
    let flat = FlatParams::new(&p.vs, |n| p.model.backward_stage(n));
    let mut opt = optimizer(&tc, flat, steps as usize).unwrap();
    let want: Vec<f64> = Vec::try_from(&r["losses"]).unwrap();
    let want_lr: Vec<f64> = Vec::try_from(&r["lrs"]).unwrap();
    for step in 0..steps {
        let get = |k: &str| r[&format!("{k}.{step}")].shallow_clone();
        let inputs = EncoderInputs {
            input_ids: get("input_ids"),
            attention_mask: get("attention_mask"),
            token_type_ids: Some(get("token_type_ids")),
        };
        let out = p.model.forward(&inputs, true);
        let loss = p.model.loss(&out, &labels(get("labels"))).unwrap();
        loss.backward();
        let lr = opt.step(step as usize).lr;
        assert!(
            (lr - want_lr[step as usize]).abs() < 1e-15,
            "step {step}: lr {lr} vs {}",
            want_lr[step as usize]
        );
        let (got, w) = (loss.double_value(&[]), want[step as usize]);
        let rel = (got - w).abs() / w.abs();
        eprintln!("step {step}: loss {got:.7} vs transformers {w:.7} (relative {rel:.1e})");
        assert!(rel <= 1e-4, "step {step}: loss {got} vs {w}");
    }
    let vars = p.vs.variables();
    for name in finals {
        let d = max_abs_diff(&vars[*name], &r[&format!("final.{name}")]);
        eprintln!("final {name}: max abs diff {d:e}");
        assert!(d <= 1e-4, "final {name} differs by {d:e}");
    }
}

#[test]
fn twenty_steps_match_torch_adamw_and_transformers_schedule() {
    check_training(
        "train_parity",
        Head::SequenceClassification,
        Labels::Classes,
        &[
            "classifier.weight",
            "bert.encoder.layer.1.output.dense.weight",
        ],
    );
}

#[test]
fn twenty_causal_lm_steps_of_a_llama_match_transformers() {
    check_training(
        "train_parity_llama",
        Head::CausalLm,
        Labels::Tokens,
        &["lm_head.weight", "model.layers.1.mlp.down_proj.weight"],
    );
}
