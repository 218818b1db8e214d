//! Fuzzing every parser a user's file reaches, on stable Rust: each target writes the input
//! to a file of the name and extension the parser expects and reads it back through
//! sprtrain's own loader. Inputs are mutations (bit flips, interesting bytes and numbers,
//! insertions, deletions, duplications, splices, truncations) of a seed corpus built from
//! tests/fixtures and ../shared/data. A finding is an input that
//! - panics (a bug: user input must get an error, never a crash),
//! - takes longer than `FUZZ_HANG_S` (default 10 s), or
//! - allocates more than `FUZZ_MEMORY_MIB` (default 2048 MiB) at once, or
//! - is refused with an error that is not one line naming the file.
//!
//! Findings are written to target/fuzz-findings/TARGET/ and fail the run. Environment:
//! `FUZZ_SECONDS` per target (default 30, what CI runs), `FUZZ_TARGETS` (comma-separated
//! names; default all), `FUZZ_SEED`, `FUZZ_REPLAY=FILE` (run FILE through `FUZZ_TARGETS`),
//! `FUZZ_LIST` (print the target names and exit).
//! `scripts/fuzz.sh SECONDS` runs every target for that long.

use std::alloc::{GlobalAlloc, Layout, System};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Result;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use sprtrain::config::{Config, DataConfig};

/// Counts live heap bytes; an allocation past the limit is a finding (unbounded allocation
/// from a size some file claimed), reported and ended before the machine runs out.
struct Bounded;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);

unsafe impl GlobalAlloc for Bounded {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        if live > LIMIT.load(Ordering::Relaxed) {
            LIMIT.store(usize::MAX, Ordering::Relaxed);
            finding_and_exit("memory", &format!("{} MiB live", live >> 20));
        }
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            let grow = new_size - layout.size();
            let live = LIVE.fetch_add(grow, Ordering::Relaxed) + grow;
            if live > LIMIT.load(Ordering::Relaxed) {
                LIMIT.store(usize::MAX, Ordering::Relaxed);
                finding_and_exit("memory", &format!("{} MiB live", live >> 20));
            }
        } else {
            LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Bounded = Bounded;

/// The input being run and its target, for the hang and memory reports.
static CURRENT: Mutex<Option<(String, Vec<u8>)>> = Mutex::new(None);
static STARTED_MS: AtomicU64 = AtomicU64::new(0);
static RUNNING: AtomicBool = AtomicBool::new(false);

fn findings_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join("fuzz-findings")
        .join(target)
}

/// FNV-1a: names findings by content and gives each target its own mutation stream.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// Saves `input` as a finding of `kind`; returns where.
fn save_finding(target: &str, kind: &str, input: &[u8]) -> PathBuf {
    let dir = findings_dir(target);
    let _ = std::fs::create_dir_all(&dir);
    let hash = input.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    });
    let path = dir.join(format!("{kind}-{hash:016x}"));
    let _ = std::fs::write(&path, input);
    path
}

/// A hang or an allocation past the limit: the input is saved and the process ends (its
/// state cannot be trusted after either).
fn finding_and_exit(kind: &str, detail: &str) -> ! {
    LIMIT.store(usize::MAX, Ordering::Relaxed);
    if let Ok(guard) = CURRENT.try_lock() {
        if let Some((target, input)) = guard.as_ref() {
            let path = save_finding(target, kind, input);
            eprintln!("FINDING {target}: {kind} ({detail}): {}", path.display());
        }
    }
    std::process::exit(2);
}

/// A parser under test: reads the file at the given path.
type Parse = fn(&Path) -> Result<()>;

struct Target {
    name: &'static str,
    /// The file name the input is written to (its extension picks the format).
    file: &'static str,
    parse: Parse,
    /// Seeds: files (whole) from these paths relative to the repository.
    seeds: &'static [&'static str],
}

fn data_config() -> DataConfig {
    DataConfig::default()
}

/// Classification rows as a run with the default `[data]` section reads them.
fn classification(path: &Path) -> Result<()> {
    let opts = sprtrain::tasks::sequence_classification::read_options(&data_config());
    sprtrain::data::classification::load_examples(path, &opts, false, None).map(|_| ())
}

/// Tagged words (CoNLL or JSON Lines) as a token-classification run reads them.
fn tagged(path: &Path) -> Result<()> {
    let opts = sprtrain::tasks::token_classification::read_options(&data_config());
    sprtrain::data::conll::read_tagged(path, &opts).map(|_| ())
}

fn squad(path: &Path) -> Result<()> {
    use sprtrain::data::squad::{load_squad, QaReadOptions};
    let opts = QaReadOptions {
        strict_answers: false,
        skip_bad_rows: false,
    };
    load_squad(path, opts).map(|_| ())
}

fn config_toml(path: &Path) -> Result<()> {
    // The file's last lines that start with "--set " are the command line's overrides.
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let overrides: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("--set "))
        .map(str::to_string)
        .collect();
    Config::load(path, &overrides).map(|_| ())
}

fn tokenizer(path: &Path) -> Result<()> {
    let tok = sprtrain::data::tokenizer::TextTokenizer::from_file(
        path,
        0,
        64,
        sprtrain::data::tokenizer::Truncation::LongestFirst,
    )?;
    tok.encode_batch(&[
        ("Hello world, héllo!".into(), Some("a second text".into())),
        (String::new(), None),
    ])?;
    Ok(())
}

fn chat_template(path: &Path) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    if let Some(template) = sprtrain::data::chat::ChatTemplate::find(dir)? {
        let messages: serde_json::Value = serde_json::json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}
        ]);
        template.render(messages.as_array().unwrap(), true)?;
    }
    Ok(())
}

const TARGETS: &[Target] = &[
    Target {
        name: "config_toml",
        file: "run.toml",
        parse: config_toml,
        seeds: &["configs/*.toml"],
    },
    Target {
        name: "config_json",
        file: "config.json",
        parse: |p| sprtrain::models::HfConfig::from_file(p).map(|_| ()),
        seeds: &[
            "tests/fixtures/parity/*/config.json",
            "tests/fixtures/*/config.json",
        ],
    },
    Target {
        name: "tokenizer_json",
        file: "tokenizer.json",
        parse: tokenizer,
        seeds: &[
            "tests/fixtures/*/tokenizer.json",
            "tests/fixtures/parity/*/tokenizer.json",
        ],
    },
    Target {
        name: "chat_template",
        file: "tokenizer_config.json",
        parse: chat_template,
        seeds: &["tests/fuzz_seeds/tokenizer_config*.json"],
    },
    Target {
        name: "safetensors",
        file: "model.safetensors",
        parse: |p| sprtrain::models::weights::read_safetensors(p).map(|_| ()),
        seeds: &[
            "tests/fixtures/train_parity/model.safetensors",
            "tests/fixtures/parity/*/model-00003-of-00003.safetensors",
        ],
    },
    Target {
        name: "shard_index",
        file: "model.safetensors.index.json",
        parse: |p| sprtrain::io::hf_files::read_index(p).map(|_| ()),
        seeds: &["tests/fixtures/parity/*/model.safetensors.index.json"],
    },
    Target {
        name: "rows_csv",
        file: "train.csv",
        parse: classification,
        seeds: &["tests/fuzz_seeds/*.csv"],
    },
    Target {
        name: "rows_tsv",
        file: "train.tsv",
        parse: classification,
        seeds: &["tests/fuzz_seeds/*.tsv", "../shared/data/sst2/dev.tsv"],
    },
    Target {
        name: "rows_jsonl",
        file: "train.jsonl",
        parse: classification,
        seeds: &[
            "tests/fuzz_seeds/rows.jsonl",
            "tests/fuzz_seeds/regression.jsonl",
        ],
    },
    Target {
        name: "rows_parquet",
        file: "train.parquet",
        parse: classification,
        seeds: &["tests/fixtures/data/*.parquet"],
    },
    Target {
        name: "squad_nested",
        file: "dev.json",
        parse: squad,
        seeds: &[
            "tests/fixtures/qa/squad_v1.json",
            "tests/fixtures/qa/squad_flat.json",
            "../shared/data/squad/xquad.en.json",
        ],
    },
    Target {
        name: "squad_flat",
        file: "dev.jsonl",
        parse: squad,
        seeds: &["tests/fixtures/qa/*.jsonl"],
    },
    Target {
        name: "conll",
        file: "train.conll",
        parse: tagged,
        seeds: &[
            "tests/fuzz_seeds/*.conll",
            "../shared/data/wnut17/emerging.dev.conll",
        ],
    },
    Target {
        name: "ner_jsonl",
        file: "ner.jsonl",
        parse: tagged,
        seeds: &["tests/fuzz_seeds/ner.jsonl"],
    },
    Target {
        name: "chat_jsonl",
        file: "chat.jsonl",
        parse: |p| sprtrain::tasks::language_modeling::read_examples(p, &data_config()).map(|_| ()),
        seeds: &[
            "tests/fixtures/data/chat.jsonl",
            "tests/fuzz_seeds/prompts.jsonl",
        ],
    },
];

/// Seed files matching a glob `pattern` relative to the crate root (`*` within one path
/// component, as `tests/fuzz_seeds/*.conll` or `tests/fixtures/parity/*/config.json`), sorted.
fn expand(pattern: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let parts: Vec<&str> = pattern.split('/').collect();
    let literal = parts
        .iter()
        .take_while(|p| !p.contains(['*', '?', '[', '{']))
        .count();
    let base = root.join(parts[..literal].join("/"));
    if literal == parts.len() {
        return if base.is_file() {
            vec![base]
        } else {
            Vec::new()
        };
    }
    let matcher = globset::GlobBuilder::new(&parts[literal..].join("/"))
        .literal_separator(true)
        .build()
        .unwrap_or_else(|e| panic!("seed pattern {pattern}: {e}"))
        .compile_matcher();
    let mut found = Vec::new();
    let mut dirs = vec![base.clone()];
    while let Some(dir) = dirs.pop() {
        for path in std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
        {
            if path.is_dir() {
                dirs.push(path);
            } else if path
                .strip_prefix(&base)
                .is_ok_and(|rel| matcher.is_match(rel))
            {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// Seeds of a target: its files, each cut to 64 KiB (text formats keep whole lines) so an
/// execution stays fast; at most 24, plus an empty input.
fn seeds(target: &Target) -> Vec<Vec<u8>> {
    let mut out = vec![Vec::new()];
    for pattern in target.seeds {
        for path in expand(pattern).into_iter().take(24) {
            let Ok(mut bytes) = std::fs::read(&path) else {
                continue;
            };
            if bytes.len() > 64 * 1024 && !target.file.ends_with(".parquet") {
                bytes.truncate(64 * 1024);
                if let Some(end) = bytes.iter().rposition(|&b| b == b'\n') {
                    bytes.truncate(end + 1);
                }
            }
            out.push(bytes);
        }
    }
    out
}

const INTERESTING: &[&[u8]] = &[
    b"0",
    b"-1",
    b"4294967296",
    b"18446744073709551616",
    b"99999999999999999999999",
    b"1e308",
    b"-1e308",
    b"NaN",
    b"inf",
    b"null",
    b"true",
    b"\"\"",
    b"[]",
    b"{}",
    b"\"\\u0000\"",
    b"\xff\xfe",
    b"\n",
    b"\r\n",
    b"\t",
    b" ",
    b"\"",
    b",",
    b":",
    b"[",
    b"]",
    b"{",
    b"}",
    b"=",
    b"-DOCSTART-",
    b"\"..\"",
    b"{{",
    b"}}",
    b"{%",
    b"%}",
    b"\xe2\x80\xa8",
    b"\x00",
];

/// One mutation of `input` (1 to 8 edits), sometimes spliced with another seed.
fn mutate(rng: &mut ChaCha8Rng, input: &[u8], corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..rng.random_range(1..=8) {
        let len = out.len();
        let at = if len == 0 {
            0
        } else {
            rng.random_range(0..len)
        };
        match rng.random_range(0..9) {
            0 if len > 0 => out[at] ^= 1 << rng.random_range(0..8),
            1 if len > 0 => out[at] = rng.random(),
            2 => {
                let token = INTERESTING[rng.random_range(0..INTERESTING.len())];
                out.splice(at..at, token.iter().copied());
            }
            3 if len > 0 => {
                // Replace a run of digits (a number, a length, an offset) with an extreme.
                let end = (at..len).find(|&i| !out[i].is_ascii_digit()).unwrap_or(len);
                let token = INTERESTING[rng.random_range(0..7)];
                out.splice(at..end, token.iter().copied());
            }
            4 if len > 0 => {
                let end = (at + rng.random_range(1..=64)).min(len);
                out.drain(at..end);
            }
            5 if len > 0 => {
                let end = (at + rng.random_range(1..=256)).min(len);
                let chunk = out[at..end].to_vec();
                let to = rng.random_range(0..=len);
                out.splice(to..to, chunk);
            }
            6 => out.truncate(at),
            7 if !corpus.is_empty() => {
                let other = &corpus[rng.random_range(0..corpus.len())];
                if !other.is_empty() {
                    let from = rng.random_range(0..other.len());
                    let end = (from + rng.random_range(1..=512)).min(other.len());
                    out.splice(at..at, other[from..end].iter().copied());
                }
            }
            _ => {
                let n = rng.random_range(1..=16);
                let mut bytes = vec![0u8; n];
                rng.fill_bytes(&mut bytes);
                out.splice(at..at, bytes);
            }
        }
        if out.len() > 256 * 1024 {
            out.truncate(256 * 1024);
        }
    }
    out
}

/// What one execution showed.
enum Outcome {
    Accepted,
    Refused,
    /// A finding, with its kind and the message.
    Bad(&'static str, String),
}

/// Runs `input` through `target` in `dir`.
fn execute(target: &Target, dir: &Path, input: &[u8]) -> Outcome {
    let path = dir.join(target.file);
    std::fs::write(&path, input).unwrap();
    *CURRENT.lock().unwrap() = Some((target.name.to_string(), input.to_vec()));
    STARTED_MS.store(now_ms(), Ordering::SeqCst);
    RUNNING.store(true, Ordering::SeqCst);
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| (target.parse)(&path)));
    RUNNING.store(false, Ordering::SeqCst);
    match result {
        Ok(Ok(())) => Outcome::Accepted,
        Ok(Err(e)) => {
            let msg = format!("{e:#}");
            if msg.contains('\n') {
                Outcome::Bad("multiline", msg)
            } else if !msg.contains(target.file) {
                Outcome::Bad("unnamed", msg)
            } else {
                Outcome::Refused
            }
        }
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Outcome::Bad("panic", msg)
        }
    }
}

fn now_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let seconds = env_num("FUZZ_SECONDS", 30);
    let hang_ms = env_num("FUZZ_HANG_S", 10) * 1000;
    let memory = env_num("FUZZ_MEMORY_MIB", 2048) as usize * 1024 * 1024;
    let seed = env_num("FUZZ_SEED", 1);
    let only: Vec<String> = std::env::var("FUZZ_TARGETS")
        .map(|v| {
            v.split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    // `cargo test` passes the test harness's flags; this harness takes none.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if std::env::var_os("FUZZ_LIST").is_some() {
        TARGETS.iter().for_each(|t| println!("{}", t.name));
        return;
    }
    let replay = std::env::var_os("FUZZ_REPLAY").map(PathBuf::from);
    // Panics are findings, reported by the harness, not printed by the default hook (which
    // a replay keeps, for the backtrace).
    if replay.is_none() {
        std::panic::set_hook(Box::new(|_| {}));
    }
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(200));
        let started = STARTED_MS.load(Ordering::SeqCst);
        if RUNNING.load(Ordering::SeqCst) && now_ms().saturating_sub(started) > hang_ms {
            finding_and_exit("hang", &format!("over {} s", hang_ms / 1000));
        }
    });
    let work = tempfile::tempdir().unwrap();
    let mut findings = 0;
    for target in TARGETS
        .iter()
        .filter(|t| only.is_empty() || only.iter().any(|o| o == t.name))
    {
        let dir = work.path().join(target.name);
        std::fs::create_dir_all(&dir).unwrap();
        if let Some(file) = &replay {
            let input = std::fs::read(file).unwrap();
            match execute(target, &dir, &input) {
                Outcome::Accepted => println!("{}: accepted", target.name),
                Outcome::Refused => println!("{}: refused", target.name),
                Outcome::Bad(kind, msg) => println!("{}: {kind}: {msg}", target.name),
            }
            continue;
        }
        let corpus = seeds(target);
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ fnv1a(target.name.as_bytes()));
        let (mut runs, mut accepted, mut bad) = (0u64, 0u64, 0usize);
        LIMIT.store(LIVE.load(Ordering::Relaxed) + memory, Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(seconds);
        // Every seed as it is first (they should parse, or be refused cleanly), then mutants.
        let mut queue: Vec<Vec<u8>> = corpus.clone();
        while Instant::now() < deadline || !queue.is_empty() {
            let input = queue.pop().unwrap_or_else(|| {
                let base = &corpus[rng.random_range(0..corpus.len())];
                mutate(&mut rng, base, &corpus)
            });
            runs += 1;
            match execute(target, &dir, &input) {
                Outcome::Accepted => accepted += 1,
                Outcome::Refused => {}
                Outcome::Bad(kind, msg) => {
                    let path = save_finding(target.name, kind, &input);
                    if bad < 5 {
                        let short: String = msg.chars().take(300).collect();
                        eprintln!(
                            "FINDING {}: {kind}: {short:?} ({})",
                            target.name,
                            path.display()
                        );
                    }
                    bad += 1;
                }
            }
        }
        LIMIT.store(usize::MAX, Ordering::Relaxed);
        println!(
            "{:<16} {runs:>8} executions, {accepted:>7} accepted, {:>3} seeds, {bad} findings",
            target.name,
            corpus.len()
        );
        findings += bad;
    }
    if findings > 0 {
        eprintln!("{findings} findings (inputs under target/fuzz-findings/)");
        std::process::exit(1);
    }
}
