//! `packshard pack --plot FILE.svg`: the SVG is well-formed XML with the
//! expected series (length histogram, real and padding tokens, one fill curve
//! per algorithm row).

use std::path::{Path, PathBuf};

mod common;
use common::{packshard, succeeded, temp_path};

/// `packshard pack ARGS --plot SVG`, which must succeed: its standard
/// output.
fn plot(args: &[&str], svg: &Path) -> String {
    let mut all = vec!["pack"];
    all.extend(args);
    all.extend(["--plot", svg.to_str().unwrap()]);
    succeeded(&packshard(&all, None))
}

/// The texts of every `<text>` element of the SVG at `path`, after checking
/// that it parses as XML with an `<svg>` root.
fn svg_texts(path: &PathBuf) -> (Vec<String>, usize) {
    let text = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("the plot is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or("").trim().to_string())
        .collect();
    let paths = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline") || n.has_tag_name("path"))
        .count();
    (texts, paths)
}

#[test]
fn plot_of_the_squad_table_has_every_series() {
    let svg = temp_path("plot", "squad.svg");
    let out = plot(&["--dataset", "squad-384", "--no-bound"], &svg);
    assert!(out.contains("plot written to"));
    let (texts, lines) = svg_texts(&svg);
    for needle in [
        "squad-384: sequence lengths",
        "sequences",
        "real tokens",
        "padding tokens",
        "padded to 384: 55.20% of the slots are padding",
        "pack fill per algorithm",
        "none 1/pack: 44.801%",
        "lpfhp max 3/pack: 97.739%",
        "nnlshp depth 3: 97.379%",
        "spfhp max 12/pack: 97.547%",
    ] {
        assert!(
            texts.iter().any(|t| t == needle),
            "missing {needle:?} in {texts:?}"
        );
    }
    // Real and padding lines, one fill curve per row (11 rows), legend marks.
    assert!(lines >= 13, "{lines} lines");
}

#[test]
fn plot_of_explicit_lengths() {
    let lengths = temp_path("plot", "lengths.txt");
    std::fs::write(&lengths, "5 9 13 2 2 7 30 31\n").unwrap();
    let svg = temp_path("plot", "lengths.svg");
    let lengths = lengths.to_str().unwrap();
    plot(
        &["--lengths", lengths, "--max-seq-len", "32", "-a", "lpfhp"],
        &svg,
    );
    let (texts, _) = svg_texts(&svg);
    assert!(
        texts.iter().any(|t| t.starts_with("lpfhp unlimited: ")),
        "{texts:?}"
    );
    assert!(texts.iter().any(|t| t == "padding tokens"), "{texts:?}");
}
