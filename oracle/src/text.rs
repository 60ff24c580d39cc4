//! Real text for the real model: lines from plain-text files, tokenized with
//! the model's own `tokenizer.json` (the `tokenizers` crate, pure-Rust
//! features), padding and truncation off.

use std::path::{Path, PathBuf};

/// The tokenizer type [`load_tokenizer`] returns (the `tokenizers` crate's).
pub use tokenizers::Tokenizer;

/// The most lines [`read_lines`] keeps (bounds memory whatever the input).
pub const MAX_LINES: usize = 1 << 20;

/// Loads `tokenizer.json` with padding and truncation turned off (the
/// MiniLM file pads to 128; sequences must keep their real lengths).
///
/// # Errors
/// A message naming the file.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, String> {
    let mut tok = Tokenizer::from_file(path).map_err(|e| format!("{}: {e}", path.display()))?;
    tok.with_padding(None);
    tok.with_truncation(None)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(tok)
}

/// Token ids of `text` with the special tokens (`[CLS] ... [SEP]` for BERT).
///
/// # Errors
/// The tokenizer's message.
pub fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<i64>, String> {
    let enc = tok.encode(text, true).map_err(|e| e.to_string())?;
    Ok(enc.get_ids().iter().map(|&i| i64::from(i)).collect())
}

/// The text files of `path`: the file itself, or the `*.txt` files of a
/// directory in name order.
///
/// # Errors
/// A message naming the path.
pub fn text_files(path: &Path) -> Result<Vec<PathBuf>, String> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let entries = std::fs::read_dir(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "txt") && p.is_file())
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("{}: no .txt files", path.display()));
    }
    Ok(files)
}

/// Up to `max_lines` non-blank lines (trimmed) of the text files of `path`,
/// taken round-robin over the files (one line of each in turn) so a small
/// sample still spans many works.
///
/// # Errors
/// A message naming the unreadable file.
pub fn read_lines(path: &Path, max_lines: usize) -> Result<Vec<String>, String> {
    let max_lines = max_lines.min(MAX_LINES);
    let mut per_file = Vec::new();
    for f in text_files(path)? {
        let bytes = std::fs::read(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let lines: Vec<String> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect();
        per_file.push(lines.into_iter());
    }
    let mut out = Vec::new();
    loop {
        let mut any = false;
        for it in per_file.iter_mut() {
            if out.len() >= max_lines {
                return Ok(out);
            }
            if let Some(l) = it.next() {
                out.push(l);
                any = true;
            }
        }
        if !any {
            return Ok(out);
        }
    }
}
