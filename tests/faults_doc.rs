//! `docs/FAULTS.md` and `packshard_reference::faults::CATALOGUE` are one
//! list: every kind in the code has a heading `### <id> <title>` on the page,
//! in the same order, and the page has no other kind.

use packshard::reference::faults::CATALOGUE;

#[test]
fn the_fault_page_and_the_catalogue_agree() {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/FAULTS.md"))
        .expect("docs/FAULTS.md");
    let headings: Vec<&str> = page
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .collect();
    let listed: Vec<String> = CATALOGUE
        .iter()
        .map(|k| format!("{} {}", k.id, k.title))
        .collect();
    assert_eq!(
        headings, listed,
        "docs/FAULTS.md headings vs faults::CATALOGUE"
    );
    assert!(listed.len() >= 14);
}
