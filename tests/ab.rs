//! `specd ab` end to end on a few prompts, and the dataset loaders.

mod common;

use specd::ab;

#[test]
fn spec_bench_loader_reads_480_questions_in_13_categories() {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(ab::SPEC_BENCH);
    let v = ab::load_spec_bench(&p).unwrap();
    assert_eq!(v.len(), 480);
    let cats: std::collections::BTreeSet<_> = v.iter().map(|p| p.category.clone()).collect();
    assert_eq!(cats.len(), 13, "{cats:?}");
    assert!(v.iter().all(|p| !p.text.is_empty()));
    assert_eq!(ab::limit_per_category(v, 2).len(), 26);
}

#[test]
fn tiny_ab_run_writes_reports_and_checks_losslessness() {
    common::smollm_path();
    let dir = common::TempDir::new("ab");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_specd"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "ab",
            "--config",
            "configs/ab/quick.toml",
            "--dataset",
            "humaneval",
            "--path",
            "tests/data/humaneval_first20.jsonl",
            "--limit-per-category",
            "3",
            "--max-tokens",
            "24",
            "--out",
            dir.0.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("Every greedy arm matched plain decoding token for token"),
        "{stdout}"
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.0.join("results.json")).unwrap())
            .unwrap();
    assert_eq!(r["prompts"], 3);
    let arms: Vec<&str> = r["overall"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["arm"].as_str().unwrap())
        .collect();
    assert_eq!(arms, vec!["plain", "ngram", "suffix"]);
    assert_eq!(r["overall"][0]["speedup"], 1.0);
    for a in r["overall"].as_array().unwrap() {
        assert!(a["speedup_ci95"][0].as_f64().unwrap() <= a["speedup_ci95"][1].as_f64().unwrap());
        assert!(a["tpot_p95_ms"].as_f64().unwrap() >= a["tpot_p50_ms"].as_f64().unwrap());
    }
    assert_eq!(r["records"].as_array().unwrap().len(), 9);
    // Interleaving: the first prompt's arms run in a different order than the second's.
    let recs = r["records"].as_array().unwrap();
    assert_ne!(recs[0]["arm"], recs[3]["arm"]);
    let html = std::fs::read_to_string(dir.0.join("report.html")).unwrap();
    assert!(html.matches("<svg").count() >= 3);
    assert!(std::fs::read_to_string(dir.0.join("summary.md"))
        .unwrap()
        .contains("| ngram |"));
}
