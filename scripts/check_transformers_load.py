#!/usr/bin/env python3
"""Loads a model directory written by sprtrain with transformers and prints, as JSON, the
loading report (missing / unexpected / mismatched keys) and the logits on given token ids.

    .venv-ref/bin/python scripts/check_transformers_load.py DIR IDS.json

IDS.json: {"input_ids": [[...]], "attention_mask": [[...]], "token_type_ids": [[...]]}.
Used by tests/train_cli.rs to check sprtrain's checkpoints against transformers 5.23.0.
"""
import json
import sys

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer


def main() -> int:
    model_dir, ids_path = sys.argv[1], sys.argv[2]
    model, info = AutoModelForSequenceClassification.from_pretrained(model_dir, output_loading_info=True)
    model.eval()
    AutoTokenizer.from_pretrained(model_dir)  # the tokenizer files load too
    batch = {k: torch.tensor(v) for k, v in json.load(open(ids_path)).items()}
    if model.config.model_type == "distilbert":
        batch.pop("token_type_ids", None)
    with torch.no_grad():
        logits = model(**batch).logits
    print(json.dumps({
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "mismatched_keys": [list(map(str, m)) for m in info.get("mismatched_keys", [])],
        "id2label": {str(k): v for k, v in model.config.id2label.items()},
        "logits": logits.tolist(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
