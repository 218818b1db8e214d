//! Activation checkpointing (`train.gradient_checkpointing`): every layer runs
//! without a graph in forward and again in backward, its dropout masks redrawn from the same
//! seeds. For every family (and the heads that read only the first token), with dropout on,
//! the loss and every parameter's gradient equal the uncheckpointed pass's bit for bit: the
//! recomputation runs the same kernels on the same inputs with the same masks, and backward
//! then runs the same ops stage by stage as the staged pass does; against one plain backward
//! (no stages) they agree within 1e-6 relative, where only the order in which a tensor's
//! gradient contributions are added may differ.

mod common;

use sprtrain::models::layers::seed_dropout;
use sprtrain::models::{backward_by_stages, from_pretrained, EncoderInputs, Head, Labels};
use tch::{Kind, Tensor};

/// How a pass runs backward.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Pass {
    Plain,
    Staged,
    Checkpointed,
}

/// Two rows of 12 tokens, the second padded after 9, and labels for `head`.
fn batch(vocab: i64, head: Head) -> (EncoderInputs, Labels) {
    let (b, t) = (2i64, 12i64);
    let ids: Vec<i64> = (0..b * t)
        .map(|i| 5 + (i * 37 + 11) % (vocab - 5))
        .collect();
    let ids = Tensor::from_slice(&ids).view([b, t]);
    let mut mask = vec![1i64; (b * t) as usize];
    mask[(t + 9) as usize..].fill(0);
    let mask = Tensor::from_slice(&mask).view([b, t]);
    let tokens = ids.where_self(&mask.ne(0), &Tensor::from(-100i64));
    let labels = match head {
        Head::SequenceClassification => Labels::Classes(Tensor::from_slice(&[0i64, 1])),
        Head::TokenClassification => Labels::Tokens(
            tokens
                .remainder(2)
                .where_self(&mask.ne(0), &Tensor::from(-100i64)),
        ),
        Head::QuestionAnswering => Labels::Spans {
            start: Tensor::from_slice(&[1i64, 3]),
            end: Tensor::from_slice(&[2i64, 6]),
        },
        // Masked LM scores every third real token.
        Head::MaskedLm => {
            let every_third = Tensor::arange(b * t, (Kind::Int64, tch::Device::Cpu))
                .remainder(3)
                .eq(0)
                .view([b, t]);
            Labels::Tokens(tokens.where_self(&every_third, &Tensor::from(-100i64)))
        }
        Head::CausalLm | Head::Base => Labels::Tokens(tokens),
    };
    let inputs = EncoderInputs {
        input_ids: ids,
        attention_mask: mask,
        token_type_ids: Some(Tensor::zeros([b, t], (Kind::Int64, tch::Device::Cpu))),
    };
    (inputs, labels)
}

/// The loss and every trainable parameter's gradient (by name) of one training pass over the
/// batch, dropout seeded the same way each time.
fn pass(fixture: &str, head: Head, how: Pass) -> (f64, Vec<(String, Tensor)>) {
    let dir = common::fixtures().join("parity").join(fixture);
    // Dropout on everywhere a family has it, so the recomputation must redraw the masks.
    let p = from_pretrained(
        &dir,
        head,
        |c| {
            c.hidden_dropout = 0.1;
            c.attention_dropout = 0.1;
            Ok(())
        },
        0,
    )
    .unwrap();
    let (inputs, labels) = batch(p.model.config.vocab_size, head);
    seed_dropout(7);
    let loss = match how {
        Pass::Plain => {
            let out = p.model.forward(&inputs, true);
            let loss = p.model.loss(&out, &labels).unwrap();
            loss.backward();
            loss
        }
        Pass::Staged | Pass::Checkpointed => {
            let (out, stages) = p
                .model
                .forward_staged(&inputs, true, how == Pass::Checkpointed);
            let loss = p.model.loss(&out, &labels).unwrap();
            backward_by_stages(&loss, &stages, |_| Ok(())).unwrap();
            loss
        }
    };
    let mut grads: Vec<(String, Tensor)> =
        p.vs.variables()
            .into_iter()
            .filter(|(_, v)| v.requires_grad())
            .map(|(name, v)| (name, v.grad().copy()))
            .collect();
    grads.sort_by(|a, b| a.0.cmp(&b.0));
    (loss.double_value(&[]), grads)
}

#[test]
fn checkpointed_gradients_equal_the_uncheckpointed_ones_in_every_family() {
    let cases = [
        ("bert-seq-cls-single", Head::SequenceClassification),
        ("bert-qa", Head::QuestionAnswering),
        ("roberta-token-cls", Head::TokenClassification),
        ("xlm-roberta-mlm", Head::MaskedLm),
        ("electra-seq-cls-single", Head::SequenceClassification),
        ("distilbert-seq-cls-single", Head::SequenceClassification),
        ("distilbert-mlm", Head::MaskedLm),
        ("deberta-v2-token-cls", Head::TokenClassification),
        ("modernbert-mlm", Head::MaskedLm),
        ("gpt2-causal-lm", Head::CausalLm),
        ("llama-causal-lm", Head::CausalLm),
        ("llama-seq-cls", Head::SequenceClassification),
        ("mistral-causal-lm", Head::CausalLm),
        ("qwen3-causal-lm", Head::CausalLm),
    ];
    for (fixture, head) in cases {
        let (plain_loss, plain) = pass(fixture, head, Pass::Plain);
        let (staged_loss, staged) = pass(fixture, head, Pass::Staged);
        let (loss, checkpointed) = pass(fixture, head, Pass::Checkpointed);
        assert_eq!(loss, staged_loss, "{fixture}: loss");
        assert_eq!(loss, plain_loss, "{fixture}: loss against the plain pass");
        let mut worst = 0.0f64;
        for ((name, g), ((_, s), (_, q))) in checkpointed.iter().zip(staged.iter().zip(&plain)) {
            assert!(
                g.defined() && g.abs().max().double_value(&[]) > 0.0,
                "{fixture}: {name} has no gradient"
            );
            assert!(g.equal(s), "{fixture}: {name} differs from the staged pass");
            let scale = q.abs().max().double_value(&[]).max(1e-30);
            worst = worst.max((g - q).abs().max().double_value(&[]) / scale);
        }
        eprintln!(
            "{fixture}: loss {loss:.6}, {} gradients equal the staged pass's; against one plain backward {worst:e} relative",
            checkpointed.len()
        );
        assert!(worst <= 1e-6, "{fixture}: {worst:e} from the plain pass");
    }
}
