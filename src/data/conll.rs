//! Word-tagged sentences for token classification: CoNLL-style files (one `token<TAB>tag` or
//! `token ... tag` per line, sentences separated by empty or whitespace-only lines,
//! `-DOCSTART-` lines skipped) and JSON Lines records `{"tokens": [...], "ner_tags": [...]}`
//! with tag names, or tag ids and `data.label_names`.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::classification::{BadRows, DataFormat};

/// How to read a tagged file: the `data.*` settings of the same names.
#[derive(Debug, Clone, PartialEq)]
pub struct TagReadOptions {
    /// "auto": JSON Lines for `.jsonl`/`.json`, CoNLL otherwise.
    pub format: DataFormat,
    pub tokens_column: String,
    pub tags_column: String,
    /// Tag names in id order: needed for integer tags; empty to use the training file's
    /// sorted distinct tags (run_ner.py's `get_label_list`).
    pub label_names: Vec<String>,
    pub skip_bad_rows: bool,
}

/// One sentence: its words, their tags, and the file line of each word (for messages).
#[derive(Debug, Clone, PartialEq)]
pub struct TaggedSentence {
    pub words: Vec<String>,
    pub tags: Vec<String>,
    pub lines: Vec<usize>,
}

/// Reads every sentence of `path`; with `skip_bad_rows`, bad lines or records are counted and
/// skipped (a CoNLL sentence with a bad line is skipped whole).
pub fn read_tagged(path: &Path, opts: &TagReadOptions) -> Result<Vec<TaggedSentence>> {
    if !path.is_file() {
        bail!("data file {} does not exist", path.display());
    }
    let name = path.to_string_lossy().to_ascii_lowercase();
    let jsonl = match opts.format {
        DataFormat::Jsonl => true,
        DataFormat::Auto | DataFormat::Conll => {
            opts.format == DataFormat::Auto && (name.ends_with(".jsonl") || name.ends_with(".json"))
        }
        other => bail!(
            "data.format {other:?}: token classification reads CoNLL files or JSON Lines (\"conll\", \"jsonl\" or \"auto\")"
        ),
    };
    let mut bad = BadRows::new(opts.skip_bad_rows);
    let file = std::fs::File::open(path)
        .with_context(|| format!("cannot open data file {}", path.display()))?;
    let reader = BufReader::new(file);
    let sentences = if jsonl {
        read_jsonl(reader, path, opts, &mut bad)?
    } else {
        read_conll(reader, path, &mut bad)?
    };
    bad.report(path, "sentences");
    if sentences.is_empty() {
        bail!("data file {} holds no tagged sentences", path.display());
    }
    Ok(sentences)
}

fn read_conll(reader: impl BufRead, path: &Path, bad: &mut BadRows) -> Result<Vec<TaggedSentence>> {
    let mut out = Vec::new();
    let mut current = TaggedSentence {
        words: Vec::new(),
        tags: Vec::new(),
        lines: Vec::new(),
    };
    let mut broken = false;
    let mut flush = |s: &mut TaggedSentence, broken: &mut bool| {
        if !s.words.is_empty() && !*broken {
            out.push(s.clone());
        }
        s.words.clear();
        s.tags.clear();
        s.lines.clear();
        *broken = false;
    };
    for (i, line) in reader.lines().enumerate() {
        let n = i + 1;
        let line = line.with_context(|| {
            format!(
                "{}:{n}: cannot read the line (is it UTF-8 text?)",
                path.display()
            )
        })?;
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.is_empty() || fields[0] == "-DOCSTART-" {
            flush(&mut current, &mut broken);
            continue;
        }
        if fields.len() < 2 {
            bad.record(anyhow::anyhow!(
                "{}:{n}: expected a token and its tag, found {:?}",
                path.display(),
                line.trim()
            ))?;
            broken = true;
            continue;
        }
        current.words.push(fields[0].to_string());
        current.tags.push(fields[fields.len() - 1].to_string());
        current.lines.push(n);
    }
    flush(&mut current, &mut broken);
    Ok(out)
}

fn read_jsonl(
    reader: impl BufRead,
    path: &Path,
    opts: &TagReadOptions,
    bad: &mut BadRows,
) -> Result<Vec<TaggedSentence>> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let n = i + 1;
        let at = format!("{}:{n}", path.display());
        let line = line.with_context(|| format!("{at}: cannot read the line"))?;
        if line.trim().is_empty() {
            continue;
        }
        match parse_record(&line, &at, opts) {
            Ok(Some((words, tags))) => out.push(TaggedSentence {
                lines: vec![n; words.len()],
                words,
                tags,
            }),
            Ok(None) => {}
            Err(e) => bad.record(e)?,
        }
    }
    Ok(out)
}

/// One JSON record's words and tag names; None for an empty sentence.
fn parse_record(
    line: &str,
    at: &str,
    opts: &TagReadOptions,
) -> Result<Option<(Vec<String>, Vec<String>)>> {
    let record: Value =
        serde_json::from_str(line).with_context(|| format!("{at}: not a JSON object"))?;
    let list = |key: &str| -> Result<&Vec<Value>> {
        record
            .get(key)
            .and_then(Value::as_array)
            .with_context(|| format!("{at}: no {key:?} list"))
    };
    let words = list(&opts.tokens_column)?
        .iter()
        .map(|w| w.as_str().map(str::to_string))
        .collect::<Option<Vec<_>>>()
        .with_context(|| format!("{at}: {:?} must hold strings", opts.tokens_column))?;
    let tags = list(&opts.tags_column)?
        .iter()
        .map(|t| match t {
            Value::String(s) => Ok(s.clone()),
            Value::Number(id) => {
                let name = id.as_u64().and_then(|id| opts.label_names.get(id as usize));
                match name {
                    Some(name) => Ok(name.clone()),
                    None if opts.label_names.is_empty() => bail!(
                        "{at}: tag id {id} needs data.label_names (the tag names in id order)"
                    ),
                    None => bail!(
                        "{at}: tag id {id} is out of range (data.label_names has {})",
                        opts.label_names.len()
                    ),
                }
            }
            other => bail!("{at}: a tag must be a name or an id, got {other}"),
        })
        .collect::<Result<Vec<_>>>()?;
    if words.len() != tags.len() {
        bail!("{at}: {} tokens but {} tags", words.len(), tags.len());
    }
    Ok((!words.is_empty()).then_some((words, tags)))
}

/// The label set: `label_names` when given, else the sorted distinct tags of `train`.
pub fn label_list(train: &[TaggedSentence], label_names: &[String]) -> Vec<String> {
    if !label_names.is_empty() {
        return label_names.to_vec();
    }
    let tags: BTreeSet<&str> = train
        .iter()
        .flat_map(|s| s.tags.iter().map(String::as_str))
        .collect();
    tags.into_iter().map(str::to_string).collect()
}

/// Each sentence's tags as label ids; a tag outside `labels` is an error naming its line (or,
/// with `skip_bad_rows`, skips the sentence).
pub fn tag_ids(
    sentences: Vec<TaggedSentence>,
    labels: &[String],
    path: &Path,
    skip_bad_rows: bool,
) -> Result<Vec<(TaggedSentence, Vec<usize>)>> {
    let mut bad = BadRows::new(skip_bad_rows);
    let mut out = Vec::with_capacity(sentences.len());
    for s in sentences {
        let ids: Result<Vec<usize>> = s
            .tags
            .iter()
            .zip(&s.lines)
            .map(|(tag, line)| {
                labels.iter().position(|l| l == tag).with_context(|| {
                    format!(
                        "{}:{line}: tag {tag:?} is not in the label set ({})",
                        path.display(),
                        labels.join(", ")
                    )
                })
            })
            .collect();
        match ids {
            Ok(ids) => out.push((s, ids)),
            Err(e) => bad.record(e)?,
        }
    }
    bad.report(path, "sentences");
    if out.is_empty() {
        bail!("data file {} holds no usable sentences", path.display());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> TagReadOptions {
        TagReadOptions {
            format: DataFormat::Auto,
            tokens_column: "tokens".into(),
            tags_column: "ner_tags".into(),
            label_names: Vec::new(),
            skip_bad_rows: false,
        }
    }

    fn write(name: &str, text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn conll_sentences_split_on_blank_and_whitespace_lines() {
        let text = "-DOCSTART- -X- O O\n\nEU NNP B-ORG\nrejects VBZ O\n \t\nPeter\tB-PER\nBlackburn\tI-PER\n\n\n";
        let (_d, path) = write("a.conll", text);
        let s = read_tagged(&path, &options()).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].words, ["EU", "rejects"]);
        assert_eq!(s[0].tags, ["B-ORG", "O"]);
        assert_eq!(s[0].lines, [3, 4]);
        assert_eq!(s[1].tags, ["B-PER", "I-PER"]);
        assert_eq!(label_list(&s, &[]), ["B-ORG", "B-PER", "I-PER", "O"]);
    }

    #[test]
    fn bad_input_names_the_file_and_line() {
        let (_d, path) = write("b.conll", "a\tO\nlonely\n\nb\tO\n");
        let e = read_tagged(&path, &options()).unwrap_err();
        assert!(format!("{e:#}").contains("b.conll:2"), "{e:#}");
        let skipping = TagReadOptions {
            skip_bad_rows: true,
            ..options()
        };
        let s = read_tagged(&path, &skipping).unwrap();
        assert_eq!(s.len(), 1, "the broken sentence is skipped whole");
        assert_eq!(s[0].words, ["b"]);

        let (_d, path) = write(
            "c.jsonl",
            "{\"tokens\": [\"a\", \"b\"], \"ner_tags\": [\"O\"]}\n",
        );
        let e = read_tagged(&path, &options()).unwrap_err();
        assert!(
            format!("{e:#}").contains("c.jsonl:1: 2 tokens but 1 tags"),
            "{e:#}"
        );

        let (_d, path) = write("d.conll", "\n \n");
        let e = read_tagged(&path, &options()).unwrap_err();
        assert!(
            format!("{e:#}").contains("holds no tagged sentences"),
            "{e:#}"
        );

        let (_d, path) = write("e.conll", "x\tB-LOC\ny\tB-FOO\n");
        let s = read_tagged(&path, &options()).unwrap();
        let labels = vec!["B-LOC".to_string(), "O".to_string()];
        let e = tag_ids(s, &labels, &path, false).unwrap_err();
        assert!(
            format!("{e:#}").contains("e.conll:2: tag \"B-FOO\" is not in the label set"),
            "{e:#}"
        );
    }

    #[test]
    fn json_lines_take_tag_names_or_ids() {
        let text = "{\"tokens\": [\"Paris\", \"!\"], \"ner_tags\": [1, 0]}\n\n{\"tokens\": [], \"ner_tags\": []}\n";
        let (_d, path) = write("f.jsonl", text);
        assert!(format!("{:#}", read_tagged(&path, &options()).unwrap_err())
            .contains("needs data.label_names"));
        let named = TagReadOptions {
            label_names: vec!["O".into(), "B-LOC".into()],
            ..options()
        };
        let s = read_tagged(&path, &named).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].tags, ["B-LOC", "O"]);
        let ids = tag_ids(s, &named.label_names, &path, false).unwrap();
        assert_eq!(ids[0].1, [1, 0]);
    }
}
