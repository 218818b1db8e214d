//! The repository holds sources, not build artefacts: no Python wheels or archives are
//! tracked, and no file over 5 MB outside tests/fixtures (which holds reference tensors).

mod common;

use std::path::Path;

const LIMIT_BYTES: u64 = 5 * 1024 * 1024;

/// Tracked files whose name marks a package or build artefact.
fn is_artefact(path: &str) -> bool {
    [".whl", ".tar.gz", ".so", ".o", ".a", ".egg"]
        .iter()
        .any(|ext| path.ends_with(ext))
        || path.contains(".so.")
}

#[test]
fn no_artefacts_or_large_files_are_tracked() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let listed = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root)
        .output()
        .ok()
        .filter(|o| o.status.success());
    let Some(listed) = common::require(listed, "not a git checkout (git ls-files failed)") else {
        return;
    };
    let files: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .split('\0')
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect();
    assert!(
        files.len() > 50,
        "git ls-files listed only {} files",
        files.len()
    );
    let artefacts: Vec<&String> = files.iter().filter(|p| is_artefact(p)).collect();
    assert!(
        artefacts.is_empty(),
        "build artefacts are tracked: {artefacts:?}"
    );
    let large: Vec<(&String, u64)> = files
        .iter()
        .filter(|p| !p.starts_with("tests/fixtures/"))
        .filter_map(|p| Some((p, std::fs::metadata(root.join(p)).ok()?.len())))
        .filter(|(_, n)| *n > LIMIT_BYTES)
        .collect();
    assert!(
        large.is_empty(),
        "files over 5 MB outside tests/fixtures: {large:?}"
    );
}

#[test]
fn artefact_names_are_recognised() {
    assert!(is_artefact(
        "numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl"
    ));
    assert!(is_artefact("lib/libtorch_cpu.so"));
    assert!(is_artefact("lib/libc10.so.2"));
    assert!(!is_artefact("src/models/seeded.cpp"));
    assert!(!is_artefact("scripts/setup.sh"));
}
