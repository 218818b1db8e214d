//! Sequence-classification examples from local CSV, TSV, JSON Lines or Parquet files
//! (Parquet is the format of Hub data sets). Columns are chosen by name, or by 0-based index
//! in files without a header. Labels are ids, names (mapped to ids and saved as `id2label`),
//! or floats for regression.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::batching::{Feature, Target};
use super::tokenizer::TextTokenizer;

/// A classification file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// From the extension: .csv, .tsv/.txt, .jsonl/.json, .parquet.
    Auto,
    Csv,
    Tsv,
    Jsonl,
    Parquet,
    /// Token classification's `token ... tag` lines.
    Conll,
}

/// How to read a classification file: the `data.*` settings of the same names
/// (`config::DataConfig` documents each).
#[derive(Debug, Clone, PartialEq)]
pub struct ReadOptions {
    pub format: DataFormat,
    pub has_header: bool,
    pub text_column: String,
    /// Empty for single texts.
    pub text_pair_column: String,
    pub label_column: String,
    /// Class names in id order; empty to infer them.
    pub label_names: Vec<String>,
    pub skip_bad_rows: bool,
}

/// One example. `label` is a class id or a regression target.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub text: String,
    pub text_pair: Option<String>,
    pub label: f64,
}

/// How raw label strings become numbers.
#[derive(Debug, Clone, PartialEq)]
pub enum LabelKind {
    /// Class names by id; strings are looked up, integers in range are ids.
    Classes(Vec<String>),
    /// Float targets.
    Regression,
}

/// A raw row before labels are resolved: (text, text_pair, label string, where).
type RawRow = (String, Option<String>, String, String);

fn detect_format(path: &Path, format: DataFormat) -> Result<DataFormat> {
    if format != DataFormat::Auto {
        return Ok(format);
    }
    let name = path.to_string_lossy().to_ascii_lowercase();
    Ok(if name.ends_with(".csv") {
        DataFormat::Csv
    } else if name.ends_with(".tsv") || name.ends_with(".txt") {
        DataFormat::Tsv
    } else if name.ends_with(".jsonl") || name.ends_with(".json") {
        DataFormat::Jsonl
    } else if name.ends_with(".parquet") {
        DataFormat::Parquet
    } else {
        bail!(
            "{}: cannot tell the format from the extension; set data.format",
            path.display()
        )
    })
}

/// Finds a column by name in `header`, or parses it as an index when there is no header.
fn column_index(header: Option<&[String]>, column: &str, path: &Path) -> Result<usize> {
    match header {
        Some(names) => names.iter().position(|n| n == column).with_context(|| {
            format!(
                "{}: no column {column:?} (columns: {})",
                path.display(),
                names
                    .iter()
                    .map(|n| match n.chars().any(char::is_control) {
                        true => format!("{n:?}"),
                        false => n.clone(),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }),
        None => column.parse().with_context(|| {
            format!(
                "{}: without a header, columns are 0-based indices; got {column:?}",
                path.display()
            )
        }),
    }
}

fn read_delimited(
    path: &Path,
    cfg: &ReadOptions,
    delimiter: u8,
    bad: &mut BadRows,
) -> Result<Vec<RawRow>> {
    let mut reader = csv::ReaderBuilder::new()
        .delimiter(delimiter)
        .has_headers(cfg.has_header)
        .flexible(true)
        // TSV files of NLP data sets quote nothing: a quote is part of the text.
        .quoting(delimiter != b'\t')
        .from_path(path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    let header: Option<Vec<String>> = if cfg.has_header {
        Some(
            reader
                .headers()
                .with_context(|| format!("{}: cannot read the header", path.display()))?
                .iter()
                .map(|h| h.trim_start_matches('\u{feff}').trim().to_string())
                .collect(),
        )
    } else {
        None
    };
    let text = column_index(header.as_deref(), &cfg.text_column, path)?;
    let pair = (!cfg.text_pair_column.is_empty())
        .then(|| column_index(header.as_deref(), &cfg.text_pair_column, path))
        .transpose()?;
    let label = column_index(header.as_deref(), &cfg.label_column, path)?;
    let mut rows = Vec::new();
    for record in reader.records() {
        let record = record.with_context(|| format!("{}: malformed row", path.display()))?;
        let line = record.position().map(|p| p.line()).unwrap_or(0);
        let at = format!("{}:{line}", path.display());
        let get = |i: usize, what: &str| {
            record
                .get(i)
                .map(|s| s.trim_end_matches('\r').to_string())
                .ok_or_else(|| anyhow!("{at}: missing {what} column"))
        };
        let row = (|| -> Result<RawRow> {
            let pair_text = pair.map(|i| get(i, "text pair")).transpose()?;
            Ok((
                get(text, "text")?,
                pair_text,
                get(label, "label")?,
                at.clone(),
            ))
        })();
        match row {
            Ok(r) => rows.push(r),
            Err(e) => bad.record(e)?,
        }
    }
    Ok(rows)
}

fn json_string(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Null => None,
        other => Some(other.to_string()),
    }
}

fn read_jsonl(path: &Path, cfg: &ReadOptions, bad: &mut BadRows) -> Result<Vec<RawRow>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{}", path.display(), i + 1);
        let row = (|| -> Result<RawRow> {
            let v: serde_json::Value =
                serde_json::from_str(line).with_context(|| format!("{at}: invalid JSON"))?;
            let field = |key: &str| {
                json_string(v.get(key)).ok_or_else(|| anyhow!("{at}: missing field {key:?}"))
            };
            let pair = (!cfg.text_pair_column.is_empty())
                .then(|| field(&cfg.text_pair_column))
                .transpose()?;
            Ok((
                field(&cfg.text_column)?,
                pair,
                field(&cfg.label_column)?,
                at.clone(),
            ))
        })();
        match row {
            Ok(r) => rows.push(r),
            Err(e) => bad.record(e)?,
        }
    }
    Ok(rows)
}

fn read_parquet(path: &Path, cfg: &ReadOptions, bad: &mut BadRows) -> Result<Vec<RawRow>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let reader = SerializedFileReader::new(file)
        .with_context(|| format!("{} is not a valid Parquet file", path.display()))?;
    let names: Vec<String> = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .root_schema()
        .get_fields()
        .iter()
        .map(|f| f.name().to_string())
        .collect();
    let text = column_index(Some(&names), &cfg.text_column, path)?;
    let pair = (!cfg.text_pair_column.is_empty())
        .then(|| column_index(Some(&names), &cfg.text_pair_column, path))
        .transpose()?;
    let label = column_index(Some(&names), &cfg.label_column, path)?;
    let as_string = |f: &Field| -> Option<String> {
        match f {
            Field::Str(s) => Some(s.clone()),
            Field::Null => None,
            other => Some(other.to_string()),
        }
    };
    let mut rows = Vec::new();
    let iter = reader
        .get_row_iter(None)
        .with_context(|| format!("{}: cannot read rows", path.display()))?;
    for (i, row) in iter.enumerate() {
        let at = format!("{} row {}", path.display(), i + 1);
        let row = row.with_context(|| format!("{at}: cannot decode"))?;
        let fields: Vec<&Field> = row.get_column_iter().map(|(_, f)| f).collect();
        let get = |idx: usize, what: &str| {
            fields
                .get(idx)
                .and_then(|f| as_string(f))
                .ok_or_else(|| anyhow!("{at}: missing {what}"))
        };
        let parsed = (|| -> Result<RawRow> {
            let p = pair.map(|i| get(i, "text pair")).transpose()?;
            Ok((get(text, "text")?, p, get(label, "label")?, at.clone()))
        })();
        match parsed {
            Ok(r) => rows.push(r),
            Err(e) => bad.record(e)?,
        }
    }
    Ok(rows)
}

/// Bad rows are errors, or, with `skip_bad_rows`, counted and warned about once.
pub(crate) struct BadRows {
    skip: bool,
    count: usize,
    first: Option<String>,
}

impl BadRows {
    pub(crate) fn new(skip: bool) -> Self {
        BadRows {
            skip,
            count: 0,
            first: None,
        }
    }

    /// Fails with `e`, or counts it when skipping.
    pub(crate) fn record(&mut self, e: anyhow::Error) -> Result<()> {
        if !self.skip {
            return Err(e);
        }
        self.count += 1;
        self.first.get_or_insert_with(|| format!("{e:#}"));
        Ok(())
    }

    /// Warns once about what was skipped in `path`.
    pub(crate) fn report(&self, path: &Path, what: &str) {
        if self.count > 0 {
            tracing::warn!(
                "{}: skipped {} bad {what} (first: {})",
                path.display(),
                self.count,
                self.first.as_deref().unwrap_or_default()
            );
        }
    }
}

fn read_raw(path: &Path, cfg: &ReadOptions, bad: &mut BadRows) -> Result<Vec<RawRow>> {
    if !path.is_file() {
        bail!("data file {} does not exist", path.display());
    }
    match detect_format(path, cfg.format)? {
        DataFormat::Csv => read_delimited(path, cfg, b',', bad),
        DataFormat::Tsv => read_delimited(path, cfg, b'\t', bad),
        DataFormat::Jsonl => read_jsonl(path, cfg, bad),
        DataFormat::Parquet => {
            crate::runtime::panic_guard::catch(path, "the parquet reader", || {
                read_parquet(path, cfg, bad)
            })
        }
        DataFormat::Conll => {
            bail!("data.format \"conll\" is for token classification (model.task \"token-cls\")")
        }
        DataFormat::Auto => unreachable!("detect_format resolves auto"),
    }
}

/// The largest class id read as an id: a head with more classes is a typo in the data (and
/// would allocate a name for every id below it).
pub const MAX_CLASS_ID: i64 = 65_535;

/// Decides the label set: given names, or integer ids, or the sorted distinct strings.
pub fn infer_labels(cfg: &ReadOptions, regression: bool, raw: &[&str]) -> Result<LabelKind> {
    if regression {
        return Ok(LabelKind::Regression);
    }
    if !cfg.label_names.is_empty() {
        return Ok(LabelKind::Classes(cfg.label_names.clone()));
    }
    // Any integer label makes all labels ids (anything else is then a bad row); only files
    // with no integer label at all use names.
    let ids: Vec<i64> = raw
        .iter()
        .filter_map(|s| s.trim().parse::<i64>().ok())
        .collect();
    if !ids.is_empty() {
        let max = ids.iter().copied().filter(|&i| i >= 0).max();
        if let Some(max) = max.filter(|&m| m > MAX_CLASS_ID) {
            bail!(
                "label {max} is not a plausible class id (at most {MAX_CLASS_ID}): for numeric targets set model.problem_type = \"regression\", for class names give data.label_names"
            );
        }
        let n = max.map_or(0, |m| m + 1) as usize;
        return Ok(LabelKind::Classes((0..n).map(|i| i.to_string()).collect()));
    }
    let distinct: std::collections::BTreeSet<&str> = raw.iter().map(|s| s.trim()).collect();
    Ok(LabelKind::Classes(
        distinct.into_iter().map(str::to_string).collect(),
    ))
}

fn resolve_label(raw: &str, kind: &LabelKind, at: &str) -> Result<f64> {
    let s = raw.trim();
    match kind {
        LabelKind::Regression => s
            .parse::<f64>()
            .with_context(|| format!("{at}: label {s:?} is not a number")),
        LabelKind::Classes(names) => {
            if let Some(id) = names.iter().position(|n| n == s) {
                return Ok(id as f64);
            }
            match s.parse::<usize>() {
                Ok(id) if id < names.len() => Ok(id as f64),
                Ok(id) => bail!("{at}: label id {id} is out of range (0..{})", names.len()),
                Err(_) => bail!("{at}: unknown label {s:?} (labels: {})", names.join(", ")),
            }
        }
    }
}

/// Reads one file into examples. `kind` fixes the labels (from the training file); `None`
/// infers them from this file.
pub fn load_examples(
    path: &Path,
    cfg: &ReadOptions,
    regression: bool,
    kind: Option<&LabelKind>,
) -> Result<(Vec<Example>, LabelKind)> {
    let mut bad = BadRows::new(cfg.skip_bad_rows);
    let raw = read_raw(path, cfg, &mut bad)?;
    let kind = match kind {
        Some(k) => k.clone(),
        None => infer_labels(
            cfg,
            regression,
            &raw.iter().map(|r| r.2.as_str()).collect::<Vec<_>>(),
        )
        .with_context(|| format!("data file {}", path.display()))?,
    };
    let mut examples = Vec::with_capacity(raw.len());
    for (text, text_pair, label, at) in raw {
        match resolve_label(&label, &kind, &at) {
            Ok(label) => examples.push(Example {
                text,
                text_pair,
                label,
            }),
            Err(e) => bad.record(e)?,
        }
    }
    bad.report(path, "rows");
    if examples.is_empty() {
        bail!("data file {} holds no examples", path.display());
    }
    Ok((examples, kind))
}

/// Tokenizes examples (in parallel, inside the tokenizers crate): class ids or regression
/// values as `kind` says.
pub fn tokenize(
    tok: &TextTokenizer,
    examples: &[Example],
    kind: &LabelKind,
) -> Result<Vec<Feature>> {
    let texts: Vec<(String, Option<String>)> = examples
        .iter()
        .map(|e| (e.text.clone(), e.text_pair.clone()))
        .collect();
    let encodings = tok.encode_batch(&texts)?;
    Ok(encodings
        .iter()
        .zip(examples)
        .map(|(enc, ex)| {
            let target = match kind {
                LabelKind::Regression => Target::Value(ex.label),
                LabelKind::Classes(_) => Target::Class(ex.label as usize),
            };
            Feature::from_encoding(enc, target)
        })
        .collect())
}

/// id2label for config.json from the label set.
pub fn id2label(kind: &LabelKind) -> BTreeMap<usize, String> {
    match kind {
        LabelKind::Classes(names) => names.iter().cloned().enumerate().collect(),
        LabelKind::Regression => BTreeMap::from([(0, "LABEL_0".to_string())]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The read options of the default `[data]` settings, changed by `f`.
    fn cfg(f: impl FnOnce(&mut ReadOptions)) -> ReadOptions {
        let mut c = crate::tasks::sequence_classification::read_options(&Default::default());
        f(&mut c);
        c
    }

    fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn csv_with_quotes_and_names() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            dir.path(),
            "d.csv",
            "text,label\n\"good, really\",pos\nbad,neg\n\"so \"\"so\"\"\",pos\n",
        );
        let (ex, kind) =
            load_examples(&p, &cfg(|c| c.text_column = "text".into()), false, None).unwrap();
        assert_eq!(kind, LabelKind::Classes(vec!["neg".into(), "pos".into()]));
        assert_eq!(
            ex[0],
            Example {
                text: "good, really".into(),
                text_pair: None,
                label: 1.0
            }
        );
        assert_eq!(ex[2].text, "so \"so\"");
        assert_eq!(
            id2label(&kind),
            BTreeMap::from([(0, "neg".to_string()), (1, "pos".to_string())])
        );
    }

    #[test]
    fn tsv_keeps_quotes_and_headerless_columns_are_indices() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            dir.path(),
            "d.tsv",
            "7\t''Conan'' rules\t1\r\n8\tdull\t0\r\n",
        );
        let c = cfg(|c| {
            c.has_header = false;
            c.text_column = "1".into();
            c.label_column = "2".into();
        });
        let (ex, _) = load_examples(&p, &c, false, None).unwrap();
        assert_eq!(ex[0].text, "''Conan'' rules");
        assert_eq!((ex[0].label, ex[1].label), (1.0, 0.0));
        let err = load_examples(&p, &cfg(|c| c.has_header = false), false, None).unwrap_err();
        assert!(format!("{err:#}").contains("0-based indices"), "{err:#}");
    }

    #[test]
    fn jsonl_pairs_and_regression() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), "d.jsonl", "{\"a\": \"x\", \"b\": \"y\", \"score\": 4.5}\n\n{\"a\": \"z\", \"b\": \"w\", \"score\": 0}\n");
        let c = cfg(|c| {
            c.text_column = "a".into();
            c.text_pair_column = "b".into();
            c.label_column = "score".into();
        });
        let (ex, kind) = load_examples(&p, &c, true, None).unwrap();
        assert_eq!(kind, LabelKind::Regression);
        assert_eq!(
            ex[0],
            Example {
                text: "x".into(),
                text_pair: Some("y".into()),
                label: 4.5
            }
        );
        assert_eq!(ex[1].label, 0.0);
    }

    #[test]
    fn hub_style_parquet() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data/pairs.parquet");
        let c = cfg(|c| {
            c.text_column = "sentence1".into();
            c.text_pair_column = "sentence2".into();
            c.label_names = vec!["not_equivalent".into(), "equivalent".into()];
        });
        let (ex, _) = load_examples(&p, &c, false, None).unwrap();
        assert_eq!(ex.len(), 5);
        assert_eq!(ex[3].text, "Amrozi accused his brother.");
        assert_eq!(
            ex[3].text_pair.as_deref(),
            Some("Referring to him, Amrozi accused his brother.")
        );
        assert_eq!(
            ex.iter().map(|e| e.label).collect::<Vec<_>>(),
            [0.0, 1.0, 0.0, 1.0, 0.0]
        );
        let err =
            load_examples(&p, &cfg(|c| c.text_column = "text".into()), false, None).unwrap_err();
        assert!(
            format!("{err:#}")
                .contains("no column \"text\" (columns: sentence1, sentence2, label, idx)"),
            "{err:#}"
        );
    }

    #[test]
    fn eval_labels_follow_the_training_labels() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), "e.tsv", "sentence\tlabel\nok\t2\n");
        let kind = LabelKind::Classes(vec!["0".into(), "1".into()]);
        let err = load_examples(&p, &cfg(|_| ()), false, Some(&kind)).unwrap_err();
        assert!(
            format!("{err:#}").contains(":2: label id 2 is out of range (0..2)"),
            "{err:#}"
        );
    }
}
