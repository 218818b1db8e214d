//! Chat templates: the Jinja template of a tokenizer (`chat_template.jinja`, or
//! `chat_template` in tokenizer_config.json) rendered as transformers'
//! `apply_chat_template` renders it: Jinja2 with `trim_blocks` and `lstrip_blocks`, the
//! special tokens as variables, `raise_exception`, and a `tojson` that writes JSON as Python's
//! `json.dumps` does.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use minijinja::{Environment, ErrorKind, Value};
use serde_json::Value as Json;

/// File names transformers reads a chat template from, beside tokenizer.json.
pub const TEMPLATE_FILE: &str = "chat_template.jinja";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// A tokenizer's chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ... as strings.
    special_tokens: Vec<(String, String)>,
    /// Where the template came from, for messages.
    pub origin: PathBuf,
}

/// A special token in tokenizer_config.json: a string or an AddedToken `{"content": ...}`.
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(m) => m
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// serde_json output with Python's separators (`", "`, `": "`).
struct PythonFormatter;

/// `", "` before every item but the first.
fn separator<W: ?Sized + std::io::Write>(writer: &mut W, first: bool) -> std::io::Result<()> {
    if first {
        Ok(())
    } else {
        writer.write_all(b", ")
    }
}

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        separator(writer, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        separator(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn tojson(value: Value, indent: Option<usize>) -> Result<String, minijinja::Error> {
    let json: Json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let formatter = serde_json::ser::PrettyFormatter::with_indent(&pad);
            let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
            serde::Serialize::serialize(&json, &mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
            serde::Serialize::serialize(&json, &mut ser)
        }
    };
    written.map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    String::from_utf8(out)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))
}

impl ChatTemplate {
    /// The template of the tokenizer in `dir`, if it has one.
    pub fn find(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config: Json = if config_path.is_file() {
            let text = std::fs::read_to_string(&config_path)
                .with_context(|| format!("cannot read {}", config_path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", config_path.display()))?
        } else {
            Json::Null
        };
        let file = dir.join(TEMPLATE_FILE);
        let (source, origin) = if file.is_file() {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            (text, file)
        } else {
            match config.get("chat_template") {
                Some(Json::String(s)) => (s.clone(), config_path),
                // Several named templates: the one named "default".
                Some(Json::Array(named)) => {
                    let default = named
                        .iter()
                        .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                        .and_then(|t| t.get("template"))
                        .and_then(|t| t.as_str())
                        .with_context(|| {
                            format!(
                                "{}: no chat template named \"default\"",
                                config_path.display()
                            )
                        })?;
                    (default.to_string(), config_path)
                }
                _ => return Ok(None),
            }
        };
        let special_tokens = [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ]
        .iter()
        .filter_map(|k| {
            config
                .get(*k)
                .and_then(token_text)
                .map(|t| (k.to_string(), t))
        })
        .collect();
        Ok(Some(Self::new(source, special_tokens, origin)?))
    }

    /// A template from its source text.
    pub fn new(
        source: String,
        special_tokens: Vec<(String, String)>,
        origin: PathBuf,
    ) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        // Python string and dict methods (.strip(), .startswith(), .items(), ...).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        check_no_namespace_cycles(&source, &origin)?;
        env.add_template_owned("chat", source).map_err(|e| {
            anyhow!(
                "{}: the chat template does not parse: {e}",
                origin.display()
            )
        })?;
        Ok(ChatTemplate {
            env,
            special_tokens,
            origin,
        })
    }

    /// The conversation as text, with the assistant's turn opened after it when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[Json], add_generation_prompt: bool) -> Result<String> {
        let template = self.env.get_template("chat").map_err(|e| anyhow!("{e}"))?;
        let mut context: serde_json::Map<String, Json> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Json::String(v.clone())))
            .collect();
        context.insert("messages".into(), Json::Array(messages.to_vec()));
        context.insert(
            "add_generation_prompt".into(),
            Json::Bool(add_generation_prompt),
        );
        template
            .render(Value::from_serialize(&context))
            .map_err(|e| {
                let mut msg = e.to_string();
                if let Some(detail) = e.detail().filter(|d| !msg.contains(d)) {
                    msg = format!("{msg}: {detail}");
                }
                anyhow!(
                    "the chat template of {} fails to render: {msg}",
                    self.origin.display()
                )
            })
    }
}

/// Jinja namespaces are mutable: one stored in a namespace's attribute (directly, or inside a
/// list or dict) can close a cycle, which minijinja follows for ever when it prints or
/// serialises the value — a stack overflow that ends the process. No real chat template
/// stores a namespace in a namespace, so a template that might is refused.
fn check_no_namespace_cycles(source: &str, origin: &Path) -> Result<()> {
    static PATTERNS: std::sync::OnceLock<[regex::Regex; 4]> = std::sync::OnceLock::new();
    let [defined, attribute_set, quoted, identifier] = PATTERNS.get_or_init(|| {
        [
            r"set\s+([A-Za-z_]\w*)\s*=\s*namespace\s*\(",
            r"set\s+([A-Za-z_]\w*)\s*\.\s*\w+\s*=((?s:.)*?)-?%\}",
            r#"'[^']*'|"[^"]*""#,
            // A bare name: not an attribute (`x.ns`), nor one being read from (`ns.n`, `ns[k]`).
            r"(^|[^.\w])([A-Za-z_]\w*)\s*([.\[(]?)",
        ]
        .map(|p| regex::Regex::new(p).expect("a valid pattern"))
    });
    let namespaces: Vec<&str> = defined
        .captures_iter(source)
        .filter_map(|c| c.get(1).map(|m| m.as_str()))
        .collect();
    for set in attribute_set.captures_iter(source) {
        let value = quoted.replace_all(set.get(2).map_or("", |m| m.as_str()), "''");
        if let Some(name) = identifier
            .captures_iter(&value)
            .filter(|c| c.get(3).is_none_or(|m| m.as_str().is_empty()))
            .filter_map(|c| c.get(2).map(|m| m.as_str()))
            .find(|name| namespaces.contains(name))
        {
            bail!(
                "{}: the chat template stores namespace {name:?} in an attribute of namespace {:?}, which can make a cycle that cannot be rendered",
                origin.display(),
                set.get(1).map_or("", |m| m.as_str())
            );
        }
    }
    Ok(())
}

/// Checks that `messages` is a list of {role, content} objects ending with the assistant's.
pub fn validate_messages(messages: &Json) -> Result<&[Json]> {
    let list = messages
        .as_array()
        .context("messages must be a list of {\"role\", \"content\"} objects")?;
    if list.len() < 2 {
        bail!("a conversation needs at least a prompt and an assistant reply");
    }
    for m in list {
        if m.get("role").and_then(|r| r.as_str()).is_none() {
            bail!("every message needs a \"role\" string");
        }
    }
    if list
        .last()
        .and_then(|m| m.get("role"))
        .and_then(|r| r.as_str())
        != Some("assistant")
    {
        bail!("the last message must be the assistant's (it is what the model learns to say)");
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> Result<ChatTemplate> {
        ChatTemplate::new(
            source.into(),
            Vec::new(),
            PathBuf::from("tok/tokenizer_config.json"),
        )
    }

    #[test]
    fn a_namespace_stored_in_a_namespace_is_refused() {
        for source in [
            "{% set ns = namespace(turns=0) %}{% set ns.turns = ns %}{{ ns.turns }}",
            "{%- set a = namespace() -%}{%- set b = namespace() -%}{%- set a.x = [1, b] -%}",
        ] {
            let e = template(source).err().expect("refused").to_string();
            assert!(
                e.starts_with("tok/tokenizer_config.json: the chat template stores namespace"),
                "{e}"
            );
        }
        // Attributes named like the namespace, strings that mention it and its own attributes
        // are fine.
        let ok = "{% set ns = namespace(n=0, s='') %}{% set ns.n = ns.n + 1 %}{% set ns.s = 'ns' ~ ns.s %}{{ ns.n }}";
        assert_eq!(template(ok).unwrap().render(&[], false).unwrap(), "1");
    }
}
