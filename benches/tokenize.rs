//! Tokenization throughput on SST-2's training sentences (../shared/data/sst2/train.tsv) with
//! the bert-base-uncased WordPiece vocabulary (all-MiniLM-L6-v2's tokenizer.json), through the
//! encoder the data pipeline uses (parallel `encode_batch`, offsets included), 128 tokens max.
//!
//!   cargo bench --bench tokenize

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use sprtrain::data::tokenizer::{TextTokenizer, Truncation};

fn main() -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let data = root.join("../shared/data/sst2/train.tsv");
    if !data.is_file() {
        println!("skipped: {} not found", data.display());
        return Ok(());
    }
    let text = std::fs::read_to_string(&data).with_context(|| data.display().to_string())?;
    let sentences: Vec<(String, Option<String>)> = text
        .lines()
        .skip(1)
        .filter_map(|l| l.split('\t').next())
        .map(|s| (s.to_string(), None))
        .collect();
    let tokenizer_json = root.join(".venv/minilm/tokenizer.json");
    let tokenizer = TextTokenizer::from_file(&tokenizer_json, 0, 128, Truncation::LongestFirst)?;
    let threads = rayon::current_num_threads();
    let mut best = f64::MAX;
    let mut tokens = 0usize;
    for _ in 0..4 {
        let t = Instant::now();
        let encodings = tokenizer.encode_batch(&sentences)?;
        best = best.min(t.elapsed().as_secs_f64());
        tokens = encodings.iter().map(|e| e.len()).sum();
    }
    println!(
        "tokenization, {} SST-2 sentences ({tokens} tokens), {threads} threads: best of 4 {:.3} s = {:.0} sentences/s, {:.2} M tokens/s",
        sentences.len(),
        best,
        sentences.len() as f64 / best,
        tokens as f64 / best / 1e6
    );
    Ok(())
}
