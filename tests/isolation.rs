//! Proposer crash isolation (`isolation = "process"`): plugins that
//! segfault, abort, exit, overflow their stack or hang never take the
//! daemon down, never lose a request, and never change an output.
//!
//! In process (`isolation = "none"`, the default) the same fixtures are
//! fatal by design: a segfault, abort, exit or stack overflow ends the
//! daemon's process and a hang stalls the draft stage. That is what
//! process isolation is for (and why `export_proposer!` refuses
//! `panic = "abort"`: `tests/plugins.rs`).

mod common;

use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::json;

const PROMPTS: [&str; 3] = [
    "def fibonacci(n):",
    "List: 1, 2, 3, 1, 2, 3, 1, 2,",
    "The capital of France is Paris. The capital of France is",
];

fn crashy() -> String {
    let dir = common::build_fixture_plugins();
    let lib = dir.join(format!(
        "{}specd_fixture_crashy{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    assert!(lib.is_file(), "{} was not built", lib.display());
    lib.display().to_string()
}

/// One process-isolated crashy proposer per failure mode, and a healthy one.
fn config(lib: &str) -> String {
    let mut c = String::from(
        "[engine]\nmax_running = 16\nmax_batch_tokens = 512\nmax_draft = 4\nadaptive_draft = false\n",
    );
    for (name, mode, at, extra) in [
        ("healthy", "none", 1, ""),
        ("segfault", "segfault", 3, ""),
        ("abort", "abort", 2, ""),
        ("exit", "exit", 4, ""),
        ("overflow", "stack-overflow", 3, ""),
        ("hang", "hang", 3, "propose_timeout_ms = 300\n"),
    ] {
        c.push_str(&format!(
            "[[proposer]]\nname = \"{name}\"\npath = \"{lib}\"\nisolation = \"process\"\n{extra}options = {{ mode = \"{mode}\", at = {at} }}\n"
        ));
    }
    c
}

fn complete(addr: &str, prompt: &str, proposer: &str, stream: bool) -> (String, serde_json::Value) {
    let body = json!({"prompt": prompt, "max_tokens": 48, "temperature": 0, "stream": stream,
                      "speculation": {"proposer": proposer}});
    let r = common::http(
        addr,
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
        &[],
    );
    assert_eq!(r.status, 200, "{proposer}: {}", r.body);
    if !stream {
        let j = r.json();
        return (
            j["choices"][0]["text"].as_str().unwrap().to_string(),
            j["usage"].clone(),
        );
    }
    assert!(r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);
    let chunks = r.sse();
    let text = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or(""))
        .collect();
    (text, chunks.last().unwrap()["usage"].clone())
}

#[test]
fn crashing_exiting_and_hanging_plugins_in_child_processes_never_cost_a_token() {
    let lib = crashy();
    let d = Daemon::start(&config(&lib), &[]);
    let plain: Vec<String> = PROMPTS
        .iter()
        .map(|p| complete(&d.addr, p, "none", false).0)
        .collect();
    let modes = ["healthy", "segfault", "abort", "exit", "overflow", "hang"];
    // Two rounds of concurrent streams, so the second round meets children
    // restarted after the first round's failures.
    for round in 0..2 {
        let handles: Vec<_> = modes
            .iter()
            .flat_map(|m| (0..PROMPTS.len()).map(move |i| (*m, i)))
            .map(|(m, i)| {
                let addr = d.addr.clone();
                std::thread::spawn(move || (m, i, complete(&addr, PROMPTS[i], m, true)))
            })
            .collect();
        for h in handles {
            let (m, i, (text, usage)) = h.join().unwrap();
            assert_eq!(
                text, plain[i],
                "round {round}: `{m}` changed the greedy output of prompt {i}"
            );
            assert_eq!(usage["speculation"]["proposer"], m);
        }
        std::thread::sleep(Duration::from_millis(400));
    }
    let log = d.stderr.lock().unwrap().clone();
    for needle in [
        "SIGSEGV",
        "SIGABRT",
        "exited with status 3",
        "missed its deadline",
    ] {
        assert!(
            log.contains(needle),
            "the log never says `{needle}`:\n{log}"
        );
    }
    for m in ["segfault", "abort", "exit", "overflow"] {
        let lbl = format!("proposer=\"{m}\"");
        assert!(
            d.metric_where("specd_proposer_crashes_total", &lbl) >= 1.0,
            "{m}: no crash counted"
        );
    }
    assert!(d.metric_where("specd_proposer_timeouts_total", "proposer=\"hang\"") >= 1.0);
    assert!(
        d.metric_where("specd_proposer_restarts_total", "") >= 1.0,
        "no child was ever restarted:\n{log}"
    );
    // The healthy child speculated (and got tokens accepted) throughout.
    assert_eq!(
        d.metric_where("specd_proposer_crashes_total", "proposer=\"healthy\""),
        0.0
    );
    assert!(
        d.metric_where("specd_accepted_tokens_total", "proposer=\"healthy\"") > 0.0,
        "the healthy isolated proposer never had a token accepted"
    );
    // The daemon still serves, losslessly.
    assert_eq!(complete(&d.addr, PROMPTS[0], "segfault", false).0, plain[0]);
    let t = Instant::now();
    while d.metric("specd_kv_used_blocks") != 0.0 {
        assert!(t.elapsed() < Duration::from_secs(20), "KV never freed");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_process_isolated_plugin_drafts_exactly_what_it_drafts_in_process() {
    // Same plugin, same seeds: identical drafts make identical sampled
    // outputs and identical acceptance counts; anything lost or altered on
    // the wire (a token, a q) would show.
    let d = Daemon::start(
        r#"
[engine]
max_draft = 4
adaptive_draft = false
[[proposer]]
name = "ngram"
plugin = "ngram"
[[proposer]]
name = "ngram-process"
plugin = "ngram"
isolation = "process"
[[proposer]]
name = "suffix"
plugin = "suffix"
[[proposer]]
name = "suffix-process"
plugin = "suffix"
isolation = "process"
"#,
        &[],
    );
    let mut accepted = 0;
    for (i, p) in PROMPTS.iter().enumerate() {
        for pair in [["ngram", "ngram-process"], ["suffix", "suffix-process"]] {
            let run = |prop: &str| {
                let r = d.post(
                    "/v1/completions",
                    &json!({"prompt": p, "max_tokens": 40, "temperature": 0.8, "seed": 7 + i,
                            "speculation": {"proposer": prop}}),
                );
                assert_eq!(r.status, 200, "{}", r.body);
                let j = r.json();
                let s = &j["usage"]["speculation"];
                (
                    j["choices"][0]["text"].as_str().unwrap().to_string(),
                    s["drafted_tokens"].as_u64().unwrap(),
                    s["accepted_tokens"].as_u64().unwrap(),
                )
            };
            let (a, b) = (run(pair[0]), run(pair[1]));
            assert_eq!(a, b, "{} in process vs in a child, prompt {i}", pair[0]);
            accepted += a.2;
        }
    }
    assert!(
        accepted > 0,
        "nothing was accepted: the comparison is empty"
    );
}
