//! A model named by Hub id, against a stand-in for the Hugging Face Hub on loopback: the
//! weights to fetch are decided from the repository's file listing, and each way the Hub can
//! fail is reported as what it is — no server, a refused token, a missing repository or
//! revision, a repository with only PyTorch pickles — in one line with a non-zero exit.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;

use common::{fixtures, sprtrain};

/// Serves `status` and `body` to at most `requests` connections on a loopback port, then
/// stops; returns the endpoint's URL.
fn stand_in_hub(status: &'static str, body: &'static str, requests: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming().take(requests).flatten() {
            let mut reader = BufReader::new(&stream);
            let mut line = String::new();
            // The request line and headers, up to the blank line.
            while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                line.clear();
            }
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = (&stream).write_all(response.as_bytes());
        }
    });
    url
}

/// `sprtrain predict` on Hub id org/tiny with the Hub at `endpoint`: its one error line.
fn predict_from_hub(endpoint: &str, home: &Path) -> String {
    let input = fixtures()
        .join("parity")
        .join("bert-seq-cls-single")
        .join("predict_input.jsonl");
    let run = sprtrain()
        .args([
            "predict", "--task", "seq-cls", "--model", "org/tiny", "--input",
        ])
        .arg(&input)
        .arg("--output")
        .arg(home.join("out.jsonl"))
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HOME", home)
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HF_TOKEN")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr).trim().to_string();
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(!home.join("out.jsonl").exists(), "no output on error");
    eprintln!("{stderr}");
    stderr
}

#[test]
fn no_server_is_a_network_error() {
    let home = tempfile::tempdir().unwrap();
    // A port that was just free: nothing listens on it.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let line = predict_from_hub(&format!("http://127.0.0.1:{port}"), home.path());
    assert!(
        line.contains("cannot reach the Hugging Face Hub for org/tiny")
            && line.contains("HF_HUB_OFFLINE=1"),
        "{line}"
    );
}

#[test]
fn a_refused_token_names_hf_token() {
    let home = tempfile::tempdir().unwrap();
    let hub = stand_in_hub("401 Unauthorized", "{\"error\":\"Invalid credentials\"}", 4);
    let line = predict_from_hub(&hub, home.path());
    assert!(
        line.contains("refused the file listing of org/tiny") && line.contains("HF_TOKEN"),
        "{line}"
    );
}

#[test]
fn a_missing_repository_or_revision_says_so() {
    let home = tempfile::tempdir().unwrap();
    let hub = stand_in_hub("404 Not Found", "{\"error\":\"Repository not found\"}", 4);
    let line = predict_from_hub(&hub, home.path());
    assert!(
        line.ends_with(
            "org/tiny (revision main) is not on the Hugging Face Hub: no such repository, or no such branch, tag or commit"
        ),
        "{line}"
    );
}

#[test]
fn a_repository_with_only_pytorch_weights_is_refused_before_any_download() {
    let home = tempfile::tempdir().unwrap();
    let listing = r#"{"sha":"abc123","siblings":[{"rfilename":"config.json"},{"rfilename":"tokenizer.json"},{"rfilename":"pytorch_model.bin"},{"rfilename":"README.md"}]}"#;
    // One request only: the listing. A download attempt would find no server.
    let hub = stand_in_hub("200 OK", listing, 1);
    let line = predict_from_hub(&hub, home.path());
    assert!(
        line.contains("org/tiny has no safetensors weights, only pytorch_model.bin")
            && line.contains("save_pretrained"),
        "{line}"
    );
}
