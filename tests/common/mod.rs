//! Shared test helpers: the cached default model, and a tiny random Llama
//! written both as GGUF and as safetensors.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// The cached SmolLM2 GGUF, fetched on first use (the only download tests
/// ever make; `.ci/run` fetches it before the tests).
pub fn smollm_path() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        specd::fetch::ensure_default_model()
            .unwrap_or_else(|e| panic!("default model unavailable: {e}"))
    })
    .clone()
}

pub struct TinySpec {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub max_seq: usize,
}

pub const TINY: TinySpec = TinySpec {
    vocab: 96,
    hidden: 64,
    intermediate: 128,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    max_seq: 256,
};

/// Seeded uniform values in [-scale, scale).
pub fn lcg_vec(seed: &mut u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Random weights in Hugging Face naming, `[out, in]` layout.
pub fn tiny_weights(s: &TinySpec, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut seed = seed;
    let hd = s.hidden / s.heads;
    let mut w = Vec::new();
    let push = |w: &mut Vec<_>, name: String, shape: Vec<usize>, scale: f32, seed: &mut u64| {
        let n = shape.iter().product();
        w.push((name, shape, lcg_vec(seed, n, scale)));
    };
    push(
        &mut w,
        "model.embed_tokens.weight".into(),
        vec![s.vocab, s.hidden],
        1.0,
        &mut seed,
    );
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        push(
            &mut w,
            format!("{p}.self_attn.q_proj.weight"),
            vec![s.heads * hd, s.hidden],
            0.2,
            &mut seed,
        );
        push(
            &mut w,
            format!("{p}.self_attn.k_proj.weight"),
            vec![s.kv_heads * hd, s.hidden],
            0.2,
            &mut seed,
        );
        push(
            &mut w,
            format!("{p}.self_attn.v_proj.weight"),
            vec![s.kv_heads * hd, s.hidden],
            0.2,
            &mut seed,
        );
        push(
            &mut w,
            format!("{p}.self_attn.o_proj.weight"),
            vec![s.hidden, s.heads * hd],
            0.2,
            &mut seed,
        );
        push(
            &mut w,
            format!("{p}.mlp.gate_proj.weight"),
            vec![s.intermediate, s.hidden],
            0.2,
            &mut seed,
        );
        push(
            &mut w,
            format!("{p}.mlp.up_proj.weight"),
            vec![s.intermediate, s.hidden],
            0.2,
            &mut seed,
        );
        push(
            &mut w,
            format!("{p}.mlp.down_proj.weight"),
            vec![s.hidden, s.intermediate],
            0.2,
            &mut seed,
        );
        let mut n1 = lcg_vec(&mut seed, s.hidden, 0.1);
        n1.iter_mut().for_each(|x| *x += 1.0);
        w.push((format!("{p}.input_layernorm.weight"), vec![s.hidden], n1));
        let mut n2 = lcg_vec(&mut seed, s.hidden, 0.1);
        n2.iter_mut().for_each(|x| *x += 1.0);
        w.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![s.hidden],
            n2,
        ));
    }
    w.push((
        "model.norm.weight".into(),
        vec![s.hidden],
        vec![1.0; s.hidden],
    ));
    push(
        &mut w,
        "lm_head.weight".into(),
        vec![s.vocab, s.hidden],
        0.5,
        &mut seed,
    );
    w
}

fn tensor(shape: &[usize], data: &[f32]) -> Tensor {
    Tensor::from_slice(data, shape, &Device::Cpu).unwrap()
}

/// Write the tiny model as a safetensors directory (config.json included).
pub fn write_tiny_safetensors(dir: &Path, s: &TinySpec, seed: u64) {
    std::fs::create_dir_all(dir).unwrap();
    let map: std::collections::HashMap<String, Tensor> = tiny_weights(s, seed)
        .into_iter()
        .map(|(n, sh, d)| (n, tensor(&sh, &d)))
        .collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    let cfg = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": s.max_seq,
        "tie_word_embeddings": false,
        "bos_token_id": 1,
        "eos_token_id": 2
    });
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

/// Write the tiny model as GGUF with matrices in `dtype` (norms stay F32).
/// `arch` lets tests write an unsupported architecture name.
pub fn write_tiny_gguf(path: &Path, s: &TinySpec, seed: u64, dtype: GgmlDType, arch: &str) {
    write_tiny_gguf_tokens(path, s, seed, dtype, arch, "t")
}

/// As `write_tiny_gguf`, with token strings `{prefix}{id}`.
pub fn write_tiny_gguf_tokens(
    path: &Path,
    s: &TinySpec,
    seed: u64,
    dtype: GgmlDType,
    arch: &str,
    prefix: &str,
) {
    write_tiny_gguf_with(path, s, seed, dtype, arch, prefix, Vec::new(), Vec::new())
}

/// As `write_tiny_gguf_tokens`, plus `extra` tensors (GGUF names, written
/// as given: matrices in `dtype`) and metadata (`extra_md` replaces keys).
#[allow(clippy::too_many_arguments)]
pub fn write_tiny_gguf_with(
    path: &Path,
    s: &TinySpec,
    seed: u64,
    dtype: GgmlDType,
    arch: &str,
    prefix: &str,
    extra: Vec<(String, Vec<usize>, Vec<f32>)>,
    extra_md: Vec<(String, Value)>,
) {
    let hf = tiny_weights(s, seed);
    let rename = |n: &str| -> String {
        n.replace("model.embed_tokens.weight", "token_embd.weight")
            .replace("model.norm.weight", "output_norm.weight")
            .replace("lm_head.weight", "output.weight")
            .replace("model.layers.", "blk.")
            .replace("self_attn.q_proj", "attn_q")
            .replace("self_attn.k_proj", "attn_k")
            .replace("self_attn.v_proj", "attn_v")
            .replace("self_attn.o_proj", "attn_output")
            .replace("mlp.gate_proj", "ffn_gate")
            .replace("mlp.up_proj", "ffn_up")
            .replace("mlp.down_proj", "ffn_down")
            .replace("input_layernorm", "attn_norm")
            .replace("post_attention_layernorm", "ffn_norm")
    };
    let qt: Vec<(String, QTensor)> = hf
        .iter()
        .map(|(n, sh, d)| (rename(n), sh, d))
        .chain(extra.iter().map(|(n, sh, d)| (n.clone(), sh, d)))
        .map(|(n, sh, d)| {
            let t = tensor(sh, d);
            let dt = if sh.len() == 2 { dtype } else { GgmlDType::F32 };
            (n, QTensor::quantize(&t, dt).unwrap())
        })
        .collect();
    let hd = (s.hidden / s.heads) as u32;
    let md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (format!("{arch}.block_count"), Value::U32(s.layers as u32)),
        (
            format!("{arch}.context_length"),
            Value::U32(s.max_seq as u32),
        ),
        (
            format!("{arch}.embedding_length"),
            Value::U32(s.hidden as u32),
        ),
        (
            format!("{arch}.feed_forward_length"),
            Value::U32(s.intermediate as u32),
        ),
        (
            format!("{arch}.attention.head_count"),
            Value::U32(s.heads as u32),
        ),
        (
            format!("{arch}.attention.head_count_kv"),
            Value::U32(s.kv_heads as u32),
        ),
        (format!("{arch}.rope.dimension_count"), Value::U32(hd)),
        (format!("{arch}.rope.freq_base"), Value::F32(10000.0)),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        ),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(
                (0..s.vocab)
                    .map(|i| Value::String(format!("{prefix}{i}")))
                    .collect(),
            ),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
    ];
    let mut md = md;
    for (k, v) in extra_md {
        md.retain(|(key, _)| *key != k);
        md.push((k, v));
    }
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qt.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
}

/// A fresh temporary directory under the target dir (removed on drop).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "specd-test-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

// ------------------------------------------------------------ test proposers

use specd::sampler::Rng;
use specd::speculative::proposer::{Capabilities, Draft, DraftQ, ProposeInput, Proposer, QKind};
use specd::speculative::SeqId;

/// Replays a known continuation of each prompt, replacing each drafted token
/// with a wrong one with probability `error_rate`.
pub struct OracleProposer {
    pub answers: std::collections::HashMap<Vec<u32>, Vec<u32>>,
    pub error_rate: f64,
    pub max_draft: usize,
    pub vocab: u32,
    prompts: std::collections::HashMap<SeqId, usize>,
    rng: Rng,
}

impl OracleProposer {
    pub fn new(
        answers: Vec<(Vec<u32>, Vec<u32>)>,
        error_rate: f64,
        max_draft: usize,
        vocab: u32,
    ) -> Self {
        Self {
            answers: answers.into_iter().collect(),
            error_rate,
            max_draft,
            vocab,
            prompts: Default::default(),
            rng: Rng::new(99),
        }
    }
}

impl Proposer for OracleProposer {
    fn name(&self) -> &str {
        "oracle"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            max_draft: self.max_draft,
            ..Default::default()
        }
    }
    fn start(&mut self, seq: SeqId, prompt: &[u32]) -> Result<(), String> {
        // On resume after preemption `prompt` includes earlier output; find
        // the original prompt as the longest known prefix.
        let len = self
            .answers
            .keys()
            .filter(|p| prompt.starts_with(p))
            .map(|p| p.len())
            .max()
            .ok_or("unknown prompt")?;
        self.prompts.insert(seq, len);
        Ok(())
    }
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
        let mut out = Vec::new();
        for b in batch {
            let plen = self.prompts[&b.seq];
            let answer = &self.answers[&b.tokens[..plen]];
            let pos = b.tokens.len() - plen;
            let mut tokens: Vec<u32> = answer.iter().skip(pos).take(b.max_draft).copied().collect();
            for t in tokens.iter_mut() {
                if self.rng.next_f64() < self.error_rate {
                    *t = (*t + 1 + (self.rng.next_u64() % (self.vocab as u64 - 1)) as u32)
                        % self.vocab;
                }
            }
            out.push(Draft {
                q: vec![DraftQ::OneHot; tokens.len()],
                tokens,
                parents: None,
                source: None,
            });
        }
        Ok(out)
    }
    fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
        Ok(())
    }
    fn finish(&mut self, seq: SeqId) {
        self.prompts.remove(&seq);
    }
}

/// Drafts from a random full distribution q (fresh each position), so that
/// acceptance exercises min(1, p/q) and the residual with a real q.
pub struct RandomProposer {
    pub vocab: usize,
    pub max_draft: usize,
    rng: Rng,
}

impl RandomProposer {
    pub fn new(vocab: usize, max_draft: usize, seed: u64) -> Self {
        Self {
            vocab,
            max_draft,
            rng: Rng::new(seed),
        }
    }
}

impl Proposer for RandomProposer {
    fn name(&self) -> &str {
        "random"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            q_kind: QKind::Full,
            max_draft: self.max_draft,
            ..Default::default()
        }
    }
    fn start(&mut self, _: SeqId, _: &[u32]) -> Result<(), String> {
        Ok(())
    }
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
        let mut out = Vec::new();
        for b in batch {
            let mut d = Draft::default();
            for _ in 0..b.max_draft {
                // Peaked random q: cubes of uniforms, normalised.
                let w: Vec<f64> = (0..self.vocab)
                    .map(|_| self.rng.next_f64().powi(3))
                    .collect();
                let z: f64 = w.iter().sum();
                let q: Vec<f32> = w.iter().map(|x| (x / z) as f32).collect();
                let u = self.rng.next_f64();
                let mut cum = 0.0;
                let mut tok = (self.vocab - 1) as u32;
                for (i, &p) in q.iter().enumerate() {
                    cum += p as f64;
                    if u < cum {
                        tok = i as u32;
                        break;
                    }
                }
                d.tokens.push(tok);
                d.q.push(DraftQ::Full(q.into()));
            }
            out.push(d);
        }
        Ok(out)
    }
    fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
        Ok(())
    }
    fn finish(&mut self, _: SeqId) {}
}

/// Panics on its second propose call.
pub struct PanickyProposer {
    calls: usize,
}

impl PanickyProposer {
    pub fn new() -> Self {
        Self { calls: 0 }
    }
}

impl Proposer for PanickyProposer {
    fn name(&self) -> &str {
        "panicky"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
    fn start(&mut self, _: SeqId, _: &[u32]) -> Result<(), String> {
        Ok(())
    }
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
        self.calls += 1;
        if self.calls == 2 {
            panic!("deliberate test panic in propose");
        }
        Ok(batch
            .iter()
            .map(|b| Draft {
                tokens: vec![b.tokens[b.tokens.len() - 1]; b.max_draft],
                q: vec![DraftQ::OneHot; b.max_draft],
                parents: None,
                source: None,
            })
            .collect())
    }
    fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
        Ok(())
    }
    fn finish(&mut self, _: SeqId) {}
}

// ------------------------------------------------------------ daemon helpers

/// A `specd serve` child process on a free loopback port.
pub struct Daemon {
    pub child: std::process::Child,
    pub addr: String,
    pub stderr: std::sync::Arc<std::sync::Mutex<String>>,
    _dir: TempDir,
}

impl Daemon {
    /// Start with `config` (TOML text) on 127.0.0.1, any free port.
    pub fn start(config: &str, envs: &[(&str, &str)]) -> Self {
        use std::io::BufRead;
        smollm_path();
        let dir = TempDir::new("daemon");
        let cfg = dir.0.join("specd.toml");
        std::fs::write(&cfg, config).unwrap();
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_specd"));
        cmd.args([
            "serve",
            "--config",
            cfg.to_str().unwrap(),
            "--port",
            "0",
            "--threads",
            "2",
        ])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
                }
                log2.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let addr = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("daemon did not start: {}", log.lock().unwrap()));
        Self {
            child,
            addr,
            stderr: log,
            _dir: dir,
        }
    }

    /// The config file the daemon was started with (a test may rewrite it
    /// and ask for a reload).
    pub fn config_path(&self) -> PathBuf {
        self._dir.0.join("specd.toml")
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> HttpResponse {
        http(&self.addr, method, path, body, headers)
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> HttpResponse {
        self.request("POST", path, Some(&body.to_string()), &[])
    }

    /// Sum of a metric's samples (all label sets) in /metrics.
    pub fn metric(&self, name: &str) -> f64 {
        self.metric_where(name, "")
    }

    /// Sum of a metric's samples whose line contains `needle` (e.g. a label).
    pub fn metric_where(&self, name: &str, needle: &str) -> f64 {
        let m = self.request("GET", "/metrics", None, &[]).body;
        m.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.split(['{', ' ']).next() == Some(name))
            .filter(|l| l.contains(needle))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl HttpResponse {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The JSON payloads of an SSE body (`data: ...` lines, `[DONE]` excluded).
    pub fn sse(&self) -> Vec<serde_json::Value> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }
}

/// Minimal blocking HTTP/1.1 client (loopback tests only).
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> HttpResponse {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(300)))
        .unwrap();
    let body = body.unwrap_or("");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    HttpResponse {
        status,
        headers: head.to_string(),
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

// ------------------------------------------------------------ head plugins

/// An engine over `cfg`'s proposers as the head-plugin tests use it: no
/// adaptive drafting (every step drafts what the plugin offers), an
/// unbounded queue.
pub fn plugin_engine(
    model: &std::sync::Arc<specd::model::Model>,
    tok: Option<std::sync::Arc<specd::tokenizer::Tokenizer>>,
    cfg: &specd::config::Config,
    running: usize,
    max_draft: usize,
) -> specd::speculative::driver::SyncDriver {
    let drafter = cfg.build_drafter(model, tok.clone()).unwrap();
    let mut ec = specd::speculative::driver::EngineConfig::for_model(model);
    ec.scheduler.max_running = running;
    ec.scheduler.max_draft = max_draft;
    ec.scheduler.max_waiting = usize::MAX;
    ec.scheduler.adaptive_draft = false;
    specd::speculative::driver::SyncDriver::new(model.clone(), tok, ec, drafter)
}

/// Run `reqs` to completion; completions in request order.
pub fn run_all(
    e: &mut specd::speculative::driver::SyncDriver,
    reqs: Vec<specd::speculative::Request>,
) -> Vec<specd::speculative::Completion> {
    let ids: Vec<u64> = reqs.into_iter().map(|r| e.add(r, None).unwrap()).collect();
    let mut done = e.run_to_completion().unwrap();
    done.sort_by_key(|c| ids.iter().position(|&i| i == c.id).unwrap());
    done
}

/// Each `(option lines, expected text)` case: a proposer of `plugin` with
/// `key = path` and the lines is refused at load with an error containing
/// the text.
pub fn assert_options_refused(
    model: &std::sync::Arc<specd::model::Model>,
    plugin: &str,
    (key, path): (&str, &std::path::Path),
    cases: &[(&str, &str)],
) {
    for (extra, want) in cases {
        let cfg = specd::config::Config::parse(
            &format!(
                "[[proposer]]\nname = \"p\"\nplugin = \"{plugin}\"\n[proposer.options]\n{key} = \"{}\"\n{extra}\n",
                path.display()
            ),
            None,
        )
        .unwrap();
        let e = match cfg.build_drafter(model, None) {
            Ok(_) => panic!("{extra}: accepted"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(want), "{extra}: {e}");
    }
}

/// Counts of the first two sampled tokens of `n` seeded requests (seeds
/// from `seed0`) through proposer `name`, and the tokens accepted and
/// drafted per request.
pub fn first_two_runs(
    model: &std::sync::Arc<specd::model::Model>,
    cfg: &specd::config::Config,
    name: &str,
    prompt: &[u32],
    params: &specd::sampler::SamplingParams,
    n: usize,
    seed0: u64,
) -> (Vec<u64>, f64, f64) {
    use specd::speculative::Request;
    let v = model.config.vocab_size;
    let mut e = plugin_engine(model, None, cfg, 64, 16);
    let reqs = (0..n)
        .map(|i| Request {
            params: specd::sampler::SamplingParams {
                seed: seed0 + i as u64,
                ..params.clone()
            },
            proposer: Some(name.into()),
            ignore_eos: true,
            ..Request::greedy(prompt.to_vec(), 3)
        })
        .collect();
    let done = run_all(&mut e, reqs);
    assert!(e.drafter.poisoned(name).is_none(), "{name} poisoned");
    let mut counts = vec![0u64; v * v];
    for c in &done {
        counts[c.tokens[0] as usize * v + c.tokens[1] as usize] += 1;
    }
    let accepted: u64 = done.iter().map(|c| c.stats.accepted).sum();
    let drafted: u64 = done.iter().map(|c| c.stats.drafted).sum();
    (
        counts,
        accepted as f64 / n as f64,
        drafted as f64 / n as f64,
    )
}

/// `texts` as chat-templated user turns, encoded.
pub fn chat_prompts(tok: &specd::tokenizer::Tokenizer, texts: &[&str]) -> Vec<Vec<u32>> {
    texts
        .iter()
        .map(|t| {
            let chat = tok
                .apply_chat_template(&[specd::tokenizer::ChatMessage::user(*t)], true)
                .unwrap();
            tok.encode(&chat, false).unwrap()
        })
        .collect()
}

/// A shipped head or module on SmolLM2 through `config` (a path under the
/// repository): greedy chat requests of each of `names` and of plain
/// decoding, batched together, equal plain decoding token for token and
/// in their logprobs bit for bit; each named proposer is not poisoned and
/// its mean accepted length is above `floor(name)`.
pub fn shipped_is_lossless_and_accepted(
    config: &str,
    names: &[&str],
    max_draft: usize,
    floor: impl Fn(&str) -> f64,
) {
    use specd::speculative::Request;
    let path = smollm_path();
    let model = std::sync::Arc::new(specd::model::load_model(&path, 2).unwrap());
    let tok = std::sync::Arc::new(specd::tokenizer::Tokenizer::for_model(&path).unwrap());
    let cfg =
        specd::config::Config::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join(config)).unwrap();
    let mut e = plugin_engine(&model, Some(tok.clone()), &cfg, 12, max_draft);
    let prompts = chat_prompts(
        &tok,
        &[
            "Explain why the sky is blue in two sentences.",
            "Write a Python function that checks whether a string is a palindrome.",
            "List four uses of copper.",
        ],
    );
    let n = 48;
    let reqs: Vec<Request> = names
        .iter()
        .chain(&["none"])
        .flat_map(|name| {
            prompts.iter().map(move |p| Request {
                proposer: Some(name.to_string()),
                ignore_eos: true,
                logprobs: Some(2),
                ..Request::greedy(p.clone(), n)
            })
        })
        .collect();
    let done = run_all(&mut e, reqs);
    let plain = &done[names.len() * prompts.len()..];
    for (i, c) in done.iter().enumerate() {
        let want = &plain[i % prompts.len()];
        assert_eq!(
            c.tokens, want.tokens,
            "{} differs from plain decoding",
            c.stats.proposer
        );
        assert_eq!(c.logprobs.len(), n);
        assert_eq!(c.logprobs, want.logprobs, "{}", c.stats.proposer);
    }
    for &name in names {
        let mut s = specd::speculative::SpecStats::default();
        for c in done.iter().filter(|c| c.stats.proposer == name) {
            s.add(&c.stats);
        }
        eprintln!(
            "{name}: mean accepted length {:.2}, {}/{} drafted tokens accepted",
            s.mean_accepted_len(),
            s.accepted,
            s.drafted,
        );
        assert!(e.drafter.poisoned(name).is_none(), "{name} poisoned");
        assert!(
            s.mean_accepted_len() > floor(name),
            "{name}: the shipped head must be accepted: {:.2}",
            s.mean_accepted_len()
        );
    }
}

// ------------------------------------------------------------ statistics

/// Exact joint distribution of the first two generated tokens.
pub fn exact_first_two(
    model: &specd::model::Model,
    prompt: &[u32],
    params: &specd::sampler::SamplingParams,
) -> Vec<f64> {
    exact_first_two_shaped(model, prompt, params, |_, _| {})
}

/// `exact_first_two` with `shape(output so far, logits)` applied to each
/// position's logits before the request's transforms (a constraint's
/// mask).
pub fn exact_first_two_shaped(
    model: &specd::model::Model,
    prompt: &[u32],
    params: &specd::sampler::SamplingParams,
    shape: impl Fn(&[u32], &mut [f32]),
) -> Vec<f64> {
    let v = model.config.vocab_size;
    let mut c = model.new_cache();
    let mut l1 = model
        .forward_one(&mut c, prompt, specd::model::Logits::Last)
        .unwrap()
        .logits;
    shape(&[], &mut l1);
    // Penalties (a no-op without them): the first token sees the prompt,
    // the second the prompt and the first.
    specd::sampler::apply_penalties(&mut l1, prompt, &[], params);
    let p1 = specd::sampler::distribution(&l1, params).dense(v);
    let mut joint = vec![0f64; v * v];
    for t1 in 0..v {
        if p1[t1] == 0.0 {
            continue;
        }
        let mut c2 = c.clone();
        let mut l2 = model
            .forward_one(&mut c2, &[t1 as u32], specd::model::Logits::Last)
            .unwrap()
            .logits;
        shape(&[t1 as u32], &mut l2);
        let ctx: Vec<u32> = prompt.iter().copied().chain([t1 as u32]).collect();
        specd::sampler::apply_penalties(&mut l2, &ctx, &[t1 as u32], params);
        let p2 = specd::sampler::distribution(&l2, params).dense(v);
        for t2 in 0..v {
            joint[t1 * v + t2] = p1[t1] as f64 * p2[t2] as f64;
        }
    }
    joint
}

/// Pearson chi-square of `counts` against `probs`, merging cells whose
/// expected count is below 5; returns (statistic, degrees of freedom).
pub fn chi_square(counts: &[u64], probs: &[f64]) -> (f64, usize) {
    let n: u64 = counts.iter().sum();
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    for (&o, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if e < 5.0 {
            pool_o += o as f64;
            pool_e += e;
            continue;
        }
        stat += (o as f64 - e).powi(2) / e;
        cells += 1;
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e.max(1e-9);
        cells += 1;
    }
    (stat, cells - 1)
}

/// Upper 0.1% point of chi-square (Wilson-Hilferty).
pub fn chi2_crit_999(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.0902; // standard normal upper 0.1%
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

// ------------------------------------------------------------ tree proposer

/// How `TreeProposer` builds its trees.
pub enum TreeMode {
    /// Greedy: trees of random shape (generated level by level, so the
    /// verifier must reorder them) that hold the true continuation of
    /// `answers` on a random branch, cut short with probability `error` at
    /// each level, among random siblings and distractor subtrees. q is
    /// one-hot.
    Oracle {
        answers: std::collections::HashMap<Vec<u32>, Vec<u32>>,
        error: f64,
    },
    /// Sampling: every node's children drawn from a fresh random q (shared
    /// by the siblings; entries are uniforms raised to `peak`, normalised;
    /// `peak` 0: half the mass on one random token, half spread evenly),
    /// independently or without replacement as the sibling mode says; up to
    /// `width` children per node, `depth` levels.
    Random {
        width: usize,
        depth: usize,
        peak: i32,
    },
    /// Sampling with a one-hot proposer (as suffix and n-gram lookups
    /// draft): trees shaped as `Random`'s, siblings distinct tokens, every
    /// node reporting q = 1 on its own token; candidates drawn from one
    /// fixed peaked distribution.
    RandomOneHot { width: usize, depth: usize },
}

/// A test-only tree proposer (see `TreeMode`).
pub struct TreeProposer {
    pub name: String,
    pub vocab: usize,
    pub max_nodes: usize,
    pub siblings: specd::speculative::proposer::SiblingMode,
    pub mode: TreeMode,
    prompts: std::collections::HashMap<SeqId, usize>,
    rng: Rng,
}

impl TreeProposer {
    pub fn new(
        name: &str,
        vocab: usize,
        max_nodes: usize,
        siblings: specd::speculative::proposer::SiblingMode,
        mode: TreeMode,
        seed: u64,
    ) -> Self {
        Self {
            name: name.into(),
            vocab,
            max_nodes,
            siblings,
            mode,
            prompts: Default::default(),
            rng: Rng::new(seed),
        }
    }

    fn other_token(&mut self, not: &[u32]) -> u32 {
        loop {
            let t = (self.rng.next_u64() % self.vocab as u64) as u32;
            if !not.contains(&t) {
                return t;
            }
        }
    }

    /// A peaked random distribution over the vocabulary.
    fn random_q(&mut self, peak: i32) -> Vec<f32> {
        if peak == 0 {
            let spike = (self.rng.next_u64() % self.vocab as u64) as usize;
            let even = 0.5 / self.vocab as f32;
            return (0..self.vocab)
                .map(|t| even + if t == spike { 0.5 } else { 0.0 })
                .collect();
        }
        let w: Vec<f64> = (0..self.vocab)
            .map(|_| self.rng.next_f64().powi(peak))
            .collect();
        let z: f64 = w.iter().sum();
        w.iter().map(|x| (x / z) as f32).collect()
    }

    fn draw(&mut self, q: &[f32], removed: &[u32]) -> u32 {
        let mass: f64 = q
            .iter()
            .enumerate()
            .filter(|(i, _)| !removed.contains(&(*i as u32)))
            .map(|(_, &p)| p as f64)
            .sum();
        let u = self.rng.next_f64() * mass;
        let mut cum = 0.0;
        let mut last = 0;
        for (i, &p) in q.iter().enumerate() {
            if removed.contains(&(i as u32)) {
                continue;
            }
            cum += p as f64;
            last = i as u32;
            if u < cum {
                return last;
            }
        }
        last
    }

    fn oracle_tree(&mut self, truth: &[u32], max: usize, error: f64) -> Draft {
        let mut tokens: Vec<u32> = Vec::new();
        let mut parents: Vec<i32> = Vec::new();
        let mut on_path: i32 = -1;
        let mut level = 0;
        while tokens.len() < max && level < truth.len() {
            let keep_truth = self.rng.next_f64() >= error;
            let k = 1 + (self.rng.next_u64() % 3) as usize;
            let t = (self.rng.next_u64() % k as u64) as usize;
            let mut next_path = None;
            let mut used = vec![truth[level]];
            for j in 0..k {
                if tokens.len() >= max {
                    break;
                }
                let tok = if j == t && keep_truth {
                    truth[level]
                } else {
                    let x = self.other_token(&used);
                    used.push(x);
                    x
                };
                if j == t && keep_truth {
                    next_path = Some(tokens.len() as i32);
                }
                tokens.push(tok);
                parents.push(on_path);
            }
            // A distractor subtree under some earlier node.
            if tokens.len() < max && !tokens.is_empty() && self.rng.next_f64() < 0.5 {
                let p = (self.rng.next_u64() % tokens.len() as u64) as i32;
                let x = self.other_token(&[]);
                tokens.push(x);
                parents.push(p);
            }
            match next_path {
                Some(p) => on_path = p,
                None => break,
            }
            level += 1;
        }
        Draft {
            q: vec![DraftQ::OneHot; tokens.len()],
            tokens,
            parents: Some(parents),
            source: None,
        }
    }

    fn random_tree(
        &mut self,
        max: usize,
        (width, depth, peak): (usize, usize, i32),
        one_hot: bool,
    ) -> Draft {
        use specd::speculative::proposer::SiblingMode;
        let mut d = Draft {
            parents: Some(Vec::new()),
            ..Default::default()
        };
        // Breadth-first: (parent index, level) to expand.
        let mut frontier: Vec<(i32, usize)> = vec![(-1, 1)];
        while let Some((parent, level)) = (!frontier.is_empty()).then(|| frontier.remove(0)) {
            if level > depth {
                continue;
            }
            let k = if parent < 0 {
                1 + (self.rng.next_u64() % width as u64) as usize
            } else {
                (self.rng.next_u64() % (width as u64 + 1)) as usize
            };
            // One-hot trees draw their candidates from one fixed peaked q
            // (as a lookup proposer favours the same continuations), so a
            // lossy rule's bias does not average out over random q's.
            let q: std::sync::Arc<[f32]> = if one_hot {
                let mut r = Rng::new(7);
                let w: Vec<f64> = (0..self.vocab).map(|_| r.next_f64().powi(3)).collect();
                let z: f64 = w.iter().sum();
                w.iter()
                    .map(|x| (x / z) as f32)
                    .collect::<Vec<f32>>()
                    .into()
            } else {
                self.random_q(peak).into()
            };
            let mut drawn = Vec::new();
            for _ in 0..k {
                if d.tokens.len() >= max {
                    break;
                }
                let removed: &[u32] = match self.siblings {
                    SiblingMode::Iid if !one_hot => &[],
                    _ => &drawn,
                };
                let x = self.draw(&q, removed);
                drawn.push(x);
                frontier.push((d.tokens.len() as i32, level + 1));
                d.tokens.push(x);
                d.q.push(if one_hot {
                    DraftQ::OneHot
                } else {
                    DraftQ::Full(q.clone())
                });
                d.parents.as_mut().unwrap().push(parent);
            }
        }
        d
    }
}

impl Proposer for TreeProposer {
    fn name(&self) -> &str {
        &self.name
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            q_kind: match self.mode {
                TreeMode::Oracle { .. } | TreeMode::RandomOneHot { .. } => QKind::OneHot,
                TreeMode::Random { .. } => QKind::Full,
            },
            max_draft: self.max_nodes,
            tree: true,
            max_depth: self.max_nodes,
            siblings: self.siblings,
            ..Default::default()
        }
    }
    fn start(&mut self, seq: SeqId, prompt: &[u32]) -> Result<(), String> {
        if let TreeMode::Oracle { answers, .. } = &self.mode {
            let len = answers
                .keys()
                .filter(|p| prompt.starts_with(p))
                .map(|p| p.len())
                .max()
                .ok_or("unknown prompt")?;
            self.prompts.insert(seq, len);
        }
        Ok(())
    }
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Draft>, String> {
        let mut out = Vec::new();
        for b in batch {
            let d = match &self.mode {
                TreeMode::Oracle { answers, error } => {
                    let plen = self.prompts[&b.seq];
                    let truth: Vec<u32> = answers[&b.tokens[..plen]]
                        .iter()
                        .skip(b.tokens.len() - plen)
                        .copied()
                        .collect();
                    let error = *error;
                    self.oracle_tree(&truth, b.max_draft, error)
                }
                TreeMode::Random { width, depth, peak } => {
                    let shape = (*width, *depth, *peak);
                    self.random_tree(b.max_draft, shape, false)
                }
                TreeMode::RandomOneHot { width, depth } => {
                    let shape = (*width, *depth, 1);
                    self.random_tree(b.max_draft, shape, true)
                }
            };
            out.push(d);
        }
        Ok(out)
    }
    fn observe(&mut self, _: SeqId, _: &[u32], _: &[usize]) -> Result<(), String> {
        Ok(())
    }
    fn finish(&mut self, seq: SeqId) {
        self.prompts.remove(&seq);
    }
}

// ------------------------------------------------------------ out-of-tree builds

/// The cargo target dir these tests run from (`<target>/release/deps/<test>`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Build an out-of-tree workspace (offline, into a separate target dir so it
/// never contends with the outer cargo) and return its release dir.
pub fn build_out_of_tree(manifest_dir: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(manifest_dir);
    let target = target_dir().join("out-of-tree");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["build", "--release", "--offline", "--quiet"])
        .current_dir(&dir)
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "building {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    target.join("release")
}

/// The fixture plugins of `tests/fixtures/plugins`, built.
pub fn build_fixture_plugins() -> PathBuf {
    build_out_of_tree("tests/fixtures/plugins")
}

/// A `distill draft` configuration small enough for a test: 1 layer,
/// hidden 32, `steps` steps on the target's answers to a few id prompts
/// (ids below 12, so any tiny target takes them); `dv` > 0: compact.
pub fn tiny_distill_config(steps: usize, dv: usize) -> specd::distill::DistillConfig {
    specd::distill::DistillConfig {
        layers: 1,
        hidden: 32,
        heads: 2,
        intermediate: 64,
        seq_len: 16,
        batch: 4,
        steps,
        lr: 1e-2,
        gen_tokens: 400,
        gen_max_tokens: 40,
        checkpoint_every: 10,
        prompt_ids: vec![vec![5, 9, 3], vec![4, 1, 2, 3], vec![7, 7, 8]],
        draft_vocab: dv,
        ..Default::default()
    }
}

/// Train a compact draft with a draft vocabulary of `dv` (see
/// `tiny_distill_config`) for the target at `target` into `out`.
pub fn train_tiny_compact(
    target: &Path,
    out: &Path,
    dv: usize,
    steps: usize,
) -> specd::distill::State {
    specd::distill::distill(target, out, &tiny_distill_config(steps, dv), 2).unwrap();
    serde_json::from_str(&std::fs::read_to_string(out.join("state.json")).unwrap()).unwrap()
}

/// Rewrite the safetensors file at `path` with `edit` applied to its
/// tensors (name, shape, data), e.g. to drop or reshape one.
pub fn rewrite_safetensors(
    path: &Path,
    edit: impl FnOnce(&mut Vec<(String, Vec<usize>, specd::model::tensor_file::TensorData)>),
) {
    use specd::model::tensor_file::{self, TensorData, TensorFile};
    let f = TensorFile::read(path).unwrap();
    let names: Vec<String> = f.names().map(str::to_string).collect();
    let mut all = Vec::new();
    for n in names {
        let shape = f.shape(&n).unwrap().to_vec();
        let data = match f.i64(&n) {
            Ok(v) => TensorData::I64(v),
            Err(_) => TensorData::F32(f.f32(&n).unwrap()),
        };
        all.push((n, shape, data));
    }
    edit(&mut all);
    tensor_file::write(path, &all).unwrap();
}
