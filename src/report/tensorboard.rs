//! TensorBoard event files (`train.report_to = ["tensorboard"]`): every numeric value of a
//! metrics record as a scalar, tagged as transformers' TensorBoardCallback tags them
//! (`eval_f1` -> `eval/f1`, `loss` -> `train/loss`).
//!
//! The format is TensorFlow's: a file of TFRecords (length, its masked CRC-32C, the bytes,
//! their masked CRC-32C), each an `Event` protobuf; the first carries the file version.
//! Messages mirror tensorflow/core/util/event.proto and framework/summary.proto (only the
//! fields written here).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use prost::Message;

/// `tensorflow.Event`.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` holding a scalar. `simple_value` is a member of the `value`
/// oneof there: optional, so that 0.0 is written rather than left out as a default.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// TFRecord's checksum: CRC-32C, rotated and offset so that checksums of checksums differ.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// An open event file; records are flushed as they are written, so TensorBoard shows a run
/// while it trains.
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// Creates `events.out.tfevents.TIME.HOST` in `dir` (created if needed).
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let now = wall_time();
        let host = crate::runtime::sysinfo::hostname();
        let path = dir.join(format!("events.out.tfevents.{}.{host}", now as u64));
        let file = std::fs::File::create(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let mut w = EventWriter { path, file };
        w.write_event(&Event {
            wall_time: now,
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        Ok(w)
    }

    fn write_event(&mut self, event: &Event) -> Result<()> {
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc(&len).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc(&data).to_le_bytes());
        self.file
            .write_all(&record)
            .and_then(|()| self.file.flush())
            .with_context(|| format!("cannot write {}", self.path.display()))
    }

    /// Writes the numeric values of a metrics record (its `step` the event's step) as
    /// scalars.
    /// Flushes the events so far to the disk.
    pub fn sync(&self) -> Result<()> {
        self.file
            .sync_data()
            .with_context(|| format!("cannot sync {} to disk", self.path.display()))
    }

    pub fn write_record(&mut self, record: &serde_json::Value) -> Result<()> {
        let Some(fields) = record.as_object() else {
            return Ok(());
        };
        let step = fields.get("step").and_then(|s| s.as_i64()).unwrap_or(0);
        let value: Vec<SummaryValue> = fields
            .iter()
            .filter(|(k, _)| k.as_str() != "step")
            .filter_map(|(k, v)| {
                let tag = match k.strip_prefix("eval_") {
                    Some(rest) => format!("eval/{rest}"),
                    None => format!("train/{k}"),
                };
                Some(SummaryValue {
                    tag,
                    simple_value: Some(v.as_f64()? as f32),
                })
            })
            .collect();
        if value.is_empty() {
            return Ok(());
        }
        self.write_event(&Event {
            wall_time: wall_time(),
            step,
            file_version: None,
            summary: Some(Summary { value }),
        })
    }
}

fn wall_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    /// The CRC is CRC-32C (Castagnoli), whose check value for "123456789" is 0xe3069283;
    /// the masking is checked by TensorBoard's own reader in tests/tensorboard.rs.
    #[test]
    fn the_checksum_is_crc32c() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
    }
}
