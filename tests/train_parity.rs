//! Training parity with transformers: the same tiny model, the same 20 batches, AdamW with
//! weight decay off biases and normalisation weights, warmup then decay, clipping at 1.0.
//! Per-step losses must agree within 1e-4 relative (fp32; the two sides differ only in op
//! order, seen ~1e-6), learning rates exactly, final weights within 1e-4. Three recipes: a BERT
//! classifier with a linear schedule, a Llama causal LM (GQA, untied head) with a cosine
//! schedule and beta2 0.95, and run_mlm.py's masked LM on batches masked by transformers'
//! DataCollatorForLanguageModeling (the same masks on both sides; sprtrain's own masking is
//! checked against the collator's statistics in `masking_statistics_match_the_collator`).

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

#[test]
fn twenty_masked_lm_steps_with_the_collators_masks_match_transformers() {
    check_training(
        "train_parity_mlm",
        Head::MaskedLm,
        Labels::Tokens,
        &[
            "cls.predictions.transform.dense.weight",
            "bert.encoder.layer.1.output.dense.weight",
        ],
    );
}

/// sprtrain's masking of the fixture texts, repeated 200 times as the collator's were,
/// against transformers' DataCollatorForLanguageModeling's counts on the same tokens: the
/// shares chosen, replaced by [MASK] and kept agree within 1.5 points (binomial standard
/// deviations: 0.2 points chosen, 0.6 replaced and kept, on each side), and neither side
/// ever chooses a special token.
#[test]
fn masking_statistics_match_the_collator() {
    use sprtrain::data::batching::{Feature, Target};
    use sprtrain::data::masking::Masking;
    let dir = fixtures().join("train_parity_mlm");
    let hp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let theirs = &hp["collator_stats"];
    let n = |k: &str| theirs[k].as_f64().unwrap();
    let masking = Masking::new(&dir.join("tokenizer.json"), 0.15, false, 7).unwrap();
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    // The texts the fixture masked: its 20 batches hold them; re-encode the corpus lines.
    let r = reference(&dir.join("reference.safetensors"));
    let mut sequences: Vec<Vec<i64>> = Vec::new();
    for step in 0..20 {
        let ids = &r[&format!("input_ids.{step}")];
        let labels = &r[&format!("labels.{step}")];
        // Unmask: where a label is set, the original token is the label.
        let original = labels.where_self(&labels.ge(0), ids);
        let mask = &r[&format!("attention_mask.{step}")];
        for row in 0..original.size()[0] {
            let len = mask.get(row).sum(None).int64_value(&[]);
            sequences.push(Vec::<i64>::try_from(original.get(row).narrow(0, 0, len)).unwrap());
        }
    }
    let special: Vec<i64> = tok
        .get_added_tokens_decoder()
        .iter()
        .filter(|(_, t)| t.special)
        .map(|(&id, _)| id as i64)
        .collect();
    let (mut maskable, mut chosen, mut replaced, mut kept, mut special_chosen) = (0, 0, 0, 0, 0);
    for (i, ids) in sequences
        .iter()
        .cycle()
        .take(sequences.len() * 200)
        .enumerate()
    {
        let f = Feature {
            input_ids: ids.clone(),
            type_ids: vec![0; ids.len()],
            target: Target::Masked,
        };
        let masked = masking.mask(&f, 0, i);
        let Target::Tokens(labels) = &masked.target else {
            panic!("masking gives token labels")
        };
        for t in 0..ids.len() {
            let is_special = special.contains(&ids[t]);
            maskable += usize::from(!is_special);
            if labels[t] != -100 {
                chosen += 1;
                special_chosen += usize::from(is_special);
                replaced += usize::from(masked.input_ids[t] == masking.mask_id);
                kept += usize::from(masked.input_ids[t] == ids[t]);
            }
        }
    }
    let ours = [
        chosen as f64 / maskable as f64,
        replaced as f64 / chosen as f64,
        kept as f64 / chosen as f64,
    ];
    let reference = [
        n("chosen") / n("maskable"),
        n("replaced_by_mask") / n("chosen"),
        n("kept") / n("chosen"),
    ];
    eprintln!(
        "masking shares (chosen, [MASK], kept): sprtrain {ours:.4?}, transformers {reference:.4?}"
    );
    for (o, t) in ours.iter().zip(reference) {
        assert!((o - t).abs() < 0.015, "{ours:?} vs {reference:?}");
    }
    assert_eq!(special_chosen, 0);
    assert_eq!(n("special_chosen"), 0.0);
}
