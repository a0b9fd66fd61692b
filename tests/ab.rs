//! `specd ab` end to end on a few prompts, and the dataset loaders.

use specd_test_kit as common;

use specd::ab;

#[test]
fn spec_bench_loader_reads_480_questions_in_13_categories() {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(ab::SPEC_BENCH_PATH);
    let v = ab::load_spec_bench(Some(&p)).unwrap();
    let embedded = ab::load_spec_bench(None).unwrap();
    assert_eq!(embedded, v, "the binary embeds the repository's copy");
    assert_eq!(v.len(), 480);
    let cats: std::collections::BTreeSet<_> = v.iter().map(|p| p.category.clone()).collect();
    assert_eq!(cats.len(), 13, "{cats:?}");
    assert!(v.iter().all(|p| !p.text.is_empty()));
    assert_eq!(ab::limit_per_category(v, 2).len(), 26);
    let he = ab::load_humaneval(None).unwrap();
    assert_eq!(he.len(), 164);
    assert_eq!(he[0].id, "HumanEval/0");
}

/// `specd ab --config configs/ab/quick.toml` over the first HumanEval
/// prompts with `args` added, which must succeed: its stdout and output
/// directory.
fn quick_ab(name: &str, args: &[&str]) -> (String, common::TempDir) {
    common::smollm_path();
    let dir = common::TempDir::new(name);
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
            "--out",
            dir.0.to_str().unwrap(),
        ])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (stdout, dir)
}

/// `quick_ab`, which must write its three reports: its stdout and
/// results.json.
fn quick_humaneval_ab(name: &str, args: &[&str]) -> (String, serde_json::Value) {
    let (stdout, dir) = quick_ab(name, args);
    let r = serde_json::from_str(&std::fs::read_to_string(dir.0.join("results.json")).unwrap())
        .unwrap();
    let html = std::fs::read_to_string(dir.0.join("report.html")).unwrap();
    assert!(html.matches("<svg").count() >= 3);
    assert!(std::fs::read_to_string(dir.0.join("summary.md"))
        .unwrap()
        .contains("| ngram |"));
    (stdout, r)
}

#[test]
fn tiny_ab_run_writes_reports_and_checks_losslessness() {
    let (stdout, r) =
        quick_humaneval_ab("ab", &["--limit-per-category", "3", "--max-tokens", "24"]);
    assert!(
        stdout.contains("Every greedy arm matched plain decoding token for token"),
        "{stdout}"
    );
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
}

/// Sampled with one seed per prompt, the lookup arms (one-hot drafts) are
/// compared with plain decoding token for token too, and match: each
/// position's token is plain decoding's draw for the seed, whatever was
/// drafted and accepted.
#[test]
fn a_sampled_ab_run_compares_the_one_hot_arms_with_plain() {
    let (stdout, r) = quick_humaneval_ab(
        "ab-sampled",
        &[
            "--limit-per-category",
            "4",
            "--max-tokens",
            "48",
            "--temperature",
            "0.8",
        ],
    );
    assert!(
        stdout.contains(
            "the arms drafting one-hot (ngram, suffix) matched plain decoding token for token"
        ),
        "{stdout}"
    );
    assert_eq!(r["compared"], serde_json::json!(["ngram", "suffix"]));
    assert_eq!(r["mismatches"], serde_json::json!([]));
    let recs = r["records"].as_array().unwrap();
    let accepted: u64 = recs
        .iter()
        .filter(|x| x["arm"] != "plain")
        .map(|x| x["accepted"].as_u64().unwrap())
        .sum();
    assert!(accepted > 0, "the lookup arms must accept drafts");
}

/// A sampled concurrency sweep compares plain and the lookup arms at
/// every concurrency with plain decoding at the first: one-hot drafts give
/// plain decoding's draws for the seed, alone or batched.
#[test]
fn a_sampled_concurrency_sweep_compares_the_one_hot_arms_at_every_point() {
    let (stdout, dir) = quick_ab(
        "ab-sweep",
        &[
            "--limit-per-category",
            "3",
            "--max-tokens",
            "32",
            "--temperature",
            "0.8",
            "--concurrency",
            "1,3",
        ],
    );
    assert!(
        stdout.contains("plain, ngram, suffix matched plain decoding at concurrency 1 token for token at every concurrency"),
        "{stdout}"
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.0.join("sweep.json")).unwrap()).unwrap();
    assert_eq!(
        r["compared"],
        serde_json::json!(["plain", "ngram", "suffix"])
    );
    assert_eq!(r["mismatches"], serde_json::json!([]));
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 6);
    // The lookup arms drafted and had drafts accepted with 3 in flight.
    for arm in ["ngram", "suffix"] {
        let row = rows
            .iter()
            .find(|x| x["arm"] == arm && x["concurrency"] == 3)
            .unwrap();
        assert!(row["accepted"].as_u64().unwrap() > 0, "{row}");
    }
}

#[test]
fn repeats_start_from_fresh_proposers() {
    common::smollm_path();
    let dir = common::TempDir::new("ab-repeats");
    // Drafts priced at the constant: a greedy request alone is otherwise
    // priced from measured times, and its draft lengths vary with them.
    let cfg = dir.0.join("quick.toml");
    let quick = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/ab/quick.toml"),
    )
    .unwrap();
    std::fs::write(
        &cfg,
        format!("[engine]\ndraft_pricing = \"fixed\"\n{quick}"),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_specd"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "ab",
            "--config",
            cfg.to_str().unwrap(),
            "--dataset",
            "humaneval",
            "--limit-per-category",
            "2",
            "--max-tokens",
            "32",
            "--repeats",
            "2",
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
    assert!(stdout.contains("fresh proposer instances"), "{stdout}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.0.join("results.json")).unwrap())
            .unwrap();
    // Greedy and fresh state: the suffix arm drafts exactly the same in
    // both repeats (a tree kept from the first repeat would already know
    // every output and accept more the second time).
    let suffix: Vec<(String, u64, u64, u64)> = r["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["arm"] == "suffix")
        .map(|x| {
            (
                x["prompt_id"].as_str().unwrap().to_string(),
                x["repeat"].as_u64().unwrap(),
                x["drafted"].as_u64().unwrap(),
                x["accepted"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(suffix.len(), 4);
    for (id, rep, drafted, accepted) in &suffix {
        if *rep == 1 {
            let first = suffix.iter().find(|s| &s.0 == id && s.1 == 0).unwrap();
            assert_eq!(
                (first.2, first.3),
                (*drafted, *accepted),
                "{id}: {suffix:?}"
            );
        }
    }
}

#[test]
fn arms_on_the_same_proposer_draft_from_their_own_instances() {
    // Two arms on one suffix proposer, back to back on every prompt: with
    // a shared instance, whichever ran second would draft the first's
    // identical greedy output from the tree. Each has its own, so both
    // draft and accept exactly the same (at constant prices: measured ones
    // vary draft lengths with the machine's timing).
    common::smollm_path();
    let dir = common::TempDir::new("ab-shared");
    let cfg = dir.0.join("ab.toml");
    std::fs::write(
        &cfg,
        "[engine]\ndraft_pricing = \"fixed\"\n\
         [[proposer]]\nname = \"suffix\"\nplugin = \"suffix\"\nmax_draft = 6\n\
         [ab]\ndataset = \"humaneval\"\nlimit_per_category = 3\nmax_tokens = 32\nbootstrap = 50\n\
         [[ab.arm]]\nname = \"suffix\"\nproposer = \"suffix\"\n\
         [[ab.arm]]\nname = \"suffix-again\"\nproposer = \"suffix\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_specd"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["ab", "--config", cfg.to_str().unwrap(), "--out"])
        .arg(dir.0.join("out"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.0.join("out/results.json")).unwrap())
            .unwrap();
    let of = |arm: &str| -> Vec<(String, u64, u64)> {
        let mut v: Vec<_> = r["records"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|x| x["arm"] == arm)
            .map(|x| {
                (
                    x["prompt_id"].as_str().unwrap().to_string(),
                    x["drafted"].as_u64().unwrap(),
                    x["accepted"].as_u64().unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let (a, b) = (of("suffix"), of("suffix-again"));
    assert_eq!(a.len(), 3);
    assert_eq!(a, b, "the arms drafted differently");
}
