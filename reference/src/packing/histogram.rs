//! Sequence-length histograms: the input of histogram packing (Krell et al., §3).

use crate::error::{Error, Result};

/// A histogram of sequence lengths.
///
/// `counts[l]` is the number of sequences of exactly `l` tokens, for `l` in
/// `0..=max_length()`. `counts[0]` counts empty sequences: they are carried so
/// that nothing is lost silently, but no packer places them (they are reported
/// as `empty_sequences`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Histogram {
    counts: Vec<u64>,
}

/// The longest length a histogram holds (2^24 tokens): it keeps one counter per length.
pub const MAX_HISTOGRAM_LENGTH: usize = 1 << 24;

/// A real histogram embedded in the binary, with its source.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddedHistogram {
    /// Name used on the command line (`--dataset`) and in `eval`.
    pub name: &'static str,
    /// What the data is.
    pub description: &'static str,
    /// The pack length the data was truncated to (the natural `max_seq_len`).
    pub max_seq_len: usize,
    /// The `length,count` CSV text.
    pub csv: &'static str,
}

/// Attribution of the embedded histograms.
pub const EMBEDDED_SOURCE: &str =
    "graphcore/examples, tutorials/blogs_code/packedBERT/histograms.py \
(commit 2d8b565326ef6ba730492ad8badd984b067645bc, MIT license), published with Krell et al., \
\"Efficient Sequence Packing without Cross-contamination\", arXiv:2107.02027";

/// The real histograms shipped with packshard (see `reference/data/SOURCES.md`).
pub const EMBEDDED: [EmbeddedHistogram; 2] = [
    EmbeddedHistogram {
        name: "wikipedia-512",
        description: "English Wikipedia, BERT pre-training phase 2 (16,279,552 sequences)",
        max_seq_len: 512,
        csv: include_str!("../../data/wikipedia_512_histogram.csv"),
    },
    EmbeddedHistogram {
        name: "squad-384",
        description: "SQuAD 1.1 training features after doc-stride (88,641 sequences)",
        max_seq_len: 384,
        csv: include_str!("../../data/squad_1_1_384_histogram.csv"),
    },
];

impl Histogram {
    /// Builds a histogram from `counts[l]` = number of sequences of length `l`.
    pub fn from_counts(counts: Vec<u64>) -> Self {
        let mut counts = counts;
        if counts.is_empty() {
            counts.push(0);
        }
        Histogram { counts }
    }

    /// Builds the histogram of explicit sequence lengths (`lengths: [n]`, tokens).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `lengths[i]` for a length over
    /// [`MAX_HISTOGRAM_LENGTH`] (a histogram holds one counter per length).
    pub fn from_lengths(lengths: &[usize]) -> Result<Self> {
        if let Some(i) = lengths.iter().position(|&l| l > MAX_HISTOGRAM_LENGTH) {
            return Err(Error::invalid(
                format!("lengths[{i}]"),
                format!(
                    "{} tokens is over the {MAX_HISTOGRAM_LENGTH} a histogram can hold",
                    lengths[i]
                ),
            ));
        }
        let max = lengths.iter().copied().max().unwrap_or(0);
        let mut counts = vec![0u64; max + 1];
        for &l in lengths {
            counts[l] += 1;
        }
        Ok(Histogram { counts })
    }

    /// Parses `length,count` CSV (blank lines and `#` comments are skipped).
    /// A header line is optional; when there is one its column names say
    /// which column is which (`length,count` or `count,length`, any case).
    /// Lengths may repeat: their counts add up.
    ///
    /// # Errors
    /// [`Error::Parse`] naming `source_name` and the 1-based line for a line that
    /// is not two non-negative integers, or a header whose columns are not
    /// `length` and `count`.
    pub fn from_csv(source_name: &str, text: &str) -> Result<Self> {
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(false)
            // Comment lines are skipped below, not by the reader: its line
            // numbers would not count them. No quoting: a histogram holds
            // integers, and a stray quote in a comment must not swallow lines.
            .quoting(false)
            .trim(csv::Trim::All)
            .flexible(true)
            .from_reader(text.as_bytes());
        let mut pairs: Vec<(usize, u64)> = Vec::new();
        // Column of the length and of the count.
        let mut columns = (0usize, 1usize);
        let mut first = true;
        for (i, record) in reader.records().enumerate() {
            let record = record.map_err(|e| Error::Parse {
                source_name: source_name.to_string(),
                line: e.position().map_or(i + 1, |p| p.line() as usize),
                message: e.to_string(),
            })?;
            let line = record.position().map_or(i + 1, |p| p.line() as usize);
            let parse_err = |message: String| Error::Parse {
                source_name: source_name.to_string(),
                line,
                message,
            };
            if (record.len() == 1 && record[0].is_empty()) || record[0].starts_with('#') {
                continue;
            }
            if record.len() != 2 {
                return Err(parse_err(format!(
                    "expected `length,count`, found {} fields",
                    record.len()
                )));
            }
            if std::mem::take(&mut first) && record[0].parse::<u64>().is_err() {
                // A header line: its names say which column is which.
                let name = |k: usize| record[k].to_ascii_lowercase();
                columns = match (name(0).as_str(), name(1).as_str()) {
                    ("length", "count") => (0, 1),
                    ("count", "length") => (1, 0),
                    _ => {
                        return Err(parse_err(format!(
                            "header `{},{}`: the columns must be named `length` and `count`",
                            &record[0], &record[1]
                        )))
                    }
                };
                continue;
            }
            let (a, b) = (&record[columns.0], &record[columns.1]);
            let length: usize = a
                .parse()
                .map_err(|_| parse_err(format!("length {a:?} is not a non-negative integer")))?;
            let count: u64 = b
                .parse()
                .map_err(|_| parse_err(format!("count {b:?} is not a non-negative integer")))?;
            if length > MAX_HISTOGRAM_LENGTH {
                return Err(parse_err(format!(
                    "length {length} is over the {MAX_HISTOGRAM_LENGTH} a histogram can hold"
                )));
            }
            pairs.push((length, count));
        }
        let max = pairs.iter().map(|p| p.0).max().unwrap_or(0);
        let mut counts = vec![0u64; max + 1];
        for (length, count) in pairs {
            counts[length] = counts[length]
                .checked_add(count)
                .ok_or_else(|| Error::Parse {
                    source_name: source_name.to_string(),
                    line: 0,
                    message: format!("count of length {length} overflows u64"),
                })?;
        }
        Ok(Histogram { counts })
    }

    /// One of the [`EMBEDDED`] histograms by name (`wikipedia-512`, `squad-384`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on field `dataset` for an unknown name.
    pub fn embedded(name: &str) -> Result<Self> {
        let entry = EMBEDDED.iter().find(|e| e.name == name).ok_or_else(|| {
            let names: Vec<_> = EMBEDDED.iter().map(|e| e.name).collect();
            Error::invalid(
                "dataset",
                format!("unknown dataset {name:?}; known: {}", names.join(", ")),
            )
        })?;
        Histogram::from_csv(entry.name, entry.csv)
    }

    /// `counts[l]` = number of sequences of length `l`, for `l` in `0..=max_length()`.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// Number of sequences of length `l` (0 beyond the maximum).
    pub fn count(&self, l: usize) -> u64 {
        self.counts.get(l).copied().unwrap_or(0)
    }

    /// The longest length the histogram can hold (its last index).
    pub fn max_length(&self) -> usize {
        self.counts.len() - 1
    }

    /// The longest length with a non-zero count (0 if none).
    pub fn longest(&self) -> usize {
        self.counts.iter().rposition(|&c| c > 0).unwrap_or(0)
    }

    /// Number of non-empty sequences (saturating at `u64::MAX`).
    pub fn num_sequences(&self) -> u64 {
        self.counts
            .iter()
            .skip(1)
            .fold(0u64, |a, &c| a.saturating_add(c))
    }

    /// Number of empty (length 0) sequences.
    pub fn empty_sequences(&self) -> u64 {
        self.counts[0]
    }

    /// Total tokens, `sum_l l * counts[l]` (saturating at `u64::MAX`).
    pub fn real_tokens(&self) -> u64 {
        self.counts.iter().enumerate().fold(0u64, |a, (l, &c)| {
            a.saturating_add((l as u64).saturating_mul(c))
        })
    }

    /// Fraction of padding when every sequence is padded to `max_seq_len`.
    pub fn padding_fraction(&self, max_seq_len: usize) -> f64 {
        let n = self.num_sequences();
        if n == 0 {
            return 0.0;
        }
        1.0 - self.real_tokens() as f64 / (n as f64 * max_seq_len as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_histograms_match_published_totals() {
        // (name, max_length, num_sequences, real_tokens)
        for (name, max_length, sequences, tokens) in [
            ("wikipedia-512", 512, 16_279_552, 4_164_796_173),
            ("squad-384", 384, 88_641, 15_249_479),
        ] {
            let h = Histogram::embedded(name).unwrap();
            assert_eq!(h.max_length(), max_length, "{name}");
            assert_eq!(h.num_sequences(), sequences, "{name}");
            assert_eq!(h.real_tokens(), tokens, "{name}");
        }
        let h = Histogram::embedded("wikipedia-512").unwrap();
        assert!((h.padding_fraction(512) - 0.50033).abs() < 5e-6);
    }

    #[test]
    fn csv_errors_name_the_line() {
        let err = Histogram::from_csv("x.csv", "length,count\n1,2\n3,-4\n").unwrap_err();
        assert_eq!(
            err,
            Error::Parse {
                source_name: "x.csv".into(),
                line: 3,
                message: "count \"-4\" is not a non-negative integer".into()
            }
        );
        let err = Histogram::from_csv("x.csv", "1,2,3\n").unwrap_err();
        assert!(matches!(err, Error::Parse { line: 1, .. }), "{err:?}");
    }

    #[test]
    fn csv_repeated_lengths_add_up_and_zero_is_empty() {
        let h = Histogram::from_csv("<inline>", "0,2\n3,1\n3,4\n").unwrap();
        assert_eq!(h.counts(), &[2, 0, 0, 5]);
        assert_eq!(h.empty_sequences(), 2);
        assert_eq!(h.num_sequences(), 5);
    }

    #[test]
    fn csv_header_names_the_columns() {
        let a = Histogram::from_csv("a.csv", "length,count\n3,10\n5,2\n").unwrap();
        let b = Histogram::from_csv("b.csv", "count,length\n10,3\n2,5\n").unwrap();
        assert_eq!(a, b);
        assert_eq!(a.count(3), 10);
        assert_eq!(a.count(5), 2);
        let e = Histogram::from_csv("c.csv", "# lengths\nlen,n\n3,10\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "c.csv line 2: header `len,n`: the columns must be named `length` and `count`"
        );
    }

    #[test]
    fn unknown_dataset_is_an_error() {
        assert_eq!(
            Histogram::embedded("c4").unwrap_err().kind(),
            "invalid_argument"
        );
    }
}
