"""run_qa.py's training labels, shared by scripts/make_fixtures.py and scripts/bench_reference.py.

`prepare_train_features` in transformers' examples/pytorch/question-answering/run_qa.py gives
each window the token positions of its example's first answer, or the CLS position when the
answer is not wholly inside the window's context.
"""


def answer_positions(tok, enc, answers):
    """(start, end) token positions for every window of `enc` (a fast tokenizer's output with
    overflowing tokens and offsets); answers[i] = (answer text, answer_start) of example i."""
    positions = []
    for i, offsets in enumerate(enc["offset_mapping"]):
        ids = enc["input_ids"][i]
        cls_index = ids.index(tok.cls_token_id)
        seq = enc.sequence_ids(i)
        text, start_char = answers[enc["overflow_to_sample_mapping"][i]]
        end_char = start_char + len(text)
        ts = 0
        while seq[ts] != 1:
            ts += 1
        te = len(ids) - 1
        while seq[te] != 1:
            te -= 1
        if not (offsets[ts][0] <= start_char and offsets[te][1] >= end_char):
            positions.append((cls_index, cls_index))
            continue
        while ts < len(offsets) and offsets[ts][0] <= start_char:
            ts += 1
        while offsets[te][1] >= end_char:
            te -= 1
        positions.append((ts - 1, te + 1))
    return positions
