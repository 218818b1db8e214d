//! Third-party parsers that panic on some malformed files (the tokenizers crate inside its
//! deserialisers, the parquet crate on corrupt metadata) instead of returning an error: their
//! panics become errors naming the file, so a user's file can never crash the process.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use anyhow::{anyhow, Result};

thread_local! {
    static CATCHING: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is inside [`catch`]: the process's panic hook stays quiet then (the
/// panic is reported as an error instead).
pub fn is_catching() -> bool {
    CATCHING.with(Cell::get)
}

/// Runs `parse` on `path`; a panic inside it is an error "PATH: cannot be read by WHAT: ...".
pub fn catch<T>(path: &Path, what: &str, parse: impl FnOnce() -> Result<T>) -> Result<T> {
    let outer = CATCHING.with(|c| c.replace(true));
    let result = catch_unwind(AssertUnwindSafe(parse));
    CATCHING.with(|c| c.set(outer));
    result.unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let first = message.lines().next().unwrap_or("");
        Err(anyhow!(
            "{} is malformed ({what} failed on it: {first})",
            path.display()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_error_naming_the_file() {
        let err = catch(
            Path::new("data/x.parquet"),
            "the parquet reader",
            || -> Result<()> { panic!("capacity overflow\nmore") },
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "data/x.parquet is malformed (the parquet reader failed on it: capacity overflow)"
        );
        assert!(!is_catching());
        assert_eq!(catch(Path::new("f"), "x", || Ok(3)).unwrap(), 3);
    }
}
