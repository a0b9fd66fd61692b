//! Proposer crash isolation (`isolation = "process"`): plugins that
//! segfault, abort, exit, overflow their stack or hang never take the
//! daemon down, never lose a request, and never change an output.
//!
//! In process (`isolation = "none"`, the default) the same fixtures are
//! fatal by design: a segfault, abort, exit or stack overflow ends the
//! daemon's process and a hang stalls the draft stage. That is what
//! process isolation is for (and why `export_proposer!` refuses
//! `panic = "abort"`: `tests/plugins.rs`).

use specd_test_kit as common;

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

/// A child that hangs is replaced, and the live sequence replayed into
/// the new one; when that replay alone outlasts the propose deadline (its
/// `start` is slow on long sequences) the sequence decodes plainly to its
/// end instead of every new child timing out on the same replay (a
/// restart loop that also kept the proposer from every new request).
#[test]
fn a_replay_that_misses_the_deadline_is_not_repeated() {
    let lib = crashy();
    let config = format!(
        "[engine]\nmax_running = 4\nmax_draft = 4\nadaptive_draft = false\n[[proposer]]\nname = \"slow\"\npath = \"{lib}\"\nisolation = \"process\"\npropose_timeout_ms = 300\noptions = {{ mode = \"hang\", at = 3, slow_start_tokens = 40, start_ms = 700 }}\n"
    );
    let d = Daemon::start(&config, &[]);
    let body = |proposer: &str| {
        json!({"prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": true,
               "speculation": {"proposer": proposer}})
    };
    let plain = d.post("/v1/completions", &body("none")).json();
    let r = d.post("/v1/completions", &body("slow"));
    assert_eq!(r.status, 200, "{}", r.body);
    let got = r.json();
    assert_eq!(got["choices"][0]["text"], plain["choices"][0]["text"]);
    let log = d.stderr.lock().unwrap().clone();
    // One timeout for the hang, one for the replay; then no more.
    let timeouts = d.metric_where("specd_proposer_timeouts_total", "proposer=\"slow\"");
    assert_eq!(timeouts, 2.0, "{log}");
    assert!(
        log.contains("replaying the live sequences into the new plugin host missed the deadline"),
        "{log}"
    );
}

#[test]
fn a_process_isolated_plugin_drafts_exactly_what_it_drafts_in_process() {
    // Same plugin, same seeds: identical drafts make identical sampled
    // outputs and identical acceptance counts; anything lost or altered on
    // the wire (a token, a q) would show. The deadline is generous: a child
    // that misses it is replaced and its sequences decode plainly (tested
    // with the hanging plugin), which on a loaded machine would make a
    // difference this test is not about.
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
propose_timeout_ms = 60000
[[proposer]]
name = "suffix"
plugin = "suffix"
[[proposer]]
name = "suffix-process"
plugin = "suffix"
isolation = "process"
propose_timeout_ms = 60000
[[proposer]]
name = "eagle"
plugin = "eagle"
options = { mode = "tree", max_draft = 8, depth = 5, top_k = 2 }
[[proposer]]
name = "eagle-process"
plugin = "eagle"
isolation = "process"
propose_timeout_ms = 60000
options = { mode = "tree", max_draft = 8, depth = 5, top_k = 2 }
[[proposer]]
name = "medusa"
plugin = "medusa"
[[proposer]]
name = "medusa-process"
plugin = "medusa"
isolation = "process"
propose_timeout_ms = 60000
[[proposer]]
name = "mtp"
plugin = "mtp"
options = { mode = "tree", max_draft = 8, depth = 4, top_k = 2 }
[[proposer]]
name = "mtp-process"
plugin = "mtp"
isolation = "process"
propose_timeout_ms = 60000
options = { mode = "tree", max_draft = 8, depth = 4, top_k = 2 }
"#,
        &[],
    );
    let mut accepted = 0;
    for (i, p) in PROMPTS.iter().enumerate() {
        // The head-based plugins call back for embeddings and the output
        // head from the child (which loads the target for them); their
        // sampled q is sparse over a draft vocabulary.
        for pair in [
            ["ngram", "ngram-process"],
            ["suffix", "suffix-process"],
            ["eagle", "eagle-process"],
            ["medusa", "medusa-process"],
            ["mtp", "mtp-process"],
        ] {
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

/// A config whose proposers are `tables` (name, plugin, extra lines).
fn proposers_config(extra: &str, tables: &[(&str, &str, &str)]) -> String {
    let mut c =
        format!("[engine]\nmax_running = 16\nmax_batch_tokens = 512\nmax_draft = 4\n{extra}");
    for (name, plugin, more) in tables {
        c.push_str(&format!(
            "\n[[proposer]]\nname = \"{name}\"\nplugin = \"{plugin}\"\n{more}\n"
        ));
    }
    c
}

fn listing(d: &Daemon) -> Vec<serde_json::Value> {
    let r = d.request("GET", "/v1/admin/proposers", None, &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["data"].as_array().unwrap().clone()
}

fn live_names(d: &Daemon) -> Vec<String> {
    let mut v: Vec<String> = listing(d)
        .iter()
        .filter(|p| p["role"] == "live")
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    v.sort();
    v
}

#[test]
fn reload_under_load_swaps_proposers_between_steps_and_loses_nothing() {
    let lib = crashy();
    let first = proposers_config("", &[("ngram", "ngram", ""), ("spare", "suffix", "")]);
    let d = Daemon::start(&first, &[]);
    let prompt = |i: usize| format!("{} Again: {}", PROMPTS[i % 3], PROMPTS[i % 3]);
    let plain: Vec<String> = (0..3)
        .map(|i| {
            let r = d.post("/v1/completions", &json!({"prompt": prompt(i), "max_tokens": 96, "temperature": 0, "ignore_eos": true, "speculation": {"proposer": "none"}}));
            r.json()["choices"][0]["text"].as_str().unwrap().to_string()
        })
        .collect();
    // Streams on `ngram` and `spare` while the config changes under them.
    let before = d.metric("specd_generated_tokens_total");
    let handles: Vec<_> = (0..12)
        .map(|i| {
            let (addr, p) = (d.addr.clone(), prompt(i));
            let prop = if i % 2 == 0 { "ngram" } else { "spare" };
            std::thread::spawn(move || {
                let body = json!({"prompt": p, "max_tokens": 96, "temperature": 0, "stream": true,
                                  "ignore_eos": true, "speculation": {"proposer": prop}});
                let r = common::http(
                    &addr,
                    "POST",
                    "/v1/completions",
                    Some(&body.to_string()),
                    &[],
                );
                assert_eq!(r.status, 200, "{}", r.body);
                assert!(r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);
                let text: String = r
                    .sse()
                    .iter()
                    .map(|c| c["choices"][0]["text"].as_str().unwrap_or("").to_string())
                    .collect();
                (i, prop, text)
            })
        })
        .collect();
    let t = Instant::now();
    while d.metric("specd_generated_tokens_total") < before + 24.0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the streams never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // ngram changes (max_draft 2, in a plugin-host child), spare goes,
    // fresh comes and becomes the default route.
    let second = format!(
        "{}\n[[proposer]]\nname = \"fresh\"\npath = \"{lib}\"\n",
        proposers_config(
            "default_proposer = \"fresh\"\n",
            &[("ngram", "ngram", "max_draft = 2\nisolation = \"process\"")],
        )
    );
    std::fs::write(d.config_path(), &second).unwrap();
    let r = d.request("POST", "/v1/admin/proposers/reload", None, &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    let rep = r.json();
    assert_eq!(rep["replaced"], json!(["ngram"]), "{rep}");
    assert_eq!(rep["added"], json!(["fresh"]), "{rep}");
    assert_eq!(rep["removed"], json!(["spare"]), "{rep}");
    assert_eq!(rep["not_applied"], json!([]), "{rep}");
    let moved =
        rep["retired_sequences"].as_u64().unwrap() + rep["orphaned_sequences"].as_u64().unwrap();
    for h in handles {
        let (i, prop, text) = h.join().unwrap();
        assert_eq!(
            text,
            plain[i % 3],
            "request {i} on `{prop}` changed across the reload"
        );
    }
    assert!(moved > 0, "the reload met no running sequence: {rep}");
    assert_eq!(live_names(&d), ["fresh", "ngram"]);
    let rows = listing(&d);
    let ngram = rows.iter().find(|p| p["name"] == "ngram").unwrap();
    assert_eq!(ngram["isolation"], "process", "{ngram}");
    assert_eq!(ngram["max_draft"], 2, "{ngram}");
    assert_eq!(ngram["state"], "healthy", "{ngram}");
    let pid = ngram["pid"].as_u64().expect("the child's pid");
    // The child offers itself to the OOM killer first: a leaking plugin
    // is what goes, not the daemon holding the model.
    let adj = std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj")).unwrap();
    assert_eq!(adj.trim(), "1000", "the plugin host's oom_score_adj");
    let fresh = rows.iter().find(|p| p["name"] == "fresh").unwrap();
    assert_eq!(fresh["plugin"], "crashy", "{fresh}");
    // Retired instances go with their last sequence (the drafter hears of
    // the end at the step after the response's last token).
    let t = Instant::now();
    while listing(&d).iter().any(|p| p["role"] == "retired") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "retired instances outlived their sequences: {:?}",
            listing(&d)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // New requests: the new set, the new default route; `spare` is gone.
    let r = d.post(
        "/v1/completions",
        &json!({"prompt": prompt(0), "max_tokens": 96, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(r.json()["usage"]["speculation"]["proposer"], "fresh");
    assert_eq!(r.json()["choices"][0]["text"], plain[0]);
    let r = d.post(
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2, "speculation": {"proposer": "spare"}}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    // Invalid reloads change nothing and say why.
    for (bad, why) in [
        ("[[proposer]\nname = ", "TOML parse error"),
        (
            proposers_config("", &[("ngram", "no-such-plugin", "")]).as_str(),
            "unknown plugin 'no-such-plugin'",
        ),
        (
            proposers_config("", &[("x", "ngram", "propose_timeout_ms = 5")]).as_str(),
            "propose_timeout_ms needs isolation",
        ),
        (
            proposers_config("", &[("a@b", "ngram", "")]).as_str(),
            "`@` is reserved",
        ),
    ] {
        std::fs::write(d.config_path(), bad).unwrap();
        let r = d.request("POST", "/v1/admin/proposers/reload", None, &[]);
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(r.body.contains(why), "`{why}` not in: {}", r.body);
        assert_eq!(live_names(&d), ["fresh", "ngram"]);
    }
    // SIGHUP reloads the same way.
    let third = proposers_config("", &[("ngram", "ngram", ""), ("viahup", "suffix", "")]);
    std::fs::write(d.config_path(), &third).unwrap();
    let pid = d.child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());
    let t = Instant::now();
    while live_names(&d) != ["ngram", "viahup"] {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "SIGHUP never reloaded: {:?}",
            live_names(&d)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(d
        .stderr
        .lock()
        .unwrap()
        .contains("SIGHUP: proposers reloaded"));
    let r = d.post("/v1/completions", &json!({"prompt": prompt(1), "max_tokens": 96, "temperature": 0, "ignore_eos": true, "speculation": {"proposer": "viahup"}}));
    assert_eq!(r.json()["choices"][0]["text"], plain[1]);
    let t = Instant::now();
    while d.metric("specd_kv_used_blocks") != 0.0 {
        assert!(t.elapsed() < Duration::from_secs(20), "KV never freed");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn admin_endpoints_need_the_api_key_and_vanish_when_disabled() {
    let d = Daemon::start(
        &proposers_config("", &[("ngram", "ngram", "")]),
        &[("SPECD_API_KEY", "sesame")],
    );
    for (method, path) in [
        ("GET", "/v1/admin/proposers"),
        ("POST", "/v1/admin/proposers/reload"),
    ] {
        assert_eq!(d.request(method, path, None, &[]).status, 401);
    }
    let auth = [("Authorization", "Bearer sesame")];
    let r = d.request("GET", "/v1/admin/proposers", None, &auth);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["data"][0]["name"], "ngram");
    assert_eq!(r.json()["data"][0]["isolation"], "none");
    drop(d);
    let d = Daemon::start("[server]\nadmin = false\n", &[]);
    for (method, path) in [
        ("GET", "/v1/admin/proposers"),
        ("POST", "/v1/admin/proposers/reload"),
    ] {
        assert_eq!(d.request(method, path, None, &[]).status, 404);
    }
}

#[test]
fn a_reload_rebuilds_a_poisoned_proposer_even_when_its_config_is_unchanged() {
    // An in-process plugin that panics on its first propose is poisoned
    // (its requests decode plainly); reloading the same file is how an
    // operator recovers it, so the poisoned instance is replaced.
    let lib = crashy();
    let config = format!(
        "{}\n[[proposer]]\nname = \"flaky\"\npath = \"{lib}\"\noptions = {{ mode = \"panic\", at = 1 }}\n",
        proposers_config("", &[("ngram", "ngram", "")])
    );
    let d = Daemon::start(&config, &[]);
    let (text, usage) = complete(&d.addr, PROMPTS[0], "flaky", false);
    assert!(!text.is_empty(), "{usage}");
    let state = |d: &Daemon| -> Option<serde_json::Value> {
        listing(d)
            .into_iter()
            .find(|p| p["name"] == "flaky" && p["role"] == "live")
            .map(|p| p["poisoned"].clone())
    };
    assert!(
        state(&d).is_some_and(|p| p.is_string()),
        "{:?}",
        listing(&d)
    );
    let r = d.request("POST", "/v1/admin/proposers/reload", None, &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    let rep = r.json();
    assert_eq!(rep["replaced"], json!(["flaky"]), "{rep}");
    assert_eq!(rep["unchanged"], json!(["ngram"]), "{rep}");
    assert_eq!(
        state(&d),
        Some(serde_json::Value::Null),
        "{:?}",
        listing(&d)
    );
}

/// A plugin rebuilt in place (a new file renamed over the old one, as
/// cargo and `install` do) is loaded anew by a reload, though its config
/// is unchanged: the dynamic loader would hand back the library already
/// loaded under that path; a process-isolated instance gets a child that
/// loads the new file. An untouched file stays as it is; a reload that
/// fails after loading the new file does not make the instances still
/// running the old one look current to the next.
#[test]
fn a_reload_loads_a_plugin_rebuilt_at_the_same_path() {
    let dir = common::TempDir::new("rebuilt-plugin");
    let lib_file = |stem: &str| {
        format!(
            "{}{stem}{}",
            std::env::consts::DLL_PREFIX,
            std::env::consts::DLL_SUFFIX
        )
    };
    let path = dir.0.join(lib_file("swap"));
    std::fs::copy(crashy(), &path).unwrap();
    // `strict` passes an option only the first library knows.
    let config = |strict_options: &str| {
        format!(
            "[[proposer]]\nname = \"swap\"\npath = \"{p}\"\n[[proposer]]\nname = \"iso\"\npath = \"{p}\"\nisolation = \"process\"\n[[proposer]]\nname = \"strict\"\npath = \"{p}\"\n{strict_options}",
            p = path.display()
        )
    };
    let d = Daemon::start(&config("options = { mode = \"none\" }\n"), &[]);
    let plugin = |d: &Daemon, name: &str| {
        listing(d)
            .into_iter()
            .find(|p| p["name"] == name && p["role"] == "live")
            .map(|p| p["plugin"].clone())
    };
    assert_eq!(
        plugin(&d, "swap"),
        Some(json!("crashy")),
        "{:?}",
        listing(&d)
    );
    let reload = |d: &Daemon| d.request("POST", "/v1/admin/proposers/reload", None, &[]);
    // The names a reload report lists under `key`, sorted.
    let names = |r: &common::HttpResponse, key: &str| {
        assert_eq!(r.status, 200, "{}", r.body);
        let mut v: Vec<String> = r.json()[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().unwrap().to_string())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(&reload(&d), "unchanged"), ["iso", "strict", "swap"]);
    let ngram = common::target_dir()
        .join("release")
        .join(lib_file("specd_proposer_ngram"));
    let fresh = dir.0.join("fresh.so");
    std::fs::copy(&ngram, &fresh).unwrap();
    std::fs::rename(&fresh, &path).unwrap();
    // The new library refuses `strict`'s option: the reload fails whole,
    // after building `swap` from the new file.
    let r = reload(&d);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("unknown option `mode`"), "{}", r.body);
    assert_eq!(plugin(&d, "swap"), Some(json!("crashy")));
    assert_eq!(plugin(&d, "iso"), Some(json!("crashy")));
    std::fs::write(d.config_path(), config("")).unwrap();
    // The process-isolated instance too: its child loaded the old file.
    assert_eq!(names(&reload(&d), "replaced"), ["iso", "strict", "swap"]);
    let (plain, _) = complete(&d.addr, PROMPTS[1], "none", false);
    for name in ["swap", "iso"] {
        assert_eq!(
            plugin(&d, name),
            Some(json!("ngram")),
            "{name}: {:?}",
            listing(&d)
        );
        let (text, usage) = complete(&d.addr, PROMPTS[1], name, false);
        assert_eq!(text, plain);
        assert!(
            usage["speculation"]["accepted_tokens"].as_u64().unwrap() > 0,
            "{name}: {usage}"
        );
    }
    // Nothing was rebuilt since: the next reload keeps every instance.
    assert_eq!(names(&reload(&d), "unchanged"), ["iso", "strict", "swap"]);
}

/// A process-isolated child that crashes after its library was rebuilt in
/// place restarts on the new file: once it is up, the listing no longer
/// calls the library rebuilt (a reload would replace it for nothing), and
/// the output stays plain decoding's throughout.
#[test]
fn a_child_restarted_on_a_rebuilt_library_lists_it_current() {
    let dir = common::TempDir::new("restart-rebuilt");
    let path = dir.0.join(format!(
        "{}restart{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    std::fs::copy(crashy(), &path).unwrap();
    let d = Daemon::start(
        &format!(
            "[[proposer]]\nname = \"iso\"\npath = \"{}\"\nisolation = \"process\"\noptions = {{ mode = \"exit\", at = 2 }}\n",
            path.display()
        ),
        &[],
    );
    let iso = |d: &Daemon| {
        listing(d)
            .into_iter()
            .find(|p| p["name"] == "iso" && p["role"] == "live")
            .unwrap()
    };
    assert_eq!(iso(&d)["library_rebuilt"], json!(false));
    let fresh = dir.0.join("fresh.so");
    std::fs::copy(crashy(), &fresh).unwrap();
    std::fs::rename(&fresh, &path).unwrap();
    assert_eq!(iso(&d)["library_rebuilt"], json!(true));
    let (plain, _) = complete(&d.addr, PROMPTS[0], "none", false);
    // Each child exits at its second propose call; requests drive the
    // restarts until one is up on the new file.
    let mut restarted = false;
    for _ in 0..40 {
        let (text, _) = complete(&d.addr, PROMPTS[0], "iso", false);
        assert_eq!(text, plain);
        let l = iso(&d);
        if l["restarts"].as_u64().unwrap() >= 1 {
            assert_eq!(l["library_rebuilt"], json!(false), "{l}");
            restarted = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(restarted, "the child never came back: {:?}", iso(&d));
}
