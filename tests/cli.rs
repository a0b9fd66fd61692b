//! The `specd` binary end to end on the default model.

use specd_test_kit as common;

use std::process::Command;

fn specd(args: &[&str]) -> std::process::Output {
    common::smollm_path();
    Command::new(env!("CARGO_BIN_EXE_specd"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn batch_mode_is_ordered_deterministic_and_lossless_with_ngram() {
    let dir = common::TempDir::new("cli-batch");
    let input = dir.0.join("prompts.jsonl");
    std::fs::write(
        &input,
        concat!(
            "{\"id\": \"a\", \"prompt\": \"def add(a, b):\\n    return a + b\\n\\ndef sub(a, b):\"}\n",
            "{\"id\": 7, \"prompt\": \"The list 1, 2, 3, 1, 2, 3, 1, 2,\", \"tag\": [1]}\n",
            "{\"id\": \"c\", \"prompt\": \"Write a haiku about rain.\"}\n",
        ),
    )
    .unwrap();
    let metrics = dir.0.join("metrics.txt");
    let run = |proposer: &str| {
        let out = specd(&[
            "generate",
            "--prompts",
            input.to_str().unwrap(),
            "--concurrency",
            "2",
            "--max-tokens",
            "24",
            "--proposer",
            proposer,
            "--metrics-out",
            metrics.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    let (plain, _) = run("none");
    let (spec, stderr) = run("ngram");
    assert_eq!(plain, spec, "greedy output must not depend on the proposer");
    let lines: Vec<serde_json::Value> = spec
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["id"], "a");
    assert_eq!(lines[1]["id"], 7);
    assert_eq!(lines[1]["tag"], serde_json::json!([1]));
    assert_eq!(lines[2]["id"], "c");
    for l in &lines {
        assert!(l["text"].as_str().is_some_and(|t| !t.is_empty()));
        assert_eq!(l["completion_tokens"], 24);
        assert_eq!(l["token_ids"].as_array().map(Vec::len), Some(24));
        assert!(l.get("prompt").is_none());
    }
    // `distill coverage` over these outputs: the share of their tokens
    // inside the shipped EAGLE head's draft vocabulary, as its d2t says.
    let outputs = dir.0.join("outputs.jsonl");
    std::fs::write(&outputs, &plain).unwrap();
    let head = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/proposers/eagle/heads/smollm2-135m-instruct"
    );
    let d2t = specd::model::tensor_file::TensorFile::read(
        &std::path::Path::new(head).join("model.safetensors"),
    )
    .unwrap()
    .i64("d2t")
    .unwrap();
    let vocab: std::collections::HashSet<i64> =
        d2t.iter().enumerate().map(|(i, d)| i as i64 + d).collect();
    let ids: Vec<i64> = lines
        .iter()
        .flat_map(|l| {
            l["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_i64().unwrap())
        })
        .collect();
    let inside = ids.iter().filter(|t| vocab.contains(t)).count();
    let out = specd(&[
        "distill",
        "coverage",
        "--outputs",
        outputs.to_str().unwrap(),
        "--head",
        head,
    ]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want = format!("| all | 72 | {:.3} |", inside as f64 / 72.0);
    assert!(table.contains(&want), "{want} in\n{table}");
    assert!(stderr.contains("mean accepted length"), "{stderr}");
    let m = std::fs::read_to_string(&metrics).unwrap();
    assert!(
        m.contains("specd_drafted_tokens_total{proposer=\"ngram\",arm=\"ngram\",member=\"ngram\"}"),
        "{m}"
    );
    assert!(m.contains("specd_verify_seconds"), "{m}");
}

#[test]
fn batch_mode_names_bad_input() {
    let dir = common::TempDir::new("cli-bad");
    let input = dir.0.join("p.jsonl");
    std::fs::write(&input, "{\"prompt\": \"ok\"}\n{\"text\": \"no prompt\"}\n").unwrap();
    let out = specd(&["generate", "--prompts", input.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("p.jsonl:2: missing string field `prompt`"),
        "{err}"
    );
    let out = specd(&["generate", "--prompt", "hi", "--proposer", "nope"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown proposer 'nope'"));
}

#[test]
fn batch_mode_times_each_request_on_its_own_timeline() {
    let dir = common::TempDir::new("cli-timeline");
    let input = dir.0.join("prompts.jsonl");
    std::fs::write(
        &input,
        "{\"prompt\": \"Count from one to fifty:\"}\n{\"prompt\": \"Name the planets:\"}\n{\"prompt\": \"Spell the alphabet:\"}\n",
    )
    .unwrap();
    let out = specd(&[
        "generate",
        "--prompts",
        input.to_str().unwrap(),
        "--concurrency",
        "3",
        "--max-tokens",
        "40",
        "--ignore-eos",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    // "request N: ... ttft X ms  Y tok/s ..." per request.
    let field = |line: &str, after: &str| -> f64 {
        line.split(after)
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let reqs: Vec<&str> = err.lines().filter(|l| l.starts_with("request ")).collect();
    assert_eq!(reqs.len(), 3, "{err}");
    let ttfts: Vec<f64> = reqs.iter().map(|l| field(l, "ttft ")).collect();
    let rates: Vec<f64> = reqs.iter().map(|l| field(l, " ms  ")).collect();
    let total_s = field(
        err.lines().find(|l| l.starts_with("total:")).unwrap(),
        "tokens  ",
    );
    // All three run in one batch: each gets its first token from the first
    // decode step, long before any of them has produced 40 tokens, so no
    // request's time to first token may include the others' decoding.
    let max_ttft = ttfts.iter().cloned().fold(0.0, f64::max);
    assert!(
        max_ttft < 0.5 * total_s * 1e3,
        "ttfts {ttfts:?} ms against a {total_s} s run: {err}"
    );
    assert!(rates.iter().all(|&r| r > 0.0), "{err}");
}

/// `specd quantize` writes a Q4_K_M copy of the default model that loads
/// natively (K-quant super-blocks kept: weights in memory within 10% of the
/// file) and generates; an unknown type is refused by name.
#[test]
fn quantize_writes_a_q4_k_m_model_that_loads_natively_and_generates() {
    use candle_core::quantized::{gguf_file, GgmlDType};
    let dir = common::TempDir::new("cli-quantize");
    // Quantize the default model to `scheme`: the file's type of each
    // tensor, after checking that it loads with its weights in memory
    // within 10% of the file.
    let quantize = |scheme: &str| {
        let out = dir.0.join(format!("{scheme}.gguf"));
        let o = specd(&["quantize", "--type", scheme, "--out", out.to_str().unwrap()]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let model = specd::model::load_model(&out, 2).unwrap();
        let file = std::fs::metadata(&out).unwrap().len() as f64;
        let w = model.weight_bytes() as f64;
        assert!(
            w <= file * 1.10 && w >= file * 0.8,
            "{scheme}: {w} bytes in memory, file {file}"
        );
        let ct = gguf_file::Content::read(&mut std::fs::File::open(&out).unwrap()).unwrap();
        let types = move |n: &str| ct.tensor_infos[n].ggml_dtype;
        (out, String::from_utf8_lossy(&o.stdout).into_owned(), types)
    };
    let (out, stdout, ty) = quantize("q4_k_m");
    assert!(stdout.contains("Q4K") && stdout.contains("Q6K"), "{stdout}");
    // SmolLM2-135M: ffn_down rows (1536) are whole super-blocks, Q6_K in
    // use_more_bits layers (0, 5) and Q4_K elsewhere; 576-wide rows fall
    // back as llama.cpp's do (Q4_K to Q5_0, Q6_K to Q8_0).
    assert_eq!(ty("blk.0.ffn_down.weight"), GgmlDType::Q6K);
    assert_eq!(ty("blk.5.ffn_down.weight"), GgmlDType::Q6K);
    assert_eq!(ty("blk.6.ffn_down.weight"), GgmlDType::Q4K);
    assert_eq!(ty("blk.6.attn_q.weight"), GgmlDType::Q5_0);
    assert_eq!(ty("blk.5.attn_v.weight"), GgmlDType::Q8_0);
    let g = specd(&[
        "generate",
        "--model",
        out.to_str().unwrap(),
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
    ]);
    assert!(g.status.success(), "{}", String::from_utf8_lossy(&g.stderr));
    assert!(String::from_utf8_lossy(&g.stdout).contains("Paris"));

    // Q5_K_M: Q5_K where Q4_K_M has Q4_K, Q5_1 as its fallback.
    let (_, _, ty) = quantize("q5_k_m");
    assert_eq!(ty("blk.6.ffn_down.weight"), GgmlDType::Q5K);
    assert_eq!(ty("blk.6.attn_q.weight"), GgmlDType::Q5_1);

    let bad = specd(&["quantize", "--type", "q3_k", "--out", out.to_str().unwrap()]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown quantization \"q3_k\""));
}

/// `bench-model --cold` times forwards that stream the weights from memory
/// and prices decode against the streaming bandwidth; without it, decode
/// is priced against re-reading a buffer the size of the weights. Either
/// way the peak RSS leaves out the bandwidth probe's buffer, and prefill
/// reports the median of its timed runs with their range.
#[test]
fn bench_model_cold_streams_the_weights_and_says_so() {
    use candle_core::quantized::GgmlDType;
    let dir = common::TempDir::new("cli-bench-cold");
    let path = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&path, &common::TINY, 3, GgmlDType::Q8_0, "llama");
    let bench = |cold: bool| {
        let mut args = vec![
            "bench-model",
            "--model",
            path.to_str().unwrap(),
            "--threads",
            "2",
            "--prefill",
            "8",
            "--decode",
            "4",
            "--context",
            "16",
            "--ks",
            "1,2",
            "--trees",
            "3",
            "--reps",
            "2",
            "--json",
        ];
        if cold {
            args.push("--cold");
        }
        let o = specd(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["model"].clone()
    };
    for cold in [false, true] {
        let m = bench(cold);
        assert_eq!(m["cold"], serde_json::json!(cold));
        let f = |k: &str| m[k].as_f64().unwrap();
        let gb_s = if cold {
            f("read_gb_s")
        } else {
            f("weights_read_gb_s")
        };
        let limit = gb_s * 1e9 / f("weight_bytes");
        assert!((f("decode_limit_tok_s") / limit - 1.0).abs() < 1e-9, "{m}");
        assert!(f("decode_tok_s") > 0.0, "{m}");
        // Prefill is the median of several timed runs, inside their range.
        assert!(m["prefill_runs"].as_u64().unwrap() >= 3, "{m}");
        let (lo, hi) = (
            m["prefill_range"][0].as_f64().unwrap(),
            m["prefill_range"][1].as_f64().unwrap(),
        );
        assert!(
            0.0 < lo && lo <= f("prefill_tok_s") && f("prefill_tok_s") <= hi,
            "{m}"
        );
        let verify = m["verify"].as_array().unwrap();
        assert_eq!(verify.len(), 2, "{m}");
        assert!(verify.iter().all(|r| r[1].as_f64().unwrap() > 0.0), "{m}");
        assert_eq!(m["tree_verify"].as_array().unwrap().len(), 1, "{m}");
        // The peak resident set is the model's work's: the 512 MiB buffer
        // of the bandwidth probe is left out (Linux reports it).
        if let Some(peak) = m["peak_rss_bytes"].as_f64() {
            assert!(peak > 0.0 && peak < 400.0 * 1048576.0, "{m}");
        } else if cfg!(target_os = "linux") {
            panic!("Linux reports the peak: {m}");
        }
    }
}

/// `distill eagle|mtp --corpus-shards` takes `A..B` with `B > A`, and
/// needs `--corpus`; each refusal names what is wrong.
#[test]
fn distill_corpus_shards_are_checked() {
    let dir = common::TempDir::new("cli-corpus-shards");
    let out = dir.0.join("out");
    let out = out.to_str().unwrap();
    for (arg, want) in [
        ("5..3", "holds no shard"),
        ("x..3", "`x` is not a shard index"),
        ("6", "expected A..B"),
    ] {
        let o = specd(&["distill", "mtp", "--out", out, "--corpus-shards", arg]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{arg}: {err}");
    }
    let o = specd(&["distill", "mtp", "--out", out, "--corpus-shards", "0..1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--corpus-shards needs --corpus"),
        "{err}"
    );
}
