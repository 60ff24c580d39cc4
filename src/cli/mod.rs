//! Subcommands of the `packshard` binary.

pub mod bench;
pub mod check;
pub mod eval;
pub mod golden;
pub mod pack;
pub mod pipeline;
pub mod verify;
pub mod verify_causal;
pub mod verify_sample;
pub mod vocab;

/// A command-line failure: a one-line message and the exit status (2 for bad
/// input or usage, 1 for a check that failed).
#[derive(Debug)]
pub struct CliError {
    pub code: u8,
    pub message: String,
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // One line, whatever the source said.
        f.write_str(&self.message.replace('\n', " "))
    }
}

impl CliError {
    /// Bad input or usage: exit status 2.
    pub fn input(message: impl std::fmt::Display) -> Self {
        CliError {
            code: 2,
            message: message.to_string(),
        }
    }
}

impl From<packshard::reference::Error> for CliError {
    fn from(e: packshard::reference::Error) -> Self {
        CliError::input(e)
    }
}

/// Reads a file, naming it in the error.
pub fn read_file(path: &std::path::Path) -> Result<String, CliError> {
    std::fs::read_to_string(path).map_err(|e| CliError::input(format!("{}: {e}", path.display())))
}

/// Writes a file, naming it in the error.
pub fn write_file(path: &std::path::Path, text: &str) -> Result<(), CliError> {
    std::fs::write(path, text).map_err(|e| CliError::input(format!("{}: {e}", path.display())))
}
